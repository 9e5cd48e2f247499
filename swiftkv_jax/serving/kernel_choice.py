"""The attention kernels the engines serve with when the caller names none: one rule per device, from GPU runs.

Off a GPU both engines keep the model config's choices (XLA). On a GPU, measured on an H200 with jax 0.11.2
(benchmarks/results/gpu-2026-11-24, `benchmarks/kernels.py`, Llama-3.1-8B heads, bf16):

- prefill, causal 8K x 1: our Mosaic flash kernel 393 TFLOP/s, cuDNN with our position/segment mask as a bias
  (what `attention_impl="cudnn"` runs: it must express packed prompts and chunks over cached context) 150; packed
  2K documents 203 against 38. cuDNN's own causal flag reaches 429, but expresses neither. So sm_90 prefills with
  `"mosaic"` and other GPUs with `"cudnn"` (16-bit activations; both refuse fp32).
- static decode, batch 32 x 4K..32K: Mosaic 0.27..1.22 ms, XLA 0.34..1.42, the Triton kernel (which needs the cache
  transposed) 0.70..3.94. So sm_90 decodes a 16-bit static cache with `"mosaic"`. Quantised caches keep the
  config's XLA path: XLA over an int8 cache (0.26..1.22 ms) beat the Mosaic kernel's in-SMEM conversion (0.35..1.56).
- paged decode (`sk.Engine`, pages of 16): the Triton paged kernel ties or beats Mosaic (0.47 against 0.52 ms at
  32 x 8K, 1.30 against 1.33 at 32 x 32K) but at 64 x 2K (0.345 against 0.325), on any GPU.

Measured again on 2026-11-25 (benchmarks/results/gpu-2026-11-25): prefill, Mosaic 464 TFLOP/s at 8K x 1 against
cuDNN's causal flag 483 and cuDNN with our mask 146; static decode, Mosaic the fastest at 32 x 32K and 128 x 4K..32K
(1.16 / 0.66..4.25 ms) but behind XLA at 32 x 4K (0.25 against 0.20 ms; the day before 0.27 against 0.34) and tied
at 32 x 8K (0.37); paged, Triton 0.19 ms against Mosaic's 0.26 at 32 x 4K. The rules stand: one run each way at the
small static points is no reason to switch, and the next run profiles them (`benchmarks/kernels.py --profile-at`).

Profiled on 2026-11-26 (benchmarks/results/gpu-2026-11-26): at 32 x 4K both defaults' kernels stream at the memory's
rate in device time (Mosaic static 0.129 ms, Triton paged 0.134 ms, for 537 MB: 101-107% of the read probe); what
a lone call adds is the GPU idle between ops. As 16 layers in one program, Mosaic 0.178 / 0.303 ms a layer at 32 x
4K / 8K against XLA's 0.194 / 0.348. The rules stand; the tuned block sizes (tuned_blocks.json) are the kernels'.

Head dims those kernels cannot take, or were not measured at, get a kernel that runs them, and the engines log why
(`serving_config`): cuDNN takes multiples of 8 up to 256 on sm_90+ and 128 before (jax's check, at the first long
prompt), so another head dim (OpenLLaMA 3B's 100) prefills with our Triton flash kernel (`"pallas"`, padded to a
power of two), or past FLASH_MAX_HEAD_DIM (256 before Hopper) with blockwise XLA (`"xla_flash"`); on sm_90 a head
dim other than 64 and 128 (Phi-2's 80, Phi-3's 96) prefills by cuDNN and decodes a static cache by XLA; the Triton
paged kernel takes powers of two, so sk.Engine's pools at another head dim are read by XLA.
"""

from __future__ import annotations

import logging
from typing import Optional

import jax

from swiftkv_jax.kernels.split_k import is_power_of_two
from swiftkv_jax.model import attention as attention_lib
from swiftkv_jax.model.config import ModelConfig
from swiftkv_jax.model.kv_quant import cache_dtype_name

SIXTEEN_BIT = ("bfloat16", "float16")
MOSAIC_HEAD_DIMS = (64, 128)  # the Mosaic kernels' measured head dims (Llama's); 256 would overrun their SMEM budget
FLASH_MAX_HEAD_DIM = 128  # the Triton flash tiles (2 stages, 128 x 64) fit any GPU up to here: 96.5 KiB at 128
log = logging.getLogger(__name__)


def is_hopper(device=None) -> bool:
    """Whether `device` (default: the first) is an sm_90 GPU, where the Mosaic GPU kernels run."""
    device = device or jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    return device.platform == "gpu" and capability is not None and str(capability).split(".")[0] == "9"


def choose(config: ModelConfig, cache_dtype="auto", *, paged: bool, device=None) -> tuple[dict, dict]:
    """(`default_impls`, {field: why a kernel the rule prefers was passed over for this config's head dim}); the
    reasons are what `serving_config` logs."""
    device = device or jax.devices()[0]
    impls = dict(attention_impl=config.attention_impl, decode_attention_impl=config.decode_attention_impl)
    reasons = {}
    if device.platform != "gpu":
        return impls, reasons
    mosaic = is_hopper(device) and config.head_dim in MOSAIC_HEAD_DIMS
    if config.dtype in SIXTEEN_BIT:
        if mosaic:
            impls["attention_impl"] = "mosaic"
        elif attention_lib.cudnn_takes_head_dim(config.head_dim, device):
            impls["attention_impl"] = "cudnn"
            if is_hopper(device):
                reasons["attention_impl"] = (f"our Mosaic flash kernel is the sm_90 default at head dims "
                                             f"{MOSAIC_HEAD_DIMS} only (as measured): prefill by cuDNN, with our mask "
                                             f"as a bias (2.6-3.7x slower than Mosaic at 8K on an H200)")
        else:  # our Triton kernel's tiles at a padded head dim of 256 would pass an A100's shared memory (~192 KiB)
            triton = config.head_dim <= FLASH_MAX_HEAD_DIM
            impls["attention_impl"] = "pallas" if triton else "xla_flash"
            reasons["attention_impl"] = (f"cuDNN attention takes head dims that are multiples of 8 up to "
                                         f"{attention_lib.cudnn_max_head_dim(device)} here, not {config.head_dim}: "
                                         + ("prefill by our Triton flash kernel ('pallas')" if triton else
                                            f"prefill by blockwise XLA ('xla_flash'; our Triton flash kernel's "
                                            f"tiles are sized for head dims up to {FLASH_MAX_HEAD_DIM})"))
    cache_name = cache_dtype_name(getattr(cache_dtype, "dtype", cache_dtype), config.dtype)  # a name or a format
    sixteen_bit_cache = cache_name in SIXTEEN_BIT
    if paged:  # the Triton paged kernel takes head dims that are powers of two >= 16 (Llama's 128, 64)
        taken = is_power_of_two(config.head_dim) and config.head_dim >= 16
        impls["decode_attention_impl"] = "pallas" if taken else "xla"
        if not taken:
            reasons["decode_attention_impl"] = ("the Triton paged kernel takes head dims that are powers of two: "
                                                "attention over the pages by XLA")
    elif mosaic and sixteen_bit_cache:
        impls["decode_attention_impl"] = "mosaic"
    elif is_hopper(device) and sixteen_bit_cache:
        reasons["decode_attention_impl"] = (f"our Mosaic decode kernel is the sm_90 default at head dims "
                                            f"{MOSAIC_HEAD_DIMS} only (as measured): decode by XLA")
    return impls, reasons


def default_impls(config: ModelConfig, cache_dtype="auto", *, paged: bool, device=None) -> dict:
    """{attention_impl, decode_attention_impl} an engine serves `config` with by default (see the module
    docstring); `paged`: sk.Engine's pools rather than the static cache."""
    return choose(config, cache_dtype, paged=paged, device=device)[0]


def serving_config(config: ModelConfig, cache_dtype="auto", *, paged: bool,
                   attention_impl: Optional[str] = None, decode_attention_impl: Optional[str] = None) -> ModelConfig:
    """`config` with the impls the caller named, and the device's defaults (`default_impls`) for the others; logs
    why a default passed over the rule's kernel for this head dim."""
    chosen, reasons = choose(config, cache_dtype, paged=paged)
    named = dict(attention_impl=attention_impl, decode_attention_impl=decode_attention_impl)
    for field, why in reasons.items():
        if not named[field]:
            log.warning("head_dim %d: %s", config.head_dim, why)
    config = config.replace(**{k: named[k] or chosen[k] for k in chosen})
    _check_mosaic(config, cache_dtype)
    if config.attention_impl == "cudnn":  # now, not at the first prompt of more than FEW_QUERIES tokens
        attention_lib.check_cudnn(config.dtype)
        if not attention_lib.cudnn_takes_head_dim(config.head_dim):
            instead = "pallas" if config.head_dim <= FLASH_MAX_HEAD_DIM else "xla_flash"
            raise ValueError(f"attention_impl='cudnn' cannot run head_dim {config.head_dim} on this GPU (cuDNN takes "
                             f"multiples of 8 up to {attention_lib.cudnn_max_head_dim()} here): use "
                             f"attention_impl='{instead}'")
    return config


def _check_mosaic(config: ModelConfig, cache_dtype) -> None:
    """The Mosaic kernels' dtypes and head dims, when the engine is made: a named one that cannot run failed at the
    first step (decode) or the first long prompt (prefill). Off a GPU they run interpreted, so the device is not
    checked."""
    if config.attention_impl == "mosaic" and config.dtype not in SIXTEEN_BIT:
        raise ValueError(f"attention_impl='mosaic' (the Mosaic GPU flash kernel) takes bfloat16 or float16 "
                         f"activations, got the model's {config.dtype}: set its dtype to bfloat16, or use "
                         f"attention_impl='xla_flash' (or 'pallas')")
    if config.decode_attention_impl != "mosaic":
        return
    cache_name = cache_dtype_name(getattr(cache_dtype, "dtype", cache_dtype), config.dtype)
    if config.dtype not in SIXTEEN_BIT or cache_name not in SIXTEEN_BIT + ("int8", "float8_e4m3fn"):
        raise ValueError(f"decode_attention_impl='mosaic' (the Mosaic GPU decode kernels) takes bfloat16 or float16 "
                         f"activations over a bfloat16, float16, int8 or float8_e4m3fn cache, got {config.dtype} over "
                         f"{cache_name}: set the model's dtype to bfloat16, or use decode_attention_impl='pallas' "
                         f"(or 'xla')")
    from swiftkv_jax.kernels.decode_attention_mgpu import HEAD_ALIGN  # Mosaic's imports only when it is named

    if config.head_dim % HEAD_ALIGN:
        raise ValueError(f"decode_attention_impl='mosaic' needs a head dim that is a multiple of {HEAD_ALIGN}, got "
                         f"{config.head_dim}: use decode_attention_impl='pallas' (or 'xla')")
