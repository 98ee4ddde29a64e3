"""``minimind-ray``: one verb per thing a user does; each is a thin call into the library.

Training verbs take a YAML recipe and dotted overrides::

    minimind-ray pretrain --config pipelines/configs/tiny.yaml cluster.num_workers=2 train.max_steps=50

``minimind-ray pretrain --help`` lists every config field with its help text.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from minimind_ray import chat_verb, export_verb, fetch_tokenizer_verb, generate_verb, train_tokenizer_verb
from minimind_ray.config_checks import ConfigError
from minimind_ray.console import quiet_environment, set_verbose
from minimind_ray.evals import eval_verb
from minimind_ray.failures import MISTAKE, Mistake, RunStopped
from minimind_ray.memory_errors import OutOfMemory
from minimind_ray.pipeline import pipeline_verb
from minimind_ray.raytrain import prepare_verb, sweep_verb, train_verb
from minimind_ray.raytrain.interrupt import Interrupted
from minimind_ray.raytrain.restarts import RestartsSpent
from minimind_ray.serve import serve_verb
from minimind_ray.stages import STAGES
from minimind_ray.store import merge_lora_verb
from minimind_ray.tokenizer_fetch import TokenizerFetchError

# The verbs after the training ones (one per stage of the registry, all raytrain/train_verb.py), in --help's order.
# Each is one module, <verb>_verb.py, of the room that does its work (docs/architecture.md, "A new verb"): HELP (its
# line in `minimind-ray --help`), add_arguments(parser) and run(args) -> the exit code. This file only assembles them.
VERBS = {"sweep": sweep_verb, "pipeline": pipeline_verb, "prepare": prepare_verb, "generate": generate_verb,
         "chat": chat_verb, "eval": eval_verb, "export": export_verb, "merge-lora": merge_lora_verb,
         "train-tokenizer": train_tokenizer_verb, "fetch-tokenizer": fetch_tokenizer_verb, "serve": serve_verb}

VERBOSE_HELP = ("show Ray's and MLflow's own lines too (Ray Data's progress, Ray Train's reports, Serve's access "
                "lines, ...), as MINIMIND_RAY_VERBOSE=1 does; by default they go to Ray's log files only")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minimind-ray", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debug", action="store_true", help="on an error, show the full traceback (before the verb)")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    sub = p.add_subparsers(dest="verb", required=True)
    verbs = [(stage.name, f"train on Ray: {stage.help}", train_verb, (stage.name,)) for stage in STAGES.values()]
    verbs += [(name, module.HELP, module, ()) for name, module in VERBS.items()]
    for name, help, module, stage in verbs:
        sp = sub.add_parser(name, help=help)
        module.add_arguments(sp, *stage)  # a stage's verb lists the config fields its stage reads
        sp.set_defaults(fn=module.run)
    for sp in sub.choices.values():  # after the verb too: `minimind-ray pretrain ... --verbose`
        sp.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    return p


def user_errors() -> tuple:
    """The library's errors about what a user gave it: bad config (ConfigError, naming the field or
    file:line), data (DataError), checkpoints (CheckpointError), weights files (WeightsError: truncated,
    non-float, no matching preset), tokenizers (TokenizerFetchError), and the ValueError/OSError a bad
    argument, path or URI raises; a run out of memory (OutOfMemory: the settings to change, the memory
    seen), a worker group that could not be restarted within cluster.max_failures (RestartsSpent), and a run that
    ended without a retry (RunStopped: the user's mistake (Mistake), or an error that recurred). Each message names the
    input, so :func:`main` prints it as one line with exit code 2. Anything else is a bug and keeps its traceback."""
    from minimind_ray.data.manifest import DataError  # lazy: pyarrow, only when this runs
    from minimind_ray.store.checkpoint import CheckpointError  # lazy: pyarrow, torch, only when this runs
    from minimind_ray.store.pth import WeightsError  # lazy: torch, only when this runs

    return (ConfigError, DataError, CheckpointError, WeightsError, TokenizerFetchError, OutOfMemory, RestartsSpent,
            Mistake, RunStopped, ValueError, OSError)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    set_verbose(args.verbose)
    quiet_environment()  # before Ray or MLflow is imported
    try:
        return args.fn(args)
    except Interrupted as e:  # Ctrl-C / SIGTERM: a clean stop, said already (raytrain/interrupt.py)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C where no stop is planned (a verb's own work): one line, not a traceback
        if args.debug:
            raise
        print(f"interrupted: minimind-ray {args.verb} stopped before it ended (--debug shows where)", file=sys.stderr)
        return 130
    except Exception as e:
        worker_traceback = e.verdict.traceback.rstrip() if isinstance(e, RunStopped) else ""  # the worker's own
        if args.debug or not isinstance(e, user_errors()):
            if worker_traceback:
                print(worker_traceback, file=sys.stderr)
            raise
        if worker_traceback and e.verdict.kind != MISTAKE:  # an error that recurred may be a bug: its traceback
            print(worker_traceback, file=sys.stderr)
        message = " ".join(str(e).split()) or type(e).__name__  # one line, whatever the library wrote
        print(f"{'config error' if isinstance(e, ConfigError) else 'error'}: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
