"""A tokenizer whose vocabulary differs from the one ``train.init_from`` trained with is refused before Ray, in one
line naming data.tokenizer, unless ``data.allow_tokenizer_change=true`` (issue 54, item 6: it was a warning without the
[minimind-ray] prefix, and the run became <stage>-latest, so the next chained stage started from a broken model).
Another chat template over the same vocabulary is said, not refused. No Ray: the check is preflight's."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tokenizers

from minimind_ray.config import ConfigError, resolve_run
from minimind_ray.preflight import check_vocabulary
from minimind_ray.tokenizer import Tokenizer, load_tokenizer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_v1"


def _trained_with(tmp_path: Path, tokenizer: Tokenizer, record_vocabulary: bool) -> Path:
    """The fixture's checkpoint, its prepared data's manifest naming ``tokenizer`` (with its vocabulary's hash as data
    prepared since issue 54 records it, or without it, as before: then the tokenizer it names is read)."""
    ckpt, prepared = tmp_path / "checkpoint_step4", tmp_path / "prepared"
    shutil.copytree(FIXTURE / "checkpoint_step4", ckpt)
    prepared.mkdir()
    manifest = {"tokenizer_hash": tokenizer.hash(), "tokenizer_path": tokenizer.path,
                **({"tokenizer_vocab_hash": tokenizer.vocab_hash()} if record_vocabulary else {})}
    (prepared / "manifest.json").write_text(json.dumps(manifest))
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["prepared_dir"] = str(prepared)
    (ckpt / "meta.json").write_text(json.dumps(meta))
    complete = json.loads((ckpt / "COMPLETE.json").read_text())
    complete["files"]["meta.json"] = (ckpt / "meta.json").stat().st_size
    (ckpt / "COMPLETE.json").write_text(json.dumps(complete))
    return ckpt


def _cfg(ckpt: Path, *overrides):
    """The sft run from ``ckpt``, resolved (config.py:resolve_run: its architecture taken from the checkpoint)."""
    return resolve_run(None, ["data.train_path=[demo]", "train.stage=sft", f"data.tokenizer={FIXTURE / 'tokenizer'}",
                              f"train.init_from={ckpt}", *overrides])


def _variant(base: Tokenizer, extra_token: bool = False, template: str = "") -> Tokenizer:
    hf = tokenizers.Tokenizer.from_file(str(Path(base.path) / "tokenizer.json"))
    if extra_token:
        hf.add_tokens(["<|extra|>"])
    return Tokenizer(hf, {**base.config, **({"chat_template": template} if template else {})}, base.path)


@pytest.mark.parametrize("record_vocabulary", [True, False], ids=["recorded", "read from its path"])
def test_another_vocabulary_is_refused_unless_allowed_and_another_template_is_said(tmp_path, record_vocabulary):
    trained = load_tokenizer(str(FIXTURE / "tokenizer"))
    ckpt = _trained_with(tmp_path, trained, record_vocabulary)
    cfg = _cfg(ckpt)
    assert check_vocabulary(cfg, trained) == []  # the same tokenizer: nothing to say

    extended = _variant(trained, extra_token=True)
    with pytest.raises(ConfigError) as refused:
        check_vocabulary(cfg, extended)
    said = str(refused.value)
    assert said.startswith(f"data.tokenizer: train.init_from {ckpt} was trained with a vocabulary other than "), said
    assert "data.allow_tokenizer_change=true" in said and "\n" not in said, said

    allowed = check_vocabulary(_cfg(ckpt, "data.allow_tokenizer_change=true"), extended)
    assert len(allowed) == 1 and allowed[0].startswith("WARNING: train.init_from") and "trained anyway" in allowed[0]

    templated = _variant(trained, template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert templated.hash() != trained.hash() and templated.vocab_hash() == trained.vocab_hash()
    said = check_vocabulary(cfg, templated)
    assert len(said) == 1 and "has the vocabulary train.init_from" in said[0] and "another chat template" in said[0]


def test_a_vocabulary_no_longer_readable_is_refused_as_unknown(tmp_path):
    trained = load_tokenizer(str(FIXTURE / "tokenizer"))
    gone = tmp_path / "gone-tokenizer"
    shutil.copytree(FIXTURE / "tokenizer", gone)
    ckpt = _trained_with(tmp_path, load_tokenizer(str(gone)), record_vocabulary=False)
    shutil.rmtree(gone)
    with pytest.raises(ConfigError, match="its vocabulary unknown"):
        check_vocabulary(_cfg(ckpt), _variant(trained, extra_token=True))
