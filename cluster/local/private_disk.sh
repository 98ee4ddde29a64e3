#!/usr/bin/env bash
# Run a command (a node's `ray start --block`, from start.sh --no-shared-disk) as a machine of its own would: in a
# mount namespace of its own (start.sh runs it under `unshare --mount --propagation private`), where
#   /tmp, /var/tmp, /dev/shm and ~/.cache are fresh tmpfs: the node's own, empty at its start, gone with it
#     (its Ray temp dir and sockets, object store, worker cwds, job working dirs, every temp folder, caches);
#   the code and the virtualenv ($MMRAY_SHARED_RO, colon-separated) are bind-mounted read-only: an image's files,
#     at their own paths wherever the checkout is, /tmp included (issue 54: a fresh tmpfs over /tmp hid a checkout
#     in /tmp, and the node could not find .venv/bin/ray).
# Nothing a process on another node (the driver of a job runs on the head) writes to its own disk can be read here:
# a run on such a cluster must keep every location in shared storage (s3://...). Needs root or CAP_SYS_ADMIN.
#
#   private_disk.sh CMD ARGS...        (called by start.sh; not meant to be run by hand)
set -euo pipefail
IFS=: read -ra shared <<< "${MMRAY_SHARED_RO:-}"

read_only_bind() {  # read_only_bind SRC DST: SRC's files at DST, read-only
  [[ -d "$2" ]] || mkdir -p "$2"
  mount --bind "$1" "$2"
  mount -o remount,ro,bind "$2"
}

# hide DIR under a fresh tmpfs, the shared folders inside it bound back in: the tmpfs is mounted beside DIR's
# contents first (DIR/.mmr-node.*), the shared folders are bound into it at their paths, then it is moved onto DIR
hide() {  # hide DIR MODE NAME
  local dir=$1 fresh d
  fresh=$(mktemp -d "$dir/.mmr-node.XXXXXX")
  mount -t tmpfs -o "mode=$2" "$3" "$fresh"
  for d in "${shared[@]}"; do
    [[ -n "$d" && -d "$d" && "$d/" == "$dir/"* ]] && read_only_bind "$d" "$fresh/${d#"$dir/"}"
  done
  exec 9<"$dir"  # DIR as it was: its placeholder for the tmpfs is removed through it once the tmpfs has moved
  mount --move "$fresh" "$dir"
  rmdir "/proc/self/fd/9/$(basename "$fresh")" 2>/dev/null || true
  exec 9<&-
}

for d in /tmp /var/tmp /dev/shm; do
  [[ -d "$d" && ! -L "$d" ]] && hide "$(cd "$d" && pwd -P)" 1777 "node-$(basename "$d")"
done
[[ -n "${HOME:-}" && -d "$HOME/.cache" ]] && hide "$(cd "$HOME/.cache" && pwd -P)" 700 node-cache
for d in "${shared[@]}"; do  # the shared folders elsewhere: read-only at their own paths
  [[ -n "$d" && -d "$d" ]] || continue
  case "$(findmnt -n -o TARGET --target "$d")" in
    "$d") ;;  # bound already, inside a hidden folder
    *) read_only_bind "$d" "$d" ;;
  esac
done
exec "$@"
