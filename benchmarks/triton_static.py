"""The Pallas Triton flash kernel as Hopper's compiler builds it, read on a CPU: MMA layouts, registers, spills, SMEM.

    pip install triton    # the compiler only: its passes and ptxas run on any x86-64 machine, no GPU
    python benchmarks/triton_static.py [--configs defaults|candidates|QxKxWxS,...] [--tokens 8192] [--head-dim 128]
                                       [--out PATH]

jax lowers our kernel (`swiftkv_jax.kernels.flash_attention`) and its bundled one (`pallas.ops.gpu.attention.mha`,
`jax_triton`, at its defaults) for CUDA sm_90 on the CPU, as a GPU run would: the Triton IR that jaxlib's GPU plugin
hands to its own Triton. pip's Triton then compiles that IR for sm_90a and we read what it built: each dot's MMA
layout (warps per CTA along the rows and columns of its tile), how many times the warps' 16-row MMA slices cover
the tile's rows (`repeat` > 1: warpgroups compute the same rows again), the registers a thread holds, the local
memory that spilled ones take, and the shared memory the launch asks for (Hopper: at most 227 KiB a CTA).

It says nothing of time: the GPU runs (`benchmarks/kernels.py`, `benchmarks/tune_kernels.py`) do. It is a proxy in
one more way: pip's Triton is not the exact Triton inside jaxlib, so a layout here is what current Triton chooses,
not a guarantee of what the GPU runs. It finds what needs no GPU to see: a tile of 64 query rows under 8 warps
gives the scores' product 2 warpgroups of 64 rows each (the tile is computed twice) and moves P between two MMA
layouts through shared memory; a 128-row tile gives each warpgroup 64 rows of its own. Llama-3.1-8B heads (32 / 8
x 128), causal, bf16. Writes benchmarks/results/triton_static_flash.json.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from results_file import DefaultsFormatter, write_results

HOPPER_SMEM = 227 * 1024  # the most dynamic shared memory one CTA may take on sm_90
JAX_DEFAULTS = (128, 128, 8, 2)  # jax's mha at head dim > 64: BlockSizes.get_default(), num_warps 8, num_stages 2
_MMA = re.compile(r"^#(\w+) = #ttg\.nvidia_mma<\{versionMajor = (\d+).*?warpsPerCTA = \[(\d+), (\d+)\]"
                  r".*?instrShape = \[(\d+),", re.M)
_DOT = re.compile(r"(?:warp_group_dot|tt\.dot) .*-> tensor<(\d+)x(\d+)xf32, #(\w+)>")


def triton_ir(fn, *args) -> tuple[str, int, int]:
    """(Triton IR as text, num_warps, num_stages) of the first Pallas Triton kernel in jit(fn)(*args), lowered for
    CUDA on this machine: what jaxlib would compile, with the launch settings the kernel chose. Reads jax's private
    lowering hook: a jax that moved it raises, naming it."""
    import jax
    try:
        from jax._src.pallas.triton import pallas_call_registration as registration
        lower_module = registration.lowering.lower_jaxpr_to_triton_module
    except (ImportError, AttributeError) as e:
        raise RuntimeError(f"jax {jax.__version__} has no jax._src.pallas.triton lowering hook to read the Triton IR "
                           f"from ({e}); this script follows jax 0.10-0.11") from e
    captured = []

    def capture(*a, **kw):
        result = lower_module(*a, **kw)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower_module
    if not captured:
        raise RuntimeError("no Pallas Triton kernel was lowered")
    launch = [int(re.search(rf"{name} = (\d+)", text).group(1)) for name in ("num_warps", "num_stages")]
    return captured[0], *launch


def built(ir: str, num_warps: int, num_stages: int) -> dict:
    """What Triton builds of `ir` for sm_90a: its dots' MMA layouts, registers, local (spilled) bytes, shared bytes."""
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ttir"
        path.write_text(ir)
        kernel = triton.compile(str(path), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=num_warps, num_stages=num_stages))
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    ttgir = kernel.asm["ttgir"]
    layouts = {m[0]: dict(version=int(m[1]), warps_per_cta=[int(m[2]), int(m[3])], instr_rows=int(m[4]))
               for m in _MMA.findall(ttgir)}
    dots = []
    for rows, cols, name in _DOT.findall(ttgir):
        layout = layouts[name]
        dots.append({"tile": [int(rows), int(cols)], **layout,
                     "repeat": max(1, layout["warps_per_cta"][0] * layout["instr_rows"] // int(rows))})
    field = lambda name: int(re.search(rf"\b{name}:(\d+)", usage).group(1))  # noqa: E731
    return {"dots": dots, "wgmma": "wgmma" in kernel.asm["ptx"], "registers": field("REG"),
            "spilled_bytes": field("LOCAL") + field("STACK"), "shared_bytes": kernel.metadata.shared,
            "fits_hopper": kernel.metadata.shared <= HOPPER_SMEM}


def _configs(text: str, head_dim: int) -> list:
    from swiftkv_jax.kernels.flash_attention import FlashBlockSizes

    default = FlashBlockSizes.for_head_dim(head_dim)
    if text == "defaults":
        return [default]
    if text == "candidates":
        from tune_kernels import CANDIDATES  # beside this script, as results_file is
        candidates = [FlashBlockSizes(**c) for c in CANDIDATES["flash"]]
        return [default, *(c for c in candidates if c != default)]
    return [FlashBlockSizes(*(int(n) for n in item.lower().split("x"))) for item in text.split(",") if item.strip()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsFormatter)
    parser.add_argument("--configs", default="candidates",
                        help="'defaults' (ours), 'candidates' (ours and tune_kernels.py's flash candidates, the "
                             "default), or block_q x block_k x num_warps x num_stages, comma-separated")
    parser.add_argument("--tokens", type=int, default=8192, help="causal prefill length (default 8192)")
    parser.add_argument("--head-dim", type=int, default=128, help="head size (32 query, 8 KV heads)")
    parser.add_argument("--out", default="benchmarks/results/triton_static_flash.json", help="JSON path")
    args = parser.parse_args(argv)
    try:
        import triton
    except ImportError:
        print("benchmarks/triton_static.py compiles with pip's Triton: `pip install triton` (its compiler and ptxas "
              "run on a CPU; nothing needs a GPU). It is not a dependency of this project.", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's own default, stated (it warns otherwise)
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import attention as jax_attention

    from swiftkv_jax.kernels.flash_attention import flash_attention

    heads, kv_heads, t, h = 32, 8, args.tokens, args.head_dim
    q, k = (jnp.zeros((1, t, n, h), jnp.bfloat16) for n in (heads, kv_heads))
    positions, segments = jnp.arange(t, dtype=jnp.int32)[None], jnp.ones((1, t), jnp.int32)
    rows = []
    for sizes in _configs(args.configs, h):
        ours = functools.partial(flash_attention, interpret=False, block_sizes=sizes)
        ir, warps, stages = triton_ir(ours, q, k, k, positions, positions, segments, segments)
        rows.append({"kernel": "ours", "block_q": sizes.block_q, "block_k": sizes.block_k, "num_warps": warps,
                     "num_stages": stages, **built(ir, warps, stages)})
    block_q, block_k, jax_warps, jax_stages = JAX_DEFAULTS
    repeated = jnp.zeros((1, t, heads, h), jnp.bfloat16)  # mha takes as many K/V heads as query heads
    theirs = functools.partial(jax_attention.mha, segment_ids=None, sm_scale=h ** -0.5, causal=True,
                               block_sizes=jax_attention.BlockSizes(block_q=block_q, block_k=block_k),
                               num_warps=jax_warps, num_stages=jax_stages)
    ir, warps, stages = triton_ir(theirs, q, repeated, repeated)
    rows.append({"kernel": "jax_triton", "block_q": block_q, "block_k": block_k, "num_warps": warps,
                 "num_stages": stages, **built(ir, warps, stages)})

    print(f"Triton {triton.__version__} for sm_90a (jax {jax.__version__} lowering), causal {t} tokens, "
          f"{heads}/{kv_heads} heads x {h}, bf16")
    print("| kernel | tiles asked (q x k) | warps | stages | dots: tile, warps per CTA, repeat | regs | spilled B "
          "| shared KiB |")
    print("|---|---|---:|---:|---|---:|---:|---:|")
    for r in rows:
        dots = "; ".join(dict.fromkeys(  # each distinct (tile, layout) once: the three loops repeat them
            f"{d['tile'][0]}x{d['tile'][1]} {d['warps_per_cta']}" + (f" x{d['repeat']}" if d["repeat"] > 1 else "")
            for d in r["dots"]))
        print(f"| {r['kernel']} | {r['block_q']} x {r['block_k']} | {r['num_warps']} | {r['num_stages']} | {dots} | "
              f"{r['registers']} | {r['spilled_bytes']} | {r['shared_bytes'] / 1024:.1f}"
              f"{'' if r['fits_hopper'] else ' (too large)'} |")
    write_results(args.out, "benchmarks/triton_static.py", argv, {
        "triton": triton.__version__, "jax": jax.__version__, "target": "sm_90a", "tokens": t, "heads": heads,
        "kv_heads": kv_heads, "head_dim": h, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
