"""The distillation step (../shared/SWIFTKV.md §4) in-process, fp32: what is trained, the loss against a
float64 numpy computation from the model's full logits, chunking, gradient accumulation, sharding,
non-finite losses, and the typed run config with its recipes.

References not written here: numpy float64 KL/MSE, the published parameter arithmetic of Llama-3.1-8B,
an unsharded single-device run, and the paper's recipe values.
"""

import collections
import dataclasses
import glob
import os

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from flax import traverse_util

import swiftkv_jax as sk
from jaxpr_walk import sub_jaxprs
from distill_fixtures import (LLAMA_8B_TRAINABLE_L16, assert_trees_close, assert_trees_equal, init_state, jit_step,
                              n_params, numpy_kl, packed_batch, student, tiny_config, write_hf_config)
from swiftkv_jax import configuration
from swiftkv_jax.configuration import ConfigError
from swiftkv_jax.distill import loss as losses
from swiftkv_jax.distill import trainer
from swiftkv_jax.distill.config import (LossSection, ModelSection, OptimSection, TrainConfig, TrainSection)
from swiftkv_jax.distill import student as student_lib
from swiftkv_jax.distill.student import student_config
from swiftkv_jax.data.packing import max_runs
from swiftkv_jax.distill.trainable import merge, split

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")
CPUS = jax.devices("cpu")
FAST = OptimSection(learning_rate=1e-2, warmup_ratio=0.0)  # the first step already moves the weights
LOSS = LossSection(hidden_loss_mult=1.0, chunk_size=16)  # the current recipe's loss, chunked
# Equivalent computations (chunking, accumulation, sharding) sum in other orders: the KL, a small difference
# of large terms, moves by ~1e-6 relative in fp32, and Adam turns a rounding-level gradient entry into up
# to ~1e-3 of an lr = 1e-2 step (1e-5 seen). Real discrepancies are orders of magnitude larger.
METRICS_RTOL, WEIGHTS_ATOL = 5e-6, 5e-5


def run_steps(fn, state, frozen, batches):
    metrics = []
    for batch in batches:
        state, m = fn(state, frozen, batch)
        metrics.append(jax.device_get(m))
    return state, metrics


def assert_same_steps(run, reference, metrics_rtol=METRICS_RTOL):
    """(state, metrics) of two runs of the same steps agree."""
    assert_trees_close(run[1], reference[1], rtol=metrics_rtol)
    assert_trees_close(run[0].trainable, reference[0].trainable, rtol=1e-6, atol=WEIGHTS_ATOL)
    assert int(run[0].step) == int(reference[0].step) == len(reference[1])
    # Adam's moments are sums of the gradients (and their squares): this compares the gradients themselves.
    for x, y in zip(jax.tree.leaves(run[0].opt_state), jax.tree.leaves(reference[0].opt_state)):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5 * np.abs(y).max())


# --- what is trained ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("qkv_bias,g", [(False, 1), (True, 2)])
def test_trainable_split_is_exactly_swiftkv_qkv_and_norm(qkv_bias, g):
    cfg = tiny_config(qkv_bias=qkv_bias, num_key_value_layers=2, key_value_group_size=g)
    params = sk.abstract_params(cfg)
    trainable, frozen = split(params)
    leaves = ("kernel", "bias") if qkv_bias else ("kernel",)
    expected = ({("norm_swiftkv", "scale")}
                | {("swiftkv_groups", m, leaf) for m in ("k_proj_swiftkv", "v_proj_swiftkv") for leaf in leaves}
                | {("swiftkv_groups", "layers", "self_attn", "q_proj_swiftkv", leaf) for leaf in leaves})
    flat_all = traverse_util.flatten_dict(params)
    assert set(traverse_util.flatten_dict(trainable)) == expected
    assert set(traverse_util.flatten_dict(frozen)) == set(flat_all) - expected
    # AcrossKV: k/v only for the (L - l) / g group owners, a query for every later layer.
    k = trainable["swiftkv_groups"]["k_proj_swiftkv"]["kernel"]
    q = trainable["swiftkv_groups"]["layers"]["self_attn"]["q_proj_swiftkv"]["kernel"]
    assert k.shape[0] == 2 // g and q.shape[:2] == (2 // g, g)
    assert traverse_util.flatten_dict(merge(trainable, frozen)) == flat_all


@pytest.mark.parametrize("g,expected", [
    (1, LLAMA_8B_TRAINABLE_L16),
    # 16 queries, 4 owners' k/v, one norm
    (4, 16 * 4096 * 4096 + 4 * 2 * 4096 * 1024 + 4096),
])
def test_llama_8b_trainable_count(g, expected):
    rope = sk.RopeConfig(theta=500000.0, type="llama3", factor=8.0)
    llama_8b = sk.ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope=rope,
                              num_key_value_layers=16, key_value_group_size=g)
    trainable, frozen = split(sk.abstract_params(llama_8b))
    assert n_params(trainable) == expected
    assert n_params(frozen) == 8_030_261_248  # the published Llama-3.1-8B: every original weight stays
    if g == 1:
        assert round(n_params(trainable) / (n_params(trainable) + n_params(frozen)), 2) == 0.05  # "5%"


def test_steps_leave_frozen_bit_identical_and_optimizer_state_only_trainable():
    cfg, trainable, frozen = student(tiny_config(), l=2)
    frozen_before = jax.tree.map(np.array, frozen)
    fn, optimizer = jit_step(cfg, LOSS, FAST)
    state, metrics = run_steps(fn, init_state(trainable, optimizer), frozen,
                               [packed_batch(cfg.vocab_size, seed=s) for s in range(3)])
    assert int(state.step) == 3 and all(np.isfinite(m["loss"]) for m in metrics)
    assert_trees_equal(frozen, frozen_before)
    moved = [not np.allclose(a, b) for a, b in zip(jax.tree.leaves(state.trainable), jax.tree.leaves(trainable))]
    assert all(moved)
    # Adam's two moments per trainable leaf, shaped like it, and nothing shaped like a frozen-only weight.
    trainable_shapes = [a.shape for a in jax.tree.leaves(trainable)]
    moments = [a for a in jax.tree.leaves(state.opt_state) if a.ndim > 0]
    assert sorted(a.shape for a in moments) == sorted(trainable_shapes * 2)
    assert n_params(moments) == 2 * n_params(trainable)
    frozen_only = {frozen["embed_tokens"]["embedding"].shape, frozen["lm_head"]["kernel"].shape,
                   frozen["layers"]["mlp"]["up_proj"]["kernel"].shape,
                   frozen["swiftkv_groups"]["layers"]["mlp"]["up_proj"]["kernel"].shape,
                   frozen["swiftkv_groups"]["layers"]["self_attn"]["o_proj"]["kernel"].shape}
    assert not frozen_only & {a.shape for a in moments}


# --- the loss -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden_loss_mult", [0.0, 1.0])
def test_student_identical_to_teacher_has_zero_loss_and_gradient(hidden_loss_mult):
    """g = 1, l = L - 1, copy init: the one SwiftKV layer computes exactly the teacher's layer (§3)."""
    cfg, trainable, frozen = student(tiny_config(), l=3)
    fn, optimizer = jit_step(cfg, LossSection(hidden_loss_mult=hidden_loss_mult))
    _, (m,) = run_steps(fn, init_state(trainable, optimizer), frozen, [packed_batch(cfg.vocab_size)])
    assert m["kl"] == 0.0 and m["hidden_mse"] == 0.0 and m["loss"] == 0.0
    assert m["grad_norm"] < 1e-6


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_kl_per_position_matches_float64(temperature):
    rng = np.random.RandomState(0)
    teacher, student_ = (rng.randn(3, 5, 50).astype(np.float32) * 4 for _ in range(2))
    got = losses.kl_per_position(teacher, student_, temperature)
    np.testing.assert_allclose(got, numpy_kl(teacher, student_, temperature), rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(losses.kl_per_position(teacher, teacher, temperature)) == 0.0)


def _head_problem(seed=1, batch=2, length=20, dim=16, vocab=50):
    rng = np.random.RandomState(seed)
    params = {"w": jnp.asarray(rng.randn(dim, vocab).astype(np.float32)),
              "scale": jnp.asarray(1 + 0.1 * rng.randn(dim).astype(np.float32))}
    head = lambda p, h: (h * p["scale"]) @ p["w"]  # a norm-like scale and a projection, as Transformer.head
    hs, ht = (jnp.asarray(rng.randn(batch, length, dim).astype(np.float32)) for _ in range(2))
    weights = jnp.asarray((rng.rand(batch, length) < 0.7).astype(np.int32))
    return head, params, hs, ht, weights


def test_chunked_kl_sum_is_independent_of_chunk_size():
    head, params, hs, ht, weights = _head_problem()
    temperature, length = 2.0, hs.shape[1]

    def value_and_grad(chunk_size):
        return jax.jit(jax.value_and_grad(
            lambda s: losses.chunked_kl_sum(head, params, s, ht, weights, temperature, chunk_size)))(hs)

    expected = np.sum(np.asarray(weights) * numpy_kl(np.asarray(head(params, ht)), np.asarray(head(params, hs)),
                                                     temperature))
    value0, grad0 = value_and_grad(0)
    np.testing.assert_allclose(value0, expected, rtol=1e-5)
    assert np.abs(grad0).max() > 1e-3
    for chunk_size in (7, 16, 10, length, 64):  # padded, padded, divisor, whole, longer than T
        value, grad = value_and_grad(chunk_size)
        np.testing.assert_allclose(value, value0, rtol=1e-6, err_msg=f"chunk {chunk_size}")
        np.testing.assert_allclose(grad, grad0, rtol=1e-6, atol=1e-6 * np.abs(grad0).max(),
                                   err_msg=f"chunk {chunk_size}")


@pytest.mark.parametrize("chunk_size", [0, 7])
def test_fused_losses_match_autodiff_of_the_whole_logits(chunk_size):
    """The gradients the chunks compute in the forward pass are jax's own gradients of the unchunked loss, for
    the hidden states and, where they are differentiated (pretraining, a trainable head), the head's weights."""
    head, params, hs, ht, weights = _head_problem(seed=2)
    temperature, w = 2.0, weights.astype(jnp.float32)
    targets = jnp.asarray(np.random.RandomState(3).randint(0, 50, hs.shape[:2]), jnp.int32)
    scale = 0.37  # the objective scales the sum; the stored gradient must take the cotangent

    def reference(p, h):
        teacher = jax.lax.stop_gradient(head(p, ht))  # the KL's teacher side has no gradient, its head's neither
        kl = jnp.sum(w * losses.kl_per_position(teacher, head(p, h), temperature))
        log_p = jax.nn.log_softmax(head(p, h), axis=-1)
        nll = -jnp.sum(w * jnp.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0])
        return scale * kl, scale * nll

    def fused(p, h):
        kl = losses.chunked_kl_sum(head, p, h, ht, weights, temperature, chunk_size)
        nll, _ = losses.chunked_cross_entropy_sums(head, p, h, targets, weights, chunk_size)
        return scale * kl, scale * nll

    for which in (0, 1):  # KL, cross-entropy
        got = jax.jit(jax.value_and_grad(lambda p, h: fused(p, h)[which], argnums=(0, 1)))(params, hs)
        want = jax.value_and_grad(lambda p, h: reference(p, h)[which], argnums=(0, 1))(params, hs)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
        for g, r in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5 * np.abs(r).max())
    # the KL's teacher side has no gradient by construction; a `rest` that is differentiated raises
    sums = lambda _, __, logits, x: (jnp.sum(logits * x)[None], x)
    with pytest.raises(ValueError, match="stop_gradient"):
        jax.grad(lambda x: losses.fused_chunked_sums(sums, head, params, hs, (x,), chunk_size)[0])(
            jnp.ones(hs.shape[:2] + (50,)))


def test_fused_kl_runs_the_head_three_times_a_token():
    """Teacher logits, student logits, the student's activation gradient: no logits recomputed in the backward
    pass and no gradient for the frozen head (XLA's FLOP count of the compiled value-and-grad, one chunk)."""
    batch, length, dim, vocab = 1, 64, 128, 4096
    rng = np.random.RandomState(0)
    params = {"w": jnp.asarray(rng.randn(dim, vocab).astype(np.float32)), "scale": jnp.ones((dim,), jnp.float32)}
    head = lambda p, h: (h * p["scale"]) @ p["w"]
    hs, ht = (jnp.asarray(rng.randn(batch, length, dim).astype(np.float32)) for _ in range(2))
    weights = jnp.ones((batch, length), jnp.int32)
    fn = jax.jit(jax.value_and_grad(lambda h, p: losses.chunked_kl_sum(head, p, h, ht, weights, 2.0, 0)))
    cost = fn.lower(hs, params).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    one_head = 2 * batch * length * dim * vocab
    assert 3 * one_head <= cost["flops"] < 3.5 * one_head, cost["flops"] / one_head


def _weight_uses(jaxpr, times: int = 1, found=None) -> collections.Counter:
    """Per module of the published layout (q_proj, gate_proj, ...): the layer-applications of its weight's
    products in a jaxpr (a product inside a scan over n layers counts n), sub-jaxprs included."""
    found = collections.Counter() if found is None else found
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            *scopes, _ = str(eqn.source_info.name_stack).split("/")
            found[scopes[-1] if scopes else ""] += times
        inner_times = times * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
        for inner in sub_jaxprs(eqn):
            _weight_uses(inner, inner_times, found)
    return found


@pytest.mark.parametrize("l", [1, 3])
def test_the_layers_below_l_run_once_a_step(l):
    """The method's saving (SWIFTKV.md: the student shares the teacher's layers below l, computed once): in the
    traced step, the teacher's own q/k/v (frozen, no gradient) are applied in L layers a step, l shared and L - l of
    the teacher's wiring, and each MLP in l + 3 (L - l): the shared forward, the teacher's, the student's, and
    the student's backward to its input. Running the layers below l again (for the student) adds l to each."""
    cfg, trainable, frozen = student(tiny_config(), l=l)
    fn, optimizer = jit_step(cfg, LOSS)
    uses = _weight_uses(jax.make_jaxpr(fn)(init_state(trainable, optimizer), frozen,
                                           packed_batch(cfg.vocab_size)).jaxpr)
    layers = cfg.num_hidden_layers
    assert uses["q_proj"] == uses["k_proj"] == uses["v_proj"] == layers, uses
    assert uses["gate_proj"] == uses["up_proj"] == uses["down_proj"] == l + 3 * (layers - l), uses


def two_steps(cfg, trainable, frozen, loss=LOSS, grad_accum=1):
    fn, optimizer = jit_step(cfg, loss, FAST, grad_accum=grad_accum)
    return run_steps(fn, init_state(trainable, optimizer), frozen,
                     [packed_batch(cfg.vocab_size, seed=s) for s in range(2)])  # 8 rows of 24 positions


@pytest.fixture(scope="module")
def perturbed():
    """(config, trainable, frozen): l = 2 of 4, trainables perturbed so that KL and hidden MSE are > 0."""
    return student(tiny_config(), l=2, noise=0.05)


@pytest.fixture(scope="module")
def reference_steps(perturbed):
    return two_steps(*perturbed)


@pytest.mark.parametrize("chunk_size", [0, 7])  # whole sequence; a non-divisor of 24 (padded); LOSS has 16
def test_train_step_is_independent_of_chunk_size(perturbed, reference_steps, chunk_size):
    assert_same_steps(two_steps(*perturbed, loss=dataclasses.replace(LOSS, chunk_size=chunk_size)), reference_steps)


@pytest.mark.parametrize("temperature,hidden_loss_mult", [(2.0, 0.0), (1.5, 0.5)])  # paper era; other values
def test_loss_is_t2_masked_kl_over_tokens_plus_hidden_mse(perturbed, temperature, hidden_loss_mult):
    """loss = T^2 * sum(mask * KL_T) / (non-padding positions) + mult * MSE(hidden entering the last layer),
    computed in float64 from the model's own full forwards of both wirings."""
    cfg, trainable, frozen = perturbed
    batch = packed_batch(cfg.vocab_size, seed=3)
    batch["loss_mask"] = np.random.RandomState(4).randint(0, 2, batch["tokens"].shape).astype(np.int32)  # padding too
    valid = batch["segment_ids"] > 0
    assert (~valid).any() and (batch["loss_mask"][~valid] == 1).any() and (batch["loss_mask"][valid] == 0).any()
    model = sk.Model(cfg, merge(trainable, frozen))
    where = dict(positions=batch["positions"], segment_ids=batch["segment_ids"])
    s_logits, s_inter = sk.intermediates(model, batch["tokens"], swiftkv=True, **where)
    t_logits, t_inter = sk.intermediates(model, batch["tokens"], swiftkv=False, **where)
    n = valid.sum()
    kl = np.sum(batch["loss_mask"] * valid * numpy_kl(t_logits, s_logits, temperature)) / n
    last = cfg.num_hidden_layers - 1  # residual[i] is the output of layer i - 1, i.e. the input of layer i
    diff = np.asarray(s_inter["residual"][last], np.float64) - np.asarray(t_inter["residual"][last], np.float64)
    mse = np.sum(valid[..., None] * diff**2) / (n * cfg.hidden_size)
    assert kl > 1e-4 and mse > 1e-4

    fn, optimizer = jit_step(cfg, LossSection(temperature=temperature, hidden_loss_mult=hidden_loss_mult,
                                              chunk_size=7))
    state, (m,) = run_steps(fn, init_state(trainable, optimizer), frozen, [batch])
    assert m["tokens"] == n
    np.testing.assert_allclose(m["kl"], kl, rtol=2e-5)
    np.testing.assert_allclose(m["loss"], temperature**2 * kl + hidden_loss_mult * mse, rtol=2e-5)
    if hidden_loss_mult:
        np.testing.assert_allclose(m["hidden_mse"], mse, rtol=2e-5)

    # The gradient the step applies is that of this loss (its metrics are recomputed from sums, so a step that
    # differentiated another weighting would still report the right loss): the same loss written with jnp over
    # the model's own full forwards, differentiated by jax.grad, against the step's gradient norm and Adam's
    # first moment after one step ((1 - b1) g, with grad_clip's scale)
    def reference_loss(tr):
        student_model = sk.Model(cfg, merge(tr, frozen))
        s_logits, s_inter = sk.intermediates(student_model, batch["tokens"], swiftkv=True, **where)
        weight = jnp.asarray(batch["loss_mask"] * valid, jnp.float32)
        log_t = jax.nn.log_softmax(jnp.asarray(t_logits, jnp.float32) / temperature)
        log_s = jax.nn.log_softmax(s_logits.astype(jnp.float32) / temperature)
        kl_ = jnp.sum(weight * jnp.sum(jnp.exp(log_t) * (log_t - log_s), -1)) / n
        diff_ = s_inter["residual"][last] - jnp.asarray(t_inter["residual"][last])
        mse_ = jnp.sum(jnp.asarray(valid, jnp.float32)[..., None] * diff_**2) / (n * cfg.hidden_size)
        return temperature**2 * kl_ + hidden_loss_mult * mse_

    grads = jax.grad(reference_loss)(trainable)
    norm = float(optax.tree_utils.tree_norm(grads))
    np.testing.assert_allclose(m["grad_norm"], norm, rtol=1e-4)
    optim = OptimSection()  # jit_step's
    scale = (1 - optim.b1) * (min(1.0, optim.grad_clip / norm) if optim.grad_clip > 0 else 1.0)
    mu = optax.tree_utils.tree_get(state.opt_state, "mu")
    assert_trees_close(mu, jax.tree.map(lambda g: scale * g, grads), rtol=2e-3, atol=1e-4 * scale * norm)


@pytest.mark.parametrize("grad_accum", [2, 4])
def test_grad_accum_gives_the_same_steps(perturbed, reference_steps, grad_accum):
    assert_same_steps(two_steps(*perturbed, grad_accum=grad_accum), reference_steps)


@pytest.mark.parametrize("mesh_shape,grad_accum", [((1, 8, 1), 1), ((2, 2, 2), 2)],
                         ids=["fsdp8", "data2-fsdp2-tensor2-accum2"])
def test_sharded_step_equals_single_device(perturbed, reference_steps, mesh_shape, grad_accum):
    """trainer.build_step on a mesh of 8 devices vs the plain jitted step on one: metrics, weights, moments."""
    mesh = sk.make_mesh(*mesh_shape, devices=CPUS[:8])
    cfg, trainable, frozen = student(tiny_config(), l=2, mesh=mesh, noise=0.05)  # born sharded
    assert_trees_equal((trainable, frozen), perturbed[1:])  # the same weights as the one-device run
    embedding = frozen["embed_tokens"]["embedding"]
    assert embedding.sharding.shard_shape(embedding.shape) != embedding.shape  # really split over devices
    config = TrainConfig(loss=LOSS, optim=FAST, train=TrainSection(global_batch_size=8, grad_accum=grad_accum))
    compiled = trainer.build_step(config, cfg, mesh, trainable, jax.tree.map(lambda a: a.sharding, frozen), 10)
    batches = [jax.device_put(packed_batch(cfg.vocab_size, seed=s), compiled.batch_sharding) for s in range(2)]
    run = run_steps(compiled.fn, compiled.init_state(trainable), frozen, batches)
    assert_same_steps(run, reference_steps, metrics_rtol=1e-5)
    assert jax.tree.map(lambda a: a.sharding, run[0].trainable) == jax.tree.map(lambda a: a.sharding, trainable)


@pytest.mark.gpu
def test_cudnn_attention_trains_as_xla_does():
    """attention_impl="cudnn" in training (jax's fused cuDNN backward, our packed-row mask as its bias) against XLA:
    the attention's gradient over packed rows (fp32 XLA as the reference), then one distillation step, bf16, with
    the bias and with cuDNN's packed layout (tests/test_cudnn_attention.py checks that one's attention)."""
    from swiftkv_jax.model.attention import attend

    batch = packed_batch(64, batch=2, length=128, seed=5)
    where = [jnp.asarray(batch[k]) for k in ("positions", "positions", "segment_ids", "segment_ids")]
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (2, 128, 4, 64), jnp.bfloat16)
    k, v = (jax.random.normal(key, (2, 128, 2, 64), jnp.bfloat16) for key in keys[1:3])
    weight = jax.random.normal(keys[3], q.shape, jnp.float32)
    grads = {impl: jax.jit(jax.grad(lambda *qkv, impl=impl: jnp.sum(
        attend(impl, *qkv, *where).astype(jnp.float32) * weight), argnums=(0, 1, 2)))(*(
            x.astype(dtype) for x in (q, k, v))) for impl, dtype in (("cudnn", jnp.bfloat16), ("xla", jnp.float32))}
    for got, want in zip(grads["cudnn"], grads["xla"]):
        np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=3e-2 * np.abs(want).max())

    cfg, trainable, frozen = student(tiny_config(head_dim=64, dtype="bfloat16"), l=2, noise=0.05)
    step_batch = packed_batch(cfg.vocab_size)
    metrics = {}
    # cuDNN with our mask as a bias, and as train.py runs it: its packed causal layout sized by the rows' runs
    for name, impl, runs in (("bias", "cudnn", None), ("packed", "cudnn", max_runs(step_batch["segment_ids"])),
                             ("xla", "xla", None)):
        fn, optimizer = jit_step(cfg.replace(attention_impl=impl, max_segments_per_row=runs), LOSS, FAST)
        metrics[name] = run_steps(fn, init_state(trainable, optimizer), frozen, [step_batch])[1][0]
    assert metrics["xla"]["loss"] > 1e-3
    for form in ("bias", "packed"):
        for name in ("loss", "kl", "grad_norm"):
            np.testing.assert_allclose(metrics[form][name], metrics["xla"][name], rtol=3e-2, err_msg=f"{form} {name}")


@pytest.mark.parametrize("poison", ["nan_lm_head", "inf_embedding"])
def test_non_finite_loss_leaves_state_unchanged(perturbed, poison):
    cfg, trainable, frozen = perturbed
    fn, optimizer = jit_step(cfg, LOSS, FAST)
    batch = packed_batch(cfg.vocab_size)
    state, _ = run_steps(fn, init_state(trainable, optimizer), frozen, [batch])  # a state with moments
    bad = jax.tree.map(lambda a: a, frozen)
    if poison == "nan_lm_head":
        bad["lm_head"] = {"kernel": frozen["lm_head"]["kernel"].at[0, 0].set(jnp.nan)}
    else:
        bad["embed_tokens"] = {"embedding": frozen["embed_tokens"]["embedding"].at[batch["tokens"][0, 0]].set(jnp.inf)}
    before = jax.tree.map(np.array, state)
    after, (m,) = run_steps(fn, state, bad, [batch])
    assert not np.isfinite(m["loss"])
    assert_trees_equal(after, before)  # step counter, weights and optimizer state
    resumed, (m,) = run_steps(fn, after, frozen, [batch])  # a good batch continues normally
    assert np.isfinite(m["loss"]) and int(resumed.step) == int(before.step) + 1


# --- the run config -----------------------------------------------------------------------------------------


def load(*overrides, path=None):
    return configuration.load(TrainConfig, path, ["model.teacher=t", "data.sources=[{path: d.jsonl}]", *overrides])


@pytest.mark.parametrize("assignment,suggestion", [
    ("optim.learnig_rate=1e-3", "optim.learning_rate"),
    ("optimm.learning_rate=1e-3", "optim.learning_rate"),
    ("train.grad_acum=2", "train.grad_accum"),
    ("loss.hiden_loss_mult=1", "loss.hidden_loss_mult"),
    # other trainers' names for our keys, before spelling (which offers optim.b2 for optim.lr)
    ("optim.lr=1e-3", "optim.learning_rate"),
    ("optim.max_grad_norm=1", "optim.grad_clip"),
    ("train.gradient_accumulation_steps=2", "train.grad_accum"),
    ("optim.save_steps=10", "checkpoint.every"),
])
def test_unknown_key_suggests_the_nearest(assignment, suggestion):
    with pytest.raises(ConfigError, match=f"did you mean '{suggestion}'"):
        load(assignment)


@pytest.mark.parametrize("text,key,suggestion", [
    ("optimm:\n  learning_rate: 1.0e-3\n", "optimm", "optim"),
    ("optim:\n  learnig_rate: 1.0e-3\n", "optim.learnig_rate", "optim.learning_rate"),
])
def test_unknown_key_in_yaml_names_the_file(tmp_path, text, key, suggestion):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"'{key}' in {path}.*did you mean '{suggestion}'"):
        load(path=path)


def test_a_yaml_bool_is_no_float(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("optim:\n  learning_rate: true\n")
    with pytest.raises(ConfigError, match="optim.learning_rate: expected float, got True"):
        configuration.load(TrainConfig, path)


@pytest.mark.parametrize("assignment,match", [
    ("train.global_batch_size=eight", "train.global_batch_size: expected int"),
    ("train.global_batch_size=2.5", "expected int"),
    ("train.global_batch_size=true", "expected int"),
    ("optim.learning_rate=fast", "optim.learning_rate: expected float"),
    ("train.resume=maybe", "train.resume: expected bool"),
    ("model.norm_init=cpy", "'cpy' is not one of copy, ones; did you mean 'copy'"),
    ("model.frozen_dtype=fp32", "is not one of float32, bfloat16, float16"),
    ("model.remat=partial", "is not one of none, full, dots"),
    ("distributed.cpu_collectives=nccl", "is not one of gloo, mpi, none"),
    ("data.sources=3", "expected DataSource"),
    ("optim.learning_rate", "must look like section.key=value"),
])
def test_wrong_values_are_rejected(assignment, match):
    with pytest.raises(ConfigError, match=match):
        load(assignment)


def test_values_are_coerced():
    config = load("optim.learning_rate=1e-4", "train.max_steps=7", "train.resume=true", "train.max_steps=null",
                  "model.tokenizer=~", "mesh.fsdp=-1")
    assert config.optim.learning_rate == 1e-4 and isinstance(config.optim.learning_rate, float)
    assert config.train.max_steps is None and config.train.resume is True and config.model.tokenizer is None
    assert config.data.sources[0].path == "d.jsonl"


@pytest.mark.parametrize("text,match", [
    (None, "does not exist"),
    ("model: [unclosed\n", "not valid YAML"),
    ("- a\n- b\n", "must hold a mapping of sections, got list"),
    ("optim: 3\n", "optim: expected OptimSection"),
])
def test_yaml_file_errors(tmp_path, text, match):
    path = tmp_path / "r.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load(path=path)


@pytest.mark.parametrize("overrides,match", [
    (("train.global_batch_size=6", "train.grad_accum=4"),
     r"global_batch_size \(6\) must be divisible by .*grad_accum \(4\)"),
    (("model.teacher=",), "model.teacher is required"),
    (("data.sources=[]",), "data.sources is empty"),
    (("model.num_key_value_layers=0",), "num_key_value_layers"),
    (("optim.warmup_ratio=1.5",), "warmup_ratio"),
    (("loss.temperature=0",), "temperature must be > 0"),
    (("train.max_steps=0",), r"max_steps must lie in \[1, 2\*\*31\)"),
    (("data.seq_len=1",), "seq_len must be >= 2"),
])
def test_validate_cross_checks(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load(*overrides)


@pytest.mark.parametrize("l,g,match", [
    (4, 1, "num_key_value_layers=4 leaves no layer to distil in a 4-layer model"),
    (5, 1, "choose l < 4"),
    (1, 2, r"model: .*"),  # (L - l) = 3 layers do not split into groups of 2
])
def test_student_config_rejects_bad_layouts(tmp_path, l, g, match):
    teacher = write_hf_config(tmp_path, num_hidden_layers=4)
    with pytest.raises(ConfigError, match=match):
        student_config(ModelSection(teacher=str(teacher), num_key_value_layers=l, key_value_group_size=g))
    assert student_config(ModelSection(teacher=str(teacher), num_key_value_layers=2, key_value_group_size=2)
                          ).num_kv_groups == 1


def test_student_config_refuses_a_forward_only_attention(tmp_path):
    teacher = write_hf_config(tmp_path, num_hidden_layers=4)
    with pytest.raises(ConfigError, match="attention_impl='pallas' has no backward pass"):
        student_config(ModelSection(teacher=str(teacher), num_key_value_layers=2, attention_impl="pallas"))


def test_student_config_refuses_cudnn_where_it_cannot_run(tmp_path):
    teacher = write_hf_config(tmp_path, num_hidden_layers=4)
    section = ModelSection(teacher=str(teacher), num_key_value_layers=2, attention_impl="cudnn")
    with pytest.raises(ConfigError, match="attention_impl='cudnn' needs an NVIDIA GPU.*use xla_chunked"):
        student_config(section)
    if jax.default_backend() == "gpu":
        with pytest.raises(ConfigError, match="compute_dtype is 'float32': set model.compute_dtype=bfloat16"):
            student_config(dataclasses.replace(section, compute_dtype="float32"))


@pytest.mark.parametrize("backend,hopper,compute,want", [
    ("cpu", False, "bfloat16", "xla_chunked"),
    ("gpu", True, "bfloat16", "cudnn"),
    ("gpu", True, "float16", "cudnn"),
    ("gpu", True, "float32", "xla_chunked"),  # cuDNN takes 16-bit activations only
    ("gpu", False, "bfloat16", "xla_chunked"),  # before Hopper cuDNN reads packed rows' mask as a [T, S] bias
])
def test_auto_attention_is_cudnn_on_hopper_in_16_bits(tmp_path, monkeypatch, backend, hopper, compute, want):
    """The shipped 7B-70B configs' `auto`: what the H200 measured fastest (cuDNN) where it runs as it was measured,
    xla_chunked elsewhere (a CPU dry run of the 8B config included); a named impl is kept as it is."""
    teacher = write_hf_config(tmp_path, num_hidden_layers=4)
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    monkeypatch.setattr(student_lib, "cudnn_packed_layout", lambda: hopper)
    section = ModelSection(teacher=str(teacher), num_key_value_layers=2, attention_impl="auto", compute_dtype=compute)
    assert student_config(section).attention_impl == want
    assert student_config(dataclasses.replace(section, attention_impl="xla")).attention_impl == "xla"


@pytest.mark.parametrize("head_dim,want", [(128, "cudnn"), (256, "cudnn"), (100, "xla_chunked"), (264, "xla_chunked")])
def test_auto_attention_takes_cudnn_only_at_head_dims_it_runs(tmp_path, monkeypatch, head_dim, want):
    """jax's cuDNN attention takes head dims that are multiples of 8 up to 256 on sm_90 (forward and backward):
    `auto` chose it for OpenLLaMA 3B's 100 too, which failed at the first step on the GPU; a named cudnn there is
    refused before any data is read."""
    teacher = write_hf_config(tmp_path, num_hidden_layers=4, head_dim=head_dim)
    hopper = type("Device", (), {"platform": "gpu", "compute_capability": "9.0"})()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [hopper])
    section = ModelSection(teacher=str(teacher), num_key_value_layers=2, attention_impl="auto")
    assert student_config(section).attention_impl == want
    cudnn = dataclasses.replace(section, attention_impl="cudnn")
    if want == "cudnn":
        assert student_config(cudnn).attention_impl == "cudnn"
    else:
        with pytest.raises(ConfigError, match=f"cannot run the teacher's head_dim {head_dim}.*use xla_chunked"):
            student_config(cudnn)


@pytest.mark.parametrize("capability,packed", [(None, False), ("8.9", False), ("9.0", True), ("10.0", True)])
def test_cudnn_packed_layout_needs_sm_90(monkeypatch, capability, packed):
    device = type("Device", (), {} if capability is None else {"compute_capability": capability})()
    monkeypatch.setattr(jax, "devices", lambda *a: [device])
    assert student_lib.cudnn_packed_layout() is packed


def test_attention_is_sized_by_the_packed_rows():
    """train.py's cuDNN config: max_segments_per_row is the most runs of segment ids (documents, then padding) in any
    packed row, read off the dataset; other attention impls are left alone."""
    rows = packed_batch(64, batch=6, length=40, seed=4)
    runs = [len(set(zip(r, np.r_[0, np.cumsum(r[1:] != r[:-1])]))) for r in rows["segment_ids"]]
    dataset = datasets.Dataset.from_dict({k: v.tolist() for k, v in rows.items()})
    said, cudnn = [], tiny_config().replace(attention_impl="cudnn")
    sized = trainer.sized_for_rows(cudnn, dataset, said.append, packed_layout=True)
    assert sized.max_segments_per_row == max(runs) > 1 and f"at most {max(runs)} runs" in said[-1]
    # before Hopper cuDNN has no packed layout: the bias, said aloud
    assert trainer.sized_for_rows(cudnn, dataset, said.append, packed_layout=False).max_segments_per_row is None
    assert "as a bias" in said[-1] and "sm_90" in said[-1]
    # xla_chunked is told its rows are packed documents (it skips the keys past each query block)
    chunked = trainer.sized_for_rows(tiny_config(attention_impl="xla_chunked"), dataset, said.append)
    assert chunked.max_segments_per_row == max(runs) and "keys up to its own end" in said[-1]
    assert trainer.sized_for_rows(tiny_config(), dataset, said.append).max_segments_per_row is None


def test_student_config_of_missing_teacher(tmp_path):
    with pytest.raises(ConfigError, match="model.teacher"):
        student_config(ModelSection(teacher=str(tmp_path / "nowhere")))


def test_describe_lists_every_key_with_its_default():
    text = configuration.describe(TrainConfig)
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("  ") and line.split()}
    defaults = configuration.to_dict(TrainConfig())
    for key in configuration.keys(TrainConfig):
        assert key in lines, key
        value = defaults
        for part in key.split("."):
            value = value[part]
        printed = lines[key].split(" = ", 1)[1]
        assert yaml.safe_load(printed) == value, (key, printed)
    assert len(configuration.keys(TrainConfig)) == len(set(configuration.keys(TrainConfig))) > 40


RECIPES = sorted(glob.glob(os.path.join(CONFIGS, "*.yaml")))


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_every_recipe_loads(path):
    config = configuration.load(TrainConfig, path, ["model.teacher=/some/teacher"])
    assert config.model.teacher == "/some/teacher" and config.data.sources


ARCTIC_SOURCES = ["HuggingFaceH4/ultrachat_200k", "lmsys/lmsys-chat-1m", "meta-math/MetaMathQA",
                  "ise-uiuc/Magicoder-OSS-Instruct-75K"]


@pytest.mark.parametrize("name", ["llama-3.1-8b-instruct.yaml", "llama-3.1-8b-instruct-acrosskv4.yaml",
                                  "llama-3.1-70b-instruct.yaml", "qwen2.5-7b-instruct.yaml"])
def test_the_arctictraining_mixture_the_recipes_document_loads(name, tmp_path):
    """The recipes keep SWIFTKV.md §4's mixture (OpenHermes-2.5) and document Snowflake's published one, whose
    sources are, in snowflakedb/ArcticTraining@5153273 projects/swiftkv/configs/llama-3.1-swiftkv-8b-instruct.yaml
    lines 16-19 (the same in llama-3.1-swiftkv-70b-instruct.yaml and qwen2.5-swiftkv-7b-instruct.yaml):
    ultrachat_200k, lmsys/lmsys-chat-1m, MetaMathQA, Magicoder-OSS-Instruct-75K. The commented line, put in
    place of OpenHermes-2.5's as the comment says, gives that list through our own loader."""
    text = open(os.path.join(CONFIGS, name)).read()
    (documented,) = [line for line in text.splitlines() if "lmsys/lmsys-chat-1m, format" in line]
    (hermes,) = [line for line in text.splitlines() if "teknium/OpenHermes-2.5" in line]
    (tmp_path / name).write_text(text.replace(hermes, "    " + documented.lstrip(" #")))
    config = configuration.load(TrainConfig, str(tmp_path / name))
    assert [s.path for s in config.data.sources] == ARCTIC_SOURCES
    (lmsys,) = [s for s in config.data.sources if s.path == "lmsys/lmsys-chat-1m"]
    assert (lmsys.format, lmsys.messages_field, lmsys.split) == ("chat", "conversation", "train")


# SWIFTKV.md §1/§4: published l, g and learning rates.
PUBLISHED = {
    "llama-3.1-8b-instruct.yaml": (16, 1, 2e-4),
    "llama-3.1-8b-instruct-acrosskv4.yaml": (16, 4, 2e-4),
    "llama-3.1-70b-instruct.yaml": (40, 1, 4e-4),
    "qwen2.5-7b-instruct.yaml": (21, 1, 2e-4),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_recipes_have_the_papers_settings(name):
    config = configuration.load(TrainConfig, os.path.join(CONFIGS, name))
    l, g, lr = PUBLISHED[name]
    assert (config.model.num_key_value_layers, config.model.key_value_group_size) == (l, g)
    assert config.optim.learning_rate == lr
    optim = config.optim
    assert (optim.b1, optim.b2, optim.weight_decay, optim.warmup_ratio) == (0.9, 0.999, 0.0, 0.05)
    assert config.loss.temperature == 2.0 and config.train.epochs == 1.0 and config.data.seq_len == 8192
    assert config.model.norm_init == "copy" and config.model.trainable_dtype == "float32"
    paths = {s.path for s in config.data.sources}
    assert {"HuggingFaceH4/ultrachat_200k", "teknium/OpenHermes-2.5", "meta-math/MetaMathQA",
            "ise-uiuc/Magicoder-OSS-Instruct-75K"} <= paths
    assert [s.split for s in config.data.sources if s.path == "HuggingFaceH4/ultrachat_200k"] == ["train_sft"]
    # Published data pipeline (snowflakedb/ArcticTraining@5153273, arctic_training/data/sft_factory.py:221-232 and
    # 251-254, `filter_dataset_length` then `pack_dataset`): a conversation over max_length (8192) is dropped whole
    # (`len(x["input_ids"]) <= self.config.max_length`), never cut into pieces that start mid-conversation.
    assert config.data.long_documents == "drop"
    if "8b" in name or "7b" in name:
        assert config.train.global_batch_size == 8  # ~8 packed sequences of 8K (~64K tokens) per step
