"""Config loading: YAML + overrides + presets, and errors that name the field before Ray starts."""
from pathlib import Path

import pytest

from minimind_ray.config import ConfigError, field_help, load_config, to_dict
from minimind_ray.data.config import accumulation_steps
from minimind_ray.config_checks import flatten

RECIPES = Path(__file__).resolve().parents[2] / "pipelines" / "configs"


def test_default_model_is_the_26m_minimind2_small():
    cfg = load_config(None, ["data.train_path=[demo]"])
    m = cfg.model
    assert (m.preset, m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads,
            m.vocab_size, m.intermediate_size, m.rms_norm_eps) == ("minimind2-small", 512, 8, 8, 2, 6400, 1408, 1e-5)


def test_preset_fills_fields_and_explicit_values_win():
    cfg = load_config(None, ["data.train_path=[demo]", "model.preset=minimind3", "model.num_hidden_layers=4"])
    assert cfg.model.generation == "minimind3" and cfg.model.qk_norm and cfg.model.hidden_size == 768
    assert cfg.model.num_hidden_layers == 4


@pytest.mark.parametrize("overrides,field", [
    (["model.preset=nope"], "model.preset"),
    (["train.global_batch_size=30", "train.micro_batch_size=4", "cluster.num_workers=2"], "train.global_batch_size"),
    (["data.train_path=[/no/such/file.jsonl]"], "data.train_path"),
    (["train.stage=rlhf"], "train.stage"),
    (["train.stage=dpo", "data.format=pretrain"], "data.format"),  # an explicit format the stage cannot train on
    (["cluster.min_workers=3", "cluster.num_workers=2"], "cluster.min_workers"),
    (["data.bad_records=ignore"], "data.bad_records"),
    (["train.lr=abc"], "train.lr"),
    (["train.unknown_field=1"], "unknown_field"),
])
def test_invalid_values_fail_naming_the_field(overrides, field):
    base = [] if any(o.startswith("data.train_path") for o in overrides) else ["data.train_path=[demo]"]
    with pytest.raises(ConfigError) as e:
        load_config(None, base + overrides)
    assert field in str(e.value)


def test_elastic_range_must_keep_the_global_batch_divisible():
    # 48 = 3 workers x 16 works, but 2 workers x 16 does not divide 48 -> refused up front
    with pytest.raises(ConfigError, match="global_batch_size"):
        load_config(None, ["data.train_path=[demo]", "train.global_batch_size=48", "train.micro_batch_size=16",
                           "cluster.num_workers=3", "cluster.min_workers=2"])


def test_accumulation_keeps_the_global_batch():
    cfg = load_config(None, ["data.train_path=[demo]", "train.global_batch_size=64", "train.micro_batch_size=8"])
    assert [accumulation_steps(cfg.train.global_batch_size, cfg.train.micro_batch_size, w) * w * 8 for w in (1, 2, 4, 8)] == [64] * 4


def test_every_field_has_help_and_params_flatten():
    rows = field_help()
    assert rows and all(h for _, _, h in rows), [n for n, _, h in rows if not h]
    flat = flatten(to_dict(load_config(None, ["data.train_path=[demo]"])))
    assert flat["model.hidden_size"] == 512 and flat["train.lora.rank"] == 16


@pytest.mark.parametrize("recipe", ["tiny.yaml", "demo_pretrain.yaml", "demo_sft.yaml"])
def test_cpu_recipes_load(recipe):
    load_config(str(RECIPES / recipe))


@pytest.mark.parametrize("recipe", ["pretrain_26m.yaml", "sft_26m.yaml", "lora_26m.yaml", "dpo_26m.yaml",
                                    "distill_26m.yaml"])
def test_gpu_recipes_are_valid_once_their_data_exists(recipe, tmp_path):
    # the recipes name MiniMind's dataset files; point them at stand-ins to validate the rest
    f = tmp_path / "data.jsonl"
    f.write_text("{}\n")
    over = [f"data.train_path=[{f}]", "data.tokenizer=builtin", "train.init_from=null"]
    if recipe.startswith("distill"):  # a field of the distill stage's section: refused on any other stage's run
        over.append("train.distill.teacher_weights=" + str(f))
    cfg = load_config(str(RECIPES / recipe), over)
    assert cfg.cluster.use_gpu is True and cfg.model.preset == "minimind2-small"
    if recipe == "pretrain_26m.yaml":
        t = cfg.train
        assert (cfg.data.max_seq_len, t.global_batch_size, t.lr, t.warmup_steps, cfg.checkpoint.interval,
                cfg.cluster.max_failures, cfg.cluster.backend, cfg.cluster.num_workers) == \
            (512, 512, 1e-4, 1000, 100, 3, "auto", 4)
        assert accumulation_steps(cfg.train.global_batch_size, cfg.train.micro_batch_size, 4) == 1  # 128 per GPU


def test_old_grpo_rollout_keys_are_read_by_the_stages_that_read_train_grpo_only(capsys):
    """Issue 48: the train.grpo.rollout* -> train.rollout migration is GRPO's section's, run by the records of the
    stages that read that section (grpo, the agent), with a notice each; another stage's run refuses them, as any field
    of a section it does not read (issue 56)."""
    old = ["train.grpo.rollout=actors", "train.grpo.rollout_actors=2", "train.grpo.rollout_overlap=true"]
    for stage, extra in (("grpo", ["data.format=prompt"]), ("agent", ["data.max_seq_len=320"])):
        cfg = load_config(None, ["data.train_path=[demo]", "model.preset=tiny", f"train.stage={stage}",
                                 "train.init_from=.", *extra, *old])
        assert (cfg.train.rollout.engine, cfg.train.rollout.actors, cfg.train.rollout.overlap) == ("actors", 2, True)
        notices = [line for line in capsys.readouterr().err.splitlines() if "notice" in line]
        assert notices == ["[minimind-ray] notice: train.grpo.rollout is now train.rollout.engine (read as "
                           "train.rollout.engine='actors')",
                           "[minimind-ray] notice: train.grpo.rollout_actors is now train.rollout.actors (read as "
                           "train.rollout.actors=2)",
                           "[minimind-ray] notice: train.grpo.rollout_overlap is now train.rollout.overlap (read as "
                           "train.rollout.overlap=True)"], stage
    with pytest.raises(ConfigError, match=r"^train\.grpo\.rollout: a field of the grpo stage's section, which the rloo "
                                          r"stage does not read; the rloo stage reads train\.rloo, train\.rollout: "
                                          r"leave it out$"):
        load_config(None, ["data.train_path=[demo]", "model.preset=tiny", "train.stage=rloo", "train.init_from=.",
                           *old])
    assert "notice" not in capsys.readouterr().err
