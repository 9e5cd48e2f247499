"""Serving under load: the continuous-batching `sk.Engine` in SwiftKV wiring against the teacher wiring of the same
weights, side by side in one run (in-process, like vLLM's benchmark_serving.py without the HTTP server).

    python benchmarks/serving.py [--preset cpu|8b] [--num-requests 64] [--rates 0.75,1.25,2,inf]
                                 [--prompt-len 384 --output-len 38] [--layers 12 --hidden 768 --vocab 8192]
                                 [--out benchmarks/results/serving_<platform>.json] [--plot PATH.png]
    python benchmarks/serving.py --quick --out /tmp/serving_quick.json     # tiny model, seconds: the script runs
    python benchmarks/serving.py --http [--smoke]   # also through `infer.py serve`: the HTTP overhead

Model: one random Llama made SwiftKV with l = L/2, g = 1 (`sk.to_swiftkv`), fp32 on a CPU (`--preset cpu`, the
default there: 12 layers, hidden 768, 12 heads of 64, 4 KV heads, MLP 2048, vocab 8192, ~94M parameters), or
Llama-3.1-8B's shape in bf16 (`--preset 8b`, the default on a GPU: prompts ~2000, outputs ~250 tokens).
Workload: `--num-requests` requests, the same at every rate and for every configuration: prompt lengths uniform in
[0.5, 1.5] x `--prompt-len`, output lengths in [0.5, 1.5] x `--output-len`, random token ids (`--seed`); greedy,
`stop_token_ids=[]` and `max_tokens` = the output length, so every request generates exactly its output length.
Arrivals: Poisson at each of `--rates` requests/s (one draw of unit-exponential gaps, scaled by 1/rate, so every
rate sees the same pattern; "inf": all at t = 0).

Configurations, each on a fresh engine per rate with the same settings (`--max-num-seqs`,
`--max-num-batched-tokens`, `--page-size`, the pool): swiftkv-tokens (SwiftKV wiring, step budget in tokens),
swiftkv-cost (SwiftKV wiring, budget in compute cost: a SwiftKV prompt token costs about l/L, so a step packs about
twice as many of them), and teacher (teacher wiring; its prompt tokens cost 1, so its "tokens" and "cost" budgets
are the same engine: it runs once). The pool holds `--max-num-seqs` requests of the longest length by default, so
nothing is preempted unless `--num-pages` is lowered. Rate by rate (lowest first), the configurations run in turn.
Before anything is timed, `warmup()` compiles every (single, prompt) bucket of each configuration (compile seconds
and bucket counts are reported); later engines reuse the compiled programs (the jit cache), and each run counts the
XLA compilations made while it was timed (expected 0, flagged otherwise).

Driver, one thread: add the requests whose arrival time has come, `engine.step()`, stamp each new token with the
wall time the step returned; when the engine is idle, sleep until the next arrival. TTFT = first token - scheduled
arrival (not the time `add_request` was called); TPOT = (last - first token) / (n - 1); ITL = the gaps between
one request's consecutive tokens (pooled). Per run: requests/s, output and total tokens/s (over the duration from
t = 0 to the last token), TTFT/TPOT/ITL p50/p90/p99 and mean, preemptions, peak pages in use (after each step).

A configuration *sustains* a finite rate when (a) it completes requests at >= 90% of the rate they arrived
(completion rate (n - 1) / (last - first finish) against the realised arrival rate (n - 1) / (last - first
arrival): unlike n / duration, neither is biased by the first request's TTFT or the last one's decode), and (b) its
TTFT p50 is at most `--ttft-factor` (4) x its TTFT p50 at the lowest rate (the queue does not grow). Summary, for
each SwiftKV configuration (targets for the CPU preset; a miss is printed as FAIL, the exit status stays 0):
- at the highest rate the teacher sustains: TTFT p50 swiftkv / teacher (<= 0.6) and TPOT p50 (<= 1.0);
- sustainable throughput: the highest requests/s achieved at any rate (rate inf, in practice), swiftkv /
  teacher (>= 1.5).
Also a PNG (`--plot`, default beside the JSON) of TTFT p50 and TPOT p50 against the rate, a line a configuration.
`--http`: after the in-process runs, the same weights (saved once to a temporary HF directory with a word-level
tokenizer of one word per token id) are served by `python infer.py serve` in a subprocess per configuration
(SwiftKV wiring with either budget unit, then `--teacher-mode`), with the same engine settings, warmed up before
anything is timed; one streaming client per request sends its token ids as the prompt (`ignore_eos`, greedy) at its
arrival time and stamps each streamed chunk (one token) as it arrives. The same figures are reported for these
runs, and the HTTP overhead against the in-process run of the same rate and configuration (throughput ratios,
added TTFT/TPOT/ITL milliseconds); the JSON gets an "http" entry. On a GPU, run it with
XLA_PYTHON_CLIENT_PREALLOCATE=false so the server process finds memory beside this one.

The JSON is rewritten after every run, so a run cut short (`--deadline`, 400 s for the 8b preset, or a kill)
keeps what it measured; runs after the deadline are recorded as not run.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

from results_file import write_results

SCRIPT = "benchmarks/serving.py"
PRESETS = {
    # ~94M parameters, fp32: the whole run ~15-20 min on 2 CPU cores. 64 sequences: a step's budget of 512 tokens
    # holds ~46 decodes at a prompt/output ratio of 10, more with the cost budget, so the batch slots seldom bind
    "cpu": dict(layers=12, hidden=768, vocab=8192, head_dim=64, dtype="float32", prompt_len=384, output_len=38,
                num_requests=64, rates="0.75,1.25,2,inf", max_num_seqs=64, max_num_batched_tokens=512,
                single_buckets="8,32", prompt_buckets="256,512", deadline=None),
    # Llama-3.1-8B's shape (SwiftKV l = 16, g = 1), bf16, for a GPU: sized for the GPU pack's 9-minute step
    # (few buckets: each compile of the 32 unrolled layers takes a while)
    "8b": dict(layers=None, hidden=None, vocab=None, head_dim=None, dtype="bfloat16", prompt_len=2000,
               output_len=250, num_requests=48, rates="1.5,3,6,inf", max_num_seqs=32, max_num_batched_tokens=2048,
               single_buckets="16", prompt_buckets="2048", deadline=400.0),
    # seconds: checks that the script runs
    "quick": dict(layers=2, hidden=64, vocab=256, head_dim=16, dtype="float32", prompt_len=48, output_len=6,
                  num_requests=8, rates="4,inf", max_num_seqs=8, max_num_batched_tokens=64, single_buckets="",
                  prompt_buckets="", deadline=None),
}
CONFIGS = {  # name -> (swiftkv wiring, budget unit)
    "swiftkv-tokens": (True, "tokens"),
    "swiftkv-cost": (True, "cost"),
    "teacher": (False, "tokens"),  # a teacher prompt token costs 1: "cost" would be the same engine
}
SUSTAIN_COMPLETION = 0.9  # completion rate / realised arrival rate, at least
TARGETS = {"ttft_p50": 0.6, "tpot_p50": 1.0, "throughput": 1.5}


def _rates(text: str) -> list:
    rates = []
    for item in text.split(","):
        rate = float(item)  # "inf" parses
        if not rate > 0:
            raise ValueError(f"a request rate must be > 0 (or inf), got {item!r}")
        rates.append(rate)
    return sorted(set(rates))


def _ints(text: str) -> list:
    return [int(x) for x in text.split(",") if x.strip()]


def _rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


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
    """Counts XLA compilations (every jitted program and eager op compiled), through jax.monitoring."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        import jax

        self.count, self.seconds, self.names = 0, 0.0, []
        jax.monitoring.register_event_duration_secs_listener(self)

    def __call__(self, event, duration, **kwargs):
        if event == self.EVENT:
            self.count += 1
            self.seconds += duration
            self.names.append(str(kwargs.get("fun_name", "?")))

    def snapshot(self):
        return self.count, self.seconds, len(self.names)

    def since(self, snap) -> dict:
        return dict(compilations=self.count - snap[0], compile_s=self.seconds - snap[1],
                    compiled=sorted(set(self.names[snap[2]:])))


def serve(engine, prompts, output_lens, arrivals, compiles: CompileCounter) -> dict:
    """Drive `engine` through one workload (arrivals in seconds from t = 0, sorted): per-request token times."""
    n = len(arrivals)
    times = [[] for _ in range(n)]
    added = [None] * n
    engine_metrics = [None] * n
    finish_reasons = [None] * n
    peak_pages, following, done, idle_steps = 0, 0, 0, 0
    compiled_before = compiles.snapshot()
    start = time.perf_counter()
    while done < n:
        now = time.perf_counter() - start
        while following < n and arrivals[following] <= now:
            engine.add_request(prompts[following], request_id=str(following), max_tokens=int(output_lens[following]),
                               temperature=0.0, stop_token_ids=[])
            added[following] = time.perf_counter() - start
            following += 1
        if not engine.has_unfinished():
            if following == n:
                raise RuntimeError(f"the engine has nothing left to run but finished {done} of {n} requests")
            time.sleep(max(0.0, arrivals[following] - (time.perf_counter() - start)))
            continue
        outputs = engine.step()
        stamp = time.perf_counter() - start
        peak_pages = max(peak_pages, engine.allocator.capacity - engine.allocator.num_free)
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
    return dict(times=times, added=added, engine_metrics=engine_metrics, finish_reasons=finish_reasons,
                peak_pages=peak_pages, **compiles.since(compiled_before),
                stats=engine.stats())


def summarise(rate, arrivals, prompt_lens, output_lens, served) -> dict:
    """One run's figures and its per-request rows (no token times)."""
    import numpy as np

    times, n = served["times"], len(arrivals)
    requests, itl = [], []
    for i in range(n):
        t = times[i]
        metrics = served["engine_metrics"][i] or {}
        lag = served["added"][i] - arrivals[i]
        requests.append(dict(
            id=i, prompt_tokens=int(prompt_lens[i]), output_tokens=len(t), max_tokens=int(output_lens[i]),
            arrival_s=float(arrivals[i]), add_lag_s=lag, ttft_s=t[0] - arrivals[i] if t else None,
            tpot_s=(t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None, e2e_s=t[-1] - arrivals[i] if t else None,
            queue_s=lag + metrics["queue_s"] if "queue_s" in metrics else None,
            preemptions=metrics.get("preemptions"), finish_reason=served["finish_reasons"][i]))
        itl.extend(np.diff(t).tolist())
    finishes = sorted(r["e2e_s"] + r["arrival_s"] for r in requests)
    duration = finishes[-1]
    generated = sum(r["output_tokens"] for r in requests)
    prompt_total = int(sum(prompt_lens))
    span = float(arrivals[-1] - arrivals[0])
    stats = served["stats"]
    return dict(
        rate=rate, num_requests=n, duration_s=duration, request_throughput=n / duration,
        output_token_throughput=generated / duration, total_token_throughput=(prompt_total + generated) / duration,
        completion_rate=(n - 1) / (finishes[-1] - finishes[0]) if n > 1 and finishes[-1] > finishes[0] else None,
        arrival_rate=(n - 1) / span if n > 1 and span > 0 else None,  # None: all at once
        ttft_s=_stats(r["ttft_s"] for r in requests), tpot_s=_stats(r["tpot_s"] for r in requests),
        itl_s=_stats(itl), e2e_s=_stats(r["e2e_s"] for r in requests), queue_s=_stats(r["queue_s"] for r in requests),
        add_lag_s=_stats(r["add_lag_s"] for r in requests),
        preemptions=stats["preemptions"], peak_pages=served["peak_pages"], pages_total=stats["pages_total"],
        peak_page_usage=served["peak_pages"] / stats["pages_total"], steps=stats["steps"], busy_s=stats["busy_s"],
        generated_tokens=generated, prompt_tokens=prompt_total,
        all_generated=all(r["output_tokens"] == r["max_tokens"] for r in requests),
        compilations=served["compilations"], compile_s=served["compile_s"], compiled=served["compiled"],
        requests=requests)


def mark_sustained(runs: dict, configs, rates, factor: float) -> None:
    """Set run["sustained"] (see the module docstring) for every finished run."""
    for name in configs:
        done = [runs[(rate, name)] for rate in rates if runs.get((rate, name), {}).get("status") == "ok"]
        if not done:
            continue
        base = done[0]["ttft_s"]["p50"]
        for run in done:
            if math.isinf(run["rate"]):
                run["sustained"] = False  # an infinite rate is never kept up with
                continue
            keeps_up = (run["completion_rate"] is None or run["arrival_rate"] is None
                        or run["completion_rate"] >= SUSTAIN_COMPLETION * run["arrival_rate"])
            run["sustained"] = bool(keeps_up and run["ttft_s"]["p50"] <= factor * base)


def compare(runs: dict, configs, rates) -> dict:
    """The summary ratios of each SwiftKV configuration against the teacher."""
    ok = lambda rate, name: runs.get((rate, name), {}).get("status") == "ok"
    out = {}
    if "teacher" not in configs:
        return out
    teacher_rates = [r for r in rates if ok(r, "teacher")]
    sustained = [r for r in teacher_rates if runs[(r, "teacher")].get("sustained")]
    at = sustained[-1] if sustained else (teacher_rates[0] if teacher_rates else None)
    out["teacher_max_sustained_rate"] = sustained[-1] if sustained else None
    out["compared_at_rate"] = None if at is None else _rate_label(at)
    out["compared_at_note"] = ("the highest rate the teacher sustains" if sustained else
                               "the teacher sustains none of the rates: compared at the lowest" if at is not None
                               else "no teacher run finished")
    best = lambda name: max((runs[(r, name)]["request_throughput"] for r in rates if ok(r, name)), default=None)
    for name in configs:
        if name == "teacher":
            continue
        row = {}
        if at is not None and ok(at, name):
            s, t = runs[(at, name)], runs[(at, "teacher")]
            row["ttft_p50"] = s["ttft_s"]["p50"] / t["ttft_s"]["p50"]
            if s["tpot_s"]["p50"] and t["tpot_s"]["p50"]:
                row["tpot_p50"] = s["tpot_s"]["p50"] / t["tpot_s"]["p50"]
        if best(name) and best("teacher"):
            row["throughput"] = best(name) / best("teacher")
            row["throughput_swiftkv"], row["throughput_teacher"] = best(name), best("teacher")
        sustained_here = [r for r in rates if ok(r, name) and runs[(r, name)].get("sustained")]
        row["max_sustained_rate"] = sustained_here[-1] if sustained_here else None
        row["pass"] = {k: bool(row[k] <= TARGETS[k] if k != "throughput" else row[k] >= TARGETS[k])
                       for k in TARGETS if k in row}
        out[name] = row
    return out


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def table(runs: dict, configs, rates) -> str:
    lines = ["| rate | config | req/s | out tok/s | total tok/s | TTFT ms p50 / p90 / p99 (mean) | "
             "TPOT ms p50 / p90 / p99 (mean) | ITL ms p50 / p90 / p99 (mean) | duration s | preempt | peak pages | "
             "sustained |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    fig = lambda s: f"{_ms(s['p50'])} / {_ms(s['p90'])} / {_ms(s['p99'])} ({_ms(s['mean'])})"
    for rate in rates:
        for name in configs:
            run = runs.get((rate, name))
            if run is None or run["status"] != "ok":
                lines.append(f"| {_rate_label(rate)} | {name} | not run |" + " |" * 9)
                continue
            lines.append(
                f"| {_rate_label(rate)} | {name} | {run['request_throughput']:.3f} | "
                f"{run['output_token_throughput']:.1f} | {run['total_token_throughput']:.1f} | {fig(run['ttft_s'])} | "
                f"{fig(run['tpot_s'])} | {fig(run['itl_s'])} | {run['duration_s']:.1f} | {run['preemptions']} | "
                f"{run['peak_pages']}/{run['pages_total']} | {'yes' if run.get('sustained') else 'no'} |")
    return "\n".join(lines)


def plot(path: Path, runs: dict, configs, rates, title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not any(run.get("status") == "ok" for run in runs.values()):
        print("no run finished: no plot")
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    positions = range(len(rates))
    for name in configs:
        xs, ttft, tpot = [], [], []
        for x, rate in zip(positions, rates):
            run = runs.get((rate, name))
            if run and run["status"] == "ok":
                xs.append(x)
                ttft.append(run["ttft_s"]["p50"])
                tpot.append((run["tpot_s"]["p50"] or math.nan) * 1e3)
        left.plot(xs, ttft, marker="o", label=name)
        right.plot(xs, tpot, marker="o", label=name)
    for ax, label in ((left, "TTFT p50 (s)"), (right, "TPOT p50 (ms)")):
        ax.set_xticks(list(positions), [_rate_label(r) for r in rates])
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    left.set_yscale("log")
    right.set_ylim(bottom=0)
    left.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return True


# ---- --http: the same workload through `infer.py serve` ------------------------------------------------------------
HTTP_CONFIG_FLAGS = {"swiftkv-tokens": [], "swiftkv-cost": [], "teacher": ["--teacher-mode"]}


def save_for_http(model, directory: Path) -> Path:
    """The benchmark's weights as an HF checkpoint that `infer.py serve` reads, with a word-level tokenizer that has
    one word per token id (so every generated id decodes to text: one streamed chunk per token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    import swiftkv_jax as sk
    from swiftkv_jax.checkpoints.sidecar import read_sidecar_files

    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    staging = directory / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(staging)
    sk.save(model, directory / "model", "hf", extra_files=read_sidecar_files(staging))
    return directory / "model"


def _server_argv(model_dir: Path, port: int, name: str, settings: dict, max_waiting: int, args) -> list:
    s = settings
    argv = [sys.executable, str(Path(__file__).resolve().parents[1] / "infer.py"), "serve", "--model", str(model_dir),
            "--port", str(port), "--served-model-name", "bench", "--cache-dtype", str(s["cache_dtype"]),
            "--page-size", str(s["page_size"]), "--num-pages", str(s["num_pages"]),
            "--max-num-seqs", str(s["max_num_seqs"]), "--max-num-batched-tokens", str(s["max_num_batched_tokens"]),
            "--budget-unit", s["budget_unit"], "--max-model-len", str(s["max_model_len"]),
            "--max-prompt-seqs", str(s["max_prompt_seqs"]), "--single-buckets", ",".join(map(str, s["single_buckets"])),
            "--prompt-buckets", ",".join(map(str, s["prompt_buckets"])), "--max-waiting", str(max_waiting)]
    for flag, value in (("--attention-impl", args.attention_impl), ("--decode-attention-impl",
                                                                     args.decode_attention_impl)):
        if value:
            argv += [flag, value]
    return argv + HTTP_CONFIG_FLAGS[name]


def start_server(argv: list, url: str, log_path: Path, timeout: float):
    """`infer.py serve` in a subprocess; returns it once /health answers 200 (after its warm-up)."""
    import os
    import subprocess

    import httpx

    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # on a GPU the server takes only what it uses
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.perf_counter() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"infer.py serve exited ({proc.returncode}):\n{log_path.read_text()[-2000:]}")
        if time.perf_counter() > deadline:
            proc.kill()
            raise RuntimeError(f"infer.py serve was not ready in {timeout:.0f} s:\n{log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def _server_metrics(url: str) -> dict:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


async def _http_workload(url: str, prompts, output_lens, arrivals) -> dict:
    """Streaming clients, one per request, each sent at its arrival time: per-request token times (one chunk per
    token, stamped as it arrives), like `serve` does in-process."""
    import asyncio

    import httpx

    n = len(arrivals)
    times, added, reasons, usage = [[] for _ in range(n)], [None] * n, [None] * n, [None] * n
    peak = {"pages": 0}
    start = time.perf_counter()

    async def one(i, http):
        await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - start)))
        body = dict(model="bench", prompt=list(prompts[i]), max_tokens=int(output_lens[i]), temperature=0,
                    ignore_eos=True, stream=True, stream_options={"include_usage": True})
        added[i] = time.perf_counter() - start
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"request {i}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage[i] = chunk["usage"]
                for choice in chunk.get("choices", []):
                    if choice["text"]:
                        times[i].append(time.perf_counter() - start)
                    reasons[i] = choice["finish_reason"] or reasons[i]

    async def watch_pages(done):
        while not done.is_set():
            m = await asyncio.to_thread(_server_metrics, url)
            peak["pages"] = max(peak["pages"], int(m["swiftkv_kv_pages_total"] - m["swiftkv_kv_pages_free"]))
            await asyncio.sleep(0.25)

    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        done = asyncio.Event()
        watcher = asyncio.create_task(watch_pages(done))
        try:
            await asyncio.gather(*[one(i, http) for i in range(n)])
        finally:
            done.set()
            await watcher
    return dict(times=times, added=added, finish_reasons=reasons, usage=usage, peak_pages=peak["pages"])


def http_runs(model_dir: Path, configs, settings: dict, rates, arrivals_at, prompts, prompt_lens, output_lens, args,
              log_dir: Path) -> dict:
    """Each configuration's server started once (warm-up included, not timed), then every rate through it."""
    import asyncio
    import socket

    runs, startup = {}, {}
    for name in configs:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        argv = _server_argv(model_dir, port, name, settings[name], len(prompts), args)
        t0 = time.perf_counter()
        proc = start_server(argv, url, log_dir / f"serve_{name}.log", timeout=900.0)
        startup[name] = time.perf_counter() - t0
        print(f"http {name}: infer.py serve ready in {startup[name]:.1f} s (warm-up included)", flush=True)
        try:
            for rate in rates:
                before = _server_metrics(url)
                arrivals = arrivals_at(rate).tolist()
                workload = asyncio.run(_http_workload(url, prompts, output_lens, arrivals))
                after = _server_metrics(url)
                delta = lambda key: after.get(key, 0) - before.get(key, 0)
                served = dict(times=workload["times"], added=workload["added"],
                              engine_metrics=[None] * len(prompts), finish_reasons=workload["finish_reasons"],
                              peak_pages=workload["peak_pages"], compilations=int(delta("swiftkv_compiled_buckets")),
                              compile_s=None, compiled=[],
                              stats=dict(preemptions=int(delta("swiftkv_num_preemptions_total")),
                                         pages_total=int(after["swiftkv_kv_pages_total"]),
                                         steps=int(delta("swiftkv_engine_steps_total")), busy_s=None))
                run = dict(status="ok", **summarise(rate, arrivals, prompt_lens, output_lens, served))
                run["usage_completion_tokens"] = sum((u or {}).get("completion_tokens", 0) for u in workload["usage"])
                runs[(rate, name)] = run
                print(f"http rate {_rate_label(rate):>5} {name:<15} {run['duration_s']:7.1f} s  "
                      f"{run['request_throughput']:.3f} req/s  TTFT p50 {run['ttft_s']['p50'] * 1e3:.0f} ms  "
                      f"TPOT p50 {_ms(run['tpot_s']['p50'])} ms"
                      + ("" if run["all_generated"] else ", SOME REQUESTS STOPPED SHORT"), flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except Exception:  # noqa: BLE001
                proc.kill()
    return dict(runs=runs, startup_s=startup)


def http_overhead(runs: dict, http: dict, configs, rates) -> list:
    """Per (rate, config): the HTTP run against the in-process run of the same workload."""
    rows = []
    for rate in rates:
        for name in configs:
            a, b = runs.get((rate, name), {}), http.get((rate, name), {})
            if a.get("status") != "ok" or b.get("status") != "ok":
                continue
            diff = lambda key, q: (None if a[key][q] is None or b[key][q] is None else b[key][q] - a[key][q])
            rows.append(dict(rate=_rate_label(rate), config=name,
                             request_throughput=b["request_throughput"] / a["request_throughput"],
                             output_token_throughput=b["output_token_throughput"] / a["output_token_throughput"],
                             ttft_p50_s=diff("ttft_s", "p50"), ttft_p99_s=diff("ttft_s", "p99"),
                             tpot_p50_s=diff("tpot_s", "p50"), itl_p50_s=diff("itl_s", "p50"),
                             itl_p99_s=diff("itl_s", "p99")))
    return rows


def overhead_table(rows: list) -> str:
    lines = ["| rate | config | req/s http / in-process | out tok/s http / in-process | TTFT p50 +ms | TTFT p99 +ms | "
             "TPOT p50 +ms | ITL p50 +ms | ITL p99 +ms |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['rate']} | {r['config']} | {r['request_throughput']:.3f} | "
                     f"{r['output_token_throughput']:.3f} | {_ms(r['ttft_p50_s'])} | {_ms(r['ttft_p99_s'])} | "
                     f"{_ms(r['tpot_p50_s'])} | {_ms(r['itl_p50_s'])} | {_ms(r['itl_p99_s'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=("auto",) + tuple(PRESETS), default="auto",
                        help="model and workload defaults: auto = 8b on a GPU, cpu otherwise")
    parser.add_argument("--quick", "--smoke", action="store_true", help="the quick preset: a tiny model, seconds")
    parser.add_argument("--layers", type=int, help="model shape (cpu / quick presets)")
    parser.add_argument("--hidden", type=int, help="hidden size; heads of --head-dim, KV heads about heads / 3")
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--head-dim", type=int)
    parser.add_argument("--dtype", help="parameter, compute and KV cache dtype (preset: float32 cpu, bfloat16 8b)")
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--prompt-len", type=int, help="mean prompt length (uniform in [0.5, 1.5] x mean)")
    parser.add_argument("--output-len", type=int, help="mean output length (uniform in [0.5, 1.5] x mean)")
    parser.add_argument("--rates", help="request rates, requests/s, comma-separated; inf = all at t = 0")
    parser.add_argument("--seed", type=int, default=0, help="weights, lengths, prompts and arrivals")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"a subset of {', '.join(CONFIGS)}")
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--max-prompt-seqs", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int,
                        help="pool pages (default: max-num-seqs requests of the longest length + the null page)")
    parser.add_argument("--single-buckets", help="single-token buckets (max-num-seqs is always added)")
    parser.add_argument("--prompt-buckets", help="prompt-token buckets (each engine's largest prompt part is added)")
    parser.add_argument("--attention-impl", help="the engine's prompt attention (default: the config's)")
    parser.add_argument("--decode-attention-impl", help="the engine's paged attention, xla or pallas")
    parser.add_argument("--ttft-factor", type=float, default=4.0,
                        help="sustained: TTFT p50 at most this x the config's TTFT p50 at the lowest rate")
    parser.add_argument("--deadline", type=float, help="seconds from the start after which no new run starts")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/serving_<platform>.json)")
    parser.add_argument("--plot", help="PNG path (default: the JSON's, .png); 'none' for no plot")
    parser.add_argument("--http", action="store_true",
                        help="also run the workload through `infer.py serve` (a subprocess per configuration, "
                             "streaming clients over 127.0.0.1) and report the HTTP overhead")
    args = parser.parse_args(argv)
    t_start = time.perf_counter()

    import jax
    import numpy as np

    import swiftkv_jax as sk
    from swiftkv_jax.model.cached import unstack_layers
    from swiftkv_jax.serving.scheduler import prompt_token_cost

    platform = jax.default_backend()
    preset_name = "quick" if args.quick else args.preset
    if preset_name == "auto":
        preset_name = "8b" if platform == "gpu" else "cpu"
    preset = PRESETS[preset_name]
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if preset_name == "8b" and any(getattr(args, k) is not None for k in ("layers", "hidden", "vocab", "head_dim")):
        parser.error("--layers/--hidden/--vocab/--head-dim apply to the cpu and quick presets; 8b has its own shape")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown or not configs:
        parser.error(f"unknown --configs {unknown}: choose from {', '.join(CONFIGS)}")
    try:
        rates = _rates(args.rates)
    except ValueError as error:
        parser.error(f"--rates {args.rates!r}: {error}")
    for name in ("num_requests", "prompt_len", "output_len", "max_num_seqs", "max_num_batched_tokens", "page_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")

    # ---- model: one set of weights, in serving layout once, shared by every engine
    if preset_name == "8b":
        from swiftkv_jax.serving import bench

        model = bench.random_model("llama-3.1-8b", dtype=args.dtype, seed=args.seed)
    else:
        heads = args.hidden // args.head_dim
        if heads * args.head_dim != args.hidden:
            parser.error(f"--hidden {args.hidden} must be a multiple of --head-dim {args.head_dim}")
        config = sk.ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                intermediate_size=64 * max(1, round(8 / 3 * args.hidden / 64)),
                                num_hidden_layers=args.layers, num_attention_heads=heads,
                                num_key_value_heads=_kv_heads(heads), head_dim=args.head_dim,
                                param_dtype=args.dtype, dtype=args.dtype)
        model = sk.to_swiftkv(sk.init(config, args.seed), args.layers // 2, 1)
    http_dir = None
    if args.http:  # the same weights, saved once for `infer.py serve`
        import tempfile

        http_dir = tempfile.TemporaryDirectory(prefix="serving_http_")
        http_model = save_for_http(model, Path(http_dir.name))
    cfg = model.config
    model = sk.Model(cfg, jax.block_until_ready(jax.jit(unstack_layers, static_argnums=1)(model.params, cfg)))
    gc.collect()
    n_params = int(sum(x.size for x in jax.tree.leaves(model.params)))

    # ---- workload: the same requests at every rate, for every configuration
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    draw = lambda mean: rng.integers(max(1, round(0.5 * mean)), max(1, round(1.5 * mean)) + 1, n)
    prompt_lens, output_lens = draw(args.prompt_len), draw(args.output_len)
    prompts = [rng.integers(0, cfg.vocab_size, int(k)).tolist() for k in prompt_lens]
    unit_gaps = np.concatenate([[0.0], np.cumsum(rng.exponential(1.0, n - 1))])  # Poisson at rate 1
    arrivals_at = lambda rate: np.zeros(n) if math.isinf(rate) else unit_gaps / rate

    longest = int(max(p + o for p, o in zip(prompt_lens, output_lens)))
    max_model_len = -(-longest // args.page_size) * args.page_size
    pages_per_seq = max_model_len // args.page_size
    num_pages = args.num_pages or 1 + args.max_num_seqs * pages_per_seq
    singles = sorted({b for b in _ints(args.single_buckets) if b < args.max_num_seqs} | {args.max_num_seqs})

    def engine_settings(name) -> dict:
        swiftkv, unit = CONFIGS[name]
        cost = prompt_token_cost(cfg, swiftkv) if unit == "cost" else 1.0
        most = int(args.max_num_batched_tokens / cost + 1e-9)  # the engine's largest prompt part
        return dict(swiftkv=swiftkv, budget_unit=unit, page_size=args.page_size, num_pages=num_pages,
                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                    max_model_len=max_model_len, max_prompt_seqs=args.max_prompt_seqs, cache_dtype=args.dtype,
                    attention_impl=args.attention_impl, decode_attention_impl=args.decode_attention_impl,
                    single_buckets=tuple(singles),
                    prompt_buckets=tuple(sorted({b for b in _ints(args.prompt_buckets) if b < most} | {most})))

    settings = {name: engine_settings(name) for name in configs}
    device = jax.devices()[0]
    count = f"{n_params / 1e9:.2f}B" if n_params >= 1e9 else f"{n_params / 1e6:.{0 if n_params >= 1e7 else 2}f}M"
    title = (f"{preset_name}: {count} params {cfg.param_dtype}, L={cfg.num_hidden_layers} "
             f"l={cfg.num_key_value_layers}, {n} requests, prompt ~{args.prompt_len}, output ~{args.output_len}, "
             f"max_num_seqs {args.max_num_seqs}, budget {args.max_num_batched_tokens}, on {device.device_kind}")
    print(title)
    print(f"pool: {num_pages} pages of {args.page_size} tokens, max_model_len {max_model_len}; prompts "
          f"{prompt_lens.min()}-{prompt_lens.max()} (mean {prompt_lens.mean():.0f}), outputs "
          f"{output_lens.min()}-{output_lens.max()} (mean {output_lens.mean():.1f}); rates "
          f"{', '.join(map(_rate_label, rates))}")

    out_path = Path(args.out or f"benchmarks/results/serving_{platform}.json")
    plot_path = None if args.plot == "none" else Path(args.plot or out_path.with_suffix(".png"))
    runs, warmups = {}, {}
    payload = lambda: {
        "device": device.device_kind, "platform": platform, "preset": preset_name, "args": vars(args),
        "params": n_params, "complete": False,
        "model": dict(layers=cfg.num_hidden_layers, num_key_value_layers=cfg.num_key_value_layers,
                      key_value_group_size=cfg.key_value_group_size, hidden=cfg.hidden_size,
                      heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                      intermediate=cfg.intermediate_size, vocab=cfg.vocab_size, dtype=cfg.param_dtype,
                      attention_impl=args.attention_impl or cfg.attention_impl,
                      decode_attention_impl=args.decode_attention_impl or cfg.decode_attention_impl),
        "engine": {name: {**s, "prompt_token_cost": prompt_token_cost(cfg, s["swiftkv"]) if s["budget_unit"] == "cost"
                          else 1.0} for name, s in settings.items()},
        "workload": dict(num_requests=n, prompt_lens=prompt_lens.tolist(), output_lens=output_lens.tolist(),
                         unit_arrivals_s=unit_gaps.tolist(), rates=[_rate_label(r) for r in rates]),
        "sustained_definition": (f"finite rate; completion rate >= {SUSTAIN_COMPLETION} x realised arrival rate; "
                                 f"TTFT p50 <= {args.ttft_factor} x the config's TTFT p50 at its lowest rate"),
        "targets": TARGETS, "warmup": warmups,
        "runs": [{**run, "config": name, "rate": _rate_label(rate)} for (rate, name), run in runs.items()],
    }
    record = lambda extra=None: write_results(out_path, SCRIPT, argv, {**payload(), **(extra or {})})

    # ---- warm-up: every bucket of every configuration compiled before anything is timed
    compiles = CompileCounter()
    for name in configs:
        engine = sk.Engine(model, **settings[name])
        seconds = engine.warmup()
        s = settings[name]
        buckets = (len(s["single_buckets"]) + 1) * (len(s["prompt_buckets"]) + 1) - 1
        warmups[name] = dict(seconds=seconds, buckets=buckets,
                             single_buckets=list(s["single_buckets"]), prompt_buckets=list(s["prompt_buckets"]),
                             pool_mib=engine.pool.nbytes / 2**20)
        print(f"warm-up {name}: {warmups[name]['buckets']} buckets (singles {s['single_buckets']} x prompts "
              f"{s['prompt_buckets']}) in {seconds:.1f} s" +
              (" (buckets shared with swiftkv-tokens were compiled already)" if name == "swiftkv-cost"
               and "swiftkv-tokens" in warmups else ""), flush=True)
        del engine
        gc.collect()

    record()  # the settings and the warm-up, in case the runs are cut short

    # ---- runs: rate by rate, the configurations in turn, each on a fresh engine
    for rate in rates:
        arrivals = arrivals_at(rate).tolist()
        for name in configs:
            if args.deadline is not None and time.perf_counter() - t_start > args.deadline:
                runs[(rate, name)] = dict(status="not run", reason=f"past the deadline of {args.deadline:g} s")
                continue
            engine = sk.Engine(model, **settings[name])
            served = serve(engine, prompts, output_lens, arrivals, compiles)
            del engine
            gc.collect()
            run = dict(status="ok", **summarise(rate, arrivals, prompt_lens, output_lens, served))
            runs[(rate, name)] = run
            note = "" if run["compilations"] == 0 else (f", {run['compilations']} COMPILATIONS WHILE TIMED "
                                                        f"({run['compile_s']:.2f} s: {', '.join(run['compiled'])})")
            note += "" if run["all_generated"] else ", SOME REQUESTS STOPPED SHORT"
            print(f"rate {_rate_label(rate):>5} {name:<15} {run['duration_s']:7.1f} s  "
                  f"{run['request_throughput']:.3f} req/s  TTFT p50 {run['ttft_s']['p50'] * 1e3:.0f} ms  "
                  f"TPOT p50 {_ms(run['tpot_s']['p50'])} ms  peak pages {run['peak_pages']}{note}", flush=True)
            mark_sustained(runs, configs, rates, args.ttft_factor)
            record()

    mark_sustained(runs, configs, rates, args.ttft_factor)
    http = {}
    if args.http:
        try:
            done = http_runs(http_model, configs, settings, rates, arrivals_at, prompts, prompt_lens, output_lens,
                             args, Path(http_dir.name))
        finally:
            http_dir.cleanup()
        mark_sustained(done["runs"], configs, rates, args.ttft_factor)
        overhead = http_overhead(runs, done["runs"], configs, rates)
        http = {"http": {"startup_s": done["startup_s"], "overhead": overhead,
                         "runs": [{**run, "config": name, "rate": _rate_label(rate)}
                                  for (rate, name), run in done["runs"].items()]}}
        print()
        print("HTTP (infer.py serve, streaming clients on 127.0.0.1):")
        print(table(done["runs"], configs, rates))
        print()
        print("HTTP overhead against the in-process runs above (ratios, and added milliseconds):")
        print(overhead_table(overhead))
    ratios = compare(runs, configs, rates)
    print()
    print(table(runs, configs, rates))
    print()
    print("teacher: one engine for both budget units (a teacher prompt token costs 1 either way)")
    print(f"sustained: {payload()['sustained_definition']}")
    if ratios:
        at = ratios["compared_at_rate"]
        sustained = ratios["teacher_max_sustained_rate"]
        top = "none of the rates" if sustained is None else f"{_rate_label(sustained)} req/s"
        print(f"teacher sustains up to {top}"
              f"; compared at {at or '-'} req/s ({ratios['compared_at_note']})")
        verdict = lambda ok: "PASS" if ok else "FAIL"
        for name, row in ratios.items():
            if not isinstance(row, dict):
                continue
            parts = []
            if "ttft_p50" in row:
                parts.append(f"TTFT p50 {row['ttft_p50']:.3f} (<= {TARGETS['ttft_p50']}: "
                             f"{verdict(row['pass']['ttft_p50'])})")
            if "tpot_p50" in row:
                parts.append(f"TPOT p50 {row['tpot_p50']:.3f} (<= {TARGETS['tpot_p50']}: "
                             f"{verdict(row['pass']['tpot_p50'])})")
            if "throughput" in row:
                parts.append(f"sustainable throughput {row['throughput_swiftkv']:.3f} / {row['throughput_teacher']:.3f}"
                             f" req/s = {row['throughput']:.3f} (>= {TARGETS['throughput']}: "
                             f"{verdict(row['pass']['throughput'])})")
            top = row["max_sustained_rate"]
            parts.append(f"sustains up to {'none' if top is None else _rate_label(top)}")
            print(f"{name} / teacher: " + "; ".join(parts))
        if preset_name == "quick":
            print("(quick: a tiny model, overheads dominate: the targets are not meaningful here)")
    plotted = plot_path is not None and plot(plot_path, runs, configs, rates, title)
    record({"complete": all(run.get("status") == "ok" for run in runs.values()), "ratios": ratios,
            "plot": str(plot_path) if plotted else None, "wall_s": time.perf_counter() - t_start, **http})
    return 0


if __name__ == "__main__":
    sys.exit(main())
