"""Tensor-parallel serving on 8 fake CPU devices (conftest): both engines on a `tensor` mesh of 2, 4 and 8 give the
single-device engines' greedy tokens and logprobs; the decode step's only collectives are the expected reductions;
checkpoints load straight onto the mesh, reading each device's part only; bad sizes are clear errors."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import swiftkv_jax as sk
from hf_models import make_hf_model
from swiftkv_jax.evaluation.scoring import rolling_loglikelihood, score_continuations
from swiftkv_jax.model.cached import unstack_layers
from swiftkv_jax.model.model import abstract_params
from swiftkv_jax.serving import tensor_parallel as tp
from swiftkv_jax.serving.bench import preset_config, sizing_rows
from swiftkv_jax.serving.cache import init_cache
from swiftkv_jax.serving.engine import decode_step

# 8 query heads, 4 KV heads: tensor 2 and 4 split the KV heads, tensor 8 replicates each on 2 devices. head_dim 16
# for the Pallas kernels; vocab 256 divides by 8.
CONFIG = sk.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=16, param_dtype="float32",
                        dtype="float32", max_position_embeddings=512, initializer_range=0.1)
PROMPTS = [[5, 17, 3, 99, 42, 7, 1, 250, 31], [8, 8, 100], [60, 2, 2, 71, 9, 13]]
NEW_TOKENS = 6
CACHE = "float32"  # a bf16 cache rounds K/V, which differently ordered sums can flip: compare at fp32


@pytest.fixture(scope="module")
def models():
    plain = sk.init(CONFIG, 0)
    return {"plain": plain, "swiftkv_g1": sk.to_swiftkv(plain, 2, 1), "swiftkv_g2": sk.to_swiftkv(plain, 2, 2)}


def static(model, mesh=None, **options):
    out = sk.generate(model, PROMPTS, NEW_TOKENS, logprobs=True, cache_dtype=options.pop("cache_dtype", CACHE),
                      mesh=mesh, **options)
    return out.tokens, out.logprobs


def paged(model, mesh=None, **options):
    engine = sk.Engine(model, num_pages=48, page_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                       cache_dtype=options.pop("cache_dtype", CACHE), mesh=mesh, **options)
    outs = engine.generate(PROMPTS, max_tokens=NEW_TOKENS, logprobs=True)
    return [o.token_ids for o in outs], [o.logprobs for o in outs], engine


@pytest.fixture(scope="module")
def references(models):
    return {name: (static(m), paged(m)[:2]) for name, m in models.items()}


def assert_same(got, want, atol=1e-4):
    assert got[0] == want[0]
    np.testing.assert_allclose(np.concatenate(got[1]), np.concatenate(want[1]), atol=atol)


def matrix(diagonal):
    """Every (model, tensor size): `diagonal` in the default suite (each model and each size once per engine), the
    rest under -m slow."""
    return [pytest.param(name, tensor, marks=() if (name, tensor) in diagonal else pytest.mark.slow)
            for name in ("plain", "swiftkv_g1", "swiftkv_g2") for tensor in (2, 4, 8)]


@pytest.mark.parametrize("name,tensor", matrix({("plain", 2), ("swiftkv_g1", 4), ("swiftkv_g2", 8)}))
def test_static_engine_matches_one_device(models, references, name, tensor):
    assert_same(static(models[name], tp.serving_mesh(tensor)), references[name][0])


@pytest.mark.parametrize("name,tensor", matrix({("plain", 8), ("swiftkv_g1", 2), ("swiftkv_g2", 4)}))
def test_paged_engine_matches_one_device(models, references, name, tensor):
    tokens, logprobs, engine = paged(models[name], tp.serving_mesh(tensor))
    assert_same((tokens, logprobs), references[name][1])
    k_pages = engine.pool.lower[0][0]  # [K, P, page_size, H], K split over the devices
    assert k_pages.sharding.spec == P("tensor")
    assert k_pages.addressable_shards[0].data.shape[0] == CONFIG.num_key_value_heads * max(1, tensor // 4) // tensor


def test_pallas_kernels_run_per_shard(models):
    """The Pallas decode, paged and flash kernels (interpret mode) inside shard_map: each device its own heads."""
    model = models["swiftkv_g2"]
    impls = dict(decode_attention_impl="pallas", attention_impl="pallas")
    mesh = tp.serving_mesh(2)
    assert_same(static(model, mesh, **impls), static(model, **impls))
    assert_same(paged(model, mesh, **impls)[:2], paged(model, **impls)[:2])


def test_quantised_cache_splits_with_its_scales(models):
    model, mesh = models["swiftkv_g2"], tp.serving_mesh(4)
    options = dict(cache_dtype="int8", kv_scales="per-token-head")
    # A split sums the residual's partial products in another order; an ulp there can move a key across an int8
    # rounding boundary, one quantum (scale / 127) of change: looser than the float cache's 1e-4.
    assert_same(static(model, mesh, **options), static(model, **options), atol=1e-3)
    assert_same(paged(model, mesh, **options)[:2], paged(model, **options)[:2], atol=1e-3)
    cache = init_cache(model.config, 2, 32, True, "int8", "per-token-head", mesh=mesh)
    k, v, k_scale, v_scale = cache.lower[0]
    assert k.addressable_shards[0].data.shape == (2, 1, 32, 16)  # [B, K, S, H]: one of the 4 KV heads
    assert k_scale.addressable_shards[0].data.shape == (2, 1, 32)


def test_scoring_matches_one_device(models):
    model, mesh = models["swiftkv_g1"], tp.serving_mesh(4)
    requests = [([5, 17, 3, 99], [42, 7]), ([5, 17, 3, 99], [1]), ([8, 8, 100, 2, 2], [71, 9, 13])]
    one, split = (score_continuations(model, requests, cache_dtype=CACHE, mesh=m) for m in (None, mesh))
    np.testing.assert_allclose([s for s, _ in split], [s for s, _ in one], atol=1e-4)
    assert [g for _, g in split] == [g for _, g in one]
    documents = [list(range(1, 40)), [3, 4, 5, 6]]
    one, split = (rolling_loglikelihood(model, documents, max_length=16, mesh=m) for m in (None, mesh))
    np.testing.assert_allclose([s for s, _ in split], [s for s, _ in one], atol=1e-4)


def collectives(hlo: str) -> dict:
    """{op: [result shape as HLO writes it, e.g. f32[3,1,64]]} of a compiled program."""
    found = {op: [] for op in tp.COLLECTIVES}
    for c in tp.collectives(hlo):
        found[c["op"]].append(f"{c['dtype']}[{','.join(map(str, c['shape']))}]")
    return found


def expected_only(found: dict, logits: str, residual: str, num_layers: int) -> None:
    """Per layer one all-reduce of the residual after attention and one after the MLP, one for the embedding (the
    vocabulary-split table gathered locally, masked, summed); one all-gather, of the logits. No weight moves."""
    assert found["all-gather"] == [logits]
    assert found["all-reduce"] == [residual] * (2 * num_layers + 1)
    assert not found["reduce-scatter"] and not found["all-to-all"] and not found["collective-permute"]


@pytest.mark.parametrize("swiftkv", [True, False])
def test_decode_step_moves_no_weights(models, swiftkv):
    mesh = tp.serving_mesh(4)
    model = tp.shard_model(models["swiftkv_g2"], mesh)
    cfg, batch = model.config, 3
    cache = init_cache(cfg, batch, 32, swiftkv, CACHE, mesh=mesh)

    def step(params, cache, tokens):
        with tp.activation_sharding(cfg, mesh):
            return decode_step(unstack_layers(params, cfg), cache, tokens, config=cfg, swiftkv=swiftkv)

    hlo = jax.jit(step).lower(model.params, cache, np.zeros(batch, np.int32)).compile().as_text()
    expected_only(collectives(hlo), f"f32[{batch},1,{cfg.vocab_size}]", f"f32[{batch},1,{cfg.hidden_size}]",
                  cfg.num_hidden_layers)


def test_engine_step_moves_no_weights(models):
    engine = sk.Engine(models["swiftkv_g2"], num_pages=16, max_num_seqs=4, max_num_batched_tokens=32,
                       cache_dtype=CACHE, mesh=tp.serving_mesh(4))
    hlo = engine.lower(4, 0, engine.pages_per_seq).compile().as_text()  # a decode-only step of 4 sequences
    cfg = engine.config
    # the engine's rows are [1, tokens]; logits gathered for the 4 sampled rows
    expected_only(collectives(hlo), f"f32[1,4,{cfg.vocab_size}]", f"f32[1,4,{cfg.hidden_size}]",
                  cfg.num_hidden_layers)


# ---- loading straight onto the mesh --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    import torch

    path = tmp_path_factory.mktemp("tp_hf")
    # bf16 as stored: each device's slices come out of the file in bf16
    make_hf_model(path, "llama", torch_dtype=torch.bfloat16, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=16)
    return path


@pytest.mark.parametrize("tensor", [2, 8])  # 8: the 2 KV heads are replicated on 4 devices each
def test_load_sharded_reads_only_each_devices_part(hf_dir, tensor, monkeypatch):
    from swiftkv_jax.checkpoints import hf

    whole_reads = []
    real_get = hf._SafetensorsFiles.get
    monkeypatch.setattr(hf._SafetensorsFiles, "get", lambda self, entry: whole_reads.append(entry.hf_name)
                        or real_get(self, entry))
    mesh = tp.serving_mesh(tensor)
    loaded = tp.load_sharded(hf_dir, mesh=mesh)
    # every weight split by heads, MLP columns or vocabulary is one block of its stored tensor: read in part
    assert not [name for name in whole_reads if not name.endswith(("norm.weight", "layernorm.weight"))]
    monkeypatch.undo()
    expected = tp.shard_model(sk.load(hf_dir), mesh)
    assert loaded.config == expected.config
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(expected.params)):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    q = loaded.params["layers"]["self_attn"]["q_proj"]["kernel"]  # [l, D, N, H]
    assert q.addressable_shards[0].data.shape[2] == 8 // tensor
    assert tp.for_serving(loaded, mesh) is loaded  # already placed: serving takes it as is


def test_load_sharded_from_orbax(models, tmp_path):
    sk.save(models["swiftkv_g2"], tmp_path / "ckpt", format="orbax")
    mesh = tp.serving_mesh(8)
    loaded = tp.load_sharded(tmp_path / "ckpt", mesh=mesh)
    expected = tp.shard_model(models["swiftkv_g2"], mesh)
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(expected.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_replicating_kv_heads_is_exact(models):
    """Each KV head repeated (8 query heads reading 8 copies instead of 4 heads): the same logits, to fp32."""
    model = models["swiftkv_g1"]
    wide = tp.replicate_kv_heads(model, 2)
    assert wide.config.num_key_value_heads == 8
    tokens = np.array(PROMPTS[0])[None]
    np.testing.assert_allclose(sk.logits(wide, tokens), sk.logits(model, tokens), atol=1e-5)


# ---- errors --------------------------------------------------------------------------------------------------------

def test_more_devices_than_there_are_is_a_clear_error():
    with pytest.raises(ValueError, match="needs 9 devices, but JAX sees 8"):
        tp.serving_mesh(9)


def test_a_size_that_does_not_divide_the_heads_names_the_sizes_that_work(models):
    with pytest.raises(ValueError, match=r"does not divide the model's num_attention_heads \(8\); sizes that work "
                                         r"for this model: 1, 2, 4, 8"):
        sk.Engine(models["plain"], num_pages=16, mesh=tp.serving_mesh(3))
    with pytest.raises(ValueError, match="sizes that work"):
        tp.plan(CONFIG.replace(intermediate_size=100), 8)


def test_a_training_mesh_is_refused_for_serving(models):
    with pytest.raises(ValueError, match="splits the model over its 'tensor' axis only"):
        sk.generate(models["plain"], PROMPTS, 2, mesh=sk.make_mesh(data=2, fsdp=1, tensor=4))


def test_a_vocabulary_that_does_not_divide_stays_whole(models):
    model = sk.init(CONFIG.replace(vocab_size=254), 0)
    plan = tp.plan(model.config, 4)
    assert not plan.vocab_split and "whole on every device" in plan.describe(model.config)
    assert_same(static(model, tp.serving_mesh(4)), static(model))


# ---- sizing --------------------------------------------------------------------------------------------------------

def test_sizing_is_the_weights_and_cache_split_by_the_rules():
    config = preset_config("llama-3.1-70b", param_dtype="bfloat16", dtype="bfloat16")
    rows = {(r["tensor_parallel"], r["wiring"]): r for r in sizing_rows(config, [1, 8, 16], batch=4, max_len=1000,
                                                                        cache_format="bfloat16")}
    whole = sum(a.size * 2 for a in jax.tree.leaves(abstract_params(config)))
    assert rows[1, "swiftkv"]["weight_bytes_per_device"] == whole
    norms = (2 * 80 + 2) * 8192 * 2  # the layer norms, norm and norm_swiftkv: whole on every device
    assert rows[8, "swiftkv"]["weight_bytes_per_device"] == (whole - norms) // 8 + norms
    # the KV cache: 2 (K, V) x 80 layers x 8 KV heads x 128 x 2 bytes per token, split by heads
    assert rows[1, "teacher"]["kv_cache_bytes_per_device"] == 2 * 80 * 8 * 128 * 2 * 4 * 1000
    assert rows[8, "teacher"]["kv_cache_bytes_per_device"] == 2 * 80 * 1 * 128 * 2 * 4 * 1000
    # 16 devices, 8 KV heads: one head per device (each held twice), so the per-device cache is 8's
    assert rows[16, "teacher"]["kv_replicas"] == 2
    assert rows[16, "teacher"]["kv_cache_bytes_per_device"] == rows[8, "teacher"]["kv_cache_bytes_per_device"]
    # init_cache allocates 1001 positions as 1008 (LENGTH_ALIGN): the dry run says what bench then allocates
    (odd,) = [r for r in sizing_rows(config, [1], batch=4, max_len=1001, cache_format="bfloat16")
              if r["wiring"] == "teacher"]
    assert odd["kv_cache_bytes_per_device"] == 2 * 80 * 8 * 128 * 2 * 4 * 1008
