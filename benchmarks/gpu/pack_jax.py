"""What the GPU pack asks of JAX and the installed packages, each in its own process (the runner imports neither):

    python benchmarks/gpu/pack_jax.py probe                 # versions, devices, unmet requirements, imports: JSON
    python benchmarks/gpu/pack_jax.py fit --preset llama-3.1-8b --gen-len 128 --tokens-per-call 65536 \
        --points 2048x1,8192x16                             # bytes each bench point needs: JSON
    python benchmarks/gpu/pack_jax.py teacher DIR [--preset tiny]   # a teacher folder holding only config.json

`fit` runs on shapes alone (jax.eval_shape; run it with JAX_PLATFORMS=cpu so that it never touches the GPU).
What `infer.py bench` holds at its peak, per point: the weights twice (the stacked tree and the serving layout
it unstacks), the teacher wiring's KV cache (the larger of the two wirings) for prompt + generated tokens, and
the prefill's activations, about batch x chunk x (4 D + 3 F) values in the compute dtype (the residual stream,
q/k/v and attention output, and the MLP's gate, up and product), plus 1 GiB for the rest. An estimate:
a point that passes it can still run out of memory, and is then recorded as failed.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import platform
import sys
from pathlib import Path

from pack_runner import help_formatters
from pack_steps import parse_points, prefill_chunk
from pack_wheels import PINS, normalize, project_requirements, read_pins, unmet

SLACK_BYTES = 2**30
ALSO_REPORTED = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "nvidia-cudnn-cu13",
                 "nvidia-cuda-runtime", "torch", "packaging")


def _tree_bytes(tree) -> int:
    import jax
    import numpy as np

    return int(sum(np.prod(a.shape, dtype=np.int64) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)))


def fit(preset: str, points, gen_len: int, tokens_per_call: int, dtype="bfloat16", cache_dtype="bfloat16") -> list:
    """[{prompt_len, batch, prefill_chunk, weight_bytes, kv_bytes, activation_bytes, need_bytes}] per point."""
    import jax
    import numpy as np

    import swiftkv_jax as sk
    from swiftkv_jax.serving import bench
    from swiftkv_jax.serving.cache import init_cache

    cfg = bench.preset_config(preset).replace(param_dtype=dtype, dtype=dtype)
    weight_bytes = _tree_bytes(sk.abstract_params(cfg))
    itemsize = np.dtype(dtype).itemsize
    rows = []
    for prompt_len, batch in points:
        cache = jax.eval_shape(lambda: init_cache(cfg, batch, prompt_len + gen_len, False, cache_dtype))
        chunk = prefill_chunk(prompt_len, batch, tokens_per_call)
        activations = batch * chunk * (4 * cfg.hidden_size + 3 * cfg.intermediate_size) * itemsize
        kv = _tree_bytes(cache)
        rows.append({"prompt_len": prompt_len, "batch": batch, "prefill_chunk": chunk, "weight_bytes": weight_bytes,
                     "kv_bytes": kv, "activation_bytes": activations,
                     "need_bytes": 2 * weight_bytes + kv + activations + SLACK_BYTES})
    return rows


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def probe() -> dict:
    """Python, JAX and its devices, the versions of what we need, what is unmet, and whether we import."""
    from packaging.requirements import Requirement

    needs = project_requirements()
    for name in read_pins(PINS):
        if _installed(name):
            needs += [(r, name) for r in importlib.metadata.requires(name) or ()]
    names = {normalize(Requirement(text).name) for text, _ in needs} | set(read_pins(PINS)) | set(ALSO_REPORTED)
    versions = {name: _installed(name) for name in sorted(names)}
    out = {"python": platform.python_version(), "executable": sys.executable, "versions": versions,
           "unmet": unmet(needs, {n: (v, "installed") for n, v in versions.items() if v})}
    imports = {}
    for module in ("swiftkv_jax", "datasets", "swiftkv_jax.distill.trainer"):
        try:
            importlib.import_module(module)
            imports[module] = "ok"
        except Exception as e:  # noqa: BLE001 - reported, never hidden
            imports[module] = f"{type(e).__name__}: {e}"[:300]
    out["imports"] = imports
    try:
        import jax

        out["jax"], out["backend"] = jax.__version__, jax.default_backend()
        out["devices"] = [{"platform": d.platform, "kind": d.device_kind,
                           "bytes_limit": (d.memory_stats() or {}).get("bytes_limit")} for d in jax.devices()]
    except Exception as e:  # noqa: BLE001
        out["jax_error"] = f"{type(e).__name__}: {e}"[:500]
    return out


def write_teacher(directory, preset: str) -> Path:
    """A teacher folder holding only the preset's plain (non-SwiftKV) config.json: enough for train.py --dry-run."""
    from swiftkv_jax.serving import bench

    hf = {"llama-3.1-8b": bench.LLAMA_3_1_8B, "tiny": bench.TINY}[preset]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf, indent=2))
    return directory


def main(argv=None) -> int:
    defaults, _ = help_formatters()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    command = functools.partial(sub.add_parser, formatter_class=defaults)  # each option says its default
    command("probe", help="versions, devices, unmet requirements and imports, as JSON")
    f = command("fit", help="the bytes each bench point needs (shapes alone), as JSON")
    f.add_argument("--preset", required=True, help="serving.bench's preset of the model")
    f.add_argument("--points", required=True, type=parse_points, help="bench points PROMPTxBATCH,...")
    f.add_argument("--gen-len", type=int, required=True, help="tokens generated a point")
    f.add_argument("--tokens-per-call", type=int, required=True,
                   help="batch x prefill chunk at most this (the prompt halved until it fits)")
    t = command("teacher", help="a teacher folder holding only the preset's config.json (train.py --dry-run)")
    t.add_argument("directory", help="the folder (made if missing)")
    t.add_argument("--preset", choices=("llama-3.1-8b", "tiny"), default="llama-3.1-8b", help="the teacher's shape")
    args = parser.parse_args(argv)
    if args.command == "probe":
        print(json.dumps(probe()))
    elif args.command == "fit":
        print(json.dumps(fit(args.preset, args.points, args.gen_len, args.tokens_per_call)))
    else:
        print(json.dumps({"teacher": str(write_teacher(args.directory, args.preset))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
