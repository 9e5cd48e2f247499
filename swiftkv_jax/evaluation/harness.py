"""Evaluate a model on tasks (`swiftkv_jax.evaluation.tasks`): tokenise, score on the serving engine, metrics.

Multiple choice: log p(continuation | context) for every choice (acc), and per character of the choice (acc_norm),
as lm-evaluation-harness. Generation: greedy answers through `sk.generate`, cut at the task's
stop strings, answer extracted and compared (GSM8K: exact_match by lm-eval's strict-match filter,
exact_match_flexible by its flexible-extract). Perplexity: rolling log-likelihood of each
document, reported per token and per byte (bits per byte compares models with different tokenizers).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import numpy as np
from jax.sharding import Mesh

from swiftkv_jax.evaluation.scoring import rolling_loglikelihood, score_continuations
from swiftkv_jax.evaluation.tasks import ANSWER_FILTERS, MultipleChoiceItem, Task, extract_answer, is_correct
from swiftkv_jax.model.model import Model
from swiftkv_jax.serving.generate import generate


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    batch_size: int = 32            # continuations (or generations, or windows) per call
    max_length: int = 2048          # context + continuation tokens; longer contexts lose their start
    max_new_tokens: int = 256       # generation tasks
    chat_template: bool = False     # wrap each context as one user turn of the tokenizer's chat template
    swiftkv: Optional[bool] = None  # None: the SwiftKV fast path for a SwiftKV model; False: teacher wiring
    cache_dtype: str = "auto"       # KV cache; "auto": each model's compute dtype (`kv_quant.as_format`)
    mesh: Optional[Mesh] = None     # tensor-parallel serving mesh (`serving_mesh(N)`), None: one device
    attention_impl: Optional[str] = None         # generation tasks' kernels; None: `generate`'s defaults
    decode_attention_impl: Optional[str] = None


PRIMARY_METRIC = {"multiple_choice": "acc", "generation": "exact_match", "perplexity": "bits_per_byte"}


def render_context(tokenizer, context: str, chat_template: bool) -> list[int]:
    """Context ids: BOS (if the tokenizer adds one) + text, or the chat template's user turn + assistant header."""
    if not chat_template:
        return _encode(tokenizer, context)
    if not tokenizer.chat_template:
        raise ValueError("--chat-template: this tokenizer has no chat template; drop the option")
    text = tokenizer.apply_chat_template([{"role": "user", "content": context}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _encode(tokenizer, text: str) -> list[int]:
    """The tokenizer's special tokens (its BOS), but none where the text starts with the BOS already (lm-eval's
    tok_encode): a context of a prompt rendered beforehand is not given a second one."""
    bos = tokenizer.bos_token
    return tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]


def encode_pair(tokenizer, context: str, continuation: str, chat_template: bool) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) split where the context ends inside the joint tokenisation, so a
    merge across the boundary is attributed to the continuation (as lm-eval)."""
    if chat_template:  # the answer starts the assistant turn: no separating space
        return render_context(tokenizer, context, True), tokenizer(continuation.lstrip(),
                                                                  add_special_tokens=False)["input_ids"]
    spaces = len(context) - len(context.rstrip())  # lm-eval's: a context's trailing spaces begin the continuation
    if spaces and context.strip():
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = _encode(tokenizer, context)
    whole = _encode(tokenizer, context + continuation)
    if whole[: len(context_ids)] == context_ids and len(whole) > len(context_ids):
        return context_ids, whole[len(context_ids):]
    return context_ids, tokenizer(continuation, add_special_tokens=False)["input_ids"]


def _truncate(context: list[int], continuation: list[int], max_length: int) -> tuple[list[int], list[int]]:
    if len(continuation) >= max_length:
        raise ValueError(f"a continuation of {len(continuation)} tokens does not fit max_length={max_length}")
    return context[max(0, len(context) + len(continuation) - max_length):], continuation


def _stderr(values) -> float:
    values = np.asarray(values, np.float64)
    return float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else float("nan")


def evaluate(model: Model, tokenizer, task: Task, options: EvalOptions = EvalOptions(),
             progress: Optional[Callable[[int], None]] = None) -> dict:
    """Metrics of `model` on `task` (a dict of floats plus n). progress(k): k more units done (see `units`)."""
    if task.kind == "multiple_choice":
        return _multiple_choice(model, tokenizer, task, options, progress)
    if task.kind == "generation":
        return _generation(model, tokenizer, task, options, progress)
    return _perplexity(model, tokenizer, task, options, progress)


def units(task: Task) -> int:
    """How many progress units `evaluate` reports: requests, answers or documents."""
    if task.kind == "multiple_choice":
        return sum(len(item.continuations) for item in task.items)
    return len(task.items)


def _multiple_choice(model, tokenizer, task, options, progress) -> dict:
    requests, owners = [], []
    for i, item in enumerate(task.items):
        for context, continuation in zip(item.contexts, item.continuations):
            requests.append(_truncate(*encode_pair(tokenizer, context, continuation, options.chat_template),
                                      options.max_length))
            owners.append(i)
    scores = score_continuations(model, requests, swiftkv=options.swiftkv, batch_size=options.batch_size,
                                 cache_dtype=options.cache_dtype, progress=progress, mesh=options.mesh)
    acc, acc_norm, start = [], [], 0
    for item in task.items:
        n = len(item.continuations)
        hits = choice_hits(item, [s[0] for s in scores[start: start + n]])
        acc.append(hits["acc"])
        acc_norm.append(hits["acc_norm"])
        start += n
    return {"acc": float(np.mean(acc)), "acc_stderr": _stderr(acc), "acc_norm": float(np.mean(acc_norm)),
            "acc_norm_stderr": _stderr(acc_norm), "n": len(task.items)}


def choice_hits(item: MultipleChoiceItem, logp) -> dict:
    """Whether the most likely choice is the gold one (acc), and the most likely per character of lm-eval's choice
    text (acc_norm: its `len(choice)`, the target delimiter left out; characters, not bytes)."""
    length = np.array([len(c) or 1 for c in item.choice_texts], np.float64)
    logp = np.asarray(logp, np.float64)
    return {"acc": float(np.argmax(logp) == item.gold), "acc_norm": float(np.argmax(logp / length) == item.gold)}


def _generation(model, tokenizer, task, options, progress) -> dict:
    budget = options.max_length - options.max_new_tokens
    if budget < 1:
        raise ValueError(f"max_new_tokens={options.max_new_tokens} leaves no room for a prompt in "
                         f"max_length={options.max_length}")
    prompts = [render_context(tokenizer, item.prompt, options.chat_template)[-budget:] for item in task.items]
    stops = set(model.config.eos_token_id or ()) | ({tokenizer.eos_token_id} - {None})
    metrics = tuple(ANSWER_FILTERS) if task.name == "gsm8k" else ("exact_match",)
    correct, outputs = {m: [] for m in metrics}, []
    for start in range(0, len(prompts), options.batch_size):
        batch = prompts[start: start + options.batch_size]
        out = generate(model, batch, options.max_new_tokens, stop_token_ids=sorted(stops), swiftkv=options.swiftkv,
                       cache_dtype=options.cache_dtype, tokenizer=tokenizer, mesh=options.mesh,
                       attention_impl=options.attention_impl, decode_attention_impl=options.decode_attention_impl)
        for item, text in zip(task.items[start: start + len(batch)], out.texts):
            answers = {m: extract_answer(task, text, m) for m in metrics}
            for m, answer in answers.items():
                correct[m].append(float(is_correct(task, answer, item.answer)))
            outputs.append({"answer": answers["exact_match"], **{f"answer_{m}": a for m, a in answers.items()
                                                                  if m != "exact_match"},
                            "target": item.answer, "output": text})
        if progress:
            progress(len(batch))
    result = {}
    for m, hits in correct.items():
        result.update({m: float(np.mean(hits)), f"{m}_stderr": _stderr(hits)})
    return {**result, "n": len(outputs), "samples": outputs[:8]}


def scored_documents(tokenizer, texts) -> list[list[int]]:
    """Each text's ids behind one token of context, so that every token of the text is predicted: the BOS a
    tokenizer adds, else its BOS or EOS put first here (lm-eval's prefix token; Qwen2's tokenizer adds none)."""
    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if prefix is None:
        raise ValueError("perplexity needs a token to condition each text's first token on, but the tokenizer has "
                         "neither a BOS nor an EOS token: give --tokenizer one that has")
    documents = [tokenizer(text)["input_ids"] for text in texts]
    return [ids if ids[:1] == [prefix] else [prefix, *ids] for ids in documents]


def _perplexity(model, tokenizer, task, options, progress) -> dict:
    documents = scored_documents(tokenizer, task.items)
    scores = rolling_loglikelihood(model, documents, max_length=options.max_length, swiftkv=options.swiftkv,
                                   batch_size=options.batch_size, progress=None, mesh=options.mesh)
    if progress:
        progress(len(documents))
    nats = -sum(s for s, _ in scores)
    tokens = sum(n for _, n in scores)
    num_bytes = sum(len(text.encode("utf-8")) for text in task.items)
    # a full forward over each window: no KV cache, so EvalOptions.cache_dtype (--cache-dtype) does not apply
    return {"nats_per_token": nats / tokens, "perplexity": math.exp(nats / tokens),
            "bits_per_byte": nats / num_bytes / math.log(2), "tokens": tokens, "n": len(documents),
            "kv_cache": "none (a full forward over each window)"}
