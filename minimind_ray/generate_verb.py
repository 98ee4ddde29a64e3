"""``minimind-ray generate``: sample from any weights (generate.py), streamed to stdout; and the flags every
inference verb shares: the weights (generate, chat), sampling (generate, chat), structured output (generate, chat:
``--json-schema FILE``) and the RoPE switch (generate, chat, eval, serve). Kept apart from generate.py so that building
the CLI's parser imports no torch.

    minimind-ray generate WEIGHTS --prompt "..." [--prompt "..."] [--raw] [--temperature 0] [--rope-scaling yarn]
                                  [--json-schema FILE]
"""
from __future__ import annotations

import argparse
import sys

HELP = "generate from prompts (streams to stdout)"


def add_weights_arguments(sp: argparse.ArgumentParser) -> None:
    """The weights of ``generate``/``chat``: WEIGHTS or ``--weights`` (read back with :func:`weights_of`)."""
    sp.add_argument("weights_arg", nargs="?", metavar="WEIGHTS",
                    help=".pth, checkpoint dir, run dir, HF folder or storage URI")
    sp.add_argument("--weights", help="the same as WEIGHTS (the older spelling)")
    sp.add_argument("--preset", help="model preset for a bare .pth (default: inferred from shapes)")
    sp.add_argument("--tokenizer", help="minimind2 | minimind3 | auto | builtin | a tokenizer dir "
                                        "(default: the run's)")


def add_sampling_arguments(sp: argparse.ArgumentParser) -> None:
    """The sampler's settings of ``generate``/``chat`` (read back with :func:`sampling_of`), and the device."""
    sp.add_argument("--max-new-tokens", type=int, default=256)
    sp.add_argument("--temperature", type=float, default=0.85, help="0 = greedy")
    sp.add_argument("--top-p", type=float, default=0.85)
    sp.add_argument("--top-k", type=int, default=50)
    sp.add_argument("--repetition-penalty", type=float, default=1.0)
    sp.add_argument("--seed", type=int, default=None)
    sp.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                    help="minimind-3 thinking switch (chat template)")
    sp.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    sp.add_argument("--prefix-cache-mb", type=float, default=64.0,
                    help="MiB of prompt keys/values kept for the next prompt that starts alike (a chat's history, "
                         "the chat template; LRU; default 64; 0 = off)")


def add_structured_arguments(sp: argparse.ArgumentParser) -> None:
    """``generate``'s and ``chat``'s structured output."""
    sp.add_argument("--json-schema", metavar="FILE", default=None,
                    help="every reply is JSON valid against this JSON Schema file (constrained decoding; "
                         "docs/serving.md, 'Structured output')")


def json_schema_of(args):
    """The --json-schema file's schema (None without the flag); a ValueError naming the file when it is not JSON."""
    if not getattr(args, "json_schema", None):
        return None
    from minimind_ray.model.grammar import read_schema_file  # lazy: llguidance, torch, only when this runs

    try:
        return read_schema_file(args.json_schema)
    except ValueError as e:
        raise ValueError(f"--json-schema {args.json_schema}: {e}") from None


def schema_constraints_of(args, model, tok):
    """Each reply's constraint to the --json-schema file's schema (None without it); a ValueError naming the file and
    the schema's keyword that cannot be enforced."""
    from minimind_ray.generate import schema_constraints  # lazy: torch, only when this runs
    from minimind_ray.model.grammar import SchemaError  # lazy: llguidance, only when this runs

    schema = json_schema_of(args)
    try:
        return schema_constraints(model, tok, schema)
    except SchemaError as e:
        raise ValueError(f"--json-schema {args.json_schema}: {e}") from None


def add_rope_scaling_arguments(sp: argparse.ArgumentParser) -> None:
    """The inference verbs' RoPE switch (generate, chat, eval, serve): MiniMind's ``--inference_rope_scaling``
    (YaRN), with its ``rope_scaling`` numbers named as MiniMind names them. Read back with :func:`rope_scaling_of`."""
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


def weights_of(args) -> str:
    """The weights of ``generate``/``chat``: WEIGHTS or ``--weights`` (the older spelling), exactly one of them."""
    if args.weights_arg and args.weights:
        raise ValueError(f"{args.verb}: the weights twice ({args.weights_arg} and --weights {args.weights}): give "
                         f"WEIGHTS or --weights, not both")
    if not (args.weights_arg or args.weights):
        raise ValueError(f"{args.verb}: which weights? give WEIGHTS (a run dir, checkpoint, .pth, HF folder or "
                         f"storage URI), or --weights")
    return args.weights_arg or args.weights


def sampling_of(args):
    from minimind_ray.model.sampling import SamplingParams  # lazy: torch, only when this runs

    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, repetition_penalty=args.repetition_penalty, seed=args.seed)


def prefix_cache_of(args):
    """The prefix cache ``--prefix-cache-mb`` asks for (None: off)."""
    from minimind_ray.model.prefix_cache import PrefixCache  # lazy: torch, only when this runs

    if args.prefix_cache_mb < 0:
        raise ValueError(f"--prefix-cache-mb: must be >= 0 (got {args.prefix_cache_mb:g})")
    return PrefixCache.of_mib(args.prefix_cache_mb)


def device_of(args) -> str:
    import torch

    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def load_model(args, device: str):
    """The model of ``generate``/``chat`` on ``device`` with the RoPE switch applied, and its tokenizer."""
    from minimind_ray.generate import tokenizer_for_weights  # lazy: torch, only when this runs
    from minimind_ray.store.weights import build_inference_model  # lazy: pyarrow, torch, only when this runs

    model, lw = build_inference_model(weights_of(args), args.preset, device=device, rope_scaling=rope_scaling_of(args))
    return model, tokenizer_for_weights(lw, args.tokenizer)


def add_arguments(sp: argparse.ArgumentParser) -> None:
    add_weights_arguments(sp)
    add_sampling_arguments(sp)
    sp.add_argument("--prompt", action="append", required=True, help="repeatable")
    sp.add_argument("--raw", action="store_true", help="plain continuation, no chat template")
    add_structured_arguments(sp)
    add_rope_scaling_arguments(sp)


def load_for_replies(args):
    """``generate``'s and ``chat``'s set-up: (device, model, tokenizer, prefix cache, the --json-schema constraints),
    a bad --json-schema file or --prefix-cache-mb refused before the weights load."""
    json_schema_of(args)
    dev = device_of(args)
    prefix_cache = prefix_cache_of(args)
    model, tok = load_model(args, dev)
    return dev, model, tok, prefix_cache, schema_constraints_of(args, model, tok)


def run(args) -> int:
    from minimind_ray.generate import generate_text  # lazy: torch, only when this runs

    dev, model, tok, prefix_cache, constraints = load_for_replies(args)
    for prompt in args.prompt:
        if len(args.prompt) > 1:
            print(f"> {prompt}")
        generate_text(model, tok, prompt, sampling_of(args), chat=not args.raw, think=args.think, out=sys.stdout,
                      device=dev, prefix_cache=prefix_cache, constraint=constraints() if constraints else None)
    return 0
