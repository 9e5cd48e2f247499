"""The host side of the paged KV cache: page arithmetic and the allocator of page ids (plain Python, no JAX).

A pool has P pages of `page_size` tokens in every cached layer, one numbering for all layers. Page 0 is never
handed out: padding tokens write there (`swiftkv_jax.model.paged.NULL_PAGE`). A token at position p of a sequence
lives in page `pages[p // page_size]` of that sequence, at offset `p % page_size`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` tokens."""
    return -(-tokens // page_size)


class PageAllocator:
    """Page ids 1..P-1, handed out and taken back by the scheduler (the device never sees the free list).
    Freed pages are reused first (last in, first out), which keeps the pages in use few and recently touched.

    Prefix caching (vLLM's automatic prefix caching): a full page can be registered under the hash of its tokens
    and every token before them (`register`); `lookup` finds the longest run of registered pages of a chain of
    hashes. Pages are reference-counted (`share` takes one more reference); a registered page that no sequence holds
    stays cached, evictable least recently freed first, and counts as available (`num_free`): `allocate` takes the
    free pages first, then evicts cached ones (dropping their hash)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))
        self._refs = [0] * num_pages
        self._page_of: dict = {}   # hash -> page
        self._hash_of: dict = {}   # page -> hash
        self._evictable: OrderedDict = OrderedDict()  # cached pages no sequence holds, least recently freed first
        self.num_evicted = 0

    @property
    def capacity(self) -> int:
        """Pages that sequences can hold (the null page excluded)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages an allocation can take: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._page_of)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.capacity

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise MemoryError(f"{n} pages asked, {self.num_free} free")
        if n <= 0:
            return []
        taken = self._free[-n:][::-1]
        del self._free[max(0, len(self._free) - n):]
        while len(taken) < n:  # evict the least recently freed cached page
            page, _ = self._evictable.popitem(last=False)
            del self._page_of[self._hash_of.pop(page)]
            self.num_evicted += 1
            taken.append(page)
        for page in taken:
            self._refs[page] = 1
        return taken

    def free(self, pages: list[int]) -> None:
        """One reference fewer to each page; a page nobody holds goes back (cached if registered)."""
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            if page in self._hash_of:
                self._evictable[page] = None
            else:
                self._free.append(page)

    def share(self, pages: list[int]) -> None:
        """One more reference to each (cached) page."""
        for page in pages:
            if not self._refs[page]:
                del self._evictable[page]
            self._refs[page] += 1

    def lookup(self, hashes) -> list[int]:
        """The pages of the longest prefix of `hashes` that is cached (not shared yet: see `share`)."""
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def register(self, page: int, page_hash) -> None:
        """Cache a full page under its chained hash (a hash already cached keeps its page)."""
        if page_hash not in self._page_of and page not in self._hash_of:
            self._page_of[page_hash] = page
            self._hash_of[page] = page_hash


def page_hashes(tokens, page_size: int, salt: bytes, count: int) -> list[bytes]:
    """The chained hashes of the first `count` full pages of `tokens`: page i's digest covers its tokens, the digest
    of page i - 1 (so two sequences share a page only when everything before it is the same) and `salt` (what
    makes K/V differ: the model, the wiring, the cache format)."""
    digests, previous = [], salt
    for i in range(count):
        chunk = np.asarray(tokens[i * page_size:(i + 1) * page_size], np.int64).tobytes()
        previous = hashlib.blake2b(previous + chunk, digest_size=16).digest()
        digests.append(previous)
    return digests
