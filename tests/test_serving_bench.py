"""The serving benchmark (CPU, fp32, the tiny preset): fields, exact KV ratios, and that it measures the real
engine (its tokens are `sk.generate`'s); the presets against the published Llama-3.1-8B numbers."""

import json
import math

import jax
import numpy as np
import pytest

import swiftkv_jax as sk
from swiftkv_jax.serving import bench as B

PROMPT_LEN, GEN_LEN, BATCH = 16, 6, 2  # 16: generate pads prompts to >= 16, so both run the same shapes


@pytest.fixture(scope="module")
def tiny():
    return B.random_model("tiny", dtype="float32", seed=0)


@pytest.fixture(scope="module")
def rows(tiny):
    return B.bench(tiny, prompt_len=PROMPT_LEN, gen_len=GEN_LEN, batch=BATCH, repeats=2, cache_dtype="float32",
                   memory_bandwidth=100e9, keep_tokens=True)


def test_rows_have_the_fields_and_finite_positive_timings(rows, tiny):
    assert [r["wiring"] for r in rows] == ["swiftkv", "teacher"]
    for r in rows:
        for key in ("ttft_s", "tpot_s", "decode_loop_s", "decode_tokens_per_s", "e2e_tokens_per_s",
                    "prefill_tokens_per_s", "prefill_compile_s", "decode_compile_s", "tpot_roofline_s",
                    "roofline_fraction"):
            assert math.isfinite(r[key]) and r[key] > 0, key
        assert len(r["ttft_runs_s"]) == len(r["decode_loop_runs_s"]) == 2
        assert r["tpot_s"] == pytest.approx(r["decode_loop_s"] / GEN_LEN)
        assert r["decode_tokens_per_s"] == pytest.approx(BATCH * GEN_LEN / r["decode_loop_s"])
        assert r["params"] == sum(a.size for a in jax.tree.leaves(sk.abstract_params(tiny.config)))
        assert r["param_bytes"] == 4 * r["params"]
    json.dumps(rows)  # JSON-serialisable as is
    table = B.format_table(rows)
    assert "swiftkv / teacher" in table and "teacher" in table.splitlines()[3]


def test_kv_bytes_follow_the_formula_exactly(rows, tiny):
    cfg = tiny.config
    L, l, g = cfg.num_hidden_layers, cfg.num_key_value_layers, cfg.key_value_group_size
    per_layer = 2 * BATCH * (PROMPT_LEN + GEN_LEN) * cfg.num_key_value_heads * cfg.head_dim * 4
    fast, slow = rows
    assert (fast["cache_layers"], slow["cache_layers"]) == (l + (L - l) // g, L) == (3, 4)
    assert fast["kv_cache_bytes"] == fast["cache_layers"] * per_layer
    assert slow["kv_cache_bytes"] == L * per_layer
    ratios = fast["vs_teacher"]
    assert ratios["kv_bytes"] == ratios["kv_bytes_expected"] == (l + (L - l) / g) / L == 0.75
    assert ratios["ttft"] == fast["ttft_s"] / slow["ttft_s"] and ratios["tpot"] == fast["tpot_s"] / slow["tpot_s"]


def test_step_bytes_count_each_wirings_weights(rows, tiny):
    cfg, (fast, slow) = tiny.config, rows
    d, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    later, owners = cfg.num_hidden_layers - cfg.num_key_value_layers, cfg.num_kv_groups
    embedding = cfg.vocab_size * d * 4
    swiftkv_only = (later * d * q + 2 * owners * d * kv + d) * 4  # q/k/v_proj_swiftkv + norm_swiftkv
    teacher_only = later * (d * q + 2 * d * kv) * 4  # the original q/k/v of layers >= l
    assert fast["step_param_bytes"] == fast["param_bytes"] - embedding - teacher_only
    assert slow["step_param_bytes"] == slow["param_bytes"] - embedding - swiftkv_only


def test_the_bench_loop_produces_generates_tokens(rows, tiny):
    """The benchmark measures the real engine: its greedy tokens (prefill's + gen_len decode steps) are those
    of `sk.generate` for the same prompts, in both wirings."""
    prompts = B.random_prompts(tiny.config.vocab_size, BATCH, PROMPT_LEN, seed=0).tolist()
    for row in rows:
        expected = sk.generate(tiny, prompts, GEN_LEN + 1, stop_token_ids=(), swiftkv=row["swiftkv"],
                               cache_dtype="float32").tokens
        assert row["tokens"] == expected, row["wiring"]


def test_a_plain_model_gives_one_row():
    plain = B.random_model(B.preset_config("tiny").replace(num_key_value_layers=None, key_value_group_size=1),
                           dtype="float32")
    (row,) = B.bench(plain, prompt_len=8, gen_len=2, batch=1, repeats=1, cache_dtype="float32", prefill_chunk=4)
    assert row["wiring"] == "plain" and row["cache_layers"] == 4 and "vs_teacher" not in row
    assert "roofline" not in B.format_table([row])


def test_random_model_is_the_swiftkv_student_of_a_random_teacher(tiny):
    """to_swiftkv's init: q_proj_swiftkv copies q_proj, the owner's k_proj_swiftkv is its group's mean."""
    groups = tiny.params["swiftkv_groups"]
    attn = groups["layers"]["self_attn"]
    np.testing.assert_array_equal(attn["q_proj_swiftkv"]["kernel"], attn["q_proj"]["kernel"])
    np.testing.assert_allclose(groups["k_proj_swiftkv"]["kernel"], attn["k_proj"]["kernel"].mean(axis=1),
                               rtol=1e-6, atol=1e-7)
    assert tiny.config.param_dtype == tiny.config.dtype == "float32"
    assert B.random_model("tiny", dtype="bfloat16").config.param_dtype == "bfloat16"


LLAMA_8B_PARAMS = 8_030_261_248  # Meta's published count for Llama-3.1-8B


@pytest.mark.parametrize("name,g", [("llama-3.1-8b", 1), ("llama-3.1-8b-acrosskv4", 4)])
def test_llama_presets_are_the_published_shapes(name, g):
    cfg = B.preset_config(name)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (128256, 4096, 14336, 32, 32, 8, 128)
    assert cfg.rope == sk.RopeConfig(theta=500000.0, type="llama3", factor=8.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_max_position_embeddings=8192)
    assert cfg.rms_norm_eps == 1e-5 and not cfg.tie_word_embeddings and cfg.family == "llama"
    assert (cfg.num_key_value_layers, cfg.key_value_group_size) == (16, g)
    count = lambda c: sum(math.prod(a.shape) for a in jax.tree.leaves(sk.abstract_params(c)))
    assert count(cfg.replace(num_key_value_layers=None, key_value_group_size=1)) == LLAMA_8B_PARAMS
    d, kv = 4096, 8 * 128
    added = 16 * d * d + (16 // g) * 2 * d * kv + d  # q_proj_swiftkv per later layer, k/v per owner, norm_swiftkv
    assert count(cfg) == LLAMA_8B_PARAMS + added
    assert B.expected_kv_ratio(cfg) == (16 + 16 / g) / 32


def test_llama_70b_preset_is_the_published_shape():
    cfg = B.preset_config("llama-3.1-70b")
    plain = cfg.replace(num_key_value_layers=None, key_value_group_size=1)
    assert sum(math.prod(a.shape) for a in jax.tree.leaves(sk.abstract_params(plain))) == 70_553_706_496  # Meta's
    assert (cfg.num_key_value_layers, cfg.key_value_group_size, cfg.num_key_value_heads) == (40, 1, 8)  # SwiftKV-70B


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match="llama-3.1-8b, llama-3.1-8b-acrosskv4, llama-3.1-70b, tiny"):
        B.preset_config("llama-3.1-7b")
    with pytest.raises(ValueError, match="unknown model preset"):
        B.random_model("nope")


def test_bad_arguments_fail_loudly(tiny):
    with pytest.raises(ValueError, match="prefill_chunk 5 must divide prompt_len 16"):
        B.bench(tiny, prompt_len=16, gen_len=1, batch=1, prefill_chunk=5)
    with pytest.raises(ValueError, match="gen_len must be a positive int"):
        B.bench(tiny, prompt_len=16, gen_len=0, batch=1)
