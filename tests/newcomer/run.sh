#!/usr/bin/env bash
# A newcomer's first hour, on a machine of its own: README's quick start
# (`scripts/quickstart.sh`), then every command of README's "Using it"
# examples verbatim, then `scripts/quickstart.sh --remove`, which must
# leave the machine as it was (files, mounts, links, addresses, routes,
# qdiscs, sysctls, processes, bpffs pins: compared before and after).
#
# The "machine" is a private mount + pid + network namespace (as root): /run
# and /tmp are fresh tmpfs, /etc, /var/lib and /usr/local are overlays on
# tmpfs, /sys is the new namespace's sysfs (so no bpffs is mounted on
# /sys/fs/bpf), and a "world" namespace behind a veth is its default route.
# No system bus runs there, so the quick start starts one. The host is not
# touched. Needs the release binaries (cargo build --release --bins) and
# the packages of scripts/deps.sh. Prints "ok - ..." / "not ok - ..." and
# "N passed, M failed"; exits non-zero on a failure.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
. "$ROOT/tests/root.sh"
require_root newcomer "namespaces, mounts, TAPs"

if [ "${NEWCOMER_INNER:-}" != 1 ]; then
    exec env NEWCOMER_INNER=1 unshare --mount --propagation private --pid --fork --mount-proc \
        --net "$0" "$@"
fi

# ---- inside: make the fresh machine -----------------------------------------
S=$(mktemp -d /tmp/cube-newcomer.XXXXXX)
mount -t tmpfs tmpfs "$S"
ovl() { # an overlay whose upper layer lives on tmpfs: writes vanish with us
    local n; n=$(echo "$1" | tr / _)
    mkdir -p "$S/$n.up" "$S/$n.wk"
    mount -t overlay overlay -o "lowerdir=$1,upperdir=$S/$n.up,workdir=$S/$n.wk" "$1"
}
mkdir -p /usr/share/polkit-1/actions /opt
for d in /etc /var/lib /usr/local /usr/share/polkit-1/actions /opt; do ovl "$d"; done
mount -t tmpfs -o mode=755 tmpfs /run
# As on any systemd host: /run/systemd/report is there before the quick
# start, so --remove must take the agent's socket in it, not a directory.
mkdir -p /run/systemd/report
mount -t sysfs sysfs /sys
# The repository: target/quickstart.state is written there.
mkdir -p "$S/repo.up" "$S/repo.wk"
mount -t overlay overlay -o "lowerdir=$ROOT,upperdir=$S/repo.up,workdir=$S/repo.wk" "$ROOT"
ip link set lo up
mkdir -p /run/netns
ip netns add world
ip link add up0 type veth peer name w0 netns world
sysctl -qw net.ipv6.conf.up0.disable_ipv6=1
ip addr add 198.51.100.1/24 dev up0
ip link set up0 up
ip -n world addr add 198.51.100.2/24 dev w0
ip -n world link set w0 up
ip -n world link set lo up
ip route add default via 198.51.100.2 dev up0
cd "$ROOT"

PASS=0 FAIL=0
ok() { echo "ok - $*"; PASS=$((PASS + 1)); }
nok() { echo "not ok - $*"; FAIL=$((FAIL + 1)); }
A="org.cube.NetworkAgent /org/cube/NetworkAgent org.cube.NetworkAgent"

snapshot() {
    echo "## files"
    find /etc /var/lib /usr/local /usr/share/polkit-1/actions /opt /run -xdev 2>/dev/null | grep -v '^/run/netns' | sort
    echo "## mounts"
    findmnt -rn -o TARGET,FSTYPE | sort
    echo "## links"
    ip -o link show | awk -F': ' '{print $2}' | sort
    echo "## addresses"
    ip -o addr show | awk '{print $2, $3, $4}' | sort
    echo "## routes"
    ip route show table all | sort
    echo "## qdiscs"
    tc qdisc show | sort
    echo "## sysctls"
    sysctl net.ipv4.conf.lo.route_localnet net.ipv4.conf.lo.accept_local net.ipv4.ip_forward
    echo "## processes"
    ps -eo comm= | grep -vxE 'ps|sort|bash|run.sh|grep|unshare|awk|sed|find|sysctl' | sort
}
snapshot >"$S/before"

# ---- --help: the script's own usage, nothing done ----------------------------
if out=$(scripts/quickstart.sh --help 2>&1) && [[ "$out" == *"scripts/quickstart.sh --remove"* ]] &&
    [ ! -e target/quickstart.state ] && ! busctl --system status >/dev/null 2>&1; then
    ok "scripts/quickstart.sh --help prints its usage and changes nothing"
else
    nok "scripts/quickstart.sh --help: $(head -c 300 <<<"$out"); state file: $(ls target/quickstart.state 2>&1)"
fi

# ---- README's quick start (the first command; deps and build are done) ------
# An agent ran here before (killed: its metrics socket stays behind, dead,
# in the host's /run/systemd/report); the quick start's agent binds it
# afresh, and --remove must take it.
/usr/bin/python3 -c 'import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])' \
    /run/systemd/report/org.cube.NetworkAgent
LOG=$S/quickstart.log
scripts/quickstart.sh --no-deps --no-build >"$LOG" 2>&1 &
QS=$!
for _ in $(seq 300); do
    busctl --system call $A Health >/dev/null 2>&1 && break
    kill -0 $QS 2>/dev/null || break
    sleep 0.05
done
if busctl --system call $A Health >/dev/null 2>&1; then
    ok "scripts/quickstart.sh: the agent answers on a system bus it started"
else
    nok "the quick start did not come up: $(tail -5 "$LOG")"
    echo "$PASS passed, $FAIL failed"
    exit 1
fi
grep -q "cubenetctl is /usr/local/bin/cubenetctl" "$LOG" && ok "the quick start says where cubenetctl is" ||
    nok "the banner does not say where cubenetctl is"
[ "$(command -v cubenetctl)" = /usr/local/bin/cubenetctl ] && ok "cubenetctl is on PATH" || nok "cubenetctl not on PATH"
health=$(busctl --system --json=short call $A Health)
[[ "$health" == *'"data":[true'* ]] && ok "Health is true" || nok "Health: $health"

# ---- a non-root user: refused with the way forward, then granted ----------
# As polkit judges it: the quick start installed the actions (without them
# polkitd answers "not registered" for every non-root call).
NOBODY=(setpriv --reuid=65534 --regid=65534 --clear-groups)
out=$("${NOBODY[@]}" cubenetctl health 2>&1)
rc=$?
if [ $rc = 4 ] && [[ "$out" == *"org.cube.NetworkAgent.read"* ]] && [[ "$out" != *"not registered"* ]] &&
    [[ "$out" == *"polkit/50-cube-network-agent.rules.example"* ]] && [ -e polkit/50-cube-network-agent.rules.example ]; then
    ok "a non-root user is refused (exit 4) with the action and an example rule that exists"
else
    nok "non-root health: exit $rc: $(head -c 400 <<<"$out")"
fi
out=$("${NOBODY[@]}" cubenetctl top </dev/null 2>&1)
rc=$?
[ $rc = 4 ] && [[ "$out" == *"AccessDenied"*"org.cube.NetworkAgent.read"* ]] &&
    ok "cubenetctl top as a non-root user: exit 4 with the way forward" ||
    nok "non-root top: exit $rc: $(head -c 400 <<<"$out")"
# The banner's grant, followed literally: its command lines as printed
# (the rule, both groups, the user: USER is nobody here).
RULE=/etc/polkit-1/rules.d/50-cube-network-agent.rules
grant=$(grep -E '^  (install .*rules\.example|groupadd |usermod )' "$LOG")
if [ "$(grep -c . <<<"$grant")" = 4 ]; then
    bad=
    while IFS= read -r line; do
        line=${line//USER/nobody}
        out=$(bash -c "$line" 2>&1) || bad="$bad; $line -> $out"
    done <<<"$grant"
    [ -z "$bad" ] && ok "the banner's grant lines run as printed ($(wc -l <<<"$grant") commands)" ||
        nok "the banner's grant lines fail:$bad"
    for _ in $(seq 60); do
        out=$(setpriv --reuid=65534 --regid=65534 --init-groups cubenetctl health 2>&1) && break
        sleep 0.1
    done
    [[ "$out" == *healthy* ]] && ok "granted by the example rule, a reader's health is answered" ||
        nok "granted reader: $(head -c 400 <<<"$out")"
    rm -f "$RULE"
    groupdel cube-network-readers
    groupdel cube-network
else
    nok "the quick start's banner does not print the grant's commands: $(grep -A6 'polkit grant' "$LOG")"
fi

# ---- a second start: refused before anything, naming the running agent ------
agent_pid=$(awk '$1 == "agent" {print $2}' target/quickstart.state | tail -1)
out=$(scripts/quickstart.sh --no-deps --no-build 2>&1)
if [ $? != 0 ] && [[ "$out" == *"already runs"*"(pid $agent_pid)"* ]] && [[ "$out" != *"starting the agent"* ]]; then
    ok "a second quick start is refused at once, naming the agent's pid"
else
    nok "a second quick start: $(head -c 400 <<<"$out")"
fi
out=$(target/release/cube-network-agent 2>&1)
[[ "$out" == *"locked by another instance (pid $agent_pid)"* ]] && ok "a second agent names the lock's holder" ||
    nok "a second agent: $(tail -c 400 <<<"$out")"

# ---- README "Using it": every command, verbatim ------------------------------
# The sh blocks from "## Using it" to "### API summary".
blocks=$(awk '/^## Using it/ {on = 1} /^### API summary/ {on = 0}
    on && /^```sh/ {inb = 1; next} on && inb && /^```/ {inb = 0; next} on && inb {print}' README.md)
[ -n "$blocks" ] && ok "README's Using it has $(grep -cv '^\s*\(#\|$\)' <<<"$blocks") commands" || nok "no commands found in README"
# Commands that follow changes until stopped run in the background while a
# network comes and goes; they must stay open and show the change.
follows() { [[ "$1" == *"busctl monitor"* || "$1" == *WatchNetworks* || "$1" == *"cubenetctl watch"* ]]; }
n=0
while IFS= read -r line; do
    [[ -z "${line// /}" || "$line" =~ ^[[:space:]]*# ]] && continue
    n=$((n + 1))
    if [[ "$line" == A=* ]]; then eval "$line"; ok "README: $line"; continue; fi
    if follows "$line"; then
        out=$S/follow.$n
        setsid bash -c "$line" >"$out" 2>&1 &
        f=$!
        sleep 1
        cubenetctl ensure follow-$n >/dev/null && cubenetctl release follow-$n >/dev/null
        sleep 1
        if kill -0 $f 2>/dev/null && grep -q "follow-$n" "$out"; then
            ok "README (follows, still open, showed the change): $line"
        else
            nok "README (follows): $line: $(kill -0 $f 2>/dev/null && echo running || echo exited); output: $(head -c 400 "$out")"
        fi
        kill -- -$f 2>/dev/null
        wait $f 2>/dev/null
        continue
    fi
    if out=$(A="$A" bash -c "$line" 2>&1 | tr -d "\0"; exit "${PIPESTATUS[0]}"); then
        # What a comment promises is there: busctl tree's "one object per
        # network" (README once ran it after the release: none).
        if [[ "$line" == "busctl tree"*"one object per network"* && "$out" != *"/org/cube/NetworkAgent/network/"* ]]; then
            nok "README: $line shows no network object: $(head -c 300 <<<"$out")"
            continue
        fi
        ok "README: $line"
    else
        nok "README: $line -> exit $?: $(head -c 400 <<<"$out")"
    fi
done <<<"$blocks"
busctl --system call $A ReleaseNetwork s sbx-1 >/dev/null 2>&1

# ---- README "Using it from containerd (CNI)": install, a hand-run ADD and
# DEL, removal, every command verbatim ----------------------------------------
cni=$(awk '/^### Using it from containerd/ {on = 1} /^## Configuration/ {on = 0}
    on && /^```sh/ {inb = 1; next} on && inb && /^```/ {inb = 0; next} on && inb {print}' README.md)
[ "$(grep -c 'cube-cni' <<<"$cni")" -ge 4 ] && ok "README's CNI section has its install, ADD, DEL and removal lines" ||
    nok "README's CNI section: $(head -c 300 <<<"$cni")"
# The CNI directories README's removal leaves (a runtime and other plugins
# use them): the test removes the ones this machine did not have.
cni_dirs_before=$(ls -d /opt/cni /etc/cni 2>/dev/null)
while IFS= read -r line; do
    [[ -z "${line// /}" || "$line" =~ ^[[:space:]]*# ]] && continue
    if out=$(bash -c "$line" 2>&1); then
        if [[ "$line" == *"ip -4 addr show eth0"* && "$out" != *"169.254.68.6/30"* ]] ||
            [[ "$line" == "cubenetctl list"* && "$out" != *"cni:demo:eth0"* ]]; then
            nok "README (CNI): $line: not what its comment says: $(head -c 300 <<<"$out")"
        else
            ok "README (CNI): ${line:0:100}"
        fi
    else
        nok "README (CNI): $line -> $(head -c 400 <<<"$out")"
    fi
done <<<"$cni"
for d in /opt/cni /etc/cni; do
    if ! grep -qx -- "$d" <<<"$cni_dirs_before"; then
        # Empty but for the directories install -D made.
        if [ -z "$(find "$d" -type f)" ]; then rm -r "$d"; else nok "README's CNI removal left files in $d: $(find "$d" -type f)"; fi
    fi
done
out=$(CNI_COMMAND=ADD CNI_CONTAINERID=x CNI_NETNS=/proc/self/ns/net CNI_IFNAME=eth9 CNI_PATH=/opt/cni/bin \
    target/release/cube-cni <examples/cni/10-cube.conflist 2>&1)
[[ "$out" == *"network configuration list"*'"type":"cube-cni"'* ]] &&
    ok "cube-cni fed the .conflist says what a runtime passes instead" || nok "cube-cni fed the conflist: $(head -c 300 <<<"$out")"

# ---- Ctrl-C, then --remove ----------------------------------------------------
kill -INT $QS 2>/dev/null
for _ in $(seq 100); do kill -0 $QS 2>/dev/null || break; sleep 0.05; done
kill -0 $QS 2>/dev/null && nok "the agent did not stop on Ctrl-C (SIGINT)" || ok "Ctrl-C stops the agent"
# A process whose pid a recorded agent's could have been recycled to, and
# whose command line says cube-network-agent: --remove must leave it alone.
bash -c 'exec -a cube-network-agent-decoy sleep 300' &
DECOY=$!
echo "agent $DECOY 1" >>target/quickstart.state
if out=$(scripts/quickstart.sh --remove 2>&1); then ok "scripts/quickstart.sh --remove"; else nok "--remove: $out"; fi
kill -0 $DECOY 2>/dev/null && ok "--remove stops only the agent it started (not a recycled pid)" ||
    nok "--remove killed an unrelated process with a recorded pid"
kill $DECOY 2>/dev/null
wait $DECOY 2>/dev/null
echo "$out" | sed 's/^/# /'
if [ -e /run/systemd/report/org.cube.NetworkAgent ] || [ ! -d /run/systemd/report ]; then
    nok "--remove: the metrics socket /run/systemd/report/org.cube.NetworkAgent must go and its directory (the host's) stay: $(ls -la /run/systemd/report 2>&1)"
else
    ok "--remove took the metrics socket and left /run/systemd/report, which was there before"
fi
snapshot >"$S/after"
if diff -u "$S/before" "$S/after" >"$S/diff"; then
    ok "--remove left the machine as it was (files, mounts, links, addresses, routes, qdiscs, sysctls, processes)"
else
    nok "the machine differs after --remove:"
    sed 's/^/#   /' "$S/diff"
fi
echo "$PASS passed, $FAIL failed"
[ "$FAIL" = 0 ]
