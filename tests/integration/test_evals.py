"""Benchmark evaluation with real parts (docs/evaluation.md): lm-eval itself (its Python API and `hf` model) on the
HF export of the session's trained tiny model, over the same files through local task YAMLs, must choose what
this project chooses for every question and report the same acc and acc_norm; and `--workers N` over Ray tasks
gives the result of one process, whatever N."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from minimind_ray.evals.config import EvalTaskConfig
from minimind_ray.evals.run import evaluate_task
from tests.unit.test_evals import ceval_folder

pytestmark = pytest.mark.integration

CEVAL_YAML = """task: mmr_ceval_accountant
dataset_path: csv
dataset_kwargs:
  data_files: {{val: {val}, dev: {dev}}}
  cache_dir: {cache}
validation_split: val
fewshot_split: dev
fewshot_config:
  sampler: first_n
num_fewshot: 2
output_type: multiple_choice
description: "以下是中国关于注册会计师的单项选择题，请选出其中的正确答案。\\n\\n"
doc_to_text: "{{{{question.strip()}}}}\\nA. {{{{A}}}}\\nB. {{{{B}}}}\\nC. {{{{C}}}}\\nD. {{{{D}}}}\\n答案："
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: "{{{{['A', 'B', 'C', 'D'].index(answer)}}}}"
metric_list: [{{metric: acc}}, {{metric: acc_norm}}]
"""
MC_YAML = """task: mmr_demo_mc
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list: [{{metric: acc}}, {{metric: acc_norm}}]
"""


@pytest.fixture(scope="module")
def export(tiny_baseline, tmp_path_factory):
    """The session's trained tiny model as an fp32 HF folder (lm-eval computes in the weights' dtype)."""
    from minimind_ray.export import export_hf
    from minimind_ray.generate import tokenizer_for_weights
    from minimind_ray.store.weights import build_inference_model

    _, res, _, _ = tiny_baseline
    model, lw = build_inference_model(res.checkpoint_dir)
    tok = tokenizer_for_weights(lw)
    return export_hf(model, tok.path, tmp_path_factory.mktemp("evals-export") / "hf", dtype=torch.float32)


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_baseline):
    from minimind_ray.data.demo import resolve_demo_path

    shared = tiny_baseline[0]
    root = tmp_path_factory.mktemp("evals-files")
    # the dev split without C-Eval's explanation column: HF datasets' csv builder wants one set of columns
    return {"ceval": ceval_folder(root / "ceval", n=24, explanation=False),
            "mc": resolve_demo_path("demo:mc_eval", "", str(shared["cache"])), "cache": root / "hf-datasets"}


def _lm_eval(export, tasks, yaml_dir, chat):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model="hf", model_args=f"pretrained={export},dtype=float32", tasks=tasks, device="cpu",
                           batch_size=8, task_manager=TaskManager(include_path=str(yaml_dir)), log_samples=True,
                           apply_chat_template=chat)


def _same_choices(ours: dict, theirs: dict, samples: list):
    """Per question: the same log-likelihood per choice (to 1e-4), the same choice; then the same accuracies."""
    by_doc = sorted(samples, key=lambda s: s["doc_id"])
    assert len(by_doc) == ours["n"]
    for mine, s in zip(ours["details"], by_doc):
        lls = [float(r[0]) for r in s["filtered_resps"]]
        assert mine["logprobs"] == pytest.approx(lls, abs=1e-4), (mine["where"], mine["logprobs"], lls)
        assert (mine["pred"] == mine["gold"]) == bool(s["acc"]) and (mine["pred_norm"] == mine["gold"]) == bool(
            s["acc_norm"]), mine["where"]
    assert ours["acc"] == pytest.approx(theirs["acc,none"], abs=1e-12)
    assert ours["acc_norm"] == pytest.approx(theirs["acc_norm,none"], abs=1e-12)


def test_choices_and_accuracies_equal_lm_evals_on_the_export(export, files, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    yaml_dir = tmp_path / "tasks"
    yaml_dir.mkdir()
    c = files["ceval"]
    (yaml_dir / "ceval.yaml").write_text(CEVAL_YAML.format(val=c / "val" / "accountant_val.csv",
                                                           dev=c / "dev" / "accountant_dev.csv", cache=files["cache"]))
    (yaml_dir / "mc.yaml").write_text(MC_YAML.format(data=files["mc"], cache=files["cache"]))
    ours = {"ceval": evaluate_task(export, EvalTaskConfig(task="ceval", data=str(c), shots=2, subjects=["accountant"])),
            "mc": evaluate_task(export, EvalTaskConfig(task="mc", data=files["mc"])),
            "mc_chat": evaluate_task(export, EvalTaskConfig(task="mc", data=files["mc"], chat_template=True))}
    raw = _lm_eval(export, ["mmr_ceval_accountant", "mmr_demo_mc"], yaml_dir, chat=False)
    chat = _lm_eval(export, ["mmr_demo_mc"], yaml_dir, chat=True)
    _same_choices(ours["ceval"], raw["results"]["mmr_ceval_accountant"], raw["samples"]["mmr_ceval_accountant"])
    _same_choices(ours["mc"], raw["results"]["mmr_demo_mc"], raw["samples"]["mmr_demo_mc"])
    _same_choices(ours["mc_chat"], chat["results"]["mmr_demo_mc"], chat["samples"]["mmr_demo_mc"])
    # the texts-scored set is where length normalisation matters: it must have changed some choice
    assert any(d["pred"] != d["pred_norm"] for d in ours["mc"]["details"])


def test_workers_give_the_result_of_one_process(ray_session, export, files):
    task = EvalTaskConfig(task="mc", data=files["mc"], batch_size=8)
    alone = evaluate_task(export, task)
    one, two = (evaluate_task(export, task, workers=n) for n in (1, 2))
    assert [d["logprobs"] for d in one["details"]] == [d["logprobs"] for d in two["details"]]  # bit for bit
    for a, b in zip(alone["details"], two["details"]):
        assert (a["pred"], a["pred_norm"]) == (b["pred"], b["pred_norm"])
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)  # another thread count here
    assert (one["acc"], one["acc_norm"]) == (two["acc"], two["acc_norm"]) == (alone["acc"], alone["acc_norm"])
    gen = EvalTaskConfig(task="gen", data=str(Path(files["mc"]).with_name("sort_heldout.jsonl")), limit=12,
                         batch_size=4, samples=3, max_new_tokens=10)
    g1, g2 = (evaluate_task(export, gen, workers=n) for n in (1, 2))
    assert [d["greedy"] for d in g1["details"]] == [d["greedy"] for d in g2["details"]]
    assert [d["samples"] for d in g1["details"]] == [d["samples"] for d in g2["details"]]
    assert (g1["pass@1"], g1["pass@k"]) == (g2["pass@1"], g2["pass@k"])


def test_checkpoints_are_scored_beside_training_once_each_and_a_failed_task_does_not_stop_it(tiny_baseline):
    """tiny_baseline's run has eval.tasks (tests/integration/conftest.py): the demo's multiple-choice set and a task
    whose file is missing. Its scores are at every checkpoint step in MLflow, logged by a Ray task that is not a
    training worker; the failure is a tag with its reason and the run finished; a second validation of the same
    checkpoint (a replayed report) logs nothing, also when its marker is gone (the logger skips logged steps)."""
    from mlflow.tracking import MlflowClient

    from minimind_ray.raytrain.validation import validate_checkpoint
    from ray.train import Checkpoint

    from .helpers import loss_history

    shared, res, _, _ = tiny_baseline
    client = MlflowClient(shared["mlflow"])
    for key in ("eval/mc_eval/acc", "eval/mc_eval/acc_norm"):
        assert [s for s, _ in loss_history(shared, res.mlflow_run_id, key)] == [4, 8, 12]
    run = client.get_run(res.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["eval/missing/error"].startswith("step 12: DataError: /nonexistent/prompts.jsonl: no such file")
    markers = sorted((Path(res.run_dir) / "eval").glob("step-*.json"))
    assert [m.name for m in markers] == ["step-12.json", "step-4.json", "step-8.json"]
    for m in markers:
        record = json.loads(m.read_text())
        assert record["task_id"] and record["actor_id"] is None  # a Ray task, not a Train worker (an actor)
        assert set(record["scores"]) == {"eval/mc_eval/acc", "eval/mc_eval/acc_norm"} and "missing" in record["errors"]
    assert res.metrics["eval/mc_eval/acc"] == json.loads(markers[0].read_text())["scores"]["eval/mc_eval/acc"]
    # each step's scores, in MLflow and in its marker, are evaluate_task's on that step's own checkpoint
    from minimind_ray.evals.run import metric_items
    from minimind_ray.store.checkpoint import open_checkpoint

    by_step = {open_checkpoint(str(c)).meta().step: str(c) for c in Path(res.run_dir).glob("checkpoint_*") if c.is_dir()}
    assert sorted(by_step) == [4, 8, 12]
    task = EvalTaskConfig(task="mc", data="demo:mc_eval", limit=24)
    details = {}
    for step, ckpt in sorted(by_step.items()):
        result = evaluate_task(ckpt, task, cache_dir=str(shared["cache"]))
        details[step] = [d["logprobs"] for d in result["details"]]
        want = metric_items(result)
        assert json.loads((Path(res.run_dir) / "eval" / f"step-{step}.json").read_text())["scores"] == want, step
        for key, value in want.items():
            assert dict(loss_history(shared, res.mlflow_run_id, key))[step] == pytest.approx(value, abs=1e-12), key
    assert details[4] != details[8] != details[12]  # three different models: a score could tell them apart
    kwargs = dict(run_dir=res.run_dir, tracking_uri=shared["mlflow"], cache_dir=str(shared["cache"]), threads=1,
                  tasks=[{"task": "mc", "data": "demo:mc_eval", "limit": 24}], tracking_timeout_s=10.0)
    ckpt = Checkpoint.from_directory(res.checkpoint_dir)
    before = loss_history(shared, res.mlflow_run_id, "eval/mc_eval/acc")
    assert validate_checkpoint(ckpt, **kwargs) == json.loads(markers[0].read_text())["scores"]
    markers[0].unlink()
    validate_checkpoint(ckpt, **kwargs)  # scored again, but step 12 is in MLflow already: nothing is sent
    assert loss_history(shared, res.mlflow_run_id, "eval/mc_eval/acc") == before
