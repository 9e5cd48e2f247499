"""Shared helpers of the distillation tests (test_distill_step.py, test_train_cli.py)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import numpy as np

import swiftkv_jax as sk
from swiftkv_jax.distill import step as step_lib
from swiftkv_jax.distill import trainable as trainable_lib
from swiftkv_jax.distill.config import LossSection, OptimSection

# Llama-3.1-8B's published config.json (the fields our reader uses); weights are never needed.
LLAMA_3_1_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}
# SWIFTKV.md §4: "Llama-3.1-8B at l=16, g=1: about 403M trainable parameters"; exactly
# 16 layers x (4096^2 (q) + 2 x 4096 x 1024 (k, v)) + 4096 (norm_swiftkv).
LLAMA_8B_TRAINABLE_L16 = 16 * (4096 * 4096 + 2 * 4096 * 1024) + 4096
assert LLAMA_8B_TRAINABLE_L16 == 402_657_280


def write_hf_config(directory, **overrides) -> Path:
    """A teacher directory that holds only config.json (enough for --dry-run and config checks)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**LLAMA_3_1_8B_CONFIG, **overrides}))
    return directory


def tiny_config(**overrides) -> sk.ModelConfig:
    """4 layers, every dimension divisible by 8 (so any mesh of 8 CPU devices shards it), fp32."""
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, initializer_range=0.2)
    return sk.ModelConfig(**{**fields, **overrides})


def student(config: sk.ModelConfig, l: int, g: int = 1, seed: int = 0, mesh=None, noise: float = 0.0):
    """(student config, trainable, frozen) of a random teacher; `noise` perturbs the trainables so that the
    student differs from the teacher already at layer l."""
    model = sk.to_swiftkv(sk.init(config, seed, mesh=mesh), l, g)
    trainable, frozen = trainable_lib.split(model.params)
    if noise:
        leaves, tree = jax.tree.flatten(trainable)
        keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
        trainable = tree.unflatten([jax.device_put(a + noise * jax.random.normal(k, a.shape, a.dtype), a.sharding)
                                    for a, k in zip(leaves, keys)])
    return model.config, trainable, frozen


def packed_batch(vocab_size: int, batch: int = 8, length: int = 24, seed: int = 0) -> dict:
    """Rows like the packer's: 1-3 documents (segment ids 1, 2, ..., positions restarting at 0), then
    padding (segment 0, loss mask 0); a random 0/1 loss mask standing in for the assistant mask."""
    rng = np.random.RandomState(seed)
    out = {k: np.zeros((batch, length), np.int32) for k in step_lib.BATCH_KEYS}
    for row in range(batch):
        used = length - rng.randint(0, length // 3)  # the rest is padding
        cuts = np.sort(rng.choice(np.arange(1, used), rng.randint(0, 3), replace=False))
        for segment, (start, stop) in enumerate(zip(np.r_[0, cuts], np.r_[cuts, used]), start=1):
            out["segment_ids"][row, start:stop] = segment
            out["positions"][row, start:stop] = np.arange(stop - start)
        out["tokens"][row, :used] = rng.randint(1, vocab_size, used)
        out["loss_mask"][row, :used] = rng.rand(used) < 0.6
    return out


@functools.lru_cache(maxsize=None)
def jit_step(config: sk.ModelConfig, loss: LossSection = LossSection(), optim: OptimSection = OptimSection(),
             total_steps: int = 10, grad_accum: int = 1):
    """(jitted train_step, optimizer) on the default device, no shardings; cached, so that tests with the
    same settings share one compilation."""
    optimizer = step_lib.make_optimizer(optim, total_steps)
    fn = jax.jit(functools.partial(step_lib.train_step, config=config, loss=loss, optimizer=optimizer,
                                   schedule=step_lib.learning_rate_schedule(optim, total_steps),
                                   grad_accum=grad_accum))
    return fn, optimizer


def init_state(trainable, optimizer) -> step_lib.TrainState:
    return step_lib.TrainState(jax.numpy.zeros((), jax.numpy.int32), trainable, optimizer.init(trainable))


def assert_trees_close(a, b, rtol: float, atol: float = 0.0):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def numpy_kl(teacher_logits, student_logits, temperature):
    """KL(teacher || student) per position of the temperature-softened distributions, in float64."""
    def log_softmax(x):
        x = np.asarray(x, np.float64) / temperature
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    t, s = log_softmax(teacher_logits), log_softmax(student_logits)
    return (np.exp(t) * (t - s)).sum(-1)


def n_params(tree) -> int:
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(tree))
