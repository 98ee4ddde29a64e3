"""``minimind-ray``: one verb per thing a user does; each is a thin call into the library.

Training verbs take a YAML recipe and dotted overrides::

    minimind-ray pretrain --config pipelines/configs/tiny.yaml cluster.num_workers=2 train.max_steps=50

``minimind-ray pretrain --help`` lists every config field with its help text.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

from minimind_ray.config_checks import ConfigError, int_at_least as _int_at_least
from minimind_ray.console import quiet_environment, set_verbose
from minimind_ray.evals.verb import __doc__ as eval_doc, add_arguments as add_eval_arguments, run_from_args
from minimind_ray.failures import MISTAKE, Mistake, RunStopped
from minimind_ray.memory_errors import OutOfMemory
from minimind_ray.pipeline.config import load_pipeline
from minimind_ray.raytrain.restarts import RestartsSpent
from minimind_ray.raytrain.sweep_config import load_sweep
from minimind_ray.stages import STAGES
from minimind_ray.tokenizer_fetch import MIRROR_ENV, PINNED, TokenizerFetchError, fetch_to


def _fields_epilog() -> str:
    from minimind_ray.config import field_help  # lazy: pyarrow, only when this runs

    rows = [f"  {name}={default!r}\n      {help}" for name, default, help in field_help()]
    return "config fields (override as key=value):\n" + "\n".join(rows)


def _load(args, stage: Optional[str] = None):
    from minimind_ray.config import load_config  # lazy: pyarrow, only when this runs

    overrides = list(args.overrides)
    if stage:
        overrides = [f"train.stage={stage}"] + overrides
    if getattr(args, "fresh", False):
        overrides.append("resume=never")
    return load_config(args.config, overrides)


def cmd_train(args) -> int:
    from minimind_ray.raytrain.driver import run  # lazy: pyarrow, only when this runs
    from minimind_ray.raytrain.resume import RunFinished  # lazy: pyarrow, only when this runs

    cfg = _load(args, args.verb)
    try:
        res = run(cfg)
    except RunFinished as done:  # the same command again: a no-op that says where the results are
        print(done.line(), flush=True)
        return 0
    print_run_summary(res)
    return 0


def print_run_summary(res) -> None:
    from minimind_ray.fsio import redact  # lazy: pyarrow, only when this runs

    lines = ["\n==== results ====", f"run name:        {res.name}", f"run directory:   {res.run_dir}",
             f"last checkpoint: {res.checkpoint_dir}", *(f"export ({k}): {v}" for k, v in res.exports.items())]
    if getattr(res, "latest", None):  # the next stage starts from it: train.init_from=runs/pretrain-latest
        lines.append(f"latest link:     {res.latest}  (train.init_from={res.latest} chains the next stage)")
    if res.mlflow_run_id:
        lines.append(f"MLflow run id:   {res.mlflow_run_id}  (tracking URI {res.tracking_uri})")
        if res.tracking_uri and res.tracking_uri.startswith("sqlite:///"):
            lines.append(f"MLflow UI:       make ui   (or: mlflow ui --backend-store-uri {res.tracking_uri} --host 127.0.0.1)")
        from minimind_ray.tracking.runs import run_page_url  # lazy: pyarrow, only when this runs
        from minimind_ray.tracking.ui import run_charts_url  # lazy: pyarrow, only when this runs

        page = run_page_url(res.tracking_uri, res.mlflow_run_id)
        if page:  # the 'Model training' view: MLflow 3's UI opens in its GenAI view unless told
            lines.append(f"MLflow run page: {page}")
        charts = run_charts_url(res.tracking_uri, res.mlflow_run_id)
        if charts:  # the run's charts with the loss first (MLflow's own tab orders its sections by name)
            lines.append(f"MLflow charts:   {charts}")
    print("\n".join(redact(line) for line in lines))  # a URI's credentials are never printed


def cmd_sweep(args) -> int:
    from minimind_ray.raytrain.sweep import print_sweep, run_sweep  # lazy: pyarrow, only when this runs

    sweep = load_sweep(args.config, args.overrides)
    out = run_sweep(sweep, Path(args.config).read_text())
    print_sweep(out, sweep)
    return 0 if out.best else 1


def cmd_pipeline(args) -> int:
    from minimind_ray.pipeline.run import print_pipeline, run_pipeline  # lazy: pyarrow, only when this runs

    pipe = load_pipeline(args.config)
    out = run_pipeline(pipe, list(args.overrides), Path(args.config).read_text())
    print_pipeline(out)
    return 0


def cmd_prepare(args) -> int:
    from minimind_ray.data.prepare import ensure_prepared  # lazy: numpy, pyarrow, only when this runs
    from minimind_ray.tokenizer import resolve_tokenizer  # lazy: tokenizers, only when this runs
    from minimind_ray.raytrain.session import connect_ray  # lazy: pyarrow, only when this runs

    cfg = _load(args)
    if args.out:
        cfg.data.cache_dir = args.out
    tok = resolve_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir, cfg.model.generation)  # before Ray: fails fast
    connect_ray(cfg, dashboard=False)  # Ray Data alone: no Ray Train cleaner polls the state API
    out = ensure_prepared(cfg.data, tok)
    manifest = json.loads((Path(out) / "manifest.json").read_text())
    print(f"prepared: {out}")
    from minimind_ray.data.manifest import skipped_records  # lazy: pyarrow, only when this runs

    print(f"skipped {skipped_records(out)}")
    print(json.dumps({k: manifest.get(k) for k in ("format", "counts", "skipped")}, indent=1, ensure_ascii=False))
    return 0


def _tokenizer_for(args, lw):
    from minimind_ray.generate import tokenizer_for_weights  # lazy: torch, only when this runs

    return tokenizer_for_weights(lw, args.tokenizer)


def _sampling(args):
    from minimind_ray.generate import SamplingConfig  # lazy: torch, only when this runs

    return SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, repetition_penalty=args.repetition_penalty, seed=args.seed)


def _device(args) -> str:
    import torch

    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def add_rope_scaling_arguments(sp) -> None:
    """The inference verbs' RoPE switch (generate, chat, serve): MiniMind's ``--inference_rope_scaling`` (YaRN),
    with its ``rope_scaling`` numbers named as MiniMind names them. Read back with :func:`rope_scaling_of`."""
    g = sp.add_argument_group("long context", "YaRN at inference, as MiniMind's --inference_rope_scaling "
                                               "(docs/training.md)")
    g.add_argument("--rope-scaling", metavar="{yarn,none}", default=None,
                   help="yarn: stretch RoPE past the trained context (MiniMind's YaRN); none: plain RoPE even "
                        "where the weights recorded YaRN (default: as the weights record)")
    g.add_argument("--factor", type=float, default=None,
                   help="YaRN: how far the context stretches (MiniMind's rope_scaling.factor, default 16)")
    g.add_argument("--original-max-position-embeddings", type=int, default=None, metavar="N",
                   help="YaRN: the context the model was trained for (MiniMind's "
                        "rope_scaling.original_max_position_embeddings, default 2048)")


def rope_scaling_of(args):
    """``--rope-scaling`` and its numbers as build_inference_model's ``rope_scaling`` (None = the weights' own)."""
    from minimind_ray.store.weights import rope_scaling_spec  # lazy: pyarrow, torch, only when this runs

    return rope_scaling_spec(args.rope_scaling, args.factor, args.original_max_position_embeddings)


def _weights_of(args) -> str:
    """The weights of ``generate``/``chat``: WEIGHTS or ``--weights`` (the older spelling), exactly one of them."""
    if args.weights_arg and args.weights:
        raise ValueError(f"{args.verb}: the weights twice ({args.weights_arg} and --weights {args.weights}): give "
                         f"WEIGHTS or --weights, not both")
    if not (args.weights_arg or args.weights):
        raise ValueError(f"{args.verb}: which weights? give WEIGHTS (a run dir, checkpoint, .pth, HF folder or "
                         f"storage URI), or --weights")
    return args.weights_arg or args.weights


def cmd_generate(args) -> int:
    from minimind_ray.generate import generate_text  # lazy: torch, only when this runs
    from minimind_ray.store.weights import build_inference_model  # lazy: pyarrow, torch, only when this runs

    weights = _weights_of(args)
    dev = _device(args)
    model, lw = build_inference_model(weights, args.preset, device=dev, rope_scaling=rope_scaling_of(args))
    tok = _tokenizer_for(args, lw)
    for prompt in args.prompt:
        if len(args.prompt) > 1:
            print(f"> {prompt}")
        generate_text(model, tok, prompt, _sampling(args), chat=not args.raw, think=args.think, out=sys.stdout,
                      device=dev)
    return 0


def cmd_chat(args) -> int:
    from minimind_ray.generate import chat_loop  # lazy: torch, only when this runs
    from minimind_ray.store.weights import build_inference_model  # lazy: pyarrow, torch, only when this runs

    weights = _weights_of(args)
    dev = _device(args)
    model, lw = build_inference_model(weights, args.preset, device=dev, rope_scaling=rope_scaling_of(args))
    chat_loop(model, _tokenizer_for(args, lw), _sampling(args), think=args.think, device=dev)
    return 0


def cmd_eval(args) -> int:
    return run_from_args(args)


def cmd_export(args) -> int:
    from minimind_ray.export import export_from_source  # lazy: pyarrow, torch, only when this runs

    formats = [f.strip() for f in args.format.split(",")]
    paths = export_from_source(args.source, args.out, formats=formats, preset=args.preset,
                               tokenizer=args.tokenizer, lora=args.lora)
    for k, v in paths.items():
        print(f"{k}: {v}")
    return 0


def cmd_merge_lora(args) -> int:
    from minimind_ray.store.weights import merge_lora_file  # lazy: pyarrow, torch, only when this runs

    print(f"merged: {merge_lora_file(args.base, args.lora, args.out, args.preset, args.alpha)}")
    return 0


def cmd_train_tokenizer(args) -> int:
    from minimind_ray.tokenizer import train_tokenizer  # lazy: pyarrow, tokenizers, only when this runs

    tok = train_tokenizer(args.data, args.out, vocab_size=args.vocab_size)
    print(f"tokenizer: {args.out} (vocab {tok.vocab_size}, hash {tok.hash()[:12]})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minimind-ray", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debug", action="store_true", help="on an error, show the full traceback (before the verb)")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    sub = p.add_subparsers(dest="verb", required=True)

    def with_config(sp):
        sp.add_argument("--config", help="YAML recipe (pipelines/configs/*.yaml)")
        sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4")

    for stage in STAGES.values():
        sp = sub.add_parser(stage.name, help=f"train on Ray: {stage.help}", epilog=_fields_epilog(),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        with_config(sp)
        sp.add_argument("--fresh", action="store_true",
                        help="start a new run even if this command's run exists (resume=never: a new run name; "
                             "nothing is deleted). Without it the same command resumes a stopped run, trains a "
                             "finished one further when train.max_steps grew, and is a no-op otherwise")
        sp.set_defaults(fn=cmd_train)

    sp = sub.add_parser("sweep", help="Ray Tune search over a recipe's fields, ASHA stopping weak trials; running it "
                                      "again resumes it (docs/sweeps.md)")
    sp.add_argument("--config", required=True, help="sweep YAML (pipelines/configs/sweep_*.yaml)")
    sp.add_argument("overrides", nargs="*", help="dotted overrides of the sweep's own fields (num_samples=8) or of its base "
                                                 "recipe for every trial (checkpoint.storage_path=/mnt/runs)")
    sp.set_defaults(fn=cmd_sweep)

    sp = sub.add_parser("pipeline", help=f"steps from data to a served model (prepare, training stages: "
                                         f"{', '.join(STAGES)}; eval, register, serve) as one resumable job "
                                         f"(docs/pipeline.md)")
    sp.add_argument("--config", required=True, help="pipeline YAML (pipelines/configs/pipeline_*.yaml)")
    sp.add_argument("overrides", nargs="*", help="dotted overrides for every training step, e.g. "
                                                 "checkpoint.storage_path=/mnt/runs")
    sp.set_defaults(fn=cmd_pipeline)

    sp = sub.add_parser("prepare", help="tokenize jsonl shards once into Parquet + manifest (Ray Data)")
    with_config(sp)
    sp.add_argument("--out", help="output cache directory (default data.cache_dir)")
    sp.set_defaults(fn=cmd_prepare)

    def with_weights(sp, tokenizer=True):
        sp.add_argument("weights_arg", nargs="?", metavar="WEIGHTS",
                        help=".pth, checkpoint dir, run dir, HF folder or storage URI")
        sp.add_argument("--weights", help="the same as WEIGHTS (the older spelling)")
        sp.add_argument("--preset", help="model preset for a bare .pth (default: inferred from shapes)")
        if tokenizer:
            sp.add_argument("--tokenizer", help="minimind2 | minimind3 | auto | builtin | a tokenizer dir "
                                                "(default: the run's)")

    def with_sampling(sp):
        sp.add_argument("--max-new-tokens", type=int, default=256)
        sp.add_argument("--temperature", type=float, default=0.85, help="0 = greedy")
        sp.add_argument("--top-p", type=float, default=0.85)
        sp.add_argument("--top-k", type=int, default=50)
        sp.add_argument("--repetition-penalty", type=float, default=1.0)
        sp.add_argument("--seed", type=int, default=None)
        sp.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                        help="minimind-3 thinking switch (chat template)")
        sp.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")

    sp = sub.add_parser("generate", help="generate from prompts (streams to stdout)")
    with_weights(sp)
    with_sampling(sp)
    sp.add_argument("--prompt", action="append", required=True, help="repeatable")
    sp.add_argument("--raw", action="store_true", help="plain continuation, no chat template")
    add_rope_scaling_arguments(sp)
    sp.set_defaults(fn=cmd_generate)

    sp = sub.add_parser("chat", help="interactive chat (empty line quits)")
    with_weights(sp)
    with_sampling(sp)
    add_rope_scaling_arguments(sp)
    sp.set_defaults(fn=cmd_chat)

    sp = sub.add_parser("eval", help="benchmark scores (ceval, cmmlu, mc, gen, toolcall, your own task class) or "
                                     "the loss of any weights (docs/evaluation.md)", description=eval_doc,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_eval_arguments(sp)
    add_rope_scaling_arguments(sp)
    sp.set_defaults(fn=cmd_eval)

    sp = sub.add_parser("export", help="export weights to MiniMind .pth, a Hugging Face folder and/or GGUF")
    sp.add_argument("source", help=".pth, checkpoint dir, run dir or storage URI")
    sp.add_argument("--out", required=True)
    sp.add_argument("--format", default="minimind,hf",
                    help="comma list of: minimind (fp16 .pth), hf (transformers folder), safetensors (MiniMind keys), "
                         "gguf (one fp16 file with the tokenizer, for llama.cpp / ollama)")
    sp.add_argument("--preset", help="for a bare .pth")
    sp.add_argument("--tokenizer", help="tokenizer dir to include (default: the run's)")
    sp.add_argument("--lora", choices=("merge", "separate"), default="merge",
                    help="LoRA runs: fold adapters into the weights, or write them separately")
    sp.set_defaults(fn=cmd_export)

    sp = sub.add_parser("merge-lora", help="fold LoRA weights into base weights")
    sp.add_argument("--base", required=True)
    sp.add_argument("--lora", required=True)
    sp.add_argument("--out", required=True)
    sp.add_argument("--preset")
    sp.add_argument("--alpha", type=float, default=None)
    sp.set_defaults(fn=cmd_merge_lora)

    sp = sub.add_parser("train-tokenizer", help="train a ByteLevel BPE tokenizer (vocab 6400, ChatML specials)")
    sp.add_argument("--data", nargs="+", required=True)
    sp.add_argument("--out", required=True)
    sp.add_argument("--vocab-size", type=int, default=6400)
    sp.set_defaults(fn=cmd_train_tokenizer)

    sp = sub.add_parser("fetch-tokenizer", help=f"download MiniMind's tokenizer NAME (pinned commit, sha256-checked) "
                                                f"into OUT/NAME: a mirror for {MIRROR_ENV} on offline clusters")
    sp.add_argument("name", choices=sorted(PINNED))
    sp.add_argument("--out", required=True, help="local directory or URI; the files land in OUT/NAME/")
    sp.set_defaults(fn=cmd_fetch_tokenizer)

    from minimind_ray.serve.launch import add_arguments as add_serve_arguments  # lazy: pyarrow, only when this runs

    sp = sub.add_parser("serve", help="serve WEIGHTS on Ray Serve: an OpenAI-compatible API and a chat page "
                                      "(docs/serving.md)")
    add_serve_arguments(sp)
    add_rope_scaling_arguments(sp)
    sp.set_defaults(fn=cmd_serve)
    for sp in sub.choices.values():  # after the verb too: `minimind-ray pretrain ... --verbose`
        sp.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    return p


VERBOSE_HELP = ("show Ray's and MLflow's own lines too (Ray Data's progress, Ray Train's reports, Serve's access "
                "lines, ...), as MINIMIND_RAY_VERBOSE=1 does; by default they go to Ray's log files only")


def cmd_serve(args) -> int:
    from minimind_ray.serve.launch import serve_from_args  # lazy: pyarrow, only when this runs

    args.rope_scaling = rope_scaling_of(args)  # a dict (ServeOptions.rope_scaling) that travels to the replicas
    return serve_from_args(args)


def cmd_fetch_tokenizer(args) -> int:
    target = fetch_to(args.name, args.out)
    print(f"{args.name}: {target} (sha256-checked)")
    print(f"use it with {MIRROR_ENV}={args.out} and data.tokenizer={args.name}, or with data.tokenizer={target}")
    return 0


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
    except Exception as e:
        if args.debug or not isinstance(e, user_errors()):
            raise
        if isinstance(e, RunStopped) and e.verdict.kind != MISTAKE and e.verdict.traceback:
            print(e.verdict.traceback.rstrip(), file=sys.stderr)  # an error that recurred may be a bug: its traceback
        message = " ".join(str(e).split()) or type(e).__name__  # one line, whatever the library wrote
        print(f"{'config error' if isinstance(e, ConfigError) else 'error'}: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
