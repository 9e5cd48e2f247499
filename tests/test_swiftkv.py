"""SwiftKV semantics (../shared/SWIFTKV.md §1-3): the transform, both wirings, AcrossKV sharing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_reference
import swiftkv_jax as sk
from hf_models import LLAMA3_ROPE, make_hf_model, random_tokens, torch_logits

L = 8


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    torch_model = make_hf_model(path, "llama", num_hidden_layers=L, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)
    return path, torch_model


@pytest.fixture(scope="module")
def base(hf_base):
    return sk.load(hf_base[0])


@pytest.fixture(scope="module")
def tokens():
    return random_tokens(320, batch=2, length=160, seed=1)


@pytest.mark.parametrize("l,g", [(4, 1), (2, 2), (2, 3), (5, 1), (1, 7)])
def test_teacher_mode_of_student_is_the_base_model_exactly(base, tokens, l, g):
    student = sk.to_swiftkv(base, l, g)
    np.testing.assert_array_equal(sk.logits(student, tokens, swiftkv=False), sk.logits(base, tokens))


def test_default_mode_follows_the_model(base, tokens):
    student = sk.to_swiftkv(base, 4)
    np.testing.assert_array_equal(sk.logits(student, tokens), sk.logits(student, tokens, swiftkv=True))
    assert not np.array_equal(sk.logits(student, tokens), sk.logits(base, tokens))
    with pytest.raises(ValueError, match="no SwiftKV layers"):
        sk.logits(base, tokens, swiftkv=True)


@pytest.mark.parametrize("l", [1, 3, 6])
def test_copy_init_keeps_layer_l_and_first_differs_at_l_plus_1(base, tokens, l):
    _, teacher = sk.intermediates(base, tokens)
    _, student = sk.intermediates(sk.to_swiftkv(base, l, 1, norm_init="copy"), tokens)
    # residual[i + 1] is the output of layer i.
    np.testing.assert_array_equal(student["residual"][: l + 2], teacher["residual"][: l + 2])
    assert not np.allclose(student["residual"][l + 2], teacher["residual"][l + 2], atol=1e-6)


def test_ones_init_differs_from_layer_l(base, tokens):
    l = 3
    _, teacher = sk.intermediates(base, tokens)
    _, student = sk.intermediates(sk.to_swiftkv(base, l, 1, norm_init="ones"), tokens)
    np.testing.assert_array_equal(student["residual"][: l + 1], teacher["residual"][: l + 1])
    assert not np.allclose(student["residual"][l + 1], teacher["residual"][l + 1], atol=1e-6)
    student = sk.to_swiftkv(base, l, 1, norm_init="ones")
    np.testing.assert_array_equal(student.params["norm_swiftkv"]["scale"], np.ones(base.config.hidden_size))


def test_init_recipe(base):
    l, g = 2, 3
    student = sk.to_swiftkv(base, l, g)
    layers = base.params["layers"]
    groups = student.params["swiftkv_groups"]
    for j in range(l, L):
        group, member = divmod(j - l, g)
        np.testing.assert_array_equal(groups["layers"]["self_attn"]["q_proj_swiftkv"]["kernel"][group, member],
                                      layers["self_attn"]["q_proj"]["kernel"][j])
    for group in range(2):
        members = slice(l + group * g, l + (group + 1) * g)
        for name in ("k_proj", "v_proj"):
            np.testing.assert_allclose(groups[f"{name}_swiftkv"]["kernel"][group],
                                       np.mean(layers["self_attn"][name]["kernel"][members], axis=0), rtol=1e-6)
    np.testing.assert_array_equal(student.params["norm_swiftkv"]["scale"], layers["input_layernorm"]["scale"][l])


def test_l_equal_L_is_the_base_model(base, tokens):
    student = sk.to_swiftkv(base, L)
    assert student.config.num_kv_cache_layers == L
    np.testing.assert_array_equal(sk.logits(student, tokens), sk.logits(base, tokens))


def test_across_kv_group_members_read_the_owners_kv(base, tokens):
    l, g = 2, 2  # groups: layers (2, 3), (4, 5), (6, 7)
    student = sk.to_swiftkv(base, l, g)
    _, before = sk.intermediates(student, tokens)
    for group in range(3):
        owner = l + group * g
        np.testing.assert_array_equal(before["keys"][owner], before["keys"][owner + 1])

    params = jax.tree.map(lambda a: a, student.params)
    kernel = params["swiftkv_groups"]["k_proj_swiftkv"]["kernel"]
    params["swiftkv_groups"]["k_proj_swiftkv"]["kernel"] = kernel.at[1].add(0.05)  # owner of group 1: layer 4
    _, after = sk.intermediates(sk.Model(student.config, params), tokens)
    changed = [i for i in range(L) if not np.array_equal(before["keys"][i], after["keys"][i])]
    assert changed == [4, 5]


@pytest.mark.parametrize("l,g", [(8, 1), (4, 1), (4, 2), (4, 4), (2, 3), (1, 1)])
def test_kv_layer_count(base, tokens, l, g):
    student = sk.to_swiftkv(base, l, g)
    expected = l + (L - l) // g
    assert student.config.num_kv_cache_layers == expected
    keys = np.asarray(sk.intermediates(student, tokens)[1]["keys"])
    distinct = {keys[i].tobytes() for i in range(L)}
    assert len(distinct) == expected


def test_full_forward_is_causal(base, tokens):
    """Logits at position t depend on tokens <= t only: the SwiftKV full forward equals the forward of the
    prefix ending at t (the invariant fast prefill relies on)."""
    student = sk.to_swiftkv(base, 3, 5)
    full = np.asarray(sk.logits(student, tokens))
    for t in (0, 37, 100):
        np.testing.assert_allclose(sk.logits(student, tokens[:, : t + 1])[:, -1], full[:, t], atol=2e-5)


def test_matches_float64_reference_of_the_published_format(hf_base, base, tmp_path):
    """Teacher wiring of the reference == transformers; SwiftKV wiring of the exported student == ours."""
    path, torch_model = hf_base
    tokens = random_tokens(320, batch=1, length=96, seed=2)
    config, tensors = numpy_reference.load_tensors(path)
    np.testing.assert_allclose(numpy_reference.forward(config, tensors, tokens[0], swiftkv=False),
                               torch_logits(torch_model, tokens)[0], atol=1e-4)
    for l, g in [(4, 1), (2, 3)]:
        student = sk.to_swiftkv(base, l, g)
        sk.save(student, tmp_path / f"s{l}{g}", format="hf")
        config, tensors = numpy_reference.load_tensors(tmp_path / f"s{l}{g}")
        reference = numpy_reference.forward(config, tensors, tokens[0], swiftkv=True)
        ours = np.asarray(sk.logits(student, tokens))[0]
        assert np.abs(ours - reference).max() <= 1e-4
        assert (ours.argmax(-1) == reference.argmax(-1)).all()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_key_value_layers=0), r"num_key_value_layers must be an int in \[1, 8\]"),
        (dict(num_key_value_layers=9), r"num_key_value_layers must be an int in \[1, 8\]"),
        (dict(num_key_value_layers=3, key_value_group_size=2), "must divide the 5 layers"),
        (dict(num_key_value_layers=4, key_value_group_size=0), "key_value_group_size must be a positive int"),
        (dict(num_key_value_layers=4, norm_init="zeros"), "norm_init must be one of"),
        # a bool is an int to Python: a[True] added an axis, and the student failed only when saved
        (dict(num_key_value_layers=True), "num_key_value_layers must be an integer, got True"),
        (dict(num_key_value_layers=4, key_value_group_size=True), "key_value_group_size must be an integer, got True"),
        (dict(num_key_value_layers=4, donate="false"), "donate must be True or False, got 'false'"),  # it donated
    ],
)
def test_invalid_transform_arguments(base, kwargs, match):
    with pytest.raises(ValueError, match=match):
        sk.to_swiftkv(base, **kwargs)
    assert sk.logits(base, np.zeros((1, 4), np.int32)).shape[0] == 1  # the teacher is whole


def test_transform_takes_numpy_ints_and_refuses_what_is_not_a_model(base):
    assert sk.to_swiftkv(base, np.int64(4)).config.num_key_value_layers == 4
    with pytest.raises(TypeError, match="to_swiftkv takes a Model .* got dict"):
        sk.to_swiftkv(base.params, 4)


def test_transform_applies_once(base):
    student = sk.to_swiftkv(base, 4)
    with pytest.raises(ValueError, match="already a SwiftKV model"):
        sk.to_swiftkv(student, 4)


def test_transform_keeps_the_parameter_dtype(base):
    student = sk.to_swiftkv(sk.cast(base, "bfloat16"), 4, 2)
    assert {a.dtype for a in jax.tree.leaves(student.params)} == {jnp.dtype(jnp.bfloat16)}
    np.testing.assert_array_equal(student.params["embed_tokens"]["embedding"],
                                  base.params["embed_tokens"]["embedding"].astype(jnp.bfloat16))


def test_a_swiftkv_flag_that_is_not_a_bool_is_refused():
    """bool("false") is True: swiftkv="false" served the SwiftKV wiring it asked to turn off, without a word."""
    model = sk.to_swiftkv(sk.init(sk.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                                 head_dim=8, max_position_embeddings=64), 0), 2, 1)
    for call in (lambda: sk.Engine(model, swiftkv="false", num_pages=16, max_num_seqs=4, max_num_batched_tokens=64),
                 lambda: sk.generate(model, [[1, 2, 3]], 2, swiftkv="false"),
                 lambda: sk.logits(model, [[1, 2, 3]], swiftkv="false")):
        with pytest.raises(ValueError, match=r"swiftkv must be True, False or None .* got 'false'"):
            call()


@pytest.mark.parametrize("l,g", [(2, 3), (5, 1), (L, 1)])
def test_donated_transform_is_the_kept_one_and_consumes_the_layers(base, l, g):
    """donate=True builds the same student, weight by weight in the input's dtype, deleting the teacher's stacked
    layer weights as it goes (so the two are never both held); the other weights become the student's as they are."""
    kept = sk.to_swiftkv(base, l, g)
    teacher = sk.Model(base.config, jax.tree.map(lambda a: a.astype(jnp.bfloat16), base.params))
    donated = sk.to_swiftkv(teacher, l, g, donate=True)
    assert jax.tree.structure(donated.params) == jax.tree.structure(kept.params)
    for got, want in zip(jax.tree.leaves(donated.params), jax.tree.leaves(kept.params)):
        assert got.dtype == jnp.bfloat16 and got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
    assert all(a.is_deleted() for a in jax.tree.leaves(teacher.params["layers"]))
    assert donated.params["embed_tokens"]["embedding"] is teacher.params["embed_tokens"]["embedding"]
