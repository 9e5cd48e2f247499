"""Continuous batching: which tokens of which sequences the next engine step runs (host side, no JAX).

Each step has a budget. Running decodes come first (one token each), then the prompt being prefilled in chunks
(at most one is ever cut short, see `swiftkv_jax.model.paged`), then waiting requests first come, first served,
while the budget, the sequence slots and the free pages last. A request that does not fit waits; nothing fails for
lack of memory. When a decode needs a page and none is free, the newest active sequence gives all of its pages
back and goes to the front of the queue, to be recomputed from its prompt and what it generated so far (vLLM's
recompute preemption): its next tokens do not change, since the recomputed K/V are the ones it had.

The budget counts `tokens` (as vLLM does) or `cost`: a token that runs every layer costs 1, a SwiftKV prompt token
only `prompt_token_cost` (layers < l and the owners' K/V projection, about half for l = L/2), so a step of the same
cost holds about twice as many of them.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from collections import deque
from typing import Optional

from swiftkv_jax.model.config import ModelConfig
from swiftkv_jax.serving.paged_cache import PageAllocator
from swiftkv_jax.serving.ragged_step import MAX_TOP_LOGPROBS
from swiftkv_jax.serving.sampling import SamplingParams


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

    def validate(self, vocab_size: int) -> None:
        def number(name, value, kind=(int, float)):
            if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")

        number("temperature", self.temperature)
        number("top_p", self.top_p)
        number("max_tokens", self.max_tokens, int)
        number("top_k", self.top_k, int)
        number("top_logprobs", self.top_logprobs, int)
        number("seed", self.seed, int)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        SamplingParams(self.temperature, self.top_k, self.top_p)  # its own range checks
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must lie in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=True")
        if not 0 <= self.seed < 2**31:
            raise ValueError(f"seed must lie in [0, 2**31), got {self.seed}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must lie in [0, {vocab_size}), got {bad}")


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request's state. tokens = prompt + output; the first `num_computed` have their K/V in the pages."""

    request_id: str
    arrival: int                # order of arrival (FCFS and the preemption victim's choice)
    prompt: list[int]
    params: RequestParams
    stop_ids: frozenset
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[dict] = dataclasses.field(default_factory=list)  # per token {id: logprob}, when asked
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: Optional[str] = None
    num_preemptions: int = 0
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    first_scheduled_time: Optional[float] = None
    token_times: list[float] = dataclasses.field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def remaining(self) -> int:
        """Tokens to run before the next one can be sampled."""
        return len(self.prompt) + len(self.output) - self.num_computed


@dataclasses.dataclass
class Chunk:
    seq: Sequence
    start: int        # first position run
    length: int       # tokens run
    samples: bool     # reaches the end of the sequence's tokens: its last token's logits give the next token


@dataclasses.dataclass
class Schedule:
    singles: list[Chunk]   # one token each, attending over pages
    prompts: list[Chunk]   # packed prompt chunks; only prompts[0] may have cached context
    preempted: list[Sequence]

    @property
    def empty(self) -> bool:
        return not (self.singles or self.prompts)


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
                 max_prompt_tokens: int, max_prompt_seqs: int, prompt_cost: float):
        self.allocator = allocator
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.budget = budget
        self.max_prompt_tokens = max_prompt_tokens  # tokens of the packed prompt part of one step
        self.max_prompt_seqs = max_prompt_seqs
        self.prompt_cost = prompt_cost
        self.waiting: deque[Sequence] = deque()
        self.active: list[Sequence] = []          # in arrival order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is (finished or aborted) and give its pages back."""
        if seq in self.active:
            self.active.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq.pages)
        seq.pages = []

    def _pages_short(self, seq: Sequence, end: int) -> int:
        return max(0, -(-end // self.page_size) - len(seq.pages))

    def _preempt(self, seq: Sequence, out: list) -> None:
        self.active.remove(seq)
        self.allocator.free(seq.pages)
        seq.pages, seq.num_computed, seq.status = [], 0, Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # back to the front, in arrival order among the preempted
        index = 0
        while index < len(self.waiting) and self.waiting[index].arrival < seq.arrival:
            index += 1
        self.waiting.insert(index, seq)
        out.append(seq)

    def schedule(self) -> Schedule:
        budget = self.budget
        singles, prompts, preempted = [], [], []
        scheduled = set()

        # 1. decodes of the active sequences, oldest first; pages by preempting the newest when none is free
        for seq in list(self.active):
            if seq not in self.active or seq.remaining != 1 or budget < 1:
                continue
            while self._pages_short(seq, seq.num_computed + 1) > self.allocator.num_free:
                victims = [s for s in self.active if s not in scheduled]
                self._preempt(victims[-1], preempted)
                if victims[-1] is seq:
                    break
            if seq not in self.active:
                continue
            seq.pages += self.allocator.allocate(self._pages_short(seq, seq.num_computed + 1))
            singles.append(Chunk(seq, seq.num_computed, 1, True))
            scheduled.add(seq)
            budget -= 1

        # 2. the prompt being prefilled, then waiting requests, first come first served
        prompt_tokens = 0
        candidates = [s for s in self.active if s not in scheduled and s.remaining > 1] + list(self.waiting)
        for seq in candidates:
            new = seq.status is Status.WAITING
            if seq in preempted or (new and len(self.active) >= self.max_num_seqs):
                break
            if seq.remaining == 1:  # a one-token prompt: a single token over its (first) page
                if budget < 1 or self._pages_short(seq, seq.num_computed + 1) > self.allocator.num_free:
                    break
                self._admit(seq, 1)
                singles.append(Chunk(seq, seq.num_computed, 1, True))
                budget -= 1
                continue
            if len(prompts) >= self.max_prompt_seqs or (prompts and seq.num_computed):
                break
            room = self.allocator.num_free * self.page_size + (len(seq.pages) * self.page_size - seq.num_computed)
            n = min(seq.remaining, int(budget / self.prompt_cost + 1e-9), self.max_prompt_tokens - prompt_tokens,
                    room)
            if n < 1:
                break
            self._admit(seq, n)
            prompts.append(Chunk(seq, seq.num_computed, n, n == seq.remaining))
            prompt_tokens += n
            budget -= n * self.prompt_cost
            if n < seq.remaining:  # cut short: it continues first in the next step
                break
        return Schedule(singles, prompts, preempted)

    def _admit(self, seq: Sequence, n: int) -> None:
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
            self.active.append(seq)
            self.active.sort(key=lambda s: s.arrival)
            seq.status = Status.ACTIVE
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()
        seq.pages += self.allocator.allocate(self._pages_short(seq, seq.num_computed + n))
