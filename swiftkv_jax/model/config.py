"""Model configuration: the architecture (read from / written to HF `config.json`) and the runtime policy.

Field names follow Hugging Face's `LlamaConfig` so the mapping to `config.json` stays obvious. The config
is frozen and hashable: it is a static argument of every jitted function.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

import numpy as np

from swiftkv_jax.checks import ArgumentError, flag, integer, real, token_ids
from swiftkv_jax.dtypes import dtype_name
from swiftkv_jax.model.attention import ATTENTION_IMPLS, DECODE_ATTENTION_IMPLS

# none: keep every activation; full: keep only each layer's input; dots: keep matmul outputs too.
REMAT_POLICIES = ("none", "full", "dots")

FAMILIES = ("llama", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding as transformers defines it (`rope_type` default | linear | llama3)."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.type not in ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_type {self.type!r}: supported are {', '.join(ROPE_TYPES)}"
            )
        # 0, a negative or a NaN gave NaN logits (theta ** x, the divisions by factor and by the llama3 band)
        for name in ("theta", "factor", "low_freq_factor", "high_freq_factor"):
            object.__setattr__(self, name, real(f"rope {name}", getattr(self, name), positive=True))
        integer("rope original_max_position_embeddings", self.original_max_position_embeddings, minimum=1)
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError("llama3 rope needs high_freq_factor > low_freq_factor")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder, optionally with SwiftKV layers.

    `num_key_value_layers` (l) is None for a plain model; a SwiftKV model has l in [1, L], layers >= l read
    their K/V from `norm_swiftkv` of layer l's input, shared by groups of `key_value_group_size` (g) layers.
    """

    family: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # llama: attention_bias; qwen2: always
    o_bias: bool = False  # llama: attention_bias; qwen2: never
    mlp_bias: bool = False
    # SwiftKV
    num_key_value_layers: Optional[int] = None
    key_value_group_size: int = 1
    # Token ids, kept for generation and export
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[tuple[int, ...]] = None
    pad_token_id: Optional[int] = None
    # Runtime policy: storage and compute dtypes are independent; norms' statistics, softmax and logits
    # are always fp32.
    param_dtype: str = "float32"
    dtype: str = "float32"
    attention_impl: str = "xla_flash"  # serving prefill and `logits`; training configs pick a differentiable one
    decode_attention_impl: str = "xla"  # few queries over a KV cache (serving decode, SwiftKV's later layers)
    remat: str = "none"  # activation checkpointing of each layer in backward passes; see REMAT_POLICIES
    # rows attended without a cache are packed documents (positions rising within each run of equal segment ids)
    # holding at most this many runs (documents, padding): lets attention_impl "cudnn" use cuDNN's causal mask over
    # its packed layout, not a [T, S] bias, and "xla_chunked" skip the keys past each query block (the trainer
    # sets it from its packed data, `swiftkv_jax.data.packing.max_runs`)
    max_segments_per_row: Optional[int] = None
    initializer_range: float = 0.02
    # config.json keys we do not interpret, as sorted JSON, so export loses nothing.
    hf_extra: str = "{}"

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unsupported model family {self.family!r}: supported are {', '.join(FAMILIES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "key_value_group_size",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:  # True is an int
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias"):
            flag(name, getattr(self, name))  # bool("false") is True: another parameter tree
        # text failed inside the first trace; 0 or less gave NaN logits
        object.__setattr__(self, "rms_norm_eps", real("rms_norm_eps", self.rms_norm_eps, positive=True))
        object.__setattr__(self, "initializer_range", real("initializer_range", self.initializer_range))
        if not isinstance(self.rope, RopeConfig):  # a dict failed at the first trace, naming neither
            raise ArgumentError(f"rope must be a RopeConfig (RopeConfig(**fields) for a dict of its fields), got "
                                f"{self.rope!r:.80}", "rope")
        # HF's config.json gives one id or a list (Llama-3.1's three); generate and the Engine iterate over a tuple
        # and the config is hashed (a static argument): an int or a list failed there, naming neither
        eos = self.eos_token_id
        if eos is not None:
            ids = token_ids("eos_token_id", [eos] if isinstance(eos, (int, np.integer)) else eos)
            object.__setattr__(self, "eos_token_id", tuple(ids))
        # text was written to config.json as text; the pad id is only written back there, and LLaMA-1's conversions
        # carry -1: any int
        for name in ("bos_token_id", "pad_token_id"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, integer(name, getattr(self, name), optional=True))
        # outside the vocabulary, a BOS fails every prompt it starts and an EOS is never sampled (generation never
        # stops on it)
        for name, ids in (("bos_token_id", (self.bos_token_id,)), ("eos_token_id", self.eos_token_id or ())):
            outside = [t for t in ids if t is not None and not 0 <= t < self.vocab_size]
            if outside:
                raise ArgumentError(f"{name} {outside[0]} lies outside the vocabulary [0, {self.vocab_size}) "
                                    f"(vocab_size): give an id inside it, or None", name)
        try:  # a dict is unhashable (the config is a static argument) and text that is not JSON failed at sk.save
            extra = json.loads(self.hf_extra) if isinstance(self.hf_extra, str) else None
        except json.JSONDecodeError:
            extra = None
        if not isinstance(extra, dict):
            raise ArgumentError(f"hf_extra must be a str holding a JSON object (config.json keys kept for export), "
                                f"e.g. json.dumps(keys, sort_keys=True), got {self.hf_extra!r:.80}", "hf_extra")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        object.__setattr__(self, "param_dtype", dtype_name(self.param_dtype))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"unknown attention_impl {self.attention_impl!r}: available are {', '.join(ATTENTION_IMPLS)}"
            )
        if self.decode_attention_impl not in DECODE_ATTENTION_IMPLS:
            raise ValueError(f"unknown decode_attention_impl {self.decode_attention_impl!r}: available are "
                             f"{', '.join(DECODE_ATTENTION_IMPLS)}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"unknown remat {self.remat!r}: available are {', '.join(REMAT_POLICIES)}")
        runs = self.max_segments_per_row
        if runs is not None and (isinstance(runs, bool) or not isinstance(runs, int) or runs < 1):
            raise ValueError(f"max_segments_per_row must be a positive int or None, got {runs!r}")
        if self.num_key_value_layers is not None:
            check_swiftkv_layout(self.num_hidden_layers, self.num_key_value_layers, self.key_value_group_size)
        elif self.key_value_group_size != 1:
            raise ValueError("key_value_group_size > 1 needs num_key_value_layers (AcrossKV is part of SwiftKV)")

    # SwiftKV layout ---------------------------------------------------------------------------------

    @property
    def is_swiftkv(self) -> bool:
        return self.num_key_value_layers is not None

    @property
    def num_lower_layers(self) -> int:
        """l: layers that compute their own K/V (all L for a plain model)."""
        return self.num_hidden_layers if self.num_key_value_layers is None else self.num_key_value_layers

    @property
    def num_kv_groups(self) -> int:
        """(L - l) / g: AcrossKV groups among the later layers, each with one owner's K/V."""
        return (self.num_hidden_layers - self.num_lower_layers) // self.key_value_group_size

    @property
    def num_kv_cache_layers(self) -> int:
        """Layers of K/V a serving cache holds: l + (L - l) / g."""
        return self.num_lower_layers + self.num_kv_groups

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def serves_swiftkv(config: ModelConfig, swiftkv) -> bool:
    """The wiring a `swiftkv` argument asks for: None, the model's own (SwiftKV for a SwiftKV model); True or False.
    Anything else raises: bool("false") is True, and would serve the SwiftKV wiring asked to be off."""
    if swiftkv is None:
        return config.is_swiftkv
    if not isinstance(swiftkv, (bool, np.bool_)):
        raise ValueError(f"swiftkv must be True, False or None (None: the model's own wiring), got {swiftkv!r}")
    return bool(swiftkv)


def check_swiftkv_layout(num_layers: int, num_key_value_layers, group_size) -> None:
    """Raise ValueError unless 1 <= l <= L and g divides L - l."""
    if (isinstance(num_key_value_layers, bool) or not isinstance(num_key_value_layers, int)  # True is an int
            or not 1 <= num_key_value_layers <= num_layers):
        raise ValueError(
            f"num_key_value_layers must be an int in [1, {num_layers}] (the model has {num_layers} layers), "
            f"got {num_key_value_layers!r}"
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"key_value_group_size must be a positive int, got {group_size!r}")
    if (num_layers - num_key_value_layers) % group_size:
        raise ValueError(
            f"key_value_group_size {group_size} must divide the {num_layers - num_key_value_layers} layers "
            f"after num_key_value_layers={num_key_value_layers} (L - l = {num_layers} - {num_key_value_layers})"
        )
