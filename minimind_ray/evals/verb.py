"""``minimind-ray eval``: benchmark scores of any weights, or their loss on a prepared split.

    minimind-ray eval WEIGHTS --task ceval --data ceval-exam/ [--shots 5] [--chat-template] [--limit N]
                              [--workers N] [--out result.json]
    minimind-ray eval WEIGHTS --task mc --data questions.jsonl        (choice texts scored)
    minimind-ray eval WEIGHTS --task gen --data prompts.jsonl --samples 16   (greedy acc, pass@1, pass@16)
    minimind-ray eval WEIGHTS --task toolcall --data tool_prompts.jsonl       (the tool called, its arguments valid)
    minimind-ray eval WEIGHTS --config task.yaml [flags override it]  (an EvalTaskConfig YAML)
    minimind-ray eval WEIGHTS [--data PREPARED_DIR]                   (loss and perplexity, as before)

WEIGHTS is a run directory, checkpoint, .pth, HF export folder or MLflow model URI (store/weights.py).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional

from minimind_ray.config_checks import int_at_least
from minimind_ray.evals.config import TASKS, EvalTaskConfig

# flag -> EvalTaskConfig field, for the flags that override a task YAML
_FLAGS = {"task": "task", "data": "data", "shots": "shots", "chat_template": "chat_template", "limit": "limit",
          "batch_size": "batch_size", "samples": "samples", "k": "k", "max_new_tokens": "max_new_tokens",
          "temperature": "temperature", "seed": "seed", "bad_records": "bad_records", "name": "name",
          "subjects": "subjects", "fewshot_data": "fewshot_data"}


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("weights_arg", nargs="?", metavar="WEIGHTS", help=".pth, checkpoint dir, run dir, HF folder or URI")
    sp.add_argument("--weights", help="the same as WEIGHTS (the older spelling)")
    sp.add_argument("--preset", help="model preset for a bare .pth (default: inferred from shapes)")
    sp.add_argument("--tokenizer", help="minimind2 | minimind3 | auto | builtin | a tokenizer dir (default: the run's)")
    sp.add_argument("--task", choices=("loss", *TASKS), default=None,
                    help="ceval | cmmlu | mc | gen | toolcall, or loss (the default without --config: loss and "
                         "perplexity)")
    sp.add_argument("--config", help="a task YAML (EvalTaskConfig fields; the flags below override it)")
    sp.add_argument("--data", help="the task's files (docs/evaluation.md); for loss: a prepared dir (default: the "
                                   "eval split of the run the weights come from)")
    sp.add_argument("--shots", type=int_at_least(0), help="k-shot from the dev split")
    sp.add_argument("--chat-template", dest="chat_template", action=argparse.BooleanOptionalAction, default=None,
                    help="render prompts with the chat template (lm-eval's --apply_chat_template)")
    sp.add_argument("--limit", type=int_at_least(1), help="at most N questions per subject (ceval/cmmlu) or per file")
    sp.add_argument("--subjects", nargs="+", help="ceval/cmmlu: only these subjects")
    sp.add_argument("--fewshot-data", dest="fewshot_data", help="mc/gen: the jsonl the shots come from")
    sp.add_argument("--name", help="the name the scores are reported under")
    sp.add_argument("--batch-size", dest="batch_size", type=int_at_least(1), help="questions per forward pass")
    sp.add_argument("--samples", type=int_at_least(0), help="gen: sampled completions per prompt (pass@1, pass@k)")
    sp.add_argument("--k", type=int_at_least(1), help="gen: the k of pass@k (default: --samples)")
    sp.add_argument("--max-new-tokens", dest="max_new_tokens", type=int_at_least(1), help="gen: most new tokens per completion")
    sp.add_argument("--temperature", type=float, help="gen: sampling temperature")
    sp.add_argument("--seed", type=int_at_least(0), help="gen: sampling seed")
    sp.add_argument("--bad-records", dest="bad_records", choices=("skip", "strict"), help="skip (count) or strict")
    sp.add_argument("--workers", type=int_at_least(0), default=0,
                    help="shard the questions over N Ray tasks (0 = this process)")
    sp.add_argument("--out", help="write the result as JSON here")
    sp.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    sp.add_argument("--batches", type=int_at_least(0), default=0, help="loss: micro-batches to use (0 = all)")
    sp.add_argument("--micro-batch-size", dest="micro_batch_size", type=int_at_least(1), default=8,
                    help="loss: micro-batch size")


def task_from_args(args) -> EvalTaskConfig:
    """The task of ``--config`` (errors name file:line) with the given flags on top, validated."""
    from omegaconf import OmegaConf

    from minimind_ray.config_checks import ConfigError, read_yaml
    from minimind_ray.evals.config import validate_task

    schema = OmegaConf.structured(EvalTaskConfig)
    layers = [schema]
    if args.config:
        layers.append(read_yaml(args.config, schema))
    given = {f: getattr(args, a) for a, f in _FLAGS.items() if getattr(args, a, None) is not None}
    try:
        task = OmegaConf.to_object(OmegaConf.merge(*layers, given))
    except Exception as e:  # a flag of the wrong type for its field
        raise ConfigError(str(e).splitlines()[0]) from None
    validate_task(task)
    return task


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"


def format_table(res: dict) -> str:
    """The result as a plain table: one row per subject, then the whole task."""
    if res["kind"] == "toolcall":
        cols = ("acc", "name_acc", "args_valid", "args_match", "call_rate")
        rows = [(s, r) for s, r in res["subjects"].items()] if len(res["subjects"]) > 1 else []
        rows.append((f"all ({res['task']})", res))
        lines = [f"{'subject':<28} {'n':>6} " + " ".join(f"{c:>10}" for c in cols)]
        lines += [f"{name:<28} {r['n']:>6} " + " ".join(f"{_fmt(r.get(c)):>10}" for c in cols) for name, r in rows]
        if res.get("pass@1") is not None:
            lines.append(f"sampled: pass@1 {_fmt(res['pass@1'])}  pass@{res['k']} {_fmt(res['pass@k'])}")
    elif res["kind"] == "gen":
        cols = "greedy_acc pass@1 pass@k".split()
        rows = [(s, r["n"], [r.get(c) for c in cols]) for s, r in res["subjects"].items()] if len(
            res["subjects"]) > 1 else []
        rows.append((f"all ({res['task']})", res["n"], [res.get(c) for c in cols]))
        head = f"{'subject':<28} {'n':>6} {'greedy_acc':>10} {'pass@1':>8} {'pass@' + str(res.get('k', 'k')):>8}"
        lines = [head] + [f"{name:<28} {n:>6} {_fmt(v[0]):>10} {_fmt(v[1]):>8} {_fmt(v[2]):>8}" for name, n, v in rows]
    else:
        head = f"{'subject':<40} {'n':>6} {'acc':>8} {'acc_norm':>8}"
        lines = [head] + [f"{s:<40} {r['n']:>6} {_fmt(r['acc']):>8} {_fmt(r['acc_norm']):>8}"
                          for s, r in res["subjects"].items()]
        lines.append(f"{'all (' + res['task'] + ')':<40} {res['n']:>6} {_fmt(res['acc']):>8} "
                     f"{_fmt(res['acc_norm']):>8}   stderr {_fmt(res['acc_stderr'])}")
    if res.get("bad_records"):
        lines.append(f"bad rows skipped: {res['bad_records']}  e.g. {next(iter(res['bad_samples'].values()))[0]}")
    if res.get("questions_per_s"):
        lines.append(f"{res['n']} questions in {res['seconds']:.1f}s ({res['questions_per_s']:.1f}/s)")
    return "\n".join(lines)


def run_from_args(args) -> int:
    weights = args.weights_arg or args.weights
    if not weights:
        raise ValueError("eval: which weights? give WEIGHTS (a run dir, checkpoint, .pth, HF folder or URI)")
    if (args.task in (None, "loss")) and not args.config:
        from minimind_ray.evaluate import evaluate_weights

        res = evaluate_weights(weights, data=args.data, preset=args.preset, batches=args.batches,
                               micro_batch_size=args.micro_batch_size, tokenizer=args.tokenizer)
        print(json.dumps(res, indent=1))
        return 0
    from minimind_ray.evals.run import evaluate_task

    from minimind_ray.store.weights import rope_scaling_spec

    task = task_from_args(args)
    rope = rope_scaling_spec(getattr(args, "rope_scaling", None), getattr(args, "factor", None),
                             getattr(args, "original_max_position_embeddings", None))  # cli.add_rope_scaling_arguments
    res = evaluate_task(weights, task, preset=args.preset, tokenizer=args.tokenizer, device=args.device,
                        workers=args.workers, rope_scaling=rope)
    print(format_table(res))
    if args.out:
        from minimind_ray.fsio import write_text_atomic

        brief = {k: v for k, v in res.items() if k != "details"}
        write_text_atomic(args.out, json.dumps(brief, indent=1, ensure_ascii=False))
        print(f"written: {args.out}", file=sys.stderr)
    return 0
