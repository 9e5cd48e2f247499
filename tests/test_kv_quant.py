"""KV cache formats (swiftkv_jax.model.kv_quant) against ml_dtypes' FP8 and numpy float64 arithmetic."""

import ml_dtypes
import numpy as np
import pytest

import jax.numpy as jnp
import swiftkv_jax as sk
from swiftkv_jax.model.kv_quant import (KVCacheFormat, as_format, check_format, dequantize, init_scales,
                                          kv_bytes_per_token, quantize)


def heads(seed=0, shape=(3, 5, 2, 64)):
    """[B, T, K, H] values with a spread of magnitudes per token-head, one all-zero head and an outlier."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-4, 3, shape[:-1]))[..., None]
    x[0, 0, 0] = 0.0
    x[1, 2, 1, 7] = 900.0
    return x.astype(np.float32)


def test_int8_per_token_head_rounds_to_half_a_step():
    x = heads()
    fmt = KVCacheFormat("int8")
    assert fmt.scales == "per-token-head"
    q, scale = quantize(jnp.asarray(x), fmt.dtype)
    assert q.dtype == jnp.int8 and scale.dtype == jnp.float32 and scale.shape == x.shape[:-1]
    step = np.abs(x).max(-1, keepdims=True).astype(np.float64) / 127
    np.testing.assert_allclose(np.asarray(scale), np.maximum(step[..., 0], 1e-12), rtol=1e-6)  # zeros: a tiny scale
    qn = np.asarray(q)
    assert np.abs(qn).max() == 127 and qn.min() >= -127
    assert (np.abs(qn).max(-1)[np.abs(x).max(-1) > 0] == 127).all(), "each token-head's largest value uses the range"
    back = np.asarray(dequantize(q, scale), np.float64)
    assert (np.abs(back - x) <= step / 2 * (1 + 1e-5) + 1e-30).all()
    assert not back[0, 0, 0].any(), "an all-zero head comes back as zeros"


def test_fp8_per_token_head_matches_ml_dtypes_e4m3fn():
    x = heads(1)
    fmt = KVCacheFormat("fp8")
    assert fmt.dtype == "float8_e4m3fn"
    q, scale = quantize(jnp.asarray(x), fmt.dtype)
    scale64 = np.maximum(np.abs(x.astype(np.float64)).max(-1) / 448, 1e-12)
    want = np.clip(x / scale64[..., None], -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    mismatch = np.asarray(q).view(np.uint8) != want.view(np.uint8)
    assert mismatch.mean() < 1e-3, "a value on a rounding tie may go either way after fp32 division, no more"
    back = np.asarray(dequantize(q, scale), np.float64)
    # e4m3: 3 mantissa bits, so a half step is 1/16 of the value; values below 2^-6 of the scale are subnormal
    bound = np.maximum(np.abs(x) / 16, scale64[..., None] * 2.0 ** -10)
    assert (np.abs(back - x) <= bound * (1 + 1e-5)).all()


def test_per_layer_scale_clips_instead_of_overflowing_to_nan():
    x = jnp.asarray([[1000.0, -1000.0, 3.3, 0.01]])
    fp8 = KVCacheFormat("float8_e4m3fn", "per-layer")
    scale = init_scales(fp8, (2, 3))[0]
    assert scale.shape == () and float(scale) == 1.0
    q, same = quantize(x, fp8.dtype, scale)
    assert same is scale
    np.testing.assert_array_equal(np.asarray(dequantize(q, scale)), [[448.0, -448.0, 3.25, 0.009765625]])
    int8 = KVCacheFormat("int8", "per-layer", per_layer_scale=0.5)
    scale = init_scales(int8, (2, 3))[1]
    q, _ = quantize(x, int8.dtype, scale)
    np.testing.assert_array_equal(np.asarray(q), [[127, -127, 7, 0]])
    np.testing.assert_array_equal(np.asarray(dequantize(q, scale)), [[63.5, -63.5, 3.5, 0.0]])


def test_unquantised_formats_cast_and_take_no_scales():
    x = jnp.asarray(heads(2))
    for name in ("bfloat16", "bf16", "float32"):
        fmt = as_format(name)
        q, scale = quantize(x, fmt.element_dtype)
        assert scale is None and fmt.scales is None and not fmt.quantized and init_scales(fmt, (2,)) == ()
        np.testing.assert_array_equal(np.asarray(dequantize(q, None)), np.asarray(x.astype(q.dtype), np.float32))


@pytest.mark.parametrize("args, message", [
    (("float8_e5m2",), "unknown KV cache dtype 'float8_e5m2': choose one of auto, float32, bfloat16, float16, "
                       "float8_e4m3fn, int8"),
    (("int4",), "unknown KV cache dtype"),
    (("bfloat16", "per-token-head"), "do not apply to a bfloat16 cache"),
    (("int8", "per-channel"), "choose one of per-layer, per-token-head"),
    (("int8", "per-layer"), "needs a calibrated scale.*per-token-head scales"),  # 1.0 rounds |x| < 0.5 to 0
    (("auto", "per-token-head"), "do not apply to cache dtype 'auto' \\(the model's float dtype\\)"),
    (("auto",), "'auto' is the model's compute dtype: resolve it with the model's"),  # no model_dtype given
])
def test_bad_settings_name_the_choices(args, message):
    with pytest.raises(ValueError, match=message):
        as_format(*args)
    with pytest.raises(ValueError, match="positive"):
        KVCacheFormat("int8", "per-layer", per_layer_scale=0.0)


@pytest.mark.parametrize("model_dtype, want", [("float32", "float32"), ("bfloat16", "bfloat16"), ("fp16", "float16"),
                                               (jnp.bfloat16, "bfloat16")])
def test_auto_is_the_models_compute_dtype(model_dtype, want):
    """`auto` (the default everywhere, as vLLM's --kv-cache-dtype auto and transformers' caches) is the model's compute
    dtype, in any spelling; a named dtype ignores the model's."""
    for auto in ("auto", "AUTO"):
        fmt = as_format(auto, model_dtype=model_dtype)
        assert fmt == KVCacheFormat(want) and fmt.element_dtype == jnp.dtype(want) and not fmt.quantized
    assert as_format("bfloat16", model_dtype="float32").dtype == "bfloat16"
    assert as_format("int8", model_dtype="float32").element_dtype == jnp.int8


def test_check_format_takes_auto_before_the_model_is_known():
    """EngineOptions and infer.py check the setting before a model is loaded: auto passes, a bad name or scales beside
    auto name the choices."""
    check_format("auto")
    check_format("fp8", "per-layer")
    with pytest.raises(ValueError, match="choose one of auto, float32, bfloat16, float16, float8_e4m3fn, int8"):
        check_format("f32x")
    with pytest.raises(ValueError, match="do not apply to cache dtype 'auto'"):
        check_format("auto", "per-layer")


def test_bytes_reproduce_the_papers_62_5_percent():
    """2-way AcrossKV at l = L/2 with FP8 holds 0.375 of the teacher's bf16 cache (1 - 0.75 x 0.5 = 62.5% less),
    plus 4 bytes of scale per token and head when the scales are dynamic."""
    cfg = sk.ModelConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         num_key_value_layers=16, key_value_group_size=2)
    teacher = kv_bytes_per_token(cfg, cfg.num_hidden_layers, as_format("bfloat16"))
    student_layers = cfg.num_kv_cache_layers
    assert student_layers == 16 + 8
    static = kv_bytes_per_token(cfg, student_layers, KVCacheFormat("fp8", "per-layer"))
    dynamic = kv_bytes_per_token(cfg, student_layers, KVCacheFormat("fp8", "per-token-head"))
    assert static / teacher == 0.375
    assert dynamic / teacher == 0.375 * (128 + 4) / 128
    assert teacher == 2 * 32 * 8 * 128 * 2


def test_bytes_benchmark_allocates_what_the_paper_counts(tmp_path):
    """benchmarks/kv_cache.py bytes: the caches init_cache allocates (shapes only) for the Llama-3.1-8B shape."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "bytes.json"
    subprocess.run([sys.executable, "benchmarks/kv_cache.py", "bytes", "--out", str(out)], cwd=repo, check=True,
                   capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text())
    rows = {(r["g"], r["format"]): r["vs_teacher_bf16"] for r in result["rows"]}
    teacher = result["teacher_bf16_bytes_per_token"] * result["tokens"]
    assert teacher == 32 * 2 * 4096 * 8 * 128 * 2
    # 16 + 32/2/2 = 24 cached layers of 1-byte K and V, plus their static scales: 2 x 24 fp32 numbers
    assert rows[(2, "float8_e4m3fn/per-layer")] == (0.375 * teacher + 2 * 24 * 4) / teacher
    assert rows[(2, "float8_e4m3fn/per-token-head")] == 0.375 * 132 / 128
    assert rows[(1, "bfloat16")] == 1.0 and rows[(4, "bfloat16")] == 0.625
