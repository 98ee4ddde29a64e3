"""GGUF files read back by llama.cpp (through llama-cpp-python): greedy tokens equal `generate`'s.

For each model: ``export_gguf`` in float32 and in float16, then in llama.cpp and in this project, per prompt
(rendered with the model's chat template):
  * whether llama.cpp's own tokenizer, from the file, turns the prompt into our token ids;
  * the largest difference of the next-token logits at the prompt's end (float16: against our model with the
    same float16-rounded weights, so only the arithmetic differs);
  * whether the greedy continuation (``--gguf-tokens`` new tokens, or up to the end token) is token for token ours.
The test fails on a prompt whose tokens or greedy continuation differ; the table gives the logit differences.

    .venv/bin/python -m pytest -m soak -s tests/soak/test_gguf.py [--gguf-weights RUN_OR_PTH --gguf-tokenizer T]

Without ``--gguf-weights`` it checks one freshly initialised model of each layout the export writes: tiny (llama),
tiny3 (qwen3), tiny3-moe (qwen3moe). llama-cpp-python is not in requirements.txt: PyPI has it as source only,
and building its llama.cpp took about an hour on this project's 2-core machine
(``CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install llama-cpp-python==0.3.36``); without it the test is skipped (under
CI=true: fails) saying so. Figures: docs/training.md.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from minimind_ray.config import ModelConfig
from minimind_ray.export_gguf import export_gguf
from minimind_ray.generate import generate_tokens, render_prompt, tokenizer_for_weights
from minimind_ray.model.minimind import build_model
from minimind_ray.model.presets import preset_values
from minimind_ray.store.weights import build_inference_model
from minimind_ray.tokenizer import resolve_tokenizer
from tests.skip_budget import missing

pytestmark = [pytest.mark.soak, pytest.mark.timeout(3600)]

PROMPTS = ["What is the capital of France?", "1 plus 2 equals", "请介绍一下你自己。",
           "Sort these digits: 3 1 2", "Tell me about the moon, rain and tea."]


def ours(model, ids, tokens: int, eos: int):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    greedy = list(generate_tokens(model, torch.tensor([ids]), max_new_tokens=tokens, temperature=0.0,
                                  eos_token_id=eos))
    return logits, greedy


def llama_cpp(llm, ids, tokens: int, eos: int):
    import numpy as np

    llm.reset()
    llm.eval(ids)
    logits = torch.from_numpy(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
    greedy = []
    for t in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        greedy.append(int(t))
        if t == eos or len(greedy) == tokens:
            break
    return logits, greedy


def check(label: str, model, tok, tokens: int, rows: list, tmp: Path) -> None:
    from llama_cpp import Llama

    model = model.float().eval()
    for dtype in (torch.float32, torch.float16):
        path = export_gguf(model, tok.path, tmp / f"{label}-{str(dtype)[6:]}.gguf", dtype=dtype)
        # logits_all: llama-cpp-python keeps the logits only then. float32 weights get a float32 KV cache, so
        # only the export is compared; float16 ones llama.cpp's default float16 cache
        cache = {"type_k": 0, "type_v": 0} if dtype == torch.float32 else {}  # 0 = GGML_TYPE_F32
        llm = Llama(model_path=path, n_ctx=512, n_threads=2, n_batch=512, verbose=False, seed=0, logits_all=True,
                    **cache)
        ref = model
        if dtype == torch.float16:  # the same rounded weights on our side: only the arithmetic differs
            ref = build_model(model.cfg)
            ref.load_state_dict({k: v.half().float() for k, v in model.state_dict().items()})
            ref.eval()
        same_tok = same_greedy = 0
        worst = 0.0
        for prompt in PROMPTS:
            text = render_prompt(tok, [{"role": "user", "content": prompt}])
            ids = tok.encode(text)
            same_tok += llm.tokenize(text.encode("utf-8"), add_bos=False, special=True) == ids
            a_logits, a = ours(ref, ids, tokens, tok.eos_id)
            b_logits, b = llama_cpp(llm, ids, tokens, tok.eos_id)
            worst = max(worst, (a_logits - b_logits).abs().max().item())
            same_greedy += a == b
            if a != b:
                print(f"  {label} {dtype}: {prompt!r}\n    ours  {a}\n    llama {b}")
        rows.append((label, str(dtype)[6:], "f32" if cache else "f16", f"{same_tok}/{len(PROMPTS)}", f"{worst:.2e}",
                     f"{same_greedy}/{len(PROMPTS)}", f"{os.path.getsize(path) / 1e6:.1f} MB"))
        llm.close()


def test_llama_cpp_reads_the_gguf_export_as_this_project_generates(request, tmp_path):
    try:
        import llama_cpp
    except ImportError:
        missing("llama-cpp-python is not installed (CMAKE_ARGS=\"-DGGML_NATIVE=OFF\" pip install "
                "llama-cpp-python==0.3.36: about an hour of building on 2 cores)")
    get = request.config.getoption
    weights, tokenizer, tokens = get("--gguf-weights", None), get("--gguf-tokenizer", None), get("--gguf-tokens", 24)
    torch.set_num_threads(2)
    rows: list = []
    if weights:
        model, lw = build_inference_model(weights)
        check(Path(weights).name, model, tokenizer_for_weights(lw, tokenizer), tokens, rows, tmp_path)
    else:
        for preset in ("tiny", "tiny3", "tiny3-moe"):
            cfg = ModelConfig(**preset_values(preset))
            tok = resolve_tokenizer(tokenizer or cfg.generation, str(tmp_path / "cache"), cfg.generation)
            check(preset, build_model(cfg, seed=0), tok, tokens, rows, tmp_path)
    print(f"\nllama-cpp-python {llama_cpp.__version__}, {len(PROMPTS)} prompts, up to {tokens} greedy tokens each")
    head = ("model", "GGUF", "KV cache", "same prompt tokens", "max |logit diff|", "same greedy tokens", "file")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    whole = f"{len(PROMPTS)}/{len(PROMPTS)}"
    assert all(r[3] == whole and r[5] == whole for r in rows), "llama.cpp differs from this project: the table above"
