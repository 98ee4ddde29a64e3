"""What turns a provider's notice into a Ray drain, against local stand-ins: cluster/spot/notice_watcher.py polls a
stand-in of AWS's IMDSv2 and of GCE's metadata server and runs `ray drain-node` (a stand-in script that records its
arguments) once with the deadline each notice gives; cluster/kuberay/prestop-drain.sh drains and waits out its
deadline; the KubeRay manifest wires the hook with a grace period longer than that deadline.
The real drain of a real node: tests/integration/test_node_faults.py."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("notice_watcher", REPO / "cluster" / "spot" / "notice_watcher.py")
watcher = importlib.util.module_from_spec(spec)
spec.loader.exec_module(watcher)


class StandIn(BaseHTTPRequestHandler):
    """AWS IMDSv2 (a PUT token, then instance-action: 404 until the notice) and GCE (preempted FALSE, then TRUE)."""
    notice_after = 2  # polls before the notice appears
    polls = 0
    aws_time = "2026-12-01T18:00:00Z"
    seen = []

    def log_message(self, *a):
        pass

    def _send(self, code, body=""):
        self.send_response(code)
        self.end_headers()
        self.wfile.write(body.encode())

    def do_PUT(self):
        if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            return self._send(200, "tok-123")
        self._send(400)

    def do_GET(self):
        cls = type(self)
        cls.seen.append((self.path, dict(self.headers)))
        if self.path == "/latest/meta-data/spot/instance-action":
            if self.headers.get("X-aws-ec2-metadata-token") != "tok-123":
                return self._send(401)
            cls.polls += 1
            if cls.polls <= cls.notice_after:
                return self._send(404)
            return self._send(200, json.dumps({"action": "terminate", "time": cls.aws_time}))
        if self.path == "/computeMetadata/v1/instance/preempted":
            if self.headers.get("Metadata-Flavor") != "Google":
                return self._send(403)
            cls.polls += 1
            return self._send(200, "TRUE" if cls.polls > cls.notice_after else "FALSE")
        self._send(404)


@pytest.fixture
def stand_in():
    StandIn.polls, StandIn.seen = 0, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def fake_ray(tmp_path):
    """A stand-in `ray` CLI: appends its arguments (one JSON list per call) to calls.jsonl."""
    calls = tmp_path / "calls.jsonl"
    exe = tmp_path / "ray"
    exe.write_text(f"#!/usr/bin/env python3\nimport json, sys\nopen({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    exe.chmod(0o755)
    return exe, calls


def _calls(calls):
    return [json.loads(x) for x in calls.read_text().splitlines()] if calls.exists() else []


def test_an_aws_spot_notice_drains_the_node_once_with_the_notice_s_deadline(stand_in, fake_ray):
    exe, calls = fake_ray
    soon = datetime.fromtimestamp(time.time() + 120, tz=timezone.utc).replace(microsecond=0)
    StandIn.aws_time = soon.isoformat().replace("+00:00", "Z")
    rc = watcher.main(["--provider", "aws", "--metadata-url", stand_in, "--interval-s", "0.01", "--ray", str(exe),
                       "--node-id", "ab" * 28, "--address", "127.0.0.1:6379", "--margin-s", "5"])
    assert rc == 0 and StandIn.polls == 3  # two polls without a notice, the third has it
    (args,) = _calls(calls)
    assert args[:3] == ["drain-node", "--reason", "DRAIN_NODE_REASON_PREEMPTION"]
    left = int(args[args.index("--deadline-remaining-seconds") + 1])
    assert 110 <= left <= 116, left  # 120 s to the notice's time, less the 5 s margin (and the test's own seconds)
    assert args[args.index("--node-id") + 1] == "ab" * 28 and args[args.index("--address") + 1] == "127.0.0.1:6379"


def test_a_gce_preemption_notice_gives_its_30_s(stand_in, fake_ray):
    exe, calls = fake_ray
    assert watcher.main(["--provider", "gce", "--metadata-url", stand_in, "--interval-s", "0.01", "--ray", str(exe)]) == 0
    (args,) = _calls(calls)
    assert int(args[args.index("--deadline-remaining-seconds") + 1]) in (29, 30) and "--node-id" not in args
    assert all(h.get("Metadata-Flavor") == "Google" for _, h in StandIn.seen)


def test_no_notice_and_an_unreachable_service_drain_nothing(stand_in, fake_ray):
    exe, calls = fake_ray
    StandIn.notice_after = 10 ** 6
    try:
        assert watcher.main(["--provider", "aws", "--metadata-url", stand_in, "--once", "--ray", str(exe)]) == 3
        assert watcher.main(["--provider", "gce", "--metadata-url", "http://127.0.0.1:9", "--once",
                             "--ray", str(exe)]) == 3
    finally:
        StandIn.notice_after = 2
    assert _calls(calls) == []


def test_the_kuberay_prestop_hook_drains_then_waits_out_its_deadline(fake_ray):
    exe, calls = fake_ray
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(REPO / "cluster/kuberay/prestop-drain.sh")], capture_output=True, text=True,
                       env={**os.environ, "RAY_BIN": str(exe), "MINIMIND_PRESTOP_DEADLINE_S": "1", "HOSTNAME": "w-1"},
                       timeout=30)
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 >= 1.0  # it waited the deadline out: the ranks checkpoint meanwhile
    (args,) = _calls(calls)
    assert args[args.index("--deadline-remaining-seconds") + 1] == "1" and "w-1" in args[args.index("--reason-message") + 1]


def test_the_raycluster_worker_pods_run_the_hook_with_room_for_its_deadline():
    docs = list(yaml.safe_load_all((REPO / "cluster/kuberay/raycluster.yaml").read_text()))
    for group in docs[0]["spec"]["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        (c,) = [c for c in pod["containers"] if c["name"] == "ray-worker"]
        assert c["lifecycle"]["preStop"]["exec"]["command"][-1].endswith("cluster/kuberay/prestop-drain.sh")
        deadline = int({e["name"]: e.get("value") for e in c["env"]}["MINIMIND_PRESTOP_DEADLINE_S"])
        assert pod["terminationGracePeriodSeconds"] > deadline
