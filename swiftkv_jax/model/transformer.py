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

from swiftkv_jax.dtypes import as_dtype
from swiftkv_jax.model.config import ModelConfig
from swiftkv_jax.model.layers import RMSNorm, logical_param, kv_projection, scanned_layers
from swiftkv_jax.model.rope import apply_rope, rope_angles


class Embedder(nn.Module):
    config: ModelConfig

    def setup(self):
        cfg = self.config
        init = nn.initializers.normal(cfg.initializer_range)
        self.embedding = logical_param(self, "embedding", init, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"))

    def __call__(self, tokens):
        return jnp.take(self.embedding, tokens, axis=0).astype(as_dtype(self.config.dtype))

    def attend(self, x):
        """Tied output head: fp32 logits."""
        return jnp.einsum("BTD,VD->BTV", x, self.embedding.astype(x.dtype), preferred_element_type=jnp.float32)


class LMHead(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        init = nn.initializers.normal(cfg.initializer_range)
        kernel = logical_param(self, "kernel", init, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"))
        return jnp.einsum("BTD,DV->BTV", x, kernel.astype(x.dtype), preferred_element_type=jnp.float32)


class SwiftKVGroup(nn.Module):
    """One AcrossKV group: the owner's K/V from `norm_swiftkv(h_l)`, read by all g layers (scan body)."""

    config: ModelConfig
    swiftkv: bool

    @nn.compact
    def __call__(self, h, x_swiftkv, rope, positions, segment_ids):
        cfg = self.config
        shared_kv = None
        if self.swiftkv or self.is_initializing():
            k = apply_rope(kv_projection(cfg, name="k_proj_swiftkv")(x_swiftkv), *rope)
            v = kv_projection(cfg, name="v_proj_swiftkv")(x_swiftkv)
            shared_kv = (k, v) if self.swiftkv else None
        layers = scanned_layers(cfg, cfg.key_value_group_size, has_swiftkv_query=True, name="layers")
        h, _ = layers(h, rope, positions, segment_ids, shared_kv)
        return h, None


class Transformer(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, tokens, positions: Optional[jnp.ndarray] = None,
                 segment_ids: Optional[jnp.ndarray] = None, swiftkv: bool = False):
        """Teacher-forced forward: tokens [B, T] -> fp32 logits [B, T, V].

        positions [B, T] (default 0..T-1) drive RoPE and the causal mask; tokens attend only within their
        segment_ids [B, T] (default all 0). `swiftkv` picks the wiring of layers >= l.
        """
        cfg = self.config
        if swiftkv and not cfg.is_swiftkv:
            raise ValueError("swiftkv=True needs a SwiftKV model: this one has no SwiftKV layers (see to_swiftkv)")
        batch, length = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        if segment_ids is None:
            segment_ids = jnp.zeros((batch, length), jnp.int32)
        rope = rope_angles(cfg.rope, cfg.head_dim, positions)

        embedder = Embedder(cfg, name="embed_tokens")
        h = embedder(tokens)
        self.sow("intermediates", "embeddings", h)
        lower = scanned_layers(cfg, cfg.num_lower_layers, has_swiftkv_query=False, name="layers")
        h, _ = lower(h, rope, positions, segment_ids, None)

        if cfg.is_swiftkv:
            x_swiftkv = None
            if swiftkv or self.is_initializing():
                x_swiftkv = RMSNorm(cfg, name="norm_swiftkv")(h)
            if cfg.num_kv_groups:
                groups = nn.scan(
                    SwiftKVGroup,
                    variable_axes={"params": 0, "intermediates": 0},
                    split_rngs={"params": True},
                    in_axes=(nn.broadcast,) * 4,
                    length=cfg.num_kv_groups,
                    metadata_params={nn.PARTITION_NAME: "layer_groups"},
                )(cfg, swiftkv, name="swiftkv_groups")
                h, _ = groups(h, x_swiftkv, rope, positions, segment_ids)

        h = RMSNorm(cfg, name="norm")(h)
        if cfg.tie_word_embeddings:
            return embedder.attend(h)
        return LMHead(cfg, name="lm_head")(h)
