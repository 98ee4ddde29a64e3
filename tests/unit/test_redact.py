"""Issue 11, item 2: credentials in URIs are never printed or stored (the helper every writer uses)."""
from __future__ import annotations

import pytest

from minimind_ray.fsio import redact, redact_obj


@pytest.mark.parametrize("text,want", [
    ("https://user:pw@mlflow.example:5000", "https://***@mlflow.example:5000"),
    ("s3://AKIAKEY:SECRET/with+slash@bucket/runs", "s3://***@bucket/runs"),
    ("gs://bucket/x?X-Goog-Signature=abc123&X-Goog-Date=1", "gs://bucket/x?X-Goog-Signature=***&X-Goog-Date=1"),
    ("http://h/p?token=t0k&a=b&password=pw&aws_secret_access_key=s", "http://h/p?token=***&a=b&password=***&aws_secret_access_key=***"),
    ("MLflow at http://alice:s3cr3t@127.0.0.1:5000 unavailable (ConnectionError)",
     "MLflow at http://***@127.0.0.1:5000 unavailable (ConnectionError)"),
    ("file:///tmp/runs/a", "file:///tmp/runs/a"),
    ("/plain/path/user@example.com", "/plain/path/user@example.com"),
    ("http://host/path/user@example.com", "http://host/path/user@example.com"),
    ("train.lr=3e-4", "train.lr=3e-4"),
])
def test_redact(text, want):
    assert redact(text) == want


def test_redact_obj_walks_configs_and_keeps_types():
    cfg = {"tracking": {"uri": "https://u:p@h"}, "data": {"train_path": ["s3://K:S@b/x.jsonl", "local.jsonl"]},
           "n": 3, "flag": None}
    assert redact_obj(cfg) == {"tracking": {"uri": "https://***@h"},
                               "data": {"train_path": ["s3://***@b/x.jsonl", "local.jsonl"]}, "n": 3, "flag": None}


def test_urls_in_printed_text_are_redacted():
    """MLflow's own 'View run ... at: <tracking URI>' line, printed when a run ends, goes out redacted."""
    from minimind_ray.fsio import redact_text

    line = "🏃 View run r at: http://alice:pw@127.0.0.1:5000/#/experiments/1/runs/ab\n"
    assert redact_text(line) == "🏃 View run r at: http://***@127.0.0.1:5000/#/experiments/1/runs/ab\n"
    assert redact_text("no url here\n") == "no url here\n"
