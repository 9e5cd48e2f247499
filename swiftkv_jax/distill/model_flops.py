"""Model FLOPs of one distillation step: the work the method needs, for MFU (recomputation is not counted).

Per token of a packed row of T positions, with d hidden, n query and k KV heads of h, f the MLP width, V the
vocabulary, L layers, l the first SwiftKV layer (S = L - l later layers), G = S / g KV owners (AcrossKV groups). A
matmul of a [d_in, d_out] weight costs 2 d_in d_out a token forward; its backward costs as much again for the
activation gradient and again for the weight gradient, each counted only where the step computes it. Causal
attention is counted at half (T/2 keys a query, the MFU convention of MaxText and PaLM): 4 n h T/2 forward, twice
that backward (dQ, dK, dV and dP).

- lower (layers < l, once for teacher and student): l (2P + 2 n h T), P = d(n h + 2 k h) + n h d + 3 d f
- teacher (layers >= l, no gradient) and its head: S (2P + 2 n h T) + 2 d V
- student forward above l: S (2 (d n h + n h d + 3 d f) + 2 n h T) + G * 2 * 2 d k h + 2 d V
- student backward, the trainable path only (SWIFTKV.md section 4: q_proj_swiftkv, the owners' k/v projections and
  norm_swiftkv train, everything else is frozen and nothing below l is differentiated):
  head and frozen matmuls (o_proj, MLP) activation gradients: 2 d V + S 2 (n h d + 3 d f);
  attention: S 4 n h T; q_proj_swiftkv: weight gradients S 2 d n h, activation gradients (S - 1) 2 d n h (layer
  l's input is the constant h_l); owners' k/v: weight and activation gradients (norm_swiftkv trains) G 2 2 2 d k h.
"""

from __future__ import annotations

from typing import NamedTuple

from swiftkv_jax.model.config import ModelConfig


class StepFlops(NamedTuple):
    """FLOPs a token of each part of the step; `total` per token, times tokens for a step."""

    lower: float
    teacher: float
    student_forward: float
    student_backward: float

    @property
    def total(self) -> float:
        return self.lower + self.teacher + self.student_forward + self.student_backward


def distill_step_flops(config: ModelConfig, seq_len: int) -> StepFlops:
    """Model FLOPs per token of `train_step` on a SwiftKV student `config` over rows of `seq_len` positions."""
    if not config.is_swiftkv:
        raise ValueError("distill_step_flops needs a SwiftKV student config (num_key_value_layers set): the teacher "
                         "wiring alone has no distillation step")
    d, n, k, h, f, v = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                        config.intermediate_size, config.vocab_size)
    l, s, g = config.num_lower_layers, config.num_hidden_layers - config.num_lower_layers, config.num_kv_groups
    q, kv, o, mlp = d * n * h, d * k * h, n * h * d, 3 * d * f
    attention = 2 * n * h * seq_len  # causal, at half: 4 n h (T / 2)
    layer = 2 * (q + 2 * kv + o + mlp) + attention
    lower = l * layer
    teacher = s * layer + 2 * d * v
    student_forward = s * (2 * (q + o + mlp) + attention) + g * 2 * 2 * kv + 2 * d * v
    student_backward = (2 * d * v + s * 2 * (o + mlp) + s * 2 * attention + s * 2 * q + (s - 1) * 2 * q
                        + g * 2 * 2 * 2 * kv)
    return StepFlops(float(lower), float(teacher), float(student_forward), float(student_backward))


FORMULA = ("per token: lower l(2P + 2nhT) + teacher S(2P + 2nhT) + 2dV + student S(2(dnh + nhd + 3df) + 2nhT) "
           "+ G·4dkh + 2dV + backward 2dV + S·2(nhd + 3df) + S·4nhT + (2S - 1)·2dnh + G·8dkh; "
           "P = d(nh + 2kh) + nhd + 3df, S = L - l, G = S/g, causal attention at half")
