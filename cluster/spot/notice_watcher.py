#!/usr/bin/env python3
"""Turn a cloud provider's spot/preemption notice into a Ray drain of this node, so training checkpoints in time.

Ray's autoscaler does not drain a node the provider takes back: a spot termination just stops Ray. Run this on
every spot/preemptible worker VM (beside `ray start`, e.g. as a systemd unit, see cluster/README.md). It polls the
instance metadata service; on a notice it runs

    ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N [--node-id ID] [--address A]

once, and exits. Ray Train's PreemptionWatcher sees the drain (within RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S, 5 s),
every rank checkpoints the step it is at and waits; at the deadline the run restarts from that step on the nodes
left (or a replacement), losing none (minimind_ray/raytrain/preemption.py, docs/reliability.md).

Notices (the deadline each gives):
  aws   IMDSv2 /latest/meta-data/spot/instance-action: {"action": "terminate"|"stop"|"hibernate", "time": ISO-8601},
        about 120 s before the instance is taken; the deadline is that time.
  gce   /computeMetadata/v1/instance/preempted (header Metadata-Flavor: Google) turns TRUE about 30 s before a
        preemptible or Spot VM is stopped (GKE Spot nodes: the same 30 s, shared with the pods' shutdown); the
        deadline is the notice + --gce-notice-s (30).

Only the standard library: it runs before and beside the project's venv. ``--metadata-url`` points it at a local
stand-in (tests/unit/test_spot_watcher.py, tests/integration/test_node_faults.py).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime
from typing import Optional

AWS_URL = "http://169.254.169.254"
GCE_URL = "http://metadata.google.internal"
DRAIN_REASON = "DRAIN_NODE_REASON_PREEMPTION"


def _get(url: str, headers: dict, timeout: float, method: str = "GET") -> Optional[str]:
    """The body, or None on a 404 (no notice); raises on anything else (unreachable, 5xx)."""
    req = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read().decode()
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


def aws_notice(base: str, timeout: float = 2.0) -> Optional[float]:
    """The epoch time AWS will take the instance, or None. IMDSv2: a session token first (IMDSv1 may be off)."""
    token = _get(f"{base}/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "300"}, timeout, method="PUT")
    body = _get(f"{base}/latest/meta-data/spot/instance-action", {"X-aws-ec2-metadata-token": token or ""}, timeout)
    if not body:
        return None
    when = json.loads(body)["time"]  # e.g. 2026-12-01T18:00:00Z
    return datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp()


def gce_notice(base: str, notice_s: float, timeout: float = 2.0) -> Optional[float]:
    """The deadline (now + the ~30 s GCE gives) once the instance is marked preempted, or None."""
    body = _get(f"{base}/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"}, timeout)
    return time.time() + notice_s if body is not None and body.strip().upper() == "TRUE" else None


def detect_provider(timeout: float = 1.0) -> str:
    for name, probe in (("aws", lambda: _get(f"{AWS_URL}/latest/api/token",
                                             {"X-aws-ec2-metadata-token-ttl-seconds": "60"}, timeout, "PUT")),
                        ("gce", lambda: _get(f"{GCE_URL}/computeMetadata/v1/instance/id",
                                             {"Metadata-Flavor": "Google"}, timeout))):
        try:
            probe()
            return name
        except OSError:
            continue
    raise SystemExit("notice_watcher: no AWS or GCE metadata service answered; pass --provider and --metadata-url")


def drain_command(args, deadline: float, now: float) -> list:
    left = max(1, int(deadline - now - args.margin_s))
    cmd = [args.ray, "drain-node", "--reason", DRAIN_REASON, "--reason-message",
           f"{args.provider} spot/preemption notice: the node goes at {datetime.fromtimestamp(deadline).isoformat()}",
           "--deadline-remaining-seconds", str(left)]
    if args.node_id:
        cmd += ["--node-id", args.node_id]
    if args.address:
        cmd += ["--address", args.address]
    return cmd


def watch(args) -> int:
    """Poll until a notice, drain once, return the drain's exit status (0 also for --dry-run)."""
    base = args.metadata_url or (AWS_URL if args.provider == "aws" else GCE_URL)
    errors = 0
    while True:
        try:
            deadline = aws_notice(base) if args.provider == "aws" else gce_notice(base, args.gce_notice_s)
            errors = 0
        except (OSError, ValueError, KeyError) as e:  # a metadata hiccup: keep polling, say so now and then
            errors += 1
            if errors in (1, 10) or errors % 100 == 0:
                print(f"notice_watcher: metadata poll failed ({type(e).__name__}: {e}); still polling", flush=True)
            deadline = None
        if deadline is not None:
            now = time.time()
            cmd = drain_command(args, deadline, now)
            print(f"notice_watcher: {args.provider} notice, the node goes in {deadline - now:.0f} s: {' '.join(cmd)}",
                  flush=True)
            if args.dry_run:
                return 0
            return subprocess.run(cmd).returncode
        if args.once:
            return 3  # no notice (for scripts and health checks)
        time.sleep(args.interval_s)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--provider", choices=("aws", "gce", "auto"), default="auto")
    p.add_argument("--metadata-url", help="the metadata service's base URL (default: the provider's; a stand-in "
                                          "in tests)")
    p.add_argument("--interval-s", type=float, default=2.0, help="seconds between polls (default 2)")
    p.add_argument("--gce-notice-s", type=float, default=30.0, help="gce: seconds from the notice to the stop")
    p.add_argument("--margin-s", type=float, default=0.0,
                   help="tell Ray the node goes this much earlier than the provider says (clock skew, shutdown)")
    p.add_argument("--node-id", help="the Ray node to drain (default: the node of this machine's raylet)")
    p.add_argument("--address", help="the Ray cluster (default: RAY_ADDRESS, or this node's)")
    p.add_argument("--ray", default=shutil.which("ray") or "ray", help="the ray CLI (default: the one on PATH)")
    p.add_argument("--once", action="store_true", help="poll once: exit 3 when there is no notice")
    p.add_argument("--dry-run", action="store_true", help="print the drain command instead of running it")
    args = p.parse_args(argv)
    if args.provider == "auto":
        if args.metadata_url:
            p.error("--metadata-url needs --provider aws|gce")
        args.provider = detect_provider()
    return watch(args)


if __name__ == "__main__":
    sys.exit(main())
