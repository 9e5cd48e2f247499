"""The serving benchmarks (CPU, fp32, tiny presets). `infer.py bench` (serving/bench.py): fields, exact KV ratios, and
that it measures the real engine (its tokens are `sk.generate`'s); the presets against the published Llama-3.1-8B
numbers. `benchmarks/serving.py`: every configuration (engines, static, the transformers peer) on the quick preset, the
roofline against the issue's figures, the GPU pack's parts. `benchmarks/serving_guidellm.py`: guidellm's report
read back to its own figures, our driver's requests in guidellm's definitions, the 20% verdict."""

import json
import math
import os
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import swiftkv_jax as sk
from swiftkv_jax.serving import bench as B
from swiftkv_jax.serving.cache import LENGTH_ALIGN

PROMPT_LEN, GEN_LEN, BATCH = 16, 6, 2  # 16: generate pads prompts to >= 16, so both run the same shapes


@pytest.fixture(scope="module")
def tiny():
    return B.random_model("tiny", dtype="float32", seed=0)


@pytest.fixture(scope="module")
def rows(tiny):
    return B.bench(tiny, prompt_len=PROMPT_LEN, gen_len=GEN_LEN, batch=BATCH, repeats=2, cache_dtype="float32",
                   memory_bandwidth=100e9, keep_tokens=True)


def test_a_memory_bandwidth_that_is_not_positive_is_refused(tiny):
    """A negative bandwidth once printed a roofline of -45762771921.7%."""
    for bandwidth in (-5.0, 0.0, float("nan")):
        with pytest.raises(ValueError, match="memory_bandwidth must be a positive number of bytes/s"):
            B.bench(tiny, prompt_len=PROMPT_LEN, gen_len=GEN_LEN, batch=BATCH, memory_bandwidth=bandwidth)


def test_the_wirings_take_turns_so_that_a_slow_spell_falls_on_both(tiny, monkeypatch):
    """After one warm-up run each, the two wirings alternate, in the other order each run: a demo's CPU run that timed
    all of one wiring's runs and then the other's put a 50% student's prefill at 0.79 of its teacher's (0.47-0.50
    timed again)."""
    runs, run_once = [], B._run_once
    monkeypatch.setattr(B, "_run_once", lambda w, *args, record: (runs.append((w.swiftkv, record)),
                                                                   run_once(w, *args, record=record)))
    swiftkv, teacher = B.bench(tiny, prompt_len=PROMPT_LEN, gen_len=2, batch=BATCH, repeats=3, cache_dtype="float32")
    assert runs == [(False, False), (True, False), (True, True), (False, True), (False, True), (True, True),
                    (True, True), (False, True)]
    assert len(swiftkv["ttft_runs_s"]) == len(teacher["ttft_runs_s"]) == len(teacher["decode_loop_runs_s"]) == 3
    assert swiftkv["vs_teacher"]["ttft"] == pytest.approx(swiftkv["ttft_s"] / teacher["ttft_s"])


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
    length = math.ceil((PROMPT_LEN + GEN_LEN) / LENGTH_ALIGN) * LENGTH_ALIGN  # as init_cache allocates it
    per_layer = 2 * BATCH * length * cfg.num_key_value_heads * cfg.head_dim * 4
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


def test_roofline_and_end_to_end_rate_by_hand(rows, tiny):
    """The TPOT roofline's bytes and the end-to-end rate from the definitions: decode step i (0..gen_len - 1) appends
    the token at position prompt_len + i and attends over prompt_len + i + 1 entries, in each of the L layers (an
    AcrossKV layer reads its owner's), K and V of every KV head in fp32; end-to-end = (gen_len + 1) tokens a sequence
    over TTFT + the decode loop."""
    cfg = tiny.config
    keys_read = sum(PROMPT_LEN + i + 1 for i in range(GEN_LEN))  # per sequence, layer and head, over the loop
    kv_bytes_per_step = cfg.num_hidden_layers * 2 * BATCH * cfg.num_key_value_heads * cfg.head_dim * 4 * keys_read
    for r in rows:
        step_bytes = r["step_param_bytes"] + kv_bytes_per_step / GEN_LEN
        assert r["step_bytes"] == int(step_bytes)
        assert r["tpot_roofline_s"] == pytest.approx(step_bytes / 100e9)
        assert r["roofline_fraction"] == pytest.approx(step_bytes / 100e9 / r["tpot_s"])
        assert r["e2e_tokens_per_s"] == pytest.approx(BATCH * (GEN_LEN + 1) / (r["ttft_s"] + r["decode_loop_s"]))
        assert r["prefill_tokens_per_s"] == pytest.approx(BATCH * PROMPT_LEN / r["ttft_s"])


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
    with pytest.raises(ValueError, match="gen_len must be a non-negative int"):
        B.bench(tiny, prompt_len=16, gen_len=-1, batch=1)
    with pytest.raises(ValueError, match="repeats must be a positive int"):
        B.bench(tiny, prompt_len=16, gen_len=1, batch=1, repeats=0)


def test_gen_len_0_times_the_prefill_only(tiny, rows):
    """The demo's prefill comparison: no decode loop compiled or run, its fields None, the prefill's token that of
    `sk.generate`, and the ratios of what was measured."""
    prefill_only = B.bench(tiny, prompt_len=PROMPT_LEN, gen_len=0, batch=BATCH, repeats=2, cache_dtype="float32",
                           memory_bandwidth=100e9, keep_tokens=True)
    prompts = B.random_prompts(tiny.config.vocab_size, BATCH, PROMPT_LEN, seed=0).tolist()
    for row, full in zip(prefill_only, rows):
        assert row["decode_compile_s"] is row["tpot_s"] is row["decode_loop_s"] is row["decode_tokens_per_s"] is None
        assert row["decode_loop_runs_s"] == [] and "roofline_fraction" not in row
        assert len(row["ttft_runs_s"]) == 2 and row["ttft_s"] > 0 and row["prefill_compile_s"] > 0
        assert row["e2e_tokens_per_s"] == pytest.approx(BATCH / row["ttft_s"])
        assert row["kv_cache_bytes"] < full["kv_cache_bytes"]  # a cache for the prompt alone
        assert row["tokens"] == [t[:1] for t in full["tokens"]] == [
            t[:1] for t in sk.generate(tiny, prompts, 1, stop_token_ids=(), swiftkv=row["swiftkv"],
                                       cache_dtype="float32").tokens]
    ratios = prefill_only[0]["vs_teacher"]
    assert ratios["tpot"] is None and ratios["ttft"] == prefill_only[0]["ttft_s"] / prefill_only[1]["ttft_s"]
    table = B.format_table(prefill_only)
    assert "tpot -" in table and " - " in table.splitlines()[2]


# ---- benchmarks/serving.py: every configuration at tiny sizes (the quick preset), its roofline and its parts -------

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import serving as S  # noqa: E402  (benchmarks/serving.py)
import serving_peer  # noqa: E402

ISSUE_FIELDS = ("total_tokens_per_s", "output_tokens_per_s", "requests_per_s", "ttft_ms", "tpot_ms",
                "roofline_total_tokens_per_s")


REPETITION_PENALTIES = []  # the repetition_penalty of every request the run below gave sk.Engine


@pytest.fixture(scope="module")
def serving_run(tmp_path_factory):
    """The whole benchmark once, on the quick preset: every configuration (the transformers peer in its process);
    each request's repetition_penalty as sk.Engine received it (REPETITION_PENALTIES)."""
    out = tmp_path_factory.mktemp("serving") / "serving.json"
    add_request = sk.Engine.add_request

    def seen(self, prompt, **options):
        REPETITION_PENALTIES.append(options.get("repetition_penalty", 1.0))
        return add_request(self, prompt, **options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sk.Engine, "add_request", seen)
        assert S.main(["--smoke", "--sweep", "0.5", "--out", str(out), "--plot", "none"]) == 0
    data = json.loads(out.read_text())
    return data, {(r["config"], r["rate"]): r for r in data["runs"]}


def test_the_penalised_configuration_penalises_every_request_and_no_other(serving_run):
    """swiftkv-penalised: every request at repetition_penalty 1.05 (the penalties' branch in every step), the other
    engine configurations none; its ratio to swiftkv-tokens is a target row."""
    data, runs = serving_run
    engine_requests = sum(r["num_requests"] for (name, _), r in runs.items() if S.CONFIGS[name]["kind"] == "engine")
    assert len(REPETITION_PENALTIES) == engine_requests
    penalised = sum(r["num_requests"] for (name, _), r in runs.items() if name == "swiftkv-penalised")
    assert REPETITION_PENALTIES.count(1.05) == penalised >= 8  # rate inf, and the rate it is compared at
    assert set(REPETITION_PENALTIES) == {1.0, 1.05}
    assert data["engine"]["swiftkv-penalised"]["sampling"] == {"repetition_penalty": 1.05}
    row, = [t for t in data["targets"] if t["target"].startswith("swiftkv-penalised / swiftkv-tokens")]
    rate = lambda name: runs[(name, "inf")]["total_tokens_per_s"]  # noqa: E731
    want = rate("swiftkv-penalised") / rate("swiftkv-tokens")
    assert row["value"] == pytest.approx(want) and row["goal"] == S.PENALISED_VS_PLAIN


def test_every_configuration_ran_at_rate_inf_with_the_issues_fields(serving_run):
    data, runs = serving_run
    assert data["complete"] and data["configs"] == list(S.CONFIGS)
    for name in S.CONFIGS:
        run = runs[(name, "inf")]
        assert run["status"] == "ok", (name, run.get("reason"))
        for key in ISSUE_FIELDS:
            assert key in run, (name, key)
        assert run["total_tokens_per_s"] > run["output_tokens_per_s"] > 0 and run["requests_per_s"] > 0
        assert run["roofline_total_tokens_per_s"] > 0 and run["roofline_share"] > 0
        assert run["prompt_tokens"] + run["generated_tokens"] == pytest.approx(
            run["total_tokens_per_s"] * run["duration_s"])
        if S.CONFIGS[name]["kind"] == "static":
            assert run["ttft_ms"]["p50"] is None and run["batches"] >= 1 and run["num_requests"] == 8
        else:
            assert 0 < run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"] and run["tpot_ms"]["p50"] > 0
            assert run["all_generated"] and not run["cut_off"] and run["finished"] == run["num_requests"] == 8
        if S.CONFIGS[name]["kind"] == "engine":
            assert run["compilations"] == 0, run["compiled"]  # warmup() compiled every program before the timing
    assert data["workload"]["num_requests"] == 8 and "| transformers continuous batching" in data["table"]


def test_the_transformers_peer_runs_the_same_weights_and_requests(serving_run):
    data, runs = serving_run
    peer = runs[("transformers", "inf")]
    assert peer["label"] == "transformers continuous batching (same CPU peer)"
    assert peer["weights_digest"] == data["weights_digest"] and "weights_note" not in peer
    assert peer["per_request"]["output_tokens"] == data["workload"]["output_lens"]  # every request to its length
    assert peer["per_request"]["prompt_tokens"] == data["workload"]["prompt_lens"]
    assert peer["attention"] == "paged|sdpa" and peer["versions"]["transformers"]
    assert runs[("teacher", "inf")]["ratios"]["vs_transformers"] == pytest.approx(
        runs[("teacher", "inf")]["total_tokens_per_s"] / peer["total_tokens_per_s"])


def test_ratios_compare_the_same_wiring(serving_run):
    _, runs = serving_run
    for name, static in (("teacher", "static-teacher"), ("swiftkv-tokens", "static-swiftkv"),
                         ("swiftkv-fp8", "static-swiftkv")):
        r = runs[(name, "inf")]
        assert r["ratios"]["vs_static"] == pytest.approx(r["total_tokens_per_s"] / runs[(static, "inf")]
                                                         ["total_tokens_per_s"])
    assert "vs_teacher" not in runs[("teacher", "inf")]["ratios"]


def test_the_sweep_runs_multiples_of_each_configs_own_throughput(serving_run):
    data, runs = serving_run
    for name in ("teacher", "swiftkv-tokens"):
        swept = [r for (n, rate), r in runs.items() if n == name and rate != "inf" and r["status"] == "ok"]
        assert all(isinstance(r["sustained"], bool) for r in swept)
        # its own multiple, run, or skipped because a lower rate (the teacher's, for SwiftKV) was not sustained:
        # whether 8 requests on 2 busy cores keep up with their arrivals is the machine's to say
        [own] = [r for (n, rate), r in runs.items() if n == name and rate != "inf"
                 and not r.get("teachers_highest_sustained_rate")]
        assert own["rate"] == pytest.approx(0.5 * runs[(name, "inf")]["requests_per_s"], rel=1e-2)
        if own["status"] == "ok":
            assert own["multiple_of_rate_inf"] == pytest.approx(0.5)
        else:
            assert own["reason"] == "a lower rate was not sustained" and own["by_rule"]  # complete all the same
            assert any(r["rate"] < own["rate"] and not r["sustained"] for r in swept)
    teacher_rates = [r["rate"] for (n, rate), r in runs.items() if n == "teacher" and rate != "inf"]
    for name in ("swiftkv-tokens", "swiftkv-cost", "swiftkv-fp8"):  # each SwiftKV engine at the teacher's rate
        at = [r for (n, rate), r in runs.items() if n == name and r.get("teachers_highest_sustained_rate")]
        assert len(at) == 1 and at[0]["rate"] in teacher_rates and "tpot_p50_vs_teacher" in at[0]["ratios"]


def test_sustained_needs_completions_bounded_ttft_and_no_cut_off():
    run = dict(rate=2.0, cut_off=False, completion_rate=1.96, arrival_rate=2.0, ttft_s=dict(p50=0.3))
    assert S.judge(run, base_ttft_p50=0.1, factor=4)
    assert not S.judge({**run, "completion_rate": 1.8}, 0.1, 4)  # < 95% of the arrivals
    assert not S.judge(run, base_ttft_p50=0.05, factor=4)  # the queue grows
    assert not S.judge({**run, "cut_off": True}, 0.1, 4) and not S.judge({**run, "rate": math.inf}, 0.1, 4)


def test_roofline_of_the_issues_workload_on_an_h100():
    """Llama-3.1-8B at 2000 + 250 tokens, 600 TFLOP/s and 3.35 TB/s, 200 sequences a step: near the issue's 27.6k
    (teacher) and 39.8k (SwiftKV l = L/2) total tokens/s; prefill compute-bound, decode memory-bound."""
    cfg = B.preset_config("llama-3.1-8b")
    kv = 2 * 32 * 8 * 128 * 2  # K and V, 32 cached layers (g = 1), 8 KV heads of 128, bf16
    roof = lambda swiftkv: S.roofline(cfg, swiftkv=swiftkv, prompt_lens=[2000] * 1000, output_lens=[250] * 1000,
                                      kv_bytes_per_token=kv, batch=200, flops_per_s=600e12, bytes_per_s=3.35e12)
    teacher, swiftkv = roof(False), roof(True)
    assert teacher["total_tokens_per_s"] == pytest.approx(27.6e3, rel=0.15)
    assert swiftkv["total_tokens_per_s"] == pytest.approx(39.8e3, rel=0.15)
    assert teacher["prefill_s"] / 1000 == pytest.approx(0.048, rel=0.1)  # ~2 x 7.0B x 2000 FLOPs + attention
    assert teacher["decode_bound"] == swiftkv["decode_bound"] == "memory"
    assert swiftkv["prompt_token_cost"] == pytest.approx(0.519, abs=1e-3) and swiftkv["attention_layers"] == 16
    assert swiftkv["decode_s"] == teacher["decode_s"]  # SwiftKV leaves decode alone
    twice_the_batch = S.roofline(cfg, swiftkv=False, prompt_lens=[2000], output_lens=[250], kv_bytes_per_token=kv,
                                 batch=400, flops_per_s=600e12, bytes_per_s=3.35e12)
    assert twice_the_batch["decode_bytes"] < roof(False)["decode_bytes"] / 1000


def test_the_8b_parts_fit_the_gpu_pack_and_the_cpu_preset_leaves_fp8_out():
    offline = S.parse_args(["--preset", "8b", "--part", "offline"])
    assert offline.configs == "teacher,swiftkv-tokens,static-teacher,static-swiftkv"
    assert (offline.num_requests, offline.multiples, offline.deadline) == (1000, [], S.PART_DEADLINE_8B)
    sweep = S.parse_args(["--preset", "8b", "--part", "sweep"])
    assert sweep.configs == "teacher,swiftkv-tokens" and sweep.num_requests == 256 and sweep.multiples
    peer = S.parse_args(["--preset", "8b", "--part", "peer"])
    assert peer.configs.startswith("transformers,") and "swiftkv-fp8" in peer.configs
    assert peer.peer_requests == peer.num_requests == 192 and peer.multiples == []
    whole = S.parse_args(["--preset", "8b"])
    assert whole.deadline is None and whole.configs == ",".join(S.CONFIGS) and whole.kv_cache_fraction == 0.9
    cpu = S.parse_args(["--preset", "cpu"])
    assert "swiftkv-fp8" not in cpu.configs.split(",") and "transformers" in cpu.configs
    assert S.parse_args(["--preset", "cpu", "--configs", "swiftkv-fp8"]).configs == "swiftkv-fp8"
    with pytest.raises(SystemExit):
        S.parse_args(["--preset", "quick", "--configs", "nope"])


def test_a_transformers_without_continuous_batching_is_recorded_as_skipped(monkeypatch):
    monkeypatch.setattr(serving_peer, "missing_api", lambda model_class: "generate_batch")
    result = serving_peer.run({"args": {}, "num_requests": 1}, Path("."))
    assert result["status"] == "skipped" and "has no generate_batch" in result["reason"]
    row = S.table({("transformers", math.inf): dict(status="skipped", reason=result["reason"])}, ["transformers"])
    assert "skipped: transformers" in row


def test_a_cut_off_run_counts_the_served_prompts_and_every_token():
    """Three requests at t = 0, the run cut at 2 s: one finished (4 tokens), one half-way (2 of 4), one not
    started."""
    served = dict(times=[[0.5, 0.75, 1.0, 1.25], [1.5, 1.75], []], cut_off=True, elapsed_s=2.0, stats={})
    run = S.summarise(math.inf, [0.0, 0.0, 0.0], [10, 20, 30], [4, 4, 4], served)
    assert run["cut_off"] and run["finished"] == 1 and not run["all_generated"]
    assert run["prompt_tokens"] == 30 and run["generated_tokens"] == 6 and run["duration_s"] == 2.0
    assert run["total_tokens_per_s"] == 18 and run["requests_per_s"] == 0.5
    assert run["ttft_ms"]["p50"] == pytest.approx(1000) and run["tpot_ms"]["p50"] == pytest.approx(250)
    assert run["per_request"]["e2e_s"] == [1.25, None, None]


def test_the_shared_prefix_workload_hits_what_it_shares(tmp_path):
    """`--workload shared-prefix` on the quick preset: every run of the matrix ran; with the system prompt cached
    before the clock, each single-turn request finds the system prompt's full pages (64 tokens at 16-token pages)
    and nothing more (its own tokens are random), caching off finds nothing, and without sharing nothing hits."""
    out = tmp_path / "prefix.json"
    assert S.main(["--workload", "shared-prefix", "--quick", "--page-size", "16", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["complete"] and len(data["runs"]) == 20 and "| workload |" in data["table"]
    for run in data["runs"]:
        queries, hits = run["prefix_cache_queries"], run["prefix_cache_hits"]
        if not run["caching"] or run["workload"] == "no-sharing":
            assert hits == 0
        elif run["workload"] == "single-turn":
            assert queries == run["prompt_tokens"] and hits == 64 * run["num_requests"]
        else:  # multi-turn: later turns also find their own earlier turns
            assert hits > 64 * run["num_requests"]
    assert {t["target"].split(":")[0] for t in data["targets"]} >= {"single-turn teacher", "multi-turn swiftkv-tokens"}
    # multi-turn's answers (3-5 tokens, the same draw on and off) against the lockstep's 4 each, judged only there
    varied, lockstep = ([r for r in data["runs"] if r["workload"] == w] for w in ("multi-turn", "multi-turn-lockstep"))
    assert len({r["generated_tokens"] for r in varied}) == 1 and all(r["all_generated"] for r in varied + lockstep)
    assert {r["generated_tokens"] for r in lockstep} == {4 * r["num_requests"] for r in lockstep}
    assert [t["passed"] for t in data["targets"] if t["target"].startswith("multi-turn-lockstep")] == [None] * 4
    with pytest.raises(SystemExit):
        S.parse_args(["--workload", "shared-prefix", "--suffix-lens", "30,10"])


# ---- benchmarks/serving_guidellm.py: guidellm's report read as guidellm computes it, our driver's definitions -------

import serving_guidellm as SG  # noqa: E402
import serving_http  # noqa: E402

GUIDELLM_REPORT = Path(__file__).resolve().parent / "data" / "guidellm_report.json"


def _guidellm():
    if os.environ.get("CI"):  # the clients extra is installed in CI
        import guidellm  # noqa: F401
    else:
        pytest.importorskip("guidellm")


def test_a_recorded_guidellm_report_reads_back_to_its_own_figures():
    """A guidellm 0.8.1 run (8 requests, constant 2/s, synthetic 64-in / 16-out, on the tiny student through `infer.py
    serve`; its JSON cut to the fields read): the requests in their scheduled order, 0.5 s apart, the chat bodies it
    sent, and the per-request TTFT / ITL give back its reported p50, mean and p99 by our summary (ITL weighted by
    output tokens - 1)."""
    _guidellm()
    r = SG.read_report(GUIDELLM_REPORT)
    assert r["totals"] == dict(successful=8, errored=0, incomplete=0, total=8)
    np.testing.assert_allclose(r["offsets_s"], [0.5 * i for i in range(8)], atol=1e-6)
    assert r["output_tokens"] == [16] * 8
    body = r["bodies"][0]
    assert body["stream"] and body["ignore_eos"] and body["max_completion_tokens"] == 16
    assert body["stream_options"] == dict(include_usage=True, continuous_usage_stats=True)
    assert body["messages"][0]["role"] == "user"
    ours = SG.summarise_round(r)
    for metric in SG.METRICS:
        for stat in ("p50", "mean", "p99"):
            assert ours[metric][stat] == pytest.approx(r["reported"][metric][stat], rel=1e-12), (metric, stat)
    assert ours["itl_ms"]["count"] == r["reported"]["itl_ms"]["count"] == 8 * 15


def test_our_requests_in_guidellms_definitions():
    """TTFT from the request's headers going out (not its scheduled arrival) to its first token; ITL = (last -
    first token) / (tokens - 1)."""
    done = dict(times=[[1.010, 1.020, 1.030], [2.5, 2.5, 2.6, 2.8]], sent=[1.002, 2.1])
    r = SG.per_request(done, arrivals=[1.0, 2.0])
    np.testing.assert_allclose(r["ttft_ms"], [8.0, 400.0])
    np.testing.assert_allclose(r["itl_ms"], [10.0, 100.0])
    np.testing.assert_allclose(r["dispatch_s"], [0.002, 0.1])
    assert r["output_tokens"] == [3, 4]


def test_a_streamed_chunk_counts_the_tokens_it_brings():
    """Chat's role chunk brings none; without continuous usage a chunk with text brings one; with it, as many as the
    usage adds (two tokens whose text came out together), and the last chunk its tokens without text."""
    n = serving_http.new_tokens
    assert n(dict(index=0, delta=dict(role="assistant", content=""), finish_reason=None), None, 0) == 0
    assert n(dict(index=0, text="t5", finish_reason=None), None, 3) == 1
    assert n(dict(index=0, text="", finish_reason=None), None, 3) == 0
    assert n(dict(index=0, delta=dict(content="ab"), finish_reason=None), dict(completion_tokens=3), 1) == 2
    assert n(dict(index=0, delta=dict(content="a"), finish_reason=None), dict(completion_tokens=3), 3) == 1
    assert n(dict(index=0, delta={}, finish_reason=None), dict(completion_tokens=4), 3) == 0
    assert n(dict(index=0, delta={}, finish_reason="length"), dict(completion_tokens=16), 15) == 1


def test_the_comparison_passes_within_twenty_percent_and_not_outside():
    """guidellm / ours of the pooled p50s: 1.15 passes, 1.25 and 1 / 1.3 fail (TTFT and ITL alike); an errored
    guidellm request, or a request short of its tokens, fails whatever the ratios."""
    _guidellm()
    g = SG.read_report(GUIDELLM_REPORT)

    def ours(scale, tokens=16):
        return dict(ttft_ms=[v / scale for v in g["ttft_ms"]], itl_ms=[v / scale for v in g["itl_ms"]],
                    output_tokens=[tokens] * 8, dispatch_s=[0.001] * 8)

    ok = SG.compare([g, g], [ours(1.15), ours(1.15)], expected_requests=8, output_tokens=16)
    assert ok["passed"] and ok["ratios"]["ttft_ms_p50"] == pytest.approx(1.15)
    assert ok["ratios"]["itl_ms_p50"] == pytest.approx(1.15) and ok["ratios"]["itl_ms_mean"] == pytest.approx(1.15)
    assert ok["guidellm"]["ttft_ms"]["count"] == 16 and "PASS" in SG.verdict(ok) and "FAIL" not in SG.verdict(ok)
    for scale in (1.25, 1 / 1.3):
        off = SG.compare([g], [ours(scale)], expected_requests=8, output_tokens=16)
        assert not off["passed"] and off["within"] == dict(ttft_ms=False, itl_ms=False)
        assert off["ratios"]["ttft_ms_p50"] == pytest.approx(scale) and "FAIL" in SG.verdict(off)
    errored = dict(g, totals=dict(successful=7, errored=1, incomplete=0, total=8))
    bad = SG.compare([errored], [ours(1.0)], expected_requests=8, output_tokens=16)
    assert not bad["passed"] and bad["guidellm_errored"] == 1 and bad["within"] == dict(ttft_ms=True, itl_ms=True)
    assert not SG.compare([g], [ours(1.0, tokens=15)], expected_requests=8, output_tokens=16)["passed"]
    assert "| guidellm / ours |" in SG.table([g], [ours(1.0)], SG.compare([g], [ours(1.0)], 8, 16))


@pytest.mark.slow
def test_the_guidellm_comparison_runs_end_to_end(tmp_path):
    """The script itself, one short round: guidellm and our driver on one server, every request of both complete
    with its tokens and none errored (the 20% verdict is the recorded run's: milliseconds on a shared CPU)."""
    _guidellm()
    out = tmp_path / "cmp.json"
    assert SG.main(["--requests", "6", "--rounds", "1", "--rate", "4", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    result = data["result"]
    assert result["guidellm_errored"] == 0 and result["all_requests_complete"] and result["all_output_lengths"]
    assert len(data["guidellm_rounds"]) == len(data["our_rounds"]) == 1
    assert data["our_rounds"][0]["output_tokens"] == [16] * 6


def test_rates_and_sweep_together_are_refused(capsys):
    """--rates replaces --sweep's multiples: given both, --sweep was dropped without a word."""
    with pytest.raises(SystemExit) as stop:
        S.parse_args(["--quick", "--rates", "1,2", "--sweep", "0.5,1"])
    assert stop.value.code == 2 and "--rates" in capsys.readouterr().err
    assert S.parse_args(["--quick", "--rates", "1,2"]).rate_list == [1.0, 2.0]
