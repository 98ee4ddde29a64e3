"""Every recipe in pipelines/configs/ resolves to the values it had before the config was split into the rooms that
own each section (issue 33), and `--help` lists the same fields with the same defaults and help lines, in order.

The golden file was written from the code before that change (tests/fixtures/recipes_golden.json). What the change
added is allowed by name below, with why: new sections (their fields are new keys and new --help lines) and the help
lines that had to say something new."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from minimind_ray.config import field_help, flatten, load_config, to_dict
from minimind_ray.stages import STAGES

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "fixtures" / "recipes_golden.json"
RECIPES = sorted(p for p in (REPO / "pipelines" / "configs").glob("*.yaml")
                 if not p.name.startswith(("sweep", "pipeline")))


def _resolved(path: Path) -> dict:
    # as JSON would hold it: tuples are lists, anything else its str; a field that moved (the agent's group policy,
    # issue 56: train.grpo.* -> train.agent.*) under the name it had, as its stage's record says
    cfg = load_config(str(path), check=False)
    flat = json.loads(json.dumps(flatten(to_dict(cfg)), sort_keys=True, default=str))
    for now, before in STAGES[cfg.train.stage].identity_renames:
        flat[before] = flat.pop(now)
    out: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


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
                # issue 56: the agent's own section holds the group policy it read from train.grpo (GRPO's defaults)
                *(f"train.agent.{n}" for n in ("num_generations", "max_gen_len", "temperature", "top_p", "top_k",
                                                "loss_type", "epsilon", "clip_high", "epsilon_high", "beta",
                                                "kl_estimator", "kl_target", "kl_horizon", "advantage",
                                                "scale_rewards", "loss_agg", "num_iterations", "mini_batches",
                                                "mask_truncated")),
                # issue 54: a tokenizer other than train.init_from's is refused unless this allows it (default: refuse)
                "data.allow_tokenizer_change",
                # issue 57: constrained rollouts, off by default (train.rloo.json_schema is in its new section)
                "train.grpo.json_schema", "train.ppo.json_schema", "train.agent.constrain_tool_calls")
# help lines that changed on purpose: the stage list names the new stage; train.grpo.rollout* moved to train.rollout;
# data.format says what a verb implies when it is not given, data.train_path that one path needs no list (issue 38)
CHANGED_HELP = {"cluster.max_failures", "train.faults",  # issue 47: what max_failures counts; the 'bug' kind
                "train.stage", "train.ppo.rewards", "train.agent.rewards", "train.grpo.rollout", "train.grpo.rollout_actors", "train.grpo.rollout_actor_cpus",
                "train.grpo.rollout_actor_gpus", "train.grpo.rollout_overlap", "data.format", "data.train_path"}


def _flat(d: dict, prefix: str = "") -> dict:
    # a list of sections (eval.tasks) by index, so that a field added to every item is one new key per item
    out = {}
    for k, v in d.items():
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            v = {str(i): x for i, x in enumerate(v)}
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _write_golden() -> None:  # by hand, for a deliberate change: python -c "from tests.unit.test_recipes_golden import _write_golden as w; w()"
    GOLDEN.write_text(json.dumps({"recipes": {p.name: _resolved(p) for p in RECIPES}, "help": _help()}, indent=1,
                                 sort_keys=True, default=str))


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


# fields added to every eval task since (issue 57: a gen task's prefix cache, off by default)
NEW_TASK_FIELDS = {"prefix_cache_mb"}

NEW_RECIPES = {"simpo_26m.yaml", "kto_26m.yaml", "demo_rloo.yaml"}  # recipes added since (the new stages')


def test_every_recipe_of_the_golden_file_is_still_there(golden):
    assert sorted(golden["recipes"]) == sorted(p.name for p in RECIPES if p.name not in NEW_RECIPES)


@pytest.mark.parametrize("recipe", [p for p in RECIPES if p.name not in NEW_RECIPES], ids=lambda p: p.name)
def test_a_recipe_resolves_to_the_same_values(recipe, golden):
    now, before = _flat(_resolved(recipe)), _flat(golden["recipes"][recipe.name])
    assert {k: now.get(k, "<missing>") for k in before} == before
    assert [k for k in now if k not in before and not k.startswith(NEW_SECTIONS)
            and k.split(".")[-1] not in NEW_TASK_FIELDS] == []


def test_help_lists_the_same_fields_defaults_and_lines(golden):
    now = {name: (default, text) for name, default, text in _help()}
    order = [name for name, _, _ in _help()]
    for name, default, text in golden["help"]:
        assert name in now, f"--help lost {name}"
        assert now[name][0] == default and (name in CHANGED_HELP or now[name][1] == text), name
    assert [n for n in order if n in {g[0] for g in golden["help"]}] == [g[0] for g in golden["help"]]
    assert [n for n in order if n not in {g[0] for g in golden["help"]} and not n.startswith(NEW_SECTIONS)] == []


# every recipe's run identity under every stage's verb, computed by the code of main before issue 56 moved the RL
# algorithms into stages/ and gave the agent its own section (tests/fixtures/recipes_identity.json: run_identity of
# load_config(recipe, ["train.stage=<verb>"], check=False) for every verb): the same command still finds, and resumes,
# a run made before. A recipe under a verb whose run is now refused (the agent's recipes, whose train.agent section a
# grpo run does not read) has no run to find; its own verb is always compared.
IDENTITIES = REPO / "tests" / "fixtures" / "recipes_identity.json"


@pytest.mark.parametrize("recipe", [p for p in RECIPES], ids=lambda p: p.name)
def test_a_recipe_keeps_its_run_identity_under_every_verb_that_still_runs_it(recipe):
    from minimind_ray.config import run_identity
    from minimind_ray.stages import STAGE_NAMES, other_stages_field

    before = json.loads(IDENTITIES.read_text())[recipe.name]
    own = load_config(str(recipe), check=False).train.stage
    now, compared = {}, {}
    for s in STAGE_NAMES:
        cfg = load_config(str(recipe), [f"train.stage={s}"], check=False)
        if s == own or other_stages_field(cfg.train) is None:
            now[s], compared[s] = run_identity(cfg), before[s]
    assert own in now and now == compared
