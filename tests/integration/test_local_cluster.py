"""cluster/local/*.sh: what the scripts refuse. (Their start, a node kill, a node's restart and a clean stop that
leaves other Ray processes alone are checked on test_node_faults.py's cluster, at the end of its module: one
cluster started fewer.)

The refusals (bad numbers, shell text in paths or in cluster.env, a state dir another
user controls) start no Ray: each must exit 2 with one line, before anything runs.
"""
from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

from .local_cluster import _free_base, _sh


def test_start_refuses_busy_ports_and_long_state_dir(cluster_env):
    """Fails before starting anything when a port is taken or the socket paths would be too long."""
    state, env = cluster_env
    base = _free_base(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", base))
        s.listen()
        r = _sh("start.sh", "1", "--state-dir", state, "--port", str(base), env=env, timeout=30)
    assert r.returncode != 0 and "in use" in r.stderr, r.stderr
    assert not list(Path(state).glob("*.pid"))
    r = _sh("start.sh", "1", "--state-dir", "/tmp/" + "x" * 40, env=env, timeout=30)
    assert r.returncode != 0 and "too long" in r.stderr, r.stderr


# ---- refusals: bad input stops the scripts before anything runs ------------------------

def _refused(r: subprocess.CompletedProcess) -> str:
    """The script exited 2 with exactly one `error: ...` line; returns it."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), \
        f"rc={r.returncode}\nstdout:{r.stdout}\nstderr:{r.stderr}"
    return lines[0]


def test_state_dir_with_shell_text_is_refused(cluster_env):
    """The issue's repro, `--state-dir '/tmp/a;touch /tmp/x'`: start.sh used to start the
    cluster and write `MMRAY_STATE=/tmp/a;touch /tmp/x` into cluster.env, which ran
    `touch` for whoever sourced it. Now it is refused before anything is created."""
    _, env = cluster_env
    tag = secrets.token_hex(3)
    marker = Path(f"/tmp/mx{tag}")
    state = f"/tmp/m{tag};touch {marker}"   # 32 chars: within start.sh's length limit
    r = _sh("start.sh", "0", "--state-dir", state, env=env, timeout=30)
    err = _refused(r)
    assert "--state-dir" in err and "only letters, digits" in err, err
    assert not marker.exists(), "the text after ';' ran"
    assert not Path(f"/tmp/m{tag};touch ").exists(), "start.sh created the state dir before refusing it"


@pytest.mark.parametrize("key, hostile", [
    # what start.sh wrote for the issue's --state-dir; `source cluster.env` ran the touch
    ("MMRAY_STATE", "/tmp/a;touch {marker}"),
    # bash arithmetic on this value would run the $(...)
    ("MMRAY_BASE_PORT", "PATH[$(touch {marker})]"),
])
def test_node_restart_reads_cluster_env_as_data(cluster_env, tmp_path, key, hostile):
    """`start.sh --node` used to `source` cluster.env: a planted or edited line ran as code.
    Now each line must be a known field with a value of the right shape."""
    state, env = cluster_env
    marker = tmp_path / "pwned"
    fields = {"RAY_ADDRESS": "127.0.0.1:27000", "RAY_API_SERVER_ADDRESS": "http://127.0.0.1:27001",
              "MMRAY_STATE": state, "MMRAY_BASE_PORT": "27000", "MMRAY_NUM_WORKER_NODES": "1",
              "MMRAY_WORKER_CPUS": "1", "MMRAY_WORKER_GPUS": "0", "MMRAY_SLOT": "trainslot",
              "MMRAY_OBJECT_STORE_MB": "128"}
    fields[key] = hostile.format(marker=marker)
    lines = ["# written by cluster/local/start.sh; source it to talk to this cluster"]
    lines += [("export " if k.startswith("RAY_") else "") + f"{k}={v}" for k, v in fields.items()]
    (Path(state) / "cluster.env").write_text("\n".join(lines) + "\n")
    lineno = 1 + list(fields).index(key) + 1

    r = _sh("start.sh", "--node", "1", "--state-dir", state, env=env, timeout=30)
    err = _refused(r)
    assert f"cluster.env:{lineno}: {key}" in err, err
    assert not marker.exists(), "a value in cluster.env ran as code"
    assert not list(Path(state).glob("*.pid"))


@pytest.mark.parametrize("script, args", [
    ("kill_node.sh", ["1+PATH[$(touch {marker})]"]),          # the node index
    ("start.sh", ["0", "--port", "PATH[$(touch {marker})]"]),
    ("start.sh", ["0", "--timeout", "PATH[$(touch {marker})]"]),
    ("stop.sh", ["--timeout", "PATH[$(touch {marker})]"]),
])
def test_numbers_are_digits_before_any_arithmetic(cluster_env, tmp_path, script, args):
    """`[[ $IDX -ge 1 ]]` and `$((BASE + 1))` evaluate their text: `1+PATH[$(touch f)]` ran touch."""
    state, env = cluster_env
    marker = tmp_path / "pwned"
    r = _sh(script, *[a.format(marker=marker) for a in args], "--state-dir", state, env=env, timeout=30)
    err = _refused(r)
    assert "takes a whole number" in err, err
    assert not marker.exists(), "the argument ran as code"
    assert not list(Path(state).iterdir()), "something was started or written before the refusal"


def _other_uid() -> int:
    return 65534 if os.getuid() != 65534 else 65533   # nobody


def _chown_or_skip(path: str) -> None:
    try:
        os.chown(path, _other_uid(), _other_uid())
    except PermissionError:
        pytest.skip("making a directory another user's needs root (CI runs as root)")


@pytest.mark.parametrize("script, args", [("start.sh", ["1"]), ("stop.sh", []), ("kill_node.sh", ["1"])])
def test_state_dir_owned_by_another_user_is_refused(cluster_env, script, args):
    """Its PID files would be signalled and its cluster.env sourced: another user could plant them."""
    state, env = cluster_env
    _chown_or_skip(state)
    r = _sh(script, *args, "--state-dir", state, env=env, timeout=30)
    err = _refused(r)
    assert f"owned by uid {_other_uid()}" in err and state in err, err
    assert not list(Path(state).iterdir())


def test_state_root_owned_by_another_user_is_refused(cluster_env):
    """A squatted /tmp/mmray-<uid> (the default root for --name): its owner could swap our state dir."""
    _, env = cluster_env
    root = tempfile.mkdtemp(prefix="mmr", dir="/tmp")
    try:
        _chown_or_skip(root)
        r = _sh("start.sh", "1", "--name", "local", env=dict(env, MMRAY_STATE_ROOT=root), timeout=30)
        err = _refused(r)
        assert f"sits in {root}, which uid {_other_uid()} owns" in err, err
        assert not os.listdir(root), "start.sh created its state dir inside the other user's directory"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_world_writable_state_dir_is_refused(cluster_env):
    state, env = cluster_env
    os.chmod(state, 0o777)
    err = _refused(_sh("start.sh", "1", "--state-dir", state, env=env, timeout=30))
    assert "writable by every user" in err, err
    assert not list(Path(state).iterdir())
