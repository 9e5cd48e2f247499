"""The benchmarks of `infer.py eval`: lm-evaluation-harness's default prompts over each task's hub schema.

A task is a tuple of items: multiple-choice (score each continuation's log-likelihood after its context),
generation (greedy answer against the gold one) or perplexity (documents). A local export of the hub dataset
(json/jsonl/parquet with the same fields) works unchanged:

    task = load_task("arc_easy=data/arc.jsonl", num_fewshot=5)     # or "arc_easy" for allenai/ai2_arc
    task = load_task("mmlu=cais/mmlu:abstract_algebra@test")       # hub name:config@split
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import os
import random
import re
from typing import Callable, Optional, Union

from swiftkv_jax.data.errors import DataError
from swiftkv_jax.data.sources import read_raw

KINDS = ("multiple_choice", "generation", "perplexity")


class TaskError(ValueError):
    """Bad task name, spec or data; the message names the problem and the fix."""


@dataclasses.dataclass(frozen=True)
class MultipleChoiceItem:
    contexts: tuple[str, ...]        # one per choice (Winogrande's differ per choice; others repeat one)
    continuations: tuple[str, ...]   # one per choice, with lm-eval's leading space (" Paris")
    gold: int
    # lm-eval's choices (its doc_to_choice), whose characters acc_norm divides by: () for the continuations without
    # their leading space (the target delimiter); Winogrande's are its contexts without a few-shot prefix
    choices: tuple[str, ...] = ()

    @property
    def choice_texts(self) -> tuple[str, ...]:
        return self.choices or tuple(c.removeprefix(" ") for c in self.continuations)


@dataclasses.dataclass(frozen=True)
class GenerationItem:
    prompt: str                      # few-shot prefix + question, ends where the model should answer
    answer: str                      # gold answer, normalised (GSM8K: lm-eval's exact_match normalisation of the
                                     # answer: the number after '#### ', no commas, '$' or final '.', lower case)


Item = Union[MultipleChoiceItem, GenerationItem, str]


@dataclasses.dataclass(frozen=True)
class Task:
    name: str                        # e.g. "arc_easy"
    kind: str                        # one of KINDS
    source: str                      # what was loaded (path, or hub name:config@split), for the report
    items: tuple[Item, ...]          # perplexity: the documents
    stop: tuple[str, ...] = ()       # generation: strings that end an answer
    num_fewshot: int = 0
    label: str = ""                  # what results are keyed by where two tasks share a name: the spec

    @property
    def key(self) -> str:
        """The task's name in reports and results: its label, else its name."""
        return self.label or self.name


# --- formatting: one row of the hub schema -> (item without few-shot prefix, the row as a few-shot example) ---

def _index(value, options: list, field: str) -> int:
    if value not in options:
        raise ValueError(f"{field} {value!r} is not one of {options}")
    return options.index(value)


def _choices(context: str, continuations: list[str], gold: int) -> tuple[MultipleChoiceItem, str]:
    item = MultipleChoiceItem((context,) * len(continuations), tuple(continuations), gold)
    return item, context + continuations[gold]


def _arc(row: dict):
    labels, texts = list(row["choices"]["label"]), list(row["choices"]["text"])
    return _choices(f"Question: {row['question']}\nAnswer:", [f" {t}" for t in texts],
                    _index(row["answerKey"], labels, "answerKey"))


def _hellaswag_text(text: str) -> str:
    """lm-eval's cleanup: brackets are artifacts of HellaSwag's WikiHow part."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def _hellaswag(row: dict):
    context = _hellaswag_text(row["activity_label"] + ": " + row["ctx_a"] + " " + row["ctx_b"].capitalize())
    endings = [" " + _hellaswag_text(e) for e in row["endings"]]
    return _choices(context, endings, _index(str(row["label"]), [str(i) for i in range(len(endings))], "label"))


def _winogrande(row: dict):
    """lm-eval's partial scoring: the option fills the blank in the context; the rest of the sentence is scored."""
    sentence = row["sentence"]
    if "_" not in sentence:
        raise ValueError(f"sentence {sentence!r} has no '_' blank")
    blank = sentence.index("_")
    contexts = tuple(sentence[:blank] + option for option in (row["option1"], row["option2"]))
    rest = " " + sentence[blank + 1:].strip()
    gold = _index(str(row["answer"]), ["1", "2"], "answer")
    return MultipleChoiceItem(contexts, (rest, rest), gold, choices=contexts), contexts[gold] + rest


def _mmlu(row: dict):
    choices = list(row["choices"])
    if len(choices) != 4:
        raise ValueError(f"choices has {len(choices)} entries, MMLU needs 4")
    lines = [row["question"].strip()] + [f"{letter}. {c}" for letter, c in zip("ABCD", choices)]
    return _choices("\n".join(lines) + "\nAnswer:", [" A", " B", " C", " D"],
                    _index(int(row["answer"]), [0, 1, 2, 3], "answer"))


def _mmlu_header(row: dict) -> str:
    return f"The following are multiple choice questions (with answers) about {row['subject'].replace('_', ' ')}.\n\n"


def _gsm8k(row: dict):
    if "####" not in row["answer"]:
        raise ValueError("answer has no '#### <number>' at its end")
    prompt = f"Question: {row['question']}\nAnswer:"
    return GenerationItem(prompt, _exact_match_form(row["answer"])), f"{prompt} {row['answer']}"


@dataclasses.dataclass(frozen=True)
class _Spec:
    kind: str
    hub: Optional[str]                # default source; None: the user names one
    config: Optional[str]
    split: str
    fewshot_split: Optional[str]      # where a hub source's few-shot examples come from (lm-eval's choice)
    fields: tuple[str, ...]
    schema: str                       # the expected row, for error messages
    render: Optional[Callable] = None
    header: Callable[[dict], str] = lambda row: ""  # before the few-shot examples (MMLU's description)
    group: Optional[str] = None       # few-shot examples share this field (lm-eval's MMLU is per subject)
    first_n: bool = False             # few-shot examples in pool order (lm-eval's MMLU), not a seeded draw
    # lm-eval draws num_fewshot + 1 examples (and drops the doc) wherever its fewshot_split equals its test_split,
    # which holds for HellaSwag and Winogrande as both are unset there: the extra draw moves the shared Random on
    draw_extra: bool = False
    stop: tuple[str, ...] = ()
    num_fewshot: int = 0              # when none is asked: lm-eval's task default (its yaml's num_fewshot)


_ARC_SCHEMA = "{question, choices: {text: [...], label: [...]}, answerKey}"
_SPECS = {
    "arc_easy": _Spec("multiple_choice", "allenai/ai2_arc", "ARC-Easy", "test", "train",
                      ("question", "choices", "answerKey"), _ARC_SCHEMA, _arc),
    "arc_challenge": _Spec("multiple_choice", "allenai/ai2_arc", "ARC-Challenge", "test", "train",
                           ("question", "choices", "answerKey"), _ARC_SCHEMA, _arc),
    "hellaswag": _Spec("multiple_choice", "Rowan/hellaswag", None, "validation", "train",
                       ("activity_label", "ctx_a", "ctx_b", "endings", "label"),
                       "{activity_label, ctx_a, ctx_b, endings: [...], label}", _hellaswag, draw_extra=True),
    "winogrande": _Spec("multiple_choice", "allenai/winogrande", "winogrande_xl", "validation", "train",
                        ("sentence", "option1", "option2", "answer"),
                        "{sentence (with one '_'), option1, option2, answer: '1' | '2'}", _winogrande,
                        draw_extra=True),
    "mmlu": _Spec("multiple_choice", "cais/mmlu", "all", "test", "dev", ("question", "subject", "choices", "answer"),
                  "{question, subject, choices: [4 strings], answer: 0-3}", _mmlu, _mmlu_header,
                  group="subject", first_n=True),
    "gsm8k": _Spec("generation", "openai/gsm8k", "main", "test", "train", ("question", "answer"),
                   "{question, answer: '... #### <number>'}", _gsm8k,
                   stop=("Question:", "</s>", "<|im_end|>"), num_fewshot=5),  # gsm8k.yaml's until and shots
    "perplexity": _Spec("perplexity", None, None, "train", None, ("text",),
                        ".txt files (one document per file) or json/jsonl/parquet rows {text}"),
}
TASK_NAMES: tuple[str, ...] = tuple(_SPECS)


def parse_task_spec(spec: str) -> tuple[str, Optional[str]]:
    """"arc_easy" -> ("arc_easy", None); "arc_easy=data/arc.jsonl" -> ("arc_easy", "data/arc.jsonl")."""
    name, eq, source = spec.partition("=")
    name, source = name.strip(), source.strip()
    if name not in _SPECS:
        near = difflib.get_close_matches(name, TASK_NAMES, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise TaskError(f"unknown task {name!r}{hint}; tasks: {', '.join(TASK_NAMES)} "
                        f"(optionally NAME=SOURCE: a local file/glob/folder or a hub name[:config][@split])")
    if eq and not source:
        raise TaskError(f"task spec {spec!r}: nothing after '='; name a source or drop the '='")
    return name, source or None


def load_task(spec: str, *, num_fewshot: Optional[int] = None, limit: Optional[int] = None, seed: int = 1234,
              cache_dir: Optional[str] = None) -> Task:
    """The task's items: the first `limit` docs, each with `num_fewshot` examples drawn with `seed` (lm-eval's
    sampler: one Random per task, an extra example drawn and dropped when the pool holds the doc itself, and for
    HellaSwag and Winogrande always, as lm-eval). `num_fewshot=None` is lm-eval's default for the task: 5 for
    GSM8K, 0 for the others."""
    name, source = parse_task_spec(spec)
    spec_ = _SPECS[name]
    num_fewshot = spec_.num_fewshot if num_fewshot is None else num_fewshot
    if num_fewshot < 0 or (limit is not None and limit < 1):
        raise TaskError(f"{name}: num_fewshot must be >= 0 and limit >= 1 or None, got {num_fewshot}, {limit}")
    if spec_.kind == "perplexity":
        return _perplexity(name, source, num_fewshot, limit, cache_dir)
    path, config, split, files = _resolve(name, spec_, source)
    where = _describe(path, config, split, files)
    rows = _read(name, spec_, path, config, split, files, cache_dir)
    # a file (or the few-shot split itself) is its own few-shot pool: examples never include the doc
    same = files or split == spec_.fewshot_split
    pool, pool_where = rows, where
    if num_fewshot and not same:
        pool_where = _describe(path, config, spec_.fewshot_split, files)
        pool = _read(name, spec_, path, config, spec_.fewshot_split, files, cache_dir)
    groups = collections.defaultdict(list)
    for j, row in enumerate(pool if num_fewshot else ()):
        groups[row[spec_.group] if spec_.group else None].append(j)
    rng, shots = random.Random(seed), {}

    def shot(j: int) -> str:
        if j not in shots:
            shots[j] = _render(name, spec_, pool[j], j, pool_where)[1]
        return shots[j]

    items = []
    for i, doc in enumerate(rows[:limit]):
        item, _, header = _render(name, spec_, doc, i, where)
        group = doc[spec_.group] if spec_.group else None
        prefix = header + "".join(shot(j) + "\n\n" for j in _fewshot(name, spec_, groups[group], i, same,
                                                                     num_fewshot, rng, group))
        if isinstance(item, MultipleChoiceItem):
            item = dataclasses.replace(item, contexts=tuple(prefix + c for c in item.contexts))
        else:
            item = dataclasses.replace(item, prompt=prefix + item.prompt)
        items.append(item)
    return Task(name, spec_.kind, where, tuple(items), spec_.stop, num_fewshot)


def _fewshot(name: str, spec_: _Spec, candidates: list[int], i: int, same: bool, n: int,
             rng: random.Random, group=None) -> list[int]:
    if n == 0:
        return []
    if len(candidates) - same < n:
        where = f" of {spec_.group} {group!r}" if spec_.group else ""
        raise TaskError(f"{name}: {n} few-shot examples asked, the few-shot pool{where} has only "
                        f"{len(candidates) - same} (other than doc {i}); lower num_fewshot (--num-fewshot)")
    k = min(n + 1, len(candidates)) if same or spec_.draw_extra else n
    picked = candidates[:k] if spec_.first_n else rng.sample(candidates, k)
    return [j for j in picked if not (same and j == i)][:n]


def _resolve(name: str, spec_: _Spec, source: Optional[str]) -> tuple[str, Optional[str], str, bool]:
    """(path, config, split, is it local file(s)). A file or glob has neither config nor split; a folder is read
    as a downloaded hub dataset, so it and hub names take the task's config and split unless given
    (`:default` for a dataset without configs)."""
    if source is None:
        return spec_.hub, spec_.config, spec_.split, False
    path, config, split = source, None, None
    if not (os.path.exists(os.path.expanduser(source)) or _is_glob(source)):
        path, config, split = re.fullmatch(r"(.+?)(?::([^:@/]+))?(?:@([^:@/]+))?", source).groups()
    if os.path.isfile(os.path.expanduser(path)) or _is_glob(path):
        if config or split:
            raise TaskError(f"{name}: source {source!r}: a config/split applies to hub datasets and their "
                            f"downloaded folders, not to files; drop ':{config or ''}@{split or ''}'")
        return path, None, "train", True
    return path, config or spec_.config, split or spec_.split, False


def _is_glob(path: str) -> bool:
    return any(ch in path for ch in "*?[")


def _looks_local(path: str) -> bool:
    """A path no hub dataset name has: absolute, relative to . or ~, or ending in a data file's extension."""
    return (path.startswith(("/", "./", "../", "~")) or
            os.path.splitext(path)[1].lower() in (".txt", ".json", ".jsonl", ".parquet", ".csv", ".gz"))


def _describe(path: str, config: Optional[str], split: str, files: bool) -> str:
    return path if files else f"{path}{f':{config}' if config else ''}@{split}"


def _read(name: str, spec_: _Spec, path: str, config: Optional[str], split: str, files: bool,
          cache_dir: Optional[str], text_by_file: bool = False) -> list[dict]:
    """The rows; `name` starts every error and names the source in the hints as `name=SOURCE` (the task spec's
    syntax; `--data=SOURCE` is argparse's for analyze)."""
    where = _describe(path, config, split, files)
    if not files and _looks_local(path) and not os.path.exists(os.path.expanduser(path)):
        raise TaskError(f"{name}: {path}: no such file or folder (a hub dataset is named like owner/name)")
    try:
        ds = read_raw(path, split=split, name=config, cache_dir=cache_dir, text_by_file=text_by_file)
    except DataError as e:
        hint = ""
        if os.path.isdir(os.path.expanduser(path)):
            hint = (f" A folder is read as a downloaded hub dataset, here config {config} split {split} (set them: "
                    f"{name}=FOLDER:CONFIG@SPLIT); for a folder of plain files use a glob: {name}='FOLDER/*.jsonl'")
        elif not files:
            hint = f" ({name}=SOURCE reads a file, folder or glob that exists, else a hub dataset of that name)"
        raise TaskError(f"{name}: cannot read {where}: {e}{hint}") from e
    if len(ds) == 0:
        raise TaskError(f"{name}: {where} has no rows")
    missing = [f for f in spec_.fields if f not in ds.column_names]
    if missing:
        raise TaskError(f"{name}: {where} has no field(s) {missing} (fields: {ds.column_names}); {name} needs rows "
                        f"{spec_.schema}, the schema of {spec_.hub or 'its source'}")
    return ds.to_list()


def _render(name: str, spec_: _Spec, row: dict, i: int, where: str) -> tuple[Item, str, str]:
    """(item without few-shot prefix, the row as a few-shot example, the text before the examples)."""
    try:
        return (*spec_.render(row), spec_.header(row))
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a null or malformed field
        raise TaskError(f"{name}: row {i} of {where} does not fit the schema {spec_.schema}: "
                        f"{type(e).__name__}: {e}") from e


def _perplexity(name: str, source: Optional[str], num_fewshot: int, limit: Optional[int],
                cache_dir: Optional[str]) -> Task:
    spec_ = _SPECS[name]
    if source is None:
        raise TaskError(f"{name} needs a source: {name}=FOLDER_OR_GLOB_OF_TXT, {name}=FILE.txt (one document per "
                        f"file) or {name}=FILE.jsonl / .parquet (one document per row, field 'text')")
    if num_fewshot:
        raise TaskError(f"{name} takes no few-shot examples; set num_fewshot to 0")
    where, docs = read_documents(source, label=name, cache_dir=cache_dir)
    return Task(name, spec_.kind, where, docs[:limit])


def read_documents(source: str, *, label: str = "perplexity", cache_dir: Optional[str] = None
                   ) -> tuple[str, tuple[str, ...]]:
    """(what was read, its non-empty documents) of a text source: .txt files (a file, folder or glob; one document
    a file) or json/jsonl/parquet rows {text}. `label` starts every error and names the source in its hints
    (`label=SOURCE`): the task name in eval's specs, `--data` for analyze."""
    spec_ = _SPECS["perplexity"]
    path, config, split, files = _resolve(label, spec_, source)
    docs = [t for t in (row["text"] for row in _read(label, spec_, path, config, split, files, cache_dir, True))
            if t and t.strip()]
    if not docs:
        raise TaskError(f"{label}: every document of {source} is empty")
    return _describe(path, config, split, files), tuple(docs)


# --- answers of generation tasks ---

# gsm8k.yaml's filters, each giving one exact_match: its first "#### N" (strict-match, the report's exact_match) and its
# last number (flexible-extract, exact_match_flexible); "[invalid]" where there is none
ANSWER_FILTERS = {"exact_match": (re.compile(r"#### (\-?[0-9\.\,]+)"), 0),
                  "exact_match_flexible": (re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)"), -1)}
_INVALID = "[invalid]"
# gsm8k.yaml's exact_match: these removed from prediction and gold, in this order, then lower case
_IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")


def _exact_match_form(text: str) -> str:
    for pattern in _IGNORE:
        text = re.sub(pattern, "", text)
    return text.lower()


def extract_answer(task: Task, generated: str, metric: str = "exact_match") -> str:
    """The answer in a generation, cut at the first stop string. GSM8K: lm-eval's filter of `metric` (a key of
    ANSWER_FILTERS): the number after the first '#### ' (strict-match) or the last number (flexible-extract), as
    written ("$1,250."); "[invalid]" when there is none."""
    cut = min((i for i in (generated.find(s) for s in task.stop) if i >= 0), default=len(generated))
    text = generated[:cut]
    if task.name != "gsm8k":
        return text.strip()
    pattern, select = ANSWER_FILTERS[metric]
    found = pattern.findall(text)
    if not found:
        return _INVALID
    match = found[select]
    if isinstance(match, tuple):
        match = next((m for m in match if m), _INVALID)
    return match.strip()


def is_correct(task: Task, predicted: str, answer: str) -> bool:
    """Whether an extracted answer (`extract_answer`) matches the gold one: GSM8K by lm-eval's exact_match (commas,
    '$' and a final '.' ignored, case too: "1,250." == "1250", but "18.0" != "18"), else exactly."""
    if task.name == "gsm8k":
        return _exact_match_form(predicted) == _exact_match_form(answer)
    return predicted == answer
