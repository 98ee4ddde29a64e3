"""``minimind-ray merge-lora``: a base's weights with a file of LoRA adapters (MiniMind's ``lora_*.pth``) folded in,
saved as a MiniMind ``.pth`` (store/weights.py:merge_lora_file). Kept apart from weights.py so that building the
CLI's parser imports no torch.

    minimind-ray merge-lora --base base.pth --lora lora_sft.pth --out merged.pth [--alpha A]
"""
from __future__ import annotations

import argparse

HELP = "fold LoRA weights into base weights"


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--base", required=True)
    sp.add_argument("--lora", required=True)
    sp.add_argument("--out", required=True)
    sp.add_argument("--preset")
    sp.add_argument("--alpha", type=float, default=None)


def run(args) -> int:
    from minimind_ray.store.weights import merge_lora_file  # lazy: pyarrow, torch, only when this runs

    print(f"merged: {merge_lora_file(args.base, args.lora, args.out, args.preset, args.alpha)}")
    return 0
