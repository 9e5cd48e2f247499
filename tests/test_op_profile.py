"""benchmarks/op_profile.py: op times from jax's profiler, categorised and FLOP-counted from the optimised HLO."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.profiler import ProfileData

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import op_profile  # noqa: E402


def test_cpu_profile_counts_a_scans_matmul_flops_by_hand():
    n, layers = 256, 4

    def scan(x, w):
        return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), jnp.sum(c)), x, w)

    x, w = jnp.ones((n, n)), jnp.full((layers, n, n), 1e-3)
    compiled = jax.jit(scan).lower(x, w).compile()
    jax.block_until_ready(compiled(x, w))
    summary = op_profile.profile_steps(lambda: compiled(x, w), 3, compiled.as_text())
    cats = {c["category"]: c for c in summary["categories"]}
    # the paper arithmetic of the loop: `layers` dots of 2 n^3 FLOPs a step, each timed once per layer
    assert cats["matmul"]["gflop"] == pytest.approx(layers * 2 * n**3 / 1e9, rel=1e-9)
    assert cats["matmul"]["tflops"] > 0
    assert "not in the HLO" not in cats  # every timed op found in the text, loops' own events left out
    assert sum(c["share"] for c in summary["categories"]) == pytest.approx(1.0)
    assert summary["source"] == "cpu-thunks" and summary["module"] == "jit_scan"
    assert 0 < summary["busy_ms_per_step"]


# The text of an optimised GPU module as XLA prints it: a cuBLAS GEMM (tuple result, dimensions in its backend
# config), a Triton GEMM fusion, cuDNN's attention, a reduction fusion, a loop fusion, a while loop.
GPU_HLO = """HloModule jit_step, is_scheduled=true, entry_computation_layout={(bf16[8192,4096]{1,0})->bf16[8192,4096]{1,0}}

%region_0.1 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%a, %b)
}

%gemm_fusion_dot.1_computation (parameter_0: bf16[8192,4096], parameter_1: bf16[4096,1024]) -> bf16[8192,1024] {
  %parameter_0 = bf16[8192,4096]{1,0} parameter(0)
  %parameter_1 = bf16[4096,1024]{1,0} parameter(1)
  ROOT %dot.3 = bf16[8192,1024]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_reduce (param_0: f32[8192,4096]) -> f32[8192] {
  %param_0 = f32[8192,4096]{1,0} parameter(0)
  %constant.2 = f32[] constant(0)
  ROOT %reduce.1 = f32[8192]{0} reduce(%param_0, %constant.2), dimensions={1}, to_apply=%region_0.1
}

%fused_add (param_0.1: bf16[8192,4096], param_1.1: bf16[8192,4096]) -> bf16[8192,4096] {
  %param_0.1 = bf16[8192,4096]{1,0} parameter(0)
  %param_1.1 = bf16[8192,4096]{1,0} parameter(1)
  ROOT %add.2 = bf16[8192,4096]{1,0} add(%param_0.1, %param_1.1)
}

ENTRY %main.9 (p.1: bf16[8192,4096]) -> bf16[8192,4096] {
  %p.1 = bf16[8192,4096]{1,0} parameter(0)
  %w.1 = bf16[4096,14336]{1,0} constant({...})
  %custom-call.1 = (bf16[8192,14336]{1,0}, s8[33554432]{0}) custom-call(%p.1, %w.1), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}}
  %w.2 = bf16[4096,1024]{1,0} constant({...})
  %gemm_fusion_dot.1 = bf16[8192,1024]{1,0} fusion(%p.1, %w.2), kind=kCustom, calls=%gemm_fusion_dot.1_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %q.1 = bf16[1,32,8192,128]{3,2,1,0} bitcast(%p.1)
  %custom-call.2 = (bf16[1,32,8192,128]{3,2,1,0}, u8[0]{0}) custom-call(%q.1, %q.1, %q.1), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config":{"fmha_scale":0.088,"intermediate_tensor_shape":{"element_type":"BF16","dimensions":["1","32","8192","8192"],"tuple_shapes":[]},"is_flash_attention":true,"mask_type":"CAUSAL","bmm1_dot_dimension_numbers":{"lhs_contracting_dimensions":["3"],"rhs_contracting_dimensions":["3"],"lhs_batch_dimensions":["0","1"],"rhs_batch_dimensions":["0","1"]}}}
  %custom-call.3 = (bf16[1,32,8192,128]{3,2,1,0}, bf16[1,32,8192,128]{3,2,1,0}, bf16[1,32,8192,128]{3,2,1,0}, u8[0]{0}) custom-call(%q.1, %q.1, %q.1, %q.1), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={"cudnn_fmha_backend_config":{"intermediate_tensor_shape":{"element_type":"BF16","dimensions":["1","32","8192","8192"]},"mask_type":"NO_MASK"}}
  %f.1 = f32[8192,4096]{1,0} convert(%p.1)
  %reduce_fusion.1 = f32[8192]{0} fusion(%f.1), kind=kInput, calls=%fused_reduce
  %loop_add_fusion.3 = bf16[8192,4096]{1,0} fusion(%p.1, %p.1), kind=kLoop, calls=%fused_add
  %tuple.1 = (bf16[8192,4096]{1,0}, /*index=1*/f32[8192]{0}) tuple(%loop_add_fusion.3, %reduce_fusion.1)
  ROOT %gte.1 = bf16[8192,4096]{1,0} get-tuple-element(%tuple.1), index=0
}
"""  # noqa: E501

STAT_IDS = {"hlo_op": 1, "hlo_module": 2, "kernel_annotation": 3}


def _event(metadata_id: int, start_us: float, dur_us: float, **stats) -> str:
    body = " ".join(f'stats {{ metadata_id: {STAT_IDS[k]} str_value: "{v}" }}' for k, v in stats.items())
    return (f"events {{ metadata_id: {metadata_id} offset_ps: {int(start_us * 1e6)} "
            f"duration_ps: {int(dur_us * 1e6)} {body} }}")


def _gpu_xspace(events: list, kernel_names: list) -> ProfileData:
    metadata = " ".join(f'event_metadata {{ key: {i + 1} value {{ id: {i + 1} name: "{n}" }} }}'
                        for i, n in enumerate(kernel_names))
    stats = " ".join(f'stat_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}' for n, i in STAT_IDS.items())
    return ProfileData.from_text_proto(
        f'planes {{ id: 1 name: "/device:GPU:0" lines {{ id: 1 name: "Stream #13(Compute)" timestamp_ns: 0 '
        f'{" ".join(events)} }} {metadata} {stats} }} '
        f'planes {{ id: 2 name: "/host:CPU" lines {{ id: 1 name: "python" timestamp_ns: 0 }} }}')


def test_gpu_trace_is_categorised_and_flop_counted_from_the_hlo():
    names = ["sm90_xmma_gemm_bf16bf16", "gemm_fusion_dot_1", "cudnn_fmha_fwd", "cudnn_fmha_fwd_reduce",
             "reduce_fusion_1", "loop_add_fusion_3", "other_module_kernel", "cudnn_fmha_bwd"]
    m = dict(hlo_module="jit_step")
    events = [  # two steps: each op once a step; cuDNN's attention launches two kernels per run
        _event(1, 0, 1000, hlo_op="custom-call.1", **m), _event(2, 1000, 100, hlo_op="gemm_fusion_dot.1", **m),
        _event(3, 1100, 300, hlo_op="custom-call.2", **m), _event(4, 1400, 50, hlo_op="custom-call.2", **m),
        _event(5, 1450, 40, hlo_op="reduce_fusion.1", **m),
        _event(6, 1490, 10, **m),  # no hlo_op: found by its kernel's name
        _event(7, 1500, 500, hlo_op="fusion.9", hlo_module="jit_other"),  # another program: not this step's
        _event(1, 2000, 1000, hlo_op="custom-call.1", **m), _event(2, 3000, 100, hlo_op="gemm_fusion_dot.1", **m),
        _event(3, 3100, 300, hlo_op="custom-call.2", **m), _event(4, 3400, 50, hlo_op="custom-call.2", **m),
        _event(5, 3450, 40, kernel_annotation="reduce:#hlo_op=reduce_fusion.1,hlo_module=jit_step#", **m),
        _event(6, 3490, 10, **m), _event(8, 3500, 500, hlo_op="custom-call.3", **m),  # once in the two steps
    ]
    summary = op_profile.summarize(_gpu_xspace(events, names), op_profile.HloIndex(GPU_HLO), steps=2, wall_s=0.005)
    assert summary["source"] == "gpu-kernels" and summary["module"] == "jit_step"
    ops = {r["op"]: r for r in summary["ops"]}
    assert set(ops) == {"custom-call.1", "gemm_fusion_dot.1", "custom-call.2", "reduce_fusion.1", "loop_add_fusion.3",
                        "custom-call.3"}
    cublas, triton, attention = ops["custom-call.1"], ops["gemm_fusion_dot.1"], ops["custom-call.2"]
    assert cublas["category"] == triton["category"] == "matmul"
    assert cublas["gflop"] == pytest.approx(2 * 8192 * 14336 * 4096 / 1e9)
    assert cublas["tflops"] == pytest.approx(cublas["gflop"] / 1.0)  # 1 ms a step
    assert triton["gflop"] == pytest.approx(2 * 8192 * 1024 * 4096 / 1e9)
    assert attention["category"] == ops["custom-call.3"]["category"] == "attention (cuDNN)"
    # cuDNN's attention: 2 x scores x head_dim a product; 2 products forward, causal half; 5 backward, no mask
    scores = 32 * 8192 * 8192
    assert attention["gflop"] == pytest.approx(2 * scores * 128 * 2 * 0.5 / 1e9)
    assert ops["custom-call.3"]["gflop"] == pytest.approx(2 * scores * 128 * 5 / 1e9 / 2)  # one run in two steps
    assert (attention["executions"], attention["kernels"], attention["ms"]) == (1, 2, pytest.approx(0.35))
    assert ops["reduce_fusion.1"]["category"] == "reduction fusion" and ops["reduce_fusion.1"]["executions"] == 1
    assert ops["loop_add_fusion.3"]["category"] == "elementwise fusion"
    assert summary["busy_ms_per_step"] == pytest.approx(1.0 + 0.1 + 0.35 + 0.04 + 0.01 + 0.25)
    assert summary["wall_ms_per_step"] == pytest.approx(2.5)
    cats = {c["category"]: c for c in summary["categories"]}
    assert cats["matmul"]["tflops"] == pytest.approx((cublas["gflop"] + triton["gflop"]) / 1.1)


def test_tuple_shapes_with_index_comments_parse():
    line = ("  %while.28 = (s32[], f32[4,8]{1,0}, /*index=2*/(f32[2]{0}, s32[])) while(%tuple.5), "
            "condition=%cond.1, body=%body.2")
    name, shape, opcode, operands, attrs = op_profile._instruction(line)
    assert (name, opcode, operands) == ("while.28", "while", "%tuple.5")
    assert shape.startswith("(s32[]") and shape.endswith("s32[]))")
    assert "body=%body.2" in attrs
