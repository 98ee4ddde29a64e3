"""cluster/local/private_disk.sh, the mount namespace of a node with no shared disk (start.sh --no-shared-disk): a
fresh /tmp hides what the host had there, and the code and the virtualenv stay readable, read-only, at their own
paths wherever the checkout is, /tmp included (issue 54: a checkout in /tmp failed the node-loss test, the node
could not find .venv/bin/ray). Needs root or CAP_SYS_ADMIN for the mounts, as the script does."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "cluster" / "local" / "private_disk.sh"


def _can_unshare() -> bool:
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs unshare --mount (root or CAP_SYS_ADMIN)")
def test_a_checkout_in_tmp_stays_readable_on_a_node_with_a_disk_of_its_own():
    host = Path(tempfile.mkdtemp(prefix="mmr-private-disk-", dir="/tmp"))
    try:
        code, venv = host / "checkout", host / "checkout" / ".venv"
        (venv / "bin").mkdir(parents=True)
        ray = venv / "bin" / "ray"
        ray.write_text("#!/bin/sh\necho the node runs its ray\n")
        ray.chmod(0o755)
        (host / "host-only.txt").write_text("the host's /tmp")
        probe = (f"{ray}; test ! -e {host / 'host-only.txt'} && echo hidden; "
                 f"touch {code / 'new'} 2>/dev/null || echo read-only; touch /tmp/mine && echo tmp-writable")
        out = subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "bash", str(SCRIPT),
                              "bash", "-c", probe], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "MMRAY_SHARED_RO": f"{code}:{venv}"})
        assert out.returncode == 0, out.stderr
        assert out.stdout.split("\n")[:4] == ["the node runs its ray", "hidden", "read-only", "tmp-writable"], out
        assert not Path("/tmp/mine").exists()  # the node's /tmp was its own
        assert not list(Path("/tmp").glob(".mmr-node.*"))  # the script's placeholder is gone from the host's /tmp
    finally:
        shutil.rmtree(host, ignore_errors=True)
