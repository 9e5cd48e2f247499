"""Log-likelihood scoring on the serving engine.

Continuations (multiple choice): each distinct context is prefilled once, by the SwiftKV prefill for a
SwiftKV model (layers >= l only for its last token), and every continuation of it then runs through all
layers over a copy of that cache (`engine.extend`). This equals the model's full forward on
context + continuation, at the serving cost. Perplexity needs every position's logits, so documents go
through the teacher-forced forward in windows.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from swiftkv_jax import sharding
from swiftkv_jax.model.config import ModelConfig, serves_swiftkv
from swiftkv_jax.model.kv_quant import as_format
from swiftkv_jax.model.model import Model, forward
from swiftkv_jax.serving.cache import init_cache
from swiftkv_jax.serving.engine import extend, prefill
from swiftkv_jax.serving.generate import padded_length
from swiftkv_jax.serving.tensor_parallel import activation_sharding, for_serving


def _token_scores(logits, targets, lengths, starts=None):
    """(sum of log p(targets) over positions [starts, lengths) (starts: 0), every one of them the argmax) per row."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    token_lp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    index = jnp.arange(targets.shape[1])
    valid = (index < lengths[:, None]) & (True if starts is None else index >= starts[:, None])
    total = jnp.sum(jnp.where(valid, token_lp, 0.0), axis=1)
    greedy = jnp.all((jnp.argmax(logits, axis=-1) == targets) | ~valid, axis=1)
    return total, greedy


@functools.partial(jax.jit, static_argnames=("config", "swiftkv", "cache_dtype", "mesh"))
def _score_batch(params, contexts, context_lengths, rows, continuations, continuation_lengths, *,
                 config: ModelConfig, swiftkv: bool, cache_dtype: str, mesh: Optional[Mesh]):
    with activation_sharding(config, mesh):
        return _score_contexts(params, contexts, context_lengths, rows, continuations, continuation_lengths, config,
                               swiftkv, cache_dtype, mesh)


def _score_contexts(params, contexts, context_lengths, rows, continuations, continuation_lengths, config, swiftkv,
                    cache_dtype, mesh):
    batch, width = contexts.shape
    cache = init_cache(config, batch, width + continuations.shape[1], swiftkv, cache_dtype, mesh=mesh)
    last, cache = prefill(params, cache, contexts, context_lengths, config=config, swiftkv=swiftkv)
    logits, _ = extend(params, cache.take(rows), continuations, continuation_lengths, config=config,
                       swiftkv=swiftkv)
    # continuation token j is predicted by the logits of the token before it
    logits = jnp.concatenate([last[rows][:, None], logits[:, :-1]], axis=1)
    return _token_scores(logits, continuations, continuation_lengths)


def _bucket(n: int) -> int:
    """Batch sizes are rounded up to a power of two, to reuse compiles."""
    return 1 << (n - 1).bit_length()


def _pad_rows(rows: Sequence[Sequence[int]], width: int, count: int) -> np.ndarray:
    out = np.zeros((count, width), np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _check_ids(what: str, ids: Sequence[int], vocab_size: int) -> None:
    if not ids:
        raise ValueError(f"an empty {what}: every {what} needs at least one token")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"{what} token ids must lie in [0, {vocab_size}), got [{min(ids)}, {max(ids)}]")


def score_continuations(model: Model, requests: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                        swiftkv: Optional[bool] = None, batch_size: int = 32, cache_dtype="auto",
                        progress: Optional[Callable[[int], None]] = None,
                        mesh: Optional[Mesh] = None) -> list[tuple[float, bool]]:
    """(log p(continuation | context), continuation is the greedy one) for (context ids, continuation ids).

    Requests sharing a context share one prefill. batch_size bounds the continuations per call.
    swiftkv=None: the SwiftKV fast path for a SwiftKV model, the plain model as is; False: teacher wiring.
    progress(n) is called with the number of requests finished by each call. mesh: tensor-parallel serving mesh.
    cache_dtype: "auto" (the model's compute dtype), or any `sk.generate` takes.
    """
    model = for_serving(model, mesh)
    cfg = model.config
    swiftkv = serves_swiftkv(cfg, swiftkv)
    cache_format = as_format(cache_dtype, model_dtype=cfg.dtype)  # "auto": the model's compute dtype
    groups: dict[tuple, list[int]] = {}
    for i, (context, continuation) in enumerate(requests):
        _check_ids("context", context, cfg.vocab_size)
        _check_ids("continuation", continuation, cfg.vocab_size)
        groups.setdefault(tuple(int(t) for t in context), []).append(i)
    # longest first (as lm-eval), so a batch's padding is small and the first call shows the peak memory
    contexts = sorted(groups, key=lambda c: -(len(c) + max(len(requests[i][1]) for i in groups[c])))
    results: list = [None] * len(requests)
    start = 0
    while start < len(contexts):
        stop, rows = start, 0
        while stop < len(contexts) and (stop == start or rows + len(groups[contexts[stop]]) <= batch_size):
            rows += len(groups[contexts[stop]])
            stop += 1
        chunk = contexts[start:stop]
        members = [(c, i) for c, context in enumerate(chunk) for i in groups[context]]
        conts = [list(requests[i][1]) for _, i in members]
        n_ctx, n_rows = _bucket(len(chunk)), _bucket(len(members))
        row_ctx = np.zeros((n_rows,), np.int32)
        row_ctx[: len(members)] = [c for c, _ in members]
        total, greedy = _score_batch(
            model.params,
            jnp.asarray(_pad_rows(chunk, padded_length(max(map(len, chunk)), None), n_ctx)),
            jnp.asarray(np.array([len(c) for c in chunk] + [1] * (n_ctx - len(chunk)), np.int32)),
            jnp.asarray(row_ctx),
            jnp.asarray(_pad_rows(conts, padded_length(max(map(len, conts)), None), n_rows)),
            jnp.asarray(np.array([len(c) for c in conts] + [0] * (n_rows - len(conts)), np.int32)),
            config=cfg, swiftkv=swiftkv, cache_dtype=cache_format, mesh=mesh)
        total, greedy = jax.device_get((total, greedy))
        for row, (_, i) in enumerate(members):
            results[i] = (float(total[row]), bool(greedy[row]))
        if progress:
            progress(len(members))
        start = stop
    return results


@functools.partial(jax.jit, static_argnames=("config", "swiftkv", "mesh"))
def _window_scores(params, inputs, targets, starts, ends, *, config: ModelConfig, swiftkv: bool,
                   mesh: Optional[Mesh]):
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
    with activation_sharding(config, mesh):
        logits = forward(params, inputs, positions, None, config=config, swiftkv=swiftkv)
        logits = sharding.constrain(logits, ("batch", "length", None))  # scored whole on every device
    return _token_scores(logits, targets, ends, starts)[0]


def rolling_loglikelihood(model: Model, documents: Sequence[Sequence[int]], *, max_length: int,
                          swiftkv: Optional[bool] = None, batch_size: int = 8,
                          progress: Optional[Callable[[int], None]] = None,
                          mesh: Optional[Mesh] = None) -> list[tuple[float, int]]:
    """(sum of log p, tokens predicted) per document of ids, every token after the first predicted.

    Documents longer than max_length are cut into disjoint windows of max_length targets, each conditioned on the
    token before it, the last (shorter) one on as many tokens before it as fill max_length: lm-eval's rolling
    log-likelihood (`get_rolling_token_windows` with context 1, then `make_disjoint_window`). mesh:
    tensor-parallel serving mesh.
    """
    model = for_serving(model, mesh)
    cfg = model.config
    swiftkv = serves_swiftkv(cfg, swiftkv)
    windows = []  # (document, input ids, their next ids: input j predicts target j, the first scored)
    for d, ids in enumerate(documents):
        ids = [int(t) for t in ids]
        if len(ids) < 2:
            raise ValueError(f"document {d} has {len(ids)} token(s): perplexity needs at least 2")
        _check_ids("document", ids, cfg.vocab_size)
        for s in range(1, len(ids), max_length):  # targets ids[s:end] after up to max_length inputs
            end = min(s + max_length, len(ids))
            first = max(0, end - 1 - max_length)
            windows.append((d, ids[first: end - 1], ids[first + 1: end], s - 1 - first))
    sums = [0.0] * len(documents)
    width = padded_length(max(len(w[1]) for w in windows), None)
    for start in range(0, len(windows), batch_size):
        chunk = windows[start: start + batch_size]
        count = min(_bucket(len(chunk)), batch_size)
        inputs = _pad_rows([w[1] for w in chunk], width, count)
        targets = _pad_rows([w[2] for w in chunk], width, count)
        starts = np.array([w[3] for w in chunk] + [0] * (count - len(chunk)), np.int32)
        ends = np.array([len(w[2]) for w in chunk] + [0] * (count - len(chunk)), np.int32)
        scores = jax.device_get(_window_scores(model.params, jnp.asarray(inputs), jnp.asarray(targets),
                                               jnp.asarray(starts), jnp.asarray(ends), config=cfg, swiftkv=swiftkv,
                                               mesh=mesh))
        for (d, *_), s in zip(chunk, scores):
            sums[d] += float(s)
        if progress:
            progress(len(chunk))
    return [(sums[d], len(ids) - 1) for d, ids in enumerate(documents)]
