"""A real S3-protocol server on one machine (for the tests, the benchmarks, and trying object storage locally):
moto's server mode on 127.0.0.1, behind a small TCP proxy.

Everything reaches it the way it would reach AWS, through the standard variables set in this process before any
Ray starts (so every Ray node of the session, and every subprocess, has them, as a real cluster's nodes would):
``AWS_ENDPOINT_URL`` (pyarrow's S3FileSystem and boto3 read it), ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``AWS_DEFAULT_REGION`` and ``MLFLOW_S3_ENDPOINT_URL``. Nothing patches boto or pyarrow: the bytes go over HTTP.

The endpoint is the proxy, not moto itself: moto keeps its buckets in memory, so the store is taken away by the
proxy (:meth:`S3Store.cut`: every open connection closed, every new one reset), never by stopping moto. The proxy
can also cut the store at a given request (:meth:`S3Store.cut_at`: the n-th PUT/POST whose request line holds a
pattern, as a checkpoint's upload begins) and cap the bandwidth (bench/bench_checkpoint_upload.py).

The proxy listens from the moment :func:`reserve` runs (the port is held, the variables name it); moto itself is
started by :meth:`S3Store.start`, on first use.
"""
from __future__ import annotations

import os
import socket
import struct
import threading
import time
from typing import Optional

BUCKET = "mmr-test"
# the credentials of every test: a known secret key, which tests/integration/test_object_storage.py looks for in
# everything a run leaves (MLflow params and tags, the console, the run's records, exception texts)
ACCESS_KEY = "MMRTESTACCESSKEY0001"
SECRET_KEY = "mmrSecret/KnownValue+0123456789abcdefXYZ"
REGION = "us-east-1"
_METHODS = (b"PUT ", b"POST ", b"GET ", b"HEAD ", b"DELETE ")


def _reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0): the peer sees the connection reset, as when a store goes away."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class S3Store:
    """The proxy (the endpoint every client uses) and, once started, moto behind it with one bucket."""

    def __init__(self, rate_bytes_s: Optional[float] = None):
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.port = self.listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.backend: Optional[tuple] = None
        self.moto = None
        self.rate = rate_bytes_s  # bytes per second through the proxy, both directions together; None: no cap
        self._bucket_t, self._bucket_tokens = time.monotonic(), 0.0
        self._lock = threading.Lock()
        self._conns: set = set()
        self._cut = False
        self._trigger = None  # (pattern, requests left before it fires, seconds)
        self.cuts = []  # (time, the request line that set it off, or "by hand")
        threading.Thread(target=self._accept, daemon=True, name="s3-proxy").start()

    # ------------------------------------------------------------------ the server
    def start(self) -> "S3Store":
        """moto on a port of its own, and the bucket; the proxy forwards to it from now on."""
        if self.moto is not None:
            return self
        import logging

        from moto.server import ThreadedMotoServer  # lazy: moto takes a second to import

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self.moto.start()
        self.backend = ("127.0.0.1", port)
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=BUCKET)
        return self

    def uri(self, *parts: str) -> str:
        return "/".join([f"s3://{BUCKET}", *(p.strip("/") for p in parts)])

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint)

    def keys(self, prefix: str = "") -> list:
        """Every object key under ``prefix`` (read straight from moto, past any cut)."""
        import boto3

        c = boto3.client("s3", endpoint_url=f"http://{self.backend[0]}:{self.backend[1]}")
        out, token = [], None
        while True:
            r = c.list_objects_v2(Bucket=BUCKET, Prefix=prefix, **({"ContinuationToken": token} if token else {}))
            out += [o["Key"] for o in r.get("Contents", [])]
            if not r.get("IsTruncated"):
                return out
            token = r["NextContinuationToken"]

    def read(self, key: str) -> bytes:
        import boto3

        c = boto3.client("s3", endpoint_url=f"http://{self.backend[0]}:{self.backend[1]}")
        return c.get_object(Bucket=BUCKET, Key=key)["Body"].read()

    # ------------------------------------------------------------------ faults
    def cut(self, why: str = "by hand") -> None:
        """The store goes away: every open connection is reset, and every new one, until :meth:`restore`."""
        with self._lock:
            self._cut = True
            conns, self._conns = list(self._conns), set()
            self.cuts.append((time.time(), why))
        for c in conns:
            _reset(c)

    def restore(self) -> None:
        with self._lock:
            self._cut = False

    def cut_at(self, pattern: bytes, nth: int = 1, seconds: float = 20.0) -> None:
        """Cut the store for ``seconds`` as the upload of the ``nth`` object whose path holds ``pattern`` begins (its
        first PUT, or the POST that starts its multipart upload)."""
        with self._lock:
            self._trigger = (pattern, nth, seconds, set())

    def _maybe_trigger(self, chunk: bytes) -> bool:
        with self._lock:
            if self._trigger is None or not chunk.startswith((b"PUT ", b"POST ")):
                return False
            line = chunk.split(b"\r\n", 1)[0]
            pattern, nth, seconds, seen = self._trigger
            path = line.split(b" ")[1].split(b"?")[0] if line.count(b" ") >= 2 else b""
            if pattern not in path or path in seen:  # an object's multipart upload is several requests: one object
                return False
            seen.add(path)
            if len(seen) < nth:
                return False
            self._trigger = None
        self.cut(line.decode("latin-1"))
        threading.Timer(seconds, self.restore).start()
        return True

    # ------------------------------------------------------------------ the proxy
    def _throttle(self, n: int) -> None:
        if not self.rate:
            return
        with self._lock:  # a token bucket shared by every connection: the link's bandwidth, not each stream's
            now = time.monotonic()
            self._bucket_tokens = min(self.rate * 0.05, self._bucket_tokens + (now - self._bucket_t) * self.rate)
            self._bucket_t = now
            self._bucket_tokens -= n
            wait = -self._bucket_tokens / self.rate if self._bucket_tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self._cut or self.backend is None:
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.backend, timeout=10)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._conns.update((client, upstream))
            for src, dst, up in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, up), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while True:
                chunk = src.recv(1 << 16)
                if not chunk:
                    break
                if upstream and chunk.startswith(_METHODS) and self._maybe_trigger(chunk):
                    return
                self._throttle(len(chunk))
                if self._cut:
                    return
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)

    def stop(self) -> None:
        self.cut("stopped")
        try:
            self.listener.close()
        except OSError:
            pass
        if self.moto is not None:
            self.moto.stop()
            self.moto = None


def credentials_env(endpoint: str) -> dict:
    """The standard variables a node of a cluster would have for this store."""
    return {"AWS_ENDPOINT_URL": endpoint, "MLFLOW_S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": REGION, "AWS_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true"}


_STORE: Optional[S3Store] = None


def reserve() -> S3Store:
    """This test process's store: the proxy listening now and the variables set in os.environ (before any Ray
    starts); moto starts on first use (:func:`store`)."""
    global _STORE
    if _STORE is None:
        _STORE = S3Store()
        os.environ.update(credentials_env(_STORE.endpoint))
    return _STORE


def store() -> S3Store:
    return reserve().start()
