"""The model itself: full-size shapes, RoPE, attention masking, dtype policy, scanning, input checks."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_reference
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import swiftkv_jax as sk
from swiftkv_jax.model.attention import ATTENTION_IMPLS, attend, xla_attention
from swiftkv_jax.model.rope import inverse_frequencies

LLAMA31_ROPE = sk.RopeConfig(theta=500000.0, type="llama3", factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8192)
LLAMA_3_1_8B = sk.ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                              rope=LLAMA31_ROPE, max_position_embeddings=131072, param_dtype="bfloat16",
                              dtype="bfloat16")
LLAMA_3_1_70B = LLAMA_3_1_8B.replace(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                     num_attention_heads=64)


def n_params(tree) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize(
    "config,l,base_count",
    [(LLAMA_3_1_8B, 16, 8_030_261_248), (LLAMA_3_1_70B, 40, 70_553_706_496)],
    ids=["llama-3.1-8b", "llama-3.1-70b"],
)
def test_full_size_configs_by_eval_shape(config, l, base_count):
    """Published parameter counts, and the SwiftKV additions by the paper's arithmetic, without allocating."""
    assert n_params(sk.abstract_params(config)) == base_count
    student = config.replace(num_key_value_layers=l)
    d, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    added = (config.num_hidden_layers - l) * (d * d + 2 * d * kv) + d  # q, k, v per later layer + norm_swiftkv
    assert n_params(sk.abstract_params(student)) == base_count + added
    if config is LLAMA_3_1_8B:
        assert round(added / 1e6) == 403  # SWIFTKV.md §4: "about 403M trainable parameters (5%)"
    tokens = jax.ShapeDtypeStruct((1, 8192), jnp.int32)
    out = jax.eval_shape(functools.partial(sk.forward, config=student, swiftkv=True),
                         sk.abstract_params(student), tokens)
    assert out.shape == (1, 8192, config.vocab_size) and out.dtype == jnp.float32


def test_compiled_program_does_not_grow_with_depth():
    def n_equations(layers, l):
        cfg = sk.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_key_value_layers=l)
        fn = functools.partial(sk.forward, config=cfg, swiftkv=True)
        return len(jax.make_jaxpr(fn)(sk.abstract_params(cfg), jax.ShapeDtypeStruct((1, 8), jnp.int32)).eqns)

    assert n_equations(4, 2) == n_equations(64, 32)


@pytest.mark.parametrize(
    "rope_parameters,head_dim",
    [
        ({"rope_type": "default", "rope_theta": 10000.0}, 64),
        ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, 128),
        ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 128),
        ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 64),  # Llama 3.2
    ],
)
def test_rope_frequencies_match_transformers(rope_parameters, head_dim):
    hf = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                     max_position_embeddings=131072, rope_parameters=dict(rope_parameters))
    expected = LlamaRotaryEmbedding(hf).inv_freq
    fields = {k: v for k, v in rope_parameters.items() if k not in ("rope_type", "rope_theta")}
    rope = sk.RopeConfig(theta=rope_parameters["rope_theta"], type=rope_parameters["rope_type"], **fields)
    np.testing.assert_allclose(inverse_frequencies(rope, head_dim), expected.numpy(), rtol=2e-6)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_xla_attention_against_float64_loops(heads, kv_heads):
    rng = np.random.RandomState(0)
    b, t, s, h = 2, 5, 9, 16
    q = rng.randn(b, t, heads, h).astype(np.float32)
    k, v = (rng.randn(b, s, kv_heads, h).astype(np.float32) for _ in range(2))
    kv_pos = np.tile(np.arange(s), (b, 1))
    q_pos = kv_pos[:, -t:]  # queries are the last t keys (decode / chunked prefill alignment)
    kv_seg = np.array([[0] * 4 + [1] * 5, [0] * 9])
    q_seg = kv_seg[:, -t:]
    q_pos = q_pos.copy()
    q_pos[1, 0] = -1  # a query that sees no key: zeros, not NaN
    got = np.asarray(xla_attention(q, k, v, q_pos, kv_pos, q_seg, kv_seg))
    np.testing.assert_allclose(got, numpy_reference.attention_float64(q, k, v, q_pos, kv_pos, q_seg, kv_seg), atol=1e-5)
    assert np.all(got[1, 0] == 0)


def test_unknown_attention_impl_raises():
    with pytest.raises(ValueError, match="unknown attention_impl 'flash'"):
        attend("flash", *([None] * 7))
    with pytest.raises(ValueError, match="unknown attention_impl"):
        sk.ModelConfig(attention_impl="cudnn-fallback")


TINY = sk.ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@pytest.mark.parametrize("impl", [i for i in ATTENTION_IMPLS if i != "xla"])
def test_parameters_do_not_depend_on_the_attention_impl(impl):
    """Shapes and initial values trace XLA attention whatever the config says: an fp32 export of a model trained
    with cuDNN (which refuses fp32, and any CPU) ran into it on the H200 (2026-11-25)."""
    config = TINY.replace(attention_impl=impl)
    assert sk.abstract_params(config) == sk.abstract_params(TINY)
    jax.tree.map(np.testing.assert_array_equal, sk.init(config, 0).params, sk.init(TINY, 0).params)


def test_packed_documents_do_not_attend_to_each_other():
    model = sk.init(TINY, 0)
    rng = np.random.RandomState(0)
    a, b = rng.randint(0, 128, 11), rng.randint(0, 128, 7)
    packed = np.concatenate([a, b])[None]
    positions = np.concatenate([np.arange(11), np.arange(7)])[None]
    segments = np.array([[0] * 11 + [1] * 7])
    out = np.asarray(sk.logits(model, packed, positions=positions, segment_ids=segments))
    np.testing.assert_allclose(out[0, :11], sk.logits(model, a[None])[0], atol=1e-5)
    np.testing.assert_allclose(out[0, 11:], sk.logits(model, b[None])[0], atol=1e-5)


def test_dtype_policy():
    tokens = np.random.RandomState(0).randint(0, 128, (2, 24))
    fp32 = sk.init(TINY, 0)
    reference = np.asarray(sk.logits(fp32, tokens))
    for param_dtype, compute_dtype in [("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("float32", "bfloat16")]:
        model = sk.cast(fp32, param_dtype, compute_dtype)
        assert {leaf.dtype for leaf in jax.tree.leaves(model.params)} == {jnp.dtype(param_dtype)}
        out = sk.logits(model, tokens)
        assert out.dtype == jnp.float32  # logits are always fp32, and computed so (the head's product accumulated
        assert (out != out.astype(jnp.bfloat16).astype(jnp.float32)).mean() > 0.9  # in fp32), not bf16 ones cast
        np.testing.assert_allclose(out, reference, atol=0.05)
    # bf16 storage with fp32 compute only rounds the weights: closer to fp32 than bf16 compute.
    err = {c: np.abs(np.asarray(sk.logits(sk.cast(fp32, "bfloat16", c), tokens)) - reference).max()
           for c in ("float32", "bfloat16")}
    assert err["float32"] < err["bfloat16"]


def test_rms_norm_against_float64():
    """bf16 activations normalised from fp32 statistics: only the output's bf16 rounding remains."""
    from swiftkv_jax.model.layers import RMSNorm

    cfg = TINY.replace(hidden_size=4096, dtype="bfloat16", param_dtype="bfloat16")
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(2, 3, 4096) * np.exp(rng.randn(2, 3, 1) * 4), jnp.bfloat16)
    scale = jnp.asarray(1 + 0.1 * rng.randn(4096), jnp.bfloat16)
    out = RMSNorm(cfg).apply({"params": {"scale": scale}}, x)
    assert out.dtype == jnp.bfloat16
    x64 = np.asarray(x, np.float64)
    expected = x64 / np.sqrt(np.mean(x64**2, -1, keepdims=True) + cfg.rms_norm_eps) * np.asarray(scale, np.float64)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize(
    "tokens,match",
    [
        (np.zeros((4,), np.int32), r"tokens must be an integer array \[B, T\]"),
        (np.zeros((1, 4), np.float32), r"tokens must be an integer array \[B, T\]"),
        (np.array([[1, 128]]), r"token ids must lie in \[0, 128\)"),
        (np.array([[-1, 3]]), r"token ids must lie in \[0, 128\)"),
    ],
)
def test_bad_tokens(tokens, match):
    with pytest.raises(ValueError, match=match):
        sk.logits(sk.init(TINY, 0), tokens)


def test_tokens_without_a_token_are_named():
    with pytest.raises(ValueError, match=r"tokens \[1, 0\] hold no token"):  # numpy's reduction error named neither
        sk.logits(sk.init(TINY, 0), np.zeros((1, 0), np.int32))


def test_config_takes_eos_ids_as_hf_gives_them_and_refuses_text_flags():
    """One id or a list (config.json's forms) is stored as a tuple: an int was iterated and a list unhashable,
    failing in generate / the Engine / jit; "false" for a flag would read as True."""
    assert TINY.replace(eos_token_id=2).eos_token_id == (2,)
    assert TINY.replace(eos_token_id=[2, np.int64(3)]).eos_token_id == (2, 3)
    hash(TINY.replace(eos_token_id=[2, 3]))
    with pytest.raises(ValueError, match="eos_token_id must be token ids"):
        TINY.replace(eos_token_id=[2.5])
    with pytest.raises(ValueError, match="tie_word_embeddings must be True or False, got 'false'"):
        TINY.replace(tie_word_embeddings="false")
    with pytest.raises(ValueError, match="max_position_embeddings must be a positive int"):
        TINY.replace(max_position_embeddings="4096")


def test_bad_positions_shape():
    with pytest.raises(ValueError, match="positions has shape"):
        sk.logits(sk.init(TINY, 0), np.zeros((1, 4), np.int32), positions=np.zeros((1, 5), np.int32))


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(num_key_value_heads=3), "must be a multiple of num_key_value_heads"),
        (dict(head_dim=15), "head_dim must be even"),
        (dict(family="mistral"), "unsupported model family"),
        (dict(param_dtype="float8"), "unknown dtype 'float8'"),
        (dict(key_value_group_size=2), "needs num_key_value_layers"),
        (dict(num_key_value_layers=2, key_value_group_size=2), "must divide the 1 layers"),
    ],
)
def test_config_validation(changes, match):
    with pytest.raises(ValueError, match=match):
        TINY.replace(**changes)


def test_unsupported_rope_type():
    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'"):
        sk.RopeConfig(type="yarn")


@pytest.mark.parametrize("changes,match", [
    (dict(vocab_size=True), "vocab_size must be a positive int, got True"),  # True is an int: a vocabulary of 1
    (dict(num_key_value_layers=True), r"num_key_value_layers must be an int in \[1, 3\].*got True"),
    (dict(rms_norm_eps=-1.0), "rms_norm_eps must be a positive finite number, got -1.0"),  # NaN logits
    (dict(rms_norm_eps="1e-6"), "rms_norm_eps must be a positive finite number, got '1e-6'"),  # failed in the trace
    (dict(initializer_range=float("nan")), "initializer_range must be a finite number, got nan"),
    (dict(rope={"theta": 5e5}), r"rope must be a RopeConfig \(RopeConfig\(\*\*fields\)"),
    (dict(hf_extra="not json"), "hf_extra must be a str holding a JSON object"),  # failed at sk.save
    (dict(hf_extra={"a": 1}), "hf_extra must be a str holding a JSON object"),  # unhashable
    (dict(eos_token_id=-1), r"eos_token_id -1 lies outside the vocabulary \[0, 128\)"),
    (dict(eos_token_id=[2, 600]), r"eos_token_id 600 lies outside the vocabulary \[0, 128\)"),  # never stops
    (dict(bos_token_id=600), r"bos_token_id 600 lies outside the vocabulary \[0, 128\)"),
    (dict(pad_token_id="5"), "pad_token_id must be an integer or None, got '5'"),  # written to config.json as text
])
def test_config_refuses_values_that_fail_later_or_silently(changes, match):
    with pytest.raises(ValueError, match=match):
        TINY.replace(**changes)


def test_config_keeps_numbers_and_ids_as_hf_gives_them():
    """An int epsilon is a float, numpy ids are ints (JSON), and LLaMA-1's pad_token_id -1 (config.json) loads."""
    config = TINY.replace(rms_norm_eps=1, bos_token_id=np.int64(1), pad_token_id=-1, rope=sk.RopeConfig(theta=10000))
    assert (config.rms_norm_eps, config.bos_token_id, config.pad_token_id, config.rope.theta) == (1.0, 1, -1, 1e4)
    assert type(config.rms_norm_eps) is float and type(config.bos_token_id) is int


@pytest.mark.parametrize("fields,match", [
    (dict(theta=0.0), "rope theta must be a positive finite number, got 0.0"),  # 1 / 0 ** x
    (dict(theta=-5e5), "rope theta must be a positive finite number, got -500000.0"),
    (dict(type="linear", factor=0.0), "rope factor must be a positive finite number, got 0.0"),
    (dict(original_max_position_embeddings=True), "original_max_position_embeddings must be an integer, got True"),
])
def test_rope_config_refuses_values_that_give_nan_logits(fields, match):
    with pytest.raises(ValueError, match=match):
        sk.RopeConfig(**fields)


@pytest.mark.parametrize("config,rng,match", [
    (TINY.__dict__, 0, "config must be a ModelConfig .* got dict"),  # no attribute 'replace'
    (TINY, None, r"rng must be an int seed or one PRNG key \(jax.random.key\(seed\)\), got None"),  # flax's error
    (TINY, "seed", "rng must be an int seed or one PRNG key .* got 'seed'"),  # jit's abstract-array error
    (TINY, True, "rng must be an int seed or one PRNG key .* got True"),
    (TINY, jax.random.split(jax.random.key(0)), r"got an array key<fry>\[2\]"),
])
def test_init_names_a_bad_config_or_rng(config, rng, match):
    with pytest.raises(TypeError, match=match):
        sk.init(config, rng)


def test_init_takes_numpy_seeds_and_legacy_keys():
    params = sk.init(TINY, 3).params
    for rng in (np.int64(3), jax.random.key(3)):
        jax.tree.map(np.testing.assert_array_equal, sk.init(TINY, rng).params, params)
    sk.init(TINY, jax.random.PRNGKey(3))


def test_forward_names_parameters_of_another_config():
    """sk.forward checks shapes as sk.logits does: flax's scan named a 'length' argument instead."""
    params = sk.init(TINY.replace(num_hidden_layers=4), 0).params
    with pytest.raises(ValueError, match=r"has shape \(4, 64\), the config needs \(3, 64\)"):
        sk.forward(params, np.zeros((1, 4), np.int32), config=TINY)
