#!/usr/bin/env bash
# Run a command (a node's `ray start --block`, from start.sh --no-shared-disk) as a machine of its own would: in a
# mount namespace of its own (start.sh runs it under `unshare --mount --propagation private`), where
#   /tmp, /var/tmp, /dev/shm and ~/.cache are fresh tmpfs: the node's own, empty at its start, gone with it
#     (its Ray temp dir and sockets, object store, worker cwds, job working dirs, every temp folder, caches);
#   the code and the virtualenv ($MMRAY_SHARED_RO, colon-separated) are bind-mounted read-only: an image's files.
# Nothing a process on another node (the driver of a job runs on the head) writes to its own disk can be read here:
# a run on such a cluster must keep every location in shared storage (s3://...). Needs root or CAP_SYS_ADMIN.
#
#   private_disk.sh CMD ARGS...        (called by start.sh; not meant to be run by hand)
set -euo pipefail
for d in /tmp /var/tmp /dev/shm; do
  [[ -d "$d" ]] && mount -t tmpfs -o mode=1777 "node-$(basename "$d")" "$d"
done
[[ -n "${HOME:-}" && -d "$HOME/.cache" ]] && mount -t tmpfs -o mode=700 node-cache "$HOME/.cache"
IFS=: read -ra shared <<< "${MMRAY_SHARED_RO:-}"
for d in "${shared[@]}"; do
  [[ -n "$d" && -d "$d" ]] || continue
  mount --bind "$d" "$d"
  mount -o remount,ro,bind "$d"
done
exec "$@"
