#!/usr/bin/env bash
# Stop a cluster started by cluster/local/start.sh, and nothing else.
#
#   cluster/local/stop.sh [--name NAME | --state-dir DIR] [--timeout S]
#
# Each node's `ray start --block` (PID in STATE/<node>.pid) gets SIGTERM, on which Ray
# drains the node and stops its processes; worker nodes go first, the head last.
# Whatever is still alive after --timeout seconds (default 20) in those nodes'
# sessions is SIGKILLed. Other Ray clusters on the machine are left alone: this never
# runs `ray stop`, which would kill every Ray process of the user.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

NAME=local; STATE_DIR=""; TIMEOUT=20
while [[ $# -gt 0 ]]; do
  case "$1" in --name|--state-dir|--timeout) need_value $# "$1";; esac
  case "$1" in
    --name) NAME="$2"; shift 2;;
    --state-dir) STATE_DIR="$2"; shift 2;;
    --timeout) TIMEOUT="$2"; shift 2;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0;;
    *) refuse "unknown argument: $(shown "$1") (see --help)";;
  esac
done
need_uint --timeout "$TIMEOUT"
resolve_state "$NAME" "$STATE_DIR"
[[ -d "$STATE" ]] || refuse "no cluster state at $STATE"
check_state_dir
T0=$SECONDS

mapfile -t NODES < <(state_nodes)
[[ ${#NODES[@]} -gt 0 ]] || { log "nothing to stop in $STATE"; exit 0; }

# Sessions that still have processes, whatever state their leader is in.
live_sessions() {
  local n pid
  for n in "$@"; do
    pid=$(cat "$STATE/$n.pid" 2>/dev/null) || continue
    # A live leader that is not ours is a recycled PID: that session is someone else's.
    # (While any member of our session lives, Linux does not reuse its id.)
    if pid_alive "$pid" && ! is_our_leader "$pid" "$STATE/$n"; then continue; fi
    [[ -n "$(session_pids "$pid")" ]] && echo "$n"
  done
  return 0
}

term_and_wait() {  # deadline_s nodes... : SIGTERM leaders, wait for their sessions to empty
  local limit="$1"; shift
  local n pid deadline=$((SECONDS + limit))
  for n in "$@"; do
    pid=$(cat "$STATE/$n.pid" 2>/dev/null) || continue
    # Only a leader we can prove is ours gets a signal (its cmdline carries our --temp-dir).
    if is_our_leader "$pid" "$STATE/$n"; then kill -TERM "$pid" 2>/dev/null || true; fi
  done
  while (( SECONDS < deadline )); do
    [[ -z "$(live_sessions "$@")" ]] && return 0
    sleep 0.2
  done
  return 1
}

WORKERS=(); for n in "${NODES[@]}"; do [[ "$n" != h ]] && WORKERS+=("$n"); done
if (( ${#WORKERS[@]} > 0 )); then
  term_and_wait "$TIMEOUT" "${WORKERS[@]}" || log "worker nodes still alive after ${TIMEOUT}s; killing"
fi
if [[ -e "$STATE/h.pid" ]]; then
  term_and_wait "$TIMEOUT" h || log "head still alive after ${TIMEOUT}s; killing"
fi

# Last resort: SIGKILL what is left in our sessions (live_sessions skips recycled
# PIDs, so this cannot reach another cluster's processes).
for n in $(live_sessions "${NODES[@]}"); do
  pid=$(cat "$STATE/$n.pid")
  pids=$(session_pids "$pid")
  [[ -n "$pids" ]] && { log "SIGKILL node $n: $(echo $pids)"; kill -KILL $pids 2>/dev/null || true; }
done
# A SIGKILLed process takes a moment to exit (freeing its memory); wait up to 10 s.
for _ in $(seq 1 50); do
  [[ -z "$(live_sessions "${NODES[@]}")" ]] && break
  sleep 0.2
done
left=$(live_sessions "${NODES[@]}")
for n in "${NODES[@]}"; do
  grep -qx "$n" <<<"$left" || rm -f "$STATE/$n.pid"
done
[[ -z "$left" ]] || die "processes still alive in node(s): $(echo $left)"
rm -f "$STATE/cluster.env"
log "stopped ${#NODES[@]} node(s) of $STATE in $((SECONDS - T0))s"
