"""A float64 numpy Llama/SwiftKV forward over Hugging Face tensor names, written from ../shared/SWIFTKV.md.

Independent of the JAX code: it reads a checkpoint's tensors by their published names, loops over layers,
and uses none of swiftkv_jax. Its teacher mode is itself checked against transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


def load_tensors(path) -> tuple[dict, dict]:
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update({k: v.astype(np.float64) for k, v in load_file(file).items()})
    return config, tensors


def _rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _linear(t, name, x):
    y = x @ t[name + ".weight"].T
    return y + t[name + ".bias"] if name + ".bias" in t else y


def _inv_freq(config, head_dim):
    # transformers 5.x nests RoPE under rope_parameters; 4.x (and our export) keeps it top-level.
    scaling = config.get("rope_parameters") or dict(config.get("rope_scaling") or {})
    theta = scaling.get("rope_theta", config.get("rope_theta", 10000.0))
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * np.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        inv = np.where(wavelen > old / low, inv / factor,
                       np.where(wavelen < old / high, inv, (1 - smooth) * inv / factor + smooth * inv))
    return inv


def _rope(x, positions, inv_freq):  # x [T, heads, H]
    angles = positions[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    a, b = np.split(x, 2, axis=-1)
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _attention(q, k, v):  # q [T, N, H], k/v [T, K, H], causal
    t, n, h = q.shape
    k = np.repeat(k, n // k.shape[1], axis=1)
    v = np.repeat(v, n // v.shape[1], axis=1)
    scores = np.einsum("tnh,snh->nts", q, k) / np.sqrt(h)
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("nts,snh->tnh", probs, v).reshape(t, n * h)


def forward(config: dict, t: dict, tokens: np.ndarray, swiftkv: bool) -> np.ndarray:
    """Logits [T, V] of one sequence, in the teacher or the SwiftKV wiring."""
    n_layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    eps = config["rms_norm_eps"]
    l = config.get("num_key_value_layers") or n_layers
    g = config.get("key_value_group_size") or 1
    positions = np.arange(len(tokens), dtype=np.float64)
    inv_freq = _inv_freq(config, head_dim)
    length = len(tokens)

    h = t["model.embed_tokens.weight"][tokens]
    shared = {}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        x = _rms_norm(h, t[p + "input_layernorm.weight"], eps)
        if swiftkv and i >= l:
            if i == l:  # every later layer's K/V comes from the input of layer l
                x_kv = _rms_norm(h, t["model.norm_swiftkv.weight"], eps)
                for owner in range(l, n_layers, g):
                    o = f"model.layers.{owner}.self_attn."
                    k = _linear(t, o + "k_proj_swiftkv", x_kv).reshape(length, kv_heads, head_dim)
                    v = _linear(t, o + "v_proj_swiftkv", x_kv).reshape(length, kv_heads, head_dim)
                    shared[owner] = (_rope(k, positions, inv_freq), v)
            q = _linear(t, p + "self_attn.q_proj_swiftkv", x).reshape(length, heads, head_dim)
            k, v = shared[l + (i - l) // g * g]
        else:
            q = _linear(t, p + "self_attn.q_proj", x).reshape(length, heads, head_dim)
            k = _rope(_linear(t, p + "self_attn.k_proj", x).reshape(length, kv_heads, head_dim), positions, inv_freq)
            v = _linear(t, p + "self_attn.v_proj", x).reshape(length, kv_heads, head_dim)
        h = h + _linear(t, p + "self_attn.o_proj", _attention(_rope(q, positions, inv_freq), k, v))
        x = _rms_norm(h, t[p + "post_attention_layernorm.weight"], eps)
        gate, up = _linear(t, p + "mlp.gate_proj", x), _linear(t, p + "mlp.up_proj", x)
        h = h + _linear(t, p + "mlp.down_proj", gate / (1 + np.exp(-gate)) * up)
    h = _rms_norm(h, t["model.norm.weight"], eps)
    head = t["model.embed_tokens.weight"] if config.get("tie_word_embeddings") else t["lm_head.weight"]
    return h @ head.T


def attention_float64(q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    """Attention by loops in float64: q [B, T, N, H], k/v [B, S, K, H]; query (b, t) sees the keys of its segment
    at positions <= its own; a query that sees none gets zeros."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, n, h = q.shape
    group = n // k.shape[2]
    out = np.zeros_like(q)
    for bi in range(b):
        for ti in range(t):
            visible = (kv_pos[bi] <= q_pos[bi, ti]) & (kv_seg[bi] == q_seg[bi, ti])
            for ni in range(n):
                if not visible.any():
                    continue
                s = k[bi, visible, ni // group] @ q[bi, ti, ni] / np.sqrt(h)
                p = np.exp(s - s.max())
                out[bi, ti, ni] = (p / p.sum()) @ v[bi, visible, ni // group]
    return out


def sampling_distribution(logits, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The next-token distribution [V] of one logits row as vLLM and Hugging Face define it, in float64: softmax at
    the temperature, the top_k most likely kept (0: all; any tied with the k-th too), then the smallest prefix of
    those, most likely first, whose mass reaches top_p (the first always), renormalised."""
    scaled = np.asarray(logits, np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(probs, kind="stable")[::-1]  # a tie's higher ids first: their ascending sort, reversed
    keep = probs >= probs[order[min(top_k or len(probs), len(probs)) - 1]]  # ties with the k-th kept, as theirs
    kept = np.where(keep, probs, 0.0) / probs[keep].sum()
    mass_before = np.cumsum(kept[order]) - kept[order]
    keep[order[mass_before >= top_p]] = False
    out = np.where(keep, probs, 0.0)
    return out / out.sum()
