#!/usr/bin/env bash
# By hand, not in CI (no registry ships Firecracker; this machine's KVM
# cannot boot its guests): Firecracker's host side against networks whose
# TAP is handed over by name (EnsureNetwork tap_owner_uid, README
# "Runtimes"). Firecracker runs as an unprivileged uid, as its jailer would
# run it, with its own /dev/net/tun and /dev/kvm nodes (as the jailer makes
# them in its chroot) bind-mounted in a private mount namespace.
#
#   CNA_FIRECRACKER=/path/to/firecracker tests/vm/firecracker.sh
#
# Checks: PUT /network-interfaces with host_dev_name = tap_name succeeds as
# the owner uid (and the agent holds no fd of the TAP), fails with EPERM as
# another uid; a clone's TAP (clone_of + tap_owner_uid) opens by name; PUT
# /snapshot/load takes network_overrides (no snapshot here: it fails on the
# missing file, after the field was accepted); ReleaseNetwork deletes the TAP
# under a live Firecracker. Environment as tests/vm/run.sh (CNA_AGENT,
# CNA_CTL, CNA_BUILD, CNA_VM_KEEP).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
. "$ROOT/tests/root.sh"
require_root tests/vm/firecracker.sh "network namespaces, TAPs, device nodes"
WORLD_IP=198.51.100.2
NODE_IP=198.51.100.1
START=$(date +%s.%N)
. "$ROOT/tests/vm/lib.sh"
FC=${CNA_FIRECRACKER:-$(command -v firecracker)}
[ -x "$FC" ] || { echo "# no Firecracker: set CNA_FIRECRACKER"; exit 2; }
vm_tools ip dbus-daemon busctl curl mount unshare setpriv mknod
vm_binaries
vm_scratch fc
vm_topology
vm_bus
for _ in $(seq 100); do [ -S "$T/bus.sock" ] && break; sleep 0.05; done
vm_agent

OWNER=4242
OTHER=4343
tap_of() { "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["tap_name"])' "$1"; }
"$CTL" --bus "$ADDR" --json ensure fc-1 --tap-owner "$OWNER:$OWNER" >"$T/fc-1.json" || die "ensure fc-1"
"$CTL" --bus "$ADDR" ensure fc-src -q || die "ensure fc-src"
"$CTL" --bus "$ADDR" --json ensure fc-clone --clone-of fc-src --tap-owner "$OWNER:$OWNER" >"$T/fc-clone.json" ||
    die "ensure fc-clone"
TAP=$(tap_of "$T/fc-1.json")
CTAP=$(tap_of "$T/fc-clone.json")
mkdir -p "$T/jail" && chmod 711 "$T" && chmod 777 "$T/jail"
mknod "$T/jail/tun" c 10 200 && mknod "$T/jail/kvm" c 10 232 && chmod 666 "$T/jail/tun" "$T/jail/kvm" ||
    die "mknod"
# fc_as UID SOCK: Firecracker as UID (no groups), API on SOCK.
fc_as() {
    ip netns exec "$NS" unshare -m --propagation private sh -c \
        'mount --bind "$1/tun" /dev/net/tun && mount --bind "$1/kvm" /dev/kvm && shift && exec "$@"' sh "$T/jail" \
        setpriv --reuid="$1" --regid="$1" --clear-groups "$FC" --api-sock "$2" --no-seccomp >"$2.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 100); do [ -S "$2" ] && break; sleep 0.05; done
}
# put SOCK PATH JSON: the answer's body, then "HTTP <code>" on a line of its own.
put() { curl -sS --unix-socket "$1" -X PUT "http://localhost$2" -H 'Content-Type: application/json' -d "$3" -w '\nHTTP %{http_code}'; }
iface() { echo "{\"iface_id\":\"eth0\",\"host_dev_name\":\"$1\",\"guest_mac\":\"20:90:6f:fc:fc:fc\"}"; }
holders() { grep -l "^iff:.$1\$" /proc/[0-9]*/fdinfo/* 2>/dev/null | cut -d/ -f3 | sort -u | xargs -r ps -o uid=,comm= -p | xargs echo; }

fc_as $OWNER "$T/jail/owner.sock"
check "as uid $OWNER: PUT /network-interfaces host_dev_name=$TAP" "HTTP 204" "$(put "$T/jail/owner.sock" /network-interfaces/eth0 "$(iface "$TAP")" | tail -1)"
check "$TAP is held by Firecracker as uid $OWNER only (not by the agent)" "$OWNER firecracker" "$(holders "$TAP")"
fc_as $OTHER "$T/jail/other.sock"
r=$(put "$T/jail/other.sock" /network-interfaces/eth0 "$(iface "$CTAP")")
check "as uid $OTHER: PUT /network-interfaces host_dev_name=$CTAP is refused (EPERM)" \
    "Operation not permitted HTTP 400" "$(grep -o 'Operation not permitted' <<<"$r") $(tail -1 <<<"$r")"
fc_as $OWNER "$T/jail/clone.sock"
check "as uid $OWNER: the clone's TAP $CTAP opens by name" "HTTP 204" "$(put "$T/jail/clone.sock" /network-interfaces/eth0 "$(iface "$CTAP")" | tail -1)"
fc_as $OWNER "$T/jail/snap.sock"
r=$(put "$T/jail/snap.sock" /snapshot/load "{\"snapshot_path\":\"/nonexistent\",\"mem_backend\":{\"backend_type\":\"File\",\"backend_path\":\"/nonexistent\"},\"network_overrides\":[{\"iface_id\":\"eth0\",\"host_dev_name\":\"$CTAP\"}]}")
check "PUT /snapshot/load takes network_overrides (then fails on the missing snapshot file)" \
    "Failed to open snapshot file" "$(grep -o 'Failed to open snapshot file' <<<"$r")"
"$CTL" --bus "$ADDR" release fc-1 -q
for _ in $(seq 50); do ip -n "$NS" link show "$TAP" >/dev/null 2>&1 || break; sleep 0.1; done
check "ReleaseNetwork deletes $TAP under a live Firecracker" "gone" "$(ip -n "$NS" link show "$TAP" >/dev/null 2>&1 && echo present || echo gone)"
log "total"
echo "$PASSED passed, $FAILED failed"
[ $FAILED = 0 ]
