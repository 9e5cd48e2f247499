"""`benchmarks/serving.py --workload shared-prefix`: prefix caching in `sk.Engine`, on against off, in SwiftKV and
teacher wiring of the same weights, in one run.

    python benchmarks/serving.py --workload shared-prefix [--preset cpu|8b|quick] [--prefix-len 1000]
                                 [--suffix-lens 100,300] [--conversations C --turns T]
                                 [--answer-range-ratio 0.2] [--out PATH.json]

Model and engine settings: serving.py's (its presets; the pool sized as there). Workloads (`--seed`):
- single-turn: every request is one system prompt of `--prefix-len` tokens (1,000) and distinct tokens of its own
  (uniform in `--suffix-lens`, 100-300), then `--output-len` tokens (greedy, no stop tokens). Run at rate inf (every
  request at t = 0: offline throughput), and at one Poisson rate, `--ttft-load` (0.5) x the rate-inf requests/s of
  the same wiring with caching off, for both on and off (the latency comparison: TTFT at a rate both sustain).
- multi-turn: `--conversations` conversations of `--turns` turns, all started at t = 0; each turn resends the
  system prompt and the whole conversation (its earlier turns and the model's answers) with a new user message
  (`--suffix-lens` tokens), sent the moment the previous answer is complete (a closed loop, as chat clients do).
  Each answer's length is drawn uniformly within `--answer-range-ratio` (0.2) of `--output-len`, as vLLM's
  multi-turn benchmark draws them (benchmarks/multi_turn/generate_multi_turn.json: 80-120 output tokens).
- multi-turn-lockstep: the same conversations with every answer `--output-len` tokens (not run when the ratio is 0).
  Started together and answering alike, the conversations stay in step: each turn arrives with the others' and
  queues behind their prompts, with caching or without; reported beside multi-turn, not judged (no traffic answers
  in lockstep), and run last, after no sharing, so that a deadline cuts it first.
- no sharing: prompts of the single-turn workload's lengths made of random tokens (nothing in common), SwiftKV
  wiring at rate inf, caching off, on, off, on: the cost of caching where it finds nothing (the best of each pair).
Each run has an engine of its own, whose cache holds the system prompt alone before the clock starts (one request
of the system prompt and one token, not timed: a server that has served this system prompt before; `--cold`: an
empty cache, where the first requests compute it), so the hit rate is that of the steady state: about
992 / 1,200 of the prompt tokens at 16-token pages.

Per run: total and output tokens/s, TTFT p50/p99, TPOT p50, the token hit rate (prefix_cache_hits /
prefix_cache_queries of `engine.stats()`: prompt tokens found cached over prompt tokens admitted).
Targets (the prefix-caching issue's; a miss prints FAIL, the exit status stays 0), per wiring, where the hit rate is
at least 80%: TTFT p50 with caching <= 0.3x without, throughput at rate inf >= 2x (for multi-turn: its closed-loop
throughput); with no sharing, caching on >= 0.97x off. multi-turn-lockstep's ratios are printed, not judged.
"""

from __future__ import annotations

import gc
import math
import time
from pathlib import Path

from results_file import write_results
from serving import (INF, CompileCounter, format_ms, rate_label, build_model, engine_settings, ok, serve,
                     summarise, targets_text)

SCRIPT = "benchmarks/serving.py"
WIRINGS = ("teacher", "swiftkv-tokens")
# serving.py's preset values that this workload sets otherwise (None: serving.py's)
PRESETS = {
    # ~94M parameters, fp32, 2 CPU cores: ~10 minutes in all. Steps bucketed as the engine's defaults do for a
    # 512-token budget and 32 sequences (what a user gets; serving.py's cpu preset compiles fewer, coarser ones)
    "cpu": dict(prefix_len=1000, suffix_lens="100,300", output_len=16, range_ratio=0.0, num_requests=24,
                sweep_requests=12, conversations=4, turns=4, max_num_seqs=32, run_timeout=300.0,
                single_buckets="8,16", mixed_single_buckets="8", prompt_buckets="32,64,128,256"),
    "8b": dict(prefix_len=1000, suffix_lens="100,300", output_len=128, range_ratio=0.0, num_requests=512,
               sweep_requests=256, conversations=64, turns=4, run_timeout=120.0),
    "quick": dict(prefix_len=64, suffix_lens="8,24", output_len=4, range_ratio=0.0, num_requests=8, sweep_requests=8,
                  conversations=2, turns=2, run_timeout=60.0),
}
TARGETS = {"hit_rate": 0.8, "ttft_p50": 0.3, "throughput": 2.0, "no_sharing": 0.97}


def add_arguments(parser) -> None:
    said = lambda key: "default: " + ", ".join(f"{name}: {preset[key]}" for name, preset in PRESETS.items())  # noqa: E731
    parser.add_argument("--workload", choices=("random", "shared-prefix"), default="random",
                        help="random: ArcticInference's (the default); shared-prefix: prefix caching on against off "
                             "(serving_prefix.py)")
    parser.add_argument("--prefix-len", type=int, help="shared-prefix: the system prompt's tokens; "
                                                       + said("prefix_len"))
    parser.add_argument("--suffix-lens", help="shared-prefix: each request's own tokens, 'low,high'; "
                                              + said("suffix_lens"))
    parser.add_argument("--conversations", type=int, help="shared-prefix: multi-turn conversations; "
                                                          + said("conversations"))
    parser.add_argument("--turns", type=int, help="shared-prefix: turns a conversation; " + said("turns"))
    parser.add_argument("--answer-range-ratio", type=float, default=0.2,
                        help="shared-prefix: multi-turn answers are uniform in (1 +- this) x --output-len tokens "
                             "(default 0.2, vLLM's multi-turn benchmark's 80-120); 0: all --output-len, and no "
                             "lockstep run")
    parser.add_argument("--cold", action="store_true",
                        help="shared-prefix: each run starts with an empty cache (default: the system prompt cached)")
    parser.add_argument("--ttft-load", type=float, default=0.5,
                        help="shared-prefix: the TTFT runs' Poisson rate, x caching off's rate-inf requests/s")


def check_arguments(parser, args) -> None:
    try:
        low, high = (int(x) for x in args.suffix_lens.split(","))
    except ValueError:
        parser.error(f"--suffix-lens takes 'low,high' (e.g. 100,300), got {args.suffix_lens!r}")
    if not 1 <= low <= high:
        parser.error(f"--suffix-lens needs 1 <= low <= high, got {low},{high}")
    args.suffix_range = (low, high)
    for name in ("prefix_len", "conversations", "turns", "sweep_requests"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.ttft_load > 0:
        parser.error("--ttft-load must be > 0")
    if not 0 <= args.answer_range_ratio < 1:
        parser.error(f"--answer-range-ratio must be in [0, 1), got {args.answer_range_ratio}")


def make_workload(args, vocab: int) -> dict:
    """The system prompt, the single-turn prompts, the same lengths with nothing shared, the conversations' user
    messages and their answers' lengths, and unit-rate Poisson gaps."""
    import numpy as np

    rng = np.random.default_rng(args.seed + 1)
    low, high = args.suffix_range
    tokens = lambda k: rng.integers(0, vocab, int(k)).tolist()
    system = tokens(args.prefix_len)
    n = max(args.num_requests, args.sweep_requests)
    shared = [system + tokens(k) for k in rng.integers(low, high + 1, n)]
    unshared = [tokens(len(p)) for p in shared]
    users = [[tokens(k) for k in rng.integers(low, high + 1, args.turns)] for _ in range(args.conversations)]
    unit_gaps = np.concatenate([[0.0], np.cumsum(rng.exponential(1.0, n - 1))])
    r, out = args.answer_range_ratio, args.output_len
    answers = rng.integers(max(1, round((1 - r) * out)), round((1 + r) * out) + 1, (args.conversations, args.turns))
    return dict(system=system, shared=shared, unshared=unshared, users=users, answers=answers.tolist(),
                unit_gaps=unit_gaps)


def serve_conversations(engine, system, users, answers, compiles, time_limit=None) -> dict:
    """Drive `engine` through conversations (a closed loop): every conversation's first turn at t = 0, each next turn
    (system + every earlier message and answer + the next message) the moment the previous answer completes; turn t
    of conversation c answers in `answers[c][t]` tokens. Returns serve()'s record, plus each request's prompt and
    answer lengths and the time it was sent (its arrival)."""
    import jax

    turns = len(users[0])
    history = [list(system) for _ in users]
    times, sent, prompt_lens, said = {}, {}, {}, {}
    peak_pages, done, cut_off = 0, 0, False
    before = compiles.snapshot()
    start = time.perf_counter()

    def send(c: int, t: int) -> None:
        i = c * turns + t
        history[c] += users[c][t]
        prompt_lens[i], times[i], said[i] = len(history[c]), [], []
        engine.add_request(history[c], request_id=str(i), max_tokens=int(answers[c][t]), temperature=0.0,
                           stop_token_ids=[])
        sent[i] = time.perf_counter() - start

    for c in range(len(users)):
        send(c, 0)
    while engine.has_unfinished():
        if time_limit is not None and time.perf_counter() - start > time_limit:
            cut_off = True
            break
        outputs = engine.step()
        stamp = time.perf_counter() - start
        stats = engine.stats()
        peak_pages = max(peak_pages, stats["pages_total"] - stats["pages_free"])
        for out in outputs:
            i = int(out.request_id)
            times[i] += [stamp] * len(out.new_token_ids)
            said[i] += out.new_token_ids
            if out.finished:
                done += 1
                c, t = divmod(i, turns)
                history[c] += said[i]
                if t + 1 < turns:
                    send(c, t + 1)
    elapsed = time.perf_counter() - start
    jax.block_until_ready(jax.live_arrays())
    order = sorted(times)
    return dict(times=[times[i] for i in order], arrivals=[sent[i] for i in order],
                prompt_lens=[prompt_lens[i] for i in order],
                output_lens=[int(answers[i // turns][i % turns]) for i in order], peak_pages=peak_pages,
                cut_off=cut_off,
                elapsed_s=elapsed, stats=engine.stats(), **compiles.since(before))


def _rate_json(rate: float):
    """A run's rate as JSON has it: "inf", "closed loop" (NaN here), or requests/s."""
    return "inf" if math.isinf(rate) else "closed loop" if math.isnan(rate) else rate


COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_evictions")


def hit_rate(stats: dict):
    queries = stats.get("prefix_cache_queries") or 0
    return stats["prefix_cache_hits"] / queries if queries else None


def run_prefix_workloads(args, argv=None) -> int:
    """The shared-prefix benchmark (see the module docstring)."""
    import jax
    import numpy as np

    import swiftkv_jax as sk
    from swiftkv_jax.model.cached import unstack_layers

    t_start = time.perf_counter()
    left = lambda: math.inf if args.deadline is None else args.deadline - (time.perf_counter() - t_start)
    model = build_model(args)
    cfg = model.config
    model = sk.Model(cfg, jax.block_until_ready(jax.jit(unstack_layers, static_argnums=1)(model.params, cfg)))
    gc.collect()
    work = make_workload(args, cfg.vocab_size)
    low, high = args.suffix_range
    longest_answer = max(max(a) for a in work["answers"])
    longest_turns = args.prefix_len + args.turns * (high + longest_answer)
    max_model_len = -(-max(longest_turns, args.prefix_len + high + args.output_len) // args.page_size) * args.page_size
    platform = jax.default_backend()
    sequences = min(args.max_num_seqs, max(args.num_requests, args.conversations))
    pool = ({"kv_cache_fraction": args.kv_cache_fraction} if args.kv_cache_fraction is not None and platform != "cpu"
            else {"num_pages": args.num_pages or 1 + sequences * (max_model_len // args.page_size)})
    out_path = Path(args.out or f"benchmarks/results/serving_prefix_{platform}.json")
    device = jax.devices()[0]
    title = (f"{args.preset} shared-prefix: L={cfg.num_hidden_layers} l={cfg.num_key_value_layers} "
             f"{cfg.param_dtype}; system prompt {args.prefix_len} tokens + {low}-{high} own, outputs "
             f"{args.output_len}; {args.num_requests} requests at rate inf, {args.sweep_requests} at "
             f"{args.ttft_load:g}x caching off's rate; {args.conversations} conversations x {args.turns} turns, "
             f"answers {min(map(min, work['answers']))}-{longest_answer}; page "
             f"{args.page_size}, budget {args.max_num_batched_tokens}, on {device.device_kind}")
    print(title, flush=True)
    compiles = CompileCounter()
    runs, warmup = [], {}

    def record(extra=None) -> None:
        rows = targets(runs)
        write_results(out_path, SCRIPT, argv, {
            **dict(preset=args.preset, workload="shared-prefix", title=title, args=vars(args), complete=False,
                   engine={w: engine_settings(args, cfg, w, pool, max_model_len) for w in WIRINGS}, warmup=warmup,
                   runs=[dict(r, rate=_rate_json(r["rate"])) for r in runs], table=table(runs), targets=rows,
                   targets_text=targets_text(rows)), **(extra or {})}, quiet=extra is None)

    def engine_for(wiring: str, caching: bool, system=None):
        """A new engine; with `system`, its cache holds that prompt (one untimed request) unless --cold."""
        engine = sk.Engine(model, **engine_settings(args, cfg, wiring, pool, max_model_len),
                           enable_prefix_caching=caching)
        key = f"{wiring}/{'on' if caching else 'off'}"
        if key not in warmup:
            warmup[key] = engine.warmup()
            print(f"warm-up {key}: {warmup[key]:.1f} s", flush=True)
        if system is not None and not args.cold:
            engine.generate([system + [0]], max_tokens=1, stop_token_ids=[])
        return engine

    def finish(run: dict, workload: str, wiring: str, caching: bool, served: dict, before: dict) -> dict:
        counts = {k: served["stats"][k] - before[k] for k in COUNTERS}
        run = dict(status="ok", workload=workload, config=wiring, caching=caching, **run, hit_rate=hit_rate(counts),
                   **counts)
        run.pop("per_request", None)
        runs.append(run)
        note = " (CUT OFF)" if run["cut_off"] else ""
        note += "" if not run.get("compilations") else f", {run['compilations']} COMPILATIONS WHILE TIMED"
        hits = "-" if run["hit_rate"] is None else f"{run['hit_rate']:.0%}"
        print(f"{workload:<12} {wiring:<15} caching {'on ' if caching else 'off'} rate {rate_label(run['rate']):>6}"
              f"  {run['num_requests']:4d} requests  {run['duration_s']:7.1f} s  {run['total_tokens_per_s']:9,.0f} "
              f"total tok/s  TTFT p50 {format_ms(run['ttft_s']['p50'])} ms  hit rate {hits}{note}", flush=True)
        record()
        return run

    def single(wiring, caching, prompts, rate, n, workload="single-turn") -> dict:
        engine = engine_for(wiring, caching, None if workload == "no-sharing" else work["system"])
        before = engine.stats()
        outputs = np.full(n, args.output_len)
        arrivals = (np.zeros(n) if math.isinf(rate) else work["unit_gaps"][:n] / rate).tolist()
        served = serve(engine, prompts[:n], outputs, arrivals, compiles, time_limit=min(args.run_timeout, left()))
        del engine
        gc.collect()
        return finish(summarise(rate, arrivals, [len(p) for p in prompts[:n]], outputs, served), workload, wiring,
                      caching, served, before)

    def too_late() -> bool:
        return left() < 10.0

    for wiring in WIRINGS:  # single-turn, rate inf, then both at one rate caching off sustains
        rate_inf = {}
        for caching in (False, True):
            if not too_late():
                rate_inf[caching] = single(wiring, caching, work["shared"], INF, args.num_requests)
        if False in rate_inf and not too_late():
            rate = args.ttft_load * rate_inf[False]["requests_per_s"]
            for caching in (False, True):
                if not too_late():
                    single(wiring, caching, work["shared"], rate, args.sweep_requests)
    def conversations(workload: str, answers) -> None:  # closed loops
        for wiring in WIRINGS:
            for caching in (False, True):
                if too_late():
                    continue
                engine = engine_for(wiring, caching, work["system"])
                before = engine.stats()
                served = serve_conversations(engine, work["system"], work["users"], answers, compiles,
                                             time_limit=min(args.run_timeout, left()))
                del engine
                gc.collect()
                finish(summarise(math.nan, served["arrivals"], served["prompt_lens"], served["output_lens"], served),
                       workload, wiring, caching, served, before)

    conversations("multi-turn", work["answers"])
    for caching in (False, True, False, True):  # no sharing: what caching costs where it finds nothing
        if not too_late():
            single("swiftkv-tokens", caching, work["unshared"], INF, args.num_requests, workload="no-sharing")
    if args.answer_range_ratio:  # last, not judged: what a deadline cuts first
        conversations("multi-turn-lockstep", [[args.output_len] * args.turns for _ in work["users"]])

    rows = targets(runs)
    print()
    print(table(runs))
    print("targets:")
    print(targets_text(rows))
    if args.preset == "quick":
        print("(quick: a tiny model, overheads dominate: the ratios are not meaningful here)")
    expected = (4 + 2 * (1 + bool(args.answer_range_ratio))) * len(WIRINGS) + 4
    record({"complete": all(ok(r) for r in runs) and len(runs) == expected, "wall_s": time.perf_counter() - t_start})
    return 0


# ---- judging and the table ------------------------------------------------------------------------------------------

def _pick(runs, workload, wiring, caching, finite=None) -> list:
    return [r for r in runs if r["workload"] == workload and r["config"] == wiring and r["caching"] == caching
            and ok(r) and (finite is None or math.isfinite(r["rate"]) == finite)]


def targets(runs: list) -> list:
    """The issue's targets, per wiring (None: not measured); each ratio on against off."""
    rows = []

    def row(name, value, op, goal, note="", applies=True):
        passed = None if value is None or not applies else (value >= goal if op == ">=" else value <= goal)
        rows.append(dict(target=name, value=value, op=op, goal=goal, passed=passed, note=note))

    def ratio(on, off, value):
        """value(on) / value(off), None where either run or value is missing."""
        mine, theirs = (value(r) if r else None for r in (on, off))
        return mine / theirs if mine and theirs else None

    for wiring in WIRINGS:
        for workload, finite in (("single-turn", True), ("multi-turn", None), ("multi-turn-lockstep", None)):
            on, off = (next(iter(_pick(runs, workload, wiring, c, finite)), None) for c in (True, False))
            if workload == "multi-turn-lockstep" and not (on or off):
                continue
            hits = on and on["hit_rate"]
            applies = hits is not None and hits >= TARGETS["hit_rate"] and workload != "multi-turn-lockstep"
            note = "" if hits is None else f"hit rate {hits:.0%}" + (
                "" if applies else ": lockstep, reported, not judged" if workload == "multi-turn-lockstep" else
                ": below 80%, the target does not apply")
            row(f"{workload} {wiring}: TTFT p50 caching on / off", ratio(on, off, lambda r: r["ttft_s"]["p50"]), "<=",
                TARGETS["ttft_p50"], note, applies)
            if workload == "single-turn":
                on, off = (next(iter(_pick(runs, workload, wiring, c, False)), None) for c in (True, False))
            row(f"{workload} {wiring}: total tokens/s caching on / off",
                ratio(on, off, lambda r: r["total_tokens_per_s"]), ">=", TARGETS["throughput"], note, applies)
    best = lambda c: max((r["total_tokens_per_s"] for r in _pick(runs, "no-sharing", "swiftkv-tokens", c)),
                         default=None)
    on, off = best(True), best(False)
    row("no sharing swiftkv-tokens: total tokens/s caching on / off (best of 2 each)", on and off and on / off, ">=",
        TARGETS["no_sharing"])
    return rows


def table(runs: list) -> str:
    """Markdown: a row per run."""
    lines = ["| workload | config | caching | rate req/s | requests | total tok/s | output tok/s | TTFT ms p50 / p99 | "
             "TPOT ms p50 | hit rate |", "|---|---|:---:|---:|---:|---:|---:|---:|---:|---:|"]
    ms = lambda value: "-" if value is None else f"{value * 1e3:.0f}"
    for r in runs:
        rate = _rate_json(r["rate"]) if math.isnan(r["rate"]) else rate_label(r["rate"])
        lines.append(f"| {r['workload']} | {r['config']} | {'on' if r['caching'] else 'off'} | {rate}"
                     f"{' (cut off)' if r['cut_off'] else ''} | {r['num_requests']} | {r['total_tokens_per_s']:,.0f} | "
                     f"{r['output_tokens_per_s']:,.0f} | {ms(r['ttft_s']['p50'])} / {ms(r['ttft_s']['p99'])} | "
                     f"{ms(r['tpot_s']['p50'])} | {'-' if r['hit_rate'] is None else format(r['hit_rate'], '.0%')} |")
    return "\n".join(lines)

