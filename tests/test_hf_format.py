"""Checkpoint formats and their failure modes: transformers 4.x/5.x config.json layouts, sharded safetensors,
the Snowflake SwiftKV layout (../shared/SWIFTKV.md §5), clear errors on bad input, and saves that never lose
what is already on disk.

Expectations come from the documented format and from `transformers` itself; tensor names and layouts are
checked with tests/hf_models.py helpers written from the format description, not with the library's tables.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file as load_numpy, save_file as save_numpy
from transformers import LlamaForCausalLM

import swiftkv_jax as sk
import swiftkv_jax.checkpoints.hf as hf_module
from hf_models import (LLAMA3_ROPE, file_digests, hf_tensors_from_params, make_hf_model, random_tokens,
                       read_hf_tensors, safetensors_header, torch_logits)

VOCAB = 320
D, N, K, H, F = 64, 8, 2, 8, 96  # tiny_hf_config: hidden, heads, kv heads, head dim, MLP
SHARD = "200KB"  # the tiny 4-layer model is ~620 KB in fp32: 4 shards


def assert_trees_equal(a, b):
    flat_a, tree_a = jax.tree_util.tree_flatten_with_path(a)
    flat_b, tree_b = jax.tree_util.tree_flatten_with_path(b)
    assert tree_a == tree_b
    for (path, x), (_, y) in zip(flat_a, flat_b):
        assert x.dtype == y.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def rewrite_config(path, edit):
    config_path = path / "config.json"
    d = json.loads(config_path.read_text())
    edit(d)
    config_path.write_text(json.dumps(d, indent=2))
    return d


def to_4x_layout(d):
    """A transformers 5.x config.json -> the layout transformers 4.x wrote (and the published models have)."""
    rope = dict(d.pop("rope_parameters"))
    d["rope_theta"] = rope.pop("rope_theta")
    d["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    d["torch_dtype"] = d.pop("dtype")
    d["transformers_version"] = "4.46.0"
    if d["model_type"] == "qwen2":  # 4.x Qwen2 configs: sliding-window fields, no layer_types
        del d["layer_types"]
        d.update(use_sliding_window=False, sliding_window=131072, max_window_layers=21)


@pytest.fixture(scope="module")
def tokens():
    return random_tokens(VOCAB, batch=2, length=200, seed=5)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(path, fp32 torch model) of a plain 4-layer Llama saved by transformers."""
    path = tmp_path_factory.mktemp("llama")
    return path, make_hf_model(path, "llama", seed=21, initializer_range=0.1)


@pytest.fixture
def llama_copy(llama, tmp_path):
    """A private copy of the Llama checkpoint, free to corrupt."""
    return shutil.copytree(llama[0], tmp_path / "ckpt")


# --- config.json layouts ------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,overrides", [
    ("llama", dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
    ("llama", dict()),
    ("qwen2", dict(rope_theta=1000000.0)),
])
def test_transformers_4x_config_layout_loads_like_5x(family, overrides, tmp_path, tokens):
    v5 = tmp_path / "v5"
    torch_model = make_hf_model(v5, family, seed=3, initializer_range=0.1, **overrides)
    assert "rope_parameters" in json.loads((v5 / "config.json").read_text())
    v4 = shutil.copytree(v5, tmp_path / "v4")
    d = rewrite_config(v4, to_4x_layout)
    assert "rope_parameters" not in d and "dtype" not in d and d["torch_dtype"] == "float32"
    if overrides.get("rope_scaling"):
        assert d["rope_scaling"]["rope_type"] == "llama3" and d["rope_theta"] == 500000.0

    new, old = sk.load(v5), sk.load(v4)
    assert old.config.replace(hf_extra="{}") == new.config.replace(hf_extra="{}")
    assert_trees_equal(old.params, new.params)
    ours = np.asarray(sk.logits(old, tokens))
    np.testing.assert_array_equal(ours, np.asarray(sk.logits(new, tokens)))
    expected = torch_logits(torch_model, tokens)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-4)


def test_a_list_of_eos_ids_survives_load_export_and_convert(tmp_path):
    """Llama-3.1's published config ends generation at any of three ids ([128001, 128008, 128009]); loading keeps all
    three (sk.generate and sk.Engine stop at each), and the HF export, plain or SwiftKV, writes the list (that
    transformers reads back from the plain one; it does not know the llama_swiftkv model type)."""
    from transformers import AutoConfig

    eos = [300, 301, 302]
    make_hf_model(tmp_path / "hf", "llama", seed=2, eos_token_id=eos)
    model = sk.load(tmp_path / "hf")
    assert model.config.eos_token_id == tuple(eos)
    for name, out in (("plain", model), ("swiftkv", sk.to_swiftkv(model, 2, 2))):
        sk.save(out, tmp_path / name, format="hf")
        assert json.loads((tmp_path / name / "config.json").read_text())["eos_token_id"] == eos
        if name == "plain":
            assert AutoConfig.from_pretrained(tmp_path / name).eos_token_id == eos
        assert sk.load(tmp_path / name).config.eos_token_id == tuple(eos)


def test_rope_parameters_without_theta_take_the_top_level_one(tmp_path, tokens):
    """{"rope_parameters": {"rope_type": "default"}, "rope_theta": 5e4}: transformers reads the theta beside
    rope_parameters into them; so do we (it was a KeyError)."""
    from transformers import AutoConfig

    torch_model = make_hf_model(tmp_path, "llama", seed=6, initializer_range=0.1, rope_theta=50000.0)
    rewrite_config(tmp_path, lambda d: d.update(rope_theta=d["rope_parameters"].pop("rope_theta")))
    assert AutoConfig.from_pretrained(tmp_path).rope_parameters["rope_theta"] == 50000.0
    model = sk.load(tmp_path)
    assert model.config.rope.theta == 50000.0
    np.testing.assert_allclose(np.asarray(sk.logits(model, tokens)), torch_logits(torch_model, tokens), rtol=0,
                               atol=1e-4)


def test_old_rope_scaling_type_key_linear(tmp_path, tokens):
    """transformers <4.45 wrote {"type": "linear", "factor": 2.0}; compare with a transformers linear model."""
    torch_model = make_hf_model(tmp_path, "llama", seed=4, initializer_range=0.1,
                                rope_scaling={"rope_type": "linear", "factor": 2.0})

    def old_style(d):
        to_4x_layout(d)
        d["rope_scaling"] = {"type": "linear", "factor": 2.0}

    rewrite_config(tmp_path, old_style)
    model = sk.load(tmp_path)
    assert (model.config.rope.type, model.config.rope.factor, model.config.rope.theta) == ("linear", 2.0, 10000.0)
    ours = np.asarray(sk.logits(model, tokens))
    expected = torch_logits(torch_model, tokens)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-4)
    np.testing.assert_array_equal(ours.argmax(-1), expected.argmax(-1))
    # Exported in the current key style, transformers reads the same linear scaling back.
    out = sk.save(model, tmp_path / "export", format="hf")
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    reloaded = LlamaForCausalLM.from_pretrained(out).eval()
    np.testing.assert_array_equal(torch_logits(reloaded, tokens), expected)
    # The scaling matters at this size: ignoring it would be caught.
    rewrite_config(tmp_path, lambda d: d.update(rope_scaling=None))
    assert np.abs(np.asarray(sk.logits(sk.load(tmp_path), tokens)) - expected).max() > 1e-2


# --- sharded safetensors ------------------------------------------------------------------------------------

def test_sharded_save_loads_in_transformers_and_back_bit_identically(llama, tmp_path, tokens):
    path, torch_model = llama
    model = sk.load(path)
    out = sk.save(model, tmp_path / "sharded", format="hf", max_shard_size=SHARD)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(shards)
    assert n >= 2
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(p.name for p in out.iterdir()) == sorted(shards + ["config.json", "model.safetensors.index.json"])

    index = json.loads((out / "model.safetensors.index.json").read_text())
    headers = {name: safetensors_header(out / name) for name in shards}
    in_file = {t: name for name, header in headers.items() for t in header if t != "__metadata__"}
    assert index["weight_map"] == in_file
    assert set(in_file) == set(read_hf_tensors(path))
    sizes = {name: sum(v["data_offsets"][1] - v["data_offsets"][0] for t, v in header.items() if t != "__metadata__")
             for name, header in headers.items()}
    assert index["metadata"]["total_size"] == sum(sizes.values())
    assert max(sizes.values()) <= 200_000

    reloaded = LlamaForCausalLM.from_pretrained(out).eval()
    np.testing.assert_array_equal(torch_logits(reloaded, tokens), torch_logits(torch_model, tokens))
    again = sk.load(out)
    assert again.config == model.config
    assert_trees_equal(again.params, model.params)


def test_loads_a_checkpoint_sharded_by_transformers(llama, tmp_path):
    path, torch_model = llama
    torch_model.save_pretrained(tmp_path, max_shard_size=SHARD)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) >= 2
    assert not (tmp_path / "model.safetensors").exists()
    assert_trees_equal(sk.load(tmp_path).params, sk.load(path).params)


# --- the SwiftKV checkpoint format (SWIFTKV.md §5) -----------------------------------------------------------

SWIFTKV_L, SWIFTKV_l = 6, 2
SWIFTKV_BASES = {
    "llama": ("llama", dict()),
    "llama_bias_tied": ("llama", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    "qwen2": ("qwen2", dict()),
}


def documented_swiftkv_keys(num_layers, l, g, *, tied, qkv_bias, o_bias, mlp_bias):
    """SWIFTKV.md §5, as a set of names."""
    keys = {"model.embed_tokens.weight", "model.norm.weight", "model.norm_swiftkv.weight"}
    if not tied:
        keys.add("lm_head.weight")

    def linear(prefix, bias):
        keys.add(f"{prefix}.weight")
        if bias:
            keys.add(f"{prefix}.bias")

    for i in range(num_layers):
        p = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj"):
            linear(f"{p}.self_attn.{proj}", qkv_bias)
        linear(f"{p}.self_attn.o_proj", o_bias)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            linear(f"{p}.mlp.{proj}", mlp_bias)
        keys.update({f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"})
        if i >= l:
            linear(f"{p}.self_attn.q_proj_swiftkv", qkv_bias)
            if (i - l) % g == 0:
                linear(f"{p}.self_attn.k_proj_swiftkv", qkv_bias)
                linear(f"{p}.self_attn.v_proj_swiftkv", qkv_bias)
    return keys


def torch_layout_shape(name):
    """[out, in] for Linear weights, [out] for biases, as the tiny config implies."""
    module, leaf = name.rsplit(".", 1)
    if module in ("model.embed_tokens", "lm_head"):
        return [VOCAB, D]
    if "norm" in module.rsplit(".", 1)[-1]:
        return [D]
    proj = module.rsplit(".", 1)[-1].removesuffix("_swiftkv")
    out_in = {"q_proj": (N * H, D), "k_proj": (K * H, D), "v_proj": (K * H, D), "o_proj": (D, N * H),
              "gate_proj": (F, D), "up_proj": (F, D), "down_proj": (D, F)}[proj]
    return list(out_in) if leaf == "weight" else [out_in[0]]


@pytest.fixture(scope="module")
def swiftkv_bases(tmp_path_factory):
    """name -> (path, fp32 torch model), built on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            family, overrides = SWIFTKV_BASES[name]
            path = tmp_path_factory.mktemp(f"base_{name}")
            cache[name] = path, make_hf_model(path, family, seed=31, initializer_range=0.1,
                                              num_hidden_layers=SWIFTKV_L, **overrides)
        return cache[name]

    return get


@pytest.fixture(scope="module", params=[("llama", 1), ("llama", 2), ("llama_bias_tied", 2), ("qwen2", 1),
                                        ("qwen2", 2)], ids=lambda p: f"{p[0]}-g{p[1]}")
def swiftkv_export(request, swiftkv_bases, tmp_path_factory):
    """(base name, g, base path, torch model, student, exported path)."""
    name, g = request.param
    base_path, torch_model = swiftkv_bases(name)
    student = sk.to_swiftkv(sk.load(base_path), SWIFTKV_l, g)
    out = sk.save(student, tmp_path_factory.mktemp(f"student_{name}_{g}") / "ckpt", format="hf")
    return name, g, base_path, torch_model, student, out


def test_swiftkv_config_json(swiftkv_export):
    name, g, base_path, _, _, out = swiftkv_export
    family = SWIFTKV_BASES[name][0]
    d = json.loads((out / "config.json").read_text())
    assert d["model_type"] == f"{family}_swiftkv"
    if family == "llama":
        assert d["architectures"] == ["LlamaSwiftKVForCausalLM"]
    else:
        assert d["architectures"] == ["Qwen2SwiftKVForCausalLM"]
    assert d["num_key_value_layers"] == SWIFTKV_l
    assert d["key_value_group_size"] == g
    assert d["swiftkv"] is True
    base = json.loads((base_path / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings"):
        assert d[key] == base[key], key
    assert d["rope_theta"] == base["rope_parameters"]["rope_theta"]


def test_swiftkv_tensor_names_and_shapes_are_the_documented_ones(swiftkv_export):
    name, g, _, torch_model, _, out = swiftkv_export
    family = SWIFTKV_BASES[name][0]
    c = torch_model.config
    expected = documented_swiftkv_keys(
        SWIFTKV_L, SWIFTKV_l, g, tied=c.tie_word_embeddings,
        qkv_bias=family == "qwen2" or c.attention_bias,
        o_bias=family == "llama" and c.attention_bias,
        mlp_bias=family == "llama" and c.mlp_bias,
    )
    header = safetensors_header(out / "model.safetensors")
    metadata = header.pop("__metadata__")
    assert metadata == {"format": "pt"}
    assert set(header) == expected
    for key, info in header.items():
        assert info["shape"] == torch_layout_shape(key), key
        assert info["dtype"] == "F32", key
    owners = sorted(int(k.split(".")[2]) for k in header if k.endswith("k_proj_swiftkv.weight"))
    assert owners == list(range(SWIFTKV_l, SWIFTKV_L, g))


def test_swiftkv_reload_is_bit_identical(swiftkv_export, tokens):
    _, _, _, _, student, out = swiftkv_export
    again = sk.load(out)
    assert again.config == student.config
    assert_trees_equal(again.params, student.params)
    for mode in (True, False):
        np.testing.assert_array_equal(np.asarray(sk.logits(again, tokens, swiftkv=mode)),
                                      np.asarray(sk.logits(student, tokens, swiftkv=mode)))
    # And the file holds exactly the student's parameters, in the documented layout.
    on_disk = {k: t.numpy() for k, t in read_hf_tensors(out).items()}
    ours = hf_tensors_from_params(student.params)
    assert set(on_disk) == set(ours)
    for key, value in ours.items():
        np.testing.assert_array_equal(on_disk[key], value, err_msg=key)


def test_swiftkv_export_keeps_the_teacher_tensors_and_initialises_per_the_recipe(swiftkv_export, tokens):
    _, g, base_path, torch_model, _, out = swiftkv_export
    base = load_numpy(base_path / "model.safetensors")
    student = load_numpy(out / "model.safetensors")
    new = set(student) - set(base)
    assert all("_swiftkv." in k for k in new)
    assert set(base) <= set(student)
    for key, value in base.items():
        assert student[key].dtype == value.dtype, key
        np.testing.assert_array_equal(student[key], value, err_msg=key)
    # SWIFTKV.md §3: q copied, owners' k/v the group mean, norm_swiftkv a copy of layer l's input norm.
    np.testing.assert_array_equal(student["model.norm_swiftkv.weight"],
                                  base[f"model.layers.{SWIFTKV_l}.input_layernorm.weight"])
    for key in new - {"model.norm_swiftkv.weight"}:
        _, _, i, _, proj, leaf = key.split(".")
        i = int(i)
        teacher = proj.removesuffix("_swiftkv")
        if teacher == "q_proj":
            np.testing.assert_array_equal(student[key], base[f"model.layers.{i}.self_attn.q_proj.{leaf}"])
        else:
            group = np.stack([base[f"model.layers.{j}.self_attn.{teacher}.{leaf}"] for j in range(i, i + g)])
            np.testing.assert_allclose(student[key], group.mean(0), rtol=1e-6, atol=1e-7, err_msg=key)
    # Teacher mode of the reloaded student is the base transformers model.
    again = sk.load(out)
    np.testing.assert_allclose(np.asarray(sk.logits(again, tokens, swiftkv=False)), torch_logits(torch_model, tokens),
                               rtol=0, atol=1e-4)


@pytest.mark.parametrize("null", ["absent", "null"])
def test_swiftkv_config_without_l_and_g_means_all_layers_and_no_grouping(swiftkv_bases, tmp_path, null):
    base_path, _ = swiftkv_bases("llama")
    student = sk.to_swiftkv(sk.load(base_path), SWIFTKV_L, 1)  # l = L: no SwiftKV layers, norm_swiftkv only
    out = sk.save(student, tmp_path / "ckpt", format="hf")

    def drop(d):
        for key in ("num_key_value_layers", "key_value_group_size"):
            if null == "absent":
                del d[key]
            else:
                d[key] = None

    rewrite_config(out, drop)
    again = sk.load(out)
    assert (again.config.num_key_value_layers, again.config.key_value_group_size) == (SWIFTKV_L, 1)
    assert_trees_equal(again.params, student.params)


# --- bad input: clear errors ---------------------------------------------------------------------------------

def test_missing_directory_or_config(llama_copy, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        sk.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        sk.load(tmp_path / "empty")
    (llama_copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        sk.load(llama_copy)


def test_config_without_weights(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    # the same config.json as an Orbax checkpoint that lost its params/: both named
    with pytest.raises(FileNotFoundError, match=r"no model.safetensors or model.safetensors.index.json \(Hugging Face "
                                                r"weights\) and no params/ .*incomplete Orbax checkpoint.*re-export"):
        sk.load(llama_copy)
    (llama_copy / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin.*safetensors"):
        sk.load(llama_copy)


def _edit_tensors(path, edit):
    file = path / "model.safetensors"
    tensors = load_numpy(file)
    edit(tensors)
    save_numpy(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_missing_tensor(llama_copy, dtype):
    _edit_tensors(llama_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    missing = r"tensor model\.layers\.1\.mlp\.up_proj\.weight \[96, 64\] is missing"
    with pytest.raises(sk.CheckpointError, match=missing):
        sk.load(llama_copy, dtype=dtype)


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_missing_embedding(llama_copy, dtype):
    _edit_tensors(llama_copy, lambda t: t.pop("model.embed_tokens.weight"))
    with pytest.raises(sk.CheckpointError, match=r"tensor model\.embed_tokens\.weight.* is missing"):
        sk.load(llama_copy, dtype=dtype)


def test_misshaped_tensor(llama_copy):
    def edit(t):
        t["model.layers.2.self_attn.k_proj.weight"] = np.zeros((32, 64), np.float32)

    _edit_tensors(llama_copy, edit)
    with pytest.raises(sk.CheckpointError, match=r"model\.layers\.2\.self_attn\.k_proj\.weight has shape \[32, 64\], "
                                                 r"config\.json implies \[16, 64\]"):
        sk.load(llama_copy)


def test_transposed_tensor(llama_copy):
    """A square-free Linear weight stored [in, out] (the JAX layout) is a shape error, not silently transposed."""
    def edit(t):
        t["model.layers.0.mlp.up_proj.weight"] = np.ascontiguousarray(t["model.layers.0.mlp.up_proj.weight"].T)

    _edit_tensors(llama_copy, edit)
    message = r"up_proj\.weight has shape \[64, 96\], config\.json implies \[96, 64\]"
    with pytest.raises(sk.CheckpointError, match=message):
        sk.load(llama_copy)


def test_unexpected_extra_tensor(llama_copy):
    def edit(t):
        t["model.layers.0.self_attn.rogue_proj.weight"] = np.zeros((8, 8), np.float32)

    _edit_tensors(llama_copy, edit)
    with pytest.raises(sk.CheckpointError, match=r"model\.layers\.0\.self_attn\.rogue_proj\.weight.*do not belong"):
        sk.load(llama_copy)


def test_swiftkv_tensors_under_a_plain_model_type(swiftkv_bases, tmp_path):
    base_path, _ = swiftkv_bases("llama")
    out = sk.save(sk.to_swiftkv(sk.load(base_path), SWIFTKV_l, 2), tmp_path / "ckpt", format="hf")
    rewrite_config(out, lambda d: d.update(model_type="llama"))
    with pytest.raises(sk.CheckpointError, match=r"q_proj_swiftkv.*do not belong to a llama model"):
        sk.load(out)


def test_malformed_config_json_names_the_file_and_line(llama_copy):
    config = llama_copy / "config.json"
    config.write_text('{"model_type": "llama",\n  vocab_size: 320}')
    with pytest.raises(sk.CheckpointError, match=f"{config}: not valid JSON .* at line 2, column 3.*re-download"):
        sk.load(llama_copy)


@pytest.mark.parametrize("sharded", [False, True])
def test_truncated_safetensors_names_the_file(llama, tmp_path, sharded):
    out = sk.save(sk.load(llama[0]), tmp_path / "ckpt", format="hf", max_shard_size=SHARD if sharded else "5GB")
    file = sorted(out.glob("model*.safetensors"))[-1]
    with open(file, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(sk.CheckpointError, match=f"{file}: not a readable safetensors file .*truncated or corrupt; "
                                                 f"re-download or re-export"):
        sk.load(out)


@pytest.mark.parametrize("size", ["5", "huge", "0GB", "5GiB"])
def test_a_shard_size_without_a_unit_is_refused_before_writing(llama, tmp_path, size):
    with pytest.raises(ValueError, match=f"'{size}' is not a size: give a number and a unit .*e.g. 5GB or 500MB"):
        sk.save(sk.load(llama[0]), tmp_path / "ckpt", format="hf", max_shard_size=size)
    assert not (tmp_path / "ckpt").exists() and not list(tmp_path.glob(".ckpt*"))


def test_index_naming_a_missing_shard(llama, tmp_path):
    out = sk.save(sk.load(llama[0]), tmp_path / "sharded", format="hf", max_shard_size=SHARD)
    shards = sorted(out.glob("model-*.safetensors"))
    shards[1].unlink()
    with pytest.raises(FileNotFoundError, match=f"lists {shards[1].name}, which is missing"):
        sk.load(out)


def test_index_mapping_a_tensor_to_a_shard_without_it(llama, tmp_path):
    out = sk.save(sk.load(llama[0]), tmp_path / "sharded", format="hf", max_shard_size=SHARD)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    name = "model.layers.0.mlp.up_proj.weight"
    wrong = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name])
    index["weight_map"][name] = wrong
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(sk.CheckpointError, match=f"index.json maps 1 tensor.s. to a file that does not hold them, e.g. "
                                              f"{name} to {wrong}; re-download or re-export"):
        sk.load(out)


def test_unsupported_model_type(llama_copy):
    rewrite_config(llama_copy, lambda d: d.update(model_type="mistral", architectures=["MistralForCausalLM"]))
    with pytest.raises(ValueError, match=r"unsupported model_type 'mistral'.*llama"):
        sk.load(llama_copy)


@pytest.mark.parametrize("rope_scaling,message", [
    ({"rope_type": "yarn", "factor": 4.0}, r"unsupported rope_type 'yarn'"),
    ({"type": "dynamic", "factor": 2.0}, r"unsupported rope_type 'dynamic'"),
    ({"rope_type": "linear", "factor": 2.0, "beta_fast": 32}, r"unsupported RoPE settings \['beta_fast'\]"),
])
def test_unsupported_rope_scaling(llama_copy, rope_scaling, message):
    def edit(d):
        to_4x_layout(d)
        d["rope_scaling"] = rope_scaling

    rewrite_config(llama_copy, edit)
    with pytest.raises(ValueError, match=message):
        sk.load(llama_copy)


def test_orbax_parameters_not_matching_config(llama, tmp_path):
    out = sk.save(sk.load(llama[0]), tmp_path / "orbax", format="orbax")
    rewrite_config(out, lambda d: d.update(num_hidden_layers=3))
    with pytest.raises(sk.CheckpointError, match=r"Orbax parameters do not match config\.json.*shape"):
        sk.load(out)


@pytest.mark.parametrize("l,g,message", [
    (7, 2, r"num_key_value_layers must be an int in \[1, 6\].*got 7"),
    (-1, 2, r"num_key_value_layers must be an int in \[1, 6\].*got -1"),
    ("2", 2, r"num_key_value_layers must be an int in \[1, 6\].*got '2'"),
    (2.5, 2, r"num_key_value_layers must be an int in \[1, 6\].*got 2\.5"),
    (2, 3, r"key_value_group_size 3 must divide the 4 layers after num_key_value_layers=2"),
    (3, 2, r"key_value_group_size 2 must divide the 3 layers after num_key_value_layers=3"),
    (2, -2, r"key_value_group_size must be a positive int, got -2"),
])
def test_invalid_swiftkv_layout_in_config(swiftkv_bases, tmp_path, l, g, message):
    base_path, _ = swiftkv_bases("llama")
    out = sk.save(sk.to_swiftkv(sk.load(base_path), SWIFTKV_l, 2), tmp_path / "ckpt", format="hf")
    rewrite_config(out, lambda d: d.update(num_key_value_layers=l, key_value_group_size=g))
    with pytest.raises(ValueError, match=message):
        sk.load(out)


@pytest.mark.parametrize("field,saved_l,message", [
    ("num_key_value_layers", SWIFTKV_L, r"num_key_value_layers must be an int in \[1, 6\].*got 0"),
    ("key_value_group_size", SWIFTKV_l, r"key_value_group_size must be a positive int, got 0"),
])
def test_zero_swiftkv_layout_fields_are_rejected(swiftkv_bases, tmp_path, field, saved_l, message):
    base_path, _ = swiftkv_bases("llama")
    # Checkpoints whose tensors happen to match the layout the 0 is (mis)read as: L layers / groups of 1.
    out = sk.save(sk.to_swiftkv(sk.load(base_path), saved_l, 1), tmp_path / "ckpt", format="hf")
    rewrite_config(out, lambda d: d.update({field: 0}))
    with pytest.raises(ValueError, match=message):
        sk.load(out)


@pytest.mark.parametrize("edit,message", [
    (dict(rms_norm_eps=-1.0), r"rms_norm_eps must be a positive finite number, got -1.0 \(in config\.json\)"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 0}), r"rope theta must be .*, got 0 \(in config"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 0}), r"rope factor .*got 0 \(in conf"),
    (dict(eos_token_id=9999), r"eos_token_id 9999 lies outside the vocabulary \[0, 320\).* \(in config\.json\)"),
    (dict(pad_token_id="5"), r"pad_token_id must be an integer or None, got '5' \(in config\.json\)"),
    (dict(tie_word_embeddings="false"), r"tie_word_embeddings must be True or False, got 'false' \(in config"),
    (dict(num_attention_heads="4"), r"num_attention_heads must be a positive int, got '4' \(in config\.json\)"),
])
def test_config_values_that_gave_nan_logits_or_never_stopped_are_named_as_config_json(llama_copy, edit, message):
    """float() and bool() read these (NaN logits, an EOS never sampled, a pad id written back as text)."""
    rewrite_config(llama_copy, lambda d: d.update(edit))
    with pytest.raises(ValueError, match=message):
        sk.load(llama_copy)


@pytest.mark.parametrize("fmt", ["hf", "orbax"])
@pytest.mark.parametrize("stored", ["int8", "float64"])
def test_a_dtype_the_weights_cannot_load_in_names_config_json_and_dtype_argument(llama, tmp_path, fmt, stored):
    path = sk.save(sk.load(llama[0]), tmp_path / fmt, format=fmt)
    rewrite_config(path, lambda d: d.update(torch_dtype=stored))
    with pytest.raises(sk.CheckpointError, match=rf"{path}: unknown dtype '{stored}' \(torch_dtype in config.json\): "
                                                 rf"the weights load in float32, bfloat16, float16; pass dtype="):
        sk.load(path)
    assert sk.load(path, dtype="float32").config.param_dtype == "float32"


def test_unknown_dtype_in_load(llama, tmp_path):
    with pytest.raises(ValueError, match=r"unknown dtype 'float8'.*bfloat16"):
        sk.load(llama[0], dtype="float8")
    with pytest.raises(ValueError, match=r"unknown dtype 'int4'"):
        sk.load(llama[0], compute_dtype="int4")
    orbax = sk.save(sk.load(llama[0]), tmp_path / "orbax", format="orbax")
    with pytest.raises(ValueError, match=r"unknown dtype 'float8'"):
        sk.load(orbax, dtype="float8")


@pytest.mark.parametrize("kwargs,message", [
    (dict(format="bogus"), r"unknown checkpoint format 'bogus': use one of orbax, hf"),
    (dict(format="hf", dtype="float8"), r"unknown dtype 'float8'"),
    (dict(format="orbax", dtype="float8"), r"unknown dtype 'float8'"),
])
def test_bad_save_arguments_write_nothing(llama, tmp_path, kwargs, message):
    model = sk.load(llama[0])
    with pytest.raises(ValueError, match=message):
        sk.save(model, tmp_path / "out", **kwargs)
    assert list(tmp_path.iterdir()) == []


# --- nothing already written is lost ------------------------------------------------------------------------

@pytest.fixture
def occupied(tmp_path):
    """A non-empty directory that holds an (old, damaged) checkpoint's config.json: one that overwrite=True replaces."""
    target = tmp_path / "target"
    (target / "sub").mkdir(parents=True)
    (target / "notes.txt").write_text("precious\n")
    (target / "sub" / "data.bin").write_bytes(os.urandom(64))
    (target / "config.json").write_text("{}")
    return target


@pytest.mark.parametrize("fmt", ["hf", "orbax"])
def test_overwrite_replaces_only_a_checkpoint(llama, occupied, fmt):
    """overwrite=True replaced whatever the path held: a folder of the user's files was deleted, and so was the
    working directory under the process. Now only a directory with a checkpoint's config.json is replaced."""
    (occupied / "config.json").unlink()
    before = file_digests(occupied)
    with pytest.raises(FileExistsError, match="holds files .* but no config.json: it is not one to replace"):
        sk.save(sk.load(llama[0]), occupied, format=fmt, overwrite=True)
    assert file_digests(occupied) == before
    (occupied / "config.json").write_text("{}")
    cwd = os.getcwd()
    try:
        os.chdir(occupied / "sub")
        with pytest.raises(FileExistsError, match="is the working directory or holds it"):
            sk.save(sk.load(llama[0]), occupied, format=fmt, overwrite=True)
    finally:
        os.chdir(cwd)
    assert file_digests(occupied) == {**before, "config.json": file_digests(occupied)["config.json"]}


@pytest.mark.parametrize("fmt", ["hf", "orbax"])
def test_save_refuses_a_non_empty_directory(llama, occupied, fmt):
    before = file_digests(occupied)
    with pytest.raises(FileExistsError, match="not empty.*overwrite=True"):
        sk.save(sk.load(llama[0]), occupied, format=fmt)
    assert file_digests(occupied) == before
    assert sorted(p.name for p in occupied.parent.iterdir()) == ["target"]


@pytest.mark.parametrize("fmt", ["hf", "orbax"])
def test_overwrite_given_as_text_is_refused_and_keeps_the_directory(llama, occupied, fmt):
    """bool("false") is True: overwrite="false" replaced the directory it was meant to keep."""
    before = file_digests(occupied)
    with pytest.raises(ValueError, match="overwrite must be True or False, got 'false'"):
        sk.save(sk.load(llama[0]), occupied, format=fmt, overwrite="false")
    assert file_digests(occupied) == before


def test_extra_files_of_text_are_refused_before_the_weights_are_written(llama, tmp_path, monkeypatch):
    """A str, not bytes, failed in write_bytes after every shard was written, naming neither."""
    import swiftkv_jax.checkpoints.hf as hf

    monkeypatch.setattr(hf, "save_file", lambda *a, **k: pytest.fail("weights written before the check"))
    with pytest.raises(TypeError, match="extra_files maps file names to bytes, got 'README.md': str"):
        sk.save(sk.load(llama[0]), tmp_path / "out", format="hf", extra_files={"README.md": "text"})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["../escaped.txt", "sub/tokenizer.json", "sub\\tokenizer.json", "..", ""])
def test_extra_files_with_a_directory_part_are_refused_before_the_weights_are_written(llama, tmp_path, monkeypatch,
                                                                                       name):
    """"../x" was written beside the checkpoint, outside it; "sub/x" failed after every shard was written."""
    import swiftkv_jax.checkpoints.hf as hf

    monkeypatch.setattr(hf, "save_file", lambda *a, **k: pytest.fail("weights written before the check"))
    with pytest.raises(ValueError, match="not a plain file name"):
        sk.save(sk.load(llama[0]), tmp_path / "out", format="hf", extra_files={name: b"x"})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt", ["hf", "orbax"])
def test_extra_files_may_not_replace_a_file_of_the_checkpoint(llama, occupied, fmt):
    """extra_files={"config.json": ...} replaced the config the save wrote, so the weights no longer loaded."""
    before = file_digests(occupied)
    with pytest.raises(FileExistsError, match="names config.json, which the save itself wrote"):
        sk.save(sk.load(llama[0]), occupied, format=fmt, overwrite=True, extra_files={"config.json": b"{}"})
    assert file_digests(occupied) == before
    assert sorted(p.name for p in occupied.parent.iterdir()) == ["target"]


def test_save_refuses_what_is_not_a_model(llama, tmp_path):
    with pytest.raises(TypeError, match="save takes a Model .* got dict"):
        sk.save(sk.load(llama[0]).params, tmp_path / "out", format="hf")
    assert list(tmp_path.iterdir()) == []


def test_save_refuses_a_file_path(llama, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        sk.save(sk.load(llama[0]), tmp_path / "file", format="hf")
    assert (tmp_path / "file").read_text() == "x"


def test_save_into_an_existing_empty_directory(llama, tmp_path):
    (tmp_path / "empty").mkdir()
    sk.save(sk.load(llama[0]), tmp_path / "empty", format="hf")
    assert_trees_equal(sk.load(tmp_path / "empty").params, sk.load(llama[0]).params)


@pytest.mark.parametrize("fmt", ["hf", "orbax"])
def test_overwrite_replaces_the_directory(llama, occupied, fmt):
    model = sk.load(llama[0])
    sk.save(model, occupied, format=fmt, overwrite=True)
    assert not (occupied / "notes.txt").exists()
    assert sk.detect_format(occupied) == fmt
    assert_trees_equal(sk.load(occupied).params, model.params)
    assert sorted(p.name for p in occupied.parent.iterdir()) == ["target"]  # no .partial / .old left behind


def _fail_on_second_shard(monkeypatch):
    real = hf_module.save_file
    calls = []

    def flaky(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("No space left on device (simulated)")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(hf_module, "save_file", flaky)
    return calls


def test_failed_save_leaves_no_partial_directory(llama, tmp_path, monkeypatch):
    model = sk.load(llama[0])
    calls = _fail_on_second_shard(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        sk.save(model, tmp_path / "out", format="hf", max_shard_size=SHARD)
    assert len(calls) == 2  # it failed midway, after one shard was written
    assert list(tmp_path.iterdir()) == []


def test_failed_overwrite_leaves_the_existing_checkpoint_untouched(llama, tmp_path, monkeypatch):
    model = sk.load(llama[0])
    target = sk.save(model, tmp_path / "target", format="hf", max_shard_size=SHARD)
    before = file_digests(target)
    _fail_on_second_shard(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        sk.save(model, target, format="hf", max_shard_size=SHARD, overwrite=True)
    assert file_digests(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]


def test_failed_orbax_save_leaves_the_existing_directory_untouched(llama, occupied, monkeypatch):
    import orbax.checkpoint as ocp

    def boom(self, *args, **kwargs):
        raise OSError("No space left on device (simulated)")

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", boom)
    before = file_digests(occupied)
    with pytest.raises(OSError, match="No space left"):
        sk.save(sk.load(llama[0]), occupied, format="orbax", overwrite=True)
    assert file_digests(occupied) == before
    assert sorted(p.name for p in occupied.parent.iterdir()) == ["target"]


@pytest.mark.parametrize("fmt", ["hf", "orbax"])
def test_a_save_killed_mid_write_keeps_the_old_checkpoint_and_the_next_save_removes_its_leftovers(llama, tmp_path,
                                                                                                   fmt):
    """SIGKILL (a scheduler after its grace, the OOM killer) mid-write: the old checkpoint stays whole and
    loadable; the next save to the path removes the hidden partial copy (each kill left one, the model's size)."""
    model = sk.load(llama[0])
    target = sk.save(model, tmp_path / "target", format=fmt)
    before = file_digests(target)
    writer = "hf.save_file" if fmt == "hf" else "ocp.StandardCheckpointer.save"
    script = (f"import os, signal\n"
              f"import orbax.checkpoint as ocp\n"
              f"import swiftkv_jax as sk\n"
              f"from swiftkv_jax.checkpoints import hf\n"
              f"real = {writer}\n"
              f"def killed(*args, **kwargs):\n"
              f"    real(*args, **kwargs)\n"
              f"    os.kill(os.getpid(), signal.SIGKILL)\n"
              f"{writer} = killed\n"
              f"sk.save(sk.load({str(llama[0])!r}), {str(target)!r}, format={fmt!r}, overwrite=True)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert file_digests(target) == before
    assert_trees_equal(sk.load(target).params, model.params)
    left = [p for p in tmp_path.iterdir() if p.name != "target"]
    assert [p.name.startswith(".target.partial-") and any(p.iterdir()) for p in left] == [True]
    sk.save(model, target, format=fmt, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]


def test_a_replaced_directory_is_removed_once_the_target_is_whole(llama, tmp_path):
    """A replaced copy whose removal a kill cut short (the target committed beside it) goes with the next save."""
    model = sk.load(llama[0])
    sk.save(model, tmp_path / "target", format="hf")
    shutil.copytree(tmp_path / "target", tmp_path / ".target.old-0123abcd")
    sk.save(model, tmp_path / "target", format="hf", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]


def test_a_replaced_directory_is_kept_while_the_target_is_missing(llama, tmp_path):
    """A kill between a commit's two renames leaves the old checkpoint as .NAME.old-*: a save then keeps it."""
    model = sk.load(llama[0])
    sk.save(model, tmp_path / "target", format="hf")
    (tmp_path / "target").rename(tmp_path / ".target.old-0123abcd")
    sk.save(model, tmp_path / "target", format="hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".target.old-0123abcd", "target"]
    assert_trees_equal(sk.load(tmp_path / ".target.old-0123abcd").params, model.params)


def test_saved_directory_has_ordinary_permissions(llama, tmp_path):
    previous = os.umask(0o022)
    try:
        sk.save(sk.load(llama[0]), tmp_path / "out", format="hf")
        (tmp_path / "plain").mkdir()
        (tmp_path / "plain.txt").write_text("")
    finally:
        os.umask(previous)
    assert oct((tmp_path / "out").stat().st_mode) == oct((tmp_path / "plain").stat().st_mode)  # 0o755
    # every file as a plain one (0o644): safetensors 0.8 wrote its files 0o600, unreadable to a serving user
    modes = {f.name: oct(f.stat().st_mode) for f in (tmp_path / "out").iterdir()}
    assert set(modes.values()) == {oct((tmp_path / "plain.txt").stat().st_mode)}, modes
