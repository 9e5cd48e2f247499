"""`benchmarks/serving_guidellm.py`: guidellm's reported TTFT and ITL beside our own HTTP driver's (serving_http.py)
on one `infer.py serve`, the same requests at the same constant rate (issue 26: within 20% of each other).

    python benchmarks/serving_guidellm.py [--model DIR] [--rate 2] [--requests 24] [--prompt-tokens 64]
                                          [--output-tokens 16] [--rounds 3] [--out PATH.json]

One server on 127.0.0.1 (prefix caching off: the rounds send the same prompts again), the tiny SwiftKV student of
`make_tiny_assets` by default (`--model`: any HF checkpoint with a tokenizer), warmed up by a few untimed requests.
Then `--rounds` rounds, guidellm then ours, the next round ours then guidellm (so a drift of the shared machine
falls on both): guidellm's `run` at a constant `--rate` with its synthetic text prompts of `--prompt-tokens` tokens
(plus the chat template's) and `--output-tokens` outputs, on its default endpoint (streaming chat completions, with
`ignore_eos`, `max_completion_tokens` and continuous usage stats), `--requests` requests; ours replays the bodies
guidellm sent (read back from its report) to the same endpoint at the same offsets from the first request.

The definitions are guidellm's (schemas/base/request_stats.py), computed the same way on both sides:
- TTFT = the first chunk with content - the request's start (when its headers begin to go out: an httpx trace hook
  on both sides). Not from the scheduled arrival, as serving_http.py's own TTFT is: the dispatch lag (scheduled to
  sent) is reported beside it for both.
- ITL = (last content chunk - first content chunk) / (output tokens - 1), one value a request (what serving.py calls
  TPOT, not its pooled gaps), with the output tokens from the server's usage; its distribution weights each request
  by output tokens - 1 (equal here: every request makes --output-tokens).
Statistics by guidellm's own `DistributionSummary` on the per-request values (for its rounds, the values in its
report, which reproduce its reported figures: checked). The target: guidellm's p50 TTFT and p50 ITL, pooled over its
rounds, within 20% of ours (|guidellm / ours - 1| <= 0.2), and no guidellm request errored. On a tiny model on a
shared CPU these are milliseconds: noisy, so rerun to confirm a verdict.

Beside each run, to tell the client from the server: the server's own mean TTFT and TPOT of the run's requests (its
/metrics histograms, taken where the engine hands tokens out, before HTTP), the client's CPU seconds (guidellm's
processes, its start-up included; ours: this process's) and the machine's 1-minute load as the run began.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_file import DefaultsFormatter, write_results
from serving_http import server_metrics, http_workload, start_server

SCRIPT = "benchmarks/serving_guidellm.py"
TARGET = 0.20  # |guidellm / ours - 1| at most, TTFT p50 and ITL p50
METRICS = ("ttft_ms", "itl_ms")
MODEL_NAME = "bench"


def distribution(values, weights=None) -> dict:
    """p50, mean and p99 of `values` as guidellm computes them (its DistributionSummary, weighted if `weights`)."""
    from guidellm.schemas import DistributionSummary

    pairs = list(zip(values, weights)) if weights is not None else list(values)
    d = DistributionSummary.from_values(pairs)
    return dict(p50=d.median, mean=d.mean, p99=d.percentiles.p99, count=d.count)


def read_report(path) -> dict:
    """guidellm's JSON report (one benchmark): its request totals, its reported TTFT and ITL (ms: p50, mean, p99),
    and per successful request, in the order they were scheduled: TTFT, ITL, output tokens, the offset of its
    targeted start from the first one's (s), dispatch lag (s) and the body it sent."""
    bench = json.loads(Path(path).read_text())["benchmarks"]
    if len(bench) != 1:
        raise ValueError(f"{path}: expected one benchmark, found {len(bench)}")
    bench = bench[0]
    m = bench["metrics"]
    reported = {}
    for ours, theirs in (("ttft_ms", "time_to_first_token_ms"), ("itl_ms", "inter_token_latency_ms")):
        s = m[theirs]["successful"]
        reported[ours] = dict(p50=s["median"], mean=s["mean"], p99=s["percentiles"]["p99"], count=s["count"])
    requests = sorted(bench["requests"]["successful"], key=lambda r: r["info"]["timings"]["targeted_start"])
    first = requests[0]["info"]["timings"]["targeted_start"] if requests else 0.0
    return dict(totals=m["request_totals"], reported=reported,
                ttft_ms=[r["time_to_first_token_ms"] for r in requests],
                itl_ms=[r["inter_token_latency_ms"] for r in requests],
                output_tokens=[r["output_tokens"] for r in requests],
                offsets_s=[r["info"]["timings"]["targeted_start"] - first for r in requests],
                dispatch_s=[r["request_dispatch_delay"] for r in requests],
                bodies=[json.loads(r["request_args"])["body"] for r in requests])


def per_request(done: dict, arrivals) -> dict:
    """Our driver's run (`http_workload`'s result) in guidellm's definitions: TTFT from the request's start (its
    headers going out) to its first token, ITL = (last - first token) / (tokens - 1), tokens by the usage."""
    ttft, itl, tokens, dispatch = [], [], [], []
    for t, sent, arrival in zip(done["times"], done["sent"], arrivals):
        ttft.append(1e3 * (t[0] - sent) if t else None)
        itl.append(1e3 * (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None)
        tokens.append(len(t))
        dispatch.append(sent - arrival)
    return dict(ttft_ms=ttft, itl_ms=itl, output_tokens=tokens, dispatch_s=dispatch)


def summarise_round(r: dict) -> dict:
    """A round's TTFT and ITL distributions (ITL weighted by output tokens - 1, as guidellm weights it)."""
    ok = [i for i, v in enumerate(r["ttft_ms"]) if v is not None]
    out = dict(ttft_ms=distribution([r["ttft_ms"][i] for i in ok]))
    two = [i for i in ok if r["itl_ms"][i] is not None]
    out["itl_ms"] = distribution([r["itl_ms"][i] for i in two], [r["output_tokens"][i] - 1 for i in two])
    out["dispatch_ms_p50"] = distribution([1e3 * r["dispatch_s"][i] for i in ok])["p50"]
    return out


def pooled(rounds: list) -> dict:
    """Every round's requests together (one side's)."""
    keys = ("ttft_ms", "itl_ms", "output_tokens", "dispatch_s")
    return summarise_round({k: [v for r in rounds for v in r[k]] for k in keys})


def compare(guidellm_rounds: list, our_rounds: list, expected_requests: int, output_tokens: int) -> dict:
    """The two sides pooled over their rounds, the ratios guidellm / ours of TTFT and ITL (p50 and mean), and the
    verdict: every guidellm request successful (none errored or incomplete, each its output tokens), every one of
    ours its output tokens, and both p50 ratios within TARGET of 1."""
    g, o = pooled(guidellm_rounds), pooled(our_rounds)
    ratios = {f"{k}_{s}": g[k][s] / o[k][s] for k in METRICS for s in ("p50", "mean")}
    errored = sum(r["totals"]["errored"] + r["totals"]["incomplete"] for r in guidellm_rounds)
    complete = all(r["totals"]["successful"] == expected_requests for r in guidellm_rounds) and errored == 0
    lengths = all(n == output_tokens for r in guidellm_rounds + our_rounds for n in r["output_tokens"])
    ours_complete = all(len(r["output_tokens"]) == expected_requests for r in our_rounds)
    within = {k: abs(ratios[f"{k}_p50"] - 1) <= TARGET for k in METRICS}
    return dict(guidellm=g, ours=o, ratios=ratios, guidellm_errored=errored, all_requests_complete=complete
                and ours_complete, all_output_lengths=lengths, within=within,
                passed=complete and ours_complete and lengths and all(within.values()))


def _f(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(guidellm_rounds: list, our_rounds: list, result: dict) -> str:
    """Per run and pooled: the client's TTFT and ITL, its dispatch lag; per run also the server's own means (the
    same requests seen before HTTP), the client's CPU seconds and the machine's load when the run began."""
    lines = ["| run | requests | TTFT p50 ms | TTFT mean ms | ITL p50 ms | ITL mean ms | dispatch p50 ms | "
             "server TTFT mean ms | server TPOT mean ms | client CPU s | load |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def row(name, n, s, r=None):
        server = (r or {}).get("server") or {}
        lines.append(f"| {name} | {n} | {_f(s['ttft_ms']['p50'])} | {_f(s['ttft_ms']['mean'])} | "
                     f"{_f(s['itl_ms']['p50'], 3)} | {_f(s['itl_ms']['mean'], 3)} | {_f(s['dispatch_ms_p50'])} | "
                     f"{_f(server.get('ttft_ms_mean'))} | {_f(server.get('tpot_ms_mean'), 3)} | "
                     f"{_f((r or {}).get('client_cpu_s'), 1)} | {_f((r or {}).get('load_1min'), 1)} |")

    for k, (g, o) in enumerate(zip(guidellm_rounds, our_rounds)):
        row(f"guidellm round {k + 1}", len(g["ttft_ms"]), summarise_round(g), g)
        row(f"ours round {k + 1}", len(o["ttft_ms"]), summarise_round(o), o)
    row("guidellm, all rounds", sum(len(g["ttft_ms"]) for g in guidellm_rounds), result["guidellm"])
    row("ours, all rounds", sum(len(o["ttft_ms"]) for o in our_rounds), result["ours"])
    r = result["ratios"]
    lines.append(f"| guidellm / ours | | {_f(r['ttft_ms_p50'], 3)} | {_f(r['ttft_ms_mean'], 3)} | "
                 f"{_f(r['itl_ms_p50'], 3)} | {_f(r['itl_ms_mean'], 3)} | | | | | |")
    return "\n".join(lines)


def verdict(result: dict) -> str:
    r, w = result["ratios"], result["within"]
    word = lambda ok: "PASS" if ok else "FAIL"
    return "\n".join([
        f"{word(w['ttft_ms'])}: guidellm's TTFT p50 / ours = {r['ttft_ms_p50']:.3f} (within {TARGET:.0%}: "
        f"[{1 - TARGET:.2f}, {1 + TARGET:.2f}])",
        f"{word(w['itl_ms'])}: guidellm's ITL p50 / ours = {r['itl_ms_p50']:.3f}",
        f"{word(result['guidellm_errored'] == 0 and result['all_requests_complete'])}: guidellm errored "
        f"{result['guidellm_errored']}, every request of both completed: {result['all_requests_complete']}",
        f"{word(result['all_output_lengths'])}: every request made its output tokens"])


def guidellm_argv(guidellm: str, url: str, tokenizer: str, args, report: Path) -> list:
    """guidellm's `run` as tests/test_server_clients.py invokes it (its default endpoint: streaming chat)."""
    return [guidellm, "run", "--backend", f"kind=openai_http,target={url}",
            "--profile", f"kind=constant,rate={args.rate:g}",
            "--constraint", f"kind=max_requests,count={args.requests}",
            "--tokenizer", f"kind=hf_auto,model={tokenizer}",
            "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
            "--output", f"kind=json,path={report}", "--disable-console-interactive"]


def server_argv(model: Path, port: int, args) -> list:
    longest = args.prompt_tokens + args.output_tokens + 64  # the chat template's tokens and guidellm's slack
    max_len = -(-longest // 8) * 8
    return [sys.executable, str(Path(__file__).resolve().parents[1] / "infer.py"), "serve", "--model", str(model),
            "--port", str(port), "--served-model-name", MODEL_NAME, "--cache-dtype", "float32", "--page-size", "8",
            "--num-pages", str(1 + 8 * (max_len // 8)), "--max-num-seqs", "8", "--max-num-batched-tokens", "128",
            "--single-buckets", "8", "--prompt-buckets", "128", "--max-model-len", str(max_len),
            "--no-enable-prefix-caching"]


def tiny_student(directory: Path) -> Path:
    """The tiny SwiftKV student tests/test_server_clients.py serves (make_tiny_assets' teacher, l = 2, g = 1)."""
    import swiftkv_jax as sk
    from swiftkv_jax.checkpoints.sidecar import read_sidecar_files
    from swiftkv_jax.tiny_assets import make_tiny_assets

    root = make_tiny_assets(directory, num_examples=200)
    sk.save(sk.to_swiftkv(sk.load(root / "teacher"), 2, 1), root / "student", "hf",
            extra_files=read_sidecar_files(root / "teacher"))
    return root / "student"


def server_side(before: dict, after: dict) -> dict:
    """The server's own view of a run's requests, from its /metrics histograms (counted where the engine hands out
    tokens, before any HTTP): mean TTFT from arrival at the engine and mean TPOT, in ms."""
    mean = lambda name: 1e3 * ((after[f"{name}_sum"] - before[f"{name}_sum"])
                               / max(after[f"{name}_count"] - before[f"{name}_count"], 1))
    return dict(ttft_ms_mean=mean("swiftkv_time_to_first_token_seconds"),
                tpot_ms_mean=mean("swiftkv_time_per_output_token_seconds"),
                requests=int(after["swiftkv_time_to_first_token_seconds_count"]
                             - before["swiftkv_time_to_first_token_seconds_count"]))


def run_guidellm(guidellm: str, url: str, tokenizer: str, args, work: Path, k: int) -> dict:
    """One guidellm run (its report read back), with its CPU seconds (its processes', start-up included)."""
    import resource

    report = work / f"guidellm_{k}.json"
    cpu = lambda: (lambda r: r.ru_utime + r.ru_stime)(resource.getrusage(resource.RUSAGE_CHILDREN))
    before = cpu()
    env = dict(os.environ)
    if args.guidellm_workers:  # its worker processes (guidellm's own default: 10)
        env["GUIDELLM__MAX_WORKER_PROCESSES"] = str(args.guidellm_workers)
    run = subprocess.run(guidellm_argv(guidellm, url, tokenizer, args, report), cwd=work, capture_output=True,
                         text=True, timeout=args.requests / args.rate + 300, env=env)
    if run.returncode != 0:
        raise RuntimeError(f"guidellm failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return dict(read_report(report), client_cpu_s=cpu() - before)


def run_ours(url: str, bodies: list, offsets: list) -> dict:
    """Our driver on `bodies` at `offsets`, with its CPU seconds."""
    before = time.process_time()
    done = asyncio.run(http_workload(url, bodies, offsets, path="/v1/chat/completions", watch_pages=False))
    return dict(per_request(done, offsets), finish_reasons=done["finish_reasons"],
                client_cpu_s=time.process_time() - before)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsFormatter)
    parser.add_argument("--model", help="an HF checkpoint with its tokenizer (default: the tiny SwiftKV student)")
    parser.add_argument("--rate", type=float, default=2.0, help="requests/s, constant (guidellm's `constant`)")
    parser.add_argument("--requests", type=int, default=24, help="requests a run")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="guidellm's synthetic prompt tokens")
    parser.add_argument("--output-tokens", type=int, default=16, help="output tokens a request (ignore_eos)")
    parser.add_argument("--rounds", type=int, default=3, help="guidellm and ours, alternating, this many times each")
    parser.add_argument("--guidellm-workers", type=int,
                        help="guidellm's worker processes (GUIDELLM__MAX_WORKER_PROCESSES; default: its own, 10)")
    parser.add_argument("--warmup-requests", type=int, default=4, help="untimed requests before the rounds")
    parser.add_argument("--out", default="benchmarks/results/serving_guidellm_cpu.json", help="JSON path")
    args = parser.parse_args(argv)
    for name in ("rate", "requests", "prompt_tokens", "output_tokens", "rounds"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    guidellm = shutil.which("guidellm") or shutil.which("guidellm", path=str(Path(sys.executable).parent))
    if guidellm is None:
        print("guidellm is not installed: pip install -e '.[clients]'", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="serving_guidellm_") as tmp:
        work = Path(tmp)
        model = Path(args.model) if args.model else tiny_student(work / "assets")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        proc = start_server(server_argv(model, port, args), url, work / "serve.log", timeout=900.0)
        print(f"infer.py serve ready in {time.perf_counter() - t0:.1f} s", flush=True)
        g_rounds, o_rounds = [], []
        try:
            if args.warmup_requests:  # untimed: the server's first requests of this shape, one at a time
                warm = [dict(model=MODEL_NAME, messages=[dict(role="user", content="warm up " * 8)], stream=True,
                             max_completion_tokens=args.output_tokens, ignore_eos=True)] * args.warmup_requests
                run_ours(url, warm, [i / args.rate for i in range(args.warmup_requests)])
            for k in range(args.rounds):
                for side in ("guidellm", "ours") if k % 2 == 0 else ("ours", "guidellm"):
                    before, load = server_metrics(url), os.getloadavg()[0]
                    if side == "guidellm":
                        g_rounds.append(run_guidellm(guidellm, url, str(model), args, work, k))
                    else:  # the bodies guidellm sent last, at its offsets
                        o_rounds.append(run_ours(url, g_rounds[-1]["bodies"], g_rounds[-1]["offsets_s"]))
                    r = (g_rounds if side == "guidellm" else o_rounds)[-1]
                    r.update(server=server_side(before, server_metrics(url)), load_1min=load)
                    s = summarise_round(r)
                    print(f"round {k + 1} {side:<8}: TTFT p50 {s['ttft_ms']['p50']:.2f} ms, ITL p50 "
                          f"{s['itl_ms']['p50']:.3f} ms; the server's own means: TTFT {r['server']['ttft_ms_mean']:.2f}"
                          f" ms, TPOT {r['server']['tpot_ms_mean']:.3f} ms; client CPU {r['client_cpu_s']:.1f} s, "
                          f"load {load:.1f}", flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    result = compare(g_rounds, o_rounds, args.requests, args.output_tokens)
    text = table(g_rounds, o_rounds, result)
    print()
    print(text)
    print(verdict(result))
    strip = lambda r: {k: v for k, v in r.items() if k != "bodies"}
    from importlib.metadata import version

    write_results(args.out, SCRIPT, argv, dict(
        settings=dict(model=args.model or "tiny SwiftKV student (make_tiny_assets, l=2, g=1)", rate=args.rate,
                      requests=args.requests, prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                      rounds=args.rounds, guidellm_workers=args.guidellm_workers, endpoint="/v1/chat/completions",
                      prefix_caching=False,
                      guidellm=version("guidellm")),
        target=f"guidellm's TTFT p50 and ITL p50 within {TARGET:.0%} of ours; 0 errored", passed=result["passed"],
        result=result, table=text, verdict=verdict(result),
        guidellm_rounds=[dict(strip(r), summary=summarise_round(r)) for r in g_rounds],
        our_rounds=[dict(r, summary=summarise_round(r)) for r in o_rounds], wall_s=time.perf_counter() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
