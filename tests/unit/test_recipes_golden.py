"""Every recipe in pipelines/configs/ resolves to the values it had before the config was split into the rooms that
own each section (issue 33), and `--help` lists the same fields with the same defaults and help lines.

The golden file was written from the code before that change (tests/fixtures/recipes_golden.json); a deliberate
change of a default or a help line rewrites it (see _write_golden) in the same commit, and says why."""
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


def _write_golden() -> None:  # by hand, for a deliberate change: python -c "from tests.unit.test_recipes_golden import _write_golden as w; w()"
    GOLDEN.write_text(json.dumps({"recipes": {p.name: _resolved(p) for p in RECIPES}, "help": _help()}, indent=1,
                                 sort_keys=True, default=str))


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


def test_every_recipe_is_in_the_golden_file(golden):
    assert sorted(golden["recipes"]) == [p.name for p in RECIPES]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_a_recipe_resolves_to_the_same_values(recipe, golden):
    assert _resolved(recipe) == golden["recipes"][recipe.name]


def test_help_lists_the_same_fields_defaults_and_lines(golden):
    assert _help() == golden["help"]
