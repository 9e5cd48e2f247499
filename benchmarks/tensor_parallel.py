"""Tensor-parallel serving: bytes per device, and the collectives of the compiled decode step.

    python benchmarks/tensor_parallel.py sizing         # 8B and 70B (bf16) on 1/2/4/8 devices; nothing allocated
    python benchmarks/tensor_parallel.py collectives    # the 8B decode step compiled for 2/4/8 fake CPU devices

sizing: `tensor_parallel.sizing` (the weights and a dense KV cache split by the logical-axis rules) for each size and
wiring, and the KV tokens a device has room for beside its weights on an 80 GB GPU (90% of it, as `serve` takes).
collectives: the static engine's decode step (`decode_step` in serving layout, as `generate` runs it) compiled from
shapes alone (ShapeDtypeStructs with their shardings: no weight exists) on `--sizes` fake CPU devices; per size, the
count and bytes per device of every collective XLA's partitioner put in. GPU timings need a multi-GPU machine.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # before jax is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

from results_file import DefaultsFormatter, write_results  # noqa: E402

GPU_BYTES = 80e9  # an H100's HBM
SERVE_FRACTION = 0.9  # what `infer.py serve` gives the weights and the cache by default


def sizing(args) -> dict:
    from swiftkv_jax.serving import bench

    tables = []
    for preset in args.presets:
        config = bench.preset_config(preset, param_dtype="bfloat16", dtype="bfloat16")
        rows = bench.sizing_rows(config, (1, 2, 4, 8), batch=args.batch, max_len=args.max_len, cache_format="bfloat16")
        for r in rows:
            if "error" not in r:
                room = SERVE_FRACTION * GPU_BYTES - r["weight_bytes_per_device"]
                r["kv_tokens_fit_80gb"] = max(0, int(room // r["kv_bytes_per_token_per_device"]))
        print(f"\n{preset}")
        print(bench.format_sizing(rows))
        print("KV tokens per 80 GB device (90% for weights + cache): "
              + ", ".join(f"TP{r['tensor_parallel']} {r['wiring']} {r['kv_tokens_fit_80gb']:,}" for r in rows))
        tables.append({"preset": preset, "rows": rows})
    return {"batch": args.batch, "max_len": args.max_len, "tables": tables}


def _abstract(tree_shapes, shardings):
    import jax

    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree_shapes, shardings)


def collectives(args) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from swiftkv_jax.model.cached import unstack_layers
    from swiftkv_jax.model.model import abstract_params, param_shardings
    from swiftkv_jax.serving import bench, tensor_parallel as tp
    from swiftkv_jax.serving.cache import CACHE_AXES, init_cache
    from swiftkv_jax.serving.engine import decode_step
    from swiftkv_jax.sharding import logical_to_shardings

    base = bench.preset_config(args.preset, param_dtype="bfloat16", dtype="bfloat16")
    rows = []
    print(f"{args.preset} decode step, batch {args.batch}, cache {args.max_len} tokens (bf16), compiled for fake CPU "
          f"devices from shapes alone")
    print(f"{'TP':>3} {'wiring':<8}{'all-reduce':>11}{'all-gather':>11}{'other':>7}{'MiB/step/device':>17}"
          f"{'weights MiB/device':>20}{'compile s':>10}")
    for size in args.sizes:
        mesh = tp.serving_mesh(size)
        plan = tp.plan(base, size)
        cfg = base.replace(num_key_value_heads=base.num_key_value_heads * plan.kv_replicas)
        params = _abstract(abstract_params(cfg), param_shardings(cfg, mesh, plan.rules))
        for swiftkv in (True, False):
            shapes = jax.eval_shape(lambda: init_cache(cfg, args.batch, args.max_len, swiftkv, "bfloat16"))
            specs = jax.tree.map(lambda s: PartitionSpec(*CACHE_AXES[len(s.shape)]), shapes)
            cache = _abstract(shapes, logical_to_shardings(specs, shapes, mesh))
            tokens = jax.ShapeDtypeStruct((args.batch,), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))

            def step(params, cache, tokens):
                with tp.activation_sharding(cfg, mesh):
                    return decode_step(unstack_layers(params, cfg), cache, tokens, config=cfg, swiftkv=swiftkv)

            start = time.perf_counter()
            hlo = jax.jit(step, donate_argnums=1).lower(params, cache, tokens).compile().as_text()
            compile_s = time.perf_counter() - start
            found = tp.collectives(hlo)
            count = lambda op: sum(c["op"] == op for c in found)
            weights = sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                          for a in jax.tree.leaves(params))
            row = dict(tensor_parallel=size, wiring="swiftkv" if swiftkv else "teacher", kv_replicas=plan.kv_replicas,
                       all_reduce=count("all-reduce"), all_gather=count("all-gather"),
                       other=len(found) - count("all-reduce") - count("all-gather"),
                       bytes_per_step=sum(c["bytes"] for c in found), weight_bytes_per_device=int(weights),
                       compile_s=compile_s, collectives=sorted({(c["op"], c["dtype"], c["shape"]) for c in found}))
            rows.append(row)
            print(f"{size:>3} {row['wiring']:<8}{row['all_reduce']:>11}{row['all_gather']:>11}{row['other']:>7}"
                  f"{row['bytes_per_step'] / 2**20:>17.2f}{weights / 2**20:>20.0f}{compile_s:>10.1f}", flush=True)
    return {"preset": args.preset, "batch": args.batch, "max_len": args.max_len, "platform": jax.default_backend(),
            "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="part", required=True)
    s = sub.add_parser("sizing", formatter_class=DefaultsFormatter,
                       help="bytes per device of the weights and a dense KV cache on 1/2/4/8 devices")
    s.add_argument("--presets", nargs="+", default=["llama-3.1-8b", "llama-3.1-8b-acrosskv4", "llama-3.1-70b"],
                   help="serving.bench's presets (default: llama-3.1-8b llama-3.1-8b-acrosskv4 llama-3.1-70b)")
    s.add_argument("--batch", type=int, default=32, help="sequences of the KV cache")
    s.add_argument("--max-len", type=int, default=8192, help="tokens a sequence of the KV cache")
    c = sub.add_parser("collectives", formatter_class=DefaultsFormatter,
                       help="the collectives of the decode step compiled for --sizes fake CPU devices")
    c.add_argument("--preset", default="llama-3.1-8b", help="serving.bench's preset of the model")
    c.add_argument("--sizes", default="2,4,8", type=lambda text: [int(x) for x in text.split(",")],
                   help="device counts, comma-separated")
    c.add_argument("--batch", type=int, default=32, help="the decode step's sequences")
    c.add_argument("--max-len", type=int, default=4096, help="the KV cache's tokens a sequence")
    for parser in (s, c):
        parser.add_argument("--output", default=None, help="JSON (default benchmarks/results/tensor_parallel_<part>"
                                                           "[_<preset>].json)")
    args = p.parse_args(argv)
    payload = sizing(args) if args.part == "sizing" else collectives(args)
    suffix = "" if args.part == "sizing" else f"_{args.preset}"
    out = args.output or os.path.join(os.path.dirname(__file__), "results", f"tensor_parallel_{args.part}{suffix}.json")
    write_results(out, "benchmarks/tensor_parallel.py", argv, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
