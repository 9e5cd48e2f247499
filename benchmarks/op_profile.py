"""Where a compiled step's time goes: its ops timed by jax's profiler, grouped by what they do, with the TFLOP/s
of every matmul.

    summary = profile_steps(step, steps=2, hlo_text=compiled.as_text())   # step() runs one step, returns arrays
    print_profile(summary)

The trace (jax.profiler, XSpace) gives each device op's time: on a GPU the kernels on the device's streams, each
tagged with its HLO op (`hlo_op`) and module (`hlo_module`); on a CPU the runtime's thunks, tagged the same way.
The optimised HLO text of the same executable says what each op is (a cuBLAS or Triton GEMM, cuDNN's attention, a
Pallas kernel, a collective, a fusion that reduces or only maps) and how many FLOPs its dots do, so each op's time
becomes a category's share of the step and a matmul's TFLOP/s. One op execution may launch several kernels: its
kernels are consecutive on its stream, so executions are counted as runs of the same op.
"""

from __future__ import annotations

import collections
import glob
import json
import math
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTRUCTION_HEAD = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s+=\s+")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_OPERAND = re.compile(r"%([\w.\-]+)")
_DIMS = re.compile(r"^\(?\s*\w+\[([\d,]*)\]")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-]+(?:,\s*%?[\w.\-]+)*)\}?")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_LHS_CONTRACTING = re.compile(r'(?:lhs_contracting_dims=\{([\d,]*)\}|"lhs_contracting_dimensions":\[([^\]]*)\])')
_SCORES = re.compile(r'"intermediate_tensor_shape":\s*\{"element_type":\s*"\w+",\s*"dimensions":\s*\[([^\]]*)\]')
_MASK = re.compile(r'"mask_type":\s*"(\w+)"')

COLLECTIVES = {"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "all-reduce-start",
               "all-gather-start", "collective-permute-start", "all-reduce-done", "all-gather-done",
               "collective-permute-done", "send", "recv", "send-done", "recv-done"}
DATA_MOVEMENT = {"copy", "transpose", "dynamic-update-slice", "dynamic-slice", "slice", "concatenate", "pad", "gather",
                 "scatter", "copy-start", "copy-done", "bitcast", "broadcast", "reshape", "iota"}
CONTROL = {"while", "conditional", "call", "async-start", "async-done", "tuple", "get-tuple-element", "parameter",
           "constant"}
# Compile options of an executable that is profiled rather than timed: XLA's command buffers (CUDA graphs) replay
# whole runs of ops as one launch, which the trace shows as `command_buffer_N` ops with no HLO behind them (the
# 2026-11-25 8B profile: 99% of the step), so the profiled copy is compiled without them (xprof issue #3070)
PROFILE_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": ""}
# categories, in the order a table lists them
CATEGORIES = ("matmul", "attention (cuDNN)", "Pallas kernel", "reduction fusion", "elementwise fusion",
              "data movement", "collective", "other", "not in the HLO")


def compile_for_profile(lowered):
    """`lowered.compile()`, on a GPU without command buffers (PROFILE_COMPILER_OPTIONS): the copy to trace."""
    import jax

    gpu = jax.devices()[0].platform == "gpu"
    return lowered.compile(compiler_options=PROFILE_COMPILER_OPTIONS if gpu else None)


@dataclass
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: list
    attrs: str
    called: list = field(default_factory=list)


def _dims(shape: str) -> list[int]:
    """[8192, 4096] of "bf16[8192,4096]{1,0}"; a tuple's first element; [] for a scalar or token."""
    m = _DIMS.match(shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _balanced(text: str, start: int) -> int:
    """The index just past the parenthesis that closes the one at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


def _instruction(line: str):
    """(name, shape, opcode, operands text, attributes text) of an HLO instruction line, or None. A tuple shape may
    hold nested tuples and /*index=N*/ comments, so parentheses are matched, not pattern-matched."""
    m = _INSTRUCTION_HEAD.match(line)
    if not m:
        return None
    i = m.end()
    end = _balanced(line, i) if line.startswith("(", i) else line.find(" ", i)
    if end < 0:
        return None
    op = _OPCODE.match(line, end)
    if not op:
        return None
    close = _balanced(line, op.end() - 1)
    return m.group(1), line[i:end], op.group(1), line[op.end():close - 1], line[close:]


def parse_hlo(text: str) -> dict[str, dict[str, Instruction]]:
    """Computations of an HLO module's text: name -> {instruction name -> Instruction}."""
    computations, current = {}, None
    for line in text.splitlines():
        if current is None:
            m = _COMPUTATION.match(line)
            if m:
                current = computations.setdefault(m.group(1), {})
            continue
        if line.strip() == "}":
            current = None
            continue
        parsed = _instruction(line)
        if parsed is None:
            continue
        name, shape, opcode, args, attrs = parsed
        called = [c.strip().lstrip("%") for g in _CALLS.findall(attrs) for c in g.split(",")]
        current[name] = Instruction(name, shape, opcode, _OPERAND.findall(args), attrs, called)
    return computations


class HloIndex:
    """What each instruction of a compiled module is: its category and the FLOPs of the dots it runs."""

    def __init__(self, hlo_text: str):
        self.module = re.match(r"HloModule\s+([\w.\-]+)", hlo_text).group(1) if hlo_text.startswith("HloModule") \
            else None
        self.computations = parse_hlo(hlo_text)
        self.instructions = {}
        for comp in self.computations.values():
            for inst in comp.values():
                self.instructions.setdefault(inst.name, (inst, comp))
        # kernel names are instruction names with '.' and '-' made '_' (XLA GPU's sanitising)
        self.by_kernel_name = {re.sub(r"[.\-]", "_", n): n for n in self.instructions}
        self._flops, self._opcodes = {}, {}

    def resolve(self, name: str) -> str | None:
        if name in self.instructions:
            return name
        return self.by_kernel_name.get(re.sub(r"[.\-]", "_", name))

    def _dot_flops(self, inst: Instruction, comp: dict) -> float:
        """2 x output elements x contracted size, from the lhs operand's shape (a dot or a cuBLAS custom call)."""
        m = _LHS_CONTRACTING.search(inst.attrs)
        if not m or not inst.operands or inst.operands[0] not in comp:
            return 0.0
        contracting = [int(d.strip().strip('"')) for d in (m.group(1) or m.group(2) or "").split(",") if d.strip()]
        lhs = _dims(comp[inst.operands[0]].shape)
        if any(d >= len(lhs) for d in contracting):
            return 0.0
        return 2.0 * math.prod(_dims(inst.shape)) * math.prod(lhs[d] for d in contracting)

    @staticmethod
    def _attention_flops(inst: Instruction, comp: dict, target: str) -> float:
        """cuDNN's fused attention: 2 x scores x head_dim a product, two forward (Q K^T, P V), five backward (the
        scores again, dP, dV, dQ, dK); causal masks half the scores. The scores' [B, N, T, S] is in its backend
        config, head_dim is q's (operand 0) last dimension."""
        scores = _SCORES.search(inst.attrs)
        if not scores or not inst.operands or inst.operands[0] not in comp:
            return 0.0
        elements = math.prod(int(d.strip().strip('"')) for d in scores.group(1).split(",") if d.strip())
        head_dim = (_dims(comp[inst.operands[0]].shape) or [0])[-1]
        mask = _MASK.search(inst.attrs)
        causal = 0.5 if mask and "CAUSAL" in mask.group(1) else 1.0
        return 2.0 * elements * head_dim * (5 if "Backward" in target else 2) * causal

    def _computation_summary(self, name: str) -> tuple[float, frozenset]:
        """(dot FLOPs, opcodes and custom-call targets) of a computation and what it calls, recursively."""
        if name in self._flops:
            return self._flops[name], self._opcodes[name]
        self._flops[name], self._opcodes[name] = 0.0, frozenset()  # a cycle guard
        flops, opcodes = 0.0, set()
        for inst in self.computations.get(name, {}).values():
            f, ops = self._instruction_summary(inst, self.computations[name])
            flops += f
            opcodes |= ops
        self._flops[name], self._opcodes[name] = flops, frozenset(opcodes)
        return flops, frozenset(opcodes)

    def _instruction_summary(self, inst: Instruction, comp: dict) -> tuple[float, set]:
        opcodes = {inst.opcode}
        target = _TARGET.search(inst.attrs)
        if target:
            opcodes.add("custom-call:" + target.group(1))
        name = target.group(1) if target else ""
        flops = (self._dot_flops(inst, comp) if inst.opcode == "dot" or "cublas" in name
                 else self._attention_flops(inst, comp, name) if name.startswith("__cudnn$fmha") else 0.0)
        if inst.opcode in ("fusion", "call", "async-start"):  # a loop's body runs many times: its own ops are timed
            for c in inst.called:
                f, ops = self._computation_summary(c)
                flops += f
                opcodes |= ops
        return flops, opcodes

    def describe(self, name: str) -> tuple[str, float]:
        """(category, dot FLOPs per execution) of the instruction `name` (already resolved)."""
        inst, comp = self.instructions[name]
        flops, opcodes = self._instruction_summary(inst, comp)
        targets = " ".join(o for o in opcodes if o.startswith("custom-call:")).lower()
        if "fmha" in targets or "cudnn" in targets:
            return "attention (cuDNN)", flops
        if "dot" in opcodes or "convolution" in opcodes or "cublas" in targets or "gemm" in targets:
            return "matmul", flops
        if "triton" in targets or "mosaic" in targets or "pallas" in targets:
            return "Pallas kernel", flops
        if opcodes & COLLECTIVES:
            return "collective", flops
        if inst.opcode == "fusion":
            return ("reduction fusion" if {"reduce", "reduce-window", "sort", "scatter"} & opcodes
                    else "elementwise fusion"), flops
        if inst.opcode in DATA_MOVEMENT:
            return "data movement", flops
        if inst.opcode in ("reduce", "reduce-window", "sort"):
            return "reduction fusion", flops
        return "other", flops

    def is_control(self, name: str) -> bool:
        """A loop, call or conditional: on a CPU its event encloses its body's events, which are timed themselves."""
        return self.instructions[name][0].opcode in CONTROL


@dataclass
class _OpTime:
    ns: float = 0.0
    kernels: int = 0
    executions: int = 0
    kernel: str = ""


def _annotated_op(stats: dict) -> str | None:
    """The op named in a kernel's annotation ("...#hlo_op=fusion.3,...#") when the trace kept no hlo_op stat."""
    for value in stats.values():
        m = re.search(r"hlo_op=([\w.\-]+)", value) if isinstance(value, str) else None
        if m:
            return m.group(1)
    return None


def device_op_times(xspace, module: str | None) -> tuple[dict, str]:
    """({hlo op name -> _OpTime}, the source) of the events of `module` in a parsed trace.

    GPU: the device planes' "XLA Ops" line where the trace has one (one event per op execution), else the kernels
    on the stream lines, executions counted as runs of consecutive kernels of one op. CPU: the host's events that
    carry an `hlo_op` (each event one execution)."""
    ops = collections.defaultdict(_OpTime)
    device_planes = [p for p in xspace.planes if p.name.startswith("/device:") and "CPU" not in p.name]
    source = "gpu-kernels"
    if not device_planes:
        device_planes, source = [p for p in xspace.planes if p.name.startswith("/host:CPU")], "cpu-thunks"
    for plane in device_planes:
        lines = list(plane.lines)
        op_lines = [ln for ln in lines if ln.name == "XLA Ops"]
        if op_lines and source != "cpu-thunks":
            lines, source = op_lines, "gpu-xla-ops"
        elif source != "cpu-thunks":
            lines = [ln for ln in lines if ln.name.startswith("Stream")] or lines
        for line in lines:
            previous = None
            for event in sorted(line.events, key=lambda e: e.start_ns):
                stats = dict(event.stats)
                if module and stats.get("hlo_module", module) != module:
                    previous = None
                    continue
                op = stats.get("hlo_op") or _annotated_op(stats) or (event.name if source != "cpu-thunks" else None)
                if not op or event.name.startswith("end: "):
                    continue
                t = ops[str(op)]
                t.ns += event.duration_ns
                t.kernels += 1
                t.kernel = t.kernel or event.name
                if source != "gpu-kernels" or op != previous:
                    t.executions += 1
                previous = op
    return dict(ops), source


def summarize(xspace, index: HloIndex, steps: int, wall_s: float, top: int = 25) -> dict:
    """The profile of `steps` steps: per-category and top-op times per step, and each matmul's TFLOP/s."""
    ops, source = device_op_times(xspace, index.module)
    cats = {c: {"category": c, "ms": 0.0, "gflop": 0.0, "flop_ms": 0.0} for c in CATEGORIES}
    rows = []
    for op, t in ops.items():
        name = index.resolve(op)
        if name is not None and source == "cpu-thunks" and index.is_control(name):
            continue
        category, flops = index.describe(name) if name else ("not in the HLO", 0.0)
        ms = t.ns / 1e6 / steps
        gflop = flops * t.executions / steps / 1e9
        cat = cats[category]
        cat["ms"] += ms
        if gflop:
            cat["gflop"] += gflop
            cat["flop_ms"] += ms
        rows.append({"op": name or op, "category": category, "ms": ms, "executions": t.executions / steps,
                     "kernels": t.kernels / steps, "gflop": gflop, "tflops": gflop / ms if gflop and ms else None,
                     "kernel": t.kernel})
    busy = sum(r["ms"] for r in rows)
    for c in cats.values():
        c["share"] = c["ms"] / busy if busy else 0.0
        # TFLOP/s of the ops whose FLOPs are known (GFLOP / ms = TFLOP/s)
        c["tflops"] = c["gflop"] / c["flop_ms"] if c["flop_ms"] else None
    rows.sort(key=lambda r: -r["ms"])
    for r in rows:
        r["share"] = r["ms"] / busy if busy else 0.0
    wall_ms = wall_s * 1e3 / steps
    return {"steps": steps, "source": source, "module": index.module, "wall_ms_per_step": wall_ms,
            "busy_ms_per_step": busy, "idle_share": max(0.0, 1.0 - busy / wall_ms) if wall_ms else None,
            "categories": [c for c in cats.values() if c["ms"] > 0], "ops": rows[:top], "ops_timed": len(rows)}


def profile_steps(step: Callable[[], object], steps: int, hlo_text: str, top: int = 25) -> dict:
    """Run `step` (one step, returns the arrays to wait on) `steps` times under jax's profiler and summarise the
    trace against the executable's optimised HLO (`compiled.as_text()`)."""
    import jax
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory(prefix="op-profile-") as logdir:
        jax.profiler.start_trace(logdir)
        try:
            start = time.perf_counter()
            for _ in range(steps):
                jax.block_until_ready(step())
            wall = time.perf_counter() - start
        finally:
            jax.profiler.stop_trace()
        files = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))
        if not files:
            raise RuntimeError(f"jax's profiler wrote no .xplane.pb under {logdir}")
        xspace = ProfileData.from_file(files[-1])
        return summarize(xspace, HloIndex(hlo_text), steps, wall, top)


def print_profile(summary: dict, title: str = "", ops: int = 12, print_fn=print, digits: int = 2) -> None:
    """The category table, then the costliest ops (times to `digits` decimals of a millisecond)."""
    print_fn(f"profile{' of ' + title if title else ''}: {summary['busy_ms_per_step']:.{digits}f} ms of device ops per "
             f"step against {summary['wall_ms_per_step']:.{digits}f} ms wall ({summary['idle_share']:.0%} idle; "
             f"{summary['ops_timed']} ops; {summary['source']})")
    print_fn(f"  {'category':<22}{'ms/step':>10}{'share':>8}{'GFLOP':>10}{'TFLOP/s':>9}")
    for c in summary["categories"]:
        tf = f"{c['tflops']:>9.3g}" if c["tflops"] else f"{'':>9}"
        print_fn(f"  {c['category']:<22}{c['ms']:>10.{digits}f}{c['share']:>8.1%}{c['gflop']:>10.0f}{tf}")
    print_fn(f"  {'op':<44}{'category':<20}{'ms/step':>9}{'share':>7}{'runs':>6}{'TFLOP/s':>9}")
    for r in summary["ops"][:ops]:
        tf = f"{r['tflops']:>9.3g}" if r["tflops"] else f"{'':>9}"
        print_fn(f"  {r['op'][:43]:<44}{r['category'][:19]:<20}{r['ms']:>9.{digits}f}{r['share']:>7.1%}"
                 f"{r['executions']:>6.0f}{tf}")


if __name__ == "__main__":  # python benchmarks/op_profile.py: a small matmul loop, profiled on this machine
    import jax
    import jax.numpy as jnp

    def demo(x, w):
        return jax.lax.scan(lambda c, wi: (jax.nn.gelu(c @ wi), jnp.sum(c)), x, w)

    x, w = jnp.ones((1024, 1024)), jnp.ones((4, 1024, 1024)) * 1e-3
    compiled = jax.jit(demo).lower(x, w).compile()
    jax.block_until_ready(compiled(x, w))
    summary = profile_steps(lambda: compiled(x, w), 3, compiled.as_text())
    print_profile(summary, "a 4-layer scan of 1024 x 1024 matmuls")
    print(json.dumps(summary["categories"], indent=1))
