# Shared helpers for cluster/local/*.sh (sourced, not run).
#
# A local cluster is a state directory:
#   $STATE/cluster.env        RAY_ADDRESS, dashboard URL, port base, node count: shell
#                             syntax (values quoted with printf %q) so that users can
#                             `source` it; the scripts themselves only read it as data
#   $STATE/<node>.pid         PID of that node's `ray start --block` process; it was
#                             started under setsid, so the PID is also the session id
#                             of every process of that node (gcs_server, raylet,
#                             dashboard, agents, workers)
#   $STATE/<node>.log         `ray start` output
#   $STATE/<node>/            the node's Ray --temp-dir (session dir, logs, sockets)
# Nodes are named h (head) and w1..wN (worker nodes).
#
# Exit codes: 2 = bad input refused before anything was started or signalled (a
# malformed option, an unsafe state dir, a malformed cluster.env); 1 = a failure while
# working (a node did not start, a process would not die).

MMRAY_ROOT_DEFAULT="${MMRAY_STATE_ROOT:-/tmp/mmray-$(id -u)}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
MY_UID="$(id -u)"
MAX_WORKER_NODES=16

die() { echo "error: $*" >&2; exit 1; }
refuse() { echo "error: $*" >&2; exit 2; }
log() { echo "[$(date +%H:%M:%S)] $*" >&2; }
# A value as the shell would need it quoted: hostile text stays on one line, inert.
shown() { printf '%q' "$1"; }

# Refuse anything but a plain decimal number. Must run before the value reaches bash
# arithmetic: $(( )), (( )) and [[ -ge ]] evaluate a variable's text as an expression,
# so a value like 'a[$(cmd)]' would run cmd.
need_uint() {  # what value
  [[ "$2" =~ ^(0|[1-9][0-9]{0,8})$ ]] || refuse "$1 takes a whole number, got $(shown "$2")"
}

# Options that take a value: refuse a missing one by name (not bash's "unbound variable").
need_value() {  # argc option
  (( $1 >= 2 )) || refuse "$2 needs a value (see --help)"
}

# The `ray` CLI and the python next to it: $RAY_BIN, else the repo venv, else PATH.
find_ray() {
  if [[ -n "${RAY_BIN:-}" ]]; then :
  elif [[ -x "$REPO_ROOT/.venv/bin/ray" ]]; then RAY_BIN="$REPO_ROOT/.venv/bin/ray"
  else RAY_BIN="$(command -v ray || true)"; fi
  [[ -n "$RAY_BIN" && -x "$RAY_BIN" ]] || die "no 'ray' CLI found (set RAY_BIN or create .venv)"
  PY_BIN="$(dirname "$RAY_BIN")/python"
  [[ -x "$PY_BIN" ]] || PY_BIN="$(command -v python3)"
}

# Resolve $STATE from --state-dir or --name (default name: local), refusing unsafe text.
# The path goes into `ray start --temp-dir=...` command lines, is matched against
# /proc/<pid>/cmdline to recognise our nodes, and is written into cluster.env: letters,
# digits and . _ + - / only, so no quoting can go wrong anywhere.
resolve_state() {
  local name="$1" dir="$2"
  if [[ -n "$dir" ]]; then
    [[ "$dir" == /* ]] || dir="$PWD/$dir"
    [[ "$dir" =~ ^[A-Za-z0-9._+/-]+$ ]] || refuse "--state-dir $(shown "$dir"): only letters, digits and . _ + - / are allowed"
    STATE="${dir%/}"
    [[ -n "$STATE" ]] || refuse "--state-dir /: give a directory of its own"
  else
    [[ "$name" =~ ^[A-Za-z0-9_+-][A-Za-z0-9._+-]*$ ]] || refuse "--name $(shown "$name"): only letters, digits and . _ + - are allowed (not starting with .)"
    [[ "$MMRAY_ROOT_DEFAULT" == /* && "$MMRAY_ROOT_DEFAULT" =~ ^[A-Za-z0-9._+/-]+$ ]] \
      || refuse "MMRAY_STATE_ROOT $(shown "$MMRAY_ROOT_DEFAULT"): must be an absolute path of letters, digits and . _ + - /"
    STATE="${MMRAY_ROOT_DEFAULT%/}/$name"
  fi
}

# Refuse a state dir that another user controls. It holds the PID files that stop.sh
# and kill_node.sh signal, the cluster.env people source, and the nodes' unix sockets:
# whoever owns or can write to it, or can replace it (owns its parent), could plant
# those. /tmp itself is fine: root owns it and its sticky bit stops such swaps.
check_state_dir() {
  local d="$STATE" uid mode
  [[ -L "$d" ]] && refuse "state dir $d is a symlink; give the directory itself"
  [[ -d "$d" ]] || refuse "state dir $d is not a directory"
  read -r uid mode < <(stat -c '%u %a' -- "$d")
  [[ "$uid" == "$MY_UID" ]] || refuse "state dir $d is owned by uid $uid, not by you (uid $MY_UID); pick a directory of your own (--state-dir or --name)"
  (( 8#$mode & 8#002 )) && refuse "state dir $d is writable by every user (mode $mode); chmod o-w it or pick another"
  check_state_parent
}

check_state_parent() {  # the directory that holds $STATE: only we or root may swap entries in it
  local p uid mode
  p=$(dirname -- "$STATE")
  read -r uid mode < <(stat -L -c '%u %a' -- "$p")
  [[ "$uid" == "$MY_UID" || "$uid" == 0 ]] || refuse "state dir $STATE sits in $p, which uid $uid owns and could swap it; pick a directory of your own"
  if (( 8#$mode & 8#002 )) && ! (( 8#$mode & 8#1000 )); then
    refuse "state dir $STATE sits in $p, which every user can write to without the sticky bit; pick another"
  fi
  return 0
}

# Node names in the state dir, workers first (sorted by index), head last.
state_nodes() {
  local f n out=()
  for f in "$STATE"/w*.pid; do
    n=$(basename "$f" .pid)
    [[ -e "$f" && "$n" =~ ^w[0-9]+$ ]] && out+=("$n")
  done
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
  [[ "$pid" =~ ^[1-9][0-9]*$ ]] && pid_alive "$pid" || return 1
  tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "--temp-dir=$tdir "
}

# PIDs of every live process whose session id is $1 (the node's leader PID);
# zombies (killed, not yet reaped by their parent) do not count.
session_pids() {
  ps -e -o pid=,sid=,stat= | awk -v s="$1" '$2 == s && $3 !~ /^Z/ { print $1 }'
}
