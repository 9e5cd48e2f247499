"""train.py's refusals that come before any model is built: config keys named with the fix, checked while the recipe
is read or the teacher's config.json alone is (so each costs no tokenising, loading or compiling).

The runs that need the tiny assets (a used output directory, a changed teacher on resume, a tokenizer beyond the
vocabulary) are in test_train_cli.py, beside its fixtures.
"""

import json
from pathlib import Path

import pytest

from distill_fixtures import write_hf_config
from swiftkv_jax import configuration
from swiftkv_jax.configuration import ConfigError
from swiftkv_jax.distill import cli, trainer
from swiftkv_jax.distill.config import ModelSection, TrainConfig
from swiftkv_jax.distill.student import student_config

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


def load(*overrides):
    return configuration.load(TrainConfig, TINY, overrides)


@pytest.mark.parametrize("size", ["5", "huge", "5GiB", "-1GB"])
def test_max_shard_size_is_checked_with_the_recipe(size):
    with pytest.raises(ConfigError, match=f"export.max_shard_size: '{size}' is not a size: give a number and a "
                                          f"unit \\(KB, MB, GB, TB\\), e.g. 5GB or 500MB"):
        load(f"export.max_shard_size={size}")
    assert load("export.max_shard_size=500MB").export.max_shard_size == "500MB"


@pytest.mark.parametrize("key", ["train.output_dir", "data.cache_dir"])
def test_a_directory_that_is_a_file(tmp_path, key):
    file = tmp_path / "afile"
    file.write_text("not a directory")
    with pytest.raises(ConfigError, match=f"{key}='{file}' is a file, not a directory"):
        load(f"{key}={file}")
    with pytest.raises(ConfigError, match=f"lies under {file}, which is a file"):
        load(f"{key}={file / 'run'}")
    section, name = key.split(".")
    assert getattr(getattr(load(f"{key}={tmp_path / 'new' / 'run'}"), section), name) == str(tmp_path / "new" / "run")


def test_a_source_without_path_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^data.sources\[1\].path is required"):
        load("data.sources=[{path: a.jsonl}, {format: chat}]")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  sources:\n    - {format: chat}\n")
    with pytest.raises(ConfigError, match=rf"^data.sources\[0\].path is required in {recipe}"):
        configuration.load(TrainConfig, recipe)


def test_unknown_attention_impl_names_the_key_and_the_choices(tmp_path):
    teacher = write_hf_config(tmp_path, num_hidden_layers=4)
    with pytest.raises(ConfigError, match="model.attention_impl='flash' is unknown: training runs one of auto, xla, "
                                          "xla_chunked, cudnn"):
        student_config(ModelSection(teacher=str(teacher), num_key_value_layers=2, attention_impl="flash"))


def test_an_unsupported_teacher_names_model_teacher_and_its_config(tmp_path, capsys):
    teacher = write_hf_config(tmp_path / "gpt2", model_type="gpt2")
    rc = cli.main(["--config", str(TINY), "--dry-run", f"model.teacher={teacher}",
                   f"train.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.startswith(f"error: model.teacher: {teacher / 'config.json'}: unsupported model_type 'gpt2'")
    (teacher / "config.json").write_text('{"model_type": "llama",\n "vocab_size": 512,,}')
    with pytest.raises(ConfigError, match=f"model.teacher: {teacher / 'config.json'}: not valid JSON "
                                          f"\\(Expecting property name .* at line 2, column 20\\)"):
        student_config(ModelSection(teacher=str(teacher)))


def test_teacher_shapes_compare_defaults_filled_in(tmp_path):
    """A config.json that spells out a default (head_dim = hidden / heads) is the same teacher; another
    hidden_size is not, and is named."""
    teacher = json.loads((write_hf_config(tmp_path / "t", num_hidden_layers=4) / "config.json").read_text())
    config = load(f"model.teacher={tmp_path / 't'}")
    explicit = {**teacher, "head_dim": teacher["hidden_size"] // teacher["num_attention_heads"]}
    teacher.pop("head_dim", None)
    out = tmp_path / "run"
    out.mkdir()
    (out / trainer.TEACHER_CONFIG_FILE).write_text(json.dumps(teacher))
    trainer._check_same_teacher(config, explicit, out)
    with pytest.raises(ConfigError, match=r"cannot resume: .*differs in hidden_size: 4096 -> 2048; head_dim: "
                                          r"128 -> 64"):
        trainer._check_same_teacher(config, {**explicit, "hidden_size": 2048, "head_dim": 64}, out)


def test_an_empty_folder_holds_no_run(tmp_path):
    """What counts as an earlier run's outputs: an empty checkpoints/ (a run stopped before its first save) does not."""
    (tmp_path / "checkpoints").mkdir()
    assert trainer._run_outputs(tmp_path, None) == []
    (tmp_path / "model_hf").mkdir()
    (tmp_path / "metrics.jsonl").write_text("")
    assert trainer._run_outputs(tmp_path, None) == ["metrics.jsonl", "model_hf/"]


@pytest.mark.parametrize("override, message", [
    ("train.epochs=inf", "train.epochs: expected a finite number, got 'inf'"),
    ("optim.learning_rate=1e999", "optim.learning_rate: expected a finite number, got .1e999."),
    ("optim.b2=nan", "optim.b2: expected a finite number, got 'nan'"),
    ("loss.temperature=1e999", "loss.temperature: expected a finite number"),
    ("optim.b1=1.5", r"optim.b1 and optim.b2 must lie in \[0, 1\), got 1.5 and 0.999"),
    ("optim.eps=-1", "optim.eps must be > 0"),
    ("optim.weight_decay=-5", "optim.weight_decay must be >= 0, got -5.0"),
    ("train.max_steps=2147483648", r"train.max_steps must lie in \[1, 2\*\*31\)"),
])
def test_numbers_out_of_range_are_refused_with_the_recipe(override, message):
    """Each trained to the end, or started and stopped at a non-finite loss (inf, nan), or overflowed the step count
    (a float epochs past it crashed in math.ceil)."""
    with pytest.raises(ConfigError, match=f"^{message}"):
        load(override)


def test_a_section_given_as_a_mapping_keeps_the_recipes_other_keys():
    """`loss={temperature: 1.0}` replaced the whole section: the recipe's hidden_loss_mult and chunk_size fell back
    to their defaults, changing the objective without a word. The mapping is merged, as keys under the section in
    the recipe would be."""
    recipe = load()
    merged = load("loss={temperature: 1.0}")
    assert merged.loss.temperature == 1.0 and recipe.loss.temperature != 1.0
    assert (merged.loss.hidden_loss_mult, merged.loss.chunk_size) == (recipe.loss.hidden_loss_mult,
                                                                      recipe.loss.chunk_size)
    assert merged.optim == recipe.optim
    with pytest.raises(ConfigError, match="unknown config key 'loss.temprature'"):
        load("loss={temprature: 1.0}")


def test_a_key_given_twice_in_a_recipe_is_named_with_its_lines(tmp_path):
    """PyYAML keeps the last of two `optim:` sections: the first one's learning rate was dropped silently."""
    recipe = tmp_path / "dup.yaml"
    recipe.write_text(TINY.read_text() + "optim:\n  grad_clip: 0.5\n")
    first = next(n for n, line in enumerate(TINY.read_text().splitlines(), 1) if line.startswith("optim:"))
    last = len(TINY.read_text().splitlines()) + 1
    with pytest.raises(ConfigError, match=f"config file {recipe} is not valid YAML: key 'optim' appears twice "
                                          f"\\(lines {first} and {last}\\): merge the two into one"):
        configuration.load(TrainConfig, recipe)


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    """`<<: *anchor` brings an anchor's keys into a mapping, whose own keys may override them: not a key twice."""
    recipe = tmp_path / "merge.yaml"
    text = TINY.read_text().replace("mesh: {data: 1, fsdp: -1, tensor: 1}", "mesh:\n  <<: &m {data: 1, fsdp: -1}\n"
                                    "  fsdp: 1\n  tensor: 1")
    assert text != TINY.read_text()
    recipe.write_text(text)
    mesh = configuration.load(TrainConfig, recipe).mesh
    assert (mesh.data, mesh.fsdp, mesh.tensor) == (1, 1, 1)


def test_a_config_that_is_a_folder_or_missing(tmp_path, capsys):
    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a directory: give the recipe's .yaml file"):
        configuration.load(TrainConfig, tmp_path)
    rc = cli.main([f"train.output_dir={tmp_path / 'run'}"])
    assert rc == 2 and "model.teacher is required" in capsys.readouterr().err
    assert "python train.py --config RECIPE.yaml" in str(pytest.raises(ConfigError, load, "model.teacher=").value)


def test_rows_longer_than_the_teachers_positions(tmp_path, capsys):
    """data.seq_len past the teacher's max_position_embeddings trained at positions it never saw; refused before the
    tokenizer or any weight is read (the teacher here is a config.json alone)."""
    teacher = write_hf_config(tmp_path / "t", num_hidden_layers=4, max_position_embeddings=32)
    for dry in ((), ("--dry-run",)):
        rc = cli.main(["--config", str(TINY), *dry, f"model.teacher={teacher}", f"train.output_dir={tmp_path / 'run'}"])
        err = capsys.readouterr().err
        assert rc == 2 and f"data.seq_len=256 is longer than the max_position_embeddings (32) of model.teacher=" \
                           f"{teacher} (its config.json): lower data.seq_len to at most 32" in err, err


def test_a_process_id_without_a_job(tmp_path, capsys):
    teacher = write_hf_config(tmp_path / "t", num_hidden_layers=4)
    rc = cli.main(["--config", str(TINY), f"model.teacher={teacher}", f"train.output_dir={tmp_path / 'run'}",
                   "distributed.process_id=5"])
    err = capsys.readouterr().err
    assert rc == 2 and "distributed.process_id=5 was given, but nothing makes this a job of several processes" in err


def test_a_damaged_run_record_is_named_on_resume(tmp_path):
    """config.yaml / teacher_config.json edited by hand or cut short: YAML's and JSON's tracebacks on resume."""
    config = load(f"train.output_dir={tmp_path}")
    (tmp_path / trainer.CONFIG_FILE).write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match=f"cannot resume: {tmp_path / 'config.yaml'} is not valid YAML: .*restore "
                                          f"it from a copy, or start a new run"):
        trainer._check_resumable(config, tmp_path / trainer.CONFIG_FILE)
    (tmp_path / trainer.TEACHER_CONFIG_FILE).write_text('{"a":')
    with pytest.raises(ConfigError, match=f"cannot resume: {tmp_path / 'teacher_config.json'} is not valid JSON"):
        trainer._check_same_teacher(config, {}, tmp_path)
    (tmp_path / trainer.TEACHER_CONFIG_FILE).write_text("[1]")
    with pytest.raises(ConfigError, match=r"is not a mapping \(list\)"):
        trainer._check_same_teacher(config, {}, tmp_path)
    assert (tmp_path / trainer.CONFIG_FILE).read_text() == "model: [unclosed\n"
