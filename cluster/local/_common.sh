# Shared helpers for cluster/local/*.sh (sourced, not run).
#
# A local cluster is a state directory:
#   $STATE/cluster.env        RAY_ADDRESS, dashboard URL, port base, node count
#   $STATE/<node>.pid         PID of that node's `ray start --block` process; it was
#                             started under setsid, so the PID is also the session id
#                             of every process of that node (gcs_server, raylet,
#                             dashboard, agents, workers)
#   $STATE/<node>.log         `ray start` output
#   $STATE/<node>/            the node's Ray --temp-dir (session dir, logs, sockets)
# Nodes are named h (head) and w1..wN (worker nodes).

MMRAY_ROOT_DEFAULT="${MMRAY_STATE_ROOT:-/tmp/mmray-$(id -u)}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

die() { echo "error: $*" >&2; exit 1; }
log() { echo "[$(date +%H:%M:%S)] $*" >&2; }

# The `ray` CLI and the python next to it: $RAY_BIN, else the repo venv, else PATH.
find_ray() {
  if [[ -n "${RAY_BIN:-}" ]]; then :
  elif [[ -x "$REPO_ROOT/.venv/bin/ray" ]]; then RAY_BIN="$REPO_ROOT/.venv/bin/ray"
  else RAY_BIN="$(command -v ray || true)"; fi
  [[ -n "$RAY_BIN" && -x "$RAY_BIN" ]] || die "no 'ray' CLI found (set RAY_BIN or create .venv)"
  PY_BIN="$(dirname "$RAY_BIN")/python"
  [[ -x "$PY_BIN" ]] || PY_BIN="$(command -v python3)"
}

# Resolve $STATE from --state-dir or --name (default name: local).
resolve_state() {
  local name="$1" dir="$2"
  if [[ -n "$dir" ]]; then STATE="$dir"; else STATE="$MMRAY_ROOT_DEFAULT/$name"; fi
}

# Node names in the state dir, workers first (sorted by index), head last.
state_nodes() {
  local f out=()
  for f in "$STATE"/w*.pid; do [[ -e "$f" ]] && out+=("$(basename "$f" .pid)"); done
  printf '%s\n' "${out[@]}" | sort -t w -k2 -n | grep . || true
  [[ -e "$STATE/h.pid" ]] && echo h
  return 0
}

# True if process $1 exists and is not a zombie.
pid_alive() {
  local st
  st=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
  [[ -n "$st" && "$st" != Z* ]]
}

# True if $1 is alive and is the `ray start` we launched for node dir $2 (guards
# against a recycled PID: the command line must carry our --temp-dir).
is_our_leader() {
  local pid="$1" tdir="$2"
  [[ -n "$pid" ]] && pid_alive "$pid" || return 1
  tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "--temp-dir=$tdir "
}

# PIDs of every live process whose session id is $1 (the node's leader PID);
# zombies (killed, not yet reaped by their parent) do not count.
session_pids() {
  ps -e -o pid=,sid=,stat= | awk -v s="$1" '$2 == s && $3 !~ /^Z/ { print $1 }'
}
