#!/usr/bin/env bash
# Builds cube-network-agent and runs it in the foreground with its built-in
# defaults on the system bus, in this host's network namespace: it creates
# the gateway device cube-dev (192.168.0.1/18) and a warm pool of 16 TAPs
# (ctapw*), and keeps its records in /var/lib/cube-network-agent.
# If no system bus is running (machines without systemd as PID 1), it
# starts one. The bus policy file is installed so root may own the name.
# The eBPF datapath attaches tc programs to the uplink (ingress), to lo and
# cube-dev (egress) and to each TAP, pins its maps under
# /sys/fs/bpf/cube-network-agent (a bpffs is mounted there if none is), and
# sets route_localnet/accept_local on lo. Pass --datapath none to skip it.
# Stop with Ctrl-C: networks and the datapath stay for the next start. To
# remove everything:
#   ip link del cube-dev; for t in $(ip -o link | grep -o 'ctap[0-9a-fw]*'); do ip link del $t; done
#   tc qdisc del dev lo clsact; tc qdisc del dev "$(ip -o route show default | awk '{print $5; exit}')" clsact
#   sysctl -w net.ipv4.conf.lo.route_localnet=0 net.ipv4.conf.lo.accept_local=0
#   rm -rf /var/lib/cube-network-agent /sys/fs/bpf/cube-network-agent
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "quickstart: run as root (the agent creates TAPs and a gateway device)" >&2; exit 1; }
scripts/deps.sh
cargo build --release --bins
install -D -m 0644 dbus/org.cube.NetworkAgent.conf /etc/dbus-1/system.d/org.cube.NetworkAgent.conf
mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf
if busctl --system status >/dev/null 2>&1; then
    busctl --system call org.freedesktop.DBus /org/freedesktop/DBus org.freedesktop.DBus ReloadConfig >/dev/null
else
    echo "quickstart: no system bus running; starting dbus-daemon --system"
    mkdir -p /run/dbus
    rm -f /run/dbus/pid
    dbus-daemon --system --fork
fi
cat <<'TXT'
quickstart: starting the agent. In another shell try:
  busctl call org.cube.NetworkAgent /org/cube/NetworkAgent org.cube.NetworkAgent \
    EnsureNetwork 'sa{sv}' sbx-1 1 port_mappings 'a(sqqs)' 1 tcp 80 0 ""
  busctl --json=short call org.cube.NetworkAgent /org/cube/NetworkAgent org.cube.NetworkAgent Health
  busctl tree org.cube.NetworkAgent
  busctl call org.cube.NetworkAgent /org/cube/NetworkAgent org.cube.NetworkAgent ReleaseNetwork s sbx-1
TXT
exec target/release/cube-network-agent "$@"
