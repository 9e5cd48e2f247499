"""Token masks without a grammar engine (no llguidance): vLLM's `allowed_token_ids` and `bad_words`, in the grammar
bitmask layout (`structured`: int32 words, bit i % 32 of word i // 32 allows token i) that `sk.Engine` applies on
the device.

    row = token_masks.allowed_row([5, 9, 12], vocab_size)      # static: the engine writes it once, at admission
    words = token_masks.bad_words_ids(["foo", "bar baz"], lambda text: tokenizer.encode(text, add_special_tokens=False))
    mask = token_masks.BadWords(words, vocab_size)              # moves with the tokens: fill(row) / accept(token)

`allowed_token_ids` does not depend on the tokens generated: its row is a constant (`allowed_row`), which the engine
writes into the request's slot once and applies every step, so the request keeps the pipeline. `bad_words` does
(a word's last token is banned only after its other tokens), so `BadWords` is a host-side mask like a grammar
(`fill`, `accept`, `done`), and a request with one runs every other step as a guided one (unless every word is one
token: its mask is then constant, and `sk.Engine` folds it into the allowed row). `Intersection` applies
several such masks together (a grammar and bad_words: the AND of their rows).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from swiftkv_jax.serving.structured import words


def allowed_row(ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """The int32 bitmask row (words(vocab_size) words) that allows exactly `ids` (each in [0, vocab_size))."""
    bits = np.zeros(words(vocab_size) * 32, bool)
    bits[np.asarray(ids, np.int64)] = True
    return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)


def ban(row: np.ndarray, ids: Sequence[int]) -> None:
    """Clear the bits of `ids` in an int32 bitmask row (in place)."""
    ids = np.asarray(ids, np.int64)
    if ids.size:
        unsigned = row.view(np.uint32)
        np.bitwise_and.at(unsigned, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))


def leaves_a_token(row: np.ndarray, stops: Sequence[int] = ()) -> bool:
    """Whether an int32 bitmask row allows some token once `stops` (min_tokens' masked stop ids) are banned too."""
    usable = row.copy()
    ban(usable, sorted(stops))
    return bool(usable.any())


def bad_words_ids(bad_words: Sequence[str], encode: Callable[[str], list]) -> list[list[int]]:
    """vLLM's tokenization of bad_words (SamplingParams.update_from_tokenizer): each word, stripped of leading
    whitespace, as is and with a leading space, by `encode` (a tokenizer's, no special tokens); the prefix-space
    variant is kept only where it is new (its first token differs) and as long as the plain one."""
    out = []
    for word in bad_words:
        plain = list(encode(word.lstrip()))
        out.append(plain)
        spaced = list(encode(" " + word.lstrip()))
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


class BadWords:
    """vLLM's bad_words over token ids (its `apply_bad_words`): a one-token word's token is never allowed; a longer
    word's last token is not allowed where the tokens generated so far end with its other tokens. `fill(row)`
    allows every token of the vocabulary but those, `accept(token)` records the generated token, and it is never
    `done`. One per request (the engine builds it from `add_request(bad_words_ids=...)`)."""

    done = False
    description = "bad_words"

    def __init__(self, word_ids: Sequence[Sequence[int]], vocab_size: int):
        self.always = sorted({int(w[0]) for w in word_ids if len(w) == 1})
        self.longer = [(tuple(int(t) for t in w[:-1]), int(w[-1])) for w in word_ids if len(w) > 1]
        self._keep = max((len(prefix) for prefix, _ in self.longer), default=0)
        self._all = allowed_row(np.arange(vocab_size), vocab_size)
        self._recent: list[int] = []  # the last _keep tokens generated

    def banned(self) -> list[int]:
        """The tokens the next one may not be."""
        recent = tuple(self._recent)
        return self.always + [last for prefix, last in self.longer if recent[-len(prefix):] == prefix]

    def fill(self, row: np.ndarray) -> None:
        n = self._all.shape[0]
        row[n:] = 0
        row[:n] = self._all
        ban(row, self.banned())

    def accept(self, token: int) -> None:
        if self._keep:
            self._recent = (self._recent + [int(token)])[-self._keep:]


class Intersection:
    """Host-side masks applied together: `fill` is the AND of their rows, each token goes to every one's `accept`,
    and it is `done` once any is (a grammar complete)."""

    def __init__(self, masks: Sequence):
        self.masks = list(masks)

    def fill(self, row: np.ndarray) -> None:
        self.masks[0].fill(row)
        scratch = np.empty_like(row)
        for mask in self.masks[1:]:
            mask.fill(scratch)
            row &= scratch

    def accept(self, token: int) -> None:
        for mask in self.masks:
            mask.accept(token)

    @property
    def done(self) -> bool:
        return any(mask.done for mask in self.masks)
