"""Tune the Pallas kernels' block sizes on this GPU and record the winners in swiftkv_jax/kernels/tuned_blocks.json.

    python benchmarks/tune_kernels.py [--write] [--repeats 10] [--out benchmarks/results/tune_kernels_gpu.json]
    python benchmarks/tune_kernels.py --smoke --table /tmp/t.json --write   # any machine: tiny, interpreted
    python benchmarks/tune_kernels.py --from-results benchmarks/results/gpu-<date>/tune_kernels_gpu.json
        # a GPU run's winners (its --out, brought back) into the table, without measuring

Llama-3.1-8B heads (32 / 8 x 128), bf16. For each kernel and shape every candidate is timed (compiled, then the
median of --repeats runs); a candidate that fails to compile or launch (shared memory, say) is recorded with its
error. The winner is checked against the kernel's jnp reference at the tuned shape before it is kept, and its time
is reported beside the defaults'. --write replaces this device's entries in the table (`--table`, default the
package's), which compiled kernels called without block sizes then use (`swiftkv_jax.kernels.tuning`).
Shapes: flash (causal prefill, batch 1) at 2K and 8K tokens; decode and paged decode (one query, batch 64, 8K
context).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from kernels import _error, timed
from results_file import commit, write_results

# (kernel, tokens the entry covers [min, max], shape) per tuned point
POINTS = [("flash", (1, 4095), dict(batch=1, tokens=2048)), ("flash", (4096, None), dict(batch=1, tokens=8192)),
          ("decode", (1, 16), dict(batch=64, context=8192)), ("paged", (1, 16), dict(batch=64, context=8192))]
SMOKE_POINTS = [("flash", (1, None), dict(batch=1, tokens=64)), ("decode", (1, 16), dict(batch=2, context=128)),
                ("paged", (1, 16), dict(batch=2, context=128))]
CANDIDATES = {
    "flash": [dict(block_q=q, block_k=k, num_warps=w, num_stages=s)
              for q, k, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))],
    "decode": [dict(block_k=k, num_splits=n, num_warps=w, num_stages=2, block_q=64)
               for k, n, w in itertools.product((32, 64, 128), (8, 16, 32), (4, 8))],
}
CANDIDATES["paged"] = CANDIDATES["decode"]
SMOKE_CANDIDATES = {"flash": [dict(block_q=16, block_k=16, num_warps=4, num_stages=2),
                              dict(block_q=32, block_k=16, num_warps=4, num_stages=2)],
                    "decode": [dict(block_k=16, num_splits=2, num_warps=4, num_stages=2, block_q=16),
                               dict(block_k=32, num_splits=4, num_warps=4, num_stages=2, block_q=16)]}
SMOKE_CANDIDATES["paged"] = SMOKE_CANDIDATES["decode"]


def write_table(table, device_kind: str, entries: list, commit: str) -> None:
    """Replace device_kind's entries of the table (default the package's) by these, stamped with the commit."""
    from swiftkv_jax.kernels.tuning import TABLE

    table = table or TABLE
    data = json.loads(table.read_text()) if table.exists() else {"entries": []}
    for e in entries:
        e["measured"]["commit"] = commit
    data["entries"] = [e for e in data.get("entries", []) if e["device"] != device_kind] + entries
    table.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {len(entries)} entries for {device_kind} to {table}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, kernels interpreted: checks the script")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per candidate (default 10, smoke 1)")
    parser.add_argument("--write", action="store_true", help="record the winners in the table")
    parser.add_argument("--table", default=None, help="the table to write (default the package's tuned_blocks.json)")
    parser.add_argument("--out", default=None, help="JSON of every candidate's time")
    parser.add_argument("--from-results", default=None, help="write the winners of an earlier run's --out JSON "
                                                             "into the table, measuring nothing")
    args = parser.parse_args(argv)
    if args.from_results:
        result = json.loads(Path(args.from_results).read_text())
        write_table(Path(args.table) if args.table else None, result["device"], result["entries"], result["commit"])
        return 0

    import jax
    import jax.numpy as jnp
    import numpy as np

    from swiftkv_jax.kernels import (DecodeBlockSizes, FlashBlockSizes, decode_attention, decode_attention_reference,
                                     flash_attention, flash_attention_reference, paged_attention,
                                     paged_attention_reference)
    device = jax.devices()[0]
    if device.platform != "gpu" and not args.smoke:
        print("benchmarks/tune_kernels.py tunes GPU kernels and this machine has none; --smoke checks the script",
              file=sys.stderr)
        return 2
    interpret = device.platform != "gpu"
    repeats = args.repeats or (1 if args.smoke else 10)
    heads, kv_heads, head_dim = (8, 2, 32) if args.smoke else (32, 8, 128)
    dtype = jnp.bfloat16
    keys = iter(jax.random.split(jax.random.key(0), 64))
    normal = lambda *shape: jax.random.normal(next(keys), shape, dtype)  # noqa: E731

    def inputs(kernel, shape):
        if kernel == "flash":
            b, t = shape["batch"], shape["tokens"]
            p = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            g = jnp.zeros((b, t), jnp.int32)
            kv = lambda: normal(b, t, kv_heads, head_dim)  # noqa: E731
            return normal(b, t, heads, head_dim), kv(), kv(), p, p, g, g
        b, s = shape["batch"], shape["context"]
        q, n, p = normal(b, 1, heads, head_dim), jnp.full((b,), s, jnp.int32), jnp.full((b, 1), s - 1, jnp.int32)
        if kernel == "decode":
            return q, normal(b, s, kv_heads, head_dim), normal(b, s, kv_heads, head_dim), n, p
        pages = s // 16
        table = jax.random.permutation(next(keys), jnp.arange(1, b * pages + 1, dtype=jnp.int32)).reshape(b, pages)
        pool = lambda: normal(kv_heads, b * pages + 1, 16, head_dim)  # noqa: E731
        return q, pool(), pool(), table, n, p

    run = {"flash": lambda sizes, *x: flash_attention(*x, block_sizes=sizes, interpret=interpret),
           "decode": lambda sizes, *x: decode_attention(*x, block_sizes=sizes, interpret=interpret),
           "paged": lambda sizes, *x: paged_attention(*x, block_sizes=sizes, interpret=interpret)}
    reference = {"flash": flash_attention_reference, "decode": decode_attention_reference,
                 "paged": paged_attention_reference}
    sizes_cls = {"flash": FlashBlockSizes, "decode": DecodeBlockSizes, "paged": DecodeBlockSizes}
    defaults = {"flash": FlashBlockSizes.for_head_dim(head_dim), "decode": DecodeBlockSizes(),
                "paged": DecodeBlockSizes()}

    rows, entries = [], []
    for kernel, (low, high), shape in (SMOKE_POINTS if args.smoke else POINTS):
        x = inputs(kernel, shape)
        timings = []
        for fields in (SMOKE_CANDIDATES if args.smoke else CANDIDATES)[kernel] + ["default"]:
            sizes = defaults[kernel] if fields == "default" else sizes_cls[kernel](**fields)
            row = dict(kernel=kernel, **shape, block_sizes=vars(sizes).copy(), default=fields == "default")
            try:
                row["time_s"], row["compile_s"] = timed(lambda *a, s=sizes: run[kernel](s, *a), *x, repeats=repeats)
                timings.append((row["time_s"], sizes, row["default"]))
            except Exception as e:  # noqa: BLE001 - a candidate that does not fit is recorded, not hidden
                row["error"] = _error(e)
            print("measured", row, file=sys.stderr, flush=True)
            rows.append(row)
        candidates = sorted(t for t in timings if not t[2])
        default_time = next((t for t, _, d in timings if d), None)
        if not candidates:
            print(f"{kernel} {shape}: no candidate ran", flush=True)
            continue
        best_time, best, _ = candidates[0]
        out = np.asarray(run[kernel](best, *x), np.float32)
        want = np.asarray(reference[kernel](*(a.astype(jnp.float32) if a.dtype == dtype else a for a in x)))
        if not np.allclose(out, want, atol=4e-3, rtol=2e-2):
            print(f"{kernel} {shape}: the winner {best} disagrees with the reference; not kept", flush=True)
            continue
        print(f"{kernel} {shape}: {best} {best_time * 1e3:.3f} ms (defaults "
              f"{'failed' if default_time is None else f'{default_time * 1e3:.3f} ms'})", flush=True)
        entry = dict(kernel=kernel, device=device.device_kind, head_dim=head_dim, group=heads // kv_heads,
                     min_tokens=low, block_sizes=vars(best).copy(),
                     measured=dict(shape=shape, time_s=best_time, default_time_s=default_time, dtype="bfloat16"))
        if high is not None:
            entry["max_tokens"] = high
        entries.append(entry)

    out = args.out or ("/tmp/swiftkv_jax_tune_smoke.json" if args.smoke else
                       f"benchmarks/results/tune_kernels_{device.platform}.json")
    write_results(out, "benchmarks/tune_kernels.py", argv,
                  {"device": device.device_kind, "interpret": interpret, "repeats": repeats, "rows": rows,
                   "entries": entries})
    if args.write:
        write_table(Path(args.table) if args.table else None, device.device_kind, entries, commit())
    return 0


if __name__ == "__main__":
    sys.exit(main())
