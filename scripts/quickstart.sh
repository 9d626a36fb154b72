#!/usr/bin/env bash
# Quick start: build cube-network-agent and run it in the foreground with its
# built-in defaults on the system bus, in this host's network namespace.
#
#   scripts/quickstart.sh [--no-deps] [--no-build] [AGENT OPTIONS...]
#   scripts/quickstart.sh --remove
#
# The agent creates the gateway device cube-dev (192.168.0.1/18) and a warm
# pool of 16 TAPs (ctapw*), keeps its records in /var/lib/cube-network-agent
# and its varlink socket in /run/cube-network-agent, pins its eBPF maps in
# /sys/fs/bpf/cube-network-agent, attaches tc programs to the uplink (the
# default route's interface), to lo and cube-dev, and sets route_localnet
# and accept_local on lo (docs/datapath.md, "Host settings"). Pass
# --datapath none to skip the datapath.
#
# This script itself: installs the run-time and build packages
# (scripts/deps.sh --runtime --build; --no-deps skips it), builds the three
# binaries (--no-build skips it), puts a symlink to cubenetctl in
# /usr/local/bin, installs the bus policy in /etc/dbus-1/system.d so root may
# own the name and the polkit actions (when polkitd is installed) so that
# non-root callers can be granted access, mounts a bpffs on /sys/fs/bpf if none is mounted, and starts
# `dbus-daemon --system` if no system bus runs. It records what it created
# (and what the host had before) in target/quickstart.state; Ctrl-C stops
# the agent (networks and the datapath stay for the next start), and
# `scripts/quickstart.sh --remove` removes exactly what this script and the
# agent created, and nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."
# -h/--help: this script's usage, before anything is done.
for a in "$@"; do
    case $a in
    -h | --help)
        sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
        echo "Agent options: target/release/cube-network-agent --help"
        exit 0
        ;;
    esac
done
ROOT=$PWD
REC=$ROOT/target/quickstart.state
AGENT_DIRS=(/var/lib/cube-network-agent /run/cube-network-agent /sys/fs/bpf/cube-network-agent)
POLICY=/etc/dbus-1/system.d/org.cube.NetworkAgent.conf
CTL_LINK=/usr/local/bin/cubenetctl
POLKIT_ACTIONS=/usr/share/polkit-1/actions/org.cube.NetworkAgent.policy
REPORT=/run/systemd/report/org.cube.NetworkAgent
LO_SYSCTLS=(net.ipv4.conf.lo.route_localnet net.ipv4.conf.lo.accept_local)

[ "$(id -u)" = 0 ] || { echo "quickstart: run as root (the agent creates TAPs and a gateway device)" >&2; exit 1; }

uplink() { ip -o -4 route show default 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "dev") { print $(i + 1); exit }}'; }
has_clsact() { tc qdisc show dev "$1" 2>/dev/null | grep -q '^qdisc clsact'; }
# Links the agent makes: cube-dev, the tc block anchor cube-blk, the shaper
# pair cube-shp and cube-shp-r (bandwidth limits) and the
# TAPs/veths of prefix ctap.
agent_links() { ip -o link show 2>/dev/null | awk -F': ' '{sub(/@.*/, "", $2); print $2}' | grep -E '^(cube-dev|cube-blk|cube-shp|ctap)' || true; }

# Field 22 of /proc/PID/stat (after the command name, which may hold spaces).
start_time() { sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | awk '{print $20}'; }

remove() {
    [ -f "$REC" ] || { echo "quickstart --remove: nothing recorded in $REC (nothing to remove)"; return 0; }
    echo "quickstart: removing what the quick start created (recorded in $REC)"
    local kind a b
    # The agent first (SIGTERM: it leaves its state; everything goes below).
    while read -r kind a b; do
        [ "$kind" = agent ] || continue
        # Only the process this script started: the pid and its start time
        # (a recycled pid has another one).
        if kill -0 "$a" 2>/dev/null && [ "$(start_time "$a")" = "$b" ] &&
            grep -q cube-network-agent "/proc/$a/cmdline" 2>/dev/null; then
            kill -TERM "$a"
            for _ in $(seq 100); do kill -0 "$a" 2>/dev/null || break; sleep 0.05; done
            kill -KILL "$a" 2>/dev/null || true
            echo "  stopped the agent (pid $a)"
        fi
    done <"$REC"
    while read -r kind a b; do
        case $kind in
        link-before) ;;
        clsact)
            if has_clsact "$a"; then tc qdisc del dev "$a" clsact && echo "  removed the clsact qdisc of $a"; fi
            ;;
        sysctl)
            sysctl -qw "$a=$b" && echo "  restored $a=$b"
            ;;
        dir)
            if [ -e "$a" ]; then rm -rf "$a" && echo "  removed $a"; fi
            ;;
        file)
            if [ -e "$a" ] || [ -L "$a" ]; then rm -f "$a" && echo "  removed $a"; fi
            ;;
        esac
    done <"$REC"
    # The metrics socket: the agent binds it afresh at every start, over
    # whatever an earlier agent left there, so once ours has stopped it is
    # the agent's, whoever made its directory (systemd does on its hosts).
    # Left alone only while another agent serves it.
    if [ -S "$REPORT" ] && ! socat -u /dev/null "UNIX-CONNECT:$REPORT" 2>/dev/null; then
        rm -f "$REPORT" && echo "  removed $REPORT"
    fi
    # Links the agent made (those that were not there before).
    local before now l
    before=$(awk '$1 == "link-before" {print $2}' "$REC")
    now=$(agent_links)
    for l in $now; do
        if ! grep -qx -- "$l" <<<"$before"; then ip link del "$l" 2>/dev/null && echo "  deleted link $l"; fi
    done
    # The bus: reload without our policy, or stop the daemon we started (and
    # what it activated).
    local reload=1
    while read -r kind a b; do
        case $kind in
        dbus-daemon)
            reload=0
            local kids
            kids=$(ps -o pid= --ppid "$a" 2>/dev/null || true)
            kill -TERM "$a" 2>/dev/null && echo "  stopped the dbus-daemon it started (pid $a)"
            for k in $kids; do kill -TERM "$k" 2>/dev/null && echo "  stopped $(cat /proc/"$k"/comm 2>/dev/null || echo pid) $k, started by that bus"; done
            for _ in $(seq 100); do kill -0 "$a" 2>/dev/null || break; sleep 0.05; done
            rm -f /run/dbus/pid /run/dbus/system_bus_socket
            ;;
        mount)
            umount "$a" && echo "  unmounted $a"
            ;;
        esac
    done <"$REC"
    while read -r kind a b; do
        if [ "$kind" = dir-bus ]; then rmdir "$a" 2>/dev/null && echo "  removed $a"; fi
    done <"$REC"
    if [ "$reload" = 1 ] && busctl --system status >/dev/null 2>&1; then
        busctl --system call org.freedesktop.DBus /org/freedesktop/DBus org.freedesktop.DBus ReloadConfig >/dev/null || true
    fi
    rm -f "$REC"
    echo "quickstart: removed. (Packages installed by scripts/deps.sh and target/ stay.)"
}

deps=1 build=1
args=()
for a in "$@"; do
    case $a in
    --remove) remove; exit 0 ;;
    --no-deps) deps=0 ;;
    --no-build) build=0 ;;
    *) args+=("$a") ;;
    esac
done

[ "$deps" = 0 ] || scripts/deps.sh --runtime --build
[ "$build" = 0 ] || cargo build --release --bin cube-network-agent --bin cubenetctl --bin cube-cni
for b in cube-network-agent cubenetctl; do
    [ -x "target/release/$b" ] || { echo "quickstart: target/release/$b is not built (drop --no-build)" >&2; exit 1; }
done

# What the host has before the agent touches it (appended: a second start
# keeps the first record's "before").
mkdir -p "$(dirname "$REC")"
first=0
[ -f "$REC" ] || first=1
rec() { echo "$*" >>"$REC"; }
if [ "$first" = 1 ]; then
    : >"$REC"
    for l in $(agent_links); do rec link-before "$l"; done
    for d in "${AGENT_DIRS[@]}"; do [ -e "$d" ] || rec dir "$d"; done
    # The directories the metrics socket (report_socket) needs where
    # systemd has none yet (outermost first: removed with its content); the
    # socket itself goes at --remove whoever made them (see remove).
    for d in /run/systemd /run/systemd/report; do
        if [ ! -e "$d" ]; then rec dir "$d"; break; fi
    done
    for k in "${LO_SYSCTLS[@]}"; do rec sysctl "$k" "$(sysctl -n "$k")"; done
    has_clsact lo || rec clsact lo
    up=$(uplink)
    if [ -n "$up" ] && ! has_clsact "$up"; then rec clsact "$up"; fi
fi
if [ ! -e "$POLICY" ]; then
    install -D -m 0644 dbus/org.cube.NetworkAgent.conf "$POLICY"
    rec file "$POLICY"
fi
# The polkit actions, so that polkitd can judge non-root callers (a grant
# is the operator's: the example rule, see the banner).
if [ -d "$(dirname "$POLKIT_ACTIONS")" ] && [ ! -e "$POLKIT_ACTIONS" ]; then
    install -m 0644 polkit/org.cube.NetworkAgent.policy "$POLKIT_ACTIONS"
    rec file "$POLKIT_ACTIONS"
fi
if [ ! -e "$CTL_LINK" ]; then
    ln -s "$ROOT/target/release/cubenetctl" "$CTL_LINK"
    rec file "$CTL_LINK"
fi
if ! mountpoint -q /sys/fs/bpf; then
    mount -t bpf bpf /sys/fs/bpf
    rec mount /sys/fs/bpf
fi
if busctl --system status >/dev/null 2>&1; then
    busctl --system call org.freedesktop.DBus /org/freedesktop/DBus org.freedesktop.DBus ReloadConfig >/dev/null
else
    echo "quickstart: no system bus running; starting dbus-daemon --system"
    [ -d /run/dbus ] || { mkdir -p /run/dbus && rec dir-bus /run/dbus; }
    rm -f /run/dbus/pid
    pid=$(dbus-daemon --system --fork --print-pid)
    rec dbus-daemon "$pid"
fi
# An agent already running on this state directory: say which, start
# nothing (the lock is the store's: its journal).
if [ -e /var/lib/cube-network-agent/journal ] && ! flock -n /var/lib/cube-network-agent/journal true; then
    holder=$(awk -v ino="$(stat -c %i /var/lib/cube-network-agent/journal)" '$2 == "FLOCK" {split($6, f, ":"); if (f[3] == ino) print $5}' /proc/locks | head -1)
    echo "quickstart: an agent already runs on /var/lib/cube-network-agent (pid ${holder:-unknown}); stop it first" >&2
    exit 1
fi
rec agent $$ "$(start_time $$)"

cat <<TXT
quickstart: starting the agent (Ctrl-C stops it; networks stay for the next start).
  cubenetctl is $CTL_LINK -> $ROOT/target/release/cubenetctl
In another shell, try README's "Using it", e.g.:
  cubenetctl ensure sbx-1 --port tcp:80
  cubenetctl list
  busctl --json=short call org.cube.NetworkAgent /org/cube/NetworkAgent org.cube.NetworkAgent Health
  cubenetctl release sbx-1
Non-root users need a polkit grant: the example rule, its two groups, and the users
in them (USER: each one; they get it with their next process):
  install -m 0644 $ROOT/polkit/50-cube-network-agent.rules.example /etc/polkit-1/rules.d/50-cube-network-agent.rules
  groupadd --system cube-network          # runtimes, VMM launchers: everything
  groupadd --system cube-network-readers  # monitoring: reads only
  usermod -aG cube-network-readers USER   # or cube-network
Remove everything it created (links, datapath, records, bus setup, the symlink):
  scripts/quickstart.sh --remove
TXT
exec target/release/cube-network-agent ${args[@]+"${args[@]}"}
