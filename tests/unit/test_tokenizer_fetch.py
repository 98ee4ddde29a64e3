"""MiniMind's tokenizers by name: fetched through a mirror (../shared/minimind, as a directory
and over HTTP) by the real fetch code, verified against the pinned sha256, cached whole or
not at all; failures are one line naming the name, the URL and the cause."""
from __future__ import annotations

import functools
import hashlib
import http.server
import os
import shutil
import threading
from pathlib import Path

import pytest

from minimind_ray import tokenizer_fetch
from minimind_ray.cli import main
from minimind_ray.config import ConfigError, load_config
from minimind_ray.tokenizer import load_tokenizer, resolve_tokenizer
from minimind_ray.tokenizer_fetch import FILES, PINNED, TokenizerFetchError, fetch_to, fetch_tokenizer
from tests.conftest import cli_stderr, TEST_CACHE_DIR, minimind_tokenizer_dir


@pytest.fixture
def mirror(tmp_path):
    """A writable copy of ../shared/minimind laid out as <name>/<file>, as a user's mirror would be."""
    for name in PINNED:
        src = minimind_tokenizer_dir(name)
        (tmp_path / "mirror" / name).mkdir(parents=True)
        for f in FILES:
            (tmp_path / "mirror" / name / f).write_bytes((src / f).read_bytes())
    return tmp_path / "mirror"


def _leftovers(cache: Path):
    """Everything in the tokenizers cache except finished tokenizer directories."""
    d = cache / "tokenizers"
    return sorted(p.name for p in d.iterdir() if p.name not in PINNED) if d.exists() else []


def test_pins_are_the_hashes_of_minimind_files_and_urls_name_the_commit():
    for name, pin in PINNED.items():
        d = minimind_tokenizer_dir(name)
        assert {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in FILES} == pin.sha256
        assert len(pin.commit) == 40
        assert tokenizer_fetch.source_url(name, "tokenizer.json", None) == \
            f"https://raw.githubusercontent.com/jingyaogong/minimind/{pin.commit}/model/tokenizer.json"
    assert tokenizer_fetch.source_url("minimind3", "tokenizer.json", "http://host/m/") == \
        "http://host/m/minimind3/tokenizer.json"


@pytest.mark.parametrize("name", sorted(PINNED))
def test_a_name_is_fetched_from_the_mirror_into_the_cache(name, mirror, tmp_path):
    d = fetch_tokenizer(name, cache_dir=str(tmp_path / "cache"), mirror=str(mirror))
    assert Path(d) == tmp_path / "cache" / "tokenizers" / name
    for f in FILES:
        assert (Path(d) / f).read_bytes() == (minimind_tokenizer_dir(name) / f).read_bytes()
    assert load_tokenizer(d).hash() == load_tokenizer(str(minimind_tokenizer_dir(name))).hash()
    assert _leftovers(tmp_path / "cache") == []
    # once cached, the mirror is no longer needed
    shutil.rmtree(mirror)
    assert fetch_tokenizer(name, cache_dir=str(tmp_path / "cache"), mirror=str(mirror)) == d


def test_resolve_by_name_and_auto_use_the_environment_mirror_and_cache():
    # conftest points MINIMIND_RAY_TOKENIZER_MIRROR at ../shared/minimind and the cache at a session dir
    want = {name: load_tokenizer(str(minimind_tokenizer_dir(name))).hash() for name in PINNED}
    assert want["minimind2"] != want["minimind3"]
    for name in PINNED:
        tok = resolve_tokenizer(name, "unused-cache-dir")
        assert tok.hash() == want[name]
        assert Path(tok.path) == Path(TEST_CACHE_DIR) / "tokenizers" / name
        assert resolve_tokenizer("auto", "unused-cache-dir", generation=name).hash() == want[name]
    with pytest.raises(ValueError, match="'auto' means the tokenizer of model.generation"):
        resolve_tokenizer("auto", "unused-cache-dir")


def test_tampered_file_is_refused_in_one_line_and_nothing_is_cached(mirror, tmp_path):
    bad = mirror / "minimind2" / "tokenizer_config.json"
    bad.write_bytes(bad.read_bytes().replace(b"<|im_end|>", b"<|im_fin|>", 1))
    with pytest.raises(TokenizerFetchError) as e:
        fetch_tokenizer("minimind2", cache_dir=str(tmp_path / "cache"), mirror=str(mirror))
    msg = str(e.value)
    assert "\n" not in msg and "'minimind2'" in msg and "sha256 mismatch" in msg and str(bad) in msg
    assert PINNED["minimind2"].sha256["tokenizer_config.json"] in msg
    assert not (tmp_path / "cache" / "tokenizers" / "minimind2").exists() and _leftovers(tmp_path / "cache") == []


def test_missing_file_in_the_mirror_names_it(mirror, tmp_path):
    (mirror / "minimind3" / "tokenizer_config.json").unlink()
    with pytest.raises(TokenizerFetchError) as e:
        fetch_tokenizer("minimind3", cache_dir=str(tmp_path / "cache"), mirror=str(mirror))
    msg = str(e.value)
    assert "\n" not in msg and "'minimind3'" in msg and "file not found" in msg
    assert str(mirror / "minimind3" / "tokenizer_config.json") in msg
    assert not (tmp_path / "cache" / "tokenizers" / "minimind3").exists() and _leftovers(tmp_path / "cache") == []


def test_no_network_is_one_line_with_the_way_out(tmp_path):
    url = "http://127.0.0.1:9/"  # the discard port: nothing listens
    with pytest.raises(TokenizerFetchError) as e:
        fetch_tokenizer("minimind2", cache_dir=str(tmp_path / "cache"), mirror=url)
    msg = str(e.value)
    assert "\n" not in msg and "'minimind2'" in msg and f"{url}minimind2/tokenizer.json" in msg
    assert "no network or server unreachable" in msg
    assert "MINIMIND_RAY_TOKENIZER_MIRROR" in msg and "minimind-ray fetch-tokenizer minimind2" in msg
    assert not (tmp_path / "cache").exists() or _leftovers(tmp_path / "cache") == []


@pytest.fixture
def http_mirror(mirror):
    """The mirror served over HTTP on a free local port."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(mirror))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def test_http_mirror_is_fetched_and_a_404_is_named(http_mirror, mirror, tmp_path):
    d = fetch_tokenizer("minimind3", cache_dir=str(tmp_path / "cache"), mirror=http_mirror)
    assert load_tokenizer(d).hash() == load_tokenizer(str(minimind_tokenizer_dir("minimind3"))).hash()
    shutil.rmtree(mirror / "minimind2")
    with pytest.raises(TokenizerFetchError, match=r"minimind2/tokenizer.json: file not found \(HTTP 404\)"):
        fetch_tokenizer("minimind2", cache_dir=str(tmp_path / "cache"), mirror=http_mirror)


def test_damaged_cache_is_fetched_again(mirror, tmp_path):
    d = Path(fetch_tokenizer("minimind2", cache_dir=str(tmp_path / "cache"), mirror=str(mirror)))
    (d / "tokenizer.json").write_text("{}")
    assert fetch_tokenizer("minimind2", cache_dir=str(tmp_path / "cache"), mirror=str(mirror)) == str(d)
    assert (d / "tokenizer.json").read_bytes() == (mirror / "minimind2" / "tokenizer.json").read_bytes()
    assert _leftovers(tmp_path / "cache") == []


def test_cache_root_follows_the_environment():
    assert tokenizer_fetch.cache_root({"MINIMIND_RAY_CACHE_DIR": "/x/y", "XDG_CACHE_HOME": "/z"}) == "/x/y"
    assert tokenizer_fetch.cache_root({"XDG_CACHE_HOME": "/z"}) == "/z/minimind-ray"
    assert tokenizer_fetch.cache_root({}) == os.path.join(os.path.expanduser("~"), ".cache", "minimind-ray")


def test_fetch_tokenizer_verb_writes_a_mirror_and_keeps_other_files(mirror, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MINIMIND_RAY_TOKENIZER_MIRROR", str(mirror))
    monkeypatch.setenv("MINIMIND_RAY_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "out"
    assert main(["fetch-tokenizer", "minimind3", "--out", str(out)]) == 0
    assert main(["fetch-tokenizer", "minimind3", "--out", str(out)]) == 0  # again: same files, nothing to do
    for f in FILES:
        assert (out / "minimind3" / f).read_bytes() == (minimind_tokenizer_dir("minimind3") / f).read_bytes()
    # what it wrote is a mirror in its own right
    d = fetch_tokenizer("minimind3", cache_dir=str(tmp_path / "cache2"), mirror=str(out))
    assert load_tokenizer(d).hash() == load_tokenizer(str(minimind_tokenizer_dir("minimind3"))).hash()
    # a different file already at the target is a user's: refused, untouched
    (out / "minimind2").mkdir()
    (out / "minimind2" / "tokenizer.json").write_text("mine")
    capsys.readouterr()
    assert main(["fetch-tokenizer", "minimind2", "--out", str(out)]) == 2
    err = cli_stderr(capsys)
    assert "\n" not in err and str(out / "minimind2" / "tokenizer.json") in err and "refusing to overwrite" in err
    assert (out / "minimind2" / "tokenizer.json").read_text() == "mine"


def test_fetch_to_refuses_an_unknown_name(tmp_path):
    with pytest.raises(TokenizerFetchError, match="unknown name"):
        fetch_to("minimind1", str(tmp_path))


def test_config_default_is_auto_and_unknown_tokenizers_are_refused(tmp_path):
    assert load_config(None, ["data.train_path=[demo]"]).data.tokenizer == "auto"
    assert load_config(None, ["data.train_path=[demo]", "data.tokenizer=minimind3"]).data.tokenizer == "minimind3"
    assert load_config(None, ["data.train_path=[demo]", f"data.tokenizer={tmp_path}"]).data.tokenizer == str(tmp_path)
    with pytest.raises(ConfigError, match="data.tokenizer: 'minimind' is neither a tokenizer name"):
        load_config(None, ["data.train_path=[demo]", "data.tokenizer=minimind"])
