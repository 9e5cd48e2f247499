"""Rotary position embeddings, half-split ("rotate_half") layout as in transformers' Llama and Qwen2."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from swiftkv_jax.model.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """[H/2] inverse frequencies, with linear or llama3 scaling; computed in float64, returned float32."""
    inv_freq = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if rope.type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def rope_angles(rope: RopeConfig, head_dim: int, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos, sin of shape [B, T, H/2] (fp32) for integer positions [B, T]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inverse_frequencies(rope, head_dim))
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate x [B, T, heads..., H] (one or more head axes) by angles [B, T, H/2]; math in fp32, result in x's
    dtype."""
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    heads = (1,) * (x.ndim - 3)
    cos, sin = (a.reshape(a.shape[:2] + heads + a.shape[2:]) for a in (cos, sin))
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)
