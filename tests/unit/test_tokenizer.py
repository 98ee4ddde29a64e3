"""Tokenizer: MiniMind's own tokenizers load and round-trip, our trained one has MiniMind's
layout, and chat templates render exactly what transformers would."""
from __future__ import annotations

import os
import pickle

import pytest

from minimind_ray.tokenizer import CHATML_TEMPLATE, Tokenizer, load_tokenizer, resolve_tokenizer, train_tokenizer
from tests.conftest import cli_stderr, minimind_tokenizer_dir

TEXTS = ["The capital of France is Paris.", "法国的首都是巴黎。", "Mixed 混合 text, 123 + 456 = 579!\n  indented"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "天气",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "你好！"}],
    [{"role": "system", "content": "You are MiniMind."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
     {"role": "assistant", "content": "Goodbye!"}],
    [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "北京天气？"},
     {"role": "assistant", "content": "",
      "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "北京"}}}]},
     {"role": "tool", "content": "{\"temp\": 20}"}, {"role": "tool", "content": "{\"wind\": 3}"},
     {"role": "assistant", "content": "20度。"}],
]


def _cases():
    """(messages, kwargs) pairs covering plain chat, system turns, tools and generation prompts."""
    out = [(c, {}) for c in CONVERSATIONS]
    out.append((CONVERSATIONS[2], {"tools": TOOLS}))
    out.append((CONVERSATIONS[0][:1], {"add_generation_prompt": True}))
    out.append((CONVERSATIONS[0][:1], {"add_generation_prompt": True, "enable_thinking": False}))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The builtin tokenizer, trained once on the demo corpus."""
    return resolve_tokenizer("builtin", str(tmp_path_factory.mktemp("cache")))


@pytest.mark.parametrize("generation", ["minimind2", "minimind3"])
def test_minimind_tokenizers_load_and_round_trip(generation):
    tok = load_tokenizer(str(minimind_tokenizer_dir(generation)))
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (6400, 0, 1, 2)
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.encode_batch([text, text]) == [ids, ids]
    # special tokens written in text are single ids (how chat text is tokenized)
    assert tok.encode("<|im_start|>user\n")[0] == 1 and tok.encode("<|im_end|>") == [2]
    assert tok.decode([1, *tok.encode("hi"), 2], skip_special_tokens=True) == "hi"


@pytest.mark.parametrize("generation", ["minimind2", "minimind3"])
def test_chat_template_renders_like_transformers(generation):
    transformers = pytest.importorskip("transformers")
    d = str(minimind_tokenizer_dir(generation))
    ours = load_tokenizer(d)
    theirs = transformers.AutoTokenizer.from_pretrained(d)
    for messages, kw in _cases():
        if generation == "minimind3" and "enable_thinking" in kw:
            kw = {**kw, "open_thinking": True}
        assert ours.apply_chat_template(messages, **kw) == theirs.apply_chat_template(messages, tokenize=False, **kw)


def test_builtin_template_renders_like_minimind2():
    minimind2 = load_tokenizer(str(minimind_tokenizer_dir("minimind2")))
    ours = Tokenizer(minimind2._hf, {**minimind2.config, "chat_template": CHATML_TEMPLATE})
    for messages, kw in _cases():
        assert ours.apply_chat_template(messages, **kw) == minimind2.apply_chat_template(messages, **kw)


def test_trained_tokenizer_has_minimind_layout(trained, tmp_path):
    assert trained.vocab_size == 6400
    assert [trained.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert (trained.pad_id, trained.bos_id, trained.eos_id) == (0, 1, 2)
    for text in TEXTS:
        assert trained.decode(trained.encode(text)) == text
    text = trained.apply_chat_template(CONVERSATIONS[0])
    assert text == ("<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n"
                    "<|im_start|>assistant\n你好！<|im_end|>\n")
    # the hash identifies content, not files: a saved copy and a pickled copy hash the same
    trained.save(str(tmp_path / "copy"))
    assert load_tokenizer(str(tmp_path / "copy")).hash() == trained.hash()
    assert pickle.loads(pickle.dumps(trained)).hash() == trained.hash()


def test_training_is_deterministic(tmp_path):
    from minimind_ray.data.demo import write_demo_corpus

    demo = list(write_demo_corpus(str(tmp_path / "demo"), n_pretrain=2000, n_sft=300, n_dpo=100).values())
    a = train_tokenizer(demo, str(tmp_path / "a"), vocab_size=1000)
    b = train_tokenizer(demo, str(tmp_path / "b"), vocab_size=1000)
    assert a.vocab_size == 1000 and a.hash() == b.hash()


def test_builtin_is_trained_once_then_reused(trained):
    stamp = os.path.getmtime(os.path.join(trained.path, "tokenizer.json"))
    assert resolve_tokenizer("builtin", os.path.dirname(trained.path)).hash() == trained.hash()
    assert os.path.getmtime(os.path.join(trained.path, "tokenizer.json")) == stamp


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    from minimind_ray.data.demo import write_demo_corpus

    return write_demo_corpus(str(tmp_path_factory.mktemp("corpus")), n_pretrain=300, n_sft=50, n_dpo=20)["pretrain"]


@pytest.mark.parametrize("out_is_cwd", [False, True], ids=["dir", "dot"])
def test_train_tokenizer_refuses_a_directory_holding_a_users_files(small_corpus, tmp_path, monkeypatch, capsys,
                                                                   out_is_cwd):
    from minimind_ray.cli import main

    out = tmp_path / "work"
    out.mkdir()
    (out / "notes.txt").write_text("a user's file")
    (out / "tokenizer.json").write_text("not ours to replace here")
    if out_is_cwd:
        monkeypatch.chdir(out)
    assert main(["train-tokenizer", "--data", small_corpus, "--out", "." if out_is_cwd else str(out),
                 "--vocab-size", "400"]) == 2
    err = cli_stderr(capsys)
    assert "\n" not in err and f"{out} is not empty and not a tokenizer directory (it holds notes.txt)" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "tokenizer.json"]
    assert (out / "notes.txt").read_text() == "a user's file"
    assert (out / "tokenizer.json").read_text() == "not ours to replace here"


def test_train_tokenizer_writes_into_new_empty_or_tokenizer_directories(small_corpus, tmp_path):
    new = train_tokenizer([small_corpus], str(tmp_path / "new" / "tok"), vocab_size=400)
    (tmp_path / "empty").mkdir()
    empty = train_tokenizer([small_corpus], str(tmp_path / "empty"), vocab_size=400)
    again = train_tokenizer([small_corpus], str(tmp_path / "new" / "tok"), vocab_size=400)  # a tokenizer dir
    assert new.hash() == empty.hash() == again.hash()
    for d in (tmp_path / "new" / "tok", tmp_path / "empty"):
        assert sorted(p.name for p in d.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
        assert load_tokenizer(str(d)).hash() == new.hash()
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["tok"]  # no temporary directory left behind
