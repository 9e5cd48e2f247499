"""stage: pretrain — next-token cross-entropy in the same trainer, on the stdlib corpus (CPU, fp32)."""

import json

import numpy as np
import pytest
from scipy.special import log_softmax

import swiftkv_jax as sk
from swiftkv_jax.checkpoints.hf_config import config_to_hf
from swiftkv_jax.data.stdlib_corpus import build_corpus, train_corpus_tokenizer
from swiftkv_jax.distill import cli
from swiftkv_jax.distill import step as step_lib
from swiftkv_jax.distill.config import LossSection
from swiftkv_jax.distill.metrics import read_metrics

ARCH = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, initializer_range=0.02)


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """A stdlib corpus, its tokenizer, and a directory holding only the model's config.json + tokenizer."""
    root = tmp_path_factory.mktemp("pretrain")
    build_corpus(root / "corpus", max_files=30)
    tokenizer = train_corpus_tokenizer(root / "corpus", vocab_size=300, out_dir=root / "init")
    config = sk.ModelConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=(tokenizer.eos_token_id,), **ARCH)
    (root / "init" / "config.json").write_text(json.dumps(config_to_hf(config)))
    return root


def args(start, out, *overrides):
    return ["stage=pretrain", f"model.teacher={start / 'init'}",
            f"data.sources=[{{path: {start / 'corpus' / 'train.parquet'}, format: text}}]", "data.seq_len=128",
            f"data.cache_dir={start / 'cache'}", "model.frozen_dtype=float32", "model.compute_dtype=float32",
            "model.remat=none", "loss.chunk_size=32", "optim.learning_rate=3e-3", "train.global_batch_size=8",
            "train.max_steps=30", f"train.output_dir={out}", "checkpoint.every=100", "export.dtype=float32",
            *overrides]


def test_cross_entropy_matches_an_independent_computation():
    """Packed rows: each position predicts the next token of its own document; the last token of a
    document and padding predict nothing. Against numpy on the model's own logits."""
    model = sk.init(sk.ModelConfig(vocab_size=50, **ARCH), 0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, (2, 12)).astype(np.int32)
    segments = np.array([[1] * 5 + [2] * 4 + [0] * 3, [1] * 12], np.int32)
    positions = np.array([list(range(5)) + list(range(4)) + [0] * 3, list(range(12))], np.int32)
    loss_mask = np.ones_like(tokens)
    loss_mask[1, 3] = 0  # the prediction made here (of token 4) is not scored: the packer's convention
    batch = {"tokens": tokens, "positions": positions, "segment_ids": segments, "loss_mask": loss_mask}
    _, sums = step_lib.pretrain_sums(model.params, {}, batch, 1.0, config=model.config,
                                     loss=LossSection(chunk_size=5))
    logits = np.asarray(sk.logits(model, tokens, positions=positions, segment_ids=segments), np.float64)
    nll, correct, count = 0.0, 0, 0
    for b in range(2):
        for t in range(11):
            if segments[b, t] > 0 and segments[b, t + 1] == segments[b, t] and loss_mask[b, t]:
                nll -= log_softmax(logits[b, t])[tokens[b, t + 1]]
                correct += int(np.argmax(logits[b, t]) == tokens[b, t + 1])
                count += 1
    assert count == 4 + 3 + 10 and float(sums["predicted"]) == count
    np.testing.assert_allclose(float(sums["nll"]), nll, rtol=1e-5)
    assert float(sums["correct"]) == correct


def test_pretrain_from_a_config_alone_learns_and_exports(start, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(args(start, out)) == 0
    records = read_metrics(out / "metrics.jsonl")
    assert {"loss", "ce", "accuracy", "grad_norm", "lr", "tokens"} <= set(records[0])
    first, last = np.mean([r["ce"] for r in records[:3]]), np.mean([r["ce"] for r in records[-3:]])
    assert first > np.log(300) - 0.2 and last < np.log(300) - 1.0  # from uniform (5.7 nats) to well below it
    model = sk.load(out / "model_hf")
    assert not model.config.is_swiftkv and model.config.num_hidden_layers == 2
    assert (out / "model_hf" / "tokenizer.json").is_file() and (out / "model_orbax").is_dir()
    assert "pretrain: a 2-layer model, every weight trained" in capsys.readouterr().out


def test_pretrain_refuses_a_swiftkv_model(start, tmp_path, capsys):
    swiftkv_dir = tmp_path / "swiftkv"
    sk.save(sk.to_swiftkv(sk.init(sk.ModelConfig(vocab_size=300, **ARCH), 0), 1, 1), swiftkv_dir, "hf")
    assert cli.main(args(start, tmp_path / "run", f"model.teacher={swiftkv_dir}")) == 2
    assert "stage pretrain trains a plain model" in capsys.readouterr().err


def test_unknown_stage_is_refused(start, tmp_path, capsys):
    assert cli.main(args(start, tmp_path / "run", "stage=finetune")) == 2
    assert "stage" in capsys.readouterr().err


@pytest.mark.parametrize("tied", [False, True])
def test_cross_entropy_gradient_is_jax_autodiff_of_the_whole_logits(tied):
    """The chunks' gradients, computed in the forward pass (embedding, every layer, the head; a tied embedding
    gets the lookup's and the head's), against jax.grad of the plain cross-entropy over `sk.forward`'s logits."""
    import jax
    import jax.numpy as jnp

    model = sk.init(sk.ModelConfig(vocab_size=50, tie_word_embeddings=tied, **ARCH), 0)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 50, (2, 12)).astype(np.int32)
    segments = np.array([[1] * 5 + [2] * 4 + [0] * 3, [1] * 12], np.int32)
    positions = np.array([list(range(5)) + list(range(4)) + [0] * 3, list(range(12))], np.int32)
    batch = {"tokens": tokens, "positions": positions, "segment_ids": segments, "loss_mask": np.ones_like(tokens)}
    targets, weights = step_lib.next_token_targets(batch)
    grads, _ = jax.jit(lambda p: step_lib.pretrain_sums(p, {}, batch, 0.5, config=model.config,
                                                        loss=LossSection(chunk_size=5)))(model.params)

    def reference(params):
        logits = sk.forward(params, tokens, positions, segments, config=model.config)
        log_p = jax.nn.log_softmax(logits, axis=-1)
        return -0.5 * jnp.sum(weights * jnp.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0])

    expected = jax.grad(reference)(model.params)
    flat, flat_expected = (jax.tree_util.tree_flatten_with_path(g)[0] for g in (grads, expected))
    assert [p for p, _ in flat] == [p for p, _ in flat_expected]
    for (path, got), (_, want) in zip(flat, flat_expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * float(np.abs(want).max()) + 1e-9,
                                   err_msg=jax.tree_util.keystr(path))
