"""`python infer.py generate | eval | bench | analyze | serve`: serve, evaluate, time and inspect a checkpoint.

The logic lives in swiftkv_jax.serving and swiftkv_jax.evaluation; this file parses and prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import functools
import json
import math
import os
import socket
import sys
from typing import Optional

from swiftkv_jax.cli_help import DefaultsFormatter as _DefaultsFormatter

TASKS_HELP = ("tasks as NAME or NAME=SOURCE (local json/jsonl/parquet/txt, a folder or glob, or a hub name "
              "owner/name[:config][@split]); NAME is one of arc_easy, arc_challenge, hellaswag, winogrande, mmlu, "
              "gsm8k, perplexity (perplexity needs a SOURCE)")


def _bounded(convert, test, what: str):
    """An argparse type: `convert` the text, then refuse a value that fails `test`, saying what the flag takes
    (argparse names the flag: "argument --batch-size: must be an integer >= 1, got -1")."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    return parse


# The shared argparse types: a bad count or size fails at parsing, before anything is loaded.
positive_int = _bounded(int, lambda v: v >= 1, "an integer >= 1")
non_negative_int = _bounded(int, lambda v: v >= 0, "an integer >= 0")
positive_float = _bounded(float, lambda v: 0 < v < math.inf, "a positive number")
non_negative_float = _bounded(float, lambda v: 0 <= v < math.inf, "a number >= 0")
fraction = _bounded(float, lambda v: 0 < v <= 1, "a fraction in (0, 1]")
unit_interval = _bounded(float, lambda v: 0 <= v <= 1, "a number in [0, 1]")
seed_number = _bounded(int, lambda v: 0 <= v < 2**31, "an integer in [0, 2**31)")  # as the server's requests (SEEDS)
port = _bounded(int, lambda v: 0 <= v <= 65535, "a TCP port in 0..65535 (0: any free port)")


def _model_options(p: argparse.ArgumentParser, teacher_mode: bool = True) -> None:
    p.add_argument("--dtype", default=None, help="parameter and compute dtype: bf16 | fp32 | fp16 (default: the "
                                                 "checkpoint's, as config.json declares it)")
    if teacher_mode:
        p.add_argument("--teacher-mode", action="store_true",
                       help="serve a SwiftKV model in its teacher wiring (every layer for every token, full KV cache)")
    p.add_argument("--cache-dtype", default="auto",
                   help="KV-cache dtype: auto (default: the model's compute dtype, --dtype's; as vLLM), bfloat16, "
                        "float32, float16, or quantised float8_e4m3fn (fp8) / int8")
    p.add_argument("--kv-scales", default=None, help="scales of a quantised KV cache: per-token-head (default) or "
                                                       "per-layer (a static scale of 1.0: fp8 only, int8 is refused)")
    p.add_argument("--attention-impl", choices=("xla_flash", "xla", "pallas", "mosaic", "cudnn"), default=None,
                   help="prefill attention (default: the checkpoint's off a GPU, xla_flash; on one, the measured "
                        "fastest, see swiftkv_jax.serving.kernel_choice)")
    p.add_argument("--decode-attention-impl", choices=("xla", "pallas", "mosaic"), default=None,
                   help="few-query attention over the cache (decode; SwiftKV's later layers in prefill); mosaic: "
                        "the Mosaic GPU (Hopper) kernel, bf16/fp16 caches")
    p.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="N",
                   help="split the model over N devices (heads, MLP columns, vocabulary; the KV cache by KV heads); "
                        "the weights load straight onto them")


def _compilation_cache_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compilation-cache", metavar="DIR|off", default=None,
                   help="JAX's persistent compilation cache: a restart loads the compiled programs instead of "
                        "compiling them (default: $SWIFTKV_JAX_COMPILATION_CACHE, else $JAX_COMPILATION_CACHE_DIR, "
                        "else $XDG_CACHE_HOME/swiftkv-jax/xla or ~/.cache/swiftkv-jax/xla; off: none)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python infer.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    command = functools.partial(sub.add_parser, formatter_class=_DefaultsFormatter)  # each option says its default

    g = command("generate", help="generate text for one prompt (streamed) or a file of prompts")
    g.add_argument("--model", required=True, help="checkpoint directory (HF or Orbax) with its tokenizer")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt; its tokens are streamed as they are generated")
    src.add_argument("--prompts-file", help="a text file with one prompt per line, .jsonl with a 'prompt' field a "
                                            "line, or .json: a list of prompts (strings or objects with a 'prompt')")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of the chat template")
    g.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens generated a prompt, at most")
    g.add_argument("--temperature", type=non_negative_float, default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=non_negative_int, default=0, help="0: off")
    g.add_argument("--top-p", type=fraction, default=1.0, help="1: off")
    g.add_argument("--min-p", type=unit_interval, default=0.0,
                   help="0: off; drops tokens less likely than min_p x the most likely one (after the temperature)")
    g.add_argument("--seed", type=seed_number, default=0, help="sampling (with --temperature > 0)")
    g.add_argument("--batch-size", type=positive_int, default=16, help="prompts per batch (--prompts-file)")
    g.add_argument("--max-len", type=positive_int, default=None,
                   help="KV-cache length (default: prompt + max-new-tokens, at least the prompt's padded bucket, "
                        "a power of two >= 16)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    _model_options(g)
    _compilation_cache_option(g)

    e = command("eval", help="accuracy / perplexity on benchmark tasks, optionally against a second model")
    e.add_argument("--model", required=True, help="checkpoint directory (HF or Orbax) with its tokenizer")
    e.add_argument("--tasks", required=True, nargs="+", help=TASKS_HELP)
    e.add_argument("--compare", metavar="DIR2", help="a second checkpoint (e.g. the teacher) evaluated in the same run")
    e.add_argument("--num-fewshot", type=non_negative_int, default=None,
                   help="examples before each question (default: lm-eval's for the task, 5 for gsm8k and 0 for the "
                        "others; not perplexity)")
    e.add_argument("--limit", type=positive_int, default=None, help="first N examples of each task")
    e.add_argument("--chat-template", action="store_true", help="each context as a user turn of the chat template")
    e.add_argument("--batch-size", type=positive_int, default=32, help="requests scored at once")
    e.add_argument("--max-length", type=positive_int, default=2048, help="context + answer tokens (perplexity: window)")
    e.add_argument("--max-new-tokens", type=positive_int, default=256, help="generation tasks (gsm8k)")
    e.add_argument("--seed", type=seed_number, default=1234, help="few-shot sampling")
    e.add_argument("--output", help="write the results as JSON here")
    e.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    _model_options(e)
    _compilation_cache_option(e)

    b = command("bench", help="TTFT, TPOT, tokens/s and KV-cache bytes: SwiftKV vs its teacher wiring")
    which = b.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="checkpoint directory (HF or Orbax)")
    which.add_argument("--preset",
                       help="a named model shape (see swiftkv_jax.serving.bench.PRESETS); needs --random-weights")
    b.add_argument("--random-weights", action="store_true",
                   help="random weights for --preset (no checkpoint; not with --model)")
    b.add_argument("--prompt-len", type=positive_int, default=2048, help="tokens of each random prompt")
    b.add_argument("--gen-len", type=non_negative_int, default=128, help="0: time the prefill only")
    b.add_argument("--batch", type=positive_int, default=1, help="prompts at once")
    b.add_argument("--repeats", type=positive_int, default=3, help="timed runs of each wiring")
    b.add_argument("--prefill-chunk", type=positive_int, default=None,
                   help="chunked prefill (must divide --prompt-len)")
    b.add_argument("--memory-bandwidth", type=positive_float, default=None,
                   help="device memory bandwidth in bytes/s (H200: 4.8e12) for the TPOT roofline (none with "
                        "--gen-len 0)")
    b.add_argument("--seed", type=seed_number, default=0, help="random prompts (and --random-weights)")
    b.add_argument("--output", help="write the results as JSON here")
    b.add_argument("--dry-run", action="store_true",
                   help="print the bytes per device of the weights and the KV cache for --tensor-parallel 1, 2, 4, 8 "
                        "(and the one given) without allocating anything; no timing")
    _model_options(b, teacher_mode=False)  # bench always measures both wirings

    a = command("analyze", help="cosine similarity of the hidden states between layers, on held-out text")
    a.add_argument("--model", required=True, help="checkpoint directory (HF or Orbax) with its tokenizer")
    a.add_argument("--data", required=True,
                   help="text: .txt files (a file, folder or glob) or json/jsonl/parquet with 'text'")
    a.add_argument("--max-tokens", type=positive_int, default=8192, help="tokens analysed in all")
    a.add_argument("--max-length", type=positive_int, default=512, help="window length")
    a.add_argument("--batch-size", type=positive_int, default=8, help="windows at once")
    a.add_argument("--swiftkv", action="store_true",
                   help="analyse a SwiftKV model's own wiring (default: the teacher's)")
    a.add_argument("--out", default=None, help="output folder (default ./analysis/<model name>)")
    a.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    a.add_argument("--dtype", default=None,
                   help="parameter and compute dtype (default: the checkpoint's, as config.json declares it)")

    s = command("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions) on "
                                     "the continuous-batching engine")
    s.add_argument("--model", required=True, help="checkpoint directory (HF or Orbax) with its tokenizer")
    s.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=port, default=8000, help="TCP port (0: any free one, logged)")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the `model` clients name (default: the directory's name); several (vLLM's): a request may "
                        "name any, the first is the default and /metrics' model_name")
    # None: sk.EngineConfig's defaults, sized for one 80 GB GPU (vLLM's on an H100); a small CPU wants fewer
    s.add_argument("--max-num-seqs", type=positive_int, default=None, help="sequences running at once (default 256)")
    s.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="a step's budget (see --budget-unit; default 8192)")
    s.add_argument("--budget-unit", choices=("tokens", "cost"), default="tokens",
                   help="cost: a SwiftKV prompt token counts about l/L of a full-depth token")
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV pages of prompt prefixes already computed (vLLM's automatic prefix caching)")
    s.add_argument("--max-prompt-seqs", type=positive_int, default=None,
                   help="prompts packed into one step, at most (default 8)")
    pool = s.add_mutually_exclusive_group()
    pool.add_argument("--kv-cache-bytes", type=positive_float, default=None,
                      help="KV-cache pool size in bytes (default: 90%% of the free device memory on a GPU, 1 GiB on a "
                           "CPU)")
    pool.add_argument("--kv-cache-fraction", type=fraction, default=None,
                      help="pool size as a fraction of free memory")
    pool.add_argument("--num-pages", type=positive_int, default=None, help="pool size in pages")
    s.add_argument("--page-size", type=positive_int, default=16, help="tokens per KV-cache page")
    s.add_argument("--max-model-len", type=positive_int, default=None,
                   help="longest prompt + completion (default: what the model and the pool hold; at most both)")
    s.add_argument("--single-buckets", default=None, help="comma-separated single-token step sizes to compile "
                                                         "(default: powers of 2 up to --max-num-seqs)")
    s.add_argument("--prompt-buckets", default=None, help="comma-separated prompt-token step sizes to compile "
                                                         "(default: doubling from budget/64, at least 32, up to the "
                                                         "step's prompt-token budget)")
    s.add_argument("--max-waiting", type=non_negative_int, default=256,
                   help="requests admitted beyond --max-num-seqs (queued); more get 503 with Retry-After")
    s.add_argument("--max-request-bytes", type=positive_int, default=None,
                   help="longest request body read; a longer one gets 413 (default: 64 MiB)")
    s.add_argument("--shutdown-grace", type=non_negative_float, default=10.0,
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT before they are aborted")
    s.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults of requests that omit temperature, top_p, top_k, repetition_penalty, "
                        "min_p, and a cap on every request's max_tokens (max_new_tokens): auto, "
                        "the model folder's generation_config.json; vllm, none (temperature 1, top_p 1, top_k off); "
                        "DIR, that folder's generation_config.json (vLLM's flag; EOS ids always come from the model "
                        "folder's) (default: auto)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="every request but /health, /metrics and /version needs `Authorization: Bearer KEY` "
                        "(default: $SWIFTKV_API_KEY, else $VLLM_API_KEY, else none: open to all)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="chat requests with tools (tool_choice auto, their default) get the model's tool calls back "
                        "as message.tool_calls, found by --tool-call-parser (vLLM's flags)")
    s.add_argument("--tool-call-parser", choices=("llama3_json", "hermes"), default=None,
                   help="how the model writes tool calls: llama3_json (Llama 3.1/3.2: JSON objects, `;`-separated), "
                        "hermes (Qwen2.5: <tool_call>{json}</tool_call>); needs --enable-auto-tool-choice")
    _model_options(s)
    _compilation_cache_option(s)
    return p


def _cache_format(args):
    """The KV cache format of --cache-dtype and --kv-scales (a bad pair raises, naming the choices); `auto` as is,
    which the library resolves to each model's compute dtype (eval's --compare model may have another)."""
    from swiftkv_jax.model.kv_quant import as_format, check_format, is_auto

    check_format(args.cache_dtype, args.kv_scales)
    return args.cache_dtype if is_auto(args.cache_dtype) else as_format(args.cache_dtype, args.kv_scales)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from swiftkv_jax.checkpoints import CheckpointError

    try:
        _check_settings(args)
        if hasattr(args, "compilation_cache"):  # before anything is compiled
            from swiftkv_jax.serving.compile_cache import enable_compilation_cache

            enable_compilation_cache(args.compilation_cache)
        return {"generate": _generate, "eval": _eval, "bench": _bench, "analyze": _analyze,
                "serve": _serve}[args.command](args)
    except (ValueError, CheckpointError, FileNotFoundError) as e:  # DataError and TaskError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2


def _check_settings(args) -> None:
    """--dtype, --cache-dtype and --kv-scales, checked before anything is read (the minutes of reading weights); a bad
    one is named by its flag (the library's messages name its own parameters, not the command line's)."""
    from swiftkv_jax.dtypes import dtype_name

    if getattr(args, "dtype", None) is not None:
        try:
            dtype_name(args.dtype)
        except ValueError as e:
            raise ValueError(f"--dtype {args.dtype}: {e}") from None
    if getattr(args, "cache_dtype", None) is None:
        return
    from swiftkv_jax.model.kv_quant import check_format

    try:
        check_format(args.cache_dtype)
    except ValueError as e:
        raise ValueError(f"--cache-dtype {args.cache_dtype}: {e}") from None
    try:
        check_format(args.cache_dtype, args.kv_scales)
    except ValueError as e:
        raise ValueError(f"--kv-scales {args.kv_scales} (with --cache-dtype {args.cache_dtype}): {e}") from None


def _mesh(args):
    """The serving mesh of --tensor-parallel (None for one device); a size larger than the devices raises here,
    before anything is read."""
    if args.tensor_parallel == 1:
        return None
    from swiftkv_jax.serving.tensor_parallel import serving_mesh

    return serving_mesh(args.tensor_parallel)


def _load_model(path: str, args, mesh=None):
    import swiftkv_jax as sk
    from swiftkv_jax.serving.tensor_parallel import load_sharded

    model = sk.load(path, args.dtype) if mesh is None else load_sharded(path, args.dtype, mesh=mesh)
    changes = {"attention_impl": args.attention_impl, "decode_attention_impl": args.decode_attention_impl}
    changes = {k: v for k, v in changes.items() if v is not None}
    eos = _generation_eos(path, model.config)
    if eos != model.config.eos_token_id:
        changes["eos_token_id"] = eos
    return sk.Model(model.config.replace(**changes), model.params) if changes else model


def _generation_config(path: str) -> tuple[dict, str]:
    """(the folder's generation_config.json as a dict, {} without one (an orbax checkpoint, a converted folder may
    have none); the file's path). A file that is not a JSON object raises, as transformers refuses such a checkpoint."""
    file = os.path.join(os.path.expanduser(path), "generation_config.json")
    if not os.path.isfile(file):
        return {}, file
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except ValueError as e:
        config = e
    if not isinstance(config, dict):
        what = config if isinstance(config, ValueError) else f"a JSON {type(config).__name__}"
        raise ValueError(f"{file} is not a JSON object ({what}): fix or delete it (it holds stop ids and sampling "
                         f"defaults)")
    return config, file


def _generation_eos(path: str, config):
    """config.json's EOS ids and generation_config.json's after them, which generate, eval and serve stop at: as
    transformers' generate and vLLM do. Llama-3-Instruct and Qwen2.5-Instruct name only <|eot_id|> / <|im_end|> in
    config.json, <|end_of_text|> / <|endoftext|> too in generation_config.json, and do end answers with them. An id
    outside the vocabulary is refused here, naming its file: it would fail every request that stops at it."""
    eos, vocab = config.eos_token_id, config.vocab_size
    more, file = _generation_config(path)
    more = more.get("eos_token_id")
    more = more if isinstance(more, list) else [more]
    extra = [t for t in more if isinstance(t, int) and not isinstance(t, bool) and t not in (eos or ())]
    bad = [t for t in extra if not 0 <= t < vocab]  # config.json's own: ModelConfig refuses them
    if bad:
        raise ValueError(f"{file}: eos_token_id {bad[0]} lies outside the model's vocabulary [0, {vocab}): fix it or "
                         f"remove it")
    return tuple(eos or ()) + tuple(dict.fromkeys(extra)) if extra else eos


def _named_impls(args) -> dict:
    """--attention-impl / --decode-attention-impl for the engines: on a GPU they serve their measured defaults
    (`kernel_choice`) unless the caller names the impls, whatever the model's config says."""
    return dict(attention_impl=args.attention_impl, decode_attention_impl=args.decode_attention_impl)


def _model_config(args, path: Optional[str] = None):
    """The checkpoint's ModelConfig from its config.json alone, before its tokenizer or any weight is read: a missing
    directory, then a malformed config, are named as such, not as a tokenizer that does not load."""
    from swiftkv_jax.checkpoints import detect_format
    from swiftkv_jax.checkpoints.hf import read_config
    from swiftkv_jax.checkpoints.hf_config import config_from_hf, stored_dtype

    path = path or args.model
    detect_format(path)
    hf = read_config(path)
    try:
        config = config_from_hf(hf)
        if getattr(args, "dtype", None) is None:
            stored_dtype(hf)
    except ValueError as e:  # the file named, and the flag that overrides its dtype
        fix = "; or give --dtype" if getattr(args, "dtype", None) is None and "dtype" in str(e) else ""
        raise ValueError(f"{os.path.join(path, 'config.json')}: {e}{fix}") from None
    _generation_eos(path, config)  # its stop ids checked before any weight is read
    if getattr(args, "teacher_mode", False) and not config.is_swiftkv:
        raise ValueError(f"--teacher-mode: {path} is not a SwiftKV model (it is already served as its own teacher)")
    return config


def _tokenizer(args, path: Optional[str] = None, chat_flag: Optional[str] = None, config=None):
    """The tokenizer of --tokenizer or the checkpoint; with `chat_flag` (the flag that asks for the chat template) one
    without a chat template is refused here, naming that flag. With the model's `config`, a --tokenizer with more
    tokens than the model's vocabulary is refused (another model's: its ids past the vocabulary have no embedding);
    a checkpoint's own such tokenizer is served with a warning (its extra tokens fail only the prompts that hold
    them)."""
    from swiftkv_jax.data import DataError
    from swiftkv_jax.data.chat import load_tokenizer

    where = args.tokenizer or path or args.model
    try:
        tokenizer = load_tokenizer(where)
    except DataError as e:
        raise DataError(f"{e}; or pass --tokenizer DIR") from e
    if config is not None and len(tokenizer) > config.vocab_size:
        mismatch = (f"the tokenizer in {where} has {len(tokenizer)} tokens, more than the model's vocabulary "
                    f"({config.vocab_size}, config.json)")
        if args.tokenizer:
            raise ValueError(f"--tokenizer {args.tokenizer}: {mismatch}: pass the model's own tokenizer")
        print(f"warning: {mismatch}: a prompt holding one of its last {len(tokenizer) - config.vocab_size} tokens "
              f"will be refused", file=sys.stderr)
    if chat_flag and not tokenizer.chat_template:
        raise ValueError(f"{chat_flag}: the tokenizer in {where} has no chat template: drop {chat_flag}, or pass "
                         f"--tokenizer DIR with one")
    return tokenizer


def _read_prompts(path: str) -> list[str]:
    """One prompt a line of a text file, the 'prompt' field of each line of a .jsonl file, or a .json file's list of
    prompts (strings or objects with a 'prompt'); a file that cannot be read, or a bad line, is named with its line
    number."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ValueError(f"--prompts-file {path}: cannot read it ({reason})") from None
    if path.endswith(".json"):
        return _json_prompts(path, text)
    lines = [(n, line) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    if not path.endswith(".jsonl"):
        return [line for _, line in lines]
    prompts = []
    for n, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--prompts-file {path}, line {n}: not valid JSON ({e.msg}, column {e.colno}); a .jsonl "
                             f"file holds one JSON object a line, e.g. {{\"prompt\": \"...\"}}") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"--prompts-file {path}, line {n}: needs an object with a string 'prompt' field, e.g. "
                             f"{{\"prompt\": \"...\"}}")
        prompts.append(row["prompt"])
    return prompts


def _json_prompts(path: str, text: str) -> list[str]:
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--prompts-file {path}: not valid JSON ({e.msg}, line {e.lineno}, column {e.colno}); a "
                         f".json file holds one list of prompts, e.g. [\"...\", {{\"prompt\": \"...\"}}]") from None
    if not isinstance(rows, list):
        raise ValueError(f"--prompts-file {path}: a .json file holds a list of prompts, got a JSON "
                         f"{type(rows).__name__}")
    prompts = [row.get("prompt") if isinstance(row, dict) else row for row in rows]
    bad = next((i for i, prompt in enumerate(prompts) if not isinstance(prompt, str)), None)
    if bad is not None:
        raise ValueError(f"--prompts-file {path}, item {bad}: needs a string, or an object with a string 'prompt' "
                         f"field, e.g. {{\"prompt\": \"...\"}}")
    return prompts


def _check_length(args, config, ids: list) -> None:
    """Prompt + --max-new-tokens within the model's positions (beyond them RoPE gives degenerate text), as vLLM."""
    limit, longest = config.max_position_embeddings, max(map(len, ids))
    if args.max_len is not None and args.max_len > limit:
        raise ValueError(f"--max-len {args.max_len} is larger than the model's max_position_embeddings ({limit}, "
                         f"config.json): lower --max-len to at most {limit}")
    if args.max_len is not None and longest + args.max_new_tokens > args.max_len:
        raise ValueError(f"a prompt of {longest} tokens plus --max-new-tokens {args.max_new_tokens} needs "
                         f"{longest + args.max_new_tokens} cache entries, but --max-len is {args.max_len}: raise "
                         f"--max-len to at least {longest + args.max_new_tokens}, lower --max-new-tokens or shorten "
                         f"the prompt")
    if longest + args.max_new_tokens > limit:
        fix = (f"lower --max-new-tokens to at most {limit - longest}" if longest < limit else
               f"shorten the prompt to fewer than {limit} tokens")
        raise ValueError(f"a prompt of {longest} tokens plus --max-new-tokens {args.max_new_tokens} needs "
                         f"{longest + args.max_new_tokens} positions, but the model has {limit} "
                         f"(max_position_embeddings): {fix}")


def _generate(args) -> int:
    from swiftkv_jax.evaluation.harness import render_context
    from swiftkv_jax.serving import generate

    prompts = [args.prompt] if args.prompt is not None else _read_prompts(args.prompts_file)
    if not prompts:
        raise ValueError(f"--prompts-file {args.prompts_file}: no prompts")
    config = _model_config(args)
    tokenizer = _tokenizer(args, chat_flag="--chat" if args.chat else None, config=config)
    ids = [render_context(tokenizer, p, args.chat) for p in prompts]
    _check_length(args, config, ids)
    mesh = _mesh(args)
    model = _load_model(args.model, args, mesh)
    stops = sorted(set(model.config.eos_token_id or ()) | ({tokenizer.eos_token_id} - {None}))
    options = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                   stop_token_ids=stops, swiftkv=False if args.teacher_mode else None, cache_dtype=_cache_format(args),
                   max_len=args.max_len, tokenizer=tokenizer, mesh=mesh, **_named_impls(args))
    if len(ids) == 1:
        stream = _Stream(tokenizer, ids[0])
        generate(model, ids, args.max_new_tokens, on_token=stream, **options)
        stream.finish()
        return 0
    for start in range(0, len(ids), args.batch_size):
        out = generate(model, ids[start: start + args.batch_size], args.max_new_tokens, **options)
        for i, text in enumerate(out.texts, start):
            print(f"=== {i}: {prompts[i]}\n{text}\n", flush=True)
    return 0


class _Stream:
    """Prints each new token's text as it arrives, through the server's incremental detokenizer: a token costs the
    same however long the output (decoding everything so far at each token was quadratic in its length), and a
    character split over tokens prints once complete."""

    def __init__(self, tokenizer, prompt_ids):
        from swiftkv_jax.serving.http.text import Detokenizer

        self.text = Detokenizer(tokenizer, prompt_ids)

    def __call__(self, tokens, live):
        if live[0]:
            self._write(self.text.push([int(tokens[0])]))

    def finish(self) -> None:
        self._write(self.text.flush() + "\n")

    @staticmethod
    def _write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()


def _eval(args) -> int:
    from tqdm import tqdm

    from swiftkv_jax.evaluation.harness import EvalOptions, evaluate, units
    from swiftkv_jax.evaluation.report import check_output_file, comparison_table, model_label, results_json
    from swiftkv_jax.evaluation.tasks import load_task, parse_task_spec

    if args.output:
        check_output_file(args.output, "--output")
    # tasks first: a bad task name or file fails before a large checkpoint is read
    shots = lambda spec: 0 if parse_task_spec(spec)[0] == "perplexity" else args.num_fewshot  # no shots in a text
    repeated = sorted({spec for spec in args.tasks if args.tasks.count(spec) > 1})
    if repeated:
        raise ValueError(f"--tasks gives {', '.join(repeated)} more than once: give each task once")
    tasks = [load_task(spec, num_fewshot=shots(spec), limit=args.limit, seed=args.seed) for spec in args.tasks]
    if any(t.kind == "generation" for t in tasks) and args.max_new_tokens >= args.max_length:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in --max-length "
                         f"{args.max_length}: lower --max-new-tokens or raise --max-length")
    names = [t.name for t in tasks]  # two of one name (perplexity of two files, two MMLU subjects): told by spec
    tasks = [dataclasses.replace(t, label=spec) if names.count(t.name) > 1 else t for t, spec in zip(tasks, args.tasks)]
    options = EvalOptions(batch_size=args.batch_size, max_length=args.max_length, max_new_tokens=args.max_new_tokens,
                          chat_template=args.chat_template, swiftkv=False if args.teacher_mode else None,
                          cache_dtype=_cache_format(args), mesh=_mesh(args), **_named_impls(args))
    paths = [args.model] + ([args.compare] if args.compare else [])
    # every checkpoint's config and tokenizer before any evaluation: a bad --compare must not cost --model's results
    chat_flag = "--chat-template" if args.chat_template else None
    tokenizers = {}
    for path in paths:
        config = _model_config(args, path)
        if args.max_length > config.max_position_embeddings:
            raise ValueError(f"--max-length {args.max_length} is larger than the max_position_embeddings of {path} "
                             f"({config.max_position_embeddings}, config.json): lower --max-length to at most "
                             f"{config.max_position_embeddings}")
        tokenizers[path] = _tokenizer(args, path, chat_flag, config)
    results = {}
    for path in paths:
        try:
            model = _load_model(path, args, options.mesh)
        except Exception:
            _report_partial(args, tasks, results)
            raise
        results[path] = {}
        for task in tasks:
            with tqdm(total=units(task), desc=f"{task.key} · {model_label(path)}",
                      unit="req", file=sys.stderr) as bar:
                results[path][task.key] = evaluate(model, tokenizers[path], task, options, progress=bar.update)
        del model
    print(comparison_table(tasks, results))
    if args.output:
        _write_json(args.output, results_json(args, tasks, results))
    return 0


def _report_partial(args, tasks, results: dict) -> None:
    """What was evaluated before a later checkpoint failed to load: printed (and written to --output), not lost."""
    from swiftkv_jax.evaluation.report import comparison_table, results_json

    if not results:
        return
    print(comparison_table(tasks, results))
    if args.output:
        _write_json(args.output, results_json(args, tasks, results))
    print(f"the results of {', '.join(results)} are above; the next checkpoint failed to load:", file=sys.stderr)


def _bench(args) -> int:
    from swiftkv_jax.evaluation.report import check_output_file
    from swiftkv_jax.serving import bench

    if args.model and args.random_weights:
        raise ValueError("--random-weights makes a --preset's model without a checkpoint; --model reads its weights: "
                         "drop --random-weights, or use --preset NAME --random-weights")
    if args.output:
        check_output_file(args.output, "--output")
    if args.dry_run:
        return _bench_dry_run(args)
    if args.preset and not args.random_weights:
        raise ValueError("--preset builds a model shape without weights: add --random-weights (or use --model DIR)")
    if args.prefill_chunk is not None and args.prompt_len % args.prefill_chunk:
        raise ValueError(f"--prefill-chunk {args.prefill_chunk} must divide --prompt-len {args.prompt_len}")
    positions = (_model_config(args) if args.model else bench.preset_config(args.preset)).max_position_embeddings
    if args.prompt_len + args.gen_len > positions:
        raise ValueError(f"--prompt-len {args.prompt_len} plus --gen-len {args.gen_len} needs "
                         f"{args.prompt_len + args.gen_len} positions, but the model has {positions} "
                         f"(max_position_embeddings): lower them")
    mesh = _mesh(args)
    if args.model:
        model = _load_model(args.model, args, mesh)
    else:
        model = bench.random_model(args.preset, dtype=args.dtype or "bfloat16", seed=args.seed, mesh=mesh)
    rows = bench.bench(model, prompt_len=args.prompt_len, gen_len=args.gen_len, batch=args.batch,
                       repeats=args.repeats, cache_dtype=_cache_format(args), attention_impl=args.attention_impl,
                       decode_attention_impl=args.decode_attention_impl, prefill_chunk=args.prefill_chunk,
                       memory_bandwidth=args.memory_bandwidth, seed=args.seed, mesh=mesh)
    print(bench.format_table(rows))
    if args.output:
        _write_json(args.output, {"command": sys.argv, "model": args.model or args.preset, "results": rows})
    return 0


def _bench_dry_run(args) -> int:
    """Bytes per device, from the config alone (a checkpoint's config.json, or a preset)."""
    from swiftkv_jax.serving import bench

    if args.model:
        from swiftkv_jax.checkpoints import detect_format
        from swiftkv_jax.checkpoints.hf import read_config
        from swiftkv_jax.checkpoints.hf_config import config_from_hf, stored_dtype

        detect_format(args.model)
        hf = read_config(args.model)
        dtype = args.dtype or stored_dtype(hf) or "float32"
        config = config_from_hf(hf, param_dtype=dtype, dtype=dtype)
    else:
        config = bench.preset_config(args.preset, param_dtype=args.dtype or "bfloat16", dtype=args.dtype or "bfloat16")
    sizes = sorted({1, 2, 4, 8, args.tensor_parallel})
    rows = bench.sizing_rows(config, sizes, batch=args.batch, max_len=args.prompt_len + args.gen_len,
                             cache_format=_cache_format(args))
    print(bench.format_sizing(rows))
    if args.output:
        _write_json(args.output, {"command": sys.argv, "model": args.model or args.preset, "sizing": rows})
    return 0


def _analyze(args) -> int:
    from tqdm import tqdm

    from swiftkv_jax.evaluation.analyze import analyze, format_summary

    config = _model_config(args)  # a missing or non-checkpoint --model is named as such, not as a tokenizer problem
    if args.swiftkv and not config.is_swiftkv:
        raise ValueError(f"--swiftkv: {args.model} is not a SwiftKV model (its only wiring is the teacher's): drop "
                         f"--swiftkv")
    _tokenizer(args, config=config)
    with tqdm(total=args.max_tokens, unit="tok", desc="analyze", file=sys.stderr) as bar:
        result = analyze(args.model, args.data, max_tokens=args.max_tokens, max_length=args.max_length,
                         out_dir=args.out, tokenizer_dir=args.tokenizer, dtype=args.dtype,
                         batch_size=args.batch_size, swiftkv=args.swiftkv, progress=bar.update,
                         names={"data_source": "--data", "out_dir": "--out"})
    print(format_summary(result))
    print(f"wrote {result['out_dir']}/similarity.json and similarity.png", file=sys.stderr)
    return 0


def _buckets(text: Optional[str], flag: str):
    if text is None:
        return None
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"{flag} takes positive integers, got {text!r}")
    return sizes


def _listening_socket(args) -> socket.socket:
    """--host/--port bound now, before minutes of loading and compiling: a port in use or a bad address fails at
    once, naming the flag; the server later listens on this very socket, so nothing can take the port meanwhile."""
    from swiftkv_jax.serving.http import listening_socket

    try:
        return listening_socket(args.host, args.port)
    except socket.gaierror as e:
        raise ValueError(f"--host {args.host}: not an address this machine resolves ({e.strerror}): give one of its "
                         f"addresses (127.0.0.1: this machine only, 0.0.0.0: every interface)") from None
    except OSError as e:
        reason = e.strerror or str(e)
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"--port {args.port}: already in use on {args.host} ({reason}): stop what listens there, "
                             f"or choose another --port (0: any free one)") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise ValueError(f"--host {args.host}: not an address of this machine ({reason}): give one of its "
                             f"addresses (127.0.0.1: this machine only, 0.0.0.0: every interface)") from None
        raise ValueError(f"cannot listen on --host {args.host} --port {args.port} ({reason})") from None


def _kv_pool(args, config) -> tuple[dict, Optional[int]]:
    """(the engine's pool setting, the tokens it holds where known before the weights are loaded: not for a fraction
    of the memory that will be free then). Default: 90% of the free device memory where the device reports it (a
    GPU), else 1 GiB."""
    import jax

    from swiftkv_jax.serving.paged_cache import pages_for_budget, tokens_held

    pool = dict(num_pages=args.num_pages, kv_cache_fraction=args.kv_cache_fraction,
                kv_cache_bytes=None if args.kv_cache_bytes is None else int(args.kv_cache_bytes))
    if all(v is None for v in pool.values()):
        has_memory_figures = "bytes_limit" in (jax.devices()[0].memory_stats() or {})
        pool["kv_cache_fraction" if has_memory_figures else "kv_cache_bytes"] = 0.9 if has_memory_figures else 1 << 30
    pool = {k: v for k, v in pool.items() if v is not None}
    if "kv_cache_fraction" in pool:
        return pool, None
    from swiftkv_jax.model.kv_quant import is_auto

    if is_auto(args.cache_dtype):  # the model's compute dtype: the one the weights will load in (as sk.load picks it)
        from swiftkv_jax.checkpoints.hf import read_config
        from swiftkv_jax.checkpoints.hf_config import stored_dtype

        dtype = args.dtype or stored_dtype(read_config(args.model))
        if dtype is None:  # an HF checkpoint's undeclared dtype is its weights': the engine checks once they are loaded
            return pool, None
        config = config.replace(param_dtype=dtype, dtype=dtype)
    swiftkv = config.is_swiftkv and not args.teacher_mode
    if args.tensor_parallel > 1:  # the engine holds each KV head on kv_replicas devices: a page costs that many copies
        from swiftkv_jax.serving.tensor_parallel import plan

        config = plan(config, args.tensor_parallel).served(config)
    try:
        pages = pages_for_budget(config, swiftkv, args.page_size, _cache_format(args), **pool)
    except ValueError as e:  # the library's names: say the flags that set them
        raise ValueError(f"{e} (the flags: --num-pages or --kv-cache-bytes, and --page-size)") from None
    return pool, tokens_held(pages, args.page_size)


def _sampling_defaults(args) -> dict:
    """--generation-config's request defaults (vLLM's): auto, the model folder's generation_config.json; vllm, none;
    DIR, DIR's (which must have one). Logs what the file sets and what of it is not applied."""
    import logging

    from swiftkv_jax.serving.http.protocol import sampling_defaults

    log = logging.getLogger(__name__)
    if args.generation_config == "vllm":
        return {}
    folder = args.model if args.generation_config == "auto" else args.generation_config
    config, file = _generation_config(folder)
    if args.generation_config != "auto" and not os.path.isfile(file):
        raise ValueError(f"--generation-config {args.generation_config}: no generation_config.json there (give "
                         f"auto, the model folder's, or vllm, none)")
    defaults, ignored = sampling_defaults(config, file)
    if defaults:
        log.info("Default sampling parameters have been overridden by the model's generation config %s: %s (a "
                 "request's own values win; --generation-config vllm ignores the file)", file,
                 ", ".join(f"{k}={v}" for k, v in defaults.items()))
    if ignored:
        log.warning("%s sets %s, which this server does not implement: NOT applied (requests are sampled without "
                    "them)", file, ", ".join(f"{k}={v}" for k, v in ignored.items()))
    return defaults


def _api_key(args) -> Optional[str]:
    """--api-key, else $SWIFTKV_API_KEY, else $VLLM_API_KEY (a deployment moved from vLLM stays closed), else None.
    An empty key is refused (it would look set and let nobody in)."""
    import logging

    for source, key in (("--api-key", args.api_key), ("SWIFTKV_API_KEY", os.environ.get("SWIFTKV_API_KEY")),
                        ("VLLM_API_KEY", os.environ.get("VLLM_API_KEY"))):
        if key is not None:
            if not key.strip():
                raise ValueError(f"{source} is empty: give a key, or unset it to serve without one")
            logging.getLogger(__name__).info("an API key is required (%s) on every path but /health, /metrics and "
                                             "/version", source)
            return key
    return None


def _tool_parser(args) -> Optional[str]:
    """--tool-call-parser, which --enable-auto-tool-choice needs (as vLLM's); a parser without the flag is not used
    (tool_choice "auto" is refused then, as vLLM's)."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser (llama3_json for Llama 3.1/3.2, hermes "
                         "for Qwen2.5)")
    return args.tool_call_parser if args.enable_auto_tool_choice else None


def _serve(args) -> int:
    import logging

    from swiftkv_jax.serving.continuous import check_max_model_len
    from swiftkv_jax.serving.http import serve

    # our own handler: an import may already have configured the root logger (then basicConfig does nothing)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    package = logging.getLogger("swiftkv_jax")
    package.setLevel(logging.INFO)
    package.addHandler(handler)
    package.propagate = False
    buckets = dict(single_buckets=_buckets(args.single_buckets, "--single-buckets"),
                   prompt_buckets=_buckets(args.prompt_buckets, "--prompt-buckets"))
    config = _model_config(args)
    tokenizer = _tokenizer(args, config=config)
    sampling = _sampling_defaults(args)
    api_key = _api_key(args)
    tool_parser = _tool_parser(args)
    names = args.served_model_name or [os.path.basename(os.path.normpath(args.model))]
    if len(set(names)) < len(names):
        raise ValueError(f"--served-model-name takes distinct names, got {' '.join(names)}")
    pool, pool_tokens = _kv_pool(args, config)
    if args.max_model_len is not None:  # the engine checks a fraction's pool once the weights are loaded
        check_max_model_len(args.max_model_len, config.max_position_embeddings, pool_tokens, name="--max-model-len",
                            pool_names="--num-pages, --kv-cache-bytes or --kv-cache-fraction")
    mesh = _mesh(args)
    sock = _listening_socket(args)
    try:
        model = _load_model(args.model, args, mesh)
    except BaseException:
        sock.close()
        raise
    given = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                 max_prompt_seqs=args.max_prompt_seqs, **pool)
    options = dict(swiftkv=False if args.teacher_mode else None, page_size=args.page_size,
                   budget_unit=args.budget_unit, max_model_len=args.max_model_len, cache_dtype=_cache_format(args),
                   enable_prefix_caching=args.enable_prefix_caching,
                   mesh=mesh, consume_weights=True,  # the model is the engine's alone: its weights in memory once
                   **_named_impls(args),
                   **buckets, **{k: v for k, v in given.items() if v is not None})
    return serve(model, tokenizer, names, host=args.host, port=args.port, engine_options=options,
                 max_waiting=args.max_waiting, shutdown_grace=args.shutdown_grace, sock=sock,
                 sampling_defaults=sampling, api_key=api_key, tool_parser=tool_parser,
                 **({} if args.max_request_bytes is None else dict(max_request_bytes=args.max_request_bytes)))


def _write_json(path: str, data) -> None:
    from swiftkv_jax.evaluation.report import write_json

    write_json(path, data)
    print(f"wrote {path}", file=sys.stderr)
