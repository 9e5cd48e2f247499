"""Checkpoint I/O: peak host memory and time of HF import/export and Orbax save/restore.

    python benchmarks/checkpoint_io.py [--hidden 1024 --layers 8 --vocab 32000] \
        [--out benchmarks/results/checkpoint_io_cpu.json]

Each load runs in a fresh process that samples its own anonymous resident memory (RssAnon: what the
process allocated, excluding the page cache of memory-mapped checkpoint files) every 5 ms. The peak above
the post-import baseline is reported as a multiple of the loaded parameters' bytes: streaming import
targets ~1x (on CPU the parameters themselves live in host memory) plus one stacked parameter in flight.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from results_file import DefaultsFormatter, write_results

CHILD_FLAG = "--child-load"


def _rss_anon_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("RssAnon not in /proc/self/status (Linux only)")


def peak_rss_anon_above(fn, period: float = 0.005):
    """(fn(), the peak of this process's anonymous resident memory while fn ran, less its value before), RssAnon
    sampled every `period` seconds on a thread (Linux). tests/test_training_memory.py's child measures with it too."""
    baseline = _rss_anon_bytes()
    peak, done = [baseline], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_anon_bytes())
            time.sleep(period)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = fn()
    finally:
        done.set()
        sampler.join()
    return result, max(peak[0], _rss_anon_bytes()) - baseline


def _child_load(path: str, dtype: str) -> None:
    import jax

    import swiftkv_jax as sk

    jax.numpy.zeros(1).block_until_ready()  # backend up before the baseline

    def load():
        start = time.perf_counter()
        model = sk.load(path, dtype=None if dtype == "stored" else dtype)
        jax.block_until_ready(model.params)
        return model, time.perf_counter() - start

    (model, seconds), peak = peak_rss_anon_above(load)
    leaves = jax.tree.leaves(model.params)
    param_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
    largest = max(leaf.size * leaf.dtype.itemsize for leaf in leaves)
    print(json.dumps({"seconds": seconds, "peak_above_baseline": peak, "param_bytes": param_bytes,
                      "largest_param_bytes": largest}))


def _measure_load(path: Path, dtype: str) -> dict:
    out = subprocess.run([sys.executable, __file__, CHILD_FLAG, str(path), dtype], check=True,
                         capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsFormatter)
    parser.add_argument("--hidden", type=int, default=1024,
                        help="the random model's hidden size (heads of 64, MLP 4x, KV heads hidden / 256)")
    parser.add_argument("--layers", type=int, default=8, help="the random model's layers")
    parser.add_argument("--vocab", type=int, default=32000, help="the random model's vocabulary")
    parser.add_argument("--out", default="benchmarks/results/checkpoint_io_cpu.json", help="JSON path")
    args = parser.parse_args()

    import jax

    import swiftkv_jax as sk

    d = args.hidden
    cfg = sk.ModelConfig(vocab_size=args.vocab, hidden_size=d, intermediate_size=4 * d,
                         num_hidden_layers=args.layers, num_attention_heads=d // 64,
                         num_key_value_heads=max(1, d // 256), head_dim=64)
    model = sk.init(cfg, 0)
    n_params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(model.params))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        timings = {}
        for name, kwargs in [("hf", dict(format="hf", max_shard_size="256MB")), ("orbax", dict(format="orbax"))]:
            start = time.perf_counter()
            sk.save(model, tmp / name, **kwargs)
            timings[name] = time.perf_counter() - start
        for source, dtype in [("hf", "stored"), ("hf", "bfloat16"), ("orbax", "stored")]:
            result = _measure_load(tmp / source, dtype)
            rows.append({
                "source": source, "load_dtype": dtype, "save_s": timings[source], "load_s": result["seconds"],
                "peak_host_over_params": result["peak_above_baseline"] / result["param_bytes"],
                "largest_param_over_params": result["largest_param_bytes"] / result["param_bytes"],
                "param_mb": result["param_bytes"] / 2**20,
            })

    print(f"model: {n_params / 1e6:.0f}M params (fp32 on disk), {platform.processor() or platform.machine()}, "
          f"jax {jax.__version__} on {jax.default_backend()}")
    header = (f"{'source':7} {'load as':9} {'save s':>7} {'load s':>7} {'params MB':>10} {'peak/params':>12} "
              f"{'largest/params':>15}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['source']:7} {r['load_dtype']:9} {r['save_s']:7.2f} {r['load_s']:7.2f} {r['param_mb']:10.0f} "
              f"{r['peak_host_over_params']:12.2f} {r['largest_param_over_params']:15.2f}")
    write_results(args.out, "benchmarks/checkpoint_io.py", None,
                  {"params": n_params, "jax": jax.__version__, "backend": jax.default_backend(), "rows": rows})


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == CHILD_FLAG:
        _child_load(sys.argv[2], sys.argv[3])
    else:
        main()
