"""Bad input to `infer.py generate | eval | bench | analyze | serve` fails early with an error that names the flag,
the file or the limit, and the fix. The checkpoint here has a config.json and a tokenizer but no weights: every
refusal must come before any weight is read (reading them would fail on their absence, with another message)."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import swiftkv_jax as sk
from swiftkv_jax.checkpoints.hf_config import config_to_hf
from swiftkv_jax.data import toy
from swiftkv_jax.infer_cli import _write_json, main
from swiftkv_jax.serving.http import listening_socket, start_engine
from swiftkv_jax.tiny_assets import TINY_LLAMA

REPO = Path(__file__).resolve().parents[1]
POSITIONS = 4096  # the tiny config's max_position_embeddings


@pytest.fixture(scope="module")
def weightless(tmp_path_factory):
    root = tmp_path_factory.mktemp("weightless") / "model"
    examples = toy.synthetic_chat_examples(20, 0)
    tokenizer = toy.train_chat_tokenizer([m["content"] for e in examples for m in e["messages"]], vocab_size=512)
    tokenizer.save_pretrained(root)
    config = sk.ModelConfig(vocab_size=len(tokenizer), max_position_embeddings=POSITIONS, **TINY_LLAMA)
    (root / "config.json").write_text(json.dumps(config_to_hf(config)))
    return root


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


@pytest.mark.parametrize("argv, message", [
    (("generate", "--prompt", "hi", "--batch-size", "-1"), "argument --batch-size: must be an integer >= 1, got -1"),
    (("generate", "--prompt", "hi", "--batch-size", "0"), "argument --batch-size: must be an integer >= 1, got 0"),
    (("eval", "--tasks", "gsm8k", "--batch-size", "-2"), "argument --batch-size: must be an integer >= 1, got -2"),
    (("eval", "--tasks", "gsm8k", "--batch-size", "0"), "argument --batch-size: must be an integer >= 1, got 0"),
    (("serve", "--port", "70000"), "argument --port: must be a TCP port in 0..65535 (0: any free port), got 70000"),
    (("serve", "--port", "-1"), "argument --port: must be a TCP port in 0..65535"),
    (("serve", "--max-model-len", "-5"), "argument --max-model-len: must be an integer >= 1, got -5"),
    (("bench", "--memory-bandwidth", "-5"), "argument --memory-bandwidth: must be a positive number, got -5"),
    (("bench", "--memory-bandwidth", "nan"), "argument --memory-bandwidth: must be a positive number, got nan"),
])
def test_counts_sizes_and_ports_are_refused_at_parsing(argv, message, capsys):
    """Items 4, 5, 19, 25: nothing is read, so a missing --model does not matter."""
    with pytest.raises(SystemExit) as exit_:
        main([argv[0], "--model", "/nonexistent", *argv[1:]])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_generate_refuses_more_positions_than_the_model_has(weightless, capsys):
    code, _, err = run(capsys, "generate", "--model", weightless, "--prompt", "hi", "--max-new-tokens", 5000)
    assert code == 2 and "plus --max-new-tokens 5000 needs" in err and f"the model has {POSITIONS}" in err
    assert "lower --max-new-tokens to at most" in err
    code, _, err = run(capsys, "generate", "--model", weightless, "--prompt", "hi", "--max-len", 5000)
    assert code == 2 and f"--max-len 5000 is larger than the model's max_position_embeddings ({POSITIONS}" in err


def test_serve_refuses_a_max_model_len_beyond_the_positions_or_the_pool(weightless, capsys):
    code, _, err = run(capsys, "serve", "--model", weightless, "--max-model-len", 100000)
    assert code == 2 and "--max-model-len 100000 is larger than the model's max_position_embeddings" in err
    assert f"lower --max-model-len to at most {POSITIONS}" in err
    code, _, err = run(capsys, "serve", "--model", weightless, "--max-model-len", 4000, "--num-pages", 64)
    assert code == 2 and "--max-model-len 4000 is more than the KV cache pool holds (1008 tokens)" in err
    assert "--num-pages, --kv-cache-bytes or --kv-cache-fraction" in err


def test_serve_refuses_a_served_model_name_given_twice(weightless, capsys):
    code, _, err = run(capsys, "serve", "--model", weightless, "--served-model-name", "a", "b", "a")
    assert code == 2 and "--served-model-name takes distinct names, got a b a" in err


def test_serves_pool_check_counts_the_kv_heads_tensor_parallelism_copies(weightless, capsys):
    """4 devices over 2 KV heads hold each twice (as the engine's pool will): the early check sizes the pool so,
    and refuses a max_model_len that only the uncopied heads would hold, before any weight is read."""
    from swiftkv_jax.checkpoints.hf_config import config_from_hf
    from swiftkv_jax.model.kv_quant import as_format
    from swiftkv_jax.serving.paged_cache import pages_for_budget, tokens_held

    config, budget = config_from_hf(json.loads((weightless / "config.json").read_text())), 1 << 20
    held = [tokens_held(pages_for_budget(config.replace(num_key_value_heads=k), False, 16, as_format("float32"),
                                         kv_cache_bytes=budget), 16) for k in (2, 4)]
    assert held[1] < held[0]
    code, _, err = run(capsys, "serve", "--model", weightless, "--tensor-parallel", 4, "--kv-cache-bytes", budget,
                       "--page-size", 16, "--cache-dtype", "float32", "--max-model-len", held[1] + 16)
    wanted = held[1] + 16
    assert code == 2 and f"--max-model-len {wanted} is more than the KV cache pool holds ({held[1]} tokens)" in err


def test_the_engine_and_the_server_refuse_a_max_model_len_they_cannot_serve():
    """The library's checks (a --kv-cache-fraction pool is known only once the weights are loaded): the engine refuses
    positions the model lacks; the server also a pool too small, before the warm-up (the engine alone serves it,
    refusing each request that does not fit)."""
    model = sk.init(sk.ModelConfig(vocab_size=64, max_position_embeddings=256, **TINY_LLAMA), 0)
    settings = dict(page_size=4, num_pages=8, max_num_seqs=2, max_num_batched_tokens=16, cache_dtype="float32")
    with pytest.raises(ValueError, match=r"max_model_len 512 is larger than the model's max_position_embeddings"):
        sk.Engine(model, **{**settings, "num_pages": 200}, max_model_len=512)
    with pytest.raises(ValueError, match="max_model_len must be a positive integer or None, got -5"):
        sk.Engine(model, max_model_len=-5, **settings)
    with pytest.raises(ValueError, match=r"max_model_len 64 is more than the KV cache pool holds \(28 tokens\)"):
        start_engine(model, dict(settings, max_model_len=64))


def test_an_output_that_cannot_be_written_is_refused_before_loading(weightless, capsys, tmp_path):
    """Item 9: --output naming a folder, or under a file; and a failed write leaves no temporary file."""
    folder = tmp_path / "outdir"
    folder.mkdir()
    (tmp_path / "afile").write_text("x")
    for argv in (("eval", "--tasks", "gsm8k"), ("bench", "--dry-run"), ("bench",)):
        code, _, err = run(capsys, argv[0], "--model", weightless, *argv[1:], "--output", folder)
        assert code == 2 and f"--output {folder} is a folder: give a file path" in err
    code, _, err = run(capsys, "eval", "--model", weightless, "--tasks", "gsm8k", "--output", tmp_path / "afile" / "x")
    assert code == 2 and f"{tmp_path / 'afile'} is a file, not a folder: choose another --output" in err
    with pytest.raises(IsADirectoryError):
        _write_json(str(folder), {"a": 1})
    assert sorted(os.listdir(tmp_path)) == ["afile", "outdir"] and not os.listdir(folder)


def test_every_compared_checkpoint_is_checked_before_any_evaluation(weightless, capsys, tmp_path):
    """Item 10 (and 15 for --compare): --model has no weights, so a check that came after its evaluation would
    report those instead."""
    tasks = tmp_path / "gsm.jsonl"
    tasks.write_text(json.dumps({"question": "2 + 2?", "answer": "#### 4"}) + "\n")
    code, _, err = run(capsys, "eval", "--model", weightless, "--tasks", f"gsm8k={tasks}", "--num-fewshot", 0,
                       "--compare", tmp_path / "nothere")
    assert code == 2 and f"{tmp_path / 'nothere'}: no such checkpoint directory" in err
    bad = _copy(weightless, tmp_path / "badjson")
    (bad / "config.json").write_text('{"model_type": "llama",\n}')
    code, _, err = run(capsys, "eval", "--model", weightless, "--tasks", f"gsm8k={tasks}", "--num-fewshot", 0,
                       "--compare", bad)
    assert code == 2 and str(bad / "config.json") in err and "tokenizer" not in err


def test_eval_without_num_fewshot_is_five_shot_gsm8k(weightless, capsys, tmp_path):
    """No --num-fewshot: lm-eval's 5 shots for GSM8K (gsm8k.yaml), so a pool of two questions is too small, named
    before the model is read; --num-fewshot 0 asks for none."""
    tasks = tmp_path / "gsm.jsonl"
    tasks.write_text("".join(json.dumps({"question": f"{i} + 2?", "answer": f"#### {i + 2}"}) + "\n" for i in range(2)))
    code, _, err = run(capsys, "eval", "--model", weightless, "--tasks", f"gsm8k={tasks}")
    assert code == 2 and "5 few-shot examples asked" in err and "--num-fewshot" in err


def test_a_malformed_config_is_named_as_such_not_as_the_tokenizer(weightless, capsys, tmp_path):
    """Item 15: the config is read before the tokenizer; bench --dry-run names the file."""
    bad = _copy(weightless, tmp_path / "badjson")
    (bad / "config.json").write_text('{"model_type": "llama",\n}')
    for argv in (("generate", "--prompt", "hi"), ("bench", "--dry-run"), ("serve",)):
        code, _, err = run(capsys, argv[0], "--model", bad, *argv[1:])
        assert code == 2 and f"{bad / 'config.json'}" in err and "JSON" in err and "tokenizer" not in err


def test_a_bad_prompts_file_is_named_with_its_line(weightless, capsys, tmp_path):
    """Item 18."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n\n{"prompt": "b"\n')
    code, _, err = run(capsys, "generate", "--model", weightless, "--prompts-file", prompts)
    assert code == 2 and f"--prompts-file {prompts}, line 3: not valid JSON" in err
    prompts.write_text('{"prompt": "a"}\n"just text"\n')
    code, _, err = run(capsys, "generate", "--model", weightless, "--prompts-file", prompts)
    assert code == 2 and f"--prompts-file {prompts}, line 2: needs an object with a string 'prompt' field" in err
    code, _, err = run(capsys, "generate", "--model", weightless, "--prompts-file", tmp_path)
    assert code == 2 and f"--prompts-file {tmp_path}: cannot read it (Is a directory)" in err


def test_chat_without_a_chat_template_names_the_flag_given(weightless, capsys, tmp_path):
    """Item 21: generate's flag is --chat, eval's --chat-template; eval refuses before evaluating anything."""
    plain = _copy(weightless, tmp_path / "nochat")
    (plain / "chat_template.jinja").unlink()
    code, _, err = run(capsys, "generate", "--model", plain, "--prompt", "hi", "--chat")
    assert code == 2 and err.startswith("error: --chat: the tokenizer in") and "has no chat template" in err
    tasks = tmp_path / "gsm.jsonl"
    tasks.write_text(json.dumps({"question": "2 + 2?", "answer": "#### 4"}) + "\n")
    code, _, err = run(capsys, "eval", "--model", plain, "--tasks", f"gsm8k={tasks}", "--num-fewshot", 0,
                       "--chat-template")
    assert code == 2 and "--chat-template: the tokenizer in" in err


def test_analyze_checks_out_and_names_data_before_loading(weightless, capsys, tmp_path):
    """Items 11 and 22."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "doc.txt").write_text("apple pear fig " * 20)
    code, _, err = run(capsys, "analyze", "--model", weightless, "--data", tmp_path / "doc.txt", "--out",
                       tmp_path / "afile")
    assert code == 2 and f"--out {tmp_path / 'afile'} exists and is not a folder" in err
    assert (tmp_path / "afile").read_text() == "x"
    code, _, err = run(capsys, "analyze", "--model", weightless, "--data", tmp_path / "nothere.txt", "--out",
                       tmp_path / "an")
    assert code == 2 and f"error: --data: {tmp_path / 'nothere.txt'}: no such file or folder" in err
    assert "perplexity" not in err and not (tmp_path / "an").exists()


def test_bench_refuses_random_weights_with_a_checkpoint(weightless, capsys):
    """Item 25: --random-weights is for --preset; with --model it would be silently ignored."""
    code, _, err = run(capsys, "bench", "--model", weightless, "--random-weights")
    assert code == 2 and "--random-weights" in err and "--preset NAME --random-weights" in err


def test_serve_with_its_port_taken_fails_at_once_naming_it(weightless, tmp_path):
    """Item 13: the port is bound before the engine is built; in a subprocess, as users run it."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        start = time.monotonic()
        proc = subprocess.run([sys.executable, str(REPO / "infer.py"), "serve", "--model", str(weightless), "--port",
                               str(port)], cwd=REPO, capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, JAX_PLATFORMS="cpu"))
        seconds = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"error: --port {port}: already in use on 127.0.0.1" in proc.stderr
    assert "choose another --port" in proc.stderr
    assert "Traceback" not in proc.stderr and "serving" not in proc.stderr and seconds < 60


def test_serve_with_an_address_not_of_this_machine_names_the_host(weightless, capsys):
    code, _, err = run(capsys, "serve", "--model", weightless, "--host", "999.1.1.1")
    assert code == 2 and "--host 999.1.1.1: not an address this machine resolves" in err
    code, _, err = run(capsys, "serve", "--model", weightless, "--host", "192.0.2.1")  # TEST-NET-1: never local
    assert code == 2 and "--host 192.0.2.1: not an address of this machine" in err


def test_serve_whose_port_another_process_took_while_it_started_fails_naming_it(weightless):
    """Two sockets may bind one port (SO_REUSEADDR) while neither listens: a second server loading beside ours, or
    ours beside it. The one that listens first keeps the port; the other stops with the port named (under uvloop
    it had logged "serving" and never answered). In a subprocess, bounded in time."""
    script = f"""
import sys
from transformers import AutoTokenizer
import swiftkv_jax as sk
from swiftkv_jax.serving.http import listening_socket, serve
from swiftkv_jax.tiny_assets import TINY_LLAMA
tokenizer = AutoTokenizer.from_pretrained({str(weightless)!r})
model = sk.init(sk.ModelConfig(vocab_size=len(tokenizer), max_position_embeddings=256, **TINY_LLAMA), 0)
settings = dict(page_size=4, num_pages=16, max_num_seqs=2, max_num_batched_tokens=16, cache_dtype="float32",
                single_buckets=(2,), prompt_buckets=(16,))
with listening_socket("127.0.0.1", 0) as ours, listening_socket("127.0.0.1", ours.getsockname()[1]) as theirs:
    theirs.listen()
    print("port", ours.getsockname()[1], flush=True)
    try:
        serve(model, tokenizer, "tiny", engine_options=settings, sock=ours)
    except ValueError as e:
        print("refused:", e)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    port = int(proc.stdout.split()[1])
    assert (f"refused: --port {port}: another process began listening on 127.0.0.1:{port} while this server was "
            f"starting") in proc.stdout and "choose another --port" in proc.stdout
    assert "serving tiny" not in proc.stderr


def test_port_zero_binds_a_free_port():
    """Item 5: port 0 is accepted because the server binds it itself and logs the port it got."""
    with listening_socket("127.0.0.1", 0) as sock:
        assert sock.getsockname()[1] > 0


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_serves_pool_check_sizes_an_auto_cache_in_the_dtype_the_weights_load_in(weightless, capsys, tmp_path):
    """--cache-dtype auto (the default) is the model's compute dtype: the early pool check sizes the pages at the
    dtype the weights will load in, config.json's or --dtype's (a bf16 checkpoint's pool holds twice the tokens of
    an fp32 one's), before any weight is read."""
    from swiftkv_jax.checkpoints.hf_config import config_from_hf
    from swiftkv_jax.model.kv_quant import as_format
    from swiftkv_jax.serving.paged_cache import pages_for_budget, tokens_held

    hf, budget = json.loads((weightless / "config.json").read_text()), 1 << 19
    bf16 = tmp_path / "bf16"
    shutil.copytree(weightless, bf16)
    hf = {k: v for k, v in hf.items() if k not in ("dtype", "torch_dtype")}
    (bf16 / "config.json").write_text(json.dumps({**hf, "torch_dtype": "bfloat16"}))
    held = {dtype: tokens_held(pages_for_budget(config_from_hf(hf), False, 16, as_format(dtype),
                                                kv_cache_bytes=budget), 16) for dtype in ("float32", "bfloat16")}
    assert held["bfloat16"] < POSITIONS
    for model, flags, dtype in ((weightless, (), "float32"), (bf16, (), "bfloat16"),
                                (bf16, ("--dtype", "fp32"), "float32")):
        code, _, err = run(capsys, "serve", "--model", model, *flags, "--kv-cache-bytes", budget, "--page-size", 16,
                           "--max-model-len", POSITIONS)
        assert code == 2 and f"pool holds ({held[dtype]} tokens)" in err, (model, flags, err)


@pytest.mark.parametrize("argv, message", [
    (("generate", "--prompt", "hi", "--seed", str(2**63)), "argument --seed: must be an integer in [0, 2**31)"),
    (("generate", "--prompt", "hi", "--seed", "-1"), "argument --seed: must be an integer in [0, 2**31), got -1"),
    (("bench", "--seed", str(2**31)), "argument --seed: must be an integer in [0, 2**31)"),
    (("generate", "--prompt", "hi", "--min-p", "1.5"), "argument --min-p: must be a number in [0, 1], got 1.5"),
])
def test_seeds_and_min_p_are_refused_at_parsing(argv, message, capsys):
    """A seed past 64 bits failed inside jax.random once the model had loaded; the CLI's seeds take the server's
    range. --min-p 0 (its default, "off") is taken."""
    with pytest.raises(SystemExit) as exit_:
        main([argv[0], "--model", "/nonexistent", *argv[1:]])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    from swiftkv_jax.infer_cli import parser

    args = parser().parse_args(["generate", "--model", "m", "--prompt", "hi", "--min-p", "0", "--seed", str(2**31 - 1)])
    assert args.min_p == 0 and args.seed == 2**31 - 1


def test_stop_ids_outside_the_vocabulary_are_named_with_their_file(weightless, capsys, tmp_path):
    """generation_config.json's EOS ids are every request's stop ids: one past the vocabulary made the server refuse
    every request (blaming the client's stop_token_ids); refused at start, naming the file, before any weight."""
    bad = _copy(weightless, tmp_path / "gc")
    (bad / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 99999]}))
    vocab = json.loads((bad / "config.json").read_text())["vocab_size"]
    for argv in (("generate", "--prompt", "hi"), ("serve",)):
        code, _, err = run(capsys, argv[0], "--model", bad, *argv[1:])
        assert code == 2 and f"{bad / 'generation_config.json'}: eos_token_id 99999 lies outside the model's " \
                             f"vocabulary [0, {vocab}): fix it or remove it" in err, err


def test_a_tokenizer_larger_than_the_vocabulary(weightless, capsys, tmp_path):
    """--tokenizer with more tokens than the model's vocabulary (another model's) is refused at start, naming both;
    a checkpoint's own such tokenizer is only warned of (a prompt without its extra tokens serves)."""
    from transformers import AutoTokenizer

    big = tmp_path / "bigtok"
    tokenizer = AutoTokenizer.from_pretrained(weightless)
    tokenizer.add_tokens(["<|big|>"])
    tokenizer.save_pretrained(big)
    code, _, err = run(capsys, "generate", "--model", weightless, "--tokenizer", big, "--prompt", "hi")
    vocab = len(tokenizer) - 1
    assert code == 2 and f"--tokenizer {big}: the tokenizer in {big} has {vocab + 1} tokens, more than the model's " \
                         f"vocabulary ({vocab}, config.json): pass the model's own tokenizer" in err
    own = _copy(weightless, tmp_path / "own")
    tokenizer.save_pretrained(own)
    code, _, err = run(capsys, "generate", "--model", own, "--prompt", "hi", "--max-new-tokens", 5000)
    assert code == 2 and f"warning: the tokenizer in {own} has {vocab + 1} tokens" in err
    assert "plus --max-new-tokens 5000 needs" in err  # went on past the warning


def test_eval_refuses_lengths_the_model_cannot_hold_before_loading(weightless, capsys, tmp_path):
    tasks = tmp_path / "gsm.jsonl"
    tasks.write_text(json.dumps({"question": "2 + 2?", "answer": "#### 4"}) + "\n")
    code, _, err = run(capsys, "eval", "--model", weightless, "--tasks", f"gsm8k={tasks}", "--num-fewshot", 0,
                       "--max-length", 8192)
    assert code == 2 and f"--max-length 8192 is larger than the max_position_embeddings of {weightless} " \
                         f"({POSITIONS}, config.json): lower --max-length to at most {POSITIONS}" in err
    code, _, err = run(capsys, "eval", "--model", weightless, "--tasks", f"gsm8k={tasks}", "--num-fewshot", 0,
                       "--max-new-tokens", 5000)
    assert code == 2 and "--max-new-tokens 5000 leaves no room for a prompt in --max-length 2048" in err


def test_bench_refuses_lengths_by_their_flags(weightless, capsys):
    code, _, err = run(capsys, "bench", "--model", weightless, "--prompt-len", 8000)
    assert code == 2 and f"--prompt-len 8000 plus --gen-len 128 needs 8128 positions, but the model has {POSITIONS}" \
                         in err
    code, _, err = run(capsys, "bench", "--model", weightless, "--prompt-len", 64, "--prefill-chunk", 48)
    assert code == 2 and "--prefill-chunk 48 must divide --prompt-len 64" in err


def test_config_errors_name_the_file_and_the_flag_that_overrides(weightless, capsys, tmp_path):
    hf = json.loads((weightless / "config.json").read_text())
    bad = _copy(weightless, tmp_path / "int8")
    (bad / "config.json").write_text(json.dumps({**hf, "torch_dtype": "int8", "dtype": "int8"}))
    code, _, err = run(capsys, "generate", "--model", bad, "--prompt", "hi")
    assert code == 2 and f"{bad / 'config.json'}: " in err and "int8" in err and "or give --dtype" in err
    (bad / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": "4"}))
    code, _, err = run(capsys, "serve", "--model", bad)
    assert code == 2 and f"{bad / 'config.json'}: num_hidden_layers must be a positive int, got '4'" in err


def test_analyze_swiftkv_on_a_teacher_names_the_flag(weightless, capsys, tmp_path):
    (tmp_path / "doc.txt").write_text("apple pear fig " * 20)
    code, _, err = run(capsys, "analyze", "--model", weightless, "--data", tmp_path / "doc.txt", "--swiftkv")
    assert code == 2 and f"--swiftkv: {weightless} is not a SwiftKV model" in err and "drop --swiftkv" in err


def test_serves_pool_errors_name_the_flags(weightless, capsys):
    code, _, err = run(capsys, "serve", "--model", weightless, "--kv-cache-bytes", 100)
    assert code == 2 and "at least 2 pages" in err and "--num-pages or --kv-cache-bytes, and --page-size" in err


def test_a_run_folder_points_at_its_models(tmp_path, capsys):
    """--model at a train.py run's folder (or a training state in it) says where the run's models are."""
    run_dir = tmp_path / "run"
    (run_dir / "student_hf").mkdir(parents=True)
    (run_dir / "student_hf" / "config.json").write_text("{}")
    (run_dir / "checkpoints" / "57" / "state").mkdir(parents=True)
    (run_dir / "checkpoints" / "57" / "meta").mkdir()
    code, _, err = run(capsys, "generate", "--model", run_dir, "--prompt", "hi")
    assert code == 2 and f"the checkpoints in it: {run_dir / 'student_hf'}" in err
    code, _, err = run(capsys, "generate", "--model", run_dir / "checkpoints" / "57", "--prompt", "hi")
    assert code == 2 and "a train.py training state" in err and "student_hf or student_orbax" in err


def test_a_json_prompts_file_is_a_list_of_prompts(tmp_path):
    from swiftkv_jax.infer_cli import _read_prompts

    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["a", {"prompt": "b\nc"}]))
    assert _read_prompts(str(prompts)) == ["a", "b\nc"]
    prompts.write_text(json.dumps({"prompt": "a"}))
    with pytest.raises(ValueError, match="a .json file holds a list of prompts, got a JSON dict"):
        _read_prompts(str(prompts))
    prompts.write_text(json.dumps(["a", {"text": "b"}]))
    with pytest.raises(ValueError, match="item 1: needs a string, or an object with a string 'prompt'"):
        _read_prompts(str(prompts))
