"""The distillation run's settings: one frozen dataclass per recipe section (see configs/*.yaml)."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from swiftkv_jax.checks import not_a_directory
from swiftkv_jax.configuration import ConfigError, field
from swiftkv_jax.data.config import DataConfig

DType = Literal["float32", "bfloat16", "float16"]


@dataclasses.dataclass(frozen=True)
class ModelSection:
    teacher: str = field("", help="teacher checkpoint directory: Hugging Face (config.json + safetensors) or ours "
                                  "(Orbax); stage pretrain: the model to train (config.json alone: random weights)")
    tokenizer: Optional[str] = field(None, help="tokenizer directory (default: the teacher's)")
    num_key_value_layers: int = field(1, help="l: layers >= l take their KV from norm_swiftkv(h_l) (SWIFTKV.md §2)")
    key_value_group_size: int = field(1, help="g: AcrossKV group size (1 = SingleInputKV only)")
    norm_init: Literal["copy", "ones"] = field(
        "copy", help="norm_swiftkv init: layer l's input norm, or ones (paper era)")
    frozen_dtype: DType = field(
        "bfloat16", help="storage of the frozen weights (held once, shared by teacher and student)")
    trainable_dtype: DType = field("float32", help="master copy of the trainable weights (and the optimizer state)")
    compute_dtype: DType = field(
        "bfloat16", help="matmul dtype; softmax, norms, logits and the loss are fp32 regardless")
    attention_impl: str = field(
        "xla", help="attention backend (see swiftkv_jax.model.attention); auto: cudnn on an NVIDIA sm_90+ GPU with "
                    "16-bit compute, else xla_chunked")
    remat: Literal["none", "full", "dots"] = field("full", help="activation checkpointing of the trained layers")


@dataclasses.dataclass(frozen=True)
class LossSection:
    temperature: float = field(2.0, help="KL(teacher || student) at this temperature, multiplied by its square")
    hidden_loss_mult: float = field(
        0.0, help="weight of the MSE between hidden states entering the last layer (current recipe: 1.0)")
    chunk_size: int = field(1024, help="positions per chunk of the logits/KL computation; 0 = whole sequence at once")


@dataclasses.dataclass(frozen=True)
class OptimSection:
    learning_rate: float = field(2e-4, help="peak learning rate (AdamW)")
    b1: float = field(0.9)
    b2: float = field(0.999)
    eps: float = field(1e-8)
    weight_decay: float = field(0.0)
    warmup_ratio: float = field(0.05, help="linear warmup over this fraction of the steps, then linear decay to 0")
    grad_clip: float = field(1.0, help="clip the global gradient norm to this (0 = off)")


@dataclasses.dataclass(frozen=True)
class TrainSection:
    output_dir: str = field("runs/distill", help="checkpoints, metrics.jsonl, loss plot and the exported student")
    global_batch_size: int = field(8, help="packed sequences per optimizer step, over all devices and hosts")
    grad_accum: int = field(1, help="micro-batches per step (global_batch_size must divide by it)")
    epochs: float = field(1.0, help="passes over the data mixture (fractions allowed)")
    max_steps: Optional[int] = field(None, help="stop after this many steps (default: from epochs)")
    seed: int = field(0)
    log_every: int = field(1, help="write metrics.jsonl every N steps")
    resume: bool = field(False, help="continue from the latest checkpoint in output_dir")


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    every: int = field(500, help="save every N steps (and at the end, and on SIGTERM/SIGINT)")
    keep: int = field(3, help="checkpoints kept")
    async_save: bool = field(True, help="write checkpoints in the background")


@dataclasses.dataclass(frozen=True)
class ExportSection:
    hf: bool = field(True, help="export the student as a Hugging Face llama_swiftkv/qwen2_swiftkv checkpoint")
    orbax: bool = field(True, help="export the student as an Orbax checkpoint")
    dtype: DType = field("bfloat16", help="dtype of the exported weights")
    max_shard_size: str = field("5GB", help="largest safetensors file of the HF export: a number and a unit "
                                                "(KB, MB, GB, TB), e.g. 500MB")


@dataclasses.dataclass(frozen=True)
class MeshSection:
    data: int = field(1, help="pure data-parallel axis size (-1: the rest of the devices)")
    fsdp: int = field(-1, help="data-parallel axis with sharded weights")
    tensor: int = field(1, help="heads/MLP/vocab split")


@dataclasses.dataclass(frozen=True)
class DistributedSection:
    coordinator_address: Optional[str] = field(
        None, help="host:port of process 0; default: JAX's environment detection")
    num_processes: Optional[int] = field(None)
    process_id: Optional[int] = field(None)
    cpu_collectives: Literal["gloo", "mpi", "none"] = field("gloo", help="collectives between CPU processes")


STAGES = ("distill", "pretrain")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    stage: Literal["distill", "pretrain"] = field(
        "distill", help="distill: SwiftKV distillation of model.teacher; pretrain: next-token cross-entropy, every "
                        "weight trained (makes a teacher; l and g are unused)")
    model: ModelSection = field(ModelSection())
    data: DataConfig = field(DataConfig())
    loss: LossSection = field(LossSection())
    optim: OptimSection = field(OptimSection())
    train: TrainSection = field(TrainSection())
    checkpoint: CheckpointSection = field(CheckpointSection())
    export: ExportSection = field(ExportSection())
    mesh: MeshSection = field(MeshSection())
    distributed: DistributedSection = field(DistributedSection())

    def validate(self) -> None:
        """Cross-field checks, run once the recipe and all overrides are applied."""
        checks = [
            (bool(self.model.teacher), "model.teacher is required: the teacher checkpoint directory (a recipe sets "
                                       "it: python train.py --config RECIPE.yaml, see configs/)"),
            (bool(self.data.sources), "data.sources is empty: list at least one dataset (see configs/)"),
            (self.model.num_key_value_layers >= 1, "model.num_key_value_layers (l) must be >= 1"),
            (self.model.key_value_group_size >= 1, "model.key_value_group_size (g) must be >= 1"),
            (self.loss.temperature > 0, "loss.temperature must be > 0"),
            (self.loss.hidden_loss_mult >= 0, "loss.hidden_loss_mult must be >= 0"),
            (self.loss.chunk_size >= 0, "loss.chunk_size must be >= 0 (0 = unchunked)"),
            (self.data.seq_len >= 2, "data.seq_len must be >= 2"),
            (self.train.global_batch_size >= 1 and self.train.grad_accum >= 1,
             "train.global_batch_size and train.grad_accum must be >= 1"),
            (self.train.global_batch_size % self.train.grad_accum == 0,
             f"train.global_batch_size ({self.train.global_batch_size}) must be divisible by train.grad_accum "
             f"({self.train.grad_accum})"),
            (self.train.epochs > 0, "train.epochs must be > 0"),
            (self.train.max_steps is None or 1 <= self.train.max_steps < 2**31,
             f"train.max_steps must lie in [1, 2**31) (the step counter is an int32), got {self.train.max_steps}"),
            (self.train.log_every >= 1 and self.checkpoint.every >= 1 and self.checkpoint.keep >= 1,
             "train.log_every, checkpoint.every and checkpoint.keep must be >= 1"),
            (0 <= self.optim.warmup_ratio <= 1, "optim.warmup_ratio must lie in [0, 1]"),
            (self.optim.learning_rate > 0 and self.optim.grad_clip >= 0,
             "optim.learning_rate must be > 0 and optim.grad_clip >= 0"),
            (0 <= self.optim.b1 < 1 and 0 <= self.optim.b2 < 1,  # Adam's decay rates, as optax and torch take them
             f"optim.b1 and optim.b2 must lie in [0, 1), got {self.optim.b1} and {self.optim.b2}"),
            (self.optim.eps > 0, f"optim.eps must be > 0 (it keeps Adam's division finite), got {self.optim.eps}"),
            (self.optim.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {self.optim.weight_decay}"),
            (bool(self.train.output_dir), "train.output_dir must be set"),
            (0 <= self.data.seed < 2**32, f"data.seed must lie in [0, 2**32), got {self.data.seed}"),
            (self.data.num_proc is None or self.data.num_proc >= 1,
             f"data.num_proc must be >= 1 (or null: one process), got {self.data.num_proc}"),
            (self.distributed.num_processes is None or self.distributed.num_processes >= 1,
             f"distributed.num_processes must be >= 1, got {self.distributed.num_processes}"),
            (self.distributed.process_id is None or self.distributed.process_id >= 0 and (
                self.distributed.num_processes is None or self.distributed.process_id < self.distributed.num_processes),
             f"distributed.process_id must lie in [0, distributed.num_processes), got process_id "
             f"{self.distributed.process_id} of num_processes {self.distributed.num_processes}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        self._check_directories()
        self._check_shard_size()

    def _check_directories(self) -> None:
        """Directories, or paths where one can be made: not files (found before minutes of tokenising)."""
        for key, value, what in (("train.output_dir", self.train.output_dir, "the run's checkpoints and exports"),
                                 ("data.cache_dir", self.data.cache_dir, "the tokenised and packed data")):
            why = not_a_directory(value) if value else None
            if why:
                raise ConfigError(f"{key}={value!r} {why}, not a directory: choose a directory path for {what}")

    def _check_shard_size(self) -> None:
        from swiftkv_jax.checkpoints.hf import parse_size  # jax: imported only once a recipe is being checked

        try:
            parse_size(self.export.max_shard_size)
        except ValueError as e:
            raise ConfigError(f"export.max_shard_size: {e}") from None
