"""`config.json` <-> ModelConfig, for transformers 4.x (top-level `rope_theta`/`rope_scaling`, `torch_dtype`)
and 5.x (nested `rope_parameters`, `dtype`), plain and SwiftKV (../shared/SWIFTKV.md §5).
"""

from __future__ import annotations

import json
from typing import Optional

from swiftkv_jax.dtypes import DTYPES, dtype_name
from swiftkv_jax.model.config import ModelConfig, RopeConfig

# model_type -> (family, has SwiftKV layers, architecture)
MODEL_TYPES = {
    "llama": ("llama", False, "LlamaForCausalLM"),
    "llama_swiftkv": ("llama", True, "LlamaSwiftKVForCausalLM"),
    "qwen2": ("qwen2", False, "Qwen2ForCausalLM"),
    "qwen2_swiftkv": ("qwen2", True, "Qwen2SwiftKVForCausalLM"),
}

# Keys read into ModelConfig, or deliberately dropped: rewritten on export (use_sliding_window: false), or unused
# (sliding_window, max_window_layers, layer_types say nothing once no layer slides, and are not written back).
_CONSUMED = {
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "max_position_embeddings", "tie_word_embeddings", "attention_bias",
    "mlp_bias", "num_key_value_layers", "key_value_group_size", "swiftkv", "bos_token_id", "eos_token_id",
    "pad_token_id", "torch_dtype", "dtype", "initializer_range", "transformers_version", "pretraining_tp",
    "use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
}


def _rope_from_hf(d: dict) -> RopeConfig:
    params = d.get("rope_parameters")  # transformers 5.x; 4.x: rope_scaling, with rope_theta beside it
    params = dict((d.get("rope_scaling") or {}) if params is None else params)
    params.setdefault("rope_theta", d.get("rope_theta", 10000.0))  # as transformers 5 reads rope_parameters too
    rope_type = params.get("rope_type", params.get("type", "default"))
    known = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings"}
    if rope_type == "default":
        known = {"rope_type", "type", "rope_theta"}
    elif rope_type == "linear":
        known = {"rope_type", "type", "rope_theta", "factor"}
    unknown = set(params) - known
    if unknown:
        raise ValueError(f"unsupported RoPE settings {sorted(unknown)} for rope_type {rope_type!r}")
    # as given, not through float() or int(): RopeConfig refuses text, 0 and negatives
    fields = {"theta": params["rope_theta"], "type": rope_type}
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if key in params:
            fields[key] = params[key]
    return RopeConfig(**fields)


def _rope_to_hf(rope: RopeConfig) -> Optional[dict]:
    if rope.type == "default":
        return None
    out = {"rope_type": rope.type, "factor": rope.factor}
    if rope.type == "llama3":
        out.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor,
                   original_max_position_embeddings=rope.original_max_position_embeddings)
    return out


def stored_dtype(d: dict) -> Optional[str]:
    """The dtype config.json declares for its weights (`dtype` in 5.x, `torch_dtype` in 4.x), if any."""
    key = "dtype" if "dtype" in d else "torch_dtype"
    value = d.get(key)
    try:
        return None if value is None else dtype_name(value)
    except ValueError:  # dtype_name's fix names spellings of an argument; the callers name theirs
        raise ValueError(f"unknown dtype {value!r} ({key} in config.json): the weights load in "
                         f"{', '.join(DTYPES)}") from None


def config_from_hf(d: dict, **runtime) -> ModelConfig:
    """ModelConfig from a parsed config.json; `runtime` sets param_dtype, dtype, attention_impl."""
    model_type = d.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r} in config.json: supported are {', '.join(MODEL_TYPES)}"
        )
    family, is_swiftkv, _ = MODEL_TYPES[model_type]
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in d]
    if missing:
        raise ValueError(f"config.json lacks required field(s) {missing}")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}: only 'silu' is supported")
    if d.get("use_sliding_window"):
        raise ValueError("sliding-window attention (use_sliding_window: true) is not supported")
    if any(t != "full_attention" for t in d.get("layer_types") or ()):
        raise ValueError(f"only full-attention layers are supported, config.json has layer_types {d['layer_types']}")
    heads = d["num_attention_heads"]
    num_layers = d["num_hidden_layers"]

    def get(key, default):  # absent or null means the default; 0 stays 0 and fails validation
        value = d.get(key)
        return default if value is None else value

    fields = dict(
        family=family,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=get("num_key_value_heads", heads),
        # the default only from ints: ModelConfig names a field of another type (text // text raised TypeError here)
        head_dim=get("head_dim", d["hidden_size"] // heads if all(
            isinstance(d[k], int) and not isinstance(d[k], bool) and d[k] > 0
            for k in ("hidden_size", "num_attention_heads")) else None),
        # as given, not through float() or bool(): ModelConfig refuses text ("false" is True), 0 and negatives
        rms_norm_eps=get("rms_norm_eps", 1e-6),
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        tie_word_embeddings=get("tie_word_embeddings", False),
        qkv_bias=True if family == "qwen2" else get("attention_bias", False),
        o_bias=False if family == "qwen2" else get("attention_bias", False),
        mlp_bias=get("mlp_bias", False),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),  # one id or a list: ModelConfig makes a tuple of either
        pad_token_id=d.get("pad_token_id"),
        initializer_range=get("initializer_range", 0.02),
        hf_extra=json.dumps({k: v for k, v in d.items() if k not in _CONSUMED}, sort_keys=True),
    )
    if is_swiftkv:
        fields["num_key_value_layers"] = get("num_key_value_layers", num_layers)
        fields["key_value_group_size"] = get("key_value_group_size", 1)
    try:
        config = ModelConfig(rope=_rope_from_hf(d), **fields)
    except ValueError as e:  # the field is named as ModelConfig's; say where its value came from
        raise ValueError(f"{e} (in config.json)") from None
    return config.replace(**runtime)  # after: a bad argument is the caller's, not config.json's


def config_to_hf(cfg: ModelConfig, dtype: Optional[str] = None) -> dict:
    """config.json for `cfg` in the transformers 4.x layout that the published SwiftKV models use
    (transformers 5.x reads it too). `dtype` is the weights' dtype on disk (default: param_dtype)."""
    model_type = cfg.family + ("_swiftkv" if cfg.is_swiftkv else "")
    d = json.loads(cfg.hf_extra)
    d.update(
        architectures=[MODEL_TYPES[model_type][2]],
        model_type=model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope.theta,
        rope_scaling=_rope_to_hf(cfg.rope),
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=(None if cfg.eos_token_id is None else
                      cfg.eos_token_id[0] if len(cfg.eos_token_id) == 1 else list(cfg.eos_token_id)),
        pad_token_id=cfg.pad_token_id,
        torch_dtype=dtype_name(dtype or cfg.param_dtype),
    )
    if cfg.family == "llama":
        if cfg.qkv_bias != cfg.o_bias:
            raise ValueError("a llama config has one attention_bias for q/k/v/o; q/k/v-only bias is qwen2's")
        d.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    else:
        if not cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias:
            raise ValueError("qwen2 has q/k/v bias, no o_proj or MLP bias; this config differs")
        d.setdefault("use_sliding_window", False)
    if cfg.is_swiftkv:
        d.update(num_key_value_layers=cfg.num_key_value_layers, key_value_group_size=cfg.key_value_group_size,
                 swiftkv=True)
    return dict(sorted(d.items()))
