"""The eval task registry (issue 33, item 5; docs/evaluation.md "Task kinds"): the six built-in kinds behind one
interface, a user's own kind named ``package.module:Class`` run by the verb, by the validation of checkpoints
and shipped to Ray workers by name, ``--log-samples`` records that are what the summary was computed from, the
subject-name rule of a C-Eval/CMMLU folder without subject_mapping.json, and the ``loss`` kind that the plain
``eval WEIGHTS`` still is. The tiny random model and tokenizers of tests/unit/test_evals.py and the checkpoint of
tests/unit/test_eval_checks.py; no Ray."""
from __future__ import annotations

import json
import math
import sys
import uuid

import pytest
import torch
import torch.nn.functional as F

from minimind_ray.config_checks import ConfigError
from minimind_ray.evals.config import EvalConfig, EvalTaskConfig, validate_task
from minimind_ray.evals.parallel import runtime_env
from minimind_ray.evals.registry import EvalTask, plugin_names, task_class, task_kinds
from minimind_ray.evals.run import aggregate_mc, evaluate_task, metric_items
from minimind_ray.evals.tasks import load_items
from minimind_ray.plugins import module_paths
from tests.unit.test_eval_checks import PREPARED, run_checkpoint  # noqa: F401  (a fixture)
from tests.unit.test_evals import TOKENIZER, model, tok, weights, write_csv  # noqa: F401  (fixtures)

USER_TASK = '''
import torch

from minimind_ray.evals.registry import EvalTask
from minimind_ray.evals.tasks import BadRows


class NextToken(EvalTask):
    """Each line's last token given the others: its log-likelihood, and whether it is the model's first choice."""

    def load_items(self, tokenizer):
        with open(self.cfg.data, encoding="utf-8") as f:
            lines = [line.strip() for line in f if line.strip()]
        return lines[:self.cfg.limit] if self.cfg.limit else lines, BadRows(self.cfg.bad_records)

    def encode(self, items, tokenizer):
        return [tokenizer.encode(text) for text in items]

    def length(self, ids):
        return len(ids)

    @torch.no_grad()
    def score(self, model, batch, batch_index, *, eos_id, pad_id, device, autocast=None):
        out = []
        for ids in batch:
            logp = torch.log_softmax(model(torch.tensor([ids[:-1]], device=device)).logits[0, -1].float(), dim=-1)
            out.append((float(logp[ids[-1]]), int(logp.argmax()) == ids[-1]))
        return out

    def summarise(self, items, results, tokenizer):
        return {"last_token_logprob": sum(lp for lp, _ in results) / len(results),
                "next_token_acc": sum(hit for _, hit in results) / len(results), "n": len(results),
                "details": [{"logprob": lp, "hit": hit} for lp, hit in results]}
'''
LINES = ["The capital of France is Paris", "Sort: 3 1 2 gives 1 2 3", "a b c d e f", "one two three four",
         "hello world hello world", "x y z"]


@pytest.fixture
def user_task(tmp_path, monkeypatch):
    """``<package>.tasks:NextToken`` in a package of a temporary folder on sys.path (a fresh name per test: Python
    keeps imported modules), and a text file for it."""
    package = f"user_evals_{uuid.uuid4().hex[:8]}"
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "tasks.py").write_text(USER_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "lines.txt"
    data.write_text("\n".join(LINES) + "\n")
    yield f"{package}.tasks:NextToken", str(data), tmp_path / package
    for name in [m for m in sys.modules if m.startswith(package)]:
        del sys.modules[name]


def last_token_logprobs(model, tok):
    out = []
    for text in LINES:
        ids = tok.encode(text)
        out.append(F.log_softmax(model(torch.tensor([ids[:-1]])).logits[0, -1].float(), dim=-1)[ids[-1]].item())
    return out


def test_the_registry_holds_the_six_kinds_and_the_verb_offers_them(capsys):
    from minimind_ray.cli import main

    assert task_kinds() == ["ceval", "cmmlu", "mc", "gen", "toolcall", "loss"]
    assert all(issubclass(task_class(k), EvalTask) for k in task_kinds())
    assert main(["eval", "--task", "list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == task_kinds() + ["yours"]
    with pytest.raises(SystemExit) as e:  # argparse: exit 2, the kinds named
        main(["eval", "w.pth", "--task", "arc"])
    assert e.value.code == 2
    assert "invalid choice: 'arc' (choose from ceval, cmmlu, mc, gen, toolcall, loss, list" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"^task: unknown task 'arc'; one of ceval, cmmlu, mc, gen, toolcall, loss"):
        validate_task(EvalTaskConfig(task="arc", data="x"))
    with pytest.raises(ConfigError, match=r"^task: cannot load eval task class 'no_such_pkg.x:Task': "
                                          r"ModuleNotFoundError"):
        validate_task(EvalTaskConfig(task="no_such_pkg.x:Task", data="x"))
    with pytest.raises(ConfigError, match=r"is a str, not a subclass of minimind_ray.evals.registry.EvalTask"):
        validate_task(EvalTaskConfig(task="minimind_ray.evals.mc:QUESTION", data="x"))
    # each kind's own checks, through the registry
    with pytest.raises(ConfigError, match=r"^fewshot_data: cmmlu takes its shots from the folder's dev split"):
        validate_task(EvalTaskConfig(task="cmmlu", data="x", fewshot_data="y"))
    with pytest.raises(ConfigError, match=r"^shots: toolcall prompts are conversations"):
        validate_task(EvalTaskConfig(task="toolcall", data="x", shots=1))
    validate_task(EvalTaskConfig(task="loss"))  # no data: the eval split of the weights' run


def test_a_user_task_class_runs_through_the_verb_and_its_score_is_reported(user_task, weights, model, tok, tmp_path,
                                                                           capsys):
    from minimind_ray.cli import main

    name, data, package_dir = user_task
    out = tmp_path / "next.json"
    assert main(["eval", weights, "--tokenizer", str(TOKENIZER), "--task", name, "--data", data, "--out", str(out),
                 "--log-samples"]) == 0
    res = json.loads(out.read_text())
    want = last_token_logprobs(model, tok)
    assert (res["task"], res["kind"], res["n"]) == ("lines", name, len(LINES))
    assert res["last_token_logprob"] == pytest.approx(sum(want) / len(want), abs=1e-5)
    assert f"last_token_logprob   {res['last_token_logprob']:.4f}" in capsys.readouterr().out
    assert metric_items(res) == {"eval/lines/last_token_logprob": res["last_token_logprob"],
                                 "eval/lines/next_token_acc": res["next_token_acc"]}
    records = [json.loads(line) for line in (tmp_path / "next.samples.jsonl").read_text().splitlines()]
    assert [(r["doc_id"], r["prompt"]) for r in records] == list(enumerate(LINES))
    assert [r["logprob"] for r in records] == pytest.approx(want, abs=1e-5)
    # the run ships the task's package to its Ray workers (tests/integration/test_eval_registry.py runs them)
    cfg = EvalConfig(tasks=[EvalTaskConfig(task="mc", data="demo:mc_eval"), EvalTaskConfig(task=name, data=data),
                            EvalTaskConfig(task=name, data=data, name="again")])
    assert plugin_names(cfg) == [name] and plugin_names(cfg.tasks) == [name]
    assert module_paths(plugin_names(cfg)) == [str(package_dir.resolve())]
    assert runtime_env(cfg.tasks[1])["py_modules"] == [str(package_dir.resolve())]  # eval --workers' own Ray
    assert "py_modules" not in runtime_env(cfg.tasks[0])


def test_the_validation_of_checkpoints_runs_a_user_kind_and_the_loss_through_the_registry(user_task, run_checkpoint):
    """raytrain/validation.py's run_tasks (what Ray Train's validation task calls) on a checkpoint, without Ray."""
    from minimind_ray.evals.loss import evaluate_weights
    from minimind_ray.raytrain.validation import run_tasks

    name, data, _ = user_task
    scores, errors = run_tasks(str(run_checkpoint), [EvalTaskConfig(task=name, data=data, name="nt"),
                                                     EvalTaskConfig(task="loss", data=str(PREPARED), limit=2)],
                               "data_cache", "cpu")
    assert not errors and set(scores) == {"eval/nt/last_token_logprob", "eval/nt/next_token_acc",
                                                 "eval/loss/loss", "eval/loss/ppl", "eval/loss/bpb"}
    assert scores["eval/nt/last_token_logprob"] < 0 and 0 <= scores["eval/nt/next_token_acc"] <= 1
    plain = evaluate_weights(str(run_checkpoint), data=str(PREPARED), micro_batch_size=16, batches=2)
    assert (scores["eval/loss/loss"], scores["eval/loss/ppl"], scores["eval/loss/bpb"]) == (
        plain["eval_loss"], plain["eval_ppl"], plain["eval_bpb"])


def test_log_samples_hold_the_prompt_each_choices_log_likelihood_the_pick_and_the_gold(weights, model, tok, tmp_path):
    from minimind_ray.cli import main

    rows = [{"question": "Sky?", "choices": ["blue", "green sea", "red"], "answer": 0},
            {"question": "Grass?", "choices": ["blue", "green"], "answer": "B"},
            {"question": "Snow?", "choices": ["white", "black", "a colour of its own", "grey"], "answer": 0,
             "subject": "s"}]
    mc = tmp_path / "quiz.jsonl"
    mc.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "quiz.json"
    assert main(["eval", weights, "--tokenizer", str(TOKENIZER), "--task", "mc", "--data", str(mc), "--shots", "1",
                 "--out", str(out), "--log-samples"]) == 0
    summary = json.loads(out.read_text())
    assert summary["samples_file"] == str(tmp_path / "quiz.samples.jsonl") and "details" not in summary
    records = [json.loads(line) for line in (tmp_path / "quiz.samples.jsonl").read_text().splitlines()]
    items, _ = load_items(EvalTaskConfig(task="mc", data=str(mc), shots=1), tok)
    assert [r["gold"] for r in records] == [0, 1, 0] and [r["subject"] for r in records] == ["quiz", "quiz", "s"]
    for r, it in zip(records, items):
        assert (r["prompt"], r["choices"], r["continuations"]) == (it.context, it.choices, it.continuations)
        assert r["pick"] == max(range(len(r["logprobs"])), key=lambda i: r["logprobs"][i])
        assert r["acc"] == float(r["pick"] == r["gold"])
        for cont, value in zip(it.continuations, r["logprobs"]):  # one full forward per choice, as lm-eval
            ctx, whole = tok.encode(it.context), tok.encode(it.context + cont)
            logp = F.log_softmax(model(torch.tensor([whole])).logits.float()[0, :-1], dim=-1)
            want = logp[torch.arange(len(ctx) - 1, len(whole) - 1), torch.tensor(whole[len(ctx):])].sum().item()
            assert value == pytest.approx(want, abs=1e-4)
    # the summary is the records' aggregate
    again = aggregate_mc(items, [r["logprobs"] for r in records])
    assert (summary["acc"], summary["acc_norm"], summary["n"]) == (again["acc"], again["acc_norm"], 3)
    assert [r["pick_norm"] for r in records] == [d["pred_norm"] for d in again["details"]]


def test_log_samples_of_a_gen_task_hold_the_completions_and_their_verdicts(weights, tmp_path):
    from minimind_ray.rl.rewards import is_correct

    data = tmp_path / "gen.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in (("Sort: 3 1 2", "1 2 3"),
                                                                                         ("abc", "d"))))
    res = evaluate_task(weights, EvalTaskConfig(task="gen", data=str(data), samples=3, max_new_tokens=6),
                        tokenizer=str(TOKENIZER), log_samples=True)
    records = res["samples_log"]
    assert [(r["doc_id"], r["prompt"], r["answer"]) for r in records] == [(0, "Sort: 3 1 2", "1 2 3"), (1, "abc", "d")]
    for r in records:
        assert len(r["samples"]) == 3 and r["sample_verdicts"] == [is_correct(s, r["answer"]) for s in r["samples"]]
        assert r["greedy_correct"] == is_correct(r["greedy"], r["answer"])
    assert res["greedy_acc"] == sum(r["greedy_correct"] for r in records) / 2
    assert res["pass@1"] == pytest.approx(sum(sum(r["sample_verdicts"]) / 3 for r in records) / 2)


def test_a_subject_without_subject_mapping_is_named_from_its_file_with_spaces(tmp_path, weights, tok):
    root = tmp_path / "ceval"
    write_csv(root / "val" / "poem_author_val.csv", [[0, "《静夜思》的作者是？", "李白", "杜甫", "王维", "白居易", "A"]])
    task = EvalTaskConfig(task="ceval", data=str(root))
    (item,), _ = load_items(task, tok)
    assert item.context.startswith("以下是中国关于poem author的单项选择题，请选出其中的正确答案。\n\n")
    res = evaluate_task(weights, task, tokenizer=str(TOKENIZER))
    assert res["subject_names"] == {"poem_author": "poem author"} and set(res["subjects"]) == {"poem_author"}
    assert res["description"] == (f"lm-eval's ceval-valid description; no subject_mapping.json in {root}: each subject "
                                  f"is named from its file name with '_' turned into a space (poem_author -> 'poem "
                                  f"author')")
    # a description of one's own names the subject the same way; subject_mapping.json, where there is one, wins
    (own,), _ = load_items(EvalTaskConfig(task="ceval", data=str(root), description="关于{subject}：\n"), tok)
    assert own.context.startswith("关于poem author：\n")
    (root / "subject_mapping.json").write_text(json.dumps({"poem_author": ["Poem Author", "诗词作者", "Humanities"]}))
    (mapped,), _ = load_items(task, tok)
    assert mapped.context.startswith("以下是中国关于诗词作者的单项选择题")
    res = evaluate_task(weights, task, tokenizer=str(TOKENIZER))
    assert res["subject_names"] == {"poem_author": "诗词作者"}
    assert res["description"].endswith(f"subjects named from {root / 'subject_mapping.json'}")


def test_the_plain_eval_verb_is_the_loss_kind_and_prints_what_it_printed(run_checkpoint, tmp_path, capsys):
    """``eval WEIGHTS --data DIR`` (no --task) and ``--task loss`` print evaluate_weights' JSON as before (with bits
    per byte since issue 36); a task YAML of kind loss gives the same numbers, and its MLflow metrics are
    eval/loss/loss, eval/loss/ppl and eval/loss/bpb."""
    from minimind_ray.cli import main
    from minimind_ray.evals.loss import evaluate_weights

    want = evaluate_weights(str(run_checkpoint), data=str(PREPARED), micro_batch_size=4, batches=3)
    assert set(want) == {"eval_loss", "eval_ppl", "eval_bpb", "eval_units"} and math.isfinite(want["eval_loss"])
    for task in ([], ["--task", "loss"]):
        assert main(["eval", str(run_checkpoint), *task, "--data", str(PREPARED), "--micro-batch-size", "4",
                     "--batches", "3"]) == 0
        assert capsys.readouterr().out == json.dumps(want, indent=1) + "\n"
    yaml = tmp_path / "loss.yaml"
    yaml.write_text(f"task: loss\ndata: {PREPARED}\nbatch_size: 4\nlimit: 3\n")
    out = tmp_path / "loss.json"
    assert main(["eval", str(run_checkpoint), "--config", str(yaml), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert {k: res[k] for k in want} == want and (res["task"], res["kind"]) == ("loss", "loss")
    assert metric_items(res) == {"eval/loss/loss": want["eval_loss"], "eval/loss/ppl": want["eval_ppl"],
                                 "eval/loss/bpb": want["eval_bpb"]}
    with pytest.raises(ValueError, match="--log-samples: the loss task has no per-question records"):
        main(["--debug", "eval", str(run_checkpoint), "--data", str(PREPARED), "--out", str(out), "--log-samples"])
