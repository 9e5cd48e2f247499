"""The distillation step's model-FLOP formula against a count by hand on a small config, and its known ratios."""

from __future__ import annotations

import pytest

from swiftkv_jax.distill.model_flops import distill_step_flops
from swiftkv_jax.model.config import ModelConfig


def small(**kw):
    return ModelConfig(**{**dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=4,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_key_value_layers=2),
                          **kw})


def test_a_count_by_hand():
    # d 8, n 2, k 1, h 4, f 16, V 10, L 4, l 2, g 1, T 6. Matmuls a token: q 2*64, k and v 2*32 each, o 2*64,
    # MLP 2*384; attention 4 n h (T/2) = 96; head 2*80.
    # lower, 2 layers: 2 * (128 + 128 + 128 + 768 + 96) = 2496; teacher: 2496 + 160 = 2656
    # student: 2 layers * (128 + 128 + 768 + 96) + 2 owners * (64 + 64) + 160 = 2240 + 256 + 160 = 2656
    # backward: head 160 + o and MLP 2 * (128 + 768) + attention 2 * 192 + q weights 2 * 128 + q inputs 1 * 128
    #           + owners' k/v weights and inputs 2 * 2 * 128 = 160 + 1792 + 384 + 256 + 128 + 512 = 3232
    flops = distill_step_flops(small(), seq_len=6)
    assert tuple(flops) == (2496, 2656, 2656, 3232) and flops.total == 11040


def test_a_count_by_hand_where_l_s_and_g_differ():
    """l = 1 of L = 5, g = 2: l (1), S = L - l (4), G = S / g (2) and S - 1 (3) all differ, so a formula that uses one
    for another (l = S = G at half depth with g = 1, the other hand count and the 8B check) is caught; the demo's
    25% / 75% and AcrossKV students are such configs."""
    # per-layer numbers as in test_a_count_by_hand: q = o = 64, k = v = 32, MLP 384, attention 96, head 2 * 80 = 160
    layer = 2 * (64 + 32 + 32 + 64 + 384) + 96                                  # 1248
    lower = 1 * layer                                                           # l = 1 layer
    teacher = 4 * layer + 160                                                   # S = 4 layers + head
    student_forward = 4 * (2 * (64 + 64 + 384) + 96) + 2 * (2 * 32 + 2 * 32) + 160  # G = 2 owners' k and v
    student_backward = (160 + 4 * 2 * (64 + 384) + 4 * 2 * 96   # head, o and MLP inputs, attention (x2) of S layers
                        + 4 * 2 * 64 + 3 * 2 * 64               # q_proj_swiftkv weights (S), inputs (S - 1)
                        + 2 * 2 * (2 * 32 + 2 * 32))            # G owners' k/v: weights and inputs
    flops = distill_step_flops(small(num_hidden_layers=5, num_key_value_layers=1, key_value_group_size=2), 6)
    assert tuple(flops) == (lower, teacher, student_forward, student_backward) == (1248, 5152, 4896, 5920)
    assert flops.total == 17216


def test_acrosskv_shares_the_owners_and_a_plain_model_is_refused():
    one, two = distill_step_flops(small(), 6), distill_step_flops(small(key_value_group_size=2), 6)
    assert one.student_forward - two.student_forward == 2 * 2 * 32  # one owner's k and v fewer
    with pytest.raises(ValueError, match="SwiftKV student"):
        distill_step_flops(small(num_key_value_layers=None), 6)


def test_llama_3_1_8b_at_half_depth():
    """Below the ~6 x 8B = 48 GFLOP a token of a full fine-tune (the paper's anchor counts ~40): no backward
    below l and frozen weights' gradients skipped."""
    config = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_key_value_layers=16)
    per_token = distill_step_flops(config, seq_len=8192).total
    assert 25e9 < per_token < 40e9, per_token / 1e9
