#!/usr/bin/env bash
# End-to-end test of VM snapshots and clones (docs/design.md "Snapshots and
# clones", issue 29): QEMU (TCG) boots the guest of tests/vm/build-guest.sh
# behind the agent's TAP, a live migration to a file snapshots it, and three
# clones restored from that file at the same time run side by side with the
# original, each on its own network made with `ensure --clone-of`.
#
#   world netns                        node netns (agent, QEMUs)             guests (all 169.254.68.6)
#   w0 198.51.100.2/24  <-- veth -->    up0 198.51.100.1/24 (uplink)
#   http :8000 (logs client + path)     cube-dev 192.168.0.1 (gateway)
#   tick :9000 (logs every line,        TAP vm-src  <== fd 3 ==> QEMU source   httpd :80, nc -> world:9000
#     never sends)                      TAP clone-1 <== fd 3 ==> QEMU clone-1  (restored from snap.mig)
#   firewall: conntrack, tcp_loose=0,   TAP clone-2 <== fd 3 ==> QEMU clone-2
#     `ct state invalid drop` (segments TAP clone-3 <== fd 3 ==> QEMU clone-3
#     of unknown connections are
#     dropped, never answered by RST)
#
# The guest (cna.stale=) keeps a TCP connection to the world's tick server
# that sends "tick N" every 0.3 s. The snapshot is taken while it is open,
# so every clone resumes it: segments of a connection the world never saw
# from that clone's address.
#
# Checks (TAP-style `ok - name` / `not ok - name`, then `N passed, M failed`):
#   ensure        vm-src; clone-1..3 with --clone-of=vm-src: cloned_from in
#                 the ensure answer and in GetNetwork (status), sandbox IPs,
#                 TAPs and tcp/80 host ports all distinct; the last clone
#                 also with --tap-owner=0: its TAP is handed over by name
#                 and its QEMU restores onto -netdev tap,ifname= (as
#                 Firecracker's network_overrides would), the others by fd
#   source        boots, its tick connection reaches the world; the snapshot
#                 (QMP migrate to exec:cat) completes
#   each clone    restored (QMP query-status: running)
#                 [RST] its pre-snapshot connection ends in the guest:
#                   GUEST-STALE-END on its console within $STALE_WAIT s
#                 [RST] on its TAP, the first TCP RST from 198.51.100.2:9000
#                   to the guest comes < 1 s after the guest's first segment
#                   to 198.51.100.2:9000 (the node answers the stale segment)
#                 reaches the world with no change inside the guest:
#                   world -> 198.51.100.1:<its host port>/cgi-bin/fetch?clone-N
#                   -> guest -> wget world (ingress + egress), the world logs
#                   from=clone-N from the uplink address
#                 node -> its sandbox IP:80 (host access)
#                 none of the source's connection is delivered to it
#   the original  keeps its pre-snapshot connection after `cont` (same
#                 client port, ticks in order, >= 2 after the clones are up,
#                 no GUEST-STALE-END); world -> its host port still answers
#   isolation     the tick server sees no connection but the source's; on the
#                 uplink the source's SNAT port carries no more segments to
#                 :9000 than the source's TAP did (no clone leaves as it)
#   paused        clone-1's VM stopped (QMP) and its network paused (ensure
#                 --clone-of=vm-src --paused): a connection from the world
#                 is dropped and reported once (`cubenetctl watch`:
#                 traffic_while_paused tcp/80 ... via port_mapping), a
#                 second attempt is not reported; resumed (ensure without
#                 --paused, QMP cont), the next connection works
# The two [RST] checks are the datapath's reset of connections from before
# the snapshot (docs/datapath.md "TCP segments of connections the sandbox
# never opened"); a build without it SNATs the stale segments, the world's
# firewall drops them, the guest keeps retransmitting and the checks fail
# after $STALE_WAIT s.
#
# Needs root: not root it skips in a developer run (exit 0, "SKIPPED") and
# fails under CI (CI set, see tests/root.sh; exit 2). Environment:
#   CNA_AGENT, CNA_CTL  the binaries (default: target/release/ of this tree)
#   CNA_BUILD=0         do not run `cargo build --release --bins` first
#   CNA_VM_CACHE        guest build cache (build-guest.sh)
#   CNA_VM_KEEP=1       keep the temporary directory (logs, captures, snapshot)
# Exit status: 0 all passed (or, not root outside CI, skipped), 1 a check
# failed, 2 setup failed (a tool missing, not root under CI, ...).
# shellcheck disable=SC2015  # `A && B || C`: C runs when A or B fails, as meant
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
. "$ROOT/tests/root.sh"
require_root tests/vm/snapshot.sh "network namespaces, TAPs, bpffs"
WORLD_IP=198.51.100.2
NODE_IP=198.51.100.1
CLONES=3
STALE_WAIT=5
START=$(date +%s.%N)

. "$ROOT/tests/vm/lib.sh"
# since T0 [T1]: T1 - T0 in seconds (T1 defaults to now)
since() { awk -v s="$1" -v n="${2:-$(now)}" 'BEGIN{printf "%.1f", n-s}'; }

vm_tools ip dbus-daemon busctl curl mount mountpoint umount tcpdump nft sysctl \
    qemu-system-x86_64 awk sed cut head tail sort tr seq wc mktemp
vm_binaries
vm_scratch snap

summary() {
    if [ $FAILED -gt 0 ]; then
        for c in src $(seq -f 'clone-%g' $CLONES); do
            [ -s "$T/console-$c.log" ] || continue
            echo "# --- console of $c (tail) ---"
            tail -n 8 "$T/console-$c.log" | tr -d '\r' | sed 's/^/#   /'
        done
        echo "# --- agent log (tail) ---"
        tail -n 15 "$T/agent.log" | sed 's/^/#   /'
    fi
    log "total"
    echo "$PASSED passed, $FAILED failed"
}

# --- node, world, bus ------------------------------------------------------------
vm_topology

# The world's firewall: segments of connections it does not know are
# dropped (conntrack "invalid": no mid-stream pickup), not answered by RST,
# as a stateful firewall in front of a real server does. A clone's stale
# segments therefore hang unless the node itself resets them.
ip netns exec "$WNS" nft -f - <<'NFT' || die "nft: cannot install the world's firewall"
table inet fw {
    chain input {
        type filter hook input priority 0; policy accept;
        ct state invalid counter drop
    }
}
NFT
ip netns exec "$WNS" sysctl -qw net.netfilter.nf_conntrack_tcp_loose=0 ||
    die "sysctl net.netfilter.nf_conntrack_tcp_loose=0 in the world"
world_dropped() { ip netns exec "$WNS" nft list chain inet fw input 2>/dev/null | sed -n 's/.*counter packets \([0-9]*\).*/\1/p'; }

# World web server: GET files from www/; logs client address and path.
echo "cna-vm-world-marker" >"$T/www/index.html"
cat >"$T/world.py" <<'PY'
import functools, http.server, sys
class H(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    def log_message(self, fmt, *a):
        sys.stderr.write("client=%s %s\n" % (self.client_address[0], fmt % a)); sys.stderr.flush()
http.server.ThreadingHTTPServer.allow_reuse_address = True
s = http.server.ThreadingHTTPServer(("0.0.0.0", 8000), functools.partial(H, directory=sys.argv[1]))
print("WORLD-READY", flush=True)
s.serve_forever()
PY
ip netns exec "$WNS" "$PY" "$T/world.py" "$T/www" >"$T/world.out" 2>"$T/world.log" &
PIDS+=($!)

# World tick server: accepts connections on :9000, never sends, logs
#   <epoch> connect|line|end client=IP:PORT [text]
cat >"$T/tick.py" <<'PY'
import socketserver, sys, threading, time
lock = threading.Lock()
def log(kind, c, text=""):
    with lock:
        sys.stdout.write("%.3f %s client=%s %s\n" % (time.time(), kind, c, text)); sys.stdout.flush()
class H(socketserver.StreamRequestHandler):
    def handle(self):
        c = "%s:%d" % self.client_address
        log("connect", c)
        try:
            for line in self.rfile:
                log("line", c, line.decode(errors="replace").strip())
            log("end", c, "eof")
        except OSError as e:
            log("end", c, repr(e))
socketserver.ThreadingTCPServer.allow_reuse_address = True
socketserver.ThreadingTCPServer.daemon_threads = True
s = socketserver.ThreadingTCPServer(("0.0.0.0", 9000), H)
sys.stderr.write("TICK-READY\n"); sys.stderr.flush()
s.serve_forever()
PY
ip netns exec "$WNS" "$PY" "$T/tick.py" >"$T/ticks.log" 2>"$T/tick.err" &
PIDS+=($!)

vm_bus

for _ in $(seq 100); do
    grep -q WORLD-READY "$T/world.out" 2>/dev/null && grep -q TICK-READY "$T/tick.err" 2>/dev/null &&
        [ -S "$T/bus.sock" ] && break
    sleep 0.05
done
grep -q WORLD-READY "$T/world.out" || die "world http server did not start: $(cat "$T/world.log")"
grep -q TICK-READY "$T/tick.err" || die "world tick server did not start: $(cat "$T/tick.err")"
[ -S "$T/bus.sock" ] || die "dbus-daemon did not start: $(cat "$T/dbus.log")"

# --- agent -------------------------------------------------------------------------
vm_agent

# netinfo FILE: "SANDBOX_IP TAP HOST_PORT_OF_TCP_80 CLONED_FROM" from a
# network's JSON (cloned_from "-" when absent).
netinfo() {
    "$PY" -c '
import json, sys
n = json.load(open(sys.argv[1]))
hp = [m["host_port"] for m in n.get("port_mappings") or [] if m["protocol"] == "tcp" and m["container_port"] == 80]
print(n["sandbox_ip"], n["tap_name"], hp[0] if hp else "-", n.get("cloned_from") or "-")' "$1"
}

"$CTL" --bus "$ADDR" --json ensure vm-src --port tcp:80 >"$T/ensure-src.json" 2>"$T/ensure-src.err" ||
    die "cubenetctl ensure vm-src: $(cat "$T/ensure-src.err")"
read -r SRC_SIP SRC_TAP SRC_HP _ < <(netinfo "$T/ensure-src.json") ||
    die "unexpected ensure output: $(cat "$T/ensure-src.json")"
[ "$SRC_HP" != - ] && [ "$SRC_HP" != 0 ] || die "no host port for tcp/80: $(cat "$T/ensure-src.json")"
ok "ensure vm-src (sandbox $SRC_SIP, tap $SRC_TAP, tcp 80 -> host port $SRC_HP)"

# capture NAME DEV: tcpdump on DEV in the node netns into $T/NAME.pcap
# (headers only); the pid goes to TCPDUMP[NAME]. --immediate-mode: without
# it libpcap hands packets over up to a second late (TPACKET_V3 blocks), and
# the stale-segment checks read the captures while they run.
declare -A TCPDUMP
capture() {
    ip netns exec "$NS" tcpdump -i "$2" -nn -U --immediate-mode -s 160 -w "$T/$1.pcap" 2>"$T/tcpdump-$1.log" &
    PIDS+=($!)
    TCPDUMP[$1]=$!
}
# wait_captures NAME...: until each tcpdump listens (5 s at most)
wait_captures() {
    local n c
    for _ in $(seq 100); do
        n=0
        for c in "$@"; do grep -q "listening on" "$T/tcpdump-$c.log" 2>/dev/null && n=$((n + 1)); done
        [ $n = $# ] && return 0
        sleep 0.05
    done
    die "tcpdump did not start: $(cat "$T/tcpdump-$1.log")"
}
capture src "$SRC_TAP"
capture up0 up0
wait_captures src up0

# --- source guest ------------------------------------------------------------------
# The same machine for the source and every clone (a migration stream only
# loads into an identical machine); each adds its serial file, QMP socket
# and, for clones, -incoming.
# shellcheck disable=SC2054  # commas inside QEMU options
QEMU=(qemu-system-x86_64 -M pc -accel tcg,tb-size=64 -m 128 -smp 1
    -nodefaults -display none -monitor none -no-reboot
    -kernel "$CACHE/vmlinux" -initrd "$CACHE/initramfs.cpio.gz"
    -append "console=ttyS0 quiet panic=-1 rdinit=/init cna.world=$WORLD_IP:8000 cna.stale=$WORLD_IP:9000 cna.checks=0 cna.big=1024"
    -netdev tap,id=n0,fd=3,vhost=off
    -device virtio-net-pci,netdev=n0,mac=20:90:6f:fc:fc:fc,romfile=)

# A minimal QMP client:
#   qmp.py SOCK cont|stop              -> resumes/pauses, prints the status
#   qmp.py SOCK wait STATUS SECONDS    -> polls query-status until STATUS,
#                                         prints "STATUS <epoch>" (exit 1 if not)
#   qmp.py SOCK migrate URI SECONDS    -> migrate, poll query-migrate until
#                                         completed, prints facts
cat >"$T/qmp.py" <<'PY'
import json, socket, sys, time
sock, cmd, args = sys.argv[1], sys.argv[2], sys.argv[3:]
s = socket.socket(socket.AF_UNIX)
for i in range(100):
    try:
        s.connect(sock); break
    except OSError as e:
        err = e; time.sleep(0.1)
else:
    sys.exit("qmp: cannot connect to %s: %s" % (sock, err))
s.settimeout(30)
f = s.makefile("rw")
f.readline()  # greeting
def call(name, arguments=None):
    msg = {"execute": name}
    if arguments is not None:
        msg["arguments"] = arguments
    f.write(json.dumps(msg) + "\n"); f.flush()
    while True:
        line = f.readline()
        if not line:
            sys.exit("qmp %s: connection closed" % name)
        r = json.loads(line)
        if "return" in r:
            return r["return"]
        if "error" in r:
            sys.exit("qmp %s: %s" % (name, r["error"].get("desc")))
        # an event: skip
call("qmp_capabilities")
if cmd in ("cont", "stop"):
    call(cmd)
    print(call("query-status")["status"])
elif cmd == "wait":
    want, deadline = args[0], time.time() + float(args[1])
    while True:
        st = call("query-status")["status"]
        if st == want:
            print(st, "%.3f" % time.time()); break
        if time.time() > deadline:
            print(st, "%.3f" % time.time()); sys.exit(1)
        time.sleep(0.05)
elif cmd == "migrate":
    uri, deadline = args[0], time.time() + float(args[1])
    # QEMU 7.2 limits migration to 32 MiB/s by default.
    call("migrate-set-parameters", {"max-bandwidth": 1 << 34})
    call("migrate", {"uri": uri})
    while True:
        m = call("query-migrate")
        st = m.get("status")
        if st == "completed":
            print("completed total=%sms downtime=%sms ram=%sB vm=%s" % (m.get("total-time"), m.get("downtime"),
                  m.get("ram", {}).get("transferred"), call("query-status")["status"]))
            break
        if st in ("failed", "cancelled") or time.time() > deadline:
            sys.exit("migrate: %s %s" % (st, m.get("error-desc", "")))
        time.sleep(0.05)
else:
    sys.exit("qmp.py: unknown command " + cmd)
PY
qmp() { "$PY" "$T/qmp.py" "$T/qmp-$1.sock" "${@:2}"; }

ip netns exec "$NS" "$CTL" --bus "$ADDR" open-tap vm-src -- "${QEMU[@]}" \
    -serial "file:$T/console-src.log" -qmp "unix:$T/qmp-src.sock,server=on,wait=off" \
    </dev/null >"$T/qemu-src.log" 2>&1 &
SRC_PID=$!
PIDS+=("$SRC_PID")
QEMU_T0=$(now)

# wait_console NAME PID PATTERN SECONDS: the first line of NAME's console
# matching PATTERN.
wait_console() {
    local f=$T/console-$1.log deadline=$(($(date +%s) + $4))
    while [ "$(date +%s)" -le $deadline ]; do
        if grep -a -m1 -- "$3" "$f" 2>/dev/null | tr -d '\r'; then return 0; fi
        kill -0 "$2" 2>/dev/null || { sleep 0.2; grep -a -m1 -- "$3" "$f" 2>/dev/null | tr -d '\r' && return 0; return 1; }
        sleep 0.1
    done
    return 1
}
# ticks_from CLIENT [AFTER]: lines the tick server got from CLIENT (after epoch AFTER)
ticks_from() { awk -v c="client=$1" -v t="${2:-0}" '$2 == "line" && $3 == c && $1 > t' "$T/ticks.log" | wc -l; }
connections() { awk '$2 == "connect" { sub(/^client=/, "", $3); print $3 }' "$T/ticks.log" | sort -u | tr '\n' ' ' | sed 's/ $//'; }

if ! NETUP=$(wait_console src $SRC_PID GUEST-NET-UP 60); then
    notok "source guest boots and configures eth0" "qemu: $(tail -3 "$T/qemu-src.log" | tr '\n' ' ')"
    summary
    exit 1
fi
ok "source guest boots and configures eth0 (${NETUP#GUEST-NET-UP }, $(since "$QEMU_T0") s after exec)"

# The source's tick connection: one connection, ticking.
SRC_CLIENT=
for _ in $(seq 150); do
    SRC_CLIENT=$(connections)
    [ -n "$SRC_CLIENT" ] && [ "$(ticks_from "$SRC_CLIENT")" -ge 3 ] && break
    sleep 0.1
done
if [ -n "$SRC_CLIENT" ] && [ "${SRC_CLIENT% *}" = "$SRC_CLIENT" ] && [ "${SRC_CLIENT%:*}" = $NODE_IP ] &&
    [ "$(ticks_from "$SRC_CLIENT")" -ge 3 ]; then
    ok "source: its tick connection reaches the world (from $SRC_CLIENT, $(ticks_from "$SRC_CLIENT") ticks)"
else
    notok "source: its tick connection reaches the world" "connections seen by the tick server: '${SRC_CLIENT}'" \
        "expected one from $NODE_IP with >= 3 ticks within 15 s; $(wait_console src $SRC_PID GUEST-STALE-END 0)"
    summary
    exit 1
fi

# --- snapshot ---------------------------------------------------------------------------
# A live migration into a file; the source ends paused (postmigrate).
if ! SNAP=$(qmp src migrate "exec:cat > $T/snap.mig" 60 2>&1); then
    notok "snapshot: migrate the source to a file" "$SNAP" "qemu: $(tail -3 "$T/qemu-src.log" | tr '\n' ' ')"
    summary
    exit 1
fi
SNAP_T=$(now)
SNAP_TICKS=$(ticks_from "$SRC_CLIENT")
check "snapshot: migrate the source to a file ($(du -m "$T/snap.mig" | cut -f1) MiB; ${SNAP% vm=*})" \
    "vm=postmigrate" "vm=${SNAP##*vm=}"
log "snapshot taken after tick $SNAP_TICKS of the source"

# --- clone networks -----------------------------------------------------------------------
declare -a C_SIP C_TAP C_HP C_UP
for i in $(seq $CLONES); do
    c=clone-$i
    by_name=()
    [ "$i" = "$CLONES" ] && by_name=(--tap-owner=0)
    if ! "$CTL" --bus "$ADDR" --json ensure "$c" --clone-of=vm-src ${by_name[@]+"${by_name[@]}"} >"$T/ensure-$c.json" 2>"$T/ensure-$c.err"; then
        notok "ensure $c --clone-of=vm-src" "$(cat "$T/ensure-$c.err")"
        summary
        exit 1
    fi
    read -r sip tap hp from < <(netinfo "$T/ensure-$c.json")
    "$CTL" --bus "$ADDR" --json status "$c" >"$T/status-$c.json" 2>"$T/status-$c.err"
    read -r ssip stap shp sfrom < <(netinfo "$T/status-$c.json" 2>/dev/null)
    C_SIP[i]=$sip C_TAP[i]=$tap C_HP[i]=$hp
    check "ensure $c --clone-of=vm-src ${by_name[*]} (sandbox $sip, tap $tap, tcp 80 -> host port $hp); GetNetwork agrees" \
        "cloned_from=vm-src port=yes status: cloned_from=vm-src $sip $tap $hp" \
        "cloned_from=$from port=$([ "$hp" != - ] && [ "$hp" != 0 ] && echo yes || echo no) status: cloned_from=${sfrom:-?} ${ssip:-?} ${stap:-?} ${shp:-?}"
done
all_distinct() { [ "$(printf '%s\n' "$@" | sort -u | wc -l)" = $# ]; }
if all_distinct "$SRC_SIP" "${C_SIP[@]}" && all_distinct "$SRC_TAP" "${C_TAP[@]}" && all_distinct "$SRC_HP" "${C_HP[@]}"; then
    ok "source and clones: distinct sandbox IPs, TAPs and host ports"
else
    notok "source and clones: distinct sandbox IPs, TAPs and host ports" \
        "sandbox IPs: $SRC_SIP ${C_SIP[*]}" "TAPs: $SRC_TAP ${C_TAP[*]}" "host ports: $SRC_HP ${C_HP[*]}"
fi

# --- restore ----------------------------------------------------------------------------------
for i in $(seq $CLONES); do capture "clone-$i" "${C_TAP[i]}"; done
wait_captures $(seq -f 'clone-%g' $CLONES)
RESTORE_T0=$(now)
for i in $(seq $CLONES); do
    c=clone-$i
    run=(ip netns exec "$NS" "$CTL" --bus "$ADDR" open-tap "$c" -- "${QEMU[@]}")
    if [ "$i" = "$CLONES" ]; then
        # By name: QEMU opens the clone's TAP itself; nothing is handed over.
        run=(ip netns exec "$NS" "${QEMU[@]/#tap,id=n0,fd=3,vhost=off/tap,id=n0,ifname=${C_TAP[i]},script=no,downscript=no,vnet_hdr=on,vhost=off}")
    fi
    "${run[@]}" \
        -serial "file:$T/console-$c.log" -qmp "unix:$T/qmp-$c.sock,server=on,wait=off" \
        -incoming "exec:cat $T/snap.mig" \
        </dev/null >"$T/qemu-$c.log" 2>&1 &
    PIDS+=($!)
done
r=$(qmp src cont 2>&1)
CONT_T=$(now)
check "source: cont after the snapshot ($(since "$SNAP_T" "$CONT_T") s paused)" running "$r"

# Each clone's QMP in parallel: "running <epoch>" once restored.
waits=()
for i in $(seq $CLONES); do
    qmp "clone-$i" wait running 60 >"$T/restored-clone-$i" 2>&1 &
    waits+=($!)
done
for p in "${waits[@]}"; do wait "$p"; done
RESTORED=0
for i in $(seq $CLONES); do
    c=clone-$i
    read -r st t <"$T/restored-clone-$i"
    if [ "$st" = running ]; then
        C_UP[i]=$t
        RESTORED=$((RESTORED + 1))
        ok "$c: restored from the snapshot and running ($(since "$RESTORE_T0" "$t") s after exec)"
    else
        C_UP[i]=
        notok "$c: restored from the snapshot and running" "QMP: $(cat "$T/restored-clone-$i")" \
            "qemu: $(tail -3 "$T/qemu-$c.log" | tr '\n' ' ')"
    fi
done
CLONES_UP=$(now)
log "clones restored; the world's firewall dropped $(world_dropped) invalid segments so far"

# --- the clones' pre-snapshot connection ends --------------------------------------------------
# [RST] Wait until every restored clone printed GUEST-STALE-END, at most
# STALE_WAIT s after it was restored.
declare -a C_END C_END_T
deadline=$(awk -v t="$CLONES_UP" -v w=$STALE_WAIT 'BEGIN{printf "%.3f", t + w}')
while :; do
    pending=0
    for i in $(seq $CLONES); do
        [ -n "${C_UP[i]}" ] && [ -z "${C_END[i]:-}" ] || continue
        if l=$(grep -a -m1 GUEST-STALE-END "$T/console-clone-$i.log" 2>/dev/null | tr -d '\r') && [ -n "$l" ]; then
            C_END[i]=$l C_END_T[i]=$(now)
        else
            pending=$((pending + 1))
        fi
    done
    [ $pending = 0 ] && break
    awk -v d="$deadline" -v n="$(now)" 'BEGIN{exit !(n > d)}' && break
    sleep 0.1
done
DROPPED=$(world_dropped)
# The captures are read while tcpdump writes them: give a loaded machine
# up to 2 s (in all) to get the segments and RSTs to the files.
deadline=$(awk -v t="$(now)" 'BEGIN{printf "%.3f", t + 2}')
for i in $(seq $CLONES); do
    c=clone-$i
    [ -n "${C_UP[i]}" ] || {
        notok "$c: its pre-snapshot connection ends in the guest" "not restored"
        notok "$c: the node answers its first stale segment with a RST within 1 s" "not restored"
        continue
    }
    pcap=$T/$c.pcap
    while :; do
        first_out=$(tcpdump -r "$pcap" -tt -nn "tcp and dst host $WORLD_IP and dst port 9000" 2>/dev/null | head -1 | cut -d' ' -f1)
        n_out=$(tcpdump -r "$pcap" -tt -nn "tcp and dst host $WORLD_IP and dst port 9000" 2>/dev/null | wc -l)
        first_rst=$(tcpdump -r "$pcap" -tt -nn "tcp and src host $WORLD_IP and src port 9000 and tcp[tcpflags] & tcp-rst != 0" 2>/dev/null |
            head -1 | cut -d' ' -f1)
        [ -n "$first_out" ] && [ -n "$first_rst" ] && break
        awk -v d="$deadline" -v n="$(now)" 'BEGIN{exit !(n > d)}' && break
        sleep 0.1
    done
    why="the node does not reset connections from before the snapshot (issue 29): the guest's $n_out stale segments to $WORLD_IP:9000 went unanswered (the world's firewall dropped $DROPPED invalid segments in all)"
    if [ -n "${C_END[i]:-}" ]; then
        ok "$c: its pre-snapshot connection ends in the guest (${C_END[i]}, $(since "${C_UP[i]}" "${C_END_T[i]}") s after restore)"
    else
        notok "$c: its pre-snapshot connection ends in the guest (GUEST-STALE-END within $STALE_WAIT s)" \
            "no GUEST-STALE-END on its console $STALE_WAIT s after restore: $why"
    fi
    if [ -z "$first_out" ]; then
        notok "$c: the node answers its first stale segment with a RST within 1 s" \
            "no segment from the guest to $WORLD_IP:9000 on ${C_TAP[i]}: did the guest resume its connection?"
    elif [ -z "$first_rst" ]; then
        notok "$c: the node answers its first stale segment with a RST within 1 s" \
            "no RST from $WORLD_IP:9000 to the guest on ${C_TAP[i]} (first stale segment at $(since "$RESTORE_T0" "$first_out") s after exec): $why"
    else
        dt=$(awk -v a="$first_out" -v b="$first_rst" 'BEGIN{printf "%.3f", b - a}')
        if awk -v d="$dt" 'BEGIN{exit !(d >= 0 && d < 1)}'; then
            ok "$c: the node answers its first stale segment with a RST within 1 s (${dt} s)"
        else
            notok "$c: the node answers its first stale segment with a RST within 1 s" \
                "first segment to $WORLD_IP:9000 at $first_out, first RST from it at $first_rst ($dt s)"
        fi
    fi
done

# --- the clones reach the world, no change inside the guest ------------------------------------
for i in $(seq $CLONES); do
    c=clone-$i
    got=$(ip netns exec "$WNS" curl -sS -m 20 --fail "http://$NODE_IP:${C_HP[i]}/cgi-bin/fetch?$c" 2>&1); rc=$?
    seen=$(grep -c "^client=$NODE_IP \"GET /index.html?from=$c HTTP" "$T/world.log")
    check "$c: world -> $NODE_IP:${C_HP[i]} -> guest -> wget world (port-mapped ingress, SNAT egress)" \
        "rc=0 cna-vm-world-marker; world log: from=$c from $NODE_IP 1 time(s)" "rc=$rc $got; world log: from=$c from $NODE_IP $seen time(s)"
done
for i in $(seq $CLONES); do
    c=clone-$i
    got=$(ip netns exec "$NS" curl -sS -m 20 --fail "http://${C_SIP[i]}/" 2>&1); rc=$?
    check "$c: node -> ${C_SIP[i]}:80 (host access)" "rc=0 cna-vm-guest-marker" "rc=$rc $got"
done

# --- the original keeps working ---------------------------------------------------------------
for _ in $(seq 100); do
    [ "$(ticks_from "$SRC_CLIENT" "$CLONES_UP")" -ge 2 ] && break
    sleep 0.1
done
after=$(ticks_from "$SRC_CLIENT" "$CLONES_UP")
total=$(ticks_from "$SRC_CLIENT")
# "tick N" lines numbered 1, 2, 3, ... on the source's connection: nothing
# lost, duplicated or mixed in.
inorder=$(awk -v c="client=$SRC_CLIENT" '$2 == "line" && $3 == c { n++; if ($5 != n) bad++ } END { print (bad ? "no" : "yes") }' "$T/ticks.log")
stale_end=$(grep -a -m1 GUEST-STALE-END "$T/console-src.log" | tr -d '\r')
if [ "$after" -ge 2 ] && [ "$inorder" = yes ] && [ -z "$stale_end" ] && [ "$total" -gt "$SNAP_TICKS" ]; then
    ok "source: its pre-snapshot connection goes on after cont (client $SRC_CLIENT, ticks 1..$total in order, $after after the clones came up)"
else
    notok "source: its pre-snapshot connection goes on after cont" \
        "client $SRC_CLIENT: $total ticks ($SNAP_TICKS before the snapshot), $after after the clones came up (want >= 2), in order: $inorder" \
        "source console: ${stale_end:-no GUEST-STALE-END}"
fi
got=$(ip netns exec "$WNS" curl -sS -m 20 --fail "http://$NODE_IP:$SRC_HP/" 2>&1); rc=$?
check "source: world -> $NODE_IP:$SRC_HP -> guest:80 (port-mapped ingress)" "rc=0 cna-vm-guest-marker" "rc=$rc $got"
got=$(ip netns exec "$WNS" curl -sS -m 20 --fail "http://$NODE_IP:$SRC_HP/cgi-bin/fetch?vm-src" 2>&1); rc=$?
check "source: world -> guest -> wget world" "rc=0 cna-vm-world-marker" "rc=$rc $got"

# --- isolation --------------------------------------------------------------------------------
sleep 0.5
for c in "${!TCPDUMP[@]}"; do kill -INT "${TCPDUMP[$c]}" 2>/dev/null; done
for c in "${!TCPDUMP[@]}"; do wait "${TCPDUMP[$c]}" 2>/dev/null; done
check "the tick server saw no connection but the source's (none opened by a clone's stale segments)" \
    "$SRC_CLIENT" "$(connections)"
for i in $(seq $CLONES); do
    c=clone-$i
    n=$(tcpdump -r "$T/$c.pcap" -nn "tcp and src host $WORLD_IP and src port 9000 and not tcp[tcpflags] & tcp-rst != 0" 2>/dev/null | wc -l)
    check "$c: none of the source's tick connection is delivered to it" "0 segments" "$n segments"
done
# The source's SNAT port on the uplink carries the source's segments and
# no clone's: no more segments to :9000 than left the source's TAP (both
# captures ran over the same time; allow one in flight at the ends).
SRC_PORT=${SRC_CLIENT##*:}
n_up=$(tcpdump -r "$T/up0.pcap" -nn "tcp and src host $NODE_IP and src port $SRC_PORT and dst host $WORLD_IP and dst port 9000" 2>/dev/null | wc -l)
n_tap=$(tcpdump -r "$T/src.pcap" -nn "tcp and dst host $WORLD_IP and dst port 9000" 2>/dev/null | wc -l)
others=$(tcpdump -r "$T/up0.pcap" -nn "tcp and src host $NODE_IP and not src port $SRC_PORT and dst host $WORLD_IP and dst port 9000" 2>/dev/null |
    awk '{ print $3 }' | sort | uniq -c | awk '{ printf "%s%s x%s", sep, $2, $1; sep = ", " }')
if [ "$n_up" -le $((n_tap + 1)) ] && [ "$n_up" -ge $((n_tap - 1)) ]; then
    ok "no clone's traffic leaves as the source's (uplink: $n_up segments from $NODE_IP:$SRC_PORT to :9000, the source's TAP $n_tap; other ports: ${others:-none})"
else
    notok "no clone's traffic leaves as the source's" \
        "uplink: $n_up segments from $NODE_IP:$SRC_PORT to $WORLD_IP:9000, but $n_tap from the source's TAP" \
        "other source ports to :9000 on the uplink: ${others:-none}"
fi

# --- a paused sandbox ---------------------------------------------------------------------
# The orchestrator pauses clone-1's VM and its network (a retried clone_of
# keeps the clone's spec; --paused is the only change): a connection
# attempt from the world is dropped and reported once (cubenetctl watch,
# the varlink WatchNetworks stream); a second one is not; resumed, the next
# attempt connects.
"$CTL" --varlink "$T/run/org.cube.NetworkAgent" watch >"$T/watch.log" 2>"$T/watch.err" &
PIDS+=($!)
for _ in $(seq 100); do grep -q " current " "$T/watch.log" 2>/dev/null && break; sleep 0.05; done
r=$(qmp clone-1 stop 2>&1)
"$CTL" --bus "$ADDR" --json ensure clone-1 --clone-of=vm-src --paused >"$T/pause.json" 2>&1
paused=$("$PY" -c 'import json,sys; n=json.load(open(sys.argv[1])); print(n.get("paused"), n.get("cloned_from"))' "$T/pause.json" 2>&1)
check "clone-1: VM stopped ($r), network paused (ensure --clone-of=vm-src --paused)" "True vm-src" "$paused"
reports() { grep -c " traffic_while_paused clone-1 " "$T/watch.log"; }
t0=$(now)
ip netns exec "$WNS" curl -sS -m 2 "http://$NODE_IP:${C_HP[1]}/" >/dev/null 2>&1 &
CURL=$!
took=""
for _ in $(seq 200); do
    [ "$(reports)" -ge 1 ] && { took=$(awk -v s="$t0" -v n="$(now)" 'BEGIN{printf "%.0f", (n-s)*1000}'); break; }
    sleep 0.01
done
wait $CURL; rc=$?
line=$(grep -m1 " traffic_while_paused clone-1 " "$T/watch.log" | cut -d' ' -f7-)
if [ "$(reports)" = 1 ] && [ "$rc" != 0 ] && [[ "$line" == "tcp/80 from $WORLD_IP:"*" via port_mapping" ]]; then
    ok "clone-1 paused: a connection from the world is dropped (curl rc=$rc) and reported once ($line, seen ${took} ms after the attempt)"
else
    notok "clone-1 paused: a connection from the world is dropped and reported once"         "curl rc=$rc (want a failure), reports: $(reports) (want 1): ${line:-none}" "watch: $(tail -3 "$T/watch.log" "$T/watch.err" | tr '\n' ' ')"
fi
ip netns exec "$WNS" curl -sS -m 1 "http://$NODE_IP:${C_HP[1]}/" >/dev/null 2>&1; rc=$?
sleep 0.3
check "clone-1 paused: a second attempt is dropped and not reported again" "rc=28 reports=1" "rc=$rc reports=$(reports)"
"$CTL" --bus "$ADDR" ensure clone-1 --clone-of=vm-src >/dev/null 2>&1
r=$(qmp clone-1 cont 2>&1)
got=$(ip netns exec "$WNS" curl -sS -m 20 --fail "http://$NODE_IP:${C_HP[1]}/" 2>&1); rc=$?
check "clone-1 resumed ($r): the next connection from the world works" "rc=0 cna-vm-guest-marker reports=1" "rc=$rc $got reports=$(reports)"

summary
[ $FAILED = 0 ]
