#!/bin/bash
# Orderly poweroff of the container booted by nspawn_up.sh, then removal of
# its host-side leftovers (cgroups, nspawn run dirs, state dir, the node and
# world network namespaces). Idempotent; safe after a failed nspawn_up.sh.
# Usage: nspawn_down.sh NAME
NAME=${1:?usage: nspawn_down.sh NAME}
BASE=${CNA_NSPAWN_DIR:-/tmp/cube-network-agent-nspawn}
STATE=$BASE/state-$NAME
NS=$(cat "$STATE/nspawn.pid" 2>/dev/null)
if [ -n "$NS" ] && kill -0 "$NS" 2>/dev/null; then
  kill -TERM "$NS"          # nspawn forwards it as SIGRTMIN+3: orderly poweroff
  for i in $(seq 150); do kill -0 "$NS" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$NS" 2>/dev/null && kill -KILL "$NS"
  for i in $(seq 50); do kill -0 "$NS" 2>/dev/null || break; sleep 0.1; done
fi
# --keep-unit leaves nspawn's cgroups in the host hierarchies; remove them depth-first
for h in /sys/fs/cgroup/systemd /sys/fs/cgroup/unified; do
  [ -d "$h/sysd-cna-$NAME" ] && find "$h/sysd-cna-$NAME" -depth -type d -exec rmdir {} \; 2>/dev/null
done
rmdir "/run/systemd/nspawn/propagate/$NAME" /run/systemd/nspawn/propagate /run/systemd/nspawn/locks /run/systemd/nspawn 2>/dev/null  # only if empty
# The node and world network namespaces (the agent's TAPs, cube-dev and the
# veth are deleted with them).
for ns in cna-node-$NAME cna-world-$NAME; do
  ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null   # world servers left behind
  ip netns del "$ns" 2>/dev/null
done
rm -rf "$STATE"   # its mounts were in a private mount namespace, gone with nspawn
rmdir "$BASE" 2>/dev/null
echo "down: $NAME"
exit 0
