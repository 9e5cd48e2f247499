"""benchmarks/distill_step.py's memory plan and targets, and benchmarks/train_pipeline.py end to end (issue 24).

The default suite checks the choices by hand-made rows and the arguments (no compile); `-m slow` compiles the plan
of the tiny preset (XLA's accounting: less recomputation costs more memory; the CPU's bf16 estimate is the fp32
compile's temporaries beside the step's own argument bytes) and runs train_pipeline's tiny preset through train.py.
"""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import distill_step  # noqa: E402
import train_pipeline  # noqa: E402


def row(remat, fits, variant="ours"):
    return {"variant": variant, "remat": remat, "fits": fits}


def test_remat_choice_is_the_least_recomputation_that_fits():
    assert distill_step.choose_remat([row("full", True), row("dots", True), row("none", False)]) == "dots"
    assert distill_step.choose_remat([row("full", True), row("dots", True), row("none", True)]) == "none"
    assert distill_step.choose_remat([row("full", False), row("dots", False), row("none", False)]) is None


def test_8b_preset_is_the_issues_shape():
    preset = distill_step.PRESETS["8b"]
    config = distill_step.model_config(preset, "full")
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (32, 4096, 128256)
    assert (config.num_key_value_layers, config.key_value_group_size) == (16, 1)
    assert (preset["batch"], preset["seq_len"], preset["dtype"], preset["frozen_dtype"]) == (1, 8192, "bfloat16",
                                                                                             "bfloat16")
    assert preset["remat"] == "auto" and config.attention_impl == "xla_chunked"


def test_targets_are_judged_only_where_measured():
    ours = {"variant": "ours", "attention_impl": "cudnn", "step_s": 0.8, "mfu": 0.45, "tokens_per_s": 9000.0}
    slower = dict(ours, attention_impl="xla_chunked", step_s=2.0, mfu=0.15, tokens_per_s=4000.0)
    got = distill_step.targets([slower, ours], {})  # ours' fastest row, whichever attention it ran
    assert got == {"mfu": {"target": 0.40, "measured": 0.45, "pass": True, "attention_impl": "cudnn"},
                   "tokens_per_s": {"target": 10_000, "measured": 9000.0, "pass": False, "attention_impl": "cudnn"}}
    assert distill_step.targets([ours], {"time_naive_over_ours": 1.2})["time_naive_over_ours"]["pass"] is False


def test_attention_is_sized_by_the_rows():
    """plain cudnn: the preset's rows are one document, so cuDNN's own causal mask (one run); cudnn:N its packed
    layout for up to N documents per row; xla_chunked told the same rows (it skips keys past each query block);
    a bound on any other impl is refused."""
    preset = distill_step.PRESETS["test"]
    for spec, runs in (("cudnn", 1), ("cudnn:8", 8), ("xla_chunked", 1), ("xla", None)):
        config = distill_step.model_config(dict(preset, attention_impl=spec), "none")
        assert (config.attention_impl, config.max_segments_per_row) == (spec.split(":")[0], runs)
    assert distill_step.attention_impls("test", "cudnn:4, xla") == ("cudnn:4", "xla")
    for bad in ("xla:4", "cudnn:0", "cudnn:x", "pallas"):
        with pytest.raises(SystemExit, match="--attention"):
            distill_step.attention_impls("test", bad)


def test_unknown_variant_is_refused(capsys):
    with pytest.raises(SystemExit):
        distill_step.main(["--preset", "test", "--variants", "ours,fast"])
    assert "choose from ours, naive" in capsys.readouterr().err


@pytest.mark.slow
def test_plan_of_the_tiny_preset(tmp_path, monkeypatch):
    out = tmp_path / "plan.json"
    assert distill_step.main(["--preset", "test", "--plan", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())["plan"]
    rows = {(r["variant"], r["remat"]): r for r in plan["rows"]}
    assert set(rows) == {("ours", "none"), ("ours", "dots"), ("ours", "full"), ("naive", "full")}
    temp = {r: rows["ours", r]["temp_bytes"] for r in ("none", "dots", "full")}
    assert temp["none"] >= temp["dots"] >= temp["full"] > 0
    assert rows["naive", "full"]["xla_peak_bytes"] > rows["ours", "full"]["xla_peak_bytes"]
    assert plan["chosen_remat"] == "none" and all(r["estimate"] == "xla" for r in plan["rows"])  # fp32: as compiled
    # a bf16 step on the CPU: its own argument bytes (half of fp32's weights), the fp32 compile's temporaries
    monkeypatch.setitem(distill_step.PRESETS, "test", dict(distill_step.PRESETS["test"], dtype="bfloat16",
                                                           frozen_dtype="bfloat16"))
    bf16 = distill_step.plan_row(distill_step.PRESETS["test"], "ours", "full")
    assert bf16["estimate"].startswith("cpu") and bf16["temp_bytes"] == rows["ours", "full"]["temp_bytes"]
    assert bf16["argument_bytes"] < rows["ours", "full"]["argument_bytes"]


def test_each_train_pipeline_preset_times_whole_checkpoint_periods():
    """A save after step s shows in step s + 1's step_s: the timed steps hold one save per checkpoint_every, neither
    the save Orbax makes after step 1 nor the last step's (the 1b preset's 40 steps after 3 of warm-up timed 3 saves
    in 37 steps, one every 12.3)."""
    for name, preset in train_pipeline.PRESETS.items():
        saves = train_pipeline.timed_saves(preset)
        assert 1 not in saves and len(saves) * preset["checkpoint_every"] == preset["steps"] - preset["skip"], name


def test_train_pipeline_judges_the_target_on_a_gpu_at_1b_only():
    assert train_pipeline.verdict("1b", "gpu", 0.95) is True and train_pipeline.verdict("1b", "gpu", 0.949) is False
    assert train_pipeline.verdict("test", "gpu", 0.5) is None and train_pipeline.verdict("cpu", "gpu", 1.0) is None
    assert train_pipeline.verdict("1b", "cpu", 1.0) is None


@pytest.mark.slow
def test_train_pipeline_tiny_preset_end_to_end(tmp_path, monkeypatch):
    from swiftkv_jax.distill import trainer

    saved, real = [], trainer._save

    def spy(manager, step, *args, force=False, **kwargs):
        if force or manager.should_save(step):
            saved.append(step)
        return real(manager, step, *args, force=force, **kwargs)

    monkeypatch.setattr(trainer, "_save", spy)
    out = tmp_path / "pipeline.json"
    assert train_pipeline.main(["--preset", "test", "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    preset = train_pipeline.PRESETS["test"]
    assert result["end_to_end"]["steps"] == preset["steps"] - preset["skip"]
    # the saves train made whose blocking time shows in a timed step's step_s (that of the step after the save)
    assert [s for s in saved if preset["skip"] < s + 1 <= preset["steps"]] == train_pipeline.timed_saves(preset)
    assert result["end_to_end"]["checkpoint_saves_timed"] == len(train_pipeline.timed_saves(preset))
    assert result["end_to_end"]["host_s_mean"] > 0 and result["bare"]["step_s"] > 0
    assert result["end_to_end_over_bare"] > 0 and result["pass"] is None  # judged on a GPU only
    # the bare step compiles train's attention: xla_chunked sized for the rows' runs of segment ids (2026-11-26 on
    # an H200 it compiled the unsized one, 756 ms a step against train.py's 518)
    assert preset["attention_impl"] == "xla_chunked"
    assert result["bare"]["max_segments_per_row"] == result["packing"]["max_runs"] > 1
    checkpoints = sorted(p.name for p in (tmp_path / "work" / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert checkpoints == ["4", "6"]


@pytest.mark.slow
def test_profiled_step_of_the_tiny_preset(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert distill_step.main(["--preset", "test", "--variants", "ours", "--profile", "1", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    cats = {c["category"]: c for c in row["profile"]["categories"]}
    assert cats["matmul"]["gflop"] > 0 and "not in the HLO" not in cats
    assert "profile of ours (xla attention)" in capsys.readouterr().out


def test_a_child_that_dies_profiling_keeps_its_timed_row(monkeypatch, tmp_path):
    """The child emits its row when timed and again with the profile; the parent keeps the last whole one."""
    timed = {"variant": "ours", "attention_impl": "xla", "step_s": 1.0}
    assert distill_step.child_rows("warning\n" + json.dumps(timed) + '\n{"variant": "ou') == [timed]

    class Died:
        returncode, stdout, stderr = -11, json.dumps(timed) + "\n", "Fatal Python error: Segmentation fault"

    monkeypatch.setattr(distill_step.subprocess, "run", lambda *a, **k: Died)
    monkeypatch.setattr(distill_step, "backend_platform", lambda: "cpu")
    monkeypatch.setattr(distill_step, "_print_rows", lambda rows, *a: {})
    out = tmp_path / "step.json"
    assert distill_step.main(["--preset", "test", "--variants", "ours", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["step_s"] == 1.0
    assert row["profile_error"] == ("the process died after its steps were timed (exit -11): "
                                    "Fatal Python error: Segmentation fault")


def test_an_auto_remat_step_runs_the_executable_its_plan_compiled(monkeypatch):
    """remat "auto" compiles each policy on abstract arguments; the chosen one's executable runs the timed steps
    with the concrete arguments, and nothing is compiled again (on a GPU, 25 s a compile of the 8b step)."""
    import jax

    monkeypatch.setitem(distill_step.PRESETS, "test", dict(distill_step.PRESETS["test"], remat="auto", steps=1))
    compiles = []
    real = jax.stages.Lowered.compile
    monkeypatch.setattr(jax.stages.Lowered, "compile", lambda self, *a, **k: compiles.append(1) or real(self, *a, **k))
    executables = {}
    remat, rows = distill_step.resolve_remat(distill_step.PRESETS["test"], "ours", executables)
    assert len(compiles) == len(distill_step.REMATS) and list(executables) == [remat] == ["none"]
    compiles.clear()
    row = distill_step._child("test", "ours", "xla")
    assert len(compiles) == len(distill_step.REMATS)  # the plan's; the steps ran the chosen one
    assert row["remat"] == "none" and row["step_s"] > 0 and len(row["step_times_s"]) == 1


def test_profiled_hfu_is_the_profiled_dots_over_the_timed_step(capsys):
    row = dict(variant="ours", attention_impl="cudnn", remat="none", step_s=0.5, tokens_per_step=8192,
               xla_peak_bytes=2**30, xla_temp_bytes=2**29, device_peak_bytes=None, model_flops_per_step=2e14,
               flops_per_step=1e11, platform="gpu", device_kind="H200", trainable_params=1, params=2,
               profile={"categories": [{"category": "matmul", "gflop": 200_000.0},
                                       {"category": "attention (cuDNN)", "gflop": 0.0}]})
    unprofiled = dict(row, profile=None, attention_impl="xla_chunked")
    distill_step._print_rows([row, unprofiled], "8b", 1000.0)
    assert row["profiled_hfu"] == pytest.approx(2e14 / 0.5 / 1e15) and row["mfu"] == pytest.approx(0.4)
    assert unprofiled["profiled_hfu"] is None
    assert "prof. HFU" in capsys.readouterr().out
