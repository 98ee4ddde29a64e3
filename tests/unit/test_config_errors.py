"""Bad config input (issue 11, items 11-13): each is one ConfigError naming the file and line, or the
field, raised by load_config, which every verb and entry point runs before Ray starts."""
from pathlib import Path

import pytest

from minimind_ray.config import ConfigError, load_config

DEMO = ["data.train_path=[demo]"]


def _error(path=None, overrides=()) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(str(path) if path else None, DEMO + list(overrides))
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_item11_invalid_yaml_names_the_file_line_and_column(tmp_path: Path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model:\n  preset: tiny\n  hidden_size: [64\ntrain:\n  lr: 1.0e-3\n")
    msg = _error(recipe)
    # the parser notices at the next key; it says where the unclosed bracket opened
    assert msg.startswith(f"{recipe}:4:6: invalid YAML: ") and "line 3, column 16" in msg, msg


@pytest.mark.parametrize("text,expect", [
    ("- model\n- train\n", "the top level must be a mapping of sections"),
    ("just words\n", "the top level must be a mapping of sections"),
    ("train:\n  lr: 1\ntrain:\n  lr: 2\n", ":3:1: invalid YAML: found duplicate key train"),
    ("a: 1\n---\nb: 2\n", ":2:1: invalid YAML: "),
])
def test_item11_yaml_that_is_not_a_config_mapping_names_the_file(tmp_path: Path, text, expect):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    msg = _error(recipe)
    assert msg.startswith(str(recipe)) and expect in msg, msg


def test_item11_a_file_that_is_not_utf8_text_names_the_file(tmp_path: Path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(b"\xff\xfe\x00m")
    assert _error(recipe).startswith(f"{recipe}: not UTF-8 text")


def test_item11_an_unknown_key_or_a_wrong_type_in_a_recipe_names_file_line_and_field(tmp_path: Path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model:\n  preset: tiny\n  hidden_sise: 64\n")
    msg = _error(recipe)
    assert msg.startswith(f"{recipe}:3: model.hidden_sise: ") and "hidden_size" in msg, msg  # OmegaConf's hint kept
    recipe.write_text("train:\n  epochs: 1\n  lr: fast\n")
    msg = _error(recipe)
    assert msg.startswith(f"{recipe}:3: train.lr: "), msg


def test_item11_an_empty_recipe_is_the_defaults(tmp_path: Path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("# nothing set yet\n")
    assert load_config(str(recipe), DEMO).model.preset == "minimind2-small"


@pytest.mark.parametrize("field", ["model.num_key_value_heads", "model.num_attention_heads"])
def test_item12_zero_heads_is_a_config_error_not_a_zero_division(field):
    # num_attention_heads=0 used to divide in validate(); num_key_value_heads=0 in the modulo check
    assert _error(overrides=[f"{field}=0"]).startswith(f"{field}: must be >= 1, got 0")


@pytest.mark.parametrize("override,field", [
    ("data.block_rows=0", "data.block_rows"),
    ("data.chunk_bytes=0", "data.chunk_bytes"),
    ("data.chunk_bytes=-5", "data.chunk_bytes"),
    ("train.epochs=0", "train.epochs"),
    ("train.epochs=-1", "train.epochs"),
    ("train.max_steps=0", "train.max_steps"),
    ("train.max_steps=-3", "train.max_steps"),
    ("model.dropout=1.0", "model.dropout"),
    ("model.dropout=-0.1", "model.dropout"),
    ("train.lora.rank=0", "train.lora.rank"),
    ("checkpoint.num_to_keep=0", "checkpoint.num_to_keep"),
    ("train.distill.temperature=0", "train.distill.temperature"),
    ("train.distill.temperature=-1.5", "train.distill.temperature"),
    ("train.dpo.beta=0", "train.dpo.beta"),
    ("train.collective_timeout_s=0", "train.collective_timeout_s"),
    ("train.collective_timeout_s=-1", "train.collective_timeout_s"),
    ("train.lr=nan", "train.lr"),  # NaN fails every bound
])
def test_item13_out_of_range_values_fail_naming_the_field(override, field):
    msg = _error(overrides=[override])
    assert msg.startswith(f"{field}: must be "), msg


def test_item13_max_seq_len_beyond_the_rope_table_fails_naming_both_fields():
    msg = _error(overrides=["model.max_position_embeddings=256", "data.max_seq_len=512"])
    assert msg.startswith("data.max_seq_len: 512 exceeds model.max_position_embeddings 256"), msg


def test_item13_values_on_the_edges_of_their_ranges_are_accepted():
    cfg = load_config(None, DEMO + ["model.dropout=0.0", "data.block_rows=1", "train.max_steps=1", "train.epochs=1",
                                    "checkpoint.num_to_keep=1", "train.stage=lora", "train.lora.rank=1",
                                    "data.max_seq_len=256", "model.max_position_embeddings=256"])
    assert cfg.data.block_rows == 1 and cfg.data.max_seq_len == cfg.model.max_position_embeddings
