"""KV cache formats (bf16, fp32, FP8 e4m3fn, int8; static per-layer or per-token-head scales): bytes, quality, speed.

    python benchmarks/kv_cache.py bytes      # allocated cache / the teacher's bf16 cache: g = 1, 2, 4, Llama-3.1-8B
    python benchmarks/kv_cache.py quality --model DIR --data VAL.parquet [--model DIR ...]   # e.g. the demo's students
    python benchmarks/kv_cache.py quality --preset llama-3.1-8b --layers 2 --context 2048    # random 8B-shaped stack
    python benchmarks/kv_cache.py speed [--preset tiny]  # decode TPOT per format (infer.py bench), ratio to bf16

Quality compares each format with the same model over a bf16 cache (the format it replaces): a context of
`--context` tokens is prefilled into the cache, then the next `--tokens` tokens are teacher-forced through it
(`extend`: every position reads the cache, its own K/V included, as a decode step does). Per format: KL(bf16 cache
‖ format) per position, validation loss of the true next tokens, the fraction of positions whose greedy pick equals
the bf16 cache's, and the common prefix of free-running greedy continuations (`sk.generate`, `--tokens` long).
Each table goes to stdout and JSON (default benchmarks/results/kv_cache_<part>_<platform>.json).
"""

from __future__ import annotations

import argparse
import sys
import time

from results_file import RawDescriptionDefaultsFormatter, write_results

FORMATS = (("bfloat16", None), ("float32", None), ("float8_e4m3fn", "per-layer"), ("float8_e4m3fn", "per-token-head"),
           ("int8", "per-layer"), ("int8", "per-token-head"))


def _label(dtype, scales) -> str:
    return dtype + (f"/{scales}" if scales else "")


def _format(dtype, scales):
    """The cache format of a row. Built directly: int8 at the uncalibrated per-layer scale of 1.0, which named
    settings refuse (kv_quant.as_format), is measured here on purpose."""
    from swiftkv_jax.model.kv_quant import KVCacheFormat

    return KVCacheFormat(dtype, scales)


def bytes_table(args) -> dict:
    """Allocated bytes (the arrays `init_cache` makes, shapes only) per token, against the teacher's bf16 cache."""
    import jax

    from swiftkv_jax.serving import bench
    from swiftkv_jax.serving.cache import init_cache

    rows = []
    teacher_cfg = bench.preset_config("llama-3.1-8b")
    tokens = 4096
    def alloc(cfg, swiftkv, dtype, scales):  # K, V and scales; not the lengths
        cache = jax.eval_shape(lambda: init_cache(cfg, 1, tokens, swiftkv, _format(dtype, scales)))
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves((cache.lower, cache.upper)))

    baseline = alloc(teacher_cfg, False, "bfloat16", None)
    for g in (1, 2, 4):
        cfg = teacher_cfg.replace(key_value_group_size=g)
        for dtype, scales in FORMATS:
            if dtype == "float32":
                continue
            nbytes = alloc(cfg, True, dtype, scales)
            rows.append({"g": g, "l": cfg.num_key_value_layers, "L": cfg.num_hidden_layers,
                         "format": _label(dtype, scales), "bytes_per_token": nbytes / tokens,
                         "vs_teacher_bf16": nbytes / baseline})
    print(f"KV cache bytes per token, Llama-3.1-8B shape (L=32, l=16, 8 KV heads x 128), against the teacher's bf16 "
          f"cache ({baseline / tokens:,.0f} B/token)")
    print(f"{'g':>3}  {'format':<30}{'bytes/token':>12}{'vs teacher bf16':>17}")
    for r in rows:
        print(f"{r['g']:>3}  {r['format']:<30}{r['bytes_per_token']:>12,.0f}{r['vs_teacher_bf16']:>17.4f}")
    return {"tokens": tokens, "teacher_bf16_bytes_per_token": baseline / tokens, "rows": rows}


def _sequences(args, model):
    """[N, context + tokens] int32: windows of the validation text (--data) or random ids (a random model)."""
    import numpy as np

    n = args.context + args.tokens
    if not args.data:
        return np.random.default_rng(args.seed).integers(0, model.config.vocab_size, (args.sequences, n), np.int32)
    import datasets

    from swiftkv_jax.data.chat import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer or args.model[0])
    texts = datasets.load_dataset("parquet", data_files=args.data, split="train")["text"]
    ids = [t for text in texts for t in tokenizer(text)["input_ids"]]  # the split as one stream
    if len(ids) < args.sequences * n:
        raise ValueError(f"{args.data}: {len(ids)} tokens, {args.sequences} windows of {n} need more: lower "
                         f"--sequences, --context or --tokens")
    step = len(ids) // args.sequences
    return np.asarray([ids[i * step: i * step + n] for i in range(args.sequences)], np.int32)


def _quality_of(name, model, sequences, args) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import swiftkv_jax as sk
    from swiftkv_jax.serving.cache import init_cache
    from swiftkv_jax.serving.engine import extend, prefill

    cfg, c, t = model.config, args.context, args.tokens
    swiftkv = cfg.is_swiftkv
    prefill_fn = jax.jit(lambda p, cache, x, n: prefill(p, cache, x, n, config=cfg, swiftkv=swiftkv,
                                                         chunk_size=args.chunk))
    extend_fn = jax.jit(lambda p, cache, x, n: extend(p, cache, x, n, config=cfg, swiftkv=swiftkv))
    b = len(sequences)
    context, targets = jnp.asarray(sequences[:, :c]), sequences[:, c + 1:]
    follow = jnp.asarray(sequences[:, c:c + t])

    def logprobs_over(dtype, scales):
        cache = init_cache(cfg, b, c + t, swiftkv, _format(dtype, scales))
        _, cache = prefill_fn(model.params, cache, context, jnp.full((b,), c, jnp.int32))
        logits, _ = extend_fn(model.params, cache, follow, jnp.full((b,), t, jnp.int32))
        return np.asarray(jax.nn.log_softmax(logits[:, :-1], axis=-1))  # [B, T-1, V] predicting targets

    prompts = sequences[: args.generate_prompts, :c].tolist()
    greedy = lambda dtype, scales: sk.generate(model, prompts, t, stop_token_ids=[], cache_dtype=_format(dtype, scales),  # noqa: E731
                                               max_len=c + t).tokens
    ref, ref_greedy = logprobs_over("bfloat16", None), greedy("bfloat16", None)
    rows = []
    for dtype, scales in FORMATS:
        start = time.perf_counter()
        lp = ref if dtype == "bfloat16" else logprobs_over(dtype, scales)
        kl = np.sum(np.exp(ref) * (ref - lp), axis=-1)
        nll = -np.take_along_axis(lp, targets[..., None], axis=-1)[..., 0]
        runs = ref_greedy if dtype == "bfloat16" else greedy(dtype, scales)
        prefix = [next((i for i, (x, y) in enumerate(zip(a, r)) if x != y), len(r)) for a, r in zip(runs, ref_greedy)]
        rows.append({"model": name, "format": _label(dtype, scales), "kl_to_bf16_cache": float(kl.mean()),
                     "kl_p99": float(np.quantile(kl, 0.99)), "val_loss": float(nll.mean()),
                     "greedy_agreement": float(np.mean(lp.argmax(-1) == ref.argmax(-1))),
                     "common_prefix": float(np.mean(prefix)), "seconds": time.perf_counter() - start})
        r = rows[-1]
        print(f"{name[-35:]:<36}{r['format']:<30}{r['kl_to_bf16_cache']:>11.2e}{r['kl_p99']:>11.2e}{r['val_loss']:>10.4f}"
              f"{r['greedy_agreement']:>9.4f}{r['common_prefix']:>9.1f}", flush=True)
    return rows


def random_model(args, dtype):
    """(name, model): random weights of --preset, cut to --layers (l = half) and --vocab when given."""
    from swiftkv_jax.serving import bench

    cfg = bench.preset_config(args.preset, dtype=dtype, param_dtype=dtype)
    layers = args.layers or cfg.num_hidden_layers
    if args.layers or args.vocab:
        cfg = cfg.replace(num_hidden_layers=layers, num_key_value_layers=max(1, layers // 2),
                          vocab_size=args.vocab or cfg.vocab_size,
                          max_position_embeddings=max(cfg.max_position_embeddings, args.context + args.tokens))
    return f"random {args.preset} x{layers} layers", bench.random_model(cfg, dtype=dtype, seed=args.seed)


def quality_table(args) -> dict:
    import swiftkv_jax as sk

    if args.model:
        models = [(path, sk.load(path, dtype="float32")) for path in args.model]  # JSON: the path; table: its tail
    else:
        models = [random_model(args, "float32")]
    print(f"context {args.context}, then {args.tokens} teacher-forced tokens; {args.sequences} sequences; fp32 "
          f"compute; references: the same model over a bf16 cache")
    print(f"{'model':<36}{'format':<30}{'KL mean':>11}{'KL p99':>11}{'val loss':>10}{'agree':>9}{'prefix':>9}")
    rows = [r for name, model in models for r in _quality_of(name, model, _sequences(args, model), args)]
    return {"context": args.context, "tokens": args.tokens, "sequences": args.sequences, "rows": rows}


def speed_table(args) -> dict:
    """Decode TPOT per format in both wirings (`infer.py bench`), as ratios to the bf16 cache of the same run."""
    from swiftkv_jax.serving import bench

    name, model = random_model(args, args.dtype)
    rows = []
    for dtype, scales in FORMATS:
        for r in bench.bench(model, prompt_len=args.context, gen_len=args.tokens, batch=args.batch,
                             repeats=args.repeats, cache_dtype=_format(dtype, scales)):
            rows.append({"format": _label(dtype, scales), "wiring": r["wiring"], "tpot_s": r["tpot_s"],
                         "ttft_s": r["ttft_s"], "kv_cache_bytes": r["kv_cache_bytes"]})
    base = {r["wiring"]: r["tpot_s"] for r in rows if r["format"] == "bfloat16"}
    print(f"decode TPOT, {name} ({args.dtype}), batch {args.batch}, context {args.context}")
    print(f"{'format':<30}{'wiring':<10}{'TPOT ms':>10}{'vs bf16':>9}{'KV MiB':>9}")
    for r in rows:
        r["tpot_vs_bf16"] = r["tpot_s"] / base[r["wiring"]]
        print(f"{r['format']:<30}{r['wiring']:<10}{r['tpot_s'] * 1e3:>10.2f}{r['tpot_vs_bf16']:>9.3f}"
              f"{r['kv_cache_bytes'] / 2**20:>9.1f}")
    return {"model": name, "batch": args.batch, "context": args.context, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=RawDescriptionDefaultsFormatter)
    p.add_argument("part", choices=("bytes", "quality", "speed"),
                   help="bytes: cache sizes; quality: each format against a bf16 cache; speed: decode TPOT")
    p.add_argument("--model", action="append", help="checkpoint folder(s) (quality); default: a random --preset")
    p.add_argument("--data", help="validation parquet with a 'text' column (with --model)")
    p.add_argument("--tokenizer", help="tokenizer folder (default: the first --model)")
    p.add_argument("--preset", default=None, help="random model's shape (serving.bench's presets); default: "
                                                  "quality llama-3.1-8b, speed tiny")
    p.add_argument("--layers", type=int, help="random model: layers kept of the preset, l = half (default: all)")
    p.add_argument("--vocab", type=int, help="random model: vocabulary (default the preset's)")
    p.add_argument("--context", type=int, default=None, help="context tokens (default: quality 2048, speed 256)")
    p.add_argument("--tokens", type=int, default=64, help="teacher-forced / generated tokens after it (default 64)")
    p.add_argument("--sequences", type=int, default=8, help="quality: windows scored (of --data, or random tokens)")
    p.add_argument("--generate-prompts", type=int, default=4, help="prompts for the free-running greedy prefix")
    p.add_argument("--chunk", type=int, default=None,
                   help="prefill chunk, bounds activation memory (default: none, the context in one pass)")
    p.add_argument("--batch", type=int, default=8, help="speed: batch")
    p.add_argument("--repeats", type=int, default=3, help="speed: timed runs per format")
    p.add_argument("--dtype", default="float32", help="speed: parameter and compute dtype (fp32 on CPU)")
    p.add_argument("--seed", type=int, default=0, help="random model's weights and random tokens")
    p.add_argument("--out", help="JSON path (default benchmarks/results/kv_cache_<part>_<platform>.json)")
    args = p.parse_args(argv)
    if args.model and not args.data:
        p.error("--model needs --data (a validation parquet)")
    args.preset = args.preset or ("tiny" if args.part == "speed" else "llama-3.1-8b")
    args.context = args.context or (256 if args.part == "speed" else 2048)
    import jax

    payload = {"bytes": bytes_table, "quality": quality_table, "speed": speed_table}[args.part](args)
    platform = jax.devices()[0].platform
    write_results(args.out or f"benchmarks/results/kv_cache_{args.part}_{platform}.json", "benchmarks/kv_cache.py",
                  argv, {"part": args.part, "device": jax.devices()[0].device_kind, "jax": jax.__version__, **payload})
    return 0


if __name__ == "__main__":
    sys.exit(main())
