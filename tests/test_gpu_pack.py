"""benchmarks/gpu/pack.py: the wheelhouse check, the runner's records (failure, time-out, not built yet, merging
calls), installing wheels with no index, and `run --smoke`, the whole step sequence on a CPU, end to end."""

import dataclasses
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACK = REPO / "benchmarks" / "gpu"
sys.path.insert(0, str(PACK))

import pack  # noqa: E402
import pack_runner  # noqa: E402
import pack_steps  # noqa: E402
import pack_wheels  # noqa: E402
from pack_runner import Command, Context, Step  # noqa: E402


def make_wheel(folder: Path, name: str, version: str, requires=(), tag="py3-none-any", module=None) -> Path:
    """A minimal installable wheel: METADATA (with Requires-Dist), WHEEL, RECORD, and optionally one module."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-{tag}.whl"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    files = {f"{dist}.dist-info/METADATA": metadata,
             f"{dist}.dist-info/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n"}
    if module:
        files[f"{module}.py"] = f"VERSION = {version!r}\n"
    files[f"{dist}.dist-info/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        for n, text in files.items():
            zf.writestr(n, text)
    return path


# --- the wheelhouse ---------------------------------------------------------------------------------------------

def test_every_requirement_of_the_project_is_pinned_or_on_the_host():
    """The list is complete at the level CI can see without downloading: each requirement of pyproject (every
    extra too) is pinned or preinstalled, in a version that satisfies it where the host's version is known."""
    _, host = pack_wheels.read_host()
    pins = pack_wheels.read_pins()
    available = {**{n: (v, "on the host") for n, v in host.items()}, **{n: (v, "pinned") for n, v in pins.items()}}
    assert pack_wheels.unmet(pack_wheels.project_requirements(), available) == []
    assert "datasets" in pins and "datasets" not in host
    assert not set(pins) & set(host), "ship only what the host lacks"


def test_check_finds_what_is_missing_conflicting_stale_or_too_big(tmp_path):
    host = {"numpy": "2.5.2", "pandas": None}
    project = [("numpy>=1.26", "pyproject"), ("alpha>=1", "pyproject"), ("torch; extra == 'x'", "pyproject")]
    make_wheel(tmp_path, "alpha", "1.0", ["beta<2", "pandas", "numpy>=3", "gamma; python_version < '3.0'"])
    make_wheel(tmp_path, "beta", "1.5", ["delta"])
    make_wheel(tmp_path, "stale", "0.1")
    make_wheel(tmp_path, "native", "1.0", tag="cp311-cp311-macosx_11_0_arm64")
    pins = {"alpha": "1.0", "beta": "1.5", "native": "1.0", "epsilon": "2.0"}
    wheels, problems = pack_wheels.check(tmp_path, pins, host, project, budget_mib=1e-4)
    text = "\n".join(problems)
    assert len(wheels) == 4
    assert "delta (needed by beta 1.5: delta): missing" in text          # a dependency of a shipped wheel
    assert "numpy 2.5.2 (on the host) does not satisfy alpha 1.0's numpy>=3" in text
    assert "stale-0.1-py3-none-any.whl: not pinned" in text
    assert "epsilon==2.0: pinned but no wheel" in text
    assert "not CPython 3.12" in text and "over the 0.0001 MiB budget" in text
    assert "gamma" not in text and "torch" not in text and "pandas" not in text  # markers, extras, unknown version
    (tmp_path / "stale-0.1-py3-none-any.whl").unlink()
    (tmp_path / "native-1.0-cp311-cp311-macosx_11_0_arm64.whl").unlink()
    make_wheel(tmp_path, "delta", "0.3")
    ok_project = [("numpy>=1.26", "pyproject"), ("alpha>=1", "pyproject")]
    _, problems = pack_wheels.check(tmp_path, {"alpha": "1.0", "beta": "1.5", "delta": "0.3"}, {**host, "numpy": "3.1"},
                                    ok_project)
    assert problems == []


def test_prepare_keeps_the_pins_removes_the_rest_and_stamps_the_commit(tmp_path):
    house, lists = tmp_path / "whl", tmp_path / "lists"
    house.mkdir(), lists.mkdir()
    (lists / "pins.txt").write_text("# comment\nalpha==1.0  # why\nbeta==2.0\n")
    (lists / "host.txt").write_text("# read: 2026-01-02\nnumpy==2.0\n")
    (lists / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = ["numpy", "alpha"]\n')
    make_wheel(house, "alpha", "1.0", ["beta"])
    make_wheel(house, "alpha", "0.9")  # another version: two stop the host's install
    downloads = []

    def download(specs, dest):
        downloads.append(specs)
        for spec in specs:
            make_wheel(dest, *spec.split("=="))

    lines = []
    rc = pack_wheels.prepare(house, lists / "pins.txt", lists / "host.txt", lists / "pyproject.toml",
                             download=download, print_fn=lines.append)
    assert rc == 0, lines
    assert downloads == [["beta==2.0"]]
    assert sorted(p.name for p in house.iterdir()) == ["alpha-1.0-py3-none-any.whl", "beta-2.0-py3-none-any.whl",
                                                       "commit.json"]
    stamp = json.loads((house / "commit.json").read_text())
    assert stamp["commit"] == "unknown" or len(stamp["commit"]) == 40
    assert any("host packages as read 2026-01-02" in line for line in lines)
    assert pack_runner.commit_info(house)["source"] == str(house / "commit.json")


def test_pins_must_be_exact(tmp_path):
    (tmp_path / "p.txt").write_text("datasets>=5\n")
    with pytest.raises(ValueError, match="exact pin"):
        pack_wheels.read_pins(tmp_path / "p.txt")


def test_install_puts_wheels_on_a_path_with_no_index(tmp_path):
    house = tmp_path / "whl"
    house.mkdir()
    make_wheel(house, "gpu-pack-probe", "1.2.3", module="gpu_pack_probe")
    record = pack_runner.install(house, tmp_path / "site", sys.executable)
    assert record["status"] == "ok", record["log_tail"]
    out = subprocess.run([sys.executable, "-c", "import gpu_pack_probe; print(gpu_pack_probe.VERSION)"],
                         env={"PYTHONPATH": str(tmp_path / "site")}, capture_output=True, text=True)
    assert out.stdout.strip() == "1.2.3"
    assert pack_runner.install(tmp_path, tmp_path / "site", sys.executable)["status"] == "skipped"


# --- the runner -------------------------------------------------------------------------------------------------

def args_only(argv):
    """benchmarks/gpu/args_only.py over a command's (python, script, *args): its script parses the args, no more."""
    return subprocess.run([sys.executable, str(PACK / "args_only.py"), *map(str, argv[1:])], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_a_later_call_of_other_points_keeps_the_earlier_rows():
    """`collect` merges calls by command label: the kernels step's names its points, so a call narrowed to the
    points still open adds its rows, and one of the same points replaces them."""
    def call(*labels, status="ok"):
        return {"step": "kernels", "status": status, "commands": [{"label": x, "status": status} for x in labels]}

    first = call("benchmarks/kernels.py --parts decode", "benchmarks/kernels.py --parts paged")
    narrowed = call("benchmarks/kernels.py --parts decode --decode-points 128x32768")
    merged = pack_runner.merge(first, narrowed)
    assert [c["label"] for c in merged["commands"]] == [c["label"] for c in first["commands"] + narrowed["commands"]]
    again = pack_runner.merge(merged, call("benchmarks/kernels.py --parts decode --decode-points 128x32768",
                                           status="failed"))
    assert [c["status"] for c in again["commands"]] == ["ok", "ok", "failed"]


def fake_steps(tmp_path):
    py = sys.executable

    def fails(ctx, run):
        run(Command("fails", (py, "-c", "print('boom'); raise SystemExit(3)"), 30))

    def sleeps(ctx, run):
        run(Command("sleeps", (py, "-c", "import time; print('waiting', flush=True); time.sleep(60)"), 1))
        run(Command("after", (py, "-c", "pass"), 30))

    def missing(ctx, run):
        run(Command("script", (py, "benchmarks/not_there.py"), 30, script="benchmarks/not_there.py"))

    def writes(ctx, run):
        out = ctx.tmp / "r.json"
        run(Command("point a", (py, "-c", f"open({str(out)!r}, 'w').write('{{\"x\": 1}}')"), 30, output=out))
        if not ctx.smoke:
            run(Command("point b", (py, "-c", "pass"), 30, parse=lambda log: {"y": 2}))

    def raises(ctx, run):
        raise RuntimeError("a bug in the step")

    names = ("fails", "sleeps", "missing", "writes", "raises")
    return [Step(i, n, f"fake {n}", 30, f) for i, (n, f) in enumerate(zip(names, (fails, sleeps, missing, writes,
                                                                                   raises)), 1)]


def fake_summary(folder):
    env, steps = pack_runner.read_results(folder)
    return "\n".join(f"{s['step']} {s['status']}" for s in steps) + "\n"


def test_runner_records_every_outcome_and_goes_on(tmp_path):
    steps = fake_steps(tmp_path)
    out = tmp_path / "out"
    ctx = Context(smoke=False, python=sys.executable, repo=REPO, tmp=tmp_path, env={"PATH": "/usr/bin:/bin"})
    rc = pack_runner.run(steps, ctx, out, tmp_path / "no-wheels", tmp_path / "site", 300, fake_summary,
                         install_wheels=False, smi={})
    assert rc == 1
    assert sorted(p.name for p in out.iterdir()) == sorted(["env.json", "summary.md"] + [
        f"{s.name}.json" for s in steps])
    records = {s.name: json.loads((out / f"{s.name}.json").read_text()) for s in steps}
    assert records["fails"]["status"] == "failed" and records["fails"]["commands"][0]["returncode"] == 3
    assert "boom" in records["fails"]["commands"][0]["log_tail"]
    sleeps = records["sleeps"]["commands"]
    assert records["sleeps"]["status"] == "timeout" and sleeps[0]["status"] == "timeout" and sleeps[1]["status"] == "ok"
    assert "waiting" in sleeps[0]["log_tail"]
    assert records["missing"]["status"] == "skipped" and "not built yet" in records["missing"]["reason"]
    assert records["writes"]["status"] == "ok"
    assert [c.get("result") for c in records["writes"]["commands"]] == [{"x": 1}, {"y": 2}]
    assert records["raises"]["status"] == "failed" and "a bug in the step" in records["raises"]["error"]
    assert (out / "summary.md").read_text().splitlines()[0] == "fails failed"
    env = json.loads((out / "env.json").read_text())
    assert env["commit"]["commit"] and env["install"]["status"] == "skipped"

    # a second call with one step: its file is merged by command label, the others stay; collect does the same
    again = tmp_path / "again"
    smoke = Context(smoke=True, python=sys.executable, repo=REPO, tmp=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert pack_runner.run([steps[3]], smoke, again, tmp_path, tmp_path / "site", 300, fake_summary,
                           install_wheels=False, smi={}) == 0
    assert [p.name for p in again.glob("*.json")].count("writes.json") == 1
    merged = pack_runner.collect([out, again], tmp_path / "merged", fake_summary)
    writes = json.loads((merged / "writes.json").read_text())
    assert [c["label"] for c in writes["commands"]] == ["point a", "point b"] and writes["calls"] == 2
    assert "fails failed" in (merged / "summary.md").read_text()


def test_a_command_past_its_limit_is_stopped_by_sigterm_within_the_deadline(tmp_path):
    """At its limit a command gets SIGTERM and stop_grace_s to end (the demo's training saves a checkpoint then),
    taken from the time left, so that its stopping too ends by the deadline; a command that would not get
    MIN_COMMAND_S besides its grace is not started."""
    saved = tmp_path / "saved"
    code = ("import signal, sys, time\n"
            "def stop(*_): time.sleep(0.5); open(sys.argv[1], 'w').write('saved'); sys.exit(143)\n"
            "signal.signal(signal.SIGTERM, stop); print('training', flush=True); time.sleep(60)")
    ctx = Context(smoke=False, python=sys.executable, repo=REPO, tmp=tmp_path, env={"PATH": "/usr/bin:/bin"})
    start = time.monotonic()
    runner = pack_runner.StepRun(Step(1, "stops", "fake", 300, lambda ctx, run: None), ctx, start + 9)
    record = runner.run(Command("stops", (sys.executable, "-c", code, saved), 300, stop_grace_s=3))
    assert record["status"] == "timeout" and record["returncode"] == 143 and saved.read_text() == "saved"
    assert record["limit_s"] <= 6 and time.monotonic() - start < 9
    late = runner.run(Command("late", (sys.executable, "-c", "pass"), 300, stop_grace_s=3))
    assert late["status"] == "not run"


def test_a_step_past_the_deadline_is_not_started(tmp_path):
    steps = fake_steps(tmp_path)[3:4]
    ctx = Context(smoke=True, python=sys.executable, repo=REPO, tmp=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert pack_runner.run(steps, ctx, tmp_path / "out", tmp_path, tmp_path / "site", 1, fake_summary,
                           install_wheels=False, smi={}) == 0
    assert not (tmp_path / "out" / "writes.json").exists()


def test_step_selection_chunks_and_bandwidth():
    assert [s.name for s in pack_steps.select("3,pytest")] == ["pytest", "bench"]
    assert len(pack_steps.select("all")) == len(pack_steps.STEPS) == 7
    assert [s.name for s in pack_steps.select("7,kernels")] == ["kernels", "tune"]
    with pytest.raises(ValueError, match="unknown step"):
        pack_steps.select("8")
    assert pack_steps.prefill_chunk(2048, 1, 65536) == 2048
    assert pack_steps.prefill_chunk(8192, 64, 65536) == 1024
    assert pack_steps.prefill_chunk(24, 8, 16) == 12 and pack_steps.prefill_chunk(36, 8, 16) == 9  # stops at 16 or odd
    assert pack_steps.parse_points("2048x1, 8192x16") == ((2048, 1), (8192, 16))
    assert pack_runner.bandwidth_of("NVIDIA H100 80GB HBM3") == 3.35e12
    assert pack_runner.bandwidth_of("NVIDIA H200") == 4.8e12 and pack_runner.bandwidth_of("cpu") is None


# --- the whole sequence ----------------------------------------------------------------------------------------

def test_smoke_runs_every_step_and_records_an_injected_failure(tmp_path):
    """`pack.py run --smoke`: every step on the CPU with tiny shapes; step 1 made to fail, the rest still run."""
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, str(PACK / "pack.py"), "run", "--smoke", "--out", str(out), "--quiet",
                           "--inject-failure", "pytest"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(["env.json", "summary.md"] + [f"{s.name}.json" for s in pack_steps.STEPS])
    assert all(p.is_file() for p in out.iterdir())  # flat (a GPU call, at most 6 steps, brings back <= 8 files)
    records = {s.name: json.loads((out / f"{s.name}.json").read_text()) for s in pack_steps.STEPS}

    def why(name):
        return json.dumps(records[name], indent=1)[-4000:]

    pytest_cmds = records["pytest"]["commands"]
    assert records["pytest"]["status"] == "failed" and pytest_cmds[-1]["label"] == "injected failure", why("pytest")
    assert [c["part"] for c in pytest_cmds[:-1]] == list(pack_steps.PYTEST_PARTS), why("pytest")
    assert all(c["status"] == "ok" and c["result"]["collected"] > 0 for c in pytest_cmds[:-1]), why("pytest")
    assert records["kernels"]["status"] == "ok", why("kernels")
    kernels = records["kernels"]["commands"][0]["result"]
    assert kernels["smoke"] is True and kernels["measured_bandwidth"] == max(kernels[k]["bandwidth"]
                                                                             for k in ("copy", "read"))
    assert {r["page_size"] for r in kernels["paged"]} == set(kernels["page_sizes"]) == {16, 32}
    step_rows = [r for r in kernels["decode"] if "layers" in r]  # --layers: a decode step's layers, per layer
    assert step_rows and all(r["layers"] == 2 and r["time_per_layer_s"] == pytest.approx(r["time_s"] / 2)
                             for r in step_rows if "time_s" in r), why("kernels")
    paged_steps = [r for r in kernels["paged"] if "layers" in r]  # sk.Engine's paths at the first page size
    assert {r["impl"] for r in paged_steps if "time_s" in r} >= {"pallas", "pallas_int8"}, why("kernels")
    assert all(r["layers"] == 2 and r["page_size"] == 16 for r in paged_steps), why("kernels")
    assert "xla, per layer of 2" in (out / "summary.md").read_text()
    assert "| pallas, per layer of 2 | 16 |" in (out / "summary.md").read_text()
    profiled = [r for r in kernels["decode"] + kernels["paged"] if "profile" in r]  # --profile-at 2x256 only
    assert profiled and {(r["batch"], r["context"]) for r in profiled} == {(2, 256)}, why("kernels")
    assert all(r["profile"]["busy_ms_per_step"] > 0 and r["profile"]["ops"] for r in profiled)
    bench = {c["label"]: c for c in records["bench"]["commands"]}
    assert records["bench"]["status"] == "ok", why("bench")
    point = bench["prompt 32 x batch 2"]
    assert point["result"]["results"][0]["wiring"] == "swiftkv" and "--prefill-chunk" in point["argv"]
    assert "roofline_fraction" in point["result"]["results"][0]
    assert bench["prompt 1048576 x batch 64"]["status"] == "skipped"
    assert bench["prompt 1048576 x batch 64"]["reason"].startswith("does not fit (33.0 GiB needed")
    assert records["distill"]["status"] == "ok", why("distill")
    distill = {c["label"].split(" (smoke")[0]: c for c in records["distill"]["commands"]}
    assert distill["train.py --config configs/llama-3.1-8b-instruct.yaml --dry-run"]["result"][
        "bytes_per_device_gib"]["total"] >= 0
    plan = distill["benchmarks/distill_step.py --preset 8b"]["result"]["plan"]  # the tiny preset's, every policy
    assert {r["remat"] for r in plan["rows"]} == {"none", "dots", "full"} and plan["chosen_remat"] == "none"
    assert all(distill[label]["status"] == "ok" for label in ("benchmarks/distill_step.py --preset 1b",
                                                             "benchmarks/train_pipeline.py --preset 1b",
                                                             "demo.py --budget gpu",
                                                             "benchmarks/recipe_sweep.py --budget gpu"))
    assert "memory plan (cpu)" in (out / "summary.md").read_text()
    assert records["tune"]["status"] == "ok", why("tune")
    tune = records["tune"]["commands"][0]["result"]
    assert [p["status"] for p in tune["points"]] == ["tuned"] and len(tune["entries"]) == 1
    assert "| decode | bfloat16 | 2,128 | tuned |" in (out / "summary.md").read_text()
    for name in ("serving", "peers"):  # skipped until the script exists, then its smoke runs
        assert records[name]["status"] in ("ok", "skipped"), why(name)
        if not (REPO / "benchmarks" / f"{name}.py").exists():
            assert records[name]["reason"].startswith("not built yet")
    env = json.loads((out / "env.json").read_text())
    assert env["probe"]["backend"] == "cpu" and env["probe"]["imports"]["swiftkv_jax"] == "ok"
    summary = (out / "summary.md").read_text()
    assert env["commit"]["commit"] in summary and "SMOKE" in summary
    assert "| 1 | pytest | **failed**" in summary and "| 3 | bench | **ok**" in summary
    assert "| paged decode impl | page | batch | context | ms | GB/s | of measured |" in summary


def test_a_gpu_call_of_more_steps_than_files_it_brings_back_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, str(PACK / "pack.py"), "run", "--out", str(tmp_path / "r"), "--no-install",
                           "--steps", "all"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "at most 8" in proc.stderr and "at most 6 steps a call" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_tune_step_passes_its_points_and_a_deadline_inside_its_limit(tmp_path):
    """On the GPU the tune step runs every point (or --tune-only's) under tune_kernels.py's own deadline, which the
    step's limit covers; the script accepts the argv."""
    seen = []
    ctx = Context(smoke=False, python=sys.executable, repo=REPO, tmp=tmp_path, tune_only="mosaic_decode:int8")
    pack_steps.tune_step(ctx, seen.append)
    (cmd,) = seen
    argv = [str(a) for a in cmd.argv]
    assert argv[argv.index("--only") + 1] == "mosaic_decode:int8"
    deadline = float(argv[argv.index("--deadline") + 1])
    assert deadline + 30 < cmd.limit_s < pack_steps.BY_NAME["tune"].limit_s
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import tune_kernels
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    assert [p.kernel for p in tune_kernels.parse_only("mosaic_decode:int8", tune_kernels.POINTS)] == ["mosaic_decode"]
    # an item naming no point is refused even beside one that does (it was skipped: a GPU call tuned the rest only)
    with pytest.raises(ValueError, match="paged:float8 names no point.*paged:float8_e4m3fn"):
        tune_kernels.parse_only("flash,paged:float8", tune_kernels.POINTS)
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "pack.py"), "run", "--out",
                           str(tmp_path / "r"), "--steps", "tune", "--tune-only", "paged:int8,mosaic_decode:fp8"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "mosaic_decode:fp8 names no point" in proc.stderr, proc.stderr
    assert not (tmp_path / "r").exists()
    assert tune_kernels.POINTS[0].kernel == "mosaic_flash" and tune_kernels.POINTS[0].shapes[0]["tokens"] == 8192


def test_serving_step_runs_each_part_with_arguments_serving_py_accepts(tmp_path):
    """On the GPU the serving step runs benchmarks/serving.py once a part (--serving-parts), each with its own label
    (so calls accumulate through collect); every argv parses with the script's own parser (on 8b, no device touched)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import serving

    commands = []
    parts = ("offline", "sweep", "peer", "prefix")
    ctx = Context(smoke=False, python=sys.executable, repo=REPO, tmp=tmp_path, serving_parts=parts)
    pack_steps.serving_step(ctx, commands.append)
    assert [c.label for c in commands] == [f"benchmarks/serving.py --part {p}" for p in parts[:3]] + [
        "benchmarks/serving.py --workload shared-prefix"]
    for command, part in zip(commands, parts):
        args = serving.parse_args([str(a) for a in command.argv[2:]])
        workload = "shared-prefix" if part == "prefix" else "random"
        assert (args.preset, args.workload, args.deadline) == ("8b", workload, serving.PART_DEADLINE_8B)
        assert args.part == (part if part != "prefix" else "all")
        assert command.output == tmp_path / f"serving_{part}.json" and command.limit_s >= args.deadline + 30
    assert pack_steps.parse_parts("offline, peer") == ("offline", "peer")
    with pytest.raises(ValueError, match="choose from offline, sweep, peer, prefix, all"):
        pack_steps.parse_parts("fast")


def test_distill_step_runs_each_part_bounded_with_arguments_its_script_accepts(tmp_path):
    """On the GPU the distill step runs one command a part (--distill-parts), each under its own limit of at most
    10 minutes and writing a JSON the record keeps; every argv parses with its script's parser."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import distill_step
    import recipe_sweep
    import train_pipeline

    from swiftkv_jax import demo

    commands = []
    ctx = Context(smoke=False, python=sys.executable, repo=REPO, tmp=tmp_path, distill_parts=pack_steps.DISTILL_PARTS)
    pack_steps.distill_step(ctx, lambda c: commands.append(c) or {"status": "ok"})
    by_label = {c.label: c for c in commands}
    assert list(by_label)[:5] == ["benchmarks/distill_step.py --preset 8b", "benchmarks/distill_step.py --preset 1b",
                                  "benchmarks/train_pipeline.py --preset 1b", "demo.py --budget gpu",
                                  "benchmarks/recipe_sweep.py --budget gpu"]
    assert all(c.limit_s <= 600 for c in commands)
    for preset in ("8b", "1b"):
        c = by_label[f"benchmarks/distill_step.py --preset {preset}"]
        args = distill_step.parser().parse_args([str(a) for a in c.argv[2:]])
        assert (args.preset, args.plan, args.variants) == (preset, False, "ours,naive") and c.output == Path(args.out)
    c = by_label["benchmarks/train_pipeline.py --preset 1b"]
    assert train_pipeline.parser().parse_args([str(a) for a in c.argv[2:]]).preset == "1b"
    c = by_label["demo.py --budget gpu"]
    args = demo.parser().parse_args([str(a) for a in c.argv[2:]])
    assert args.budget == "gpu" and c.output == args.results / "results.json" and args.attention is None
    # in the checkout (kept between the calls of a warm machine), given time to save a checkpoint when stopped
    assert Path(args.out) == REPO / pack_steps.DEMO_DIR and c.stop_grace_s == pack_steps.DEMO_STOP_GRACE_S
    assert subprocess.run(["git", "check-ignore", "-q", pack_steps.DEMO_DIR], cwd=REPO).returncode == 0
    c = by_label["benchmarks/recipe_sweep.py --budget gpu"]  # the demo's teacher, the budget's steps
    args = recipe_sweep.parser().parse_args([str(a) for a in c.argv[2:]])
    assert (args.work, args.budget, c.output) == (REPO / pack_steps.DEMO_DIR, "gpu", args.out)
    rows = [recipe_sweep.parse_row(r) for r in args.rows]
    rate = float(next(o for o in demo.SETTINGS["gpu"].distill_overrides if "learning_rate" in o).split("=")[1])
    assert [(steps, len(overrides), overrides[0].split("=")[0]) for _, steps, overrides in rows[:2]] == [
        (None, 1, "optim.learning_rate")] * 2  # the budget's steps; half and twice its rate
    assert [float(overrides[0].split("=")[1]) for _, _, overrides in rows[:2]] == pytest.approx([rate / 2, rate * 2])
    settings = demo.SETTINGS["gpu"]  # then its tokens and rate in half the steps of twice the rows (the earlier recipe)
    (_, steps, overrides), = rows[2:]
    rows_a_step = settings.distill_rows * 2
    assert (steps, overrides) == (settings.distill_steps // 2, (f"train.global_batch_size={rows_a_step}",))
    assert steps * settings.distill_rows * 2 == settings.distill_steps * settings.distill_rows
    commands.clear()  # --demo-attention reaches demo.py and every row of the sweep
    pack_steps.distill_step(dataclasses.replace(ctx, distill_parts=("demo", "sweep"), demo_attention="cudnn"),
                            lambda c: commands.append(c) or {"status": "ok"})
    assert demo.parser().parse_args([str(a) for a in commands[0].argv[2:]]).attention == "cudnn"
    rows = [recipe_sweep.parse_row(r) for r in recipe_sweep.parser().parse_args(
        [str(a) for a in commands[1].argv[2:]]).rows]
    assert all(r[2][-1] == "model.attention_impl=cudnn" for r in rows) and len(rows) == 3
    assert pack_steps.parse_distill_parts("8b, demo") == ("8b", "demo")
    with pytest.raises(ValueError, match="choose from 8b, 1b, train, demo, sweep, dryrun"):
        pack_steps.parse_distill_parts("9b")


def test_pytest_step_runs_each_part_bounded_over_every_gpu_test_file(tmp_path):
    """On the GPU the pytest step runs one command a part (--pytest-parts), each over its files with its own junit
    and a limit that fits a call of 10 minutes; the parts' files are disjoint and hold every file with GPU tests."""
    commands = []
    ctx = Context(smoke=False, python=sys.executable, repo=REPO, tmp=tmp_path)
    pack_steps.pytest_step(ctx, lambda c: commands.append(c) or {"status": "ok"})
    assert [c.label for c in commands] == [f"pytest -m gpu: {p}" for p in pack_steps.PYTEST_PARTS]
    assert all(c.limit_s <= 540 and c.skip is None for c in commands)
    junits = [c.argv[c.argv.index("--junitxml") + 1] for c in commands]
    assert len(set(junits)) == len(commands) and all(Path(j).parent == tmp_path for j in junits)
    files = [pack_steps.pytest_files(REPO, p) for p in pack_steps.PYTEST_PARTS]
    assert all(c.argv[-len(f):] == tuple(f) for c, f in zip(commands, files))
    flat = [f for part in files for f in part]
    gpu_files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py")
                       if "mark.gpu" in p.read_text())
    assert sorted(flat) == gpu_files and len(set(flat)) == len(flat)
    assert pack_steps.parse_pytest_parts("mosaic, rest") == ("mosaic", "rest")
    with pytest.raises(ValueError, match="choose from mosaic, pallas, rest"):
        pack_steps.parse_pytest_parts("triton")


def test_kernel_tables_read_both_probes_page_sizes_and_earlier_runs():
    """summary.md's kernels tables: decode rows as a share of the larger bandwidth probe, paged rows with their page
    size, an impl refused at a page size in one row; a run before the read probe (copy alone, one page size) too."""
    row = {"impl": "pallas", "batch": 32, "context": 4096, "time_s": 1e-3, "bandwidth": 2e12}
    new = {"copy": {"bandwidth": 2.5e12}, "read": {"bandwidth": 4e12}, "measured_bandwidth": 4e12, "device": "H200",
           "decode": [row], "paged": [{**row, "page_size": 32}, {"impl": "mosaic_int8", "page_size": 16,
                                                                   "error": "ValueError: refused"}],
           "prefill": [{"impl": "jax_mosaic_fp16", "error": "unavailable"}]}
    lines = pack_steps._kernel_tables(new)
    assert lines[0] == "measured bandwidth 4000 GB/s (read 4000, copy 2500 GB/s) on H200"
    assert "| pallas | 32 | 4096 | 1.00 | 2000 | 50% |" in lines
    assert "| pallas | 32 | 32 | 4096 | 1.00 | 2000 | 50% |" in lines
    assert "| mosaic_int8 | 16 | - | - | error: ValueError: refused |  |  |" in lines
    assert "| jax_mosaic_fp16 | - | - | - | error: unavailable |  |" in lines
    old = {"copy": {"bandwidth": 2e12}, "page_size": 16, "device": "H200", "paged": [row]}
    lines = pack_steps._kernel_tables(old)
    assert lines[0] == "measured bandwidth 2000 GB/s (copy 2000 GB/s) on H200"
    assert "| pallas | 16 | 32 | 4096 | 1.00 | 2000 | 100% |" in lines


def test_kernels_bench_puts_the_targets_points_first():
    """benchmarks/kernels.py's points: those the targets need ahead of the rest, so a --deadline cuts the rest."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import kernels

    points = [(32, 2048), (32, 4096), (64, 4096), (128, 4096)]
    assert kernels.leading(points, [(128, 4096), (32, 4096), (32, 32768)]) == [(128, 4096), (32, 4096), (32, 2048),
                                                                               (64, 4096)]


def test_kernels_bench_fits_a_fixed_cost_and_a_stream_to_each_implementations_contexts(tmp_path, capsys):
    """kernels.py's cost fits: time = fixed + bytes / stream through an impl's rows of one batch (a decode step's rows
    per layer), checked against hand arithmetic: 1 GB in 0.30 ms and 2 GB in 0.55 ms is 0.25 ms a GB (4 TB/s) past
    a fixed 50 us. A row with an error, or an impl timed at one context, has no fit. --fits-of reads a pack step's
    JSON; summary.md shows the fits."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import kernels

    rows = [{"impl": "mosaic", "batch": 32, "context": 4096, "kv_bytes": 1e9, "time_s": 0.30e-3},
            {"impl": "mosaic", "batch": 32, "context": 8192, "kv_bytes": 2e9, "time_s": 0.55e-3},
            {"impl": "mosaic", "batch": 32, "context": 4096, "layers": 4, "kv_bytes": 4e9, "time_s": 4 * 0.20e-3},
            {"impl": "mosaic", "batch": 32, "context": 8192, "layers": 4, "kv_bytes": 8e9, "time_s": 4 * 0.45e-3},
            {"impl": "xla", "batch": 32, "context": 4096, "kv_bytes": 1e9, "time_s": 0.3e-3},
            {"impl": "xla", "batch": 32, "context": 8192, "error": "not measured: past --deadline 1 s"}]
    fits = kernels.cost_fits(rows, measured_bw=5e12)
    assert [(f["impl"], f["layers"], f["contexts"]) for f in fits] == [("mosaic", None, [4096, 8192]),
                                                                      ("mosaic", 4, [4096, 8192])]
    single, step = fits
    assert single["fixed_s"] == pytest.approx(50e-6) and single["stream_bandwidth"] == pytest.approx(4e12)
    assert single["stream_of_measured"] == pytest.approx(0.8) and single["worst_residual"] < 1e-9
    assert step["fixed_s"] == pytest.approx(-50e-6, abs=1e-12) and step["stream_bandwidth"] == pytest.approx(4e12)

    record = {"commands": [{"label": "kernels: decode", "result": {
        "command": "python benchmarks/kernels.py --parts decode", "device": "H200", "commit": "0" * 40,
        "measured_bandwidth": 5e12, "decode": rows}}]}
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(record))
    assert kernels.main(["--fits-of", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "decode cost fits" in printed and "mosaic, 4 layers" in printed
    assert [line.split()[-4:] for line in printed.splitlines() if line.startswith("mosaic   ")] == [
        ["50.0", "4000", "80.0%", "0.0%"]]
    path.write_text(json.dumps({"commands": []}))
    assert kernels.main(["--fits-of", str(path)]) == 2

    lines = pack_steps._kernel_tables({"read": {"bandwidth": 5e12}, "device": "H200",
                                       "cost_fits": {"decode": fits, "paged": []}})
    assert "| mosaic | - | 32 | 4096,8192 | 50 | 4000 | 80% |" in lines
    assert "| mosaic, per layer of 4 | - | 32 | 4096,8192 | -50 | 4000 | 80% |" in lines


def test_kernels_bench_times_rivals_at_the_targets_points_only(tmp_path):
    """--rivals targets (the GPU default): our kernels and the engines' defaults at every point, the rivals at the
    targets' points only (in --smoke the first point of each table), so a bounded call covers our kernels."""
    out = tmp_path / "k.json"
    proc = subprocess.run([sys.executable, "benchmarks/kernels.py", "--smoke", "--repeats", "1", "--parts",
                           "decode,prefill", "--rivals", "targets", "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["rivals_at"] == "targets"
    for table, point in (("decode", ("batch", "context")), ("prefill", ("batch", "seq"))):
        timed = [r for r in result[table] if "time_s" in r]
        where = lambda impl: {tuple(r[k] for k in point) for r in timed if r["impl"] == impl}  # noqa: E731
        targets = {tuple(x) for x in result["target_points"][table]}
        rivals = {r["impl"] for r in timed} & set(result["rivals"][table])
        ours = {r["impl"] for r in timed} - set(result["rivals"][table])
        assert rivals and ours, (table, rivals, ours)
        assert all(where(impl) == targets for impl in rivals), table
        assert all(where(impl) > targets for impl in ours), table


def test_kernels_bench_at_chosen_points_times_every_implementation_there_only(tmp_path):
    """--decode-points / --prefill-points replace the grids: each timed implementation, rivals included, at exactly
    the points given (the short GPU call for the points still open)."""
    out = tmp_path / "k.json"
    proc = subprocess.run([sys.executable, "benchmarks/kernels.py", "--smoke", "--repeats", "1", "--parts",
                           "decode,prefill", "--layers", "0", "--decode-points", "2x512", "--prefill-points", "1x64",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["target_points"] == {"decode": [[2, 512]], "prefill": [[1, 64]]}
    for table, point, want in (("decode", ("batch", "context"), {(2, 512)}), ("prefill", ("batch", "seq"), {(1, 64)})):
        timed = [r for r in result[table] if "time_s" in r]
        assert {tuple(r[k] for k in point) for r in timed} == want, table
        assert {r["impl"] for r in timed} & set(result["rivals"][table]), table  # rivals timed there too


def test_kernels_and_tune_steps_fit_their_deadlines_to_the_time_left(tmp_path):
    """A short call (15 minutes of device time hold about one full call): the kernels step's parts and the tune
    step's own deadline shrink to what is left of the step, so their scripts stop by themselves (a tune point cut
    by its deadline keeps its best candidate; one killed keeps nothing); chosen points reach kernels.py."""
    assert pack_steps.fitted([200, 140, 120], None, 45) == [200, 140, 120]
    assert pack_steps.fitted([200, 140, 120], 10_000, 45) == [200, 140, 120]  # never scaled up
    assert pack_steps.fitted([200, 100], 240, 20) == [133, 66] and pack_steps.fitted([200], 30, 45) == [10]
    assert pack_steps.parse_kernel_points(" 32x4096, 32X8192") == "32x4096,32x8192"
    for bad in ("32", "32x0", "ax4096", ""):
        with pytest.raises(ValueError, match="BATCHxLENGTH"):
            pack_steps.parse_kernel_points(bad)

    seen = []
    ctx = Context(smoke=False, python=sys.executable, repo=REPO, tmp=tmp_path, ends_at=time.monotonic() + 300,
                  kernel_points={"decode": "32x4096,32x8192", "prefill": "1x8192"})
    pack_steps.kernels_step(ctx, seen.append)
    argvs = [[str(a) for a in cmd.argv] for cmd in seen]
    assert [a[a.index("--parts") + 1] for a in argvs] == ["decode", "paged", "prefill"]
    assert [a[a.index("--decode-points") + 1] for a in argvs[:2]] == ["32x4096,32x8192"] * 2
    assert argvs[2][argvs[2].index("--prefill-points") + 1] == "1x8192" and "--decode-points" not in argvs[2]
    assert sum(cmd.limit_s for cmd in seen) <= 300
    paged_deadline_of_three = float(argvs[1][argvs[1].index("--deadline") + 1])
    for argv in argvs:  # every argv parses with the script's own parser
        assert args_only(argv).returncode == 0
    assert args_only([*argvs[0], "--no-such-option"]).returncode == 2  # which --help after it would not have said
    assert [cmd.label for cmd in seen] == ["benchmarks/kernels.py --parts decode --decode-points 32x4096,32x8192",
                                           "benchmarks/kernels.py --parts paged --decode-points 32x4096,32x8192",
                                           "benchmarks/kernels.py --parts prefill --prefill-points 1x8192"]

    seen.clear()
    pack_steps.tune_step(dataclasses.replace(ctx, ends_at=time.monotonic() + 200), seen.append)
    (cmd,) = seen
    argv = [str(a) for a in cmd.argv]
    assert float(argv[argv.index("--deadline") + 1]) <= 200 - pack_steps.TUNE_MARGIN_S and cmd.limit_s <= 200

    parsed = pack.parser().parse_args(["run", "--out", str(tmp_path), "--decode-points", "32x4096",
                                       "--prefill-points", "1x8192,1x2048"])
    assert (parsed.decode_points, parsed.prefill_points) == ("32x4096", "1x8192,1x2048")
    assert parsed.kernel_parts == ("decode", "paged", "prefill")

    # --kernel-parts: only those tables, in the step's order, sharing the time left
    parsed = pack.parser().parse_args(["run", "--out", str(tmp_path), "--kernel-parts", "prefill, paged"])
    assert parsed.kernel_parts == ("paged", "prefill")
    seen.clear()
    pack_steps.kernels_step(dataclasses.replace(ctx, kernel_parts=parsed.kernel_parts), seen.append)
    argvs = [[str(a) for a in cmd.argv] for cmd in seen]
    assert [a[a.index("--parts") + 1] for a in argvs] == ["paged", "prefill"]
    assert sum(cmd.limit_s for cmd in seen) <= 300
    # the two share the time the three did: paged gets about 113 s of 300 where it got about 50
    assert float(argvs[0][argvs[0].index("--deadline") + 1]) > 2 * paged_deadline_of_three
    with pytest.raises(SystemExit):
        pack.parser().parse_args(["run", "--out", str(tmp_path), "--kernel-parts", "mosaic"])


def test_smoke_kernels_step_runs_the_chosen_tables_and_parses_the_gpu_command_lines(tmp_path):
    """--smoke with the next loan's --kernel-parts and --decode-points: kernels.py --smoke over those tables only
    (their tiny points: the GPU's, interpreted, would take hours), then each GPU command line, deadline and points
    included, through kernels.py's own parser (smoke ran all three tables and never saw the points before)."""
    seen = []
    ctx = Context(smoke=True, python=sys.executable, repo=REPO, tmp=tmp_path, ends_at=time.monotonic() + 120,
                  kernel_parts=("paged",), kernel_points={"decode": "32x4096,32x8192"})
    pack_steps.kernels_step(ctx, seen.append)
    smoke, check = seen
    assert smoke.argv[smoke.argv.index("--parts") + 1] == "paged" and "--smoke" in smoke.argv
    assert "--decode-points" not in smoke.argv
    argv = [str(a) for a in check.argv]
    assert argv[1] == str(pack_steps.ARGS_ONLY) and argv[2] == "benchmarks/kernels.py"
    assert argv[argv.index("--parts") + 1] == "paged" and argv[argv.index("--decode-points") + 1] == "32x4096,32x8192"
    assert "--deadline" in argv and "--smoke" not in argv
    assert check.label.startswith("benchmarks/kernels.py --parts paged --decode-points 32x4096,32x8192 (smoke")
    assert args_only([argv[0], *argv[2:]]).returncode == 0  # the very command the step runs, run here


def test_run_hands_its_step_options_to_the_steps(tmp_path, monkeypatch):
    """`pack.py run`'s step options reach the Context the steps run with, not only its parser: --kernel-parts there
    runs only those tables (a Context built without it ran all three, and env.json's options said all three)."""
    called = {}
    monkeypatch.setattr(pack_runner, "nvidia_smi", lambda: {})
    monkeypatch.setattr(pack_runner, "run", lambda steps, ctx, *a, **kw: called.update(ctx=ctx, **kw) or 0)
    args = pack.parser().parse_args(["run", "--out", str(tmp_path / "r"), "--no-install", "--steps", "kernels,tune",
                                     "--kernel-parts", "prefill,paged", "--decode-points", "32x4096",
                                     "--prefill-points", "1x2048", "--tune-only", "paged:int8",
                                     "--demo-attention", "cudnn"])
    assert pack._run(args) == 0
    ctx = called["ctx"]
    assert (ctx.kernel_parts, ctx.kernel_points) == (("paged", "prefill"), {"decode": "32x4096", "prefill": "1x2048"})
    assert (ctx.tune_only, ctx.demo_attention) == ("paged:int8", "cudnn")
    assert called["options"]["kernel_parts"] == ["paged", "prefill"]
    seen = []
    pack_steps.kernels_step(dataclasses.replace(ctx, ends_at=time.monotonic() + 300), seen.append)
    assert [cmd.label for cmd in seen] == ["benchmarks/kernels.py --parts paged --decode-points 32x4096",
                                           "benchmarks/kernels.py --parts prefill --prefill-points 1x2048"]


def test_distill_summary_names_each_rows_attention_and_the_failed_steps():
    row = lambda variant, attention, step_s: {"variant": variant, "attention_impl": attention, "remat": "none",
                                              "step_s": step_s, "tokens_per_s": 8192 / step_s, "mfu": 0.3,
                                              "xla_peak_bytes": 2**30, "device_peak_bytes": None}
    result = {"results": [row("ours", "cudnn", 0.8), row("ours", "xla_chunked", 2.0)],
              "failed": [{"variant": "ours", "attention_impl": "cudnn:8", "returncode": 1,
                          "stderr_tail": "Traceback ...\n"
                                         "ValueError: attention_impl='cudnn' does not support this case"}],
              "targets": {"mfu": {"target": 0.4, "measured": 0.3, "pass": False, "attention_impl": "cudnn"}}}
    text = "\n".join(pack_steps._distill_lines("distill_step.py --preset 8b", result))
    assert "| ours | cudnn | none | 0.8000 |" in text and "| ours | xla_chunked |" in text
    assert "cudnn:8 attention: **failed** (exit 1)" in text and "does not support this case" in text
    assert "mfu 0.3 vs 0.4 FAIL (cudnn)" in text
    rows = [line for line in text.splitlines() if line.startswith("| ours |")]
    assert len(rows) == 2 and all(line.endswith("| - |") for line in rows)  # no profile, no prof. HFU


def test_distill_summary_says_where_each_profiled_steps_time_went():
    profile = {"busy_ms_per_step": 780.0, "wall_ms_per_step": 800.0,
               "categories": [{"category": "matmul", "ms": 500.0, "share": 0.64, "tflops": 520.0},
                              {"category": "attention (cuDNN)", "ms": 200.0, "share": 0.26, "tflops": None}],
               "ops": [{"op": "custom-call.7", "ms": 40.0}, {"op": "fusion.3", "ms": 12.5}]}
    row = {"variant": "ours", "attention_impl": "cudnn", "remat": "none", "step_s": 0.8, "tokens_per_s": 10240,
           "mfu": 0.35, "xla_peak_bytes": 2**30, "device_peak_bytes": None, "profile": profile}
    failed_row = dict(row, attention_impl="xla_chunked", profile=None, profile_error="RuntimeError: no trace\nmore")
    text = "\n".join(pack_steps._distill_lines("distill_step.py --preset 8b", {"results": [row, failed_row]}))
    assert ("profile of ours (cudnn): 780 ms of device ops in a 800 ms step: matmul 500 ms (64%, 520 TFLOP/s), "
            "attention (cuDNN) 200 ms (26%); costliest ops custom-call.7 40.0 ms, fusion.3 12.5 ms") in text
    assert "profile of ours (xla_chunked): **failed** RuntimeError: no trace" in text


def test_distill_summary_shows_the_recipe_sweep():
    result = {"budget": "gpu", "arch": {}, "teacher_val_loss": 2.5, "undistilled_val_loss": 2.7,
              "rows": [{"name": "lr6e-3", "steps": 300, "overrides": ["optim.learning_rate=6e-3"], "val_loss": 2.52,
                        "gap_closed": 0.9}]}
    text = "\n".join(pack_steps._distill_lines("benchmarks/recipe_sweep.py --budget gpu", result))
    assert "recipe sweep (gpu): teacher 2.5000, undistilled 50% 2.7000" in text
    assert "| lr6e-3 | 300 | optim.learning_rate=6e-3 | 2.5200 | 90.0% |" in text


def test_demo_summary_totals_a_resumed_demo_with_its_earlier_calls_wall_time():
    """A resumed demo's total is its earlier calls' wall time (earlier_calls_seconds), not their training plus
    evaluation seconds, which overlap on the gpu budget; results written before that field sum those two."""
    row = {"model": "teacher", "val_loss": 2.5, "kl_to_teacher": 0.0, "greedy_agreement": 1.0,
           "prefill_time_vs_teacher": 1.0}
    result = {"settings": "gpu", "device": "H100 (gpu)", "rows": [row], "stage_seconds": {"data": 5.0},
              "checks": {"gap_closed_by_distillation_at_50": 0.95, "gap_closed_target": 0.9, "gap_closed_pass": True},
              "seconds": 60.0, "seconds_with_earlier_calls": 150.0, "earlier_calls_seconds": 90.0,
              "earlier_training_seconds": 0.0, "earlier_evaluation_seconds": 0.0}
    line = lambda result: next(line for line in pack_steps._distill_lines("demo.py --budget gpu", result)
                               if line.startswith("demo ("))
    assert line(result) == "demo (gpu, H100 (gpu), 2.5 min with earlier calls, 1.0 min this call: data 5 s)"
    first = dict(result, seconds_with_earlier_calls=60.0, earlier_calls_seconds=0.0, earlier_training_seconds=30.0)
    assert line(first) == "demo (gpu, H100 (gpu), 1.0 min this call: data 5 s)"
    older = {k: v for k, v in dict(result, earlier_training_seconds=50.0).items() if k != "earlier_calls_seconds"}
    assert "2.5 min with earlier calls, 1.0 min this call" in line(older)
    assert "gap closed by distillation at 50%: 95.0% (target 90%: PASS)" in pack_steps._distill_lines("", result)
