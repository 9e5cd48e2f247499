"""Every GPU check and benchmark of this project in one command, on a GPU host with no package index.

Where pip works (here):
    python benchmarks/gpu/pack.py prepare            # .whl/: the pinned wheels the host lacks, checked; commit.json
    python benchmarks/gpu/pack.py check              # the same check, nothing downloaded
On the GPU host (the working tree and .whl/ copied there; python3 is the host's):
    python3 benchmarks/gpu/pack.py run --out DIR --steps pytest,kernels | 1,2 [--deadline 540]  # at most 6 a call
    python3 benchmarks/gpu/pack.py run --out DIR --steps pytest --pytest-parts mosaic     # one call, then
    python3 benchmarks/gpu/pack.py run --out DIR --steps pytest --pytest-parts pallas,rest  # another
Anywhere (a CPU: tiny shapes, kernels interpreted; CI runs it):
    python benchmarks/gpu/pack.py run --smoke --out /tmp/gpu-pack-smoke
Afterwards:
    python benchmarks/gpu/pack.py collect CALL_DIR [CALL_DIR ...] --into benchmarks/results/gpu-YYYY-MM-DD
    python benchmarks/gpu/pack.py summary DIR        # rebuild DIR/summary.md from the step files there
    python benchmarks/gpu/pack.py steps              # the steps, their time limits and their parts' limits

`run` installs the wheelhouse into --site with no index and no dependency resolution, puts it and the repo on
PYTHONPATH for every step, records the machine in env.json, then runs the steps in order, each in its own
processes under its time limit and the call's --deadline; a step that fails or runs out of time is recorded and
the next one starts. DIR stays flat: env.json, <step>.json per step, summary.md (a GPU call runs at most 6 steps,
so that it writes at most the 8 files a device call brings back). It exits 1
when a step failed or timed out.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from pathlib import Path

import pack_runner
from pack_steps import (BENCH, DISTILL_LIMITS, DISTILL_PARTS, PYTEST_LIMITS, PYTEST_PARTS, SERVING_PARTS, STEPS,
                        parse_distill_parts, parse_kernel_parts, parse_kernel_points, parse_parts, parse_points,
                        parse_pytest_parts, parse_tune_only, select, summarize)

REPO = pack_runner.REPO
SMOKE_MEMORY = 4 * 2**30  # smoke: a device this size takes the tiny point and not the giant one
MAX_FILES_BACK = 8  # files a device call brings back from $OUT


def _limits(items) -> dict:
    limits = {}
    for item in items or ():
        name, _, seconds = item.partition("=")
        if name not in {s.name for s in STEPS} or not seconds.replace(".", "", 1).isdigit():
            raise ValueError(f"--limit {item!r}: want STEP=SECONDS with STEP one of {', '.join(s.name for s in STEPS)}")
        limits[name] = float(seconds)
    return limits


def parser() -> argparse.ArgumentParser:
    defaults, raw_defaults = pack_runner.help_formatters()
    p = argparse.ArgumentParser(prog="pack.py", description=__doc__.split("\n\n")[0],
                                formatter_class=raw_defaults, epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="command", required=True)
    command = functools.partial(sub.add_parser, formatter_class=defaults)  # each option says its default
    wheelhouse = "the wheels' folder (default: .whl in the repository)"
    for name, help_ in (("prepare", "download the pinned wheels into the wheelhouse, check it, stamp the commit"),
                        ("check", "check the wheelhouse and the pins against pyproject and the host's packages")):
        s = command(name, help=help_)
        s.add_argument("--wheelhouse", type=Path, default=REPO / ".whl", help=wheelhouse)
        s.add_argument("--budget-mib", type=float, default=40.0, help="size budget of the wheels (default 40)")
    r = command("run", help="install the wheelhouse, then run the steps (on the GPU host, or --smoke)")
    r.add_argument("--out", type=Path, required=True, help="results folder (flat; earlier step files are kept)")
    r.add_argument("--steps", default="all", help="numbers or names, at most 6 a GPU call: 1,2 / pytest,kernels / "
                   "'all' (the default, for --smoke) / " +
                   ",".join(s.name for s in STEPS))
    r.add_argument("--smoke", action="store_true", help="the same steps with tiny shapes on the CPU")
    r.add_argument("--deadline", type=float, default=540.0,
                   help="seconds for the whole call; no step starts with less than 20 s left (default 540)")
    r.add_argument("--limit", action="append", metavar="STEP=SECONDS",
                   help="a step's time limit, repeatable (default: the step's own, see `pack.py steps`)")
    r.add_argument("--memory-bandwidth", type=float, default=None,
                   help="bytes/s for the bench roofline (default: from the GPU's name; H100 3.35e12, H200 4.8e12)")
    r.add_argument("--mem-fraction", type=float, default=0.9,
                   help="XLA_PYTHON_CLIENT_MEM_FRACTION for every step, and the share of memory a bench point may "
                        "take (default 0.9)")
    r.add_argument("--device-memory-gib", type=float, default=None,
                   help="device memory (default: nvidia-smi's; with --smoke 4, so that one point does not fit)")
    r.add_argument("--bench-points", type=_said(parse_points), default=None,
                   help="bench points PROMPTxBATCH,... (default 2048,8192,32768 x 1,16,64)")
    r.add_argument("--pytest-parts", type=_said(parse_pytest_parts), default=tuple(PYTEST_PARTS),
                   help=f"the pytest step's commands, comma-separated, in order ({', '.join(PYTEST_PARTS)}; default "
                        "all): each part's test files with their own junit and time limit; about one call of 10 "
                        "minutes for mosaic, one for pallas with rest")
    r.add_argument("--serving-parts", type=_said(parse_parts), default=("offline",),
                   help="benchmarks/serving.py --part for the serving step, comma-separated, one command each, in "
                        f"order ({', '.join(SERVING_PARTS)}; default offline): about one call of 10 minutes each")
    r.add_argument("--distill-parts", type=_said(parse_distill_parts), default=None,
                   help=f"the distill step's commands, comma-separated, in order ({', '.join(DISTILL_PARTS)}; default "
                        "8b,1b,dryrun; with --smoke all): about one call of 10 minutes for 8b with 1b, train, demo and "
                        "sweep each")
    r.add_argument("--demo-attention", default=None,
                   help="the distill step's demo and sweep parts: demo.py --attention (auto, xla, xla_chunked, "
                        "cudnn; default the gpu budget's auto, cudnn on sm_90+), and the same attention for every row "
                        "of the sweep")
    r.add_argument("--tune-only", type=_said(parse_tune_only), default=None,
                   help="the tune step's points: benchmarks/tune_kernels.py --only (kernel[:cache_dtype],...; "
                        "default every point, the targets' first)")
    r.add_argument("--kernel-parts", type=_said(parse_kernel_parts), default=("decode", "paged", "prefill"),
                   help="the kernels step's tables, comma-separated (decode, paged, prefill; default all), each "
                        "under its own kernels.py --deadline")
    for table, example in (("decode", "32x4096,32x8192"), ("prefill", "1x8192,1x2048")):
        r.add_argument(f"--{table}-points", type=_said(parse_kernel_points), default=None, metavar="BxS,...",
                       help=f"the kernels step's {table} points (kernels.py --{table}-points, e.g. {example}"
                            f"{'; the paged table too' if table == 'decode' else ''}; default the whole grid)")
    r.add_argument("--wheelhouse", type=Path, default=REPO / ".whl", help=wheelhouse)
    r.add_argument("--site", type=Path, default=Path("/tmp/swiftkv-jax-site"), help="where the wheels go")
    r.add_argument("--no-install", action="store_true", help="use this environment as it is (--smoke implies it)")
    r.add_argument("--quiet", action="store_true", help="do not echo the steps' output")
    r.add_argument("--inject-failure", action="append", default=[], metavar="STEP", help=argparse.SUPPRESS)
    s = command("summary", help="rebuild DIR/summary.md from the step files in DIR")
    s.add_argument("folder", type=Path, help="a results folder (a `run --out` or a `collect --into`)")
    c = command("collect", help="merge the results folders of several calls into one, and summarize")
    c.add_argument("sources", type=Path, nargs="+",
                   help="the calls' results folders (`run --out`), merged in this order; env.json the newest")
    c.add_argument("--into", type=Path, required=True, help="the merged folder (made if missing), with its summary.md")
    command("steps", help="list the steps")
    return p


def _said(parse):
    """`parse` as an argparse type whose ValueError's message reaches the user (argparse prints a ValueError's type
    as "invalid parse_x value" and drops the message, which names the choices)."""
    def typed(text):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return typed


def _run(args) -> int:
    steps = select(args.steps)
    if not args.smoke and len(steps) + 2 > MAX_FILES_BACK:
        raise ValueError(f"{len(steps)} steps in one call would write {len(steps) + 2} files (env.json, summary.md and "
                         f"a file a step), but a device call brings back at most {MAX_FILES_BACK}: run at most "
                         f"{MAX_FILES_BACK - 2} steps a call (--steps), as one call of 10 minutes holds only a few")
    limits = _limits(args.limit)
    steps = [dataclasses.replace(s, limit_s=limits[s.name], smoke_limit_s=limits[s.name]) if s.name in limits else s
             for s in steps]
    smi = pack_runner.nvidia_smi()
    gpu = (smi.get("gpus") or [{}])[0]
    memory = (args.device_memory_gib * 2**30 if args.device_memory_gib else
              SMOKE_MEMORY if args.smoke else gpu.get("memory_bytes"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if args.smoke:
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{args.mem_fraction:g}")
        env.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/swiftkv-jax-compile-cache")
    ctx = pack_runner.Context(
        smoke=args.smoke, python=sys.executable, repo=REPO, env=env,
        usable_memory=int(memory * args.mem_fraction) if memory else None,
        memory_bandwidth=args.memory_bandwidth or (1e11 if args.smoke else pack_runner.bandwidth_of(gpu.get("name"))),
        bench_points=args.bench_points, pytest_parts=args.pytest_parts, serving_parts=args.serving_parts,
        distill_parts=args.distill_parts or (DISTILL_PARTS if args.smoke else pack_runner.Context.distill_parts),
        tune_only=args.tune_only, demo_attention=args.demo_attention, kernel_parts=args.kernel_parts,
        kernel_points={k: v for k, v in (("decode", args.decode_points), ("prefill", args.prefill_points)) if v})
    echo = None if args.quiet else (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    options = {"steps": [s.name for s in steps], "deadline_s": args.deadline, "limits": limits,
               "mem_fraction": args.mem_fraction, "bench": BENCH[args.smoke][:4] if not args.bench_points else
               args.bench_points, "pytest_parts": list(args.pytest_parts), "serving_parts": list(args.serving_parts),
               "distill_parts": list(ctx.distill_parts), "tune_only": args.tune_only,
               "demo_attention": args.demo_attention, "kernel_parts": list(ctx.kernel_parts),
               "kernel_points": ctx.kernel_points,
               "inject_failure": args.inject_failure}
    return pack_runner.run(steps, ctx, args.out, args.wheelhouse, args.site, args.deadline, summarize,
                           install_wheels=not (args.no_install or args.smoke), inject_failure=set(args.inject_failure),
                           options=options, echo=echo, smi=smi)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return _main(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _main(args) -> int:
    if args.command in ("prepare", "check"):
        import pack_wheels

        if args.command == "prepare":
            return pack_wheels.prepare(args.wheelhouse, budget_mib=args.budget_mib)
        return pack_wheels.report(args.wheelhouse, budget_mib=args.budget_mib)
    if args.command == "run":
        return _run(args)
    if args.command == "summary":
        (args.folder / "summary.md").write_text(summarize(args.folder))
        print(args.folder / "summary.md")
        return 0
    if args.command == "collect":
        print(pack_runner.collect(args.sources, args.into, summarize) / "summary.md")
        return 0
    part_limits = {"pytest": PYTEST_LIMITS, "distill": DISTILL_LIMITS}
    for s in STEPS:
        print(f"{s.index} {s.name:<8} limit {s.limit_s:.0f} s (smoke {s.smoke_limit_s:.0f} s): {s.title}")
        if s.name in part_limits:
            print(" " * 11 + "parts: " + ", ".join(f"{k} {v} s" for k, v in part_limits[s.name].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
