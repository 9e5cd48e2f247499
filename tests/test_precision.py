"""swiftkv_jax.model.precision.einsum_fp32: fp32 scores and logits whose backward runs in the operands' dtype."""

import jax
import jax.numpy as jnp
import numpy as np

import swiftkv_jax as sk
from swiftkv_jax.model.precision import einsum_fp32
from swiftkv_jax.model.transformer import Transformer

from jaxpr_walk import sub_jaxprs

EQUATION = "BTD,DV->BTV"


def _operands(dtype):
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    return (jax.random.normal(ka, (2, 16, 64), jnp.float32).astype(dtype),
            (jax.random.normal(kb, (64, 256), jnp.float32) / 8).astype(dtype))


def _loss(f):  # the logits' use in training: a softmax cross-entropy
    return lambda a, b: -jnp.sum(jax.nn.log_softmax(f(a, b), axis=-1)[..., 3])


def _dot_operand_dtypes(jaxpr) -> list:
    """The operand dtypes of every dot_general in a jaxpr and the jaxprs inside its equations."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(tuple(v.aval.dtype for v in eqn.invars))
        for inner in sub_jaxprs(eqn):
            found += _dot_operand_dtypes(inner)
    return found


def test_fp32_operands_match_autodiff():
    a, b = _operands(jnp.float32)
    plain = lambda a, b: jnp.einsum(EQUATION, a, b, preferred_element_type=jnp.float32)
    ours = lambda a, b: einsum_fp32(EQUATION, a, b)
    np.testing.assert_array_equal(ours(a, b), plain(a, b))
    for got, want in zip(jax.grad(_loss(ours), (0, 1))(a, b), jax.grad(_loss(plain), (0, 1))(a, b)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_bf16_backward_contracts_in_bf16_and_stays_close_to_float64():
    a, b = _operands(jnp.bfloat16)
    assert einsum_fp32(EQUATION, a, b).dtype == jnp.float32
    grad = jax.grad(_loss(lambda a, b: einsum_fp32(EQUATION, a, b)), (0, 1))
    dots = _dot_operand_dtypes(jax.make_jaxpr(grad)(a, b).jaxpr)
    assert len(dots) >= 3 and all(d == (jnp.bfloat16, jnp.bfloat16) for d in dots), dots  # forward, dA, dB
    # plain autodiff of the fp32 einsum casts the operands up: the cost this removes
    plain = jax.grad(_loss(lambda a, b: jnp.einsum(EQUATION, a, b, preferred_element_type=jnp.float32)), (0, 1))
    assert any(jnp.float32 in d for d in _dot_operand_dtypes(jax.make_jaxpr(plain)(a, b).jaxpr))
    # against autodiff of the same bf16 values in float64: the extra rounding is the cotangent's and the results'
    a64, b64 = (np.asarray(x, np.float64) for x in (a, b))
    logits = np.einsum("btd,dv->btv", a64, b64)
    g = np.exp(logits - logits.max(-1, keepdims=True))
    g /= g.sum(-1, keepdims=True)
    g[..., 3] -= 1.0
    want = (np.einsum("btv,dv->btd", g, b64), np.einsum("btd,btv->dv", a64, g))
    for x, w in zip(grad(a, b), want):
        assert x.dtype == jnp.bfloat16
        assert np.linalg.norm(np.asarray(x, np.float64) - w) / np.linalg.norm(w) < 1e-2


def test_transformer_heads_backward_is_in_the_compute_dtype():
    """The output head (tied and untied) differentiated at bf16: no fp32 contraction with the [D, V] kernel."""
    for tied in (False, True):
        config = sk.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied,
                                dtype="bfloat16", param_dtype="bfloat16")
        params = sk.init(config).params
        loss = lambda h: jnp.sum(Transformer(config).apply({"params": params}, h, method="head")[..., 0])
        dots = _dot_operand_dtypes(jax.make_jaxpr(jax.grad(loss))(jnp.ones((1, 4, 64), jnp.bfloat16)).jaxpr)
        assert len(dots) >= 2 and all(d == (jnp.bfloat16, jnp.bfloat16) for d in dots), (tied, dots)
