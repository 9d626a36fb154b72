#!/usr/bin/env bash
# Runs a busybox container through a real runtime, Debian 12's containerd
# 1.6 + `ctr run --cni` (go-cni 1.1.7, libcni 1.1.2), against a given CNI
# config and plugin dir, without touching the host's containerd, CNI dirs
# or interfaces. Needs root and containerd, runc, busybox-static
# (scripts/deps.sh).
#
#   ctr-run.sh run CMD     one-shot: ctr run --rm --cni ... /bin/sh -c CMD
#   ctr-run.sh start CMD   keep running (returns once the task is RUNNING,
#                          i.e. after the CNI ADD); prints shell assignments
#                          for eval: CTR_RUN_STATE CTR_ID CNI_CONTAINERID
#                          CTR_PID CTR_NETNS
#   ctr-run.sh stop STATE  kills that task (SIGKILL), waits for ctr to DEL
#                          and remove the container, tears everything down,
#                          prints the container's output
#
# Environment (run, start):
#   NODE_NS    netns where ctr runs, hence where the CNI plugins run (the
#              agent's "node" netns): a name under /run/netns or a path
#   CONF_DIR   directory bind-mounted over /etc/cni/net.d (ctr hard-codes
#              it and, like CRI, uses only the first file in sort order)
#   BIN_DIR    directory bind-mounted over /opt/cni/bin (also hard-coded)
#   CTR_ID     container id (default ctrrun-PID-RANDOM); the plugins see
#              CNI_CONTAINERID=default-CTR_ID (containerd namespace "default")
#   CTR_TIMEOUT  run: seconds before the task is killed (default 60)
#
# What the plugins see (ctr 1.6): ADD with CNI_NETNS=/proc/PID/ns/net and
# CNI_IFNAME=eth0, no capability args (ctr has no port flags); DEL with
# CNI_NETNS="" (ctr's network.Remove passes an empty path) on exit of a
# non-detached run, also after a failed ADD. ctr never calls CHECK, and a
# DEL failure is only logged by ctr (msg="network review"), which this
# script turns into exit status 125. The libcni cache (/var/lib/cni) is a
# private directory: STATE/cnicache/results/NET-default-CTR_ID-eth0.
#
# Exit status: run: the container command's exit status; 124 if it was
# killed after CTR_TIMEOUT; 125 a failure of this script or of ctr
# (setup, CNI ADD, logged CNI DEL failure), with a "ctr-run:" message on
# stderr; 2 usage. start: 0, or 125/2 as for run. stop: 0 when the task was
# killed and ctr finished cleanly, the container's own exit status if it had
# already exited by itself, 125 on failure.
#
# How: containerd runs with a private config, root, state and opt dir under
# a temp dir (CRI disabled) in its own mount namespace with a tmpfs on /run,
# so nothing lands in the host's /run/containerd, /var/lib/containerd or
# /opt/containerd. ctr runs under NODE_NS in a private mount namespace that
# bind-mounts CONF_DIR, BIN_DIR and a private cache over /etc/cni/net.d,
# /opt/cni/bin and /var/lib/cni; those mountpoints are created on the host
# if absent and removed again (rmdir, only the components this script
# created). The container has no cgroup parent (--cgroup ""), so no
# /sys/fs/cgroup/*/default is left behind. Teardown runs on every exit path
# (trap): the task, ctr, containerd and its shims, the temp dir, the
# created mountpoints. Not safe to run concurrently with another instance
# that has to create the same mountpoints.
set -euo pipefail

R=""
keep=0

die() {
    echo "ctr-run: $*" >&2
    exit 125
}
usage() {
    echo "usage: $0 run CMD | $0 start CMD | $0 stop STATE  (env NODE_NS CONF_DIR BIN_DIR [CTR_ID CTR_TIMEOUT])" >&2
    exit 2
}

# alive PID: the process exists and is not a zombie.
alive() {
    local st
    st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
    [ -n "$st" ] && [ "$st" != Z ]
}

# wait_gone PID SECONDS
wait_gone() {
    local i
    for ((i = 0; i < $2 * 20; i++)); do
        alive "$1" || return 0
        sleep 0.05
    done
    return 1
}

ctrc() { ctr -a "$R/containerd.sock" "$@"; }

# ensure_dir DIR: mkdir -p, recording every component created, so that
# teardown removes exactly those (rmdir, deepest first).
ensure_dir() {
    local d=$1 todo=()
    while [ ! -e "$d" ]; do
        todo=("$d" "${todo[@]}")
        d=$(dirname "$d")
    done
    [ -d "$d" ] || die "$d exists and is not a directory"
    for d in "${todo[@]}"; do
        mkdir "$d"
        echo "$d" >>"$R/created"
    done
}

teardown() {
    local rc=$? pid p argv0
    set +e
    if [ -z "$R" ] || [ ! -d "$R" ] || [ "$keep" = 1 ]; then return "$rc"; fi
    # The task: kill it and let ctr finish (DEL, container removal).
    if [ -f "$R/wrapper.pid" ] && [ ! -f "$R/ctr.rc" ]; then
        pid=$(cat "$R/wrapper.pid")
        if alive "$pid"; then
            ctrc task kill -s SIGKILL "$(cat "$R/id")" >/dev/null 2>&1
            if ! wait_gone "$pid" 20; then
                echo "ctr-run: ctr did not finish after SIGKILL of the task; killing it (no DEL)" >&2
                [ -f "$R/ctr.pid" ] && kill -KILL "$(cat "$R/ctr.pid")" 2>/dev/null
                kill -KILL "$pid" 2>/dev/null
                wait_gone "$pid" 5
            fi
        fi
    fi
    if [ -f "$R/containerd.pid" ]; then
        pid=$(cat "$R/containerd.pid")
        if alive "$pid"; then
            ctrc task rm -f "$(cat "$R/id" 2>/dev/null)" >/dev/null 2>&1
            ctrc container rm "$(cat "$R/id" 2>/dev/null)" >/dev/null 2>&1
            kill -TERM "$pid" 2>/dev/null
            wait_gone "$pid" 10 || { kill -KILL "$pid" 2>/dev/null; wait_gone "$pid" 5; }
        fi
        # Leftover shims of this containerd: containerd-shim* whose command
        # line names our socket.
        for p in /proc/[0-9]*; do
            argv0=""
            { IFS= read -r -d '' argv0 <"$p/cmdline"; } 2>/dev/null
            [[ $argv0 == *containerd-shim* ]] || continue
            if tr '\0' ' ' 2>/dev/null <"$p/cmdline" | grep -qF -- "-address $R/containerd.sock"; then
                kill -KILL "${p#/proc/}" 2>/dev/null
            fi
        done
    fi
    # Every mount lived in a private namespace; refuse to rm across one.
    if findmnt -rn -o TARGET | grep -qF -- "$R"; then
        echo "ctr-run: mounts left under $R; not removing it" >&2
        exit 125
    else
        if [ -f "$R/created" ]; then
            tac "$R/created" | while read -r p; do rmdir "$p" 2>/dev/null || echo "ctr-run: could not rmdir $p" >&2; done
        fi
        rm -rf --one-file-system "$R"
    fi
    return "$rc"
}

# start_containerd: private containerd in its own mount namespace.
start_containerd() {
    mkdir -p "$R/root" "$R/state" "$R/opt" "$R/fifo" "$R/cnicache"
    cat >"$R/config.toml" <<EOF
version = 2
root = "$R/root"
state = "$R/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "$R/containerd.sock"
[ttrpc]
  address = "$R/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$R/opt"
EOF
    # The pid is written from inside (setsid may fork).
    # shellcheck disable=SC2016
    setsid unshare -m --propagation private sh -c \
        'echo $$ >"$2.pid" && mount -t tmpfs -o mode=0755 ctr-run /run && exec containerd --config "$1"' \
        ctr-run-containerd "$R/config.toml" "$R/containerd" </dev/null >"$R/containerd.log" 2>&1 &
    local i
    for ((i = 0; i < 400; i++)); do
        ctrc version >/dev/null 2>&1 && return 0
        if [ -f "$R/containerd.pid" ] && ! alive "$(cat "$R/containerd.pid")"; then break; fi
        sleep 0.05
    done
    tail -n 20 "$R/containerd.log" >&2
    die "containerd did not come up (log above)"
}

make_rootfs() {
    local bb a
    bb=$(command -v busybox) || die "busybox not found (busybox-static; see scripts/deps.sh)"
    if ldd "$bb" >/dev/null 2>&1; then die "$bb is dynamically linked; the container needs busybox-static"; fi
    mkdir -p "$R/rootfs/bin" "$R/rootfs/proc" "$R/rootfs/sys" "$R/rootfs/dev" "$R/rootfs/tmp" "$R/rootfs/etc"
    cp "$bb" "$R/rootfs/bin/busybox"
    for a in $("$bb" --list); do
        [ "$a" = busybox ] || ln -s busybox "$R/rootfs/bin/$a"
    done
}

# launch CMD: ctr run --rm --cni in the background, in NODE_NS and a private
# mount namespace. Writes wrapper.pid, ctr.pid, later ctr.rc; out, err.
launch() {
    local enter
    if [[ $NODE_NS == /* ]]; then
        [ -e "$NODE_NS" ] || die "NODE_NS $NODE_NS does not exist"
        enter=(nsenter "--net=$NODE_NS")
    else
        [ -e "/run/netns/$NODE_NS" ] || die "netns $NODE_NS not found in /run/netns"
        enter=(ip netns exec "$NODE_NS")
    fi
    # Inner script, positional: $1 remount /sys (nsenter only), $2 CONF_DIR,
    # $3 BIN_DIR, $4 cache, $5 state dir; then the ctr arguments.
    # shellcheck disable=SC2016
    local inner='
        set -e
        echo $$ >"$5/wrapper.pid"
        if [ "$1" = 1 ]; then umount -l /sys 2>/dev/null || true; mount -t sysfs sysfs /sys; fi
        mount --bind "$2" /etc/cni/net.d
        mount --bind "$3" /opt/cni/bin
        mount --bind "$4" /var/lib/cni
        st=$5
        shift 5
        set +e
        ctr "$@" </dev/null >"$st/out" 2>"$st/err" &
        echo $! >"$st/ctr.pid"
        wait $!
        echo $? >"$st/ctr.rc.tmp"
        mv "$st/ctr.rc.tmp" "$st/ctr.rc"'
    local remount=0
    [ "${enter[0]}" = nsenter ] && remount=1
    # The outer sh runs CMD in a child shell, then leaves its exit status in
    # the rootfs (= $R/rootfs on the host): absent means killed or never ran.
    # shellcheck disable=SC2016
    setsid "${enter[@]}" unshare -m --propagation private sh -c "$inner" ctr-run-inner \
        "$remount" "$CONF_DIR" "$BIN_DIR" "$R/cnicache" "$R" \
        -a "$R/containerd.sock" run --rm --cni --cgroup "" --fifo-dir "$R/fifo" \
        --env PATH=/bin --rootfs "$R/rootfs" "$ID" \
        /bin/sh -c '/bin/sh -c "$1"; echo $? >/.ctr-run-exit' ctr-run "$CMD" \
        </dev/null >"$R/launch.log" 2>&1 &
    local i
    for ((i = 0; i < 200; i++)); do
        [ -s "$R/wrapper.pid" ] && return 0
        sleep 0.05
    done
    cat "$R/launch.log" >&2
    die "could not start ctr in $NODE_NS (log above)"
}

# finish [stderr]: ctr has exited. Prints the container's output (its
# stdout to stderr with "stderr"); sets status, ctr_rc and ctr_failed.
finish() {
    if [ "${1:-}" = stderr ]; then cat "$R/out" >&2 2>/dev/null; else cat "$R/out" 2>/dev/null; fi
    cat "$R/launch.log" "$R/err" >&2 2>/dev/null
    ctr_rc=$(cat "$R/ctr.rc" 2>/dev/null || echo 255)
    ctr_failed=""
    if grep -q 'msg="network review"' "$R/err" 2>/dev/null; then
        ctr_failed="ctr's CNI DEL (network.Remove) failed (see the error above)"
    fi
    if [ -f "$R/rootfs/.ctr-run-exit" ]; then
        status=$(cat "$R/rootfs/.ctr-run-exit")
    else
        status=""
    fi
}

prepare() {
    [ "$(id -u)" = 0 ] || die "needs root"
    local v
    for v in NODE_NS CONF_DIR BIN_DIR; do
        [ -n "${!v:-}" ] || { echo "ctr-run: $v is not set" >&2; usage; }
    done
    [ -d "$CONF_DIR" ] || die "CONF_DIR $CONF_DIR is not a directory"
    [ -d "$BIN_DIR" ] || die "BIN_DIR $BIN_DIR is not a directory"
    CONF_DIR=$(cd "$CONF_DIR" && pwd)
    BIN_DIR=$(cd "$BIN_DIR" && pwd)
    local c
    for c in containerd ctr runc containerd-shim-runc-v2 unshare nsenter ip findmnt; do
        command -v "$c" >/dev/null || die "$c not found (see scripts/deps.sh)"
    done
    ID=${CTR_ID:-ctrrun-$$-$RANDOM}
    [[ $ID =~ ^[A-Za-z0-9][A-Za-z0-9_.-]*$ ]] || die "bad CTR_ID $ID"
    R=$(mktemp -d /tmp/ctr-run.XXXXXX)
    echo "$ID" >"$R/id"
    trap teardown EXIT
    trap 'exit 130' INT TERM HUP
    ensure_dir /etc/cni/net.d
    ensure_dir /opt/cni/bin
    ensure_dir /var/lib/cni
    make_rootfs
    start_containerd
}

[ $# -ge 1 ] || usage
mode=$1
shift
case $mode in
run)
    [ $# -eq 1 ] || usage
    CMD=$1
    timeout=${CTR_TIMEOUT:-60}
    [[ $timeout =~ ^[1-9][0-9]*$ ]] || die "bad CTR_TIMEOUT $timeout"
    prepare
    launch
    wpid=$(cat "$R/wrapper.pid")
    timed_out=0
    if ! wait_gone "$wpid" "$timeout"; then
        timed_out=1
        ctrc task kill -s SIGKILL "$ID" >/dev/null 2>&1 || true
        wait_gone "$wpid" 20 || true
    fi
    wait "$wpid" 2>/dev/null || true
    finish
    if [ "$timed_out" = 1 ]; then
        echo "ctr-run: killed the task after ${timeout}s" >&2
        [ -z "$ctr_failed" ] || die "$ctr_failed"
        exit 124
    fi
    if [ -z "$status" ]; then
        [ -z "$ctr_failed" ] || echo "ctr-run: $ctr_failed" >&2
        die "ctr failed (rc $ctr_rc) before the container command finished (see ctr's error above)"
    fi
    if [ -n "$ctr_failed" ]; then
        echo "ctr-run: the container command exited with $status" >&2
        die "$ctr_failed"
    fi
    exit "$status"
    ;;
start)
    [ $# -eq 1 ] || usage
    CMD=$1
    prepare
    launch
    wpid=$(cat "$R/wrapper.pid")
    for ((i = 0; i < 600; i++)); do
        line=$(ctrc task ls 2>/dev/null | awk -v id="$ID" '$1 == id {print $2, $3}')
        [ "${line#* }" = RUNNING ] && break
        alive "$wpid" || break
        sleep 0.05
    done
    if [ "${line#* }" != RUNNING ]; then
        wait_gone "$wpid" 5 || true
        finish stderr
        [ -z "$status" ] || die "the container command exited (status $status) before start saw the task RUNNING (output above)"
        die "the task did not reach RUNNING (ctr rc ${ctr_rc}; output above)"
    fi
    pid=${line%% *}
    keep=1
    printf 'CTR_RUN_STATE=%s\nCTR_ID=%s\nCNI_CONTAINERID=default-%s\nCTR_PID=%s\nCTR_NETNS=/proc/%s/ns/net\n' \
        "$R" "$ID" "$ID" "$pid" "$pid"
    ;;
stop)
    [ $# -eq 1 ] || usage
    R=$1
    if [ ! -f "$R/id" ] || [ ! -f "$R/wrapper.pid" ]; then die "$R is not a ctr-run.sh state dir"; fi
    R=$(cd "$R" && pwd)
    [[ $R == /tmp/ctr-run.* ]] || die "$R is not a ctr-run.sh state dir"
    ID=$(cat "$R/id")
    trap teardown EXIT
    trap 'exit 130' INT TERM HUP
    killed=0
    if [ ! -f "$R/ctr.rc" ]; then
        if [ ! -f "$R/rootfs/.ctr-run-exit" ]; then
            ctrc task kill -s SIGKILL "$ID" >/dev/null 2>&1 || true
            killed=1
        fi
        for ((i = 0; i < 400; i++)); do
            [ -f "$R/ctr.rc" ] && break
            sleep 0.05
        done
        [ -f "$R/ctr.rc" ] || die "ctr did not finish within 20 s after the kill"
    fi
    finish
    [ -z "$ctr_failed" ] || die "$ctr_failed"
    if [ -n "$status" ]; then exit "$status"; fi
    [ "$killed" = 1 ] && exit 0
    die "ctr failed (rc $ctr_rc; see its error above)"
    ;;
*) usage ;;
esac
