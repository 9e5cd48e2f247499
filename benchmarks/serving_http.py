"""`benchmarks/serving.py --http`: the serving benchmark's workload through `infer.py serve` (a subprocess per
configuration, streaming clients over 127.0.0.1), and its overhead against the in-process runs.

The same weights (saved once to a temporary HF directory with a word-level tokenizer of one word per token id) are
served by `python infer.py serve` per configuration (SwiftKV wiring with either budget unit or an FP8 pool, or
`--teacher-mode`), with the engine settings of the in-process runs, warmed up before anything is timed; one streaming
client per request sends its token ids as the prompt (`ignore_eos`, greedy) at its arrival time and stamps each
streamed chunk (one token) as it arrives. On a GPU, run it with XLA_PYTHON_CLIENT_PREALLOCATE=false so the server
process finds memory beside the benchmark's.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from serving import format_ms, rate_label, summarise

HTTP_CONFIG_FLAGS = {"swiftkv-tokens": [], "swiftkv-cost": [], "swiftkv-fp8": [], "teacher": ["--teacher-mode"]}


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


def server_metrics(url: str) -> dict:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def completion_bodies(prompts, output_lens) -> list:
    """The benchmark's requests as streaming /v1/completions bodies: token ids as the prompt, greedy, `ignore_eos`,
    `max_tokens` the output length."""
    return [dict(model="bench", prompt=[int(t) for t in p], max_tokens=int(o), temperature=0, ignore_eos=True,
                 stream=True, stream_options={"include_usage": True}) for p, o in zip(prompts, output_lens)]


def new_tokens(choice: dict, usage, counted: int) -> int:
    """The tokens a streamed chunk's choice (completions' or chat's) brings, `counted` so far: with the usage so far
    on the chunk (continuous usage stats), as many as it adds (a chunk with text at least one; the last chunk may
    bring tokens whose text was empty); without, one for a chunk with text. Chat's opening role chunk brings none."""
    text = choice["text"] if "text" in choice else (choice.get("delta") or {}).get("content")
    so_far = (usage or {}).get("completion_tokens")
    if so_far is None:
        return 1 if text else 0
    return max(so_far - counted, 1 if text else 0) if text or choice.get("finish_reason") else 0


async def http_workload(url: str, bodies, arrivals, path: str = "/v1/completions", watch_pages: bool = True) -> dict:
    """Streaming clients, one per request: bodies[i] POSTed to url + path at arrivals[i] s (completions or chat
    completions), each chunk with text stamped as it arrives, once per token it carries (by the usage on every chunk
    when the body asks for continuous usage stats, else one: a chunk a token). Per request: `added` (the client's
    clock when it started the request), `sent` (when its headers began to go out, as guidellm stamps it: an httpx
    trace), `times` (a time per token). `watch_pages`: poll /metrics for the pages in use meanwhile (4 times a
    second, on the server's loop too)."""
    import asyncio

    import httpx

    n = len(arrivals)
    times, added, sent = [[] for _ in range(n)], [None] * n, [None] * n
    reasons, usage = [None] * n, [None] * n
    peak = {"pages": 0}
    start = time.perf_counter()

    async def one(i, http):
        await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - start)))

        async def trace(event, info):
            if sent[i] is None and event.endswith(".send_request_headers.started"):
                sent[i] = time.perf_counter() - start

        added[i] = time.perf_counter() - start
        async with http.stream("POST", f"{url}{path}", json=bodies[i], extensions={"trace": trace}) as response:
            if response.status_code != 200:
                raise RuntimeError(f"request {i}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter() - start
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage[i] = chunk["usage"]
                for choice in chunk.get("choices", []):
                    times[i].extend([now] * new_tokens(choice, chunk.get("usage"), len(times[i])))
                    reasons[i] = choice["finish_reason"] or reasons[i]

    async def watch(done):
        while not done.is_set():
            m = await asyncio.to_thread(server_metrics, url)
            peak["pages"] = max(peak["pages"], int(m["swiftkv_kv_pages_total"] - m["swiftkv_kv_pages_free"]))
            await asyncio.sleep(0.25)

    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done)) if watch_pages else None
        try:
            await asyncio.gather(*[one(i, http) for i in range(n)])
        finally:
            done.set()
            if watcher:
                await watcher
    return dict(times=times, added=added, sent=sent, finish_reasons=reasons, usage=usage, peak_pages=peak["pages"])


def http_runs(model_dir: Path, plan: dict, settings, workload, args, log_dir: Path) -> dict:
    """Each configuration's server started once (warm-up included, not timed), then each (rate, requests) of `plan`
    ({config: [(rate, n), ...]}) through it."""
    import asyncio
    import math
    import socket

    import numpy as np

    runs, startup = {}, {}
    for name, points in plan.items():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        argv = _server_argv(model_dir, port, name, settings[name], max(n for _, n in points), args)
        t0 = time.perf_counter()
        proc = start_server(argv, url, log_dir / f"serve_{name}.log", timeout=900.0)
        startup[name] = time.perf_counter() - t0
        print(f"http {name}: infer.py serve ready in {startup[name]:.1f} s (warm-up included)", flush=True)
        try:
            for rate, n in points:
                before = server_metrics(url)
                arrivals = (np.zeros(n) if math.isinf(rate) else workload["unit_gaps"][:n] / rate).tolist()
                prompt_lens, output_lens = workload["prompt_lens"][:n], workload["output_lens"][:n]
                done = asyncio.run(http_workload(url, completion_bodies(workload["prompts"][:n], output_lens),
                                                 arrivals))
                after = server_metrics(url)
                delta = lambda key: after.get(key, 0) - before.get(key, 0)
                served = dict(times=done["times"], added=done["added"], engine_metrics=[None] * n,
                              finish_reasons=done["finish_reasons"], peak_pages=done["peak_pages"],
                              compilations=int(delta("swiftkv_compiled_buckets")), compile_s=None, compiled=[],
                              elapsed_s=None, stats=dict(preemptions=int(delta("swiftkv_num_preemptions_total")),
                                                         pages_total=int(after["swiftkv_kv_pages_total"]),
                                                         steps=int(delta("swiftkv_engine_steps_total")), busy_s=None))
                run = dict(status="ok", **summarise(rate, arrivals, prompt_lens, output_lens, served))
                run["usage_completion_tokens"] = sum((u or {}).get("completion_tokens", 0) for u in done["usage"])
                runs[(name, rate)] = run
                print(f"http {name:<15} rate {rate_label(rate):>6} {run['duration_s']:7.1f} s  "
                      f"{run['requests_per_s']:.3f} req/s  TTFT p50 {format_ms(run['ttft_s']['p50'])} ms  "
                      f"TPOT p50 {format_ms(run['tpot_s']['p50'])} ms"
                      + ("" if run["all_generated"] else ", SOME REQUESTS STOPPED SHORT"), flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except Exception:  # noqa: BLE001
                proc.kill()
    return dict(runs=runs, startup_s=startup)


def http_overhead(runs: dict, http: dict) -> list:
    """Per (config, rate) run through HTTP: against the in-process run of the same workload."""
    rows = []
    for key, b in http.items():
        a = runs.get(key, {})
        if a.get("status") != "ok" or b.get("status") != "ok":
            continue
        diff = lambda stat, q: (None if a[stat][q] is None or b[stat][q] is None else b[stat][q] - a[stat][q])
        rows.append(dict(config=key[0], rate=rate_label(key[1]),
                         requests_per_s=b["requests_per_s"] / a["requests_per_s"],
                         output_tokens_per_s=b["output_tokens_per_s"] / a["output_tokens_per_s"],
                         ttft_p50_s=diff("ttft_s", "p50"), ttft_p99_s=diff("ttft_s", "p99"),
                         tpot_p50_s=diff("tpot_s", "p50"), itl_p50_s=diff("itl_s", "p50"),
                         itl_p99_s=diff("itl_s", "p99")))
    return rows


def overhead_table(rows: list) -> str:
    lines = ["| config | rate | req/s http / in-process | out tok/s http / in-process | TTFT p50 +ms | TTFT p99 +ms | "
             "TPOT p50 +ms | ITL p50 +ms | ITL p99 +ms |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['rate']} | {r['requests_per_s']:.3f} | "
                     f"{r['output_tokens_per_s']:.3f} | {format_ms(r['ttft_p50_s'])} | {format_ms(r['ttft_p99_s'])} | "
                     f"{format_ms(r['tpot_p50_s'])} | {format_ms(r['itl_p50_s'])} | {format_ms(r['itl_p99_s'])} |")
    return "\n".join(lines)


def run_http(model_dir: Path, runs: dict, order: list, settings, workload, args) -> dict:
    """The engines' in-process runs again through `infer.py serve` (each config's rates and request counts, its pool
    as many pages as in-process): {"http": {startup_s, overhead, runs}} for the JSON; prints the tables."""
    from serving import CONFIGS, table

    plan, server_settings = {}, {}
    for name in order:
        points = [(rate, run["num_requests"]) for (n, rate), run in runs.items() if n == name and
                  run.get("status") == "ok"]
        if CONFIGS[name]["kind"] != "engine" or not points or name not in HTTP_CONFIG_FLAGS:
            continue
        plan[name] = sorted(points)
        pages = next(run["pages_total"] for (n, _), run in runs.items() if n == name and run.get("status") == "ok")
        s = dict(settings(name))
        s.pop("kv_cache_fraction", None)
        server_settings[name] = dict(s, num_pages=pages)
    done = http_runs(model_dir, plan, server_settings, workload, args, model_dir.parent)
    overhead = http_overhead(runs, done["runs"])
    print()
    print("HTTP (infer.py serve, streaming clients on 127.0.0.1):")
    print(table(done["runs"], order))
    print()
    print("HTTP overhead against the in-process runs (ratios, and added milliseconds):")
    print(overhead_table(overhead))
    return {"http": {"startup_s": done["startup_s"], "overhead": overhead,
                     "runs": [{**run, "config": name, "rate": rate_label(rate)}
                              for (name, rate), run in done["runs"].items()]}}
