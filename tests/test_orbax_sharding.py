"""Orbax round trips and placement on a device mesh (8 fake CPU devices, see conftest)."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import swiftkv_jax as sk
from hf_models import make_hf_model, random_tokens

CPUS = jax.devices("cpu")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    make_hf_model(path, "llama", num_hidden_layers=6, num_key_value_heads=4)
    return path


@pytest.fixture(scope="module")
def student(hf_dir):
    return sk.to_swiftkv(sk.load(hf_dir), 2, 2)


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_orbax_round_trip_is_bit_identical(student, tmp_path):
    sk.save(student, tmp_path / "ckpt", format="orbax")
    assert sk.detect_format(tmp_path / "ckpt") == "orbax"
    restored = sk.load(tmp_path / "ckpt")
    assert restored.config == student.config
    assert_trees_equal(restored.params, student.params)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["model_type"] == "llama_swiftkv" and config["num_key_value_layers"] == 2


def test_orbax_restore_casts_dtype(student, tmp_path):
    sk.save(student, tmp_path / "ckpt", format="orbax")
    restored = sk.load(tmp_path / "ckpt", dtype="bfloat16")
    assert restored.config.param_dtype == restored.config.dtype == "bfloat16"
    assert_trees_equal(restored.params, sk.cast(student, "bfloat16").params)


def test_restore_onto_4_device_mesh_from_1_device_save(student, tmp_path):
    sk.save(student, tmp_path / "ckpt", format="orbax")  # saved from one device
    mesh = sk.make_mesh(fsdp=2, tensor=2, devices=CPUS[:4])
    restored = sk.load(tmp_path / "ckpt", mesh=mesh)
    q = restored.params["swiftkv_groups"]["layers"]["self_attn"]["q_proj"]["kernel"]  # [G, g, D, N, H]
    assert q.sharding == NamedSharding(mesh, P(None, None, "fsdp", "tensor", None))
    embedding = restored.params["embed_tokens"]["embedding"]  # [V, D]
    assert embedding.sharding == NamedSharding(mesh, P("tensor", "fsdp"))
    assert len(embedding.addressable_shards) == 4
    assert_trees_equal(restored.params, student.params)
    tokens = random_tokens(student.config.vocab_size, batch=2, length=64)
    np.testing.assert_allclose(sk.logits(restored, tokens), sk.logits(student, tokens), atol=1e-5)


def test_hf_load_onto_mesh(hf_dir):
    mesh = sk.make_mesh(data=2, fsdp=2, tensor=2, devices=CPUS[:8])
    sharded = sk.load(hf_dir, mesh=mesh)
    local = sk.load(hf_dir)
    down = sharded.params["layers"]["mlp"]["down_proj"]["kernel"]  # [l, F, D]
    assert down.sharding == NamedSharding(mesh, P(None, "tensor", "fsdp"))
    assert_trees_equal(sharded.params, local.params)


def test_student_of_sharded_model_stays_sharded(hf_dir):
    mesh = sk.make_mesh(fsdp=4, devices=CPUS[:4])
    student = sk.to_swiftkv(sk.load(hf_dir, mesh=mesh), 2, 2)
    expected = sk.param_shardings(student.config, mesh)
    for leaf, sharding in zip(jax.tree.leaves(student.params), jax.tree.leaves(expected)):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)


def test_init_is_born_sharded():
    cfg = sk.ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    mesh = sk.make_mesh(fsdp=2, tensor=2, devices=CPUS[:4])
    model = sk.init(cfg, 0, mesh=mesh)
    for leaf, sharding in zip(jax.tree.leaves(model.params), jax.tree.leaves(sk.param_shardings(cfg, mesh))):
        assert leaf.sharding == sharding
    assert_trees_equal(model.params, sk.init(cfg, 0).params)


def test_indivisible_sharding_is_a_clear_error(hf_dir):
    mesh = sk.make_mesh(tensor=8, fsdp=1, devices=CPUS[:8])  # 4 kv heads cannot split 8 ways
    with pytest.raises(ValueError, match=r"cannot shard .*k_proj.*not divisible by mesh axes tensor of size 8"):
        sk.load(hf_dir, mesh=mesh)


@pytest.mark.parametrize(
    "sizes,match",
    [
        (dict(data=3, fsdp=1, tensor=1), "needs 3 devices, 8 are available"),
        (dict(data=-1, fsdp=-1), "at most one -1"),
        (dict(data=3, fsdp=-1), "do not split"),
    ],
)
def test_make_mesh_errors(sizes, match):
    with pytest.raises(ValueError, match=match):
        sk.make_mesh(**sizes, devices=CPUS[:8])


def test_orbax_config_mismatch_is_a_clear_error(student, tmp_path):
    sk.save(student, tmp_path / "ckpt", format="orbax")
    path = tmp_path / "ckpt" / "config.json"
    config = json.loads(path.read_text())
    config["intermediate_size"] += 1
    path.write_text(json.dumps(config))
    with pytest.raises(sk.CheckpointError, match="do not match config.json: parameter .* has shape"):
        sk.load(tmp_path / "ckpt")


def test_orbax_save_refuses_non_empty_directory(student, tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty"):
        sk.save(student, target, format="orbax")
    assert (target / "notes.txt").read_text() == "keep me"
    with pytest.raises(FileExistsError, match="no config.json: it is not one to replace"):  # not a checkpoint
        sk.save(student, target, format="orbax", overwrite=True)
    assert (target / "notes.txt").read_text() == "keep me"
    (target / "config.json").write_text("{}")  # an (old) checkpoint's: overwrite replaces it
    sk.save(student, target, format="orbax", overwrite=True)
    assert not (target / "notes.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary directories left behind
