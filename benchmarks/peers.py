"""Our engine against transformers on the same weights, side by side in one run: the baseline SwiftKV is quoted against.

    python benchmarks/peers.py [--shape smol|1b] [--prefill 512,1024,2048] [--batches 1,8,32] [--context 1024]
                               [--out benchmarks/results/peers_<shape>_<platform>.json]

One random Llama (`--shape`), exported with `sk.save(..., format="hf")` and read back by transformers'
`LlamaForCausalLM.from_pretrained` (SDPA attention), so both engines hold the same weights; a first check compares
their last-token logits. Rows:
- prefill: one prompt of N tokens filling an empty cache and giving the last token's logits. transformers:
  `model(ids, logits_to_keep=1)` (its DynamicCache filled as a side effect); ours: `swiftkv_jax.serving.prefill`
  jitted with the cache donated, in teacher wiring and in SwiftKV wiring (l = L/2) of the same weights.
- decode TPOT: `--steps` greedy steps of a batch after `--context` cached tokens. The caches are filled with
  random K/V of that length rather than by a prefill (the step's cost does not depend on their values).
  transformers: a Python loop of `model(tok, past_key_values=cache)`; ours: one jitted `fori_loop` of
  `decode_step`s with the cache donated, the weights held in serving layout as an engine holds them.
After one untimed warm-up each, `--repeats` rounds time the three engines in turn (a slow stretch of a shared
machine then weighs on all alike); times are medians, ratios (ours / transformers: <= 1.0 is as fast or faster)
the median of the rounds' ratios. fp32 on CPU; bf16 and CUDA when a GPU is there.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time

from results_file import DefaultsFormatter, write_results

SHAPES = {
    # SmolLM-135M's shape (143M parameters): the measurements
    "smol": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True),
    # Llama-3.2-1B's shape (1.24B parameters)
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
               rope_theta=500000.0),
}


def _interleaved(runs: dict, repeats: int, steps: int = 1) -> dict:
    """{name: (setup, run)} -> {name: median seconds / steps}, plus per-round ratios to "transformers".

    One untimed warm-up each, then `repeats` rounds that time every engine once in turn, so that a slow
    stretch of a shared machine weighs on all of them alike; ratios are the median of the rounds' ratios."""
    times = {name: [] for name in runs}
    for round_ in range(repeats + 1):
        for name, (setup, run) in runs.items():
            args = setup()
            start = time.perf_counter()
            run(args)
            if round_:
                times[name].append((time.perf_counter() - start) / steps)
    out = {name: statistics.median(t) for name, t in times.items()}
    base = times["transformers"]
    for name in runs:
        if name != "transformers":
            out[f"{name}_vs_transformers"] = statistics.median(a / b for a, b in zip(times[name], base))
    out["runs_s"] = times
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsFormatter)
    parser.add_argument("--shape", choices=tuple(SHAPES), default="smol",
                        help="the random model's shape: smol SmolLM-135M's, 1b Llama-3.2-1B's")
    parser.add_argument("--prefill", default=None, help="prompt lengths (default 512,1024,2048; 1b: 512,1024)")
    parser.add_argument("--batches", default=None, help="decode batch sizes (default 1,8,32; 1b: 1,8)")
    parser.add_argument("--context", type=int, default=1024, help="cached tokens before the timed decode steps")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timed run")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed runs of each point and side, the sides interleaved")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/peers_<shape>_<platform>.json)")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from transformers import DynamicCache, LlamaForCausalLM

    import swiftkv_jax as sk
    from swiftkv_jax.serving import decode_step, init_cache, prefill
    from swiftkv_jax.model.cached import unstack_layers

    platform = jax.default_backend()
    dtype = args.dtype or ("bfloat16" if platform == "gpu" else "float32")
    lengths = [int(x) for x in (args.prefill or ("512,1024" if args.shape == "1b" else "512,1024,2048")).split(",")]
    batches = [int(x) for x in (args.batches or ("1,8" if args.shape == "1b" else "1,8,32")).split(",")]
    torch_device = "cuda" if platform == "gpu" and torch.cuda.is_available() else "cpu"
    torch_dtype = getattr(torch, dtype)

    config = sk.ModelConfig(**SHAPES[args.shape], param_dtype=dtype, dtype=dtype)
    plain = sk.init(config, 0)
    with tempfile.TemporaryDirectory() as tmp:
        sk.save(plain, tmp, format="hf", overwrite=True)
        peer = LlamaForCausalLM.from_pretrained(tmp, dtype=torch_dtype, attn_implementation="sdpa")
    peer = peer.to(torch_device).eval()
    layers = config.num_hidden_layers
    model = sk.to_swiftkv(plain, layers // 2, 1)
    del plain
    params = jax.block_until_ready(jax.jit(unstack_layers, static_argnums=1)(model.params, model.config))
    n_params = sum(p.numel() for p in peer.parameters())
    sync = torch.cuda.synchronize if torch_device == "cuda" else (lambda: None)

    # same weights: the last prompt token's logits of both engines (teacher wiring) agree
    probe = np.random.default_rng(1).integers(0, config.vocab_size, (1, 64), dtype=np.int32)
    with torch.inference_mode():
        want = peer(torch.as_tensor(probe, device=torch_device).long(), logits_to_keep=1).logits[0, -1]
    got, _ = prefill(params, init_cache(model.config, 1, 64, False, dtype), jnp.asarray(probe),
                     jnp.asarray([64], jnp.int32), config=model.config, swiftkv=False)
    logit_gap = float(np.max(np.abs(np.asarray(got[0], np.float32) - want.float().cpu().numpy())))
    print(f"{args.shape}: {n_params / 1e6:.0f}M params, {dtype}, L={layers}, l={layers // 2}; jax on {platform}, "
          f"transformers {peer.config._attn_implementation} on {torch_device}; last-token logit gap {logit_gap:.2e}")

    rows = []

    def record(kind, size, timed):
        row = {"kind": kind, "size": size, "transformers_s": timed["transformers"], "teacher_s": timed["teacher"],
               "swiftkv_s": timed["swiftkv"], "teacher_vs_transformers": timed["teacher_vs_transformers"],
               "swiftkv_vs_transformers": timed["swiftkv_vs_transformers"],
               "swiftkv_vs_teacher": timed["swiftkv"] / timed["teacher"], "runs_s": timed["runs_s"]}
        rows.append(row)
        unit, scale = ("s", 1) if kind == "prefill" else ("ms", 1e3)
        print(f"{kind:<8}{size:>6}  transformers {row['transformers_s'] * scale:9.2f} {unit}  teacher "
              f"{row['teacher_s'] * scale:9.2f} {unit} ({row['teacher_vs_transformers']:.2f}x)  swiftkv "
              f"{row['swiftkv_s'] * scale:9.2f} {unit} ({row['swiftkv_vs_transformers']:.2f}x)", flush=True)

    no_setup = lambda: None
    for length in lengths:
        ids = np.random.default_rng(length).integers(0, config.vocab_size, (1, length), dtype=np.int32)
        torch_ids = torch.as_tensor(ids, device=torch_device).long()

        def run_peer(_):
            with torch.inference_mode():
                peer(torch_ids, logits_to_keep=1)
            sync()

        runs = {"transformers": (no_setup, run_peer)}
        for swiftkv in (False, True):
            fn = jax.jit(functools.partial(prefill, config=model.config, swiftkv=swiftkv), donate_argnums=(1,))
            fresh = functools.partial(
                lambda swiftkv: jax.block_until_ready(init_cache(model.config, 1, length, swiftkv, dtype)), swiftkv)
            run = functools.partial(
                lambda fn, cache: jax.block_until_ready(fn(params, cache, jnp.asarray(ids), jnp.asarray([length]))), fn)
            runs["swiftkv" if swiftkv else "teacher"] = (fresh, run)
        record("prefill", length, _interleaved(runs, args.repeats))

    for batch in batches:
        kv_shape = (batch, config.num_key_value_heads, args.context, config.head_dim)

        def peer_cache():
            gen = torch.Generator(device=torch_device).manual_seed(0)
            cache = DynamicCache()
            for layer in range(layers):
                kv = [torch.randn(kv_shape, generator=gen, device=torch_device, dtype=torch_dtype) for _ in range(2)]
                cache.update(*kv, layer)
            return cache

        def run_peer(cache):
            token = torch.zeros((batch, 1), dtype=torch.long, device=torch_device)
            with torch.inference_mode():
                for _ in range(args.steps):
                    logits = peer(token, past_key_values=cache, use_cache=True).logits
                    token = logits[:, -1].argmax(-1, keepdim=True)
            sync()

        def loop(params, cache, token, *, swiftkv):
            def body(_, carry):
                cache, token = carry
                logits, cache = decode_step(params, cache, token, config=model.config, swiftkv=swiftkv)
                return cache, jnp.argmax(logits, axis=-1).astype(jnp.int32)
            return jax.lax.fori_loop(0, args.steps, body, (cache, token))

        def filled_cache(swiftkv):
            cache = init_cache(model.config, batch, args.context + args.steps, swiftkv, dtype)
            fill = lambda a: jax.random.normal(jax.random.key(0), a.shape, a.dtype)
            cache = cache.replace(lower=jax.tree.map(fill, cache.lower), upper=jax.tree.map(fill, cache.upper),
                                  lengths=jnp.full((batch,), args.context, jnp.int32))
            return jax.block_until_ready(cache)

        runs = {"transformers": (peer_cache, run_peer)}
        for swiftkv in (False, True):
            fn = jax.jit(functools.partial(loop, swiftkv=swiftkv), donate_argnums=(1,))
            run = functools.partial(
                lambda fn, cache: jax.block_until_ready(fn(params, cache, jnp.zeros((batch,), jnp.int32))), fn)
            runs["swiftkv" if swiftkv else "teacher"] = (functools.partial(filled_cache, swiftkv), run)
        record("decode", batch, _interleaved(runs, args.repeats, args.steps))

    device = jax.devices()[0].device_kind
    write_results(args.out or f"benchmarks/results/peers_{args.shape}_{platform}.json", "benchmarks/peers.py", argv,
                  {"device": device, "torch_device": torch_device, "torch": torch.__version__,
                   "torch_threads": torch.get_num_threads(), "params": n_params, "dtype": dtype,
                   "attention_impl": model.config.attention_impl,
                   "decode_attention_impl": model.config.decode_attention_impl, "logit_gap": logit_gap,
                   "context": args.context, "steps": args.steps, "repeats": args.repeats,
                   "shape": SHAPES[args.shape], "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
