"""`python infer.py serve` under the tools users point at any OpenAI-compatible endpoint: lm-evaluation-harness's
`local-completions` model, in a SwiftKV student's own wiring and in teacher mode, and vLLM's guidellm.

A local task in a temporary directory (a JSONL file and lm-eval YAMLs, no download): its multiple-choice accuracy
through the server (echo + logprobs: the prompt's own log-probabilities) equals `infer.py eval`'s scoring of the same
items (`evaluation.harness.evaluate`), per choice within 1e-3 nats; a `generate_until` task runs to the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import swiftkv_jax as sk
from swiftkv_jax.checkpoints.sidecar import read_sidecar_files
from swiftkv_jax.data.chat import load_tokenizer
from swiftkv_jax.evaluation.harness import EvalOptions, encode_pair, evaluate
from swiftkv_jax.evaluation.scoring import score_continuations
from swiftkv_jax.evaluation.tasks import load_task
from swiftkv_jax.tiny_assets import make_tiny_assets

from server_process import free_port, wait_until_healthy

# the `clients` extra (pip install -e ".[test,clients]", as CI does); outside CI (the GPU pack's `pytest -m gpu`
# collects this module) a checkout without it skips
lm_eval = __import__("lm_eval") if os.environ.get("CI") else pytest.importorskip("lm_eval")


REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-swiftkv"
WORDS = ["apple", "river", "stone", "cloud", "music", "tiger", "paper", "green"]
ITEMS = 12


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The tiny SwiftKV student, an ARC-format JSONL and lm-eval task YAMLs over it."""
    root = make_tiny_assets(tmp_path_factory.mktemp("clients"), num_examples=200)
    sk.save(sk.to_swiftkv(sk.load(root / "teacher"), 2, 1), root / "student", "hf",
            extra_files=read_sidecar_files(root / "teacher"))
    rng = np.random.default_rng(0)
    rows = []
    for i in range(ITEMS):
        words = rng.choice(WORDS, 4, replace=False).tolist()
        rows.append(dict(id=str(i), question=f"Which word comes after {WORDS[i % 8]}?",
                         choices=dict(text=words, label=list("ABCD")), answerKey="ABCD"[i % 4]))
    tasks = root / "tasks"
    tasks.mkdir()
    data = tasks / "arc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (tasks / "tiny_arc.yaml").write_text(  # lm-eval's own arc_easy prompt
        "task: tiny_arc\n" + common + "output_type: multiple_choice\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_target: \"{{choices.label.index(answerKey)}}\"\n"
        "doc_to_choice: \"{{choices.text}}\"\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (tasks / "tiny_gen.yaml").write_text(
        "task: tiny_gen\n" + common + "output_type: generate_until\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_target: \"{{choices.text[0]}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return root


def _serve(student: Path, extra: list, log_path: Path):
    port = free_port()
    argv = [sys.executable, str(REPO / "infer.py"), "serve", "--model", str(student), "--port", str(port),
            "--served-model-name", MODEL, "--cache-dtype", "float32", "--page-size", "8", "--num-pages", "129",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--single-buckets", "8",
            "--prompt-buckets", "64", "--max-model-len", "128", *extra]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env=dict(os.environ, JAX_PLATFORMS="cpu"))
    return proc, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("teacher_mode", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["swiftkv", "teacher-mode"])
def test_lm_eval_local_completions_scores_what_infer_eval_scores(assets, teacher_mode, tmp_path):
    from lm_eval.tasks import TaskManager

    student = assets / "student"
    proc, url = _serve(student, ["--teacher-mode"] if teacher_mode else [], tmp_path / "server.log")
    try:
        tokenizer = load_tokenizer(str(student))
        bos = tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]
        model = sk.load(student)
        task = load_task(f"arc_easy={assets / 'tasks' / 'arc.jsonl'}")
        options = EvalOptions(cache_dtype="float32", swiftkv=False if teacher_mode else None)
        ours = evaluate(model, tokenizer, task, options)  # infer.py eval's numbers, meanwhile the server warms up
        pairs = [encode_pair(tokenizer, c, x, False) for item in task.items
                 for c, x in zip(item.contexts, item.continuations)]
        scores = score_continuations(model, pairs, swiftkv=options.swiftkv, cache_dtype="float32")
        wait_until_healthy(proc, url, tmp_path / "server.log", timeout=240)
        args = (f"model={MODEL},base_url={url}/v1/completions,tokenizer={student},tokenizer_backend=huggingface,"
                f"num_concurrent=1,max_retries=1,add_bos_token={bos},max_length=128")
        out = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["tiny_arc", "tiny_gen"],
                                      task_manager=TaskManager(include_path=str(assets / "tasks")), log_samples=True,
                                      batch_size=4)
    finally:
        proc.terminate()
        proc.wait(30)
    arc = out["results"]["tiny_arc"]
    assert arc["acc,none"] == pytest.approx(ours["acc"], abs=1e-9)
    assert arc["acc_norm,none"] == pytest.approx(ours["acc_norm"], abs=1e-9)
    theirs = [float(r[0][0]) for s in out["samples"]["tiny_arc"] for r in [s["resps"][k] for k in range(4)]]
    np.testing.assert_allclose(theirs, [s for s, _ in scores], atol=1e-3)
    gen = out["samples"]["tiny_gen"]
    assert len(gen) == ITEMS and all(isinstance(s["resps"][0][0], str) for s in gen)
    assert "exact_match,none" in out["results"]["tiny_gen"]


def test_guidellm_at_a_constant_rate_completes_every_request(assets, tmp_path):
    """guidellm (its own synthetic prompts and token counting, streaming chat requests with ignore_eos,
    max_completion_tokens and continuous usage stats) at 2 requests/s: 24 of 24 succeed, none errors, each with the
    16 output tokens it asked for, and the server holds no page afterwards."""
    import shutil

    import httpx

    guidellm = shutil.which("guidellm")
    if guidellm is None and not os.environ.get("CI"):
        pytest.skip("guidellm is not installed: pip install -e '.[test,clients]'")
    assert guidellm, "guidellm is not installed: pip install -e '.[test,clients]'"
    student = assets / "student"
    proc, url = _serve(student, [], tmp_path / "server.log")
    try:
        wait_until_healthy(proc, url, tmp_path / "server.log", timeout=240)
        report = tmp_path / "guidellm.json"
        run = subprocess.run([guidellm, "run", "--backend", f"kind=openai_http,target={url}",
                              "--profile", "kind=constant,rate=2", "--constraint", "kind=max_requests,count=24",
                              "--tokenizer", f"kind=hf_auto,model={student}",
                              "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=16",
                              "--output", f"kind=json,path={report}", "--disable-console-interactive"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    finally:
        proc.terminate()
        proc.wait(30)
    bench = json.loads(report.read_text())["benchmarks"][0]
    assert bench["metrics"]["request_totals"] == dict(successful=24, errored=0, incomplete=0, total=24)
    assert bench["metrics"]["output_token_count"]["successful"]["mean"] == 16
    free = [line for line in metrics.splitlines()
            if line.startswith(("swiftkv_kv_pages_free ", "swiftkv_kv_pages_total "))]
    assert len(free) == 2 and free[0].split()[1] == free[1].split()[1]
