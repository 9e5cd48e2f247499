"""The training run: build the student (or, for stage pretrain, the model), stream packed batches, step,
checkpoint, export.

`train(config)` is what `python train.py --config …` runs; `dry_run(config)` sizes the run per device
without loading a weight.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import signal
import time
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import yaml
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from swiftkv_jax import checkpoints, distributed, sharding
from swiftkv_jax.checkpoints.atomic import write_text_atomic
from swiftkv_jax.checkpoints.hf import read_config
from swiftkv_jax.checkpoints.hf_config import config_from_hf
from swiftkv_jax.checkpoints.orbax import unreadable_orbax
from swiftkv_jax.checkpoints.sidecar import read_sidecar_files
from swiftkv_jax.configuration import ConfigError, to_dict
from swiftkv_jax.distill import step as step_lib
from swiftkv_jax.distill import student as student_lib
from swiftkv_jax.distill.config import TrainConfig
from swiftkv_jax.distill.metrics import METRICS_FILE, PLOT_FILE, MetricsLog, plot_losses, read_metrics
from swiftkv_jax.distill.trainable import merge
from swiftkv_jax.model.config import ModelConfig
from swiftkv_jax.model.model import Model, param_shardings

CHECKPOINT_DIR = "checkpoints"
CONFIG_FILE = "config.yaml"
TEACHER_CONFIG_FILE = "teacher_config.json"  # model.teacher's config.json as the run started: checked on resume
EXPORT_DIRS = {"distill": {"hf": "student_hf", "orbax": "student_orbax"},
               "pretrain": {"hf": "model_hf", "orbax": "model_orbax"}}
MAX_STEPS = 2**31 - 1  # the optimizer's step count is an int32
STOPPED_BY_SIGNAL = 128  # train()'s exit status when a signal stopped it: this plus the signal's number
# Settings a resumed run must share with the run it continues (the rest, e.g. max_steps, may change).
RESUME_INVARIANTS = ("stage", "model", "data", "loss", "optim", "train.global_batch_size", "train.seed", "train.epochs")
# ...but for these, which change how the same model and data are computed, not what (remat after running out of
# memory, another attention backend or machine, more tokenising workers)
RESUME_FREE = ("model.remat", "model.attention_impl", "data.num_proc", "data.cache_dir")
RESTORE_FIX = ("it was saved for another model (did the checkpoint at model.teacher change?): resume with the run's "
               "teacher, or start a new run in another train.output_dir; or it is damaged: move that step's directory "
               "away to resume from an earlier step")


class TrainingStopped(RuntimeError):
    """The run stopped before its last step (non-finite loss)."""


def make_mesh(config: TrainConfig) -> Mesh:
    m = config.mesh
    try:
        mesh = sharding.make_mesh(m.data, m.fsdp, m.tensor)
    except ValueError as e:
        raise ConfigError(f"mesh: {e}: set mesh.data, mesh.fsdp and mesh.tensor so that their product is the "
                          f"{jax.device_count()} device(s) (one of them -1: the rest)") from None
    axes = step_lib.batch_sharding(mesh, sharding.LOGICAL_AXIS_RULES).spec[0]
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    shards, batch = math.prod(mesh.shape[a] for a in axes), config.train.global_batch_size
    if batch % shards:  # each device of the batch's axes holds as many rows
        raise ConfigError(f"train.global_batch_size={batch} does not split evenly over the {shards} devices that "
                          f"share the batch (mesh {dict(mesh.shape)}, batch over {' x '.join(axes)}): use a "
                          f"multiple of {shards}, such as {max(shards, batch - batch % shards)} or "
                          f"{batch - batch % shards + shards}")
    # the weights' sharded dimensions against the mesh, from config.json alone: before tokenising, not at loading
    model_config = (student_lib.pretrain_config if config.stage == "pretrain" else student_lib.student_config
                    )(config.model)
    try:
        param_shardings(model_config, mesh)
    except ValueError as e:
        raise ConfigError(f"mesh {dict(mesh.shape)} does not fit model.teacher's shapes ({e}): give mesh.fsdp and "
                          f"mesh.tensor sizes that divide them (mesh.tensor at most num_key_value_heads="
                          f"{model_config.num_key_value_heads}, and a divisor of it), and mesh.data the rest of the "
                          f"devices") from None
    return mesh


@dataclasses.dataclass
class CompiledStep:
    """The jitted step, its optimizer, and the shardings of its state (for init and restore)."""

    fn: object
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    state_shardings: step_lib.TrainState
    batch_sharding: NamedSharding

    def abstract_state(self, trainable) -> step_lib.TrainState:
        """ShapeDtypeStructs with shardings of the whole TrainState for `trainable`."""
        shapes = jax.eval_shape(lambda t: step_lib.TrainState(jnp.zeros((), jnp.int32), t, self.optimizer.init(t)),
                                trainable)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                            self.state_shardings)

    def init_state(self, trainable) -> step_lib.TrainState:
        return jax.jit(lambda t: step_lib.TrainState(jnp.zeros((), jnp.int32), t, self.optimizer.init(t)),
                       out_shardings=self.state_shardings)(trainable)

    def abstract_batch(self, config: TrainConfig) -> dict:
        shape = (config.train.global_batch_size, config.data.seq_len)
        return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding) for k in step_lib.BATCH_KEYS}


def build_step(config: TrainConfig, model_config: ModelConfig, mesh: Mesh, trainable, frozen_shardings,
               total_steps: int, rules=sharding.LOGICAL_AXIS_RULES) -> CompiledStep:
    """`train_step` jitted with explicit shardings and the state donated."""
    optimizer = step_lib.make_optimizer(config.optim, total_steps)
    schedule = step_lib.learning_rate_schedule(config.optim, total_steps)
    replicated = NamedSharding(mesh, PartitionSpec())
    trainable_shardings = jax.tree.map(lambda a: a.sharding, trainable)
    opt_shapes = jax.eval_shape(optimizer.init, trainable)
    opt_shardings = optax.tree_map_params(optimizer, lambda _, s: s, opt_shapes, trainable_shardings,
                                          transform_non_params=lambda _: replicated)
    state_shardings = step_lib.TrainState(replicated, trainable_shardings, opt_shardings)
    batch_sharding = step_lib.batch_sharding(mesh, rules)
    batch_shardings = {k: batch_sharding for k in step_lib.BATCH_KEYS}
    step = functools.partial(step_lib.train_step, config=model_config, loss=config.loss, optimizer=optimizer,
                             schedule=schedule, grad_accum=config.train.grad_accum, batch_sharding=batch_sharding,
                             stage_name=config.stage)

    def sharded_step(*args):
        with sharding.activation_sharding(mesh, rules):
            return step(*args)

    fn = jax.jit(
        sharded_step,
        in_shardings=(state_shardings, frozen_shardings, batch_shardings),
        out_shardings=(state_shardings, replicated),
        donate_argnums=(0,),
    )
    return CompiledStep(fn, optimizer, schedule, state_shardings, batch_sharding)


def tree_bytes_per_device(tree) -> int:
    """Bytes one device holds of a tree of (abstract) arrays with shardings."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def count(tree) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def _check_positions(config: TrainConfig, positions) -> None:
    """Rows no longer than the teacher's positions: past them RoPE gives it degenerate outputs to learn from."""
    if isinstance(positions, int) and config.data.seq_len > positions:
        raise ConfigError(f"data.seq_len={config.data.seq_len} is longer than the max_position_embeddings "
                          f"({positions}) of model.teacher={config.model.teacher} (its config.json): lower "
                          f"data.seq_len to at most {positions}")


def dry_run(config: TrainConfig, print_fn=print) -> dict:
    """Compile the step for the configured mesh from shapes alone and report per-device memory."""
    mesh = make_mesh(config)
    abstract = student_lib.abstract_pretrain if config.stage == "pretrain" else student_lib.abstract_student
    model_config, trainable, frozen = abstract(config.model, mesh)
    _check_positions(config, model_config.max_position_embeddings)
    compiled = build_step(config, model_config, mesh, trainable, jax.tree.map(lambda a: a.sharding, frozen), 1000)
    state = compiled.abstract_state(trainable)
    executable = compiled.fn.lower(state, frozen, compiled.abstract_batch(config)).compile()
    memory = executable.memory_analysis()
    report = {
        "devices": int(mesh.size),
        "mesh": dict(mesh.shape),
        "platform": jax.devices()[0].platform,
        "trainable_parameters": count(trainable),
        "frozen_parameters": count(frozen),
        "bytes_per_device": {
            "frozen_weights": tree_bytes_per_device(frozen),
            "trainable_weights": tree_bytes_per_device(trainable),
            "optimizer_state": tree_bytes_per_device(state.opt_state),
            "step_temporaries": int(getattr(memory, "temp_size_in_bytes", -1)) if memory else -1,
        },
    }
    per = report["bytes_per_device"]
    per["total"] = sum(v for v in per.values() if v > 0)
    gib = lambda b: f"{b / 2**30:9.2f} GiB"
    total_params = report["trainable_parameters"] + report["frozen_parameters"]
    print_fn(f"dry run ({config.stage}): {config.model.teacher} -> {_describe(model_config, config.stage)}; "
             f"mesh {report['mesh']} ({report['platform']})")
    print_fn(f"  trainable parameters {report['trainable_parameters']:,} of {total_params:,} "
             f"({report['trainable_parameters'] / total_params:.2%})")
    print_fn(f"  global batch {config.train.global_batch_size} x {config.data.seq_len} tokens over "
             f"{mesh.size} devices, grad_accum {config.train.grad_accum}; bytes per device:")
    for name, value in per.items():
        print_fn(f"  {name:<20}{gib(value)}")
    if report["platform"] == "cpu":
        print_fn("  (step temporaries are the CPU compiler's; a GPU compile of the same step differs)")
    return report


def _process_rows(batch_sharding: NamedSharding, shape) -> np.ndarray:
    """Rows of the global batch held by this process's devices (what it loads)."""
    rows = set()
    for index in batch_sharding.addressable_devices_indices_map(shape).values():
        rows.update(range(*index[0].indices(shape[0])))
    return np.array(sorted(rows))


class _StopRequest:
    """SIGTERM/SIGINT set a flag; the loop saves a checkpoint and exits at the next step boundary."""

    def __init__(self):
        self.signal = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signal is not None:  # a second signal: stop now
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum)

    def requested(self) -> int:
        """The number of the signal that asks this run to stop (0: none). Several processes: any one's, so that
        every process stops at the same step."""
        signum = int(self.signal or 0)
        if jax.process_count() > 1:
            signum = int(np.max(multihost_utils.process_allgather(np.int32(signum))))
        return signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def setting_changes(key: str, before, now, free=RESUME_FREE, common_only: bool = False) -> list[str]:
    """`key: old -> new` for every leaf under `key` ("" for the root) that differs (lists compared whole, e.g.
    data.sources), but for the keys in `free` (default: those a resume may change); common_only: over the keys both
    have (one added to the code since is no change)."""
    if key in free:
        return []
    if isinstance(before, dict) and isinstance(now, dict):
        names = [n for n in before if n in now] if common_only else dict.fromkeys([*before, *now])
        return [change for name in names
                for change in setting_changes(f"{key}.{name}" if key else name, before.get(name), now.get(name),
                                              free, common_only)]
    return [] if before == now else [f"{key}: {before!r} -> {now!r}"]


def _check_resumable(config: TrainConfig, saved_path: Path) -> None:
    if not saved_path.is_file():
        return
    saved, now = _read_run_file(saved_path, yaml.safe_load, "YAML"), to_dict(config)
    changed = []
    for key in RESUME_INVARIANTS:
        a, b = saved, now
        for part in key.split("."):
            a, b = (a or {}).get(part), (b or {}).get(part)
        changed += setting_changes(key, a, b)
    if changed:
        raise ConfigError(
            f"cannot resume: settings differ from the run saved in {saved_path.parent} (see {saved_path}): "
            f"{'; '.join(changed)}. Resume with the saved settings, or start a new run in another train.output_dir"
        )


def _read_run_file(path: Path, parse, kind: str) -> dict:
    """A run's own record (config.yaml, teacher_config.json) that a resume compares against; damaged (edited by hand,
    cut short): a ConfigError naming it, the run directory left as it is."""
    try:
        value = parse(path.read_text(encoding="utf-8"))
    except (ValueError, yaml.YAMLError, UnicodeDecodeError) as e:
        value = e
    if not isinstance(value, dict):
        why = f"not valid {kind}: {' '.join(str(value).split())[:200]}" if isinstance(value, Exception) else \
            f"not a mapping ({type(value).__name__})"
        raise ConfigError(f"cannot resume: {path} is {why}. The run writes it when it starts: restore it from a copy, "
                          f"or start a new run in another train.output_dir (nothing in {path.parent} was changed)")
    return value


def _teacher_shapes(hf_config: dict) -> dict:
    """The config.json fields that fix the shapes of the teacher's (and so the trained) parameters, defaults
    filled in (an absent head_dim equals an explicit hidden_size / heads)."""
    c = config_from_hf(hf_config)
    return {"model_type": hf_config.get("model_type"), "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "tie_word_embeddings": c.tie_word_embeddings, "attention_bias": c.qkv_bias,
            "mlp_bias": c.mlp_bias, "num_key_value_layers": c.num_key_value_layers,
            "key_value_group_size": c.key_value_group_size}


def _check_same_teacher(config: TrainConfig, teacher_config: dict, out: Path) -> None:
    """A resumed run's teacher has the shapes of the one it started from (weights are not hashed: too slow for
    8B; shapes are what a checkpoint cannot be restored across)."""
    saved = out / TEACHER_CONFIG_FILE
    if not saved.is_file():  # a run from before the file was written
        return
    before, now = _teacher_shapes(_read_run_file(saved, json.loads, "JSON")), _teacher_shapes(teacher_config)
    changed = [f"{key}: {before[key]!r} -> {now[key]!r}" for key in before if before[key] != now[key]]
    if changed:
        raise ConfigError(
            f"cannot resume: the teacher at model.teacher={config.model.teacher} is not the model the run in {out} "
            f"started from (see {saved}); its config.json differs in {'; '.join(changed)}. Resume with that "
            f"teacher, or start a new run in another train.output_dir"
        )


def _run_outputs(out: Path, latest: Optional[int]) -> list[str]:
    """What an earlier run left in `out` that a new one would overwrite."""
    found = []
    checkpoints_dir = out / CHECKPOINT_DIR
    if checkpoints_dir.is_dir() and any(checkpoints_dir.iterdir()):
        found.append(f"{CHECKPOINT_DIR}/" + (f" (latest step {latest})" if latest is not None else ""))
    found += [name for name in (CONFIG_FILE, TEACHER_CONFIG_FILE, METRICS_FILE, PLOT_FILE) if (out / name).exists()]
    return found + _exports(out)


def _exports(out: Path) -> list[str]:
    return [f"{name}/" for dirs in EXPORT_DIRS.values() for name in dirs.values() if (out / name).exists()]


def _check_output_dir(config: TrainConfig, out: Path, latest: Optional[int]) -> None:
    """A new run never overwrites an earlier one's outputs (a finished run's export outlives its checkpoints);
    train.resume=true continues the run that is there."""
    if not config.train.resume:
        found = _run_outputs(out, latest)
        if found:
            raise ConfigError(
                f"train.output_dir {out} already holds a run's outputs: {', '.join(found)}. Continue that run with "
                f"train.resume=true, or choose another train.output_dir (nothing there was changed)"
            )
    elif latest is None and _exports(out):
        raise ConfigError(
            f"train.resume=true, but train.output_dir {out} has no checkpoint to resume from, only the export(s) "
            f"{', '.join(_exports(out))} of a finished run, which a new run would overwrite: choose another "
            f"train.output_dir"
        )


def _load_tokenizer(section):
    """The run's tokenizer, its error naming the key it came from."""
    from swiftkv_jax.data import DataError, load_tokenizer

    try:
        return load_tokenizer(section.tokenizer or section.teacher)
    except DataError as e:
        key = "model.tokenizer" if section.tokenizer else "model.teacher (its tokenizer; or set model.tokenizer)"
        raise DataError(f"{key}: {e}") from None


def check_vocab(tokenizer, vocab_size: int, section) -> None:
    """Every token id the tokenizer can produce has an embedding row (a larger vocab_size is normal: padded)."""
    if len(tokenizer) > vocab_size:
        which = (f"model.tokenizer={section.tokenizer}" if section.tokenizer
                 else f"the tokenizer of model.teacher={section.teacher}")
        raise ConfigError(
            f"{which} has {len(tokenizer)} tokens, more than the vocab_size {vocab_size} of model.teacher="
            f"{section.teacher} (its config.json): token ids >= {vocab_size} have no embedding. Use the teacher's "
            f"own tokenizer{' (unset model.tokenizer)' if section.tokenizer else ''}"
        )


def _checkpoint_manager(config: TrainConfig, create: bool = True) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=config.checkpoint.every, max_to_keep=config.checkpoint.keep,
        enable_async_checkpointing=config.checkpoint.async_save, create=create)
    return ocp.CheckpointManager(Path(config.train.output_dir).absolute() / CHECKPOINT_DIR, options=options)


def _save(manager, step: int, state, data_position: int, config: TrainConfig, force: bool = False) -> None:
    meta = {"step": step, "data_position": data_position, "seed": config.train.seed}
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                 force=force)


def _describe(config: ModelConfig, stage: str) -> str:
    if stage == "pretrain":
        return f"a {config.num_hidden_layers}-layer model, every weight trained"
    return (f"SwiftKV l={config.num_key_value_layers} g={config.key_value_group_size} of "
            f"{config.num_hidden_layers} layers")


def export_student(model_config: ModelConfig, trainable, frozen, config: TrainConfig) -> list[Path]:
    """The trained model (the student; for stage pretrain the model) as HF and/or Orbax checkpoints with the
    tokenizer files beside them."""
    out = Path(config.train.output_dir)
    export_dirs = EXPORT_DIRS[config.stage]
    model = Model(model_config.replace(remat="none"), merge(trainable, frozen))
    sidecars = read_sidecar_files(config.model.tokenizer or config.model.teacher)
    written = []
    for fmt, enabled in (("hf", config.export.hf), ("orbax", config.export.orbax)):
        if not enabled:
            continue
        # Only a resumed run replaces an export (its own, from before): train() refused any other on start.
        written.append(checkpoints.save(model, out / export_dirs[fmt], fmt, dtype=config.export.dtype,
                                        overwrite=config.train.resume, max_shard_size=config.export.max_shard_size,
                                        extra_files=sidecars))
    return written


def sized_for_rows(model_config: ModelConfig, dataset, print_fn=print, packed_layout: Optional[bool] = None
                   ) -> ModelConfig:
    """Attention told that its rows are packed documents: the most runs of segment ids in any row (documents and
    padding) becomes `max_segments_per_row`. cuDNN then masks causally within each document instead of reading a
    [T, S] bias; `xla_chunked` skips the keys past each query block. cuDNN's packed layout (more than one run per
    row) needs Hopper or later (`packed_layout`: default, the first device's compute capability >= 9); before it,
    cuDNN attends with the bias, and says so. Other attention impls need nothing from the data."""
    from swiftkv_jax.data.packing import max_runs

    impl = model_config.attention_impl
    if impl not in ("cudnn", "xla_chunked"):
        return model_config
    runs = max_runs(dataset)
    if impl == "xla_chunked":
        print_fn("attention: XLA in query blocks, each over the keys up to its own end (rows of packed documents)")
        return model_config.replace(max_segments_per_row=runs)
    if packed_layout is None:
        packed_layout = student_lib.cudnn_packed_layout()
    if runs > 1 and not packed_layout:
        print_fn(f"attention: cuDNN with our mask as a bias (rows hold up to {runs} runs of segment ids; cuDNN's "
                 f"packed layout needs an sm_90+ GPU)")
        return model_config
    print_fn(f"attention: cuDNN, causal within each of at most {runs} runs of segment ids per row (documents and "
             f"padding)")
    return model_config.replace(max_segments_per_row=runs)


def load_model(config: TrainConfig, mesh, dataset, print_fn=print):
    """(model config, trainable, frozen) of what `train` trains on `mesh`: the pretraining model or the student
    with its teacher's frozen weights, its attention sized for the dataset's rows (`sized_for_rows`). Benchmarks
    that time the bare step load it here too, so that they compile the step `train` runs."""
    if config.stage == "pretrain":
        model_config, trainable, frozen = student_lib.load_pretrain(config.model, mesh, config.train.seed)
    else:
        model_config, trainable, frozen = student_lib.load_student(config.model, mesh)
    return sized_for_rows(model_config, dataset, print_fn), trainable, frozen


def train(config: TrainConfig, print_fn=print) -> int:
    """Run (or resume) a distillation; returns the exit status: 0 when finished, 128 + the signal's number when a
    signal stopped it cleanly (a checkpoint saved; 143 for SIGTERM, 130 for SIGINT, the shell's convention, so that a
    scheduler or `train.py && ...` does not take an unfinished run for a finished one).

    Raises ConfigError/DataError on bad input before anything is written, TrainingStopped on a
    non-finite loss (the last good checkpoint stays intact).
    """
    from swiftkv_jax.data import Batches, build_dataset  # datasets/transformers: heavy imports

    d = config.distributed
    try:
        joined = distributed.initialize(d.coordinator_address, d.num_processes, d.process_id, d.cpu_collectives)
        if not joined and d.process_id:  # a lone process would train as the whole job: a job missing its settings
            raise ValueError(f"distributed.process_id={d.process_id} was given, but nothing makes this a job of "
                             f"several processes")
    except ValueError as e:  # settings JAX cannot start from (a missing coordinator, a bad JAX_* variable)
        raise ConfigError(f"distributed: {e}. Give distributed.coordinator_address (host:port of process 0), "
                          f"distributed.num_processes and distributed.process_id (or JAX_COORDINATOR_ADDRESS, "
                          f"JAX_NUM_PROCESSES, JAX_PROCESS_ID), or start under a launcher JAX detects (SLURM, "
                          f"Open MPI)") from None
    lead = jax.process_index() == 0
    say = print_fn if lead else (lambda *_: None)
    out = Path(config.train.output_dir)
    # Every process reads its own input; one's error (its own data path missing, say) stops all of them here
    with distributed.stop_together("setup"):
        latest = _checkpoint_manager(config, create=False).latest_step() if (out / CHECKPOINT_DIR).is_dir() else None
        _check_output_dir(config, out, latest)
        if latest is not None:
            _check_resumable(config, out / CONFIG_FILE)

        # The model's settings first: a wrong teacher must fail before minutes of tokenising.
        vocab_size = (student_lib.pretrain_config if config.stage == "pretrain" else student_lib.student_config
                      )(config.model).vocab_size
        teacher_config = read_config(config.model.teacher)  # valid: the line above read it
        _check_positions(config, teacher_config.get("max_position_embeddings"))
        if config.stage == "distill":  # before tokenising, not when the weights are loaded
            student_lib.require_weights(config.model)
        if latest is not None:
            _check_same_teacher(config, teacher_config, out)
        mesh = make_mesh(config)  # also before tokenising (jax.process_index above has started the devices already)
        tokenizer = _load_tokenizer(config.model)
        check_vocab(tokenizer, vocab_size, config.model)
        dataset = build_dataset(config.data, tokenizer)
        model_config, trainable, frozen = load_model(config, mesh, dataset, say)
        shape = (config.train.global_batch_size, config.data.seq_len)
        rows = _process_rows(step_lib.batch_sharding(mesh, sharding.LOGICAL_AXIS_RULES), shape)
        batches = Batches(dataset, config.train.global_batch_size, config.data.seed, rows=rows)
        epoch_steps = config.train.epochs * batches.steps_per_epoch  # a float: inf for a huge train.epochs
        if config.train.max_steps is None and epoch_steps > MAX_STEPS:
            raise ConfigError(f"train.epochs={config.train.epochs} makes {epoch_steps:.3g} steps, more than the step "
                              f"counter holds ({MAX_STEPS}): lower train.epochs, or set train.max_steps")
        total_steps = config.train.max_steps or max(1, math.ceil(epoch_steps))
        if latest is not None and latest > total_steps:  # its state is past the schedule this run would end
            raise ConfigError(f"cannot resume: {out / CHECKPOINT_DIR} holds step {latest}, past the {total_steps} "
                              f"steps this run trains (train.max_steps={config.train.max_steps}, train.epochs="
                              f"{config.train.epochs}): train for at least {latest} steps, or start a new "
                              f"train.output_dir")
        compiled = build_step(config, model_config, mesh, trainable, jax.tree.map(lambda a: a.sharding, frozen),
                              total_steps)
        n_train, n_frozen = count(trainable), count(frozen)
        say(f"{config.stage}: {_describe(model_config, config.stage)}; trainable {n_train:,} of "
            f"{n_train + n_frozen:,} parameters ({n_train / (n_train + n_frozen):.2%})")
        say(f"data: {len(dataset):,} packed sequences of {config.data.seq_len}; {batches.steps_per_epoch} steps per "
            f"epoch; {total_steps} steps; mesh {dict(mesh.shape)} over {jax.process_count()} process(es)")

    state = compiled.init_state(trainable)
    del trainable
    manager = _checkpoint_manager(config)  # the first thing written: the input is valid by now
    start = 0
    if latest is not None:
        with unreadable_orbax(out / CHECKPOINT_DIR / str(latest), fix=RESTORE_FIX):
            restored = manager.restore(latest, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(compiled.abstract_state(state.trainable)), meta=ocp.args.JsonRestore()))
        state, start = restored.state, int(restored.meta["step"])
        batches = Batches(dataset, config.train.global_batch_size, config.data.seed, rows=rows,
                          start=int(restored.meta["data_position"]))
        say(f"resumed from step {start} (data position {restored.meta['data_position']})")
    elif config.train.resume:  # as a typo in train.output_dir would look: said, not silent
        say(f"train.resume=true, but {out / CHECKPOINT_DIR} holds no checkpoint: starting at step 0")
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / CONFIG_FILE, yaml.safe_dump(to_dict(config), sort_keys=False))  # what resume reads
        write_text_atomic(out / TEACHER_CONFIG_FILE, json.dumps(teacher_config, indent=2) + "\n")
        log = MetricsLog(out, resume_step=start)

    step_fn = compiled.fn.lower(state, frozen, compiled.abstract_batch(config)).compile()
    progress = _progress(total_steps, start, lead)
    load = functools.partial(_load_batch, batches, compiled.batch_sharding, shape)
    loaded = load() if start < total_steps else None
    with _StopRequest() as stop:
        last = time.perf_counter()
        for step in range(start, total_steps):
            batch, position, host_s = loaded
            state, metrics = step_fn(state, frozen, batch)  # dispatched: runs while the next batch is loaded
            loaded = load() if step + 1 < total_steps else None
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            now = time.perf_counter()
            seconds, last = now - last, now
            # step_s: the wall time since the previous step's metrics came back: this step, the next batch's
            # loading beside it, and the previous step's logging and checkpoint save (the blocking part of an
            # asynchronous save), so that the steps add up to the run; host_s: loading its batch (reading packed
            # rows, device_put), hidden behind the previous step
            record = {"step": step + 1, **{k: v for k, v in metrics.items() if k != "tokens"},
                      "tokens": int(metrics["tokens"]), "tokens_per_s": metrics["tokens"] / seconds,
                      "step_s": seconds, "host_s": host_s}
            if not (math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])):
                manager.wait_until_finished()
                progress.close()
                good = manager.latest_step()
                kept = (f"The last good checkpoint (step {good}) in {out / CHECKPOINT_DIR} is intact"
                        if good is not None else "No checkpoint had been saved yet")
                retry = ("lower optim.learning_rate in a new train.output_dir (a resumed run keeps its settings, and "
                         "would replay this step)" if good is not None else
                         "lower optim.learning_rate and start again (here with train.resume=true)")
                raise TrainingStopped(
                    f"non-finite loss {metrics['loss']} (grad norm {metrics['grad_norm']}) at step {step + 1}; "
                    f"stopped without applying it. {kept}. Check the data and the teacher weights (a NaN or inf in "
                    f"either does this at any learning rate), or {retry}")
            if lead and (step + 1) % config.train.log_every == 0:
                log.write(record)
            progress.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}")
            progress.update(1)
            signum = stop.requested()
            if signum:
                _save(manager, step + 1, state, position, config, force=True)
                manager.wait_until_finished()
                progress.close()
                say(f"{signal.Signals(signum).name} received: checkpoint saved at step {step + 1} in "
                    f"{out / CHECKPOINT_DIR}; continue with train.resume=true")
                manager.close()
                return STOPPED_BY_SIGNAL + signum
            _save(manager, step + 1, state, position, config)
        progress.close()
    if manager.latest_step() != total_steps:
        _save(manager, total_steps, state, batches.position, config, force=True)
    manager.wait_until_finished()
    manager.close()

    for path in export_student(model_config, state.trainable, frozen, config):
        say(f"exported the {'model' if config.stage == 'pretrain' else 'student'} to {path}")
    for fmt, enabled in (("hf", config.export.hf), ("orbax", config.export.orbax)):
        stale = out / EXPORT_DIRS[config.stage][fmt]
        if not enabled and stale.exists():  # a resumed run's earlier export: kept (it is the user's), but said
            say(f"warning: {stale} is an export from before this resume, not updated (export.{fmt}=false): delete "
                f"it, or resume once more with export.{fmt}=true")
    if lead:
        records = read_metrics(out / "metrics.jsonl")
        if records:
            plot_losses(records, out / PLOT_FILE, title=f"{config.stage}: {_describe(model_config, config.stage)}")
        say(f"metrics: {out / 'metrics.jsonl'}; loss curves: {out / PLOT_FILE}")
    return 0


def _load_batch(batches, batch_sharding: NamedSharding, shape) -> tuple[dict, int, float]:
    """(the next global batch on the devices, the data position after it, host seconds spent): this process's rows
    read from the packed dataset and put on its devices (asynchronously: the copy overlaps a running step)."""
    start = time.perf_counter()
    local = next(batches)
    batch = {k: jax.make_array_from_process_local_data(batch_sharding, local[k].astype(np.int32), shape)
             for k in step_lib.BATCH_KEYS}
    return batch, batches.position, time.perf_counter() - start


def _progress(total: int, start: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=start, disable=not enabled, unit="step", dynamic_ncols=True)
