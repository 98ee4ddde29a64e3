#!/usr/bin/env bash
# KubeRay worker preStop hook: before a worker pod is stopped (a GKE Spot/preemptible node shutting down, the AWS
# Node Termination Handler draining a spot node on its 2-minute notice, a scale-down), tell Ray that this pod's node
# goes in N seconds, then wait those N seconds so the training ranks can checkpoint first.
#
#   lifecycle.preStop.exec.command: [/bin/bash, /home/ray/minimind-ray/cluster/kuberay/prestop-drain.sh]
#
# Ray Train's PreemptionWatcher sees the drain within RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S (5 s); every rank saves
# the step it is at and waits; at the deadline the run restarts from that step on the pods left (elastic) or on a
# replacement (docs/reliability.md, "Preemption"). The pod's terminationGracePeriodSeconds must exceed N.
#
#   MINIMIND_PRESTOP_DEADLINE_S   N (default 25: GKE gives a Spot node's pods about 30 s in all; with AWS's NTH and
#                                 a 120 s notice, 100 and terminationGracePeriodSeconds 110)
#   RAY_BIN                       the ray CLI (default: ray on PATH)
# The node drained is this pod's own (ray drain-node's default: the node of the raylet this pod runs).
set -uo pipefail
N="${MINIMIND_PRESTOP_DEADLINE_S:-25}"
[[ "$N" =~ ^[1-9][0-9]{0,4}$ ]] || { echo "prestop-drain: MINIMIND_PRESTOP_DEADLINE_S must be a whole number of seconds, got '$N'" >&2; N=25; }
RAY="${RAY_BIN:-ray}"
# a drain that is refused or fails must not keep the pod from stopping: say so and still wait out N
"$RAY" drain-node --reason DRAIN_NODE_REASON_PREEMPTION \
  --reason-message "kubernetes preStop of pod ${HOSTNAME:-?}: stopping in ${N}s" \
  --deadline-remaining-seconds "$N" || echo "prestop-drain: ray drain-node failed (exit $?); waiting anyway" >&2
sleep "$N"
