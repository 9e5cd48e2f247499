"""The host side of the paged KV cache: page arithmetic and the allocator of page ids (plain Python, no JAX).

A pool has P pages of `page_size` tokens in every cached layer, one numbering for all layers. Page 0 is never
handed out: padding tokens write there (`swiftkv_jax.model.paged.NULL_PAGE`). A token at position p of a sequence
lives in page `pages[p // page_size]` of that sequence, at offset `p % page_size`.
"""

from __future__ import annotations


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` tokens."""
    return -(-tokens // page_size)


class PageAllocator:
    """Page ids 1..P-1, handed out and taken back by the scheduler (the device never sees the free list).
    Freed pages are reused first (last in, first out), which keeps the pages in use few and recently touched."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def capacity(self) -> int:
        """Pages that sequences can hold (the null page excluded)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.capacity

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{n} pages asked, {len(self._free)} free")
        if n <= 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        return taken[::-1]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
