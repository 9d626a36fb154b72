#!/usr/bin/env bash
# CNI ADD / DEL latency through a real libcni client (tests/cni/cnirun,
# libcni 1.1.2): cube-cni (+ the agent) against the stock
# bridge + host-local + portmap chain (/usr/lib/cni), in the same run,
# with and without one port mapping. Issue target: cube-cni's ADD and DEL
# p50 each >= 15x faster than the stock chain's (ratio stock / cube-cni,
# both scenarios).
#
#   scripts/cni-bench.sh [--quick] [-n N] [--keep]
#
#   -n N      iterations per chain and scenario (default 30)
#   --quick   N = 10
#   --keep    keep the temp dir (logs, results) and print its path
#
# Environment: CUBE_AGENT, CUBE_CNI (default target/release/cube-network-agent
# and target/release/cube-cni; both are copied into the temp dir first, so a
# rebuild during the run does not mix versions), STOCK_CNI_DIR (default
# /usr/lib/cni). cnirun is built into the temp dir by
# tests/cni/build-cnirun.sh (offline, GOPATH mode; needs scripts/deps.sh).
#
# What is timed: the wall time of one `cnirun add|del` process (fork + exec
# of cnirun, libcni loading the conflist and its cache, every plugin exec,
# the plugins' work), measured with $EPOCHREALTIME by a small bash worker
# that already runs inside the chain's node netns, so `ip netns exec` is
# not in the timings. Each ADD gets a fresh container netns (created before
# timing) and a fresh container id; its DEL follows right after, so one
# attachment exists at a time. Iterations interleave the chains (the order
# rotates every iteration) so that load from other jobs hits all of them.
# Rows:
#   cube-cni    {"type":"cube-cni","dbusAddress":<private bus>,
#               "capabilities":{"portMappings":true}}; the agent
#               (--config /dev/null: defaults, eBPF datapath, host ports
#               20000-29999) runs in node netns A on a private dbus-daemon.
#   stock       bridge (isGateway) + host-local (dataDir in the temp dir)
#               + portmap, the conflist of docs / CNI research §2, run in
#               node netns B (its bridge and iptables rules stay in there).
#   floor       cnirun + a /bin/sh no-op plugin: the client's own share
#               of every row (informational).
#   exec        a bare `CNI_COMMAND=VERSION` exec of cube-cni and of
#               bridge (process start cost, informational).
# "port" scenario: CAP_ARGS portMappings with one tcp mapping hostPort P ->
# 80, P unique per iteration inside the agent's default host_port_range
# (src/config.rs: 20000-29999) and checked to be unused in both node netns.
# p50 and p99 are nearest-rank; with N < 100, p99 is the maximum.
#
# Checked as it goes (a failure is exit 1): every ADD and DEL exits 0, ADD
# results carry the expected address (169.254.68.6 / the stock subnet), on
# the first port iteration the mapping exists (agent ListNetworks shows the
# port; the stock node netns has the DNAT rule); at the end the agent's
# ListNetworks is `aa{sv} 0`, the agent's node netns has no veth left, the
# stock node netns has no DNAT rule and host-local no reservation, and every
# container netns holds only lo.
#
# Exit status (like cube-netbench / cube-dpbench, see docs/benchmarks.md):
#   0 ran, every target met
#   1 broken: an ADD/DEL failed or answered wrongly, a worker hung, a final
#     check failed (logs printed; --keep keeps them)
#   2 setup failed: bad arguments, not root, a tool missing, cnirun build,
#     dbus-daemon or agent did not come up
#   3 ran, all checks passed, a target was missed (named at the end)
#   130 interrupted
# Cleanup runs on every exit path (trap): workers, agent, dbus-daemon,
# bpffs, every netns this run created (prefix cnib-PID-), the temp dir.
set -euo pipefail
export LC_ALL=C

N=30
keep=0
usage() {
    echo "usage: $0 [--quick] [-n N] [--keep]" >&2
    exit 2
}
while [ $# -gt 0 ]; do
    case $1 in
    --quick) N=10 ;;
    -n | --iterations)
        [ $# -ge 2 ] || usage
        N=$2
        shift
        ;;
    --keep) keep=1 ;;
    -h | --help)
        sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
        exit 0
        ;;
    *) usage ;;
    esac
    shift
done
[[ $N =~ ^[0-9]+$ ]] && [ "$N" -ge 1 ] && [ "$N" -le 4000 ] || {
    echo "cni-bench: -n wants 1..4000" >&2
    exit 2
}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
AGENT=${CUBE_AGENT:-$root/target/release/cube-network-agent}
CNI=${CUBE_CNI:-$root/target/release/cube-cni}
STOCK=${STOCK_CNI_DIR:-/usr/lib/cni}
TARGET=15

setup_fail() {
    echo "cni-bench: setup failed: $*" >&2
    exit 2
}
broken() {
    echo "cni-bench: BROKEN: $*" >&2
    exit 1
}

[ "$(id -u)" = 0 ] || setup_fail "must run as root (network namespaces, bpffs, iptables)"
for t in ip busctl dbus-daemon iptables ss setsid mount umount awk sort; do
    command -v "$t" >/dev/null || setup_fail "$t not found (scripts/deps.sh)"
done
for f in "$AGENT" "$CNI" "$STOCK/bridge" "$STOCK/host-local" "$STOCK/portmap"; do
    [ -x "$f" ] || setup_fail "$f missing or not executable"
done
[ -f "$root/tests/data/bus.conf" ] || setup_fail "tests/data/bus.conf missing"

P=cnib-$$-
NODE_C=${P}node-cube
NODE_S=${P}node-stock
D=""
agent_pid="" dbus_pid="" bpf_mounted=0
declare -A wpid=() wfd_in=() wfd_out=()
t_start=$EPOCHREALTIME

cleanup() {
    local rc=$? c pid i ns
    set +e
    trap - EXIT INT TERM HUP
    for c in "${!wpid[@]}"; do
        [ -n "${wfd_in[$c]:-}" ] && eval "exec ${wfd_in[$c]}>&-"
        [ -n "${wfd_out[$c]:-}" ] && eval "exec ${wfd_out[$c]}<&-"
    done
    for pid in "${wpid[@]}" $agent_pid $dbus_pid; do
        kill -TERM "$pid" 2>/dev/null
    done
    for pid in "${wpid[@]}" $agent_pid $dbus_pid; do
        for ((i = 0; i < 100; i++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.05
        done
        kill -KILL "$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
    done
    if [ -n "$D" ] && [ "$rc" != 0 ] && [ "$rc" != 3 ] && [ -s "$D/agent.log" ]; then
        echo "--- agent log (last 30 lines) ---" >&2
        tail -n 30 "$D/agent.log" >&2
    fi
    [ "$bpf_mounted" = 1 ] && umount "$D/bpf"
    if [ -d /run/netns ]; then
        for ns in /run/netns/"$P"*; do
            [ -e "$ns" ] && echo "netns del ${ns#/run/netns/}"
        done | ip -batch - 2>/dev/null
        # ip -batch stops at the first error; sweep what it left
        for ns in /run/netns/"$P"*; do
            [ -e "$ns" ] && ip netns del "${ns#/run/netns/}" 2>/dev/null
        done
    fi
    if [ -n "$D" ]; then
        if [ "$keep" = 1 ]; then
            echo "cni-bench: kept $D" >&2
        else
            rm -rf "$D"
        fi
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

D=$(mktemp -d /tmp/cni-bench.XXXXXX)
mkdir -p "$D"/{bin,cube-bin,floor-bin,conf-cube,conf-stock,conf-floor,cache-cube,cache-stock,cache-floor,hl,out,state,run,bpf}

# --- binaries -----------------------------------------------------------
"$root/tests/cni/build-cnirun.sh" "$D/bin/cnirun" || setup_fail "tests/cni/build-cnirun.sh failed"
cp "$AGENT" "$D/bin/cube-network-agent"
cp "$CNI" "$D/cube-bin/cube-cni"
cat >"$D/floor-bin/noop" <<'EOF'
#!/bin/sh
cat >/dev/null
case "$CNI_COMMAND" in
ADD) echo '{"cniVersion":"1.0.0","interfaces":[],"ips":[]}' ;;
VERSION) echo '{"cniVersion":"1.0.0","supportedVersions":["0.3.0","0.3.1","0.4.0","1.0.0"]}' ;;
esac
EOF
chmod +x "$D/floor-bin/noop"

# --- namespaces ---------------------------------------------------------
# container netns: one per timed ADD, created up front (ip -batch)
chains=(cube stock floor)
scen=(noport port)
{
    echo "netns add $NODE_C"
    echo "netns add $NODE_S"
    for c in "${chains[@]}"; do echo "netns add ${P}warm-$c"; done
    for c in "${chains[@]}"; do
        for s in "${scen[@]}"; do
            for ((i = 1; i <= N; i++)); do echo "netns add ${P}$c-$s-$i"; done
        done
    done
} | ip -batch - || setup_fail "creating network namespaces"
ip -n "$NODE_C" link set lo up
ip -n "$NODE_S" link set lo up

# host ports: PORT_BASE+i, inside 20000-29999, not listened on in either node netns
PORT_BASE=21000
used=$( { ip netns exec "$NODE_C" ss -Htaun; ip netns exec "$NODE_S" ss -Htaun; } | awk '{n=split($5,a,":"); print a[n]}')
for ((i = 1; i <= N; i++)); do
    if grep -qx "$((PORT_BASE + i))" <<<"$used"; then
        setup_fail "port $((PORT_BASE + i)) is in use in a node netns"
    fi
done
[ $((PORT_BASE + N)) -le 29999 ] || setup_fail "port range overflow"

# --- private bus + agent in node netns A ----------------------------------
BUS=unix:path=$D/bus.sock
mount -t bpf bpf "$D/bpf" || setup_fail "mount -t bpf"
bpf_mounted=1
setsid dbus-daemon --config-file="$root/tests/data/bus.conf" --address="$BUS" --nofork --nopidfile \
    >"$D/dbus.log" 2>&1 </dev/null &
dbus_pid=$!
for ((i = 0; i < 200; i++)); do
    [ -S "$D/bus.sock" ] && break
    kill -0 "$dbus_pid" 2>/dev/null || setup_fail "dbus-daemon exited: $(cat "$D/dbus.log")"
    sleep 0.05
done
[ -S "$D/bus.sock" ] || setup_fail "dbus-daemon socket did not appear"

setsid ip netns exec "$NODE_C" "$D/bin/cube-network-agent" --bus "$BUS" --state-dir "$D/state" \
    --runtime-dir "$D/run" --report-socket "$D/report.sock" --config /dev/null --bpf-pin-dir "$D/bpf" \
    2>"$D/agent.log" >/dev/null </dev/null &
agent_pid=$!
ok=0
for ((i = 0; i < 300; i++)); do
    kill -0 "$agent_pid" 2>/dev/null || setup_fail "agent exited (log: $(tail -n 5 "$D/agent.log"))"
    if busctl --address "$BUS" status org.cube.NetworkAgent >/dev/null 2>&1; then
        ok=1
        break
    fi
    sleep 0.1
done
[ "$ok" = 1 ] || setup_fail "agent not on the bus after 30 s"
list_networks() {
    busctl --address "$BUS" call org.cube.NetworkAgent /org/cube/NetworkAgent org.cube.NetworkAgent ListNetworks
}
[ "$(list_networks)" = "aa{sv} 0" ] || setup_fail "agent starts with networks: $(list_networks)"

# --- conflists ------------------------------------------------------------
cat >"$D/conf-cube/10-cube.conflist" <<EOF
{"cniVersion":"1.0.0","cniVersions":["1.0.0","1.1.0"],"name":"cube","plugins":[
 {"type":"cube-cni","dbusAddress":"$BUS","capabilities":{"portMappings":true}}]}
EOF
STOCK_SUBNET=10.88.77
cat >"$D/conf-stock/10-stock.conflist" <<EOF
{"cniVersion":"1.0.0","name":"stock","plugins":[
 {"type":"bridge","bridge":"cnibench0","isGateway":true,
  "ipam":{"type":"host-local","dataDir":"$D/hl","ranges":[[{"subnet":"$STOCK_SUBNET.0/24"}]],"routes":[{"dst":"0.0.0.0/0"}]}},
 {"type":"portmap","capabilities":{"portMappings":true}}]}
EOF
cat >"$D/conf-floor/10-floor.conflist" <<EOF
{"cniVersion":"1.0.0","name":"floor","plugins":[{"type":"noop","capabilities":{"portMappings":true}}]}
EOF

# --- workers: one bash per chain, already inside its node netns -------------
# stdin: "VERB ID NETNS CAPS" (CAPS "-" = none); VERB add|del run cnirun,
# VERB version runs plugin NETNS (a path) with CNI_COMMAND=VERSION.
# stdout: "RC T0_US T1_US".
worker='
export LC_ALL=C
while read -r verb id ns caps; do
    [ "$caps" = - ] && caps=""
    if [ "$verb" = version ]; then
        t0=$EPOCHREALTIME
        CNI_COMMAND=VERSION "$ns" <<<"{\"cniVersion\":\"1.0.0\"}" >"$OUT/$id.version.out" 2>"$OUT/$id.version.err"
        rc=$?
        t1=$EPOCHREALTIME
    else
        t0=$EPOCHREALTIME
        CNI_CONTAINERID=$id CAP_ARGS=$caps "$CNIRUN" "$verb" "$NET" "/run/netns/$ns" >"$OUT/$id.$verb.out" 2>"$OUT/$id.$verb.err"
        rc=$?
        t1=$EPOCHREALTIME
    fi
    echo "$rc ${t0/./} ${t1/./}"
done'
start_worker() { # CHAIN NODE_NS NETNAME CNI_PATH
    local c=$1 fin fout
    mkfifo "$D/$c.in" "$D/$c.out"
    env NETCONFPATH="$D/conf-$c" CNI_PATH="$4" CNI_CACHE_DIR="$D/cache-$c" CNI_IFNAME=eth0 \
        CNIRUN="$D/bin/cnirun" CNIRUN_TIMEOUT=60 NET="$3" OUT="$D/out" \
        ip netns exec "$2" bash -c "$worker" <"$D/$c.in" >"$D/$c.out" 2>"$D/$c.worker.err" &
    wpid[$c]=$!
    exec {fin}>"$D/$c.in" {fout}<"$D/$c.out"
    wfd_in[$c]=$fin
    wfd_out[$c]=$fout
}
start_worker cube "$NODE_C" cube "$D/cube-bin"
start_worker stock "$NODE_S" stock "$STOCK"
start_worker floor "$NODE_S" floor "$D/floor-bin"

# op CHAIN VERB ID NETNS CAPS -> sets op_rc, op_us
op() {
    local t0 t1
    echo "$2 $3 $4 $5" >&"${wfd_in[$1]}"
    if ! read -r -t 120 -u "${wfd_out[$1]}" op_rc t0 t1; then
        broken "$1 worker: no answer to '$2 $3' within 120 s ($(cat "$D/$1.worker.err" 2>/dev/null))"
    fi
    op_us=$((t1 - t0))
}
fail_op() { # CHAIN VERB ID
    echo "--- $1 $2 $3: stdout ---" >&2
    cat "$D/out/$3.$2.out" >&2 2>/dev/null
    echo "--- stderr ---" >&2
    cat "$D/out/$3.$2.err" >&2 2>/dev/null
    broken "$1 $2 $3 exited $op_rc"
}

declare -A samples=()
record() { samples[$1]+="$2 "; } # KEY US

echo "cni-bench: N=$N per chain and scenario; $(nproc) cores, kernel $(uname -r); timing..." >&2

# warm-up (untimed): page cache for every binary, the agent's first call
for c in "${chains[@]}"; do
    op $c add "warm-$c" "${P}warm-$c" -
    [ "$op_rc" = 0 ] || fail_op $c add "warm-$c"
    op $c del "warm-$c" "${P}warm-$c" -
    [ "$op_rc" = 0 ] || fail_op $c del "warm-$c"
done

t_loop=$EPOCHREALTIME
for s in "${scen[@]}"; do
    for ((i = 1; i <= N; i++)); do
        caps=-
        port=$((PORT_BASE + i))
        [ "$s" = port ] && caps="{\"portMappings\":[{\"hostPort\":$port,\"containerPort\":80,\"protocol\":\"tcp\"}]}"
        for ((k = 0; k < ${#chains[@]}; k++)); do
            c=${chains[$(((i + k) % ${#chains[@]}))]}
            id=bench-$c-$s-$i
            ns=${P}$c-$s-$i
            op $c add "$id" "$ns" "$caps"
            [ "$op_rc" = 0 ] || fail_op $c add "$id"
            record "$c.$s.add" $op_us
            case $c in
            cube) grep -q '"169.254.68.6/30"' "$D/out/$id.add.out" || { op_rc="0 but no 169.254.68.6/30 in the result"; fail_op $c add "$id"; } ;;
            stock) grep -q "\"$STOCK_SUBNET\.[0-9]*/24\"" "$D/out/$id.add.out" || { op_rc="0 but no $STOCK_SUBNET.x/24 in the result"; fail_op $c add "$id"; } ;;
            esac
            if [ "$s" = port ] && [ "$i" = 1 ]; then
                case $c in
                cube) list_networks | grep -qw "$port" || broken "cube: port $port not in ListNetworks after ADD: $(list_networks)" ;;
                stock) ip netns exec "$NODE_S" iptables -t nat -S | grep -q -- "--dport $port .*DNAT" ||
                    broken "stock: no DNAT rule for port $port in the node netns after ADD" ;;
                esac
            fi
            op $c del "$id" "$ns" "$caps"
            [ "$op_rc" = 0 ] || fail_op $c del "$id"
            record "$c.$s.del" $op_us
        done
        # bare exec, once per iteration (no ADD/DEL state involved)
        op cube version "v-cube-$s-$i" "$D/cube-bin/cube-cni" -
        [ "$op_rc" = 0 ] || fail_op cube version "v-cube-$s-$i"
        record "exec.cube" $op_us
        op stock version "v-bridge-$s-$i" "$STOCK/bridge" -
        [ "$op_rc" = 0 ] || fail_op stock version "v-bridge-$s-$i"
        record "exec.bridge" $op_us
    done
done
t_timed=$EPOCHREALTIME

# --- final checks -----------------------------------------------------------
nets=$(list_networks) || broken "ListNetworks failed at the end"
[ "$nets" = "aa{sv} 0" ] || broken "agent still lists networks after every DEL: $nets"
left=""
for ((i = 0; i < 40; i++)); do # host ends may be retired in the background
    left=$(ip -n "$NODE_C" -o link show type veth)
    [ -z "$left" ] && break
    sleep 0.05
done
[ -z "$left" ] || broken "veths left in the agent's node netns: $left"
dnat=$(ip netns exec "$NODE_S" iptables -t nat -S | grep -c -- '-j DNAT' || true)
[ "$dnat" = 0 ] || broken "stock: $dnat DNAT rules left in its node netns"
resv=$(find "$D/hl" -type f ! -name 'last_reserved_ip*' ! -name lock | wc -l)
[ "$resv" = 0 ] || broken "stock: $resv host-local reservations left: $(ls -R "$D/hl")"
for ns in /run/netns/"$P"{cube,stock,warm}-*; do
    links=$(ip -n "${ns#/run/netns/}" -o link show | awk -F': ' '{print $2}' | tr '\n' ' ')
    [ "$links" = "lo " ] || broken "${ns#/run/netns/} still holds: $links"
done

# --- report -------------------------------------------------------------------
# the agent's own time per call (its "network ensured/released ... elapsed_us"
# log lines), to split cube-cni's rows into agent and the rest
for s in "${scen[@]}"; do
    for v in ensured released; do
        samples[agent.$s.$v]=$(awk -v v="$v" -v id="sandbox_id=\"cni:bench-cube-$s-" '
            index($0, "network " v " ") && index($0, id) {
                for (i = 1; i <= NF; i++) if ($i ~ /^elapsed_us=[0-9]+$/) { sub(/^elapsed_us=/, "", $i); printf "%s ", $i } }' "$D/agent.log")
    done
done
# pct KEY Q -> nearest-rank percentile in ms (1 decimal); "n/a" without samples
pct() {
    [ -n "${samples[$1]// /}" ] || { echo n/a; return; }
    tr ' ' '\n' <<<"${samples[$1]}" | sed '/^$/d' | sort -n |
        awk -v q="$2" '{v[NR]=$1} END {r=int(q*NR); if (r<q*NR) r++; if (r<1) r=1; printf "%.1f", v[r]/1000}'
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.1f", a/b}'; }
meets() { awk -v r="$1" -v t="$TARGET" 'BEGIN {exit !(r>=t)}'; }

label() {
    case $1 in
    cube) echo "cube-cni (+ agent over D-Bus)" ;;
    stock) echo "stock bridge+host-local+portmap" ;;
    floor) echo "floor: cnirun + /bin/sh no-op plugin" ;;
    esac
}
p99note="p99 = nearest rank"
[ "$N" -lt 100 ] && p99note="p99 = max (N < 100)"
echo
echo "CNI ADD / DEL wall time per cnirun process (libcni 1.1.2), ms; N=$N per row; $p99note"
echo
echo "| chain | port mappings | ADD p50 | ADD p99 | DEL p50 | DEL p99 |"
echo "|---|---|---|---|---|---|"
for s in "${scen[@]}"; do
    for c in "${chains[@]}"; do
        pm=0
        [ "$s" = port ] && pm=1
        printf "| %s | %s | %s | %s | %s | %s |\n" "$(label $c)" "$pm" \
            "$(pct $c.$s.add 0.5)" "$(pct $c.$s.add 0.99)" "$(pct $c.$s.del 0.5)" "$(pct $c.$s.del 0.99)"
    done
done
echo
echo "Where cube-cni's time goes (informational), ms:"
echo
echo "| piece | p50 | p99 |"
echo "|---|---|---|"
printf "| bare exec of cube-cni, CNI_COMMAND=VERSION (N=%s) | %s | %s |\n" $((2 * N)) "$(pct exec.cube 0.5)" "$(pct exec.cube 0.99)"
printf "| bare exec of bridge, CNI_COMMAND=VERSION (N=%s) | %s | %s |\n" $((2 * N)) "$(pct exec.bridge 0.5)" "$(pct exec.bridge 0.99)"
for s in "${scen[@]}"; do
    pm=0
    [ "$s" = port ] && pm=1
    printf "| agent EnsureNetwork, %s port mapping(s) (its log's elapsed_us) | %s | %s |\n" $pm "$(pct agent.$s.ensured 0.5)" "$(pct agent.$s.ensured 0.99)"
    printf "| agent ReleaseNetwork, %s port mapping(s) (its log's elapsed_us) | %s | %s |\n" $pm "$(pct agent.$s.released 0.5)" "$(pct agent.$s.released 0.99)"
done
echo
echo "| ratio stock ÷ cube-cni (p50) | ADD | DEL | target | net of the floor (ADD / DEL) | ceiling = stock ÷ floor (ADD / DEL) |"
echo "|---|---|---|---|---|---|"
missed=()
for s in "${scen[@]}"; do
    ra=$(ratio "$(pct stock.$s.add 0.5)" "$(pct cube.$s.add 0.5)")
    rd=$(ratio "$(pct stock.$s.del 0.5)" "$(pct cube.$s.del 0.5)")
    ma=met md=met
    meets "$ra" || { ma=MISSED; missed+=("ADD, $s: ${ra}x < ${TARGET}x"); }
    meets "$rd" || { md=MISSED; missed+=("DEL, $s: ${rd}x < ${TARGET}x"); }
    pm=0
    [ "$s" = port ] && pm=1
    na=$(awk -v a="$(pct stock.$s.add 0.5)" -v b="$(pct cube.$s.add 0.5)" -v f="$(pct floor.$s.add 0.5)" 'BEGIN {if (b>f) printf "%.1fx", (a-f)/(b-f); else print "n/a"}')
    nd=$(awk -v a="$(pct stock.$s.del 0.5)" -v b="$(pct cube.$s.del 0.5)" -v f="$(pct floor.$s.del 0.5)" 'BEGIN {if (b>f) printf "%.1fx", (a-f)/(b-f); else print "n/a"}')
    ca=$(ratio "$(pct stock.$s.add 0.5)" "$(pct floor.$s.add 0.5)")
    cd=$(ratio "$(pct stock.$s.del 0.5)" "$(pct floor.$s.del 0.5)")
    printf "| %s port mapping(s) | %sx (%s) | %sx (%s) | >= %sx each | %s / %s | %sx / %sx |\n" "$pm" "$ra" "$ma" "$rd" "$md" "$TARGET" "$na" "$nd" "$ca" "$cd"
done
t_end=$EPOCHREALTIME
echo
echo "net of the floor: (stock - floor) / (cube-cni - floor). ceiling: the best ratio any plugin"
echo "could show through this client (a plugin that costs nothing); below ${TARGET}x the target"
echo "cannot be met on this machine whatever cube-cni does."
echo
printf "measurement loop %.1f s; whole run %.1f s (setup, warm-up, final checks included)\n" \
    "$(awk -v a="${t_loop/./}" -v b="${t_timed/./}" 'BEGIN{print (b-a)/1e6}')" \
    "$(awk -v a="${t_start/./}" -v b="${t_end/./}" 'BEGIN{print (b-a)/1e6}')"
if [ ${#missed[@]} -gt 0 ]; then
    echo
    echo "MISSED targets:"
    printf '  %s\n' "${missed[@]}"
    exit 3
fi
echo "all targets met"
exit 0
