# shellcheck shell=bash disable=SC2015  # `A && B || C`: C runs when A or B fails, as meant
# Shared by tests/vm/run.sh and tests/vm/snapshot.sh (sourced after ROOT,
# START, WORLD_IP and NODE_IP are set): logging, TAP-style results, the
# binaries and the guest, a scratch directory and namespaces cleaned up on
# every exit, the node/world topology, a private bus and the agent.
#
#   world netns                      node netns (agent, QEMU)
#   w0 $WORLD_IP/24  <-- veth -->    up0 $NODE_IP/24 (uplink, default route via w0)
#
# Environment: CNA_AGENT, CNA_CTL (binaries; default target/release/ of
# this tree), CNA_BUILD=0 (no `cargo build --release --bins` first),
# CNA_VM_KEEP=1 (keep the scratch directory).

AGENT=${CNA_AGENT:-$ROOT/target/release/cube-network-agent}
CTL=${CNA_CTL:-$ROOT/target/release/cubenetctl}

now() { date +%s.%N; }
elapsed() { awk -v s="$START" -v n="$(now)" 'BEGIN{printf "%.1f", n-s}'; }
log() { echo "# [$(elapsed)s] $*"; }
die() {
    echo "# setup failed: $*"
    exit 2
}

# vm_tools TOOL...: each must be installed (scripts/deps.sh installs them);
# sets PY (python3).
vm_tools() {
    local tool
    for tool in "$@"; do
        command -v "$tool" >/dev/null || die "$tool not installed (run scripts/deps.sh)"
    done
    PY=/usr/bin/python3
    [ -x "$PY" ] || PY=$(command -v python3) || die "python3 not installed (run scripts/deps.sh)"
}

# vm_binaries: unless CNA_BUILD=0, asks cargo (a no-op when up to date:
# stale binaries would test old code; others may be mid-edit: retry, then
# fall back to the existing binaries), then sets CACHE to the guest
# (build-guest.sh).
vm_binaries() {
    local attempt
    if [ "${CNA_BUILD:-1}" != 0 ]; then
        for attempt in 1 2 3; do
            if (cd "$ROOT" && cargo build --release --bins -q 2>"/tmp/cna-vm-build.$$.log"); then
                rm -f "/tmp/cna-vm-build.$$.log"
                break
            fi
            if [ $attempt = 3 ]; then
                tail -20 "/tmp/cna-vm-build.$$.log"; rm -f "/tmp/cna-vm-build.$$.log"
                [ -x "$AGENT" ] && [ -x "$CTL" ] || { echo "# cargo build failed 3 times"; exit 2; }
                log "WARNING: cargo build failed 3 times; testing the existing binaries"
                break
            fi
            log "cargo build failed (someone mid-edit?), retrying in 60 s"
            sleep 60
        done
    fi
    [ -x "$AGENT" ] || die "no agent binary $AGENT"
    [ -x "$CTL" ] || die "no cubenetctl binary $CTL"
    CACHE=$("$ROOT/tests/vm/build-guest.sh" | tail -1) || { echo "# building the guest failed"; exit 2; }
    [ -s "$CACHE/vmlinux" ] && [ -s "$CACHE/initramfs.cpio.gz" ] || { echo "# no guest in $CACHE"; exit 2; }
    log "guest: $CACHE; agent: $AGENT"
}

# vm_scratch NAME: the scratch directory T and the namespaces NS, WNS
# (names only), PIDS (killed in reverse order at exit), the counters; every
# exit cleans up.
vm_scratch() {
    T=$(mktemp -d "/tmp/cna-$1.XXXXXX")
    NS=cna$1-$$
    WNS=$NS-w
    PIDS=()
    FAILED=0
    PASSED=0
    trap vm_cleanup EXIT
    trap 'exit 130' INT TERM
}

vm_cleanup() {
    local rc=$? i p n
    trap - EXIT INT TERM
    for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
        kill "${PIDS[i]}" 2>/dev/null
    done
    for p in "${PIDS[@]}"; do
        # Up to 2 s for a clean exit, then SIGKILL.
        for _ in $(seq 20); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$p" 2>/dev/null
        wait "$p" 2>/dev/null
    done
    # Anything still inside our namespaces was started by us.
    for n in "$NS" "$WNS" "$NS-m" "$NS-f"; do
        for p in $(ip netns pids "$n" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
        ip netns del "$n" 2>/dev/null
    done
    mountpoint -q "$T/bpf" && umount "$T/bpf"
    if [ "${CNA_VM_KEEP:-0}" = 1 ]; then
        echo "# kept $T"
    else
        rm -rf "$T"
    fi
    exit $rc
}

ok() { echo "ok - $1"; PASSED=$((PASSED + 1)); }
notok() {
    echo "not ok - $1"
    shift
    local l
    for l in "$@"; do echo "#   $l"; done
    FAILED=$((FAILED + 1))
}
# check NAME EXPECTED ACTUAL
check() {
    if [ "$2" = "$3" ]; then ok "$1"; else notok "$1" "expected: $2" "got:      $3"; fi
}

# vm_topology: the namespaces, the agent's own bpffs ($T/bpf: `ip netns
# exec` remounts /sys, see tests/common/mod.rs) and the uplink veth.
vm_topology() {
    mkdir -p "$T/bpf" "$T/state" "$T/run" "$T/www"
    ip netns add "$NS" || die "ip netns add $NS"
    ip netns add "$WNS" || die "ip netns add $WNS"
    ip -n "$NS" link set lo up
    ip -n "$WNS" link set lo up
    mount -t bpf bpf "$T/bpf" || die "mount bpffs"
    ip -n "$NS" link add up0 type veth peer name w0 netns "$WNS" || die "veth"
    ip -n "$NS" addr add "$NODE_IP/24" dev up0
    ip -n "$WNS" addr add "$WORLD_IP/24" dev w0
    ip -n "$NS" link set up0 up
    ip -n "$WNS" link set w0 up
    ip -n "$NS" route replace default via "$WORLD_IP" dev up0 || die "default route"
}

# vm_bus: a private dbus-daemon at ADDR ($T/bus.sock); the caller waits
# for the socket with its own servers.
vm_bus() {
    ADDR="unix:path=$T/bus.sock"
    dbus-daemon --config-file="$ROOT/tests/data/bus.conf" --address="$ADDR" --nofork --nopidfile \
        >/dev/null 2>"$T/dbus.log" &
    PIDS+=($!)
}

# vm_agent: the agent in the node namespace (warm pool 2, debug log in
# $T/agent.log), AGENT_PID; returns once it holds its bus name.
vm_agent() {
    ip netns exec "$NS" "$AGENT" --bus "$ADDR" --state-dir "$T/state" --runtime-dir "$T/run" \
        --report-socket "$T/report.sock" --bpf-pin-dir "$T/bpf" --config /dev/null --warm-pool 2 \
        --log-level debug ${VM_AGENT_ARGS[@]+"${VM_AGENT_ARGS[@]}"} >/dev/null 2>>"$T/agent.log" &
    AGENT_PID=$!
    PIDS+=("$AGENT_PID")
    for _ in $(seq 200); do
        kill -0 $AGENT_PID 2>/dev/null || { tail -20 "$T/agent.log"; die "agent exited"; }
        busctl --address "$ADDR" status org.cube.NetworkAgent >/dev/null 2>&1 && break
        sleep 0.05
    done
    busctl --address "$ADDR" status org.cube.NetworkAgent >/dev/null 2>&1 ||
        { tail -20 "$T/agent.log"; die "agent did not take its bus name"; }
    log "agent up (pid $AGENT_PID)"
}
