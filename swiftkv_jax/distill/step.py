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
    head = functools.partial(stage, frozen, config, "head")
    temperature = loss.temperature

    def objective(trainable):
        student = stage(merge(trainable, frozen), config, "upper", h_l, positions, segment_ids, swiftkv=True,
                        with_last_input=with_hidden)
        student_final, student_last = student if with_hidden else (student, None)
        weights = batch["loss_mask"] * valid
        kl = losses.chunked_kl_sum(head, student_final, teacher_final, weights, temperature, loss.chunk_size)
        sq = losses.hidden_sq_error_sum(student_last, teacher_last, valid) if with_hidden else jnp.zeros(())
        total = (temperature**2 * kl + loss.hidden_loss_mult * sq / config.hidden_size) * inv_tokens
        return total, {"kl": kl, "sq": sq}

    (_, sums), grads = jax.value_and_grad(objective, has_aux=True)(trainable)
    return grads, sums


def train_step(state: TrainState, frozen: dict, batch: dict, *, config: ModelConfig, loss: LossSection,
               optimizer: optax.GradientTransformation, schedule: optax.Schedule, grad_accum: int = 1,
               batch_sharding: Optional[NamedSharding] = None):
    """(new state, metrics). A non-finite loss or gradient leaves the state unchanged (metrics show it)."""
    tokens = jnp.sum(batch["segment_ids"] > 0)
    inv_tokens = 1.0 / jnp.maximum(tokens, 1).astype(jnp.float32)
    sums_of = functools.partial(distill_sums, config=config, loss=loss)
    if grad_accum == 1:
        grads, sums = sums_of(state.trainable, frozen, batch, inv_tokens)
    else:
        def accumulate(acc, micro):
            g, s = sums_of(state.trainable, frozen, micro, inv_tokens)
            return jax.tree.map(jnp.add, acc, (g, s)), None

        zeros = jax.tree.map(jnp.zeros_like, state.trainable), {"kl": jnp.zeros(()), "sq": jnp.zeros(())}
        (grads, sums), _ = jax.lax.scan(accumulate, zeros, _split_microbatches(batch, grad_accum, batch_sharding))

    kl = sums["kl"] * inv_tokens
    hidden_mse = sums["sq"] * inv_tokens / config.hidden_size
    total = loss.temperature**2 * kl + loss.hidden_loss_mult * hidden_mse
    grad_norm = optax.tree_utils.tree_norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.trainable)
    trainable = optax.apply_updates(state.trainable, updates)
    finite = jnp.isfinite(total) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = TrainState(state.step + finite.astype(state.step.dtype), keep(trainable, state.trainable),
                           keep(opt_state, state.opt_state))
    metrics = {"loss": total, "kl": kl, "hidden_mse": hidden_mse, "grad_norm": grad_norm,
               "lr": schedule(state.step), "tokens": tokens}
    return new_state, metrics


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
    """Rows over the mesh axes the rules give the logical 'batch' axis."""
    return nn.logical_to_mesh_sharding(PartitionSpec("batch", None), mesh, rules)
