"""Every recipe in pipelines/configs/ resolves to the values it had before the config was split into the rooms that
own each section (issue 33), and `--help` lists the same fields with the same defaults and help lines, in order.

The golden file was written from the code before that change (tests/fixtures/recipes_golden.json). What the change
added is allowed by name below, with why: new sections (their fields are new keys and new --help lines) and the help
lines that had to say something new."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from minimind_ray.config import field_help, load_config, to_dict

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "fixtures" / "recipes_golden.json"
RECIPES = sorted(p for p in (REPO / "pipelines" / "configs").glob("*.yaml")
                 if not p.name.startswith(("sweep", "pipeline")))


def _resolved(path: Path) -> dict:
    # as JSON would hold it: tuples are lists, anything else its str
    return json.loads(json.dumps(to_dict(load_config(str(path), check=False)), sort_keys=True, default=str))


def _help() -> list:
    return [[name, repr(default), text] for name, default, text in field_help()]


# sections added since the golden file: new stages' (SimPO; KTO and RLOO, issue 48) and the rollout engine every RL
# stage shares; and fields added to train: since (issue 36, FSDP: how the workers share the model, activation checkpointing, FSDP's resharding),
# each with a default that keeps every recipe's run as it was (ddp, none, true)
NEW_SECTIONS = ("train.simpo.", "train.rollout.", "train.parallelism", "train.activation_checkpointing",
                "train.reshard_after_forward", "train.kto.", "train.rloo.",
                # issue 47: whether a user's mistake is retried, and the check of what a local Ray can hold (defaults
                # keep every recipe's run as it was: a mistake failed every attempt anyway)
                "cluster.retry_mistakes", "cluster.check_local_fit",
                # issue 49: how a checkpoint reaches storage (the same files either way; a bucket's upload off the step)
                "checkpoint.upload",
                # issue 54: a tokenizer other than train.init_from's is refused unless this allows it (default: refuse)
                "data.allow_tokenizer_change")
# help lines that changed on purpose: the stage list names the new stage; train.grpo.rollout* moved to train.rollout;
# data.format says what a verb implies when it is not given, data.train_path that one path needs no list (issue 38)
CHANGED_HELP = {"cluster.max_failures", "train.faults",  # issue 47: what max_failures counts; the 'bug' kind
                "train.stage", "train.grpo.rollout", "train.grpo.rollout_actors", "train.grpo.rollout_actor_cpus",
                "train.grpo.rollout_actor_gpus", "train.grpo.rollout_overlap", "data.format", "data.train_path"}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _write_golden() -> None:  # by hand, for a deliberate change: python -c "from tests.unit.test_recipes_golden import _write_golden as w; w()"
    GOLDEN.write_text(json.dumps({"recipes": {p.name: _resolved(p) for p in RECIPES}, "help": _help()}, indent=1,
                                 sort_keys=True, default=str))


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


NEW_RECIPES = {"simpo_26m.yaml", "kto_26m.yaml", "demo_rloo.yaml"}  # recipes added since (the new stages')


def test_every_recipe_of_the_golden_file_is_still_there(golden):
    assert sorted(golden["recipes"]) == sorted(p.name for p in RECIPES if p.name not in NEW_RECIPES)


@pytest.mark.parametrize("recipe", [p for p in RECIPES if p.name not in NEW_RECIPES], ids=lambda p: p.name)
def test_a_recipe_resolves_to_the_same_values(recipe, golden):
    now, before = _flat(_resolved(recipe)), _flat(golden["recipes"][recipe.name])
    assert {k: now.get(k, "<missing>") for k in before} == before
    assert [k for k in now if k not in before and not k.startswith(NEW_SECTIONS)] == []


def test_help_lists_the_same_fields_defaults_and_lines(golden):
    now = {name: (default, text) for name, default, text in _help()}
    order = [name for name, _, _ in _help()]
    for name, default, text in golden["help"]:
        assert name in now, f"--help lost {name}"
        assert now[name][0] == default and (name in CHANGED_HELP or now[name][1] == text), name
    assert [n for n in order if n in {g[0] for g in golden["help"]}] == [g[0] for g in golden["help"]]
    assert [n for n in order if n not in {g[0] for g in golden["help"]} and not n.startswith(NEW_SECTIONS)] == []
