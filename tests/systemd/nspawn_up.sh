#!/bin/bash
# Boot a throw-away systemd (PID 1) container whose root is a tmpfs-backed
# overlay of the host "/", in a private mount namespace and (with
# --private-network) its own network namespace: nothing it does reaches the
# host's filesystem or interfaces.
#
# Usage: nspawn_up.sh NAME     prints "container=NAME leader_pid=... state=..."
# State (pids, console log) lives in $CNA_NSPAWN_DIR/state-NAME
# (default /tmp/cube-network-agent-nspawn). Run nspawn_exec.sh NAME CMD to
# run commands inside; nspawn_down.sh NAME to tear it down.
#
# Needs root and systemd-nspawn; installs systemd-container pinned to the
# host's systemd version if it is missing (the newer candidate drags a
# libsystemd-shared upgrade).
set -eu
NAME=${1:?usage: nspawn_up.sh NAME}
HERE=$(cd "$(dirname "$0")" && pwd)
BASE=${CNA_NSPAWN_DIR:-/tmp/cube-network-agent-nspawn}
STATE=$BASE/state-$NAME
if ! command -v systemd-nspawn >/dev/null; then
  echo "installing systemd-container=252.38-1~deb12u1" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd-container=252.38-1~deb12u1 >&2
fi
mkdir -p "$STATE"
cat > "$STATE/inner.sh" <<INNER
#!/bin/bash
set -eu
B=$STATE/ovl
mkdir -p \$B
mount -t tmpfs -o mode=755 tmpfs \$B            # upper on another fs than the lower "/"
mkdir -p \$B/upper \$B/work \$B/root
mount -t overlay overlay -o lowerdir=/,upperdir=\$B/upper,workdir=\$B/work \$B/root
R=\$B/root
# Trim the image before boot (changes live only in the tmpfs upper layer):
# mask units that are slow, irrelevant or would touch shared state.
for u in postgresql.service postgresql@15-main.service e2scrub_reap.service systemd-timesyncd.service \
         apt-daily.timer apt-daily-upgrade.timer man-db.timer e2scrub_all.timer dpkg-db-backup.timer fstrim.timer; do
  ln -sf /dev/null \$R/etc/systemd/system/\$u
done
# Start from a clean slate: no agent files inherited from the host.
rm -rf \$R/var/lib/cube-network-agent \$R/etc/cube-network-agent
tr -d - < /proc/sys/kernel/random/uuid > \$R/etc/machine-id   # a machine-id of its own
# nspawn gets its own cgroup in both hierarchies so its supervisor/payload
# subgroups do not collide with anything else on the host.
for h in /sys/fs/cgroup/systemd /sys/fs/cgroup/unified; do
  [ -d \$h ] || continue
  mkdir -p \$h/sysd-cna-$NAME; echo \$\$ > \$h/sysd-cna-$NAME/cgroup.procs
done
echo \$\$ > $STATE/nspawn.pid
# nspawn's default bounding set lacks CAP_BPF and CAP_PERFMON, which the
# agent's unit grants (eBPF datapath): give them to the container.
exec systemd-nspawn -D \$R -M $NAME --register=no --keep-unit --private-network \
     --capability=CAP_BPF,CAP_PERFMON \
     --console=read-only --boot
INNER
chmod +x "$STATE/inner.sh"
rm -f "$STATE/nspawn.pid" "$STATE/leader.pid"
T0=$(date +%s.%N)
setsid unshare --mount --propagation private "$STATE/inner.sh" > "$STATE/console.log" 2>&1 < /dev/null &
for i in $(seq 100); do [ -s "$STATE/nspawn.pid" ] && break; sleep 0.1; done
NS=$(cat "$STATE/nspawn.pid" 2>/dev/null || true)
[ -n "$NS" ] || { echo "nspawn did not start; see $STATE/console.log" >&2; exit 1; }
L=""
for i in $(seq 100); do
  L=$(pgrep -P "$NS" | head -1 || true)
  [ -n "$L" ] && [ "$(cat /proc/$L/comm 2>/dev/null)" = systemd ] && break
  sleep 0.1
done
[ -n "$L" ] || { echo "no systemd in the container; see $STATE/console.log" >&2; exit 1; }
echo "$L" > "$STATE/leader.pid"
S=""
for i in $(seq 300); do   # /run/systemd/private appears a moment after PID 1 starts
  S=$("$HERE/nspawn_exec.sh" "$NAME" timeout 5 systemctl is-system-running --wait 2>/dev/null || true)
  case "$S" in running|degraded) break;; esac; sleep 0.1
done
T1=$(date +%s.%N)
echo "container=$NAME nspawn_pid=$NS leader_pid=$L state=$S boot_seconds=$(echo "$T1 - $T0" | bc)"
case "$S" in running|degraded) ;; *) exit 1;; esac
