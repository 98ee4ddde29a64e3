"""Structured output (not a test): the two grammar libraries side by side, and what the constraint costs a decode step.

``--libraries`` (the default, with ``--decode``): llguidance and xgrammar on this CPU, for MiniMind's minimind2
tokenizer (by name, through tokenizer_fetch: MINIMIND_RAY_TOKENIZER_MIRROR or its cache) and the built-in demo
tokenizer, both byte-level BPE with 6400 ids, over the schemas of the tests (tests/fixtures/structured_schemas.json):

  compile      ms to turn one schema into a matcher for the tokenizer (median of --rounds, no cache)
  mask b1      CPU µs of this thread to fill one row's bitmask of allowed tokens, per token, along random walks
               through the grammar (each step a random allowed token, the end of turn taken half the time it is allowed)
  mask b16     the same per token when 16 such walks fill their 16 rows one after another (llguidance also with its
               parallel executor, ``par``: wall µs, its threads' CPU is not this thread's)

then a table of JSON Schema features: each keyword's probe schema compiles (or is refused, or is silently ignored:
``ignored`` when a walk the library accepted does not validate with jsonschema). xgrammar is measured only where it
is installed: it is not in requirements.txt (it requires triton and transformers); install it for this with
``pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2``.

``--decode``: the serving engine (serve/engine.py) at batch 16 on a freshly initialised --preset model, every row
free vs every row constrained to the ``person`` schema, temperature 1; a finished row is replaced at once by a new
request, and a step counts only when all 16 rows decoded and none joined (no prefill in it). Figures are CPU
seconds of the engine thread per step (``time.thread_time``: on a shared machine wall time mostly measures the
other processes), the median over --steps such steps, and the same split for the masking alone.

Usage:  .venv/bin/python bench/bench_structured.py [--libraries] [--decode] [--rounds 5] [--steps 64]
                                                   [--preset minimind2-small] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time

import torch
from common import REPO, fresh_model, load, table

from minimind_ray.model.grammar import GrammarCompiler, new_bitmask, schema_grammar
from minimind_ray.model.sampling import apply_token_bitmask
from minimind_ray.serve.engine import Engine, GenRequest
from minimind_ray.tokenizer import resolve_tokenizer

SCHEMAS = json.loads((REPO / "tests" / "fixtures" / "structured_schemas.json").read_text())
FEATURES = {  # keyword -> a probe schema using it
    "type, properties, required": SCHEMAS["weather_args"],
    "additionalProperties: false": {"type": "object", "properties": {"a": {"type": "integer"}},
                                    "additionalProperties": False},
    "enum / const": {"type": "object", "properties": {"e": {"enum": [1, "x"]}, "c": {"const": 3}},
                     "required": ["e", "c"]},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}]},
    "$ref / $defs": {"$defs": {"n": {"type": "integer", "maximum": 5}}, "type": "array",
                     "items": {"$ref": "#/$defs/n"}, "maxItems": 3},
    "minLength / maxLength": {"type": "string", "minLength": 2, "maxLength": 4},
    "pattern": {"type": "string", "pattern": "^[a-c]{2,3}$"},
    "format: date": {"type": "string", "format": "date"},
    "minimum / maximum": {"type": "integer", "minimum": 3, "maximum": 7},
    "exclusiveMinimum": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "multipleOf": {"type": "integer", "multipleOf": 5, "maximum": 100},
    "minItems / maxItems": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3},
    "uniqueItems": {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}], "items": False},
    "patternProperties": {"type": "object", "patternProperties": {"^x": {"type": "integer"}},
                          "additionalProperties": False},
    "propertyNames": {"type": "object", "propertyNames": {"maxLength": 2}, "maxProperties": 2},
    "min/maxProperties": {"type": "object", "minProperties": 1, "maxProperties": 2},
    "if / then / else": {"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 9}, "else": {"minimum": 0}},
    "not": {"type": "integer", "not": {"const": 3}},
    "dependentRequired": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                          "dependentRequired": {"a": ["b"]}},
}
STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def tokenizers():
    import tempfile


    cache = tempfile.mkdtemp(prefix="bench-structured-")
    return {"minimind2": resolve_tokenizer("minimind2", cache), "builtin": resolve_tokenizer("builtin", cache)}


class LLG:
    name = "llguidance"

    def __init__(self, tok):
        import llguidance

        self.lib, self.tok = llguidance, llguidance.LLTokenizer(tok.to_json(), eos_token=tok.eos_id)
        self.eos, self.vocab = tok.eos_id, tok.vocab_size
        self.executor = llguidance.LLExecutor()

    def compile(self, schema):
        g = self.lib.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=dict(STYLE))
        m = self.lib.LLMatcher(self.tok, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, mask, i):
        row = mask[i]
        m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def fill_par(self, ms, mask):
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(ms)], mask.data_ptr(),
                                              mask.shape[1] * 4, mask.shape[0])

    def accept(self, m, t):
        return m.consume_token(t)

    def done(self, m):
        return m.is_stopped()


class XGR:
    name = "xgrammar"

    def __init__(self, tok):
        import xgrammar

        vocab = [tok.id_to_token(i) for i in range(tok.vocab_size)]
        info = xgrammar.TokenizerInfo(vocab, vocab_type=xgrammar.VocabType.BYTE_LEVEL, vocab_size=tok.vocab_size,
                                      stop_token_ids=[tok.eos_id])
        self.lib, self.eos, self.vocab = xgrammar, tok.eos_id, tok.vocab_size
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "),
                                                 strict_mode=False)

    def matcher(self, compiled):
        return self.lib.GrammarMatcher(compiled)

    def fill(self, m, mask, i):
        m.fill_next_token_bitmask(mask, i)

    fill_par = None

    def accept(self, m, t):
        return m.accept_token(t)

    def done(self, m):
        return m.is_terminated()


def allowed_ids(mask_row, vocab):
    import numpy as np

    bits = np.unpackbits(mask_row.numpy().view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits).tolist()


def walk(lib, compiled, rng, steps=200):
    """One random walk: (tokens, finished by the grammar)."""

    m, mask, out = lib.matcher(compiled), torch.full((1, (lib.vocab + 31) // 32), -1, dtype=torch.int32), []
    for _ in range(steps):
        lib.fill(m, mask, 0)
        ids = allowed_ids(mask[0], lib.vocab)
        if not ids:
            return out, False
        t = lib.eos if lib.eos in ids and rng.random() < 0.5 else rng.choice(ids)
        if t == lib.eos:
            lib.accept(m, t)
            return out, True
        if not lib.accept(m, t):
            return out, False
        out.append(t)
    return out, False


def mask_times(lib, compiled, batch: int, steps: int, par: bool) -> float:
    """µs per row-token of filling ``batch`` rows' masks, the walks restarting when they finish."""

    rng = random.Random(batch)
    ms = [lib.matcher(compiled) for _ in range(batch)]
    mask = torch.full((batch, (lib.vocab + 31) // 32), -1, dtype=torch.int32)
    spent = 0.0
    clock = time.perf_counter if par else time.thread_time  # the executor's threads are not this thread's CPU
    for _ in range(steps):
        t0 = clock()
        if par:
            lib.fill_par(ms, mask)
        else:
            for i, m in enumerate(ms):
                lib.fill(m, mask, i)
        spent += clock() - t0
        for i in range(batch):
            ids = allowed_ids(mask[i], lib.vocab)
            t = lib.eos if lib.eos in ids and rng.random() < 0.5 else rng.choice(ids)
            if t == lib.eos or not lib.accept(ms[i], t) or lib.done(ms[i]):
                ms[i] = lib.matcher(compiled)
    return spent / (steps * batch) * 1e6


def libraries(rounds: int) -> None:
    import jsonschema

    toks = tokenizers()
    libs = [LLG]
    try:
        import xgrammar  # noqa: F401
        libs.append(XGR)
    except ImportError:
        print("xgrammar is not installed: only llguidance is measured (see this script's docstring)")
    rows = []
    for tname, tok in toks.items():
        for cls in libs:
            t0 = time.perf_counter()
            lib = cls(tok)
            setup = (time.perf_counter() - t0) * 1e3
            for sname, schema in SCHEMAS.items():
                times = []
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    compiled = lib.compile(schema)
                    times.append((time.perf_counter() - t0) * 1e3)
                b1 = mask_times(lib, compiled, 1, 64, False)
                b16 = mask_times(lib, compiled, 16, 32, False)
                b16p = f"{mask_times(lib, compiled, 16, 32, True):.1f}" if lib.fill_par else "-"
                rows.append([tname, lib.name, f"{setup:.0f}", sname, f"{statistics.median(times):.2f}", f"{b1:.1f}",
                             f"{b16:.1f}", b16p])
    print(f"\n## grammar libraries on this CPU ({load()})\n")
    table(["tokenizer", "library", "tokenizer setup ms", "schema", "compile ms", "mask b1 µs/token",
           "mask b16 µs/token", "b16 par µs/token"], rows)
    feats = []
    tok = toks["minimind2"]
    insts = [cls(tok) for cls in libs]
    for feature, schema in FEATURES.items():
        row = [feature]
        for lib in insts:
            try:
                compiled = lib.compile(schema)
            except Exception as e:  # noqa: BLE001 - a refusal is the answer
                row.append("refused: " + str(e).strip().splitlines()[0][:50])
                continue
            rng, bad, finished = random.Random(7), 0, 0
            for _ in range(20):
                ids, ok = walk(lib, compiled, rng)
                if not ok:
                    continue
                finished += 1
                try:
                    jsonschema.validate(json.loads(tok.decode(ids)), schema)
                except (ValueError, jsonschema.ValidationError):
                    bad += 1
            row.append("yes" if finished and not bad else f"ignored ({bad}/{finished} invalid)" if bad else
                       "compiles (no walk finished)")
        feats.append(row)
    print("\n## JSON Schema features (minimind2 tokenizer; 20 random walks each, validated with jsonschema)\n")
    table(["feature"] + [lib.name for lib in insts], feats)


def decode(preset: str, steps: int, threads: int) -> None:


    torch.set_num_threads(threads)
    tok = tokenizers()["minimind2"]
    model = fresh_model(preset)
    grammars = GrammarCompiler(tok.to_json(), tok.eos_id, model.cfg.vocab_size)
    person = schema_grammar(SCHEMAS["person"])
    rows = []
    for mode in ("free", "constrained"):
        engine = Engine(model, eos_id=tok.eos_id, max_batch=16, context=256)
        prompt = tok.encode("<|im_start|>user\nWho is it?<|im_end|>\n<|im_start|>assistant\n")
        clean, marks, done, seeds = [], [], threading.Event(), iter(range(10 ** 6))

        def request():
            constraint = grammars.constraint(person) if mode == "constrained" else None
            return GenRequest(prompt_ids=prompt, max_new_tokens=64, on_event=on_event, temperature=1.0,
                              seed=next(seeds), constraint=constraint)

        def on_event(event):  # on the engine thread: its CPU clock
            s = engine.stats
            mark = (s.decode_steps, s.decode_rows, s.prefills)
            if not marks or marks[-1][0] != mark:
                if marks and mark[0] == marks[-1][0][0] + 1 and mark[1] - marks[-1][0][1] == 16 \
                        and mark[2] == marks[-1][0][2]:
                    clean.append(time.thread_time() - marks[-1][1])
                marks.append((mark, time.thread_time()))
            if event[0] == "end" and not done.is_set():
                engine.submit(request())
            if len(clean) >= steps:
                done.set()

        for _ in range(16):
            engine.submit(request())
        done.wait(600)
        engine.close()
        per_step = statistics.median(clean)
        rows.append([mode, len(clean), f"{per_step * 1e3:.2f}", f"{per_step / 16 * 1e3:.3f}"])
    ratio = float(rows[1][3]) / float(rows[0][3])
    rows[1].append(f"{ratio:.2f}x")
    rows[0].append("1.00x")
    print(f"\n## decode at batch 16, {preset}, {threads} thread(s) ({load()})\n")
    table(["rows", "clean steps", "CPU ms / step", "CPU ms / token", "vs free"], rows)
    mask_alone(grammars, person, model.cfg.vocab_size)


def mask_alone(grammars, grammar, vocab: int) -> None:
    """The constraint's own share: 16 rows' masks filled and applied, and 16 tokens advanced, per step."""


    rng = random.Random(0)
    rows = [grammars.constraint(grammar) for _ in range(16)]
    fill = apply = adv = 0.0
    n = 64
    for _ in range(n):
        t0 = time.thread_time()
        mask = new_bitmask(16, vocab)
        for i, r in enumerate(rows):
            r.fill(mask[i])
        t1 = time.thread_time()
        logits = apply_token_bitmask(torch.randn(16, vocab), mask)
        t2 = time.thread_time()
        picks = logits.argmax(-1).tolist() if rng.random() < 0 else [
            rng.choice(torch.isfinite(logits[i]).nonzero().flatten().tolist()) for i in range(16)]
        t3 = time.thread_time()
        for i, r in enumerate(rows):
            r.advance(picks[i])
            if r.complete or r.failed:
                rows[i] = grammars.constraint(grammar)
        adv += time.thread_time() - t3
        fill, apply = fill + t1 - t0, apply + t2 - t1
    print("\n## the constraint's share of a step at batch 16 (CPU ms per step)\n")
    table(["fill 16 masks", "apply to logits", "advance 16 matchers"],
          [[f"{fill / n * 1e3:.3f}", f"{apply / n * 1e3:.3f}", f"{adv / n * 1e3:.3f}"]])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--libraries", action="store_true")
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--preset", default="minimind2-small")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    both = not (args.libraries or args.decode)
    if args.libraries or both:
        libraries(args.rounds)
    if args.decode or both:
        decode(args.preset, args.steps, args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
