"""`python train.py` end to end on the tiny recipe (configs/tiny.yaml): a full run and its exports, --help,
--dry-run, resume, signals, refusals, non-finite losses, bad input, and two processes on localhost.

Most runs call `cli.main([...])` in-process (8 fake CPU devices, see conftest); subprocesses where the
process matters (the real entry point, SIGTERM, device counts, multi-process). References not written
here: transformers (config, tokenizer, the teacher's logits from the exported student), a float64 numpy
forward of the published tensor layout, the teacher's own safetensors, and an uninterrupted run.
"""

import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import numpy_reference
import swiftkv_jax as sk
from conftest import xla_flags
from distill_fixtures import LLAMA_8B_TRAINABLE_L16, assert_trees_equal, numpy_kl, write_hf_config
from hf_models import file_digests, read_hf_tensors, torch_logits
from swiftkv_jax import configuration
from swiftkv_jax.distill import cli, trainer
from swiftkv_jax.distill.config import TrainConfig
from swiftkv_jax.distill.metrics import MetricsLog, read_metrics
from swiftkv_jax.tiny_assets import make_tiny_assets

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"
L, LAYER_L = 4, 2  # the tiny teacher's layers, the recipe's l
METRIC_FIELDS = {"step", "loss", "kl", "hidden_mse", "lr", "grad_norm", "tokens", "tokens_per_s", "step_s", "host_s"}
COMPARED = ("loss", "kl", "hidden_mse", "lr", "grad_norm", "tokens")  # all but the timings


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """chat.jsonl and teacher/ (random 4-layer HF Llama with tokenizer files), made once."""
    return make_tiny_assets(tmp_path_factory.mktemp("tiny"))


def recipe(assets, out, *overrides) -> list[str]:
    """train.py arguments: the tiny recipe on this module's assets, writing to `out`."""
    return ["--config", str(TINY), f"model.teacher={assets / 'teacher'}",
            f"data.sources=[{{path: {assets / 'chat.jsonl'}}}]", f"data.cache_dir={assets / 'cache'}",
            f"train.output_dir={out}", *overrides]


def env_with_devices(n: int) -> dict:
    return {**os.environ, "XLA_FLAGS": xla_flags(n)}


def train_py(args, devices: int = 1, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *map(str, args)], cwd=REPO, env=env_with_devices(devices),
                          capture_output=True, text=True, timeout=timeout)


def main(capsys, args) -> tuple[int, str, str]:
    """cli.main in-process: (exit code, stdout, stderr)."""
    rc = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def compared(records):
    return [{k: r[k] for k in ("step",) + COMPARED} for r in records]


# --- a full run of the tiny recipe --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_run(assets, tmp_path_factory):
    """`python train.py --config configs/tiny.yaml` to the end (57 steps), one CPU device."""
    out = tmp_path_factory.mktemp("full") / "run"
    proc = train_py(recipe(assets, out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc


def test_tiny_recipe_trains_and_the_loss_falls(full_run, assets):
    out, proc = full_run
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 58))  # 157 packed rows / 8, 3 epochs
    assert all(set(r) == METRIC_FIELDS for r in records)
    assert all(np.isfinite(r[k]) and r[k] >= 0 for r in records for k in METRIC_FIELDS)
    assert all(r["tokens_per_s"] > 0 and 0 < r["tokens"] <= 8 * 256 for r in records)
    assert all(0 < r["host_s"] and 0 < r["step_s"] for r in records)
    for r in records:  # loss = T^2 KL + hidden_loss_mult MSE, T = 2, mult = 1 (the recipe)
        np.testing.assert_allclose(r["loss"], 4 * r["kl"] + r["hidden_mse"], rtol=1e-6)
    # warmup over round(5% of 57) = 3 steps to 3e-3, then linear decay to 0
    lrs = [r["lr"] for r in records]
    assert lrs[0] == 0.0 and max(lrs) == pytest.approx(3e-3) and lrs.index(max(lrs)) == 3
    assert all(a > b for a, b in zip(lrs[3:], lrs[4:])) and lrs[-1] == pytest.approx(3e-3 / 54, rel=1e-4)
    losses = [r["loss"] for r in records]
    assert np.mean(losses[-5:]) < 0.2 * np.mean(losses[:5])  # measured: ~0.0004 vs ~0.0073
    assert "trainable 16,448 of 230,016 parameters" in proc.stdout  # 2 x (64^2 + 2 x 64 x 32) + 64
    for name in ("student_hf", "student_orbax", "metrics.jsonl", "loss.png"):
        assert f"{out / name}" in proc.stdout
    # the teacher's config.json as the run started, for resumes to compare against
    assert (json.loads((out / trainer.TEACHER_CONFIG_FILE).read_text())
            == json.loads((assets / "teacher" / "config.json").read_text()))
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "loss.png").stat().st_size > 5000


def test_exports_load_with_tokenizer_and_swiftkv_config(full_run, assets):
    out, _ = full_run
    teacher = assets / "teacher"
    hf, orbax = sk.load(out / "student_hf"), sk.load(out / "student_orbax")
    assert hf.config == orbax.config
    assert (hf.config.num_key_value_layers, hf.config.key_value_group_size) == (LAYER_L, 1)
    assert hf.config.num_hidden_layers == L
    assert_trees_equal(hf.params, orbax.params)  # float32 export: both formats hold the same weights
    for directory in (out / "student_hf", out / "student_orbax"):
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            assert (directory / name).read_bytes() == (teacher / name).read_bytes()
    config = json.loads((out / "student_hf" / "config.json").read_text())
    assert config["model_type"] == "llama_swiftkv" and config["architectures"] == ["LlamaSwiftKVForCausalLM"]
    assert (config["num_key_value_layers"], config["key_value_group_size"]) == (LAYER_L, 1)
    # transformers reads the exported config and tokenizer
    hf_config = LlamaConfig.from_pretrained(out / "student_hf")
    assert (hf_config.num_hidden_layers, hf_config.hidden_size, hf_config.num_key_value_layers) == (L, 64, LAYER_L)
    text = "What is the capital of France? Paris."
    assert (AutoTokenizer.from_pretrained(out / "student_hf")(text)["input_ids"]
            == AutoTokenizer.from_pretrained(teacher)(text)["input_ids"])


def test_export_keeps_the_teachers_weights_and_trains_only_swiftkv(full_run, assets):
    out, _ = full_run
    teacher, exported = read_hf_tensors(assets / "teacher"), read_hf_tensors(out / "student_hf")
    for name, tensor in teacher.items():  # every original tensor, bit for bit
        assert torch.equal(exported[name], tensor), name
    added = {f"model.layers.{i}.self_attn.{p}_proj_swiftkv.weight" for i in range(LAYER_L, L) for p in "qkv"}
    assert set(exported) - set(teacher) == added | {"model.norm_swiftkv.weight"}
    for i in range(LAYER_L, L):  # moved away from their init (copies of the teacher's projections)
        for p in "qkv":
            assert not torch.allclose(exported[f"model.layers.{i}.self_attn.{p}_proj_swiftkv.weight"],
                                      teacher[f"model.layers.{i}.self_attn.{p}_proj.weight"])
    # transformers runs the exported student as a plain Llama: exactly the teacher
    tokens = np.random.RandomState(0).randint(0, 512, (1, 40))
    student_as_llama = LlamaForCausalLM.from_pretrained(out / "student_hf").eval()
    teacher_model = LlamaForCausalLM.from_pretrained(assets / "teacher").eval()
    np.testing.assert_array_equal(torch_logits(student_as_llama, tokens), torch_logits(teacher_model, tokens))


def test_distilled_student_is_closer_to_the_teacher_in_float64(full_run, assets):
    """KL(teacher || student) on a training document by the float64 numpy forward of the published tensor
    layout: the exported student against the §3 initialisation built by hand from the teacher's tensors."""
    out, _ = full_run
    config, teacher = numpy_reference.load_tensors(assets / "teacher")
    student_config, student = numpy_reference.load_tensors(out / "student_hf")
    init = dict(teacher, **{"model.norm_swiftkv.weight": teacher[f"model.layers.{LAYER_L}.input_layernorm.weight"]})
    for i in range(LAYER_L, L):
        for p in "qkv":
            attention = f"model.layers.{i}.self_attn.{p}_proj"
            init[f"{attention}_swiftkv.weight"] = teacher[f"{attention}.weight"]
    example = json.loads((assets / "chat.jsonl").read_text().splitlines()[0])
    tokenizer = AutoTokenizer.from_pretrained(assets / "teacher")
    text = tokenizer.apply_chat_template(example["messages"], tokenize=False)
    tokens = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert 20 < len(tokens) <= 256

    def mean_kl(tensors):
        return np.mean(numpy_kl(numpy_reference.forward(config, teacher, tokens, swiftkv=False),
                                numpy_reference.forward(student_config, tensors, tokens, swiftkv=True), 2.0))

    before, after = mean_kl(init), mean_kl(student)
    assert before > 1e-4 and after < 0.3 * before  # measured: 0.0088 -> 0.0010


# --- --help and --dry-run -----------------------------------------------------------------------------------


def test_help_lists_every_key_with_its_default(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "--dry-run" in text and "--config" in text
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("  ") and line.split()}
    for key in configuration.keys(TrainConfig):
        assert key in lines and " = " in lines[key], key
    assert lines["optim.learning_rate"].endswith("float = 0.0002")
    assert lines["loss.temperature"].endswith("float = 2.0")
    assert lines["mesh.fsdp"].endswith("int = -1")
    assert lines["model.norm_init"].endswith("copy|ones = copy")


BYTE_LINES = ("frozen_weights", "trainable_weights", "optimizer_state", "step_temporaries", "total")


def gib_lines(text: str) -> dict:
    return {m[1]: float(m[2]) for m in re.finditer(r"^  (\w+)\s+([\d.]+) GiB$", text, re.M)}


def test_dry_run_prints_per_device_bytes_and_writes_nothing(capsys, assets, tmp_path):
    out = tmp_path / "never"
    rc, stdout, _ = main(capsys, ["--dry-run", *recipe(assets, out)])
    assert rc == 0
    assert set(gib_lines(stdout)) == set(BYTE_LINES)
    assert "trainable parameters 16,448 of 230,016" in stdout and "8 devices" in stdout
    assert not out.exists()


def test_dry_run_of_llama_3_1_8b_from_its_config_alone(tmp_path):
    teacher = write_hf_config(tmp_path / "Llama-3.1-8B-Instruct")
    proc = train_py(["--config", REPO / "configs" / "llama-3.1-8b-instruct.yaml", "--dry-run",
                     f"model.teacher={teacher}", f"train.output_dir={tmp_path / 'out'}"], devices=8, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    frozen_params = 8_030_261_248  # the published count, every original weight
    total = frozen_params + LLAMA_8B_TRAINABLE_L16
    assert f"trainable parameters {LLAMA_8B_TRAINABLE_L16:,} of {total:,}" in proc.stdout
    assert "fsdp': 8" in proc.stdout
    gib = gib_lines(proc.stdout)
    # fsdp = 8 splits every weight but the norms (32 x 2 + 1 vectors of 4096, and norm_swiftkv) 8 ways
    norms = (2 * 32 + 1) * 4096
    assert gib["frozen_weights"] == round(((frozen_params - norms) / 8 + norms) * 2 / 2**30, 2)  # bf16
    assert gib["trainable_weights"] == round(((LLAMA_8B_TRAINABLE_L16 - 4096) / 8 + 4096) * 4 / 2**30, 2)  # fp32
    assert gib["optimizer_state"] == round(2 * ((LLAMA_8B_TRAINABLE_L16 - 4096) / 8 + 4096) * 4 / 2**30, 2)
    assert not (tmp_path / "out").exists()


def test_dry_run_sizes_the_70b_recipe_for_its_32_devices(tmp_path):
    """The 70B recipe is for 32 GPUs; its "size it first" dry run on one machine (1 CPU device, or one node's 8 GPUs)
    sized it for that machine's devices instead: fsdp 1 and 32 rows a device, 914 GiB a device (8 GPUs: 119 GiB).
    --devices 32 sizes the recipe's own mesh (fsdp 32, one 8K row a device) on fake CPU devices."""
    teacher = write_hf_config(tmp_path / "Llama-3.1-70B-Instruct", hidden_size=8192, intermediate_size=28672,
                              num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8)
    proc = train_py(["--config", REPO / "configs" / "llama-3.1-70b-instruct.yaml", "--dry-run", "--devices", 32,
                     f"model.teacher={teacher}", f"train.output_dir={tmp_path / 'out'}"], devices=1, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fsdp': 32" in proc.stdout and "global batch 32 x 8192 tokens over 32 devices" in proc.stdout
    trainable = 40 * (8192 * 8192 + 2 * 8192 * 1024) + 8192  # q, k, v_proj_swiftkv of layers 40-79, norm_swiftkv
    gib = gib_lines(proc.stdout)
    assert gib["trainable_weights"] == round(((trainable - 8192) / 32 + 8192) * 4 / 2**30, 2)  # fp32, 32 ways
    assert gib["frozen_weights"] < 4.2 and gib["total"] < 74.5  # 131 GiB of bf16 over 32; under an H100's 80 GB
    assert not (tmp_path / "out").exists()


def test_devices_is_for_a_dry_run_before_jax_starts(capsys, assets, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--devices", "8", *recipe(assets, tmp_path / "never")])
    assert exit_.value.code == 2 and "--devices sizes a --dry-run" in capsys.readouterr().err
    # in this process JAX already runs on the suite's 8 devices: another count is refused, not silently ignored
    rc, _, err = main(capsys, ["--dry-run", "--devices", 3, *recipe(assets, tmp_path / "never")])
    assert rc == 2 and "--devices 3: JAX already runs on 8 cpu device(s)" in err
    assert not (tmp_path / "never").exists()


# --- resume, signals, refusals ------------------------------------------------------------------------------


def test_resume_equals_uninterrupted_run(capsys, assets, tmp_path, monkeypatch):
    steps = ["train.max_steps=12", "checkpoint.every=4", "model.attention_impl=auto"]  # auto: xla_chunked here
    # train.resume=true with nothing to resume (a typo in train.output_dir looks so) starts afresh, and says so
    rc, stdout, _ = main(capsys, recipe(assets, tmp_path / "a", *steps, "train.resume=true"))
    assert rc == 0 and f"train.resume=true, but {tmp_path / 'a' / 'checkpoints'} holds no checkpoint: starting at " \
                       f"step 0" in stdout
    calls = itertools.count(1)
    with monkeypatch.context() as m:  # a stop request after the 5th step, as SIGINT would make
        m.setattr(trainer._StopRequest, "requested", lambda self: signal.SIGINT if next(calls) == 5 else 0)
        rc, stdout, _ = main(capsys, recipe(assets, tmp_path / "b", *steps))
    # not finished: the shell's status of a run stopped by SIGINT (128 + 2), its checkpoint saved
    assert rc == 130 and "SIGINT received: checkpoint saved at step 5" in stdout and "train.resume=true" in stdout
    assert [r["step"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")] == list(range(1, 6))
    assert not (tmp_path / "b" / "student_hf").exists()
    rc, stdout, _ = main(capsys, recipe(assets, tmp_path / "b", *steps, "train.resume=true"))
    assert rc == 0 and "resumed from step 5" in stdout
    uninterrupted = read_metrics(tmp_path / "a" / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert compared(resumed) == compared(uninterrupted)  # bit-identical
    assert_trees_equal(sk.load(tmp_path / "b" / "student_orbax").params,
                       sk.load(tmp_path / "a" / "student_orbax").params)


def test_step_time_counts_the_checkpoint_saves(capsys, assets, tmp_path, monkeypatch):
    """metrics.jsonl's step_s is the wall time between steps: a save's blocking time (here 0.5 s added to the save
    after step 2) shows in the next step's, so the steps add up to the run (train_pipeline's e2e rate)."""
    real = trainer._save

    def slow_save(manager, step, *args, **kwargs):
        if step == 2:
            time.sleep(0.5)
        return real(manager, step, *args, **kwargs)

    monkeypatch.setattr(trainer, "_save", slow_save)
    rc, _, _ = main(capsys, recipe(assets, tmp_path / "run", "train.max_steps=4", "checkpoint.every=2"))
    steps = {r["step"]: r["step_s"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")}
    assert rc == 0 and steps[3] >= 0.5 > steps[4]


def test_sigterm_saves_a_checkpoint_and_exits_143(assets, tmp_path):
    """A signal saves and stops; the exit status is the shell's for SIGTERM (128 + 15), so that a scheduler or
    `train.py && ...` does not take the unfinished run for a finished one."""
    out = tmp_path / "run"
    args = recipe(assets, out, "train.max_steps=5000", "checkpoint.every=1000")
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO, env=env_with_devices(1),
                                stdout=stdout, stderr=stderr)
        try:
            deadline = time.time() + 180
            while len(read_metrics(out / "metrics.jsonl")) < 3:  # training has begun
                assert proc.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
                assert time.time() < deadline
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 143, (tmp_path / "stderr").read_text()[-3000:]
    printed = (tmp_path / "stdout").read_text()
    match = re.search(r"SIGTERM received: checkpoint saved at step (\d+) in (\S+); continue with train.resume=true",
                      printed)
    assert match, printed
    step = int(match[1])
    assert match[2] == str(out / "checkpoints")
    with ocp.CheckpointManager(out / "checkpoints") as manager:
        assert manager.latest_step() == step
    assert read_metrics(out / "metrics.jsonl")[-1]["step"] == step < 5000


@pytest.fixture
def finished_copy(full_run, tmp_path):
    """A copy of the full run's output directory (checkpoints at steps 40 and 57), and its digests."""
    copy = tmp_path / "run"
    shutil.copytree(full_run[0], copy)
    return copy, file_digests(copy)


def test_restart_into_a_run_without_resume_is_refused(capsys, assets, finished_copy):
    out, digests = finished_copy
    rc, _, err = main(capsys, recipe(assets, out))
    assert rc == 2
    assert "already holds a run's outputs: checkpoints/ (latest step 57)" in err and "train.resume=true" in err
    assert file_digests(out) == digests


@pytest.mark.parametrize("kept", [("student_hf",), ("metrics.jsonl", "config.yaml", "teacher_config.json")])
def test_a_finished_run_without_checkpoints_is_not_overwritten(capsys, assets, finished_copy, kept):
    """A finished run whose checkpoints were deleted still has its export and metrics: a new run (or a resume,
    which would find nothing to resume and start again) in its folder is refused before anything is read."""
    out, _ = finished_copy
    for path in out.iterdir():
        if path.name not in kept:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    digests = file_digests(out)
    rc, _, err = main(capsys, recipe(assets, out))
    assert rc == 2 and f"train.output_dir {out} already holds a run's outputs: " in err
    assert all(name in err for name in kept) and "train.resume=true" in err and "another train.output_dir" in err
    if "student_hf" in kept:
        rc, _, err = main(capsys, recipe(assets, out, "train.resume=true"))
        assert rc == 2 and "no checkpoint to resume from, only the export(s) student_hf/" in err
    assert file_digests(out) == digests


@pytest.mark.parametrize("filled_at", ["config.yaml", "teacher_config.json"])
def test_a_full_disk_as_a_resume_rewrites_its_config_keeps_the_run_resumable(capsys, assets, finished_copy,
                                                                            monkeypatch, filled_at):
    """Resume rewrites config.yaml and teacher_config.json, which the next resume reads: written in place, a full disk
    (or a kill) mid-write left them cut short and the run unresumable. Whole or not at all, and no temporary file."""
    import yaml

    out, _ = finished_copy
    names = ("config.yaml", "teacher_config.json", "metrics.jsonl")
    before = {name: (out / name).read_bytes() for name in names}
    write_text = Path.write_text

    def full_disk(self, text, *args, **kwargs):  # the disk fills as `filled_at` (or its temporary copy) is written
        if filled_at not in self.name:
            return write_text(self, text, *args, **kwargs)
        write_text(self, text[:10], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        main(capsys, recipe(assets, out, "train.resume=true", "export.hf=false"))
    monkeypatch.undo()
    assert (out / filled_at).read_bytes() == before[filled_at]  # the file being written when the disk filled
    assert (out / "metrics.jsonl").read_bytes() == before["metrics.jsonl"]
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["output_dir"]  # old or new, whole
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


def test_resuming_a_finished_run_exports_again(capsys, assets, finished_copy):
    """Its own earlier export is replaced (the one case an export is). Settings of how, not what, it computes
    may change on resume (trainer.RESUME_FREE: here remat and the attention backend)."""
    out, _ = finished_copy
    rc, stdout, _ = main(capsys, recipe(assets, out, "train.resume=true", "export.hf=false", "model.remat=full",
                                        "model.attention_impl=auto"))
    assert rc == 0 and "resumed from step 57" in stdout and f"exported the student to {out / 'student_orbax'}" in stdout
    assert sk.load(out / "student_orbax").config.num_key_value_layers == LAYER_L
    # the earlier HF export stays (it is the user's) but is said to be stale, not left to pass for the new one
    assert f"warning: {out / 'student_hf'} is an export from before this resume, not updated (export.hf=false)" in \
        stdout


def test_resume_after_a_metrics_line_cut_short(assets, full_run, finished_copy):
    """A full disk (or a kill) mid-append leaves metrics.jsonl's last line cut short; the run resumes from its
    checkpoint (step 40) as if uninterrupted, that line dropped."""
    out, _ = finished_copy
    shutil.rmtree(out / "checkpoints" / "57")
    for name in ("student_hf", "student_orbax", "loss.png"):
        shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(lines[:45]) + lines[45][:100])  # step 46 half written
    proc = train_py(recipe(assets, out, "train.resume=true"))  # one device, as full_run
    assert proc.returncode == 0 and "resumed from step 40" in proc.stdout, proc.stderr[-3000:]
    assert compared(read_metrics(out / "metrics.jsonl")) == compared(read_metrics(full_run[0] / "metrics.jsonl"))


def test_a_damaged_metrics_line_before_the_last_is_not_skipped(tmp_path):
    """Only an unfinished last line is an interrupted append; damage elsewhere is not hidden."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(ValueError):
        read_metrics(tmp_path / "metrics.jsonl")


def test_a_damaged_last_metrics_line_that_ends_its_line_is_not_skipped(tmp_path):
    """A line with its newline was appended whole: damage there is not an interrupted append, and raises."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo\n')
    with pytest.raises(ValueError):
        read_metrics(tmp_path / "metrics.jsonl")


def test_resume_trimming_metrics_on_a_full_disk_keeps_the_history(tmp_path, monkeypatch):
    """On resume metrics.jsonl is rewritten without the steps past the checkpoint: written in place, a full disk (or
    a kill) mid-write left it truncated, the run's history lost. Now whole or not at all, and no temporary file."""
    records = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 6))
    (tmp_path / "metrics.jsonl").write_text(records)
    write_text = Path.write_text

    def full_disk(self, text, *args, **kwargs):
        write_text(self, text[:10], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        MetricsLog(tmp_path, resume_step=3)
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_text() == records and os.listdir(tmp_path) == ["metrics.jsonl"]
    MetricsLog(tmp_path, resume_step=3)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_resuming_past_the_runs_last_step_is_refused(capsys, assets, finished_copy):
    """A checkpoint beyond the steps this run would train is not relabelled as its last: refused, nothing
    changed."""
    out, digests = finished_copy
    rc, _, err = main(capsys, recipe(assets, out, "train.resume=true", "train.max_steps=10"))
    assert rc == 2 and "holds step 57, past the 10 steps this run trains (train.max_steps=10" in err
    assert "train for at least 57 steps, or start a new train.output_dir" in err
    assert file_digests(out) == digests


@pytest.mark.parametrize("change,changed", [
    ("model.num_key_value_layers=1", "model.num_key_value_layers: 2 -> 1"),
    ("data.seq_len=128", "data.seq_len: 256 -> 128"),
    ("loss.temperature=1.0", "loss.temperature: 2.0 -> 1.0"),
])
def test_resume_with_changed_settings_is_refused(capsys, assets, finished_copy, change, changed):
    out, digests = finished_copy
    rc, _, err = main(capsys, recipe(assets, out, "train.resume=true", change))
    assert rc == 2
    assert "cannot resume: settings differ" in err and changed in err and "config.yaml" in err
    assert file_digests(out) == digests


def test_resume_onto_a_teacher_of_other_shapes_is_refused(capsys, assets, finished_copy):
    """The teacher at the same path was replaced by another model since the run started (here: the run's record
    of it says hidden_size 32): named by the changed fields, before any weight or checkpoint is read."""
    out, _ = finished_copy
    saved = out / trainer.TEACHER_CONFIG_FILE
    saved.write_text(json.dumps({**json.loads(saved.read_text()), "hidden_size": 32, "head_dim": 8}))
    digests = file_digests(out)
    rc, _, err = main(capsys, recipe(assets, out, "train.resume=true"))
    assert rc == 2 and f"the teacher at model.teacher={assets / 'teacher'} is not the model" in err
    assert "hidden_size: 32 -> 64" in err and "num_hidden_layers" not in err and "Traceback" not in err
    assert file_digests(out) == digests


# --- non-finite losses --------------------------------------------------------------------------------------


def test_non_finite_loss_stops_with_exit_1_and_keeps_the_last_checkpoint(capsys, assets, tmp_path):
    """lr 1e30 from the first step: the weights reach ~1e30 and the next step's logits overflow."""
    out = tmp_path / "run"
    rc, _, err = main(capsys, recipe(assets, out, "optim.learning_rate=1e30", "optim.warmup_ratio=0",
                                     "checkpoint.every=1", "train.max_steps=6"))
    assert rc == 1
    assert re.search(r"error: non-finite loss nan .* at step 2; stopped without applying it", err), err
    assert f"last good checkpoint (step 1) in {out / 'checkpoints'} is intact" in err
    assert "lower optim.learning_rate in a new train.output_dir (a resumed run keeps its settings" in err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1]
    with ocp.CheckpointManager(out / "checkpoints") as manager:
        assert manager.all_steps() == [1]
        restored = manager.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore(),
                                                              meta=ocp.args.JsonRestore()))
    assert restored.meta["step"] == 1 and int(restored.state["step"]) == 1
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(restored.state))
    assert not (out / "student_hf").exists()


def test_non_finite_first_step_does_not_claim_a_checkpoint(capsys, assets, tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(assets / "teacher", teacher)
    tensors = load_file(teacher / "model.safetensors")
    tensors["lm_head.weight"][0, 0] = np.inf
    save_file(tensors, teacher / "model.safetensors", metadata={"format": "pt"})
    rc, _, err = main(capsys, recipe(assets, tmp_path / "run", f"model.teacher={teacher}", "train.max_steps=3"))
    assert rc == 1 and "non-finite loss" in err and "at step 1" in err
    assert "step None" not in err


# --- bad input ----------------------------------------------------------------------------------------------


BAD_INPUT = {
    "unknown key": (["optim.learnig_rate=1e-3"], "did you mean 'optim.learning_rate'"),
    "bad type": (["train.global_batch_size=eight"], "train.global_batch_size: expected int, got 'eight'"),
    "bad choice": (["model.remat=some"], "model.remat: 'some' is not one of none, full, dots"),
    "missing teacher": (["model.teacher=/nonexistent/teacher"], "/nonexistent/teacher: no such checkpoint directory"),
    "missing data": (["data.sources=[{path: /nonexistent/chat.jsonl}]"], "/nonexistent/chat.jsonl"),
    "l >= L": (["model.num_key_value_layers=4"], "num_key_value_layers=4 leaves no layer to distil in a 4-layer model"),
    "bad mesh": (["mesh.fsdp=3"], "mesh:"),  # before tokenising: no progress bar precedes the error
    "batch vs grad_accum": (["train.grad_accum=3"], "must be divisible by train.grad_accum (3)"),
    # the tiny teacher has 2 KV heads: 4 tensor-parallel ways cannot split them (a traceback after tokenising)
    "mesh vs heads": (["mesh.tensor=4", "mesh.fsdp=2"], "mesh {'data': 1, 'fsdp': 2, 'tensor': 4} does not fit "
                      "model.teacher's shapes"),
    "batch vs devices": (["train.global_batch_size=12"], "train.global_batch_size=12 does not split evenly over "
                         "the 8 devices that share the batch (mesh {'data': 1, 'fsdp': 8, 'tensor': 1}, batch over "
                         "data x fsdp): use a multiple of 8, such as 8 or 16"),
    "unknown attention": (["model.attention_impl=flash"],
                          "model.attention_impl='flash' is unknown: training runs one of auto, xla, xla_chunked, "
                          "cudnn"),
    "negative seed": (["data.seed=-1"], "data.seed must lie in [0, 2**32), got -1"),
    "num_proc": (["data.num_proc=-1"], "data.num_proc must be >= 1 (or null: one process), got -1"),
    "bad yaml": (["data.sources=[{path: a.jsonl, weight: 2]"], "data.sources: '[{path: a.jsonl, weight: 2]' is not "
                 "valid YAML (expected ',' or '}', but got ']'): check its brackets"),
    "process id": (["distributed.num_processes=2", "distributed.process_id=5"],
                   "distributed.process_id must lie in [0, distributed.num_processes), got process_id 5 of "
                   "num_processes 2"),
    "missing tokenizer": (["model.tokenizer=/nonexistent/tok"],
                          "model.tokenizer: the tokenizer directory '/nonexistent/tok' does not exist"),
}


def test_distilling_a_teacher_without_weights_says_only_pretraining_starts_from_a_config(capsys, assets, tmp_path):
    teacher = shutil.copytree(assets / "teacher", tmp_path / "teacher")
    (teacher / "model.safetensors").unlink()
    rc, _, err = main(capsys, recipe(assets, tmp_path / "run", f"model.teacher={teacher}"))
    assert rc == 2 and f"model.teacher: {teacher} holds a config.json but no weights: distillation needs the " \
                       f"teacher's weights (only stage: pretrain starts from a config.json alone" in err, err


@pytest.mark.parametrize("name", BAD_INPUT)
def test_bad_input_exits_2_with_a_clear_message(capsys, assets, tmp_path, name):
    overrides, message = BAD_INPUT[name]
    rc, _, err = main(capsys, recipe(assets, tmp_path / "run", *overrides))
    assert rc == 2
    assert err.startswith("error: ") and message in err, err
    assert "Traceback" not in err


def test_a_tokenizer_beyond_the_teachers_vocabulary_is_refused(capsys, assets, tmp_path):
    """Ids past vocab_size would index no embedding row (NaN losses blamed on the learning rate): refused before
    tokenising; the reverse, a vocab_size padded past the tokenizer, is normal."""
    tokenizer = AutoTokenizer.from_pretrained(assets / "teacher")
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(600)])
    tokenizer.save_pretrained(tmp_path / "tok")
    rc, _, err = main(capsys, recipe(assets, tmp_path / "run", f"model.tokenizer={tmp_path / 'tok'}"))
    assert rc == 2
    assert (f"model.tokenizer={tmp_path / 'tok'} has {len(tokenizer)} tokens, more than the vocab_size 512 of "
            f"model.teacher={assets / 'teacher'}") in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["missing data", "l >= L", "bad mesh", "batch vs devices"])
def test_bad_input_writes_nothing(capsys, assets, tmp_path, name):
    rc, _, _ = main(capsys, recipe(assets, tmp_path / "run", *BAD_INPUT[name][0]))
    assert rc == 2
    assert not (tmp_path / "run").exists()


# --- two processes ------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def two_processes(args, logs: Path, timeout: float, last_only=()) -> list[tuple[int, str]]:
    """The same train.py run as 2 processes of 2 CPU devices each, joined over localhost (gloo), `last_only` added
    to process 1's arguments: [(exit code or None when killed at the timeout, stderr)] per process."""
    port = free_port()
    procs = []
    for i in range(2):
        with open(logs / f"stdout.{i}", "w") as stdout, open(logs / f"stderr.{i}", "w") as stderr:
            procs.append(subprocess.Popen(
                [sys.executable, "train.py", *args, f"distributed.coordinator_address=localhost:{port}",
                 "distributed.num_processes=2", f"distributed.process_id={i}", *(last_only if i else ())],
                cwd=REPO, env=env_with_devices(2), stdout=stdout, stderr=stderr))
    deadline = time.time() + timeout
    try:
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [(None if proc.returncode < 0 else proc.returncode, (logs / f"stderr.{i}").read_text())
            for i, proc in enumerate(procs)]


def test_two_processes_equal_one_process(assets, tmp_path):
    """Same losses as one process, and the exports (collective Orbax; HF gathered tensor by tensor, written by
    process 0) hold the same weights."""
    steps = ["train.max_steps=4"]
    results = two_processes(recipe(assets, tmp_path / "two", *steps), tmp_path, timeout=240)
    for rc, err in results:
        assert rc == 0, err[-3000:]
    lead = (tmp_path / "stdout.0").read_text()
    assert "over 2 process(es)" in lead and "fsdp': 4" in lead
    one = train_py(recipe(assets, tmp_path / "one", *steps), devices=4)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "over 1 process(es)" in one.stdout and "fsdp': 4" in one.stdout
    two_records, one_records = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("two", "one"))
    assert [r["step"] for r in two_records] == [r["step"] for r in one_records] == [1, 2, 3, 4]
    # The first step is the same computation; then the weights carry the rounding of a different
    # reduction order (gloo across processes vs in-process), measured ~2e-6 relative in the KL by step 3.
    for a, b in zip(two_records, one_records):
        assert a["tokens"] == b["tokens"]
        for key in ("loss", "kl", "hidden_mse", "lr", "grad_norm"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-6 if a["step"] == 1 else 1e-5, err_msg=key)
    with ocp.CheckpointManager(tmp_path / "two" / "checkpoints") as manager:
        assert manager.latest_step() == 4
    assert [p.name for p in (tmp_path / "two").iterdir() if p.name.startswith(".")] == []  # no partial dirs
    for export in ("student_orbax", "student_hf"):
        two, one = (sk.load(tmp_path / d / export) for d in ("two", "one"))
        assert two.config.num_key_value_layers == LAYER_L
        for a, b in zip(jax.tree.leaves(two.params), jax.tree.leaves(one.params)):
            np.testing.assert_allclose(a, b, atol=1e-5, err_msg=export)
    assert (sorted(p.name for p in (tmp_path / "two" / "student_hf").iterdir())
            == sorted(p.name for p in (tmp_path / "one" / "student_hf").iterdir()))


def test_stop_together_blocks_run_again_in_one_job(tmp_path):
    """train() called twice in one two-process job (two stages in a script): the second setup block set the first
    one's keys again, which the coordination service refuses (ALREADY_EXISTS); each block has its own now, and an
    error in one process still stops the other."""
    script = ("import sys, jax\n"
              "jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))\n"
              "from swiftkv_jax.distributed import stop_together\n"
              "for call in range(3):\n"
              "    try:\n"
              "        with stop_together('setup', timeout_s=60):\n"
              "            if call == 2 and jax.process_index() == 1:\n"
              "                raise ValueError('bad input')\n"
              "        print(call, 'ok', flush=True)\n"
              "    except Exception as e:\n"
              "        print(call, type(e).__name__, str(e).splitlines()[0], flush=True)\n")
    address = f"localhost:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", script, address, str(i)], cwd=REPO, env=env_with_devices(1),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [proc.communicate(timeout=120)[0].splitlines() for proc in procs]
    assert outs[0] == ["0 ok", "1 ok", "2 ConfigError process 1 of 2 stopped (ValueError: bad input), so this one "
                                       "stops too"], outs
    assert outs[1] == ["0 ok", "1 ok", "2 ValueError bad input"], outs


def test_bad_input_in_one_process_stops_both(assets, tmp_path):
    """Process 1's data path is missing on its host: it says so, and process 0 stops after its own setup with that
    error instead of waiting for process 1 at its first collective (it got a Gloo timeout naming nothing)."""
    start = time.time()
    (rc0, err0), (rc1, err1) = two_processes(recipe(assets, tmp_path / "run", "train.max_steps=2"), tmp_path,
                                             timeout=180, last_only=["data.sources=[{path: missing.jsonl}]"])
    assert rc1 == 2 and "error: source 'missing.jsonl': no such file or directory" in err1
    assert rc0 == 2 and ("error: process 1 of 2 stopped (DataError: source 'missing.jsonl': no such file or "
                         "directory") in err0, err0[-3000:]
    assert time.time() - start < 120
    assert not (tmp_path / "run").exists()


def cut_at(run: Path, copy: Path, step: int) -> None:
    """`copy`: `run` as it was when it had saved `step` (the later checkpoints removed; the metrics past it are
    dropped by the resume)."""
    shutil.copytree(run, copy)
    for path in (copy / "checkpoints").iterdir():
        if path.name.isdigit() and int(path.name) > step:
            shutil.rmtree(path)


@pytest.mark.slow  # five runs, three of them two processes: about 2.5 minutes on 2 CPU cores
def test_checkpoints_resume_across_process_counts(assets, tmp_path):
    """A two-process checkpoint resumes in two processes exactly as the run went on, and in one process (the same
    4 devices) within the rounding of another reduction order (see test_two_processes_equal_one_process); a
    one-process checkpoint resumes in two processes likewise."""
    steps = ["train.max_steps=4", "checkpoint.every=2", "export.hf=false", "export.orbax=false"]
    for rc, err in two_processes(recipe(assets, tmp_path / "two", *steps), tmp_path, timeout=240):
        assert rc == 0, err[-3000:]
    one = train_py(recipe(assets, tmp_path / "one", *steps), devices=4)
    assert one.returncode == 0, one.stderr[-3000:]
    for run, copy in (("two", "two_in_two"), ("two", "two_in_one"), ("one", "one_in_two")):
        cut_at(tmp_path / run, tmp_path / copy, 2)
    resume = [*steps, "train.resume=true"]
    for copy in ("two_in_two", "one_in_two"):
        for rc, err in two_processes(recipe(assets, tmp_path / copy, *resume), tmp_path, timeout=240):
            assert rc == 0, err[-3000:]
        assert "resumed from step 2 (data position 2)" in (tmp_path / "stdout.0").read_text()
    resumed = train_py(recipe(assets, tmp_path / "two_in_one", *resume), devices=4)
    assert resumed.returncode == 0 and "resumed from step 2 (data position 2)" in resumed.stdout, resumed.stderr
    records = {d: read_metrics(tmp_path / d / "metrics.jsonl") for d in ("two", "one", "two_in_two", "two_in_one",
                                                                        "one_in_two")}
    assert compared(records["two_in_two"]) == compared(records["two"])  # bit-identical
    for copy, run in (("two_in_one", "two"), ("one_in_two", "one")):
        assert [r["step"] for r in records[copy]] == [1, 2, 3, 4]
        for a, b in zip(records[copy], records[run]):
            assert a["tokens"] == b["tokens"]  # the same rows
            for key in ("loss", "kl", "hidden_mse", "lr", "grad_norm"):
                np.testing.assert_allclose(a[key], b[key], rtol=1e-5, err_msg=f"{copy} {key} step {a['step']}")
