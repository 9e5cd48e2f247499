"""The GPU pack's steps, in order, each as it runs on the GPU and as `--smoke` runs it on a CPU; and summary.md.

 1 pytest   `pytest -m gpu`: compiled kernels against their references, cuDNN against XLA; one bounded command
            per --pytest-parts part, each over its test files with its own junit: mosaic (the Mosaic GPU kernels'
            files), pallas (the Triton kernels' files) and rest (every other file with GPU tests); about one call
            of 10 minutes for mosaic, one for pallas with rest (smoke: each part's GPU tests collected, not run)
 2 kernels  benchmarks/kernels.py, the decode, paged and prefill tables each under its own --deadline, the targets'
            points first (smoke: its --smoke over the --kernel-parts tables, kernels interpreted; the GPU's command
            lines, points and deadlines included, checked by kernels.py's parser)
 3 bench    `infer.py bench --preset llama-3.1-8b --random-weights` at 2K/8K/32K prompts x batch 1/16/64 with the
            TPOT roofline, one process a point; a point whose estimated memory exceeds the device's is skipped
            ("does not fit"), and large batch x prompt prefills are chunked to bound their activations
            (smoke: the tiny preset, one chunked point and one that does not fit)
 4 distill  one bounded command per --distill-parts part, each writing its result as it ends: 8b and 1b
            (benchmarks/distill_step.py --preset 8b|1b: ours and the naive step, MFU; the 8b plan first), train
            (benchmarks/train_pipeline.py --preset 1b: train.py end to end against its bare step), demo (demo.py
            --budget gpu: pretrain, distil and evaluate, results.json kept), sweep (benchmarks/recipe_sweep.py on
            the gpu demo's teacher: its 50% student distilled at other rates), dryrun (the 8B recipe's train.py
            --dry-run compiled for the device, its teacher a folder holding Llama-3.1-8B's config.json alone)
            (smoke: distill_step's plan of its tiny preset; the 1b, train, demo and sweep arguments checked; the dry
            run on the tiny config with a few overrides)
 5 serving  benchmarks/serving.py --preset 8b: sk.Engine in SwiftKV and teacher wiring, the static engine and
            transformers' continuous batching on ArcticInference's workload (2000 + 250 tokens), offline and under a
            Poisson sweep, against the roofline; one command per --serving-parts part (offline, sweep, peer, and
            prefix: --workload shared-prefix, prefix caching on against off; one call of under 10 minutes each)
            (smoke: its arguments checked; its --smoke runs in tests/test_serving_bench.py)
 6 peers    benchmarks/peers.py --shape 1b (smoke: its arguments checked)
 7 tune     benchmarks/tune_kernels.py: block sizes of the Mosaic and Triton kernels per point (kernel, cache dtype),
            the targets' points first, under its own --deadline, the results rewritten after every point; bring them
            into the table with `tune_kernels.py --from-results <results>/tune.json` (--tune-only picks points)
            (smoke: the Triton decode point interpreted)
Standard library only, like the runner.
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from itertools import product
from pathlib import Path

from pack_runner import HERE, REPO, Command, Step, read_results

PACK_JAX = HERE / "pack_jax.py"
ARGS_ONLY = HERE / "args_only.py"  # a GPU command's own arguments parsed by its script, nothing run (smoke)
DRY_RUN_RECIPE = "configs/llama-3.1-8b-instruct.yaml"
# bench: (preset, points, gen_len, repeats, tokens per prefill call) on the GPU and in smoke
BENCH = {False: ("llama-3.1-8b", tuple(product((2048, 8192, 32768), (1, 16, 64))), 128, 3, 65536),
         True: ("tiny", ((32, 2), (1 << 20, 64)), 4, 1, 32)}
SMOKE_DRY_RUN = ("model.num_key_value_layers=2", "data.seq_len=64", "train.global_batch_size=8")


def prefill_chunk(prompt_len: int, batch: int, tokens_per_call: int) -> int:
    """The prefill chunk for a bench point: the whole prompt when batch x prompt fits tokens_per_call, else the
    prompt halved (while even, down to 16) until it does, which bounds the prefill's activation memory."""
    chunk = prompt_len
    while batch * chunk > tokens_per_call and chunk % 2 == 0 and chunk > 16:
        chunk //= 2
    return chunk


def parse_points(text: str) -> tuple:
    """"2048x1,8192x16" -> ((2048, 1), (8192, 16)): prompt length x batch."""
    points = []
    for item in text.split(","):
        prompt, _, batch = item.strip().partition("x")
        if not (prompt.isdigit() and batch.isdigit()) or not int(prompt) or not int(batch):
            raise ValueError(f"bench point {item!r}: want PROMPTxBATCH, e.g. 2048x16")
        points.append((int(prompt), int(batch)))
    return tuple(points)


def last_json_line(text: str):
    return json.loads(text.strip().splitlines()[-1])


def gib(n) -> str:
    return f"{n / 2**30:.1f}"


# --- the steps ------------------------------------------------------------------------------------------------

# The GPU tests by file, in parts that fit a device call of 10 minutes with the install and the probe (all of them
# take some 12 minutes on an H200, about 4 s a test, mostly compiling): mosaic 92 tests, pallas 78; "rest" is every
# other file with GPU tests (the engines' GPU defaults and cuDNN paths against XLA: a few tests, each compiling an
# engine), found by their marks so that a new file is not left out.
PYTEST_PARTS = {"mosaic": ("tests/test_decode_attention_mgpu_kernel.py", "tests/test_flash_attention_mgpu_kernel.py"),
                "pallas": ("tests/test_decode_attention_kernel.py", "tests/test_flash_attention_kernel.py",
                           "tests/test_paged_attention_kernel.py", "tests/test_ragged_paged_attention_kernel.py"),
                "rest": ()}
PYTEST_LIMITS = {"mosaic": 500, "pallas": 420, "rest": 300}  # each part's time limit on the GPU


def parse_pytest_parts(text: str) -> tuple:
    """"mosaic,rest" -> ("mosaic", "rest"): the pytest step's commands, in order."""
    return parse_parts(text, tuple(PYTEST_PARTS), "pytest")


def pytest_files(repo: Path, part: str) -> list[str]:
    """A part's test files (relative to the repo): its own, or for "rest" every other file with GPU tests."""
    if PYTEST_PARTS[part]:
        return list(PYTEST_PARTS[part])
    named = {f for files in PYTEST_PARTS.values() for f in files}
    return sorted(f for f in (str(p.relative_to(repo)) for p in (repo / "tests").glob("test_*.py")
                              if "mark.gpu" in p.read_text()) if f not in named)


def pytest_step(ctx, run):
    base = (ctx.python, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider")
    for part in ctx.pytest_parts:
        files = pytest_files(ctx.repo, part)
        skip = None if files else "no files with GPU tests"  # pytest given none would run the whole suite
        if ctx.smoke:
            run(Command(f"pytest -m gpu --collect-only: {part} (smoke: collected, not run)",
                        (*base, "--collect-only", *files), 120, parse=_collected, skip=skip, info={"part": part}))
            continue
        junit = ctx.tmp / f"junit_{part}.xml"
        argv = (*base, "-rfE", "--continue-on-collection-errors", "--junitxml", junit, *files)
        run(Command(f"pytest -m gpu: {part}", argv, PYTEST_LIMITS[part], parse=lambda _, junit=junit: _junit(junit),
                    skip=skip, info={"part": part}))


def _collected(log: str) -> dict:
    match = re.search(r"(\d+)(?:/\d+)? tests? collected", log)
    return {"collected": int(match[1]) if match else 0}


def _junit(path: Path) -> dict:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = []
    for case in root.iter("testcase"):
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            failed.append({"test": f"{case.get('classname')}::{case.get('name')}",
                           "message": (problem.get("message") or "")[:300]})
    return {**counts, "failed": failed[:30]}


KERNEL_PARTS = (("decode", 200), ("paged", 140), ("prefill", 120))  # kernels.py --parts, each with its --deadline
KERNEL_OVERHEAD_S = 45  # a kernels.py command beyond its deadline: start-up, the bandwidth probes, the row under way


def fitted(deadlines: list, left, overhead: float) -> list:
    """`deadlines` (seconds, one a command run in turn), scaled down together so that they and `overhead` a command
    fit the `left` seconds (None: no limit); never up, and never below 10 s each."""
    if left is None:
        return list(deadlines)
    scale = min(1.0, max(0.0, left - overhead * len(deadlines)) / sum(deadlines))
    return [max(10, int(d * scale)) for d in deadlines]


def parse_kernel_points(text: str) -> str:
    """"32x4096, 32x8192" -> "32x4096,32x8192" (kernels.py's BxS points, checked here on the host)."""
    items = [item.strip().lower() for item in text.split(",") if item.strip()]
    for item in items:
        batch, _, length = item.partition("x")
        if not (batch.isdigit() and length.isdigit()) or not int(batch) or not int(length):
            raise ValueError(f"kernel point {item!r}: want BATCHxLENGTH, e.g. 32x4096")
    if not items:
        raise ValueError("no kernel points given: want BATCHxLENGTH,..., e.g. 32x4096,32x8192")
    return ",".join(items)


def parse_kernel_parts(text: str) -> tuple:
    """"paged,prefill" -> ("paged", "prefill"): the kernels step's tables, run in KERNEL_PARTS' order."""
    names = tuple(name for name, _ in KERNEL_PARTS)
    chosen = parse_parts(text, names, "kernel")
    return tuple(name for name in names if name in chosen)


def kernels_step(ctx, run):
    if ctx.smoke:
        # the tables --kernel-parts names, at kernels.py's own tiny points (the GPU's, interpreted, would take hours);
        # then the GPU's command lines (their --deadline and --decode-points / --prefill-points) parsed by kernels.py
        out, parts = ctx.tmp / "kernels.json", ",".join(ctx.kernel_parts)
        run(Command(f"benchmarks/kernels.py --smoke --parts {parts}",
                    (ctx.python, "benchmarks/kernels.py", "--smoke", "--repeats", "1", "--profile-at", "2x256",
                     "--parts", parts, "--out", out), 600, output=out, script="benchmarks/kernels.py"))
        for label, argv, _ in _kernel_commands(ctx, None):
            run(Command(f"{label} (smoke: arguments checked only)", args_only(argv), 60,
                        script="benchmarks/kernels.py"))
        return
    for label, argv, limit in _kernel_commands(ctx, ctx.seconds_left()):
        run(Command(label, argv, limit, output=argv[argv.index("--out") + 1], script="benchmarks/kernels.py"))


def _kernel_commands(ctx, left) -> list:
    """(label, argv, limit) of each kernels.py command on the GPU, their deadlines fitted to `left` seconds."""
    # the whole grid takes longer than one call: the dense and paged decode tables (bf16, int8, FP8 caches; paged at
    # pages of 16 and 32) and prefill each under kernels.py's own deadline (rows written as measured, the targets'
    # points first; points not started recorded as such). Prefill's targets take the fewest rows. Decode has the
    # most time: its targets' points took all of 160 s on 2026-11-25, and its decode-step and profiled rows come
    # right after the first two; the paged table's rivals now run at the targets' points only. --decode-points and
    # --prefill-points narrow the tables to the points still open; the deadlines shrink to the time left.
    # --kernel-parts runs some of them (their deadlines fitted to the time left among themselves).
    chosen = [(parts, deadline) for parts, deadline in KERNEL_PARTS if parts in ctx.kernel_parts]
    deadlines = fitted([deadline for _, deadline in chosen], left, KERNEL_OVERHEAD_S)
    commands = []
    for (parts, _), deadline in zip(chosen, deadlines):
        out = ctx.tmp / f"kernels_{parts}.json"
        table = "prefill" if parts == "prefill" else "decode"  # the paged table's points are the decode ones
        points = ctx.kernel_points.get(table)
        argv = (ctx.python, "benchmarks/kernels.py", "--parts", parts, "--deadline", str(deadline), "--out", out,
                *((f"--{table}-points", points) if points else ()))
        # the label names the points: `collect` keeps an earlier call's rows of other points (a call's commands
        # replace those of the same label only)
        label = f"benchmarks/kernels.py --parts {parts}" + (f" --{table}-points {points}" if points else "")
        commands.append((label, argv, deadline + KERNEL_OVERHEAD_S))
    return commands


def args_only(argv: tuple) -> tuple:
    """(python, script, *args) -> the command that has the script parse those arguments and stop (args_only.py)."""
    return (argv[0], ARGS_ONLY, *argv[1:])


def bench_step(ctx, run):
    preset, points, gen_len, repeats, per_call = BENCH[ctx.smoke]
    points = ctx.bench_points or points
    spec = ",".join(f"{t}x{b}" for t, b in points)
    fit = run(Command("memory estimate of each point (shapes only, on the CPU)",
                      (ctx.python, PACK_JAX, "fit", "--preset", preset, "--points", spec, "--gen-len", gen_len,
                       "--tokens-per-call", per_call), 300, parse=last_json_line, env={"JAX_PLATFORMS": "cpu"}))
    estimates = {(r["prompt_len"], r["batch"]): r for r in fit.get("result") or []}
    for prompt_len, batch in points:
        estimate = estimates.get((prompt_len, batch), {})
        chunk = prefill_chunk(prompt_len, batch, per_call)
        skip = None
        if estimate and ctx.usable_memory and estimate["need_bytes"] > ctx.usable_memory:
            skip = f"does not fit ({gib(estimate['need_bytes'])} GiB needed, {gib(ctx.usable_memory)} GiB usable)"
        out = ctx.tmp / f"bench_{prompt_len}x{batch}.json"
        argv = (ctx.python, "infer.py", "bench", "--preset", preset, "--random-weights", "--prompt-len", prompt_len,
                "--batch", batch, "--gen-len", gen_len, "--repeats", repeats, "--output", out)
        argv += ("--prefill-chunk", chunk) if chunk != prompt_len else ()
        argv += ("--memory-bandwidth", f"{ctx.memory_bandwidth:g}") if ctx.memory_bandwidth else ()
        run(Command(f"prompt {prompt_len} x batch {batch}", argv, 300, output=out, skip=skip, script="infer.py",
                    info={"point": {"prompt_len": prompt_len, "batch": batch, "prefill_chunk": chunk},
                          "estimate": estimate or None}))


DISTILL_PARTS = ("8b", "1b", "train", "demo", "sweep", "dryrun")
# each part's time limit on the GPU: one device call of 10 minutes holds the install, the probe and one heavy part
DISTILL_LIMITS = {"8b": 540, "1b": 420, "train": 480, "demo": 570, "sweep": 540, "dryrun": 360}


def parse_tune_only(text: str) -> str:
    """--tune-only, checked here against tune_kernels.py's points (a name that matches none is refused before a GPU
    call, not skipped on the GPU)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import tune_kernels
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    tune_kernels.parse_only(text, tune_kernels.POINTS)
    return text


def parse_distill_parts(text: str) -> tuple:
    """"8b,1b" -> ("8b", "1b"): the distill step's commands, in order."""
    return parse_parts(text, DISTILL_PARTS, "distill")


def distill_step(ctx, run):
    for part in ctx.distill_parts:
        DISTILL_COMMANDS[part](ctx, run)


def _distill_bench(preset: str):
    def command(ctx, run):
        out = ctx.tmp / f"distill_step_{preset}.json"
        script = "benchmarks/distill_step.py"
        if ctx.smoke:  # the GPU presets take minutes on a CPU: 8b: the plan of the tiny preset (ours, every remat
            # policy compiled, nothing allocated); 1b: the arguments
            out = ctx.tmp / "distill_step_plan_test.json"
            argv = ((ctx.python, script, "--preset", "test", "--plan", "--variants", "ours", "--out", out)
                    if preset == "8b" else args_only((ctx.python, script, "--preset", preset, "--out", out)))
            run(Command(f"{script} --preset {preset} (smoke: " + ("--preset test --plan)" if preset == "8b" else
                                                                   "arguments checked only)"), argv, 120,
                        output=out if preset == "8b" else None, script=script))
            return
        run(Command(f"{script} --preset {preset}", (ctx.python, script, "--preset", preset, "--out", out),
                    DISTILL_LIMITS[preset], output=out, script=script))
    return command


def _train_pipeline(ctx, run):
    script = "benchmarks/train_pipeline.py"
    out = ctx.tmp / "train_pipeline_1b.json"
    argv = (ctx.python, script, "--preset", "1b", "--work", ctx.tmp / "train_pipeline", "--out", out)
    if ctx.smoke:  # its tiny preset runs under `pytest -m slow` (tests/test_distill_bench.py): the arguments here
        run(Command(f"{script} --preset 1b (smoke: arguments checked only)", args_only(argv), 60, script=script))
        return
    run(Command(f"{script} --preset 1b", argv, DISTILL_LIMITS["train"], output=out, script=script))


DEMO_DIR = "artifacts/gpu-pack-demo"  # the gpu demo's working folder in the checkout (git-ignored)
DEMO_STOP_GRACE_S = 60  # past its limit the demo's training saves a checkpoint (a 247M model with AdamW: ~3 GB)


def _demo(ctx, run):
    """demo.py --budget gpu in a folder of the checkout, not the step's temporary one: a warm machine keeps it
    between calls, so a demo stopped at its limit (SIGTERM: its training saves a checkpoint and it exits 143) is
    continued by the same call made at once."""
    results = ctx.tmp / "demo_results"
    argv = (ctx.python, "demo.py", "--budget", "gpu", "--out", ctx.repo / DEMO_DIR, "--results", results,
            *(("--attention", ctx.demo_attention) if ctx.demo_attention else ()))
    if ctx.smoke:  # its GPU budget refuses a CPU and its smoke budget takes minutes: the arguments parse
        run(Command("demo.py --budget gpu (smoke: arguments checked only)", args_only(argv), 60, script="demo.py"))
        return
    run(Command("demo.py --budget gpu", argv, DISTILL_LIMITS["demo"], output=results / "results.json",
                script="demo.py", stop_grace_s=DEMO_STOP_GRACE_S))


# The gpu demo's rate (2e-3) is extrapolated from CPU sweeps, not tuned (demo.py): its 50% student at half and twice
# it, the budget's steps each (~30 s of matmuls a row by demo.gpu_seconds' arithmetic, plus compiling and scoring).
# Then the same tokens at that rate in half the steps of twice the rows: the recipe before 2026-11-27 (87.5% and 92.6%
# of the gap closed on an H200), which the budget's more, smaller steps replaced on the CPU's evidence.
DEMO_SWEEP_ROWS = ("lr1e-3||optim.learning_rate=1e-3", "lr4e-3||optim.learning_rate=4e-3",
                   "300x32|300|train.global_batch_size=32")


def _demo_sweep(ctx, run):
    """benchmarks/recipe_sweep.py on the gpu demo's folder (its teacher pretrained there first if the demo has not
    run), in the demo's attention."""
    script, out = "benchmarks/recipe_sweep.py", ctx.tmp / "recipe_sweep_gpu.json"
    attention = f";model.attention_impl={ctx.demo_attention}" if ctx.demo_attention else ""
    argv = (ctx.python, script, ctx.repo / DEMO_DIR, "--budget", "gpu", "--out", out,
            *(row + attention for row in DEMO_SWEEP_ROWS))
    if ctx.smoke:  # its smoke budget runs in tests/test_demo.py: the arguments here
        run(Command(f"{script} --budget gpu (smoke: arguments checked only)", args_only(argv), 60, script=script))
        return
    run(Command(f"{script} --budget gpu", argv, DISTILL_LIMITS["sweep"], output=out, script=script,
                stop_grace_s=DEMO_STOP_GRACE_S))


def _dry_run_command(ctx, run):
    teacher = ctx.tmp / "teacher"
    made = run(Command("teacher folder: config.json only", (ctx.python, PACK_JAX, "teacher", teacher, "--preset",
                                                            "tiny" if ctx.smoke else "llama-3.1-8b"), 120,
                       env={"JAX_PLATFORMS": "cpu"}))
    overrides = (f"model.teacher={teacher}", f"train.output_dir={ctx.tmp / 'never'}",
                 *(SMOKE_DRY_RUN if ctx.smoke else ()))
    run(Command(f"train.py --config {DRY_RUN_RECIPE} --dry-run",
                (ctx.python, "train.py", "--config", DRY_RUN_RECIPE, "--dry-run", *overrides), 360,
                parse=_dry_run, script="train.py", skip=None if made["status"] == "ok" else "no teacher folder"))


DISTILL_COMMANDS = {"8b": _distill_bench("8b"), "1b": _distill_bench("1b"), "train": _train_pipeline, "demo": _demo,
                    "sweep": _demo_sweep, "dryrun": _dry_run_command}


def _dry_run(log: str) -> dict:
    out = {"bytes_per_device_gib": {m[1]: float(m[2]) for m in re.finditer(r"^  (\w+)\s+([\d.]+) GiB$", log, re.M)}}
    if match := re.search(r"trainable parameters ([\d,]+) of ([\d,]+)", log):
        out["trainable_parameters"], out["parameters"] = (int(g.replace(",", "")) for g in match.groups())
    if match := re.search(r"mesh (\{.*?\}) \((\w+)\)", log):
        out["mesh"], out["platform"] = match[1], match[2]
    if not out["bytes_per_device_gib"]:
        raise ValueError("no per-device bytes in the dry run's output")
    return out


SERVING_PARTS = ("offline", "sweep", "peer", "prefix", "all")  # prefix: --workload shared-prefix


def parse_parts(text: str, choices: tuple = SERVING_PARTS, what: str = "serving") -> tuple:
    """"offline,sweep" -> ("offline", "sweep"): benchmarks/serving.py --part values (or another step's `choices`),
    in order."""
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in parts if p not in choices]
    if bad or not parts:
        raise ValueError(f"{what} parts {text!r}: choose from {', '.join(choices)}")
    return parts


def serving_step(ctx, run):
    for part in ctx.serving_parts:  # each under serving.py's own deadline (500 s), well inside the step's limit
        out = ctx.tmp / f"serving_{part}.json"
        which = ("--workload", "shared-prefix") if part == "prefix" else ("--part", part)
        argv = (ctx.python, "benchmarks/serving.py", "--preset", "8b", *which, "--out", out, "--plot", "none")
        if ctx.smoke:  # its --smoke (every configuration, on a tiny model) runs in tests/test_serving_bench.py
            run(Command(f"benchmarks/serving.py {' '.join(which)} (smoke: arguments checked only)", args_only(argv),
                        60, script="benchmarks/serving.py"))
            continue
        run(Command(f"benchmarks/serving.py {' '.join(which)}", argv, 600, output=out,
                    script="benchmarks/serving.py"))


def peers_step(ctx, run):
    out = ctx.tmp / "peers.json"
    argv = (ctx.python, "benchmarks/peers.py", "--shape", "1b", "--out", out)
    if ctx.smoke:  # transformers and a 30-layer model take minutes on a CPU: check that the arguments parse
        run(Command("benchmarks/peers.py --shape 1b (smoke: arguments checked only)", args_only(argv), 60,
                    script="benchmarks/peers.py"))
    else:
        run(Command("benchmarks/peers.py --shape 1b", argv, 540, output=out, script="benchmarks/peers.py"))


TUNE_SMOKE_POINTS = "decode"  # the other points' smoke runs in tests/test_kernel_tuning.py
TUNE_DEADLINE_S = 480
TUNE_MARGIN_S = 60  # the step's limit beyond tune_kernels.py's deadline: the candidate under way, the winner's check


def tune_step(ctx, run):
    out = ctx.tmp / "tune_kernels.json"
    script = "benchmarks/tune_kernels.py"
    only = ctx.tune_only or (TUNE_SMOKE_POINTS if ctx.smoke else None)
    # its own deadline leaves the step's limit room for the candidate under way and the winner's check, and ends
    # inside the call's: a point cut by its deadline keeps its best candidate, one killed keeps nothing
    (deadline,) = fitted([TUNE_DEADLINE_S], ctx.seconds_left(), TUNE_MARGIN_S)
    argv = (ctx.python, script, *(("--smoke",) if ctx.smoke else ("--deadline", deadline)), "--out", out,
            *(("--only", only) if only else ()))
    run(Command(f"{script}" + (f" --only {only}" if only else ""), argv, 300 if ctx.smoke else deadline + TUNE_MARGIN_S,
                output=out, script=script))


STEPS = (
    Step(1, "pytest", "pytest -m gpu: compiled kernels against references, cuDNN against XLA (--pytest-parts)", 590,
         pytest_step),
    Step(2, "kernels", "benchmarks/kernels.py: decode and prefill attention kernels against their rivals", 585,
         kernels_step),
    Step(3, "bench", "infer.py bench, Llama-3.1-8B (SwiftKV l=16), random weights: 2K/8K/32K x batch 1/16/64",
         560, bench_step),
    Step(4, "distill", "distillation: the 8b and 1b steps against naive, train.py end to end, the gpu demo, the 8B "
         "dry run (--distill-parts)", 590, distill_step, smoke_limit_s=300),
    Step(5, "serving", "benchmarks/serving.py --preset 8b: engine (SwiftKV, teacher), static engine, transformers; "
         "offline and Poisson, against the roofline", 540, serving_step),
    Step(6, "peers", "benchmarks/peers.py --shape 1b: our engine against transformers", 480, peers_step),
    Step(7, "tune", "benchmarks/tune_kernels.py: the kernels' block sizes per GPU, kernel and cache dtype "
         "(--tune-only)", TUNE_DEADLINE_S + 75, tune_step, smoke_limit_s=300),
)
BY_NAME = {s.name: s for s in STEPS}


def select(spec: str | None) -> list[Step]:
    """Steps by "1,2", "bench,distill" or "all" (None), in the pack's order."""
    if spec in (None, "", "all"):
        return list(STEPS)
    chosen = set()
    for item in spec.split(","):
        item = item.strip()
        step = BY_NAME.get(item) or next((s for s in STEPS if item.isdigit() and s.index == int(item)), None)
        if step is None:
            raise ValueError(f"unknown step {item!r}: steps are " + ", ".join(f"{s.index} {s.name}" for s in STEPS))
        chosen.add(step.name)
    return [s for s in STEPS if s.name in chosen]


# --- summary.md -----------------------------------------------------------------------------------------------

def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _mib(n) -> str:
    return f"{n / 2**20:,.0f}" if n >= 2**20 else f"{n / 2**20:.3f}"


def _ms(seconds) -> str:
    return f"{seconds * 1e3:.2f}" if isinstance(seconds, (int, float)) else "-"


def _first_line(text) -> str:
    return (str(text).strip().splitlines() or [""])[0][:160]


def _headline(record: dict) -> str:
    """One line of what a step found, for the overview table."""
    results = [c.get("result") for c in record.get("commands", []) if isinstance(c.get("result"), dict)]
    name = record["step"]
    if name == "pytest" and results:
        counts = []
        for c in record["commands"]:
            r = c.get("result")
            if isinstance(r, dict):
                counts.append((f"{c['part']}: " if "part" in c else "") + (
                    f"{r['collected']} GPU tests collected" if "collected" in r else
                    f"{r['passed']} passed, {r['failures']} failed, {r['errors']} errors, {r['skipped']} skipped"))
        return "; ".join(counts)
    if name == "bench":
        points = [c for c in record["commands"] if "point" in c]
        done = sum(c["status"] == "ok" for c in points)
        skipped = sum(c["status"] == "skipped" for c in points)
        return f"{done} of {len(points)} points measured, {skipped} skipped"
    if name == "tune" and results:
        points = [p for result in results for p in result.get("points", [])]
        return f"{sum(p['status'].startswith('tuned') for p in points)} of {len(points)} points tuned"
    if name == "kernels" and results:
        rows = {part: [r for result in results for r in result.get(part, [])]
                for part in ("decode", "paged", "prefill")}
        return "; ".join(f"{part}: {sum('error' not in r for r in rows[part])} of {len(rows[part])} rows timed"
                         for part in rows if rows[part])
    commands = record.get("commands", [])
    if record["status"] == "skipped":
        return ""
    return f"{sum(c['status'] == 'ok' for c in commands)} of {len(commands)} commands ok"


def _details(record: dict) -> list[str]:
    name, lines = record["step"], []
    for c in record.get("commands", []):
        result = c.get("result") if isinstance(c.get("result"), dict) else {}
        if name == "pytest" and result.get("failed"):
            lines += [f"- FAILED `{f['test']}`: {_first_line(f['message'])}" for f in result["failed"]]
        if name == "kernels" and result:
            lines += _kernel_tables(result)
        if name == "tune" and result.get("points"):
            lines += _table(["kernel", "cache", "shapes", "outcome", "winner", "ms (geo. mean)", "over defaults"],
                            _tune_rows(result))
        if name == "distill" and "dry-run" in c["label"] and result:
            lines += [f"8B recipe dry run ({result.get('platform', '?')}, mesh {result.get('mesh', '?')}), GiB per "
                      "device: " + ", ".join(f"{k} {v}" for k, v in result["bytes_per_device_gib"].items())]
        if name == "distill" and result:
            lines += _distill_lines(c["label"], result)
    if name == "bench":
        lines += _bench_table(record)
    if name == "serving":
        lines += _serving_tables(record)
    problems = [c for c in record.get("commands", []) if c["status"] not in ("ok",) and
                not (name == "bench" and "point" in c and c["status"] == "skipped")]
    lines += [f"- {c['label']}: **{c['status']}** {c.get('reason') or _first_line(_last(c.get('log_tail', '')))}"
              for c in problems]
    return lines


def _distill_lines(label: str, result: dict) -> list[str]:
    """A distill command's numbers: the step table and targets, the memory plan, train.py against its bare step, the
    demo's table."""
    lines = []
    if result.get("results"):
        lines += ["", f"`{label}`", ""] + _table(
            ["variant", "attention", "remat", "step s", "tokens/s", "MFU", "XLA peak GiB", "device peak GiB",
             "prof. HFU"],
            [[r["variant"], r.get("attention_impl", "-"), r.get("remat", "-"), f"{r['step_s']:.4f}",
              f"{r.get('tokens_per_s', 0):,.0f}",
              f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-", gib(r["xla_peak_bytes"]),
              gib(r["device_peak_bytes"]) if r.get("device_peak_bytes") else "-",
              f"{r['profiled_hfu']:.1%}" if r.get("profiled_hfu") is not None else "-"] for r in result["results"]])
        lines += [f"- {f['variant']} step with {f['attention_impl']} attention: **failed** (exit {f['returncode']}) "
                  f"{_first_line(_last(f.get('stderr_tail', '')))}" for f in result.get("failed", [])]
        if result.get("ratios"):
            lines.append("naive / ours: " + ", ".join(f"{k} {v:.2f}x" for k, v in result["ratios"].items()))
        for r in result["results"]:
            lines += _profile_lines(r)
        if result.get("targets"):
            lines.append("targets: " + ", ".join(f"{k} {t['measured']:.3g} vs {t['target']:g} "
                                                 f"{'PASS' if t['pass'] else 'FAIL'}"
                                                 + (f" ({t['attention_impl']})" if t.get("attention_impl") else "")
                                                 for k, t in result["targets"].items()))
    if result.get("plan"):
        plan = result["plan"]
        lines.append(f"memory plan ({plan['platform']}): " + ", ".join(
            f"{r['variant']} {r['remat']} {gib(r['xla_peak_bytes'])} GiB" for r in plan["rows"])
            + f"; chosen remat {plan['chosen_remat']}")
    if result.get("end_to_end"):
        e2e, bare = result["end_to_end"], result["bare"]
        verdict = {True: "PASS", False: "FAIL", None: "not judged"}[result.get("pass")]
        lines.append(f"train.py end to end ({result['preset']}): {e2e['step_s_mean'] * 1e3:.1f} ms a step against "
                     f"the bare step's {bare['step_s'] * 1e3:.1f} ms = {result['end_to_end_over_bare']:.3f} (target "
                     f"{result['target']}: {verdict}); host {e2e['host_s_mean'] * 1e3:.2f} ms a step")
    if result.get("rows") and result.get("checks"):
        checks = result["checks"]
        # a demo resumed after a call's time limit: the earlier calls' wall time up to their last save (results
        # written before 2026-11-27 summed their training and evaluation seconds instead)
        earlier = result.get("earlier_calls_seconds", (result.get("earlier_training_seconds") or 0)
                             + (result.get("earlier_evaluation_seconds") or 0))
        total = f"{result['seconds_with_earlier_calls'] / 60:.1f} min with earlier calls, " if earlier else ""
        stages = ", ".join(f"{k} {v:.0f} s" for k, v in result.get("stage_seconds", {}).items())
        lines += ["", f"demo ({result['settings']}, {result.get('device', '?')}, {total}{result['seconds'] / 60:.1f} "
                      f"min this call: {stages})", ""]
        lines += _table(["model", "val loss", "KL to teacher", "greedy agreement", "prefill vs teacher"],
                        [[r["model"], f"{r['val_loss']:.4f}", f"{r['kl_to_teacher']:.4f}",
                          f"{r['greedy_agreement']:.3f}", f"{r['prefill_time_vs_teacher']:.3f}"]
                         for r in result["rows"]])
        lines.append(f"gap closed by distillation at 50%: {checks['gap_closed_by_distillation_at_50']:.1%}"
                     + (f" (target {checks['gap_closed_target']:.0%}: "
                        f"{'PASS' if checks['gap_closed_pass'] else 'FAIL'})" if "gap_closed_pass" in checks else ""))
    if result.get("rows") and "undistilled_val_loss" in result:  # benchmarks/recipe_sweep.py
        lines += ["", f"recipe sweep ({result['budget']}): teacher {result['teacher_val_loss']:.4f}, undistilled 50% "
                      f"{result['undistilled_val_loss']:.4f}", ""]
        lines += _table(["row", "steps", "overrides", "val loss", "gap closed"],
                        [[r["name"], r["steps"], "; ".join(r["overrides"]), f"{r['val_loss']:.4f}",
                          f"{r['gap_closed']:.1%}"] for r in result["rows"]])
    return lines


def _profile_lines(row: dict, title: str | None = None, unit: str = "step") -> list[str]:
    """Where a distill step's (a kernel call's) device time went (benchmarks/op_profile.py), one line a variant."""
    title = title or f"{row['variant']} ({row.get('attention_impl', '-')})"
    if row.get("profile_error"):
        return [f"- profile of {title}: **failed** {_first_line(row['profile_error'])}"]
    prof = row.get("profile")
    if not prof:
        return []
    digits = 0 if unit == "step" else 3  # a kernel call is a fraction of a millisecond
    cats = ", ".join(f"{c['category']} {c['ms']:.{digits}f} ms ({c['share']:.0%}"
                     + (f", {c['tflops']:.0f} TFLOP/s)" if c.get("tflops") else ")") for c in prof["categories"])
    top = ", ".join(f"{o['op']} {o['ms']:.{digits + 1}f} ms" for o in prof["ops"][:3])
    return [f"- profile of {title}: {prof['busy_ms_per_step']:.{digits}f} ms of device ops in a "
            f"{prof['wall_ms_per_step']:.{digits}f} ms {unit}: {cats}; costliest ops {top}"]


def _tune_rows(result: dict) -> list:
    """A row per tuned point: its winner (the entry written for it) and its gain over the kernel's defaults."""
    entries = {(e["kernel"], e["cache_dtype"], e["min_tokens"]): e for e in result.get("entries", [])}
    rows = []
    for p in result["points"]:
        e = entries.get((p["kernel"], p["cache_dtype"], p["tokens"][0])) if p["status"].startswith("tuned") else None
        shapes = "; ".join(",".join(str(v) for v in shape.values()) for shape in p["shapes"])
        gain = p.get("speedup_over_default")
        rows.append([p["kernel"], p["cache_dtype"], shapes, _first_line(p["status"])[:60],
                     ", ".join(f"{k}={v}" for k, v in e["block_sizes"].items()) if e else "-",
                     _ms(e["measured"]["time_s"]) if e else "-", f"{gain:.2f}x" if gain else "-"])
    return rows


def _last(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _timed_cells(row: dict, cells, width: int) -> list:
    """A kernel row's timing cells, or its error in the first of `width` cells."""
    return cells(row) if "error" not in row else ["error: " + _first_line(row["error"])[:80]] + [""] * (width - 1)


def _kernel_tables(result: dict) -> list[str]:
    """kernels.py's tables. Decode rows as a share of the measured bandwidth, the larger of its probes (a run before
    the read probe had the copy alone, and one page size); an impl that failed its check has one row, no point."""
    probes = {k: result[k]["bandwidth"] for k in ("read", "copy") if k in result}
    measured = max(probes.values())
    # a decode-step row (kernels.py --layers): its time per layer
    decode = lambda r: [_ms(r.get("time_per_layer_s", r["time_s"])), f"{r['bandwidth'] / 1e9:.0f}",
                        f"{r['bandwidth'] / measured:.0%}"]
    impl = lambda r: f"{r['impl']}, per layer of {r['layers']}" if "layers" in r else r["impl"]
    prefill = lambda r: [_ms(r["time_s"]), f"{r['tflops']:.1f}"]
    lines = [f"measured bandwidth {measured / 1e9:.0f} GB/s ("
             + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in probes.items()) + f" GB/s) on "
             f"{result.get('device')}{' (smoke)' if result.get('smoke') else ''}", ""]
    point = lambda r, *keys: [r.get(k, "-") for k in keys]
    if result.get("decode"):
        lines += _table(["decode impl", "batch", "context", "ms", "GB/s", "of measured"],
                        [[impl(r), *point(r, "batch", "context"), *_timed_cells(r, decode, 3)]
                         for r in result["decode"]]) + [""]
    if result.get("paged"):
        lines += _table(["paged decode impl", "page", "batch", "context", "ms", "GB/s", "of measured"],
                        [[impl(r), r.get("page_size", result.get("page_size")), *point(r, "batch", "context"),
                          *_timed_cells(r, decode, 3)] for r in result["paged"]]) + [""]
    if result.get("prefill"):
        lines += _table(["prefill impl", "batch", "seq", "packed", "ms", "TFLOP/s"],
                        [[r["impl"], *point(r, "batch", "seq"), {True: "yes", False: "no"}.get(r.get("packed"), "-"),
                          *_timed_cells(r, prefill, 2)] for r in result["prefill"]])
    for table, fits in result.get("cost_fits", {}).items():  # each impl's time = fixed + bytes / stream
        lines += [""] + _table([f"{table} cost fit", "page", "batch", "contexts", "fixed us", "stream GB/s",
                                "of measured"],
                               [[f"{f['impl']}, per layer of {f['layers']}" if f["layers"] else f["impl"],
                                 f["page_size"] or "-", f["batch"], ",".join(map(str, f["contexts"])),
                                 f"{f['fixed_s'] * 1e6:.0f}",
                                 *([f"{f['stream_bandwidth'] / 1e9:.0f}", f"{f['stream_of_measured']:.0%}"]
                                   if f["stream_bandwidth"] else ["-", "-"])] for f in fits]) if fits else []
    for r in result.get("decode", []) + result.get("paged", []):  # --profile-at's rows: kernel against XLA ops
        pages = (f", pages of {r['page_size']}" if "page_size" in r else "") + (
            f", {r['layers']} layers a call" if "layers" in r else "")
        lines += _profile_lines(r, f"{r['impl']} at {r.get('batch')} x {r.get('context')}{pages}", unit="call")
    return lines


def _serving_tables(record: dict) -> list[str]:
    """Each serving command's table (benchmarks/serving.py writes it into its JSON) and its targets."""
    lines = []
    for c in record["commands"]:
        result = c.get("result") if isinstance(c.get("result"), dict) else {}
        if not result.get("table"):
            continue
        lines += ["", f"`{c['label']}` ({c['status']}): {result.get('title', '')}", "", result["table"]]
        lines += [result["targets_text"]] if result.get("targets_text") else []
    return lines


def _bench_table(record: dict) -> list[str]:
    rows = []
    for c in record["commands"]:
        if "point" not in c:
            continue
        p = c["point"]
        wirings = {r.get("wiring"): r for r in (c.get("result") or {}).get("results", [])}
        fast, slow = wirings.get("swiftkv", {}), wirings.get("teacher", {})
        if not fast:
            rows.append([p["prompt_len"], p["batch"], p["prefill_chunk"], c["status"] + ": " +
                         (c.get("reason") or _first_line(_last(c.get("log_tail", ""))))[:100]] + [""] * 6)
            continue
        ratio = fast.get("vs_teacher", {})
        rows.append([p["prompt_len"], p["batch"], p["prefill_chunk"], c["status"],
                     f"{_ms(fast['ttft_s'])} / {_ms(slow.get('ttft_s'))}", f"{ratio.get('ttft', 0):.2f}",
                     f"{_ms(fast['tpot_s'])} / {_ms(slow.get('tpot_s'))}", f"{fast['decode_tokens_per_s']:,.0f}",
                     f"{fast['roofline_fraction']:.0%}" if "roofline_fraction" in fast else "-",
                     f"{_mib(fast['kv_cache_bytes'])} / {_mib(slow.get('kv_cache_bytes', 0))}"])
    return _table(["prompt", "batch", "chunk", "status", "TTFT ms SwiftKV / teacher", "TTFT ratio",
                   "TPOT ms SwiftKV / teacher", "decode tok/s SwiftKV", "roofline", "KV MiB SwiftKV / teacher"], rows)


def summarize(folder) -> str:
    """summary.md of a results folder: the commit and machine, a line a step, then each step's numbers."""
    env, steps = read_results(folder)
    env = env or {}
    probe, smi = env.get("probe", {}), env.get("nvidia_smi", {})
    commit = env.get("commit", {})
    lines = ["# GPU pack results" + (" (SMOKE: tiny shapes on a CPU; nothing here is a measurement)"
                                     if env.get("smoke") else ""), ""]
    dirty = f" + uncommitted changes (diff {commit.get('diff', '?')})" if commit.get("dirty") else ""
    lines.append(f"- commit: `{commit.get('commit', 'unknown')}`{dirty} (from {commit.get('source', '?')})")
    for gpu in smi.get("gpus", []):
        lines.append(f"- GPU: {gpu['name']}, {gib(gpu['memory_bytes'])} GiB, driver {gpu['driver']}, "
                     f"CUDA {smi.get('cuda')}")
    versions = probe.get("versions", {})
    lines.append(f"- jax {probe.get('jax', versions.get('jax'))} (backend {probe.get('backend')}), jaxlib "
                 f"{versions.get('jaxlib')}, plugin {versions.get('jax-cuda13-plugin')}, Python {env.get('python')}, "
                 f"host {env.get('host')}, last call written {env.get('written')}")
    install = env.get("install", {})
    lines.append(f"- wheelhouse install: {install.get('status')} {install.get('reason') or ''}"
                 f"{', '.join(install.get('wheels', []))}")
    if probe.get("unmet"):
        lines.append("- unmet requirements: " + "; ".join(probe["unmet"]))
    bad_imports = {k: v for k, v in probe.get("imports", {}).items() if v != "ok"}
    if bad_imports:
        lines.append("- imports failing: " + "; ".join(f"{k}: {v}" for k, v in bad_imports.items()))
    lines.append("")
    by_name = {s["step"]: s for s in steps}
    overview = []
    for step in STEPS:
        record = by_name.pop(step.name, None)
        if record is None:
            overview.append([step.index, step.name, "not run", "", ""])
            continue
        reason = f" ({record['reason']})" if record.get("reason") else ""
        other = record.get("env", {})
        elsewhere = (f"; on {other.get('device')}, commit {str(other.get('commit'))[:10]}"
                     if other.get("commit") != commit.get("commit") else "")
        overview.append([step.index, step.name, f"**{record['status']}**{reason}"[:200],
                         f"{record.get('seconds', 0):.0f} s", _headline(record) + elsewhere])
    lines += _table(["#", "step", "status", "time", "result"], overview)
    for record in steps:
        if record["step"] not in BY_NAME:
            continue
        details = _details(record)
        if details:
            lines += ["", f"## {record['index']}. {record['step']}: {record['title']}", ""] + details
    return "\n".join(lines) + "\n"
