"""Tiny deterministic data and tokenizer for tests and the tiny recipe: no downloads.

Conversations are small tasks a tiny model can learn (arithmetic, counting, sorting, repeating,
reversing); the tokenizer is a byte-level BPE with Llama 3's special tokens and chat format.
"""

from __future__ import annotations

import random
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<|begin_of_text|>", "<|eot_id|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", EOS, PAD]
# Llama 3's chat format (content trimmed, BOS first), without the 3.1 tool and date preamble.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

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


def train_chat_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on `texts`, with BOS/EOS/PAD and a Llama-3-style chat template."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    # as Llama 3: untrimmed offsets, BOS added by `tokenizer(text)` (not by the chat path, whose template has it)
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                      special_tokens=[(BOS, tokenizer.token_to_id(BOS))]),
    ])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   chat_template=CHAT_TEMPLATE, model_max_length=1 << 30)
