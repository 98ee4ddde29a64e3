"""``minimind-ray chat``: an interactive chat with any weights (generate.py's ``chat_loop``; an empty line quits),
with generate's flags of the weights, the sampler and the RoPE switch (generate_verb.py).

    minimind-ray chat WEIGHTS [--tokenizer minimind2] [--think] [--rope-scaling yarn] [--json-schema FILE]
"""
from __future__ import annotations

import argparse

from minimind_ray.generate_verb import (add_rope_scaling_arguments, add_sampling_arguments, add_structured_arguments,
                                        add_weights_arguments, device_of, json_schema_of, load_model, prefix_cache_of,
                                        sampling_of, schema_constraints_of)

HELP = "interactive chat (empty line quits)"


def add_arguments(sp: argparse.ArgumentParser) -> None:
    add_weights_arguments(sp)
    add_sampling_arguments(sp)
    add_structured_arguments(sp)
    add_rope_scaling_arguments(sp)


def run(args) -> int:
    from minimind_ray.generate import chat_loop  # lazy: torch, only when this runs

    json_schema_of(args)  # a bad file before the model loads
    dev = device_of(args)
    prefix_cache = prefix_cache_of(args)  # a bad flag before the weights load
    model, tok = load_model(args, dev)
    chat_loop(model, tok, sampling_of(args), think=args.think, device=dev, prefix_cache=prefix_cache,
              constraints=schema_constraints_of(args, model, tok))
    return 0
