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


def test_output_dir_that_is_a_file(tmp_path):
    file = tmp_path / "afile"
    file.write_text("not a directory")
    with pytest.raises(ConfigError, match=f"train.output_dir='{file}' is a file, not a directory"):
        load(f"train.output_dir={file}")
    with pytest.raises(ConfigError, match=f"lies under {file}, which is a file"):
        load(f"train.output_dir={file / 'run'}")
    assert load(f"train.output_dir={tmp_path / 'new' / 'run'}").train.output_dir == str(tmp_path / "new" / "run")


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
