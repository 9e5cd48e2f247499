"""Serving throughput and latency on one device: the continuous-batching `sk.Engine` in SwiftKV and teacher wiring of
the same weights, the static `sk.generate` on the same requests (our own upper bound) and transformers' continuous
batching (the same-device peer), in one run, against the roofline of the workload (in-process, like vLLM's
benchmark_serving.py without the HTTP server; ArcticInference's workload on the 8b preset).

    python benchmarks/serving.py [--preset cpu|8b|quick] [--part all|offline|sweep|peer] [--configs A,B,...]
                                 [--num-requests N] [--sweep 0.5,0.7,0.85,0.95 | --rates 1,2] [--sweep-requests N]
                                 [--deadline S] [--out benchmarks/results/serving_<platform>.json] [--plot PATH.png]
    python benchmarks/serving.py --preset 8b --part offline --out OUT.json   # one GPU pack call (`pack.py run
                                                                             # --steps serving --serving-parts offline`)
    python benchmarks/serving.py --smoke --out /tmp/serving_smoke.json       # a tiny model, seconds: the script runs
    python benchmarks/serving.py --http [--smoke]   # also through `infer.py serve`: the HTTP overhead (serving_http.py)

Model: one random Llama made SwiftKV with l = L/2, g = 1; fp32 on a CPU (`--preset cpu`, the default there: 12 layers,
hidden 768, 12 heads of 64, 4 KV heads, MLP 2048, vocab 8192, ~94M parameters; 24 requests), or Llama-3.1-8B's shape
in bf16 (`--preset 8b`, the default on a GPU: `bench.random_model("llama-3.1-8b")`; 1000 requests).
Workload: random token ids; prompt lengths uniform in [1 - r, 1 + r] x `--prompt-len`, outputs likewise around
`--output-len` (r = `--range-ratio`: 0 on 8b, i.e. every prompt 2000 tokens and every output 250, as ArcticInference's
benchmark; 0.5 on cpu); greedy, `stop_token_ids=[]`, `max_tokens` = the output length, so every request generates
exactly its output length. Every run takes the first n of one list of requests (`--seed`).

Configurations (`--configs`), on the same weights:
- teacher, swiftkv-tokens, swiftkv-fp8, swiftkv-cost: `sk.Engine` in teacher wiring, SwiftKV wiring with the step budget
  in tokens, SwiftKV (tokens) over an FP8 pool (`cache_dtype=float8_e4m3fn`, per-token-head scales; left out of the cpu
  preset, where XLA's CPU float8 conversions make it 3.2x slower than bf16, 24 requests at rate inf in
  benchmarks/results/serving_fp8_cpu.json: GPU-only there, though --configs can name it), and SwiftKV with the budget in
  compute cost (a SwiftKV prompt token costs about l/L, so a step packs about twice as many). swiftkv-pages: SwiftKV
  (tokens) with every token read from the pages by the ragged Pallas kernel, prompt chunks included (the GPU default
  reads a fresh chunk's own K/V by cuDNN); left out on a CPU, where the kernel runs in interpret mode.
  swiftkv-penalised: swiftkv-tokens with every request at repetition_penalty 1.05 (Qwen2.5-Instruct's
  generation_config.json default, which the server applies to every request), so every step takes the penalties'
  branch (the counts gathered over the vocabulary; `ragged_step.sample_penalised`): its cost beside swiftkv-tokens in
  one run; left out of the cpu preset's default (--configs names it). Engine settings
  are passed explicitly (`--max-num-seqs`, `--max-num-batched-tokens`, the buckets, `--page-size`); the pool is
  `--kv-cache-fraction` (0.9: 90% of the memory free beside the weights, on 8b) or, where the device reports no memory
  (a CPU), `--num-pages` (default: max-num-seqs requests of the longest length). Each configuration's programs are
  compiled by `warmup()` before its first timed run (seconds reported); every timed run counts the XLA compilations it
  made (expected 0, flagged otherwise).
- static-teacher, static-swiftkv: `sk.generate` on the same requests in batches (sorted by length, each padded to its
  longest prompt and run for its longest output; only full batches, at most `--static-batches`) of as many sequences
  as the engine's pool holds at the longest length (at most max-num-seqs); each batch runs once, the first one's
  compile (JAX's tracing, lowering and compile events) subtracted from its time. Its tokens/s is the upper bound the
  engine is compared with (the same wiring).
- transformers: transformers' continuous batching (`generate_batch`'s manager, attention "paged|sdpa", the KV cache at
  90% of the free memory) on the teacher wiring of the same weights, the first `--peer-requests` requests at t = 0:
  the same-device peer, labelled so. It runs first, in processes of its own (`serving_peer.py`: a JAX one writes the
  weights as a Llama checkpoint, a torch one runs transformers), before this one touches the accelerator, within
  `--peer-timeout`. Recorded as skipped, with the reason, where that transformers has no `generate_batch` or torch
  cannot reach the GPU.

Phases: rate inf (every request at t = 0: offline throughput) for every configuration, `--run-timeout` at most a run;
then the Poisson sweep for `--sweep-configs` (engines): rates at `--sweep` multiples of each configuration's own
measured rate-inf requests/s (or the absolute `--rates`), ascending, `--sweep-requests` a run and at most
`--sweep-timeout` seconds (fewer requests where they would not arrive within 3/4 of it); a configuration's sweep stops
at its first rate not sustained. Every SwiftKV engine also runs at the teacher's highest sustained rate (the teacher is
swept first; its lowest rate if it sustains none), for the latency comparison. Arrivals: one draw of unit-exponential
gaps, scaled by 1/rate. No run starts after `--deadline` (seconds from the start), nor an engine's first run where its
compile would not fit before it, and every run is cut at it; a cut-off run reports what it measured (`cut_off`: the
prompt tokens of the requests that got a first token, and every generated token, over the time it ran).

Driver, one thread: add the requests whose arrival time has come, `engine.step()`, stamp each new token with the wall
time the step returned; when the engine is idle, sleep until the next arrival. TTFT = first token - scheduled arrival;
TPOT = (last - first token) / (n - 1); ITL = the gaps between one request's consecutive tokens (pooled). Per run:
requests/s, output and total tokens/s (over the duration from t = 0 to the last token), TTFT/TPOT/ITL p50/p90/p99 and
mean, preemptions, peak pages in use. A finite rate is *sustained* when the run was not cut off, it completes
requests at >= 95% of the rate they arrived ((n - 1) / (last - first finish) against (n - 1) / (last - first
arrival)), and its TTFT p50 is at most `--ttft-factor` (4) x the configuration's TTFT p50 at its lowest rate.

Roofline, per configuration and run (printed with its inputs): seconds = prefill FLOPs / R + max(decode FLOPs / R,
decode bytes / BW) over the run's requests. Prefill FLOPs of a prompt of p tokens = 2 c P p + 2 A N H p^2 (P the
matmul parameters of the L layers, c the prompt-token cost of `scheduler.prompt_token_cost`: 1 in teacher wiring,
l layers + the owners' K/V projections in SwiftKV's; A the layers whose attention the prompt runs: L, or l);
decode FLOPs of a token at context t = 2 (P + lm_head) + 4 L N H t; decode bytes = W / B + t x (KV bytes a token):
the weights W (layers + lm_head) read once per step, shared by the B sequences of a step (max-num-seqs, or what the
pool holds at the workload's mean length; the static batch), and every cached K/V read. R is a `--matmul-size`^3
matmul in the model's dtype timed on the device, BW the memory bandwidth of `benchmarks/kernels.py`. A configuration's
share = its total tokens/s / its roofline's.

Targets (a miss prints FAIL; the exit status stays 0). 8b: teacher >= 19k total tokens/s at rate inf and >= 70% of its
roofline; SwiftKV >= 1.35x the teacher at rate inf; SwiftKV TPOT p50 <= the teacher's at the teacher's highest
sustained rate; the engine >= 0.9x the static engine (same wiring); >= 5x transformers; the FP8 pool >= the bf16 one.
cpu: at the teacher's highest sustained rate SwiftKV's TTFT p50 <= 0.6x and TPOT p50 <= 1.0x the teacher's; at rate
inf its throughput >= 1.5x. `--part` (8b): one GPU pack call's share of the configurations (offline: teacher,
swiftkv-tokens and both static, 1000 requests; sweep: teacher and swiftkv-tokens, 256 requests at rate inf, then the
sweep; peer: transformers, teacher, swiftkv-tokens, swiftkv-fp8, swiftkv-cost on 192 requests), each under a
deadline of 500 s; `all` (the default) is everything in one run (about 25 minutes on an H100).

The JSON (rewritten after every run, so a run cut short keeps what it measured) has per run: config, rate,
total_tokens_per_s, output_tokens_per_s, requests_per_s, ttft_ms / tpot_ms {p50, p99}, roofline_total_tokens_per_s,
roofline_share, sustained, the ratios, and more (rate: requests/s, or "inf"); plus the device's measured rates,
the engine settings, the targets and a Markdown table. A PNG (`--plot`, default beside the JSON): TTFT and TPOT p50
against the rate, and each configuration's rate-inf throughput against its roofline.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_file import DefaultsFormatter, write_results

SCRIPT = "benchmarks/serving.py"
PEER_SCRIPT = Path(__file__).resolve().with_name("serving_peer.py")
PRESETS = {
    # ~94M parameters, fp32, on 2 CPU cores: the whole run ~10 min (the engine does ~300-500 tokens/s there,
    # transformers' continuous batching ~140); the FP8 pool is left out (see CPU_LEFT_OUT), only the teacher is
    # swept (SwiftKV runs at its highest sustained rate: the cpu targets)
    "cpu": dict(layers=12, hidden=768, vocab=8192, head_dim=64, dtype="float32", prompt_len=384, output_len=38,
                range_ratio=0.5, num_requests=24, sweep="0.6,0.9", sweep_requests=24, sweep_configs="teacher",
                max_num_seqs=64,
                max_num_batched_tokens=512, single_buckets="8,32", mixed_single_buckets="8", prompt_buckets="256,512",
                kv_cache_fraction=None, matmul_size=1024, copy_gib=0.125, static_batches=None,
                static_chunk_tokens=8192, run_timeout=300.0, sweep_timeout=200.0, peer_timeout=400.0),
    # Llama-3.1-8B's shape (SwiftKV l = 16, g = 1), bf16, for one GPU, with ArcticInference's workload. Few buckets
    # (each engine program of the 32 layers compiles in ~15 s): decode-only steps pad to 256 rows, which costs no
    # time while a step reads the weights and the KV cache (memory-bound); prompt parts of 2048 or the budget.
    "8b": dict(layers=None, hidden=None, vocab=None, head_dim=None, dtype="bfloat16", prompt_len=2000,
               output_len=250, range_ratio=0.0, num_requests=1000, sweep="0.5,0.7,0.85,0.95", sweep_requests=128,
               sweep_configs="teacher,swiftkv-tokens",
               max_num_seqs=256, max_num_batched_tokens=8192, single_buckets="", mixed_single_buckets="",
               prompt_buckets="2048", kv_cache_fraction=0.9, matmul_size=8192, copy_gib=2.0, static_batches=2,
               static_chunk_tokens=16384, run_timeout=150.0, sweep_timeout=60.0, peer_timeout=260.0),
    # seconds: checks that the script runs
    "quick": dict(layers=2, hidden=64, vocab=256, head_dim=16, dtype="float32", prompt_len=48, output_len=6,
                  range_ratio=0.5, num_requests=8, sweep="0.5", sweep_requests=8,
                  sweep_configs="teacher,swiftkv-tokens", max_num_seqs=8,
                  max_num_batched_tokens=64, single_buckets="", mixed_single_buckets="", prompt_buckets="",
                  kv_cache_fraction=None, matmul_size=128, copy_gib=1 / 256, static_batches=None,
                  static_chunk_tokens=256, run_timeout=120.0, sweep_timeout=60.0, peer_timeout=240.0),
}
CONFIGS = {  # name -> kind, wiring, budget unit, KV cache dtype (None: the model's)
    "teacher": dict(kind="engine", swiftkv=False, budget_unit="tokens"),  # its prompt token costs 1 in either unit
    "swiftkv-tokens": dict(kind="engine", swiftkv=True, budget_unit="tokens"),
    "swiftkv-fp8": dict(kind="engine", swiftkv=True, budget_unit="tokens", cache_dtype="float8_e4m3fn"),
    "swiftkv-cost": dict(kind="engine", swiftkv=True, budget_unit="cost"),
    # every token from the pages by the ragged Pallas kernel, prompts included (the default reads fresh chunks' own
    # K/V by cuDNN): the GPU run decides which is the default
    "swiftkv-pages": dict(kind="engine", swiftkv=True, budget_unit="tokens", attention_impl="pallas",
                          decode_attention_impl="pallas"),
    # every request penalised (Qwen2.5-Instruct's default repetition_penalty): the cost of the penalties' branch
    "swiftkv-penalised": dict(kind="engine", swiftkv=True, budget_unit="tokens",
                              sampling=dict(repetition_penalty=1.05)),
    "static-teacher": dict(kind="static", swiftkv=False),
    "static-swiftkv": dict(kind="static", swiftkv=True),
    "transformers": dict(kind="peer", swiftkv=False),
}
PEER_LABEL = "transformers continuous batching (same {device} peer)"
# --part: one GPU pack call's configurations; on 8b the sweep and peer parts run 256 requests at rate inf
PARTS = {"all": ",".join(CONFIGS), "offline": "teacher,swiftkv-tokens,static-teacher,static-swiftkv",
         "sweep": "teacher,swiftkv-tokens",
         "peer": "transformers,teacher,swiftkv-tokens,swiftkv-fp8,swiftkv-cost,swiftkv-pages"}
PART_8B = {"offline": dict(sweep=""), "sweep": dict(num_requests=256), "peer": dict(num_requests=192, sweep="")}
PART_DEADLINE_8B = 500.0
# On a CPU the FP8 pool is a GPU configuration: XLA's CPU backend converts float8 element by element (the cpu preset's
# rate-inf run takes 3.5x the bf16 pool's time, its compile 46 s); --configs can still name it (the quick preset
# runs it)
# swiftkv-pages: the Pallas kernel runs in interpret mode on a CPU; swiftkv-penalised: a question for the GPU's
# vocabulary and step times (benchmarks/results/serving_penalised_cpu.json has it beside swiftkv-tokens on the CPU)
CPU_LEFT_OUT = ("swiftkv-fp8", "swiftkv-pages", "swiftkv-penalised")
SUSTAIN_COMPLETION = 0.95  # completion rate / realised arrival rate, at least
GPU_TARGETS = {"teacher_total_tokens_per_s": 19000.0, "teacher_roofline_share": 0.70, "swiftkv_vs_teacher": 1.35,
               "swiftkv_tpot_vs_teacher": 1.0, "engine_vs_static": 0.9, "engine_vs_transformers": 5.0,
               "fp8_vs_bf16": 1.0}
CPU_TARGETS = {"ttft_p50": 0.6, "tpot_p50": 1.0, "throughput": 1.5}
PENALISED_VS_PLAIN = 0.95  # ours: penalties on every request cost at most 5% of the throughput (any preset)
INF = math.inf


def _floats(text: str) -> list:
    values = []
    for item in text.split(","):
        if not item.strip():
            continue
        value = float(item)  # "inf" parses
        if not value > 0:
            raise ValueError(f"a rate must be > 0 (or inf), got {item!r}")
        values.append(value)
    return sorted(set(values))


def _ints(text: str) -> list:
    return [int(x) for x in text.split(",") if x.strip()]


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:.3g}"


def format_ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def _stats(values) -> dict:
    import numpy as np

    values = [v for v in values if v is not None]
    if not values:
        return dict(p50=None, p90=None, p99=None, mean=None)
    p50, p90, p99 = (float(x) for x in np.percentile(values, [50, 90, 99]))
    return dict(p50=p50, p90=p90, p99=p99, mean=float(np.mean(values)))


def _kv_heads(heads: int) -> int:
    """The largest divisor of `heads` that is at most heads // 3 (12 heads -> 4 KV heads)."""
    return max(d for d in range(1, heads + 1) if heads % d == 0 and d <= max(1, heads // 3))


class CompileCounter:
    """Counts XLA compilations (every jitted program and eager op compiled), through jax.monitoring; `overhead`
    also sums the tracing and lowering before them (seconds a first call spends before it runs)."""

    EVENT = "/jax/core/compile/backend_compile_duration"
    BEFORE = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")

    def __init__(self):
        import jax

        self.count, self.seconds, self.overhead, self.names = 0, 0.0, 0.0, []
        jax.monitoring.register_event_duration_secs_listener(self)

    def __call__(self, event, duration, **kwargs):
        if event == self.EVENT:
            self.count += 1
            self.seconds += duration
            self.names.append(str(kwargs.get("fun_name", "?")))
        if event == self.EVENT or event in self.BEFORE:
            self.overhead += duration

    def snapshot(self):
        return self.count, self.seconds, len(self.names), self.overhead

    def since(self, snap) -> dict:
        return dict(compilations=self.count - snap[0], compile_s=self.seconds - snap[1],
                    compiled=sorted(set(self.names[snap[2]:])))


# ---- model, workload, device ----------------------------------------------------------------------------------------

def resolved_args(values: dict) -> argparse.Namespace:
    """The arguments of a run (`vars(args)` after the preset's defaults), e.g. as serving_peer.py receives them."""
    return argparse.Namespace(**values)


def build_model(args):
    """The benchmark's weights (stacked layers): the same for the same arguments on the same platform."""
    import swiftkv_jax as sk

    if args.preset == "8b":
        from swiftkv_jax.serving import bench

        return bench.random_model("llama-3.1-8b", dtype=args.dtype, seed=args.seed)
    heads = args.hidden // args.head_dim
    config = sk.ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                            intermediate_size=64 * max(1, round(8 / 3 * args.hidden / 64)),
                            num_hidden_layers=args.layers, num_attention_heads=heads,
                            num_key_value_heads=_kv_heads(heads), head_dim=args.head_dim,
                            param_dtype=args.dtype, dtype=args.dtype)
    return sk.to_swiftkv(sk.init(config, args.seed), args.layers // 2, 1)


def weights_digest(params) -> int:
    """A checksum of the weights' bits (integer sums, so exact in any order of summation)."""
    import jax
    import jax.numpy as jnp

    def bits(x):
        wide = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
        return jnp.sum(jax.lax.bitcast_convert_type(x, wide).astype(jnp.uint32), dtype=jnp.uint32)

    total = 0
    for leaf in jax.tree.leaves(params):
        total = (total + int(jax.jit(bits)(leaf))) % 2**32
    return total


def make_workload(args) -> dict:
    """The requests (token ids, lengths) and unit-rate Poisson gaps; every run takes a prefix."""
    import numpy as np

    n = max(args.num_requests, args.sweep_requests or 0, args.peer_requests or 0)
    rng = np.random.default_rng(args.seed)
    r = args.range_ratio
    draw = lambda mean: rng.integers(max(1, round((1 - r) * mean)), max(1, round((1 + r) * mean)) + 1, n)
    prompt_lens, output_lens = draw(args.prompt_len), draw(args.output_len)
    if args.preset == "8b":
        from swiftkv_jax.serving.bench import preset_config

        vocab = preset_config("llama-3.1-8b").vocab_size
    else:
        vocab = args.vocab
    prompts = [rng.integers(0, vocab, int(k)).tolist() for k in prompt_lens]
    unit_gaps = np.concatenate([[0.0], np.cumsum(rng.exponential(1.0, n - 1))])  # Poisson at rate 1
    return dict(prompts=prompts, prompt_lens=prompt_lens, output_lens=output_lens, unit_gaps=unit_gaps)


def engine_settings(args, cfg, name: str, pool: dict, max_model_len: int) -> dict:
    """`sk.Engine`'s settings for configuration `name` (CONFIGS) from the command line: the buckets grow to
    max-num-seqs and to the engine's largest prompt part."""
    from swiftkv_jax.serving.scheduler import prompt_token_cost

    c = CONFIGS[name]
    cost = prompt_token_cost(cfg, c["swiftkv"]) if c["budget_unit"] == "cost" else 1.0
    most = int(args.max_num_batched_tokens / cost + 1e-9)  # the engine's largest prompt part
    grow = lambda text, top: tuple(sorted({b for b in _ints(text) if b < top} | {top}))
    return dict(swiftkv=c["swiftkv"], budget_unit=c["budget_unit"], page_size=args.page_size, **pool,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=max_model_len, max_prompt_seqs=args.max_prompt_seqs,
                cache_dtype=c.get("cache_dtype", args.dtype),
                attention_impl=c.get("attention_impl", args.attention_impl),
                decode_attention_impl=c.get("decode_attention_impl", args.decode_attention_impl),
                single_buckets=grow(args.single_buckets, args.max_num_seqs),
                mixed_single_buckets=grow(args.mixed_single_buckets, args.max_num_seqs),
                prompt_buckets=grow(args.prompt_buckets, most))


def measure_device(args) -> dict:
    """The matmul rate (a `--matmul-size`^3 matmul in the model's dtype) and the memory bandwidth, on the device."""
    import jax
    import jax.numpy as jnp

    from kernels import memory_bandwidth, timed

    n = args.matmul_size
    a, b = (jax.random.normal(jax.random.key(i), (n, n), args.dtype) for i in (1, 2))
    seconds, _ = timed(jnp.matmul, a, b, repeats=10)
    copy = memory_bandwidth(args.copy_gib, args.dtype, repeats=10)
    return dict(matmul=dict(size=n, dtype=args.dtype, time_s=seconds, flops_per_s=2 * n**3 / seconds), copy=copy)


def platform_of_a_fresh_process() -> str:
    """JAX's default backend, asked of a child process: this one must not take the accelerator before the peer ran."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    out = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], capture_output=True,
                         text=True, env=env, timeout=300)
    if out.returncode:
        raise RuntimeError(f"could not ask JAX for its backend:\n{out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


# ---- roofline -------------------------------------------------------------------------------------------------------

def roofline(cfg, *, swiftkv: bool, prompt_lens, output_lens, kv_bytes_per_token: float, batch: int,
             flops_per_s: float, bytes_per_s: float) -> dict:
    """The workload's best time on this device (see the module docstring) and its tokens/s."""
    import jax.numpy as jnp
    import numpy as np

    from swiftkv_jax.serving.scheduler import prompt_token_cost

    d, n, k, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    layers = cfg.num_hidden_layers * (d * (2 * n * h + 2 * k * h) + 3 * d * cfg.intermediate_size)
    head = d * cfg.vocab_size
    weight_bytes = (layers + head) * jnp.dtype(cfg.param_dtype).itemsize
    cost = prompt_token_cost(cfg, swiftkv)
    attention_layers = cfg.num_lower_layers if swiftkv else cfg.num_hidden_layers
    p, o = np.asarray(prompt_lens, np.float64), np.asarray(output_lens, np.float64)
    prefill_flops = float(np.sum(2 * cost * layers * p + 2 * attention_layers * n * h * p**2))
    context = float(np.sum(o * p + o * (o + 1) / 2))  # summed over every generated token
    decode_flops = 2 * (layers + head) * float(o.sum()) + 4 * cfg.num_hidden_layers * n * h * context
    decode_bytes = weight_bytes * float(o.sum()) / batch + kv_bytes_per_token * context
    prefill_s = prefill_flops / flops_per_s
    decode_s = max(decode_flops / flops_per_s, decode_bytes / bytes_per_s)
    seconds = prefill_s + decode_s
    return dict(total_tokens_per_s=float(p.sum() + o.sum()) / seconds, output_tokens_per_s=float(o.sum()) / seconds,
                requests_per_s=len(p) / seconds, prefill_s=prefill_s, decode_s=decode_s,
                decode_bound="compute" if decode_flops / flops_per_s > decode_bytes / bytes_per_s else "memory",
                prefill_flops=prefill_flops, decode_flops=decode_flops, decode_bytes=decode_bytes,
                matmul_params=layers, head_params=head, weight_bytes=weight_bytes, prompt_token_cost=cost,
                attention_layers=attention_layers, kv_bytes_per_token=kv_bytes_per_token, batch=batch)


# ---- runs -----------------------------------------------------------------------------------------------------------

def serve(engine, prompts, output_lens, arrivals, compiles: CompileCounter, time_limit=None,
          sampling: "dict | None" = None) -> dict:
    """Drive `engine` through one workload (arrivals in seconds from t = 0, sorted): per-request token times. Stops
    at `time_limit` seconds (cut_off) if given."""
    import jax

    n = len(arrivals)
    times = [[] for _ in range(n)]
    added = [None] * n
    engine_metrics = [None] * n
    finish_reasons = [None] * n
    peak_pages, following, done, idle_steps, cut_off = 0, 0, 0, 0, False
    compiled_before = compiles.snapshot()
    start = time.perf_counter()
    while done < n:
        now = time.perf_counter() - start
        if time_limit is not None and now > time_limit:
            cut_off = True
            break
        while following < n and arrivals[following] <= now:
            engine.add_request(prompts[following], request_id=str(following), max_tokens=int(output_lens[following]),
                               temperature=0.0, stop_token_ids=[], **(sampling or {}))
            added[following] = time.perf_counter() - start
            following += 1
        if not engine.has_unfinished():
            if following == n:
                raise RuntimeError(f"the engine has nothing left to run but finished {done} of {n} requests")
            time.sleep(max(0.0, min(arrivals[following] - (time.perf_counter() - start),
                                    math.inf if time_limit is None else time_limit - now)))
            continue
        outputs = engine.step()
        stamp = time.perf_counter() - start
        stats = engine.stats()
        peak_pages = max(peak_pages, stats["pages_total"] - stats["pages_free"])
        idle_steps = 0 if outputs else idle_steps + 1
        if idle_steps > 100_000:
            raise RuntimeError(f"the engine made no progress in {idle_steps} steps: {engine.stats()}")
        for out in outputs:
            i = int(out.request_id)
            if out.new_token_ids:
                times[i].extend([stamp] * len(out.new_token_ids))
            if out.finished:
                done += 1
                engine_metrics[i], finish_reasons[i] = out.metrics, out.finish_reason
    elapsed = time.perf_counter() - start
    jax.block_until_ready(jax.live_arrays())  # a step still in flight ends before the next run's pool is sized
    return dict(times=times, added=added, engine_metrics=engine_metrics, finish_reasons=finish_reasons,
                peak_pages=peak_pages, cut_off=cut_off, elapsed_s=elapsed, **compiles.since(compiled_before),
                stats=engine.stats())


def _rounded(values, digits=5) -> list:
    return [None if v is None else round(float(v), digits) for v in values]


def summarise(rate, arrivals, prompt_lens, output_lens, served) -> dict:
    """One run's figures, and per-request columns (no token times). A cut-off run counts the prompts of the requests
    that got a first token and every token generated, over the time it ran."""
    import numpy as np

    times, n = served["times"], len(arrivals)
    cut_off = bool(served.get("cut_off"))
    added = served.get("added") or [None] * n
    metrics = served.get("engine_metrics") or [None] * n
    ttft, tpot, e2e, lag, queue, itl, finishes = [], [], [], [], [], [], []
    for i in range(n):
        t = times[i]
        ttft.append(t[0] - arrivals[i] if t else None)
        tpot.append((t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None)
        finished = bool(t) and len(t) >= int(output_lens[i])
        e2e.append(t[-1] - arrivals[i] if finished else None)
        if finished:
            finishes.append(t[-1])
        lag.append(None if added[i] is None else added[i] - arrivals[i])
        m = metrics[i] or {}
        queue.append(lag[i] + m["queue_s"] if "queue_s" in m and lag[i] is not None else None)
        itl.extend(np.diff(t).tolist())
    finishes.sort()
    served_prompts = [int(prompt_lens[i]) for i in range(n) if times[i]]
    generated = sum(len(t) for t in times)
    duration = served["elapsed_s"] if cut_off else max(max(finishes, default=0.0), 1e-9)
    arrived = [a for a in arrivals if a <= duration]
    span = float(arrived[-1] - arrived[0]) if arrived else 0.0
    ms = lambda s: {q: None if s[q] is None else s[q] * 1e3 for q in ("p50", "p99")}
    stats = served["stats"]
    run = dict(
        rate=rate, num_requests=n, cut_off=cut_off, finished=len(finishes), duration_s=duration,
        requests_per_s=len(finishes) / duration, output_tokens_per_s=generated / duration,
        total_tokens_per_s=(sum(served_prompts) + generated) / duration,
        completion_rate=((len(finishes) - 1) / (finishes[-1] - finishes[0])
                         if len(finishes) > 1 and finishes[-1] > finishes[0] else None),
        arrival_rate=(len(arrived) - 1) / span if len(arrived) > 1 and span > 0 else None,  # None: all at once
        ttft_s=_stats(ttft), tpot_s=_stats(tpot), itl_s=_stats(itl), e2e_s=_stats(e2e), queue_s=_stats(queue),
        add_lag_s=_stats(lag), generated_tokens=generated, prompt_tokens=sum(served_prompts),
        all_generated=not cut_off and all(len(times[i]) == int(output_lens[i]) for i in range(n)),
        per_request=dict(prompt_tokens=[int(x) for x in prompt_lens], output_tokens=[len(t) for t in times],
                         ttft_s=_rounded(ttft), tpot_s=_rounded(tpot), e2e_s=_rounded(e2e)))
    run["ttft_ms"], run["tpot_ms"] = ms(run["ttft_s"]), ms(run["tpot_s"])
    if stats:
        run.update(preemptions=stats.get("preemptions"), pages_total=stats.get("pages_total"),
                   peak_pages=served.get("peak_pages"), steps=stats.get("steps"), busy_s=stats.get("busy_s"))
        if stats.get("pages_total"):
            run["peak_page_usage"] = served["peak_pages"] / stats["pages_total"]
    for key in ("compilations", "compile_s", "compiled"):
        if key in served:
            run[key] = served[key]
    return run


def static_run(model, workload, n, *, swiftkv: bool, batch: int, args, attention_impl, time_left, compiles,
               estimate_tokens_per_s=None) -> dict:
    """`sk.generate` over the first n requests in batches (see the module docstring): the static engine's tokens/s.
    Each batch runs once; the first one's compile (JAX's tracing, lowering and XLA compile events) is subtracted."""
    import swiftkv_jax as sk

    p, o = workload["prompt_lens"][:n], workload["output_lens"][:n]
    order = sorted(range(n), key=lambda i: (int(p[i]), int(o[i])))
    batch = min(batch, n)
    batches = [order[i:i + batch] for i in range(0, n - batch + 1, batch)][:args.static_batches or None]
    chunk = max(16, 1 << max(0, (args.static_chunk_tokens // batch).bit_length() - 1))
    chunk = None if chunk >= int(p.max()) else chunk
    info = dict(batch=batch, prefill_chunk=chunk, attention_impl=attention_impl)
    batch_tokens = int(sum(p[i] + o[i] for i in batches[0]))
    if estimate_tokens_per_s and time_left() < 2 * batch_tokens / estimate_tokens_per_s + 30:
        return dict(status="not run", reason=f"too little time left for a batch (~"
                                             f"{batch_tokens / estimate_tokens_per_s:.0f} s) and its compile", **info)
    seconds, compile_s = [], []
    for rows in batches:
        if seconds and time_left() < 1.2 * max(seconds):
            break
        before = compiles.overhead
        start = time.perf_counter()
        out = sk.generate(model, [workload["prompts"][i] for i in rows], int(max(o[i] for i in rows)),
                          stop_token_ids=[], swiftkv=swiftkv, cache_dtype=args.dtype, prefill_chunk=chunk,
                          attention_impl=attention_impl, decode_attention_impl=args.decode_attention_impl)
        wall = time.perf_counter() - start
        assert all(len(t) >= o[i] for t, i in zip(out.tokens, rows)), "a static row stopped short"
        compile_s.append(compiles.overhead - before)
        seconds.append(wall - compile_s[-1])
    rows = [i for b in batches[:len(seconds)] for i in b]
    prompt_tokens, output_tokens, total_s = int(sum(p[i] for i in rows)), int(sum(o[i] for i in rows)), sum(seconds)
    padded = sum(len(b) * (int(max(p[i] for i in b)) + int(max(o[i] for i in b))) for b in batches[:len(seconds)])
    return dict(status="ok", rate=INF, num_requests=len(rows), cut_off=False, duration_s=total_s,
                requests_per_s=len(rows) / total_s, output_tokens_per_s=output_tokens / total_s,
                total_tokens_per_s=(prompt_tokens + output_tokens) / total_s, prompt_tokens=prompt_tokens,
                generated_tokens=output_tokens, batches=len(seconds), batch_s=seconds, compile_s_subtracted=compile_s,
                padding_overhead=padded / (prompt_tokens + output_tokens) - 1, ttft_ms=dict(p50=None, p99=None),
                tpot_ms=dict(p50=None, p99=None), **info)


def peer_run(args, workload, n: int, limit_s: float, cpu_num_pages: int) -> dict:
    """The transformers peer (serving_peer.py: the weights written by a JAX process, then transformers in a torch
    one), summarised like an engine run."""
    start = time.perf_counter()
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryDirectory(prefix="serving_peer_") as tmp:
        spec, weights, out = Path(tmp) / "spec.json", Path(tmp) / "weights", Path(tmp) / "out.json"
        weights.mkdir()
        results = {}
        for mode in ("weights", "run"):
            left = limit_s - (time.perf_counter() - start)
            spec.write_text(json.dumps(dict(
                args=vars(args), num_requests=n, memory_fraction=args.kv_cache_fraction or 0.9,
                cpu_num_pages=cpu_num_pages, time_limit_s=args.run_timeout, total_limit_s=left,
                platform=results.get("weights", {}).get("platform"))))
            try:
                code = subprocess.run([sys.executable, str(PEER_SCRIPT), mode, str(spec), str(weights), str(out)],
                                      env=env, timeout=max(1.0, left)).returncode
            except subprocess.TimeoutExpired:
                code = "killed at the time limit"
            results[mode] = result = json.loads(out.read_text()) if out.exists() else {}
            out.unlink(missing_ok=True)
            if result.get("status") != "ok":
                break
    weights_step = results["weights"]
    wall = time.perf_counter() - start
    if not result:
        return dict(status="failed", reason=f"serving_peer.py {mode} wrote nothing (exit {code})", wall_s=wall)
    info = {k: result[k] for k in ("versions", "device", "settings", "resolved", "attention", "attention_in_use",
                                   "startup_s", "errors") if k in result}
    info["weights_digest"] = weights_step.get("weights_digest")
    if result["status"] != "ok":
        return dict(status=result["status"], reason=f"{mode}: {result.get('reason')}", wall_s=wall, **info)
    served = dict(times=result["times"], cut_off=result["cut_off"], elapsed_s=result["elapsed_s"], stats={})
    run = summarise(INF, [0.0] * n, workload["prompt_lens"][:n], workload["output_lens"][:n], served)
    label = PEER_LABEL.format(device="GPU" if result["device"] == "cuda" else "CPU")
    return dict(status="ok", label=label, wall_s=wall, weights_s=weights_step.get("seconds"), **run, **info)


# ---- judging --------------------------------------------------------------------------------------------------------

def ok(run) -> bool:
    return bool(run) and run.get("status") == "ok"


def judge(run: dict, base_ttft_p50: float, factor: float) -> bool:
    """Sustained (see the module docstring): a finite rate kept up with, TTFT bounded, not cut off."""
    if math.isinf(run["rate"]) or run["cut_off"]:
        return False
    keeps_up = (run["completion_rate"] is None or run["arrival_rate"] is None
                or run["completion_rate"] >= SUSTAIN_COMPLETION * run["arrival_rate"])
    return bool(keeps_up and run["ttft_s"]["p50"] is not None and run["ttft_s"]["p50"] <= factor * base_ttft_p50)


def highest_sustained(runs: dict, name: str):
    rates = [rate for (n, rate), run in runs.items() if n == name and ok(run) and run.get("sustained")]
    return max(rates) if rates else None


def static_of(name: str) -> str:
    return "static-swiftkv" if CONFIGS[name]["swiftkv"] else "static-teacher"


def add_ratios(runs: dict) -> None:
    """Each run's ratios: at rate inf its total tokens/s against the teacher's, the static engine's of its wiring and
    transformers'; at a finite rate its TTFT and TPOT p50 against the teacher's at the same rate."""
    for (name, rate), run in runs.items():
        if not ok(run):
            continue
        ratios = {}
        if math.isinf(rate):
            for key, other in (("vs_teacher", "teacher"), ("vs_static", static_of(name)),
                               ("vs_transformers", "transformers")):
                peer = runs.get((other, INF))
                if other != name and ok(peer) and peer["total_tokens_per_s"]:
                    ratios[key] = run["total_tokens_per_s"] / peer["total_tokens_per_s"]
                    if peer["num_requests"] != run["num_requests"]:
                        ratios[key + "_note"] = f"{run['num_requests']} requests against {peer['num_requests']}"
        elif name != "teacher" and ok(runs.get(("teacher", rate))):
            teacher = runs[("teacher", rate)]
            for key in ("ttft", "tpot"):
                mine, theirs = run[f"{key}_s"]["p50"], teacher[f"{key}_s"]["p50"]
                if mine is not None and theirs:
                    ratios[f"{key}_p50_vs_teacher"] = mine / theirs
        run["ratios"] = ratios


def targets(runs: dict, preset: str) -> list:
    """The issue's targets (8b) or the CPU preset's, each with its value and verdict (None: not measured)."""
    at = lambda name, rate=INF: runs.get((name, rate)) if ok(runs.get((name, rate))) else None
    swiftkv = [n for n in ("swiftkv-tokens", "swiftkv-cost", "swiftkv-fp8") if at(n)]
    rows = []

    def row(name, value, op, target, note=""):
        verdict = None if value is None else (value >= target if op == ">=" else value <= target)
        rows.append(dict(target=name, value=value, op=op, goal=target, passed=verdict, note=note))

    teacher_max = highest_sustained(runs, "teacher")
    if preset == "8b":
        t = at("teacher")
        row("teacher total tokens/s at rate inf", t and t["total_tokens_per_s"], ">=",
            GPU_TARGETS["teacher_total_tokens_per_s"])
        row("teacher share of its roofline", t and t.get("roofline_share"), ">=", GPU_TARGETS["teacher_roofline_share"])
        for n in swiftkv:
            row(f"{n} / teacher, total tokens/s at rate inf", at(n)["ratios"].get("vs_teacher"), ">=",
                GPU_TARGETS["swiftkv_vs_teacher"])
            s = at(n, teacher_max) if teacher_max else None
            row(f"{n} / teacher, TPOT p50 at the teacher's highest sustained rate",
                s and s["ratios"].get("tpot_p50_vs_teacher"), "<=", GPU_TARGETS["swiftkv_tpot_vs_teacher"],
                "" if teacher_max else "the teacher sustained no rate (or was not swept)")
        for n in ["teacher"] + swiftkv:
            row(f"{n} / {static_of(n)}", at(n) and at(n)["ratios"].get("vs_static"), ">=",
                GPU_TARGETS["engine_vs_static"])
        for n in ["teacher"] + swiftkv:
            row(f"{n} / transformers", at(n) and at(n)["ratios"].get("vs_transformers"), ">=",
                GPU_TARGETS["engine_vs_transformers"])
        fp8, bf16 = at("swiftkv-fp8"), at("swiftkv-tokens")
        row("swiftkv-fp8 / swiftkv-tokens (bf16 pool), total tokens/s", fp8 and bf16 and
            fp8["total_tokens_per_s"] / bf16["total_tokens_per_s"], ">=", GPU_TARGETS["fp8_vs_bf16"])
    elif preset == "cpu":
        rates = sorted(r for (n, r), run in runs.items() if n == "teacher" and ok(run) and not math.isinf(r))
        compare_at = teacher_max or (rates[0] if rates else None)
        note = "at the teacher's highest sustained rate" if teacher_max else "at the teacher's lowest rate"
        for n in ("swiftkv-tokens", "swiftkv-cost"):
            s = at(n, compare_at) if compare_at else None
            row(f"{n} / teacher, TTFT p50 ({note})", s and s["ratios"].get("ttft_p50_vs_teacher"), "<=",
                CPU_TARGETS["ttft_p50"])
            row(f"{n} / teacher, TPOT p50 ({note})", s and s["ratios"].get("tpot_p50_vs_teacher"), "<=",
                CPU_TARGETS["tpot_p50"])
            row(f"{n} / teacher, throughput at rate inf", at(n) and at(n)["ratios"].get("vs_teacher"), ">=",
                CPU_TARGETS["throughput"])
    penalised, plain = at("swiftkv-penalised"), at("swiftkv-tokens")
    if penalised and plain:  # named by --configs: what a repetition penalty on every request costs
        row("swiftkv-penalised / swiftkv-tokens, total tokens/s at rate inf",
            penalised["total_tokens_per_s"] / plain["total_tokens_per_s"], ">=", PENALISED_VS_PLAIN,
            "every request at repetition_penalty 1.05")
    return rows


# ---- reporting ------------------------------------------------------------------------------------------------------

def _ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def table(runs: dict, order: list) -> str:
    """Markdown: a row per run, rate inf first."""
    lines = ["| config | rate req/s | requests | total tok/s | output tok/s | req/s | TTFT ms p50 / p99 | "
             "TPOT ms p50 / p99 | of roofline | vs teacher | vs static | vs transformers | sustained |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    ms = lambda value: "-" if value is None else f"{value:.0f}"
    keys = sorted(runs, key=lambda k: (not math.isinf(k[1]), order.index(k[0]), k[1]))
    for name, rate in keys:
        run = runs[(name, rate)]
        label = run.get("label", name) if name == "transformers" else name
        if not ok(run):
            lines.append(f"| {label} | {rate_label(rate)} | {run.get('status')}: {run.get('reason', '')} |"
                         + " |" * 10)
            continue
        r = run.get("ratios", {})
        vs_teacher = (_ratio(r.get("vs_teacher")) if math.isinf(rate) else
                      f"TTFT {_ratio(r.get('ttft_p50_vs_teacher'))}, TPOT {_ratio(r.get('tpot_p50_vs_teacher'))}"
                      if "tpot_p50_vs_teacher" in r or "ttft_p50_vs_teacher" in r else "-")
        share = run.get("roofline_share")
        cut = " (cut off)" if run.get("cut_off") else ""
        lines.append(
            f"| {label} | {rate_label(rate)}{cut} | {run['num_requests']} | {run['total_tokens_per_s']:,.0f} | "
            f"{run['output_tokens_per_s']:,.0f} | {run['requests_per_s']:.3f} | "
            f"{ms(run['ttft_ms']['p50'])} / {ms(run['ttft_ms']['p99'])} | "
            f"{ms(run['tpot_ms']['p50'])} / {ms(run['tpot_ms']['p99'])} | "
            f"{'-' if share is None or not math.isinf(rate) else f'{share:.0%}'} | {vs_teacher} | "
            f"{_ratio(r.get('vs_static'))} | {_ratio(r.get('vs_transformers'))} | "
            f"{'-' if math.isinf(rate) else 'yes' if run.get('sustained') else 'no'} |")
    return "\n".join(lines)


def roofline_header(device: dict, rooflines: dict) -> str:
    """The roofline's formula and inputs, and each configuration's roofline at rate inf."""
    m, c = device["matmul"], device["copy"]
    any_roof = next(iter(rooflines.values()), None)
    lines = [f"roofline: seconds = prefill FLOPs / R + max(decode FLOPs / R, decode bytes / BW); R = "
             f"{m['flops_per_s'] / 1e12:.3g} TFLOP/s ({m['dtype']} {m['size']}^3 matmul, measured), BW = "
             f"{c['bandwidth'] / 1e9:.4g} GB/s (the better of a copy and a read of {c['bytes'] / 2**30:.3g} GiB, "
             "measured)"]
    if any_roof:
        lines.append(f"  prefill FLOPs = 2 c P p + 2 A N H p^2 a prompt; decode FLOPs = 2 (P + head) + 4 L N H t a "
                     f"token; decode bytes = W / B + t KV; P = {any_roof['matmul_params'] / 1e9:.4g}B matmul "
                     f"params, head {any_roof['head_params'] / 1e6:.4g}M, W = {any_roof['weight_bytes'] / 1e9:.4g} GB")
    lines.append("| config | c (prompt-token cost) | A (prompt attention layers) | KV bytes / token | B (sequences "
                 "a step) | roofline total tok/s | decode bound |")
    lines.append("|---|---:|---:|---:|---:|---:|:---:|")
    for name, r in rooflines.items():
        lines.append(f"| {name} | {r['prompt_token_cost']:.3f} | {r['attention_layers']} | "
                     f"{r['kv_bytes_per_token']:,.0f} | {r['batch']} | {r['total_tokens_per_s']:,.0f} | "
                     f"{r['decode_bound']} |")
    return "\n".join(lines)


def targets_text(rows: list) -> str:
    lines = []
    for t in rows:
        verdict = ("not measured" if t["value"] is None else "not judged" if t["passed"] is None else
                   "PASS" if t["passed"] else "FAIL")
        value = "-" if t["value"] is None else f"{t['value']:,.3f}" if t["value"] < 100 else f"{t['value']:,.0f}"
        lines.append(f"- {t['target']}: {value} ({t['op']} {t['goal']:g}): {verdict}"
                     + (f" ({t['note']})" if t["note"] else ""))
    return "\n".join(lines)


def plot(path: Path, runs: dict, order: list, title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not any(ok(run) for run in runs.values()):
        print("no run finished: no plot")
        return False
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.2))
    for name in order:
        finite = sorted((rate, run) for (n, rate), run in runs.items() if n == name and ok(run)
                        and not math.isinf(rate))
        if finite:
            xs = [rate for rate, _ in finite]
            left.plot(xs, [run["ttft_s"]["p50"] for _, run in finite], marker="o", label=name)
            middle.plot(xs, [(run["tpot_s"]["p50"] or math.nan) * 1e3 for _, run in finite], marker="o", label=name)
    for ax, label in ((left, "TTFT p50 (s)"), (middle, "TPOT p50 (ms)")):
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    left.set_yscale("log")
    middle.set_ylim(bottom=0)
    if left.get_legend_handles_labels()[0]:
        left.legend(fontsize=8)
    offline = [(name, runs[(name, INF)]) for name in order if ok(runs.get((name, INF)))]
    xs = range(len(offline))
    right.bar(xs, [run["total_tokens_per_s"] for _, run in offline], label="measured")
    right.scatter(xs, [run.get("roofline_total_tokens_per_s") or math.nan for _, run in offline], color="k",
                  marker="_", s=400, label="roofline")
    right.set_xticks(list(xs), [name for name, _ in offline], rotation=30, ha="right", fontsize=8)
    right.set_ylabel("total tokens/s, rate inf")
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return True


# ---- the command ----------------------------------------------------------------------------------------------------

def _shown(value) -> str:
    return "none" if value == "" else f"{value:g}" if isinstance(value, float) else str(value)


def preset_default(key: str, prefix_presets: dict = None) -> str:
    """--help's 'default: the preset's (cpu: 64, 8b: 256, quick: 8)' of a preset-filled option, built from PRESETS,
    PART_8B and shared-prefix's presets (serving_prefix.PRESETS) as parse_args applies them (a None is left out)."""
    text = "default: the preset's (" + ", ".join(f"{name}: {_shown(preset[key])}" for name, preset in PRESETS.items()
                                                 if preset.get(key) is not None)
    parts = [f"{part}: {_shown(values[key])}" for part, values in PART_8B.items() if key in values]
    if parts:
        text += "; 8b with --part " + ", ".join(parts)
    shared = [f"{name}: {_shown(preset[key])}" for name, preset in (prefix_presets or {}).items() if key in preset]
    if shared:
        text += "; --workload shared-prefix " + ", ".join(shared)
    return text + ")"


def parse_args(argv=None) -> argparse.Namespace:
    import serving_prefix  # it imports this module's helpers

    said = lambda key: preset_default(key, serving_prefix.PRESETS)  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsFormatter)
    parser.add_argument("--preset", choices=("auto",) + tuple(PRESETS), default="auto",
                        help="model and workload defaults: cpu ~94M parameters fp32 on 2 CPU cores, 8b Llama-3.1-8B's "
                             "shape bf16 for one GPU, quick a tiny model; default: auto, 8b on a GPU, cpu otherwise")
    parser.add_argument("--quick", "--smoke", action="store_true", help="the quick preset: a tiny model, seconds")
    parser.add_argument("--part", choices=tuple(PARTS), default="all",
                        help="which configurations (see the docstring): one GPU pack call's share, or all of them; "
                             + "; ".join(f"{part}: {configs}" for part, configs in PARTS.items() if part != "all")
                             + f" (the cpu preset leaves out {', '.join(CPU_LEFT_OUT)})")
    parser.add_argument("--configs", help=f"comma-separated, a subset of {', '.join(CONFIGS)} (default: the part's)")
    parser.add_argument("--layers", type=int, help="model shape, cpu / quick presets (8b has its own); "
                                                   + said("layers"))
    parser.add_argument("--hidden", type=int, help="hidden size; heads of --head-dim, KV heads about heads / 3; "
                                                   + said("hidden"))
    parser.add_argument("--vocab", type=int, help="vocabulary, cpu / quick presets; " + said("vocab"))
    parser.add_argument("--head-dim", type=int, help="head size, cpu / quick presets; " + said("head_dim"))
    parser.add_argument("--dtype", help="parameter, compute and KV cache dtype; " + said("dtype"))
    parser.add_argument("--num-requests", type=int, help="requests at rate inf; " + said("num_requests"))
    parser.add_argument("--prompt-len", type=int, help="mean prompt length; " + said("prompt_len"))
    parser.add_argument("--output-len", type=int, help="mean output length; " + said("output_len"))
    parser.add_argument("--range-ratio", type=float, help="lengths uniform in [1 - r, 1 + r] x the mean; "
                                                          + said("range_ratio"))
    parser.add_argument("--sweep", help="Poisson rates as multiples of each configuration's rate-inf requests/s "
                                        "('' for none); " + said("sweep"))
    parser.add_argument("--rates", help="absolute Poisson rates, requests/s (instead of --sweep's multiples)")
    parser.add_argument("--sweep-configs",
                        help="engine configurations swept, of --configs; every other SwiftKV engine runs at the "
                             "teacher's highest sustained rate; " + said("sweep_configs"))
    parser.add_argument("--sweep-requests", type=int, help="requests a sweep run, at most; " + said("sweep_requests"))
    parser.add_argument("--peer-requests", type=int, help="requests the transformers peer runs (default: "
                                                          "--num-requests)")
    parser.add_argument("--seed", type=int, default=0, help="weights, lengths, prompts and arrivals")
    parser.add_argument("--max-num-seqs", type=int, help="sequences a step, at most; " + said("max_num_seqs"))
    parser.add_argument("--max-num-batched-tokens", type=int,
                        help="a step's token budget; " + said("max_num_batched_tokens"))
    parser.add_argument("--max-prompt-seqs", type=int, default=8, help="prompts packed in one step, at most")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page")
    parser.add_argument("--kv-cache-fraction", type=float,
                        help="each engine's pool off a CPU: this fraction of the memory free beside the weights; "
                             + said("kv_cache_fraction") + "; else --num-pages")
    parser.add_argument("--num-pages", type=int,
                        help="each engine's pool in pages, where no fraction is given (default: max-num-seqs "
                             "requests of the longest length + the null page)")
    parser.add_argument("--single-buckets", help="decode-only step sizes (max-num-seqs is always added); "
                                                 + said("single_buckets"))
    parser.add_argument("--mixed-single-buckets", help="decode rows of steps with prompt tokens (max-num-seqs "
                                                       "added); " + said("mixed_single_buckets"))
    parser.add_argument("--prompt-buckets", help="prompt-token step sizes (each engine's largest prompt part added); "
                                                 + said("prompt_buckets"))
    parser.add_argument("--attention-impl", help="prompt attention (default: the engine's; static: the model's, cudnn "
                                                 "on a GPU in bf16 / fp16); swiftkv-pages always runs pallas")
    parser.add_argument("--decode-attention-impl", help="the engine's and static's few-query attention, xla, pallas "
                                                        "or mosaic (default: the engine's); swiftkv-pages always runs "
                                                        "pallas")
    parser.add_argument("--static-batches", type=int, help="full static batches timed, at most; "
                                                           + said("static_batches") + "; else all")
    parser.add_argument("--static-chunk-tokens", type=int, help="static prefill: batch x chunk at most this; "
                                                                + said("static_chunk_tokens"))
    parser.add_argument("--matmul-size", type=int, help="the roofline's matmul rate: an N^3 matmul; "
                                                        + said("matmul_size"))
    parser.add_argument("--copy-gib", type=float, help="the roofline's memory bandwidth: GiB of its probes; "
                                                       + said("copy_gib"))
    parser.add_argument("--ttft-factor", type=float, default=4.0,
                        help="sustained: TTFT p50 at most this x the config's TTFT p50 at its lowest rate")
    parser.add_argument("--run-timeout", type=float, help="seconds a rate-inf run (and the peer's) may take; "
                                                          + said("run_timeout"))
    parser.add_argument("--sweep-timeout", type=float, help="seconds a sweep run may take; " + said("sweep_timeout"))
    parser.add_argument("--peer-timeout", type=float, help="seconds the peer's process may take, start-up included; "
                                                           + said("peer_timeout"))
    parser.add_argument("--deadline", type=float,
                        help=f"seconds from the start: no run starts after it, every run is cut at it (default: "
                             f"{PART_DEADLINE_8B:g} on the 8b preset with a --part other than all or with --workload "
                             f"shared-prefix; else none)")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/serving_<platform>.json)")
    parser.add_argument("--plot", help="PNG path (default: the JSON's, .png); 'none' for no plot")
    parser.add_argument("--http", action="store_true",
                        help="also run the engines' workloads through `infer.py serve` and report the HTTP overhead")
    serving_prefix.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.rates and args.sweep:  # --rates replaces the multiples: both given, --sweep was dropped without a word
        parser.error("--rates (absolute rates) and --sweep (multiples of rate inf) are two ways to give the sweep's "
                     "rates: give one")
    args.platform = None
    if args.quick:
        args.preset = "quick"
    elif args.preset == "auto":
        args.platform = platform_of_a_fresh_process()
        args.preset = "8b" if args.platform == "gpu" else "cpu"
    preset = dict(PRESETS[args.preset])
    if args.preset == "8b":
        if any(getattr(args, k) is not None for k in ("layers", "hidden", "vocab", "head_dim")):
            parser.error("--layers/--hidden/--vocab/--head-dim apply to the cpu and quick presets; 8b has its own "
                         "shape")
        preset.update(PART_8B.get(args.part, {}))
        if args.part != "all" or args.workload == "shared-prefix":
            preset["deadline"] = PART_DEADLINE_8B
    if args.workload == "shared-prefix":
        preset.update(serving_prefix.PRESETS[args.preset])
    preset.setdefault("deadline", None)
    preset["configs"] = ",".join(c for c in PARTS[args.part].split(",")
                                 if not (args.preset == "cpu" and c in CPU_LEFT_OUT))
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.peer_requests = args.peer_requests or args.num_requests
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown or not configs:
        parser.error(f"unknown --configs {unknown}: choose from {', '.join(CONFIGS)}")
    args.configs = ",".join(configs)
    try:
        args.rate_list = _floats(args.rates) if args.rates else None
        args.multiples = _floats(args.sweep) if args.sweep else []
    except ValueError as error:
        parser.error(str(error))
    if any(math.isinf(r) for r in (args.rate_list or []) + args.multiples):
        parser.error("--rates/--sweep take finite rates: rate inf is always run")
    for name in ("num_requests", "prompt_len", "output_len", "max_num_seqs", "max_num_batched_tokens", "page_size",
                 "peer_requests"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.range_ratio < 1:
        parser.error("--range-ratio must lie in [0, 1)")
    if args.preset != "8b" and args.hidden % args.head_dim:
        parser.error(f"--hidden {args.hidden} must be a multiple of --head-dim {args.head_dim}")
    if args.workload == "shared-prefix":
        serving_prefix.check_arguments(parser, args)
    return args


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    if args.workload == "shared-prefix":
        import serving_prefix

        return serving_prefix.run_prefix_workloads(args, argv)
    configs = args.configs.split(",")
    order = [name for name in CONFIGS if name in configs]
    engines = [n for n in order if CONFIGS[n]["kind"] == "engine"]
    swept = [n for n in order if n in args.sweep_configs.split(",") and n in engines and (args.multiples
                                                                                          or args.rate_list)]
    workload = make_workload(args)
    p_all, o_all = workload["prompt_lens"], workload["output_lens"]
    longest = int(max(p + o for p, o in zip(p_all, o_all)))
    max_model_len = -(-longest // args.page_size) * args.page_size
    cpu_num_pages = args.num_pages or 1 + args.max_num_seqs * (max_model_len // args.page_size)
    left = lambda: math.inf if args.deadline is None else args.deadline - (time.perf_counter() - t_start)
    runs, info = {}, dict(warmup={}, engine={}, rooflines={})
    out_path = [Path(args.out) if args.out else None]

    def record(extra=None) -> None:
        add_ratios(runs)
        payload = {
            "preset": args.preset, "part": args.part, "args": vars(args), "configs": order, "complete": False,
            "workload": dict(num_requests=args.num_requests, prompt_len=args.prompt_len, output_len=args.output_len,
                             range_ratio=args.range_ratio, prompt_lens=p_all[:args.num_requests].tolist(),
                             output_lens=o_all[:args.num_requests].tolist(),
                             unit_arrivals_s=workload["unit_gaps"].round(4).tolist()),
            "sustained_definition": (f"finite rate, not cut off; completion rate >= {SUSTAIN_COMPLETION} x realised "
                                     f"arrival rate; TTFT p50 <= {args.ttft_factor} x the config's TTFT p50 at its "
                                     f"lowest rate"),
            **info, "highest_sustained_rate": {n: highest_sustained(runs, n) for n in swept},
            "targets": (rows := targets(runs, args.preset)), "targets_text": targets_text(rows),
            "table": table(runs, order),
            "runs": [{**run, "config": name, "rate": rate if math.isfinite(rate) else "inf"}
                     for (name, rate), run in runs.items()],
            **(extra or {})}
        write_results(out_path[0], SCRIPT, argv, payload)

    # ---- 1. the peer, in a process of its own, before this one takes the accelerator
    if "transformers" in configs:
        if out_path[0] is None:
            args.platform = args.platform or platform_of_a_fresh_process()
            out_path[0] = Path(f"benchmarks/results/serving_{args.platform}.json")
        limit = min(args.peer_timeout, left())
        print(f"transformers peer: {args.peer_requests} requests (limit {limit:.0f} s, start-up included)",
              flush=True)
        run = peer_run(args, workload, args.peer_requests, limit, cpu_num_pages)
        runs[("transformers", INF)] = run
        print(f"transformers peer: {run['status']}" + (f" ({run.get('reason')})" if run.get("reason") else
              f", {run['total_tokens_per_s']:,.0f} total tok/s, {run['requests_per_s']:.3f} req/s"
              + (" (cut off)" if run["cut_off"] else "")), flush=True)
        record()

    # ---- 2. the model, the device's rates, the engines' settings
    import jax
    import numpy as np

    import swiftkv_jax as sk
    from swiftkv_jax.model.cached import unstack_layers
    from swiftkv_jax.serving.paged_cache import page_bytes, pages_for_budget
    from swiftkv_jax.serving.scheduler import prompt_token_cost

    platform = jax.default_backend()
    if args.platform and args.platform != platform:
        raise RuntimeError(f"the platform changed: {args.platform} in a fresh process, {platform} here")
    out_path[0] = out_path[0] or Path(f"benchmarks/results/serving_{platform}.json")
    plot_path = None if args.plot == "none" else Path(args.plot or out_path[0].with_suffix(".png"))
    model = build_model(args)
    info["weights_digest"] = weights_digest(model.params)
    http_dir = None
    if args.http:  # the same weights, saved once (stacked) for `infer.py serve`
        import serving_http

        http_dir = tempfile.TemporaryDirectory(prefix="serving_http_")
        http_model = serving_http.save_for_http(model, Path(http_dir.name))
    cfg = model.config
    model = sk.Model(cfg, jax.block_until_ready(jax.jit(unstack_layers, static_argnums=1)(model.params, cfg)))
    gc.collect()
    n_params = int(sum(x.size for x in jax.tree.leaves(model.params)))
    device = jax.devices()[0]
    info["device"] = dict(kind=device.device_kind, platform=platform, **measure_device(args))
    peer = runs.get(("transformers", INF))
    if ok(peer) and peer.get("weights_digest") != info["weights_digest"]:
        peer["weights_note"] = "NOT the same weights: the digests differ"
    pool = ({"kv_cache_fraction": args.kv_cache_fraction} if args.kv_cache_fraction is not None and platform != "cpu"
            else {"num_pages": cpu_num_pages})
    gpu_bf16 = platform == "gpu" and args.dtype in ("bfloat16", "float16")
    static_attention = args.attention_impl or ("cudnn" if gpu_bf16 else None)

    def settings(name) -> dict:
        return engine_settings(args, cfg, name, pool, max_model_len)

    mean_len = float(np.mean(p_all + o_all))

    def pool_of(swiftkv, cache_dtype) -> dict:
        pages = pages_for_budget(cfg, swiftkv, args.page_size, cache_dtype, **pool)
        per_page = page_bytes(cfg, swiftkv, args.page_size, cache_dtype)
        return dict(pages=pages, tokens=(pages - 1) * args.page_size, kv_bytes_per_token=per_page / args.page_size,
                    page_bytes=per_page, sequences=(pages - 1) * args.page_size // max_model_len)

    def roof_inputs(name) -> dict:
        c = CONFIGS[name]
        p = pool_of(c["swiftkv"], c.get("cache_dtype", args.dtype))
        if c["kind"] == "static":
            batch = min(args.max_num_seqs, max(1, p["sequences"]), args.num_requests)
        else:  # an engine (the peer: the teacher's): the sequences a step decodes
            batch = max(1, min(args.max_num_seqs, int(p["tokens"] // mean_len), args.num_requests))
        return dict(swiftkv=c["swiftkv"], kv_bytes_per_token=p["kv_bytes_per_token"], batch=batch, pool=p)

    inputs = {name: roof_inputs(name) for name in order}
    rates_measured = info["device"]

    def add_roofline(name, run) -> None:
        if not ok(run):
            return
        i = inputs[name]
        n = run["num_requests"]
        if CONFIGS[name]["kind"] == "static":
            rows = sorted(range(args.num_requests), key=lambda j: (int(p_all[j]), int(o_all[j])))[:n]
            p, o = p_all[rows], o_all[rows]
        else:
            p, o = p_all[:n], o_all[:n]
        r = roofline(cfg, swiftkv=i["swiftkv"], prompt_lens=p, output_lens=o,
                     kv_bytes_per_token=i["kv_bytes_per_token"], batch=min(run.get("batch") or i["batch"], n),
                     flops_per_s=rates_measured["matmul"]["flops_per_s"],
                     bytes_per_s=rates_measured["copy"]["bandwidth"])
        run["roofline"] = r
        run["roofline_total_tokens_per_s"] = r["total_tokens_per_s"]
        run["roofline_share"] = run["total_tokens_per_s"] / r["total_tokens_per_s"]

    for name in order:
        if CONFIGS[name]["kind"] == "engine":
            cost = prompt_token_cost(cfg, CONFIGS[name]["swiftkv"]) if CONFIGS[name]["budget_unit"] == "cost" else 1.0
            info["engine"][name] = {**settings(name), "prompt_token_cost": cost,
                                    "sampling": CONFIGS[name].get("sampling", {})}
        i = inputs[name]
        info["rooflines"][name] = roofline(cfg, swiftkv=i["swiftkv"], prompt_lens=p_all[:args.num_requests],
                                           output_lens=o_all[:args.num_requests],
                                           kv_bytes_per_token=i["kv_bytes_per_token"], batch=i["batch"],
                                           flops_per_s=rates_measured["matmul"]["flops_per_s"],
                                           bytes_per_s=rates_measured["copy"]["bandwidth"])
        info["rooflines"][name]["pool"] = i["pool"]
    if ok(peer):
        add_roofline("transformers", peer)
    count = f"{n_params / 1e9:.2f}B" if n_params >= 1e9 else f"{n_params / 1e6:.{0 if n_params >= 1e7 else 2}f}M"
    title = (f"{args.preset} ({args.part}): {count} params {cfg.param_dtype}, L={cfg.num_hidden_layers} "
             f"l={cfg.num_key_value_layers}, {args.num_requests} requests of {args.prompt_len} + {args.output_len} "
             f"tokens (range {args.range_ratio:g}), max_num_seqs {args.max_num_seqs}, budget "
             f"{args.max_num_batched_tokens}, on {device.device_kind}")
    info["title"] = title
    print(title)
    print(f"pool: {', '.join(f'{k} {v}' for k, v in pool.items())}, max_model_len {max_model_len}; prompts "
          f"{p_all.min()}-{p_all.max()}, outputs {o_all.min()}-{o_all.max()}")
    print(roofline_header(info["device"], info["rooflines"]), flush=True)
    record()

    compiles = CompileCounter()
    warmed = set()

    def guarded(fn, *a, **kw) -> dict:
        """fn's run, or a failed one with the error (an out-of-memory, say): the other configurations still run."""
        try:
            return fn(*a, **kw)
        except Exception as e:  # noqa: BLE001 - recorded in the run and printed, never hidden
            import traceback

            traceback.print_exc()
            gc.collect()
            return dict(status="failed", reason=f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}")

    def engine_run(name, rate, n, cap) -> dict:
        engine = sk.Engine(model, **settings(name))
        if name not in warmed:
            seconds = engine.warmup()
            warmed.add(name)
            s = settings(name)
            stats = engine.stats()
            pool_bytes = stats["pages_total"] * inputs[name]["pool"]["page_bytes"]
            info["warmup"][name] = dict(seconds=seconds, programs=stats["compiled_buckets"],
                                        single_buckets=list(s["single_buckets"]),
                                        mixed_single_buckets=list(s["mixed_single_buckets"]),
                                        prompt_buckets=list(s["prompt_buckets"]),
                                        pool_mib=pool_bytes / 2**20, pool_pages=stats["pages_total"])
            print(f"warm-up {name}: {stats['compiled_buckets']} programs in {seconds:.1f} s; pool "
                  f"{stats['pages_total']} pages, {pool_bytes / 2**30:.2f} GiB", flush=True)
        arrivals = (np.zeros(n) if math.isinf(rate) else workload["unit_gaps"][:n] / rate).tolist()
        served = serve(engine, workload["prompts"][:n], o_all[:n], arrivals, compiles,
                       time_limit=min(cap, left()) if math.isfinite(min(cap, left())) else None,
                       sampling=CONFIGS[name].get("sampling"))
        del engine
        gc.collect()
        run = dict(status="ok", **summarise(rate, arrivals, p_all[:n], o_all[:n], served))
        add_roofline(name, run)
        note = "" if run["compilations"] == 0 else (f", {run['compilations']} COMPILATIONS WHILE TIMED "
                                                    f"({run['compile_s']:.2f} s: {', '.join(run['compiled'])})")
        note += " (CUT OFF)" if run["cut_off"] else "" if run["all_generated"] else ", SOME REQUESTS STOPPED SHORT"
        print(f"{name:<15} rate {rate_label(rate):>6}  {n} requests  {run['duration_s']:7.1f} s  "
              f"{run['total_tokens_per_s']:9,.0f} total tok/s  {run['requests_per_s']:.3f} req/s  "
              f"TTFT p50 {format_ms(run['ttft_s']['p50'])} ms  TPOT p50 {format_ms(run['tpot_s']['p50'])} ms  "
              f"peak pages {run['peak_pages']}/{run['pages_total']}{note}", flush=True)
        return run

    def too_late(name, rate) -> bool:
        """No run starts within 5% of the deadline, nor a first run where its compile would not fit before it."""
        compile_s = 0 if name in warmed or CONFIGS[name]["kind"] != "engine" else max(
            [w["seconds"] for w in info["warmup"].values()], default=0)
        if left() < max(10.0, 0.05 * (args.deadline or 0)) + compile_s:
            runs[(name, rate)] = dict(status="not run", reason=f"past the deadline of {args.deadline:g} s"
                                      + (f" once compiled (~{compile_s:.0f} s)" if compile_s else ""))
            return True
        return False

    # ---- 3. rate inf: the engines, then the static engine
    for name in engines:
        if not too_late(name, INF):
            runs[(name, INF)] = guarded(engine_run, name, INF, args.num_requests, args.run_timeout)
            record()
    for name in (n for n in order if CONFIGS[n]["kind"] == "static"):
        if too_late(name, INF):
            continue
        same = runs.get(("swiftkv-tokens" if CONFIGS[name]["swiftkv"] else "teacher", INF))
        run = guarded(static_run, model, workload, args.num_requests, swiftkv=CONFIGS[name]["swiftkv"],
                      batch=inputs[name]["batch"], args=args, attention_impl=static_attention, time_left=left,
                      compiles=compiles, estimate_tokens_per_s=same["total_tokens_per_s"] if ok(same) else None)
        add_roofline(name, run)
        runs[(name, INF)] = run
        print(f"{name:<15} rate    inf  " + (f"{run['num_requests']} requests in {run['batches']} batches of "
              f"{run['batch']}  {run['duration_s']:7.1f} s  {run['total_tokens_per_s']:9,.0f} total tok/s "
              f"(compile {sum(run['compile_s_subtracted']):.1f} s subtracted)" if ok(run) else
              f"{run['status']}: {run['reason']}"), flush=True)
        gc.collect()
        record()

    # ---- 4. the Poisson sweep, the teacher first; every SwiftKV engine also at the teacher's highest sustained rate
    teacher_swept = "teacher" in swept
    for name in [n for n in engines if n in swept or (teacher_swept and CONFIGS[n]["swiftkv"])]:
        base = runs.get((name, INF))
        if not ok(base):
            continue
        rates = [] if name not in swept else list(args.rate_list or [m * base["requests_per_s"]
                                                                      for m in args.multiples])
        extra = None
        if name != "teacher" and teacher_swept:
            teacher_rates = sorted(r for (n, r), run in runs.items() if n == "teacher" and ok(run) and math.isfinite(r))
            extra = highest_sustained(runs, "teacher") or (teacher_rates[0] if teacher_rates else None)
            if extra is not None and extra not in rates:
                rates.append(extra)
        lowest_ttft, failed = None, False
        for rate in sorted(rates):
            if failed and rate != extra:
                runs[(name, rate)] = dict(status="not run", reason="a lower rate was not sustained", by_rule=True)
                continue
            if too_late(name, rate):
                continue
            n = args.sweep_requests
            if args.sweep_timeout:
                n = min(n, int(0.75 * args.sweep_timeout * rate))
            if n < 8:
                runs[(name, rate)] = dict(status="not run", reason=f"only {n} requests arrive in 3/4 of the "
                                                                   f"sweep's {args.sweep_timeout:g} s", by_rule=True)
                continue
            run = guarded(engine_run, name, rate, n, args.sweep_timeout or math.inf)
            runs[(name, rate)] = run
            if not ok(run):
                failed = True
                continue
            run["multiple_of_rate_inf"] = rate / base["requests_per_s"]
            run["teachers_highest_sustained_rate"] = rate == extra
            lowest_ttft = lowest_ttft if lowest_ttft is not None else run["ttft_s"]["p50"] or math.inf
            run["sustained"] = judge(run, lowest_ttft, args.ttft_factor)
            failed = failed or not run["sustained"]
            runs[(name, rate)] = run
            record()

    # ---- 5. the table, the targets, the plot, --http
    add_ratios(runs)
    http = {}
    if args.http:
        try:
            http = serving_http.run_http(http_model, runs, order, settings, workload, args)
        finally:
            http_dir.cleanup()
    rows = targets(runs, args.preset)
    print()
    print(table(runs, order))
    print()
    print(roofline_header(info["device"], info["rooflines"]))
    print(f"sustained: finite rate, not cut off, completion >= {SUSTAIN_COMPLETION} x arrivals, TTFT p50 <= "
          f"{args.ttft_factor:g} x the config's at its lowest rate; highest sustained: "
          + ", ".join(f"{n} {'none' if highest_sustained(runs, n) is None else rate_label(highest_sustained(runs, n))}"
                      for n in swept))
    if ok(peer):
        print(f"transformers: {peer['label']}, transformers {peer['versions']['transformers']}, torch "
              f"{peer['versions']['torch']}, attention {peer.get('attention_in_use')}"
              + (f"; {peer['weights_note']}" if peer.get("weights_note") else "; the same weights (digest)"))
    if rows:
        print("targets:")
        print(targets_text(rows))
    if args.preset == "quick":
        print("(quick: a tiny model, overheads dominate: the ratios are not meaningful here)")
    plotted = plot_path is not None and plot(plot_path, runs, order, title)
    # complete: every run ran, or the sweep's own rules left it out (by_rule), none failed or cut by the deadline
    record({"complete": all(ok(run) or run.get("by_rule") for run in runs.values()),
            "plot": str(plot_path) if plotted else None,
            "wall_s": time.perf_counter() - t_start, **http})
    return 0


if __name__ == "__main__":
    sys.exit(main())
