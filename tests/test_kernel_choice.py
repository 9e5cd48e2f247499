"""The engines' default attention kernels per device (`serving.kernel_choice`): the rule on described devices here,
and on a GPU (`gpu`-marked) that what the defaults serve is what XLA serves."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import swiftkv_jax as sk
from swiftkv_jax.serving.continuous import Engine
from swiftkv_jax.serving.kernel_choice import default_impls, is_hopper, serving_config

from test_continuous_engine import PROMPTS, run
from test_serving import CFG, engine_logits

H100 = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
A100 = types.SimpleNamespace(platform="gpu", compute_capability="8.0")
CPU = types.SimpleNamespace(platform="cpu")
BF16 = sk.ModelConfig(dtype="bfloat16", param_dtype="bfloat16")  # head dim 128, as Llama's


@pytest.mark.parametrize("device, config, cache, paged, want", [
    (H100, BF16, "bfloat16", False, ("mosaic", "mosaic")),
    (H100, BF16, "bfloat16", True, ("mosaic", "pallas")),  # the Triton paged kernel ties or beats Mosaic
    (H100, BF16, "int8", False, ("mosaic", "xla")),  # XLA over int8 beat Mosaic's in-SMEM conversion
    (H100, BF16.replace(head_dim=96), "bfloat16", False, ("cudnn", "xla")),  # Mosaic: head dims of 64 and 128
    (H100, BF16.replace(head_dim=256), "bfloat16", False, ("cudnn", "xla")),
    (A100, BF16, "bfloat16", False, ("cudnn", "xla")),  # no wgmma before sm_90
    (A100, BF16, "bfloat16", True, ("cudnn", "pallas")),
    (H100, BF16.replace(head_dim=96), "bfloat16", True, ("cudnn", "xla")),  # the Triton kernel: powers of two
    # cuDNN takes multiples of 8 up to 256 (128 before sm_90): OpenLLaMA 3B's 100 prefills by our Triton kernel
    (A100, BF16.replace(head_dim=100), "bfloat16", True, ("pallas", "xla")),
    (H100, BF16.replace(head_dim=100), "bfloat16", False, ("pallas", "xla")),
    # past 128 our Triton tiles would overrun an A100's shared memory: blockwise XLA
    (A100, BF16.replace(head_dim=256), "bfloat16", True, ("xla_flash", "pallas")),
    (H100, BF16.replace(head_dim=256), "bfloat16", True, ("cudnn", "pallas")),
    (H100, BF16.replace(dtype="float32"), "float32", False, ("xla_flash", "xla")),  # both kernels refuse fp32
    (CPU, BF16, "bfloat16", True, ("xla_flash", "xla")),
    # the Triton paged kernel's head dims are powers of two >= 16 (paged_attention.paged_attention's docstring)
    (A100, BF16.replace(head_dim=16), "bfloat16", True, ("cudnn", "pallas")),
    (A100, BF16.replace(head_dim=8), "bfloat16", True, ("cudnn", "xla")),
])
def test_default_impls_follow_the_measured_rule(device, config, cache, paged, want):
    got = default_impls(config, cache, paged=paged, device=device)
    assert (got["attention_impl"], got["decode_attention_impl"]) == want


@pytest.mark.parametrize("device", [H100, A100], ids=["sm_90", "sm_80"])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 100, 128, 256])
def test_default_prefill_runs_the_head_dim_and_says_why_it_passed_cudnn_over(device, head_dim, monkeypatch, caplog):
    """cuDNN's fused attention refuses head dims that are not multiples of 8, or above 256 (128 before sm_90): jax's
    own check (in the lowering, so at the first prompt longer than FEW_QUERIES tokens on a GPU, not when the engine
    is made). Lowered for CUDA here with a GPU's answers, as test_cudnn_attention does: the default prefill never
    picks cuDNN where that check refuses, and the engine's log says which kernel it took instead."""
    from jax._src.cudnn import fused_attention_stablehlo as fused

    from swiftkv_jax.model import attention
    from swiftkv_jax.serving import kernel_choice

    major = int(device.compute_capability.split(".")[0])
    monkeypatch.setattr(fused, "check_cudnn_version", lambda: 91100)
    monkeypatch.setattr(fused, "check_compute_capability", lambda capability: major >= float(capability))
    monkeypatch.setattr(fused, "is_cuda_compute_capability_equal", lambda capability: False)
    monkeypatch.setattr(attention, "check_cudnn", lambda dtype: None)
    S = jax.ShapeDtypeStruct
    q, kv, ids = S((1, 64, 8, head_dim), jnp.bfloat16), S((1, 64, 2, head_dim), jnp.bfloat16), S((1, 64), jnp.int32)
    jax.clear_caches()  # jax checks the head dim while tracing: another device's cached trace would skip it
    try:
        jax.jit(attention.cudnn_attention).trace(q, kv, kv, ids, ids, ids, ids).lower(lowering_platforms=("cuda",))
        cudnn_runs = True
    except ValueError as e:
        assert "head dim must be" in str(e)
        cudnn_runs = False
    config = BF16.replace(head_dim=head_dim)
    chosen = default_impls(config, "bfloat16", paged=True, device=device)["attention_impl"]
    assert chosen in ("mosaic", "cudnn", "pallas", "xla_flash") and (chosen != "cudnn" or cudnn_runs)
    monkeypatch.setattr(kernel_choice.jax, "devices", lambda: [device])
    with caplog.at_level("WARNING", logger=kernel_choice.__name__):
        assert serving_config(config, paged=True).attention_impl == chosen
    assert ("prefill by our Triton flash kernel" in caplog.text) == (chosen == "pallas")


@pytest.mark.parametrize("device, head_dim, paged, cache, logged", [
    (H100, 96, False, "bfloat16", ("prefill by cuDNN", "decode by XLA")),  # Phi-3's head dim
    (H100, 80, True, "bfloat16", ("prefill by cuDNN", "pages by XLA")),    # Phi-2's
    (A100, 80, True, "bfloat16", ("pages by XLA",)),
    (H100, 96, False, "int8", ("prefill by cuDNN",)),  # XLA over an int8 cache is the rule at every head dim
    (H100, 128, True, "bfloat16", ()), (H100, 64, False, "bfloat16", ()), (A100, 128, True, "bfloat16", ()),
])
def test_a_head_dim_the_measured_kernels_do_not_serve_is_logged(device, head_dim, paged, cache, logged, monkeypatch,
                                                                  caplog):
    """Qwen's and Llama's head dims (64, 128) get the measured kernels silently; another head dim gets a kernel
    that runs it, slower than the rule's, and the engine's log says which and why (a silent slow default is what
    the rule must not be). A kernel the caller names is not explained."""
    from swiftkv_jax.serving import kernel_choice

    monkeypatch.setattr(kernel_choice.jax, "devices", lambda: [device])
    monkeypatch.setattr(kernel_choice.attention_lib, "check_cudnn", lambda dtype: None)  # the described GPU has it
    config = BF16.replace(head_dim=head_dim)
    with caplog.at_level("WARNING", logger=kernel_choice.__name__):
        serving_config(config, cache, paged=paged)
    for words in ("prefill by cuDNN", "decode by XLA", "pages by XLA", "our Triton flash kernel"):
        assert (words in caplog.text) == (words in logged), (words, caplog.text)
    assert (f"head_dim {head_dim}" in caplog.text) == bool(logged)
    caplog.clear()
    with caplog.at_level("WARNING", logger=kernel_choice.__name__):
        serving_config(config, cache, paged=paged, attention_impl="xla", decode_attention_impl="xla")
    assert not caplog.text


def test_named_cudnn_refuses_a_head_dim_it_cannot_run_when_the_engine_is_made(monkeypatch):
    from swiftkv_jax.serving import kernel_choice

    monkeypatch.setattr(kernel_choice.attention_lib, "check_cudnn", lambda dtype: None)  # the described GPU has it
    monkeypatch.setattr(kernel_choice.jax, "devices", lambda: [A100])
    with pytest.raises(ValueError, match="cannot run head_dim 100 on this GPU.*use attention_impl='pallas'"):
        serving_config(BF16.replace(head_dim=100), paged=False, attention_impl="cudnn")
    # past 128 (cuDNN's limit before sm_90) it names the kernel the default takes there: blockwise XLA, not our
    # Triton kernel, whose tiles are sized for head dims up to 128
    with pytest.raises(ValueError, match="cannot run head_dim 136 on this GPU.*up to 128 here.*'xla_flash'"):
        serving_config(BF16.replace(head_dim=136), paged=False, attention_impl="cudnn")
    assert default_impls(BF16.replace(head_dim=136), paged=False, device=A100)["attention_impl"] == "xla_flash"
    assert serving_config(BF16.replace(head_dim=96), paged=False, attention_impl="cudnn").attention_impl == "cudnn"


@pytest.mark.parametrize("capability", [None, "7.5", "8.0", "8.9", "9.0", "10.0", "12.0"])
def test_cudnn_head_dims_are_the_ones_jaxs_own_check_takes(capability, monkeypatch):
    """`cudnn_takes_head_dim` against jax's check (`check_is_flash_attention`, training, 16 bits) at every head dim up
    to 272, on each compute capability: Blackwell (10.0, 12.0) runs 256 as Hopper does (the examples above are sm_90
    and sm_80 only, and say only that cuDNN is not chosen where jax refuses). A device without a compute capability
    is taken as one before sm_90."""
    from jax._src.cudnn import fused_attention_stablehlo as fused

    from swiftkv_jax.model.attention import cudnn_takes_head_dim

    fields = {} if capability is None else {"compute_capability": capability}
    device = types.SimpleNamespace(platform="gpu", **fields)
    current = tuple(int(x) for x in (capability or "0.0").split("."))
    monkeypatch.setattr(fused, "check_compute_capability", lambda c: current >= tuple(int(x) for x in c.split(".")))
    monkeypatch.setattr(fused, "is_cuda_compute_capability_equal", lambda c: False)
    for head_dim in range(1, 273):
        x = jax.ShapeDtypeStruct((1, 64, 8, head_dim), jnp.bfloat16)
        try:
            fused.check_is_flash_attention(x, x, x, fused.AttentionLayout.BTNH.value, 91100, has_bias=False,
                                           is_training=True)
            runs = True
        except NotImplementedError:
            runs = False
        assert cudnn_takes_head_dim(head_dim, device) == runs, (capability, head_dim)


@pytest.mark.parametrize("capability, head_dim, limit", [("8.0", 256, 128), ("9.0", 264, 256), ("10.0", 264, 256)])
def test_the_logged_reason_names_the_devices_cudnn_limit(capability, head_dim, limit, monkeypatch, caplog):
    """The reason the prefill passed cuDNN over names the widest head dim cuDNN takes on this device (on sm_100 it
    said 128: only sm_90 counted as Hopper there)."""
    from swiftkv_jax.serving import kernel_choice

    monkeypatch.setattr(kernel_choice.jax, "devices", lambda: [types.SimpleNamespace(platform="gpu",
                                                                                      compute_capability=capability)])
    with caplog.at_level("WARNING", logger=kernel_choice.__name__):
        want = "pallas" if head_dim <= 128 else "xla_flash"
        assert serving_config(BF16.replace(head_dim=head_dim), paged=False).attention_impl == want
    assert f"multiples of 8 up to {limit} here, not {head_dim}" in caplog.text, caplog.text
    assert ("prefill by blockwise XLA ('xla_flash'" in caplog.text) == (head_dim > 128)


def test_a_named_impl_is_not_explained_and_the_other_default_still_is(monkeypatch, caplog):
    """Naming one impl silences only its own reason: the default chosen for the other is still explained."""
    from swiftkv_jax.serving import kernel_choice

    monkeypatch.setattr(kernel_choice.jax, "devices", lambda: [H100])
    monkeypatch.setattr(kernel_choice.attention_lib, "check_cudnn", lambda dtype: None)  # the described GPU has it
    config = BF16.replace(head_dim=80)  # Phi-2's: both defaults on sm_90 pass the rule's kernels over
    for named, logged, silent in [(dict(attention_impl="xla"), "pages by XLA", "prefill by cuDNN"),
                                  (dict(decode_attention_impl="xla"), "prefill by cuDNN", "pages by XLA")]:
        caplog.clear()
        with caplog.at_level("WARNING", logger=kernel_choice.__name__):
            serving_config(config, paged=True, **named)
        assert logged in caplog.text and silent not in caplog.text, (named, caplog.text)


def test_a_gpu_whose_compute_capability_is_not_a_number_gets_a_choice(monkeypatch):
    """A device that reports its architecture by name (ROCm's are "gfx90a"-style) was parsed as an int and failed
    the engine as it was made; it is taken as a GPU before sm_90, as one with no compute capability."""
    rocm = types.SimpleNamespace(platform="gpu", compute_capability="gfx90a")
    assert default_impls(BF16, "bfloat16", paged=False, device=rocm) == \
        default_impls(BF16, "bfloat16", paged=False, device=types.SimpleNamespace(platform="gpu"))


def test_named_impls_win_and_hopper_is_sm_90():
    config = serving_config(BF16, paged=False, attention_impl="pallas", decode_attention_impl="pallas")
    assert (config.attention_impl, config.decode_attention_impl) == ("pallas", "pallas")
    assert is_hopper(types.SimpleNamespace(platform="gpu", compute_capability="9.0"))
    assert not is_hopper(A100) and not is_hopper(CPU)


@pytest.mark.gpu
def test_the_static_engines_gpu_defaults_serve_what_xla_serves():
    """The defaults on this GPU (Mosaic prefill and decode on sm_90, cuDNN prefill elsewhere) against XLA: chunked
    prefill over a cache, then decode, SwiftKV wiring, bf16."""
    cfg = CFG.replace(head_dim=64, dtype="bfloat16", param_dtype="bfloat16")
    model = sk.to_swiftkv(sk.init(cfg, 1), 2, 2)
    chosen = sk.Model(serving_config(model.config, "bfloat16", paged=False), model.params)
    assert chosen.config.attention_impl != model.config.attention_impl  # a GPU default, not the config's
    xla = sk.Model(model.config.replace(attention_impl="xla", decode_attention_impl="xla"), model.params)
    seq = np.random.default_rng(3).integers(6, 96, (2, 48))
    want, _ = engine_logits(xla, True, seq, [37, 30], padded=40, chunk=20, max_len=48, cache_dtype="bfloat16")
    got, _ = engine_logits(chosen, True, seq, [37, 30], padded=40, chunk=20, max_len=48, cache_dtype="bfloat16")
    np.testing.assert_allclose(got, want, atol=5e-2)


@pytest.mark.gpu
def test_the_engines_gpu_defaults_serve_what_xla_serves():
    """sk.Engine with the GPU's default kernels (packed prompt chunks, continued chunks, decodes) against XLA, bf16:
    the same greedy tokens, or the same up to a near tie, and their log-probabilities close."""
    cfg = CFG.replace(head_dim=64, dtype="bfloat16", param_dtype="bfloat16")
    model = sk.to_swiftkv(sk.init(cfg, 1), 2, 2)
    kwargs = dict(swiftkv=True, page_size=16, num_pages=64, max_num_seqs=4, max_num_batched_tokens=32,
                  cache_dtype="bfloat16", single_buckets=(4,), prompt_buckets=(32,), max_model_len=128)
    outs = {}
    for impls in ({}, dict(attention_impl="xla", decode_attention_impl="xla")):
        done = run(Engine(model, **impls, **kwargs), PROMPTS[:4], arrivals=[0, 0, 1, 2], max_tokens=8)
        outs[bool(impls)] = [done[str(i)] for i in range(4)]
    for default, xla in zip(outs[False], outs[True]):
        same = next((i for i, (a, b) in enumerate(zip(default.token_ids, xla.token_ids)) if a != b),
                    len(xla.token_ids))
        assert same >= 1, (default.token_ids, xla.token_ids)
        np.testing.assert_allclose(default.logprobs[:same], xla.logprobs[:same], atol=5e-2)
