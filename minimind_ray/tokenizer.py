"""Tokenizers: load MiniMind's (or any HF ``tokenizer.json``), train one, render chat.

Built on HF ``tokenizers`` (the Rust BPE) plus ``jinja2`` for chat templates, so the
data pipeline and the training workers never import ``transformers``. The jinja
environment mirrors the one ``transformers`` uses (sandboxed, ``trim_blocks``,
``lstrip_blocks``, a ``tojson`` that keeps non-ASCII text), so a template renders the
same string here as in ``AutoTokenizer.apply_chat_template``; tests check this against
MiniMind's own templates.

``data.tokenizer`` names a tokenizer (:func:`resolve_tokenizer`): ``auto`` (MiniMind's tokenizer
of the model's generation, the default), ``minimind2`` / ``minimind3`` (MiniMind's own, fetched
by name and sha256-checked, see :mod:`minimind_ray.tokenizer_fetch`), ``builtin`` (trained on
the demo corpus) or a directory.

A tokenizer is identified by :meth:`Tokenizer.hash`: prepared data records it in its
manifest, and training refuses prepared data made with a different tokenizer (token
ids would silently mean different things).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from datetime import datetime
from typing import Iterator, List, Optional

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from minimind_ray.data.demo import write_demo_corpus
from minimind_ray.data.sources import iter_records, resolve_sources
from minimind_ray.fsio import atomic_write, exists, is_uri, join, local_copy, upload_dir, write_json_atomic
from minimind_ray.tokenizer_fetch import PINNED, cache_root, fetch_tokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2: MiniMind's layout
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # all a tokenizer directory holds

# ChatML as MiniMind2 renders it: a system turn always comes first (a default one when the
# conversation has none and no tools are given); tools are listed inside the system turn;
# assistant tool calls are <tool_call> JSON blocks; consecutive tool results form one user
# turn of <tool_response> blocks. Written for this project; its output matches MiniMind2's
# template string for string (tests/unit/test_tokenizer.py).
CHATML_TEMPLATE = r"""
{%- set first_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if first_system -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif first_system -%}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- else -%}
    {{- '<|im_start|>system\nYou are a helpful assistant<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
    {%- set content = m.content if m.content is string else '' -%}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}
        {{- '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' -}}
    {%- elif m.role == 'assistant' -%}
        {{- '<|im_start|>assistant\n' + content -}}
        {%- for call in (m.tool_calls or []) -%}
            {%- set call = call.function if call.function else call -%}
            {%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' -}}
            {{- call.arguments if call.arguments is string else (call.arguments | tojson) -}}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif m.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
""".strip()


def _token_name(value) -> Optional[str]:
    """tokenizer_config.json stores special tokens as strings or AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _compile(template: str):
    """A sandboxed jinja environment configured like transformers' chat templating."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


class Tokenizer:
    """A HF ``tokenizers.Tokenizer`` plus its ``tokenizer_config.json``.

    ``encode`` never adds special tokens: the formats add bos/eos themselves (MiniMind's
    pretrain rule) and chat text already contains them. Special tokens written in the
    text (``<|im_start|>``) are still recognised as single ids, as in MiniMind.
    Picklable (it travels to Ray Data tasks as its JSON).
    """

    def __init__(self, hf: tokenizers.Tokenizer, config: dict, path: str = ""):
        self._hf = hf
        self.config = dict(config)
        self.path = path
        self.source = path  # where it was loaded from for other machines to load it too: a URI, or ``path``
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        self.bos_token = _token_name(self.config.get("bos_token")) or SPECIAL_TOKENS[1]
        self.eos_token = _token_name(self.config.get("eos_token")) or SPECIAL_TOKENS[2]
        self.pad_token = _token_name(self.config.get("pad_token")) or SPECIAL_TOKENS[0]
        ids = {name: hf.token_to_id(name) for name in (self.bos_token, self.eos_token, self.pad_token)}
        unknown = [name for name, i in ids.items() if i is None]
        if unknown:
            raise ValueError(f"tokenizer {path or '(in memory)'}: special tokens {unknown} are not in its vocabulary")
        self.bos_id: int = ids[self.bos_token]
        self.eos_id: int = ids[self.eos_token]
        self.pad_id: int = ids[self.pad_token]
        template = self.config.get("chat_template")
        if isinstance(template, list):  # HF's named-template form
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: Optional[str] = template
        self._compiled = None
        self._hash: Optional[str] = None

    # pickling: the Rust object serialises as its JSON; the compiled template is rebuilt lazily
    def __getstate__(self):
        return {"json": self.to_json(), "config": self.config, "path": self.path, "source": self.source}

    def __setstate__(self, state):
        self.__init__(tokenizers.Tokenizer.from_str(state["json"]), state["config"], state["path"])
        self.source = state.get("source", self.path)

    def to_json(self) -> str:
        """The HF tokenizers JSON of the vocabulary, merges and added tokens (structured output's grammar compiler
        reads it: model/grammar.py)."""
        return self._hf.to_str()

    def encode(self, text: str) -> List[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: List[str]) -> List[List[int]]:
        """Batch encoding (Rust; parallel unless TOKENIZERS_PARALLELISM=false). Offsets are not
        computed (``encode_batch_fast``): nothing here needs them and they cost time."""
        return [e.ids for e in self._hf.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> Optional[str]:
        """The vocabulary's own spelling of one token (byte-level BPE: 'Ġ' for a space), None past the vocabulary."""
        return self._hf.id_to_token(int(token_id))

    def token_bytes(self) -> List[int]:
        """The UTF-8 bytes each id spells, by id: what bits per byte divides by (engine/evaluate.py). A byte-level BPE
        token's characters stand for one byte each (GPT-2's byte-to-unicode alphabet: MiniMind's tokenizers); a
        special token spells none (markup, not text); any other added token its own text (``<think>``)."""
        byte_level = set(pre_tokenizers.ByteLevel.alphabet())
        added = self._hf.get_added_tokens_decoder()
        out = []
        for i in range(self.vocab_size):
            if i in added:
                out.append(0 if added[i].special else len(added[i].content.encode("utf-8")))
                continue
            token = self._hf.id_to_token(i) or ""
            out.append(len(token) if set(token) <= byte_level else len(self.decode([i]).encode("utf-8")))
        return out

    def apply_chat_template(self, messages: List[dict], add_generation_prompt: bool = False, **kw) -> str:
        """Render a conversation to text. ``kw`` reaches the template as variables: ``tools``,
        ``enable_thinking`` (MiniMind2), ``open_thinking`` (minimind-3), ...; the special
        token strings are available as ``bos_token`` etc., as in transformers."""
        if not self.chat_template:
            raise ValueError(f"tokenizer {self.path or '(in memory)'} has no chat_template in tokenizer_config.json")
        if self._compiled is None:
            self._compiled = _compile(self.chat_template)
        special = {k: _token_name(v) for k, v in self.config.items()
                   if k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **{"tools": None, **special, **kw})

    def hash(self) -> str:
        """sha256 of the canonical tokenizer JSON, the chat template and the bos/eos/pad names:
        everything that decides which ids a text becomes. Independent of file formatting, so a
        saved copy hashes the same as its original."""
        if self._hash is None:
            canon = json.dumps(json.loads(self._hf.to_str()), sort_keys=True, ensure_ascii=False,
                               separators=(",", ":"))
            h = hashlib.sha256(canon.encode())
            for part in (self.chat_template or "", self.bos_token, self.eos_token, self.pad_token):
                h.update(b"\0" + part.encode())
            self._hash = h.hexdigest()
        return self._hash

    def vocab_hash(self) -> str:
        """sha256 of the vocabulary alone (every token and its id, added tokens included): what a model's embedding
        rows mean. Two tokenizers that differ only in their chat template or special-token names have the same."""
        vocab = sorted(self._hf.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        return hashlib.sha256(json.dumps(vocab, ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()

    def save(self, out_dir: str) -> None:
        """tokenizer.json + tokenizer_config.json (with the chat template): loadable here and by
        ``transformers.AutoTokenizer``. Each file is written atomically; nothing else in
        ``out_dir`` is touched."""
        os.makedirs(out_dir, exist_ok=True)
        atomic_write(os.path.join(out_dir, "tokenizer.json"), lambda tmp: self._hf.save(tmp))
        config = dict(self.config)
        if self.chat_template:
            config["chat_template"] = self.chat_template
        write_json_atomic(os.path.join(out_dir, "tokenizer_config.json"), config, indent=2)

    def __repr__(self) -> str:
        return f"Tokenizer(path={self.path!r}, vocab_size={self.vocab_size}, hash={self.hash()[:12]})"


def load_tokenizer(path_or_dir: str) -> Tokenizer:
    """Load a directory holding tokenizer.json (+ tokenizer_config.json), or a tokenizer.json.

    Without a tokenizer_config.json, MiniMind's special-token names are assumed and there
    is no chat template (SFT/DPO data then cannot be rendered).
    """
    if is_uri(path_or_dir):  # a tokenizer in a bucket: this node's own copy (the tokenizers library reads files)
        uri = str(path_or_dir)
        uri = uri.rsplit("/", 1)[0] if uri.endswith(".json") else uri
        tok = load_tokenizer(local_copy(uri, TOKENIZER_FILES, cache_root()))
        tok.source = uri  # what a manifest records: every node can load it (the local copy is this node's)
        return tok
    path = os.path.abspath(path_or_dir)
    d = os.path.dirname(path) if path.endswith(".json") else path
    tj = path if path.endswith(".json") else os.path.join(d, "tokenizer.json")
    if not os.path.exists(tj):
        raise FileNotFoundError(f"data.tokenizer: no tokenizer.json at {tj} (data.tokenizer is a tokenizer "
                                f"directory or one of {', '.join(TOKENIZER_NAMES)})")
    config = {}
    cfg_path = os.path.join(d, "tokenizer_config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            config = json.load(f)
    return Tokenizer(tokenizers.Tokenizer.from_file(tj), config, d)


def _minimind_config() -> dict:
    """tokenizer_config.json in MiniMind2's layout, so transformers loads it the same way."""
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    return {
        "add_bos_token": False, "add_eos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": added, "additional_special_tokens": [],
        "bos_token": SPECIAL_TOKENS[1], "eos_token": SPECIAL_TOKENS[2], "pad_token": SPECIAL_TOKENS[0],
        "unk_token": SPECIAL_TOKENS[0], "clean_up_tokenization_spaces": False, "legacy": True,
        "model_max_length": 32768, "spaces_between_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML_TEMPLATE,
    }


def _corpus_texts(files: List[str]) -> Iterator[str]:
    """Texts of every record, streamed file by file: pretrain ``text``, the message contents
    of ``conversations`` / ``chosen`` / ``rejected``. Unparseable lines are skipped here;
    ``prepare`` is where bad records are counted."""
    def texts_of(rec):
        if not isinstance(rec, dict):
            return
        if isinstance(rec.get("text"), str):
            yield rec["text"]
        for key in ("conversations", "chosen", "rejected"):
            msgs = rec.get(key)
            if isinstance(msgs, list):
                parts = [m["content"] for m in msgs if isinstance(m, dict) and isinstance(m.get("content"), str)]
                if parts:
                    yield "\n".join(parts)

    sources, missing = resolve_sources(files)
    if missing:
        raise FileNotFoundError(f"train_tokenizer: no data at {missing}")
    for sf in sources:
        for item in iter_records(sf):
            try:
                rec = json.loads(item) if isinstance(item, bytes) else item
            except ValueError:
                continue
            yield from texts_of(rec)


def check_output_dir(out_dir: str) -> None:
    """Refuse to write a tokenizer into a directory that holds anything but a tokenizer's own
    files: ``train-tokenizer --out .`` must never touch a user's files."""
    if not os.path.lexists(out_dir):
        return
    if not os.path.isdir(out_dir):
        raise ValueError(f"tokenizer output {out_dir} exists and is not a directory; choose a new or empty directory")
    others = sorted(set(os.listdir(out_dir)) - set(TOKENIZER_FILES))
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise ValueError(f"tokenizer output {out_dir} is not empty and not a tokenizer directory (it holds {shown}); "
                         f"choose a new or empty directory")


def train_tokenizer(jsonl_files: List[str], out_dir: str, vocab_size: int = 6400) -> Tokenizer:
    """Train a MiniMind-style ByteLevel BPE: special tokens <|endoftext|>=0, <|im_start|>=1,
    <|im_end|>=2, then the 256 byte symbols, then merges up to ``vocab_size``.

    The corpus is streamed (an iterator over the files), never held in memory. The
    result gets the ChatML template and a MiniMind2-layout tokenizer_config.json.

    ``out_dir`` must be new, empty, or a tokenizer directory (checked before training, see
    :func:`check_output_dir`); only ``tokenizer.json`` and ``tokenizer_config.json`` are
    written there. A new directory appears complete or not at all (written beside it, then
    renamed); in an existing one each of the two files is replaced atomically.
    """
    out_dir = os.path.abspath(out_dir)
    check_output_dir(out_dir)
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(_corpus_texts(jsonl_files), trainer=trainer)
    for i, tok in enumerate(SPECIAL_TOKENS):
        assert hf.token_to_id(tok) == i, f"{tok} should have id {i}"
    if hf.get_vocab_size() < vocab_size:
        warnings.warn(f"train_tokenizer: the corpus only supports {hf.get_vocab_size()} tokens (< {vocab_size})")
    tok = Tokenizer(hf, _minimind_config(), out_dir)
    if os.path.isdir(out_dir):
        tok.save(out_dir)
        return tok
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tokenizer-", dir=parent)
    try:
        tok.save(tmp)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


TOKENIZER_NAMES = ("auto", "builtin", *PINNED)  # what data.tokenizer accepts besides a directory


def resolve_tokenizer(spec: str, cache_dir: str, generation: Optional[str] = None) -> Tokenizer:
    """The tokenizer ``data.tokenizer`` names; the one function the driver, ``prepare`` and the
    inference verbs resolve it with.

    - ``'auto'``: MiniMind's tokenizer of the model's ``generation`` (``minimind2`` or ``minimind3``);
    - ``'minimind2'`` / ``'minimind3'``: MiniMind's own, fetched once and sha256-checked
      (:mod:`minimind_ray.tokenizer_fetch`);
    - ``'builtin'``: the tokenizer trained on the demo corpus, trained once into
      ``cache_dir/tokenizer-builtin`` and reused after;
    - anything else: a directory (or tokenizer.json) for :func:`load_tokenizer`.
    """
    if spec == "auto":
        if generation not in PINNED:
            raise ValueError(f"data.tokenizer: 'auto' means the tokenizer of model.generation, "
                             f"but the generation is {generation!r} (one of {', '.join(PINNED)})")
        spec = generation
    if spec in PINNED:
        return load_tokenizer(fetch_tokenizer(spec))
    if spec != "builtin":
        return load_tokenizer(spec)
    if is_uri(cache_dir):  # data.cache_dir in a bucket: the tokenizer lives there too, for every node to read
        return _builtin_in_bucket(join(cache_dir, "tokenizer-builtin"), join(cache_dir, "demo"))
    out = os.path.join(os.path.abspath(cache_dir), "tokenizer-builtin")
    if os.path.exists(os.path.join(out, "tokenizer_config.json")):
        return load_tokenizer(out)

    demo = write_demo_corpus(os.path.join(os.path.abspath(cache_dir), "demo"))
    return train_tokenizer([demo["pretrain"], demo["sft"], demo["dpo"]], out)


def _builtin_in_bucket(out: str, demo_dir: str) -> Tokenizer:
    """The builtin tokenizer at a URI: trained once (into a local temporary directory, uploaded with
    tokenizer_config.json last: its presence says the pair is whole), then read by every node from the bucket.
    (Before, ``os.path.abspath`` of an ``s3://`` cache made a local ``./s3:/...`` folder on the driver.)"""
    if not exists(join(out, "tokenizer_config.json")):
        demo = write_demo_corpus(demo_dir)
        with tempfile.TemporaryDirectory(prefix="mmr-tokenizer-") as tmp:
            train_tokenizer([demo["pretrain"], demo["sft"], demo["dpo"]], os.path.join(tmp, "tok"))
            upload_dir(os.path.join(tmp, "tok"), out, TOKENIZER_FILES)
    return load_tokenizer(out)
