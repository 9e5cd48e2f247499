"""Distillation step: ours against a naive step, same model and batch, measured side by side in one run.

    python benchmarks/distill_step.py [--preset cpu|1b] [--out benchmarks/results/distill_step_cpu.json]

ours  = swiftkv_jax.distill.step.train_step: layers < l once, teacher's later layers without gradients,
        backward through the student's later layers only, optimizer state for the trainable 5-7% only,
        KL in sequence chunks.
naive = two full forwards (teacher and student wiring) from the embeddings, backward through the whole
        student, AdamW state for every weight (updates of frozen weights masked to zero), full-vocab KL.

Each variant runs in its own process, so peaks do not mix. Memory: XLA's accounting of the compiled step
(arguments + temporaries + outputs - aliased), plus the device's peak bytes in use where the backend
reports it (GPU). Time: median of the timed steps. MFU in model FLOPs (`swiftkv_jax.distill.model_flops`: the
method's work, causal attention at half, no recomputation; the same numerator for both variants) against
--peak-tflops, the accelerator's dense bf16 peak; HFU from XLA's cost analysis of the compiled step, which counts a
loop's body once (the layers run in a scan), so it undercounts: on the cpu preset 0.030 TFLOP against 0.087 of model
FLOPs. MFU is the figure to read; earlier results' "mfu" came from that cost analysis.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

from results_file import write_results

from swiftkv_jax.distill.model_flops import FORMULA

PRESETS = {
    # runs in ~1 minute on 2 CPU cores
    "cpu": dict(model=dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=32),
                l=4, batch=4, seq_len=512, chunk=128, dtype="float32", frozen_dtype="float32", steps=5),
    # Llama-3.2-1B shapes (tied embeddings), bf16 compute, one 8K-token packed sequence per step
    "1b": dict(model=dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                          rope_theta=500000.0),
               l=8, batch=1, seq_len=8192, chunk=1024, dtype="bfloat16", frozen_dtype="bfloat16", steps=10),
}
CHILD_FLAG = "--child"


def _child(preset_name: str, variant: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import swiftkv_jax as sk
    from swiftkv_jax.distill import loss as losses
    from swiftkv_jax.distill import step as step_lib
    from swiftkv_jax.distill import trainable as trainable_lib
    from swiftkv_jax.distill.model_flops import distill_step_flops
    from swiftkv_jax.distill.config import LossSection, OptimSection
    from swiftkv_jax.model.config import RopeConfig

    preset = PRESETS[preset_name]
    model_kw = dict(preset["model"])
    rope = RopeConfig(theta=model_kw.pop("rope_theta", 10000.0))
    config = sk.ModelConfig(**model_kw, rope=rope, param_dtype=preset["frozen_dtype"], dtype=preset["dtype"],
                            remat="full")
    student = sk.to_swiftkv(sk.init(config, 0), preset["l"], 1)
    b, t = preset["batch"], preset["seq_len"]
    rng = np.random.default_rng(0)
    batch = {"tokens": jnp.asarray(rng.integers(0, config.vocab_size, (b, t)), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
             "segment_ids": jnp.ones((b, t), jnp.int32), "loss_mask": jnp.ones((b, t), jnp.int32)}
    optim, loss_cfg = OptimSection(), LossSection(chunk_size=preset["chunk"])
    optimizer = step_lib.make_optimizer(optim, 1000)
    trainable, frozen = trainable_lib.split(student.params)
    trainable = jax.tree.map(lambda a: a.astype(jnp.float32), trainable)

    if variant == "ours":
        state = step_lib.TrainState(jnp.zeros((), jnp.int32), trainable, optimizer.init(trainable))
        fn = jax.jit(functools.partial(step_lib.train_step, config=student.config, loss=loss_cfg, optimizer=optimizer,
                                       schedule=step_lib.learning_rate_schedule(optim, 1000)), donate_argnums=(0,))
        args = (state, frozen, batch)
        run = lambda args: (fn(*args)[0], args[1], args[2])
    else:
        params = jax.tree.map(lambda a: a.astype(jnp.float32), student.params)  # one fp32 master tree
        mask = jax.tree.map(lambda _: False, params)
        mask = trainable_lib.merge(jax.tree.map(lambda _: True, trainable), trainable_lib.split(mask)[1])

        def naive_step(params, opt_state, batch):
            def objective(params):
                fwd = functools.partial(sk.forward, params, batch["tokens"], batch["positions"],
                                        batch["segment_ids"], config=student.config)
                teacher = jax.lax.stop_gradient(fwd(swiftkv=False))
                kl = losses.kl_per_position(teacher, fwd(swiftkv=True), loss_cfg.temperature)
                return loss_cfg.temperature**2 * jnp.mean(kl)
            loss, grads = jax.value_and_grad(objective)(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            updates = jax.tree.map(lambda u, m: u * m, updates, mask)
            return optax.apply_updates(params, updates), opt_state, loss

        fn = jax.jit(naive_step, donate_argnums=(0, 1))
        args = (params, optimizer.init(params), batch)
        run = lambda args: (*fn(*args)[:2], args[2])

    compiled = fn.lower(*args).compile()
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    args = run(args)  # warm-up (includes nothing compiled twice: same shapes)
    jax.block_until_ready(args)
    times = []
    for _ in range(preset["steps"]):
        start = time.perf_counter()
        args = run(args)
        jax.block_until_ready(args)
        times.append(time.perf_counter() - start)
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    xla_bytes = (memory.argument_size_in_bytes + memory.temp_size_in_bytes + memory.output_size_in_bytes
                 - memory.alias_size_in_bytes)
    return {
        "variant": variant, "step_s": statistics.median(times), "tokens_per_step": b * t,
        "xla_peak_bytes": int(xla_bytes), "xla_temp_bytes": int(memory.temp_size_in_bytes),
        "device_peak_bytes": stats.get("peak_bytes_in_use"), "flops_per_step": float(cost.get("flops", 0.0)),
        "model_flops_per_step": distill_step_flops(student.config, t).total * b * t,
        "platform": device.platform, "device_kind": device.device_kind,
        "trainable_params": sum(x.size for x in jax.tree.leaves(trainable)),
        "params": sum(x.size for x in jax.tree.leaves(student.params)),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H100/H200: 989)")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/distill_step_<preset>_<platform>.json)")
    parser.add_argument(CHILD_FLAG, nargs=2, metavar=("PRESET", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(*args.child)))
        return 0

    rows = []
    for variant in ("ours", "naive"):
        out = subprocess.run([sys.executable, __file__, CHILD_FLAG, args.preset, variant], capture_output=True,
                             text=True, check=True, env=os.environ)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    ours, naive = rows
    gpu = ours["platform"] == "gpu"
    gib = lambda b: f"{b / 2**30:8.3f}" if b else "     n/a"
    print(f"distillation step, preset {args.preset} on {ours['device_kind']} ({ours['platform']}); "
          f"{ours['tokens_per_step']} tokens/step; trainable {ours['trainable_params']:,} of {ours['params']:,}")
    print(f"model FLOPs (the method's work, no recomputation): {FORMULA}")
    print(f"{'variant':<8}{'step s':>10}{'tokens/s':>12}{'XLA peak GiB':>14}{'temp GiB':>10}{'device peak GiB':>17}"
          f"{'model TFLOP':>12}{'XLA TFLOP':>11}" + (f"{'MFU':>8}{'HFU':>8}" if gpu else ""))
    for r in rows:
        r["tokens_per_s"] = r["tokens_per_step"] / r["step_s"]
        peak = args.peak_tflops * 1e12
        # MFU: model FLOPs (the same work for both variants) / time; HFU: what XLA says the compiled step executes
        r["mfu"] = r["model_flops_per_step"] / r["step_s"] / peak if gpu else None
        r["hfu"] = r["flops_per_step"] / r["step_s"] / peak if gpu else None
        print(f"{r['variant']:<8}{r['step_s']:>10.4f}{r['tokens_per_s']:>12,.0f}{gib(r['xla_peak_bytes']):>14}"
              f"{gib(r['xla_temp_bytes']):>10}{gib(r['device_peak_bytes']):>17}"
              f"{r['model_flops_per_step'] / 1e12:>12.3f}{r['flops_per_step'] / 1e12:>11.3f}"
              + (f"{r['mfu']:>8.1%}{r['hfu']:>8.1%}" if gpu else ""))
    ratios = {"time_naive_over_ours": naive["step_s"] / ours["step_s"],
              "xla_peak_naive_over_ours": naive["xla_peak_bytes"] / ours["xla_peak_bytes"],
              "flops_naive_over_ours": naive["flops_per_step"] / max(ours["flops_per_step"], 1.0)}
    if ours["device_peak_bytes"] and naive["device_peak_bytes"]:
        ratios["device_peak_naive_over_ours"] = naive["device_peak_bytes"] / ours["device_peak_bytes"]
    print("naive / ours: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))

    write_results(args.out or f"benchmarks/results/distill_step_{args.preset}_{ours['platform']}.json",
                  "benchmarks/distill_step.py", argv,
                  {"preset": args.preset, "config": PRESETS[args.preset], "results": rows, "ratios": ratios})
    return 0


if __name__ == "__main__":
    sys.exit(main())
