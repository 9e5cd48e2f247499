"""Pallas kernels (Triton-style, and Mosaic GPU kernels for Hopper; interpret mode on CPU, compiled on GPU), each
with a plain-jnp reference. They stand alone (nothing here imports the model); the model picks them by name."""

from swiftkv_jax.kernels.decode_attention import decode_attention, decode_attention_reference
from swiftkv_jax.kernels.decode_attention_mgpu import (MosaicDecodeBlockSizes, decode_attention_mgpu,
                                                       paged_attention_mgpu)
from swiftkv_jax.kernels.flash_attention import FlashBlockSizes, flash_attention, flash_attention_reference
from swiftkv_jax.kernels.flash_attention_mgpu import (MosaicFlashBlockSizes, flash_attention_mgpu,
                                                      flash_attention_mgpu_reference)
from swiftkv_jax.kernels.paged_attention import paged_attention, paged_attention_reference
from swiftkv_jax.kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference
from swiftkv_jax.kernels.split_k import MASK_VALUE, AttentionResiduals, DecodeBlockSizes, merge_partials, normalize

__all__ = [
    "MASK_VALUE", "AttentionResiduals", "DecodeBlockSizes", "FlashBlockSizes", "MosaicDecodeBlockSizes",
    "MosaicFlashBlockSizes", "decode_attention", "decode_attention_mgpu", "decode_attention_reference",
    "flash_attention", "flash_attention_mgpu", "flash_attention_mgpu_reference", "flash_attention_reference",
    "merge_partials", "normalize", "paged_attention", "paged_attention_mgpu", "paged_attention_reference",
    "ragged_paged_attention", "ragged_paged_attention_reference",
]
