"""The demo end to end, as a subprocess on one CPU device (the suite's 8 fake devices would only slow it down).

`python demo.py --quick` (about 4 minutes on 2 cores, `-m slow`) checks that the table is complete and finite and
ordered as the method says it must be. The default suite runs the same pipeline on the "smoke" budget (about a
minute), too small to learn anything: its table must be complete and finite, its arithmetic columns exact.
"""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from swiftkv_jax import demo
from swiftkv_jax.distill.metrics import read_metrics

from conftest import xla_flags

REPO = Path(__file__).resolve().parents[1]


def run_demo(out: Path, name: str, stop_at_step: int = 0) -> str:
    """demo.run(out, name) in a subprocess on one device; "quick" trains for minutes, so it is compiled optimised
    as users run it (the smoke budget is mostly compiling: it keeps the suite's setting, see conftest.py).
    stop_at_step: the first training stage is asked to stop after that step, as SIGTERM asks it; the process must
    then exit with the shell's status of SIGTERM, 143."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if name == "smoke":
        env["XLA_FLAGS"] = xla_flags(1)
    else:
        env.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
    code = f"import sys; from pathlib import Path; from swiftkv_jax import demo; demo.run(Path(sys.argv[1]), {name!r})"
    if stop_at_step:
        code = ("import itertools, signal, sys; from pathlib import Path; from swiftkv_jax import demo; "
                "from swiftkv_jax.distill import trainer; steps = itertools.count(1); "
                "trainer._StopRequest.requested = "
                f"lambda self: signal.SIGTERM if next(steps) == {stop_at_step} else 0\n"
                f"try: demo.run(Path(sys.argv[1]), {name!r})\n"
                "except demo.Stopped as e: print(e); sys.exit(e.status)")
    proc = subprocess.run([sys.executable, "-c", code, str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == (143 if stop_at_step else 0), proc.stderr[-3000:]
    return proc.stdout


def check_table(out: Path, stdout: str) -> dict:
    """Every row and column present and finite, the teacher exact against itself, the cache arithmetic exact, the
    tables and figures written; returns the rows by model."""
    result = json.loads((out / "results.json").read_text())
    rows = {r["model"]: r for r in result["rows"]}
    assert set(rows) == {"teacher", "swiftkv-25", "swiftkv-25-undistilled", "swiftkv-50", "swiftkv-50-undistilled",
                         "swiftkv-75", "swiftkv-75-undistilled", "swiftkv-50-acrosskv2"}
    for r in rows.values():
        for key, _, _ in demo.COLUMNS:
            assert math.isfinite(r[key]), (r["model"], key)
    teacher = rows["teacher"]
    assert teacher["kl_to_teacher"] == 0 and teacher["greedy_agreement"] == 1
    # the cache: SingleInputKV keeps every layer's KV, 2-way AcrossKV of layers 2..3 of 4 drops one: 3/4
    assert rows["swiftkv-50"]["kv_bytes_vs_teacher"] == 1.0
    assert rows["swiftkv-50-acrosskv2"]["kv_bytes_vs_teacher"] == pytest.approx(0.75)
    assert rows["swiftkv-50"]["prefill_time_vs_teacher"] > 0
    table = (out / "results.md").read_text()
    for name in demo.TABLE_ROWS:
        assert f"| {demo.LABELS[name]} |" in table and f"| {demo.LABELS[name]} |" in stdout
    assert all(f"| {label} |" in table for label in demo.LABELS.values())
    for png in ("quality_vs_layers_skipped.png", "analysis/similarity.png", "teacher/loss.png"):
        assert (out / png).stat().st_size > 0
    return rows


def test_the_pipeline_runs_end_to_end_on_the_smoke_budget(tmp_path):
    """First stopped in its pretraining as SIGTERM stops it (a checkpoint saved, no later stage run, status 143);
    then the same call continues from that checkpoint to the whole table."""
    out = tmp_path / "smoke"
    stopped = run_demo(out, "smoke", stop_at_step=3)
    assert "SIGTERM received: checkpoint saved at step 3" in stopped and "run the same command again" in stopped
    assert (out / "teacher" / "checkpoints").is_dir() and not (out / "teacher" / "model_hf").exists()
    assert not (out / "distill").exists()
    stdout = run_demo(out, "smoke")
    assert "resumed from step 3" in stdout
    rows = check_table(out, stdout)
    # models are scored while the later students distil: the AcrossKV student (no undistilled twin) distils first,
    # the undistilled rows are in before the last student is
    exports = [line for line in stdout.splitlines() if "stdlib-swiftkv.yaml ->" in line]
    assert len(exports) == 4 and "swiftkv-50-acrosskv2" in exports[0]
    assert stdout.index("evaluated swiftkv-25-undistilled") < stdout.index(exports[-1])
    assert json.loads((out / "demo_settings.json").read_text())["settings"] == "smoke"
    # each finished training stage leaves its seconds beside its export, for a later call's total; the stopped
    # call's pretraining (up to its checkpoint) is an earlier call's time, and the teacher's total includes it
    result = json.loads((out / "results.json").read_text())
    stopped_s = json.loads((out / "teacher" / demo.STOPPED_SECONDS).read_text())["seconds"]
    assert 0 < stopped_s == result["earlier_training_seconds"]
    # earlier calls' time is their wall time up to their last save: the stopped call's, its corpus and pretraining
    [stopped_call] = json.loads((out / demo.CALLS).read_text())["calls"][:1]
    assert stopped_s <= stopped_call == result["earlier_calls_seconds"]
    assert result["seconds_with_earlier_calls"] == pytest.approx(result["seconds"] + stopped_call)
    teacher_s = json.loads((out / "teacher" / demo.TRAIN_SECONDS).read_text())
    assert teacher_s["seconds"] == pytest.approx(stopped_s + teacher_s["this_call_seconds"], abs=0.11)
    # the students trained on their own rows a step (distill_batch_size), the teacher on its own, as on the gpu budget
    settings = demo.SETTINGS["smoke"]
    assert settings.distill_rows < settings.batch_size
    for run_dir, rows_a_step in ((out / "teacher", settings.batch_size),
                                 (out / "distill" / "swiftkv-50", settings.distill_rows)):
        trained = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]
        assert trained["global_batch_size"] == rows_a_step, run_dir
    stages = sorted(p.parent.name for p in out.glob(f"**/{demo.TRAIN_SECONDS}"))
    layers = demo.SETTINGS["smoke"].architecture["num_hidden_layers"]
    assert stages == sorted(["teacher", *(v.name for v in demo.variants(layers) if v.distilled)])
    assert stopped_s < demo.earlier_training_seconds(out, layers) < result["seconds"] + stopped_s
    assert result["earlier_evaluation_seconds"] == 0 and not any(r["evaluated_earlier"] for r in result["rows"])
    # a call stopped mid-evaluation continues there: the rows written so far (checkpoints unchanged, every field
    # there) are read back, the others evaluated; a reused row's prefill comparison serves the other row of its
    # (l, g), whichever comes first; both calls' times count
    done = json.loads((out / demo.EVAL_ROWS).read_text())
    assert set(done) == set(rows)
    removed = {"swiftkv-75", "swiftkv-75-undistilled", "swiftkv-25"}  # swiftkv-25-undistilled stays
    del done["swiftkv-50-acrosskv2"]["row"]["eval_seconds"]  # a row without a field this code writes
    (out / demo.EVAL_ROWS).write_text(json.dumps({k: v for k, v in done.items() if k not in removed}))
    stdout = run_demo(out, "smoke")
    again = json.loads((out / "results.json").read_text())
    by_name = {r["model"]: r for r in again["rows"]}
    redo = removed | {"swiftkv-50-acrosskv2"}
    assert {name for name, r in by_name.items() if not r["evaluated_earlier"]} == redo
    assert "evaluated swiftkv-50 in an earlier call" in stdout and "evaluated swiftkv-75: val loss" in stdout
    assert all(by_name[name]["val_loss"] == rows[name]["val_loss"] for name in set(rows) - redo)
    assert by_name["swiftkv-75"]["val_loss"] == pytest.approx(rows["swiftkv-75"]["val_loss"], rel=1e-5)
    benched = {name for name in redo if "prefill_bench" in by_name[name]["eval_seconds"]}  # in this call
    assert benched == {"swiftkv-75", "swiftkv-50-acrosskv2"}  # the (l, g) with no row to read back
    for name in ("swiftkv-25", "swiftkv-75-undistilled"):
        twin = name.replace("-undistilled", "") if "undistilled" in name else name + "-undistilled"
        assert by_name[name]["prefill_time_vs_teacher"] == by_name[twin]["prefill_time_vs_teacher"]
    reused = sum(sum(r["eval_seconds"].values()) for r in again["rows"] if r["evaluated_earlier"])
    assert again["earlier_evaluation_seconds"] == pytest.approx(reused) and reused > 0
    # the call before took result["seconds"] in all, its rows scored beside its distillations: counted once
    assert 0 < again["earlier_calls_seconds"] - stopped_call <= result["seconds"] + 0.05  # (rounded to 0.1 s)
    assert again["seconds_with_earlier_calls"] == pytest.approx(again["seconds"] + again["earlier_calls_seconds"])
    assert set(json.loads((out / demo.EVAL_ROWS).read_text())) == set(rows)
    # the recipe sweep over that demo's teacher: one row, scored against the demo's own numbers
    sweep = tmp_path / "sweep.json"
    proc = subprocess.run([sys.executable, "benchmarks/recipe_sweep.py", str(out), "--budget", "smoke", "--out",
                           str(sweep), "lr1e-3|2|optim.learning_rate=1e-3"], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "XLA_FLAGS": xla_flags(1)})  # one device,
    # as the demo ran (its students' 4 rows a step do not split over the suite's 8 fake devices)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(sweep.read_text())
    assert record["teacher_val_loss"] == pytest.approx(rows["teacher"]["val_loss"], rel=1e-5)
    assert record["undistilled_val_loss"] == pytest.approx(rows["swiftkv-50-undistilled"]["val_loss"], rel=1e-5)
    [row] = record["rows"]
    assert (row["name"], row["steps"], row["overrides"]) == ("lr1e-3", 2, ["optim.learning_rate=1e-3"])
    assert math.isfinite(row["gap_closed"]) and "| lr1e-3 | 2 |" in proc.stdout
    trained = read_metrics(out / "distill" / "exp-lr1e-3" / "metrics.jsonl")
    assert [r["step"] for r in trained] == [1, 2] and max(r["lr"] for r in trained) == pytest.approx(1e-3)


@pytest.mark.slow
def test_quick_demo_table_is_complete_finite_and_ordered(tmp_path):
    out = tmp_path / "quick"
    rows = check_table(out, run_demo(out, "quick"))
    result = json.loads((out / "results.json").read_text())
    teacher = rows["teacher"]
    # distillation helps at 50%, and more layers skipped costs more
    assert rows["swiftkv-50"]["val_loss"] < rows["swiftkv-50-undistilled"]["val_loss"]
    assert rows["swiftkv-50"]["kl_to_teacher"] < rows["swiftkv-50-undistilled"]["kl_to_teacher"]
    assert rows["swiftkv-75"]["kl_to_teacher"] > rows["swiftkv-50"]["kl_to_teacher"]
    assert teacher["val_loss"] <= rows["swiftkv-50"]["val_loss"] + 1e-3
    assert 0 < rows["swiftkv-50"]["prefill_time_vs_teacher"] < 1
    assert result["checks"]["distilled_better_than_undistilled"]


def _scheduled(tmp_path, monkeypatch, **settings):
    """An Evaluation over stub models (teacher; (2, 1): "a", "a-undistilled"; (1, 1): "b") whose scoring only records
    when each row starts and ends, and a row of (1, 1) or (2, 1) waits, up to 10 s, for one of the other (l, g) to be
    scoring too. Returns (evaluation, events, prefill speeds timed)."""
    import threading

    events, lock, benched = [], threading.Lock(), []
    meet = threading.Barrier(2, timeout=10)

    def quality_row(teacher, model, variant, batches, prompts, settings_):
        with lock:
            events.append(("start", model))
        if model in ("a-undistilled", "b"):
            meet.wait()  # BrokenBarrierError unless the two (l, g)s are scored at once
        with lock:
            events.append(("end", model))
        return {"val_loss": 1.0, "kl_to_teacher": 0.0, "eval_seconds": {}}

    monkeypatch.setattr(demo, "quality_row", quality_row)
    monkeypatch.setattr(demo, "prefill_speed", lambda model, settings_: benched.append(model) or dict.fromkeys(
        demo.SPEED, 0.5))
    monkeypatch.setattr("swiftkv_jax.to_swiftkv", lambda teacher, l, g: f"wiring {l} {g}")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir(parents=True, exist_ok=True)
    variants = {"teacher": None, "a": demo.Variant("a", 2), "a-undistilled": demo.Variant("a-undistilled", 2,
                                                                                          distilled=False),
                "b": demo.Variant("b", 1)}
    models = {name: (lambda name=name: name, v, [checkpoint]) for name, v in variants.items()}
    settings_ = dataclasses.replace(demo.SETTINGS["smoke"], **settings)
    return demo.Evaluation("teacher", models, [], [], settings_, done=tmp_path / demo.EVAL_ROWS), events, benched


def test_evaluation_scores_the_teacher_first_then_one_row_of_an_l_g_at_a_time(tmp_path, monkeypatch):
    """The schedule the GPU demo relies on (the smoke run above scores for real): one prefill comparison per (l, g),
    on the teacher's wiring, before any score; the teacher's row before any other; the rows of an (l, g) one after
    the other, different (l, g)s at once; rows written as each ends."""
    evaluation, events, benched = _scheduled(tmp_path, monkeypatch, eval_workers=3, evaluate_while_distilling=True)
    with evaluation:
        evaluation.time_prefills()
        assert benched == ["wiring 2 1", "wiring 1 1"] and events == []
        for name in ("teacher", "a-undistilled", "b", "a"):
            evaluation.start(name)
        rows = evaluation.rows()
    assert [r["model"] for r in rows] == ["teacher", "a", "a-undistilled", "b"]
    assert events[:2] == [("start", "teacher"), ("end", "teacher")]
    (start_u, end_u), (start_a, end_a) = ([events.index((edge, name)) for edge in ("start", "end")]
                                          for name in ("a-undistilled", "a"))
    assert end_u < start_a or end_a < start_u  # the rows of (2, 1) never overlap
    by_name = {r["model"]: r for r in rows}
    assert "prefill_bench" in by_name["a"]["eval_seconds"] and "prefill_bench" not in by_name["a-undistilled"][
        "eval_seconds"]  # the (l, g)'s first row carries its comparison's seconds
    assert by_name["b"]["prefill_time_vs_teacher"] == 0.5
    assert set(json.loads((tmp_path / demo.EVAL_ROWS).read_text())) == set(by_name)


def test_evaluation_on_a_cpu_budget_waits_and_an_error_cancels_what_has_not_started(tmp_path, monkeypatch):
    """evaluate_while_distilling off: nothing is scored before rows(). On: an error (a stopped distillation) leaves
    at once, and the rows not yet started never are."""
    import threading

    evaluation, events, _ = _scheduled(tmp_path, monkeypatch, eval_workers=2, evaluate_while_distilling=False)
    with evaluation:
        evaluation.time_prefills()
        for name in ("teacher", "a-undistilled", "b", "a"):
            evaluation.start(name)
        assert events == []
        assert len(evaluation.rows()) == 4 and len(events) == 8

    evaluation, events, _ = _scheduled(tmp_path / "again", monkeypatch, eval_workers=1,
                                       evaluate_while_distilling=True)
    release = threading.Event()
    evaluation.also(release.wait, 10)  # occupies the one thread
    with pytest.raises(demo.Stopped), evaluation:
        evaluation.time_prefills()
        evaluation.start("teacher")
        raise demo.Stopped(143, "stopped")
    release.set()
    evaluation.pool.shutdown(wait=True)
    assert events == []  # the teacher's row was cancelled, not run


def test_demo_refuses_a_folder_of_other_settings_naming_the_changes(tmp_path, capsys):
    record = json.dumps(demo.settings_record("full", demo.SETTINGS["full"]))
    (tmp_path / demo.SETTINGS_FILE).write_text(record)
    (tmp_path / "teacher").mkdir()  # a training stage started: its models are of those settings
    assert demo.main(["--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds a demo run with other settings (settings: full -> quick; max_files: None -> 300;" in err
    assert "architecture.hidden_size: 128 -> 64" in err
    assert (tmp_path / demo.SETTINGS_FILE).read_text() == record


def test_a_fixable_mistake_does_not_lock_the_out_folder(tmp_path, monkeypatch, capsys):
    """--attention cudnn on a CPU is refused before anything is written; a folder whose settings another call
    recorded but where nothing was trained takes this call's, naming what changed, and rebuilds its corpus."""
    out = tmp_path / "dq2"
    assert demo.main(["--quick", "--attention", "cudnn", "--out", str(out)]) == 2
    assert "--attention cudnn: model.attention_impl='cudnn' needs an NVIDIA GPU" in capsys.readouterr().err
    assert not out.exists()
    out.mkdir()  # as that call left it before: its settings and a corpus
    cudnn = demo.settings_record("quick", demo.with_attention(demo.SETTINGS["quick"], "cudnn"))
    (out / demo.SETTINGS_FILE).write_text(json.dumps(cudnn))
    (out / "corpus").mkdir()
    built = []

    def build_data(out_, settings, replace=False):
        built.append(replace)
        raise ValueError("stop here")

    monkeypatch.setattr(demo, "build_data", build_data)
    assert demo.main(["--quick", "--out", str(out)]) == 2
    assert "pretrain_overrides: ['model.attention_impl=cudnn'] -> []" in capsys.readouterr().out
    assert json.loads((out / demo.SETTINGS_FILE).read_text()) == demo.settings_record("quick", demo.SETTINGS["quick"])
    assert built == [True]
    (out / "teacher").mkdir()  # trained since: the corpus is kept
    assert demo.main(["--quick", "--out", str(out)]) == 2 and built == [True, False]


def test_a_changed_corpus_under_trained_models_names_the_demos_flags(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "meta.json").write_text(json.dumps({"max_files": 3}))
    with pytest.raises(ValueError, match="holds a different stdlib corpus .*choose another --out, or delete") as e:
        demo.build_data(tmp_path, demo.SETTINGS["smoke"])
    assert "overwrite" not in str(e.value)
    assert json.loads((tmp_path / "corpus" / "meta.json").read_text()) == {"max_files": 3}


def test_demo_takes_over_no_folder_of_other_files(tmp_path, monkeypatch, capsys):
    """An --out with files but no demo run, or a --results with files that are not a demo's results, is refused
    before anything is written: the demo's teacher/, results.md, corpus/ ... would overwrite or mix with them."""
    monkeypatch.setattr(demo, "build_data", lambda *args, **kwargs: pytest.fail("the demo started"))
    user = tmp_path / "user"
    (user / "teacher_init").mkdir(parents=True)
    (user / "teacher_init" / "config.json").write_text("mine")
    for name in ("results.md", "corpus"):
        (user / name).mkdir() if name == "corpus" else (user / name).write_text("mine")
        before = sorted(str(p) for p in user.rglob("*"))
        assert demo.main(["--quick", "--out", str(user)]) == 2
        err = capsys.readouterr().err
        assert f"--out {user} holds other files (" in err and "choose an empty or new --out" in err
        assert "teacher_init" in err and "overwrite" not in err
        assert sorted(str(p) for p in user.rglob("*")) == before
    assert (user / "teacher_init" / "config.json").read_text() == "mine"
    results = tmp_path / "results"
    results.mkdir()
    (results / "results.md").write_text("mine")
    assert demo.main(["--quick", "--out", str(tmp_path / "new"), "--results", str(results)]) == 2
    assert f"--results {results} holds other files (results.md)" in capsys.readouterr().err
    assert not (tmp_path / "new").exists() and (results / "results.md").read_text() == "mine"
    # an earlier demo's results are updated; with a file of the user's beside them, refused
    (results / "results.json").write_text(json.dumps({"settings": "quick", "rows": [], "checks": {}}))
    demo.check_results(results)
    (results / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds other files \\(notes.txt, results.json, results.md\\)"):
        demo.check_results(results)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc, where no folder can be made")
def test_demo_refuses_an_out_or_results_that_cannot_be_made(tmp_path, capsys):
    for argv, flag in ((["--out", "/proc/x"], "--out"), (["--out", str(tmp_path / "o"), "--results", "/proc/y"],
                                                          "--results")):
        assert demo.main(["--quick", *argv]) == 2
        err = capsys.readouterr().err
        assert f"error: {flag} /proc/" in err and "cannot be made" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())


def test_demo_refuses_an_empty_out_or_results(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the old code took "" for the default folder, or the current one
    monkeypatch.setattr(demo, "build_data", lambda *args, **kwargs: pytest.fail("the demo started"))
    for flag in ("--out", "--results"):
        with pytest.raises(SystemExit) as exit_:
            demo.main(["--quick", flag, ""])
        assert exit_.value.code == 2 and f"argument {flag}: an empty path" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_demo_refuses_an_out_or_results_that_is_a_file_before_any_work(tmp_path, capsys):
    """Both are written at the end (results after ~37 minutes on a CPU): a file in their place fails at once, naming
    the flag; nothing is written."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv, flag in ((["--results", str(afile), "--out", str(tmp_path / "out")], "--results"),
                       (["--quick", "--out", str(afile)], "--out"),
                       (["--quick", "--out", str(afile / "sub")], "--out")):
        with pytest.raises(SystemExit) as exit_:
            demo.main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"error: {flag} {afile}" in err and "Errno" not in err
    with pytest.raises(ValueError, match="results .* exists and is not a folder"):
        demo.run(tmp_path / "out", "smoke", results=afile)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"] and afile.read_text() == "x"


def test_gpu_budget_is_a_valid_run_of_both_recipes_within_ten_minutes_of_matmuls(tmp_path):
    """The gpu budget's overrides load with both recipes (the smoke run above covers the code they drive), its
    FLOP-arithmetic estimate stays well inside 10 minutes, and a CPU is refused before anything is written."""
    from swiftkv_jax import configuration
    from swiftkv_jax.distill.config import TrainConfig

    settings = demo.SETTINGS["gpu"]
    out = tmp_path / "demo, #2"  # a folder name YAML would misread unquoted
    common = demo.common_overrides(out, settings, 1, tmp_path / "run")
    teacher = configuration.load(TrainConfig, demo.CONFIGS / "stdlib-teacher.yaml",
                                 ["model.teacher=x"] + common + list(settings.pretrain_overrides))
    student = configuration.load(TrainConfig, demo.CONFIGS / "stdlib-swiftkv.yaml",
                                 ["model.teacher=x"] + demo.common_overrides(out, settings, 1, tmp_path / "run",
                                                                            settings.distill_rows)
                                 + list(settings.distill_overrides))
    # students take their tokens in more, smaller steps than the teacher's (demo.py)
    assert (teacher.train.global_batch_size, student.train.global_batch_size) == (32, 16)
    for config in (teacher, student):
        assert (config.model.compute_dtype, config.model.trainable_dtype) == ("bfloat16", "float32")
        assert config.data.sources[0].path == str(out / "corpus" / "train.parquet")
    estimate = demo.gpu_seconds(settings)
    assert 200e6 < estimate["parameters"] < 500e6 and estimate["total_s"] < 300
    with pytest.raises(ValueError, match="the gpu budget needs a GPU"):
        demo.run(tmp_path / "gpu", "gpu")
    assert not (tmp_path / "gpu").exists()


def test_stages_train_with_their_own_rows_a_step(tmp_path, monkeypatch):
    """The gpu budget pretrains on 32 rows a step and distils on 16 (twice the steps, the same tokens): each stage's
    train() gets its own global_batch_size and steps."""
    trained = {}
    monkeypatch.setattr(demo, "_train", lambda recipe, overrides, export: trained.update({recipe: overrides}))
    settings = demo.SETTINGS["gpu"]
    demo.pretrain(tmp_path, settings, tmp_path / "init")
    demo.distill(tmp_path, settings, tmp_path / "teacher", demo.Variant("swiftkv-50", l=8))
    teacher, student = trained["stdlib-teacher.yaml"], trained["stdlib-swiftkv.yaml"]
    assert {"train.global_batch_size=32", f"train.max_steps={settings.pretrain_steps}"} <= set(teacher)
    assert {"train.global_batch_size=16", f"train.max_steps={settings.distill_steps}"} <= set(student)
    assert settings.distill_steps * 16 == 300 * 32  # the tokens of the 2026-11-25/27 GPU runs' 300 x 32
    estimate = demo.gpu_seconds(settings)  # the distillation's FLOPs count its own rows
    halved = demo.gpu_seconds(dataclasses.replace(settings, distill_batch_size=8))
    assert halved["distill_s"] == pytest.approx(estimate["distill_s"] / 2)
    assert halved["pretrain_s"] == estimate["pretrain_s"]


def test_recipe_sweep_rows_change_only_what_they_name(tmp_path, capsys):
    """A sweep row keeps its budget's overrides (the gpu budget's bf16 runtime) and its own win; bad rows are named."""
    from swiftkv_jax import configuration
    from swiftkv_jax.distill.config import TrainConfig

    sys.path.insert(0, str(REPO / "benchmarks"))
    import recipe_sweep

    name, steps, overrides = recipe_sweep.parse_row("lr6e-3||optim.learning_rate=6e-3;loss.temperature=1.0")
    assert (name, steps) == ("lr6e-3", None)
    settings = recipe_sweep.row_settings(demo.SETTINGS["gpu"], steps, overrides)
    assert settings.distill_steps == demo.SETTINGS["gpu"].distill_steps
    common = demo.common_overrides(tmp_path, settings, 1, tmp_path / "run")
    config = configuration.load(TrainConfig, demo.CONFIGS / "stdlib-swiftkv.yaml",
                                ["model.teacher=x"] + common + list(settings.distill_overrides))
    assert (config.optim.learning_rate, config.loss.temperature, config.model.compute_dtype) == (6e-3, 1.0, "bfloat16")
    assert recipe_sweep.row_settings(demo.SETTINGS["gpu"], 50, ()).distill_steps == 50
    for bad in ("lr|x|", "lr", "|10|", "a/b|10|"):
        with pytest.raises(ValueError, match="NAME|STEPS"):
            recipe_sweep.parse_row(bad)
    with pytest.raises(SystemExit):
        recipe_sweep.main([str(tmp_path), "lr|0|"])
    assert not any(tmp_path.iterdir())
    with pytest.raises(SystemExit):
        recipe_sweep.main([str(tmp_path), "lr||", "--budget", "gpu"])
    assert "the gpu budget needs a GPU" in capsys.readouterr().err and not any(tmp_path.iterdir())
    with pytest.raises(SystemExit):
        recipe_sweep.main([str(tmp_path), "lr||", "--arch", "hiden_size=256"])
    assert "hiden_size is not an architecture key of the demo's teacher" in capsys.readouterr().err
    (tmp_path / "demo_settings.json").write_text(json.dumps({"settings": "full"}))
    with pytest.raises(SystemExit):
        recipe_sweep.main([str(tmp_path), "lr||", "--budget", "quick"])
    assert re.search("holds a demo of the full budget .* pass --budget full", capsys.readouterr().err)
    assert [p.name for p in tmp_path.iterdir()] == ["demo_settings.json"]


def test_recipe_sweep_records_the_demo_it_makes_and_takes_over_no_other_folder(tmp_path, monkeypatch, capsys):
    """A sweep where no demo ran pretrains the teacher there as the demo would: it records the demo's settings (so
    demo.py reuses that teacher, not refusing a folder without a demo run), and refuses a folder of the user's."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import recipe_sweep

    class Built(Exception):
        pass

    monkeypatch.setattr(demo, "build_data", lambda *args, **kwargs: (_ for _ in ()).throw(Built()))
    work = tmp_path / "work"
    with pytest.raises(Built):
        recipe_sweep.main([str(work), "lr||", "--budget", "smoke"])
    record = demo.settings_record("smoke", demo.SETTINGS["smoke"])
    assert json.loads((work / demo.SETTINGS_FILE).read_text()) == record and demo.check_out(work, record) == []
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        recipe_sweep.main([str(user), "lr||", "--budget", "smoke"])
    assert f"{user} holds other files (notes.txt)" in capsys.readouterr().err
    assert [p.name for p in user.iterdir()] == ["notes.txt"]


def test_attention_replaces_the_budgets_in_both_recipes(tmp_path):
    """--attention: the training's attention_impl, once, in pretraining and distillation; the rest untouched."""
    from swiftkv_jax import configuration
    from swiftkv_jax.distill.config import TrainConfig

    settings = demo.with_attention(demo.SETTINGS["gpu"], "cudnn")
    for overrides, recipe in ((settings.pretrain_overrides, "stdlib-teacher.yaml"),
                              (settings.distill_overrides, "stdlib-swiftkv.yaml")):
        assert [o for o in overrides if "attention_impl" in o] == ["model.attention_impl=cudnn"]
        assert len(overrides) == len(demo.SETTINGS["gpu"].pretrain_overrides if "teacher" in recipe
                                     else demo.SETTINGS["gpu"].distill_overrides)
        common = demo.common_overrides(tmp_path, settings, 1, tmp_path / "run")
        config = configuration.load(TrainConfig, demo.CONFIGS / recipe, ["model.teacher=x"] + common + list(overrides))
        assert config.model.attention_impl == "cudnn"
    smoke = demo.with_attention(demo.SETTINGS["smoke"], "xla_chunked")  # a budget without its own: added
    assert smoke.pretrain_overrides == smoke.distill_overrides == ("model.attention_impl=xla_chunked",)
    with pytest.raises(ValueError, match="differentiable attention, one of auto, xla, xla_chunked, cudnn"):
        demo.with_attention(demo.SETTINGS["gpu"], "mosaic")
    assert demo.parser().parse_args(["--budget", "gpu", "--attention", "cudnn"]).attention == "cudnn"


def test_a_kept_training_stage_of_other_settings_is_refused_not_reported(tmp_path, monkeypatch):
    """A stage's export is reused only if its config.yaml holds what this call would train (a recipe sweep's row run
    again under its name with other steps or rate was scored and reported as trained with them); where its files
    are (a moved --out) is not a change."""
    import yaml

    from swiftkv_jax import configuration
    from swiftkv_jax.configuration import to_dict
    from swiftkv_jax.distill import trainer
    from swiftkv_jax.distill.config import TrainConfig

    settings = demo.SETTINGS["smoke"]

    def overrides(out, steps, rate):
        return ([f"model.teacher={out / 'teacher'}", f"optim.learning_rate={rate}"]
                + demo.common_overrides(out, settings, steps, out / "run"))

    before = configuration.load(TrainConfig, demo.CONFIGS / "stdlib-swiftkv.yaml", overrides(tmp_path / "a", 2, 1e-3))
    run_dir = tmp_path / "b" / "run"
    (run_dir / "student_hf").mkdir(parents=True)
    (run_dir / trainer.CONFIG_FILE).write_text(yaml.safe_dump(to_dict(before), sort_keys=False))  # as train() does
    monkeypatch.setattr(trainer, "train", lambda config: pytest.fail("a kept stage trained again"))
    demo._train("stdlib-swiftkv.yaml", overrides(tmp_path / "b", 2, 1e-3), run_dir / "student_hf")  # moved: kept
    for (steps, rate), change in (((50, 1e-3), "train.max_steps: 2 -> 50"),
                                  ((2, 5e-2), "optim.learning_rate: 0.001 -> 0.05")):
        with pytest.raises(ValueError, match=f"trained with other settings \\({re.escape(change)}\\)"):
            demo._train("stdlib-swiftkv.yaml", overrides(tmp_path / "b", steps, rate), run_dir / "student_hf")


def test_a_stage_cut_short_between_its_exports_is_resumed_not_kept(tmp_path, monkeypatch):
    """SIGTERM (outside the training loop) or SIGKILL after the teacher's model_hf, before its model_orbax, loss.png
    and seconds: the next call resumed nothing (model_hf exists: skipped), so those were never written. Now the stage
    is finished when its seconds are written; until then it resumes from its checkpoints (only exporting again)."""
    from swiftkv_jax.distill import trainer

    settings = demo.SETTINGS["smoke"]
    run_dir = tmp_path / "teacher"
    overrides = [f"model.teacher={tmp_path / 'init'}"] + demo.common_overrides(tmp_path, settings, 2, run_dir)
    (run_dir / "model_hf").mkdir(parents=True)
    (run_dir / trainer.CHECKPOINT_DIR / "2").mkdir(parents=True)
    calls = []
    monkeypatch.setattr(trainer, "train", lambda config: calls.append(config.train.resume) or 0)
    demo._train("stdlib-teacher.yaml", overrides, run_dir / "model_hf")
    assert calls == [True] and (run_dir / demo.TRAIN_SECONDS).is_file()
    demo._train("stdlib-teacher.yaml", overrides, run_dir / "model_hf")  # finished: kept
    assert calls == [True]


def test_shape_checks_against_hand_computed_gaps():
    """The share of the 50% gap closed is (undistilled - distilled) / (undistilled - teacher) in validation loss (the
    recipe sweep's formula); the second difference of the gaps over 25/50/75%; the gpu target is judged on it."""
    def rows(distilled_50, skipped_75=3.6):
        loss = {"teacher": 3.0, "swiftkv-25": 3.1, "swiftkv-50-undistilled": 4.0, "swiftkv-50": distilled_50,
                "swiftkv-75": skipped_75}
        return [{"model": name, "val_loss": value} for name, value in loss.items()]

    checks = demo.shape_checks(rows(3.2), target=0.9)  # gaps 0.1, 0.2 (undistilled 1.0), 0.6
    assert checks["gap_closed_by_distillation_at_50"] == pytest.approx(0.8)
    assert checks["second_difference_of_gap"] == pytest.approx((0.6 - 0.2) - (0.2 - 0.1))
    assert checks["quality_falls_faster_beyond_50"] and checks["distilled_better_than_undistilled"]
    assert (checks["gap_closed_target"], checks["gap_closed_pass"]) == (0.9, False)
    assert demo.shape_checks(rows(3.05), target=0.9)["gap_closed_pass"]  # 95%
    assert not demo.shape_checks(rows(3.2, skipped_75=3.25))["quality_falls_faster_beyond_50"]  # 0.05 < 0.1
    assert "gap_closed_pass" not in demo.shape_checks(rows(3.2))  # the CPU budgets have no target
    worse = demo.shape_checks(rows(4.2))
    assert worse["gap_closed_by_distillation_at_50"] == pytest.approx(-0.2)
    assert not worse["distilled_better_than_undistilled"]
