#!/usr/bin/env bash
# Start a multi-node Ray cluster on this one machine: a head node and N worker nodes,
# each a separate `ray start` (own raylet, object store, ports and --temp-dir), so that
# multi-node behaviour (placement, node loss, elastic restarts) can be tried on a laptop.
#
#   cluster/local/start.sh [N]            N worker nodes (default 2)
#   cluster/local/start.sh --node 2       (re)start worker node 2 of a running cluster
#
# Options:
#   --name NAME         cluster name (default: local); state in $MMRAY_STATE_ROOT/NAME
#                       (MMRAY_STATE_ROOT defaults to /tmp/mmray-<uid>)
#   --state-dir DIR     explicit state dir (must be short: Ray's unix sockets live under it;
#                       letters, digits and . _ + - / only). A new one is created 0700;
#                       one owned by another user, writable by all, or in a directory
#                       another user owns is refused (exit 2), as are malformed options
#   --port P            base port (default 27000). Layout: P gcs, P+1 dashboard,
#                       P+2 ray-client server, P+10+10k.. P+15+10k node k's node-manager,
#                       object-manager, agent http, agent grpc, runtime-env agent,
#                       metrics; P+500+100k..P+599+100k node k's worker ports (head k=0)
#   --head-cpus C       logical CPUs on the head (default 2); the head has no trainslot,
#                       so training workers land on worker nodes, the driver and Ray Data
#                       tasks may use the head
#   --worker-cpus C     logical CPUs per worker node (default 2)
#   --worker-gpus G     GPUs per worker node (default 0)
#   --slot NAME         custom resource, one unit per worker node (default trainslot);
#                       pair with cluster.worker_resource=NAME
#   --object-store-mb M object store per node in MiB (default 512)
#   --timeout S         seconds to wait for each node (default 240: a head on a busy 2-core machine, load ~20, took
#                       94 s to bring its dashboard up and more than 120 s in all)
#   --no-shared-disk    every node in a mount namespace of its own (cluster/local/private_disk.sh): private
#                       /tmp, /var/tmp, /dev/shm and ~/.cache, the code and the venv read-only; nodes then
#                       share no disk, as machines of a real cluster: every location of a run must be in
#                       shared storage (s3://...). Needs root or CAP_SYS_ADMIN (`unshare --mount`); kept
#                       for nodes restarted with --node
#   --drain-timeout S   on SIGTERM (stop.sh, kill_node.sh --graceful) a node first asks
#                       the GCS to drain it and waits up to S seconds for its workers to
#                       finish (Ray's default 30; here 0 = stop at once, as there is no
#                       Serve traffic to move; $RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S wins)
#
# Every node runs `ray start --block` under setsid: its PID is recorded in
# STATE/<node>.pid and is the session id of all of that node's processes, which is how
# stop.sh and kill_node.sh find exactly what this script started (never `ray stop`,
# which kills every Ray on the machine). The dashboard binds 127.0.0.1 only.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

N=2; NAME=local; STATE_DIR=""; BASE=27000; HEAD_CPUS=2; WORKER_CPUS=2; WORKER_GPUS=0
SLOT=trainslot; OBJ_MB=512; TIMEOUT=240; ONLY_NODE=""; PRIVATE=0; PRIVATE_ASKED=0
DRAIN="${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name|--state-dir|--port|--head-cpus|--worker-cpus|--worker-gpus|--slot|--object-store-mb|--timeout|--drain-timeout|--node)
      need_value $# "$1";;
  esac
  case "$1" in
    --name) NAME="$2"; shift 2;;
    --state-dir) STATE_DIR="$2"; shift 2;;
    --port) BASE="$2"; shift 2;;
    --head-cpus) HEAD_CPUS="$2"; shift 2;;
    --worker-cpus) WORKER_CPUS="$2"; shift 2;;
    --worker-gpus) WORKER_GPUS="$2"; shift 2;;
    --slot) SLOT="$2"; shift 2;;
    --object-store-mb) OBJ_MB="$2"; shift 2;;
    --timeout) TIMEOUT="$2"; shift 2;;
    --drain-timeout) DRAIN="$2"; shift 2;;
    --node) ONLY_NODE="$2"; shift 2;;
    --no-shared-disk) PRIVATE=1; PRIVATE_ASKED=1; shift;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0;;
    [0-9]*) N="$1"; shift;;
    *) refuse "unknown argument: $(shown "$1") (see --help)";;
  esac
done
# Every number is checked before any arithmetic sees it (see need_uint).
need_uint "the number of worker nodes" "$N"
need_uint --port "$BASE"; need_uint --head-cpus "$HEAD_CPUS"; need_uint --worker-cpus "$WORKER_CPUS"
need_uint --worker-gpus "$WORKER_GPUS"; need_uint --object-store-mb "$OBJ_MB"; need_uint --timeout "$TIMEOUT"
need_uint "--drain-timeout (or RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S)" "$DRAIN"
[[ -z "$ONLY_NODE" ]] || need_uint --node "$ONLY_NODE"
(( N <= MAX_WORKER_NODES )) || refuse "N must be 0..$MAX_WORKER_NODES worker nodes, got $N"
[[ -z "$ONLY_NODE" ]] || (( ONLY_NODE >= 1 && ONLY_NODE <= MAX_WORKER_NODES )) \
  || refuse "--node takes a worker index 1..$MAX_WORKER_NODES, got $ONLY_NODE"
# The port layout (see --port) reaches P+599+100*16 for the 16th worker node.
(( BASE >= 1024 && BASE + 599 + 100 * MAX_WORKER_NODES <= 65535 )) \
  || refuse "--port $BASE: the base port must be in 1024..$((65535 - 599 - 100 * MAX_WORKER_NODES))"
(( OBJ_MB >= 75 )) || refuse "--object-store-mb $OBJ_MB: Ray needs at least 75 MiB"
# The slot name goes into the JSON of `ray start --resources`.
[[ "$SLOT" =~ ^[A-Za-z][A-Za-z0-9_-]{0,63}$ ]] || refuse "--slot $(shown "$SLOT"): a resource name of letters, digits, _ and - (starting with a letter)"
resolve_state "$NAME" "$STATE_DIR"
find_ray
# Ray's unix sockets live at <temp-dir>/session_<date>_<pid>/sockets/<name>: AF_UNIX
# paths are capped at 107 bytes, which leaves about 40 for the temp dir.
[[ ${#STATE} -le 36 ]] || refuse "state dir '$STATE' is too long for Ray's socket paths (max 36 chars); use --state-dir /tmp/<short>"
export RAY_USAGE_STATS_ENABLED=0
# The head's dashboard modules get 120 s to come up instead of Ray's 30, and `ray start` waits 200 s for the
# dashboard instead of 60: a busy 2-core machine (load 15-40) misses either and the head fails to start (measured:
# 9 module processes still starting after 60 s at load 17, "start_api_server" raised, all 3 tries).
export RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT="${RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT:-120}"
export RAY_DASHBOARD_STARTUP_TIMEOUT_S="${RAY_DASHBOARD_STARTUP_TIMEOUT_S:-200}"
# Read by each node's `ray start` when it gets SIGTERM. With Ray's default (30 s) a head
# that ever ran a job waits the full 30 s: the detached actors left on it never let the
# drain finish.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="$DRAIN"
# The nodes' processes, and so every job entrypoint (`python -m pipelines...`), see the
# Python that runs Ray first on PATH, as they would in a cluster image; without this a
# job's `python` is whatever the caller's PATH finds (e.g. a system python without the deps).
RAY_BIN_DIR="$(cd "$(dirname "$RAY_BIN")" && pwd)"
export PATH="$RAY_BIN_DIR:$PATH"
[[ -f "$RAY_BIN_DIR/activate" ]] && export VIRTUAL_ENV="$(dirname "$RAY_BIN_DIR")"
# Token authentication, made explicit. Ray 2.60 starts a local cluster with token auth when a token exists
# (~/.ray/auth_token), but a driver that names the cluster's address (RAY_ADDRESS, as cluster.env sets it) sends
# the token only under RAY_AUTH_MODE=token: without it, "InvalidAuthToken". So the nodes run in token mode, with a
# token made if there is none, and cluster.env exports the mode for the drivers. RAY_AUTH_MODE=disabled opts out.
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
if [[ "$RAY_AUTH_MODE" == token && -z "${RAY_AUTH_TOKEN:-}${RAY_AUTH_TOKEN_PATH:-}" ]]; then
  "$RAY_BIN" get-auth-token --generate >/dev/null || die "could not make Ray's auth token (ray get-auth-token --generate)"
fi

node_ports() {  # k -> NM OM AGENT AGENT_GRPC RTENV METRICS WLO WHI
  local k="$1" b=$((BASE + 10 + 10 * $1))
  echo "$b $((b+1)) $((b+2)) $((b+3)) $((b+4)) $((b+5)) $((BASE+500+100*k)) $((BASE+599+100*k))"
}

check_free() {  # ports... : fail naming the first port something already listens on
  "$PY_BIN" - "$@" <<'PY'
import socket, sys
ports = [int(p) for p in sys.argv[1:]]
busy = []
for p in ports:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # like the servers that will bind it: a port only in TIME_WAIT is free
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("0.0.0.0", p))
    except OSError:
        busy.append(p)
    finally:
        s.close()
if busy:
    sys.exit(f"ports already in use: {busy[:10]}{' ...' if len(busy) > 10 else ''} (pick another --port)")
PY
}

launch() {  # node-name k extra-args... : start `ray start --block` for one node, wait until ready
  local node="$1" k="$2"; shift 2
  local tdir="$STATE/$node" pidf="$STATE/$node.pid" logf="$STATE/$node.log"
  if [[ -e "$pidf" ]] && is_our_leader "$(cat "$pidf")" "$tdir"; then
    die "node $node of '$STATE' is already running (pid $(cat "$pidf")); stop.sh first"
  fi
  read -r NM OM AG AGG RTE MET WLO WHI <<<"$(node_ports "$k")"
  local wports; wports=$(seq "$WLO" "$WHI")
  check_free $NM $OM $AG $AGG $RTE $MET $wports
  mkdir -p "$tdir"
  # setsid: the node gets its own session, so its PID names all its processes.
  # (No --node-ip-address 127.0.0.1: Ray resolves loopback to this machine's IP anyway;
  # the nodes register under that IP and 127.0.0.1:<port> reaches the same listeners.)
  local own=()  # --no-shared-disk: the node's own mount namespace (private_disk.sh), the same PID after its execs
  if (( PRIVATE )); then
    command -v unshare >/dev/null || die "--no-shared-disk needs unshare (util-linux)"
    own=(env "MMRAY_SHARED_RO=$REPO_ROOT:$(cd "$RAY_BIN_DIR/.." && pwd -P)"
         unshare --mount --propagation private -- bash "$REPO_ROOT/cluster/local/private_disk.sh")
  fi
  setsid "${own[@]}" "$RAY_BIN" start --block --disable-usage-stats --log-style record \
    --node-name "$node" --temp-dir="$tdir" \
    --node-manager-port "$NM" --object-manager-port "$OM" \
    --dashboard-agent-listen-port "$AG" --dashboard-agent-grpc-port "$AGG" \
    --runtime-env-agent-port "$RTE" --metrics-export-port "$MET" \
    --min-worker-port "$WLO" --max-worker-port "$WHI" \
    --object-store-memory $((OBJ_MB * 1024 * 1024)) "$@" </dev/null >"$logf" 2>&1 &
  local pid=$!
  echo "$pid" > "$pidf"
  STARTED+=("$node:$pid")
}

wait_ready() {  # node : until its `ray start` says the runtime started
  local node="$1" pid; pid=$(cat "$STATE/$node.pid")
  local deadline=$((SECONDS + TIMEOUT))
  until grep -q "Ray runtime started" "$STATE/$node.log" 2>/dev/null; do
    if ! pid_alive "$pid"; then
      tail -n 30 "$STATE/$node.log" >&2; die "node $node exited during startup (log: $STATE/$node.log)"
    fi
    (( SECONDS < deadline )) || { tail -n 30 "$STATE/$node.log" >&2; die "node $node not ready after ${TIMEOUT}s"; }
    sleep 0.3
  done
  local sid; sid=$(ps -o sid= -p "$pid" | tr -d ' ')
  [[ "$sid" == "$pid" ]] || die "node $node (pid $pid) did not get its own session (sid $sid): stop.sh could not find its processes"
}

STARTED=()
cleanup_on_error() {
  local rc=$?
  if (( rc != 0 )) && (( ${#STARTED[@]} > 0 )); then
    log "startup failed; stopping the nodes this call started: ${STARTED[*]}"
    for e in "${STARTED[@]}"; do
      kill -TERM -- "-${e#*:}" 2>/dev/null || kill -TERM "${e#*:}" 2>/dev/null || true
    done
    sleep 2
    for e in "${STARTED[@]}"; do
      kill -KILL -- "-${e#*:}" 2>/dev/null || true
      kill -KILL $(session_pids "${e#*:}") 2>/dev/null || true
      rm -f "$STATE/${e%%:*}.pid"
    done
  fi
}
trap cleanup_on_error EXIT

# The state dir: created private (0700) if new; refused if another user controls it.
# Checked before anything is created in it, and again after.
[[ -z "$ONLY_NODE" || -d "$STATE" ]] || refuse "no cluster in $STATE (start it first)"
if [[ -e "$STATE" || -L "$STATE" ]]; then check_state_dir
elif [[ -d "$(dirname -- "$STATE")" ]]; then check_state_parent; fi
mkdir -p -m 700 -- "$STATE"
check_state_dir

# cluster.env is shell for people (`source` it; every value quoted with printf %q) and
# data for this script: --node reads it back line by line, never sources it.
CLUSTER_ENV="$STATE/cluster.env"
write_cluster_env() {
  {
    echo "# written by cluster/local/start.sh; source it to talk to this cluster"
    printf 'export RAY_ADDRESS=%q\n' "$ADDR"
    printf 'export RAY_API_SERVER_ADDRESS=%q\n' "$DASH"
    printf 'export RAY_AUTH_MODE=%q\n' "$RAY_AUTH_MODE"
    printf 'MMRAY_STATE=%q\n' "$STATE"
    printf 'MMRAY_BASE_PORT=%q\n' "$BASE"
    printf 'MMRAY_NUM_WORKER_NODES=%q\n' "$N"
    printf 'MMRAY_WORKER_CPUS=%q\n' "$WORKER_CPUS"
    printf 'MMRAY_WORKER_GPUS=%q\n' "$WORKER_GPUS"
    printf 'MMRAY_SLOT=%q\n' "$SLOT"
    printf 'MMRAY_OBJECT_STORE_MB=%q\n' "$OBJ_MB"
    printf 'MMRAY_NO_SHARED_DISK=%q\n' "$PRIVATE"
  } > "$CLUSTER_ENV"
}

# Read cluster.env as data into BASE, N, WORKER_CPUS, ...: each line must be a known
# KEY=VALUE whose value has the shape start.sh writes; anything else is refused,
# naming the file, line and field.
read_cluster_env() {
  local f="$CLUSTER_ENV" line key val n=0 uint='^(0|[1-9][0-9]{0,8})$'
  local -A seen=()
  while IFS= read -r line || [[ -n "$line" ]]; do
    n=$((n + 1))
    [[ -z "$line" || "$line" == \#* ]] && continue
    [[ "$line" =~ ^(export\ )?([A-Z_]+)=(.*)$ ]] || refuse "$f:$n: not a KEY=VALUE line: $(shown "$line")"
    key="${BASH_REMATCH[2]}" val="${BASH_REMATCH[3]}"
    case "$key" in
      MMRAY_BASE_PORT|MMRAY_NUM_WORKER_NODES|MMRAY_WORKER_CPUS|MMRAY_WORKER_GPUS|MMRAY_OBJECT_STORE_MB|MMRAY_NO_SHARED_DISK)
        [[ "$val" =~ $uint ]] || refuse "$f:$n: $key must be a whole number, got $(shown "$val")";;
      MMRAY_SLOT)
        [[ "$val" =~ ^[A-Za-z][A-Za-z0-9_-]{0,63}$ ]] || refuse "$f:$n: $key must be a resource name, got $(shown "$val")";;
      MMRAY_STATE)
        [[ "$val" == "$STATE" ]] || refuse "$f:$n: $key is $(shown "$val"), not this state dir $STATE";;
      RAY_ADDRESS)
        [[ "$val" =~ ^127\.0\.0\.1:[0-9]{1,5}$ ]] || refuse "$f:$n: $key must be 127.0.0.1:<port>, got $(shown "$val")";;
      RAY_AUTH_MODE)
        [[ "$val" =~ ^(token|disabled)$ ]] || refuse "$f:$n: $key must be token or disabled, got $(shown "$val")";;
      RAY_API_SERVER_ADDRESS)
        [[ "$val" =~ ^http://127\.0\.0\.1:[0-9]{1,5}$ ]] || refuse "$f:$n: $key must be http://127.0.0.1:<port>, got $(shown "$val")";;
      *) refuse "$f:$n: unknown field $key";;
    esac
    seen[$key]="$val"
  done < "$f"
  for key in MMRAY_BASE_PORT MMRAY_NUM_WORKER_NODES MMRAY_WORKER_CPUS MMRAY_WORKER_GPUS MMRAY_SLOT MMRAY_OBJECT_STORE_MB; do
    [[ -n "${seen[$key]+set}" ]] || refuse "$f: field $key is missing"
  done
  BASE="${seen[MMRAY_BASE_PORT]}"; N="${seen[MMRAY_NUM_WORKER_NODES]}"
  WORKER_CPUS="${seen[MMRAY_WORKER_CPUS]}"; WORKER_GPUS="${seen[MMRAY_WORKER_GPUS]}"
  SLOT="${seen[MMRAY_SLOT]}"; OBJ_MB="${seen[MMRAY_OBJECT_STORE_MB]}"
  PRIVATE="${seen[MMRAY_NO_SHARED_DISK]:-0}"  # optional: a cluster.env written before the option
  if (( PRIVATE_ASKED )); then PRIVATE=1; fi  # --node K --no-shared-disk: this node without a shared disk
}

if [[ -n "$ONLY_NODE" ]]; then
  [[ -f "$CLUSTER_ENV" ]] || refuse "no cluster in $STATE (start it first)"
  read_cluster_env
fi
ADDR="127.0.0.1:$BASE"
DASH="http://127.0.0.1:$((BASE + 1))"
SLOT_JSON="{\"$SLOT\": 1}"
worker_args=(--address "$ADDR" --num-cpus "$WORKER_CPUS" --num-gpus "$WORKER_GPUS" --resources "$SLOT_JSON")
T0=$SECONDS
# Processes on the nodes that look for "their" cluster without an address (Ray Train's
# placement-group cleaner, the state API) would otherwise pick /tmp/ray's latest
# cluster or fail with "Found multiple active Ray instances" when this machine runs
# other Rays. RAY_ADDRESS pins them to this one.
export RAY_ADDRESS="$ADDR"

if [[ -n "$ONLY_NODE" ]]; then
  is_our_leader "$(cat "$STATE/h.pid" 2>/dev/null)" "$STATE/h" || die "the head of $STATE is not running"
  launch "w$ONLY_NODE" "$ONLY_NODE" "${worker_args[@]}"
  wait_ready "w$ONLY_NODE"
  if (( ONLY_NODE > N )); then N="$ONLY_NODE"; write_cluster_env; fi
  log "worker node w$ONLY_NODE up (pid $(cat "$STATE/w$ONLY_NODE.pid")) in $((SECONDS - T0))s"
  STARTED=()
  exit 0
fi

ls "$STATE"/*.pid >/dev/null 2>&1 && for f in "$STATE"/*.pid; do
  n=$(basename "$f" .pid)
  is_our_leader "$(cat "$f")" "$STATE/$n" && die "cluster '$STATE' is already running (node $n, pid $(cat "$f")); run cluster/local/stop.sh --state-dir $STATE"
  rm -f "$f"
done
check_free "$BASE" "$((BASE + 1))" "$((BASE + 2))"

log "starting head on $ADDR (state: $STATE)"
launch h 0 --head --port "$BASE" --num-cpus "$HEAD_CPUS" --num-gpus 0 \
  --include-dashboard true --dashboard-host 127.0.0.1 --dashboard-port "$((BASE + 1))" \
  --ray-client-server-port "$((BASE + 2))"
wait_ready h
log "head up in $((SECONDS - T0))s; starting $N worker node(s)"
for i in $(seq 1 "$N"); do launch "w$i" "$i" "${worker_args[@]}"; done
for i in $(seq 1 "$N"); do wait_ready "w$i"; done

write_cluster_env
STARTED=()
log "cluster up in $((SECONDS - T0))s"
cat <<EOF
Ray address:    $ADDR            (cluster.address=$ADDR, or: source $STATE/cluster.env)
Dashboard:      $DASH    (job server too; bound to 127.0.0.1)
Nodes:          head (${HEAD_CPUS} CPU, no $SLOT) + $N worker node(s) (${WORKER_CPUS} CPU, ${WORKER_GPUS} GPU, 1 $SLOT each)
State:          $STATE
Submit (from the repo root; absolute paths, as a job runs in a temp copy of the repo):
  ray job submit --address $DASH --working-dir . -- python -m pipelines.pretrain \\
    --config pipelines/configs/tiny.yaml cluster.worker_resource=$SLOT \\
    checkpoint.storage_path=\$PWD/runs data.cache_dir=\$PWD/data_cache
Kill a node:    cluster/local/kill_node.sh 1 --state-dir $STATE
Stop:           cluster/local/stop.sh --state-dir $STATE
EOF
