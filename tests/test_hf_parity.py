"""Parity with transformers in fp32: logits, hidden states, export back to torch, packed documents, dtypes.

The peer is a tiny random `transformers` model saved with `save_pretrained` (tests/hf_models.py); nothing here
is compared against this library's own output alone. Prompts are >= 512 tokens so RoPE errors at long range
show; the tolerance is 1e-4 on the logits plus identical argmax at every position.
"""

import json

import jax
import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM, Qwen2ForCausalLM

import swiftkv_jax as sk
from hf_models import (LLAMA3_ROPE, hf_tensors_from_params, make_hf_model, random_tokens, read_hf_tensors,
                       torch_logits)

ATOL = 1e-4
VOCAB = 320
# Weights 5x transformers' default scale: attention is then far from uniform, so a RoPE, mask or scale error
# moves the logits by O(1) instead of O(1e-3) (measured: a wrong rope_type moves them by ~2.8, not 4e-3).
INIT = dict(initializer_range=0.1)
TORCH_CLASSES = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}

CASES = {
    "llama_gqa": ("llama", dict(num_attention_heads=8, num_key_value_heads=2)),
    "llama_mqa": ("llama", dict(num_key_value_heads=1)),
    # Llama 3.2 1B/3B: tied embeddings, llama3 RoPE (factor 32), theta 500000.
    "llama_tied": ("llama", dict(tie_word_embeddings=True, rope_theta=500000.0,
                                 rope_scaling={**LLAMA3_ROPE, "factor": 32.0})),
    "llama3_rope": ("llama", dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
    "llama_bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama_head_dim": ("llama", dict(head_dim=16)),  # q_proj is [128, 64]: head_dim != hidden / heads
    "qwen2": ("qwen2", dict(rope_theta=1000000.0)),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
}

# Measured figures, printed as a table when the module finishes (run pytest with -s to see it).
MEASURED: dict = {}


@pytest.fixture(scope="module", autouse=True)
def print_measured_figures():
    yield
    print("\n\ncase | figure | value")
    for name, figures in MEASURED.items():
        for what, value in figures.items():
            print(f"{name} | {what} | {value:.3g}")


@pytest.fixture(scope="module")
def tokens():
    return random_tokens(VOCAB, batch=2, length=520, seed=0)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, tokens):
    """(name, family, saved path, fp32 torch model, sk model, torch logits)."""
    name = request.param
    family, overrides = CASES[name]
    path = tmp_path_factory.mktemp(name)
    torch_model = make_hf_model(path, family, seed=list(CASES).index(name) + 1, **INIT, **overrides)
    model = sk.load(path)
    return name, family, path, torch_model, model, torch_logits(torch_model, tokens)


def _record(name, what, value, record_property):
    MEASURED.setdefault(name, {})[what] = value
    record_property(what, value)
    print(f"\n{name}: {what} = {value}")


def test_logits_match_transformers(case, tokens, record_property):
    name, _, _, _, model, expected = case
    assert model.config.param_dtype == "float32"
    ours = np.asarray(sk.logits(model, tokens))
    assert ours.shape == expected.shape == (2, 520, VOCAB)
    delta = float(np.abs(ours - expected).max())
    agree = float((ours.argmax(-1) == expected.argmax(-1)).mean())
    _record(name, "max_abs_dlogits", delta, record_property)
    _record(name, "argmax_agreement", agree, record_property)
    _record(name, "logit_scale", float(np.abs(expected).max()), record_property)
    assert delta <= ATOL
    np.testing.assert_array_equal(ours.argmax(-1), expected.argmax(-1))


def test_hidden_states_match_transformers(case, tokens, record_property):
    name, _, _, torch_model, model, _ = case
    num_layers = model.config.num_hidden_layers
    with torch.no_grad():
        out = torch_model(torch.as_tensor(tokens), output_hidden_states=True)
    theirs = [h.numpy() for h in out.hidden_states]
    assert len(theirs) == num_layers + 1
    _, inter = sk.intermediates(model, tokens)
    residual = np.asarray(inter["residual"])
    assert residual.shape == (num_layers + 1, 2, 520, model.config.hidden_size)
    # HF: embeddings, outputs of layers 0..L-2, then the last layer's output *after* the final norm.
    worst = 0.0
    for i in range(num_layers):
        np.testing.assert_allclose(residual[i], theirs[i], rtol=0, atol=ATOL, err_msg=f"hidden state {i}")
        worst = max(worst, float(np.abs(residual[i] - theirs[i]).max()))
    with torch.no_grad():
        normed = torch_model.model.norm(torch.from_numpy(residual[num_layers].copy())).numpy()
    np.testing.assert_allclose(normed, theirs[num_layers], rtol=0, atol=ATOL, err_msg="final hidden state")
    worst = max(worst, float(np.abs(normed - theirs[num_layers]).max()))
    _record(name, "max_abs_dhidden", worst, record_property)


def test_hf_export_reloads_in_transformers(case, tokens, tmp_path, record_property):
    name, family, path, torch_model, model, expected = case
    out = sk.save(model, tmp_path / "export", format="hf")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family
    assert config["architectures"] == [TORCH_CLASSES[family].__name__]
    # The exported tensors are the original ones, bit for bit, and nothing else.
    original = read_hf_tensors(path)
    exported = read_hf_tensors(out)
    assert set(exported) == set(original)
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype, key
        assert torch.equal(exported[key], tensor), key
    reloaded = TORCH_CLASSES[family].from_pretrained(out).eval()
    assert reloaded.config.tie_word_embeddings == torch_model.config.tie_word_embeddings
    assert reloaded.config.rope_parameters == torch_model.config.rope_parameters
    again = torch_logits(reloaded, tokens)
    delta = float(np.abs(again - expected).max())
    _record(name, "export_max_abs_dlogits_vs_original_torch", delta, record_property)
    assert delta <= 1e-6


@pytest.mark.parametrize("name", ["llama3_rope", "qwen2"])
def test_packed_documents_match_each_document_alone(name, tmp_path, record_property):
    family, overrides = CASES[name]
    torch_model = make_hf_model(tmp_path, family, seed=7, **INIT, **overrides)
    model = sk.load(tmp_path)
    rng = np.random.RandomState(3)
    splits = [(300, 220), (97, 423)]  # two documents per row, 520 tokens each row
    docs = [[rng.randint(0, VOCAB, (1, n)) for n in split] for split in splits]
    tokens = np.concatenate([np.concatenate(row, axis=1) for row in docs])
    positions = np.concatenate([np.concatenate([np.arange(n) for n in split])[None] for split in splits])
    segment_ids = np.concatenate([np.repeat([0, 1], split)[None] for split in splits])
    packed = np.asarray(sk.logits(model, tokens, positions=positions, segment_ids=segment_ids))
    worst = 0.0
    for row, split in enumerate(splits):
        start = 0
        for doc, n in zip(docs[row], split):
            alone = torch_logits(torch_model, doc)[0]
            ours = packed[row, start:start + n]
            worst = max(worst, float(np.abs(ours - alone).max()))
            np.testing.assert_allclose(ours, alone, rtol=0, atol=ATOL)
            np.testing.assert_array_equal(ours.argmax(-1), alone.argmax(-1))
            start += n
    _record(f"packed_{name}", "max_abs_dlogits", worst, record_property)
    # Without the segment ids the second document would see the first: the check above is sensitive to it.
    unsegmented = np.asarray(sk.logits(model, tokens, positions=positions))
    assert np.abs(unsegmented[0, 300:] - packed[0, 300:]).max() > 1e-3


@pytest.mark.parametrize("torch_dtype,name", [(torch.bfloat16, "bfloat16"), (torch.float16, "float16")])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_stored_dtype_is_kept_or_upcast_exactly(family, torch_dtype, name, tmp_path):
    make_hf_model(tmp_path, family, seed=11, torch_dtype=torch_dtype, attention_bias=True)
    stored = read_hf_tensors(tmp_path)
    assert {t.dtype for t in stored.values()} == {torch_dtype}
    as_fp32 = {k: t.float().numpy() for k, t in stored.items()}

    native = sk.load(tmp_path)  # dtype=None: as stored
    assert native.config.param_dtype == name
    assert native.config.dtype == name
    leaves = hf_tensors_from_params(native.params)
    assert {str(a.dtype) for a in leaves.values()} == {name}
    assert set(leaves) == set(stored)
    for key, value in leaves.items():
        np.testing.assert_array_equal(value.astype(np.float32), as_fp32[key], err_msg=key)

    upcast = sk.load(tmp_path, dtype="float32")
    assert upcast.config.param_dtype == "float32"
    leaves = hf_tensors_from_params(upcast.params)
    assert {str(a.dtype) for a in leaves.values()} == {"float32"}
    for key, value in leaves.items():
        np.testing.assert_array_equal(value, as_fp32[key], err_msg=key)


@pytest.mark.parametrize("config_dtype,stored", [
    ("bfloat16", {"model.embed_tokens.weight": torch.float32}),  # an fp32 embedding beside bf16 layers
    ("bfloat16", {"": torch.float32}),  # every tensor fp32 under a bf16 config
    ("float32", {"": torch.bfloat16}),
    (None, {"": torch.bfloat16}),  # no dtype in config.json: the weights'
])
@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])  # transformers 4.x's name and 5.x's (4.x's alone passed)
def test_default_dtype_is_transformers_auto(config_dtype, stored, key, tmp_path):
    """dtype=None picks what transformers' from_pretrained(dtype="auto") does: config.json's dtype, else the
    weights'. Reading the embedding's alone loaded a bf16 checkpoint with an fp32 embedding all in fp32 (2x)."""
    from safetensors.torch import save_file

    make_hf_model(tmp_path, "llama", seed=3, torch_dtype=torch.bfloat16)
    tensors = read_hf_tensors(tmp_path)
    tensors = {k: v.to(stored.get(k, stored.get("", v.dtype))).contiguous() for k, v in tensors.items()}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("torch_dtype", None)
    config.pop("dtype", None)
    if config_dtype is not None:
        config[key] = config_dtype
    (tmp_path / "config.json").write_text(json.dumps(config))

    expected = str(LlamaForCausalLM.from_pretrained(tmp_path, dtype="auto").dtype).removeprefix("torch.")
    model = sk.load(tmp_path)
    assert model.config.param_dtype == model.config.dtype == expected
    assert {str(a.dtype) for a in jax.tree.leaves(model.params)} == {expected}
