"""Layer-similarity analysis: the batched, packed and padded accumulation against numpy on one window at a time."""

import json

import numpy as np
import pytest

import swiftkv_jax as sk
from swiftkv_jax.evaluation.analyze import (JSON_FILE, PLOT_FILE, analyze, first_similar_layer, format_summary,
                                            layer_similarity)
from swiftkv_jax.tiny_assets import make_tiny_assets

CONFIG = sk.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8)
MAX_LENGTH = 16
LENGTHS = (6, 5, 13, 3, 9, 20)  # packed into rows [6 5] [13 3] [9] [16] [4]: the 20 is two windows


@pytest.fixture(scope="module")
def model():
    return sk.init(CONFIG, 0)


@pytest.fixture(scope="module")
def documents():
    rng = np.random.default_rng(0)
    return [rng.integers(1, CONFIG.vocab_size, n).tolist() for n in LENGTHS]


def numpy_sums(model, window):
    """(sum over tokens of the cosine matrix, sum of |h| per depth) of one unpadded window, in numpy."""
    _, inter = sk.intermediates(model, np.asarray([window], np.int32))
    h = np.asarray(inter["residual"], np.float64)[:, 0]           # [L + 1, T, D]
    norm = np.linalg.norm(h, axis=-1)
    unit = h / norm[..., None]
    return np.einsum("itd,jtd->ij", unit, unit), norm.sum(axis=1)


def expected(model, documents):
    windows = [d[s: s + MAX_LENGTH] for d in documents for s in range(0, len(d), MAX_LENGTH)]
    sums = [numpy_sums(model, w) for w in windows]
    tokens = sum(map(len, windows))
    return sum(s for s, _ in sums) / tokens, sum(n for _, n in sums) / tokens, tokens


def test_one_window_matches_numpy(model, documents):
    result = layer_similarity(model, [documents[2]], max_length=MAX_LENGTH)
    sim, norm, tokens = expected(model, [documents[2]])
    assert result["tokens"] == tokens == 13
    np.testing.assert_allclose(result["similarity"], sim, atol=2e-6)
    np.testing.assert_allclose(result["mean_norm"], norm, rtol=1e-5)


@pytest.mark.parametrize("batch_size", [2, 8])  # 2: three batches; 8: five rows + three rows of padding
def test_packed_padded_batches_match_numpy_per_window(model, documents, batch_size):
    result = layer_similarity(model, documents, max_length=MAX_LENGTH, batch_size=batch_size)
    sim, norm, tokens = expected(model, documents)
    assert (result["tokens"], result["documents"], result["windows"]) == (sum(LENGTHS), 6, 7) == (tokens, 6, 7)
    np.testing.assert_allclose(result["similarity"], sim, atol=2e-6)
    np.testing.assert_allclose(result["mean_norm"], norm, rtol=1e-5)
    # the random model's similarities are far from 1, so a leak of padding or of another window would show
    assert sim.min() < 0.9


def test_matrix_shape_symmetry_and_views(model, documents):
    result = layer_similarity(model, documents, max_length=MAX_LENGTH)
    sim = result["similarity"]
    depths = CONFIG.num_hidden_layers + 1
    assert sim.shape == (depths, depths) and sim.dtype == np.float64
    np.testing.assert_allclose(sim, sim.T, atol=1e-12)
    np.testing.assert_allclose(np.diag(sim), 1.0, atol=1e-6)
    assert np.all(np.abs(sim) <= 1 + 1e-6)
    np.testing.assert_array_equal(result["adjacent"], [sim[i, i + 1] for i in range(depths - 1)])
    np.testing.assert_array_equal(result["to_final"], sim[:, -1])
    assert result["num_layers"] == CONFIG.num_hidden_layers and result["swiftkv"] is False


def test_swiftkv_wiring(model, documents):
    student = sk.to_swiftkv(model, num_key_value_layers=2)
    teacher = layer_similarity(student, documents, max_length=MAX_LENGTH)
    swift = layer_similarity(student, documents, max_length=MAX_LENGTH, swiftkv=True)
    assert swift["swiftkv"] is True
    # copy init: layers 0..l are identical in both wirings (depths 0..l+1); layer l+1 differs
    np.testing.assert_allclose(swift["similarity"][:4, :4], teacher["similarity"][:4, :4], atol=1e-5)
    assert not np.allclose(swift["similarity"][4], teacher["similarity"][4], atol=1e-4)
    np.testing.assert_allclose(teacher["similarity"], layer_similarity(model, documents, max_length=MAX_LENGTH)
                               ["similarity"], atol=1e-6)  # default: the teacher wiring
    with pytest.raises(ValueError, match="SwiftKV model"):
        layer_similarity(model, documents, swiftkv=True)
    with pytest.raises(ValueError, match="token ids"):
        layer_similarity(model, [[1, 2, CONFIG.vocab_size]])


def test_first_similar_layer_and_summary():
    assert first_similar_layer([0.5, 0.95, 0.97]) == 1
    assert first_similar_layer([0.95, 0.97]) == 0
    assert first_similar_layer([0.5, 0.95, 0.6]) is None
    sim = np.eye(4)
    for i, value in enumerate([0.5, 0.95, 0.6]):
        sim[i, i + 1] = sim[i + 1, i] = value
    result = {"model": "/ckpt/tiny/", "tokens": 10, "documents": 2, "max_length": 16, "swiftkv": False,
              "similarity": sim, "adjacent": [0.5, 0.95, 0.6], "to_final": sim[:, -1], "mean_norm": [1, 2, 3, 4]}
    text = format_summary(result)
    assert text.startswith("tiny: ") and "10 tokens" in text
    assert "1 of 3 layers have cos(input, output) >= 0.9" in text
    assert "layers 1 to 1 all have cos(input, output) >= 0.9; the last layer 0.6000" in text


def test_analyze_end_to_end(tmp_path, monkeypatch):
    teacher = make_tiny_assets(tmp_path / "tiny", num_examples=50) / "teacher"
    docs = tmp_path / "docs"
    docs.mkdir()
    texts = ["The quick brown fox jumps over the lazy dog. " * 6, "Hello there, how are you today?",
             "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15."]
    for i, text in enumerate(texts):
        (docs / f"{i}.txt").write_text(text)
    monkeypatch.chdir(tmp_path)
    result = analyze(teacher, str(docs / "*.txt"), max_tokens=60, max_length=32, cache_dir=str(tmp_path / "cache"))
    out = tmp_path / "analysis" / "teacher"  # the default: never inside the checkpoint
    assert result["out_dir"] == "analysis/teacher" and result["tokens"] == 60 and result["model"] == str(teacher)
    saved = json.loads((out / JSON_FILE).read_text())
    assert saved["tokens"] == 60 and saved["model"] == str(teacher)
    np.testing.assert_allclose(saved["similarity"], result["similarity"])
    assert len(saved["adjacent"]) == 4 and len(saved["similarity"]) == 5
    assert (out / PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (teacher / "analysis").exists()
    assert format_summary(saved).startswith("teacher: residual-stream cosine similarity over 60 tokens")
