"""Render and tokenize documents with the teacher's own tokenizer, marking the assistant's tokens.

Chat examples go through the tokenizer's chat template; the assistant's characters are found by rendering
each conversation up to every assistant turn (works for any template, also those without
`{% generation %}`), and mapped to tokens through the offsets of one tokenization of the whole text.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Optional

import datasets
import jinja2
import numpy as np
from datasets.fingerprint import Hasher
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from swiftkv_jax.data.errors import DataError

FEATURES = datasets.Features({
    "input_ids": datasets.Sequence(datasets.Value("int32")),
    "assistant": datasets.Sequence(datasets.Value("int8")),  # 1 where the token belongs to the assistant
    "length": datasets.Value("int32"),
})

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@contextlib.contextmanager
def _transformers_errors_only():
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():  # and its FutureWarning about config keys the tokenizer never reads
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        hf_logging.set_verbosity(level)


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer saved in `path` (a teacher checkpoint directory), never downloaded."""
    fix = (f"copy the teacher's tokenizer files (tokenizer.json, tokenizer_config.json) there, e.g. with "
           f"tokenizer.save_pretrained({path!r})")
    local = os.path.expanduser(path)
    if os.path.isdir(local) and not any(os.path.exists(os.path.join(local, f)) for f in TOKENIZER_FILES):
        raise DataError(f"no tokenizer in {path!r} (files there: {sorted(os.listdir(local))}); {fix}")
    try:
        # AutoTokenizer reads config.json too; transformers then warns that it does not know a *_swiftkv
        # model_type, which is harmless for the tokenizer: keep that out of users' logs.
        with _transformers_errors_only():
            return AutoTokenizer.from_pretrained(local, local_files_only=True)
    except (OSError, ValueError) as e:
        if not os.path.exists(local):  # not a hub id in the local cache either
            where = "" if os.path.isabs(local) else f" (relative to {os.getcwd()})"
            raise DataError(f"the tokenizer directory {path!r} does not exist{where}: check the path") from None
        raise DataError(f"no usable tokenizer in {path!r} ({' '.join(str(e).split())}); {fix}") from e


def tokenize(ds: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, assistant_mask: bool = True,
             num_proc: Optional[int] = None) -> datasets.Dataset:
    """Rows {messages, text} -> {input_ids, assistant, length}, one document per row.

    Without `assistant_mask` every token counts as the assistant's, so templates that rewrite earlier
    turns (and cannot be split by prefix) still work with loss_mask: all.
    """
    if assistant_mask and not tokenizer.is_fast:
        raise DataError("loss_mask: assistant needs a fast tokenizer (tokenizer.json) for offset mappings")
    what = tokenizer_fingerprint(tokenizer)
    return ds.map(_tokenize_batch, batched=True, remove_columns=ds.column_names, features=FEATURES,
                  fn_kwargs={"tokenizer": tokenizer, "assistant_mask": assistant_mask}, num_proc=num_proc,
                  new_fingerprint=None if what is None else Hasher.hash(
                      ("tokenize", ds._fingerprint, what, assistant_mask, Hasher.hash(_tokenize_batch),
                       Hasher.hash(render_chat))),
                  desc="tokenizing")


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> Optional[str]:
    """What tokenizing with `tokenizer` depends on (its model, template and special tokens), not where it was loaded
    from: datasets' own hash of the object holds its folder, so a copied or moved teacher re-tokenized all the data.
    None for a slow tokenizer, which has no serialised model (datasets' own hash then, paths included)."""
    if not tokenizer.is_fast:
        return None
    return Hasher.hash((type(tokenizer).__name__, tokenizer.backend_tokenizer.to_str(), tokenizer.chat_template,
                        tokenizer.special_tokens_map, tokenizer.bos_token_id, tokenizer.eos_token_id))


def encode(tokenizer: PreTrainedTokenizerBase, messages: list, text: Optional[str],
           assistant_mask: bool = True) -> tuple[list[int], list[int]]:
    """One document: (token ids, assistant mask)."""
    out = _tokenize_batch({"messages": [messages], "text": [text]}, tokenizer, assistant_mask)
    return out["input_ids"][0], out["assistant"][0].tolist()


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list,
                assistant_mask: bool = True) -> tuple[str, list[tuple[int, int]]]:
    """The conversation as text, and the character spans [start, end) of the assistant turns."""
    if not tokenizer.chat_template:
        raise DataError("the tokenizer has no chat template but the data has chat examples: use the tokenizer "
                        "of a chat (instruct) model, or give the source format: text")

    def render(msgs, prompt=False):
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)
        except jinja2.TemplateError as e:  # raise_exception() in the template: it refuses this conversation
            roles = ", ".join(str(m.get("role")) for m in messages)
            raise DataError(f"the tokenizer's chat template refused a conversation (roles: {roles}): {e}. Drop or "
                            f"merge the turns it refuses (e.g. system turns) in the data, or give model.tokenizer a "
                            f"tokenizer whose template accepts them") from None

    full = render(messages)
    spans = []
    for i, message in enumerate(messages if assistant_mask else ()):
        if message["role"] != "assistant":
            continue
        upto = render(messages[:i + 1])
        before = render(messages[:i], prompt=True) if i else _opening_reply_start(render, message, upto)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise DataError(f"the chat template does not render turn {i} (assistant) as a continuation of the "
                            f"earlier turns, so the assistant's tokens cannot be located: use loss_mask: all "
                            f"for this template. Rendered prefix: {before[-200:]!r}")
        spans.append((len(before), len(upto)))
    return full, spans


def _opening_reply_start(render, message: dict, rendered: str) -> str:
    """What comes before the content of a conversation's first turn, an assistant's (a greeting: trained as any reply,
    as transformers' `{% generation %}` mask and axolotl mark it). With no earlier turn to render a generation prompt
    after (transformers refuses an empty conversation), it is where `rendered` parts from the turn rendered with other
    content, one that differs in its first character."""
    other = "y" if message["content"].lstrip().startswith("x") else "x"
    return os.path.commonprefix([rendered, render([{**message, "content": other}])])


def _tokenize_batch(batch, tokenizer: PreTrainedTokenizerBase, assistant_mask: bool):
    # Chat: the template already holds BOS and turn ends, so no special tokens are added. Text: BOS + EOS, where the
    # text does not hold them already (a text column of conversations rendered with the chat template starts with
    # its BOS and ends with its EOT): a second BOS is not what serving sends the model.
    rendered = [render_chat(tokenizer, m, assistant_mask) if m else (t, None)
                for m, t in zip(batch["messages"], batch["text"])]
    enc = tokenizer([text for text, _ in rendered], add_special_tokens=False, verbose=False,
                    return_offsets_mapping=assistant_mask)
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    ids, masks = [], []
    for i, (text, spans) in enumerate(rendered):
        text_ids = enc["input_ids"][i]
        ids.append(text_ids if spans is not None else
                   (bos if text_ids[:1] != bos else []) + text_ids + (eos if text_ids[-1:] != eos else []))
        masks.append(np.ones(len(ids[-1]), np.int8))
        if spans is not None and assistant_mask:
            in_span = np.zeros(len(text) + 1, np.int8)
            for start, end in spans:
                in_span[start:end] = 1
            starts = np.array([s for s, _ in enc["offset_mapping"][i]], np.int64).reshape(-1)
            masks[-1] = in_span[starts]  # a token belongs where its first character does
    return {"input_ids": ids, "assistant": masks, "length": [len(x) for x in ids]}
