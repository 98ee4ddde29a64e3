"""``minimind-ray chat``: an interactive chat with any weights (generate.py's ``chat_loop``; an empty line quits),
with generate's flags of the weights, the sampler and the RoPE switch (generate_verb.py).

    minimind-ray chat WEIGHTS [--tokenizer minimind2] [--think] [--rope-scaling yarn] [--json-schema FILE]
"""
from __future__ import annotations

import argparse

from minimind_ray.generate_verb import (add_rope_scaling_arguments, add_sampling_arguments, add_structured_arguments,
                                        add_weights_arguments, load_for_replies, sampling_of)

HELP = "interactive chat (empty line quits)"


def add_arguments(sp: argparse.ArgumentParser) -> None:
    add_weights_arguments(sp)
    add_sampling_arguments(sp)
    add_structured_arguments(sp)
    add_rope_scaling_arguments(sp)


def run(args) -> int:
    from minimind_ray.generate import chat_loop  # lazy: torch, only when this runs

    dev, model, tok, prefix_cache, constraints = load_for_replies(args)
    chat_loop(model, tok, sampling_of(args), think=args.think, device=dev, prefix_cache=prefix_cache,
              constraints=constraints)
    return 0
