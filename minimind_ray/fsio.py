"""Cross-cutting file chores, written once: is it a URI, which filesystem, atomic writes.

Every path the project reads or writes may be a local path or a URI (``s3://``,
``gs://``, ``file://``, ...): :func:`filesystem` turns either into a ``pyarrow.fs``
filesystem and a path inside it. Every file the project writes for a reader to trust
(checkpoints, manifests, exports, tokenizers, the demo corpus) goes through
:func:`atomic_write` or :func:`write_bytes_atomic`: written under a temporary name in
the same directory, then renamed, so a reader sees the whole file or none of it.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Tuple, Union

import pyarrow.fs as pafs

PathLike = Union[str, "os.PathLike[str]"]
_URI_OR_COLLAPSED = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:/")  # s3://b/k, and s3:/b/k as Path("s3://b/k") says it


def is_uri(location: PathLike) -> bool:
    """True for ``scheme://...`` (s3, gs, hdfs, file, ...), False for a plain local path."""
    return "://" in str(location)


def filesystem(location: PathLike) -> Tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path inside it) for a local path or any URI pyarrow understands."""
    location = str(location)
    if is_uri(location):
        try:
            return pafs.FileSystem.from_uri(location)
        except (ValueError, OSError) as e:  # pyarrow's text repeats the URI as given, credentials and all
            raise type(e)(redact_text(str(e))) from None
    return pafs.LocalFileSystem(), os.path.abspath(location)


def join(base: PathLike, name: str) -> str:
    """Join a name to a local path or a URI."""
    base = str(base)
    return base.rstrip("/") + "/" + name if is_uri(base) else os.path.join(base, name)


def _umask() -> int:
    """This process's umask, read without changing it (os.umask sets as it reads: not thread-safe)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def atomic_write(path: PathLike, write_fn: Callable[[str], Any]) -> None:
    """Call ``write_fn(tmp_path)`` on a temporary file beside ``path``, then rename it to ``path``.

    A crash or an exception leaves ``path`` as it was (absent or the previous version)
    and removes the temporary file: never half a file. The file gets the mode any new file gets here
    (0666 less the umask), not mkstemp's 0600: an export or a checkpoint is for others to read too.
    Local paths only: a URI (or one a ``Path`` collapsed, ``s3:/bucket/...``) is refused, never written to a folder
    named ``s3:`` in the working directory (CI, stop 52: a bucket run's error.log was)."""
    if _URI_OR_COLLAPSED.match(str(path)):
        raise ValueError(f"{path}: a URI; atomic_write writes local files (write_bytes_atomic takes both)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    mode = 0o666 & ~_umask()
    os.chmod(tmp, mode)
    try:
        write_fn(tmp)
        os.chmod(tmp, mode)  # again: a writer may replace the file (safetensors' save_file leaves it 0600)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text_atomic(location: PathLike, text: str) -> None:
    """UTF-8 text to a local path or a URI, whole or not at all."""
    write_bytes_atomic(location, text.encode("utf-8"))


def write_json_atomic(location: PathLike, obj: Any, indent: int = 1) -> None:
    write_text_atomic(location, json.dumps(obj, indent=indent, ensure_ascii=False, default=str))


def torch_save_atomic(obj: Any, location: PathLike) -> None:
    import torch

    if is_uri(location):
        import io

        buf = io.BytesIO()
        torch.save(obj, buf)
        write_bytes_atomic(location, buf.getvalue())
        return
    atomic_write(location, lambda tmp: torch.save(obj, tmp))


def write_bytes_atomic(location: PathLike, data: bytes) -> None:
    """:func:`atomic_write` for a local path or a URI: on object stores a single PUT is already
    all-or-nothing, and the temporary name + move keeps local and POSIX-like filesystems safe."""
    if not is_uri(location):
        atomic_write(location, lambda tmp: Path(tmp).write_bytes(data))
        return
    fs, path = filesystem(location)
    if isinstance(fs, pafs.LocalFileSystem):  # a file:// folder must exist; a bucket has none to make
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    fs.move(tmp, path)


def upload_dir(local_dir: PathLike, location: PathLike, names=None) -> None:
    """Copy the files of ``local_dir`` (or only ``names``, in that order: a marker last) to ``location``, a local
    path or a URI; each object is one PUT, whole or absent."""
    fs, root = filesystem(location)
    root = root.rstrip("/")
    names = list(names) if names is not None else sorted(
        str(p.relative_to(local_dir)) for p in Path(local_dir).rglob("*") if p.is_file())
    for name in names:
        dest = f"{root}/{name}"
        fs.create_dir(dest.rsplit("/", 1)[0], recursive=True)
        with open(Path(local_dir) / name, "rb") as src, fs.open_output_stream(dest) as out:
            while True:
                block = src.read(8 << 20)
                if not block:
                    break
                out.write(block)


def local_copy(location: PathLike, names, cache_root: PathLike) -> str:
    """A local directory holding ``names`` read from ``location`` (a URI); the same local path when it is one.
    Downloaded once per node into ``cache_root/remote/<hash of the URI>`` (a whole directory renamed into place);
    a name the location lacks is left out. Readers that need local files (the tokenizers library, export) use it:
    on a cluster with no shared disk every node makes its own copy from the bucket."""
    import hashlib
    import shutil

    location = str(location)
    if not is_uri(location):
        return os.path.abspath(location)
    out = Path(cache_root) / "remote" / hashlib.sha256(location.rstrip("/").encode()).hexdigest()[:24]
    if out.is_dir():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".copy-", dir=out.parent))
    try:
        fs, root = filesystem(location)
        for name in names:
            try:
                with fs.open_input_stream(f"{root.rstrip('/')}/{name}") as src:
                    (tmp / name).write_bytes(src.read())
            except FileNotFoundError:
                continue
        try:
            os.replace(tmp, out)
        except OSError:  # another process of this node got there first: its copy is as good
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def exists(location: PathLike) -> bool:
    """Is there a file at ``location`` (a local path or a URI)?"""
    fs, path = filesystem(location)
    return fs.get_file_info(path).type == pafs.FileType.File


# --------------------------------------------------------------------------- secrets in URIs

# userinfo of any scheme://user:password@host, and the values of query parameters whose name says secret
# (a user:secret pair may hold an unescaped '/', as AWS secret keys do: then it is taken up to the '@')
_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<userinfo>[^/@\s'\"]+|[^/@\s'\":]+:[^@\s'\"]+)@")
_SECRET_QUERY = re.compile(r"(?P<name>[?&;][^=&\s'\"#]*(?:secret|token|password|passwd|pwd|signature|credential|"
                           r"access[_-]?key|api[_-]?key)[^=&\s'\"#]*=)[^&\s'\"#]*", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with the credentials of every URI in it replaced by ``***``: the userinfo of
    ``scheme://user:pw@host`` and the values of ``?...secret/token/password/key...=`` query parameters.
    Applied to everything the project prints or stores; the real URI is still what is used."""
    if not isinstance(text, str) or ("://" not in text and "=" not in text):
        return text
    return _SECRET_QUERY.sub(r"\g<name>***", _USERINFO.sub(r"\g<scheme>***@", text))


def redact_obj(obj: Any) -> Any:
    """:func:`redact` applied to every string in nested dicts, lists and tuples (a config, a meta record)."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {k: redact_obj(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_obj(v) for v in obj)
    return obj


def redact_text(text: str) -> str:
    """``text`` (a library's printed line, a message) with every URL in it redacted by :func:`redact`."""
    import re

    return re.sub(r"[a-z][a-z0-9+.-]*://\S+", lambda m: redact(m.group(0)), text)
