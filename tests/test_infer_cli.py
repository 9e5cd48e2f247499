"""`python infer.py generate | eval | bench` end to end on a tiny teacher and its SwiftKV student (CPU, fp32)."""

import importlib
import json
import shutil
import types

import numpy as np
import pytest

import swiftkv_jax as sk
from swiftkv_jax.checkpoints.sidecar import read_sidecar_files
from swiftkv_jax.data.chat import load_tokenizer
from swiftkv_jax.infer_cli import main
from swiftkv_jax.tiny_assets import make_tiny_assets

ARC_ROWS = [
    {"question": "What do bees make?", "choices": {"text": ["honey", "milk", "glass"], "label": ["A", "B", "C"]},
     "answerKey": "A"},
    {"question": "Which is a fruit?", "choices": {"text": ["owl", "pear"], "label": ["A", "B"]}, "answerKey": "B"},
    {"question": "Count to three.", "choices": {"text": ["1 2 3", "3 2 1", "1 1 1", "2 2"],
                                                "label": ["1", "2", "3", "4"]}, "answerKey": "1"},
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = make_tiny_assets(tmp_path_factory.mktemp("infer"), num_examples=200)
    teacher = root / "teacher"
    student = sk.to_swiftkv(sk.load(teacher), 2, 1)
    sk.save(student, root / "student", "hf", extra_files=read_sidecar_files(teacher))
    with open(root / "arc.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in ARC_ROWS)
    with open(root / "gsm8k.jsonl", "w") as f:
        for q, a in [("What is 2 + 3?", "2 + 3 = 5\n#### 5"), ("What is 10 + 1?", "10 + 1 = 11\n#### 11")]:
            f.write(json.dumps({"question": q, "answer": a}) + "\n")
    (root / "docs").mkdir()
    (root / "docs" / "a.txt").write_text("apple pear fig " * 20)
    (root / "docs" / "b.txt").write_text("Count from 3 to 9. 3 4 5 6 7 8 9")
    return root


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_streams_what_the_engine_generates(checkpoints, capsys, monkeypatch):
    infer_cli, contexts = importlib.import_module("swiftkv_jax.infer_cli"), []
    stream = infer_cli._Stream
    monkeypatch.setattr(infer_cli, "_Stream", lambda tokenizer, ids: contexts.append(list(ids)) or
                        stream(tokenizer, ids))
    student = checkpoints / "student"
    code, out, _ = run(capsys, "generate", "--model", student, "--prompt", "What is 4 + 5?", "--max-new-tokens", 12)
    assert code == 0
    tokenizer = load_tokenizer(str(student))
    assert contexts == [tokenizer("What is 4 + 5?")["input_ids"]]  # the stream decodes in the prompt's context
    want = sk.generate(sk.load(student), "What is 4 + 5?", 12, tokenizer=tokenizer,
                       stop_token_ids=[tokenizer.eos_token_id]).texts[0]
    assert out == want + "\n"


def test_generate_streams_at_a_cost_per_token_that_does_not_grow(checkpoints, capsys, monkeypatch):
    """`generate --prompt` decoded every token so far at each new token: 400 tokens decoded 80,200 ids (quadratic in
    the output's length). The stream now decodes a short window per token and still prints the whole text, each
    character whole."""
    from swiftkv_jax.infer_cli import _Stream

    tokenizer = load_tokenizer(str(checkpoints / "student"))
    prompt = tokenizer("Count: ")["input_ids"]
    ids = tokenizer(" é 1 2 3 😀" * 40)["input_ids"][1:401]  # multi-byte characters split over byte-level tokens
    decoded, decode = [], tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda t, **kw: decoded.append(len(t)) or decode(t, **kw))
    stream = _Stream(tokenizer, prompt)
    for token in ids:
        stream(np.array([token]), np.array([True]))
    stream.finish()
    out = capsys.readouterr().out
    assert out == decode(ids, skip_special_tokens=True) + "\n" and "\ufffd" not in out
    assert sum(decoded) < 20 * len(ids), sum(decoded)


def test_generate_streams_the_prompts_continuation_as_transformers_decodes_it(capsys):
    """A Llama 2 style (SentencePiece) tokenizer drops the first space of a decoded sequence: the stream is the prompt's
    continuation, tokenizer.decode(prompt + output) less decode(prompt), so the output's first token keeps its space
    after a prompt (the server's text, test_server); after BOS alone, or a prompt ending inside a character (its bytes
    would fuse with the output's), it is the output decoded alone. A step where the row is not live prints nothing.
    (The tiny byte-level tokenizer above decodes alike with or without the prompt.)"""
    from test_server import _llama2_style_tokenizer

    from swiftkv_jax.infer_cli import _Stream

    tokenizer = _llama2_style_tokenizer()
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    out = tokenizer("Hello world 日本 é, wor!", add_special_tokens=False)["input_ids"]
    hello = tokenizer("Hello")["input_ids"]
    mid_character = tokenizer("Hello 日", add_special_tokens=False)["input_ids"][:-1]  # the last byte token cut off
    assert decode(mid_character).endswith("\ufffd")
    for prompt, want in [(hello, decode(hello + out)[len(decode(hello)):]), ([tokenizer.bos_token_id], decode(out)),
                         (mid_character, decode(out))]:
        stream = _Stream(tokenizer, prompt)
        for token in out:
            stream(np.array([token]), np.array([True]))
        stream(np.array([out[0]]), np.array([False]))
        stream.finish()
        assert capsys.readouterr().out == want + "\n", prompt
    assert want.startswith("Hello world") and decode(hello + out)[len(decode(hello)):].startswith(" Hello world")


def test_generate_from_a_prompts_file_with_the_chat_template(checkpoints, capsys, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Sort these words: fig apple\nRepeat 'owl' 2 times.\n")
    code, out, _ = run(capsys, "generate", "--model", checkpoints / "student", "--prompts-file", prompts, "--chat",
                       "--max-new-tokens", 6, "--teacher-mode")
    assert code == 0
    assert "=== 0: Sort these words: fig apple" in out and "=== 1: Repeat 'owl' 2 times." in out


def test_min_p_one_samples_what_greedy_takes(checkpoints, capsys):
    """--min-p 1 keeps only the most likely token, so sampling at temperature 1 gives greedy's text."""
    common = ("generate", "--model", checkpoints / "student", "--prompt", "Hello", "--max-new-tokens", 8)
    greedy = run(capsys, *common)
    sampled = run(capsys, *common, "--temperature", 1.0, "--min-p", 1.0, "--seed", 3)
    plain = run(capsys, *common, "--temperature", 1.0, "--seed", 3)
    assert greedy[0] == sampled[0] == plain[0] == 0
    assert sampled[1] == greedy[1] != plain[1]


def test_prompt_longer_than_the_cache_is_a_clear_error(checkpoints, capsys):
    """The command names its flags (the library's message named max_len and max_new_tokens, its parameters)."""
    code, _, err = run(capsys, "generate", "--model", checkpoints / "student", "--prompt", "apple " * 40,
                       "--max-len", 32)
    assert code == 2 and "but --max-len is 32: raise --max-len to at least" in err, err
    assert "--max-new-tokens 128" in err and "max_len" not in err, err


def test_checkpoint_without_a_tokenizer_is_a_clear_error(checkpoints, capsys, tmp_path):
    sk.save(sk.load(checkpoints / "teacher"), tmp_path / "bare", "hf")
    code, _, err = run(capsys, "generate", "--model", tmp_path / "bare", "--prompt", "hi")
    assert code == 2 and "no tokenizer in" in err and "or pass --tokenizer DIR" in err


def test_a_missing_checkpoint_is_named_as_such_not_as_a_missing_tokenizer(capsys, tmp_path):
    for command in (("generate", "--prompt", "hi"), ("serve",)):
        code, _, err = run(capsys, command[0], "--model", tmp_path / "nowhere", *command[1:])
        assert code == 2 and f"{tmp_path / 'nowhere'}: no such checkpoint directory" in err and "tokenizer" not in err


def test_eval_compares_student_and_teacher(checkpoints, capsys, tmp_path):
    out_json = tmp_path / "eval.json"
    code, out, _ = run(capsys, "eval", "--model", checkpoints / "student", "--compare", checkpoints / "teacher",
                       "--tasks", f"arc_easy={checkpoints / 'arc.jsonl'}", f"gsm8k={checkpoints / 'gsm8k.jsonl'}",
                       f"perplexity={checkpoints / 'docs'}", "--max-new-tokens", 8, "--num-fewshot", 0,
                       "--output", out_json)
    assert code == 0
    report = json.loads(out_json.read_text())
    student, teacher = str(checkpoints / "student"), str(checkpoints / "teacher")
    assert set(report["results"]) == {student, teacher}
    assert "Δ (model − compare)" in out and "arc_easy" in out and "bits_per_byte" in out
    for name in ("arc_easy", "gsm8k", "perplexity"):
        for metric, delta in report["deltas"][name].items():
            assert delta == pytest.approx(report["results"][student][name][metric]
                                          - report["results"][teacher][name][metric])
    # the metrics against an independent computation, each sequence scored by one full forward in float64:
    # acc and lm-eval's acc_norm (per character of the choice) from context + choice; perplexity per token and
    # bits per byte over the documents (every token after the prefix BOS predicted; one window each here)
    tokenizer = load_tokenizer(student)

    def logp(model, ids):
        logits = np.asarray(sk.logits(model, np.asarray([ids])), np.float64)[0]
        return (logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True))[np.arange(len(ids) - 1), ids[1:]]

    texts = [(checkpoints / "docs" / name).read_text() for name in ("a.txt", "b.txt")]
    documents = [tokenizer(t)["input_ids"] for t in texts]
    documents = [ids if ids[0] == tokenizer.bos_token_id else [tokenizer.bos_token_id] + ids for ids in documents]
    for path in (student, teacher):
        model = sk.load(path)
        correct, correct_norm = [], []
        for row in ARC_ROWS:
            context = f"Question: {row['question']}\nAnswer:"
            n = len(tokenizer(context)["input_ids"])
            scores = np.array([logp(model, tokenizer(context + " " + c)["input_ids"])[n - 1:].sum()
                               for c in row["choices"]["text"]])
            chars = np.array([len(c) for c in row["choices"]["text"]])
            for hits, pick in ((correct, np.argmax(scores)), (correct_norm, np.argmax(scores / chars))):
                hits.append(row["choices"]["label"][int(pick)] == row["answerKey"])
        got = report["results"][path]
        assert got["arc_easy"]["acc"] == pytest.approx(np.mean(correct))
        assert got["arc_easy"]["acc_norm"] == pytest.approx(np.mean(correct_norm))
        nats = -sum(logp(model, ids).sum() for ids in documents)
        tokens = sum(len(ids) - 1 for ids in documents)
        assert got["perplexity"]["tokens"] == tokens
        assert got["perplexity"]["nats_per_token"] == pytest.approx(nats / tokens, rel=1e-4)
        assert got["perplexity"]["perplexity"] == pytest.approx(np.exp(nats / tokens), rel=1e-4)
        assert got["perplexity"]["bits_per_byte"] == pytest.approx(
            nats / sum(len(t.encode("utf-8")) for t in texts) / np.log(2), rel=1e-4)
    # the table's last column is model - compare, as its header says
    rows = [cells for cells in ([c.strip() for c in line.strip("|").split("|")] for line in out.splitlines())
            if len(cells) == 7 and cells[0] in report["deltas"]]
    # arc_easy acc, acc_norm; gsm8k exact_match, exact_match_flexible; perplexity perplexity, bits_per_byte,
    # nats_per_token
    assert len(rows) == 7
    assert {task: spec["num_fewshot"] for task, spec in report["tasks"].items()} == dict.fromkeys(report["deltas"], 0)
    for task, shots, metric, *_, delta in rows:
        assert shots == "0"
        assert float(delta) == pytest.approx(report["deltas"][task][metric], abs=1e-4)


def test_eval_keeps_the_results_of_a_model_when_the_compared_one_fails_to_load(checkpoints, capsys, tmp_path):
    """--compare's config and tokenizer are checked up front (test_inference_bad_input); weights that fail to load
    after --model's evaluation leave its table printed and --output written, then the error."""
    compare = tmp_path / "weightless"
    compare.mkdir()
    for f in (checkpoints / "teacher").iterdir():
        if f.suffix != ".safetensors":
            (compare / f.name).write_bytes(f.read_bytes())
    out_json = tmp_path / "eval.json"
    code, out, err = run(capsys, "eval", "--model", checkpoints / "student", "--compare", compare, "--tasks",
                         f"arc_easy={checkpoints / 'arc.jsonl'}", "--output", out_json)
    assert code == 2 and "arc_easy" in out and "student" in out and "the next checkpoint failed to load" in err
    assert list(json.loads(out_json.read_text())["results"]) == [str(checkpoints / "student")]


def test_tasks_of_one_name_are_reported_apart(checkpoints, capsys, tmp_path):
    """Perplexity of two sources in one run: each under its own spec, each what it is alone; a spec given twice is
    refused before any checkpoint is read."""
    specs = [f"perplexity={checkpoints / 'docs' / name}" for name in ("a.txt", "b.txt")]
    alone = []
    for spec in specs:
        code, _, _ = run(capsys, "eval", "--model", checkpoints / "teacher", "--tasks", spec, "--output",
                         tmp_path / "alone.json")
        assert code == 0
        alone.append(json.loads((tmp_path / "alone.json").read_text())["results"][str(checkpoints / "teacher")])
    code, out, _ = run(capsys, "eval", "--model", checkpoints / "teacher", "--tasks", *specs, "--output",
                       tmp_path / "both.json")
    both = json.loads((tmp_path / "both.json").read_text())
    assert code == 0 and all(spec in out for spec in specs) and list(both["tasks"]) == specs
    assert [both["results"][str(checkpoints / "teacher")][spec] for spec in specs] == [a["perplexity"] for a in alone]
    # --cache-dtype does not reach perplexity (a full forward, no cache): its results say so
    assert all(a["perplexity"]["kv_cache"] == "none (a full forward over each window)" for a in alone)
    code, _, err = run(capsys, "eval", "--model", "/nonexistent", "--tasks", specs[0], specs[0])
    assert code == 2 and f"--tasks gives {specs[0]} more than once: give each task once" in err


def test_perplexity_predicts_every_token_of_a_text(checkpoints):
    """Each text is conditioned on one token, so its first token is predicted too: the BOS its tokenizer adds, or
    the one put first when the tokenizer adds none (Qwen2's; lm-eval's prefix token)."""
    import copy

    from swiftkv_jax.evaluation.harness import scored_documents

    with_bos = load_tokenizer(checkpoints / "teacher")
    without = copy.deepcopy(with_bos)
    without.backend_tokenizer.post_processor = None
    texts = ["apple pear fig", "1"]
    assert without("apple pear fig")["input_ids"] == with_bos("apple pear fig")["input_ids"][1:]
    documents = scored_documents(with_bos, texts)
    assert documents == [with_bos(t)["input_ids"] for t in texts] == scored_documents(without, texts)
    assert all(d[0] == with_bos.bos_token_id and len(d) >= 2 for d in documents)


def test_unknown_task_fails_before_loading_a_model(capsys):
    code, _, err = run(capsys, "eval", "--model", "/nonexistent", "--tasks", "arc_eazy")
    assert code == 2 and "arc_easy" in err


def test_teacher_mode_needs_a_swiftkv_model(checkpoints, capsys):
    code, _, err = run(capsys, "generate", "--model", checkpoints / "teacher", "--prompt", "hi", "--teacher-mode")
    assert code == 2 and "not a SwiftKV model" in err


def test_bench_reports_both_wirings(checkpoints, capsys, tmp_path):
    out_json = tmp_path / "bench.json"
    code, out, _ = run(capsys, "bench", "--model", checkpoints / "student", "--prompt-len", 32, "--gen-len", 4,
                       "--batch", 2, "--repeats", 1, "--cache-dtype", "float32", "--output", out_json)
    assert code == 0 and "swiftkv / teacher" in out
    rows = json.loads(out_json.read_text())["results"]
    assert [r["wiring"] for r in rows] == ["swiftkv", "teacher"]
    assert rows[0]["vs_teacher"]["kv_bytes"] == pytest.approx((2 + 2 / 1) / 4)  # l=2, g=1 of 4 layers: 1.0
    code, _, err = run(capsys, "bench", "--preset", "tiny")
    assert code == 2 and "--random-weights" in err


def test_quantised_cache_from_the_command_line(checkpoints, capsys, tmp_path):
    """--cache-dtype int8 / fp8 and --kv-scales reach generate and bench; a bad pair is a clear error."""
    student = checkpoints / "student"
    code, out, _ = run(capsys, "generate", "--model", student, "--prompt", "What is 4 + 5?", "--max-new-tokens", 8,
                       "--cache-dtype", "int8")
    tokenizer = load_tokenizer(str(student))
    want = sk.generate(sk.load(student), "What is 4 + 5?", 8, tokenizer=tokenizer, cache_dtype="int8",
                       stop_token_ids=[tokenizer.eos_token_id]).texts[0]
    assert code == 0 and out == want + "\n"
    out_json = tmp_path / "bench.json"
    code, _, _ = run(capsys, "bench", "--model", student, "--prompt-len", 16, "--gen-len", 2, "--batch", 1,
                     "--repeats", 1, "--cache-dtype", "fp8", "--kv-scales", "per-layer", "--output", out_json)
    rows = json.loads(out_json.read_text())["results"]
    assert code == 0 and {(r["cache_dtype"], r["kv_scales"]) for r in rows} == {("float8_e4m3fn", "per-layer")}
    code, _, err = run(capsys, "generate", "--model", student, "--prompt", "hi", "--kv-scales", "per-layer")
    assert code == 2 and "--kv-scales per-layer (with --cache-dtype auto): " in err  # auto: the default
    assert "do not apply to cache dtype 'auto'" in err
    code, _, err = run(capsys, "generate", "--model", student, "--prompt", "hi", "--cache-dtype", "int4")
    assert code == 2 and "--cache-dtype int4: unknown KV cache dtype 'int4': choose one of" in err


def test_bench_records_the_dtype_an_auto_cache_resolves_to(checkpoints, capsys, tmp_path):
    """--cache-dtype auto (the default): the model's compute dtype, the checkpoint's (fp32 here) or --dtype's; the
    JSON rows record that dtype, never 'auto'."""
    out_json = tmp_path / "bench.json"
    for flags, want in (((), "float32"), (("--dtype", "bf16"), "bfloat16")):
        code, out, _ = run(capsys, "bench", "--model", checkpoints / "teacher", "--prompt-len", 16, "--gen-len", 1,
                           "--batch", 1, "--repeats", 1, *flags, "--output", out_json)
        rows = json.loads(out_json.read_text())["results"]
        assert code == 0 and [r["cache_dtype"] for r in rows] == [want] and f"KV {want}" in out


def test_tensor_parallel_from_the_command_line(checkpoints, capsys, tmp_path):
    """--tensor-parallel 2 (8 fake CPU devices) generates what one device does and serves the eval; a size that does
    not fit the devices or the heads is a clear error before any weight is read."""
    student = checkpoints / "student"
    texts = []
    for size in (1, 2):
        code, out, _ = run(capsys, "generate", "--model", student, "--prompt", "What is 4 + 5?", "--max-new-tokens",
                           8, "--cache-dtype", "float32", "--tensor-parallel", size)
        assert code == 0
        texts.append(out)
    assert texts[0] == texts[1]
    code, out, _ = run(capsys, "eval", "--model", student, "--tasks", f"arc_easy={checkpoints / 'arc.jsonl'}",
                       "--tensor-parallel", 2, "--cache-dtype", "float32")
    assert code == 0 and "arc_easy" in out
    code, _, err = run(capsys, "generate", "--model", student, "--prompt", "hi", "--tensor-parallel", 16)
    assert code == 2 and "--tensor-parallel 16 needs 16 devices, but JAX sees 8" in err
    code, _, err = run(capsys, "generate", "--model", tmp_path / "missing", "--tokenizer", student, "--prompt", "hi",
                       "--tensor-parallel", 3)
    assert code == 2 and "missing: no such checkpoint directory" in err  # named before anything is loaded
    code, _, err = run(capsys, "generate", "--model", student, "--prompt", "hi", "--tensor-parallel", 3)
    assert code == 2 and "does not divide the model's num_attention_heads (4); sizes that work" in err


def test_bench_dry_run_sizes_a_70b_model_without_allocating(capsys, tmp_path):
    out_json = tmp_path / "sizing.json"
    code, out, _ = run(capsys, "bench", "--preset", "llama-3.1-70b", "--tensor-parallel", 8, "--dry-run", "--batch",
                       8, "--prompt-len", 2048, "--gen-len", 128, "--output", out_json)
    assert code == 0 and "nothing allocated" in out
    rows = json.loads(out_json.read_text())["sizing"]
    assert [r["tensor_parallel"] for r in rows] == [1, 1, 2, 2, 4, 4, 8, 8]
    by_tp = {r["tensor_parallel"]: r for r in rows if r["wiring"] == "swiftkv"}
    assert by_tp[1]["weight_bytes_per_device"] > 130 * 2**30  # 70B in bf16 (with the SwiftKV projections)
    assert by_tp[8]["weight_bytes_per_device"] == pytest.approx(by_tp[1]["weight_bytes_per_device"] / 8, rel=1e-3)


def test_analyze_writes_the_similarity_of_layers(checkpoints, capsys, tmp_path):
    code, out, _ = run(capsys, "analyze", "--model", checkpoints / "teacher", "--data", checkpoints / "docs",
                       "--max-tokens", 64, "--out", tmp_path / "analysis")
    report = json.loads((tmp_path / "analysis" / "similarity.json").read_text())
    assert code == 0 and report["tokens"] == 64 and len(report["similarity"]) == 5
    assert (tmp_path / "analysis" / "similarity.png").stat().st_size > 0 and "layer" in out


def test_bad_settings_are_refused_before_the_weights_are_read(checkpoints, capsys, tmp_path):
    """generate and bench built the cache format after reading the weights, and every subcommand checked --dtype
    there: on a real checkpoint, after minutes. Weights that cannot be read show which check comes first."""
    broken = tmp_path / "broken"
    shutil.copytree(checkpoints / "teacher", broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    for sub in (["generate", "--prompt", "hi"], ["bench", "--gen-len", "1", "--prompt-len", "8", "--repeats", "1"]):
        # each named by its flag (the library's messages name only its parameters)
        for flags, said in ((["--cache-dtype", "fp9"], "--cache-dtype fp9: unknown KV cache dtype 'fp9'"),
                            (["--dtype", "fp9"], "--dtype fp9: unknown dtype 'fp9'"),
                            (["--kv-scales", "per-row", "--cache-dtype", "int8"], "--kv-scales per-row"),
                            (["--cache-dtype", "int8", "--kv-scales", "per-layer"], "needs a calibrated scale")):
            code, _, err = run(capsys, *sub, "--model", broken, *flags)
            assert code == 2 and said in err, (sub, flags, err)
    # analyze read the tokenizer first, so a missing checkpoint was reported as a missing tokenizer
    code, _, err = run(capsys, "analyze", "--model", tmp_path / "nowhere", "--data", checkpoints / "docs" / "a.txt",
                       "--out", tmp_path / "analysis")
    assert code == 2 and "no such checkpoint directory" in err, err
    code, _, err = run(capsys, "analyze", "--model", checkpoints / "teacher", "--data", checkpoints / "docs",
                       "--dtype", "fp9", "--out", tmp_path / "analysis")
    assert code == 2 and "--dtype fp9: unknown dtype 'fp9'" in err, err


class _Resolved(Exception):
    """Raised by the spy once an engine has resolved its kernels: nothing needs to run past that."""


@pytest.mark.parametrize("command", [
    ["generate", "--prompt", "hi"], ["serve", "--port", "0"],
    ["eval", "--tasks", "gsm8k={gsm8k}", "--num-fewshot", "0", "--max-new-tokens", "2"]])
def test_named_attention_impls_are_served_on_a_gpu(checkpoints, capsys, monkeypatch, command):
    """--attention-impl / --decode-attention-impl only went into the model's config, and on a GPU the engines
    serve their measured defaults unless the impls are named to them (`kernel_choice`): `--attention-impl xla`
    ran cuDNN or Mosaic there, without a word. Shown on a described GPU (sm_90), the kernels each engine resolves."""
    kernel_choice = importlib.import_module("swiftkv_jax.serving.kernel_choice")
    hopper = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
    choose = kernel_choice.choose
    monkeypatch.setattr(kernel_choice, "choose", lambda config, cache_dtype="bfloat16", *, paged, device=None:
                        choose(config, cache_dtype, paged=paged, device=hopper))
    monkeypatch.setattr(kernel_choice.attention_lib, "check_cudnn", lambda dtype: None)  # the described GPU has it
    resolved = []

    def spy(config, *args, **kwargs):
        chosen = kernel_choice.serving_config(config, *args, **kwargs)
        resolved.append((chosen.attention_impl, chosen.decode_attention_impl))
        raise _Resolved

    for module in ("swiftkv_jax.serving.generate", "swiftkv_jax.serving.continuous"):
        monkeypatch.setattr(importlib.import_module(module), "serving_config", spy)
    argv = [a.format(gsm8k=checkpoints / "gsm8k.jsonl") for a in command]
    with pytest.raises(_Resolved):
        main([*argv, "--model", str(checkpoints / "teacher"), "--dtype", "bfloat16", "--attention-impl", "xla",
              "--decode-attention-impl", "xla"])
    capsys.readouterr()
    assert resolved == [("xla", "xla")]


def test_generate_eval_and_serve_stop_at_generation_configs_eos_ids_too(checkpoints, tmp_path):
    """As Llama-3-Instruct and Qwen2.5-Instruct ship: config.json names <|eot_id|>, generation_config.json
    <|end_of_text|> too. The model the commands load stops at what transformers' generate stops at."""
    from transformers import GenerationConfig

    from swiftkv_jax.infer_cli import _load_model
    model_dir = shutil.copytree(checkpoints / "teacher", tmp_path / "teacher")
    tokenizer = load_tokenizer(str(model_dir))
    eot, end = tokenizer.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"])
    assert json.loads((model_dir / "config.json").read_text())["eos_token_id"] == eot
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [end, eot]}))
    args = types.SimpleNamespace(dtype=None, attention_impl=None, decode_attention_impl=None)
    eos = _load_model(str(model_dir), args).config.eos_token_id
    assert sorted(eos) == sorted(GenerationConfig.from_pretrained(model_dir).eos_token_id) == sorted([eot, end])
    (model_dir / "generation_config.json").unlink()
    assert _load_model(str(model_dir), args).config.eos_token_id == (eot,)
    (model_dir / "generation_config.json").write_text("{not json")  # named, as transformers refuses it too
    with pytest.raises(ValueError, match=r"generation_config.json is not a JSON object .*fix or delete it"):
        _load_model(str(model_dir), args)



@pytest.mark.parametrize("command", ["generate", "eval", "bench", "analyze", "serve"])
def test_help_names_every_default_the_parser_uses(command, capsys):
    """--max-new-tokens, --seed, --batch-size, --prompt-len, --batch, --repeats had no help at all, and --top-k,
    --page-size, --port, --tensor-parallel... said nothing of their defaults: --help showed none of them."""
    import argparse

    from swiftkv_jax.infer_cli import parser

    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    for action in sub._actions:
        if (not action.option_strings or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS):
            continue
        assert action.help, action.option_strings
        said = "default" in action.help or f"(default: {action.default})" in text
        assert said, (action.option_strings, action.default)
    if command in ("generate", "bench"):
        assert "(default: 128)" in text
