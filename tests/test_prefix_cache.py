"""Prefix caching in `sk.Engine`: prompts that share a prefix reuse its pages, and nothing else changes.

Every request's greedy tokens equal `sk.generate` on it alone (logprobs within 1e-4) with caching on, and equal the
same run with caching off, for a plain Llama and SwiftKV students with g = 1 and g = 2, over schedules whose prompts
share prefixes of random lengths (ending mid-page, on a page boundary, or the whole prompt). The allocator's
reference counts, its least-recently-freed eviction and the hit counters are checked on their own.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_continuous_engine import MAX_TOKENS, alone, assert_matches_alone, engine, run

from swiftkv_jax.serving.pages import PageAllocator, page_hashes

PAGE = 4


def shared_prompts(prefix_len: int, suffixes: list[int], seed: int = 0) -> list[list[int]]:
    """One prefix, then each request's own suffix (0: the prompt is the prefix alone)."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(6, 96, prefix_len).tolist()
    return [prefix + rng.integers(6, 96, n).tolist() for n in suffixes]


# ---- the allocator ------------------------------------------------------------------------------------------------

def test_pages_are_shared_cached_and_evicted_least_recently_freed_first():
    alloc = PageAllocator(6)  # pages 1..5
    a = alloc.allocate(2)
    hashes = page_hashes(list(range(8)), PAGE, b"salt", 2)
    for page, h in zip(a, hashes):
        alloc.register(page, h)
    assert alloc.lookup(hashes) == a and alloc.lookup(hashes[:1]) == a[:1]
    alloc.share(a)  # a second holder
    alloc.free(a)
    assert alloc.num_free == 3 and alloc.lookup(hashes) == a  # still held once
    alloc.free(a)
    assert alloc.num_free == 5 and alloc.num_cached == 2  # nobody holds them: cached, and available
    b = alloc.allocate(4)  # the 3 free pages, then the least recently freed cached one (a[1]: freed first)
    assert a[1] in b and a[0] not in b and alloc.num_evicted == 1
    assert alloc.lookup(hashes) == [a[0]] and alloc.num_cached == 1
    alloc.share([a[0]])
    assert alloc.num_free == 0
    with pytest.raises(MemoryError):
        alloc.allocate(1)


def test_hashes_chain_and_salt():
    tokens = list(range(12))
    base = page_hashes(tokens, PAGE, b"x", 3)
    assert page_hashes(tokens, PAGE, b"y", 3)[0] != base[0]  # another model / wiring / format
    changed = page_hashes([99] + tokens[1:], PAGE, b"x", 3)
    assert all(c != h for c, h in zip(changed, base))  # a change in page 0 changes every later page


def test_the_engine_salt_separates_wirings():
    a, b = engine("swiftkv-g2"), engine("swiftkv-g2", swiftkv=False)
    assert a.scheduler.cache_salt != b.scheduler.cache_salt


# ---- the engine ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["plain", "swiftkv-g1", "swiftkv-g2"])
def test_shared_prefixes_equal_generate_alone_and_caching_off(name):
    # prefix of 9 tokens (2 full pages + 1): requests 1..3 arrive once request 0 was prefilled; request 3 is the
    # prefix alone (entirely cached but its last token), 4 a prefix ending on a page boundary of the first
    prompts = shared_prompts(9, [5, 3, 11, 0]) + [shared_prompts(9, [0])[0][:8] + [7, 7, 7]]
    arrivals = [0, 2, 2, 3, 5]
    done = {}
    for caching in (True, False):
        eng = engine(name, enable_prefix_caching=caching)
        done[caching] = run(eng, prompts, arrivals)
        stats = eng.stats()
        if caching:
            # 1, 2, 3 and 4 each find the prefix's 2 full pages (request 3: 9 tokens, its last one runs)
            assert stats["prefix_cache_hits"] == 4 * 2 * PAGE
            assert stats["prefix_cache_queries"] == sum(map(len, prompts))
        else:
            assert stats["prefix_cache_hits"] == 0
        # the work: a hit's tokens are not run again (a hit that re-ran its prefix would serve the same tokens)
        assert stats["prompt_tokens"] == sum(map(len, prompts)) - stats["prefix_cache_hits"]
        assert stats["pages_free"] == stats["pages_total"]  # every page free or cached, none leaked
    assert_matches_alone(name, prompts, done[True])
    for i in range(len(prompts)):
        on, off = done[True][str(i)], done[False][str(i)]
        assert on.token_ids == off.token_ids
        np.testing.assert_allclose(on.logprobs, off.logprobs, atol=1e-4)


def test_pressure_eviction_preemption_and_abort_with_shared_pages():
    """A pool too small for every request at once: requests sharing pages are preempted, aborted and finish while
    others still read those pages; every result is still the request alone, and afterwards no page is held."""
    name = "swiftkv-g2"
    prompts = shared_prompts(13, [6, 2, 9, 4, 0, 12], seed=3)
    eng = engine(name, num_pages=16, max_num_seqs=4)
    done = run(eng, prompts, arrivals=[0, 1, 1, 4, 6, 9], aborts=[("2", 7)])
    assert eng.stats()["preemptions"] > 0 or eng.stats()["prefix_cache_evictions"] > 0
    assert_matches_alone(name, prompts, done, skip=("2",))
    assert done["2"].finish_reason in ("abort", "length")
    alloc = eng.allocator
    assert alloc.num_free == alloc.capacity and not any(alloc._refs)


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(prefix=st.integers(1, 14), suffixes=st.lists(st.integers(0, 6), min_size=2, max_size=5),
       gaps=st.lists(st.integers(0, 3), min_size=5, max_size=5), seed=st.integers(0, 5))
def test_random_shared_prefix_schedules(prefix, suffixes, gaps, seed):
    prompts = shared_prompts(prefix, suffixes, seed)
    arrivals = np.cumsum(gaps[:len(prompts)]).tolist()
    eng = engine("swiftkv-g1")
    done = run(eng, prompts, arrivals)
    assert_matches_alone("swiftkv-g1", prompts, done)
    assert eng.stats()["pages_free"] == eng.stats()["pages_total"]
    assert alone("swiftkv-g1", tuple(prompts[0]))[0] == done["0"].token_ids and len(done["0"].token_ids) == MAX_TOKENS
