"""cuDNN's attention of a row to itself (`attention.cudnn_row_attention`, issue 24): the packed layout it hands
cuDNN, the bound on runs per row that train.py reads off its data, and the model's wiring, on the CPU against
`attention_mask` and XLA; the distillation step lowered for CUDA with each of cuDNN's forms (jax's checks of the
calls, from the CPU); the kernel itself against XLA on a GPU (`-m gpu`).

cuDNN's packed mode masks causally by index within each run of equal segment ids; `attention_mask` masks by
position and segment. They agree on every token of rows as `swiftkv_jax.data.pack` makes them (positions rising
along each document), except among a row's trailing padding, whose outputs nothing reads.
"""

import itertools
import re
import sys
from pathlib import Path

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import swiftkv_jax as sk
from distill_fixtures import packed_batch, tiny_config
from swiftkv_jax.data import packing
from swiftkv_jax.model import attention
from swiftkv_jax.model.attention import attend, attention_mask, segment_runs, xla_attention


def packed_rows(seed=0, batch=6, length=48):
    """Rows of the real packer: documents of 1-30 tokens into rows of `length` (padding segment 0)."""
    lengths = np.random.default_rng(seed).integers(1, 30, 5 * batch).tolist()
    docs = datasets.Dataset.from_dict({"input_ids": [list(range(1, n + 1)) for n in lengths],
                                       "assistant": [[1] * n for n in lengths], "length": lengths})
    packed = packing.pack(docs, length)
    return packed, {k: np.asarray(v)[:batch] for k, v in packed.with_format("numpy")[:].items()}


def reference_runs(row):
    """(starts, lengths) of the runs of equal values in one row, by itertools.groupby."""
    lengths = [len(list(group)) for _, group in itertools.groupby(row.tolist())]
    return np.cumsum([0] + lengths[:-1]).tolist(), lengths


def test_segment_runs_are_the_rows_runs():
    _, rows = packed_rows()
    ids = np.concatenate([rows["segment_ids"], np.ones((1, 48), np.int32)])  # one whole-row document too
    most = max(len(reference_runs(r)[1]) for r in ids)
    for bound in (most, most + 3):
        offsets, lengths, runs = map(np.asarray, segment_runs(jnp.asarray(ids), bound))
        assert offsets.shape == (len(ids), bound + 1) and lengths.shape == (len(ids), bound)
        for row, off, n, count in zip(ids, offsets, lengths, runs):
            starts, sizes = reference_runs(row)
            assert count == len(sizes)
            assert off.tolist() == starts + [-1] * (bound + 1 - len(starts))  # the last entry is always -1
            assert n.tolist() == sizes + [-1] * (bound - len(sizes))
    _, _, runs = segment_runs(jnp.asarray(ids), 1)  # too small a bound: the count still says so
    assert np.asarray(runs).max() == most > 1


def test_max_runs_of_arrays_and_of_a_packed_dataset():
    assert packing.max_runs(np.ones((2, 8), np.int32)) == 1
    assert packing.max_runs(np.array([[1, 1, 2, 2, 0], [1, 2, 3, 0, 0]])) == 4
    packed, rows = packed_rows(seed=3)
    every = {k: np.asarray(v) for k, v in packed.with_format("numpy")[:].items()}
    want = max(len(reference_runs(r)[1]) for r in every["segment_ids"])
    assert packing.max_runs(packed) == packing.max_runs(every["segment_ids"]) == want > 1


def runs_mask(segment_ids):
    """[B, T, T] cuDNN's packed causal mask: same run of segment ids, key index <= query index."""
    run = np.cumsum(np.c_[np.ones((len(segment_ids), 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    t = np.arange(segment_ids.shape[1])
    return (run[:, :, None] == run[:, None, :]) & (t[None, None, :] <= t[None, :, None])


def test_runs_mask_is_attention_mask_on_every_document_token():
    _, rows = packed_rows(seed=1)
    ids, pos = rows["segment_ids"], rows["positions"]
    ours = np.asarray(attention_mask(pos, pos, ids, ids))
    documents = ids > 0  # padding (segment 0, positions 0) sees all of itself in ours, its past in cuDNN's
    assert documents.sum() > 0 and (~documents).sum() > 0
    np.testing.assert_array_equal(runs_mask(ids)[documents], ours[documents])


def emulated_row_attention(q, k, v, segment_ids, max_runs):
    """cudnn_row_attention's contract in XLA: causal by index within runs, NaN rows past `max_runs` runs."""
    b, t = segment_ids.shape
    run = jnp.cumsum(jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1), 1)
    index = jnp.broadcast_to(jnp.arange(t), (b, t))
    out = xla_attention(q, k, v, index, index, run, run)
    return jnp.where((run[:, -1] <= max_runs)[:, None, None, None], out, jnp.nan)


def test_model_uses_row_attention_only_without_a_cache(monkeypatch):
    """A cuDNN model with max_segments_per_row: every layer of a forward (teacher and SwiftKV wiring) attends its row
    with cudnn_row_attention (emulated here), and the logits of document tokens are XLA's; serving with a cache
    takes the general path."""
    calls = []

    def row_attention(q, k, v, segment_ids, max_runs):
        calls.append(max_runs)
        return emulated_row_attention(q, k, v, segment_ids, max_runs)

    monkeypatch.setattr(attention, "cudnn_row_attention", row_attention)
    config = tiny_config().replace(num_key_value_layers=2)
    params = sk.init(config, jax.random.key(0)).params
    batch = packed_batch(config.vocab_size, batch=3, length=32, seed=2)
    tokens, pos, ids = (jnp.asarray(batch[k]) for k in ("tokens", "positions", "segment_ids"))
    want = {w: sk.forward(params, tokens, pos, ids, config=config.replace(attention_impl="xla"), swiftkv=w)
            for w in (False, True)}
    cudnn = config.replace(attention_impl="cudnn", max_segments_per_row=4)
    for wiring in (False, True):
        got = sk.forward(params, tokens, pos, ids, config=cudnn, swiftkv=wiring)
        np.testing.assert_allclose(got[ids > 0], want[wiring][ids > 0], rtol=1e-5, atol=1e-5)
    assert calls and set(calls) == {4}
    calls.clear()
    with pytest.raises(ValueError, match="attention_impl='cudnn' needs an NVIDIA GPU"):
        sk.generate(sk.Model(cudnn, params), [list(range(1, 40))], max_new_tokens=2)  # a cache: the general path
    assert not calls
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):  # the real one refuses a CPU by name
        monkeypatch.undo()
        attend("cudnn", *(jnp.zeros((1, 8, 2, 16), jnp.bfloat16),) * 3, pos[:1, :8], pos[:1, :8], ids[:1, :8],
               ids[:1, :8], row_runs=2)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "4"])
def test_max_segments_per_row_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="max_segments_per_row must be a positive int or None"):
        tiny_config().replace(max_segments_per_row=bad)


@pytest.fixture
def cuda_lowering(monkeypatch):
    """Lowering for CUDA on a CPU: jax's cuDNN attention asks the installed cuDNN for its version and the device for
    its compute capability while it traces (a GPU's answers here: cuDNN 9.11, Hopper), and our refusal of a CPU
    backend is lifted (its own test is above). What is left is jax's real lowering of our calls."""
    from jax._src.cudnn import fused_attention_stablehlo as fused

    monkeypatch.setattr(fused, "check_cudnn_version", lambda: 91100)
    monkeypatch.setattr(fused, "check_compute_capability", lambda capability: True)
    monkeypatch.setattr(fused, "is_cuda_compute_capability_equal", lambda capability: False)
    monkeypatch.setattr(attention, "check_cudnn", lambda dtype: None)


def cudnn_calls(lowered_text: str) -> list[tuple[str, str]]:
    """(call, mask type) of each cuDNN attention call in a lowered program's text, e.g. ("fmhaSoftmax", "CAUSAL")."""
    calls = re.findall(r'custom_call @__cudnn\$(\w+)\(.*?mask_type\\22: \\22(\w+)\\22', lowered_text)
    assert len(calls) == lowered_text.count("custom_call @__cudnn$"), "a cuDNN call without a mask type"
    return calls


# each form of attention_impl="cudnn" in training: (max_segments_per_row, cuDNN's call, its mask)
CUDNN_FORMS = [(1, "fmhaSoftmax", "CAUSAL"), (4, "fmhaSoftmax", "PADDING_CAUSAL"),
               (None, "fmhaScaleBiasSoftmax", "NO_MASK")]


def step_cudnn_calls(max_segments, **replace) -> list[tuple[str, str]]:
    """The cuDNN calls (sorted) of the tiny distillation step with attention_impl="cudnn", lowered for CUDA; replace:
    fields of the student's config (e.g. remat)."""
    from distill_fixtures import init_state, jit_step, student

    config = tiny_config(hidden_size=128, head_dim=64, dtype="bfloat16", attention_impl="cudnn",
                         max_segments_per_row=max_segments)
    config, trainable, frozen = student(config, l=2)
    fn, optimizer = jit_step(config.replace(**replace))
    batch = {k: jnp.asarray(v) for k, v in packed_batch(config.vocab_size, batch=2, length=128, seed=4).items()}
    text = fn.trace(init_state(trainable, optimizer), frozen, batch).lower(lowering_platforms=("cuda",)).as_text()
    return sorted(cudnn_calls(text))


@pytest.mark.parametrize("max_segments, call, mask", CUDNN_FORMS)
def test_distillation_step_with_cudnn_lowers_for_cuda(cuda_lowering, max_segments, call, mask):
    """The whole distillation step (teacher, SwiftKV student, loss, gradients, Adam) with attention_impl="cudnn"
    lowers for CUDA from the CPU in each of its forms: cuDNN's own causal mask (one document a row), its packed
    layout through jax's private API (at most 4 documents a row: sequence lengths and offsets), our mask as a bias.
    jax checks the layouts, shapes and offsets we hand it while lowering, so a wrong call fails here and not in a GPU
    call; the program holds that form's forward and backward calls and no other."""
    # the layers run in scans: one forward call each for the layers below l, the teacher's and the student's above
    # it; one backward call for the student's (the only trainable attention)
    assert step_cudnn_calls(max_segments) == [(call, mask)] * 3 + [(call + "Backward", mask)]


@pytest.mark.parametrize("remat, recomputed", [("dots", 0), ("full", 1)])
def test_remat_dots_keeps_the_cudnn_forward(cuda_lowering, remat, recomputed):
    """Under remat `dots` the trained layers' backward does not run cuDNN's attention forward again: the policy
    saves its outputs beside the matmuls' (one forward call each for the layers below l, the teacher's and the
    student's above it, as without remat); `full` saves nothing, so the student's forward runs once more."""
    assert step_cudnn_calls(1, remat=remat) == ([("fmhaSoftmax", "CAUSAL")] * (3 + recomputed)
                                                + [("fmhaSoftmaxBackward", "CAUSAL")])


@pytest.mark.parametrize("variant", ["ours", "naive"])
@pytest.mark.parametrize("impl", ["cudnn", "cudnn:8"])
def test_the_8b_benchmark_step_with_cudnn_lowers_for_cuda(cuda_lowering, impl, variant):
    """What the GPU pack's first call runs (`benchmarks/distill_step.py --preset 8b`: Llama-3.1-8B, one 8K-token row,
    l = 16) lowers for CUDA at its real shapes, on abstract arguments (nothing allocated), with both cuDNN forms:
    forward calls, and backward calls for the trainable attention (ours: the student's; naive: the student's
    through every SwiftKV layer, and the teacher's is stop-gradient)."""
    benchmarks = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    import distill_step

    preset = dict(distill_step.PRESETS["8b"], attention_impl=impl)
    fn, args, _, _, _ = distill_step._build(preset, variant, "none", abstract=True)
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    mask = "PADDING_CAUSAL" if impl == "cudnn:8" else "CAUSAL"
    assert set(cudnn_calls(text)) == {("fmhaSoftmax", mask), ("fmhaSoftmaxBackward", mask)}


# --- on a GPU: the kernel against XLA ------------------------------------------------------------------------------


def _qkv(b, t, n, kv, h, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16),
            *(jax.random.normal(key, (b, t, kv, h), jnp.bfloat16) for key in keys[1:]))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("layout", ["packed", "one_document"])
def test_cudnn_row_attention_matches_xla_forward_and_backward(layout, head_dim):
    """Packed rows (1-3 documents, padding; bound 4 and 8) and whole-row documents (bound 1, cuDNN's plain causal
    mask): outputs token by token, a weighted loss and its gradients of q, k, v (GQA 8/2) against fp32 XLA, on
    document tokens."""
    b, t = 2, 256
    if layout == "packed":
        batch = packed_batch(64, batch=b, length=t, seed=5)
        pos, ids = jnp.asarray(batch["positions"]), jnp.asarray(batch["segment_ids"])
        bounds = (4, 8)
    else:
        pos, ids = jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.ones((b, t), jnp.int32)
        bounds = (1, 4)
    q, k, v = _qkv(b, t, 8, 2, head_dim)
    weight = jax.random.normal(jax.random.key(9), q.shape, jnp.float32) * (ids > 0)[:, :, None, None]
    loss = lambda fn: jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * weight),
                                                 argnums=(0, 1, 2)))
    want, want_grads = loss(lambda *x: xla_attention(*x, pos, pos, ids, ids))(
        *(x.astype(jnp.float32) for x in (q, k, v)))
    reference = np.asarray(xla_attention(*(x.astype(jnp.float32) for x in (q, k, v)), pos, pos, ids, ids))
    documents = np.asarray(ids) > 0
    for bound in bounds:
        attention = lambda *x, bound=bound: attend("cudnn", *x, pos, pos, ids, ids, row_runs=bound)
        out = np.asarray(jax.jit(attention)(q, k, v), np.float32)  # every document token, not only a weighted sum
        np.testing.assert_allclose(out[documents], reference[documents], atol=2e-2, rtol=2e-2, err_msg=f"bound {bound}")
        got, grads = loss(attention)(q, k, v)
        np.testing.assert_allclose(got, want, rtol=2e-2, err_msg=f"bound {bound}")
        for name, g, w in zip("qkv", grads, want_grads):
            np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=3e-2 * np.abs(w).max(),
                                       err_msg=f"d{name}, bound {bound}")


@pytest.mark.gpu
def test_cudnn_row_attention_poisons_rows_past_its_bound():
    ids = jnp.asarray([[1] * 64 + [2] * 64, [1] * 128], jnp.int32)  # 2 runs, then 1
    out = attend("cudnn", *_qkv(2, 128, 4, 2, 64), ids, ids, ids, ids, row_runs=1)
    out = np.asarray(out, np.float32)
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()
