#!/bin/bash
# Run a command inside the container booted by nspawn_up.sh (all namespaces
# of its PID 1, clean environment).   Usage: nspawn_exec.sh NAME CMD...
NAME=${1:?usage: nspawn_exec.sh NAME CMD...}; shift
BASE=${CNA_NSPAWN_DIR:-/tmp/cube-network-agent-nspawn}
L=$(cat "$BASE/state-$NAME/leader.pid")
exec nsenter --target "$L" --mount --uts --ipc --net --pid --cgroup --root --wd \
  env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin TERM=dumb LANG=C.UTF-8 \
  SYSTEMD_PAGER=cat SYSTEMD_COLORS=0 "$@"
