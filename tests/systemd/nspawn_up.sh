#!/bin/bash
# Boot a throw-away systemd (PID 1) container whose root is a tmpfs-backed
# overlay of the host "/", in a private mount namespace and its own network
# namespace: nothing it does reaches the host's filesystem or interfaces.
#
# It is set up like a real node, so the agent's eBPF datapath loads:
#  - network: the container runs in netns cna-node-NAME (not a private one
#    nspawn makes), whose uplink up0 198.51.100.1/24 (default route via
#    198.51.100.2) is a veth to w0 198.51.100.2/24 in netns cna-world-NAME,
#    "the world" (ip netns exec cna-world-NAME ... to run servers there).
#    Both namespaces are created here and deleted by nspawn_down.sh; the veth
#    is created directly inside them (nothing touches the host's links).
#  - capabilities: nspawn keeps CAP_NET_ADMIN only for a network namespace
#    of its own making (--private-network & co), not for
#    --network-namespace-path=; --capability= adds it back, with CAP_BPF and
#    CAP_PERFMON (the agent's unit grants all three).
#  - bpf(2): nspawn gives PID 1 (and so every unit) a seccomp allow-list
#    without bpf; --system-call-filter=bpf adds it.
#  - bpffs: nspawn's /sys has none at /sys/fs/bpf. A bpffs mounted in the
#    private mount namespace (state dir) is bind-mounted there.
#  - the system bus: BUS=dbus-daemon (default) or BUS=dbus-broker picks the
#    unit that serves dbus.socket, set before boot with `systemctl --root=
#    enable|disable dbus-broker.service` (its Alias=dbus.service symlink in
#    /etc), whatever the host has: Debian's dbus-broker package enables
#    itself that way when installed.
#
# Usage: [BUS=dbus-daemon|dbus-broker] nspawn_up.sh NAME
#        prints "container=NAME leader_pid=... state=... bus=..."
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
BUS=${BUS:-dbus-daemon}
case $BUS in
  dbus-daemon) BUS_ENABLE=disable ;;
  dbus-broker) BUS_ENABLE=enable
    [ -x /usr/bin/dbus-broker-launch ] || { echo "BUS=dbus-broker: dbus-broker is not installed (scripts/deps.sh installs it)" >&2; exit 1; } ;;
  *) echo "BUS=$BUS: want dbus-daemon or dbus-broker" >&2; exit 2 ;;
esac
if ! command -v systemd-nspawn >/dev/null; then
  # Pinned to the installed systemd's version, never a literal one: the newer
  # candidate drags a libsystemd-shared upgrade, and literals break after a
  # point release.
  V=$(dpkg-query -W -f='${Version}' systemd)
  echo "installing systemd-container=$V" >&2
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "systemd-container=$V" >&2; then
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "systemd-container=$V" >&2
  fi
fi
mkdir -p "$STATE"
# ---- network: node and world namespaces, veth between them -----------------
NODE=cna-node-$NAME WORLD=cna-world-$NAME
for ns in $NODE $WORLD; do
  if [ -e "/run/netns/$ns" ]; then echo "netns $ns exists (run nspawn_down.sh $NAME)" >&2; exit 1; fi
done
ip netns add $NODE
ip netns add $WORLD
ip link add up0 netns $NODE type veth peer name w0 netns $WORLD
ip -n $NODE link set lo up
ip -n $NODE link set up0 up
ip -n $NODE addr add 198.51.100.1/24 dev up0
ip -n $NODE route add default via 198.51.100.2 dev up0
ip -n $WORLD link set lo up
ip -n $WORLD link set w0 up
ip -n $WORLD addr add 198.51.100.2/24 dev w0
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
# The system bus asked for (see the header); the container's own systemctl
# on its root, before boot.
if [ -e \$R/lib/systemd/system/dbus-broker.service ] || [ $BUS_ENABLE = enable ]; then
  systemctl --root=\$R --quiet $BUS_ENABLE dbus-broker.service
fi
# Start from a clean slate: no agent files inherited from the host.
rm -rf \$R/var/lib/cube-network-agent \$R/etc/cube-network-agent
tr -d - < /proc/sys/kernel/random/uuid > \$R/etc/machine-id   # a machine-id of its own
# A bpffs for the container's /sys/fs/bpf (it lives as long as this mount
# namespace, i.e. as long as nspawn; pins survive agent restarts).
mkdir -p $STATE/bpffs
mount -t bpf bpf $STATE/bpffs
# nspawn gets its own cgroup in both hierarchies so its supervisor/payload
# subgroups do not collide with anything else on the host.
for h in /sys/fs/cgroup/systemd /sys/fs/cgroup/unified; do
  [ -d \$h ] || continue
  mkdir -p \$h/sysd-cna-$NAME; echo \$\$ > \$h/sysd-cna-$NAME/cgroup.procs
done
echo \$\$ > $STATE/nspawn.pid
# nspawn's default bounding set lacks CAP_BPF and CAP_PERFMON, and
# CAP_NET_ADMIN with --network-namespace-path=, which the agent's unit grants
# (TAPs, links, eBPF datapath), and its seccomp allow-list lacks bpf(2):
# give them to the container.
exec systemd-nspawn -D \$R -M $NAME --register=no --keep-unit \
     --network-namespace-path=/run/netns/$NODE \
     --capability=CAP_NET_ADMIN,CAP_BPF,CAP_PERFMON --system-call-filter=bpf \
     --bind=$STATE/bpffs:/sys/fs/bpf \
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
echo "container=$NAME nspawn_pid=$NS leader_pid=$L state=$S boot_seconds=$(echo "$T1 - $T0" | bc) node_netns=$NODE world_netns=$WORLD bus=$BUS"
case "$S" in running|degraded) ;; *) exit 1;; esac
