"""The embedded default, end to end with nothing downloaded: the Python standard library's source is the corpus.

    python demo.py [--quick | --budget full|quick|gpu] [--out artifacts/demo] [--results DIR]

build the corpus and a byte-level BPE -> pretrain a small Llama teacher (configs/stdlib-teacher.yaml; skipped when
its export exists) -> time each SwiftKV wiring's prefill against the teacher's -> SwiftKV transform at 25/50/75% of
the layers skipped, and 50% + 2-way AcrossKV -> distil each with the same step budget (configs/stdlib-swiftkv.yaml)
-> evaluate on the held-out split (on the gpu budget each model as soon as it exists, beside the next distillation:
`Evaluation`) -> print the table, write it as Markdown + JSON, and plot. Every stage reuses what an earlier run of
the same settings left in --out, each model's evaluation too (`evaluation_rows.json`, written as each model is
evaluated and keyed by its checkpoints' files: delete it to evaluate again), so a call stopped by a time limit
continues where it stopped and a rerun only prints and plots. SIGTERM/SIGINT in a training stage save its checkpoint
and stop the demo (exit status 128 + the signal's number); the same command continues from there. The gpu budget
pretrains a 247M-parameter teacher in bf16 on one GPU (its time from FLOP arithmetic: `gpu_seconds`); --results
copies the table, JSON and plots to a folder of their own.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import functools
import json
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from swiftkv_jax.checkpoints.atomic import write_text_atomic

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
FRACTIONS = (0.25, 0.5, 0.75)  # of the layers whose KV comes from layer l's input (L - l) / L


@dataclasses.dataclass(frozen=True)
class DemoSettings:
    max_files: Optional[int]   # stdlib files in the corpus (None: all)
    vocab_size: int
    architecture: dict         # of the teacher's config.json
    seq_len: int
    batch_size: int            # rows a pretraining step (and a distillation step unless distill_batch_size)
    pretrain_steps: int
    distill_steps: int
    val_rows: int              # packed held-out rows scored
    prompts: int               # held-out prompts for greedy agreement
    prompt_tokens: int
    new_tokens: int = 64
    prefill_len: int = 1024
    pretrain_overrides: tuple = ()  # recipe keys for this budget (e.g. bf16 compute on a GPU)
    distill_overrides: tuple = ()
    eval_workers: int = 1      # models whose quality is scored at once (`Evaluation`: compiling overlaps running)
    evaluate_while_distilling: bool = False  # score each model as soon as it exists, beside the next distillation
    distill_batch_size: Optional[int] = None  # rows a distillation step (None: batch_size)

    @property
    def distill_rows(self) -> int:
        return self.distill_batch_size or self.batch_size


SETTINGS = {
    "full": DemoSettings(max_files=None, vocab_size=4096, seq_len=256, batch_size=32, pretrain_steps=440,
                         distill_steps=120, val_rows=256, prompts=64, prompt_tokens=128,
                         architecture=dict(hidden_size=128, intermediate_size=384, num_hidden_layers=8,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    "quick": DemoSettings(max_files=300, vocab_size=1024, seq_len=128, batch_size=32, pretrain_steps=800,
                          distill_steps=100, val_rows=64, prompts=16, prompt_tokens=64,
                          architecture=dict(hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                                            num_attention_heads=2, num_key_value_heads=1, head_dim=32)),
}
# One GPU (H100/H200), bf16 compute (fp32 masters): a 247M-parameter teacher (16 layers of 1024, GQA 16/4, MLP 4096,
# tied 4096-token vocabulary) on the whole stdlib, 800 steps of 32 x 1024 tokens (26M tokens); students 600 steps of
# 16 x 1024 tokens each. ~5 minutes of matmuls at an assumed 30% of 989 TFLOP/s (gpu_seconds), plus compiling and
# evaluation. Models are scored on 4 threads (eval_workers) as soon as they exist, while the later students distil
# (evaluate_while_distilling): compiling is most of a GPU evaluation, and what is left after the last distillation is
# that student's scores, whose programs its undistilled twin compiled (the AcrossKV student distils first).
# On an H200, students of 300 steps of 32 rows (the same tokens): 2026-11-25, cuDNN attention, each 36-48 s, 92.6% of
# the 50% gap closed; 2026-11-27, attention auto, the whole demo in 417 s (pretraining 130 s, distillation 227 s),
# 87.5% closed (target 90%). Two runs straddle the target, so the students now take their tokens in twice the steps
# of half the rows: on the CPU, at equal tokens, 4x the steps closed 96-97% of the gap where 4x the rows closed 88-89%
# (width 256), and each doubling of the steps about 4 points more. Not yet measured on a GPU (the pack's `sweep`
# part distils the 300 x 32 recipe beside it).
# The students' rate, from CPU sweeps of the 50% student (benchmarks/results/demo/README.md): the best rate halved
# when the width doubled (muP's 1/width: 8e-3 at width 128, 4e-3 at 256, 120 steps of 8K tokens), doubled with 4x the
# steps (480: 91% of the gap closed at 1.6e-2, width 128; 96-97% at 4e-3-8e-3, width 256) and stayed with 4x the rows
# a step (width 256: 89/88% at 4e-3/8e-3); too high costs far more than too low (width 256, 120 steps: 82/85/80/64%
# at 2e-3/4e-3/8e-3/1.6e-2). Width 1024: 1e-3 at 120 steps, ~1.6e-3 at 300, ~2.3e-3 at 600; 2e-3, on the low side
# that costs less. The GPU pack's `sweep` part checks half and twice it.
_GPU_RUNTIME = ("model.frozen_dtype=bfloat16", "model.compute_dtype=bfloat16", "model.trainable_dtype=float32",
                "model.remat=dots", "model.attention_impl=auto", "loss.chunk_size=256")
SETTINGS["gpu"] = DemoSettings(max_files=None, vocab_size=4096, seq_len=1024, batch_size=32, pretrain_steps=800,
                               distill_steps=600, distill_batch_size=16, val_rows=256, prompts=64, prompt_tokens=128,
                               prefill_len=2048,
                               architecture=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
                                                 num_attention_heads=16, num_key_value_heads=4, head_dim=64),
                               pretrain_overrides=_GPU_RUNTIME + ("optim.learning_rate=1e-3",
                                                                  "checkpoint.every=400"),
                               distill_overrides=_GPU_RUNTIME + ("optim.learning_rate=2e-3",  # (above)
                                                                 "checkpoint.every=200"),  # 3 saves, as before
                               eval_workers=4, evaluate_while_distilling=True)
ASSUMED_MFU, PEAK_FLOPS = 0.30, 989e12  # gpu_seconds' assumptions (H100/H200 dense bf16), not measurements


def gpu_seconds(settings: DemoSettings, mfu: float = ASSUMED_MFU, peak: float = PEAK_FLOPS) -> dict:
    """Seconds of matmul work of the training stages at `mfu` of `peak`: pretraining at 6 FLOPs a parameter a token
    plus causal attention (6 n h T a layer), each distillation by `distill_step_flops` (no recomputation counted:
    remat adds to this). Compiling, evaluation and the corpus come on top (a few minutes, not estimated here)."""
    import swiftkv_jax as sk
    from swiftkv_jax.distill.model_flops import distill_step_flops

    a, v, t = settings.architecture, settings.vocab_size, settings.seq_len
    config = sk.ModelConfig(vocab_size=v, tie_word_embeddings=True, **a)
    d, n, k, h, f, layers = (a["hidden_size"], a["num_attention_heads"], a["num_key_value_heads"], a["head_dim"],
                             a["intermediate_size"], a["num_hidden_layers"])
    matmul_params = layers * (d * n * h + 2 * d * k * h + n * h * d + 3 * d * f) + d * v
    tokens = settings.batch_size * t
    pretrain = settings.pretrain_steps * tokens * (6 * matmul_params + 6 * n * h * t * layers)
    distill = sum(settings.distill_steps * settings.distill_rows * t * distill_step_flops(
        config.replace(num_key_value_layers=var.l, key_value_group_size=var.g), t).total
        for var in variants(layers) if var.distilled)
    rate = mfu * peak
    return {"parameters": matmul_params, "pretrain_tokens": settings.pretrain_steps * tokens,
            "pretrain_s": pretrain / rate, "distill_s": distill / rate, "total_s": (pretrain + distill) / rate,
            "assumed_mfu": mfu, "peak_flops": peak}


# The test suite's: the quick pipeline on a budget too small to learn anything (its table is complete, not ordered).
# Its students, like the gpu budget's, take fewer rows a step than the teacher (distill_batch_size), so that the
# CPU runs the path the gpu budget takes.
SETTINGS["smoke"] = dataclasses.replace(SETTINGS["quick"], max_files=100, vocab_size=512, seq_len=64, batch_size=8,
                                        pretrain_steps=20, distill_steps=5, distill_batch_size=4, val_rows=8,
                                        prompts=4, prompt_tokens=16, new_tokens=8, prefill_len=128, eval_workers=2,
                                        evaluate_while_distilling=True)


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    l: int
    g: int = 1
    distilled: bool = True

    def fraction(self, layers: int) -> float:
        return (layers - self.l) / layers


def variants(layers: int) -> list[Variant]:
    out = []
    for f in FRACTIONS:
        l = layers - round(f * layers)
        out += [Variant(f"swiftkv-{round(f * 100)}", l), Variant(f"swiftkv-{round(f * 100)}-undistilled", l,
                                                                  distilled=False)]
    return out + [Variant("swiftkv-50-acrosskv2", layers // 2, 2)]


_STARTED = time.monotonic()


def _say(message: str) -> None:
    """A progress line stamped with the seconds since the demo started: where a run's time went, even in the log of
    one stopped by a time limit."""
    print(f"[demo {time.monotonic() - _STARTED:.0f} s] {message}", flush=True)


def with_attention(settings: DemoSettings, impl: str) -> DemoSettings:
    """The settings with `model.attention_impl=impl` in training (pretraining and distillation), replacing the
    budget's own. impl: one that trains (`swiftkv_jax.distill.student.TRAINING_ATTENTION`)."""
    from swiftkv_jax.distill.student import TRAINING_ATTENTION

    if impl not in TRAINING_ATTENTION:
        raise ValueError(f"--attention {impl!r}: training needs a differentiable attention, one of "
                         f"{', '.join(TRAINING_ATTENTION)}")
    key = "model.attention_impl="

    def replace(overrides: tuple) -> tuple:
        return tuple(o for o in overrides if not o.startswith(key)) + (key + impl,)

    return dataclasses.replace(settings, pretrain_overrides=replace(settings.pretrain_overrides),
                               distill_overrides=replace(settings.distill_overrides))


def check_device(name: str) -> None:
    """The gpu budget refuses any other backend (its bf16 247M teacher would take hours on a CPU)."""
    import jax

    if name == "gpu" and jax.default_backend() != "gpu":
        raise ValueError(f"the gpu budget needs a GPU, but JAX's backend is {jax.default_backend()!r}: use "
                         f"--quick or the full budget on a CPU")


def check_training(out: Path, settings: DemoSettings) -> None:
    """Both recipes load with this call's overrides and their attention runs here (cuDNN needs a GPU computing in 16
    bits): a mistake there (--attention cudnn on a CPU) is refused before anything is written, not after the corpus
    with its settings recorded."""
    from swiftkv_jax import configuration
    from swiftkv_jax.distill.config import TrainConfig
    from swiftkv_jax.distill.student import check_attention

    for recipe, overrides in (("stdlib-teacher.yaml", settings.pretrain_overrides),
                              ("stdlib-swiftkv.yaml", settings.distill_overrides)):
        config = configuration.load(TrainConfig, CONFIGS / recipe, ["model.teacher=x"] + common_overrides(
            out, settings, 1, out / "run") + list(overrides))
        check_attention(config.model)


SCHEDULING = ("eval_workers", "evaluate_while_distilling")  # DemoSettings that change when, not what
SETTINGS_FILE = "demo_settings.json"  # in --out: the settings of the demo run there


def settings_record(name: str, settings: DemoSettings) -> dict:
    """What demo_settings.json holds. (How many models are evaluated at once, and when, changes no result.)"""
    fields = {k: v for k, v in dataclasses.asdict(settings).items() if k not in SCHEDULING}
    return json.loads(json.dumps({"settings": name, **fields}))  # tuples as JSON lists


def _changes(old, new, key: str = "") -> list[str]:
    """`key: old -> new` for each setting that differs: the architecture's keys one by one, of an overrides list
    the entries only one side has."""
    if old == new:
        return []
    if isinstance(old, dict) and isinstance(new, dict):
        return [c for k in {**old, **new} for c in _changes(old.get(k), new.get(k), f"{key}.{k}".lstrip("."))]
    if isinstance(old, list) and isinstance(new, list) and set(map(str, old)) != set(map(str, new)):
        old, new = [o for o in old if o not in new], [o for o in new if o not in old]
    return [f"{key}: {old} -> {new}"]


def trained(out: Path) -> bool:
    """A training stage has started in `out`: its models (and a recipe sweep's) depend on the settings and corpus."""
    return (out / "teacher").exists() or (out / "distill").exists()


def _listing(folder: Path) -> str:
    names = sorted(p.name for p in folder.iterdir())
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def check_out(out: Path, record: dict) -> list[str]:
    """One --out per settings: a run of other settings would mix models; refused once a training stage has started
    (naming the changed keys). Before that only the corpus depends on them, rebuilt in seconds: the changes are
    returned, to be taken. A folder without a demo run is not taken over: the user's files could be overwritten."""
    path = out / SETTINGS_FILE
    if path.is_file():
        changed = _changes(json.loads(path.read_text()), record)
        if changed and trained(out):
            raise ValueError(f"{out} holds a demo run with other settings ({'; '.join(changed)}; see {path}): "
                             f"choose another --out, or delete it")
        return changed
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"--out {out} holds other files ({_listing(out)}) and no demo run: choose an empty or new "
                         f"--out")
    return []


def record_settings(out: Path, record: dict, changed: list[str]) -> None:
    """Make `out` and write its demo_settings.json; changed: `check_out`'s."""
    make_folder(out, "--out")
    if changed:
        _say(f"nothing trained in {out} yet: this call's settings replace its earlier ({'; '.join(changed)})")
    write_text_atomic(out / SETTINGS_FILE, json.dumps(record, indent=2) + "\n")


def _demo_results(folder: Path) -> bool:
    """`folder` holds only the demo's result files, an earlier demo's results.json among them."""
    try:
        earlier = json.loads((folder / "results.json").read_text())
    except (OSError, ValueError):
        return False
    ours = {name.replace("/", "_") for name in RESULT_FILES}
    return ({p.name for p in folder.iterdir()} <= ours and isinstance(earlier, dict)
            and {"settings", "rows", "checks"} <= earlier.keys())


def check_results(results: Path) -> None:
    """--results gets the demo's files: written into a new or empty folder, or over an earlier demo's results, never
    over other files (a results.md of the user's)."""
    if results.is_dir() and any(results.iterdir()) and not _demo_results(results):
        raise ValueError(f"--results {results} holds other files ({_listing(results)}): choose an empty or new "
                         f"--results, or one holding an earlier demo's results")


def make_folder(folder: Path, flag: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # what check_output_folder cannot see: /proc, a read-only filesystem, another's mount
        raise ValueError(f"{flag} {folder} cannot be made ({e.strerror}): choose another {flag}") from None


def build_data(out: Path, settings: DemoSettings, replace: bool = False):
    """The corpus and tokenizer in out/corpus; replace: one built differently is rebuilt (nothing trained on it)."""
    from swiftkv_jax.data.stdlib_corpus import build_corpus, train_corpus_tokenizer

    try:
        meta = build_corpus(out / "corpus", max_files=settings.max_files, overwrite=replace)
        tokenizer = train_corpus_tokenizer(out / "corpus", vocab_size=settings.vocab_size,
                                           out_dir=out / "corpus" / "tokenizer", overwrite=replace)
    except FileExistsError as e:  # its advice, overwrite=True (--overwrite), is no flag of demo.py's
        raise ValueError(f"{str(e).partition(': pass overwrite')[0]}, and models in {out} were trained on it: "
                         f"choose another --out, or delete {out} to start over") from None
    _say(f"corpus: {meta['python']['implementation']} {meta['python']['version'].split()[0]} stdlib, "
         f"{meta['splits']['train']['files']} train / {meta['splits']['validation']['files']} validation files; "
         f"tokenizer vocab {len(tokenizer)}")
    return meta, tokenizer


def teacher_init(out: Path, settings: DemoSettings, tokenizer) -> Path:
    """config.json (+ the tokenizer) of the teacher to pretrain: no weights, so the trainer starts at random."""
    import swiftkv_jax as sk
    from swiftkv_jax.checkpoints.hf_config import config_to_hf
    from swiftkv_jax.checkpoints.sidecar import read_sidecar_files

    path = out / "teacher_init"
    path.mkdir(parents=True, exist_ok=True)
    config = sk.ModelConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id,
                            initializer_range=0.02, tie_word_embeddings=True, max_position_embeddings=4096,
                            **settings.architecture)
    (path / "config.json").write_text(json.dumps(config_to_hf(config), indent=2) + "\n")
    for name, data in read_sidecar_files(out / "corpus" / "tokenizer").items():
        (path / name).write_bytes(data)
    return path


class Stopped(RuntimeError):
    """A training stage was stopped by a signal (its checkpoint saved); `status` is train()'s exit status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


TRAIN_SECONDS = "demo_train_seconds.json"  # beside a training stage's export: how long it took, over all its calls
STOPPED_SECONDS = "demo_train_seconds_stopped.json"  # a stage a signal stopped: its seconds up to its checkpoint


def _seconds(path: Path) -> float:
    return json.loads(path.read_text())["seconds"] if path.is_file() else 0.0


def _train(recipe: str, overrides: list[str], export: Path) -> None:
    """Run a recipe unless it finished; continue it from its checkpoints if it was interrupted. Its seconds,
    those of the calls a signal stopped included (they end in a checkpoint, so no work is lost), go beside it."""
    from swiftkv_jax import configuration
    from swiftkv_jax.distill import trainer
    from swiftkv_jax.distill.config import TrainConfig

    run_dir = export.parent
    resume = ["train.resume=true"] if (run_dir / trainer.CHECKPOINT_DIR).is_dir() else []
    config = configuration.load(TrainConfig, CONFIGS / recipe, overrides + resume)
    if export.is_dir():
        # kept only if trained as asked: a sweep row run again under its name with other steps or overrides, or a
        # recipe edited since, would otherwise be reported under settings it was not trained with
        changed = _changed_settings(run_dir / trainer.CONFIG_FILE, config)
        if changed:
            raise ValueError(f"{export} was trained with other settings ({'; '.join(changed)}): delete {run_dir} "
                             f"to train it again, or choose another folder")
        # finished once its seconds are written, after its last export and plot; an export without them beside its
        # checkpoints is a run cut short between its exports (HF, then Orbax): resumed, it only exports again
        if (run_dir / TRAIN_SECONDS).is_file() or not (run_dir / trainer.CHECKPOINT_DIR).is_dir():
            _say(f"{export} exists: skipped")
            return
    start = time.perf_counter()
    status = trainer.train(config)
    seconds = time.perf_counter() - start
    before = _seconds(run_dir / STOPPED_SECONDS)  # earlier calls' part of this stage
    if status:  # a signal stopped it, its checkpoint saved: the later stages need its export
        write_text_atomic(run_dir / STOPPED_SECONDS, json.dumps({"seconds": round(before + seconds, 1)}) + "\n")
        raise Stopped(status, f"{recipe} stopped in {run_dir} (status {status}), its checkpoint saved: run the same "
                              f"command again to continue from it")
    write_text_atomic(run_dir / TRAIN_SECONDS, json.dumps({"seconds": round(before + seconds, 1),
                                                           "this_call_seconds": round(seconds, 1)}) + "\n")
    _say(f"{recipe} -> {export} in {seconds:.0f} s" + (f" ({before + seconds:.0f} s with earlier calls)"
                                                        if before else ""))


# keys that say where a run's files are or how it computes, not what it trains: a moved --out stays usable
_WHERE_NOT_WHAT = ("train.resume", "train.output_dir", "model.teacher", "data.sources")


def _changed_settings(saved: Path, config) -> list[str]:
    """`key: saved -> now` for each setting of `config` that differs from the run saved at `saved` (its config.yaml),
    over the keys both have (a key added to the code since is not a change)."""
    import yaml

    from swiftkv_jax.configuration import to_dict
    from swiftkv_jax.distill.trainer import RESUME_FREE, setting_changes

    if not saved.is_file():
        return []
    now = yaml.safe_load(yaml.safe_dump(to_dict(config)))  # as config.yaml holds it (tuples as lists)
    return setting_changes("", yaml.safe_load(saved.read_text()), now, free=RESUME_FREE + _WHERE_NOT_WHAT,
                           common_only=True)


def earlier_training_seconds(out: Path, layers: int) -> float:
    """Seconds of the demo's training stages (the teacher's and its distilled students', not a recipe sweep's rows
    beside them) that earlier calls spent: a finished stage's whole time, a stopped one's up to its checkpoint.
    (Not to be added to earlier evaluation seconds: on the gpu budget models were scored beside the training.)"""
    runs = [out / "teacher", *(out / "distill" / v.name for v in variants(layers) if v.distilled)]
    return sum(_seconds(r / TRAIN_SECONDS) if (r / TRAIN_SECONDS).is_file() else _seconds(r / STOPPED_SECONDS)
               for r in runs)


CALLS = "demo_calls.json"  # in --out: each earlier call's seconds up to the last thing it saved


class _Calls:
    """This call's entry in CALLS, rewritten whenever it saves something new (a training stage's export or a stopped
    one's checkpoint, an evaluated row): the time a later call adds as its earlier calls'. Wall time: the models
    scored beside a distillation, or on several threads, count once (summing their seconds counted them again). A
    call that saved nothing new (a rerun that only reads back) adds nothing; a call killed outright, its time up to
    its last save."""

    def __init__(self, out: Path, start: float):
        self.path, self.start, self.lock = out / CALLS, start, threading.Lock()
        self.earlier = json.loads(self.path.read_text())["calls"] if self.path.is_file() else []

    def saved(self) -> None:
        with self.lock:
            write_text_atomic(self.path, json.dumps(
                {"calls": self.earlier + [round(time.perf_counter() - self.start, 1)]}) + "\n")


def common_overrides(out: Path, settings: DemoSettings, steps: int, run_dir: Path,
                     rows: Optional[int] = None) -> list[str]:
    """The corpus, lengths and run folder of a training stage; `rows` a step (None: the pretraining's)."""
    corpus = json.dumps(str(out / "corpus" / "train.parquet"))  # quoted: a path may hold ',' or ' #'
    return [f"data.sources=[{{path: {corpus}, format: text}}]",
            f"data.seq_len={settings.seq_len}", f"data.cache_dir={out / 'cache'}",
            f"train.global_batch_size={rows or settings.batch_size}", f"train.max_steps={steps}",
            f"train.output_dir={run_dir}"]


def pretrain(out: Path, settings: DemoSettings, init_dir: Path) -> Path:
    run_dir = out / "teacher"
    _train("stdlib-teacher.yaml", [f"model.teacher={init_dir}"]
           + common_overrides(out, settings, settings.pretrain_steps, run_dir) + list(settings.pretrain_overrides),
           run_dir / "model_hf")
    return run_dir / "model_hf"


def student_export(out: Path, variant: Variant) -> Path:
    """Where `distill` exports the student of `variant` (Hugging Face format)."""
    return out / "distill" / variant.name / "student_hf"


def distill(out: Path, settings: DemoSettings, teacher_dir: Path, variant: Variant) -> Path:
    export = student_export(out, variant)
    _train("stdlib-swiftkv.yaml", [f"model.teacher={teacher_dir}", f"model.num_key_value_layers={variant.l}",
                                   f"model.key_value_group_size={variant.g}"]
           + common_overrides(out, settings, settings.distill_steps, export.parent, settings.distill_rows)
           + list(settings.distill_overrides),
           export)
    return export


def held_out(out: Path, settings: DemoSettings, tokenizer):
    """(packed validation batches, agreement prompts): the same for every model."""
    import datasets
    import numpy as np

    from swiftkv_jax.data import build_dataset
    from swiftkv_jax.data.config import DataConfig, DataSource

    val = out / "corpus" / "validation.parquet"
    packed = build_dataset(DataConfig(sources=(DataSource(str(val), format="text"),), seq_len=settings.seq_len,
                                      cache_dir=str(out / "cache")), tokenizer)
    rows = packed[: settings.val_rows]
    batches = [{k: rows[k][i: i + 8] for k in ("tokens", "positions", "segment_ids", "loss_mask")}
               for i in range(0, len(rows["tokens"]), 8)]
    texts = datasets.load_dataset("parquet", data_files=str(val), split="train",
                                  cache_dir=str(out / "cache"))["text"]
    prompts = []
    rng = np.random.default_rng(0)
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        if len(ids) > settings.prompt_tokens + settings.new_tokens:
            start = int(rng.integers(0, len(ids) - settings.prompt_tokens - settings.new_tokens))
            prompts.append(ids[start: start + settings.prompt_tokens])
        if len(prompts) == settings.prompts:
            break
    return batches, prompts


EVAL_ROWS = "evaluation_rows.json"  # in --out: each model's row as soon as it is evaluated
SPEED = ("prefill_time_vs_teacher", "kv_bytes_vs_teacher")  # a row's fields that depend on its (l, g) only


def _fingerprint(checkpoint: Path) -> list:
    """What identifies a checkpoint on disk: its files' names, sizes and modification times."""
    return sorted([f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in checkpoint.iterdir() if f.is_file())


class Evaluation:
    """The demo's rows, one per model: held-out scores, agreement, and prefill time / KV bytes relative to the teacher,
    scored while the later students are still distilling (`settings.evaluate_while_distilling`).

    models: name -> (load() -> Model, its Variant or None for the teacher, the checkpoints its row depends on: the
    teacher's, and a student's own), in the table's order. done: a JSON file of the rows evaluated so far, each with
    its checkpoints' fingerprints, rewritten as each row is complete: a row whose checkpoints are unchanged is read
    back instead of evaluated again (`evaluated_earlier`), so a demo that a time limit stopped continues there.

    1. `time_prefills()`: each (l, g)'s prefill comparison (the two rows of an (l, g) share it), timed one at a time
       with nothing else on the device, on the teacher's undistilled SwiftKV wiring: the program a student of that
       (l, g) runs, and a time does not depend on the weights, so no student need exist yet.
    2. `start(name)` once a model's checkpoints exist: its quality scores run on `settings.eval_workers` threads,
       the teacher's before any other's (every row runs the teacher's programs), the rows of one (l, g), which share
       their programs, one after the other. One model compiles (most of the evaluation's time on a GPU) while
       another runs, and while the next student distils. Their `eval_seconds` are wall times under that sharing.
    3. `also(fn, ...)`: other work on the same threads (the teacher's layer analysis).
       With `evaluate_while_distilling` off (the CPU budgets: 2 cores have nothing to spare) what 2 and 3 start
       waits until `rows()`.
    4. `rows()`: every row, once all are scored. Leaving the `with` block on an error cancels what has not started.
    """

    def __init__(self, teacher, models: dict, batches, prompts, settings: DemoSettings, done: Optional[Path] = None,
                 saved=lambda: None):
        self.teacher, self.models, self.settings, self.done, self.saved = teacher, models, settings, done, saved
        self.batches, self.prompts = batches, prompts
        self.earlier = json.loads(done.read_text()) if done is not None and done.is_file() else {}
        self.results, self.bench_seconds, self.speed = {}, {}, {}  # name -> row; name -> s; (l, g) -> SPEED
        self.lock, self.teacher_scored = threading.Lock(), threading.Event()
        self.group_locks = collections.defaultdict(threading.Lock)  # (l, g) -> held while one of its rows is scored
        self.pool = concurrent.futures.ThreadPoolExecutor(settings.eval_workers)
        self.futures, self.held = [], []

    def __enter__(self) -> "Evaluation":
        return self

    def __exit__(self, kind, *_) -> None:
        self.pool.shutdown(wait=kind is None, cancel_futures=kind is not None)

    def _reusable(self, name: str) -> Optional[dict]:
        """The row an earlier call wrote for `name` if its checkpoints are those on disk now (and it has every field
        this code writes), else None."""
        entry, checkpoints = self.earlier.get(name, {}), self.models[name][2]
        if not all(c.is_dir() for c in checkpoints) or not ROW_FIELDS <= set(entry.get("row", {})):
            return None
        fingerprints = [_fingerprint(c) for c in checkpoints]
        return dict(entry["row"], evaluated_earlier=True) if entry.get("checkpoints") == fingerprints else None

    def time_prefills(self) -> None:
        import swiftkv_jax as sk

        groups = {}  # (l, g) -> its rows' names, in order
        for name, (_, variant, _) in self.models.items():
            if variant is not None:
                groups.setdefault((variant.l, variant.g), []).append(name)
        for (l, g), names in groups.items():
            reused = next((row for row in map(self._reusable, names) if row is not None), None)
            if reused is not None:  # the same (l, g) and teacher: the comparison an earlier call timed
                self.speed[(l, g)] = {k: reused[k] for k in SPEED}
                continue
            start = time.perf_counter()
            self.speed[(l, g)] = prefill_speed(sk.to_swiftkv(self.teacher, l, g), self.settings)
            self.bench_seconds[names[0]] = round(time.perf_counter() - start, 1)

    def start(self, name: str) -> None:
        row = self._reusable(name)
        if row is not None:
            self._record(name, row, written=True)
            if self.models[name][1] is None:
                self.teacher_scored.set()
        else:
            self.also(self._score, name)

    def also(self, fn, *args, **kwargs) -> None:
        if self.settings.evaluate_while_distilling:
            self.futures.append(self.pool.submit(fn, *args, **kwargs))
        else:
            self.held.append(functools.partial(fn, *args, **kwargs))

    def rows(self) -> list[dict]:
        self.futures += [self.pool.submit(fn) for fn in self.held]
        self.held = []
        for future in self.futures:
            future.result()  # a worker's exception, raised here
        return [{"model": name, **self.results[name]} for name in self.models]

    def _score(self, name: str) -> None:
        load, variant, _ = self.models[name]
        if variant is None:
            try:
                self._record(name, self._quality(load(), None))
            finally:  # the students' rows wait for it; on an error they run (and rows() raises it)
                self.teacher_scored.set()
            return
        self.teacher_scored.wait()
        with self.group_locks[(variant.l, variant.g)]:
            self._record(name, self._quality(load(), variant))

    def _quality(self, model, variant: Optional[Variant]) -> dict:
        row = quality_row(self.teacher, model, variant, self.batches, self.prompts, self.settings)
        row.update(dict(prefill_time_vs_teacher=1.0, kv_bytes_vs_teacher=1.0) if variant is None
                   else self.speed[(variant.l, variant.g)])
        return row

    def _record(self, name: str, row: dict, written: bool = False) -> None:
        if name in self.bench_seconds and not written:
            row["eval_seconds"]["prefill_bench"] = self.bench_seconds[name]
        with self.lock:
            self.results[name] = row
            if self.done is not None and not written:
                self.earlier[name] = {"checkpoints": [_fingerprint(c) for c in self.models[name][2]], "row": row}
                write_text_atomic(self.done, json.dumps(self.earlier, indent=1) + "\n")
                self.saved()
            _say_evaluated(name, row)


def _say_evaluated(name: str, row: dict) -> None:
    _say(f"evaluated {name}{' in an earlier call' if row.get('evaluated_earlier') else ''}: val loss "
         f"{row['val_loss']:.4f}, KL {row['kl_to_teacher']:.4f} "
         f"({', '.join(f'{k} {v:.0f} s' for k, v in row['eval_seconds'].items())})")


def quality_row(teacher, model, variant: Optional[Variant], batches, prompts, settings: DemoSettings) -> dict:
    """`Evaluation`'s row of one model without its SPEED: held-out scores and greedy agreement, and the seconds of
    each (`eval_seconds`: where the evaluation's time goes, compiling on a GPU)."""
    from swiftkv_jax.evaluation.quality import greedy_agreement, held_out_scores

    row = {"layers_skipped": 0.0 if variant is None else variant.fraction(teacher.config.num_hidden_layers),
           "l": None if variant is None else variant.l, "g": None if variant is None else variant.g,
           "distilled": None if variant is None else variant.distilled, "evaluated_earlier": False}
    seconds = row["eval_seconds"] = {}

    def part(what, fn, *args, **kwargs):
        start = time.perf_counter()
        row.update(fn(*args, **kwargs))
        seconds[what] = round(time.perf_counter() - start, 1)

    part("held_out", held_out_scores, teacher, model, batches)
    part("greedy", greedy_agreement, teacher, model, prompts, settings.new_tokens)
    return row


def prefill_speed(model, settings: DemoSettings) -> dict:
    """SPEED of a SwiftKV model: its prefill time and KV bytes over its teacher wiring's (the same weights), timed
    side by side in one bench call, the prefill only (gen_len 0: no decode loop compiled)."""
    from swiftkv_jax.serving import bench

    ratios = bench.bench(model, prompt_len=settings.prefill_len, gen_len=0, batch=1, repeats=5,
                         cache_dtype="float32")[0]["vs_teacher"]
    return dict(zip(SPEED, (ratios["ttft"], ratios["kv_bytes"])))


TABLE_ROWS = ("teacher", "swiftkv-50-undistilled", "swiftkv-50", "swiftkv-50-acrosskv2")
LABELS = {"teacher": "teacher", "swiftkv-50-acrosskv2": "SwiftKV 50% + 2-way AcrossKV, distilled",
          **{f"swiftkv-{p}{suffix}": f"SwiftKV {p}%, {state}" for p in (25, 50, 75)
             for suffix, state in (("", "distilled"), ("-undistilled", "not distilled"))}}
COLUMNS = (("val_loss", "val loss (nats/token)", "{:.4f}"), ("accuracy", "next-token acc", "{:.4f}"),
           ("kl_to_teacher", "KL to teacher", "{:.4f}"),
           ("greedy_agreement", "greedy agreement ({new_tokens})", "{:.3f}"),
           ("prefill_time_vs_teacher", "prefill time @{prefill_len} vs teacher", "{:.3f}"),
           ("kv_bytes_vs_teacher", "KV bytes vs teacher", "{:.3f}"))
ROW_FIELDS = {"eval_seconds", *SPEED, *(key for key, _, _ in COLUMNS)}  # what a reused row must have


def markdown_table(rows: list[dict], settings: DemoSettings, names=TABLE_ROWS) -> str:
    by_name = {r["model"]: r for r in rows}
    headers = [c[1].format(new_tokens=settings.new_tokens, prefill_len=settings.prefill_len) for c in COLUMNS]
    lines = ["| model | " + " | ".join(headers) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for name in names:
        r = by_name[name]
        lines.append(f"| {LABELS.get(name, name)} | " + " | ".join(fmt.format(r[k]) for k, _, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def shape_checks(rows: list[dict], target: Optional[float] = None) -> dict:
    """The paper's shape: distillation closes most of the gap to the teacher at 50%, and quality falls faster
    beyond 50% skipped than before it (validation loss gaps to the teacher); target: the share of the gap to close
    (the gpu budget's GAP_CLOSED_TARGET), judged as gap_closed_pass."""
    loss = {r["model"]: r["val_loss"] for r in rows}
    gap = lambda name: loss[name] - loss["teacher"]
    closed = (1 - gap("swiftkv-50") / gap("swiftkv-50-undistilled") if gap("swiftkv-50-undistilled") > 0
              else float("nan"))
    steeper = (gap("swiftkv-75") - gap("swiftkv-50")) - (gap("swiftkv-50") - gap("swiftkv-25"))
    checks = {"gap_closed_by_distillation_at_50": float(closed), "distilled_better_than_undistilled":
              bool(loss["swiftkv-50"] < loss["swiftkv-50-undistilled"]),
              "quality_falls_faster_beyond_50": bool(steeper > 0), "second_difference_of_gap": float(steeper)}
    if target is not None:
        checks.update(gap_closed_target=target, gap_closed_pass=bool(closed >= target))  # nan: not passed
    return checks


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    teacher = next(r for r in rows if r["model"] == "teacher")
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for distilled, style in ((True, "o-"), (False, "s--")):
        pts = sorted((r["layers_skipped"], r["val_loss"]) for r in rows if r["distilled"] is distilled and r["g"] == 1)
        ax.plot(*zip(*pts), style, label="SwiftKV, distilled" if distilled else "SwiftKV, not distilled")
    across = next(r for r in rows if r["model"] == "swiftkv-50-acrosskv2")
    ax.plot([across["layers_skipped"]], [across["val_loss"]], "^", label="+ 2-way AcrossKV, distilled")
    ax.axhline(teacher["val_loss"], color="gray", linestyle=":", label="teacher")
    ax.set_xlabel("fraction of layers skipped in prefill, (L - l) / L")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("quality vs layers skipped, equal distillation budget", fontsize=10)
    ax.set_xticks(list(FRACTIONS))
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# results.json first: a copy into --results cut short is still an earlier demo's results (`check_results`)
RESULT_FILES = ("results.json", "results.md", "quality_vs_layers_skipped.png", "analysis/similarity.png",
                "teacher/loss.png")
GAP_CLOSED_TARGET = 0.9  # issue 24, gpu budget: the distilled 50% student closes >= 90% of the undistilled one's gap


def run(out: Path, name: str = "full", results: Optional[Path] = None, attention: Optional[str] = None) -> dict:
    """The whole pipeline with SETTINGS[name] ("full", "quick", "gpu" or "smoke"), in `out`; `results`: a folder
    that receives RESULT_FILES (flat, "/" as "_"), e.g. benchmarks/results/gpu-DATE/demo; attention: the training's
    attention_impl instead of the budget's (`with_attention`)."""
    import jax

    import swiftkv_jax as sk

    from swiftkv_jax.configuration import ConfigError
    from swiftkv_jax.evaluation.analyze import analyze
    from swiftkv_jax.evaluation.report import check_output_folder

    settings = SETTINGS[name] if attention is None else with_attention(SETTINGS[name], attention)
    # all before anything is written; results are copied at the very end: checked (and made) now
    for what, folder in (("out", out), ("results", results)):
        if folder is not None:
            check_output_folder(folder, what)
    check_device(name)
    try:
        check_training(out, settings)
    except ConfigError as e:
        if attention is None:
            raise
        raise ConfigError(f"--attention {attention}: {e}") from None
    record = settings_record(name, settings)
    changed = check_out(out, record)
    if results is not None:
        check_results(results)
        make_folder(results, "--results")
    record_settings(out, record, changed)
    fresh = not trained(out)
    earlier = earlier_training_seconds(out, settings.architecture["num_hidden_layers"])
    start = time.perf_counter()
    calls, stages = _Calls(out, start), {}

    def lap(stage: str) -> None:
        stages[stage] = round(time.perf_counter() - start - sum(stages.values()), 1)

    def train(export: Path, fn, *args) -> Path:  # a stage trained (or stopped at its checkpoint) in this call
        new = not export.is_dir()
        try:
            fn(*args)
        except Stopped:
            calls.saved()
            raise
        if new:
            calls.saved()
        return export

    _, tokenizer = build_data(out, settings, replace=fresh)
    lap("data")
    teacher_dir = train(out / "teacher" / "model_hf", pretrain, out, settings, teacher_init(out, settings, tokenizer))
    lap("pretrain")
    teacher = sk.load(teacher_dir)
    layers = teacher.config.num_hidden_layers
    models = {"teacher": (lambda: teacher, None, [teacher_dir])}  # each loaded when it is scored
    for v in variants(layers):
        student = student_export(out, v)
        models[v.name] = ((functools.partial(sk.load, student), v, [teacher_dir, student]) if v.distilled
                          else (functools.partial(sk.to_swiftkv, teacher, v.l, v.g), v, [teacher_dir]))
    batches, prompts = held_out(out, settings, tokenizer)
    with Evaluation(teacher, models, batches, prompts, settings, done=out / EVAL_ROWS,
                    saved=calls.saved) as evaluation:
        evaluation.time_prefills()
        lap("prefill_bench")
        evaluation.start("teacher")
        evaluation.also(analyze, str(teacher_dir), str(out / "corpus" / "validation.parquet"),
                        max_tokens=4 * settings.seq_len * 8, max_length=settings.seq_len, out_dir=str(out / "analysis"))
        for v in variants(layers):
            if not v.distilled:
                evaluation.start(v.name)
        # the AcrossKV student first: it has no undistilled twin whose scores compile its programs
        for v in sorted((v for v in variants(layers) if v.distilled), key=lambda v: v.g == 1):
            train(student_export(out, v), distill, out, settings, teacher_dir, v)
            evaluation.start(v.name)
        lap("distill")
        rows = evaluation.rows()
    lap("evaluate")
    # rows read back from an earlier call: the seconds their scoring took there (wall times of rows scored at once,
    # beside training on the gpu budget: overlapping, so not added to a total; CALLS' entries are)
    earlier_eval = sum(sum(r["eval_seconds"].values()) for r in rows if r["evaluated_earlier"])
    checks = shape_checks(rows, GAP_CLOSED_TARGET if name == "gpu" else None)
    table = markdown_table(rows, settings)
    every = markdown_table(rows, settings, sorted((r["model"] for r in rows), key=lambda n: (n != "teacher", n)))
    (out / "results.md").write_text(f"{table}\n\nAll models:\n\n{every}\n")
    device = jax.devices()[0]
    seconds = time.perf_counter() - start
    earlier_calls = round(sum(calls.earlier), 1)
    result = {"settings": name, "rows": rows, "checks": checks, "seconds": seconds,
              "seconds_with_earlier_calls": seconds + earlier_calls, "earlier_calls_seconds": earlier_calls,
              "earlier_training_seconds": earlier, "earlier_evaluation_seconds": earlier_eval,
              "stage_seconds": stages, "device": f"{device.device_kind} ({device.platform})",
              "estimate": gpu_seconds(settings) if name == "gpu" else None}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, out / "quality_vs_layers_skipped.png")
    print(table)
    print(f"\ndistillation closes {checks['gap_closed_by_distillation_at_50']:.0%} of the 50% gap; quality falls "
          f"{'faster' if checks['quality_falls_faster_beyond_50'] else 'NOT faster'} beyond 50% skipped")
    if results is not None:
        try:
            check_results(results)  # again: files may have come since the start
        except ValueError as e:
            raise ValueError(f"{e} (this run's results are in {out})") from None
        for name_ in RESULT_FILES:
            shutil.copyfile(out / name_, results / name_.replace("/", "_"))
        _say(f"results copied to {results}")
    resumed = f"; {(seconds + earlier_calls) / 60:.1f} min with earlier calls" if earlier_calls else ""
    _say(f"done in {seconds / 60:.1f} min{resumed} ({', '.join(f'{k} {v:.0f} s' for k, v in stages.items())}): "
         f"{out / 'results.md'}, {out / 'results.json'}, {out / 'quality_vs_layers_skipped.png'}, "
         f"{out / 'analysis' / 'similarity.png'}")
    return result


def _folder(text: str) -> Path:
    if not text.strip():  # Path("") is ".": an empty --out fell back to the default, --results wrote into the cwd
        raise argparse.ArgumentTypeError("an empty path: give a folder")
    return Path(text)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python demo.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller corpus, model and budget (about 5 minutes); "
                                                              "the same as --budget quick")
    parser.add_argument("--budget", choices=("full", "quick", "gpu"), default=None,
                        help="full (CPU, ~37 minutes), quick (CPU, ~5 minutes) or gpu (one GPU, bf16, a 247M teacher, "
                             "under 10 minutes)")
    parser.add_argument("--out", type=_folder, default=None,
                        help="working folder, new or empty or an earlier demo's (default artifacts/demo, "
                             "artifacts/demo-quick or artifacts/demo-gpu)")
    parser.add_argument("--results", type=_folder, default=None,
                        help="also copy the table, results JSON and plots into this folder (flat; new or empty or "
                             "an earlier demo's results)")
    parser.add_argument("--attention", default=None,
                        help="the training's model.attention_impl (auto, xla, xla_chunked, or cudnn on a GPU with "
                             "bf16 compute) instead of the budget's (xla; auto on a GPU)")
    return parser


def main(argv=None) -> int:
    parser_ = parser()
    args = parser_.parse_args(argv)
    if args.quick and args.budget not in (None, "quick"):
        parser_.error(f"--quick and --budget {args.budget} disagree: give one")
    budget = "quick" if args.quick else args.budget or "full"
    out = args.out or Path({"full": "artifacts/demo", "quick": "artifacts/demo-quick",
                            "gpu": "artifacts/demo-gpu"}[budget])
    from swiftkv_jax.configuration import ConfigError
    from swiftkv_jax.evaluation.report import check_output_folder

    try:  # before the corpus and minutes of training: the results go there at the very end
        check_output_folder(out, "--out")
        if args.results is not None:
            check_output_folder(args.results, "--results")
    except ValueError as e:
        parser_.error(str(e))

    if budget == "gpu":
        e = gpu_seconds(SETTINGS["gpu"])
        _say(f"gpu budget: a {e['parameters'] / 1e6:.0f}M-parameter teacher on {e['pretrain_tokens'] / 1e6:.0f}M "
             f"tokens; matmul work {e['pretrain_s']:.0f} s pretraining + {e['distill_s']:.0f} s distilling at an "
             f"assumed {e['assumed_mfu']:.0%} of {e['peak_flops'] / 1e12:.0f} TFLOP/s (compiling and evaluation on "
             "top)")
    try:
        run(out, budget, args.results, args.attention)
    except (ValueError, ConfigError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        _say(str(e))
        return e.status
    return 0


if __name__ == "__main__":
    sys.exit(main())
