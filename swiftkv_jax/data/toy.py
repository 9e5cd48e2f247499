"""Tiny deterministic data and tokenizer for tests and the tiny recipe: no downloads.

Conversations are small tasks a tiny model can learn (arithmetic, counting, sorting, repeating,
reversing); the tokenizer is `bpe.train_chat_tokenizer`, a byte-level BPE with Llama 3's special tokens
and chat format.
"""

from __future__ import annotations

import random

from swiftkv_jax.data.bpe import BOS, CHAT_TEMPLATE, EOS, PAD, SPECIAL_TOKENS, train_chat_tokenizer

# the tokenizer lives in bpe.py (also used for the stdlib corpus); re-exported for existing callers
__all__ = ["BOS", "CHAT_TEMPLATE", "EOS", "PAD", "SPECIAL_TOKENS", "synthetic_chat_examples",
           "train_chat_tokenizer"]

WORDS = ("apple", "pear", "fig", "plum", "kiwi", "lime", "grape", "melon", "peach", "cherry", "mango", "lemon",
         "red", "blue", "green", "cat", "dog", "owl", "fox", "bee")
SYSTEMS = ("You are a helpful assistant.", "Answer briefly.", "You are a careful tutor. Be exact.")


def _add(rng):
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."


def _count(rng):
    start = rng.randint(1, 30)
    stop = start + rng.randint(2, 12)
    return f"Count from {start} to {stop}.", " ".join(str(i) for i in range(start, stop + 1))


def _sort(rng):
    words = rng.sample(WORDS, rng.randint(3, 7))
    return f"Sort these words: {' '.join(words)}", " ".join(sorted(words))


def _repeat(rng):
    word, times = rng.choice(WORDS), rng.randint(2, 6)
    return f"Repeat '{word}' {times} times.", " ".join([word] * times)


def _reverse(rng):
    words = rng.sample(WORDS, rng.randint(3, 6))
    return f"Reverse: {' '.join(words)}", " ".join(reversed(words))


TASKS = (_add, _count, _sort, _repeat, _reverse)


def synthetic_chat_examples(n: int, seed: int = 0) -> list[dict]:
    """n conversations {"messages": [...]}: optional system prompt, 1-3 user/assistant exchanges,
    20-300 characters of content each."""
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.4 else []
        for turn in range(rng.choice((1, 1, 2, 3))):
            question, answer = rng.choice(TASKS)(rng)
            size = sum(len(m["content"]) for m in messages) + len(question) + len(answer)
            if turn and size > 300:
                break
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        examples.append({"messages": messages})
    return examples
