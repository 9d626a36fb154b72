#!/usr/bin/env bash
# Installs the Debian packages the agent and its tests need, if missing:
# dbus-daemon (private and system buses), iproute2 (namespaces, links),
# systemd (busctl), clang-19 + libbpf-dev (eBPF build, checked
# reproducible in CI), qemu-system-x86 + busybox-static + tcpdump (the
# real-kernel guest test in tests/vm), iperf3 + nftables (cube-dpbench and
# its nft baseline). Idempotent; needs root.
set -euo pipefail
want=(dbus-daemon iproute2 systemd clang-19 libbpf-dev qemu-system-x86 busybox-static tcpdump iperf3 nftables)
missing=()
for p in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
