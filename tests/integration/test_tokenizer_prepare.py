"""`minimind-ray prepare data.tokenizer=minimind2` from an unrelated directory, with the tokenizer
fetched from a mirror (a copy of ../shared/minimind) on the shared Ray: the manifest carries the
tokenizer's hash, data prepared with minimind2 is refused for minimind3, and a tampered mirror
fails in one line before any data work."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from minimind_ray.cli import main
from minimind_ray.tokenizer import load_tokenizer
from minimind_ray.tokenizer_fetch import FILES, PINNED
from tests.conftest import cli_stderr, minimind_tokenizer_dir

pytestmark = pytest.mark.integration


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A fresh cwd, a fresh tokenizer cache and a mirror copied from ../shared/minimind."""
    for name in PINNED:
        (tmp_path / "mirror" / name).mkdir(parents=True)
        for f in FILES:
            (tmp_path / "mirror" / name / f).write_bytes((minimind_tokenizer_dir(name) / f).read_bytes())
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setenv("MINIMIND_RAY_TOKENIZER_MIRROR", str(tmp_path / "mirror"))
    monkeypatch.setenv("MINIMIND_RAY_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "pretrain.jsonl"
    data.write_text("".join(json.dumps({"text": f"第{i}条: MiniMind tokenizes text number {i}."},
                                       ensure_ascii=False) + "\n" for i in range(40)), encoding="utf-8")
    return tmp_path, data


def test_prepare_with_a_named_tokenizer_from_any_directory(ray_session, elsewhere, capsys):
    tmp_path, data = elsewhere
    common = ["data.format=pretrain", "data.max_seq_len=32", "cluster.num_workers=1"]
    assert main(["prepare", f"data.train_path=[{data}]", "data.tokenizer=minimind2", *common]) == 0
    manifests = list((tmp_path / "cwd" / "data_cache").glob("pretrain-*/manifest.json"))
    assert len(manifests) == 1
    manifest = json.loads(manifests[0].read_text())
    minimind2 = load_tokenizer(str(minimind_tokenizer_dir("minimind2"))).hash()
    assert manifest["tokenizer_hash"] == minimind2 and manifest["counts"]["records"] == 40
    assert Path(manifest["tokenizer_path"]) == tmp_path / "cache" / "tokenizers" / "minimind2"

    # a tampered mirror (and no cached copy) fails in one line naming the hash mismatch
    capsys.readouterr()
    bad = tmp_path / "mirror" / "minimind3" / "tokenizer.json"
    original = bad.read_bytes()
    bad.write_bytes(original.replace(b'"<|im_end|>"', b'"<|im_stop|>"', 1))
    assert main(["prepare", f"data.train_path=[{data}]", "data.tokenizer=minimind3", *common]) == 2
    err = cli_stderr(capsys)
    assert "\n" not in err and "sha256 mismatch" in err and str(bad) in err and "'minimind3'" in err
    assert not (tmp_path / "cache" / "tokenizers" / "minimind3").exists()

    # the prepared data, asked for with minimind3's (genuine) tokenizer: refused, naming both hashes
    bad.write_bytes(original)
    prepared = manifests[0].parent
    assert main(["prepare", f"data.train_path=[{prepared}]", "data.tokenizer=minimind3", *common]) == 2
    err = cli_stderr(capsys)
    minimind3 = load_tokenizer(str(minimind_tokenizer_dir("minimind3"))).hash()
    assert "\n" not in err and f"tokenizer hash {minimind2}" in err and f"has hash {minimind3}" in err
