"""``minimind-ray eval``: benchmark scores of any weights, or their loss on a prepared split.

    minimind-ray eval WEIGHTS --task ceval --data ceval-exam/ [--shots 5] [--chat-template] [--limit N]
                              [--workers N] [--out result.json]
    minimind-ray eval WEIGHTS --task mc --data questions.jsonl        (choice texts scored)
    minimind-ray eval WEIGHTS --task gen --data prompts.jsonl --samples 16   (greedy acc, pass@1, pass@16)
    minimind-ray eval WEIGHTS --task toolcall --data tool_prompts.jsonl       (the tool called, its arguments valid)
    minimind-ray eval WEIGHTS --task mypkg.tasks:MyTask --data ...   (your own kind: an EvalTask subclass)
    minimind-ray eval WEIGHTS --config task.yaml [flags override it]  (an EvalTaskConfig YAML)
    minimind-ray eval WEIGHTS [--data PREPARED_DIR]                   (--task loss: loss and perplexity, as before)
    minimind-ray eval --task list                                     (the kinds of the registry)

WEIGHTS is a run directory, checkpoint, .pth, HF export folder or MLflow model URI (store/weights.py).
--out FILE.json --log-samples also writes FILE.samples.jsonl: one record per question (lm-eval's --log_samples).
"""
from __future__ import annotations

import argparse
import json
import sys

from minimind_ray.config_checks import ConfigError, int_at_least, read_yaml
from minimind_ray.evals.config import EvalTaskConfig, validate_task
from minimind_ray.evals.registry import summary_line, task_for, task_kinds
from minimind_ray.generate_verb import add_rope_scaling_arguments, rope_scaling_of

HELP = ("benchmark scores (ceval, cmmlu, mc, gen, toolcall, your own task class) or the loss of any weights "
        "(docs/evaluation.md)")

# flag -> EvalTaskConfig field, for the flags that override a task YAML
_FLAGS = {"task": "task", "data": "data", "shots": "shots", "chat_template": "chat_template", "limit": "limit",
          "batch_size": "batch_size", "samples": "samples", "k": "k", "max_new_tokens": "max_new_tokens",
          "temperature": "temperature", "seed": "seed", "bad_records": "bad_records", "name": "name",
          "subjects": "subjects", "fewshot_data": "fewshot_data"}


def task_kind(text: str) -> str:
    """An argparse type: a kind of the registry, 'list', or a user's 'package.module:Class' (loaded later, when
    the task is checked, so that a wrong one is named with its import error)."""
    if text in task_kinds() or text == "list" or ":" in text:
        return text
    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(task_kinds())}, list, or "
                                     f"your own package.module:Class)")


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.description = __doc__  # the usage lines above, laid out as written
    sp.formatter_class = argparse.RawDescriptionHelpFormatter
    sp.add_argument("weights_arg", nargs="?", metavar="WEIGHTS", help=".pth, checkpoint dir, run dir, HF folder or URI")
    sp.add_argument("--weights", help="the same as WEIGHTS (the older spelling)")
    sp.add_argument("--preset", help="model preset for a bare .pth (default: inferred from shapes)")
    sp.add_argument("--tokenizer", help="minimind2 | minimind3 | auto | builtin | a tokenizer dir (default: the run's)")
    sp.add_argument("--task", type=task_kind, default=None, metavar="{" + ",".join(task_kinds()) + "}|MODULE:CLASS",
                    help=f"a kind of the registry (evals/registry.py): {' | '.join(task_kinds())} (loss, the default "
                         f"without --config: loss and perplexity); or your own 'package.module:Class' (a subclass of "
                         f"minimind_ray.evals.registry.EvalTask); 'list' prints the kinds")
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
    sp.add_argument("--log-samples", dest="log_samples", action="store_true",
                    help="with --out FILE.json, also FILE.samples.jsonl: per question the prompt, each choice's "
                         "log-likelihood, the pick and the gold (gen: the completions and their verdicts)")
    sp.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    sp.add_argument("--batches", type=int_at_least(0), default=0, help="loss: micro-batches to use (0 = all)")
    sp.add_argument("--micro-batch-size", dest="micro_batch_size", type=int_at_least(1), default=8,
                    help="loss: micro-batch size")
    add_rope_scaling_arguments(sp)


def task_from_args(args) -> EvalTaskConfig:
    """The task of ``--config`` (errors name file:line) with the given flags on top, validated."""
    from omegaconf import OmegaConf

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


def format_table(res: dict) -> str:
    """The result as its kind prints it (for the benchmarks: one row per subject, then the whole task), with the
    subjects skipped for want of shots, those given fewer, the bad rows skipped and the pace."""
    lines = [task_for(EvalTaskConfig(**res["config"])).table(res)]
    for subject, why in res.get("skipped_subjects", {}).items():
        lines.append(f"skipped {subject}: {why}")
    for subject, s in res.get("short_shots", {}).items():
        lines.append(f"{subject}: {s['used']} of {s['asked']} shots (all that {s['file']} has)")
    if res.get("bad_records"):
        lines.append(f"bad rows skipped: {res['bad_records']}  e.g. {next(iter(res['bad_samples'].values()))[0]}")
    if res.get("questions_per_s"):
        lines.append(f"{res['n']} questions in {res['seconds']:.1f}s ({res['questions_per_s']:.1f}/s)")
    return "\n".join(lines)


def loss_task(args) -> EvalTaskConfig:
    """``eval WEIGHTS [--data DIR]`` without --config: the loss task with the verb's own flags, as before."""
    task = EvalTaskConfig(task="loss", data=args.data or "", batch_size=args.micro_batch_size,
                          limit=args.batches or None)
    validate_task(task)
    return task


def samples_path(out: str) -> str:
    """Where --log-samples writes beside ``--out``: FILE.json -> FILE.samples.jsonl."""
    return (out[:-len(".json")] if out.endswith(".json") else out) + ".samples.jsonl"


def print_kinds() -> None:
    for kind in task_kinds():
        print(f"{kind:<10} {summary_line(kind) or ''}")
    print(f"{'yours':<10} --task package.module:Class, a subclass of minimind_ray.evals.registry.EvalTask "
          "(docs/evaluation.md)")


def run(args) -> int:
    if args.task == "list":
        print_kinds()
        return 0
    weights = args.weights_arg or args.weights
    if not weights:
        raise ValueError("eval: which weights? give WEIGHTS (a run dir, checkpoint, .pth, HF folder or URI)")
    if args.log_samples and not args.out:
        raise ValueError("eval: --log-samples writes beside the result: give --out FILE.json")
    task = loss_task(args) if args.task in (None, "loss") and not args.config else task_from_args(args)
    if args.log_samples and task.task == "loss":
        raise ValueError("eval: --log-samples: the loss task has no per-question records")
    from minimind_ray.evals.run import evaluate_task  # lazy: numpy, pyarrow, torch, only when this runs

    res = evaluate_task(weights, task, preset=args.preset, tokenizer=args.tokenizer, device=args.device,
                        workers=args.workers, rope_scaling=rope_scaling_of(args), log_samples=args.log_samples)
    print(format_table(res))
    if args.out:
        from minimind_ray.fsio import write_text_atomic  # lazy: pyarrow, only when this runs

        records = res.pop("samples_log", None)
        brief = {k: v for k, v in res.items() if k != "details"}
        if records is not None:
            brief["samples_file"] = samples_path(args.out)
            write_text_atomic(brief["samples_file"], "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                                             for r in records))
            print(f"written: {brief['samples_file']} ({len(records)} records)", file=sys.stderr)
        write_text_atomic(args.out, json.dumps(brief, indent=1, ensure_ascii=False))
        print(f"written: {args.out}", file=sys.stderr)
    return 0
