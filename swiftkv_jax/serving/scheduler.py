"""Continuous batching: which tokens of which sequences the next engine step runs, and every change of a
sequence's state (host side: plain Python, no JAX program imported).

Each step has a budget. Running decodes come first (one token each), then the prompt being prefilled in chunks
(at most one is ever cut short), then waiting requests first come, first served,
while the budget, the sequence slots and the free pages last. A request that does not fit waits; nothing fails for
lack of memory. When a decode needs a page and none is free, the newest active sequence gives all of its pages
back and goes to the front of the queue, to be recomputed from its prompt and what it generated so far (vLLM's
recompute preemption): its next tokens do not change, since the recomputed K/V are the ones it had.

The budget counts `tokens` (as vLLM does) or `cost`: a token that runs every layer costs 1, a SwiftKV prompt token
only `prompt_token_cost` (layers < l and the owners' K/V projection, about half for l = L/2), so a step of the same
cost holds about twice as many of them.

Asynchronous steps: `schedule` counts what it schedules as computed at once (as vLLM V1 does), and a chunk that
samples adds a *pending* token, which the device holds until `update` hands it over. So step N + 1 is scheduled while
step N runs: a decode whose input token is still pending reads it on the device. A sequence that will finish on its
pending token (max_tokens, max_model_len) is not scheduled again; one that stops on a stop id gets one decode too many,
whose token `update` drops. A sequence with a grammar (structured outputs) or bad_words is not scheduled while its
token is pending: its mask follows from that token, so it runs every other step (the others keep the pipeline, an
allowed_token_ids mask's among them: it is constant). Each
active sequence holds a slot (its row of the device's block table).

Prompt logprobs (`RequestParams.prompt_logprobs`): such a prompt runs as single tokens, each through every layer
in the engine's wiring (in SwiftKV wiring: the layers < l, the owners' K/V, then the layers >= l over the group
pages, what `sk.logits` computes), each with its logit row and the next prompt token as its target; it costs 1 a
token in the budget (full depth), takes the single rows the decodes leave (so the largest single bucket bounds it),
and neither reads nor fills the prefix cache. Requests that do not ask keep the fast prefill.

Prefix caching (`prefix_caching`): a new sequence starts with the cached pages of its prompt's longest cached prefix
(`PageAllocator.lookup` over its chained page hashes, never its last prompt token) and runs only the rest, as a
chunk that continues a cached prompt; the full prompt pages a step completes are registered once the whole step is
scheduled. Any number of a step's chunks may continue a cached prompt.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import itertools
import operator
import time
from collections import deque
from typing import Optional

import numpy as np

from swiftkv_jax.checks import flag, integer, real
from swiftkv_jax.model.config import ModelConfig
from swiftkv_jax.serving.errors import InvalidRequest
from swiftkv_jax.serving.pages import PageAllocator, page_hashes, pages_for
from swiftkv_jax.serving.sampling import (SamplingParams, check_logit_bias, check_min_tokens, check_penalties,
                                         check_seed, check_stop_ids)

MAX_TOP_LOGPROBS = 20  # as the OpenAI API allows


# inter-token latency buckets, seconds (vLLM's, of `vllm:inter_token_latency_seconds`)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                       40.0, 80.0)


class Histogram:
    """A latency's counts per bucket (`bounds`: inclusive upper bounds, then +Inf) and their sum, kept as tokens
    arrive: a bisect and an increment a token, cheap enough for every token of every step."""

    def __init__(self, bounds: tuple):
        self.bounds, self.counts, self.total = tuple(bounds), [0] * (len(bounds) + 1), 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def snapshot(self) -> dict:
        return dict(bounds=self.bounds, counts=list(self.counts), sum=self.total)


class Status(enum.Enum):
    WAITING = "waiting"    # no pages (new, or preempted)
    ACTIVE = "active"      # holds a sequence slot and pages: being prefilled or decoding
    FINISHED = "finished"


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """Per-request sampling and stopping; checked by `validate`."""

    max_tokens: int = 16
    temperature: float = 0.0    # 0: greedy
    top_k: int = 0              # 0: off
    top_p: float = 1.0          # 1: off
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False      # the sampled token's log-probability under the model (before temperature etc.)
    top_logprobs: int = 0       # and the k most likely tokens' (k <= MAX_TOP_LOGPROBS), with logprobs
    prompt_logprobs: Optional[int] = None  # each prompt token's logprob and the k most likely there (vLLM's)
    min_p: float = 0.0                # vLLM's: 0 off, in [0, 1]
    repetition_penalty: float = 1.0   # 1 off, > 0: on the prompt's and the output's tokens
    presence_penalty: float = 0.0     # 0 off, in [-2, 2]: on the output's tokens
    frequency_penalty: float = 0.0    # 0 off, in [-2, 2]: on the output's tokens, times their count
    logit_bias: tuple = ()            # OpenAI's: {token id: bias in [-100, 100]}, validated to sorted (id, bias)
    min_tokens: int = 0               # vLLM's: in [0, max_tokens], no stop id sampled before that many tokens

    @property
    def penalised(self) -> bool:
        """Whether a penalty is on (the engine then keeps this sequence's token counts)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def biased(self) -> bool:
        """Whether a logit bias is set (the engine then writes it to this sequence's slot)."""
        return bool(self.logit_bias)

    def validate(self, vocab_size: int) -> "RequestParams":
        """These params with numpy scalars as Python numbers; InvalidRequest naming the first bad setting."""
        number = lambda name, value: real(name, value, InvalidRequest)
        whole = lambda name, value: integer(name, value, error=InvalidRequest)
        sampling = SamplingParams(number("temperature", self.temperature), self.top_k,
                                  number("top_p", self.top_p), number("min_p", self.min_p))  # its own range checks
        bias = dict(self.logit_bias) if isinstance(self.logit_bias, tuple) else self.logit_bias  # () or a dict
        repetition, presence, frequency = check_penalties(self.repetition_penalty, self.presence_penalty,
                                                          self.frequency_penalty)
        changes = dict(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                       min_p=sampling.min_p, repetition_penalty=repetition, presence_penalty=presence,
                       frequency_penalty=frequency, logit_bias=check_logit_bias(bias, vocab_size),
                       max_tokens=whole("max_tokens", self.max_tokens), seed=check_seed(self.seed),
                       top_logprobs=whole("top_logprobs", self.top_logprobs),
                       logprobs=flag("logprobs", self.logprobs, InvalidRequest))  # bool("false") is True
        if changes["max_tokens"] < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {self.max_tokens}", "max_tokens")
        changes["min_tokens"] = check_min_tokens(self.min_tokens, changes["max_tokens"])
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must lie in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
                                 "top_logprobs")
        if self.top_logprobs and not changes["logprobs"]:
            raise InvalidRequest("top_logprobs needs logprobs=True", "top_logprobs")
        if self.prompt_logprobs is not None:
            changes["prompt_logprobs"] = whole("prompt_logprobs", self.prompt_logprobs)
            if not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
                raise InvalidRequest(f"prompt_logprobs must lie in [0, {MAX_TOP_LOGPROBS}] (or None: off), got "
                                     f"{self.prompt_logprobs}", "prompt_logprobs")
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in self.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be token ids (integers), got {list(self.stop_token_ids)}",
                                 "stop_token_ids")
        check_stop_ids(self.stop_token_ids, vocab_size)
        return dataclasses.replace(self, stop_token_ids=tuple(map(int, self.stop_token_ids)), **changes)


@dataclasses.dataclass(eq=False, slots=True)  # slots: the engine touches every running one each step
class Sequence:
    """One request's state. Its tokens are prompt + output + `num_pending` sampled tokens not yet back from the
    device; the first `num_computed` have their K/V in the pages (or are being written by a step in flight)."""

    request_id: str
    arrival: int                # order of arrival (FCFS and the preemption victim's choice)
    prompt: list[int]
    params: RequestParams
    stop_ids: frozenset
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[dict] = dataclasses.field(default_factory=list)  # per token {id: logprob}, when asked
    pages: list[int] = dataclasses.field(default_factory=list)
    slot: int = -1              # row of the device block table while active
    num_computed: int = 0
    num_pending: int = 0
    status: Status = Status.WAITING
    finish_reason: Optional[str] = None
    num_preemptions: int = 0
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    prompt_hashes: Optional[list] = None  # chained hashes of the prompt's full pages (prefix caching)
    num_registered: int = 0     # of its pages, those registered in the prefix cache
    cached_tokens: int = 0      # prompt tokens found in the prefix cache at its admission
    # with params.prompt_logprobs: per prompt position (None at 0) the prompt token's logprob, and the top ones
    prompt_logprobs: Optional[list] = None
    prompt_top_logprobs: Optional[list] = None
    # structured outputs: the request's host-side token mask (`structured.Grammar`, `token_masks.BadWords`, or their
    # `token_masks.Intersection`: fill, accept, done), None without. Its mask needs the previous token, so such a
    # sequence is never scheduled while a token is pending
    grammar: Optional[object] = None
    # allowed_token_ids (and bad words of one token each): its constant bitmask row (int32 [ceil(V / 32)]), written to
    # its slot at admission; None without. It needs no token, so the sequence keeps the pipeline. allowed_from: the
    # setting that made it ("allowed_token_ids", or "bad_words_ids" alone), the one an empty mask names
    allowed: Optional[object] = None
    allowed_from: Optional[str] = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output) + self.num_pending

    @property
    def scoring(self) -> bool:
        """Its prompt runs at full depth for its logprobs: asked, and no token sampled yet (a sequence preempted
        after that recomputes by the fast prefill: its prompt logprobs are known)."""
        return self.params.prompt_logprobs is not None and not self.output and not self.num_pending

    @property
    def remaining(self) -> int:
        """Tokens to run before the next one can be sampled."""
        return self.num_tokens - self.num_computed

    def token_ids(self, start: int, length: int) -> list[int]:
        """Tokens [start, start + length), -1 for one still pending (the device has it)."""
        prompt, known = self.prompt, len(self.prompt) + len(self.output)
        if start >= known:  # a decode of its pending token: the common case
            return [-1] * length
        if start + length <= len(prompt):
            return prompt[start:start + length]
        known = (prompt[start:] if start < len(prompt) else []) + self.output[max(0, start - len(prompt)):
                                                                             start + length - len(prompt)]
        return known + [-1] * (length - len(known))


_arrival = operator.attrgetter("arrival")


@dataclasses.dataclass(slots=True)
class Chunk:
    seq: Sequence
    start: int        # first position run
    length: int       # tokens run
    samples: bool     # reaches the end of the sequence's tokens: its last token's logits give the next token
    count: int = 0    # tokens the sequence sampled before this one (its sampling key)
    token: int = -1   # a single token's id (-1: pending, the device has it), known when it is scheduled
    target: int = -1  # a scored prompt token's next prompt token, whose logprob its row gives (-1: it samples)


@dataclasses.dataclass
class Schedule:
    singles: list[Chunk]   # one token each, attending over pages
    prompts: list[Chunk]   # packed prompt chunks (any may continue a cached prompt)
    preempted: list[Sequence]
    new_pages: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (slot, index, page)
    admitted: list[Sequence] = dataclasses.field(default_factory=list)  # given a slot by this step
    # (slot, pages) of admitted sequences that start with pages found in the prefix cache: their table rows
    cached_rows: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)
    scored: int = 0  # singles that are scored prompt tokens (their targets matter)

    @property
    def empty(self) -> bool:
        return not (self.singles or self.prompts)

    @property
    def sampling(self) -> list[Chunk]:
        """The chunks that sample, in the order of the step's logit rows."""
        return self.singles + [c for c in self.prompts if c.samples]


def prompt_token_cost(config: ModelConfig, swiftkv: bool) -> float:
    """The compute of a prompt token relative to a full-depth token (weights' multiply-adds; attention, the
    embedding and the head left out). SwiftKV: l layers and the owners' K/V projection of L layers."""
    if not swiftkv:
        return 1.0
    d, n, k, h, f = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                     config.intermediate_size)
    layer = d * (2 * n * h + 2 * k * h) + 3 * d * f
    owners = config.num_kv_groups * 2 * d * k * h
    return (config.num_lower_layers * layer + owners) / (config.num_hidden_layers * layer)


class Scheduler:
    def __init__(self, allocator: PageAllocator, *, page_size: int, max_num_seqs: int, budget: float,
                 max_prompt_tokens: int, max_prompt_seqs: int, prompt_cost: float, max_model_len: int,
                 prefix_caching: bool = False, cache_salt: bytes = b""):
        self.allocator = allocator
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.budget = budget
        self.max_prompt_tokens = max_prompt_tokens  # tokens of the packed prompt part of one step
        self.max_prompt_seqs = max_prompt_seqs
        self.prompt_cost = prompt_cost
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.active: list[Sequence] = []          # in arrival order
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0
        self.prefix_caching, self.cache_salt = prefix_caching, cache_salt
        self.prefix_cache_queries = self.prefix_cache_hits = 0  # prompt tokens admitted, and found cached
        self.inter_token = Histogram(INTER_TOKEN_BUCKETS)  # seconds between a request's successive tokens
        self.prompt_tokens_answered = 0  # prompt tokens of the requests given a first token (cached ones too)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is (finished or aborted): its pages and slot go back."""
        if seq in self.active:
            self.active.remove(seq)
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.pages)
        self._free_slots.append(seq.slot)
        seq.pages, seq.slot, seq.num_registered = [], -1, 0

    def _pages_short(self, seq: Sequence, end: int) -> int:
        return max(0, pages_for(end, self.page_size) - len(seq.pages))

    def _grow(self, seq: Sequence, end: int, new_pages: list) -> None:
        """Pages for the first `end` tokens of an active sequence, recorded as block-table entries to write."""
        pages = self.allocator.allocate(self._pages_short(seq, end))
        new_pages.extend((seq.slot, len(seq.pages) + i, page) for i, page in enumerate(pages))
        seq.pages += pages

    def _preempt(self, seq: Sequence, out: list) -> None:
        self.active.remove(seq)
        self._release(seq)
        seq.num_computed, seq.status = 0, Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # back to the front, in arrival order among the preempted
        index = 0
        while index < len(self.waiting) and self.waiting[index].arrival < seq.arrival:
            index += 1
        self.waiting.insert(index, seq)
        out.append(seq)

    def _run(self, seq: Sequence, n: int, out: list) -> None:
        chunk = Chunk(seq, seq.num_computed, n, n == seq.remaining, len(seq.output) + seq.num_pending,
                      seq.token_ids(seq.num_computed, 1)[0])
        seq.num_computed += n
        seq.num_pending += chunk.samples
        out.append(chunk)

    # ---- prefix caching -------------------------------------------------------------------------------------
    def _take_cached_prefix(self, seq: Sequence) -> None:
        """A sequence without pages starts with the cached pages of its prompt's longest cached prefix, at most up
        to (not including) its last prompt token, which must run: its logits give the first token."""
        page_size = self.page_size
        if seq.prompt_hashes is None:
            seq.prompt_hashes = page_hashes(seq.prompt, page_size, self.cache_salt, len(seq.prompt) // page_size)
        pages = self.allocator.lookup(seq.prompt_hashes[:(len(seq.prompt) - 1) // page_size])
        self.allocator.share(pages)
        seq.pages, seq.num_registered = list(pages), len(pages)
        seq.num_computed = seq.cached_tokens = len(pages) * page_size

    def _untake(self, seq: Sequence) -> None:
        """Undo `_take_cached_prefix` for a sequence that was not admitted after all."""
        self.allocator.free(seq.pages)
        seq.pages, seq.num_registered, seq.num_computed, seq.cached_tokens = [], 0, 0, 0

    def _register(self, seqs) -> None:
        """Cache the prompt pages these sequences' scheduled chunks complete (after the whole step is scheduled,
        so that no request of the same step reads a page this step writes)."""
        for seq in seqs:
            done = min(seq.num_computed, len(seq.prompt)) // self.page_size
            for i in range(seq.num_registered, done):
                self.allocator.register(seq.pages[i], seq.prompt_hashes[i])
            seq.num_registered = max(seq.num_registered, done)

    def schedule(self) -> Schedule:
        budget = self.budget
        singles, prompts, preempted, new_pages = [], [], [], []
        scheduled = set()
        continuing = []  # active sequences with more than one token to run: being prefilled
        page_size, max_model_len, active = self.page_size, self.max_model_len, Status.ACTIVE

        # 1. decodes of the active sequences, oldest first; pages by preempting the newest when none is free. Inlined
        # arithmetic: this loop runs over every running sequence at every step.
        for seq in list(self.active):
            if seq.status is not active:
                continue
            pending, generated = seq.num_pending, len(seq.output)
            num_tokens = len(seq.prompt) + generated + pending
            position = seq.num_computed
            if num_tokens - position != 1:
                if num_tokens - position > 1:
                    continuing.append(seq)
                continue
            if budget < 1 or pending and (generated + pending >= seq.params.max_tokens or num_tokens >= max_model_len
                                          or seq.grammar is not None):
                continue  # no budget left, its pending token will end it, or its grammar's mask needs that token
            if position >= len(seq.pages) * page_size:  # its next token starts a page
                while not self.allocator.num_free:
                    victims = [s for s in self.active if s not in scheduled]
                    self._preempt(victims[-1], preempted)
                    if victims[-1] is seq:
                        break
                if seq.status is not active:
                    continue
                self._grow(seq, position + 1, new_pages)
            token = -1 if pending else (seq.output[-1] if generated else seq.prompt[-1])  # the last token
            singles.append(Chunk(seq, position, 1, True, generated + pending, token))
            seq.num_computed, seq.num_pending = position + 1, pending + 1
            scheduled.add(seq)
            budget -= 1

        # 2. the prompt being prefilled, then waiting requests, first come first served
        prompt_tokens, admitted = 0, []
        # the loop ends at the first waiting request it does not admit, so it sees at most one more than the free
        # slots: only those are copied (a queue of thousands costs nothing a step)
        candidates = ([s for s in continuing if s.status is active]
                      + list(itertools.islice(self.waiting, max(0, self.max_num_seqs - len(self.active)) + 1)))
        tentative = None  # a new sequence holding cached pages, until it is admitted
        scored = 0
        prefilled = []
        for seq in candidates:
            new = seq.status is Status.WAITING
            if seq in preempted or seq.num_pending or (new and len(self.active) >= self.max_num_seqs):
                break  # a sequence waiting for its pending token comes back once it has it
            if seq.scoring:
                n = self._score(seq, budget, singles, new_pages, admitted)
                if n < 1:
                    break
                budget -= n
                scored += n
                if not seq.num_pending:  # cut short: it continues first in the next step
                    break
                continue
            if new and self.prefix_caching and not seq.pages:
                # what a cache hit cannot change refuses it first: a lookup shares its prefix's pages (and the
                # refusal frees them), a cost of the prefix's length at every step it waits. Any hit leaves its
                # last prompt token's page to allocate; only a prompt cached to its last token runs as a single
                single = seq.num_tokens - (len(seq.prompt) - 1) // page_size * page_size == 1
                if (budget < min(1.0, self.prompt_cost) or not self.allocator.num_free
                        or (not single and len(prompts) >= self.max_prompt_seqs)):
                    break
                self._take_cached_prefix(seq)
                tentative = seq
            if seq.remaining == 1:  # a one-token prompt: a single token over its (first) page
                if budget < 1 or self._pages_short(seq, seq.num_computed + 1) > self.allocator.num_free:
                    break
                self._admit(seq, admitted)
                self._grow(seq, seq.num_computed + 1, new_pages)
                self._run(seq, 1, singles)
                prefilled.append(seq)
                budget -= 1
                continue
            if len(prompts) >= self.max_prompt_seqs:
                break
            room = self.allocator.num_free * self.page_size + (len(seq.pages) * self.page_size - seq.num_computed)
            n = min(seq.remaining, int(budget / self.prompt_cost + 1e-9), self.max_prompt_tokens - prompt_tokens,
                    room)
            if n < 1:
                break
            self._admit(seq, admitted)
            self._grow(seq, seq.num_computed + n, new_pages)
            self._run(seq, n, prompts)
            prefilled.append(seq)
            prompt_tokens += n
            budget -= n * self.prompt_cost
            if not prompts[-1].samples:  # cut short: it continues first in the next step
                break
        if tentative is not None and tentative.status is Status.WAITING:
            self._untake(tentative)
        cached_rows = [(seq.slot, list(seq.pages)) for seq in admitted if seq.cached_tokens]
        if self.prefix_caching:
            self._register(prefilled)
        return Schedule(singles, prompts, preempted, new_pages, admitted, cached_rows, scored)

    def _score(self, seq: Sequence, budget: float, singles: list, new_pages: list, admitted: list) -> int:
        """Run as many of a scored prompt's tokens as the budget (1 each: full depth), the single rows left and the
        free pages allow, each a single token whose logit row scores the next prompt token. Returns how many."""
        room = self.allocator.num_free * self.page_size + (len(seq.pages) * self.page_size - seq.num_computed)
        n = min(seq.remaining, int(budget + 1e-9), self.max_num_seqs - len(singles), room)
        if n < 1:
            return 0
        self._admit(seq, admitted)
        start, prompt = seq.num_computed, seq.prompt
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs, seq.prompt_top_logprobs = [None] * len(prompt), [None] * len(prompt)
        self._grow(seq, start + n, new_pages)
        last = len(prompt) - 1
        for p in range(start, start + n):
            singles.append(Chunk(seq, p, 1, p == last, 0, prompt[p], prompt[p + 1] if p < last else -1))
        seq.num_computed += n
        seq.num_pending += start + n > last
        return n

    def _admit(self, seq: Sequence, admitted: list) -> None:
        if seq.status is Status.WAITING:
            admitted.append(seq)
            self.waiting.remove(seq)
            bisect.insort(self.active, seq, key=_arrival)  # arrival order (a preempted one returns to its place)
            seq.status = Status.ACTIVE
            seq.slot = self._free_slots.pop()
            if self.prefix_caching and not seq.scoring:  # a scored prompt never looks
                self.prefix_cache_queries += len(seq.prompt)
                self.prefix_cache_hits += seq.cached_tokens
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()

    def update(self, schedule: Schedule, tokens, logprobs, top: Optional[tuple] = None,
               now: Optional[float] = None) -> list[tuple[Sequence, Optional[str]]]:
        """Hand over what the step of `schedule` sampled: tokens and logprobs per row of `schedule.sampling` (and
        `top` = (values, ids) [rows, k] when any row asked for its top logprobs). Each token joins its sequence
        (rows of a sequence finished since are dropped); a stop id, max_tokens or max_model_len finishes it (its
        pages go back). Returns (sequence, finish reason or None) per token that joined, in row order."""
        now = time.perf_counter() if now is None else now
        tokens, logprobs = np.asarray(tokens).tolist(), np.asarray(logprobs).tolist()  # Python numbers, once
        max_model_len, finished = self.max_model_len, Status.FINISHED
        out = []
        for row, chunk in enumerate(schedule.sampling):
            seq = chunk.seq
            if seq.status is finished:
                continue
            if chunk.target >= 0:  # a scored prompt token: the logprob of the prompt token after it
                seq.prompt_logprobs[chunk.start + 1] = logprobs[row]
                k = seq.params.prompt_logprobs
                if k:
                    values, ids = top
                    seq.prompt_top_logprobs[chunk.start + 1] = dict(zip(ids[row, :k].tolist(),
                                                                        values[row, :k].tolist()))
                continue
            token = tokens[row]
            seq.num_pending -= 1
            seq.output.append(token)
            seq.logprobs.append(logprobs[row])
            k = seq.params.top_logprobs
            if k:
                values, ids = top
                seq.top_logprobs.append(dict(zip(ids[row, :k].tolist(), values[row, :k].tolist())))
            if seq.first_token_time is None:
                seq.first_token_time = now
                self.prompt_tokens_answered += len(seq.prompt)
            else:
                self.inter_token.observe(now - seq.last_token_time)
            seq.last_token_time = now
            reason = None
            if token in seq.stop_ids and len(seq.output) > seq.params.min_tokens:  # vLLM's: none before min_tokens
                reason = "stop"
            elif len(seq.output) >= seq.params.max_tokens or len(seq.prompt) + len(seq.output) >= max_model_len:
                reason = "length"
            if reason:
                self.finish(seq, reason)
            out.append((seq, reason))
        return out

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (finished, or aborted): out of the queues, its pages and slot back."""
        self.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
