"""One writer per run (issue 54, item 1; store/lease.py): the lease of a run directory, on local disk (an OS lock that a
crash releases) and in a bucket (a lease object made by a conditional write, on the suite's S3 server). A second
holder is refused in one line naming the first and what to do; a lease whose holder ended without releasing it, or
that was not renewed, is taken over, and that is said. No Ray."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid

import pytest

from minimind_ray.store.lease import LEASE, BucketLease, RunInUse, hold


def _refused(run_dir: str) -> str:
    with pytest.raises(RunInUse) as e:
        hold(run_dir)
    line = str(e.value)
    assert "\n" not in line
    return line


def test_a_second_local_holder_is_refused_naming_the_first_and_a_released_lease_is_free(tmp_path):
    run_dir = str(tmp_path / "runs" / "pretrain-x")
    first = hold(run_dir)
    assert first.lines == []
    line = _refused(run_dir)  # another open of the lock file conflicts, even in this process: as another command
    assert line.startswith(f"run {run_dir} is being trained by pid {os.getpid()} on host {socket.gethostname()}, "
                           f"since "), line
    assert line.endswith("one writer per run; wait for it to end (the same command then resumes the run), or pass "
                         "name=<another> for a new run"), line
    first.release()
    again = hold(run_dir)  # a clean end leaves nothing to take over
    assert again.lines == []
    again.release()


def test_a_local_lease_whose_holder_was_killed_is_taken_over_and_said(tmp_path):
    run_dir = tmp_path / "run"
    code = ("import os, sys\nfrom minimind_ray.store.lease import hold\nhold(sys.argv[1])\nprint('held', flush=True)\n"
            "os.kill(os.getpid(), 9)\n")
    p = subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True, timeout=120)
    assert p.returncode == -9 and p.stdout == "held\n", p.stderr[-2000:]
    assert json.loads((run_dir / LEASE).read_text())["pid"] != os.getpid()  # its record stayed, its lock did not
    lease = hold(str(run_dir))
    assert len(lease.lines) == 1 and lease.lines[0].startswith(f"took over the lease of run {run_dir} from pid "), \
        lease.lines
    assert lease.lines[0].endswith("which ended without releasing it")
    lease.release()


def test_a_bucket_lease_is_one_conditional_write_renewed_and_taken_over_when_stale(s3):
    run_dir = s3.uri("unit", uuid.uuid4().hex[:8], "pretrain-x")
    key = f"{run_dir.split(f'{s3.uri()}/', 1)[1]}/{LEASE}"
    first = hold(run_dir)
    assert first.lines == [] and json.loads(s3.read(key))["pid"] == os.getpid()
    line = _refused(run_dir)
    assert line.startswith(f"run {run_dir} is being trained by pid {os.getpid()} on host "), line
    first.release()
    assert key not in s3.keys(key)  # released: the object is gone
    # a holder on another host that stopped renewing: taken over once stale (here: at once)
    s3.client().put_object(Bucket="mmr-test", Key=key, Body=json.dumps(
        {"host": "elsewhere", "pid": 1, "job": "raysubmit_x", "started": 0, "renewed": 0}).encode())
    with pytest.raises(RunInUse, match="pid 1 on host elsewhere, job raysubmit_x"):
        hold(run_dir)  # renewed moments ago by the store's clock: not stale
    taken = BucketLease(run_dir, stale_s=0.0)
    assert len(taken.lines) == 1 and "from pid 1 on host elsewhere, job raysubmit_x" in taken.lines[0] \
        and "not renewed for" in taken.lines[0], taken.lines
    assert json.loads(s3.read(key))["pid"] == os.getpid()
    taken.release()


def test_a_bucket_lease_of_a_process_of_this_host_that_is_gone_is_taken_over_at_once(s3):
    run_dir = s3.uri("unit", uuid.uuid4().hex[:8], "pretrain-y")
    key = f"{run_dir.split(f'{s3.uri()}/', 1)[1]}/{LEASE}"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    s3.client().put_object(Bucket="mmr-test", Key=key, Body=json.dumps(
        {"host": socket.gethostname(), "pid": int(dead.stdout), "job": "", "started": 0, "renewed": 0}).encode())
    lease = hold(run_dir)
    assert len(lease.lines) == 1 and lease.lines[0].endswith("(its process is gone)"), lease.lines
    lease.release()


def test_renewal_keeps_a_bucket_lease_and_a_lost_one_is_said(s3, capsys):
    run_dir = s3.uri("unit", uuid.uuid4().hex[:8], "pretrain-z")
    lease = BucketLease(run_dir, renew_s=0.05)
    key = f"{run_dir.split(f'{s3.uri()}/', 1)[1]}/{LEASE}"
    first = json.loads(s3.read(key))["renewed"]
    while json.loads(s3.read(key))["renewed"] == first:  # renewed by its thread (a conditional write on its ETag)
        pass
    s3.client().put_object(Bucket="mmr-test", Key=key, Body=b'{"host": "thief", "pid": 2}')  # taken over
    lease.thread.join(timeout=30)
    assert lease.lost and "was taken over by another command" in capsys.readouterr().out
    lease.release()  # leaves the taker's object alone
    assert json.loads(s3.read(key))["host"] == "thief"


def test_a_bucket_lease_of_the_same_ray_job_is_taken_over_at_once(s3, monkeypatch):
    """A sweep trial that Tune restarts on another node holds its run again: the lease of a process of the same Ray
    job (the sweep's) is taken over; another job's is not."""
    from minimind_ray.store import lease as lease_module

    run_dir = s3.uri("unit", uuid.uuid4().hex[:8], "sweep-trial")
    key = f"{run_dir.split(f'{s3.uri()}/', 1)[1]}/{LEASE}"
    s3.client().put_object(Bucket="mmr-test", Key=key, Body=json.dumps(
        {"host": "lost-node", "pid": 7, "job": "", "ray_job": "02000000", "started": 0, "renewed": 0}).encode())
    mine = lease_module.holder_record()
    monkeypatch.setattr(lease_module, "holder_record", lambda: {**mine, "ray_job": "03000000"})
    with pytest.raises(RunInUse, match="pid 7 on host lost-node"):
        hold(run_dir)
    monkeypatch.setattr(lease_module, "holder_record", lambda: {**mine, "ray_job": "02000000"})
    lease = hold(run_dir)
    assert len(lease.lines) == 1 and lease.lines[0].endswith("(a process of this same Ray job: a restarted sweep "
                                                             "trial)"), lease.lines
    lease.release()


def test_a_bucket_run_without_boto3_is_refused_in_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    from minimind_ray.config_checks import ConfigError

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "boto3" else find_spec(name, *a))
    with pytest.raises(ConfigError) as e:
        hold("s3://bucket/runs/pretrain-x?endpoint_override=127.0.0.1:9")
    line = str(e.value)
    assert "\n" not in line and line.startswith("checkpoint.storage_path: a run in a bucket"), line
    assert line.endswith("pip install 'minimind-ray[s3]'"), line
