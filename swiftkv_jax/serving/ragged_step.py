"""One jitted engine step over a flat, ragged batch of tokens and the paged KV cache.

Tokens [D + R] (see `swiftkv_jax.model.paged`): D single tokens, then R packed prompt tokens. Every token runs the
embedding and the layers < l, writing its K/V. SwiftKV wiring: the owners' K/V projection for every token, then
only the U tokens whose logits are wanted (the singles and each completed prompt's last token) are gathered and run
through the layers >= l, reading the group pages. Teacher wiring: every token runs every layer, and the U rows are
gathered before the head. Then the head and per-row sampling for those U rows only.

Shapes are static per (D, R) bucket and table width; everything that varies per step is an array argument. The
block tables and the last sampled token of each sequence live on the device (see `ragged_step`), so a step's
inputs are O(tokens), whatever the tables' width, and sampled tokens feed the next step without the host.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh

from swiftkv_jax.model.cached import cached_lower, cached_upper, head, swiftkv_cache_kv
from swiftkv_jax.model.config import ModelConfig
from swiftkv_jax.model.paged import NULL_PAGE, PagedBatch
from swiftkv_jax.serving.paged_cache import PagePool
from swiftkv_jax.serving.sampling import TINY
from swiftkv_jax.serving.scheduler import MAX_TOP_LOGPROBS
from swiftkv_jax.serving.tensor_parallel import activation_sharding


@struct.dataclass
class Sampled:
    """Per logit row [U]: temperature (0 greedy), top_k (0 off), top_p (1 off), seed and the number of tokens the
    request generated before (the key is fold_in(key(seed), count): the same draw whatever else is in the batch);
    vLLM's min_p (0 off) and penalties (`apply_penalties`): repetition (1 off), presence and frequency (0 off);
    masked (int32, 0 off): the row's request has generated fewer than its min_tokens, so its slot's stop ids are
    masked (`mask_stops`); guided (int32, 0 off): the row's request has a token mask (a grammar, bad_words or
    allowed_token_ids), whose allowed tokens are its slot's row of the bitmask table (`apply_grammar`). None: off for
    every row."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    count: jax.Array
    min_p: Optional[jax.Array] = None
    repetition_penalty: Optional[jax.Array] = None
    presence_penalty: Optional[jax.Array] = None
    frequency_penalty: Optional[jax.Array] = None
    masked: Optional[jax.Array] = None
    guided: Optional[jax.Array] = None


# The engine's per-slot token counts for the penalties, [max_num_seqs, V] int32 on the device (256 x 128,256 =
# 131 MB): bits 0-29 count the sequence's output tokens of each id, PROMPT_BIT marks the ids of its prompt.
PROMPT_BIT = 1 << 30


def penalised(s: Sampled):
    """[U] bool: the rows with a penalty on."""
    return (s.repetition_penalty != 1) | (s.presence_penalty != 0) | (s.frequency_penalty != 0)


def apply_penalties(logits, s: Sampled, counts, slots):
    """fp32 logits [U, V] with each row's penalties, as vLLM's (and transformers' repetition penalty): a token seen
    in the prompt or the output has a positive logit divided by repetition_penalty, a negative one multiplied; then
    logit -= frequency_penalty x its output count + presence_penalty x (count > 0) (OpenAI's formula). counts: the
    engine's per-slot counts [S, V] (`PROMPT_BIT`), slots [U] each row's (-1: padding, whose settings are off)."""
    row = counts[jnp.maximum(slots, 0)]
    output = row & (PROMPT_BIT - 1)
    r = s.repetition_penalty[:, None]
    out = jnp.where(row != 0, jnp.where(logits > 0, logits / r, logits * r), logits)
    return out - s.frequency_penalty[:, None] * output - s.presence_penalty[:, None] * (output > 0)


def biased(bias_ids, slots, vocab: int):
    """[U] bool: the rows whose slot has a logit bias (its first id < vocab, `apply_bias`; slot -1: none)."""
    return (slots >= 0) & (bias_ids[jnp.maximum(slots, 0), 0] < vocab)


def apply_bias(logits, bias, slots):
    """fp32 logits [U, V] plus each row's logit bias (OpenAI's logit_bias): bias = (ids [S, K] int32, values [S, K]
    fp32), the engine's per-slot table (ids first, padded with ids >= V, which are dropped), slots [U] each row's.
    Rows of slot -1 (padding) or of a slot with no bias: unchanged."""
    ids, values = bias
    vocab, row = logits.shape[-1], jnp.maximum(slots, 0)
    ids = jnp.where(biased(ids, slots, vocab)[:, None], ids[row], vocab)
    return logits.at[jnp.arange(logits.shape[0])[:, None], ids].add(values[row], mode="drop")


def masking(s: Sampled, slots):
    """[U] bool: the rows whose stop ids are masked (vLLM's min_tokens not reached yet; slot -1: none)."""
    return (slots >= 0) & (s.masked != 0)


def mask_stops(logits, stops, s: Sampled, slots):
    """fp32 logits [U, V] with each masked row's (`masking`) stop ids at -inf, so that no sampling (greedy, top-k,
    top-p, min_p) can pick them (vLLM's MinTokensLogitsProcessor): stops [S, K] int32, the engine's per-slot stop ids
    (padded with ids >= V, which are dropped), slots [U] each row's."""
    vocab = logits.shape[-1]
    ids = jnp.where(masking(s, slots)[:, None], stops[jnp.maximum(slots, 0)], vocab)
    return logits.at[jnp.arange(logits.shape[0])[:, None], ids].set(-jnp.inf, mode="drop")


def guiding(s: Sampled, slots):
    """[U] bool: the rows under a token mask (a grammar, bad_words, allowed_token_ids; slot -1: none)."""
    return (slots >= 0) & (s.guided != 0)


def apply_grammar(logits, masks, s: Sampled, slots):
    """fp32 logits [U, V] with each guided row's (`guiding`) disallowed tokens at -inf: masks [S, ceil(V / 32)] int32,
    the engine's per-slot grammar bitmasks (token i allowed where bit i % 32 of word i // 32 is set: llguidance's and
    vLLM's layout), slots [U] each row's. Other rows: unchanged."""
    vocab = logits.shape[-1]
    words = masks[jnp.maximum(slots, 0)]  # [U, W]
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(words.shape[0], -1)[:, :vocab] != 0
    return jnp.where(guiding(s, slots)[:, None] & ~allowed, -jnp.inf, logits)


def sample_penalised(logits, s: Sampled, counts, slots, bias=None, stops=None, masks=None):
    """tokens [U]: `sample_rows` of the logits with their grammar's disallowed tokens masked (`apply_grammar`, masks
    None or s.guided None: none), their stop ids masked (`mask_stops`, stops None or s.masked None: none), their
    logit bias (`apply_bias`, bias None: none), then their penalties (`apply_penalties`), vLLM V1's order (its
    model runner applies the grammar bitmask to the logits before its sampler; a masked token stays at -inf through
    the bias and the penalties). A step where no row has a grammar, a penalty, a bias or a mask runs none of it (not
    even the [U, V] gather of counts); the branches give tokens, not logits, so the other branch does not copy the
    [U, V] logits either (the step still reads them for the logprobs)."""
    stops = None if s.masked is None else stops
    masks = None if s.guided is None else masks
    on = penalised(s)
    if bias is not None:
        on |= biased(bias[0], slots, logits.shape[-1])
    if stops is not None:
        on |= masking(s, slots)
    if masks is not None:
        on |= guiding(s, slots)

    def adjust(x):
        x = x if masks is None else apply_grammar(x, masks, s, slots)
        x = x if stops is None else mask_stops(x, stops, s, slots)
        return x if bias is None else apply_bias(x, bias, slots)

    return jax.lax.cond(jnp.any(on), lambda: sample_rows(apply_penalties(adjust(logits), s, counts, slots), s),
                        lambda: sample_rows(logits, s))


def count_tokens(counts, s: Sampled, slots, tokens):
    """counts [S, V] plus each penalised row's sampled token (rows of slot -1 or out of range: none)."""
    rows = jnp.where(penalised(s) & (slots >= 0), slots, counts.shape[0])
    return counts.at[rows, tokens].add(1, mode="drop")


def sample_rows(logits, s: Sampled):
    """tokens [U] from fp32 logits [U, V], each row by its own settings (`sampling.sample`'s rules per row; min_p
    after the temperature, before top-k and top-p, as vLLM V1)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw():
        # less each row's max first: a tiny temperature overflowed the quotient to inf (`sampling.sample`)
        temperature = jnp.where(s.temperature > 0, jnp.maximum(s.temperature, TINY), 1.0)
        scaled = (logits - logits.max(axis=-1, keepdims=True)) / temperature[:, None]
        order = jnp.flip(jnp.argsort(scaled, axis=-1), axis=-1)  # ties: higher ids first, as `sampling.sample`
        ranked = jnp.take_along_axis(scaled, order, axis=-1)
        # every token tied with the k-th too, as transformers' TopKLogitsWarper, vLLM and `sampling.sample` keep them
        kth = jnp.take_along_axis(ranked, jnp.clip(s.top_k - 1, 0, logits.shape[-1] - 1)[:, None], axis=-1)
        keep = (s.top_k[:, None] == 0) | (ranked >= kth)
        if s.min_p is not None:  # p / p_max = exp(ranked), ranked less the max
            keep &= jnp.exp(ranked) >= s.min_p[:, None]
        probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf), axis=-1)
        keep &= jnp.cumsum(probs, axis=-1) - probs < s.top_p[:, None]  # the smallest prefix reaching top_p
        keys = jax.vmap(lambda seed, n: jax.random.fold_in(jax.random.key(seed), n))(s.seed, s.count)
        pick = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, ranked, -jnp.inf))
        return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)

    sampled = jax.lax.cond(jnp.any(s.temperature > 0), draw, lambda: greedy)
    return jnp.where(s.temperature > 0, sampled, greedy)


@struct.dataclass
class StepInput:
    """One step's host-built arrays (bucketed shapes, int32 unless noted). Rows: D single tokens, then R packed
    prompt tokens; U logit rows; A block-table entries added by this step."""

    tokens: jax.Array           # [D + R] token ids; -1: the token its sequence sampled in the previous step
    positions: jax.Array        # [D + R]
    slots: jax.Array            # [D + R] the token's sequence's slot (row of the block table); -1 padding
    segments: jax.Array         # [R] prompt segment of each prompt token, -1 padding
    upper_index: jax.Array      # [U] rows run to the head (into the D + R tokens); -1 padding
    targets: jax.Array          # [U] a scored prompt token's next token, whose logprob the row gives; -1: it samples
    sampling: Sampled           # [U]
    table_slots: jax.Array      # [A] block-table entries to write: slot (out of range: none), index, page id
    table_indices: jax.Array
    table_pages: jax.Array

    def pack(self) -> np.ndarray:
        """int32 [n]: the host arrays as one, the floats by their bits, so that a step costs one transfer, not
        fifteen."""
        s, u = self.sampling, self.upper_index.shape[0]
        off = lambda x, value: np.full(u, value) if x is None else x  # noqa: E731 (a setting None: off)
        ints = [self.tokens, self.positions, self.slots, self.segments, self.upper_index, self.targets,
                self.sampling.top_k, self.sampling.seed, self.sampling.count, off(s.masked, 0), off(s.guided, 0),
                self.table_slots, self.table_indices, self.table_pages]
        floats = [np.asarray(x, np.float32).view(np.int32) for x in (
            s.temperature, s.top_p, off(s.min_p, 0), off(s.repetition_penalty, 1), off(s.presence_penalty, 0),
            off(s.frequency_penalty, 0))]
        return np.concatenate([np.asarray(x, np.int32).reshape(-1) for x in ints] + floats)

    @classmethod
    def unpack(cls, packed, sizes: tuple) -> "StepInput":
        """The inverse of `pack` for a step of sizes (D + R tokens, R prompt tokens, U rows, A table entries)."""
        t, r, u, a = sizes
        parts = np.cumsum([0, t, t, t, r, u, u, u, u, u, u, u, a, a, a] + [u] * 6)
        (tokens, positions, slots, segments, upper_index, targets, top_k, seed, count, masked, guided, table_slots,
         table_indices, table_pages, *floats) = (packed[parts[i]:parts[i + 1]] for i in range(len(parts) - 1))
        temperature, top_p, min_p, repetition, presence, frequency = (
            jax.lax.bitcast_convert_type(x, jnp.float32) for x in floats)
        sampling = Sampled(temperature, top_k, top_p, seed, count, min_p, repetition, presence, frequency, masked,
                           guided)
        return cls(tokens, positions, slots, segments, upper_index, targets, sampling, table_slots, table_indices,
                   table_pages)

    @property
    def sizes(self) -> tuple:
        return (self.tokens.shape[0], self.segments.shape[0], self.upper_index.shape[0], self.table_slots.shape[0])


@functools.partial(jax.jit, static_argnames=("sizes", "config", "swiftkv", "width", "xla_loop", "mesh"),
                   donate_argnames=("pool", "tables", "last_tokens", "counts"))
def ragged_step(params, pool: PagePool, tables, last_tokens, counts, bias, stops, masks, packed, want_top, *,
                sizes: tuple,
                config: ModelConfig, swiftkv: bool, width: int, xla_loop: str = "dynamic", mesh: Optional[Mesh] = None):
    """(tokens [U], logprobs [U] fp32, (top logprobs, top ids) [U, MAX_TOP_LOGPROBS], pool, tables, last_tokens,
    counts).
    params in serving layout (`unstack_layers`, done once by the engine).

    The device keeps the engine's state between steps, donated and updated in place: the pool, the block tables
    [S, M] (a row per slot; this step writes its new entries) and last_tokens [S] (the token each slot's sequence
    sampled last, which a decode whose token is still on its way to the host reads) and counts [S, V] (the
    penalties' token counts, `PROMPT_BIT`: a penalised row adds its sampled token). bias: the per-slot logit bias
    table (ids, values) [S, K] (`apply_bias`) and stops the per-slot stop ids [S, MAX_MASKED_STOP_IDS] that rows
    under their min_tokens mask (`mask_stops`), and masks the per-slot grammar bitmasks [S, ceil(V / 32)] int32 that
    guided rows apply (`apply_grammar`), all read only. Attention reads the first
    `width` entries of each table (the engine's bucket of the step's longest sequence); `xla_loop` is the XLA
    paged path's form (`model.paged.default_xla_loop`). want_top []: whether any row asked for its top logprobs
    (else zeros, and no top-k over the vocabulary). mesh: the tensor-parallel mesh of params and pool, None for
    one device. packed: `StepInput.pack()` of the step's inputs, whose `sizes` are static."""
    with activation_sharding(config, mesh):
        return _ragged_step(params, pool, tables, last_tokens, counts, bias, stops, masks,
                            StepInput.unpack(packed, sizes), want_top, config, swiftkv, width, xla_loop)


def _ragged_step(params, pool, tables, last_tokens, counts, bias, stops, masks, step, want_top, config, swiftkv, width,
                 xla_loop):
    num_slots, page_size = tables.shape[0], pool.lower[0][0].shape[2]
    tables = tables.at[step.table_slots, step.table_indices].set(step.table_pages, mode="drop")
    slots, positions = step.slots, step.positions
    tokens = jnp.where(step.tokens < 0, last_tokens[jnp.maximum(slots, 0)], step.tokens)
    d = tokens.shape[0] - step.segments.shape[0]
    page = tables[jnp.maximum(slots, 0), positions // page_size]
    # A chunk continues a prompt when it starts past position 0 (its start is cached): it reads the pages.
    starts = jax.ops.segment_min(positions[d:], step.segments, num_segments=max(1, step.segments.shape[0]))
    continued = (step.segments >= 0) & (starts[jnp.maximum(step.segments, 0)] > 0)
    prompt_runs = step.upper_index.shape[0] - d + 1  # a logit row per packed prompt (the engine's rows), padding
    batch = PagedBatch(jnp.where(slots >= 0, page, NULL_PAGE), positions % page_size, tables[:, :width], slots,
                       step.segments, continued, xla_loop, min(step.segments.shape[0], prompt_runs))
    upper_index = jnp.maximum(step.upper_index, 0)
    upper_slots = jnp.where(step.upper_index >= 0, slots[upper_index], -1)
    upper = PagedBatch(None, None, batch.tables, upper_slots, jnp.zeros(0, jnp.int32), jnp.zeros(0, bool), xla_loop)
    sampling = step.sampling
    tokens, positions = tokens[None], positions[None]
    h, lower = cached_lower(params, config, tokens, positions, batch, pool.lower)
    upper_positions = positions[:, upper_index]
    if swiftkv:
        upper_pool = swiftkv_cache_kv(params, config, h, positions, batch, pool.upper)
        h, _ = cached_upper(params, config, h[:, upper_index], upper_positions, upper, upper_pool, swiftkv=True)
    else:
        h, upper_pool = cached_upper(params, config, h, positions, batch, pool.upper, swiftkv=False)
        h = h[:, upper_index]
    logits = head(params, config, h)[0]
    # the grammar's mask, the min_tokens mask of stop ids, logit bias, penalties, then the temperature, min_p, top-k
    # and top-p (vLLM V1's order); the logprobs are the model's own
    token = sample_penalised(logits, sampling, counts, upper_slots, bias, stops, masks)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    scored = step.targets >= 0  # a scored prompt token's row: the logprob of its target, and no token kept
    logprob = jnp.take_along_axis(log_probs, jnp.where(scored, step.targets, token)[:, None], axis=-1)[:, 0]
    k = min(MAX_TOP_LOGPROBS, logits.shape[-1])
    top = jax.lax.cond(want_top, lambda: tuple(jax.lax.top_k(log_probs, k)),
                       lambda: (jnp.zeros((logits.shape[0], k), log_probs.dtype), jnp.zeros((logits.shape[0], k),
                                                                                            jnp.int32)))
    keep = (upper_slots >= 0) & ~scored
    last_tokens = last_tokens.at[jnp.where(keep, upper_slots, num_slots)].set(token, mode="drop")
    counts = count_tokens(counts, sampling, jnp.where(keep, upper_slots, -1), token)
    return token, logprob, top, PagePool(lower, upper_pool), tables, last_tokens, counts
