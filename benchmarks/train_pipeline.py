"""train.py end to end against its bare step: does the input pipeline keep up?

    python benchmarks/train_pipeline.py [--preset cpu|1b] [--work DIR] [--out JSON]

end to end: `swiftkv_jax.distill.trainer.train` (what `python train.py` runs) distilling a random-weight teacher of
the preset's shape on the standard library's source (nothing downloaded): tokenising and packing (once, cached),
reading each step's packed rows with their masks and putting them on the device while the previous step runs,
the step, metrics.jsonl every step, an asynchronous checkpoint every `checkpoint_every` steps. Its steps after the
first `skip` (warm-up) give the iteration time (train.py's `step_s`: the wall time between steps, checkpoint saves
and logging included) and the host time loading a batch (`host_s`). A save after step s shows in step s + 1's
`step_s`, so each preset times whole checkpoint periods (`timed_saves`): `steps - skip` steps holding one save per
`checkpoint_every` (not the save Orbax makes after step 1, nor the run's final one).
bare: the same compiled step (train's own trainer.load_model and trainer.build_step: the same config, mesh, and
attention sized for the rows) on one batch already on the device, dispatched back to back, blocked on once at the
end. The ratio e2e / bare in tokens/s is the issue's target
(>= 0.95 on a GPU at 1b); on the CPU the host line (load ms against step ms) is what to read.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

from results_file import DefaultsFormatter, write_results

PRESETS = {
    # the distill_step cpu preset's model on 2 CPU cores: ~1 s a step
    "cpu": dict(architecture=dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                                  num_attention_heads=8, num_key_value_heads=2, head_dim=32),
                l=4, seq_len=512, batch=4, chunk=128, dtype="float32", remat="none", attention_impl="xla",
                steps=17, skip=2, checkpoint_every=5, bare_steps=5, max_files=400, vocab=4096),
    # Llama-3.2-1B shapes, one 8K-token packed row a step, bf16 (distill_step's 1b preset; remat none: its CPU plan,
    # `distill_step.py --preset 1b --plan`, puts the step at 22.1 GiB at most without recomputation)
    "1b": dict(architecture=dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                 num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0),
               l=8, seq_len=8192, batch=1, chunk=1024, dtype="bfloat16", remat="none", attention_impl="xla_chunked",
               steps=43, skip=3, checkpoint_every=10, bare_steps=10, max_files=None, vocab=4096),
    # the test suite's: every stage in seconds (8 rows a step: the suite forces 8 CPU devices)
    "test": dict(architecture=dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16),
                 l=1, seq_len=64, batch=8, chunk=0, dtype="float32", remat="none", attention_impl="xla_chunked",
                 steps=6, skip=2, checkpoint_every=2, bare_steps=2, max_files=30, vocab=300),
}
TARGET = 0.95  # end-to-end tokens/s over the bare step's, on a GPU at 1b
TARGET_PRESET = "1b"


def timed_saves(preset: dict) -> list[int]:
    """The steps whose checkpoint save's blocking time lands in the timed steps (those after the first `skip`):
    train saves after step 1 (Orbax saves a manager's first step) and after each multiple of `checkpoint_every`,
    and a save after step s shows in step s + 1's `step_s` (the last step's save in none)."""
    every = preset["checkpoint_every"]
    return [s for s in range(1, preset["steps"]) if (s == 1 or s % every == 0) and s + 1 > preset["skip"]]


def verdict(preset_name: str, platform: str, ratio: float):
    """The target's pass/fail: judged on a GPU at the 1b preset only (None elsewhere)."""
    return ratio >= TARGET if platform == "gpu" and preset_name == TARGET_PRESET else None


def prepare(work: Path, preset: dict):
    """(corpus train split, the tokenizer, a teacher checkpoint of random weights in the preset's shape), each
    reused when an earlier run of the same preset left it in `work`."""
    import swiftkv_jax as sk
    from swiftkv_jax import checkpoints
    from swiftkv_jax.checkpoints.sidecar import read_sidecar_files
    from swiftkv_jax.data.stdlib_corpus import build_corpus, train_corpus_tokenizer
    from swiftkv_jax.model.config import RopeConfig
    from swiftkv_jax.serving import bench

    build_corpus(work / "corpus", max_files=preset["max_files"])
    tokenizer = train_corpus_tokenizer(work / "corpus", vocab_size=preset["vocab"], out_dir=work / "tokenizer")
    teacher = work / "teacher"
    if not (teacher / "config.json").is_file():
        arch = dict(preset["architecture"])
        rope = RopeConfig(theta=arch.pop("rope_theta", 10000.0))
        config = sk.ModelConfig(**{**arch, "vocab_size": max(arch["vocab_size"], len(tokenizer))}, rope=rope,
                                bos_token_id=tokenizer.bos_token_id,
                                eos_token_id=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id,
                                max_position_embeddings=max(4096, preset["seq_len"]))
        checkpoints.save(bench.random_model(config, dtype=preset["dtype"]), teacher, "hf", dtype=preset["dtype"],
                         overwrite=True, extra_files=read_sidecar_files(work / "tokenizer"))
    return work / "corpus" / "train.parquet", tokenizer, teacher


def train_config(work: Path, preset: dict, train_file: Path, teacher: Path, run_dir: Path):
    from swiftkv_jax import configuration
    from swiftkv_jax.distill.config import TrainConfig

    overrides = [f"model.teacher={teacher}", f"model.num_key_value_layers={preset['l']}",
                 f"model.frozen_dtype={preset['dtype']}", f"model.compute_dtype={preset['dtype']}",
                 f"model.remat={preset['remat']}", f"model.attention_impl={preset['attention_impl']}",
                 f"loss.chunk_size={preset['chunk']}", f"data.sources=[{{path: {train_file}, format: text}}]",
                 f"data.seq_len={preset['seq_len']}", f"data.cache_dir={work / 'cache'}",
                 f"train.global_batch_size={preset['batch']}", f"train.max_steps={preset['steps']}",
                 f"train.output_dir={run_dir}", "train.log_every=1", f"checkpoint.every={preset['checkpoint_every']}",
                 "checkpoint.keep=2", "export.hf=false", "export.orbax=false"]
    return configuration.load(TrainConfig, None, overrides)


def bare_step(config, steps: int) -> dict:
    """The trainer's compiled step on one device-resident batch, back to back: the device's rate alone."""
    import jax

    from swiftkv_jax import sharding
    from swiftkv_jax.data import Batches, build_dataset, load_tokenizer
    from swiftkv_jax.distill import step as step_lib
    from swiftkv_jax.distill import trainer

    mesh = trainer.make_mesh(config)
    dataset = build_dataset(config.data, load_tokenizer(config.model.teacher))  # the cached packed rows
    # train's own loading: its attention is sized for the rows (xla_chunked skips the keys past each query block)
    model_config, trainable, frozen = trainer.load_model(config, mesh, dataset, print_fn=lambda *_: None)
    compiled = trainer.build_step(config, model_config, mesh, trainable, jax.tree.map(lambda a: a.sharding, frozen),
                                  config.train.max_steps)
    state = compiled.init_state(trainable)
    del trainable
    fn = compiled.fn.lower(state, frozen, compiled.abstract_batch(config)).compile()
    shape = (config.train.global_batch_size, config.data.seq_len)
    rows = trainer._process_rows(step_lib.batch_sharding(mesh, sharding.LOGICAL_AXIS_RULES), shape)
    batch, _, _ = trainer._load_batch(Batches(dataset, config.train.global_batch_size, config.data.seed, rows=rows),
                                      compiled.batch_sharding, shape)
    for _ in range(2):  # warm-up
        state, metrics = fn(state, frozen, batch)
    jax.block_until_ready((state, metrics))
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = fn(state, frozen, batch)
    jax.block_until_ready((state, metrics))
    seconds = (time.perf_counter() - start) / steps
    return {"step_s": seconds, "tokens_per_step": int(jax.device_get(metrics)["tokens"]), "steps": steps,
            "max_segments_per_row": model_config.max_segments_per_row}


def measure(preset_name: str, work: Path, print_fn=print) -> dict:
    import jax

    from swiftkv_jax.data import build_dataset, load_tokenizer
    from swiftkv_jax.data.packing import max_runs
    from swiftkv_jax.distill import trainer
    from swiftkv_jax.distill.metrics import read_metrics

    preset = PRESETS[preset_name]
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    train_file, _, teacher = prepare(work, preset)
    prepare_s = time.perf_counter() - start
    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)  # ours: a fresh run each time (train.py refuses a used folder)
    config = train_config(work, preset, train_file, teacher, run_dir)
    fresh = not (work / "cache").is_dir()
    start = time.perf_counter()
    packed = build_dataset(config.data, load_tokenizer(teacher))  # tokenise + pack once, cached for the run below
    pack_s = time.perf_counter() - start
    start = time.perf_counter()
    trainer.train(config, print_fn=lambda *_: None)
    train_s = time.perf_counter() - start
    records = read_metrics(run_dir / "metrics.jsonl")[preset["skip"]:]
    bare = bare_step(config, preset["bare_steps"])
    step_s = statistics.fmean(r["step_s"] for r in records)
    tokens = statistics.fmean(r["tokens"] for r in records)
    row_tokens = preset["batch"] * preset["seq_len"]
    e2e = {"steps": len(records), "step_s_mean": step_s,
           "step_s_median": statistics.median(r["step_s"] for r in records),
           "host_s_mean": statistics.fmean(r["host_s"] for r in records),
           "host_s_max": max(r["host_s"] for r in records), "tokens_per_step": tokens, "tokens_per_s": tokens / step_s,
           "positions_per_s": row_tokens / step_s, "train_call_s": train_s,
           "checkpoint_saves_timed": len(timed_saves(preset))}
    bare["positions_per_s"] = row_tokens / bare["step_s"]
    device = jax.devices()[0]
    result = {
        "preset": preset_name, "config": preset, "platform": device.platform, "device_kind": device.device_kind,
        "prepare_s": prepare_s, "packing": {"seconds": pack_s, "rows": len(packed), "fresh": fresh,
                                            "max_runs": max_runs(packed),
                                            "ms_per_step_share": 1e3 * pack_s * preset["batch"] / len(packed)},
        "end_to_end": e2e, "bare": bare,
        # per packed position: a row's padding counts the same in both (the bare batch is one of the run's)
        "end_to_end_over_bare": e2e["positions_per_s"] / bare["positions_per_s"],
        "host_over_step": e2e["host_s_mean"] / bare["step_s"], "target": TARGET,
    }
    result["pass"] = verdict(preset_name, device.platform, result["end_to_end_over_bare"])
    print_fn(f"train.py end to end, preset {preset_name} on {device.device_kind} ({device.platform}): "
             f"{preset['batch']} x {preset['seq_len']} tokens a step, checkpoint every {preset['checkpoint_every']}")
    print_fn(f"  host per step (read packed rows + device_put, beside the running step): "
             f"{1e3 * e2e['host_s_mean']:.2f} ms mean, {1e3 * e2e['host_s_max']:.2f} ms max; "
             f"bare step {1e3 * bare['step_s']:.1f} ms ({result['host_over_step']:.2%} of it)")
    print_fn(f"  packing (tokenise + pack the corpus, {'fresh' if fresh else 'from the cache'}): {pack_s:.2f} s for "
             f"{len(packed)} rows, {result['packing']['ms_per_step_share']:.2f} ms per step's rows")
    print_fn(f"  end to end {1e3 * step_s:.1f} ms a step ({e2e['tokens_per_s']:,.0f} tokens/s) against bare "
             f"{1e3 * bare['step_s']:.1f} ms: {result['end_to_end_over_bare']:.3f} of the bare step's rate "
             f"(target {TARGET} on a GPU at 1b" + (f": {'PASS' if result['pass'] else 'FAIL'})" if result["pass"]
                                                   is not None else ")"))
    return result


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                        help="teacher shape, rows, steps and checkpoint period (PRESETS): cpu ~1 s a step on 2 CPU "
                             "cores, 1b Llama-3.2-1B's shapes (the target's), test the test suite's")
    parser.add_argument("--work", type=Path, default=None,
                        help="corpus, tokenizer, teacher and the run (default artifacts/train_pipeline_<preset>)")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/train_pipeline_<preset>_<platform>.json)")
    return parser


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    result = measure(args.preset, args.work or Path(f"artifacts/train_pipeline_{args.preset}"))
    write_results(args.out or f"benchmarks/results/train_pipeline_{args.preset}_{result['platform']}.json",
                  "benchmarks/train_pipeline.py", argv, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
