"""One writer per run (issue 54, item 1): a run holds a lease in its run directory while it trains.

The same command started twice (two shells, the same ``name=`` and storage; a job resubmitted while the first still
runs) had both copies train the same run directory and MLflow run, each deleting the other's checkpoints. As git's
``index.lock`` and PostgreSQL's ``postmaster.pid`` do, the second is refused instead, before Ray starts, in one line
naming the holder and what to do (:class:`RunInUse`). The lease is never a file that a crash leaves blocking:

* **Local storage**: an OS lock (``flock``) on ``<run_dir>/.writer.lease``, which the kernel releases when the holding
  process ends however it ends. The file says who holds it (host, pid, job id, start time); a lock that is free but
  names a holder is one that ended without releasing it: taken over, and said.
* **A bucket** (``s3://``): a lease object ``<run_dir>/.writer.lease``, created with a conditional write
  (``If-None-Match: *``: of two creators exactly one succeeds; boto3's ``put_object(IfNoneMatch=...)``, which AWS S3,
  MinIO and the suite's moto server honour; pyarrow's S3 filesystem cannot make a conditional write). The holder renews
  it every :data:`RENEW_S` (``If-Match`` its last ETag); one not renewed for :data:`STALE_S` by the store's own clock, or
  whose holder was a process of this host that is gone, or of this same Ray job (a sweep trial Tune restarted on
  another node), is stale and taken over (a conditional write again: one taker wins), and that is said.
* Any other storage (``gs://``, ...): no lease; a line says so.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time
from typing import List, Optional
from urllib.parse import parse_qs, urlparse

from minimind_ray.config_checks import require_extra
from minimind_ray.fsio import is_uri, redact

LEASE = ".writer.lease"
RENEW_S = 30.0  # a bucket lease is renewed this often
STALE_S = 120.0  # and taken over once not renewed for this long


class RunInUse(OSError):
    """Another command trains this run: one line naming the holder and what to do (cli.py prints it, exit 2)."""


def holder_record() -> dict:
    """Who this process is: host, pid, the Ray job it runs in (a submitted job's id), when it started."""
    try:  # a `ray job submit`ted driver: its submission id (what `ray job stop` takes)
        job = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")).get("metadata", {}).get(
            "job_submission_id", "")
    except (ValueError, AttributeError):
        job = ""
    ray = sys.modules.get("ray")  # not imported for this: a CLI run holds its lease before Ray starts
    ray_job = ray.get_runtime_context().get_job_id() if ray is not None and ray.is_initialized() else ""
    now = time.time()
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": job, "ray_job": ray_job, "started": now,
            "renewed": now}


def describe(holder: Optional[dict]) -> str:
    """``pid 123 on host h (job raysubmit_x), since 2026-12-07 02:10:00 UTC``."""
    if not holder:
        return "another command (its record is not written yet)"
    since = datetime.datetime.fromtimestamp(float(holder.get("started", 0)), datetime.timezone.utc)
    job = f", job {holder['job']}" if holder.get("job") else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')}{job}, since {since:%Y-%m-%d %H:%M:%S} UTC"


def _refusal(run_dir: str, holder: Optional[dict]) -> RunInUse:
    return RunInUse(redact(f"run {run_dir} is being trained by {describe(holder)}: one writer per run; wait for it "
                           f"to end (the same command then resumes the run), or pass name=<another> for a new run"))


def _gone_from_this_host(holder: Optional[dict]) -> bool:
    """A holder that was a process of this host which no longer runs."""
    if not holder or holder.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return False


class Lease:
    """A held lease: :meth:`release` it when the run ends (a crash releases a local one; a bucket's goes stale)."""

    lines: List[str]

    def release(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class NoLease(Lease):
    def __init__(self, lines: List[str]):
        self.lines = lines

    def release(self) -> None:
        pass


class LocalLease(Lease):
    """``flock`` on the lease file, held by this open file until :meth:`release` or the process ends."""

    def __init__(self, run_dir: str):
        import fcntl  # lazy: POSIX only, where a run's directory is local

        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, LEASE)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._read()
            os.close(self.fd)
            raise _refusal(run_dir, holder) from None
        before = self._read()
        self.lines = [f"took over the lease of run {run_dir} from {describe(before)}, which ended without releasing "
                      f"it"] if before else []
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps(holder_record()).encode(), 0)

    def _read(self) -> Optional[dict]:
        try:
            data = os.pread(self.fd, 1 << 16, 0)
            return json.loads(data) if data.strip() else None
        except (OSError, ValueError):
            return None

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)  # a clean end: the next holder has nothing to take over
        finally:
            os.close(self.fd)  # the lock goes with the last descriptor
            self.fd = None


class BucketLease(Lease):
    """The lease object of a run in an S3 bucket: conditional create, renewal by a thread, conditional take-over."""

    def __init__(self, run_dir: str, renew_s: float = RENEW_S, stale_s: float = STALE_S):
        import boto3  # lazy: only for a run in a bucket
        from botocore.exceptions import ClientError

        self.ClientError = ClientError
        url = urlparse(run_dir)
        query = parse_qs(url.query)
        endpoint = query.get("endpoint_override", [None])[0]
        if endpoint and "://" not in endpoint:
            endpoint = f"{query.get('scheme', ['https'])[0]}://{endpoint}"
        self.client = boto3.client("s3", endpoint_url=endpoint)
        self.bucket, self.key = url.netloc, f"{url.path.strip('/')}/{LEASE}".lstrip("/")
        self.run_dir, self.stale_s, self.renew_s = run_dir, stale_s, renew_s
        self.record, self.lines = holder_record(), []
        try:
            self.etag = self._put(IfNoneMatch="*")
        except ClientError as e:
            if not _precondition(e):
                raise
            self.etag = self._take_over()
        self.stop, self.lost = threading.Event(), False
        self.thread = threading.Thread(target=self._renew, name="run-lease", daemon=True)
        self.thread.start()

    def _put(self, **condition) -> str:
        body = json.dumps(self.record).encode()
        return self.client.put_object(Bucket=self.bucket, Key=self.key, Body=body, **condition)["ETag"]

    def _take_over(self) -> str:
        got = self.client.get_object(Bucket=self.bucket, Key=self.key)
        try:
            holder = json.loads(got["Body"].read())
        except ValueError:
            holder = None
        server_now = _server_time(got)
        idle = (server_now - got["LastModified"]).total_seconds() if server_now else 0.0
        # a restarted trial of the same Ray job is another process; the same process asking twice is a second writer
        same_job = bool(holder and holder.get("ray_job") and holder.get("ray_job") == self.record["ray_job"]
                        and (holder.get("host"), holder.get("pid")) != (self.record["host"], self.record["pid"]))
        if idle < self.stale_s and not _gone_from_this_host(holder) and not same_job:
            raise _refusal(self.run_dir, holder)
        try:
            etag = self._put(IfMatch=got["ETag"])  # of two takers, one wins
        except self.ClientError as e:
            if _precondition(e):
                raise _refusal(self.run_dir, None) from None
            raise
        why = (f"not renewed for {idle:.0f} s" if idle >= self.stale_s else
               "its process is gone" if not same_job else "a process of this same Ray job: a restarted sweep trial")
        self.lines.append(f"took over the lease of run {self.run_dir} from {describe(holder)} ({why})")
        return etag

    def _renew(self) -> None:
        while not self.stop.wait(self.renew_s):
            self.record["renewed"] = time.time()
            try:
                self.etag = self._put(IfMatch=self.etag)
            except self.ClientError as e:
                if _precondition(e):  # taken over: this process went unrenewed past STALE_S
                    self.lost = True
                    print(redact(f"[minimind-ray] WARNING: the lease of run {self.run_dir} was taken over by another "
                                 f"command; this one is no longer its only writer"), flush=True)
                    return
            except Exception:  # the store away for a while: try again at the next renewal
                continue

    def release(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        if self.lost:
            return
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self.key)
            if head["ETag"] == self.etag:
                self.client.delete_object(Bucket=self.bucket, Key=self.key)
        except Exception:  # left in place, it goes stale: the next command takes it over
            pass


def _precondition(e) -> bool:
    code = str(e.response.get("Error", {}).get("Code", ""))
    return code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")


def _server_time(response) -> Optional[datetime.datetime]:
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    if not date:
        return None
    from email.utils import parsedate_to_datetime

    return parsedate_to_datetime(date)


def hold(run_dir: str) -> Lease:
    """The lease of ``run_dir`` for this process: held, or :class:`RunInUse` naming who holds it."""
    if not is_uri(run_dir):
        return LocalLease(run_dir)
    if run_dir.startswith("s3://"):  # pyarrow reads and writes the bucket; its lease's conditional write is boto3's
        require_extra("boto3", "s3", "checkpoint.storage_path", f"a run in a bucket ({redact(run_dir)}: its writer lease)")
        return BucketLease(run_dir)
    return NoLease([f"no writer lease on {urlparse(run_dir).scheme}:// storage (a conditional write is needed): make "
                    f"sure no other command trains run {redact(run_dir)}"])
