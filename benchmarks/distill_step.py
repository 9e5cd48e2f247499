"""Distillation step: ours against a naive step, same model and batch, measured side by side in one run.

    python benchmarks/distill_step.py [--preset cpu|1b|8b] [--variants ours,naive] [--out JSON]
    python benchmarks/distill_step.py --preset 8b --plan      # XLA's peak memory of every remat policy, no weights
    python benchmarks/distill_step.py --preset 1b --profile 2 # and where each step's device time goes

ours  = swiftkv_jax.distill.step.train_step: layers < l once, teacher's later layers without gradients,
        backward through the student's later layers only, optimizer state for the trainable 5-7% only,
        KL in sequence chunks.
naive = two full forwards (teacher and student wiring) from the embeddings, backward through the whole
        student, AdamW state for every weight (updates of frozen weights masked to zero), full-vocab KL; at 8b
        AdamW for the trainable only (an fp32 AdamW of all 8B weights fits no single GPU), every weight's
        gradient still computed (it enters the global-norm clip).

remat "auto" (1b, 8b): each policy (none, dots, full) is compiled on abstract inputs first and the one with least
recomputation whose XLA peak is within 85% of an 80 GB H100 runs (on a GPU, XLA's own figure; on a CPU an upper
bound, see plan_row).

Each variant runs in its own process, so peaks do not mix. Memory: XLA's accounting of the compiled step
(arguments + temporaries + outputs - aliased), plus the device's peak bytes in use where the backend
reports it (GPU). Time: median of the timed steps. MFU in model FLOPs (`swiftkv_jax.distill.model_flops`: the
method's work, causal attention at half, no recomputation; the same numerator for both variants) against
--peak-tflops, the accelerator's dense bf16 peak; HFU from XLA's cost analysis of the compiled step, which counts a
loop's body once (the layers run in a scan), so it undercounts: on the cpu preset 0.028 TFLOP against 0.087 of model
FLOPs. MFU is the figure to read; earlier results' "mfu" came from that cost analysis.

Profile (--profile N, default 2 on a GPU): N more steps under jax's profiler, after the timed ones, of the same
step compiled again without XLA's command buffers on a GPU (their CUDA graphs hide each op from the trace);
benchmarks/op_profile.py splits their device time into matmuls (with their TFLOP/s, counted from the HLO's
dots), cuDNN attention, Pallas kernels, fusions and copies, and names the costliest ops. "prof. HFU": the FLOPs
the profiled step's matmuls and cuDNN attention executed (every loop trip and recomputation counted) over the timed
step time.
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

import op_profile
from results_file import DefaultsFormatter, write_results

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
               l=8, batch=1, seq_len=8192, chunk=1024, dtype="bfloat16", frozen_dtype="bfloat16", steps=10,
               attention_impl="xla_chunked", remat="auto"),
    # Llama-3.1-8B shapes (serving.bench's llama-3.1-8b), SwiftKV at l = 16, one 8K-token packed sequence per step,
    # frozen weights bf16, trainable weights and AdamW state fp32. remat "auto": the least recomputation whose
    # compiled peak fits 85% of an 80 GB H100 (plan_row; --plan prints every policy). The naive step's AdamW covers
    # the trainable weights only (an fp32 master + AdamW of all 8B weights, ~135 GB, fits no single GPU); it still
    # computes every weight's gradient, two full forwards and the full-vocabulary KL.
    "8b": dict(model="llama-3.1-8b", l=16, batch=1, seq_len=8192, chunk=1024, dtype="bfloat16",
               frozen_dtype="bfloat16", steps=5, attention_impl="xla_chunked", remat="auto",
               naive_adam="trainable"),
    # the test suite's: the plan and the arguments, in seconds
    "test": dict(model=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16),
                 l=2, batch=2, seq_len=64, chunk=32, dtype="float32", frozen_dtype="float32", steps=2),
}
VARIANTS = ("ours", "naive")
REMATS = ("none", "dots", "full")  # swiftkv_jax.model.config.REMAT_POLICIES, least recomputation first
H100_BYTES = 80 * 10**9  # the budget: one H100 80 GB
PLAN_MARGIN = 0.85  # a plan fits when XLA's peak is at most this share of the budget (fragmentation, cuBLAS, NCCL)
CHILD_FLAG = "--child"


def parse_attention(spec: str) -> tuple:
    """"cudnn:8" -> ("cudnn", 8): an attention_impl, and for cuDNN the most runs of segment ids per row it is built
    for (its packed layout); plain "cudnn" gets the preset's rows' own (one document: 1, plain causal), as train.py
    sets it from its data."""
    impl, _, runs = spec.partition(":")
    if runs and (impl != "cudnn" or not runs.isdigit() or int(runs) < 1):
        raise ValueError(f"attention {spec!r}: only cudnn takes a bound on runs per row (cudnn:N, N >= 1)")
    return impl, int(runs) if runs else None


def model_config(preset: dict, remat: str):
    """The student's ModelConfig of a preset (SwiftKV at its l, g = 1) with `remat`; its rows are one document
    (`_build`'s batch), so cuDNN attention gets one run per row unless the preset's attention names a bound, and
    `xla_chunked` skips the keys past each query block (both as train.py sets them from its packed data)."""
    import swiftkv_jax as sk
    from swiftkv_jax.model.config import RopeConfig
    from swiftkv_jax.serving import bench

    runtime = dict(param_dtype=preset["frozen_dtype"], dtype=preset["dtype"])
    if isinstance(preset["model"], str):
        config = bench.preset_config(preset["model"], **runtime)
    else:
        model_kw = dict(preset["model"])
        rope = RopeConfig(theta=model_kw.pop("rope_theta", 10000.0))
        config = sk.ModelConfig(**model_kw, rope=rope, **runtime)
    impl, runs = parse_attention(preset.get("attention_impl", config.attention_impl))
    return config.replace(num_key_value_layers=preset["l"], key_value_group_size=1, remat=remat, attention_impl=impl,
                          max_segments_per_row=(runs or 1) if impl in ("cudnn", "xla_chunked") else None)


def _build(preset: dict, variant: str, remat: str, abstract: bool):
    """(jitted step, its arguments, run: (step, args) -> next args, student config, counts); `step` is the jitted
    step or its compiled executable. abstract: the arguments are ShapeDtypeStructs (nothing allocated; for compiling
    the step to read its memory)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import swiftkv_jax as sk
    from swiftkv_jax.distill import loss as losses
    from swiftkv_jax.distill import step as step_lib
    from swiftkv_jax.distill import trainable as trainable_lib
    from swiftkv_jax.distill.config import LossSection, OptimSection
    from swiftkv_jax.serving import bench

    config = model_config(preset, remat)
    b, t = preset["batch"], preset["seq_len"]
    if abstract:
        params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(preset["frozen_dtype"])),
                              sk.abstract_params(config))
        batch = {k: jax.ShapeDtypeStruct((b, t), jnp.int32) for k in step_lib.BATCH_KEYS}
    else:
        params = bench.random_model(config, dtype=preset["frozen_dtype"]).params
        rng = np.random.default_rng(0)
        batch = {"tokens": jnp.asarray(rng.integers(0, config.vocab_size, (b, t)), jnp.int32),
                 "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
                 "segment_ids": jnp.ones((b, t), jnp.int32), "loss_mask": jnp.ones((b, t), jnp.int32)}
    fp32 = lambda tree: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32) if abstract else a.astype(jnp.float32), tree)
    init = lambda fn, *a: jax.eval_shape(fn, *a) if abstract else fn(*a)
    optim, loss_cfg = OptimSection(), LossSection(chunk_size=preset["chunk"])
    optimizer = step_lib.make_optimizer(optim, 1000)
    trainable, frozen = trainable_lib.split(params)
    trainable = fp32(trainable)
    counts = {"trainable_params": sum(x.size for x in jax.tree.leaves(trainable)),
              "params": sum(x.size for x in jax.tree.leaves(params))}

    if variant == "ours":
        state = init(lambda t: step_lib.TrainState(jnp.zeros((), jnp.int32), t, optimizer.init(t)), trainable)
        fn = jax.jit(functools.partial(step_lib.train_step, config=config, loss=loss_cfg, optimizer=optimizer,
                                       schedule=step_lib.learning_rate_schedule(optim, 1000)), donate_argnums=(0,))
        return fn, (state, frozen, batch), lambda step, args: (step(*args)[0], args[1], args[2]), config, counts

    if preset.get("naive_adam", "all") == "all":  # one fp32 master tree, AdamW state for every weight
        params = fp32(params)
        labels = trainable_lib.merge(jax.tree.map(lambda _: "train", trainable),
                                     jax.tree.map(lambda _: "frozen", trainable_lib.split(params)[1]))
        naive_opt = optax.chain(optimizer, optax.multi_transform(
            {"train": optax.identity(), "frozen": optax.set_to_zero()}, labels))
    else:  # frozen weights as stored, fp32 trainable master; AdamW state for the trainable only
        params = trainable_lib.merge(trainable, frozen)
        labels = trainable_lib.merge(jax.tree.map(lambda _: "train", trainable),
                                     jax.tree.map(lambda _: "frozen", frozen))
        # every weight's gradient is computed and enters the global-norm clip, as in the "all" form
        adamw = optax.adamw(step_lib.learning_rate_schedule(optim, 1000), b1=optim.b1, b2=optim.b2, eps=optim.eps,
                            weight_decay=optim.weight_decay)
        naive_opt = optax.chain(optax.clip_by_global_norm(optim.grad_clip), optax.multi_transform(
            {"train": adamw, "frozen": optax.set_to_zero()}, labels))

    def naive_step(params, opt_state, batch):
        def objective(params):
            fwd = functools.partial(sk.forward, params, batch["tokens"], batch["positions"],
                                    batch["segment_ids"], config=config)
            teacher = jax.lax.stop_gradient(fwd(swiftkv=False))
            kl = losses.kl_per_position(teacher, fwd(swiftkv=True), loss_cfg.temperature)
            return loss_cfg.temperature**2 * jnp.mean(kl)
        loss, grads = jax.value_and_grad(objective)(params)
        updates, opt_state = naive_opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    fn = jax.jit(naive_step, donate_argnums=(0, 1))
    return (fn, (params, init(naive_opt.init, params), batch), lambda step, args: (*step(*args)[:2], args[2]), config,
            counts)


def memory_record(compiled) -> dict:
    """XLA's accounting of a compiled step: arguments, temporaries, outputs, aliases, and its peak."""
    m = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "temp_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
              "peak_memory_in_bytes")
    record = {f.replace("_size_in_bytes", "_bytes").replace("_memory_in_bytes", "_bytes"): int(getattr(m, f, 0))
              for f in fields}
    record["xla_peak_bytes"] = (record["argument_bytes"] + record["temp_bytes"] + record["output_bytes"]
                                - record["alias_bytes"])
    return record


def _tree_bytes(tree) -> int:
    import jax
    import numpy as np

    return int(sum(np.prod(a.shape, dtype=np.int64) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)))


def plan_row(preset: dict, variant: str, remat: str, budget: int = H100_BYTES,
             executables: dict | None = None) -> dict:
    """XLA's memory accounting of one step compiled on abstract arguments (nothing allocated). executables: where
    the compiled step is kept by remat policy when it is the one that runs (not the CPU's fp32 proxy), so that the
    step measured under this policy is not compiled twice (8b on a GPU: 25 s a compile).

    On a GPU the step is compiled as it runs: the figure is XLA's own. On a CPU a bf16 step is no guide (the CPU
    converts bf16 weights to fp32 for its matmuls, whole stacked weights at a time: 3.8 GB each of 8B's MLP), so the
    estimate is the step's arguments in their own dtypes (exact) plus the temporaries of the same step compiled in
    fp32: an upper bound, as each bf16 buffer is half its fp32 counterpart and the fp32 ones are fp32 either way."""
    import jax

    start = time.perf_counter()
    fn, args, _, _, counts = _build(preset, variant, remat, abstract=True)
    proxy = jax.devices()[0].platform == "cpu" and "float32" != preset["dtype"]
    if proxy:
        fn, proxy_args, _, _, _ = _build(dict(preset, dtype="float32", frozen_dtype="float32"), variant, remat,
                                         abstract=True)
        memory = memory_record(fn.lower(*proxy_args).compile())
        memory["argument_bytes"] = _tree_bytes(args)
        memory["xla_peak_bytes"] = (memory["argument_bytes"] + memory["temp_bytes"] + memory["output_bytes"]
                                    - memory["alias_bytes"])
    else:
        compiled = fn.lower(*args).compile()
        memory = memory_record(compiled)
        if executables is not None:
            executables[remat] = compiled
    return {"variant": variant, "remat": remat, "compile_s": round(time.perf_counter() - start, 1),
            "estimate": "cpu: arguments + fp32 temporaries (upper bound)" if proxy else "xla",
            **counts, **memory, "fits": memory["xla_peak_bytes"] <= PLAN_MARGIN * budget}


def choose_remat(rows: list) -> str | None:
    """The policy with least recomputation (REMATS order) whose planned peak fits, or None."""
    fitting = {r["remat"] for r in rows if r["fits"]}
    return next((r for r in REMATS if r in fitting), None)


def plan(preset_name: str, remats=REMATS, variants=VARIANTS, budget: int = H100_BYTES, print_fn=print) -> dict:
    """Plan rows for each remat policy (ours) and the naive step (its preset's policy, "auto" as ours'); the policy
    ours uses under remat "auto" is the one with least recomputation within PLAN_MARGIN of `budget`."""
    import jax

    preset = PRESETS[preset_name]
    rows = []
    for variant in variants:
        for remat in (remats if variant == "ours" else (preset.get("naive_remat", "full"),)):
            row = plan_row(preset, variant, remat, budget)
            rows.append(row)
            print_fn(f"plan {preset_name} {variant:<6} remat {remat:<5}: peak {row['xla_peak_bytes'] / 2**30:7.2f} GiB "
                     f"(arguments {row['argument_bytes'] / 2**30:.2f}, temporaries {row['temp_bytes'] / 2**30:.2f}, "
                     f"outputs {row['output_bytes'] / 2**30:.2f}, aliased {row['alias_bytes'] / 2**30:.2f}; "
                     f"{row['estimate']}): {'fits' if row['fits'] else 'does NOT fit'} {PLAN_MARGIN:.0%} of "
                     f"{budget / 1e9:.0f} GB [{row['compile_s']} s]")
    chosen = choose_remat([r for r in rows if r["variant"] == "ours"])
    device = jax.devices()[0]
    print_fn(f"plan: remat {chosen!r} for ours (least recomputation that fits {PLAN_MARGIN:.0%} of "
             f"{budget / 1e9:.0f} GB); the preset's remat is {preset.get('remat', 'full')!r}")
    return {"budget_bytes": budget, "margin": PLAN_MARGIN, "platform": device.platform,
            "device_kind": device.device_kind, "rows": rows, "chosen_remat": chosen,
            "preset_remat": preset.get("remat", "full")}


def resolve_remat(preset: dict, variant: str, executables: dict | None = None) -> tuple[str, list]:
    """(the remat policy a variant runs with, the plan rows behind an "auto" choice); `executables` as plan_row."""
    remat = preset.get("remat", "full") if variant == "ours" else preset.get("naive_remat", "full")
    if remat != "auto":
        return remat, []
    rows = [plan_row(preset, variant, r, executables=executables) for r in REMATS]
    chosen = choose_remat(rows)
    for other in set(executables or ()) - {chosen}:  # only the one that runs stays alive
        del executables[other]
    if chosen is None:
        raise SystemExit(f"no remat policy fits the {variant} step within {PLAN_MARGIN:.0%} of {H100_BYTES / 1e9:.0f} "
                         f"GB: " + ", ".join(f"{r['remat']} {r['xla_peak_bytes'] / 2**30:.1f} GiB" for r in rows))
    return chosen, rows


def _child(preset_name: str, variant: str, attention_impl: str, profile: int = 0, emit=lambda row: None) -> dict:
    """Time one variant; `emit(row)` the row as soon as it is timed and again with its profile (a profiler that
    takes the process down leaves the timed row behind)."""
    import jax

    from swiftkv_jax.distill.model_flops import distill_step_flops

    preset = dict(PRESETS[preset_name], attention_impl=attention_impl)
    executables = {}
    remat, plan_rows = resolve_remat(preset, variant, executables)
    fn, args, run, config, counts = _build(preset, variant, remat, abstract=False)
    compiled = executables.get(remat) or fn.lower(*args).compile()
    memory = memory_record(compiled)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    args = run(compiled, args)  # warm-up: the executable compiled above runs every step
    jax.block_until_ready(args)
    times = []
    for _ in range(preset["steps"]):
        start = time.perf_counter()
        args = run(compiled, args)
        jax.block_until_ready(args)
        times.append(time.perf_counter() - start)
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    b, t = preset["batch"], preset["seq_len"]
    row = {
        "variant": variant, "remat": config.remat, "attention_impl": attention_impl,
        "max_segments_per_row": config.max_segments_per_row,
        "step_s": statistics.median(times), "step_times_s": times, "tokens_per_step": b * t,
        "xla_peak_bytes": memory["xla_peak_bytes"], "xla_temp_bytes": memory["temp_bytes"], "xla_memory": memory,
        "device_peak_bytes": stats.get("peak_bytes_in_use"), "device_limit_bytes": stats.get("bytes_limit"),
        "flops_per_step": float(cost.get("flops", 0.0)),
        "model_flops_per_step": distill_step_flops(config, t).total * b * t,
        "platform": device.platform, "device_kind": device.device_kind, **counts, "remat_plan": plan_rows,
    }
    emit(row)
    if profile:  # after the timed steps, so tracing costs them nothing
        state = [args]
        try:  # a copy without command buffers on a GPU, so the trace names each op (op_profile)
            profiled = op_profile.compile_for_profile(fn.lower(*args)) if device.platform == "gpu" else compiled

            def one_step():
                state[0] = run(profiled, state[0])
                return state[0]

            row["profile"] = op_profile.profile_steps(one_step, profile, profiled.as_text())
        except Exception as e:  # recorded and printed: the timed row stands without it
            row["profile_error"] = f"{type(e).__name__}: {e}"
        emit(row)
    return row


def child_rows(stdout: str) -> list:
    """The rows a child emitted (JSON lines), last the most complete."""
    rows = []
    for line in stdout.splitlines():
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by the process's death
                pass
    return rows


def _print_rows(rows: list, preset: str, peak_tflops: float) -> dict:
    """The table of measured variants; the naive / ours ratios when both ran."""
    first = rows[0]
    gpu = first["platform"] == "gpu"
    gib = lambda b: f"{b / 2**30:8.3f}" if b else "     n/a"
    print(f"distillation step, preset {preset} on {first['device_kind']} ({first['platform']}); "
          f"{first['tokens_per_step']} tokens/step; trainable {first['trainable_params']:,} of {first['params']:,}")
    print(f"model FLOPs (the method's work, no recomputation): {FORMULA}")
    print(f"{'variant':<8}{'attention':>12}{'remat':>6}{'step s':>10}{'tokens/s':>12}{'XLA peak GiB':>14}"
          f"{'temp GiB':>10}{'device peak GiB':>17}{'model TFLOP':>12}{'XLA TFLOP':>11}"
          + (f"{'MFU':>8}{'HFU':>8}{'prof. HFU':>11}" if gpu else ""))
    for r in rows:
        r["tokens_per_s"] = r["tokens_per_step"] / r["step_s"]
        peak = peak_tflops * 1e12
        # MFU: model FLOPs (the same work for both variants) / time; HFU: what XLA says the compiled step executes
        r["mfu"] = r["model_flops_per_step"] / r["step_s"] / peak if gpu else None
        r["hfu"] = r["flops_per_step"] / r["step_s"] / peak if gpu else None
        # prof. HFU: the FLOPs the profiled step's matmuls and cuDNN attention executed (op_profile) / the timed step
        executed = sum(c["gflop"] for c in r["profile"]["categories"]) * 1e9 if r.get("profile") else None
        r["profiled_hfu"] = executed / r["step_s"] / peak if gpu and executed else None
        profiled_hfu = f"{r['profiled_hfu']:>11.1%}" if r["profiled_hfu"] is not None else f"{'-':>11}"
        print(f"{r['variant']:<8}{r['attention_impl']:>12}{r['remat']:>6}{r['step_s']:>10.4f}{r['tokens_per_s']:>12,.0f}"
              f"{gib(r['xla_peak_bytes']):>14}{gib(r['xla_temp_bytes']):>10}{gib(r['device_peak_bytes']):>17}"
              f"{r['model_flops_per_step'] / 1e12:>12.3f}{r['flops_per_step'] / 1e12:>11.3f}"
              + (f"{r['mfu']:>8.1%}{r['hfu']:>8.1%}{profiled_hfu}" if gpu else ""))
    by = {}
    for r in rows:  # the first attention's rows: naive runs only with it
        by.setdefault(r["variant"], r)
    if set(by) != set(VARIANTS) or by["ours"]["attention_impl"] != by["naive"]["attention_impl"]:
        return {}
    ours, naive = by["ours"], by["naive"]
    ratios = {"time_naive_over_ours": naive["step_s"] / ours["step_s"],
              "xla_peak_naive_over_ours": naive["xla_peak_bytes"] / ours["xla_peak_bytes"],
              "flops_naive_over_ours": naive["flops_per_step"] / max(ours["flops_per_step"], 1.0)}
    if ours["device_peak_bytes"] and naive["device_peak_bytes"]:
        ratios["device_peak_naive_over_ours"] = naive["device_peak_bytes"] / ours["device_peak_bytes"]
    print("naive / ours: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    return ratios


# Issue 24's targets for the 8b preset on one H100 (bf16): MFU in model FLOPs, tokens/s, and speed over the naive step
TARGETS_8B = {"mfu": 0.40, "tokens_per_s": 10_000, "time_naive_over_ours": 1.3}


def targets(rows: list, ratios: dict) -> dict:
    """PASS/FAIL of each 8b target that was measured (ours' fastest row, whose attention a recipe can pick; the
    ratio, of the first attention's rows, only when both variants ran)."""
    ours = min((r for r in rows if r["variant"] == "ours" and "step_s" in r), key=lambda r: r["step_s"], default=None)
    got = {"mfu": ours and ours.get("mfu"), "tokens_per_s": ours and ours.get("tokens_per_s"),
           "time_naive_over_ours": ratios.get("time_naive_over_ours")}
    return {k: {"target": v, "measured": got[k], "pass": got[k] >= v,
                **({"attention_impl": ours["attention_impl"]} if k != "time_naive_over_ours" else {})}
            for k, v in TARGETS_8B.items() if got[k] is not None}


def attention_impls(preset_name: str, spec=None, platform=None) -> tuple:
    """The attention impls to measure: `spec` (comma-separated; cudnn:N for cuDNN's packed layout with room for N
    documents per row), else on a GPU for the bf16 presets cuDNN's fused attention (fwd and bwd) as the rows need it
    (one document: its plain causal mask), then as packed rows of up to 8 documents need it, beside the preset's XLA
    one (the GPU run of 2026-11-24 measured XLA's attention at ~40 TFLOP/s, most of the 8b step); else the
    preset's. platform: JAX's backend (default: `backend_platform()`)."""
    from swiftkv_jax.model.attention import DIFFERENTIABLE_IMPLS

    preset = PRESETS[preset_name]
    default = preset.get("attention_impl", "xla")
    if spec is None:
        gpu = (platform or backend_platform()) == "gpu" and preset["dtype"] == "bfloat16"
        return ("cudnn", "cudnn:8", default) if gpu else (default,)
    impls = tuple(a.strip() for a in spec.split(",") if a.strip())
    try:
        names = {parse_attention(a)[0] for a in impls}
    except ValueError as e:
        raise SystemExit(f"--attention: {e}") from None
    if not impls or names - set(DIFFERENTIABLE_IMPLS):
        raise SystemExit(f"--attention {spec!r}: choose from {', '.join(DIFFERENTIABLE_IMPLS)} (they have a backward "
                         f"pass; cudnn:N packs up to N documents per row)")
    return impls


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                        help="model shape, batch, sequence length, dtypes and steps (PRESETS): cpu ~1 minute on 2 CPU "
                             "cores, 1b Llama-3.2-1B's shapes, 8b Llama-3.1-8B's, test the test suite's")
    parser.add_argument("--variants", default="ours,naive",
                        help="which steps to measure, comma-separated (ours, naive), each in its own process")
    parser.add_argument("--plan", action="store_true",
                        help="compile the step for each remat policy on abstract inputs (nothing allocated), print "
                             "XLA's peak memory against an 80 GB H100 and the policy chosen, then exit")
    parser.add_argument("--attention", default=None,
                        help="attention_impl of the steps, comma-separated: ours runs with each, naive with the first; "
                             "cudnn:N: cuDNN's packed layout for up to N documents per row (default: cudnn,cudnn:8,"
                             "xla_chunked on a GPU for the bf16 presets, else the preset's: "
                             + "; ".join(f"{name} {preset.get('attention_impl', 'xla')}"
                                         for name, preset in sorted(PRESETS.items())) + ")")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H100/H200: 989)")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/distill_step_<preset>_<platform>.json, "
                                      "with --plan distill_step_plan_<preset>_<platform>.json)")
    parser.add_argument("--profile", type=int, default=None, metavar="STEPS",
                        help="after the timed steps, trace this many more under jax's profiler and print where each "
                             "step's device time goes (benchmarks/op_profile.py: matmul TFLOP/s, attention, fusions); "
                             "default 2 on a GPU, 0 elsewhere")
    parser.add_argument(CHILD_FLAG, nargs=4, metavar=("PRESET", "VARIANT", "ATTENTION", "PROFILE"),
                        help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    parser_ = parser()
    args = parser_.parse_args(argv)
    if args.child:
        preset_name, variant, attention, profile = args.child
        _child(preset_name, variant, attention, int(profile), emit=lambda row: print(json.dumps(row), flush=True))
        return 0
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    if not variants or set(variants) - set(VARIANTS):
        parser_.error(f"--variants {args.variants!r}: choose from {', '.join(VARIANTS)}")
    if args.plan:
        import jax

        result = plan(args.preset, variants=variants)
        write_results(args.out
                      or f"benchmarks/results/distill_step_plan_{args.preset}_{jax.devices()[0].platform}.json",
                      "benchmarks/distill_step.py", argv, {"preset": args.preset, "config": PRESETS[args.preset],
                                                           "plan": result})
        return 0

    platform = backend_platform()
    attentions = attention_impls(args.preset, args.attention, platform)
    profile = (2 if platform == "gpu" else 0) if args.profile is None else args.profile
    rows, failed = [], []
    out_path = args.out or f"benchmarks/results/distill_step_{args.preset}_{platform}.json"
    for variant, attention in [(v, a) for a in attentions for v in variants if v == "ours" or a == attentions[0]]:
        out = subprocess.run([sys.executable, __file__, CHILD_FLAG, args.preset, variant, attention, str(profile)],
                             capture_output=True, text=True, env=os.environ)
        emitted = child_rows(out.stdout)
        if out.returncode != 0 and emitted:  # timed, then died profiling: the row stands, the profile is the failure
            sys.stderr.write(out.stderr[-5000:])
            emitted[-1]["profile_error"] = (f"the process died after its steps were timed (exit {out.returncode}): "
                                            + (out.stderr.strip().splitlines() or [""])[-1][-300:])
        elif out.returncode != 0:  # recorded; the other steps still run (each is its own process)
            sys.stderr.write(out.stderr[-5000:])
            print(f"the {variant} step ({attention} attention) failed (exit {out.returncode}); its error is above")
            failed.append({"variant": variant, "attention_impl": attention, "returncode": out.returncode,
                           "stderr_tail": out.stderr[-3000:]})
        if emitted:
            rows.append(emitted[-1])
        write_results(out_path, "benchmarks/distill_step.py", argv, {  # as measured: a killed run keeps its rows
            "preset": args.preset, "config": PRESETS[args.preset], "results": rows, "failed": failed, "partial": True})
    if not rows:
        raise SystemExit("every step failed; the errors are above")
    ratios = _print_rows(rows, args.preset, args.peak_tflops)
    for r in rows:
        if "profile" in r:
            op_profile.print_profile(r["profile"], f"{r['variant']} ({r['attention_impl']} attention)")
        elif "profile_error" in r:
            print(f"profile of {r['variant']} ({r['attention_impl']} attention) failed: {r['profile_error']}")
    payload = {"preset": args.preset, "config": PRESETS[args.preset], "results": rows, "failed": failed,
               "ratios": ratios}
    if args.preset == "8b" and rows[0]["platform"] == "gpu":
        payload["targets"] = targets(rows, ratios)
        print("targets (one H100, bf16): " + ", ".join(
            f"{k} {t['measured']:.3g} vs {t['target']:g} {'PASS' if t['pass'] else 'FAIL'}"
            for k, t in payload["targets"].items()))
    write_results(out_path, "benchmarks/distill_step.py", argv, payload)
    return 1 if failed else 0


def backend_platform() -> str:
    """JAX's backend platform, asked of a child process: starting the backend in this (parent) process would take
    most of the GPU's memory (XLA preallocates it) away from the processes that run the steps."""
    out = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], capture_output=True,
                         text=True, env=os.environ, check=True)
    return out.stdout.strip().splitlines()[-1]


if __name__ == "__main__":
    sys.exit(main())
