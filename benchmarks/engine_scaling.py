"""Does `sk.Engine`'s cost follow the work? Three checks on the CPU, each printed as a table and written as JSON.

    python benchmarks/engine_scaling.py [context] [cost] [host] [--out PATH]

- context: the same 16 requests (prompts of ~300 tokens chunked by a 128-token budget, 32 new tokens each, a 4-layer
  SwiftKV model, the same pool) served by two engines that differ only in `max_model_len`, 1K and 32K: wall time
  of the second of two runs (the first compiles), in the CPU's form of the XLA paged path (a loop that stops at the
  longest sequence) and in the GPU's form forced on the CPU (`xla_loop="static"`, tables bucketed to the step's
  longest sequence). Target: within 15% (before issue 22: 17.5x and 26.5x).
- cost: XLA's cost analysis (bytes accessed) of the compiled decode step those requests run in, 1K against 32K, both
  forms. Target: less than 5% apart.
- host: host milliseconds per engine step at 32, 128 and 256 running sequences, the device step replaced by a no-op
  that returns outputs of the same shapes: scheduling, building the step's arrays, their transfer, and handing out
  the tokens. Target: <= 1 ms at 256.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULT_OUT = Path(__file__).parent / "results" / "engine_scaling_cpu.json"
LIMITS = (1024, 32768)
FORMS = {"cpu": "dynamic", "gpu": "static"}


def model():
    import swiftkv_jax as sk
    from swiftkv_jax.model.config import ModelConfig

    cfg = ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=32768)
    return sk.to_swiftkv(sk.init(cfg, 0), 2, 1)


def requests(vocab: int):
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(1, vocab, int(n)).tolist() for n in rng.integers(250, 350, 16)]


def engine(student, max_model_len: int, form: str, **settings):
    import swiftkv_jax as sk

    return sk.Engine(student, **{**dict(page_size=16, num_pages=512, max_num_seqs=16, max_num_batched_tokens=128,
                                        cache_dtype="float32", max_model_len=max_model_len, xla_loop=FORMS[form]),
                                 **settings})


def context(student) -> list[dict]:
    prompts = requests(student.config.vocab_size)
    rows = []
    for form in FORMS:
        seconds = {}
        for limit in LIMITS:
            eng = engine(student, limit, form)
            outs = []
            for _ in range(2):  # the first run compiles what the second runs
                start = time.perf_counter()
                outs.append(eng.generate(prompts, max_tokens=32, stop_token_ids=[]))
                seconds[limit] = time.perf_counter() - start
            assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
        ratio = seconds[LIMITS[1]] / seconds[LIMITS[0]]
        rows.append(dict(form=form, seconds_1k=seconds[LIMITS[0]], seconds_32k=seconds[LIMITS[1]], ratio=ratio,
                         target=1.15, ok=ratio <= 1.15))
        print(f"context  {form:>3} form: max_model_len 1K {seconds[LIMITS[0]]:6.2f} s, 32K "
              f"{seconds[LIMITS[1]]:6.2f} s, ratio {ratio:.3f} (target <= 1.15) {'ok' if ratio <= 1.15 else 'FAIL'}")
    return rows


def cost(student) -> list[dict]:
    from swiftkv_jax.serving.pages import pages_for

    context_tokens = 350 + 32
    rows = []
    for form in FORMS:
        accessed = {}
        for limit in LIMITS:
            eng = engine(student, limit, form)
            d, r, width = eng._shape(16, 0, pages_for(context_tokens, eng.page_size))
            analysis = eng.lower(d, r, width).compile().cost_analysis()
            analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
            accessed[limit] = float(analysis["bytes accessed"])
        diff = abs(accessed[LIMITS[1]] - accessed[LIMITS[0]]) / accessed[LIMITS[0]]
        rows.append(dict(form=form, bytes_1k=accessed[LIMITS[0]], bytes_32k=accessed[LIMITS[1]], difference=diff,
                         target=0.05, ok=diff < 0.05))
        print(f"cost     {form:>3} form: decode step bytes accessed 1K {accessed[LIMITS[0]] / 2**20:8.2f} MiB, 32K "
              f"{accessed[LIMITS[1]] / 2**20:8.2f} MiB, {100 * diff:.2f}% apart (target < 5%) "
              f"{'ok' if diff < 0.05 else 'FAIL'}")
    return rows


def host(student, counts=(32, 128, 256), steps: int = 60) -> list[dict]:
    import numpy as np

    from swiftkv_jax.serving import continuous
    from swiftkv_jax.serving.scheduler import MAX_TOP_LOGPROBS

    def no_op(params, pool, tables, last_tokens, counts, *_, sizes, **__):  # the step's other inputs: unread
        u = sizes[2]
        top = (np.zeros((u, MAX_TOP_LOGPROBS), np.float32), np.zeros((u, MAX_TOP_LOGPROBS), np.int32))
        return np.ones(u, np.int32), np.zeros(u, np.float32), top, pool, tables, last_tokens, counts

    real, continuous.ragged_step = continuous.ragged_step, no_op
    rows = []
    try:
        for n in counts:
            eng = engine(student, 4096, "cpu", max_num_seqs=n, max_num_batched_tokens=max(512, n), num_pages=n * 40)
            for i in range(n):
                eng.add_request(list(range(1, 17)), max_tokens=1000, stop_token_ids=[], temperature=0.7, seed=i)
            while len(eng.scheduler.active) < n or any(s.remaining > 1 for s in eng.scheduler.active):
                eng.step()
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                eng.step()
                times.append(time.perf_counter() - start)
            ms = 1e3 * statistics.median(times)
            rows.append(dict(running=n, host_ms_per_step=ms, target_ms=1.0 if n == 256 else None))
            print(f"host     {n:4d} running sequences: {ms:6.3f} ms a step (device step a no-op)"
                  + (f" (target <= 1 ms) {'ok' if ms <= 1.0 else 'FAIL'}" if n == 256 else ""))
    finally:
        continuous.ragged_step = real
    return rows


def main(argv=None) -> int:
    from results_file import DefaultsFormatter

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=DefaultsFormatter)
    parser.add_argument("checks", nargs="*", help="context, cost and/or host (default: all three)")
    parser.add_argument("--out", default=str(DEFAULT_OUT),
                        help="JSON path (default: benchmarks/results/engine_scaling_cpu.json, in this checkout)")
    args = parser.parse_args(argv)
    if set(args.checks) - {"context", "cost", "host"}:
        parser.error(f"unknown checks {args.checks}: choose from context, cost, host")

    import jax

    from results_file import write_results

    student = model()
    results = {"device": jax.devices()[0].device_kind, "platform": jax.default_backend()}
    for name in args.checks or ["context", "cost", "host"]:
        results[name] = globals()[name](student)
    write_results(args.out, "benchmarks/engine_scaling.py", argv, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
