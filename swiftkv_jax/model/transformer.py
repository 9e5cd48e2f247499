"""The whole decoder, in teacher or SwiftKV wiring (../shared/SWIFTKV.md §1-2).

Parameter tree (plain nested dicts; leading axes from the scans):
  embed_tokens/embedding                [V, D]
  layers/...                            [l, ...]     layers 0..l-1 (all L for a plain model)
  norm_swiftkv/scale                    [D]          SwiftKV models only
  swiftkv_groups/{k,v}_proj_swiftkv/... [G, ...]     the owner of each AcrossKV group, G = (L - l) / g
  swiftkv_groups/layers/...             [G, g, ...]  layers l..L-1, original weights + q_proj_swiftkv
  norm/scale                            [D]
  lm_head/kernel                        [D, V]       unless tied to the embedding
Layers below l are one scanned stack used by both wirings, so the teacher and the student share them.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax.numpy as jnp

from swiftkv_jax import sharding
from swiftkv_jax.dtypes import as_dtype
from swiftkv_jax.model.config import ModelConfig
from swiftkv_jax.model.layers import RMSNorm, kv_projection, logical_param, scanned_layers
from swiftkv_jax.model.precision import einsum_fp32
from swiftkv_jax.model.rope import apply_rope, rope_angles


LOGIT_AXES = ("batch", "length", "vocab")


class Embedder(nn.Module):
    config: ModelConfig

    def setup(self):
        cfg = self.config
        init = nn.initializers.normal(cfg.initializer_range)
        self.embedding = logical_param(self, "embedding", init, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"))

    def __call__(self, tokens):
        h = jnp.take(self.embedding, tokens, axis=0).astype(as_dtype(self.config.dtype))
        return sharding.constrain(h, ("batch", "length", "act_embed"))

    def attend(self, x):
        """Tied output head: fp32 logits (backward in x's dtype: `einsum_fp32`)."""
        logits = einsum_fp32("BTD,VD->BTV", x, self.embedding.astype(x.dtype))
        return sharding.constrain(logits, LOGIT_AXES)


class LMHead(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        init = nn.initializers.normal(cfg.initializer_range)
        kernel = logical_param(self, "kernel", init, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"))
        logits = einsum_fp32("BTD,DV->BTV", x, kernel.astype(x.dtype))
        return sharding.constrain(logits, LOGIT_AXES)


class SwiftKVGroup(nn.Module):
    """One AcrossKV group (scan body): g layers reading one K/V.

    With `x_swiftkv = norm_swiftkv(h_l)` the group's owner projects that K/V (SwiftKV wiring); with None each
    layer computes its own (teacher wiring). Serving runs the same layers one by one (`swiftkv_jax.model.cached`).
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, carry, x_swiftkv, rope, positions, segment_ids):
        cfg = self.config
        shared_kv = None
        if x_swiftkv is not None:
            k = apply_rope(kv_projection(cfg, name="k_proj_swiftkv")(x_swiftkv), *rope)
            v = kv_projection(cfg, name="v_proj_swiftkv")(x_swiftkv)
            shared_kv = (k, v, positions, segment_ids, None)
        layers = scanned_layers(cfg, cfg.key_value_group_size, has_swiftkv_query=True, name="layers")
        carry, _ = layers(carry, rope, positions, segment_ids, shared_kv, None, None)
        return carry, None


def default_positions(tokens, positions=None, segment_ids=None):
    """positions 0..T-1 and a single segment unless given."""
    batch, length = tokens.shape[:2]
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    if segment_ids is None:
        segment_ids = jnp.zeros((batch, length), jnp.int32)
    return positions, segment_ids


class Transformer(nn.Module):
    """The decoder. `__call__` is the whole forward; `lower`, `upper` and `head` are its three stages,
    so that distillation can run layers < l once for both wirings and the teacher without gradients."""

    config: ModelConfig

    def setup(self):
        cfg = self.config
        self.embed_tokens = Embedder(cfg)
        self.layers = scanned_layers(cfg, cfg.num_lower_layers, has_swiftkv_query=False)
        if cfg.is_swiftkv:
            self.norm_swiftkv = RMSNorm(cfg)
            if cfg.num_kv_groups:
                self.swiftkv_groups = nn.scan(
                    SwiftKVGroup,
                    variable_axes={"params": 0, "intermediates": 0},
                    split_rngs={"params": True},
                    in_axes=(nn.broadcast,) * 4,  # x_swiftkv, rope, positions, segment_ids
                    length=cfg.num_kv_groups,
                    metadata_params={nn.PARTITION_NAME: "layer_groups"},
                )(cfg)
        self.norm = RMSNorm(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = LMHead(cfg)

    def __call__(self, tokens, positions: Optional[jnp.ndarray] = None,
                 segment_ids: Optional[jnp.ndarray] = None, swiftkv: bool = False):
        """Teacher-forced forward: tokens [B, T] -> fp32 logits [B, T, V].

        positions [B, T] (default 0..T-1) drive RoPE and the causal mask; tokens attend only within their
        segment_ids [B, T] (default all 0). `swiftkv` picks the wiring of layers >= l.
        """
        positions, segment_ids = default_positions(tokens, positions, segment_ids)
        h = self.lower(tokens, positions, segment_ids)
        return self.head(self.upper(h, positions, segment_ids, swiftkv))

    def lower(self, tokens, positions, segment_ids):
        """Embedding and layers < l (shared by both wirings): the residual h_l [B, T, D]."""
        cfg = self.config
        h = self.embed_tokens(tokens)
        self.sow("intermediates", "embeddings", h)
        rope = rope_angles(cfg.rope, cfg.head_dim, positions)
        h, _ = self.layers(h, rope, positions, segment_ids, None, None, None)
        return h

    def upper(self, h, positions, segment_ids, swiftkv: bool = False, with_last_input: bool = False):
        """Layers >= l from h_l, in the SwiftKV or the teacher wiring: the final residual [B, T, D].

        with_last_input: return (final residual, residual entering the last layer) instead.
        """
        cfg = self.config
        if swiftkv and not cfg.is_swiftkv:
            raise ValueError("swiftkv=True needs a SwiftKV model: this one has no SwiftKV layers (see to_swiftkv)")
        if with_last_input and not cfg.num_kv_groups:
            raise ValueError("with_last_input needs layers >= l (num_key_value_layers < num_hidden_layers)")
        if not cfg.num_kv_groups:
            if cfg.is_swiftkv and self.is_initializing():
                self.norm_swiftkv(h)
            return h
        x_swiftkv = None
        if swiftkv or self.is_initializing():  # initialisation creates both wirings' parameters
            x_swiftkv = self.norm_swiftkv(h)
        rope = rope_angles(cfg.rope, cfg.head_dim, positions)
        carry = (h, h) if with_last_input else h
        carry, _ = self.swiftkv_groups(carry, x_swiftkv, rope, positions, segment_ids)
        return carry

    def head(self, h):
        """Final norm and output projection: fp32 logits [..., V]."""
        h = self.norm(h)
        if self.config.tie_word_embeddings:
            return self.embed_tokens.attend(h)
        return self.lm_head(h)
