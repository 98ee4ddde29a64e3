"""Benchmark evaluation, measured (not a test): two tables, each side by side in one run.

1. Questions per second: this project's ``evaluate_task`` against lm-eval's own ``hf`` model on the same HF
   export (fp32) and the same files: a C-Eval-layout folder of made-up questions (letters scored, 0- and
   k-shot) and the demo's multiple-choice set (choice texts scored). The same batch size and torch threads on
   both sides; lm-eval through its Python API (``simple_evaluate``) with a local task YAML, timed around the
   call, data loading included on both sides. Both give the same choice for every question (checked here
   too; tests/integration/test_evals.py is the exact parity test).
2. Validation during training: the same training run without ``eval.tasks`` and with them (the demo's
   multiple-choice set on every checkpoint, in a Ray task beside the workers): mean step time from the run's
   MLflow history, and the evaluations' own time from their markers.
3. ``--gen``: a ``gen`` task's questions per second before and after the static KV cache (issue 35): the
   held-out sorting prompts (demo:sort_heldout) with greedy and sampled completions, on the demo model (16
   samples of 10 tokens, as bench_grpo.py scores it) and on minimind2-small (4 samples of 64 tokens); fresh
   weights, the demo tokenizer. "before" is the commit before issue 35 (``--before``), "after" this checkout, in
   alternating rounds (common.before_after), and whether both gave the same completions.

Usage:  .venv/bin/python bench/bench_eval.py [--preset minimind2-small] [--questions 200] [--shots 5]
                                             [--skip-validation] [--skip-qps]
        .venv/bin/python bench/bench_eval.py --gen [--rounds 2] [--before REV]
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common import before_after, curve, fresh_model, fresh_weights, table, timed, worker_main

# No minimind_ray import at the top: --gen's worker puts the tree it measures (--src) first on sys.path before it
# imports minimind_ray (common.worker_main); the rest import it in their functions, each saying so.

CEVAL_YAML = """task: bench_ceval
dataset_path: csv
dataset_kwargs:
  data_files: {{val: {val}, dev: {dev}}}
  cache_dir: {cache}
validation_split: val
fewshot_split: dev
fewshot_config:
  sampler: first_n
num_fewshot: {shots}
output_type: multiple_choice
description: "以下是中国关于会计的单项选择题，请选出其中的正确答案。\\n\\n"
doc_to_text: "{{{{question.strip()}}}}\\nA. {{{{A}}}}\\nB. {{{{B}}}}\\nC. {{{{C}}}}\\nD. {{{{D}}}}\\n答案："
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: "{{{{['A', 'B', 'C', 'D'].index(answer)}}}}"
metric_list: [{{metric: acc}}, {{metric: acc_norm}}]
"""
MC_YAML = """task: bench_mc
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


def ceval_files(root: Path, n: int, seed: int = 0) -> Path:
    """One subject ('accountant', described as 会计) of made-up questions with long-ish Chinese stems."""
    rng = random.Random(seed)
    header = ["id", "question", "A", "B", "C", "D", "answer"]
    for split, count in (("val", n), ("dev", 5)):
        d = root / split
        d.mkdir(parents=True, exist_ok=True)
        with open(d / f"accountant_{split}.csv", "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(header)
            for i in range(count):
                stem = "某公司" + "".join(rng.choice("年度收入成本利润资产负债计提折旧摊销税费") for _ in range(rng.randint(20, 60)))
                w.writerow([i, stem + "，下列说法正确的是？", *(f"选项{rng.randint(100, 999)}" for _ in "ABCD"),
                            "ABCD"[i % 4]])
    (root / "subject_mapping.json").write_text(json.dumps({"accountant": ["Accountant", "会计", "Other"]}))
    return root


def bench_qps(args, work: Path) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from minimind_ray.data.demo import resolve_demo_path  # lazy: no minimind_ray at the top (see there)
    from minimind_ray.evals.config import EvalTaskConfig  # lazy: the same
    from minimind_ray.evals.run import evaluate_task  # lazy: the same
    from minimind_ray.export import export_hf  # lazy: the same
    from minimind_ray.tokenizer import resolve_tokenizer  # lazy: the same

    tok = resolve_tokenizer("builtin", str(work / "cache"))
    export = export_hf(fresh_model(args.preset), tok.path, work / "hf", dtype=torch.float32)
    ceval = ceval_files(work / "ceval", args.questions)
    mc = resolve_demo_path("demo:mc_eval", "", str(work / "cache"))
    yaml_dir = work / "tasks"
    yaml_dir.mkdir(exist_ok=True)
    rows = []
    for label, task, data, shots in (("ceval 0-shot (letters)", "ceval", str(ceval), 0),
                                     (f"ceval {args.shots}-shot (letters)", "ceval", str(ceval), args.shots),
                                     ("demo mc (choice texts)", "mc", mc, 0)):
        ours_cfg = EvalTaskConfig(task=task, data=data, shots=shots, batch_size=args.batch_size)
        yaml_name = f"bench_{task}"  # CEVAL_YAML's task, or MC_YAML's
        (yaml_dir / f"{yaml_name}.yaml").write_text({"ceval": CEVAL_YAML, "mc": MC_YAML}[task].format(
            val=ceval / "val" / "accountant_val.csv", dev=ceval / "dev" / "accountant_dev.csv", shots=shots,
            data=mc, cache=work / "hf-datasets"))
        ours, t_ours = timed(evaluate_task, export, ours_cfg)
        theirs, t_theirs = timed(simple_evaluate, model="hf", model_args=f"pretrained={export},dtype=float32",
                                 tasks=[yaml_name], device="cpu", batch_size=args.batch_size,
                                 task_manager=TaskManager(include_path=str(yaml_dir)), log_samples=True)
        samples = sorted(theirs["samples"][yaml_name], key=lambda s: s["doc_id"])
        same = sum(int(d["pred"] == max(range(len(s["filtered_resps"])), key=lambda i: (float(s["filtered_resps"][i][0]), -i)))
                   for d, s in zip(ours["details"], samples))
        n = ours["n"]
        rows.append((label, n, n / t_ours, n / t_theirs, same))
    print(f"\n==== questions per second, {args.preset} (fp32, CPU, {torch.get_num_threads()} threads, batch "
          f"{args.batch_size}), the same HF export and files ====")
    table(("task", "n", "minimind-ray", "lm-eval hf", "ratio", "same choice"),
          [(label, n, f"{a:.1f}", f"{b:.1f}", f"{a / b:.2f}x", f"{same}/{n}") for label, n, a, b, same in rows])


def bench_validation(args, work: Path) -> None:
    from minimind_ray.config import load_config  # lazy: no minimind_ray at the top (see there)
    from minimind_ray.raytrain.driver import run  # lazy: the same

    common = ["train.max_steps=200", "checkpoint.interval=50", "train.log_interval=10", "train.eval_interval=0",
              "data.eval_fraction=0", f"data.cache_dir={work / 'cache'}", f"checkpoint.storage_path={work / 'runs'}",
              f"tracking.uri=sqlite:///{work / 'mlflow.db'}", "resume=never"]
    rows = []
    for label, extra in (("without eval.tasks", ["eval.tasks=[]"]),
                         ("with eval.tasks (mc, every 50 steps)", ["eval.interval=50",
                                                                    "eval.tasks=[{task: mc, data: 'demo:mc_eval'}]"])):
        cfg = load_config("pipelines/configs/demo_pretrain.yaml", common + extra)
        res, wall = timed(run, cfg)
        hist = curve(f"sqlite:///{work / 'mlflow.db'}", res.mlflow_run_id, ["perf/step_time_s"])["step_time_s"]
        steps = list(hist.values())[1:]  # the first interval holds the start
        evals = [json.loads(p.read_text())["seconds"] for p in sorted((Path(res.run_dir) / "eval").glob("*.json"))]
        rows.append((label, statistics.mean(steps), wall, evals))
    base = rows[0][1]
    print("\n==== validation during training: demo preset, 200 steps, 2 workers, checkpoint every 50 ====")
    table(("run", "step time (s)", "vs without", "wall (s)", "evaluations"),
          [(label, f"{step:.4f}", f"{step / base:.3f}x", f"{wall:.0f}",
            f"{len(evals)} x {statistics.mean(evals):.1f}s" if evals else "-") for label, step, wall, evals in rows])


GEN_CASES = {  # preset: (questions, samples, max_new_tokens, batch_size)
    "demo": (100, 16, 10, 25),
    "minimind2-small": (40, 4, 64, 10),
}


def gen_worker(args) -> dict:
    """In a fresh process with ``args.src`` first on sys.path: each case's questions/s and a digest of its
    completions."""
    import hashlib

    from minimind_ray.evals.config import EvalTaskConfig  # lazy: after --src is first on sys.path
    from minimind_ray.evals.run import evaluate_task  # lazy: the same

    setup = json.loads(Path(args.setup).read_text())
    out = {}
    for preset, (n, samples, max_new, batch) in GEN_CASES.items():
        task = EvalTaskConfig(task="gen", data=setup["data"], chat_template=True, samples=samples,
                              max_new_tokens=max_new, temperature=1.0, limit=n, batch_size=batch)
        cpu = time.process_time()
        res = evaluate_task(setup["weights"][preset], task, tokenizer=setup["tokenizer"], device="cpu",
                            cache_dir=setup["cache"])
        cpu = time.process_time() - cpu  # one torch thread: the work, which the machine's other load disturbs less
        digest = hashlib.sha256(json.dumps([(d["greedy"], d.get("samples")) for d in res["details"]]).encode())
        out[preset] = {"qps": res["n"] / cpu, "wall_qps": res["questions_per_s"], "n": res["n"],
                       "completions": digest.hexdigest()[:16]}
    return out


def bench_gen(args, work: Path) -> None:
    from minimind_ray.data.demo import resolve_demo_path  # lazy: no minimind_ray at the top (see there)
    from minimind_ray.tokenizer import resolve_tokenizer  # lazy: the same

    cache = work / "cache"
    tok = resolve_tokenizer("builtin", str(cache))
    weights = {preset: fresh_weights(preset, work) for preset in GEN_CASES}
    setup = work / "gen.json"
    setup.write_text(json.dumps({"data": resolve_demo_path("demo:sort_heldout", "", str(cache)), "weights": weights,
                                 "tokenizer": tok.path, "cache": str(cache)}))
    rev, best, loads = before_after(__file__, ["--setup", str(setup), "--threads", str(args.threads)], args.threads,
                                    args.rounds, args.before, score=lambda v: v["qps"],
                                    show=lambda v: f"{v['qps']:.2f} q/CPU s")
    print(f"\n`gen` task questions per CPU second (wall q/s in brackets), best of {args.rounds} rounds, {args.threads} "
          f"torch thread(s); before = {rev}, after = this checkout; load average (1 min) {loads}\n")
    rows = []
    for preset, (n, samples, max_new, _) in GEN_CASES.items():
        b, a = best["before"][preset], best["after"][preset]
        rows.append((preset, f"{a['n']} x (1 + {samples}) x {max_new}", f"{b['qps']:.2f} ({b['wall_qps']:.2f})",
                     f"{a['qps']:.2f} ({a['wall_qps']:.2f})", f"{a['qps'] / b['qps']:.2f}x",
                     "yes" if a["completions"] == b["completions"] else "NO"))
    table(("model", "questions x (1 greedy + samples) x tokens", "before q/CPU s (wall q/s)",
           "after q/CPU s (wall q/s)", "after / before", "same completions"), rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="minimind2-small")
    ap.add_argument("--questions", type=int, default=200)
    ap.add_argument("--shots", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--skip-qps", action="store_true")
    ap.add_argument("--skip-validation", action="store_true")
    ap.add_argument("--gen", action="store_true", help="only the gen task's questions/s, before and after")
    ap.add_argument("--rounds", type=int, default=2, help="--gen: rounds of each side")
    ap.add_argument("--threads", type=int, default=1, help="--gen: torch threads")
    ap.add_argument("--before", default=None, help="--gen: the commit to compare with (common.BASE_REV)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # --gen's worker (common.before_after)
    ap.add_argument("--src", help=argparse.SUPPRESS)
    ap.add_argument("--setup", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args, gen_worker)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
        work = Path(tmp)
        if args.gen:
            return bench_gen(args, work)
        if not args.skip_qps:
            bench_qps(args, work)
        if not args.skip_validation:
            bench_validation(args, work)


if __name__ == "__main__":
    main()
