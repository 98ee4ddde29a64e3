"""``minimind-ray export``: any weights to a MiniMind ``.pth``, a Hugging Face folder, MiniMind-keyed safetensors
and/or one GGUF file (export.py, export_gguf.py). Kept apart from export.py so that building the CLI's parser
imports no torch.

    minimind-ray export WEIGHTS --out DIR [--format minimind,hf,safetensors,gguf] [--lora merge|separate]
"""
from __future__ import annotations

import argparse

HELP = "export weights to MiniMind .pth, a Hugging Face folder and/or GGUF"


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("source", help=".pth, checkpoint dir, run dir or storage URI")
    sp.add_argument("--out", required=True)
    sp.add_argument("--format", default="minimind,hf",
                    help="comma list of: minimind (fp16 .pth), hf (transformers folder), safetensors (MiniMind keys), "
                         "gguf (one fp16 file with the tokenizer, for llama.cpp / ollama)")
    sp.add_argument("--preset", help="for a bare .pth")
    sp.add_argument("--tokenizer", help="tokenizer dir to include (default: the run's)")
    sp.add_argument("--lora", choices=("merge", "separate"), default="merge",
                    help="LoRA runs: fold adapters into the weights, or write them separately")


def run(args) -> int:
    from minimind_ray.export import export_from_source  # lazy: pyarrow, torch, only when this runs

    formats = [f.strip() for f in args.format.split(",")]
    paths = export_from_source(args.source, args.out, formats=formats, preset=args.preset,
                               tokenizer=args.tokenizer, lora=args.lora)
    for k, v in paths.items():
        print(f"{k}: {v}")
    return 0
