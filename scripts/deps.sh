#!/usr/bin/env bash
# Installs the Debian packages cube-network-agent needs, if missing.
#
#   scripts/deps.sh [--runtime] [--build] [--test]    (no flag: all three)
#
# --runtime  what running the agent and the README's commands needs:
#            dbus-daemon (a system bus where none runs), iproute2 (ip, tc),
#            systemd (busctl), socat (the varlink examples), polkitd
#            (judges non-root callers; the quick start installs the actions).
# --build    what building it needs besides the machine's cargo: make, and
#            clang-19 + libbpf-dev to compile the eBPF datapath (without
#            them build.rs uses the committed object).
# --test     what the test suite and the benchmarks need:
#            qemu-system-x86 + busybox-static + tcpdump + curl + python3
#            (the real-kernel guest in tests/vm: qemu-system-x86_64, the
#            guest's busybox, the GSO capture, host-side HTTP, the world web
#            server); polkitd + python3-dbus + python3-gi (tests/polkit, and
#            its callers in tests/systemd); dbus-broker (tests/systemd with
#            BUS=dbus-broker; Debian's package enables it as the host's
#            dbus.service from the next boot under systemd, which these
#            machines do not have; the test containers pick their bus
#            themselves); iperf3 + nftables (cube-dpbench
#            and its nft baseline); golang-go + golang-github-appc-cni-dev
#            (libcni) + golang-github-containerd-go-cni-dev (go-cni) to build
#            tests/cni/cnirun offline in GOPATH mode; containernetworking-
#            plugins (/usr/lib/cni: tuning chained after cube-cni, the
#            bridge+host-local+portmap baseline, the loopback containerd's
#            CRI needs); containerd + runc (tests/cni/ctr-run.sh, and the
#            CRI plugin in tests/cri/containerd-cri.sh); podman (rootful,
#            its CNI backend, driven by its CLI in tests/podman.rs; brings
#            conmon); bpftool (program
#            tags in the upgrade test); man-db + groff-base (man -l in
#            tests/install) and zsh (the zsh completion's syntax check);
#            coreutils (md5sum, timeout),
#            mount + util-linux (mount, umount, mountpoint, findmnt, unshare,
#            nsenter, setpriv, flock) are essential packages and listed so
#            that a stripped image still fails loudly here. systemd-nspawn
#            (systemd-container, pinned to the host's systemd) is installed
#            by tests/systemd/nspawn_up.sh.
#            python3-prometheus-client (its OpenMetrics parser reads
#            `cubenetctl metrics` in tests/metrics.rs) and python3-venv: with
#            --test, the reference varlink client (PyPI varlink 31.0.0) goes
#            into the venv /opt/cube-network-agent-test/venv (tests/metrics:
#            io.systemd.Metrics through a foreign client), and so does gRPC
#            for the CRI client that plays kubelet in tests/cri.rs
#            (tests/cri/cri.py: PyPI grpcio + grpcio-tools 1.85.1, whose
#            protoc compiles tests/cri/cri_subset.proto, protobuf 7.36.2).
#            dnsmasq-base (the world's DNS server in tests/egress.rs) and
#            bind9-dnsutils (dig, a real client in its container test);
#            openssl (the world's TLS server and s_client in strict mode;
#            the egress gateway test's CA and upstream certificates),
#            ca-certificates (the system trust store the gateway verifies
#            upstreams against by default), python3-requests and nodejs
#            (the real clients of tests/gateway.rs: requests, fetch).
#            varlink-go (varlink-go-interface-generator, the reference Go
#            parser: tests/varlink.rs parses every varlink/*.varlink with it).
# Idempotent; needs root.
set -euo pipefail
runtime=(dbus-daemon iproute2 systemd socat polkitd)
build=(make clang-19 libbpf-dev)
test=(qemu-system-x86 busybox-static tcpdump curl python3 polkitd iperf3 nftables golang-go
    golang-github-appc-cni-dev golang-github-containerd-go-cni-dev containernetworking-plugins
    containerd runc podman bpftool man-db groff-base zsh coreutils mount util-linux python3-dbus
    python3-gi dbus-broker python3-prometheus-client python3-venv dnsmasq-base bind9-dnsutils
    openssl varlink-go ca-certificates nodejs)
want=()
for a in "$@"; do
    case $a in
    --runtime) want+=("${runtime[@]}") ;;
    --build) want+=("${build[@]}") ;;
    --test) want+=("${test[@]}") ;;
    *)
        echo "deps.sh: unknown argument '$a' (--runtime, --build, --test)" >&2
        exit 2
        ;;
    esac
done
[ $# -gt 0 ] || want=("${runtime[@]}" "${build[@]}" "${test[@]}")
missing=()
for p in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Python requests: Debian's package unless an importable one is there.
case " ${want[*]} " in *" nodejs "*)
    python3 -c 'import requests' 2>/dev/null || missing+=(python3-requests) ;;
esac
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# The reference varlink client, in a venv of its own (Debian has no
# package of it; the system Python stays untouched).
for a in "${want[@]}"; do
    if [ "$a" = python3-venv ]; then
        venv=/opt/cube-network-agent-test/venv
        if ! "$venv/bin/python" -c 'import varlink' 2>/dev/null; then
            echo "installing the varlink client (PyPI varlink 31.0.0) into $venv"
            /usr/bin/python3 -m venv "$venv"
            "$venv/bin/pip" install -q --disable-pip-version-check varlink==31.0.0
        fi
        # No Debian package has the CRI API, and crictl is not packaged.
        grpc=(grpcio==1.85.1 grpcio-tools==1.85.1 protobuf==7.36.2)
        if ! "$venv/bin/python" - "${grpc[@]}" 2>/dev/null <<'EOF'
import sys
from importlib.metadata import version
sys.exit(any(version(n) != v for n, v in (p.split("==") for p in sys.argv[1:])))
EOF
        then
            echo "installing gRPC (PyPI ${grpc[*]}) into $venv"
            [ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv "$venv"
            "$venv/bin/pip" install -q --disable-pip-version-check "${grpc[@]}"
        fi
        break
    fi
done
