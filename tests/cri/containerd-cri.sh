#!/usr/bin/env bash
# Runs Debian 12's containerd 1.6 with its CRI plugin enabled, as kubelet's
# runtime, against a given CNI config and plugin dir, without touching the
# host's containerd, CNI dirs, cgroups or interfaces. A CRI client
# (tests/cri/cri.py) then plays kubelet on the socket. Needs root and
# containerd, runc, busybox-static (scripts/deps.sh).
#
#   containerd-cri.sh start    start it; returns once containerd answers
#                              and the image is imported; prints shell
#                              assignments: CRI_STATE CRI_SOCK CRI_IMAGE
#                              CRI_CGROUP CRI_PID CRI_CNI_CACHE
#   containerd-cri.sh stop STATE
#                              tear it down: containerd, its shims, every
#                              container process, the pods' cgroups, the
#                              state dir; prints the tail of containerd's
#                              log to stderr when it logged CNI errors
#
# Environment (start):
#   NODE_NS    netns where containerd runs, hence where the CNI plugins run
#              (the agent's "node" netns): a name under /run/netns or a path
#   CONF_DIR   the CRI plugin's cni.conf_dir (max_conf_num = 1: the first
#              config file in sort order)
#   BIN_DIR    the CRI plugin's cni.bin_dir
#
# The image: a docker-archive tar (manifest.json, config.json whose
# rootfs.diff_ids is the sha256 of layer.tar, layer.tar) of a busybox-static
# rootfs, imported as CRI_IMAGE (cube.test/busybox:1) into the k8s.io
# namespace. Its Cmd sleeps forever, so it is also the sandbox ("pause")
# image. Pods must set linux.cgroup_parent = CRI_CGROUP (cri.py
# --cgroup-parent): the cgroupfs driver then puts every pod and container
# under /sys/fs/cgroup/*/CRI_CGROUP, which stop empties and removes.
#
# CRI settings this machine needs (docs/kubernetes.md): sandbox_image a
# local image (no registry), disable_apparmor, restrict_oom_score_adj (root
# here lacks CAP_SYS_RESOURCE: without it the sandbox fails with "can't get
# final child's PID from pipe: EOF"), snapshotter "native", runc with
# SystemdCgroup = false (no systemd as PID 1).
#
# How: containerd runs under NODE_NS (nsenter --net: `ip netns exec` would
# remount /sys, and runc needs the cgroup mounts) in its own mount namespace
# with a tmpfs on /run (its sockets, the shims', runc's state, the pods'
# netns files /run/netns/cni-*) and STATE/varlib bind-mounted over /var/lib
# (libcni's cache, /var/lib/cni, has no setting in containerd 1.6; it is
# STATE/varlib/cni = CRI_CNI_CACHE on the host: the results and the
# runtimeConfig containerd sent). Root, state, opt dir and sockets live in
# STATE. Nothing lands in the host's /run/containerd, /var/lib/containerd,
# /opt/containerd or /var/lib/cni. Teardown runs on every exit path of start
# (trap) and in stop. Instances may run concurrently (one per node netns).
#
# Exit status: 0; 125 a failure of this script or of containerd, with a
# "containerd-cri:" message on stderr; 2 usage.
set -euo pipefail

R=""
keep=0
IMAGE=cube.test/busybox:1

die() {
    echo "containerd-cri: $*" >&2
    exit 125
}
usage() {
    echo "usage: $0 start | $0 stop STATE  (start: env NODE_NS CONF_DIR BIN_DIR)" >&2
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

ctrc() { ctr -a "$R/containerd.sock" -n k8s.io "$@"; }

# descendants PID: every process below PID (children first found, then
# theirs), from /proc/*/stat's ppid.
descendants() {
    local want=" $1 " found=1 p ppid out=""
    while [ "$found" = 1 ]; do
        found=0
        for p in /proc/[0-9]*; do
            p=${p#/proc/}
            [[ $want == *" $p "* ]] && continue
            ppid=$(awk '{print $4}' "/proc/$p/stat" 2>/dev/null) || continue
            if [[ $want == *" $ppid "* ]]; then
                want+="$p "
                out+="$p "
                found=1
            fi
        done
    done
    echo "$out"
}

# shims: pids of containerd-shim* processes whose command line names our
# socket.
shims() {
    local p argv0
    for p in /proc/[0-9]*; do
        argv0=""
        { IFS= read -r -d '' argv0 <"$p/cmdline"; } 2>/dev/null
        [[ $argv0 == *containerd-shim* ]] || continue
        if tr '\0' ' ' 2>/dev/null <"$p/cmdline" | grep -qF -- "-address $R/containerd.sock"; then
            echo "${p#/proc/}"
        fi
    done
}

# cgroup_dirs: our pods' cgroup directories in every hierarchy, deepest
# first.
cgroup_dirs() {
    local cg
    cg=$(cat "$R/cgroup" 2>/dev/null) || return 0
    [[ $cg =~ ^cube-cri-[0-9]+-[0-9]+$ ]] || return 0
    find /sys/fs/cgroup -mindepth 1 -maxdepth 3 -type d -name "$cg" 2>/dev/null |
        while read -r d; do find "$d" -depth -type d; done
}

teardown() {
    local rc=$? pid p d n failed=0
    set +e
    if [ -z "$R" ] || [ ! -d "$R" ] || [ "$keep" = 1 ]; then return "$rc"; fi
    # Containers first (their processes outlive a killed shim), then the
    # shims, then containerd. Every shim was started by this containerd;
    # a shim re-parents to init if containerd went first, so they are
    # found by their command line, not by ancestry.
    local victims=""
    for p in $(shims); do victims+="$(descendants "$p") $p "; done
    for d in $(cgroup_dirs); do
        victims+="$(cat "$d/cgroup.procs" 2>/dev/null | tr '\n' ' ') "
    done
    for p in $victims; do kill -KILL "$p" 2>/dev/null; done
    if [ -f "$R/containerd.pid" ]; then
        pid=$(cat "$R/containerd.pid")
        if alive "$pid"; then
            kill -TERM "$pid" 2>/dev/null
            wait_gone "$pid" 10 || { kill -KILL "$pid" 2>/dev/null; wait_gone "$pid" 5; }
        fi
    fi
    for p in $victims $(shims); do
        kill -KILL "$p" 2>/dev/null
        wait_gone "$p" 5 || { echo "containerd-cri: process $p did not exit" >&2; failed=1; }
    done
    # The pods' cgroups: empty once their processes are gone (the kernel
    # may take a moment to let go of a killed task).
    for d in $(cgroup_dirs); do
        for ((n = 0; n < 100; n++)); do
            rmdir "$d" 2>/dev/null && break
            for p in $(cat "$d/cgroup.procs" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
            sleep 0.05
        done
        [ -d "$d" ] && { echo "containerd-cri: could not remove cgroup $d" >&2; failed=1; }
    done
    # Every mount lived in the private namespace, gone with containerd and
    # its shims; refuse to rm across a mount that is still there.
    if findmnt -rn -o TARGET | grep -qF -- "$R"; then
        echo "containerd-cri: mounts left under $R; not removing it" >&2
        failed=1
    else
        rm -rf --one-file-system "$R"
    fi
    [ "$failed" = 0 ] || exit 125
    return "$rc"
}

# make_image: the busybox docker-archive tar, $R/image.tar.
make_image() {
    local bb a img=$R/image diff
    bb=$(command -v busybox) || die "busybox not found (busybox-static; see scripts/deps.sh)"
    if ldd "$bb" >/dev/null 2>&1; then
        die "$bb is dynamically linked; the image needs busybox-static"
    fi
    mkdir -p "$img/rootfs/bin" "$img/rootfs/proc" "$img/rootfs/sys" "$img/rootfs/dev" \
        "$img/rootfs/tmp" "$img/rootfs/etc" "$img/rootfs/root"
    chmod 1777 "$img/rootfs/tmp"
    cp "$bb" "$img/rootfs/bin/busybox"
    for a in $("$bb" --list); do
        [ "$a" = busybox ] || ln -s busybox "$img/rootfs/bin/$a"
    done
    tar --numeric-owner --owner=0 --group=0 -C "$img/rootfs" -cf "$img/layer.tar" .
    diff=$(sha256sum "$img/layer.tar" | cut -d' ' -f1)
    cat >"$img/config.json" <<EOF
{"architecture": "amd64", "os": "linux",
 "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sleep", "100000000"], "WorkingDir": "/"},
 "rootfs": {"type": "layers", "diff_ids": ["sha256:$diff"]}}
EOF
    cat >"$img/manifest.json" <<EOF
[{"Config": "config.json", "RepoTags": ["$IMAGE"], "Layers": ["layer.tar"]}]
EOF
    tar -C "$img" -cf "$R/image.tar" manifest.json config.json layer.tar
    rm -rf "$img"
}

start_containerd() {
    mkdir -p "$R/root" "$R/state" "$R/opt" "$R/varlib/cni" "$R/logs"
    cat >"$R/config.toml" <<EOF
version = 2
root = "$R/root"
state = "$R/state"
[grpc]
  address = "$R/containerd.sock"
[ttrpc]
  address = "$R/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$R/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$IMAGE"
  disable_apparmor = true
  restrict_oom_score_adj = true
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$BIN_DIR"
    conf_dir = "$CONF_DIR"
    max_conf_num = 1
EOF
    # The pid is written from inside (setsid may fork).
    # shellcheck disable=SC2016
    setsid nsenter "--net=$NETNS" unshare -m --propagation private sh -c \
        'echo $$ >"$2.pid" && mount -t tmpfs -o mode=0755 containerd-cri /run &&
         mount --bind "$3" /var/lib && exec containerd --config "$1"' \
        containerd-cri "$R/config.toml" "$R/containerd" "$R/varlib" \
        </dev/null >"$R/containerd.log" 2>&1 &
    local i
    for ((i = 0; i < 400; i++)); do
        ctrc version >/dev/null 2>&1 && return 0
        if [ -f "$R/containerd.pid" ] && ! alive "$(cat "$R/containerd.pid")"; then break; fi
        sleep 0.05
    done
    tail -n 20 "$R/containerd.log" >&2
    die "containerd did not come up (log above)"
}

[ $# -ge 1 ] || usage
mode=$1
shift
case $mode in
start)
    [ $# -eq 0 ] || usage
    [ "$(id -u)" = 0 ] || die "needs root"
    for v in NODE_NS CONF_DIR BIN_DIR; do
        [ -n "${!v:-}" ] || { echo "containerd-cri: $v is not set" >&2; usage; }
    done
    if [[ $NODE_NS == /* ]]; then NETNS=$NODE_NS; else NETNS=/run/netns/$NODE_NS; fi
    [ -e "$NETNS" ] || die "netns $NETNS not found"
    [ -d "$CONF_DIR" ] || die "CONF_DIR $CONF_DIR is not a directory"
    [ -d "$BIN_DIR" ] || die "BIN_DIR $BIN_DIR is not a directory"
    CONF_DIR=$(cd "$CONF_DIR" && pwd)
    BIN_DIR=$(cd "$BIN_DIR" && pwd)
    for c in containerd ctr runc containerd-shim-runc-v2 unshare nsenter findmnt sha256sum tar; do
        command -v "$c" >/dev/null || die "$c not found (see scripts/deps.sh)"
    done
    R=$(mktemp -d /tmp/containerd-cri.XXXXXX)
    cg=cube-cri-$$-$RANDOM
    echo "$cg" >"$R/cgroup"
    trap teardown EXIT
    trap 'exit 130' INT TERM HUP
    make_image
    start_containerd
    out=$(ctrc images import --snapshotter native "$R/image.tar" 2>&1) ||
        die "ctr images import: $out"
    rm -f "$R/image.tar"
    keep=1
    printf 'CRI_STATE=%s\nCRI_SOCK=%s\nCRI_IMAGE=%s\n' "$R" "$R/containerd.sock" "$IMAGE"
    printf 'CRI_CGROUP=/%s\nCRI_PID=%s\nCRI_CNI_CACHE=%s\n' \
        "$cg" "$(cat "$R/containerd.pid")" "$R/varlib/cni"
    ;;
stop)
    [ $# -eq 1 ] || usage
    R=$1
    [ -f "$R/cgroup" ] && [ -f "$R/config.toml" ] || die "$R is not a containerd-cri.sh state dir"
    R=$(cd "$R" && pwd)
    [[ $R == /tmp/containerd-cri.* ]] || die "$R is not a containerd-cri.sh state dir"
    trap teardown EXIT
    trap 'exit 130' INT TERM HUP
    exit 0
    ;;
*) usage ;;
esac
