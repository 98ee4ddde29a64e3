"""Is the run's storage there? Asked once, before Ray starts.

A store that cannot be reached at the start would otherwise look like an empty one: the search for a run's
checkpoints finds none (store/checkpoint.py reads an unreadable listing as "nothing there"), and the run would
start afresh into a bucket that holds its earlier checkpoints, or Ray Train would fail minutes later with a
traceback from its storage layer. :func:`check_storage` reads the location once, in a thread it waits for at most
``timeout_s``, and says what is wrong in one line that names the config field and the endpoint.
"""
from __future__ import annotations

import os
import threading
from typing import Optional

from minimind_ray.config_checks import ConfigError
from minimind_ray.fsio import filesystem, is_uri, redact


class StorageUnreachable(ConfigError):
    """The run's storage cannot be read: one line (a ConfigError: the CLI prints it without a traceback)."""


def endpoint_of(location: str) -> str:
    """Where a URI's requests go, as a user would look for it: the URI's own ``endpoint_override``, else
    ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` for ``s3://``, else the scheme's public service."""
    scheme = location.split("://", 1)[0].lower()
    if "endpoint_override=" in location:
        return location.split("endpoint_override=", 1)[1].split("&", 1)[0]
    if scheme == "s3":
        return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3 (no AWS_ENDPOINT_URL)"
    return f"the {scheme} service"


def check_storage(location: str, field: str = "checkpoint.storage_path", timeout_s: float = 20.0) -> None:
    """Raise :class:`StorageUnreachable` unless ``location`` (a URI; a local path is always fine) can be listed
    within ``timeout_s``. An absent prefix is fine (a new run creates it); an absent bucket, refused credentials, a
    server that is down or does not answer are not."""
    if not is_uri(location):
        return
    outcome: dict = {}

    def probe() -> None:
        try:
            fs, path = filesystem(location)
            fs.get_file_info(path)
            bucket = path.split("/", 1)[0]
            if bucket and bucket != path:  # an absent prefix reads as NotFound: the bucket itself must be there
                from pyarrow.fs import FileType  # lazy: pyarrow is loaded by filesystem() above anyway

                if fs.get_file_info(bucket).type == FileType.NotFound:
                    raise FileNotFoundError(f"bucket {bucket!r} does not exist")
        except BaseException as e:  # reported by the caller's thread, as one line
            outcome["error"] = e

    t = threading.Thread(target=probe, daemon=True, name="storage-check")
    t.start()
    t.join(timeout_s)
    error: Optional[BaseException] = outcome.get("error")
    if t.is_alive():
        why = f"no answer within {timeout_s:.0f} s"
    elif error is None:
        return
    else:
        text = str(error).strip().splitlines()
        why = f"{type(error).__name__}: {text[0] if text else ''}"
    raise StorageUnreachable(redact(f"{field}: {location} cannot be read at {endpoint_of(location)} ({why}); is the "
                                    f"store up, the bucket there and the node's credentials set (AWS_ACCESS_KEY_ID/"
                                    f"AWS_SECRET_ACCESS_KEY or ~/.aws)?"))
