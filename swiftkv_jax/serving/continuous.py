"""`Engine`: continuous batching over a paged KV cache, the serving engine for many concurrent requests.

    engine = sk.Engine(model, kv_cache_bytes=2 << 30, max_num_seqs=64, max_num_batched_tokens=512)
    rid = engine.add_request(prompt_ids, max_tokens=128, temperature=0.7, seed=1)
    while engine.has_unfinished():
        for out in engine.step():          # new tokens, and the requests that finished
            ...
    engine.generate([[1, 2, 3], [4, 5]], max_tokens=32)   # blocking, for offline batches

Each `step` schedules (`scheduler.Scheduler`), builds the host arrays of one ragged batch, launches the jitted step
(`ragged_step`) for its bucket, and only then waits for the previous step's tokens (vLLM V1's asynchronous
scheduling): while the device runs step N + 1 the host hands out step N's tokens, and the step after is scheduled
before they are back. Sampled tokens stay on the device and feed the next step; the block tables live there too and
change only where a page was added. So `step` returns the outputs of the step launched by the call before it.
A request with a grammar (structured outputs, `add_request(grammar=...)`) or vLLM's bad_words of several tokens
(`bad_words_ids`) is the exception: its next mask needs its last token, so it runs every other step (never scheduled
while its token is pending); the others keep the pipeline. vLLM's allowed_token_ids is a mask too, but a constant one
(as are bad words of one token each, folded into it): its bitmask row is written once, when the request gets its
slot, and applied on the device every step, so it keeps the pipeline.
`add_request` and `abort` may be called from any thread: they only enqueue, and `step` (one thread) applies them
first.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import itertools
import logging
import queue
import threading
import time
from typing import Optional, Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from swiftkv_jax.checks import flag, integer, real, token_ids
from swiftkv_jax.model.cached import unstack_layers
from swiftkv_jax.model.config import ModelConfig, serves_swiftkv
from swiftkv_jax.model.kv_quant import as_format, check_format
from swiftkv_jax.model.model import Model, check_params
from swiftkv_jax.model.paged import XLA_LOOPS, default_xla_loop
from swiftkv_jax.serving.compile_cache import count_compiles
from swiftkv_jax.serving.errors import InvalidRequest
from swiftkv_jax.serving.paged_cache import init_pool, pages_for_budget, tokens_held
from swiftkv_jax.serving.kernel_choice import serving_config
from swiftkv_jax.serving.pages import PageAllocator, pages_for
from swiftkv_jax.serving.ragged_step import PROMPT_BIT, Sampled, StepInput, ragged_step
from swiftkv_jax.serving.tensor_parallel import for_serving, replicated
from swiftkv_jax.serving.sampling import MAX_LOGIT_BIAS, MAX_MASKED_STOP_IDS
from swiftkv_jax.serving.scheduler import RequestParams, Schedule, Scheduler, Sequence, prompt_token_cost
from swiftkv_jax.serving import token_masks
from swiftkv_jax.serving.structured import words

log = logging.getLogger(__name__)
BUDGET_UNITS = ("tokens", "cost")


@dataclasses.dataclass(slots=True)
class RequestOutput:
    """What one step gave one request: its new token (if any) and, once finished, the whole result."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    finished: bool = False
    finish_reason: Optional[str] = None        # "stop" | "length" | "abort" | "error" (its mask failed: `error`)
    token_ids: Optional[list[int]] = None      # all generated tokens, when finished
    logprobs: Optional[list[float]] = None
    metrics: Optional[dict] = None             # queue_s, ttft_s, tpot_s, prefill_s, decode_s, ... when finished
    new_top_logprobs: list[dict] = dataclasses.field(default_factory=list)  # {token id: logprob}, when asked
    top_logprobs: Optional[list[dict]] = None  # per generated token, when finished and asked
    # with prompt_logprobs, on the first token's output and the finished one: per prompt token its logprob (None
    # for the first) and the most likely tokens there ({id: logprob}, prompt_logprobs of them)
    prompt_logprobs: Optional[list] = None
    prompt_top_logprobs: Optional[list] = None
    # finished ("stop") because its grammar was complete (structured outputs): its last token is text, not a stop id
    grammar_done: bool = False
    # finish_reason "error": why (its grammar could not give a mask: llguidance's error; or its masks together allow
    # no token)
    error: Optional[str] = None
    # finish_reason "error" that the request's own settings caused (its masks together allow no token): the setting
    # to blame (engine name: allowed_token_ids, bad_words_ids, grammar or min_tokens), so that a server answers 400
    error_param: Optional[str] = None


def _blamed_mask(seq: Sequence, any_before_stops: bool) -> str:
    """The setting to name when a sequence's token masks together allow no token: min_tokens where its stop ids were
    the last ones left, else the setting of its constant row (allowed_token_ids, or one-token bad words alone) that
    the other masks met, else bad_words_ids where they were there, else its grammar."""
    if any_before_stops:
        return "min_tokens"
    if seq.allowed is not None:
        return seq.allowed_from
    masks = getattr(seq.grammar, "masks", [seq.grammar])
    return "bad_words_ids" if any(isinstance(m, token_masks.BadWords) for m in masks) else "grammar"


@functools.partial(jax.jit, donate_argnums=0)
def _set_rows(table, slots, rows):
    """A per-slot device table (the block tables, the min_tokens stop ids [S, MAX_MASKED_STOP_IDS], the grammar
    bitmasks [S, ceil(V / 32)]) with the row of `slots` (one, or [G]) replaced by `rows` (in place: donated). A slot
    out of range (padding): no change."""
    return table.at[slots].set(rows, mode="drop")


@functools.partial(jax.jit, donate_argnums=0)
def _reset_counts(counts, slot, marks):
    """The penalties' counts [S, V] with one slot's row rebuilt (in place: donated) from marks [n]: a prompt token's
    id (< V) sets its PROMPT_BIT, V + id counts an output token, 2V is padding. A slot out of range: no change."""
    vocab = counts.shape[1]
    prompt = marks < vocab
    row = jnp.zeros(vocab, counts.dtype).at[jnp.where(prompt, marks, vocab)].set(PROMPT_BIT, mode="drop")
    row = row.at[jnp.where(prompt, vocab, marks - vocab)].add(1, mode="drop")
    return counts.at[slot].set(row, mode="drop")


@functools.partial(jax.jit, donate_argnums=0)
def _set_bias(bias, slot, ids, values):
    """The logit bias table (ids, values) [S, MAX_LOGIT_BIAS] with one slot's row replaced (in place: donated) by
    ids [MAX_LOGIT_BIAS] (padding: V) and values. A slot out of range: no change."""
    return bias[0].at[slot].set(ids, mode="drop"), bias[1].at[slot].set(values, mode="drop")


def _growing(low: int, high: int, factor: int = 2) -> tuple[int, ...]:
    sizes, size = [], low
    while size < high:
        sizes.append(size)
        size *= factor
    return tuple(sizes) + (high,)


def check_max_model_len(max_model_len: int, max_positions: int, pool_tokens: Optional[int], *,
                        name: str = "max_model_len",
                        pool_names: str = "num_pages, kv_cache_bytes or kv_cache_fraction") -> None:
    """vLLM's two refusals of a given max_model_len: beyond the model's max_position_embeddings (positions its RoPE
    never saw: degenerate text), or beyond the tokens the KV cache pool holds (such a sequence could never finish).
    `name` and `pool_names` are what the message calls the settings (the CLI passes its flags); pool_tokens None:
    not checked (the engine's own; the server checks it)."""
    if max_model_len > max_positions:
        raise ValueError(f"{name} {max_model_len} is larger than the model's max_position_embeddings "
                         f"({max_positions}, config.json): lower {name} to at most {max_positions}")
    if pool_tokens is not None and max_model_len > pool_tokens:
        raise ValueError(f"{name} {max_model_len} is more than the KV cache pool holds ({pool_tokens} tokens): lower "
                         f"{name} to at most {pool_tokens}, or give the pool more memory ({pool_names})")


def _bucket(n: int, buckets: tuple) -> int:
    return buckets[bisect.bisect_left(buckets, n)]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Every setting of an `Engine`, checked once (`check`). The keyword form `Engine(model, page_size=...)` builds one.

    swiftkv: None serves a SwiftKV model in SwiftKV wiring, a plain model as is; False serves a SwiftKV model as its
    teacher. The pool: `page_size` tokens a page, sized by exactly one of `num_pages`, `kv_cache_bytes` or
    `kv_cache_fraction` (of the device memory free once the engine holds its weights). A step runs at most
    `max_num_seqs` sequences and `max_num_batched_tokens` of budget, in `budget_unit` "tokens" or "cost" (a SwiftKV
    prompt token costs about l/L); at most `max_prompt_seqs` prompts are packed in one step. The defaults are
    sized for a GPU of 80 GB serving an 8B model (vLLM's on an H100: 256 sequences, 8192 tokens).

    Shapes are bucketed, and `warmup()` compiles every program: a step of decodes only pads its count to one of
    `single_buckets`; a step with prompt tokens pads them to one of `prompt_buckets` and its decodes to one of
    `mixed_single_buckets` (few: such a step is large anyway). The XLA paged path's tables are read `table_buckets`
    pages wide (the step's longest sequence, bucketed) where its cost follows the width (`xla_loop="static"`, the
    form off the CPU); elsewhere one width. attention_impl / decode_attention_impl: None keeps the model config's
    off a GPU; on one, prompts run our Mosaic flash kernel on sm_90 and cuDNN elsewhere (bf16 / fp16 models), few
    queries the Pallas paged kernel (`kernel_choice`: what the GPU runs measured fastest). enable_prefix_caching:
    reuse the pages of prompt prefixes already computed (see the scheduler).
    """

    swiftkv: Optional[bool] = None
    page_size: int = 16
    num_pages: Optional[int] = None
    kv_cache_bytes: Optional[int] = None
    kv_cache_fraction: Optional[float] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    budget_unit: str = "tokens"
    max_model_len: Optional[int] = None
    max_prompt_seqs: int = 8
    cache_dtype: object = "auto"  # the model's compute dtype (kv_quant.AUTO)
    kv_scales: Optional[str] = None
    attention_impl: Optional[str] = None
    decode_attention_impl: Optional[str] = None
    xla_loop: Optional[str] = None
    single_buckets: Optional[tuple] = None
    mixed_single_buckets: Optional[tuple] = None
    prompt_buckets: Optional[tuple] = None
    table_buckets: Optional[tuple] = None
    mesh: Optional[Mesh] = None
    consume_weights: bool = False
    warmup: bool = False
    enable_prefix_caching: bool = True

    def __post_init__(self):
        for name in ("single_buckets", "mixed_single_buckets", "prompt_buckets", "table_buckets"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(sorted(value)))

    def check(self) -> None:
        """Raise ValueError naming the setting and what it takes."""
        if self.budget_unit not in BUDGET_UNITS:
            raise ValueError(f"budget_unit must be one of {BUDGET_UNITS}, got {self.budget_unit!r}")
        # numpy scalars are taken as Python numbers; a float page count (int() floored 2.5 to 2), text or a string
        # "false" for a flag (consume_weights="false" deleted the caller's weights) are refused by name
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "max_prompt_seqs"):
            object.__setattr__(self, name, integer(name, getattr(self, name), 1))
        for name in ("max_model_len", "num_pages", "kv_cache_bytes"):  # None: unset (the pool's size: its own check)
            if getattr(self, name) is not None:
                minimum = 1 if name == "max_model_len" else None
                object.__setattr__(self, name, integer(name, getattr(self, name), minimum, optional=True))
        if self.kv_cache_fraction is not None:
            object.__setattr__(self, "kv_cache_fraction", real("kv_cache_fraction", self.kv_cache_fraction))
        for name in ("consume_weights", "warmup", "enable_prefix_caching"):
            flag(name, getattr(self, name))
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                             f"({self.max_num_seqs}), so that every running sequence can decode in every step")
        if self.xla_loop is not None and self.xla_loop not in XLA_LOOPS:
            raise ValueError(f"xla_loop must be one of {XLA_LOOPS} (or None: by backend), got {self.xla_loop!r}")
        for name in ("single_buckets", "mixed_single_buckets", "prompt_buckets", "table_buckets"):
            value = getattr(self, name)
            if value is not None and (not value or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                                                       for v in value)):
                raise ValueError(f"{name} must be positive integers, got {value!r}")
        check_format(self.cache_dtype, self.kv_scales)  # a bad dtype or scale setting names the choices


@dataclasses.dataclass
class _InFlight:
    """A launched step: what it ran, and its outputs on the device."""

    schedule: Schedule
    token: jax.Array
    logprob: jax.Array
    top: Optional[tuple]   # (values, ids) when a row asked for top logprobs


class Engine:
    """Continuous batching with a paged KV cache (see the module docstring and `EngineConfig` for the settings,
    given as an `EngineConfig` or as keywords). The engine holds the weights in its own layout (per-layer arrays);
    `consume_weights=True` deletes the model's stacked layer arrays as they are copied, so that the weights exist
    once (`infer.py serve` does; `model` is unusable afterwards).
    """

    @staticmethod
    def _max_model_len(options: EngineConfig, cfg: ModelConfig, pool_tokens: int) -> int:
        return int(options.max_model_len or min(cfg.max_position_embeddings, pool_tokens))

    @staticmethod
    def _check_table_buckets(options: EngineConfig, page_size: int, max_model_len: int) -> None:
        pages = pages_for(max_model_len, page_size)
        if max(options.table_buckets) < pages:
            raise ValueError(f"the largest table bucket must hold max_model_len={max_model_len} tokens ({pages} "
                             f"pages), got table_buckets {options.table_buckets}")

    def __init__(self, model: Model, engine_config: Optional[EngineConfig] = None, **settings):
        if not isinstance(model, Model):
            raise TypeError(f"Engine takes a Model (as sk.load and sk.init return), got {type(model).__name__}")
        if engine_config is not None and not isinstance(engine_config, EngineConfig):
            raise TypeError(f"engine_config must be an EngineConfig, got {type(engine_config).__name__}: or give the "
                            f"settings as keywords, Engine(model, max_num_seqs=...)")
        if engine_config is not None and settings:
            raise ValueError("pass an EngineConfig or keyword settings, not both")
        try:
            options = engine_config or EngineConfig(**settings)
        except TypeError as e:
            names = ", ".join(f.name for f in dataclasses.fields(EngineConfig))
            raise TypeError(f"{e}; Engine settings are: {names}") from None
        options.check()
        self.engine_config = options
        self.mesh = mesh = options.mesh
        check_params(model.config, model.params)  # another config's weights failed in the first step, not here
        model = for_serving(model, mesh)  # first: a tensor size that cannot work fails before anything is allocated
        self.config = cfg = serving_config(model.config, options.cache_dtype, paged=True,
                                           attention_impl=options.attention_impl,
                                           decode_attention_impl=options.decode_attention_impl)
        self.swiftkv = serves_swiftkv(cfg, options.swiftkv)
        # "auto": the model's compute dtype, the one the pool is sized and allocated in (and the compile key holds)
        self.cache_format = as_format(options.cache_dtype, options.kv_scales, cfg.dtype)
        page_size = self.page_size = options.page_size
        budget = dict(num_pages=options.num_pages, kv_cache_bytes=options.kv_cache_bytes,
                      kv_cache_fraction=options.kv_cache_fraction,
                      devices=None if mesh is None else list(mesh.devices.flat))
        # a bad budget fails here; a fraction's count is of the memory free once the weights are laid out (below)
        early_pages = pages_for_budget(cfg, self.swiftkv, page_size, self.cache_format, **budget)
        self.prompt_cost = prompt_token_cost(cfg, self.swiftkv) if options.budget_unit == "cost" else 1.0
        max_num_seqs = options.max_num_seqs
        max_prompt_tokens = int(options.max_num_batched_tokens / self.prompt_cost + 1e-9)
        self.single_buckets = options.single_buckets or _growing(min(8, max_num_seqs), max_num_seqs)
        self.mixed_single_buckets = options.mixed_single_buckets or tuple(sorted(
            {_bucket(max(1, max_num_seqs // 8), self.single_buckets), self.single_buckets[-1]}))
        self.prompt_buckets = options.prompt_buckets or _growing(
            min(max_prompt_tokens, max(32, max_prompt_tokens // 64)), max_prompt_tokens)
        if (self.single_buckets[-1] < max_num_seqs or self.mixed_single_buckets[-1] < max_num_seqs
                or self.prompt_buckets[-1] < max_prompt_tokens):
            raise ValueError(f"the largest buckets must hold max_num_seqs={max_num_seqs} single tokens and "
                             f"{max_prompt_tokens} prompt tokens, got single_buckets {self.single_buckets}, "
                             f"mixed_single_buckets {self.mixed_single_buckets} and prompt_buckets "
                             f"{self.prompt_buckets}")
        if options.max_model_len is not None:  # before the weights are consumed: a refusal leaves the model whole
            check_max_model_len(options.max_model_len, cfg.max_position_embeddings, None)
        if options.table_buckets and options.kv_cache_fraction is None:  # the pool is known: so is max_model_len
            self._check_table_buckets(options, page_size, self._max_model_len(
                options, cfg, tokens_held(early_pages, page_size)))
        # The serving layout (once, not per step) before the pool is sized: a kv_cache_fraction is of the memory
        # free once the engine's weights exist, and, consumed, the stacked copy is gone (no second copy to OOM).
        self.params = unstack_layers(model.params, cfg, consume=options.consume_weights)
        del model
        # The penalties' per-slot token counts (`ragged_step.PROMPT_BIT`), before the pool is sized from the free
        # memory: [max_num_seqs, V] int32, 256 x 128,256 x 4 = 131 MB at vLLM's defaults for Llama 3, born on the
        # device(s). Kept for the slots of penalised requests only (their admission rebuilds the row, `_launch`).
        shape = (max_num_seqs, cfg.vocab_size)
        zeros = functools.partial(jnp.zeros, shape, jnp.int32)
        self.counts = zeros() if mesh is None else jax.jit(
            zeros, out_shardings=NamedSharding(mesh, PartitionSpec()))()
        # The logit bias of each slot, sparse: (ids, values) [max_num_seqs, MAX_LOGIT_BIAS], ids padded with V (0.6
        # MB at 256 slots); a biased request's admission writes its slot's row, `_launch`
        self.bias = replicated(mesh, (np.full((max_num_seqs, MAX_LOGIT_BIAS), cfg.vocab_size, np.int32),
                                      np.zeros((max_num_seqs, MAX_LOGIT_BIAS), np.float32)))
        self._slot_biased = np.zeros(max_num_seqs, bool)  # the slots whose row holds a bias (to clear on reuse)
        # vLLM's min_tokens: each slot's stop ids [max_num_seqs, MAX_MASKED_STOP_IDS] padded with V (128 KB at 256
        # slots), written at the admission of a request with min_tokens (`_launch`); a step masks them (logit -inf) in
        # the rows whose request has generated fewer than min_tokens, a per-row flag of the step's packed settings
        # that the host computes from the sequence's count of tokens (`_build`). So a request without min_tokens,
        # or past it, costs nothing (the rows' flag is off: the step's `sample_penalised` gate stays shut, and a
        # stale row of a reused slot is never read), and a step moves no more than its per-row settings.
        self.stops = replicated(mesh, np.full((max_num_seqs, MAX_MASKED_STOP_IDS), cfg.vocab_size, np.int32))
        # structured outputs: each slot's token bitmask [max_num_seqs, ceil(V / 32)] int32 (4 MB at 256 x 128K),
        # written before a step (`_write_masks`: one `_set_rows` of the rows to write, their count padded to one of
        # mask_buckets): a grammar's (or bad_words') rows before each step they run in, an allowed_token_ids row
        # once, at its request's admission. A step applies a row's only where its packed `guided` flag is on, so
        # unmasked steps pay nothing and a stale row of a reused slot is never read
        self.masks = replicated(mesh, np.zeros((max_num_seqs, words(cfg.vocab_size)), np.int32))
        self.mask_buckets = _growing(min(8, max_num_seqs), max_num_seqs)
        num_pages = pages_for_budget(cfg, self.swiftkv, page_size, self.cache_format, **budget)
        # default: what the model and the pool can hold; work follows each sequence's length, not this limit
        # (a given one may exceed the pool: requests that do not fit are refused, small pools test preemption; the
        # server refuses it at start-up, `http.process.start_engine`)
        pool_tokens = tokens_held(num_pages, page_size)
        if not options.prompt_buckets:  # a step's prompt tokens need pages: default buckets past the pool never run
            reach = min(max_prompt_tokens, pool_tokens)
            self.prompt_buckets = tuple(b for b in self.prompt_buckets if b < reach) + (
                _bucket(reach, self.prompt_buckets),)
        self.max_model_len = self._max_model_len(options, cfg, pool_tokens)
        self.pages_per_seq = pages_for(self.max_model_len, page_size)
        self.xla_loop = options.xla_loop or default_xla_loop()
        if options.table_buckets:
            self._check_table_buckets(options, page_size, self.max_model_len)
            self.table_buckets = tuple(min(w, self.pages_per_seq) for w in options.table_buckets)
        elif cfg.decode_attention_impl == "xla" and self.xla_loop == "static":  # cost follows the width: a handful
            self.table_buckets = _growing(min(self.pages_per_seq, pages_for(1024, page_size)), self.pages_per_seq, 4)
        else:  # the kernel and the dynamic loop stop at each length: one width
            self.table_buckets = (self.pages_per_seq,)
        self.allocator = PageAllocator(num_pages)
        self.pool = init_pool(cfg, num_pages, page_size, self.swiftkv, self.cache_format, mesh=mesh)
        self.tables, self.last_tokens = replicated(mesh, (np.zeros((max_num_seqs, self.pages_per_seq), np.int32),
                                                          np.zeros(max_num_seqs, np.int32)))
        self.max_prompt_seqs = options.max_prompt_seqs
        # per slot: temperature, top_p, top_k, seed, top_logprobs, min_p, repetition, presence and frequency
        # penalties, and min_tokens (0 where it has no stop id to mask) of the sequence that holds it
        self._slot_settings = np.zeros((max_num_seqs, 10), np.float64)
        # rebuilding a penalised sequence's counts row (`_reset_counts`): its tokens padded to one of these
        self.count_buckets = _growing(min(64, self.max_model_len), self.max_model_len)
        self.scheduler = Scheduler(self.allocator, page_size=page_size, max_num_seqs=max_num_seqs,
                                   budget=float(options.max_num_batched_tokens), max_prompt_tokens=max_prompt_tokens,
                                   max_prompt_seqs=options.max_prompt_seqs, prompt_cost=self.prompt_cost,
                                   max_model_len=self.max_model_len, prefix_caching=options.enable_prefix_caching,
                                   cache_salt=self._cache_salt(cfg))
        self.default_stop_ids = tuple(cfg.eos_token_id or ())
        self._sequences: dict[str, Sequence] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._live_ids: set[str] = set()  # ids queued or running: an id names one request until it finishes
        self._arrivals = itertools.count()
        self._id_lock = threading.Lock()
        self._in_flight: Optional[_InFlight] = None
        self._compiled: set = set()
        self.counters = dict(steps=0, prompt_tokens=0, generated_tokens=0, finished=0, aborted=0, busy_s=0.0)
        log.info("paged KV cache: %d pages of %d tokens = %d tokens, %.1f MiB (%s wiring, %d cached layers)%s; "
                 "attention %s / %s", self.allocator.capacity, page_size, self.allocator.capacity * page_size,
                 self.pool.nbytes / 2**20, "SwiftKV" if self.swiftkv else "teacher",
                 len(self.pool.lower) + len(self.pool.upper or ()),
                 "" if mesh is None else f", split over {mesh.size} devices by KV heads", cfg.attention_impl,
                 cfg.decode_attention_impl + (f" ({self.xla_loop} loop)" if cfg.decode_attention_impl == "xla" else ""))
        if options.warmup:
            self.warmup()

    # ---- requests -------------------------------------------------------------------------------------------
    def add_request(self, prompt: Seq[int], *, request_id: Optional[str] = None, max_tokens: int = 16,
                    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
                    stop_token_ids: Optional[Seq[int]] = None, logprobs: bool = False, top_logprobs: int = 0,
                    prompt_logprobs: Optional[int] = None, min_p: float = 0.0, repetition_penalty: float = 1.0,
                    presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                    logit_bias: Optional[dict] = None, min_tokens: int = 0, grammar=None,
                    allowed_token_ids: Optional[Seq[int]] = None,
                    bad_words_ids: Optional[Seq[Seq[int]]] = None) -> str:
        """Queue a request (thread-safe); bad input raises `InvalidRequest` (a ValueError naming the setting) here,
        for this request only. prompt_logprobs (vLLM's): None, or k: every prompt token's logprob under the model
        and the k most likely tokens at its position, computed at full depth in the engine's wiring (the prompt
        runs as full-depth single tokens, see the scheduler); on the request's first output.

        vLLM's sampling, in vLLM's order: the penalties on the model's logits, then the temperature, min_p, top_k
        and top_p. repetition_penalty (> 0, 1 off): a token of the prompt or the output so far has a positive logit
        divided by it, a negative one multiplied; presence_penalty and frequency_penalty (in [-2, 2], 0 off): a
        token the request generated n > 0 times has its logit lowered by presence + frequency x n (OpenAI's). Greedy
        (temperature 0) takes the argmax of the penalised logits. min_p (in [0, 1], 0 off): tokens less likely than
        min_p x the most likely one (after the temperature) are dropped. logit_bias (OpenAI's): {token id: bias in
        [-100, 100]}, at most MAX_LOGIT_BIAS (300) ids, each bias added to that token's logit before the penalties
        (vLLM V1's order; -100 all but bans a token, +100 all but forces it). min_tokens (vLLM's, in [0,
        max_tokens]): while the request has generated fewer tokens, its stop ids (stop_token_ids, else the config's
        EOS ids; at most MAX_MASKED_STOP_IDS of them) get logit -inf before all of that, so that no sampling picks
        one. The logprobs stay the model's own.

        grammar (structured outputs): an object with `fill(row)` (the allowed next tokens into an int32 bitmask row of
        ceil(vocab_size / 32) words), `accept(token)` and `done`, such as `structured.json_schema(tokenizer,
        schema)`; one per request, not shared. Every token the request samples is masked by it first (before
        min_tokens' mask, the bias and the penalties), accepted by it once back on the host, and the request
        finishes ("stop") when it is `done` (or on a stop id it allows, EOS once complete). Such a request runs every
        other step (see the module docstring).

        allowed_token_ids (vLLM's): a non-empty list of ids in [0, vocab_size), the only tokens the request may
        sample, every step; a constant bitmask row written at its admission and applied on the device with the
        grammars' (no host work per step, no pipeline break). bad_words_ids (vLLM's bad_words, tokenized by the
        caller: `token_masks.bad_words_ids`): lists of token ids; a one-token word's token is never sampled, a longer
        word's last token not where the tokens generated so far end with its other tokens (`token_masks.BadWords`,
        a host-side mask: such a request runs every other step, as a guided one; words of one token each are a
        constant row, folded into allowed_token_ids' at admission: the pipeline kept). All of them apply together: the
        row is the AND of the grammar's, the bad words' and the allowed ids'. Where they (and min_tokens' stop ids)
        leave no token, the request finishes with finish_reason "error" (`RequestOutput.error` says why, and
        `error_param` names the setting to loosen)."""
        prompt = token_ids("prompt", prompt, InvalidRequest)  # int() made 1.7 token 1 and "123" tokens 1, 2, 3
        if not prompt:
            raise InvalidRequest("the prompt is empty: a request needs at least one token", "prompt")
        vocab = self.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise InvalidRequest(f"prompt token ids must lie in [0, {vocab}), got [{min(prompt)}, {max(prompt)}]",
                                 "prompt")
        with self._id_lock:
            number = next(self._ids)
        if stop_token_ids is not None:
            stop_token_ids = token_ids("stop_token_ids", stop_token_ids, InvalidRequest)
        params = RequestParams(max_tokens, temperature, top_k, top_p, number % 2**31 if seed is None else seed,
                               tuple(stop_token_ids or ()), logprobs, top_logprobs, prompt_logprobs, min_p,
                               repetition_penalty, presence_penalty, frequency_penalty,
                               () if logit_bias is None else logit_bias, min_tokens).validate(vocab)
        stops = frozenset(params.stop_token_ids if stop_token_ids is not None else self.default_stop_ids)
        allowed = self._allowed_row(allowed_token_ids, stops if params.min_tokens else ())
        allowed_from = None if allowed is None else "allowed_token_ids"
        bad_words = self._bad_words(bad_words_ids)
        if bad_words is not None and not bad_words.longer:
            # one-token words only: a constant mask (no host work, the pipeline kept), folded into the allowed row
            allowed, allowed_from = self._without(allowed, bad_words, stops if params.min_tokens else ()), \
                allowed_from or "bad_words_ids"
            bad_words = None
        max_tokens = params.max_tokens
        if params.top_k >= vocab:  # keeps every token: off (and int32 on the device)
            params = dataclasses.replace(params, top_k=0)
        needed = len(prompt) + max_tokens
        if needed > self.max_model_len:
            raise InvalidRequest(f"a prompt of {len(prompt)} tokens plus max_tokens={max_tokens} needs {needed} "
                                 f"positions, but the engine's max_model_len is {self.max_model_len}: shorten the "
                                 f"prompt or lower max_tokens", "max_tokens")
        if -(-needed // self.page_size) > self.allocator.capacity:
            raise InvalidRequest(f"a prompt of {len(prompt)} tokens plus max_tokens={max_tokens} needs "
                                 f"{-(-needed // self.page_size)} pages of {self.page_size} tokens, but the whole KV "
                                 f"cache has {self.allocator.capacity}: raise the cache size or shorten the request",
                                 "max_tokens")
        if request_id is not None and (isinstance(request_id, bool) or not isinstance(request_id, (str, int))):
            raise InvalidRequest(f"request_id must be a string (or an int), got {request_id!r:.60}", "request_id")
        with self._id_lock:
            if request_id is None:
                while str(number) in self._live_ids:  # a caller's own id took it
                    number = next(self._ids)
            elif str(request_id) in self._live_ids:
                raise InvalidRequest(f"request_id {str(request_id)!r} is in use by a request that has not finished: "
                                     f"give each request its own id", "request_id")
            request_id = str(number) if request_id is None else str(request_id)
            self._live_ids.add(request_id)
        if params.min_tokens and len(stops) > MAX_MASKED_STOP_IDS:
            with self._id_lock:
                self._live_ids.discard(request_id)
            raise InvalidRequest(f"min_tokens masks at most {MAX_MASKED_STOP_IDS} stop token ids, but this request "
                                 f"has {len(stops)}: give fewer stop_token_ids", "min_tokens")
        if grammar is not None:
            problem = None
            if not all(callable(getattr(grammar, name, None)) for name in ("fill", "accept")) or not hasattr(
                    grammar, "done"):
                problem = (f"grammar must have fill(row), accept(token) and done (structured.Grammar), got "
                           f"{type(grammar).__name__}")
            elif getattr(grammar, "tokenizer_vocab", 0) > vocab:
                problem = (f"the grammar's tokenizer has {grammar.tokenizer_vocab} tokens, more than the model's "
                           f"vocab_size {vocab}")
            if problem:
                with self._id_lock:
                    self._live_ids.discard(request_id)
                raise InvalidRequest(problem, "grammar")
        seq = Sequence(request_id, -1, prompt, params, stops)
        seq.allowed, seq.allowed_from = allowed, allowed_from
        masks = [m for m in (grammar, bad_words) if m is not None]
        seq.grammar = token_masks.Intersection(masks) if len(masks) > 1 else (masks or [None])[0]
        self._inbox.put(("add", seq))
        return request_id

    def _allowed_row(self, ids, stops) -> Optional[np.ndarray]:
        """allowed_token_ids' bitmask row (None: none), checked; `stops`: the stop ids min_tokens masks (none: ())."""
        if ids is None:
            return None
        ids = token_ids("allowed_token_ids", ids, InvalidRequest)
        vocab = self.config.vocab_size
        if not ids:
            raise InvalidRequest("allowed_token_ids must not be empty: omit it to allow every token",
                                 "allowed_token_ids")
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequest(f"allowed_token_ids must lie in [0, {vocab}), got "
                                 f"{[t for t in ids if not 0 <= t < vocab][:5]}", "allowed_token_ids")
        if stops and set(ids) <= stops:
            raise InvalidRequest("every allowed_token_ids is a stop id, which min_tokens masks: no token could be "
                                 "sampled", "allowed_token_ids")
        return token_masks.allowed_row(ids, vocab)

    def _without(self, allowed: Optional[np.ndarray], bad_words: token_masks.BadWords, stops) -> np.ndarray:
        """The constant bitmask row of one-token bad words (their mask before any token) ANDed with allowed_token_ids'
        row (None: none), checked to leave a token (`stops`: the stop ids min_tokens masks)."""
        row = np.empty(words(self.config.vocab_size), np.int32)
        bad_words.fill(row)
        if allowed is not None:
            row &= allowed
        if not token_masks.leaves_a_token(row, stops):
            raise InvalidRequest("bad_words_ids ban every token that allowed_token_ids (or the vocabulary) leaves"
                                 + (", the stop ids aside, which min_tokens masks" if stops else "")
                                 + ": no token could be sampled", "bad_words_ids")
        return row

    def _bad_words(self, word_ids) -> Optional[token_masks.BadWords]:
        """bad_words_ids' mask (None: none), checked."""
        if word_ids is None:
            return None
        if isinstance(word_ids, (str, bytes)) or not hasattr(word_ids, "__iter__"):
            raise InvalidRequest(f"bad_words_ids must be a list of lists of token ids, got {word_ids!r:.80}",
                                 "bad_words_ids")
        words_ = [token_ids("bad_words_ids", w, InvalidRequest) for w in word_ids]
        vocab = self.config.vocab_size
        for w in words_:
            if not w or min(w) < 0 or max(w) >= vocab:
                raise InvalidRequest(f"bad_words_ids: each word must be a non-empty list of ids in [0, {vocab}), "
                                     f"got {w[:8]}", "bad_words_ids")
        return token_masks.BadWords(words_, vocab) if words_ else None

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End a request (thread-safe): its pages go back to the pool at the start of the next step. reason: "abort",
        or "stop" when the caller saw a stop condition of its own (a server's stop string): it then counts as
        finished, not aborted."""
        if reason not in ("abort", "stop"):
            raise ValueError(f"reason must be 'abort' or 'stop', got {reason!r}")
        self._inbox.put(("abort", (str(request_id), reason)))

    def _drain_inbox(self, outputs: list) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":  # its id is unique among live requests (add_request)
                item.arrival = next(self._arrivals)
                self._sequences[item.request_id] = item
                self.scheduler.add(item)
            elif item[0] in self._sequences:
                request_id, reason = item
                outputs.append(self._finish(self._sequences[request_id], reason))
                self.counters["aborted"] += reason == "abort"

    @property
    def state_bytes(self) -> int:
        """Bytes the engine keeps on its devices besides the weights: the pool, the block tables, the last tokens and
        the penalties' token counts, the logit bias table, the min_tokens stop-id table and the grammar bitmasks."""
        return (self.pool.nbytes + self.tables.nbytes + self.last_tokens.nbytes + self.counts.nbytes
                + sum(a.nbytes for a in self.bias) + self.stops.nbytes + self.masks.nbytes)

    def has_unfinished(self) -> bool:
        return bool(self._sequences) or not self._inbox.empty() or self._in_flight is not None

    # ---- the step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launch the next engine step, then return the outputs of the one before it: the new token of every
        request that sampled one there, and the finished (or aborted) requests."""
        start = time.perf_counter()
        outputs: list[RequestOutput] = []
        self._drain_inbox(outputs)
        schedule = self.scheduler.schedule()
        launched = None if schedule.empty else self._launch(schedule, outputs)
        if self._in_flight is not None:
            outputs += self._collect(self._in_flight)
        self._in_flight = launched
        if launched is not None or outputs:
            self.counters["busy_s"] += time.perf_counter() - start
        return outputs

    def _cache_salt(self, cfg) -> bytes:
        """What makes this engine's K/V differ from another's (the prefix cache's hashes start from it): the
        model's config, the wiring and the cache format. Pages live in one engine, so a weights change (a new
        engine) never finds them."""
        return hashlib.blake2b(repr((cfg, self.swiftkv, self.cache_format)).encode(), digest_size=16).digest()

    def _launch(self, schedule: Schedule, outputs: list) -> _InFlight:
        for slot, pages in schedule.cached_rows:  # sequences starting on cached pages: their table rows first
            row = np.zeros(self.pages_per_seq, np.int32)
            row[:len(pages)] = pages
            self.tables = _set_rows(self.tables, np.int32(slot), replicated(self.mesh, row))
        for seq in schedule.admitted:  # penalised sequences given a slot: its counts row, from their tokens so far
            if seq.params.penalised:
                self._reset_slot_counts(seq)
            if seq.params.biased or self._slot_biased[seq.slot]:  # a biased one's row, or a former one's cleared
                self._set_slot_bias(seq)
            if seq.params.min_tokens and seq.stop_ids:  # its stop ids to mask (a former one's row: never read)
                ids = np.full(MAX_MASKED_STOP_IDS, self.config.vocab_size, np.int32)
                ids[:len(seq.stop_ids)] = sorted(seq.stop_ids)
                self.stops = _set_rows(self.stops, np.int32(seq.slot), replicated(self.mesh, ids))
        key, step, want_top = self._build(schedule)
        self._write_masks(schedule, step.sampling.guided, outputs)
        if key not in self._compiled:
            log.info("compiling the engine step for %d single and %d prompt tokens, tables %d pages wide (not "
                     "warmed up)", *key)
            self._compiled.add(key)
        token, logprob, top = self._run_step(step, want_top, key[2])
        self.counters["steps"] += 1
        # prompt tokens run as packed chunks, and as single rows (scored ones, and a prompt's last token left alone)
        self.counters["prompt_tokens"] += (sum(c.length for c in schedule.prompts)
                                           + sum(c.start < len(c.seq.prompt) for c in schedule.singles))
        return _InFlight(schedule, token, logprob, top if want_top else None)

    def _write_masks(self, schedule: Schedule, guided: Optional[np.ndarray], outputs: list) -> None:
        """Write the token bitmask rows this step needs, before it is launched, in one `_set_rows`: the slot of each
        sequence admitted with allowed_token_ids and no host-side mask gets its constant row (once: the request then
        keeps the pipeline), and each guided row whose request has a grammar or bad_words (`seq.grammar`) gets its
        mask from their state (its last token accepted: such a sequence is never scheduled with a token pending),
        ANDed with its allowed_token_ids. A mask that cannot be given (llguidance in an error state: a limit of its
        parser reached), or one that allows no token (with min_tokens' stop ids masked), finishes its request alone,
        finish_reason "error" (its row runs, and `update` drops its token), not the engine."""
        entries = [(seq, None) for seq in schedule.admitted if seq.allowed is not None and seq.grammar is None]
        if guided is not None:
            chunks = schedule.sampling
            entries += [(chunks[row].seq, chunks[row].seq.grammar) for row in np.flatnonzero(guided)
                        if chunks[row].seq.grammar is not None]
        if not entries:
            return
        n = _bucket(len(entries), self.mask_buckets)
        slots = np.full(n, self.scheduler.max_num_seqs, np.int32)
        table = np.zeros((n, self.masks.shape[1]), np.int32)
        for i, (seq, mask) in enumerate(entries):
            slots[i] = seq.slot
            if mask is None:
                table[i] = seq.allowed
                continue
            try:
                mask.fill(table[i])
                if seq.allowed is not None:
                    table[i] &= seq.allowed
                if not token_masks.leaves_a_token(
                        table[i], seq.stop_ids if len(seq.output) < seq.params.min_tokens else ()):
                    raise InvalidRequest("its token masks (grammar, allowed_token_ids, bad_words and the stop ids "
                                         "min_tokens masks) together allow no token: loosen one of them",
                                         _blamed_mask(seq, table[i].any()))
            except Exception as e:  # noqa: BLE001  the request's own failure
                log.warning("request %s: no mask for its next token, finishing it: %s", seq.request_id, e)
                outputs.append(self._finish(seq, "error"))
                outputs[-1].error = f"the request's token mask failed: {e}"
                outputs[-1].error_param = e.param if isinstance(e, InvalidRequest) else None
        self.masks = _set_rows(self.masks, slots, replicated(self.mesh, table))

    def _reset_slot_counts(self, seq: Sequence) -> None:
        """Rebuild the counts row of a penalised sequence's new slot from the host: its whole prompt (pages found in
        the prefix cache never pass through a step) and its output (a preempted sequence comes back once its
        pending token is known, so the host has every token; the steps add each one sampled after). Launched
        before the step, after any step that wrote the slot for its previous sequence."""
        vocab = self.config.vocab_size
        n = len(seq.prompt) + len(seq.output)
        marks = np.full(_bucket(n, self.count_buckets), 2 * vocab, np.int32)
        marks[:len(seq.prompt)] = seq.prompt
        marks[len(seq.prompt):n] = np.asarray(seq.output, np.int32) + vocab
        self.counts = _reset_counts(self.counts, np.int32(seq.slot), replicated(self.mesh, marks))

    def _set_slot_bias(self, seq: Sequence) -> None:
        """Write a sequence's logit bias to its new slot's row (none: the row cleared). Launched before the step,
        after any step that read the slot for its previous sequence."""
        ids = np.full(MAX_LOGIT_BIAS, self.config.vocab_size, np.int32)
        values = np.zeros(MAX_LOGIT_BIAS, np.float32)
        n = len(seq.params.logit_bias)
        if n:
            ids[:n], values[:n] = zip(*seq.params.logit_bias)
        self.bias = _set_bias(self.bias, np.int32(seq.slot), *replicated(self.mesh, (ids, values)))
        self._slot_biased[seq.slot] = n > 0

    def _collect(self, flight: _InFlight) -> list[RequestOutput]:
        """Wait for a launched step's tokens and hand them to their requests."""
        token, logprob, top = jax.device_get((flight.token, flight.logprob, flight.top))
        outputs = []
        joined = self.scheduler.update(flight.schedule, token, logprob, top)
        self.counters["generated_tokens"] += len(joined)
        for seq, reason in joined:
            stopped_by_grammar = False
            if seq.grammar is not None:  # a token outside its mask raises: a bug
                seq.grammar.accept(seq.output[-1])
                if reason is None and seq.grammar.done:  # nothing but EOS may follow: over
                    self.scheduler.finish(seq, "stop")
                    reason, stopped_by_grammar = "stop", True
            lp = [seq.logprobs[-1]] if seq.params.logprobs else []
            top_lp = seq.top_logprobs[-1:]
            if reason:
                done = self._finished(seq)
                done.grammar_done = stopped_by_grammar
                done.new_token_ids, done.new_logprobs, done.new_top_logprobs = [seq.output[-1]], lp, top_lp
                outputs.append(done)
            else:
                outputs.append(RequestOutput(seq.request_id, [seq.output[-1]], lp, new_top_logprobs=top_lp))
                if seq.prompt_logprobs is not None and len(seq.output) == 1:
                    outputs[-1].prompt_logprobs = list(seq.prompt_logprobs)
                    outputs[-1].prompt_top_logprobs = list(seq.prompt_top_logprobs)
        return outputs

    def _finish(self, seq: Sequence, reason: str) -> RequestOutput:
        self.scheduler.finish(seq, reason)
        return self._finished(seq)

    def _finished(self, seq: Sequence) -> RequestOutput:
        """The whole result of a sequence the scheduler has finished."""
        reason = seq.finish_reason
        del self._sequences[seq.request_id]
        with self._id_lock:
            self._live_ids.discard(seq.request_id)
        self.counters["finished"] += reason != "abort"
        first, last, n = seq.first_token_time, seq.last_token_time, len(seq.output)
        scheduled = seq.first_scheduled_time
        metrics = dict(queue_s=(scheduled or time.perf_counter()) - seq.arrival_time,
                       ttft_s=first - seq.arrival_time if n else None,
                       tpot_s=(last - first) / (n - 1) if n > 1 else None,
                       prefill_s=first - scheduled if n else None, decode_s=last - first if n else None,
                       inference_s=last - scheduled if n else None,
                       e2e_s=time.perf_counter() - seq.arrival_time, preemptions=seq.num_preemptions,
                       prompt_tokens=len(seq.prompt), generated_tokens=len(seq.output),
                       max_tokens=seq.params.max_tokens)
        prompt_lp, prompt_top = seq.prompt_logprobs, seq.prompt_top_logprobs
        return RequestOutput(seq.request_id, [], [], True, reason, list(seq.output),
                             list(seq.logprobs) if seq.params.logprobs else None, metrics,
                             top_logprobs=list(seq.top_logprobs) if seq.params.top_logprobs else None,
                             prompt_logprobs=None if prompt_lp is None else list(prompt_lp),
                             prompt_top_logprobs=None if prompt_top is None else list(prompt_top))

    def _shape(self, num_single: int, num_prompt: int, num_pages: int) -> tuple[int, int, int]:
        """The program (single tokens, prompt tokens, table width) a step of these sizes runs in."""
        if num_prompt:
            return (_bucket(num_single, self.mixed_single_buckets), _bucket(num_prompt, self.prompt_buckets),
                    _bucket(num_pages, self.table_buckets))
        return _bucket(num_single, self.single_buckets), 0, _bucket(num_pages, self.table_buckets)

    def _rows(self, d: int, r: int) -> tuple[int, int]:
        """(logit rows, block-table entries) of a step of d single and r prompt tokens: every single samples, and so
        may each packed prompt; a prompt chunk of n tokens adds at most n // page_size + 1 pages, a single one."""
        prompt_seqs = min(self.max_prompt_seqs, r) if r else 0
        return d + prompt_seqs, d + r // self.page_size + prompt_seqs

    def programs(self) -> list[tuple[int, int, int]]:
        """Every (single tokens, prompt tokens, table width) program the engine may run."""
        steps = [(d, 0) for d in self.single_buckets]
        steps += [(d, r) for d in self.mixed_single_buckets for r in self.prompt_buckets]
        return [(d, r, w) for d, r in steps for w in self.table_buckets]

    def _build(self, schedule: Schedule):
        """(the program, the step's StepInput, whether any row wants top logprobs): numpy over the step's rows, with
        each slot's sampling settings kept on the host from its admission on (as vLLM's persistent batch)."""
        singles, prompts, sampling_chunks = schedule.singles, schedule.prompts, schedule.sampling
        for seq in schedule.admitted:
            p = seq.params
            self._slot_settings[seq.slot] = (p.temperature, p.top_p, p.top_k, p.seed, p.top_logprobs, p.min_p,
                                             p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
                                             p.min_tokens if seq.stop_ids else 0)
        num_prompt = sum(c.length for c in prompts)
        widest = max(max([len(c.seq.pages) for c in singles], default=0), max([len(c.seq.pages) for c in prompts],
                                                                               default=0))
        key = d, r, _ = self._shape(len(singles), num_prompt, widest)
        u, a = self._rows(d, r)
        assert len(prompts) <= u - d, "the step's prompt runs are bounded by its logit rows (ragged_step)"
        tokens, positions, slots = np.zeros(d + r, np.int32), np.zeros(d + r, np.int32), np.full(d + r, -1, np.int32)
        segments = np.full(r, -1, np.int32)
        n = len(singles)
        tokens[:n] = [c.token for c in singles]  # plain comprehensions: this runs over every running sequence
        positions[:n] = [c.start for c in singles]
        slots[:n] = [c.seq.slot for c in singles]
        upper_index, targets = np.full(u, -1, np.int32), np.full(u, -1, np.int32)
        upper_index[:n] = np.arange(n)
        if schedule.scored:
            targets[:n] = [c.target for c in singles]
        rows, offset = n, d
        for segment, chunk in enumerate(prompts):
            end = offset + chunk.length
            tokens[offset:end] = chunk.seq.token_ids(chunk.start, chunk.length)
            positions[offset:end] = np.arange(chunk.start, chunk.start + chunk.length)
            slots[offset:end] = chunk.seq.slot
            segments[offset - d:end - d] = segment
            if chunk.samples:
                upper_index[rows] = end - 1
                rows += 1
            offset = end
        settings = np.zeros((u, 10), np.float64)
        settings[:, [1, 6]] = 1.0  # padding rows: greedy, top_p and the repetition penalty off
        settings[:rows] = self._slot_settings[slots[upper_index[:rows]]]
        count = np.zeros(u, np.int32)
        count[:rows] = [c.count for c in sampling_chunks]
        floats = settings.astype(np.float32)
        # min_tokens: a row masks its stop ids while its request has generated fewer (a scored prompt token's row
        # keeps no token: never)
        masked = ((count < settings[:, 9]) & (targets < 0)).astype(np.int32)
        # the rows whose request has a token mask (a grammar, bad_words, allowed_token_ids: its slot's bitmask row;
        # None: no such row)
        guided = None
        if any(c.seq.grammar is not None or c.seq.allowed is not None for c in sampling_chunks):
            guided = np.zeros(u, np.int32)
            guided[:rows] = [c.seq.grammar is not None or c.seq.allowed is not None for c in sampling_chunks]
            guided &= targets < 0
        sampling = Sampled(floats[:, 0], settings[:, 2].astype(np.int32), floats[:, 1],
                           settings[:, 3].astype(np.int32), count, *floats[:, 5:9].T, masked, guided)
        new = schedule.new_pages
        assert len(new) <= a, (len(new), a)
        table = np.zeros((3, a), np.int32)
        table[0] = self.scheduler.max_num_seqs  # out of range: no entry
        if new:
            table[:, :len(new)] = np.array(new, np.int32).T
        step = StepInput(tokens, positions, slots, segments, upper_index, targets, sampling, *table)
        # top logprobs: for rows that asked, and for scored prompt tokens that did (only while they are scored, so
        # a request's decodes after its prompt pay nothing for them)
        want_top = bool(settings[:rows, 4].any()) or bool(schedule.scored) and any(
            c.seq.params.prompt_logprobs for c in singles if c.target >= 0)
        return key, step, want_top

    def _run_step(self, step: StepInput, want_top: bool, width: int):
        """Launch the step (asynchronously): its outputs on the device; the engine's state moves on."""
        # one transfer each of the step's ints and floats (jnp.asarray would compile a conversion per shape), to
        # every device of a tensor-parallel mesh
        token, logprob, top, self.pool, self.tables, self.last_tokens, self.counts = ragged_step(
            self.params, self.pool, self.tables, self.last_tokens, self.counts, self.bias, self.stops, self.masks,
            replicated(self.mesh, step.pack()),
            np.bool_(want_top), sizes=step.sizes, **self._step_options(width))
        return token, logprob, top

    # ---- convenience ----------------------------------------------------------------------------------------
    def warmup(self) -> float:
        """Compile every program now (`programs()`), so that serving never compiles. Returns seconds."""
        start = time.perf_counter()
        # the table-row update of a prefix-cache hit (before any request: row 0 is all null pages either way)
        self.tables = _set_rows(self.tables, np.int32(0), replicated(self.mesh, np.zeros(self.pages_per_seq, np.int32)))
        for n in self.count_buckets:  # a penalised request's counts row, by its tokens' bucket (no slot: no change)
            marks = np.full(n, 2 * self.config.vocab_size, np.int32)
            self.counts = _reset_counts(self.counts, np.int32(self.scheduler.max_num_seqs),
                                        replicated(self.mesh, marks))
        no_bias = np.full(MAX_LOGIT_BIAS, self.config.vocab_size, np.int32), np.zeros(MAX_LOGIT_BIAS, np.float32)
        self.bias = _set_bias(self.bias, np.int32(self.scheduler.max_num_seqs), *replicated(self.mesh, no_bias))
        no_stops = np.full(MAX_MASKED_STOP_IDS, self.config.vocab_size, np.int32)
        self.stops = _set_rows(self.stops, np.int32(self.scheduler.max_num_seqs), replicated(self.mesh, no_stops))
        for n in self.mask_buckets:  # the grammar bitmasks of n guided rows (no slot: no change)
            self.masks = _set_rows(self.masks, np.full(n, self.scheduler.max_num_seqs, np.int32),
                                    replicated(self.mesh, np.zeros((n, self.masks.shape[1]), np.int32)))
        for key in self.programs():
            t0 = time.perf_counter()
            with count_compiles() as counts:
                self._run_empty(*key)
            self._compiled.add(key)
            how = "loaded from the compilation cache" if counts.loaded and not counts.compiled else "compiled"
            log.info("engine step for %d single and %d prompt tokens, tables %d pages wide: %s in %.1f s", *key, how,
                     time.perf_counter() - t0)
        return time.perf_counter() - start

    def _empty_step(self, d: int, r: int) -> StepInput:
        """A step of padding only: every write goes to the null page, no table entry or last token changes."""
        u, a = self._rows(d, r)
        z = lambda n, fill=0: np.full(n, fill, np.int32)
        sampling = Sampled(np.zeros(u, np.float32), z(u), np.ones(u, np.float32), z(u), z(u))
        return StepInput(z(d + r), z(d + r), z(d + r, -1), z(r, -1), z(u, -1), z(u, -1), sampling,
                         z(a, self.scheduler.max_num_seqs), z(a), z(a))

    def _step_options(self, width: int) -> dict:
        return dict(config=self.config, swiftkv=self.swiftkv, width=width, xla_loop=self.xla_loop, mesh=self.mesh)

    def lower(self, d: int, r: int, width: int):
        """The program (d single tokens, r prompt tokens, tables `width` pages wide), lowered (`jax.stages.Lowered`):
        for its HLO, cost and memory analyses."""
        step = self._empty_step(d, r)
        return ragged_step.lower(self.params, self.pool, self.tables, self.last_tokens, self.counts, self.bias,
                                 self.stops, self.masks, replicated(self.mesh, step.pack()), np.bool_(False),
                                 sizes=step.sizes, **self._step_options(width))

    def _run_empty(self, d: int, r: int, width: int) -> None:
        """Run a step of padding only: compiles the program, changes nothing."""
        self._run_step(self._empty_step(d, r), False, width)[0].block_until_ready()

    def generate(self, prompts: Seq[Seq[int]], **request) -> list[RequestOutput]:
        """Run `prompts` to completion (blocking), with the same `add_request` options for all; finished outputs in
        prompt order. Each request gets an id of its own (a `request_id` is refused)."""
        if "request_id" in request:
            raise TypeError("Engine.generate names its requests itself: pass no request_id (add_request takes one)")
        given = prompts
        try:
            prompts = None if isinstance(given, (str, bytes)) else list(given)
        except TypeError:  # not iterable
            prompts = None
        if prompts is None or (prompts and isinstance(prompts[0], (int, np.integer))):
            raise TypeError(f"Engine.generate takes a list of prompts (token id lists), e.g. [[1, 2, 3]], got "
                            f"{str(given)[:60]}")
        ids = []
        try:
            for p in prompts:
                ids.append(self.add_request(p, **request))
        except BaseException:  # all or none: the prompts added before a bad one are not left to run
            for i in ids:
                self.abort(i)
            raise
        done = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def stats(self) -> dict:
        """Engine counters: running, waiting, page use, preemptions, tokens and tokens/s of busy time, the prefix
        cache's, and the inter-token latency's histogram ({bounds, counts, sum}: seconds between a request's
        successive tokens, timed on the host as each step's tokens arrive)."""
        busy = self.counters["busy_s"]
        return dict(self.counters, running=len(self.scheduler.active), waiting=len(self.scheduler.waiting),
                    pages_total=self.allocator.capacity, pages_free=self.allocator.num_free,
                    page_usage=self.allocator.usage, preemptions=self.scheduler.num_preemptions,
                    generated_tokens_per_s=self.counters["generated_tokens"] / busy if busy else 0.0,
                    compiled_buckets=len(self._compiled),
                    prefix_cache_queries=self.scheduler.prefix_cache_queries,
                    prefix_cache_hits=self.scheduler.prefix_cache_hits,
                    prompt_tokens_answered=self.scheduler.prompt_tokens_answered,
                    prefix_cache_pages=self.allocator.num_cached, prefix_cache_evictions=self.allocator.num_evicted,
                    inter_token_latency=self.scheduler.inter_token.snapshot())
