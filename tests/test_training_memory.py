"""What keeps distillation's memory bounded: query-chunked attention and pinned activation shardings."""

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import swiftkv_jax as sk
from swiftkv_jax import sharding
from swiftkv_jax.distill import step as step_lib
from swiftkv_jax.distill import trainable
from swiftkv_jax.distill.config import LossSection, OptimSection
from swiftkv_jax.model.attention import xla_attention, xla_chunked_attention

from conftest import xla_flags


@pytest.mark.parametrize("length,chunk", [(300, 64), (256, 64), (40, 64)])  # padded, exact, single block
def test_chunked_attention_equals_xla_attention(length, chunk):
    """Values and gradients, with two packed documents and GQA."""
    rng = np.random.default_rng(0)
    b, n, k, h = 2, 4, 2, 8
    q, kk, v = (jnp.asarray(rng.normal(size=(b, length, heads, h)), jnp.float32) for heads in (n, k, k))
    positions = jnp.broadcast_to(jnp.arange(length), (b, length))
    segments = jnp.broadcast_to(1 + (jnp.arange(length) >= length // 3), (b, length))
    chunked = functools.partial(xla_chunked_attention, chunk=chunk)

    def loss(fn, *qkv):
        return jnp.sum(jnp.sin(fn(*qkv, positions, positions, segments, segments)))

    np.testing.assert_allclose(chunked(q, kk, v, positions, positions, segments, segments),
                               xla_attention(q, kk, v, positions, positions, segments, segments), atol=2e-6)
    grads = jax.grad(functools.partial(loss, chunked), argnums=(0, 1, 2))(q, kk, v)
    expected = jax.grad(functools.partial(loss, xla_attention), argnums=(0, 1, 2))(q, kk, v)
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got, want, atol=3e-5, rtol=1e-5)


@pytest.mark.parametrize("queries,keys,chunk", [(40, 70, 16), (600, 1200, 512)])
def test_chunked_attention_over_a_longer_cache_sees_every_key(queries, keys, chunk):
    """A prefill chunk over a cache longer than its padded queries (the serving path of attention_impl="xla_chunked"
    for more than 16 queries): the keys past the padded query count were dropped."""
    rng = np.random.default_rng(1)
    b, n, k, h = 1, 4, 2, 8
    q = jnp.asarray(rng.normal(size=(b, queries, n, h)), jnp.float32)
    kk, v = (jnp.asarray(rng.normal(size=(b, keys, k, h)), jnp.float32) for _ in "kv")
    q_pos = jnp.broadcast_to(keys - queries + jnp.arange(queries), (b, queries))  # the chunk ends the cache
    kv_pos = jnp.broadcast_to(jnp.arange(keys), (b, keys))
    q_seg, kv_seg = jnp.zeros((b, queries), jnp.int32), jnp.zeros((b, keys), jnp.int32)
    np.testing.assert_allclose(xla_chunked_attention(q, kk, v, q_pos, kv_pos, q_seg, kv_seg, chunk=chunk),
                               xla_attention(q, kk, v, q_pos, kv_pos, q_seg, kv_seg), atol=2e-6)


@pytest.mark.parametrize("length,chunk", [(300, 64), (256, 64)])  # padded, exact
def test_own_rows_skip_keys_past_each_block_exactly(length, chunk):
    """Rows as `pack` makes them (three documents, then padding: segment 0 at position 0): values and gradients of
    every document token equal full attention's, for less work."""
    rng = np.random.default_rng(2)
    b, n, k, h = 2, 4, 2, 8
    q, kk, v = (jnp.asarray(rng.normal(size=(b, length, heads, h)), jnp.float32) for heads in (n, k, k))
    cuts = np.array([0, 70, 71, length - 40, length])  # a document of one token; 40 padding positions
    index = np.arange(length)
    doc = np.searchsorted(cuts, index, side="right") - 1
    ids = np.where(doc == 3, 0, doc + 1)
    positions = jnp.asarray(np.broadcast_to(np.where(ids > 0, index - cuts[doc], 0), (b, length)), jnp.int32)
    segments = jnp.asarray(np.broadcast_to(ids, (b, length)), jnp.int32)
    used = (segments > 0)[..., None, None]
    own = functools.partial(xla_chunked_attention, chunk=chunk, own_rows=True)

    def loss(fn, *qkv):
        return jnp.sum(jnp.where(used, jnp.sin(fn(*qkv, positions, positions, segments, segments)), 0.0))

    got = own(q, kk, v, positions, positions, segments, segments)
    want = xla_attention(q, kk, v, positions, positions, segments, segments)
    np.testing.assert_allclose(jnp.where(used, got, 0), jnp.where(used, want, 0), atol=2e-6)
    grads = jax.grad(functools.partial(loss, own), argnums=(0, 1, 2))(q, kk, v)
    expected = jax.grad(functools.partial(loss, xla_attention), argnums=(0, 1, 2))(q, kk, v)
    for g, w in zip(grads, expected):
        np.testing.assert_allclose(g, w, atol=3e-5, rtol=1e-5)

    def flops(own_rows):
        fn = functools.partial(xla_chunked_attention, chunk=chunk, own_rows=own_rows)
        cost = jax.jit(fn).lower(q, kk, v, positions, positions, segments, segments).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]
    # XLA counts a loop body once: one block over the group's keys per group (4 groups of the 4 or 5 blocks),
    # against one block over all `length` keys; the blocks of group g see the keys up to its last block's end
    blocks = -(-length // chunk)
    cuts = [round(g * blocks / 4) for g in range(5)]
    ends = [min(stop * chunk, length) for stop in cuts[1:]]
    assert flops(True) / flops(False) == pytest.approx(sum(ends) / length, rel=0.02)
    work = sum((stop - first) * end for first, stop, end in zip(cuts, cuts[1:], ends)) / (blocks * length)
    assert work < 0.7, work
    with pytest.raises(ValueError, match="attends a row to itself"):
        own(q, kk[:, :-1], v[:, :-1], positions, positions[:, :-1], segments, segments[:, :-1])


def test_chunked_attention_model_matches_xla_model():
    cfg = sk.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.2)
    tokens = np.random.default_rng(1).integers(0, 64, (2, 1100))
    model = sk.init(cfg, 0)
    chunked = sk.Model(cfg.replace(attention_impl="xla_chunked"), model.params)
    np.testing.assert_allclose(sk.logits(chunked, tokens), sk.logits(model, tokens), atol=2e-5)


def _float_all_gather_shapes(hlo: str) -> list[tuple[int, ...]]:
    """Output shapes of the floating-point all-gathers (token ids gathered for the embedding lookup are
    integers, and cheap)."""
    found = re.findall(r"= (bf16|f16|f32)\[([\d,]+)\]\{[^}]*\} all-gather(?:-start)?\(", hlo)
    return [tuple(int(d) for d in dims.split(",")) for _, dims in found]


def test_fsdp_step_gathers_weights_not_the_batch():
    """On an fsdp mesh the step all-gathers each layer's weights, never the batch of activations (GSPMD
    would otherwise gather the batch and have every device compute every sequence)."""
    mesh = sk.make_mesh(data=1, fsdp=8, tensor=1)
    cfg = sk.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=16, remat="full")
    student = sk.to_swiftkv(sk.init(cfg, 0, mesh=mesh), 2)
    train, frozen = trainable.split(student.params)
    optimizer = step_lib.make_optimizer(OptimSection(), 10)
    state = step_lib.TrainState(jnp.zeros((), jnp.int32), train, optimizer.init(train))
    batch_size, length, chunk = 8, 48, 24  # sizes that no weight dimension has
    rows = step_lib.batch_sharding(mesh, sharding.LOGICAL_AXIS_RULES)
    batch = {k: jax.ShapeDtypeStruct((batch_size, length), jnp.int32, sharding=rows) for k in step_lib.BATCH_KEYS}

    def sharded_step(*args):
        with sharding.activation_sharding(mesh):
            return step_lib.train_step(*args, config=student.config, loss=LossSection(chunk_size=chunk),
                                       optimizer=optimizer,
                                       schedule=step_lib.learning_rate_schedule(OptimSection(), 10))

    hlo = jax.jit(sharded_step).lower(state, frozen, batch).compile().as_text()
    gathered = _float_all_gather_shapes(hlo)
    weight_shapes = {tuple(a.shape[1:]) for a in jax.tree.leaves(student.params["layers"])}
    assert weight_shapes & set(gathered), "expected per-layer weight all-gathers (FSDP)"
    batch_like = [s for s in gathered
                  if len(s) >= 2 and s[0] in (batch_size, 2 * batch_size) and s[1] in (length, chunk)]
    assert not batch_like, f"activations gathered over the batch: {batch_like}"


LOAD_STUDENT_PEAK = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])  # benchmarks/: the checkpoint I/O benchmark's RssAnon sampler
import jax
from checkpoint_io import peak_rss_anon_above
from swiftkv_jax import sharding
from swiftkv_jax.distill.config import ModelSection
from swiftkv_jax.distill.student import load_student

mesh = sharding.make_mesh(1, -1, 1)
jax.numpy.zeros(1).block_until_ready()  # the backend up before the baseline
section = ModelSection(teacher=sys.argv[1], num_key_value_layers=4, attention_impl="xla_chunked")
_, peak = peak_rss_anon_above(lambda: jax.block_until_ready(load_student(section, mesh)[1:]), period=0.001)
print(peak)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads RssAnon from /proc/self/status")
def test_load_student_holds_the_weights_about_once(tmp_path):
    """The student is built from the teacher it consumes (`to_swiftkv(..., donate=True)`): the teacher's stacked layers
    and the student's were both alive, now one stacked weight is in flight. Anonymous memory over loading, in a fresh
    process, as a multiple of the bf16 weights: 2.63x before, 1.57x after (sk.load alone: 1.16x); with a 259 MB
    teacher 2.52x before, 1.45x after. glibc is told to map every large buffer on its own, so that a freed one leaves
    RssAnon at once rather than staying in an arena: the peak is then the memory alive, not glibc's retention."""
    config = sk.ModelConfig(vocab_size=4096, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                            num_attention_heads=12, num_key_value_heads=4, param_dtype="bfloat16", dtype="bfloat16")
    teacher = sk.init(config, 0)
    weights = sum(a.nbytes for a in jax.tree.leaves(teacher.params))
    sk.save(teacher, tmp_path / "teacher", "hf")
    del teacher
    env = {**os.environ, "XLA_FLAGS": xla_flags(1), "MALLOC_MMAP_THRESHOLD_": "1048576"}
    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    proc = subprocess.run([sys.executable, "-c", LOAD_STUDENT_PEAK, str(tmp_path / "teacher"), str(benchmarks)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    peak = int(proc.stdout.split()[-1])
    assert peak < 2.0 * weights, f"load_student peaked at {peak / weights:.2f}x the teacher's {weights / 1e6:.0f} MB"
