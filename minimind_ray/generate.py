"""Talk to a trained model: one-shot generation and an interactive chat, streamed token by token."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Iterator, List, Optional, TextIO

import torch


@dataclass
class SamplingConfig:
    max_new_tokens: int = 256
    temperature: float = 0.85  # 0 = greedy
    top_p: float = 0.85
    top_k: int = 50
    repetition_penalty: float = 1.0
    seed: Optional[int] = None


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


def stream_reply(model, tokenizer, prompt_text: str, sampling: SamplingConfig, device: str = "cpu") -> Iterator[str]:
    from minimind_ray.model.minimind import generate

    ids = torch.tensor([tokenizer.encode(prompt_text)], dtype=torch.long, device=device)
    gen = None
    if sampling.seed is not None:
        gen = torch.Generator(device=device).manual_seed(sampling.seed)
    dec = StreamDecoder(tokenizer)
    for tok in generate(model, ids, max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                        top_p=sampling.top_p, top_k=sampling.top_k, repetition_penalty=sampling.repetition_penalty,
                        eos_token_id=tokenizer.eos_id, generator=gen):
        if tok == tokenizer.eos_id:
            break
        piece = dec.push(int(tok))
        if piece:
            yield piece


def generate_text(model, tokenizer, prompt: str, sampling: SamplingConfig, chat: bool = True,
                  think: Optional[bool] = None, out: Optional[TextIO] = None, device: str = "cpu") -> str:
    """Generate a reply (chat template) or a continuation (raw), streaming to ``out``."""
    text = render_prompt(tokenizer, [{"role": "user", "content": prompt}], think) if chat else \
        tokenizer.decode([tokenizer.bos_id]) + prompt
    pieces = stream_reply(model, tokenizer, text, sampling, device)
    if out is None:
        return "".join(pieces)
    reply = "".join(_tee(pieces, out))
    out.write("\n")
    return reply


def chat_loop(model, tokenizer, sampling: SamplingConfig, think: Optional[bool] = None, device: str = "cpu",
              inp: TextIO = sys.stdin, out: TextIO = sys.stdout, history_turns: int = 4) -> None:
    """Interactive chat; keeps the last ``history_turns`` exchanges as context. Empty line or EOF quits."""
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
                                          device), out))
        out.write("\n")
        history.append({"role": "assistant", "content": reply})
        history = history[-2 * history_turns:]


def _tee(pieces, out):
    for p in pieces:
        out.write(p)
        out.flush()
        yield p
