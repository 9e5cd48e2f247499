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
