"""One distillation step: layers < l once, the teacher's later layers without gradients, the student's
later layers differentiated with respect to the trainable parameters only.

The frozen tree is an input of the step and never differentiated, so no gradient or optimizer state
exists for it; `h_l` enters the student's objective as a constant, so nothing upstream of layer l has a
backward pass. Gradient accumulation sums micro-batch gradients of a loss already normalised by the whole
global batch's token count, so any `grad_accum` gives the same update.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from swiftkv_jax.distill import loss as losses
from swiftkv_jax.distill.config import LossSection, OptimSection
from swiftkv_jax.distill.trainable import merge
from swiftkv_jax.model.config import ModelConfig
from swiftkv_jax.model.transformer import Transformer

BATCH_KEYS = ("tokens", "positions", "segment_ids", "loss_mask")


@struct.dataclass
class TrainState:
    step: jax.Array       # int32 scalar: optimizer updates applied
    trainable: dict       # master weights (fp32 by default)
    opt_state: Any


def learning_rate_schedule(optim: OptimSection, total_steps: int) -> optax.Schedule:
    """Linear warmup over `warmup_ratio` of the steps, then linear decay to 0 (SWIFTKV.md §4)."""
    warmup = int(round(optim.warmup_ratio * total_steps))
    peak = optim.learning_rate
    decay = optax.linear_schedule(peak, 0.0, max(total_steps - warmup, 1))
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def make_optimizer(optim: OptimSection, total_steps: int) -> optax.GradientTransformation:
    adamw = optax.adamw(learning_rate_schedule(optim, total_steps), b1=optim.b1, b2=optim.b2, eps=optim.eps,
                        weight_decay=optim.weight_decay)
    if optim.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(optim.grad_clip), adamw)
    return adamw


def stage(params, config: ModelConfig, method: str, *args, **kwargs):
    """One stage of the decoder (`Transformer.lower`, `.upper` or `.head`) as a pure function."""
    return Transformer(config).apply({"params": params}, *args, method=method, **kwargs)


def head(params, h, *, config: ModelConfig):
    """Final norm and output projection as a function of the head's own parameters (`head_params`)."""
    return stage(params, config, "head", h)


def head_params(params: dict, config: ModelConfig) -> dict:
    """The subtree `Transformer.head` reads: only these get a gradient from the loss's head."""
    return {k: params[k] for k in ("norm", "embed_tokens" if config.tie_word_embeddings else "lm_head")}


def _split_microbatches(batch: dict, grad_accum: int, batch_spec: Optional[NamedSharding]) -> dict:
    """[B, T] -> [A, B / A, T], micro-batch a = rows a, a + A, …: every device holds part of each one."""
    def split(x):
        x = x.reshape((x.shape[0] // grad_accum, grad_accum) + x.shape[1:]).swapaxes(0, 1)
        if batch_spec is not None:
            x = jax.lax.with_sharding_constraint(
                x, NamedSharding(batch_spec.mesh, PartitionSpec(None, *batch_spec.spec)))
        return x
    return {k: split(batch[k]) for k in BATCH_KEYS}


def distill_sums(trainable, frozen, batch, inv_tokens, *, config: ModelConfig, loss: LossSection):
    """Gradients and loss sums of one (micro-)batch; the objective is already divided by the token count."""
    positions, segment_ids = batch["positions"], batch["segment_ids"]
    valid = segment_ids > 0
    with_hidden = loss.hidden_loss_mult > 0
    h_l = stage(frozen, config, "lower", batch["tokens"], positions, segment_ids)
    teacher = stage(frozen, config, "upper", h_l, positions, segment_ids, swiftkv=False, with_last_input=with_hidden)
    teacher_final, teacher_last = teacher if with_hidden else (teacher, None)
    temperature = loss.temperature

    def objective(trainable):
        student = stage(merge(trainable, frozen), config, "upper", h_l, positions, segment_ids, swiftkv=True,
                        with_last_input=with_hidden)
        student_final, student_last = student if with_hidden else (student, None)
        weights = batch["loss_mask"] * valid
        kl = losses.chunked_kl_sum(functools.partial(head, config=config), head_params(frozen, config),
                                   student_final, teacher_final, weights, temperature, loss.chunk_size)
        sq = losses.hidden_sq_error_sum(student_last, teacher_last, valid) if with_hidden else jnp.zeros(())
        total = (temperature**2 * kl + loss.hidden_loss_mult * sq / config.hidden_size) * inv_tokens
        return total, {"kl": kl, "sq": sq}

    (_, sums), grads = jax.value_and_grad(objective, has_aux=True)(trainable)
    return grads, sums


def next_token_targets(batch: dict):
    """(targets, weights) [B, T]: position t predicts token t + 1 of the same document (packed rows hold
    several; the last token of each predicts nothing), weighted by the loss mask at t, which the packer already
    sets by the predicted token (`data.packing.pack`: "assistant" marks t where t + 1 is an assistant token)."""
    tokens, segments = batch["tokens"], batch["segment_ids"]
    shift = lambda a: jnp.pad(a[:, 1:], ((0, 0), (0, 1)))
    same_document = (shift(segments) == segments) & (segments > 0)
    return shift(tokens), batch["loss_mask"] * same_document


def pretrain_sums(trainable, frozen, batch, inv_tokens, *, config: ModelConfig, loss: LossSection):
    """Gradients and sums of next-token cross-entropy, every parameter trainable (the teacher's pretraining)."""
    positions, segment_ids = batch["positions"], batch["segment_ids"]
    targets, weights = next_token_targets(batch)

    def objective(trainable):
        params = merge(trainable, frozen)
        h = stage(params, config, "lower", batch["tokens"], positions, segment_ids)
        h = stage(params, config, "upper", h, positions, segment_ids)
        nll, correct = losses.chunked_cross_entropy_sums(functools.partial(head, config=config),
                                                         head_params(params, config), h, targets, weights,
                                                         loss.chunk_size)
        return nll * inv_tokens, {"nll": nll, "correct": correct, "predicted": jnp.sum(weights)}

    (_, sums), grads = jax.value_and_grad(objective, has_aux=True)(trainable)
    return grads, sums


def _stage_metrics(stage_name: str, sums: dict, inv_tokens, loss: LossSection, config: ModelConfig) -> dict:
    if stage_name == "pretrain":  # the objective divides by all tokens; report per predicted token
        per = 1.0 / jnp.maximum(sums["predicted"], 1.0)
        return {"loss": sums["nll"] * inv_tokens, "ce": sums["nll"] * per, "accuracy": sums["correct"] * per}
    kl = sums["kl"] * inv_tokens
    hidden_mse = sums["sq"] * inv_tokens / config.hidden_size
    return {"loss": loss.temperature**2 * kl + loss.hidden_loss_mult * hidden_mse, "kl": kl,
            "hidden_mse": hidden_mse}


OBJECTIVES = {"distill": distill_sums, "pretrain": pretrain_sums}


def train_step(state: TrainState, frozen: dict, batch: dict, *, config: ModelConfig, loss: LossSection,
               optimizer: optax.GradientTransformation, schedule: optax.Schedule, grad_accum: int = 1,
               batch_sharding: Optional[NamedSharding] = None, stage_name: str = "distill"):
    """(new state, metrics). A non-finite loss or gradient leaves the state unchanged (metrics show it).

    stage_name: "distill" (SwiftKV's KL objective) or "pretrain" (cross-entropy, all weights trainable)."""
    tokens = jnp.sum(batch["segment_ids"] > 0)
    inv_tokens = 1.0 / jnp.maximum(tokens, 1).astype(jnp.float32)
    sums_of = functools.partial(OBJECTIVES[stage_name], config=config, loss=loss)
    if grad_accum == 1:
        grads, sums = sums_of(state.trainable, frozen, batch, inv_tokens)
    else:
        micro_batches = _split_microbatches(batch, grad_accum, batch_sharding)

        def accumulate(acc, micro):
            g, s = sums_of(state.trainable, frozen, micro, inv_tokens)
            return jax.tree.map(jnp.add, acc, (g, s)), None

        first = jax.tree.map(lambda x: x[0], micro_batches)
        shapes = jax.eval_shape(sums_of, state.trainable, frozen, first, inv_tokens)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        (grads, sums), _ = jax.lax.scan(accumulate, zeros, micro_batches)

    metrics = _stage_metrics(stage_name, sums, inv_tokens, loss, config)
    total = metrics["loss"]
    grad_norm = optax.tree_utils.tree_norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.trainable)
    trainable = optax.apply_updates(state.trainable, updates)
    finite = jnp.isfinite(total) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = TrainState(state.step + finite.astype(state.step.dtype), keep(trainable, state.trainable),
                           keep(opt_state, state.opt_state))
    metrics.update(grad_norm=grad_norm, lr=schedule(state.step), tokens=tokens)
    return new_state, metrics


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
    """Rows over the mesh axes the rules give the logical 'batch' axis."""
    return nn.logical_to_mesh_sharding(PartitionSpec("batch", None), mesh, rules)
