"""``minimind-ray fetch-tokenizer NAME --out DIR``: MiniMind's tokenizer NAME fetched at its pinned commit,
sha256-checked, into ``DIR/NAME`` (tokenizer_fetch.py does the work): a mirror for offline clusters."""
from __future__ import annotations

import argparse

from minimind_ray.tokenizer_fetch import MIRROR_ENV, PINNED, fetch_to

HELP = (f"download MiniMind's tokenizer NAME (pinned commit, sha256-checked) into OUT/NAME: a mirror for {MIRROR_ENV} "
        f"on offline clusters")


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("name", choices=sorted(PINNED))
    sp.add_argument("--out", required=True, help="local directory or URI; the files land in OUT/NAME/")


def run(args) -> int:
    target = fetch_to(args.name, args.out)
    print(f"{args.name}: {target} (sha256-checked)")
    print(f"use it with {MIRROR_ENV}={args.out} and data.tokenizer={args.name}, or with data.tokenizer={target}")
    return 0
