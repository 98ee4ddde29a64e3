"""Talk to a trained model: one-shot generation and an interactive chat, streamed token by token."""
from __future__ import annotations

import sys
from typing import Iterator, List, Optional, TextIO

import torch
from torch import Tensor

from minimind_ray.model.grammar import GrammarCompiler, RowConstraint, new_bitmask, schema_grammar
from minimind_ray.model.kv_cache import KVCache
from minimind_ray.model.prefix_cache import PrefixCache
from minimind_ray.model.sampling import SamplingParams, apply_token_bitmask, sample_tokens


@torch.inference_mode()
def generate_tokens(model, input_ids: Tensor, max_new_tokens: int, temperature: float = 0.85,
                    top_p: float = 0.85, top_k: int = 50, repetition_penalty: float = 1.0,
                    eos_token_id: Optional[int] = 2, use_cache: bool = True,
                    generator: Optional[torch.Generator] = None,
                    prefix_cache: Optional[PrefixCache] = None,
                    constraint: Optional[RowConstraint] = None) -> Iterator[int]:
    """Yield new token ids one at a time (streaming) for a single prompt ``input_ids`` (1, T).

    Sampling follows MiniMind's: repetition penalty over every token seen, then the one sampler
    (model/sampling.py: temperature, top-k, top-p). ``temperature == 0`` is greedy. Stops after yielding
    ``eos_token_id`` or at the model's maximum length; with a ``constraint`` (structured output, model/grammar.py)
    only the tokens its grammar allows, the end of turn where it accepts. One prefill of the prompt into a KV cache,
    then one token per forward (``use_cache=False``: the whole sequence every time, the reference the tests use).
    With ``prefix_cache`` (model/prefix_cache.py) the prompt's cached prefix is copied in and only the rest is
    prefilled, and the prompt's blocks are stored for the next call (a chat's next turn, the next prompt).
    The model runs in eval mode and its previous mode is restored afterwards.
    """
    was_training = model.training
    model.eval()
    try:
        ids = input_ids
        limit = model.cfg.max_position_embeddings
        cache = KVCache.for_model(model, slots=1) if use_cache else None
        if cache is not None and prefix_cache is not None:
            prefix_cache.check_weights(model)
            prefix_cache.load(cache, 0, input_ids[0].tolist())
        for _ in range(max_new_tokens):
            if ids.shape[1] >= limit:
                return
            if cache is None:
                logits = model(ids).logits[0, -1:].float()  # (1, V)
            else:
                step_in = ids[:, cache.lengths[0]:]  # the prompt, then the newest token
                logits = model(step_in, kv_cache=cache, logits_at=step_in.new_tensor([step_in.shape[1] - 1])
                               ).logits[:, -1].float()  # (1, V)
                if prefix_cache is not None and ids is input_ids:  # the prompt's prefill: keep its blocks
                    prefix_cache.save(cache, 0, input_ids[0].tolist())
            if repetition_penalty != 1.0:
                seen = torch.unique(ids[0])
                s = logits[0, seen]
                logits[0, seen] = torch.where(s > 0, s / repetition_penalty, s * repetition_penalty)
            if constraint is not None:
                mask = new_bitmask(1, logits.shape[-1])
                constraint.fill(mask[0])
                apply_token_bitmask(logits, mask)
            nxt = int(sample_tokens(logits, temperature, top_p, top_k, generator))
            if constraint is not None:
                constraint.advance(nxt)
            yield nxt
            if eos_token_id is not None and nxt == eos_token_id:
                return
            ids = torch.cat([ids, ids.new_tensor([[nxt]])], dim=1)
    finally:
        model.train(was_training)


def tokenizer_for_weights(lw, spec: Optional[str] = None):
    """The tokenizer of loaded weights (a store.weights.LoadedWeights): ``spec`` when given (a name, auto = MiniMind's
    tokenizer of the weights' generation, or a directory), else the run's (its data.tokenizer), else an HF export
    folder's own; a ValueError naming what to pass when the weights record none."""
    from minimind_ray.tokenizer import resolve_tokenizer  # lazy: pyarrow, tokenizers, only when this runs

    data = lw.run_config["data"] if lw.run_config else None  # the run's recorded config (a plain dict)
    if spec:
        return resolve_tokenizer(spec, data["cache_dir"] if data else "data_cache", lw.model_cfg.generation)
    if data is not None:
        return resolve_tokenizer(data["tokenizer"], data["cache_dir"], lw.model_cfg.generation)
    if lw.tokenizer_dir:  # an HF export folder carries its tokenizer
        return resolve_tokenizer(lw.tokenizer_dir, "data_cache", lw.model_cfg.generation)
    raise ValueError(f"{lw.source}: --tokenizer is needed for weights without a tokenizer: minimind2, minimind3, "
                     f"auto (MiniMind's tokenizer of the model's generation) or a tokenizer directory")


def render_prompt(tokenizer, messages: List[dict], think: Optional[bool] = None) -> str:
    """The chat template with the generation prompt; ``think`` drives minimind-3's thinking switch.

    MiniMind2's template reads ``enable_thinking``, minimind-3's ``open_thinking``; both are passed."""
    kw = {}
    if think is not None:
        kw = {"enable_thinking": think, "open_thinking": think}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kw)


class StreamDecoder:
    """Turns a stream of token ids into text pieces without splitting multi-byte characters."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.emitted = tokenizer, [], ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        piece, self.emitted = text[len(self.emitted):], text
        return piece


def schema_constraints(model, tokenizer, schema: Optional[dict]):
    """Structured output for ``generate``/``chat --json-schema``: a function that gives each reply a fresh
    constraint to ``schema`` (compiled once; a SchemaError, a ValueError, when it cannot be enforced), or None."""
    if schema is None:
        return None
    compiler = GrammarCompiler(tokenizer.to_json(), tokenizer.eos_id, model.cfg.vocab_size, compile_timeout_s=60.0)
    grammar = schema_grammar(schema)
    compiler.compile(grammar)
    return lambda: compiler.constraint(grammar)


def stream_reply(model, tokenizer, prompt_text: str, sampling: SamplingParams, device: str = "cpu",
                 prefix_cache: Optional[PrefixCache] = None,
                 constraint: Optional[RowConstraint] = None) -> Iterator[str]:
    ids = torch.tensor([tokenizer.encode(prompt_text)], dtype=torch.long, device=device)
    gen = None
    if sampling.seed is not None:
        gen = torch.Generator(device=device).manual_seed(sampling.seed)
    dec = StreamDecoder(tokenizer)
    for tok in generate_tokens(model, ids, max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                        top_p=sampling.top_p, top_k=sampling.top_k, repetition_penalty=sampling.repetition_penalty,
                        eos_token_id=tokenizer.eos_id, generator=gen, prefix_cache=prefix_cache,
                        constraint=constraint):
        if tok == tokenizer.eos_id:
            break
        piece = dec.push(int(tok))
        if piece:
            yield piece


def generate_text(model, tokenizer, prompt: str, sampling: SamplingParams, chat: bool = True,
                  think: Optional[bool] = None, out: Optional[TextIO] = None, device: str = "cpu",
                  prefix_cache: Optional[PrefixCache] = None, constraint: Optional[RowConstraint] = None) -> str:
    """Generate a reply (chat template) or a continuation (raw), streaming to ``out``; JSON valid against a schema
    with a ``constraint`` (:func:`schema_constraints`)."""
    text = render_prompt(tokenizer, [{"role": "user", "content": prompt}], think) if chat else \
        tokenizer.decode([tokenizer.bos_id]) + prompt
    pieces = stream_reply(model, tokenizer, text, sampling, device, prefix_cache, constraint)
    if out is None:
        return "".join(pieces)
    reply = "".join(_tee(pieces, out))
    out.write("\n")
    return reply


def chat_loop(model, tokenizer, sampling: SamplingParams, think: Optional[bool] = None, device: str = "cpu",
              inp: TextIO = sys.stdin, out: TextIO = sys.stdout, history_turns: int = 4,
              prefix_cache: Optional[PrefixCache] = None, constraints=None) -> None:
    """Interactive chat; keeps the last ``history_turns`` exchanges as context. Empty line or EOF quits. With
    ``prefix_cache``, each turn prefills only what the turns before it did not (the history is a prefix).
    ``constraints`` (:func:`schema_constraints`): every reply is JSON valid against its schema."""
    history: List[dict] = []
    while True:
        out.write("you> ")
        out.flush()
        line = inp.readline()
        if not line or not line.strip():
            return
        history.append({"role": "user", "content": line.strip()})
        out.write("minimind> ")
        reply = "".join(_tee(stream_reply(model, tokenizer, render_prompt(tokenizer, history, think), sampling,
                                          device, prefix_cache, constraints() if constraints else None), out))
        out.write("\n")
        history.append({"role": "assistant", "content": reply})
        history = history[-2 * history_turns:]


def _tee(pieces, out):
    for p in pieces:
        out.write(p)
        out.flush()
        yield p
