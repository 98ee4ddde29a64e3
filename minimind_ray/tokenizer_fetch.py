"""MiniMind's tokenizers by name: fetched once from MiniMind's repository at a pinned commit,
checked against pinned sha256 digests, kept in a per-user cache.

``data.tokenizer=minimind2`` (or ``minimind3``) resolves here. The repository holds no copy
of MiniMind's files; each file comes from one of:

- ``$MINIMIND_RAY_TOKENIZER_MIRROR`` when it is set: a local directory, an ``http(s)://``
  prefix or any pyarrow URI (``s3://``, ``gs://``, ``file://``), laid out as
  ``<name>/tokenizer.json`` and ``<name>/tokenizer_config.json``. This is for clusters
  without internet; ``minimind-ray fetch-tokenizer NAME --out DIR`` makes such a directory.
- otherwise ``raw.githubusercontent.com/jingyaogong/minimind/<commit>/model/<file>``.

Either way a file is used only if its sha256 is the pinned one, so a mirror cannot
substitute another tokenizer. The cache is ``$MINIMIND_RAY_CACHE_DIR/tokenizers/<name>``
(default ``$XDG_CACHE_HOME/minimind-ray``, else ``~/.cache/minimind-ray``). A fetch writes
into a temporary directory beside it and renames it into place only once every file has
verified, so the cache never holds half a tokenizer. A cached copy is re-verified on every
use (two files, about a millisecond) and fetched again if it was damaged.

Only the driver resolves a tokenizer (workers receive it pickled), so only the driver
needs the network or the mirror.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

MIRROR_ENV = "MINIMIND_RAY_TOKENIZER_MIRROR"
CACHE_ENV = "MINIMIND_RAY_CACHE_DIR"
FILES = ("tokenizer.json", "tokenizer_config.json")
RAW_URL = "https://raw.githubusercontent.com/jingyaogong/minimind/{commit}/model/{file}"
HTTP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class PinnedTokenizer:
    """One of MiniMind's tokenizers: where it lives in MiniMind's history and what its files hash to."""

    name: str
    commit: str  # full 40-hex commit of github.com/jingyaogong/minimind
    sha256: Dict[str, str]  # file name -> hex digest


PINNED: Dict[str, PinnedTokenizer] = {p.name: p for p in (
    PinnedTokenizer("minimind2", "83e52f6a2720a125e52a9aa838397093e472f9f0", {
        "tokenizer.json": "d98595c6aef70d95f72748582fb9b4f53d76dd58c1ae1dd702ad7c84e1caf5e4",
        "tokenizer_config.json": "57edb808531fc23ff7c182a849c68a349c108d01bc4b6dbb5a6116785b85e562"}),
    PinnedTokenizer("minimind3", "d65ef2c00ebc6082f9df11541e1b191655eddb00", {
        "tokenizer.json": "71f32c68cf63a15355a8fc171b7594b3d41870fe0ddb54fc6aefa55f73a4a668",
        "tokenizer_config.json": "d7cd6a60c9f191c4f9ffec69b2eb289ad2f960366724f328b681ae1e46e4c110"}),
)}


class TokenizerFetchError(ValueError):
    """A named tokenizer could not be fetched or did not verify. The message is one line naming
    the tokenizer, the URL and the cause (a ValueError, so the CLI prints it without a traceback)."""


def cache_root(environ: Mapping[str, str] = os.environ) -> str:
    """minimind-ray's per-user cache: $MINIMIND_RAY_CACHE_DIR, else $XDG_CACHE_HOME/minimind-ray,
    else ~/.cache/minimind-ray."""
    if environ.get(CACHE_ENV):
        return os.path.abspath(os.path.expanduser(environ[CACHE_ENV]))
    xdg = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(xdg), "minimind-ray")


def mirror_from_env(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    return environ.get(MIRROR_ENV, "").strip() or None


def _pin(name: str) -> PinnedTokenizer:
    if name not in PINNED:
        raise TokenizerFetchError(f"tokenizer {name!r}: unknown name; MiniMind's tokenizers are {', '.join(PINNED)}")
    return PINNED[name]


def source_url(name: str, file: str, mirror: Optional[str]) -> str:
    """Where ``file`` of tokenizer ``name`` is read from: the mirror's ``<name>/<file>`` or GitHub."""
    if mirror:
        from minimind_ray import fsio  # lazy: pyarrow, only when this runs

        return fsio.join(mirror, f"{name}/{file}")
    return RAW_URL.format(commit=_pin(name).commit, file=file)


def _one_line(x) -> str:
    return " ".join(str(x).split())


def _read(name: str, url: str, mirror: Optional[str]) -> bytes:
    """The bytes at ``url``, or a TokenizerFetchError saying why not."""
    where = f"the mirror {mirror} ({MIRROR_ENV})" if mirror else "GitHub"
    offline_hint = (f"; offline? set {MIRROR_ENV} to a directory or URL holding {name}/tokenizer.json, "
                    f"or pre-fetch with `minimind-ray fetch-tokenizer {name} --out DIR`")
    missing_hint = f"; {where} must hold {name}/tokenizer.json and {name}/tokenizer_config.json"
    try:
        if url.startswith(("http://", "https://")):
            with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as r:
                return r.read()
        from minimind_ray import fsio  # lazy: pyarrow, only when this runs

        fs, path = fsio.filesystem(url)
        with fs.open_input_stream(path) as f:
            return f.read()
    except urllib.error.HTTPError as e:
        cause = "file not found (HTTP 404)" if e.code == 404 else f"HTTP {e.code} {_one_line(e.reason)}"
        raise TokenizerFetchError(f"tokenizer {name!r}: cannot fetch {url}: {cause}"
                                  f"{missing_hint if e.code == 404 else offline_hint}") from None
    except urllib.error.URLError as e:
        raise TokenizerFetchError(f"tokenizer {name!r}: cannot fetch {url}: no network or server unreachable "
                                  f"({_one_line(e.reason)}){offline_hint}") from None
    except TimeoutError:
        raise TokenizerFetchError(f"tokenizer {name!r}: cannot fetch {url}: no answer within {HTTP_TIMEOUT_S:g} s"
                                  f"{offline_hint}") from None
    except FileNotFoundError:
        raise TokenizerFetchError(f"tokenizer {name!r}: cannot fetch {url}: file not found{missing_hint}") from None
    except OSError as e:  # pyarrow filesystems: permissions, bad bucket, ...
        raise TokenizerFetchError(f"tokenizer {name!r}: cannot fetch {url}: {_one_line(e) or type(e).__name__}"
                                  f"{offline_hint}") from None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch_verified(name: str, file: str, mirror: Optional[str]) -> bytes:
    """One file of a named tokenizer, from the mirror or GitHub, checked against its pinned sha256."""
    pin = _pin(name)
    url = source_url(name, file, mirror)
    data = _read(name, url, mirror)
    got = _sha256(data)
    if got != pin.sha256[file]:
        raise TokenizerFetchError(
            f"tokenizer {name!r}: sha256 mismatch for {url}: got {got}, pinned {pin.sha256[file]} "
            f"(MiniMind commit {pin.commit[:7]}); the file is damaged or is not MiniMind's {name} {file}")
    return data


def _verified_dir(d: str, pin: PinnedTokenizer) -> bool:
    """True when ``d`` holds every file of ``pin`` with its pinned digest."""
    for file in FILES:
        try:
            with open(os.path.join(d, file), "rb") as f:
                if _sha256(f.read()) != pin.sha256[file]:
                    return False
        except OSError:
            return False
    return True


def fetch_tokenizer(name: str, cache_dir: Optional[str] = None, mirror: Optional[str] = None) -> str:
    """The local directory of MiniMind's tokenizer ``name``, fetched and verified on first use.

    ``cache_dir`` defaults to :func:`cache_root`, ``mirror`` to ``$MINIMIND_RAY_TOKENIZER_MIRROR``.
    """
    pin = _pin(name)
    mirror = mirror if mirror is not None else mirror_from_env()
    dest = os.path.join(cache_dir or cache_root(), "tokenizers", name)
    if _verified_dir(dest, pin):
        return dest
    files = {file: fetch_verified(name, file, mirror) for file in FILES}  # all verified before anything is written
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=parent)
    try:
        for file, data in files.items():
            with open(os.path.join(tmp, file), "wb") as f:
                f.write(data)
        if os.path.lexists(dest):  # a damaged copy in our own cache: move it aside, then drop it
            stale = tempfile.mkdtemp(prefix=f".{name}-stale-", dir=parent)
            os.replace(dest, os.path.join(stale, name))
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, dest)
        except OSError:
            if not _verified_dir(dest, pin):  # not a concurrent fetch that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def fetch_to(name: str, out: str, mirror: Optional[str] = None, cache_dir: Optional[str] = None) -> str:
    """``minimind-ray fetch-tokenizer``: write tokenizer ``name`` into ``out/<name>/`` (a local
    directory or a URI), the layout ``$MINIMIND_RAY_TOKENIZER_MIRROR`` reads. A file already
    there is kept when it is the same one, and refused (never overwritten) when it differs."""
    import pyarrow.fs as pafs

    from minimind_ray import fsio  # lazy: pyarrow, only when this runs

    pin = _pin(name)
    src = fetch_tokenizer(name, cache_dir=cache_dir, mirror=mirror)
    target = fsio.join(out, name)
    for file in FILES:
        with open(os.path.join(src, file), "rb") as f:
            data = f.read()
        dst = fsio.join(target, file)
        fs, path = fsio.filesystem(dst)
        if fs.get_file_info(path).type != pafs.FileType.NotFound:
            with fs.open_input_stream(path) as f:
                if _sha256(f.read()) == pin.sha256[file]:
                    continue
            raise TokenizerFetchError(f"fetch-tokenizer: {dst} already exists and is not MiniMind's {name} {file}; "
                                      f"refusing to overwrite it (move it away or choose another --out)")
        fsio.write_bytes_atomic(dst, data)
    return target
