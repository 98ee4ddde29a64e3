"""Benchmark evaluation without Ray (minimind_ray/evals, docs/evaluation.md): the files read in their own layouts,
prompts built as lm-eval builds them, bad rows counted or named, the batched shared-prefix log-likelihoods against
one full forward per choice, the aggregates and pass@k by hand, batched greedy generation against `generate`, and
a random-init model near chance. A tiny random model and the 300-token tokenizer of tests/fixtures; no training."""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minimind_ray.config import ModelConfig
from minimind_ray.data.manifest import DataError
from minimind_ray.evals.config import EvalTaskConfig
from minimind_ray.evals.run import aggregate_mc, evaluate_task, pass_at_k
from minimind_ray.evals.scoring import choice_logprobs, encode_question, generate_batch
from minimind_ray.evals.tasks import load_items
from minimind_ray.model.minimind import build_model
from minimind_ray.model.presets import preset_values
from minimind_ray.tokenizer import load_tokenizer

TOKENIZER = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_v1" / "tokenizer"
HEADER = ["id", "question", "A", "B", "C", "D", "answer"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(TOKENIZER))


@pytest.fixture(scope="module")
def model():
    """The tiny preset sized to the fixture tokenizer's 300 ids, so every id it samples decodes to text."""
    return build_model(ModelConfig(**{**preset_values("tiny"), "vocab_size": 300}), seed=5).eval()


@pytest.fixture(scope="module")
def weights(tmp_path_factory, model):
    """The model as an HF export folder (fp32): it records its config and carries the tokenizer."""
    from minimind_ray.export import export_hf

    return export_hf(model, TOKENIZER, tmp_path_factory.mktemp("evals") / "hf", dtype=torch.float32)


def write_csv(path: Path, rows, header=HEADER):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def ceval_folder(root: Path, n: int = 40, seed: int = 0, explanation: bool = True) -> Path:
    """A C-Eval-layout folder of made-up questions: two subjects, answers spread evenly over A-D; the dev split
    with C-Eval's extra explanation column unless told otherwise."""
    rng = random.Random(seed)
    for subject in ("accountant", "physician"):
        rows = [[i, f"题目{i}：{rng.randint(10, 99)}加{rng.randint(10, 99)}是多少？",
                 *(str(rng.randint(10, 200)) for _ in "ABCD"), "ABCD"[i % 4]] for i in range(n)]
        write_csv(root / "val" / f"{subject}_val.csv", rows)
        if explanation:
            write_csv(root / "dev" / f"{subject}_dev.csv", [r + ["解析"] for r in rows[:5]], HEADER + ["explanation"])
        else:
            write_csv(root / "dev" / f"{subject}_dev.csv", rows[:5])
    (root / "subject_mapping.json").write_text(json.dumps({"accountant": ["Accountant", "注册会计师", "Other"],
                                                           "physician": ["Physician", "医师资格", "Other"]}))
    return root


def test_ceval_prompts_are_lm_evals_text_with_shots_and_letters(tmp_path, tok):
    root = ceval_folder(tmp_path / "ceval", n=3)
    items, bad = load_items(EvalTaskConfig(task="ceval", data=str(root), shots=1, subjects=["accountant"]), tok)
    assert len(items) == 3 and not bad.report()
    with open(root / "val" / "accountant_val.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    with open(root / "dev" / "accountant_dev.csv", encoding="utf-8") as f:
        shot = next(csv.DictReader(f))

    def text(r):
        return f"{r['question']}\nA. {r['A']}\nB. {r['B']}\nC. {r['C']}\nD. {r['D']}\n答案："

    expected = "以下是中国关于注册会计师的单项选择题，请选出其中的正确答案。\n\n" + text(shot) + " " + shot["answer"] + "\n\n" + \
        text(rows[1])
    assert items[1].context == expected
    assert items[1].continuations == [" A", " B", " C", " D"] and items[1].gold == "ABCD".index(rows[1]["answer"])
    assert items[1].where == f"{root / 'val' / 'accountant_val.csv'}:3"
    # the chat template: the description is the system turn, shots and question one user turn, no delimiter
    chat, _ = load_items(EvalTaskConfig(task="ceval", data=str(root), shots=1, subjects=["accountant"],
                                        chat_template=True), tok)
    assert chat[1].context == tok.apply_chat_template(
        [{"role": "system", "content": "以下是中国关于注册会计师的单项选择题，请选出其中的正确答案。\n\n"},
         {"role": "user", "content": text(shot) + " " + shot["answer"] + "\n\n" + text(rows[1])}],
        add_generation_prompt=True)
    assert chat[1].continuations == ["A", "B", "C", "D"]


def test_cmmlu_layout_and_mc_jsonl_with_letters_or_indices(tmp_path, tok):
    write_csv(tmp_path / "cmmlu" / "test" / "agronomy.csv", [[0, "问题？", "甲", "乙", "丙", "丁", "C"]],
              ["", "Question", "A", "B", "C", "D", "Answer"])
    (items, _) = load_items(EvalTaskConfig(task="cmmlu", data=str(tmp_path / "cmmlu")), tok)
    assert items[0].context == "以下是关于agronomy的单项选择题，请直接给出正确答案的选项。\n\n问题？\nA. 甲\nB. 乙\nC. 丙\nD. 丁\n答案："
    assert items[0].gold == 2
    mc = tmp_path / "mc.jsonl"
    mc.write_text("\n".join(json.dumps(r) for r in (
        {"question": "Sky?", "choices": ["blue", "green", "red"], "answer": 0},
        {"question": "Grass?", "choices": ["blue", "green"], "answer": "B"})) + "\n")
    items, _ = load_items(EvalTaskConfig(task="mc", data=str(mc), shots=1), tok)
    assert [it.gold for it in items] == [0, 1]
    # one shot from the same file, never the question itself (lm-eval's rule when shots and questions share a split)
    assert items[0].context == "Question: Grass?\nAnswer: green\n\nQuestion: Sky?\nAnswer:"
    assert items[1].context == "Question: Sky?\nAnswer: blue\n\nQuestion: Grass?\nAnswer:"
    assert items[0].continuations == [" blue", " green", " red"] and items[0].choices == ["blue", "green", "red"]


def test_bad_rows_are_counted_with_file_and_line_or_named_in_strict_mode(tmp_path, tok):
    path = tmp_path / "bad" / "val" / "law_val.csv"
    write_csv(path, [[0, "好问题", "1", "2", "3", "4", "A"],
                     [1, "缺选项", "1", "", "3", "4", "A"],
                     [2, "答案错", "1", "2", "3", "4", "E"],
                     [3, "多一列", "1", "2", "3", "4", "A", "extra"],
                     [4, "", "1", "2", "3", "4", "B"]])
    items, bad = load_items(EvalTaskConfig(task="ceval", data=str(tmp_path / "bad")), tok)
    assert len(items) == 1
    assert bad.report() == {"bad_answer": 1, "bad_row": 1, "missing_choice": 1, "missing_field": 1}
    assert bad.samples["missing_choice"] == [f"{path}:3: field 'B' (a choice) is empty"]
    assert bad.samples["bad_answer"][0].startswith(f"{path}:4: field 'answer' is 'E'")
    with pytest.raises(DataError, match=rf"^{path}:3: field 'B' \(a choice\) is empty \(missing_choice"):
        load_items(EvalTaskConfig(task="ceval", data=str(tmp_path / "bad"), bad_records="strict"), tok)
    mc = tmp_path / "bad.jsonl"
    mc.write_text('{"question": "q", "choices": ["a", "b"], "answer": 2}\nnot json\n'
                  '{"question": "q", "choices": ["a"], "answer": 0}\n{"question": "\\ud800", "choices": ["a", "b"], '
                  '"answer": 1}\n{"choices": ["a", "b"], "answer": 1}\n')
    items, bad = load_items(EvalTaskConfig(task="mc", data=str(mc)), tok)
    assert not items
    assert bad.report() == {"bad_answer": 1, "bad_json": 1, "bad_text": 1, "missing_choice": 1, "missing_field": 1}
    assert bad.samples["bad_json"][0].startswith(f"{mc}:2: ")
    with pytest.raises(DataError, match=rf"^{mc}:1: field 'answer' 2 is not among the 2 choices"):
        load_items(EvalTaskConfig(task="mc", data=str(mc), bad_records="strict"), tok)


def test_shared_prefix_log_likelihoods_equal_one_full_forward_per_choice(model, tok):
    """The batched cache-and-continue computation against the plain one: ctx + continuation in one forward,
    log_softmax, the continuation's tokens summed; contexts of different lengths (left padding) and choices
    of different lengths (right padding), and lm-eval's split of trailing whitespace."""
    questions = [("The capital of France is", [" Paris.", " a very long answer of many words", " Rome"]),
                 ("Q: what?\nA:", [" x", " yy"]), ("Sort: 3 1 2 ", ["1 2 3", "3 2 1", "2", "1 1 1 1"])]
    batch = [encode_question(tok, c, conts) for c, conts in questions]
    got = choice_logprobs(model, batch, pad_id=tok.pad_id)
    for (ctx, conts), row in zip(batch, got):
        for cont, value in zip(conts, row):
            ids = torch.tensor([ctx + cont])
            logp = F.log_softmax(model(ids).logits.float()[0, :-1], dim=-1)
            want = logp[torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1), torch.tensor(cont)].sum().item()
            assert value == pytest.approx(want, abs=1e-4)
    # the whitespace rule: the context's trailing space went to the continuation
    assert batch[2][1][0] == tok.encode("Sort: 3 1 2 1 2 3")[len(tok.encode("Sort: 3 1 2")):]


def test_aggregates_and_pass_at_k_by_hand():
    from minimind_ray.evals.tasks import MCItem

    items = [MCItem("a", "", [" x", " yyy"], ["x", "yyy"], 1, "f:1"), MCItem("a", "", [" x", " yyy"], ["x", "yyy"], 0,
                                                                             "f:2"),
             MCItem("b", "", [" x", " yyy"], ["x", "yyy"], 1, "f:3")]
    # q1: -2 vs -3 -> acc picks x (wrong), per character yyy (-3/3 = -1 > -2/1): right; q2: x both ways (-1 vs
    # -5/3); q3: yyy both ways
    res = aggregate_mc(items, [[-2.0, -3.0], [-1.0, -5.0], [-4.0, -3.0]])
    assert (res["acc"], res["acc_norm"], res["n"]) == (pytest.approx(2 / 3), 1.0, 3)
    assert res["subjects"] == {"a": {"acc": 0.5, "acc_norm": 1.0, "n": 2}, "b": {"acc": 1.0, "acc_norm": 1.0, "n": 1}}
    assert [d["pred"] for d in res["details"]] == [0, 0, 1] and [d["pred_norm"] for d in res["details"]] == [1, 0, 1]
    assert res["acc_stderr"] == pytest.approx(math.sqrt((2 * (1 / 3) ** 2 + (2 / 3) ** 2) / 2 / 3))
    assert pass_at_k(10, 0, 1) == 0.0 and pass_at_k(10, 10, 5) == 1.0 and pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - (3 * 2 / 2) / (4 * 3 / 2))  # 1 - C(3,2)/C(4,2) = 0.5


def test_batched_greedy_completions_equal_generate(model, tok):
    from minimind_ray.generate import generate_tokens

    prompts = [tok.encode(t) for t in ("The capital of", "Sort: 9 8 7 6 5 4", "a")]
    greedy, sampled = generate_batch(model, prompts, max_new_tokens=12, samples=3, temperature=1.0, top_p=1.0,
                                     top_k=0, eos_id=tok.eos_id, pad_id=tok.pad_id, seed=7)
    for p, g in zip(prompts, greedy):
        solo = list(generate_tokens(model, torch.tensor([p]), 12, temperature=0, eos_token_id=tok.eos_id))
        assert g == [t for t in solo if t != tok.eos_id]
    assert len(sampled) == 3 and all(len(s) == 3 for s in sampled)
    again = generate_batch(model, prompts, max_new_tokens=12, samples=3, temperature=1.0, top_p=1.0, top_k=0,
                           eos_id=tok.eos_id, pad_id=tok.pad_id, seed=7)[1]
    assert again == sampled  # the batch's own generator: the same seed, the same samples


def test_a_random_init_model_scores_near_chance_on_a_ceval_folder(tmp_path, weights, capsys):
    from minimind_ray.cli import main

    root = ceval_folder(tmp_path / "ceval", n=80)
    out = tmp_path / "result.json"
    assert main(["eval", weights, "--tokenizer", str(TOKENIZER), "--task", "ceval", "--data", str(root), "--shots",
                 "1", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert set(res) >= {"task", "acc", "acc_norm", "acc_stderr", "n", "subjects", "bad_records"}
    assert res["n"] == 160 and set(res["subjects"]) == {"accountant", "physician"}
    assert abs(res["acc"] - 0.25) < 3 * res["acc_stderr"], res  # four letters: chance is 1/4
    assert res["acc"] == res["acc_norm"]  # one-character choices: the normalisation changes nothing
    for s in ("accountant", "physician"):
        assert f"{s:<40} {80:>6} {res['subjects'][s]['acc']:>8.4f}" in table
    assert f"all (ceval)" in table


def test_a_gen_task_scores_exact_answers(tmp_path, weights, model, tok):
    """A prompt whose answer is the model's own greedy completion is right; one with another answer is wrong."""
    prompts = ["Sort: 3 1 2", "The capital of", "abc"]
    greedy, _ = generate_batch(model, [tok.encode(p) for p in prompts], max_new_tokens=8, samples=0, temperature=1,
                               top_p=1, top_k=0, eos_id=tok.eos_id, pad_id=tok.pad_id, seed=0)
    texts = [tok.decode(g, skip_special_tokens=True) for g in greedy]
    data = tmp_path / "gen.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n"
                            for p, a in zip(prompts, [texts[0], texts[1], texts[2] + " and more"])))
    res = evaluate_task(weights, EvalTaskConfig(task="gen", data=str(data), max_new_tokens=8, samples=4),
                        tokenizer=str(TOKENIZER))
    assert [d["greedy_correct"] for d in res["details"]] == [True, True, False]
    assert res["greedy_acc"] == pytest.approx(2 / 3) and res["k"] == 4 and 0 <= res["pass@1"] <= res["pass@k"] <= 1


def test_a_shared_few_shot_prefix_is_computed_once_and_scores_as_the_plain_batch(model, tok, monkeypatch):
    """Contexts that share a long prefix (k shots) take the few-shot path: the same log-likelihoods as one full
    forward per choice, and the prefix's tokens go through the model once, not once per question."""
    from minimind_ray.evals import scoring

    shots = "".join(f"Question: {i} plus {i}?\nAnswer: {2 * i}\n\n" for i in range(12))
    questions = [(shots + f"Question: {q}?\nAnswer:", [" yes", " no", " maybe not"]) for q in ("sky", "sea", "a b c")]
    batch = [encode_question(tok, c, conts) for c, conts in questions]
    assert len(scoring.common_prefix([c for c, _ in batch])) >= scoring.SHARED_PREFIX_MIN
    seen = []
    forward = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda self, ids, *a, **k: seen.append(ids.numel()) or forward(
        self, ids, *a, **k))
    got = choice_logprobs(model, batch, pad_id=tok.pad_id)
    monkeypatch.undo()
    assert sum(seen) < sum(len(c) for c, _ in batch)  # fewer tokens than the contexts hold, choices included
    for (ctx, conts), row in zip(batch, got):
        for cont, value in zip(conts, row):
            logp = F.log_softmax(model(torch.tensor([ctx + cont])).logits.float()[0, :-1], dim=-1)
            want = logp[torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1), torch.tensor(cont)].sum().item()
            assert value == pytest.approx(want, abs=1e-4)


def test_shots_skip_a_subject_without_dev_rows_and_name_one_with_fewer(tmp_path, weights, tok, capsys):
    """Issue 47: `eval --shots N` over a folder where one subject has no dev file and one has no usable dev row skips
    those two (the printed table and --out's JSON say so), and a subject with fewer than N usable dev rows is scored
    with the rows it has, said for that subject; before, the first of them refused the whole evaluation."""
    from minimind_ray.cli import main

    root = ceval_folder(tmp_path / "ceval", n=8)  # accountant, physician: 5 dev rows each
    (root / "dev" / "physician_dev.csv").unlink()
    write_csv(root / "val" / "law_val.csv", [[i, f"法{i}", "1", "2", "3", "4", "ABCD"[i % 4]] for i in range(6)])
    write_csv(root / "dev" / "law_dev.csv", [[0, "法例", "1", "2", "3", "4", "B"], [1, "坏", "1", "2", "3", "4", "Z"],
                                            [2, "法例二", "1", "2", "3", "4", "C"]])  # 2 usable rows of 3
    write_csv(root / "val" / "tax_val.csv", [[0, "税", "1", "2", "3", "4", "A"]])
    write_csv(root / "dev" / "tax_dev.csv", [[0, "", "1", "2", "3", "4", "A"]])  # no usable row
    out = tmp_path / "result.json"
    assert main(["eval", weights, "--tokenizer", str(TOKENIZER), "--task", "ceval", "--data", str(root), "--shots",
                 "3", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert set(res["subjects"]) == {"accountant", "law"} and res["n"] == 8 + 6
    assert res["skipped_subjects"] == {
        "physician": f"{root / 'dev' / 'physician_dev.csv'}: no such file (3 shots come from the dev split)",
        "tax": f"{root / 'dev' / 'tax_dev.csv'}: no usable dev row (3 shots come from the dev split)"}
    assert res["short_shots"] == {"law": {"asked": 3, "used": 2, "file": str(root / "dev" / "law_dev.csv")}}
    assert "skipped physician: " in table and "skipped tax: " in table
    assert f"law: 2 of 3 shots (all that {root / 'dev' / 'law_dev.csv'} has)" in table
    from minimind_ray.evals.run import result_notes  # what the pipeline's eval stage tags its MLflow run with

    assert result_notes(res) == {"eval/ceval/skipped_subjects": "physician, tax", "eval/ceval/short_shots": "law 2 of 3"}
    items, _ = load_items(EvalTaskConfig(task="ceval", data=str(root), shots=3, subjects=["law"]), tok)
    assert items[0].context.count("答案：") == 3  # two shots and the question
    # every subject without shots: nothing to evaluate is an error naming them
    with pytest.raises(DataError, match=r"no subject has dev rows for 3 shots: physician \(.*\), tax \(.*\)"):
        load_items(EvalTaskConfig(task="ceval", data=str(root), shots=3, subjects=["physician", "tax"]), tok)


def test_mc_shots_beyond_the_pool_use_what_there_is_and_say_so(tmp_path, tok):
    from minimind_ray.evals.eval_verb import format_table

    mc = tmp_path / "arc.jsonl"
    mc.write_text("".join(json.dumps({"question": f"Q{i}?", "choices": ["a", "b"], "answer": i % 2}) + "\n"
                          for i in range(3)))
    items, bad = load_items(EvalTaskConfig(task="mc", data=str(mc), shots=5), tok)
    assert len(items) == 3 and [it.context.count("Answer:") for it in items] == [3, 3, 3]  # 2 shots each
    assert bad.shot_report() == {"short_shots": {"arc": {"asked": 5, "used": 2, "file": str(mc)}}}
    res = {"task": "arc", "kind": "mc", "acc": 0.5, "acc_norm": 0.5, "acc_stderr": 0.1, "n": 3,
           "subjects": {"arc": {"acc": 0.5, "acc_norm": 0.5, "n": 3}}, "short_shots": bad.shot_report()["short_shots"],
           "config": dataclasses.asdict(EvalTaskConfig(task="mc", data=str(mc), shots=5))}
    assert f"arc: 2 of 5 shots (all that {mc} has)" in format_table(res)
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"question": "Q?", "choices": ["a", "b"], "answer": 0}) + "\n")
    with pytest.raises(DataError, match=rf"^{one}: 1 shots asked, no usable record to take them from"):
        load_items(EvalTaskConfig(task="mc", data=str(one), shots=1), tok)
