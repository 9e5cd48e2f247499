"""Tune the Pallas kernels' block sizes on this GPU and record the winners in swiftkv_jax/kernels/tuned_blocks.json.

    python benchmarks/tune_kernels.py [--write] [--only mosaic_decode,paged:int8] [--deadline 540]
    python benchmarks/tune_kernels.py --smoke --table /tmp/t.json --write   # any machine: tiny, interpreted
    python benchmarks/tune_kernels.py --from-results run1.json gpu-<date>/tune.json   # GPU runs' winners (their
        --out, or the GPU pack's tune step) into the table, without measuring

Llama-3.1-8B heads (32 / 8 x 128). A point is a kernel, the query tokens its entry covers, a cache dtype and the
shapes it is timed at; the points run in the order of the issue's targets: the Mosaic GPU prefill at 8K, Mosaic
decode over bf16, int8 and FP8 caches (32 sequences x 4K and 32K keys), the Triton paged kernel (what sk.Engine
runs) over int8 and bf16 pools, Mosaic paged, then the Triton prefill and decode. Every candidate (and the
kernel's defaults) is timed at each of the point's shapes (compiled, then the median of --repeats samples, as
benchmarks/kernels.py times), the defaults first; its score is the geometric mean of those times. A candidate
that fails to compile, launch or fit shared memory is recorded with its error. The fastest that agrees with the
kernel's jnp reference over the same (quantised) cache wins (the defaults may: the entry then records that they
were measured best; one that disagrees is recorded). Each candidate faster than the best so far is checked as soon
as it is timed, and the results file is rewritten then and after every point, so a run killed inside a candidate
(one compile outlasted the deadline's margin on 2026-11-26 and the whole point was lost) keeps the point's checked
best so far; no point or candidate starts after --deadline seconds (a point cut there keeps the best of the
candidates that ran, and says so), so a bounded GPU call keeps what it measured. --write
replaces this device's entries for the tuned points (kernel, cache dtype and token range) in the table
(`--table`, default the package's), which compiled kernels called without block sizes then use
(`swiftkv_jax.kernels.tuning`).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import NamedTuple

from kernels import error_line, timed
from results_file import DefaultsFormatter, commit, write_results


class Point(NamedTuple):
    kernel: str        # a tuning-table kernel name (swiftkv_jax.kernels.tuning.KERNELS)
    tokens: tuple      # (min, max or None): the query tokens the entry covers
    cache_dtype: str   # K and V's dtype (int8 / float8_e4m3fn: quantised per token and head, as the engines do)
    shapes: tuple      # dicts: flash (batch, tokens); decode (batch, context); paged (batch, context, page_size)


_DECODE = (dict(batch=32, context=4096), dict(batch=32, context=32768))
POINTS = (
    Point("mosaic_flash", (4096, None), "bfloat16", (dict(batch=1, tokens=8192),)),
    Point("mosaic_decode", (1, 16), "bfloat16", _DECODE),
    Point("mosaic_decode", (1, 16), "int8", _DECODE),
    Point("mosaic_decode", (1, 16), "float8_e4m3fn", _DECODE),
    Point("paged", (1, 16), "int8", (dict(batch=32, context=8192, page_size=16),)),
    Point("paged", (1, 16), "bfloat16", (dict(batch=32, context=8192, page_size=16),)),
    # 2026-11-26, untuned: 0.42 ms against bf16's 0.33 (int8 untuned 0.41 on 2026-11-25, tuned 0.32)
    Point("paged", (1, 16), "float8_e4m3fn", (dict(batch=32, context=8192, page_size=16),)),
    Point("mosaic_paged", (1, 16), "bfloat16", (dict(batch=32, context=8192, page_size=16),)),
    Point("mosaic_paged", (1, 16), "int8", (dict(batch=32, context=8192, page_size=32),)),
    Point("mosaic_flash", (1, 4095), "bfloat16", (dict(batch=1, tokens=2048),)),
    Point("flash", (4096, None), "bfloat16", (dict(batch=1, tokens=8192),)),
    Point("flash", (1, 4095), "bfloat16", (dict(batch=1, tokens=2048),)),
    Point("decode", (1, 16), "bfloat16", (dict(batch=64, context=8192),)),
)
SMOKE_POINTS = (
    Point("flash", (1, None), "bfloat16", (dict(batch=1, tokens=64),)),
    Point("decode", (1, 16), "bfloat16", (dict(batch=2, context=128),)),
    Point("paged", (1, 16), "bfloat16", (dict(batch=2, context=128, page_size=16),)),
    Point("paged", (1, 16), "int8", (dict(batch=2, context=128, page_size=16),)),
    Point("mosaic_flash", (1, None), "bfloat16", (dict(batch=1, tokens=128),)),
    Point("mosaic_decode", (1, 16), "int8", (dict(batch=1, context=128), dict(batch=2, context=64))),
    Point("mosaic_paged", (1, 16), "bfloat16", (dict(batch=1, context=128, page_size=32),)),
)
# Deeper pipelines too (more bytes in flight a program: decode is bound by memory latency as much as bandwidth)
_SPLIT_K = ([dict(block_k=k, num_splits=n, num_warps=w, num_stages=2, block_q=64)
             for k, n, w in itertools.product((32, 64, 128), (8, 16, 32), (4, 8))]
            + [dict(block_k=k, num_splits=n, num_warps=4, num_stages=s, block_q=64)
               for k, n, s in itertools.product((64, 128), (8, 16), (3, 4))])
_MOSAIC_SPLIT_K = [dict(block_kv=k, max_concurrent_steps=s, ctas_per_sm=c)
                   for k, s, c in itertools.product((64, 128, 256), (2, 3, 4), (1, 2, 4, 8))]
CANDIDATES = {
    # 16 query rows a warp first (Hopper's MMA: 64 rows a warpgroup): compiled for sm_90a, fewer warps spill
    # registers and more compute rows twice (benchmarks/triton_static.py), so a deadline cuts those
    "flash": sorted([dict(block_q=q, block_k=k, num_warps=w, num_stages=s)
                     for q, k, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))],
                    key=lambda c: c["block_q"] != 16 * c["num_warps"]),
    "decode": _SPLIT_K, "paged": _SPLIT_K,
    # shapes that do not fit shared memory are refused before launching (recorded, cheaply)
    "mosaic_flash": [dict(block_q=q, block_kv=k, max_concurrent_steps=s)
                     for q, k, s in itertools.product((64, 128), (64, 128, 256), (2, 3, 4))],
    "mosaic_decode": _MOSAIC_SPLIT_K, "mosaic_paged": _MOSAIC_SPLIT_K,
}
_SMOKE_SPLIT_K = [dict(block_k=16, num_splits=2, num_warps=4, num_stages=2, block_q=16),
                  dict(block_k=32, num_splits=4, num_warps=4, num_stages=2, block_q=16)]
_SMOKE_MOSAIC_SPLIT_K = [dict(block_kv=64, max_concurrent_steps=2, ctas_per_sm=1),
                         dict(block_kv=64, max_concurrent_steps=3, ctas_per_sm=2)]
SMOKE_CANDIDATES = {"flash": [dict(block_q=16, block_k=16, num_warps=4, num_stages=2),
                              dict(block_q=32, block_k=16, num_warps=4, num_stages=2)],
                    "decode": _SMOKE_SPLIT_K, "paged": _SMOKE_SPLIT_K,
                    "mosaic_flash": [dict(block_q=64, block_kv=64, max_concurrent_steps=2)],
                    "mosaic_decode": _SMOKE_MOSAIC_SPLIT_K, "mosaic_paged": _SMOKE_MOSAIC_SPLIT_K}
ONE_BYTE_CACHES = ("int8", "float8_e4m3fn")


def candidates_for(point: Point, smoke: bool = False) -> list:
    """The block sizes a point tries after the defaults. The Triton split-K kernels over a 1-byte cache try each shape
    three ways (`DecodeBlockSizes.dequant_dtype`): its values converted straight to fp16, to fp32 (TF32 products),
    and to q's dtype."""
    candidates = (SMOKE_CANDIDATES if smoke else CANDIDATES)[point.kernel]
    if point.kernel in ("decode", "paged") and point.cache_dtype in ONE_BYTE_CACHES:
        candidates = [c for fields in candidates for c in (dict(fields, dequant_dtype="float16"),
                                                            dict(fields, dequant_dtype="float32"), fields)]
    return candidates


def parse_only(text: str | None, points) -> tuple:
    """The points that "--only kernel[:dtype],..." names, in the run's order; all for None."""
    if not text:
        return tuple(points)
    wanted = [item.strip().split(":") for item in text.split(",") if item.strip()]
    names = lambda w, p: w[0] == p.kernel and (len(w) == 1 or w[1:] == [p.cache_dtype])
    # every item must name a point: one that names none would be skipped on the GPU, its minutes spent for nothing
    unknown = [":".join(w) for w in wanted if not any(names(w, p) for p in points)]
    if unknown or not wanted:
        raise ValueError(f"--only {text!r}: {', '.join(unknown) or 'nothing'} names no point; points are "
                         + ", ".join(sorted({f"{p.kernel}:{p.cache_dtype}" for p in points})))
    return tuple(p for p in points if any(names(w, p) for w in wanted))


def entry_key(e: dict) -> tuple:
    return (e["device"], e["kernel"], e.get("cache_dtype"), e.get("min_tokens"), e.get("max_tokens"))


def write_table(table, entries: list, commit: str) -> None:
    """Put these entries into the table (default the package's), stamped with the commit, replacing the entries of
    the same device, kernel, cache dtype and token range (other points' entries stay)."""
    from swiftkv_jax.kernels.tuning import TABLE

    table = table or TABLE
    data = json.loads(table.read_text()) if table.exists() else {"entries": []}
    for e in entries:
        e["measured"]["commit"] = commit
    new = {entry_key(e) for e in entries}
    data["entries"] = [e for e in data.get("entries", []) if entry_key(e) not in new] + entries
    table.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {len(entries)} entries to {table}")


def tuning_results(data: dict) -> list:
    """This script's results in a file: its own --out, or the GPU pack's record of its `tune` step (tune.json, each
    command's result kept)."""
    if "entries" in data:
        return [data]
    found = [c["result"] for c in data.get("commands", []) if isinstance(c.get("result"), dict)
             and "entries" in c["result"]]
    if not found:
        raise SystemExit("no tuning results in that file: give a tune_kernels.py --out or the GPU pack's tune.json")
    return found


class Kernels:
    """The kernels under tuning: their calls (block sizes first, then `inputs`' arrays), references, block-size
    types, defaults and inputs, at Llama-3.1-8B's heads (tiny heads for --smoke)."""

    def __init__(self, smoke: bool, interpret: bool):
        import jax
        import jax.numpy as jnp

        from swiftkv_jax import kernels as sk

        self.jax, self.jnp = jax, jnp
        self.heads, self.kv_heads, self.head_dim = (8, 2, 64) if smoke else (32, 8, 128)
        self._keys = iter(jax.random.split(jax.random.key(0), 256))
        mode = dict(interpret=interpret)
        flash_call = lambda fn: lambda s, q, k, v, p, g: fn(q, k, v, p, p, g, g, block_sizes=s, **mode)  # noqa: E731
        split_call = lambda fn: (lambda s, *x: fn(*x[:-2], block_sizes=s, k_scale=x[-2], v_scale=x[-1],  # noqa: E731
                                                    **mode))
        self.call = {"flash": flash_call(sk.flash_attention), "mosaic_flash": flash_call(sk.flash_attention_mgpu),
                     "decode": split_call(sk.decode_attention), "mosaic_decode": split_call(sk.decode_attention_mgpu),
                     "paged": split_call(sk.paged_attention), "mosaic_paged": split_call(sk.paged_attention_mgpu)}
        to_bskh = lambda x: None if x is None else jnp.swapaxes(x, 1, 2)  # noqa: E731 - [B, K, S(, H)] -> [B, S, K(, H)]
        self.reference = {
            "flash": lambda q, k, v, p, g: sk.flash_attention_reference(q, k, v, p, p, g, g),
            "decode": lambda *x: sk.decode_attention_reference(*x[:-2], k_scale=x[-2], v_scale=x[-1]),
            "paged": lambda *x: sk.paged_attention_reference(*x[:-2], k_scale=x[-2], v_scale=x[-1]),
            "mosaic_decode": lambda q, k, v, n, p, ks, vs: sk.decode_attention_reference(
                q, to_bskh(k), to_bskh(v), n, p, k_scale=to_bskh(ks), v_scale=to_bskh(vs))}
        self.reference["mosaic_flash"], self.reference["mosaic_paged"] = (self.reference["flash"],
                                                                          self.reference["paged"])
        self.sizes = {"flash": sk.FlashBlockSizes, "decode": sk.DecodeBlockSizes, "paged": sk.DecodeBlockSizes,
                      "mosaic_flash": sk.MosaicFlashBlockSizes, "mosaic_decode": sk.MosaicDecodeBlockSizes,
                      "mosaic_paged": sk.MosaicDecodeBlockSizes}
        self.defaults = {**{k: cls() for k, cls in self.sizes.items()},
                         "flash": sk.FlashBlockSizes.for_head_dim(self.head_dim)}

    def _normal(self, *shape):
        return self.jax.random.normal(next(self._keys), shape, self.jnp.bfloat16)

    def _cache(self, shape, cache_dtype):
        """(values, scales or None): a bf16 cache of `shape`, quantised per token and head as the engines store it."""
        from swiftkv_jax.model.kv_quant import quantize

        return quantize(self._normal(*shape), cache_dtype)

    def inputs(self, kernel: str, cache_dtype: str, shape: dict) -> tuple:
        """The arrays of one call at `shape`: the queries, K / V, positions / lengths / tables, and for the split-K
        kernels the scales last (k_scale, v_scale: None over a 16-bit cache; arguments, not constants of the
        compiled call)."""
        jnp, heads, kv_heads, h = self.jnp, self.heads, self.kv_heads, self.head_dim
        if kernel.endswith("flash"):
            b, t = shape["batch"], shape["tokens"]
            p = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            kv = lambda: self._normal(b, t, kv_heads, h)  # noqa: E731
            return self._normal(b, t, heads, h), kv(), kv(), p, jnp.zeros((b, t), jnp.int32)
        b, s = shape["batch"], shape["context"]
        q = self._normal(b, 1, heads, h)
        lengths, positions = jnp.full((b,), s, jnp.int32), jnp.full((b, 1), s - 1, jnp.int32)
        if kernel.endswith("paged"):
            page = shape["page_size"]
            pages = s // page
            table = self.jax.random.permutation(next(self._keys), jnp.arange(1, b * pages + 1, dtype=jnp.int32))
            (k, ks), (v, vs) = (self._cache((kv_heads, b * pages + 1, page, h), cache_dtype) for _ in "kv")
            return q, k, v, table.reshape(b, pages), lengths, positions, ks, vs
        layout = (b, kv_heads, s, h) if kernel == "mosaic_decode" else (b, s, kv_heads, h)
        (k, ks), (v, vs) = (self._cache(layout, cache_dtype) for _ in "kv")
        return q, k, v, lengths, positions, ks, vs


def tune_point(kernels: Kernels, point: Point, candidates: list, repeats: int, stop_at: float, rows: list,
               clock=time.monotonic, on_best=None) -> dict:
    """Time the defaults, then every candidate, at the point's shapes, until the deadline; rows are appended to
    `rows` as measured. The fastest that agrees with the reference wins (the defaults may: an entry is never slower
    than no entry). Each candidate faster than the best so far is checked as soon as it is timed, and
    `on_best(outcome)` gets the outcome as it stands, so that a run killed inside a candidate (a compile can outlast
    the deadline by minutes) has kept the point's checked best. Returns the outcome: status, and the winner's block
    sizes, score, per-shape times and the defaults' score when there is one."""
    import numpy as np

    jax, jnp = kernels.jax, kernels.jnp
    inputs = [kernels.inputs(point.kernel, point.cache_dtype, shape) for shape in point.shapes]
    call = kernels.call[point.kernel]
    wanted = []  # the reference at each shape, over the same (quantised) cache, fp32 products (no TF32)
    with jax.default_matmul_precision("highest"):
        for args in inputs:
            wide = tuple(a.astype(jnp.float32) if a is not None and a.dtype == jnp.bfloat16 else a for a in args)
            wanted.append(np.asarray(kernels.reference[point.kernel](*wide), np.float32))

    def disagreement(sizes):
        """None if these block sizes agree with the reference at every shape, else the largest difference."""
        for args, want in zip(inputs, wanted):
            out = np.asarray(call(sizes, *args), np.float32)
            # Tolerances on the output's own scale: over 32K random keys an output is ~0.006, so a fixed atol of
            # a few 1e-3 would pass a block of keys missed or read twice; bf16 P and output rounding stay < 1%.
            if not np.allclose(out, want, rtol=1e-2, atol=1e-2 * float(np.sqrt(np.mean(want ** 2)))):
                return float(np.abs(out - want).max())
        return None

    outcome = dict(candidates_run=0, candidates=len(candidates) + 1, default_time_s=None, disagreed=[])
    best = None  # the checked best: dict(block_sizes, time_s, shape_times_s)
    for fields in ["default"] + candidates:
        if clock() > stop_at:
            break
        outcome["candidates_run"] += 1
        sizes = kernels.defaults[point.kernel] if fields == "default" else kernels.sizes[point.kernel](**fields)
        row = dict(kernel=point.kernel, cache_dtype=point.cache_dtype, block_sizes=vars(sizes).copy(),
                   default=fields == "default", shapes=[])
        try:
            for shape, args in zip(point.shapes, inputs):
                t, compile_s = timed(lambda *a, s=sizes: call(s, *a), *args, repeats=repeats)
                row["shapes"].append(dict(shape, time_s=t, compile_s=compile_s))
            row["time_s"] = math.exp(sum(math.log(r["time_s"]) for r in row["shapes"]) / len(row["shapes"]))
        except Exception as e:  # noqa: BLE001 - a candidate that does not fit is recorded, not hidden
            row["error"] = error_line(e)
        print("measured", row, file=sys.stderr, flush=True)
        rows.append(row)
        if "time_s" not in row:
            continue
        if row["default"]:
            outcome["default_time_s"] = row["time_s"]
        if best is None or row["time_s"] < best["time_s"]:
            diff = disagreement(sizes)
            if diff is not None:
                outcome["disagreed"].append(dict(block_sizes=vars(sizes).copy(), max_abs_diff=diff))
                continue
            best = dict(block_sizes=sizes, time_s=row["time_s"], shape_times_s=[r["time_s"] for r in row["shapes"]])
            if on_best is not None:
                on_best(dict(outcome, **best, status=f"tuned over {outcome['candidates_run']} of "
                                                     f"{outcome['candidates']} so far (the run was cut)"))
    partial = outcome["candidates_run"] < outcome["candidates"]
    if best is not None:
        status = f"tuned over {outcome['candidates_run']} of {outcome['candidates']} (the deadline)" if partial \
            else "tuned"
        return dict(outcome, **best, status=status)
    timed_any = any("time_s" in r for r in rows[len(rows) - outcome["candidates_run"]:])
    status = ("stopped at the deadline" if partial and not timed_any else "no candidate ran" if not timed_any
              else "every candidate that ran disagrees with the reference")
    return dict(outcome, status=status)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, kernels interpreted: checks the script")
    parser.add_argument("--repeats", type=int, default=None, help="timed samples per candidate (default 10, smoke 1)")
    parser.add_argument("--only", default=None, help="points to tune: kernel or kernel:cache_dtype, comma-separated "
                                                     "(e.g. mosaic_decode,paged:int8); default all, in order")
    parser.add_argument("--deadline", type=float, default=None, help="seconds after which no point or candidate "
                                                                     "starts, results so far kept (default: none)")
    parser.add_argument("--write", action="store_true", help="record the winners in the table")
    parser.add_argument("--table", default=None, help="the table to write (default the package's tuned_blocks.json)")
    parser.add_argument("--out", default=None, help="JSON of every candidate's time, rewritten after each point "
                                                    "(default benchmarks/results/tune_kernels_<platform>.json; with "
                                                    "--smoke /tmp/swiftkv_jax_tune_smoke.json)")
    parser.add_argument("--from-results", nargs="+", default=None, help="write the winners of earlier runs' --out "
                                                                          "JSON into the table, measuring nothing")
    args = parser.parse_args(argv)
    table = Path(args.table) if args.table else None
    if args.from_results:
        for path in args.from_results:
            for result in tuning_results(json.loads(Path(path).read_text())):
                write_table(table, result["entries"], result["commit"])
        return 0

    import jax

    device = jax.devices()[0]
    if device.platform != "gpu" and not args.smoke:
        print("benchmarks/tune_kernels.py tunes GPU kernels and this machine has none; --smoke checks the script",
              file=sys.stderr)
        return 2
    interpret = device.platform != "gpu"
    repeats = args.repeats or (1 if args.smoke else 10)
    points = parse_only(args.only, SMOKE_POINTS if args.smoke else POINTS)
    stop_at = time.monotonic() + (args.deadline if args.deadline is not None else float("inf"))
    kernels = Kernels(args.smoke, interpret)
    out = args.out or ("/tmp/swiftkv_jax_tune_smoke.json" if args.smoke else
                       f"benchmarks/results/tune_kernels_{device.platform}.json")
    rows, entries, outcomes = [], [], []

    def save():
        write_results(out, "benchmarks/tune_kernels.py", argv,
                      {"device": device.device_kind, "interpret": interpret, "repeats": repeats, "rows": rows,
                       "entries": entries, "points": outcomes})

    def settled(point: Point, outcome: dict) -> tuple:
        """(the point's outcome as recorded, its table entry or None) from tune_point's outcome."""
        outcome = dict(outcome)
        best, default_time = outcome.pop("block_sizes", None), outcome["default_time_s"]
        if best is None:
            return dict(point._asdict(), **outcome), None
        entry = dict(kernel=point.kernel, device=device.device_kind,
                     compute_capability=getattr(device, "compute_capability", None), head_dim=kernels.head_dim,
                     group=kernels.heads // kernels.kv_heads, cache_dtype=point.cache_dtype,
                     min_tokens=point.tokens[0], block_sizes=vars(best).copy(),
                     measured=dict(shapes=list(point.shapes), time_s=outcome["time_s"],
                                   shape_times_s=outcome["shape_times_s"], default_time_s=default_time,
                                   candidates_run=outcome["candidates_run"], candidates=outcome["candidates"],
                                   score="geometric mean over the shapes"))
        if point.tokens[1] is not None:
            entry["max_tokens"] = point.tokens[1]
        outcome["speedup_over_default"] = None if default_time is None else default_time / outcome["time_s"]
        return dict(point._asdict(), **outcome), entry

    def save_with(point: Point, outcome: dict):
        """The file as it stands, this point's best so far in it (a run killed inside a candidate keeps it)."""
        recorded, entry = settled(point, outcome)
        write_results(out, "benchmarks/tune_kernels.py", argv,
                      {"device": device.device_kind, "interpret": interpret, "repeats": repeats, "rows": rows,
                       "entries": entries + ([entry] if entry else []), "points": outcomes + [recorded]})

    for point in points:
        label = f"{point.kernel} {point.cache_dtype} {list(point.shapes)}"
        if time.monotonic() > stop_at:
            outcomes.append(dict(point._asdict(), status="not started (deadline)"))
            continue
        candidates = candidates_for(point, args.smoke)
        outcome = tune_point(kernels, point, candidates, repeats, stop_at, rows,
                             on_best=functools.partial(save_with, point))
        recorded, entry = settled(point, outcome)
        if entry is None:
            print(f"{label}: {outcome['status']}; nothing kept", flush=True)
        else:
            default_time = outcome["default_time_s"]
            print(f"{label}: {outcome['block_sizes']} {outcome['time_s'] * 1e3:.3f} ms (defaults "
                  f"{'failed' if default_time is None else f'{default_time * 1e3:.3f} ms'})", flush=True)
            entries.append(entry)
        outcomes.append(recorded)
        save()
    save()
    if args.write:
        write_table(table, entries, commit())
    return 0


if __name__ == "__main__":
    sys.exit(main())
