"""``minimind-ray train-tokenizer``: a ByteLevel BPE tokenizer trained on jsonl files (tokenizer.py), MiniMind's
vocabulary size and ChatML specials by default. Kept apart from tokenizer.py so that building the CLI's parser
imports no tokenizers.

    minimind-ray train-tokenizer --data corpus.jsonl [more.jsonl ...] --out DIR [--vocab-size 6400]
"""
from __future__ import annotations

import argparse

HELP = "train a ByteLevel BPE tokenizer (vocab 6400, ChatML specials)"


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--data", nargs="+", required=True)
    sp.add_argument("--out", required=True)
    sp.add_argument("--vocab-size", type=int, default=6400)


def run(args) -> int:
    from minimind_ray.tokenizer import train_tokenizer  # lazy: pyarrow, tokenizers, only when this runs

    tok = train_tokenizer(args.data, args.out, vocab_size=args.vocab_size)
    print(f"tokenizer: {args.out} (vocab {tok.vocab_size}, hash {tok.hash()[:12]})")
    return 0
