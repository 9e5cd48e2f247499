"""Tiny random `transformers` models, saved with `save_pretrained`: the peer we compare against."""

from __future__ import annotations

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # far below the test prompts' length, so all three wavelength bands are exercised
               "original_max_position_embeddings": 128}


def tiny_hf_config(family: str = "llama", **overrides):
    config_cls, _ = FAMILIES[family]
    fields = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                  rms_norm_eps=1e-6)
    fields.update(overrides)
    return config_cls(**fields)


def make_hf_model(path, family: str = "llama", seed: int = 0, torch_dtype=torch.float32, **overrides):
    """A random model whose norms and biases are perturbed too (transformers inits them to 1 and 0,
    which would hide a norm or bias mix-up), saved to `path`. Returns the fp32 torch model."""
    torch.manual_seed(seed)
    _, model_cls = FAMILIES[family]
    model = model_cls(tiny_hf_config(family, **overrides)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    model.to(torch_dtype).save_pretrained(path)
    return model.float()


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


def random_tokens(vocab_size: int, batch: int = 2, length: int = 520, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, vocab_size, (batch, length))


# Checkpoint-format helpers, written from the documented HF layout (../shared/SWIFTKV.md §5), independently of
# swiftkv_jax.checkpoints, so that tests can check what the library reads and writes.

def hf_tensors_from_params(params) -> dict:
    """Our parameter tree -> {HF tensor name: numpy array in torch layout ([out, in] for Linear weights)}.

    Kernels store input dims first (o_proj: [N, H, D], the rest: [D, ...] or [F, D]); biases and norms only
    flatten. Layers: `layers/...` [l, ...] are layers 0..l-1, `swiftkv_groups/layers/...` [G, g, ...] are layer
    l + G * g + member, `swiftkv_groups/{k,v}_proj_swiftkv/...` [G, ...] belong to the owner l + G * g.
    """
    import jax

    p = jax.tree.map(np.asarray, params)

    def hf_layout(module: str, leaf_name: str, a: np.ndarray) -> tuple[str, np.ndarray]:
        if leaf_name == "kernel":
            in_dims = a.reshape(-1, a.shape[-1]) if module.endswith("o_proj") else a.reshape(a.shape[0], -1)
            return "weight", in_dims.T
        if leaf_name == "bias":
            return "bias", a.reshape(-1)
        assert leaf_name == "scale", leaf_name
        return "weight", a

    def layer_tensors(tree, prefix: str, out: dict, index):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            keys = [k.key for k in path]
            suffix, value = hf_layout(".".join(keys[:-1]), keys[-1], leaf[index])
            out[f"{prefix}.{'.'.join(keys[:-1])}.{suffix}"] = value

    out = {"model.embed_tokens.weight": p["embed_tokens"]["embedding"], "model.norm.weight": p["norm"]["scale"]}
    if "lm_head" in p:
        out["lm_head.weight"] = p["lm_head"]["kernel"].T
    if "norm_swiftkv" in p:
        out["model.norm_swiftkv.weight"] = p["norm_swiftkv"]["scale"]
    lower = jax.tree.leaves(p["layers"])[0].shape[0]
    for i in range(lower):
        layer_tensors(p["layers"], f"model.layers.{i}", out, i)
    if "swiftkv_groups" in p:
        groups = p["swiftkv_groups"]
        num_groups, group_size = jax.tree.leaves(groups["layers"])[0].shape[:2]
        for group in range(num_groups):
            owner = lower + group * group_size
            for member in range(group_size):
                layer_tensors(groups["layers"], f"model.layers.{owner + member}", out, (group, member))
            layer_tensors({k: v for k, v in groups.items() if k != "layers"}, f"model.layers.{owner}.self_attn",
                          out, group)
    return out


def read_hf_tensors(path) -> dict:
    """{name: torch tensor, as stored} over a HF directory's safetensors file(s)."""
    from pathlib import Path

    from safetensors.torch import load_file

    out = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(file))
    return out


def safetensors_header(file) -> dict:
    """The JSON header of a .safetensors file: {name: {"dtype", "shape", "data_offsets"}, "__metadata__": ...}."""
    import json
    import struct

    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def file_digests(path) -> dict:
    """{relative path: sha256} of every file under `path` (to prove a directory was left untouched)."""
    import hashlib
    from pathlib import Path

    root = Path(path)
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}
