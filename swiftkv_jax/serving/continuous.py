"""`Engine`: continuous batching over a paged KV cache, the serving engine for many concurrent requests.

    engine = sk.Engine(model, kv_cache_bytes=2 << 30, max_num_seqs=64, max_num_batched_tokens=512)
    rid = engine.add_request(prompt_ids, max_tokens=128, temperature=0.7, seed=1)
    while engine.has_unfinished():
        for out in engine.step():          # new tokens, and the requests that finished
            ...
    engine.generate([[1, 2, 3], [4, 5]], max_tokens=32)   # blocking, for offline batches

Each `step` schedules (`scheduler.Scheduler`), builds the host arrays of one ragged batch, runs the jitted step
(`ragged_step`) for its (singles, prompt tokens) bucket, and hands out the sampled tokens. `add_request` and `abort`
may be called from any thread: they only enqueue, and `step` (one thread) applies them first.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import queue
import threading
import time
from typing import Optional, Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from swiftkv_jax.model.cached import unstack_layers
from swiftkv_jax.model.kv_quant import as_format
from swiftkv_jax.model.model import Model
from swiftkv_jax.model.paged import NULL_PAGE, PagedBatch
from swiftkv_jax.serving.paged_cache import PageAllocator, init_pool, pages_for_budget
from swiftkv_jax.serving.ragged_step import Sampled, ragged_step
from swiftkv_jax.serving.tensor_parallel import for_serving, replicated
from swiftkv_jax.serving.scheduler import (RequestParams, Schedule, Scheduler, Sequence, Status,
                                           prompt_token_cost)

log = logging.getLogger(__name__)
BUDGET_UNITS = ("tokens", "cost")


@dataclasses.dataclass
class RequestOutput:
    """What one step gave one request: its new token (if any) and, once finished, the whole result."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    finished: bool = False
    finish_reason: Optional[str] = None        # "stop" | "length" | "abort"
    token_ids: Optional[list[int]] = None      # all generated tokens, when finished
    logprobs: Optional[list[float]] = None
    metrics: Optional[dict] = None             # queue_s, ttft_s, tpot_s, e2e_s, preemptions, when finished
    new_top_logprobs: list[dict] = dataclasses.field(default_factory=list)  # {token id: logprob}, when asked
    top_logprobs: Optional[list[dict]] = None             # queue_s, ttft_s, tpot_s, e2e_s, preemptions, when finished


def _doubling(low: int, high: int) -> tuple[int, ...]:
    sizes, size = [], low
    while size < high:
        sizes.append(size)
        size *= 2
    return tuple(sizes) + (high,)


class Engine:
    """Continuous batching with a paged KV cache (see the module docstring).

    swiftkv: None serves a SwiftKV model in SwiftKV wiring, a plain model as is; False serves a SwiftKV model as its
    teacher. The pool: `page_size` tokens a page, sized by exactly one of `num_pages`, `kv_cache_bytes` or
    `kv_cache_fraction` (of the device memory free once the engine holds its weights). A step runs at most
    `max_num_seqs` sequences and `max_num_batched_tokens` of budget, in `budget_unit` "tokens" or "cost" (a SwiftKV
    prompt token costs about l/L); at most `max_prompt_seqs` prompts are packed in one step. Shapes are bucketed: `single_buckets` (single
    tokens) x `prompt_buckets` (packed prompt tokens); `warmup()` compiles them all. The engine holds the weights
    in its own layout (per-layer arrays); `consume_weights=True` deletes the model's stacked layer arrays as they
    are copied, so that the weights exist once (`infer.py serve` does; `model` is unusable afterwards).
    """

    def __init__(self, model: Model, *, swiftkv: Optional[bool] = None, page_size: int = 16,
                 num_pages: Optional[int] = None, kv_cache_bytes: Optional[int] = None,
                 kv_cache_fraction: Optional[float] = None, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 512, budget_unit: str = "tokens", max_model_len: Optional[int] = None,
                 max_prompt_seqs: int = 8, cache_dtype="bfloat16", attention_impl: Optional[str] = None,
                 decode_attention_impl: Optional[str] = None, single_buckets: Optional[Seq[int]] = None,
                 prompt_buckets: Optional[Seq[int]] = None, warmup: bool = False, kv_scales: Optional[str] = None,
                 mesh: Optional[Mesh] = None, consume_weights: bool = False):
        self.mesh = mesh
        model = for_serving(model, mesh)  # first: a tensor size that cannot work fails before anything is allocated
        cfg = model.config
        overrides = {"attention_impl": attention_impl, "decode_attention_impl": decode_attention_impl}
        self.config = cfg = cfg.replace(**{k: v for k, v in overrides.items() if v is not None})
        self.swiftkv = cfg.is_swiftkv if swiftkv is None else bool(swiftkv)
        if budget_unit not in BUDGET_UNITS:
            raise ValueError(f"budget_unit must be one of {BUDGET_UNITS}, got {budget_unit!r}")
        for name, value in (("page_size", page_size), ("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens), ("max_prompt_seqs", max_prompt_seqs)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_num_seqs "
                             f"({max_num_seqs}), so that every running sequence can decode in every step")
        self.cache_format = as_format(cache_dtype, kv_scales)  # first: a bad dtype or scale setting names the choices
        budget = dict(num_pages=num_pages, kv_cache_bytes=kv_cache_bytes, kv_cache_fraction=kv_cache_fraction,
                      devices=None if mesh is None else list(mesh.devices.flat))
        pages_for_budget(cfg, self.swiftkv, page_size, self.cache_format, **budget)  # a bad budget fails here
        self.prompt_cost = prompt_token_cost(cfg, self.swiftkv) if budget_unit == "cost" else 1.0
        max_prompt_tokens = int(max_num_batched_tokens / self.prompt_cost + 1e-9)
        self.single_buckets = tuple(sorted(single_buckets or _doubling(1, max_num_seqs)))
        self.prompt_buckets = tuple(sorted(prompt_buckets or _doubling(min(32, max_prompt_tokens), max_prompt_tokens)))
        if self.single_buckets[-1] < max_num_seqs or self.prompt_buckets[-1] < max_prompt_tokens:
            raise ValueError(f"the largest buckets must hold max_num_seqs={max_num_seqs} single tokens and "
                             f"{max_prompt_tokens} prompt tokens, got {self.single_buckets} and {self.prompt_buckets}")
        # The serving layout (once, not per step) before the pool is sized: a kv_cache_fraction is of the memory
        # free once the engine's weights exist, and, consumed, the stacked copy is gone (no second copy to OOM).
        self.params = unstack_layers(model.params, cfg, consume=consume_weights)
        del model
        num_pages = pages_for_budget(cfg, self.swiftkv, page_size, self.cache_format, **budget)
        self.page_size = page_size
        # default: what the model and the pool can hold (the continued prompt's context gather costs this many keys)
        self.max_model_len = int(max_model_len or min(cfg.max_position_embeddings, (num_pages - 1) * page_size))
        self.pages_per_seq = -(-self.max_model_len // page_size)
        self.allocator = PageAllocator(num_pages)
        self.pool = init_pool(cfg, num_pages, page_size, self.swiftkv, self.cache_format, mesh=mesh)
        self.max_prompt_seqs = max_prompt_seqs
        self.scheduler = Scheduler(self.allocator, page_size=page_size, max_num_seqs=max_num_seqs,
                                   budget=float(max_num_batched_tokens), max_prompt_tokens=max_prompt_tokens,
                                   max_prompt_seqs=max_prompt_seqs, prompt_cost=self.prompt_cost)
        self.default_stop_ids = tuple(cfg.eos_token_id or ())
        self._sequences: dict[str, Sequence] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._id_lock = threading.Lock()
        self._compiled: set = set()
        self.counters = dict(steps=0, prompt_tokens=0, generated_tokens=0, finished=0, aborted=0, busy_s=0.0)
        log.info("paged KV cache: %d pages of %d tokens = %d tokens, %.1f MiB (%s wiring, %d cached layers)%s",
                 self.allocator.capacity, page_size, self.allocator.capacity * page_size,
                 self.pool.nbytes / 2**20, "SwiftKV" if self.swiftkv else "teacher",
                 len(self.pool.lower) + len(self.pool.upper or ()),
                 "" if mesh is None else f", split over {mesh.size} devices by KV heads")
        if warmup:
            self.warmup()

    # ---- requests -------------------------------------------------------------------------------------------
    def add_request(self, prompt: Seq[int], *, request_id: Optional[str] = None, max_tokens: int = 16,
                    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
                    stop_token_ids: Optional[Seq[int]] = None, logprobs: bool = False, top_logprobs: int = 0,
                    prompt_logprobs: bool = False) -> str:
        """Queue a request (thread-safe); bad input raises ValueError here, for this request only."""
        if prompt_logprobs:
            raise ValueError("prompt logprobs are not available from this engine: "
                             + ("a SwiftKV prefill never runs the prompt tokens through the layers >= l, so the "
                                "model has no logits for them; score prompts with `infer.py eval` or `sk.logits`"
                                if self.swiftkv else "the engine computes logits for sampled positions only; "
                                "score prompts with `infer.py eval` or `sk.logits`"))
        try:
            prompt = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise ValueError("a prompt must be a sequence of token ids (integers)") from None
        if not prompt:
            raise ValueError("the prompt is empty: a request needs at least one token")
        vocab = self.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab}), got [{min(prompt)}, {max(prompt)}]")
        with self._id_lock:
            number = next(self._ids)
        if seed is None:
            seed = number % 2**31
        params = RequestParams(max_tokens, temperature, top_k, top_p, seed, tuple(stop_token_ids or ()), logprobs,
                               top_logprobs)
        params.validate(vocab)
        needed = len(prompt) + max_tokens
        if needed > self.max_model_len:
            raise ValueError(f"a prompt of {len(prompt)} tokens plus max_tokens={max_tokens} needs {needed} positions, "
                             f"but the engine's max_model_len is {self.max_model_len}: shorten the prompt or lower "
                             f"max_tokens")
        if -(-needed // self.page_size) > self.allocator.capacity:
            raise ValueError(f"a prompt of {len(prompt)} tokens plus max_tokens={max_tokens} needs "
                             f"{-(-needed // self.page_size)} pages of {self.page_size} tokens, but the whole KV cache "
                             f"has {self.allocator.capacity}: raise the cache size or shorten the request")
        request_id = str(number) if request_id is None else str(request_id)
        stops = frozenset(params.stop_token_ids if stop_token_ids is not None else self.default_stop_ids)
        self._inbox.put(("add", Sequence(request_id, -1, prompt, params, stops)))
        return request_id

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
            if kind == "add":
                if item.request_id in self._sequences:
                    log.warning("request id %r is already running; the new request is dropped", item.request_id)
                    outputs.append(RequestOutput(item.request_id, [], [], True, "abort", [], []))
                    continue
                item.arrival = next(self._arrivals)
                self._sequences[item.request_id] = item
                self.scheduler.add(item)
            elif item[0] in self._sequences:
                request_id, reason = item
                outputs.append(self._finish(self._sequences[request_id], reason))
                self.counters["aborted"] += reason == "abort"

    def has_unfinished(self) -> bool:
        return bool(self._sequences) or not self._inbox.empty()

    # ---- the step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step: the new token of every request that sampled one, and the finished requests."""
        outputs: list[RequestOutput] = []
        self._drain_inbox(outputs)
        schedule = self.scheduler.schedule()
        if schedule.empty:
            return outputs
        start = time.perf_counter()
        key, arrays, rows = self._build(schedule)
        if key not in self._compiled:
            log.info("compiling the engine step for %d single and %d prompt tokens (not warmed up)", *key)
            self._compiled.add(key)
        want_top = np.bool_(any(seq.params.top_logprobs for _, seq in rows))  # one dtype: no recompile
        token, logprob, top, self.pool = ragged_step(self.params, self.pool, *arrays, want_top, config=self.config,
                                                     swiftkv=self.swiftkv, mesh=self.mesh)
        token, logprob, (top_values, top_ids) = jax.device_get((token, logprob, top))
        now = time.perf_counter()
        self.counters["steps"] += 1
        self.counters["busy_s"] += now - start
        self.counters["prompt_tokens"] += sum(c.length for c in schedule.prompts)
        for chunk in schedule.singles + schedule.prompts:
            chunk.seq.num_computed += chunk.length
        for row, seq in rows:
            seq.output.append(int(token[row]))
            seq.logprobs.append(float(logprob[row]))
            k = seq.params.top_logprobs
            if k:
                seq.top_logprobs.append({int(i): float(v) for i, v in zip(top_ids[row, :k], top_values[row, :k])})
            seq.token_times.append(now)
            self.counters["generated_tokens"] += 1
            reason = None
            if token[row] in seq.stop_ids:
                reason = "stop"
            elif len(seq.output) >= seq.params.max_tokens or len(seq.tokens) >= self.max_model_len:
                reason = "length"
            lp = [seq.logprobs[-1]] if seq.params.logprobs else []
            top_lp = seq.top_logprobs[-1:]
            if reason:
                done = self._finish(seq, reason)
                done.new_token_ids, done.new_logprobs, done.new_top_logprobs = [seq.output[-1]], lp, top_lp
                outputs.append(done)
            else:
                outputs.append(RequestOutput(seq.request_id, [seq.output[-1]], lp, new_top_logprobs=top_lp))
        return outputs

    def _finish(self, seq: Sequence, reason: str) -> RequestOutput:
        self.scheduler.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        del self._sequences[seq.request_id]
        self.counters["finished"] += reason != "abort"
        times = seq.token_times
        metrics = dict(queue_s=(seq.first_scheduled_time or time.perf_counter()) - seq.arrival_time,
                       ttft_s=times[0] - seq.arrival_time if times else None,
                       tpot_s=(times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
                       e2e_s=time.perf_counter() - seq.arrival_time, preemptions=seq.num_preemptions,
                       prompt_tokens=len(seq.prompt), generated_tokens=len(seq.output))
        return RequestOutput(seq.request_id, [], [], True, reason, list(seq.output),
                             list(seq.logprobs) if seq.params.logprobs else None, metrics,
                             top_logprobs=list(seq.top_logprobs) if seq.params.top_logprobs else None)

    def _bucket(self, n: int, buckets: tuple) -> int:
        return 0 if n == 0 else buckets[bisect.bisect_left(buckets, n)]

    def _table(self, seq: Sequence) -> np.ndarray:
        table = np.zeros(self.pages_per_seq, np.int32)
        table[: len(seq.pages)] = seq.pages
        return table

    def _build(self, schedule: Schedule):
        """(the bucket, the step's arrays, [(logit row, sequence)] of the rows that sample)."""
        d = self._bucket(len(schedule.singles), self.single_buckets)
        r = self._bucket(sum(c.length for c in schedule.prompts), self.prompt_buckets)
        u = d + (min(self.max_prompt_seqs, r) if r else 0)
        m, ps = self.pages_per_seq, self.page_size
        tokens, positions = np.zeros(d + r, np.int32), np.zeros(d + r, np.int32)
        write_pages, write_offsets = np.full(d + r, NULL_PAGE, np.int32), np.zeros(d + r, np.int32)
        tables, lengths = np.zeros((d, m), np.int32), np.zeros(d, np.int32)
        segments, context_table = np.full(r, -1, np.int32), np.zeros(m, np.int32)
        context_length = 0
        upper_index, upper_tables, upper_lengths = np.zeros(u, np.int32), np.zeros((u, m), np.int32), np.zeros(u, np.int32)
        sampled = dict(temperature=np.zeros(u, np.float32), top_k=np.zeros(u, np.int32), top_p=np.ones(u, np.float32),
                       seed=np.zeros(u, np.int32), count=np.zeros(u, np.int32))
        rows = []

        def place(i, seq, start, n):
            pos = np.arange(start, start + n)
            tokens[i:i + n] = seq.tokens[start:start + n]
            positions[i:i + n] = pos
            write_pages[i:i + n] = np.asarray(seq.pages, np.int32)[pos // ps]
            write_offsets[i:i + n] = pos % ps

        def sample_row(row, index, seq, position):
            upper_index[row], upper_tables[row], upper_lengths[row] = index, self._table(seq), position + 1
            p = seq.params
            for name, value in (("temperature", p.temperature), ("top_k", p.top_k), ("top_p", p.top_p),
                                ("seed", p.seed), ("count", len(seq.output))):
                sampled[name][row] = value
            rows.append((row, seq))

        for i, chunk in enumerate(schedule.singles):
            place(i, chunk.seq, chunk.start, 1)
            tables[i], lengths[i] = self._table(chunk.seq), chunk.start + 1
            sample_row(i, i, chunk.seq, chunk.start)
        offset = row = d
        for segment, chunk in enumerate(schedule.prompts):
            place(offset, chunk.seq, chunk.start, chunk.length)
            segments[offset - d:offset - d + chunk.length] = segment
            if chunk.start:
                assert segment == 0, "only the first packed prompt may continue a cached one"
                context_table, context_length = self._table(chunk.seq), chunk.start
            if chunk.samples:
                sample_row(row, offset + chunk.length - 1, chunk.seq, chunk.start + chunk.length - 1)
                row += 1
            offset += chunk.length
        batch = PagedBatch(write_pages, write_offsets, tables, lengths, segments, context_table,
                           np.int32(context_length))
        upper = PagedBatch(None, None, upper_tables, upper_lengths, np.zeros(0, np.int32), context_table, np.int32(0))
        arrays = (tokens, positions, batch, upper_index, upper, Sampled(**sampled))
        # a transfer (jnp.asarray would compile a conversion per shape), to every device of a tensor-parallel mesh
        return (d, r), replicated(self.mesh, arrays), rows

    # ---- convenience ----------------------------------------------------------------------------------------
    def warmup(self) -> float:
        """Compile the step for every (single, prompt) bucket now, so that serving never compiles. Returns seconds."""
        start = time.perf_counter()
        for d in (0,) + self.single_buckets:
            for r in (0,) + self.prompt_buckets:
                if d == 0 and r == 0:
                    continue
                t0 = time.perf_counter()
                self._run_empty(d, r)
                self._compiled.add((d, r))
                log.info("compiled the engine step for %d single and %d prompt tokens in %.1f s", d, r,
                         time.perf_counter() - t0)
        return time.perf_counter() - start

    def _run_empty(self, d: int, r: int) -> None:
        """Run a step of padding only (every write goes to the null page): compiles the bucket, changes nothing."""
        u = d + (min(self.max_prompt_seqs, r) if r else 0)
        m = self.pages_per_seq
        z = lambda *shape: jnp.zeros(shape, jnp.int32)
        batch = PagedBatch(z(d + r), z(d + r), z(d, m), z(d), jnp.full((r,), -1, jnp.int32), z(m), jnp.int32(0))
        upper = PagedBatch(None, None, z(u, m), z(u), z(0), z(m), jnp.int32(0))
        sampled = Sampled(jnp.zeros(u), z(u), jnp.ones(u), z(u), z(u))
        arrays = replicated(self.mesh, (z(d + r), z(d + r), batch, z(u), upper, sampled))
        token, _, _, self.pool = ragged_step(self.params, self.pool, *arrays, np.bool_(False), config=self.config,
                                             swiftkv=self.swiftkv, mesh=self.mesh)
        token.block_until_ready()

    def generate(self, prompts: Seq[Seq[int]], **request) -> list[RequestOutput]:
        """Run `prompts` to completion (blocking), with the same `add_request` options for all; finished outputs in
        prompt order."""
        ids = [self.add_request(p, **request) for p in prompts]
        done = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def stats(self) -> dict:
        """Engine counters: running, waiting, page use, preemptions, tokens and tokens/s of busy time."""
        busy = self.counters["busy_s"]
        return dict(self.counters, running=len(self.scheduler.active), waiting=len(self.scheduler.waiting),
                    pages_total=self.allocator.capacity, pages_free=self.allocator.num_free,
                    page_usage=self.allocator.usage, preemptions=self.scheduler.num_preemptions,
                    generated_tokens_per_s=self.counters["generated_tokens"] / busy if busy else 0.0,
                    compiled_buckets=len(self._compiled))
