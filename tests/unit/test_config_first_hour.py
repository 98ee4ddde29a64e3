"""A user's first hour with the config (issue 38): one path where a list is, verbs that imply their data format, and
typos answered with the nearest field by its dotted name, never a class name. No Ray: config parsing only."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from minimind_ray.config import ConfigError, load_config
from minimind_ray.stages import STAGES


def _error(path=None, overrides=()) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(str(path) if path else None, list(overrides), check=False)
    msg = str(e.value)
    assert "\n" not in msg and not re.search(r"[A-Z]\w*Config\b|AnyNode|ListConfig", msg), msg
    return msg


@pytest.mark.parametrize("value", ["pretrain_hq.jsonl", "/data/*.jsonl", "s3://bucket/minimind/pretrain_hq.jsonl"])
def test_one_path_glob_or_uri_is_a_list_of_one_on_the_command_line_and_in_yaml(tmp_path: Path, value):
    assert load_config(None, [f"data.train_path={value}"], check=False).data.train_path == [value]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"data:\n  train_path: {value}\ntrain:\n  lora:\n    targets: q_proj\n")
    cfg = load_config(str(recipe), check=False)
    assert cfg.data.train_path == [value] and cfg.train.lora.targets == ["q_proj"]
    assert load_config(None, ["data.train_path=[a.jsonl,b.jsonl]"], check=False).data.train_path == ["a.jsonl", "b.jsonl"]


def test_one_entry_where_a_list_of_entries_is_and_a_bare_word_there_is_refused(tmp_path: Path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("eval:\n  tasks: {task: mc, data: 'demo:mc_eval'}\n")
    assert [t.task for t in load_config(str(recipe), check=False).eval.tasks] == ["mc"]
    assert _error(overrides=["eval.tasks=mc"]).startswith("eval.tasks: a list of entries with fields task, data")


def test_each_verb_implies_its_own_format_and_an_explicit_other_one_is_refused_in_one_line():
    own = {name: load_config(None, ["data.train_path=[demo]", f"train.stage={name}"], check=False).data.format
           for name in STAGES}
    assert own == {"pretrain": "pretrain", "sft": "sft", "lora": "sft", "dpo": "dpo", "distill": "sft",
                   "grpo": "rlaif", "ppo": "rlaif", "agent": "agent_rl", "simpo": "dpo", "kto": "kto",
                   "rloo": "rlaif"}
    for name in ("sft", "dpo"):  # validated too: what the user typed, with no data.format
        assert load_config(None, ["data.train_path=[demo]", f"train.stage={name}"]).data.format == name
    with pytest.raises(ConfigError) as e:
        load_config(None, ["data.train_path=[demo]", "train.stage=sft", "data.format=pretrain"])
    assert str(e.value) == ("data.format: sft trains on sft records, not 'pretrain'; leave data.format out and the "
                            "sft verb reads sft")
    # an explicit format the stage can train on is kept
    assert load_config(None, ["data.train_path=[demo]", "train.stage=grpo", "data.format=prompt"],
                       check=False).data.format == "prompt"


@pytest.mark.parametrize("override,expect", [
    ("train.learning_rate=1e-3", "train.learning_rate: no such field in train; did you mean train.lr?"),
    ("trian.lr=1", "trian: no such field at the top level (model, data, train, ...); did you mean train?"),
    ("train.max_seq_len=64", "train.max_seq_len: no such field in train; did you mean data.max_seq_len?"),
    ("model.layers=4", "model.layers: no such field in model; did you mean model.num_hidden_layers?"),
    ("model.hidden_sise=64", "model.hidden_sise: no such field in model; did you mean model.hidden_size?"),
    ("train.grpo.betta=0.1", "train.grpo.betta: no such field in train.grpo; did you mean train.grpo.beta?"),
    ("train=3", "train: is a section, not a value: set its fields (train.stage, "),
    ("train.lr.peak=1", "train.lr: is a value, not a section"),
])
def test_typos_get_the_nearest_field_by_its_dotted_name_at_every_level(override, expect):
    assert _error(overrides=[override]).startswith(expect)


def test_a_recipe_typo_names_file_line_and_the_nearest_field(tmp_path: Path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("train:\n  epochs: 1\n  learning_rate: 1.0e-3\n")
    assert _error(recipe) == f"{recipe}:3: train.learning_rate: no such field in train; did you mean train.lr?"
    recipe.write_text("eval:\n  tasks:\n    - {task: mc, data: x}\n    - {task: mc, dta: x}\n")
    assert _error(recipe) == (f"{recipe}:4: eval.tasks[1].dta: no such field in eval.tasks[1]; "
                              f"did you mean eval.tasks[1].data?")
