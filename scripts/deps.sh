#!/usr/bin/env bash
# Installs the Debian packages the agent and its tests need, if missing:
# dbus-daemon (private and system buses), iproute2 (ip: namespaces, links),
# systemd (busctl, systemd-analyze), clang-19 + libbpf-dev (eBPF build,
# checked reproducible in CI), make (ebpf/Makefile, make check-units),
# qemu-system-x86 + busybox-static + tcpdump + curl + python3 (the
# real-kernel guest test in tests/vm: qemu-system-x86_64, the guest's
# busybox, the GSO capture, host-side HTTP, the world web server),
# polkitd + python3 + python3-dbus + python3-gi (tests/polkit, and its
# callers in tests/systemd), dbus-broker (tests/systemd with BUS=dbus-broker;
# Debian's package enables it as the host's dbus.service from the next boot
# under systemd, which these machines do not have; the test containers pick
# their bus themselves), iperf3 + nftables (cube-dpbench and its
# nft baseline); golang-go + golang-github-appc-cni-dev (libcni) +
# golang-github-containerd-go-cni-dev (go-cni) to build tests/cni/cnirun
# offline in GOPATH mode, containernetworking-plugins (/usr/lib/cni: tuning
# chained after cube-cni, the bridge+host-local+portmap baseline),
# containerd + runc (tests/cni/ctr-run.sh: a real runtime, ctr run --cni of
# a busybox-static rootfs); coreutils (md5sum, timeout), mount + util-linux
# (mount, umount, mountpoint, findmnt, unshare, nsenter, setpriv, flock) are
# essential packages and listed so that a stripped image still fails loudly
# here. systemd-nspawn (systemd-container, pinned to the host's systemd) is
# installed by tests/systemd/nspawn_up.sh. Idempotent; needs root.
set -euo pipefail
want=(dbus-daemon iproute2 systemd clang-19 libbpf-dev make qemu-system-x86 busybox-static tcpdump
    curl python3 polkitd iperf3 nftables golang-go golang-github-appc-cni-dev golang-github-containerd-go-cni-dev
    containernetworking-plugins containerd runc coreutils mount util-linux python3-dbus python3-gi dbus-broker)
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
