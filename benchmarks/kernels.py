"""Attention kernels on the GPU: the few-query (decode) kernel and the prefill flash kernel, against their rivals.

    python benchmarks/kernels.py [--parts decode,paged,prefill] [--page-size 16,32] [--deadline S] [--repeats 20]
                                 [--profile-at 32x4096] [--rivals targets|all] [--layers 16] [--out PATH]
                                 [--decode-points 32x4096,32x8192] [--prefill-points 1x8192,1x2048]
    python benchmarks/kernels.py --smoke   # any machine: tiny shapes, kernels in interpret mode on CPU
    python benchmarks/kernels.py --fits-of benchmarks/results/gpu-DATE/kernels.json   # any machine: cost fits

Llama-3.1-8B heads (32 query heads, 8 KV heads, head_dim 128), bf16.
- Decode: one query token per sequence over a full cache, batch 32..256 x context 2K..32K (K/V of a layer at most
  16 GiB), dense and paged (bf16, and int8 / FP8 pools with per-token scales; pages of each --page-size). Reported
  as the memory bandwidth achieved (bytes of K and V read / time), beside the device's measured bandwidth: the
  larger of two probes over a [n / 8192, 8192] array of --copy-gib GiB, a copy (jitted `x + 1`, bytes read +
  written / time) and a read (a sum over the last axis into fp32, bytes read / time). Rivals: XLA
  (`attend_cache("xla")`, the engine's default) and jax's bundled Pallas decode kernel
  (`pallas.ops.gpu.decode_attention.gqa`; its API takes K/V as [B, K, S, H], so it transposes the cache on every
  call, and that copy is part of its time), and ours on Mosaic GPU (`mosaic`: decode_attention_mgpu, the dense
  cache read in place by TMA, wgmma, FA3's P V form; `mosaic_smem`: the form jax's interpreter runs, compiled;
  `mosaic_2cta`: 64-key blocks in 2 slots, small enough that two CTAs share an SM; paged: paged_attention_mgpu, one
  TMA copy per page). Paged `pallas_f16_<fmt>`: our Triton kernel over a 1-byte
  pool with its values converted straight to fp16 (`DecodeBlockSizes.dequant_dtype`), at the default block sizes,
  beside `pallas_<fmt>` (to bf16 through fp32, at the tuning table's block sizes where it has some: until a GPU
  run fills the table, the same defaults).
- Prefill: causal self-attention, batch 1..4 x 2K..32K tokens, in TFLOP/s of causal FLOPs
  4 * B * N * T * T * H / 2, and packed (documents of 2K tokens with segment ids: each its own triangle). Rivals:
  cuDNN (`jax.nn.dot_product_attention(implementation="cudnn")`, causal flag), the engine's cuDNN path
  (attention_impl="cudnn": our position mask as a bias), jax's Mosaic GPU kernel (`attention_mgpu`, causal, no
  segments: what Pallas on Hopper reaches; `jax_mosaic_fp16`: it supports float16 only, so it runs on float16
  copies of the inputs, q scaled by 1/sqrt(H) as it does not, made before timing), jax's Pallas Triton kernel
  (`jax_triton`: `mha`, causal, at its default blocks, K/V heads repeated to the query heads before timing: what
  Triton-Pallas reaches, beside ours, `pallas`), ours on Mosaic GPU (`mosaic`:
  flash_attention_mgpu in FA3's form; `mosaic_smem`: the form jax's interpreter runs, compiled;
  `mosaic_float8_e4m3fn`: K/V from an FP8 cache, which the engines dequantise with XLA before the kernel) and XLA
  (`xla_attention`, fp32 logits [B, N, T, T]: it runs out of memory at the largest shapes, reported so).
`--decode-points` / `--prefill-points` replace the grids by the points given (every implementation timed at each: a
short GPU call for the points still open). Rows are written to the JSON as they are measured (`--deadline S`: no
point is started after S seconds, the rest recorded as not measured; `complete` says whether the run finished).
The points the targets need come first
(decode at batch 32 and 128 x context 4K, 8K, 32K; prefill 8K x 1, 8K x 4, 32K x 1), the rest after. Each
implementation is first checked at one small shape (a quantised row against the XLA path over the same quantised
cache, any other against an fp32 reference); one that disagrees, fails or refuses the shape gets one row with its
error and is not timed. Timings: compiled first, then the median of --repeats samples, each `inner` calls
enqueued back to back and waited for once (inner set so that a sample lasts at least 2 ms: a small kernel's
dispatch latency hides behind the calls queued before it), divided by inner.
Layers (--layers L, default 16): at LAYERED_POINTS (right after their own single-call rows, ahead of the other
points) the engines' decode paths (LAYERED: the static engine's, and sk.Engine's paged ones at the first
--page-size) are also timed as a decode step runs them, L layers' caches attended one after another in one program
(at most MAX_KV_GIB of K/V in all), and reported per layer: one call of one layer pays a launch and its XLA ops
apart, which a step spreads over its layers.
Rivals (--rivals targets, the default on a GPU): the implementations the engines run by default on sm_90 and our
kernels are timed at every point; the others (RIVALS: jax's kernels, the Triton kernels' transposing or quantised
dense forms, XLA's paged path and prefill, the interpreter forms compiled, cuDNN with our mask) at the targets'
points only, so that one bounded GPU call covers every point of our kernels (on 2026-11-25 the deadline stopped the
tables at a third of their rows). `--rivals all` times every implementation everywhere.
Profiles (--profile-at BxS, default 32x4096 on a GPU: the decode target's point furthest from the bandwidth): the
PROFILED decode and paged rows timed at such a point (decode-step rows included) are then traced
(benchmarks/op_profile.py, compiled again without XLA's command buffers, which hide each op) for PROFILE_CALLS
calls, so its row says how much of its time is the kernel and how much the XLA ops around it (laying out q, the row
limits, merging the splits).
Cost fits (printed under each decode table, `cost_fits` in the JSON; `--fits-of` computes them from a results file
already written): each implementation's rows of one batch (and page size; a decode step's rows per layer) fitted to
time = fixed + K/V bytes / stream. On the 2026-11-25 H200 run, at batch 32, our Mosaic kernel streamed at 4020 GB/s
(102% of the measured bandwidth) past ~98 us a call, XLA at 3252 GB/s past ~30 us: the decode target at 32 x 4K
(~134 us of bytes) is lost to the fixed part, which the decode-step rows say whether a step pays once per layer.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time

import op_profile
from results_file import DefaultsFormatter, write_results

SMOKE_OUT = "/tmp/swiftkv_jax_kernels_smoke.json"
MAX_KV_GIB = 16  # decode points whose K/V (one layer) would exceed this are left out
DOCUMENT = 2048  # tokens per document of the packed prefill rows (segment ids)
PROFILE_CALLS = 10  # traced calls of a profiled row
LAYERED_POINTS = ((32, 4096), (32, 8192))  # decode points (batch, context) furthest from the bandwidth target
# Per table, the paths timed as a decode step runs them (--layers). Static: the engine's defaults on sm_90 (bf16,
# 1-byte caches), XLA's bf16, the Mosaic kernel at two CTAs an SM. Paged (pages of the first --page-size):
# sk.Engine's Triton kernel over each cache dtype, and the Mosaic one.
LAYERED = {"decode": ("mosaic", "xla", "xla_int8", "mosaic_2cta"),
           "paged": ("pallas", "pallas_int8", "pallas_float8_e4m3fn", "mosaic")}
PROFILED = {"decode": {"mosaic", "mosaic_smem", "mosaic_2cta", "xla"}, "paged": {"pallas", "mosaic"}}  # --profile-at
# Per table, the implementations `--rivals targets` times at the targets' points only (see the docstring)
_QUANTIZED_TRITON = ("pallas_int8", "pallas_float8_e4m3fn")
RIVALS = {
    "decode": {"pallas", "pallas_bskh", "jax_pallas", "mosaic_2cta", *_QUANTIZED_TRITON},
    "paged": {"xla", "xla_int8", "xla_float8_e4m3fn", "pallas_f16_int8", "pallas_f16_float8_e4m3fn"},
    "prefill": {"xla", "jax_mosaic_fp16", "jax_triton", "mosaic_smem", "cudnn_mask"},
}


def cost_fits(rows: list, measured_bw: float) -> list:
    """Where a decode kernel's time goes beyond streaming K/V: per implementation (and page size, batch, and
    single call or decode step) timed at two or more contexts, the least-squares line time = fixed + bytes /
    stream through its rows (a decode-step row per layer: its time and bytes / layers). `fixed_s` is what a call
    (or a layer of a step) costs whatever the context (launch, XLA ops around the kernel, each CTA's start and
    epilogue, splits merged); `stream_bandwidth` is how fast the kernel reads the bytes past that. At two contexts
    the line passes through both rows; `worst_residual` (relative) says how well it fits more."""
    import numpy as np

    groups: dict = {}
    for r in rows:
        if "time_s" not in r or "kv_bytes" not in r:
            continue
        layers = r.get("layers", 1)
        key = (r["impl"], r.get("page_size"), r["batch"], r.get("layers"))
        groups.setdefault(key, []).append((r["context"], r["kv_bytes"] / layers, r["time_s"] / layers))
    fits = []
    for (impl, page_size, batch, layers), points in groups.items():
        if len({c for c, _, _ in points}) < 2:
            continue
        nbytes, seconds = (np.array([p[i] for p in points], np.float64) for i in (1, 2))
        per_byte, fixed = np.polyfit(nbytes, seconds, 1)
        stream = 1 / per_byte if per_byte > 0 else None
        fits.append({"impl": impl, "page_size": page_size, "batch": batch, "layers": layers,
                     "contexts": sorted(c for c, _, _ in points), "fixed_s": float(fixed),
                     "stream_bandwidth": stream and float(stream),
                     "stream_of_measured": stream and float(stream / measured_bw),
                     "worst_residual": float(np.max(np.abs(fixed + per_byte * nbytes - seconds) / seconds))})
    return fits


def print_cost_fits(fits: list, title: str) -> None:
    if not fits:
        return
    print(f"\n{title}: time = fixed + K/V bytes / stream, fitted over each implementation's contexts (per layer "
          f"for a decode step's rows)")
    print(f"{'impl':<26}{'page':>6}{'batch':>6}  {'contexts':<22}{'fixed us':>10}{'stream GB/s':>13}"
          f"{'of measured':>13}{'residual':>10}")
    for f in fits:
        impl = f"{f['impl']}, {f['layers']} layers" if f["layers"] else f["impl"]
        stream = (f"{f['stream_bandwidth'] / 1e9:>13.0f}{f['stream_of_measured']:>13.1%}" if f["stream_bandwidth"]
                  else f"{'-':>13}{'-':>13}")
        print(f"{impl:<26}{f['page_size'] or '-':>6}{f['batch']:>6}  {','.join(map(str, f['contexts'])):<22}"
              f"{f['fixed_s'] * 1e6:>10.1f}{stream}{f['worst_residual']:>10.1%}")


def print_fits_of(path: str) -> int:
    """--fits-of: the cost fits of a results file already written (this script's JSON, or a GPU pack step's whose
    commands hold it), computed from its rows."""
    import json
    from pathlib import Path

    record = json.loads(Path(path).read_text())
    results = [record] if "decode" in record else [c["result"] for c in record.get("commands", [])
                                                   if isinstance(c.get("result"), dict) and "decode" in c["result"]]
    if not results:
        print(f"{path} holds no benchmarks/kernels.py results (no decode / paged rows)", file=sys.stderr)
        return 2
    for result in results:  # runs before 2026-11-25 measured a copy only
        measured = result.get("measured_bandwidth") or result["copy"]["bandwidth"]
        print(f"\n{result['command']}: {result.get('device')}, commit {result.get('commit', '?')[:12]}, measured "
              f"bandwidth {measured / 1e9:.0f} GB/s")
        for table in ("decode", "paged"):
            print_cost_fits(cost_fits(result.get(table, []), measured), f"{table} cost fits")
    return 0


def error_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"


def timed(fn, *inputs, repeats: int, sample_s: float = 2e-3, max_inner: int = 200) -> tuple[float, float]:
    """(seconds a call, compile seconds) of jit(fn)(*inputs): compiled first (timed), run once to warm up and once
    more to set `inner` (enough calls for a sample of at least sample_s, at most max_inner), then `repeats` samples
    of `inner` calls enqueued back to back and waited for together: the median sample / inner. One call waited for
    alone would add the launch and dispatch latency to a kernel of a fraction of a millisecond."""
    import jax

    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*inputs).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(*inputs))
    start = time.perf_counter()
    jax.block_until_ready(compiled(*inputs))
    inner = max(1, min(max_inner, math.ceil(sample_s / max(time.perf_counter() - start, 1e-9))))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready([compiled(*inputs) for _ in range(inner)])  # every output: backends may overlap calls
        times.append(time.perf_counter() - start)
    return statistics.median(times) / inner, compile_s


def memory_bandwidth(gib: float, dtype="bfloat16", repeats: int = 20) -> dict:
    """The device's memory bandwidth, the larger of two probes over an array of `gib` GiB shaped [n / 8192, 8192]:
    a copy (jitted `x + 1`, bytes read + written / time) and a read (a sum over the last axis into fp32, bytes read
    / time; its output is 1/8192 of the input). The copy alone underestimates: on an H200 decode kernels reading
    K/V outran it by half. {"bytes", "copy": {"bytes", "shape", "time_s", "bandwidth"}, "read": {...}, "bandwidth"}
    (bytes of the array, seconds, bytes/s)."""
    import jax.numpy as jnp

    x = jnp.ones((max(1, int(gib * 2**30) // jnp.dtype(dtype).itemsize // 8192), 8192), dtype)
    probes = {}
    for name, fn, passes in (("copy", lambda a: a + 1, 2), ("read", lambda a: a.sum(-1, dtype=jnp.float32), 1)):
        seconds, _ = timed(fn, x, repeats=repeats)
        probes[name] = {"bytes": x.nbytes, "shape": list(x.shape), "time_s": seconds,
                        "bandwidth": passes * x.nbytes / seconds}
    return {"bytes": x.nbytes, **probes, "bandwidth": max(p["bandwidth"] for p in probes.values())}


def leading(points, first) -> list:
    """points, those of `first` among them ahead of the rest (in first's order): a --deadline cuts the rest short."""
    return [p for p in first if p in points] + [p for p in points if p not in first]


def profiled(fn, inputs, calls: int = PROFILE_CALLS) -> dict:
    """op_profile's summary of `calls` calls of jit(fn)(*inputs), compiled without command buffers on a GPU (their
    CUDA graphs show as ops with no HLO behind them); its top ops only."""
    import jax

    compiled = op_profile.compile_for_profile(jax.jit(fn).lower(*inputs))
    jax.block_until_ready(compiled(*inputs))
    return op_profile.profile_steps(lambda: compiled(*inputs), calls, compiled.as_text(), top=8)


def _points(text: str) -> tuple:
    """'32x4096,128x8192' -> ((32, 4096), (128, 8192)); '' -> ()."""
    try:
        return tuple(tuple(int(n) for n in x.lower().split("x")) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(text) from None


def _non_negative(text: str) -> int:
    if int(text) < 0:
        raise ValueError(text)
    return int(text)


def _page_sizes(text: str) -> tuple:
    sizes = tuple(int(x) for x in text.split(",") if x.strip())
    if not sizes or min(sizes) < 1:
        raise ValueError(text)
    return sizes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode on CPU: checks the script")
    parser.add_argument("--repeats", type=int, help="timed samples per point (default 20, smoke 2)")
    parser.add_argument("--copy-gib", type=float, help="size of the bandwidth probes' array (default 2, smoke 1/64)")
    parser.add_argument("--parts", default="decode,paged,prefill",
                        help="which tables to measure, comma-separated (default decode,paged,prefill)")
    parser.add_argument("--page-size", type=_page_sizes, default=(16, 32), metavar="SIZES",
                        help="tokens a page in the paged rows, comma-separated, each point timed at each (default "
                             "16,32: sk.Engine's 16, and 32, the least the Mosaic kernel's per-token scales take)")
    parser.add_argument("--profile-at", type=_points, default=None, metavar="BxS,...",
                        help="decode / paged points (batch x context) whose rows are also traced: the kernel's time "
                             "apart from the XLA ops around it (default 32x4096 on a GPU, none elsewhere; '' none)")
    parser.add_argument("--rivals", choices=("targets", "all"), default=None,
                        help="where RIVALS are timed: at the targets' points only (default on a GPU) or at every "
                             "point (default in --smoke)")
    parser.add_argument("--layers", type=_non_negative, default=None,
                        help="layers of the decode-step rows at LAYERED_POINTS (default 16, smoke 2; 0: none)")
    parser.add_argument("--decode-points", type=_points, default=None, metavar="BxS,...",
                        help="the decode and paged tables' points (batch x context) instead of the whole grid; every "
                             "implementation is timed at each (they count as the targets' points)")
    parser.add_argument("--prefill-points", type=_points, default=None, metavar="BxT,...",
                        help="the prefill table's points (batch x tokens), likewise")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds after which no new point is started, rows so far kept and the JSON saying so "
                             "(default: none)")
    parser.add_argument("--fits-of", metavar="JSON", help="print the decode and paged cost fits of a results file "
                                                           "already written (any machine) and exit")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/kernels_<platform>.json; "
                                      f"with --smoke {SMOKE_OUT})")
    args = parser.parse_args(argv)
    if args.fits_of:
        return print_fits_of(args.fits_of)
    parts = set(args.parts.split(","))
    if not parts or parts - {"decode", "paged", "prefill"}:
        parser.error(f"--parts {args.parts!r}: choose from decode, paged, prefill")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from swiftkv_jax.kernels.decode_attention import decode_attention
    from swiftkv_jax.kernels.decode_attention_mgpu import MosaicDecodeBlockSizes, decode_attention_mgpu
    from swiftkv_jax.kernels.flash_attention import flash_attention
    from swiftkv_jax.kernels.flash_attention_mgpu import flash_attention_mgpu
    from swiftkv_jax.kernels.paged_attention import paged_attention
    from swiftkv_jax.kernels.split_k import DecodeBlockSizes
    from swiftkv_jax.model.attention import attend, attend_cache, xla_attention
    from swiftkv_jax.model.kv_quant import dequantize_pair, quantize
    from swiftkv_jax.model.paged import paged_attend

    name_quantized = lambda name: name.endswith(("_int8", "_float8_e4m3fn"))  # noqa: E731
    two_ctas = MosaicDecodeBlockSizes(block_kv=64, max_concurrent_steps=2)  # `mosaic_2cta`

    device = jax.devices()[0]
    if device.platform != "gpu" and not args.smoke:
        print(f"benchmarks/kernels.py times GPU kernels: it needs a GPU, and this machine's JAX backend is "
              f"{device.platform!r}. Nothing was measured. `--smoke` runs tiny shapes in interpret mode to "
              f"check that the script works.", file=sys.stderr)
        return 2
    interpret = device.platform == "cpu"
    repeats = args.repeats or (2 if args.smoke else 20)
    rivals_at = args.rivals or ("all" if args.smoke else "targets")
    profile_at = set(args.profile_at if args.profile_at is not None else
                     ((32, 4096),) if device.platform == "gpu" else ())
    if args.layers is None:
        args.layers = 2 if args.smoke else 16
    if args.smoke:  # tiny, and N / K = 4 as in Llama-3.1-8B
        heads, kv_heads, head_dim = 8, 2, 32
        decode_points, prefill_points = [(2, 256), (2, 512)], [(1, 64), (2, 128)]
        decode_targets, prefill_targets = decode_points[:1], prefill_points[:1]
    else:
        heads, kv_heads, head_dim = 32, 8, 128
        # K and V of one layer at most MAX_KV_GIB: 256 x 32K would be 34 GB of bf16. The targets' points first:
        # decode at batch >= 32 and context >= 4K, prefill 8K causal against cuDNN.
        decode_targets = [(b, s) for b in (32, 128) for s in (4096, 8192, 32768)]
        prefill_targets = [(1, 8192), (4, 8192), (1, 32768)]
        decode_points = leading([(b, s) for b in (32, 64, 128, 256) for s in (2048, 4096, 8192, 16384, 32768)
                                 if 2 * b * s * kv_heads * head_dim * 2 <= MAX_KV_GIB * 2**30], decode_targets)
        prefill_points = leading([(b, t) for t in (2048, 8192, 16384, 32768) for b in (1, 2, 4)], prefill_targets)

    # chosen points replace the grid and count as the targets' (every rival timed at each), in the order given
    if args.decode_points is not None:
        decode_points = decode_targets = list(args.decode_points)
    if args.prefill_points is not None:
        prefill_points = prefill_targets = list(args.prefill_points)
    layered_points = [p for p in (((2, 256),) if args.smoke else LAYERED_POINTS) if p in decode_points
                      ] if args.layers else []

    def timed_here(table: str, name: str, point: tuple) -> bool:
        """Whether `name` is timed at this point of `table` (`--rivals`)."""
        return rivals_at == "all" or name not in RIVALS[table] or point in (
            prefill_targets if table == "prefill" else decode_targets)
    copy_gib = args.copy_gib or (1 / 64 if args.smoke else 2.0)
    dtype = jnp.bfloat16
    keys = iter(jax.random.split(jax.random.key(0, impl="rbg"), 1024))
    normal = lambda *shape: jax.jit(lambda k: jax.random.normal(k, shape, dtype))(next(keys))

    document = 32 if args.smoke else DOCUMENT  # the packed prefill rows' documents
    started = time.perf_counter()
    tables = {"decode": [], "paged": [], "prefill": []}
    out = args.out or (SMOKE_OUT if args.smoke else f"benchmarks/results/kernels_{device.platform}.json")

    def save(complete: bool) -> None:
        write_results(out, "benchmarks/kernels.py", argv, {
            "device": device.device_kind, "platform": device.platform, "jax": jax.__version__, "smoke": args.smoke,
            "interpret": interpret, "repeats": repeats, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "dtype": "bfloat16", "copy": memory["copy"], "read": memory["read"],
            "measured_bandwidth": memory["bandwidth"], "parts": sorted(parts), "page_sizes": list(args.page_size),
            "document_tokens": document, "deadline_s": args.deadline, "complete": complete,
            "rivals_at": rivals_at, "rivals": {k: sorted(v) for k, v in RIVALS.items()},
            "target_points": {"decode": decode_targets, "prefill": prefill_targets}, **tables,
            "cost_fits": {t: cost_fits(tables[t], memory["bandwidth"]) for t in ("decode", "paged")}}, quiet=True)

    def measure(table: str, row: dict, error, fn=None, inputs=None, derived=None, profile=False) -> dict:
        """row + timings and derived(seconds), or + the error that kept it from being timed, appended to its table;
        the JSON is rewritten after every row (and each logged to stderr), so a run stopped by a time limit
        leaves what it measured. `inputs()` makes fn's inputs, so that none are made past --deadline, where a row
        is recorded as not measured. profile: the timed row is also traced (`profiled`; its failure is recorded
        as profile_error, the timing stands)."""
        if args.deadline is not None and time.perf_counter() - started > args.deadline:
            error = error or f"not measured: past --deadline {args.deadline:g} s"
        if error is None:
            try:
                made = inputs()
                seconds, compile_s = timed(fn, *made, repeats=repeats)
                row = {**row, "time_s": seconds, "compile_s": compile_s, **derived(seconds)}
            except Exception as e:  # noqa: BLE001 - reported in the row, never hidden
                row = {**row, "error": error_line(e)}
            if profile and "error" not in row:
                try:
                    row["profile"] = profiled(fn, made)
                except Exception as e:  # noqa: BLE001 - recorded beside the timing
                    row["profile_error"] = error_line(e)
        else:
            row = {**row, "error": error}
        print("measured", row, file=sys.stderr, flush=True)
        tables[table].append(row)
        save(complete=False)
        return row

    def check(name, fn, reference, inputs) -> str | None:
        """None if fn agrees with its reference at these (small) inputs, else why not. A quantised row's cache is
        quantised once, from the bf16 inputs, and both fn and the reference (the XLA path, q in fp32) read that
        same cache: quantised apart, in and out of jit, a value at a rounding boundary can differ by an FP8 ulp
        between them. Any other row's reference is the fp32 one, on fp32 copies of the inputs. Both references at
        matmul precision "highest", which keeps TF32 out of them."""
        quantized = name_quantized(name)
        try:
            laid = laid_out(name, inputs)
            got = np.asarray(jax.jit(fn)(*laid), np.float32)
            with jax.default_matmul_precision("highest"):
                want = np.asarray(reference(*(x.astype(jnp.float32) if x.dtype == dtype else x
                                              for x in (laid if quantized else inputs))), np.float32)
            diff = np.abs(got - want)
            if np.any(diff > 4e-3 + 1e-2 * np.abs(want)):  # bf16 rounding; a key missed or added is ~2e-2
                against = "the XLA path over the same quantised cache" if quantized else "the fp32 reference"
                return f"disagrees with {against} at a small shape: max |diff| {diff.max():.3g}"
            return None
        except Exception as e:  # noqa: BLE001 - reported in the row, never hidden
            return error_line(e)

    def checked(table: str, impls: dict, reference, small, known: dict, row: dict) -> list:
        """The impls that agree with their reference at the small inputs; each other one (`known`: its error
        without trying, e.g. absent from this jax) gets one row with its error, none a point, and is not timed."""
        passed = []
        for name in {**impls, **known}:
            error = known.get(name) or check(name, impls[name], quantized_reference.get(name, reference), small)
            if error:
                measure(table, {"impl": name, **row}, error)
            else:
                passed.append(name)
        return passed

    memory = memory_bandwidth(copy_gib, dtype, repeats)  # the tables' denominator: the larger of copy and read
    measured_bw = memory["bandwidth"]
    if args.smoke:
        print("SMOKE RUN: tiny shapes" + (", kernels interpreted on the CPU" if interpret else "")
              + "; the numbers below check that the script runs, they measure nothing")
    print(f"{device.device_kind} ({device.platform}{', interpret mode' if interpret else ''}): measured bandwidth "
          f"{measured_bw / 1e9:.1f} GB/s, the larger of a copy ({memory['copy']['bandwidth'] / 1e9:.1f} GB/s: "
          f"{copy_gib:g} GiB read + written in {memory['copy']['time_s'] * 1e3:.2f} ms) and a read "
          f"({memory['read']['bandwidth'] / 1e9:.1f} GB/s: {memory['read']['time_s'] * 1e3:.2f} ms)")

    # Decode: q [B, 1, N, H] over the dense cache's k, v [B, K, S, H], every entry valid, the query at S - 1.
    # jax's bundled kernel takes [B, S, K, H]: its inputs are laid out so before timing (`layouts`).
    # "pallas" is what the static engine runs (the kernel takes [B, S, K, H], so the cache is transposed first);
    # "pallas_bskh" is the kernel alone on inputs already in its layout.
    bskh = lambda q, k, v, n, p: (q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), n, p)
    decode_impls = {
        "pallas": lambda q, k, v, n, p: attend_cache("pallas", q, k, v, p, n),
        "pallas_bskh": lambda q, k, v, n, p: decode_attention(q, k, v, n, p),
        "xla": lambda q, k, v, n, p: attend_cache("xla", q, k, v, p, n),
        # our Mosaic GPU kernel, reading the cache in place in the model's layout (FA3's P V form), and the form
        # jax's interpreter runs (P through SMEM) compiled
        "mosaic": lambda q, k, v, n, p: decode_attention_mgpu(q, k, v, n, p),
        "mosaic_smem": lambda q, k, v, n, p: decode_attention_mgpu(q, k, v, n, p, interpreter_safe=True),
        # 64-key blocks in 2 slots: two CTAs share an SM (`resident_ctas`), one's start and epilogue behind the
        # other's copies
        "mosaic_2cta": lambda q, k, v, n, p: decode_attention_mgpu(q, k, v, n, p, block_sizes=two_ctas),
    }
    # interpreted, the Mosaic kernels take minutes at these shapes (tests/ interpret them at tiny ones)
    mosaic_gpu_only = {name: "Mosaic GPU kernel: timed on a GPU only" for name in ("mosaic", "mosaic_smem",
                                                                                    "mosaic_2cta")
                       } if interpret else {}
    layouts = {"pallas_bskh": bskh}
    try:
        from jax.experimental.pallas.ops.gpu.decode_attention import gqa as jax_gqa
        decode_impls["jax_pallas"] = lambda q, k, v, n, p: jax_gqa(q[:, 0], k, v, kv_seq_len=n,
                                                                   interpret=interpret)[:, None]
        layouts["jax_pallas"] = bskh
    except ImportError as e:
        jax_gqa_error = f"unavailable in jax {jax.__version__}: {error_line(e)}"
    else:
        jax_gqa_error = None
    decode_reference = lambda q, k, v, n, p: attend_cache("xla", q, k, v, p, n)

    # The same caches quantised per token and head (kv_quant, as the engines store them; done before timing): the
    # kernels read 1-byte K/V and their fp32 scales (Triton dequantises in registers, Mosaic converts each tile in
    # SMEM), XLA dequantises whole. Each is checked against the XLA path over the same quantised cache (the fp32
    # reference would see the rounding). `call(impl, *inputs, k_scale, v_scale)` runs one impl.
    quantized_reference = {}  # name -> its check's reference, over the laid-out (quantised) inputs

    def add_quantized(impls, impl_names, call, formats=("int8", "float8_e4m3fn")):
        for fmt in formats:
            def lay(*inputs, fmt=fmt):  # inputs: (q, k, v, ...) -> (q, k8, v8, ..., k_scale, v_scale)
                (kq, ks), (vq, vs) = quantize(inputs[1], fmt), quantize(inputs[2], fmt)
                return (inputs[0], kq, vq, *inputs[3:], ks, vs)

            for impl in impl_names:
                name = f"{impl}_{fmt}"
                impls[name] = functools.partial(call, impl)
                layouts[name] = lay
                quantized_reference[name] = functools.partial(call, "xla")

    add_quantized(decode_impls, ("pallas", "xla", "mosaic"),
                  lambda impl, q, k, v, n, p, ks, vs: attend_cache(impl, q, k, v, p, n, ks, vs))
    if interpret:
        mosaic_gpu_only.update({f"mosaic_{fmt}": mosaic_gpu_only["mosaic"] for fmt in ("int8", "float8_e4m3fn")})

    def decode_inputs(b, s):
        return (normal(b, 1, heads, head_dim), normal(b, kv_heads, s, head_dim), normal(b, kv_heads, s, head_dim),
                jnp.full((b,), s, jnp.int32), jnp.full((b, 1), s - 1, jnp.int32))

    def layer_kv_bytes(name, b, s):  # one layer's K and V (quantised: 1 byte a value, an fp32 scale a token and head)
        return 2 * b * s * kv_heads * (head_dim + 4 if name_quantized(name) else head_dim * jnp.dtype(dtype).itemsize)

    def laid_out(name, inputs):
        return layouts[name](*inputs) if name in layouts else inputs

    def decode_table(table, impls, reference, variants, known, after_targets=None):
        """variants: (row fields, make_inputs(b, s)) each, its impls checked at a small shape, then timed at every
        point (the variants of a point side by side). after_targets(names of the first variant that passed): run
        once the LAYERED_POINTS' own rows are measured, ahead of the other points (which a --deadline may cut)."""
        passed = [(row, make, checked(table, impls, reference, make(2, 512), known, row)) for row, make in variants]
        # after_targets once the LAYERED_POINTS' own rows are measured (the first targets' points)
        hook_at = 1 + max(decode_points.index(p) for p in layered_points) if layered_points else -1
        for i, (b, s) in enumerate(decode_points):
            if i == hook_at and after_targets:
                after_targets(passed[0][2])
            for row, make, names in passed:
                point = functools.cache(functools.partial(make, b, s))
                for name in (n for n in names if timed_here(table, n, (b, s))):
                    kv_bytes = layer_kv_bytes(name, b, s)
                    measure(table, {"impl": name, **row, "batch": b, "context": s, "kv_bytes": kv_bytes}, None,
                            impls[name], lambda n=name, p=point: laid_out(n, p()),
                            lambda seconds, n=kv_bytes: dict(bandwidth=n / seconds,
                                                             of_measured_bandwidth=n / seconds / measured_bw),
                            profile=(b, s) in profile_at and name in PROFILED[table])
                del point
        if after_targets and hook_at >= len(decode_points):  # no point after the layered ones
            after_targets(passed[0][2])

    def decode_steps(table, impls, make_inputs, width, row=None):
        """after_targets for `table`: the decode-step rows (--layers) of its LAYERED impls that passed their check,
        `width` inputs a layer (+ 2 scales if quantised), `row`: the fields of the variant they are timed in."""
        def run(passed):
            for b, s in layered_points:
                # a decode step's attention: `count` layers' caches one after another in one program, per layer
                count = max(1, min(args.layers, MAX_KV_GIB * 2**30 // (2 * b * s * kv_heads * head_dim * 2)))
                point = functools.cache(lambda b=b, s=s, count=count: [make_inputs(b, s) for _ in range(count)])
                for name in (n for n in LAYERED[table] if n in passed):
                    kv_bytes = count * layer_kv_bytes(name, b, s)
                    step_width = width + 2 * name_quantized(name)

                    def step(*flat, name=name, count=count, step_width=step_width):
                        return [impls[name](*flat[i * step_width:(i + 1) * step_width]) for i in range(count)]

                    measure(table, {"impl": name, **(row or {}), "batch": b, "context": s, "layers": count,
                                    "kv_bytes": kv_bytes},
                            None, step, lambda n=name, p=point: [x for layer in p() for x in laid_out(n, layer)],
                            lambda seconds, n=kv_bytes, count=count: dict(
                                time_per_layer_s=seconds / count, bandwidth=n / seconds,
                                of_measured_bandwidth=n / seconds / measured_bw),
                            profile=(b, s) in profile_at and name in PROFILED[table])
                del point
        return run

    if "decode" in parts:  # the decode-step rows right after their own points' rows, ahead of the others
        decode_table("decode", decode_impls, decode_reference, [({}, decode_inputs)],
                     {**mosaic_gpu_only, **({"jax_pallas": jax_gqa_error} if jax_gqa_error else {})},
                     after_targets=decode_steps("decode", decode_impls, decode_inputs, 5))  # q, k, v, lengths, pos

    # Paged decode, what sk.Engine runs: the same queries over pools [K, P, page_size, H] through shuffled block
    # tables (sequences' pages scattered over the pool), by each decode_attention_impl's paged form, at each
    # --page-size (an impl refusing one, as the Mosaic kernel refuses per-token scales on pages of 16, gets its
    # one row saying so there).

    def paged_inputs(b, s, page_size):
        pages_per_seq = s // page_size
        pool_pages = b * pages_per_seq + 1  # page 0 is the engine's null page
        order = jax.random.permutation(next(keys), jnp.arange(1, pool_pages, dtype=jnp.int32))
        return (normal(b, 1, heads, head_dim), normal(kv_heads, pool_pages, page_size, head_dim),
                normal(kv_heads, pool_pages, page_size, head_dim), order.reshape(b, pages_per_seq),
                jnp.full((b,), s, jnp.int32), jnp.full((b, 1), s - 1, jnp.int32))

    paged_impls = {name: (lambda q, k, v, t, n, p, name=name: paged_attend(name, q, k, v, t, n, p))
                   for name in ("pallas", "xla", "mosaic")}
    # The same pools quantised per token and head, as sk.Engine stores them (above); pallas_f16: the Triton kernel
    # with the pool's values converted straight to fp16 (`DecodeBlockSizes.dequant_dtype`, a tuning knob)
    f16_sizes = DecodeBlockSizes(dequant_dtype="float16")
    add_quantized(paged_impls, ("pallas", "pallas_f16", "xla", "mosaic"),
                  lambda impl, q, k, v, t, n, p, ks, vs: (
                      paged_attention(q, k, v, t, n, p, block_sizes=f16_sizes, k_scale=ks, v_scale=vs)
                      if impl == "pallas_f16" else paged_attend(impl, q, k, v, t, n, p, ks, vs)))
    paged_reference = lambda q, k, v, t, n, p: paged_attend("xla", q, k, v, t, n, p)
    if "paged" in parts:
        pages = args.page_size[0]  # the decode-step rows': the first page size (sk.Engine's default 16 first)
        decode_table("paged", paged_impls, paged_reference,
                     [({"page_size": size}, functools.partial(paged_inputs, page_size=size))
                      for size in args.page_size],
                     {name: error for name, error in mosaic_gpu_only.items() if name in paged_impls},
                     after_targets=decode_steps("paged", paged_impls, functools.partial(paged_inputs, page_size=pages),
                                                6, {"page_size": pages}))  # q, k, v, block table, lengths, positions

    # Prefill: causal self-attention, q [B, T, N, H], k, v [B, T, K, H]; "packed": documents of DOCUMENT tokens side
    # by side (segment ids, positions restarting), what the engines' packed prompts are, for the impls that take
    # segment ids (cuDNN's causal flag does not; the engine's cuDNN path passes the mask as a bias).
    def prefill_inputs(b, t, packed=False):
        positions = jnp.arange(t, dtype=jnp.int32)
        segments = positions // document if packed else jnp.zeros(t, jnp.int32)
        positions = positions % document if packed else positions
        return (normal(b, t, heads, head_dim), normal(b, t, kv_heads, head_dim), normal(b, t, kv_heads, head_dim),
                jnp.broadcast_to(positions, (b, t)), jnp.broadcast_to(segments, (b, t)))

    prefill_impls = {
        "pallas": lambda q, k, v, p, g: flash_attention(q, k, v, p, p, g, g),
        "cudnn": lambda q, k, v, p, g: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"),
        "cudnn_mask": lambda q, k, v, p, g: attend("cudnn", q, k, v, p, p, g, g),  # the engine's cuDNN path
        "xla": lambda q, k, v, p, g: xla_attention(q, k, v, p, p, g, g),
        # our Mosaic GPU kernel (FA3 form), and its interpreter form compiled (P V through SMEM)
        "mosaic": lambda q, k, v, p, g: flash_attention_mgpu(q, k, v, p, p, g, g),
        "mosaic_smem": lambda q, k, v, p, g: flash_attention_mgpu(q, k, v, p, p, g, g, interpreter_safe=True),
    }
    # The engines' prefill over an FP8 cache (a chunk over cached context): XLA dequantises K/V to the activations'
    # dtype first, then the same kernel runs (model/layers.py); this row prices that pre-pass against the bf16 row's.
    # The reference (q in fp32) reads the same bf16-rounded K/V in fp32: the rounding is the engine's, and alone
    # moves an output by up to 1.5x the check's tolerance (the H200's 0.0134 of 2026-11-25).
    add_quantized(prefill_impls, ("mosaic",), lambda impl, q, k, v, p, g, ks, vs: attend(
        impl, q, *(x.astype(dtype).astype(q.dtype) for x in dequantize_pair((k, v, ks, vs))), p, p, g, g),
        formats=("float8_e4m3fn",))
    segmented = ("pallas", "cudnn_mask", "xla", "mosaic", "mosaic_smem", "mosaic_float8_e4m3fn")
    # jax's bundled Mosaic GPU kernel (FA3-style: warp specialisation, wgmma, TMA; causal, no segment ids): what
    # Pallas on Hopper reaches. Its kernel keeps float16 buffers whatever the inputs (bfloat16 fails to lower), so
    # it runs on float16 copies made before timing: the same FLOPs. It needs jaxlib's CUDA plugin even to lower, so
    # on a CPU its row carries the error.
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu
        mosaic = attention_mgpu.TuningConfig(block_q=128, block_kv=128, max_concurrent_steps=2, causal=True)
        prefill_impls["jax_mosaic_fp16"] = lambda q, k, v, p, g: attention_mgpu.attention(q, k, v, mosaic)
        # ... and applies no softmax scale (nor does its reference): q comes pre-scaled by 1 / sqrt(H)
        layouts["jax_mosaic_fp16"] = lambda q, k, v, p, g: (
            *(x.astype(jnp.float16) for x in (q * head_dim**-0.5, k, v)), p, g)
    except (ImportError, AttributeError, TypeError) as e:
        mosaic_error = f"unavailable in jax {jax.__version__}: {error_line(e)}"
    else:
        mosaic_error = (None if getattr(attention_mgpu, "cuda_versions", True) is not None else
                        "Mosaic GPU needs jaxlib's CUDA plugin, even to lower (none on this machine)")
    # jax's bundled Pallas Triton kernel (`pallas.ops.gpu.attention.mha`, causal, no segments) at its own defaults
    # (128 x 128 blocks, 8 warps at head dim 128, 2 stages): what Triton-Pallas reaches, beside ours. It takes as many
    # K/V heads as query heads, so K and V are repeated to them before timing.
    try:
        from jax.experimental.pallas.ops.gpu import attention as jax_triton
        prefill_impls["jax_triton"] = lambda q, k, v, p, g: jax_triton.mha(q, k, v, None, sm_scale=head_dim**-0.5,
                                                                           causal=True, interpret=interpret)
        layouts["jax_triton"] = lambda q, k, v, p, g: (
            q, *(jnp.repeat(x, heads // kv_heads, axis=2) for x in (k, v)), p, g)
        triton_error = None
    except (ImportError, AttributeError) as e:
        triton_error = f"unavailable in jax {jax.__version__}: {error_line(e)}"
    prefill_reference = lambda q, k, v, p, g: xla_attention(q, k, v, p, p, g, g)
    if "prefill" in parts:
        # our Mosaic GPU kernel interpreted takes minutes even at the small shape (tests/ interpret it at tiny ones)
        known = {**{name: "Mosaic GPU kernel: timed on a GPU only"
                    for name in ("mosaic", "mosaic_smem", "mosaic_float8_e4m3fn") if interpret},
                 **({"jax_mosaic_fp16": mosaic_error} if mosaic_error else {}),
                 **({"jax_triton": triton_error} if triton_error else {})}
        names = checked("prefill", prefill_impls, prefill_reference, prefill_inputs(1, 256), known, {})
        for b, t in prefill_points:
            flops = 4 * b * heads * t * t * head_dim / 2
            for packed in (False, True) if t > document else (False,):
                point = functools.cache(functools.partial(prefill_inputs, b, t, packed))
                # packed: each document's own causal triangle (the last one shorter where t is not a multiple)
                sizes = [document] * (t // document) + ([t % document] if t % document else [])
                work = 4 * b * heads * sum(d * d for d in sizes) * head_dim / 2 if packed else flops
                for name in names:
                    if (packed and name not in segmented) or not timed_here("prefill", name, (b, t)):
                        continue
                    measure("prefill", {"impl": name, "batch": b, "seq": t, "packed": packed, "flops": work}, None,
                            prefill_impls[name], lambda n=name, p=point: laid_out(n, p()),
                            lambda seconds, w=work: dict(tflops=w / seconds / 1e12))
                del point

    for title, table in (("decode, dense cache [B, K, S, H]", "decode"),
                         ("paged decode, pools [K, P, page, H], shuffled tables", "paged")):
        if not tables[table]:
            continue
        paged = table == "paged"
        print(f"\n{title}: 1 query, {heads}/{kv_heads} heads x {head_dim}, bf16; bandwidth = K+V bytes / time")
        print(f"{'impl':<26}" + (f"{'page':>6}" if paged else "") +
              f"{'batch':>6}{'context':>9}{'ms':>10}{'GB/s':>9}{'of measured':>13}")
        for r in tables[table]:  # a decode-step row: its impl, the layers it ran, and its time per layer
            impl = f"{r['impl']}, {r['layers']} layers" if "layers" in r else r["impl"]
            ms = r.get("time_per_layer_s", r.get("time_s", 0)) * 1e3
            print(f"{impl:<26}" + (f"{r['page_size']:>6}" if paged else "") +
                  f"{r.get('batch', '-'):>6}{r.get('context', '-'):>9}" + (
                      f"  {r['error']}" if "error" in r else f"{ms:>10.3f}{r['bandwidth'] / 1e9:>9.1f}"
                                                             f"{r['of_measured_bandwidth']:>13.1%}"))
        for r in tables[table]:  # where the profiled rows' device time went, per category and op
            if "profile" in r or "profile_error" in r:
                where = (f"{r['impl']}" + (f", pages of {r['page_size']}" if paged else "")
                         + (f", {r['layers']} layers a call" if "layers" in r else ""))
                print(f"\nprofile of {where} at {r['batch']} x {r['context']}:"
                      + (f" {r['profile_error']}" if "profile_error" in r else ""))
                if "profile" in r:
                    op_profile.print_profile(r["profile"], ops=6, print_fn=lambda line: print("  " + line), digits=3)
        print_cost_fits(cost_fits(tables[table], measured_bw), f"{table} cost fits")
    if tables["prefill"]:
        print(f"\nprefill: causal, {heads}/{kv_heads} heads x {head_dim}, bf16 (_float8_e4m3fn: K/V read from an FP8 "
              f"cache, dequantised by XLA first, as the engines do); TFLOP/s of 4*B*N*T*T*H/2")
        print(f"{'impl':<22}{'batch':>6}{'seq':>9}{'packed':>8}{'ms':>10}{'TFLOP/s':>9}")
        for r in tables["prefill"]:
            packed = {True: "yes", False: "no"}.get(r.get("packed"), "-")
            print(f"{r['impl']:<22}{r.get('batch', '-'):>6}{r.get('seq', '-'):>9}{packed:>8}" + (
                f"  {r['error']}" if "error" in r else f"{r['time_s'] * 1e3:>10.3f}{r['tflops']:>9.2f}"))
    save(complete=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
