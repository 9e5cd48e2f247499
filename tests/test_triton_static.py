"""benchmarks/triton_static.py: the Triton IR and launch settings jax lowers our flash kernel to, read on a CPU."""

import sys
from pathlib import Path

import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import triton_static  # noqa: E402

from swiftkv_jax.kernels.flash_attention import FlashBlockSizes, flash_attention  # noqa: E402


def _lowered(tokens: int, block_sizes=None):
    q, k = (jnp.zeros((1, tokens, n, 128), jnp.bfloat16) for n in (32, 8))
    positions, segments = jnp.arange(tokens, dtype=jnp.int32)[None], jnp.ones((1, tokens), jnp.int32)
    return triton_static.triton_ir(lambda *x: flash_attention(*x, block_sizes=block_sizes, interpret=False),
                                   q, k, k, positions, positions, segments, segments)


def test_the_launch_is_the_one_the_kernel_chose_not_the_one_asked():
    """At head dim 128 the default is 128-row tiles under 8 warps, 2 stages; a short input's 64-row tile gets 4 warps
    (Hopper's MMA gives a warp 16 rows: 8 warps over 64 rows compute them twice), read off the lowered call."""
    ir, warps, stages = _lowered(8192)
    assert "tt.func" in ir and "tt.dot" in ir and (warps, stages) == (8, 2)
    assert FlashBlockSizes.for_head_dim(128) == FlashBlockSizes(128, 64, 8, 2)
    assert FlashBlockSizes.for_head_dim(64) == FlashBlockSizes(64, 64, 4, 2)
    _, warps, _ = _lowered(64)
    assert warps == 4
    _, warps, stages = _lowered(8192, FlashBlockSizes(64, 32, 8, 3))  # a tile as asked keeps its warps
    assert (warps, stages) == (8, 3)


def test_without_triton_it_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    assert triton_static.main(["--configs", "defaults", "--out", "/dev/null"]) == 2
    assert "pip install triton" in capsys.readouterr().err
