"""Benchmark task definitions: lm-evaluation-harness's default prompts over local files in each hub schema.

The expected strings are written out from lm-eval's task templates (arc_easy.yaml, hellaswag/utils.py,
winogrande/preprocess_winogrande.py, mmlu/default/_default_template_yaml, gsm8k.yaml), not computed.
"""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from swiftkv_jax.evaluation.tasks import (KINDS, TASK_NAMES, GenerationItem, MultipleChoiceItem, TaskError,
                                          extract_answer, is_correct, load_task, parse_task_spec)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def load(tmp_path):
    def load(spec, **kw):
        return load_task(spec, cache_dir=str(tmp_path / "cache"), **kw)
    return load


def arc_row(i, key="B"):
    return {"id": f"q{i}", "question": f"Question number {i}?",
            "choices": {"text": [f"wrong {i}", f"right {i}", f"other {i}"], "label": ["A", "B", "C"]},
            "answerKey": key}


def test_arc_prompt_continuations_and_gold(tmp_path, load):
    rows = [{"id": "a", "question": "What is the capital of France?",
             "choices": {"text": ["Berlin", "Paris", "Rome", "Madrid"], "label": ["A", "B", "C", "D"]},
             "answerKey": "B"},
            {"id": "b", "question": "Which gas do plants absorb?",  # numeric labels occur in ARC
             "choices": {"text": ["Oxygen", "Nitrogen", "Carbon dioxide"], "label": ["1", "2", "3"]},
             "answerKey": "3"}]
    for name in ("arc_easy", "arc_challenge"):
        task = load(f"{name}={write_jsonl(tmp_path / 'arc.jsonl', rows)}")
        assert (task.name, task.kind, task.source, task.stop) == (name, "multiple_choice", str(tmp_path / "arc.jsonl"),
                                                                  ())
        assert task.items == (
            MultipleChoiceItem(("Question: What is the capital of France?\nAnswer:",) * 4,
                               (" Berlin", " Paris", " Rome", " Madrid"), 1),
            MultipleChoiceItem(("Question: Which gas do plants absorb?\nAnswer:",) * 3,
                               (" Oxygen", " Nitrogen", " Carbon dioxide"), 2))


def test_arc_from_parquet_and_limit(tmp_path, load):
    pq.write_table(pa.Table.from_pylist([arc_row(i) for i in range(5)]), tmp_path / "arc.parquet")
    task = load(f"arc_easy={tmp_path / 'arc.parquet'}", limit=2)
    assert [it.contexts[0] for it in task.items] == ["Question: Question number 0?\nAnswer:",
                                                    "Question: Question number 1?\nAnswer:"]
    assert task.items[1].continuations == (" wrong 1", " right 1", " other 1") and task.items[1].gold == 1


def test_hellaswag_preprocessing(tmp_path, load):
    rows = [{"ind": 4, "activity_label": "Home and Garden",
             "ctx_a": "[header] How to clean a grill. [title] Heat the grill.", "ctx_b": "then scrub the grates.",
             "endings": ["Scrub the grates [substeps] with a wire brush.", "Eat the grill.  ", "Paint it.",
                         "Sell the grill."],
             "label": "0"},
            {"ind": 5, "activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
             "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                         "is holding a rubik's cube.", "starts pulling up roofing on a roof."],
             "label": 3}]
    task = load(f"hellaswag={write_jsonl(tmp_path / 'hs.jsonl', rows)}")
    # " [title]" -> ". ", brackets dropped, double spaces collapsed (lm-eval's ".." is kept); ctx_b capitalised
    assert task.items[0] == MultipleChoiceItem(
        ("Home and Garden: How to clean a grill.. Heat the grill. Then scrub the grates.",) * 4,
        (" Scrub the grates with a wire brush.", " Eat the grill.", " Paint it.", " Sell the grill."), 0)
    assert task.items[1] == MultipleChoiceItem(
        ("Roof shingle removal: A man is sitting on a roof. He",) * 4,
        (" is using wrap to wrap a pair of skis.", " is ripping level tiles off.", " is holding a rubik's cube.",
         " starts pulling up roofing on a roof."), 3)


def test_winogrande_partial_contexts(tmp_path, load):
    rows = [{"sentence": "Sarah was a much better surgeon than Maria so _ always got the harder cases.",
             "option1": "Sarah", "option2": "Maria", "answer": "1"},
            {"sentence": "The trophy doesn't fit into the suitcase because the _ is too small.",
             "option1": "trophy", "option2": "suitcase", "answer": "2"}]
    task = load(f"winogrande={write_jsonl(tmp_path / 'wg.jsonl', rows)}", num_fewshot=1)
    assert task.items[0] == MultipleChoiceItem(
        ("The trophy doesn't fit into the suitcase because the suitcase is too small.\n\n"
         "Sarah was a much better surgeon than Maria so Sarah",
         "The trophy doesn't fit into the suitcase because the suitcase is too small.\n\n"
         "Sarah was a much better surgeon than Maria so Maria"),
        (" always got the harder cases.", " always got the harder cases."), 0,
        choices=("Sarah was a much better surgeon than Maria so Sarah", "Sarah was a much better surgeon than Maria so "
                 "Maria"))  # lm-eval's doc_to_choice: the filled-in contexts, without the few-shot prefix
    assert task.items[1].contexts == (
        "Sarah was a much better surgeon than Maria so Sarah always got the harder cases.\n\n"
        "The trophy doesn't fit into the suitcase because the trophy",
        "Sarah was a much better surgeon than Maria so Sarah always got the harder cases.\n\n"
        "The trophy doesn't fit into the suitcase because the suitcase")
    assert task.items[1].continuations == (" is too small.",) * 2 and task.items[1].gold == 1


def mmlu_row(subject, question, answer=1):
    return {"question": question, "subject": subject, "choices": ["Atlantic", "Pacific", "Indian", "Arctic"],
            "answer": answer}


def test_mmlu_header_letters_and_same_subject_shots(tmp_path, load):
    rows = [mmlu_row("high_school_geography", "  Which is the largest ocean?\n"),
            mmlu_row("astronomy", "Which ocean is on Mars?", 3),
            mmlu_row("high_school_geography", "Which ocean borders Portugal?", 0)]
    path = write_jsonl(tmp_path / "mmlu.jsonl", rows)
    item = load(f"mmlu={path}").items[0]
    assert item == MultipleChoiceItem(
        ("The following are multiple choice questions (with answers) about high school geography.\n\n"
         "Which is the largest ocean?\nA. Atlantic\nB. Pacific\nC. Indian\nD. Arctic\nAnswer:",) * 4,
        (" A", " B", " C", " D"), 1)
    # one description first, then the example (same subject, gold letter appended), then the question
    assert load(f"mmlu={path}", num_fewshot=1, limit=1).items[0].contexts[0] == (
        "The following are multiple choice questions (with answers) about high school geography.\n\n"
        "Which ocean borders Portugal?\nA. Atlantic\nB. Pacific\nC. Indian\nD. Arctic\nAnswer: A\n\n"
        "Which is the largest ocean?\nA. Atlantic\nB. Pacific\nC. Indian\nD. Arctic\nAnswer:")
    with pytest.raises(TaskError, match="pool of subject 'astronomy' has only 0"):  # no other example
        load(f"mmlu={path}", num_fewshot=1, limit=2)


def test_gsm8k_prompt_answer_and_fewshot(tmp_path, load):
    rows = [{"question": "Janet has 3 apples and buys 15 more. How many does she have?",
             "answer": "She has 3+15=<<3+15=18>>18 apples.\n#### 18"},
            {"question": "A car costs $1,000 and a bike $250. What do both cost?",
             "answer": "1,000+250=<<1000+250=1250>>1,250\n#### 1,250"}]
    path = write_jsonl(tmp_path / "gsm8k.jsonl", rows)
    task = load(f"gsm8k={path}", num_fewshot=0)
    assert (task.kind, task.stop) == ("generation", ("Question:", "</s>", "<|im_end|>"))  # gsm8k.yaml's until
    assert task.items == (
        GenerationItem("Question: Janet has 3 apples and buys 15 more. How many does she have?\nAnswer:", "18"),
        GenerationItem("Question: A car costs $1,000 and a bike $250. What do both cost?\nAnswer:", "1250"))
    assert load(f"gsm8k={path}", num_fewshot=1).items[0].prompt == (
        "Question: A car costs $1,000 and a bike $250. What do both cost?\n"
        "Answer: 1,000+250=<<1000+250=1250>>1,250\n#### 1,250\n\n"
        "Question: Janet has 3 apples and buys 15 more. How many does she have?\nAnswer:")


def test_fewshot_count_seed_and_never_the_doc(tmp_path, load):
    path = write_jsonl(tmp_path / "arc.jsonl", [arc_row(i) for i in range(12)])
    task = load(f"arc_easy={path}", num_fewshot=3)
    assert task.num_fewshot == 3
    for i, item in enumerate(task.items):
        context = item.contexts[0]
        assert context.count("Question: ") == 4 and context.count(f"Question number {i}?") == 1
        assert context.endswith(f"\n\nQuestion: Question number {i}?\nAnswer:")
        shots = context.split("\n\n")[:-1]
        assert all(s.startswith("Question: Question number ") for s in shots)
        assert all(s.endswith(f"\nAnswer: right {s.split('number ')[1].split('?')[0]}") for s in shots)
    assert load(f"arc_easy={path}", num_fewshot=3) == task
    assert load(f"arc_easy={path}", num_fewshot=3, seed=7) != task
    two = write_jsonl(tmp_path / "two.jsonl", [arc_row(0), arc_row(1, "C")])
    assert load(f"arc_easy={two}", num_fewshot=1).items[1].contexts[0] == (
        "Question: Question number 0?\nAnswer: right 0\n\nQuestion: Question number 1?\nAnswer:")
    with pytest.raises(TaskError, match="2 few-shot examples asked.*only 1"):
        load(f"arc_easy={two}", num_fewshot=2)


def test_folder_is_read_like_a_hub_dataset_with_splits(tmp_path, load):
    (tmp_path / "gsm").mkdir()  # a downloaded dataset: docs from split test, few-shot examples from train
    write_jsonl(tmp_path / "gsm" / "test.jsonl", [{"question": "q0", "answer": "a #### 1"}])
    write_jsonl(tmp_path / "gsm" / "train.jsonl", [{"question": f"t{i}", "answer": f"b #### {i}"} for i in range(2)])
    task = load(f"gsm8k={tmp_path / 'gsm'}:default", num_fewshot=1, limit=1)
    assert task.source == f"{tmp_path / 'gsm'}:default@test"
    assert task.items[0].prompt.startswith("Question: t") and task.items[0].prompt.endswith("\n\nQuestion: q0\nAnswer:")
    # evaluating the few-shot split itself: the example is the other row
    assert load(f"gsm8k={tmp_path / 'gsm'}:default@train", num_fewshot=1).items == (
        GenerationItem("Question: t1\nAnswer: b #### 1\n\nQuestion: t0\nAnswer:", "0"),
        GenerationItem("Question: t0\nAnswer: b #### 0\n\nQuestion: t1\nAnswer:", "1"))
    with pytest.raises(TaskError, match="FOLDER:CONFIG@SPLIT"):  # default config "main" is not in a plain folder
        load(f"gsm8k={tmp_path / 'gsm'}")


@pytest.mark.parametrize("generated, strict, flexible", [
    ("She has 3 + 15 = 18 apples.\n#### 18", "18", "18"),
    ("#### 42 since 6 * 7 = 42, not 100", "42", "100"),                   # strict: the first "#### N"; flexible: last
    ("So she has 5 + 13 = 18 apples.", "[invalid]", "18"),
    ("The total is $1,250.50.", "[invalid]", "$1,250.50."),               # as written; exact_match drops $ , and "."
    ("#### $1,000", "[invalid]", "$1,000"),                               # strict wants a digit after "#### "
    ("####18", "[invalid]", "18"),
    ("It drops to -7 degrees.", "[invalid]", "-7"),
    ("I do not know.", "[invalid]", "[invalid]"),
    ("#### 18\n\nThen 20 more", "18", "20"),                               # "\n\n" is no stop string in gsm8k.yaml
    ("The answer is 18.\n\nQuestion: Tom has 99 apples", "[invalid]", "18."),  # cut at the stop strings
    ("It is 5 Question: and 7", "[invalid]", "5"),
    ("It is 5<|im_end|>7", "[invalid]", "5"),
])
def test_gsm8k_extract_answer_is_lm_evals_filters(tmp_path, load, generated, strict, flexible):
    """gsm8k.yaml's strict-match and flexible-extract filters (regex, take_first) after its until strings; checked
    against lm-eval's own RegexFilter where it is installed."""
    task = load(f"gsm8k={write_jsonl(tmp_path / 'g.jsonl', [{'question': 'q', 'answer': '#### 1'}])}", num_fewshot=0)
    assert extract_answer(task, generated) == strict
    assert extract_answer(task, generated, "exact_match_flexible") == flexible
    extraction = pytest.importorskip("lm_eval.filters.extraction")
    cut = generated
    for stop in task.stop:
        cut = cut.split(stop)[0]
    assert extraction.RegexFilter(r"#### (\-?[0-9\.\,]+)").apply([[cut]], [{}]) == [[strict]]
    assert extraction.RegexFilter(r"(-?[$0-9.,]{2,})|(-?[0-9]+)", group_select=-1).apply([[cut]], [{}]) == [[flexible]]


def test_gsm8k_is_correct_is_lm_evals_exact_match(tmp_path, load):
    """gsm8k.yaml's exact_match: ",", "$", everything to "#### " and a final "." removed from both sides, case
    ignored; no numeric comparison ("18.0" is not "18")."""
    path = write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "x\n#### -3"}])
    task = load(f"gsm8k={path}", num_fewshot=0)
    assert task.items[0].answer == "-3"
    assert is_correct(task, "-3", "-3") and is_correct(task, "$1,000.", "1000") and is_correct(task, "-3.", "-3")
    assert not is_correct(task, "-3.0", "-3") and not is_correct(task, "-4", "-3")
    assert not is_correct(task, "[invalid]", "-3") and not is_correct(task, "1000..", "1000")
    metrics = pytest.importorskip("lm_eval.api.metrics")
    for predicted, gold in (("$1,000.", "x\n#### 1,000"), ("-3.0", "x #### -3"), ("18...", "a\n#### 18")):
        lm_eval = metrics.exact_match_hf_evaluate([gold], [predicted], ignore_case=True, ignore_punctuation=False,
                                                  regexes_to_ignore=[",", "\\$", "(?s).*#### ", "\\.$"])
        assert is_correct(task, predicted, gold) == bool(lm_eval["exact_match"])


def _shots(context: str) -> list[str]:
    return context.split("\n\n")[:-1]


def test_hellaswag_and_winogrande_draw_one_example_more_as_lm_eval(tmp_path, load):
    """lm-eval draws num_fewshot + 1 examples from the shared Random (and keeps the first num_fewshot that are not the
    doc) where the task's fewshot_split equals its test_split: for HellaSwag and Winogrande both are unset, so even
    with a separate train split each doc moves the Random on by one draw more than ARC's. Written out with
    random.Random(1234), and checked against lm-eval's own ConfigurableTask where it is installed."""
    import os
    import random

    hs = [{"ind": i, "activity_label": f"Act {i}", "ctx_a": f"Context {i}.", "ctx_b": "then", "endings":
           [f"end {i}.{k}" for k in range(4)], "label": str(i % 4)} for i in range(30)]
    wg = [{"sentence": f"Ann{i} met Bo{i} and _ smiled.", "option1": f"Ann{i}", "option2": f"Bo{i}",
           "answer": "12"[i % 2]} for i in range(30)]
    for name, rows, split, first in (("hellaswag", hs, "validation", "Act {}:"), ("winogrande", wg, "validation",
                                                                                 "Ann{} met")):
        folder = tmp_path / name
        (folder / "data").mkdir(parents=True)
        files = {"train": write_jsonl(folder / "data" / "train-00000-of-00001.jsonl", rows[:24]),
                 split: write_jsonl(folder / "data" / f"{split}-00000-of-00001.jsonl", rows[24:])}
        task = load(f"{name}={folder}:default", num_fewshot=3)
        rng, expected = random.Random(1234), []
        for _ in task.items:
            expected.append(rng.sample(range(24), 4)[:3])
        for item, picked in zip(task.items, expected):
            shots = _shots(item.contexts[0])
            assert len(shots) == 3 and all(s.startswith(first.format(j)) for s, j in zip(shots, picked))
        lm_eval = pytest.importorskip("lm_eval")
        lm_task = pytest.importorskip("lm_eval.api.task")
        yaml = pytest.importorskip("lm_eval.tasks._yaml_loader")
        config = yaml.load_yaml(os.path.join(os.path.dirname(lm_eval.__file__), "tasks", name,
                                             {"hellaswag": "hellaswag.yaml", "winogrande": "default.yaml"}[name]))
        config.pop("tag", None)
        config.update(dataset_path="json", dataset_name=None, num_fewshot=3,
                      dataset_kwargs={"data_files": files, "cache_dir": str(tmp_path / "hf")})
        reference = lm_task.ConfigurableTask(config=config)
        reference.set_fewshot_seed(1234)
        reference.build_all_requests(rank=0, world_size=1)
        contexts = [i.arguments[0] for i in reference.instances]  # every choice of every doc, in order
        assert contexts == [c for it in task.items for c in it.contexts]


def test_gsm8k_default_prompts_are_lm_evals_five_shot(tmp_path, load):
    """With no num_fewshot asked, each GSM8K prompt is the one lm-eval's own gsm8k.yaml builds (its 5 shots, drawn
    from train with seed 1234, and its delimiters), where lm-eval is installed."""
    import os

    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} plus {i}.\n#### {2 * i}"} for i in range(30)]
    folder = tmp_path / "gsm8k"
    (folder / "data").mkdir(parents=True)
    files = {"train": write_jsonl(folder / "data" / "train-00000-of-00001.jsonl", rows[:24]),
             "test": write_jsonl(folder / "data" / "test-00000-of-00001.jsonl", rows[24:])}
    task = load(f"gsm8k={folder}:default")
    lm_eval = pytest.importorskip("lm_eval")
    lm_task = pytest.importorskip("lm_eval.api.task")
    yaml = pytest.importorskip("lm_eval.tasks._yaml_loader")
    config = yaml.load_yaml(os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "gsm8k", "gsm8k.yaml"))
    config.pop("tag", None)
    config.update(dataset_path="json", dataset_name=None,
                  dataset_kwargs={"data_files": files, "cache_dir": str(tmp_path / "hf")})
    reference = lm_task.ConfigurableTask(config=config)  # its num_fewshot, as `lm_eval --tasks gsm8k`
    reference.set_fewshot_seed(1234)
    reference.build_all_requests(rank=0, world_size=1)
    assert task.num_fewshot == 5 and [i.arguments[0] for i in reference.instances] == [it.prompt for it in task.items]


def test_perplexity_documents(tmp_path, load):
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "a.txt").write_text("First document.\n\nIts second paragraph.\n")
    (tmp_path / "docs" / "sub" / "b.txt").write_text("Second document, one line.")
    (tmp_path / "docs" / "README.md").write_text("not a document")
    task = load(f"perplexity={tmp_path / 'docs'}")
    assert (task.kind, task.items) == ("perplexity", ("First document.\n\nIts second paragraph.\n",
                                                      "Second document, one line."))
    assert load(f"perplexity={tmp_path / 'docs' / '*.txt'}").items == ("First document.\n\nIts second paragraph.\n",)
    rows = [{"text": "row one"}, {"text": ""}, {"text": "row two\nstill two"}, {"text": "row three"}]
    assert load(f"perplexity={write_jsonl(tmp_path / 'p.jsonl', rows)}", limit=2).items == (
        "row one", "row two\nstill two")
    with pytest.raises(TaskError, match="needs a source"):
        load("perplexity")
    with pytest.raises(TaskError, match="no field.*'text'"):
        load(f"perplexity={write_jsonl(tmp_path / 'q.jsonl', [{'body': 'x'}])}")


def test_parse_task_spec_and_unknown_names():
    assert TASK_NAMES == ("arc_easy", "arc_challenge", "hellaswag", "winogrande", "mmlu", "gsm8k", "perplexity")
    assert KINDS == ("multiple_choice", "generation", "perplexity")
    assert parse_task_spec("arc_easy") == ("arc_easy", None)
    assert parse_task_spec("arc_easy=data/arc.jsonl") == ("arc_easy", "data/arc.jsonl")
    assert parse_task_spec("mmlu=cais/mmlu:all@test") == ("mmlu", "cais/mmlu:all@test")
    with pytest.raises(TaskError, match="'arc_easy'.*mmlu"):
        parse_task_spec("arc-easy=x.jsonl")
    with pytest.raises(TaskError, match="'hellaswag'"):
        load_task("helaswag")
    with pytest.raises(TaskError, match="nothing after '='"):
        parse_task_spec("gsm8k=")


def test_bad_data_errors(tmp_path, load):
    row = arc_row(0)
    del row["answerKey"]
    with pytest.raises(TaskError, match=r"arc_easy: .* no field\(s\) \['answerKey'\].*allenai/ai2_arc"):
        load(f"arc_easy={write_jsonl(tmp_path / 'a.jsonl', [row])}")
    with pytest.raises(TaskError, match="row 1 .*answerKey 'F' is not one of"):
        load(f"arc_easy={write_jsonl(tmp_path / 'b.jsonl', [arc_row(0), arc_row(1, 'F')])}")
    no_blank = {"sentence": "No blank here.", "option1": "a", "option2": "b", "answer": "1"}
    with pytest.raises(TaskError, match="row 0 .*has no '_' blank"):
        load(f"winogrande={write_jsonl(tmp_path / 'w.jsonl', [no_blank])}")
    with pytest.raises(TaskError, match="no such file"):
        load(f"hellaswag={tmp_path / 'missing.jsonl'}")
    with pytest.raises(TaskError, match="config/split applies to hub datasets"):
        load(f"arc_easy={write_jsonl(tmp_path / 'c.jsonl', [arc_row(0)])}@test")


def test_hub_names_offline_say_how_to_download(load):
    with pytest.raises(TaskError, match="offline.*hf download allenai/ai2_arc"):
        load("arc_easy")
    with pytest.raises(TaskError, match="cais/mmlu:abstract_algebra@validation.*offline"):
        load("mmlu=cais/mmlu:abstract_algebra@validation")


def test_acc_norm_divides_by_the_choices_characters_as_lm_eval():
    """lm-eval's multiple-choice acc_norm: argmax(loglikelihood / len(choice)), the choice as its doc_to_choice gives
    it (no target delimiter) and counted in characters (bytes are its acc_bytes). Numbers where counting the
    leading space, or bytes, picks the other choice."""
    from swiftkv_jax.evaluation.harness import choice_hits

    item = MultipleChoiceItem(("Q:",) * 2, (" ab", " abcd"), 1)
    assert choice_hits(item, [-2.0, -3.9]) == {"acc": 0.0, "acc_norm": 1.0}  # -1.0 < -0.975; with the space, 0 wins
    item = MultipleChoiceItem(("Q:",) * 2, (" é", " ab"), 1)
    assert choice_hits(item, [-1.1, -2.0]) == {"acc": 0.0, "acc_norm": 1.0}  # per byte, "é" (2 bytes) would win
    winogrande = MultipleChoiceItem(("shots\n\nIt was x", "shots\n\nIt was yyy"), (" ok.", " ok."), 1,
                                    choices=("It was x", "It was yyy"))
    assert choice_hits(winogrande, [-8.2, -10.0])["acc_norm"] == 1.0  # -1.025 < -1.0: lengths of its choices


@pytest.mark.parametrize("context,continuation", [
    ("Question: What is 2 + 3?\nAnswer:", " 5"),
    ("Question: What is 2 + 3?\nAnswer: ", "5"),          # the space ends the context: lm-eval moves it on
    ("The dog ran to the. ", " Sort these words"),       # HellaSwag's " [title]" -> ". " leaves one there
    ("<|begin_of_text|>Question: What is 2 + 3?\nAnswer:", " 5"),  # rendered with its BOS: no second one
])
def test_context_and_continuation_ids_are_lm_evals(context, continuation):
    """lm-eval's own _encode_pair, over HFLM.tok_encode (the tokenizer's BOS, none where the text starts with
    it; written out here, as HFLM needs accelerate), gives the ids that infer.py eval scores."""
    from types import SimpleNamespace

    from swiftkv_jax.data import toy
    from swiftkv_jax.evaluation.harness import encode_pair
    template_lm = pytest.importorskip("lm_eval.api.model").TemplateLM
    tokenizer = toy.train_chat_tokenizer([m["content"] for e in toy.synthetic_chat_examples(40)
                                          for m in e["messages"]], vocab_size=400)

    def tok_encode(text, add_special_tokens=None):
        return tokenizer.encode(text, add_special_tokens=not text.startswith(tokenizer.bos_token))

    lm_eval = template_lm._encode_pair(SimpleNamespace(backend="causal", tok_encode=tok_encode), context, continuation)
    assert encode_pair(tokenizer, context, continuation, False) == lm_eval
    assert lm_eval[0].count(tokenizer.bos_token_id) == 1


def test_gsm8k_is_five_shot_unless_asked_as_lm_eval(tmp_path, load):
    """`eval --tasks gsm8k` was 0-shot while lm-eval's (and the published numbers') is 5-shot: a user comparing
    scores compared different prompts. None now means the task's lm-eval default; a pool too small is named."""
    rows = [{"question": f"q{i}", "answer": f"a\n#### {i}"} for i in range(7)]
    task = load(f"gsm8k={write_jsonl(tmp_path / 'g.jsonl', rows)}")
    assert task.num_fewshot == 5
    assert all(item.prompt.count("Question: ") == 6 and item.prompt.endswith(f"Question: q{i}\nAnswer:")
               for i, item in enumerate(task.items))
    assert load(f"gsm8k={write_jsonl(tmp_path / 'g.jsonl', rows)}", num_fewshot=0).items[0].prompt == (
        "Question: q0\nAnswer:")
    with pytest.raises(TaskError, match=r"5 few-shot examples asked.*only 1 .*lower num_fewshot \(--num-fewshot\)"):
        load(f"gsm8k={write_jsonl(tmp_path / 'two.jsonl', rows[:2])}")
    arc = load(f"arc_easy={write_jsonl(tmp_path / 'arc.jsonl', [arc_row(i) for i in range(3)])}")
    assert arc.num_fewshot == 0 and arc.items[0].contexts[0].count("Question: ") == 1


@pytest.mark.parametrize("name, yaml_file", [
    ("arc_easy", "arc/arc_easy.yaml"), ("arc_challenge", "arc/arc_easy.yaml"),
    ("hellaswag", "hellaswag/hellaswag.yaml"),
    ("winogrande", "winogrande/default.yaml"), ("mmlu", "mmlu/default/_default_template_yaml"),
    ("gsm8k", "gsm8k/gsm8k.yaml")])
def test_default_shots_are_lm_evals(name, yaml_file):
    """Each task's default number of shots is its lm-eval yaml's num_fewshot (0 where it sets none), read from the
    installed lm-eval (arc_challenge.yaml includes arc_easy.yaml)."""
    import re
    from pathlib import Path

    from swiftkv_jax.evaluation import tasks

    lm_eval = pytest.importorskip("lm_eval")
    text = (Path(lm_eval.__file__).parent / "tasks" / yaml_file).read_text()
    found = re.search(r"^num_fewshot:\s*(\d+)", text, re.MULTILINE)
    assert tasks._SPECS[name].num_fewshot == (int(found.group(1)) if found else 0)


def test_the_report_gives_each_tasks_shots():
    """The table's n-shot column and the JSON's num_fewshot are each task's own (5-shot GSM8K beside 0-shot ARC)."""
    import argparse

    from swiftkv_jax.evaluation.report import comparison_table, results_json
    from swiftkv_jax.evaluation.tasks import Task

    tasks = [Task("gsm8k", "generation", "g.jsonl", (), num_fewshot=5), Task("arc_easy", "multiple_choice", "a", ())]
    metrics = {"n": 3, "exact_match": 0.5, "exact_match_flexible": 0.5, "acc": 0.25, "acc_norm": 0.25}
    results = {"m": {"gsm8k": metrics, "arc_easy": metrics}}
    lines = [[c.strip() for c in line.strip("|").split("|")] for line in comparison_table(tasks, results).splitlines()]
    header = next(cells for cells in lines if "n-shot" in cells)
    shots = {cells[0]: cells[header.index("n-shot")] for cells in lines if cells[0] in ("gsm8k", "arc_easy")}
    assert shots == {"gsm8k": "5", "arc_easy": "0"}
    report = results_json(argparse.Namespace(command="eval"), tasks, results)
    assert {k: v["num_fewshot"] for k, v in report["tasks"].items()} == {"gsm8k": 5, "arc_easy": 0}
