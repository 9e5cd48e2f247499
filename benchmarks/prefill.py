"""Prefill: SwiftKV wiring against the same weights in teacher wiring, side by side in one run.

    python benchmarks/prefill.py [--prompt-len 2048 --layers 12 --hidden 768] \
        [--out benchmarks/results/prefill_cpu.json]

Both run `swiftkv_jax.serving.prefill` (fills the KV cache, logits of the last prompt token) on one
random ~100M-parameter Llama made SwiftKV with l = L/2, g = 1. Arithmetic: the SwiftKV prefill does the
layers < l for every token plus one K/V projection per later layer, so its time is about
(l + (L-l) * kv_share) / L of the teacher's, ~0.52 here. Also reports KV-cache bytes of both layouts.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

from results_file import DefaultsFormatter, write_results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsFormatter)
    parser.add_argument("--prompt-len", type=int, default=2048, help="prompt tokens a row")
    parser.add_argument("--batch", type=int, default=1, help="prompts prefilled at once")
    parser.add_argument("--layers", type=int, default=12, help="the random model's layers L (SwiftKV l = L / 2)")
    parser.add_argument("--hidden", type=int, default=768,
                        help="the random model's hidden size (heads of 64, KV heads heads / 3, MLP 4x)")
    parser.add_argument("--vocab", type=int, default=8192, help="the random model's vocabulary")
    parser.add_argument("--group", type=int, default=1, help="AcrossKV group size g")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each wiring (median)")
    parser.add_argument("--dtype", default="float32", help="parameter and compute dtype (fp32 on CPU)")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/prefill_<platform>.json)")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import swiftkv_jax as sk
    from swiftkv_jax.serving import init_cache, prefill

    heads = args.hidden // 64
    config = sk.ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                            num_hidden_layers=args.layers, num_attention_heads=heads,
                            num_key_value_heads=max(1, heads // 3), head_dim=64, param_dtype=args.dtype,
                            dtype=args.dtype)
    l = args.layers // 2
    model = sk.to_swiftkv(sk.init(config, 0), l, args.group)
    n_params = sum(x.size for x in jax.tree.leaves(model.params))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.prompt_len)), jnp.int32)
    lengths = jnp.full((args.batch,), args.prompt_len, jnp.int32)
    rows = []
    for swiftkv in (True, False):
        fn = jax.jit(functools.partial(prefill, config=model.config, swiftkv=swiftkv), donate_argnums=(1,))
        fresh = lambda: init_cache(model.config, args.batch, args.prompt_len, swiftkv, args.dtype)
        compiled = fn.lower(model.params, fresh(), tokens, lengths).compile()
        jax.block_until_ready(compiled(model.params, fresh(), tokens, lengths))  # warm-up
        times = []
        for _ in range(args.repeats):
            cache = fresh()
            jax.block_until_ready(cache)
            start = time.perf_counter()
            jax.block_until_ready(compiled(model.params, cache, tokens, lengths))
            times.append(time.perf_counter() - start)
        rows.append({"wiring": "swiftkv" if swiftkv else "teacher", "prefill_s": statistics.median(times),
                     "times_s": times, "kv_cache_bytes": fresh().nbytes,
                     "cache_layers": model.config.num_kv_cache_layers if swiftkv else args.layers})
    fast, slow = rows
    ratios = {"prefill_time_swiftkv_over_teacher": fast["prefill_s"] / slow["prefill_s"],
              "kv_bytes_swiftkv_over_teacher": fast["kv_cache_bytes"] / slow["kv_cache_bytes"],
              "kv_bytes_expected": (l + (args.layers - l) // args.group) / args.layers}
    device = jax.devices()[0]
    print(f"prefill of {args.batch} x {args.prompt_len} tokens, {n_params / 1e6:.0f}M params, L={args.layers}, "
          f"l={l}, g={args.group}, {args.dtype}, on {device.device_kind} ({device.platform})")
    print(f"{'wiring':<9}{'prefill s':>11}{'cache layers':>14}{'KV MiB':>9}")
    for r in rows:
        print(f"{r['wiring']:<9}{r['prefill_s']:>11.3f}{r['cache_layers']:>14}{r['kv_cache_bytes'] / 2**20:>9.1f}")
    print("swiftkv / teacher: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    write_results(args.out or f"benchmarks/results/prefill_{device.platform}.json", "benchmarks/prefill.py", argv,
                  {"device": device.device_kind, "params": n_params, "args": vars(args), "results": rows,
                   "ratios": ratios})
    return 0


if __name__ == "__main__":
    sys.exit(main())
