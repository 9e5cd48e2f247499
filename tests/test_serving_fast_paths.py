"""The serving engine's fast paths against their references: blockwise prefill attention (`xla_flash`), few-query
attention over the [B, K, S, H] cache, and a decode step that updates the cache in place (checked on the compiled
program, so that a full-cache copy cannot come back unnoticed)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_reference
import swiftkv_jax as sk
from swiftkv_jax.kernels import decode_attention_reference
from swiftkv_jax.model.attention import attend_cache, xla_attention, xla_flash_attention
from swiftkv_jax.model.cached import unstack_layers
from swiftkv_jax.serving import decode_step, init_cache


def _inputs(b, t, s, n, kv_heads, h, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=(b, length, heads, h)), jnp.float32)
                 for length, heads in ((t, n), (s, kv_heads), (s, kv_heads)))


FLASH_CASES = {
    # causal prefill from position 0, not a multiple of either block, GQA 3
    "causal": dict(t=150, s=150, n=6, kv_heads=2, start=0, tail=0, packed=False),
    # a chunk of queries after 70 cached tokens, over a cache with 37 unused entries (segment -1)
    "chunk-over-cache": dict(t=90, s=197, n=4, kv_heads=4, start=70, tail=37, packed=False),
    # packed documents (positions restart, segments differ), GQA 4
    "packed": dict(t=130, s=130, n=8, kv_heads=2, start=0, tail=0, packed=True),
}


@pytest.mark.parametrize("name", FLASH_CASES)
def test_xla_flash_equals_xla_and_float64(name):
    c = FLASH_CASES[name]
    b, h = 2, 16
    q, k, v = _inputs(b, c["t"], c["s"], c["n"], c["kv_heads"], h)
    q_pos = jnp.broadcast_to(c["start"] + jnp.arange(c["t"]), (b, c["t"])).astype(jnp.int32)
    kv_pos = jnp.broadcast_to(jnp.arange(c["s"]), (b, c["s"])).astype(jnp.int32)
    q_seg, kv_seg = jnp.zeros_like(q_pos), jnp.where(kv_pos < c["s"] - c["tail"], 0, -1)
    if c["packed"]:
        split = c["t"] // 3
        q_seg = kv_seg = jnp.broadcast_to((jnp.arange(c["t"]) >= split).astype(jnp.int32), (b, c["t"]))
        q_pos = kv_pos = jnp.where(q_seg == 0, jnp.arange(c["t"]), jnp.arange(c["t"]) - split).astype(jnp.int32)
    args = (q, k, v, q_pos, kv_pos, q_seg, kv_seg)
    flash = jax.jit(functools.partial(xla_flash_attention, block_q=32, block_k=48))(*args)
    np.testing.assert_allclose(flash, xla_attention(*args), atol=2e-6)
    np.testing.assert_allclose(flash, numpy_reference.attention_float64(*args), atol=2e-5)


def test_xla_flash_packed_prompts_over_a_context():
    """The continuous-batching engine's prompt row: five packed prompts (positions restart, segments in order, one
    of them empty of keys beyond its own), segment 0 also seeing 50 cached keys of its own (and 30 unused ones)
    ahead of the row; blocks whose segments cannot meet are skipped, the result is unchanged."""
    b, h, t, context, unused = 1, 16, 150, 50, 30
    q, k, v = _inputs(b, t, context + unused + t, 8, 2, h, seed=4)
    bounds = [0, 40, 41, 90, 140, 150]
    seg = np.zeros(t, np.int32)
    pos = np.zeros(t, np.int32)
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        seg[lo:hi], pos[lo:hi] = i, np.arange(hi - lo) + (context if i == 0 else 0)
    kv_seg = np.concatenate([np.zeros(context), np.full(unused, -2), seg]).astype(np.int32)
    kv_pos = np.concatenate([np.arange(context + unused), pos]).astype(np.int32)
    args = (q, k, v, jnp.asarray(pos)[None], jnp.asarray(kv_pos)[None], jnp.asarray(seg)[None],
            jnp.asarray(kv_seg)[None])
    flash = jax.jit(functools.partial(xla_flash_attention, block_q=32, block_k=32))(*args)
    np.testing.assert_allclose(flash, xla_attention(*args), atol=2e-6)
    np.testing.assert_allclose(flash, numpy_reference.attention_float64(*args), atol=2e-5)


def test_xla_flash_skips_nothing_it_needs_and_zeros_unseen_queries():
    """Queries whose keys all lie in a skipped block still get them; a query that sees no key gets zeros."""
    b, t, h = 1, 64, 16
    q, k, v = _inputs(b, t, t, 2, 1, h, seed=1)
    q_pos = jnp.arange(t, dtype=jnp.int32)[None]
    kv_pos = q_pos[:, ::-1]  # keys in reverse order: the first key block holds the largest positions
    q_seg = jnp.where(jnp.arange(t) == 5, 7, 0)[None].astype(jnp.int32)  # query 5 alone in segment 7
    args = (q, k, v, q_pos, kv_pos, q_seg, jnp.zeros_like(q_seg))
    flash = xla_flash_attention(*args, block_q=16, block_k=16)
    np.testing.assert_allclose(flash, numpy_reference.attention_float64(*args), atol=2e-5)
    assert np.all(np.asarray(flash[0, 5]) == 0)



def test_xla_flash_bf16_is_as_accurate_as_torch_sdpa():
    """bf16 at head dim 128 (1/sqrt(128) is no power of two) and sharp attention (scores' std ~9), against float64
    of the same bf16 values: no worse than torch's sdpa, transformers' default attention. Pre-scaling the bf16 q
    rounded every query: 2.6x sdpa's mean error and 3.8x its largest."""
    import torch

    b, t, n, kv_heads, h = 1, 192, 4, 2, 128
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, heads, h)) * scale, jnp.bfloat16)
               for heads, scale in ((n, 3), (kv_heads, 3), (kv_heads, 1)))
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    seg = jnp.zeros_like(pos)
    want = numpy_reference.attention_float64(*(np.asarray(a, np.float32) for a in (q, k, v)), pos, pos, seg, seg)
    got = jax.jit(functools.partial(xla_flash_attention, block_q=64, block_k=64))(q, k, v, pos, pos, seg, seg)
    tq, tk, tv = (torch.from_numpy(np.asarray(a, np.float32)).bfloat16().transpose(1, 2) for a in (q, k, v))
    peer = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)
    ours, theirs = (np.abs(np.asarray(x, np.float64) - want) for x in (got, peer.transpose(1, 2).double().numpy()))
    assert ours.mean() <= 1.25 * theirs.mean(), (ours.mean(), theirs.mean())
    assert ours.max() <= 1.5 * theirs.max(), (ours.max(), theirs.max())

@pytest.mark.parametrize("t,n,kv_heads", [(1, 4, 4), (1, 8, 2), (3, 8, 1), (16, 6, 2)])
def test_few_query_cache_attention_equals_the_kernel_reference(t, n, kv_heads):
    """The XLA few-query path over the [B, K, S, H] cache against the Pallas kernel's jnp reference, which
    takes the cache as [B, S, K, H]: ragged lengths (one empty), queries at and before each length."""
    b, s, h = 3, 40, 16
    q, k, v = _inputs(b, t, s, n, kv_heads, h, seed=2)
    lengths = jnp.asarray([0, 17, 40], jnp.int32)
    q_pos = jnp.maximum(lengths[:, None] - t + jnp.arange(t), 0).astype(jnp.int32)
    got = attend_cache("xla", q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), q_pos, lengths)
    np.testing.assert_allclose(got, decode_attention_reference(q, k, v, lengths, q_pos), atol=2e-6)


def test_xla_flash_prefill_serves_what_xla_serves():
    """attention_impl="xla_flash" in the engine: prompts past one query block, one of them chunked."""
    cfg = sk.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.2)
    model = sk.to_swiftkv(sk.init(cfg, 3), 2, 1)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 96, 300).tolist(), rng.integers(0, 96, 261).tolist()]
    for swiftkv in (True, False):
        kwargs = dict(max_new_tokens=6, swiftkv=swiftkv, cache_dtype="float32", logprobs=True, stop_token_ids=[])
        want = sk.generate(model, prompts, **kwargs, attention_impl="xla")
        got = sk.generate(model, prompts, **kwargs, attention_impl="xla_flash")
        assert got.tokens == want.tokens
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)
        chunked = sk.generate(model, prompts, **kwargs, attention_impl="xla_flash", prefill_chunk=100)
        assert chunked.tokens == want.tokens


@pytest.mark.parametrize("swiftkv", [False, True])
def test_decode_step_updates_the_cache_in_place(swiftkv):
    """The compiled decode step aliases the donated cache to its output and allocates less scratch than half of
    one layer's K: a copy or transpose of any cache array (the scanned-cache engine copied the whole cache
    every step) would need at least one. It reads every weight in place, too."""
    cfg = sk.ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    model = sk.to_swiftkv(sk.init(cfg, 0), 2, 1)
    cache = init_cache(model.config, 3, 2048, swiftkv, "float32")
    layer_bytes = cache.lower[0][0].nbytes
    step = jax.jit(functools.partial(decode_step, config=model.config, swiftkv=swiftkv), donate_argnums=(1,))
    compiled = step.lower(unstack_layers(model.params, model.config), cache, jnp.zeros(3, jnp.int32)).compile()
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes >= cache.nbytes
    assert memory.temp_size_in_bytes < layer_bytes / 2, (memory.temp_size_in_bytes, layer_bytes)
    shape = "f32[" + ",".join(map(str, cache.lower[0][0].shape)) + "]"
    copies = re.findall(re.escape(shape) + r"\{[^}]*\} (copy|transpose)\(", compiled.as_text())
    assert not copies
    assert not _weight_copies(compiled.as_text())


def _weight_copies(hlo: str) -> list[str]:
    """The weights (entry parameters named params...) that a copy or transpose of the compiled program reads."""
    weights = set(re.findall(r"%(params\S*) = \S+ parameter\(", hlo))
    assert weights, "the program names no weight parameter: the check would pass vacuously"
    reads = re.findall(r"%\S*(?:copy|transpose)\S* = \S+ (?:fusion|copy|transpose)\(%(params[^,)\s]*)", hlo)
    return sorted(set(reads) & weights)


@pytest.mark.parametrize("wiring,dtype", [("teacher", "float32"), ("swiftkv", "float32"),
                                          pytest.param("swiftkv", "bfloat16", marks=pytest.mark.gpu)])
def test_engine_steps_read_every_weight_in_place(wiring, dtype):
    """Every program of `sk.Engine` (decode and mixed steps) reads the weights where they are: XLA once transposed
    each o_proj kernel (a multi-axis contraction) and the owners' stacked k/v_proj_swiftkv at every step, a copy of
    those weights per token (~15% of the CPU engine's decode step). The gpu case checks the GPU's compiled steps."""
    cfg = sk.ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, dtype=dtype, param_dtype=dtype)
    model = sk.to_swiftkv(sk.init(cfg, 0), 2, 1)
    engine = sk.Engine(model, swiftkv=wiring == "swiftkv", page_size=16, num_pages=64, max_num_seqs=8,
                       max_num_batched_tokens=64, cache_dtype=dtype, single_buckets=(8,), prompt_buckets=(64,),
                       max_model_len=256)
    for program in engine.programs():
        assert not _weight_copies(engine.lower(*program).compile().as_text()), program
