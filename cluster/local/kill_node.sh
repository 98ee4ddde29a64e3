#!/usr/bin/env bash
# Kill one worker node of a cluster started by cluster/local/start.sh, to test recovery.
#
#   cluster/local/kill_node.sh <i> [--name NAME | --state-dir DIR] [--graceful]
#
# Default: SIGKILL to every process of worker node i at once (its raylet, object
# store, agents and the training workers on it), which is what losing a machine looks
# like to the rest of the cluster; the GCS marks the node dead after its health checks
# fail (about 15 s with Ray's defaults). --graceful sends SIGTERM to the node's
# `ray start` instead, which drains the node first (a planned scale-down).
# Bring it back with: cluster/local/start.sh --node <i> --state-dir STATE
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

NAME=local; STATE_DIR=""; IDX=""; GRACEFUL=0
while [[ $# -gt 0 ]]; do
  case "$1" in --name|--state-dir) need_value $# "$1";; esac
  case "$1" in
    --name) NAME="$2"; shift 2;;
    --state-dir) STATE_DIR="$2"; shift 2;;
    --graceful) GRACEFUL=1; shift;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0;;
    [0-9]*) IDX="$1"; shift;;
    *) refuse "unknown argument: $(shown "$1") (see --help)";;
  esac
done
usage="usage: kill_node.sh <worker index 1..$MAX_WORKER_NODES> (the head is not killed by this script)"
[[ -n "$IDX" ]] || refuse "$usage"
# Digits first: [[ -ge ]] would evaluate the text as arithmetic (see need_uint).
need_uint "the worker index" "$IDX"
(( IDX >= 1 && IDX <= MAX_WORKER_NODES )) || refuse "$usage, got $IDX"
resolve_state "$NAME" "$STATE_DIR"
[[ -d "$STATE" ]] || refuse "no cluster state at $STATE"
check_state_dir
node="w$IDX"
pid=$(cat "$STATE/$node.pid" 2>/dev/null) || die "no worker node $IDX in $STATE"
is_our_leader "$pid" "$STATE/$node" || die "worker node $IDX (pid $(shown "$pid")) is not running"

if (( GRACEFUL )); then
  kill -TERM "$pid"
  for _ in $(seq 1 100); do [[ -z "$(session_pids "$pid")" ]] && break; sleep 0.2; done
else
  # The process group first (one atomic signal), then any session member outside it.
  kill -KILL -- "-$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do
    pids=$(session_pids "$pid"); [[ -z "$pids" ]] && break
    kill -KILL $pids 2>/dev/null || true; sleep 0.1
  done
fi
left=$(session_pids "$pid")
[[ -z "$left" ]] || die "node $node still has processes: $(echo $left)"
rm -f "$STATE/$node.pid"
log "killed worker node $IDX ($node, session $pid)"
