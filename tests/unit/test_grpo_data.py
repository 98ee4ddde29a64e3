"""GRPO's data and config: MiniMind's rlaif.jsonl and plain {prompt, answer} records become left-padded
prompts with their reference answers; bad records are counted per reason with their line (or stop a
strict run); the grpo config is checked before Ray starts, naming the field."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from minimind_ray.config import ConfigError, DataConfig, load_config
from minimind_ray.data.formats import Encoder, collate
from minimind_ray.data.prepare import DataError, merge_summaries, plan_chunks, process_chunk
from minimind_ray.data.sources import resolve_sources
from minimind_ray.tokenizer import load_tokenizer
from tests.conftest import REPO, minimind_tokenizer_dir


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(minimind_tokenizer_dir("minimind2")))


CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 plus 7?"},
        {"role": "assistant", "content": "19"}]


def test_rlaif_and_prompt_records_become_generation_prompts_with_answers(tok):
    enc = Encoder("rlaif", tok, max_seq_len=64)
    assert enc.add([{"conversations": CONV}, {"conversations": CONV[1:2] + [{"role": "assistant", "content": ""}]}]) == []
    rows = enc.take(final=True)
    want = tok.apply_chat_template(CONV[:2], add_generation_prompt=True)
    assert want.endswith("<|im_start|>assistant\n")  # the prompt stops where the reply to generate starts
    assert tok.decode(rows["prompt_ids"][0].tolist()) == want
    assert [bytes(a).decode() for a in rows["answer_utf8"]] == ["19", ""]
    b = collate("rlaif", rows, np.array([7, 8]), pad_id=tok.pad_id, max_seq_len=64)
    lengths = [len(p) for p in rows["prompt_ids"]]
    s, long, short = int(np.argmin(lengths)), max(lengths), min(lengths)
    assert long > short and b["prompt_ids"].shape == (2, long)
    assert b["prompt_mask"][s].tolist() == [0] * (long - short) + [1] * short
    assert b["prompt_ids"][s, long - short:].tolist() == rows["prompt_ids"][s].tolist()  # left-padded
    assert (b["prompt_ids"][s, :long - short] == tok.pad_id).all() and b["prompt_mask"][1 - s].all()
    assert b["answer_len"].tolist() == [2, 0] and bytes(b["answer_utf8"][0, :2].tolist()) == b"19"
    assert b["sample_ids"].tolist() == [7, 8]

    enc = Encoder("prompt", tok, max_seq_len=64)
    assert enc.add([{"prompt": "What is 12 plus 7?", "answer": 19}, {"prompt": "首都？", "answer": "北京"}]) == []
    rows = enc.take(final=True)
    assert tok.decode(rows["prompt_ids"][0].tolist()) == tok.apply_chat_template(
        [{"role": "user", "content": "What is 12 plus 7?"}], add_generation_prompt=True)
    assert [bytes(a).decode() for a in rows["answer_utf8"]] == ["19", "北京"]


def test_a_long_prompt_keeps_its_end_and_is_counted(tok):
    enc = Encoder("prompt", tok, max_seq_len=12)
    issues = enc.add([{"prompt": "word " * 40 + "What is 1 plus 1?", "answer": 2}])
    assert [(i, r) for i, r, _ in issues] == [(0, "truncated")]
    ids = enc.take(final=True)["prompt_ids"][0]
    assert len(ids) == 12 and tok.decode(ids.tolist()).endswith("<|im_start|>assistant\n")


BAD_RLAIF = [
    json.dumps({"conversations": CONV}),                                                    # 1 good
    json.dumps({"conversations": [{"role": "user", "content": "hi"}]}),                    # 2 last turn not assistant
    json.dumps({"conversations": [{"role": "assistant", "content": "x"}]}),                # 3 nothing to prompt with
    json.dumps({"conversations": "What is 1 plus 1?"}),                                   # 4 not a list
    json.dumps({"conv": []}),                                                               # 5 no conversations
    json.dumps({"conversations": [{"role": "user"}, {"role": "assistant", "content": ""}]}),  # 6 no content
    '{"conversations": [{"role": "user", "content": "cut off',                            # 7 truncated JSON
    json.dumps({"conversations": CONV[1:]}),                                                # 8 good
    '{"conversations": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": ""}]}',  # 9
    "",                                                                                     # 10 blank
    json.dumps({"conversations": [{"role": "robot", "content": "hi"},
                                  {"role": "assistant", "content": ""}]}),                  # 11 unknown role
]


def _prepare_locally(lines, tmp_path, fmt, tok, strict=False):
    src = tmp_path / f"{fmt}.jsonl"
    src.write_text("\n".join(lines) + "\n")
    cfg = DataConfig(format=fmt, max_seq_len=64, chunk_bytes=80, block_rows=2,
                     bad_records="strict" if strict else "skip")
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    files, _ = resolve_sources([str(src)])
    chunks = plan_chunks(files, cfg.chunk_bytes)
    return str(src), merge_summaries(chunks, [process_chunk(c, tok, cfg, str(out)) for c in chunks], [])


def test_bad_rlaif_records_are_counted_per_reason_with_their_lines(tok, tmp_path):
    src, merged = _prepare_locally(BAD_RLAIF, tmp_path, "rlaif", tok)
    skipped = {r: e["samples"] for r, e in merged["skipped"].items()}
    assert skipped == {"wrong_type": [f"{src}:2", f"{src}:4", f"{src}:11"], "no_prompt": [f"{src}:3"],
                       "missing_field": [f"{src}:5", f"{src}:6"], "bad_json": [f"{src}:7"],
                       "bad_text": [f"{src}:9"], "empty_line": [f"{src}:10"]}
    assert merged["counts"]["records"] == 2


def test_strict_rlaif_stops_at_the_first_bad_line_naming_it(tok, tmp_path):
    with pytest.raises(DataError, match=r":2: wrong_type: 'conversations\[-1\]\.role' is 'user', expected 'assistant'"):
        _prepare_locally(BAD_RLAIF, tmp_path, "rlaif", tok, strict=True)


def test_bad_prompt_records_are_named(tok, tmp_path):
    lines = [json.dumps(r) for r in ({"prompt": "What is 1 plus 1?", "answer": 2}, {"prompt": 5, "answer": 1},
                                     {"prompt": "q"}, {"prompt": "   ", "answer": "x"}, {"prompt": "q", "answer": True},
                                     {"prompt": "q", "answer": [1]}, {"prompt": "What is 2 plus 2?", "answer": "4"})]
    src, merged = _prepare_locally(lines, tmp_path, "prompt", tok)
    assert {r: e["samples"] for r, e in merged["skipped"].items()} == {
        "wrong_type": [f"{src}:2", f"{src}:5", f"{src}:6"], "missing_field": [f"{src}:3"], "no_prompt": [f"{src}:4"]}
    assert merged["counts"]["records"] == 2


@pytest.fixture(scope="module")
def base_pth(tmp_path_factory):
    from minimind_ray.model.minimind import build_model
    from minimind_ray.store.pth import save_pth

    path = tmp_path_factory.mktemp("base") / "base.pth"
    save_pth(build_model(load_config(None, ["data.train_path=[demo]", "model.preset=tiny"]).model, seed=0), str(path))
    return str(path)


@pytest.fixture
def grpo_cfg(base_pth):
    return lambda *extra: load_config(None, ["data.train_path=[demo]", "model.preset=tiny", "train.stage=grpo",
                                             "data.format=prompt", f"train.init_from={base_pth}", *extra])


def test_grpo_defaults_are_minimind_and_other_stages_refuse_rl_data(grpo_cfg):
    g = grpo_cfg().train.grpo
    assert (g.num_generations, g.beta, g.loss_type, g.epsilon, g.epsilon_high) == (6, 0.1, "cispo", 0.2, 5.0)
    assert [r.name for r in g.rewards] == ["length", "think_format", "repetition"]
    assert grpo_cfg("data.format=rlaif").data.format == "rlaif"
    with pytest.raises(ConfigError, match="data.format: grpo trains on rlaif or prompt records, not 'sft'"):
        grpo_cfg("data.format=sft")
    with pytest.raises(ConfigError, match="data.format: sft trains on sft records, not 'prompt'"):
        load_config(None, ["data.train_path=[demo]", "train.stage=sft", "data.format=prompt"])


@pytest.mark.parametrize("override, message", [
    ("train.grpo.num_generations=1", "train.grpo.num_generations: must be >= 2"),
    ("train.grpo.loss_type=ppo", "train.grpo.loss_type: 'ppo' is not 'cispo' or 'grpo'"),
    ("train.grpo.top_p=0", r"train.grpo.top_p: must be in \(0, 1\]"),
    ("train.grpo.temperature=0", "train.grpo.temperature: must be > 0"),
    ("train.grpo.beta=-1", "train.grpo.beta: must be >= 0"),
    ("train.grpo.max_gen_len=40000", "train.grpo.max_gen_len: data.max_seq_len 512 \\+ max_gen_len 40000 exceed"),
    ("data.eval_fraction=0.1", "data.eval_fraction: must be 0 for grpo"),
    ("train.grpo.rewards=[]", "train.grpo.rewards: no reward terms"),
    ("train.grpo.rewards=[{name: exact_answer}, {name: nope}]", r"train.grpo.rewards\[1\].name: 'nope' is neither"),
    ("train.grpo.rewards=[{name: 'no_such_module_xyz:f'}]", r"rewards\[0\].name: cannot load reward"),
    ("train.grpo.rewards=[{name: reward_model, path: /no/such/dir}]", r"rewards\[0\].path: not a directory"),
    ("train.grpo.rollout=vllm", r"train.grpo.rollout: 'vllm' is not one of \('torch', 'actors'\)"),
    ("train.grpo.rollout_overlap=true", "train.rollout.overlap: .* needs train.rollout.engine=actors"),
    ("train.grpo.loss_agg=mean", r"train.grpo.loss_agg: 'mean' is not one of"),
    ("train.grpo.kl_estimator=k4", r"train.grpo.kl_estimator: 'k4' is not one of"),
    ("train.grpo.clip_high=0", r"train.grpo.clip_high: must be > 0"),
    ("train.init_from=null", "train.init_from: GRPO improves a trained policy"),
])
def test_bad_grpo_settings_fail_naming_the_field(grpo_cfg, override, message):
    with pytest.raises(ConfigError, match=message):
        grpo_cfg(override)



def test_a_reward_model_without_transformers_names_the_extra(grpo_cfg, tmp_path, monkeypatch):
    """transformers is the hf extra (pyproject.toml): without it a reward model is refused with the config, in one line
    naming what to install, not an ImportError in a worker (the wheel test, tests/integration/test_wheel.py, does the
    same in a venv that really lacks it)."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # what import machinery reads as "not installed"
    with pytest.raises(ConfigError, match=r"^train.grpo.rewards\[0\]: a reward model needs transformers, which is "
                                          r"not installed here: pip install 'minimind-ray\[hf\]'$"):
        grpo_cfg(f"train.grpo.rewards=[{{name: reward_model, path: {tmp_path}}}]")

def test_grpo_recipes_load(base_pth, tmp_path):
    cfg = load_config(str(REPO / "pipelines/configs/demo_grpo.yaml"), [f"train.init_from={base_pth}"])
    g = cfg.train.grpo  # the sorting demo's settings (docs/rl.md): what the measured rise came from
    assert cfg.train.stage == "grpo" and [r.name for r in g.rewards] == ["permutation_answer"]
    assert (g.loss_type, g.clip_high, g.loss_agg, g.num_iterations, g.beta) == ("grpo", 0.28, "token-mean", 2, 0.0)
    # the 26M recipe names MiniMind's files: stand-ins for its prompts and its reward model's directory
    data, rm = tmp_path / "rlaif.jsonl", tmp_path / "internlm2-1_8b-reward"
    data.write_text("{}\n")
    rm.mkdir()
    recipe = tmp_path / "grpo_26m.yaml"
    with open(REPO / "pipelines/configs/grpo_26m.yaml", encoding="utf-8") as f:
        recipe.write_text(f.read().replace("/mnt/shared/models/internlm2-1_8b-reward", str(rm)))
    cfg = load_config(str(recipe), [f"data.train_path=[{data}]", "data.tokenizer=builtin", f"train.init_from={base_pth}"])
    g = cfg.train.grpo
    assert (g.num_generations, g.beta, g.loss_type, g.epsilon, g.epsilon_high, g.temperature, g.max_gen_len,
            cfg.train.lr) == (6, 0.1, "cispo", 0.2, 5.0, 0.8, 1024, 3e-7)  # MiniMind's train_grpo.py
    assert [r.name for r in g.rewards] == ["length", "think_format", "repetition", "reward_model"]
    assert g.rewards[3].args["trust_remote_code"] is True and cfg.cluster.use_gpu is True
