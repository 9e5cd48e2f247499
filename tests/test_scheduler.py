"""The scheduler alone, on synthetic sequences (no model, no JAX program): what each step runs, preemption, the one
continued prompt, the cost budget, asynchronous tokens, and every page and slot back (as vLLM's
tests/v1/core/test_scheduler.py does for its scheduler)."""

from __future__ import annotations

import pytest

from swiftkv_jax.serving.pages import PageAllocator, pages_for
from swiftkv_jax.serving.scheduler import RequestParams, Scheduler, Sequence, Status

PAGE = 4


def make(num_pages=64, max_num_seqs=4, budget=16, max_prompt_tokens=None, max_prompt_seqs=4, prompt_cost=1.0,
         max_model_len=1000) -> Scheduler:
    return Scheduler(PageAllocator(num_pages), page_size=PAGE, max_num_seqs=max_num_seqs, budget=float(budget),
                     max_prompt_tokens=max_prompt_tokens or int(budget / prompt_cost), max_prompt_seqs=max_prompt_seqs,
                     prompt_cost=prompt_cost, max_model_len=max_model_len)


def request(arrival: int, prompt_len: int, max_tokens: int = 8, stop=()) -> Sequence:
    return Sequence(str(arrival), arrival, list(range(1, prompt_len + 1)), RequestParams(max_tokens=max_tokens),
                    frozenset(stop))


def finish_step(sched: Scheduler, schedule, token: int = 7):
    """Hand the step's sampled tokens back (every row samples `token`)."""
    rows = len(schedule.sampling)
    return sched.update(schedule, [token] * rows, [0.0] * rows)


def check_books(sched: Scheduler, seqs) -> None:
    """Pages: every page held once, by an active sequence, the rest free; slots distinct; block-table entries as
    held."""
    held = [p for s in seqs if s.status is Status.ACTIVE for p in s.pages]
    assert len(held) == len(set(held)) and 0 not in held
    assert len(held) + sched.allocator.num_free == sched.allocator.capacity
    slots = [s.slot for s in seqs if s.status is Status.ACTIVE]
    assert len(slots) == len(set(slots)) and all(0 <= s < sched.max_num_seqs for s in slots)
    assert all(s.slot == -1 and not s.pages for s in seqs if s.status is not Status.ACTIVE)


def test_decodes_first_then_prompts_first_come_first_served():
    sched = make(budget=16)
    a, b, c = request(0, 10), request(1, 5), request(2, 9)
    for s in (a, b, c):
        sched.add(s)
    first = sched.schedule()
    # a whole (10), b whole (5), c cut to the 1 token left of the budget: it continues first in the next step
    assert [(ch.seq, ch.start, ch.length, ch.samples) for ch in first.prompts] == [(a, 0, 10, True), (b, 0, 5, True),
                                                                                (c, 0, 1, False)]
    assert [s.num_pending for s in (a, b, c)] == [1, 1, 0]
    second = sched.schedule()  # before the first step's tokens are back: a and b decode their pending tokens
    assert [(ch.seq, ch.start) for ch in second.singles] == [(a, 10), (b, 5)]
    assert [ch.seq.token_ids(ch.start, 1) for ch in second.singles] == [[-1], [-1]]  # the device has them
    assert [(ch.seq, ch.start, ch.length) for ch in second.prompts] == [(c, 1, 8)]
    check_books(sched, (a, b, c))
    finish_step(sched, first)
    assert a.output == [7] and a.num_pending == 1 and a.token_ids(10, 1) == [7]
    check_books(sched, (a, b, c))


def test_only_the_first_prompt_continues_a_cached_one():
    sched = make(budget=8, max_prompt_seqs=4)
    seqs = [request(i, 6) for i in range(4)]
    for s in seqs:
        sched.add(s)
    for _ in range(12):
        schedule = sched.schedule()
        assert all(ch.start == 0 or i == 0 for i, ch in enumerate(schedule.prompts) if ch.seq.prompt)
        assert sum(1 for ch in schedule.prompts if not ch.samples) <= 1
        if schedule.prompts and not schedule.prompts[-1].samples:
            cut = schedule.prompts[-1].seq
            nxt = sched.schedule()
            assert nxt.prompts and nxt.prompts[0].seq is cut and nxt.prompts[0].start > 0
            finish_step(sched, schedule)
            finish_step(sched, nxt)
        else:
            finish_step(sched, schedule)
        check_books(sched, seqs)


def test_cost_budget_holds_more_swiftkv_prompt_tokens():
    tokens, cost = make(budget=16), make(budget=16, prompt_cost=0.5)
    for sched in (tokens, cost):
        sched.add(request(0, 40))
    assert tokens.schedule().prompts[0].length == 16
    assert cost.schedule().prompts[0].length == 32


def test_preemption_takes_the_newest_and_requeues_it_first():
    # 7-token prompts (2 pages) x 3 and a 3-token one (1 page): all 7 pages; the first decode to cross a page preempts
    sched = make(num_pages=8, budget=32, max_prompt_tokens=32)
    seqs = [request(i, n, max_tokens=20) for i, n in enumerate((7, 7, 7, 3))]
    for s in seqs:
        sched.add(s)
    pending = [sched.schedule()]
    preempted = []
    for _ in range(6):
        schedule = sched.schedule()
        for victim in schedule.preempted:  # the newest of those not yet scheduled in this step
            newest = max((s for s in sched.active if s not in [c.seq for c in schedule.singles]),
                         key=lambda s: s.arrival, default=None)
            assert newest is None or victim.arrival > newest.arrival
        preempted += schedule.preempted
        finish_step(sched, pending.pop())
        pending.append(schedule)
        check_books(sched, seqs)
        waiting = list(sched.waiting)
        assert waiting == sorted(waiting, key=lambda s: s.arrival), "the preempted wait first, in arrival order"
    assert preempted[:2] == [seqs[3], seqs[2]]
    assert all(s.num_preemptions for s in preempted)


def test_a_sequence_ending_on_its_pending_token_is_not_scheduled_again():
    sched = make()
    seq = request(0, 3, max_tokens=1)
    sched.add(seq)
    first = sched.schedule()
    assert first.prompts[0].samples and seq.num_pending == 1
    assert sched.schedule().empty  # max_tokens = 1: the pending token is its last
    [(done, reason)] = finish_step(sched, first)
    assert done is seq and reason == "length" and seq.status is Status.FINISHED
    assert sched.allocator.num_free == sched.allocator.capacity


def test_a_stop_id_drops_the_decode_already_scheduled():
    sched = make()
    seq = request(0, 3, max_tokens=10, stop=(7,))
    sched.add(seq)
    first = sched.schedule()
    second = sched.schedule()  # scheduled before the stop id is known
    assert [ch.seq for ch in second.singles] == [seq] and second.singles[0].count == 1
    assert finish_step(sched, first) == [(seq, "stop")]
    assert finish_step(sched, second) == []  # its token is dropped
    assert seq.output == [7] and seq.slot == -1 and sched.allocator.num_free == sched.allocator.capacity


def test_sampling_counts_follow_the_tokens_sampled():
    sched = make()
    seq = request(0, 2, max_tokens=5)
    sched.add(seq)
    counts, flights = [], []
    while seq.status is not Status.FINISHED:
        schedule = sched.schedule()
        counts += [ch.count for ch in schedule.sampling]
        flights.append(schedule)
        if len(flights) > 1:
            finish_step(sched, flights.pop(0))
    for schedule in flights:
        finish_step(sched, schedule)
    assert counts == [0, 1, 2, 3, 4] and len(seq.output) == 5


def test_block_table_entries_are_the_pages_held():
    sched = make(budget=64, max_prompt_tokens=64)
    seqs = [request(i, n) for i, n in enumerate((9, 1, 13))]
    for s in seqs:
        sched.add(s)
    table = {}
    for _ in range(8):
        schedule = sched.schedule()
        for slot, index, page in schedule.new_pages:
            table[slot, index] = page
        for s in seqs:
            if s.status is Status.ACTIVE:
                assert [table[s.slot, i] for i in range(len(s.pages))] == s.pages
                assert len(s.pages) == pages_for(s.num_computed, PAGE)
        finish_step(sched, schedule)


def test_finish_and_abort_give_pages_and_slots_back():
    sched = make()
    seqs = [request(i, 5) for i in range(4)]
    for s in seqs:
        sched.add(s)
    sched.schedule()
    for s in seqs:
        sched.finish(s, "abort")
    assert sched.allocator.num_free == sched.allocator.capacity and not sched.active and not sched.waiting
    assert sorted(sched._free_slots) == list(range(4))


def test_admission_is_bounded_by_slots():
    sched = make(max_num_seqs=2, budget=64, max_prompt_tokens=64)
    seqs = [request(i, 3) for i in range(3)]
    for s in seqs:
        sched.add(s)
    schedule = sched.schedule()
    assert [ch.seq for ch in schedule.prompts] == seqs[:2] and seqs[2].status is Status.WAITING


@pytest.mark.parametrize("n", [0, 1, 5])
def test_allocator_hands_out_and_takes_back(n):
    alloc = PageAllocator(8)
    pages = alloc.allocate(n)
    assert len(pages) == n and 0 not in pages and alloc.num_free == 7 - n
    alloc.free(pages)
    assert alloc.num_free == 7
    with pytest.raises(MemoryError):
        alloc.allocate(8)


def test_a_waiting_request_the_step_cannot_start_does_not_look_up_its_cached_prefix():
    """A lookup shares every cached page of the prefix (and a refusal frees them again): a cost of the prefix's
    length. While the running decodes take the whole budget, a waiting request with a cached prefix is refused
    before it; once there is room it gets its hit."""
    sched = Scheduler(PageAllocator(64), page_size=PAGE, max_num_seqs=4, budget=2.0, max_prompt_tokens=16,
                      max_prompt_seqs=4, prompt_cost=1.0, max_model_len=1000, prefix_caching=True)
    lookups = []
    lookup = sched.allocator.lookup
    sched.allocator.lookup = lambda hashes: lookups.append(len(hashes)) or lookup(hashes)
    a, b = request(0, 1, max_tokens=50), request(1, 1, max_tokens=50)
    for s in (a, b):
        sched.add(s)
    finish_step(sched, sched.schedule())  # one-token prompts: single rows, then decodes that take the budget
    assert lookups == [0, 0]
    c = Sequence("c", 2, list(range(1, 14)), RequestParams(max_tokens=4), frozenset())
    d = Sequence("d", 3, list(range(1, 14)), RequestParams(max_tokens=4), frozenset())
    sched.add(c)
    for _ in range(3):
        step = sched.schedule()
        assert [ch.seq for ch in step.singles] == [a, b] and not step.prompts
        finish_step(sched, step)
    assert lookups == [0, 0]  # c was refused before its lookup, three times
    sched.finish(b, "abort")
    finish_step(sched, sched.schedule())  # a decodes; c finds nothing cached and starts (1 token: the budget left)
    sched.add(d)
    sched.finish(a, "abort")
    while c.status is not Status.FINISHED:
        finish_step(sched, sched.schedule())
    assert d.cached_tokens == 12 and lookups[-1] == 3  # d found c's three full pages


def test_a_stop_token_that_is_also_the_last_allowed_ends_as_a_stop():
    """As vLLM and OpenAI report it: the stop id sampled as the max_tokens-th token is a "stop", not a "length"."""
    sched = make()
    a = request(0, 3, max_tokens=2, stop=(9,))
    sched.add(a)
    assert finish_step(sched, sched.schedule(), token=5) == [(a, None)]
    assert finish_step(sched, sched.schedule(), token=9) == [(a, "stop")]
    assert a.output == [5, 9] and a.finish_reason == "stop"
    b = request(1, 3, max_tokens=2, stop=(9,))
    sched.add(b)
    finish_step(sched, sched.schedule(), token=5)
    assert finish_step(sched, sched.schedule(), token=4) == [(b, "length")]


def test_the_inter_token_histogram_buckets_as_prometheus_client_does():
    """The engine's host-side latency histogram, exposed under vLLM's name, gives the buckets (inclusive upper
    bounds, cumulative), count and sum that prometheus_client's own Histogram gives for the same values."""
    from prometheus_client import CollectorRegistry
    from prometheus_client import Histogram as Reference

    from swiftkv_jax.serving.http.metrics import _inter_token_histograms
    from swiftkv_jax.serving.scheduler import INTER_TOKEN_BUCKETS, Histogram

    values = [0.0, 0.01, 0.0100001, 0.05, 0.3, 0.99, 1.0, 80.0, 80.5, 1e4]
    ours, reference = Histogram(INTER_TOKEN_BUCKETS), Reference("x", "x", buckets=INTER_TOKEN_BUCKETS,
                                                                registry=CollectorRegistry())
    for v in values:
        ours.observe(v)
        reference.observe(v)
    samples = lambda family: {(s.name.rsplit("_", 1)[-1], s.labels.get("le")): s.value for s in family.samples
                              if not s.name.endswith("_created")}
    expected = samples(next(iter(reference.collect())))
    for family in _inter_token_histograms(ours.snapshot(), dict(model_name="m", engine="0")):
        assert samples(family) == pytest.approx(expected)
