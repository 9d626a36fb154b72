#!/bin/bash
# End-to-end test of the systemd / D-Bus integration: boots a throw-away
# systemd container (tmpfs overlay of "/", private network namespace, see
# nspawn_up.sh), installs the agent with `make install NO_BUILD=1
# DESTDIR=/proc/<container pid 1>/root`, and checks activation, notify
# STATUS, journald fields, restart after kill -9, clean stop, unit
# verification. Nothing touches the host's interfaces or files outside the
# overlay; the container is removed on exit, failure included.
#
# Usage (root): tests/systemd/run.sh
#   CNA_BUILD=1   run `cargo build --release --bins` first (default: only
#                 when target/release/cube-network-agent is missing)
#   CNA_KEEP=1    leave the container running for inspection (prints how
#                 to enter and remove it)
# Output: one "ok - NAME" / "not ok - NAME" line per check (diagnostics on
# "#" lines), then "N passed, M failed"; exit status 1 if any failed.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
cd "$ROOT"

if [ "$(id -u)" != 0 ]; then
  echo "SKIPPED tests/systemd/run.sh: needs root (systemd-nspawn)"
  exit 0
fi

BIN=target/release/cube-network-agent
if [ "${CNA_BUILD:-}" = 1 ] || [ ! -x "$BIN" ]; then
  cargo build --release --bins || { echo "build failed"; exit 1; }
fi
echo "# binary: $BIN ($(stat -c %y "$BIN" | cut -d. -f1))"

NAME=cna-$$
X="$HERE/nspawn_exec.sh $NAME"
A="org.cube.NetworkAgent /org/cube/NetworkAgent org.cube.NetworkAgent"
UNIT=cube-network-agent.service
SOCK=/run/cube-network-agent/org.cube.NetworkAgent
PASS=0; FAIL=0; FAILED=()

cleanup() {
  if [ "${CNA_KEEP:-}" = 1 ]; then
    echo "# kept: $HERE/nspawn_exec.sh $NAME bash   /   $HERE/nspawn_down.sh $NAME"
  else
    "$HERE/nspawn_down.sh" "$NAME" >/dev/null 2>&1
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ok()     { PASS=$((PASS + 1)); echo "ok - $1"; }
not_ok() { FAIL=$((FAIL + 1)); FAILED+=("$1"); echo "not ok - $1"; shift; for l in "$@"; do printf '%s\n' "$l" | sed 's/^/#   /'; done; }
# check NAME CMD...: ok if CMD exits 0; its output becomes the diagnostic otherwise
check() { local name=$1 out; shift; if out=$("$@" 2>&1); then ok "$name"; else not_ok "$name" "$out"; fi; }
# in: run a shell snippet inside the container
cx() { $X bash -c "$1"; }
prop() { $X systemctl show -P "$1" "${2:-$UNIT}" 2>/dev/null; }
wait_for() {  # wait_for SECONDS SNIPPET: poll a container snippet until it succeeds
  local t=$(( $1 * 10 )) i
  for ((i = 0; i < t; i++)); do cx "$2" >/dev/null 2>&1 && return 0; sleep 0.1; done
  return 1
}
get_network() {  # prints "sandbox_ip tap_name" of sbx-1
  $X busctl --timeout=10 --json=short call $A GetNetwork s sbx-1 2>&1 |
    python3 -c 'import json,sys; d=json.load(sys.stdin)["data"][0]; print(d["sandbox_ip"]["data"], d["tap_name"]["data"])' 2>&1
}

T0=$(date +%s)
# ---- container + install ----------------------------------------------
if ! up=$("$HERE/nspawn_up.sh" "$NAME" 2>&1); then
  not_ok "container boots" "$up"
  echo "$PASS passed, $FAIL failed"; exit 1
fi
echo "# $up"
L=$(cat "${CNA_NSPAWN_DIR:-/tmp/cube-network-agent-nspawn}/state-$NAME/leader.pid")

if out=$(make -s install NO_BUILD=1 DESTDIR=/proc/$L/root 2>&1) &&
   out2=$(cx 'systemctl daemon-reload && systemctl enable cube-network-agent.service 2>&1 &&
              test -L /etc/systemd/system/dbus-org.cube.NetworkAgent.service &&
              test -L /etc/systemd/system/sockets.target.wants/cube-network-agent.socket &&
              systemctl start cube-network-agent.socket' 2>&1); then
  ok "make install into the container, enable (Alias=, Also=), start the socket"
else
  not_ok "make install into the container, enable (Alias=, Also=), start the socket" "${out:-}" "${out2:-}"
fi

check "0 system bus runs in the container (dbus.socket)" cx 'systemctl is-active dbus.socket'

# ---- 1: socket active, service waiting ---------------------------------
s1=$(cx 'systemctl is-active cube-network-agent.socket'); s2=$(cx "systemctl is-active $UNIT")
if [ "$s1" = active ] && [ "$s2" = inactive ] && cx "test -S $SOCK"; then
  ok "1 socket active, service inactive before the first client"
else
  not_ok "1 socket active, service inactive before the first client" "socket=$s1 service=$s2" "$(cx "ls -l $SOCK" 2>&1)"
fi

# ---- 2: D-Bus activation -----------------------------------------------
if out=$($X busctl --timeout=30 call $A Health 2>&1) && [ "$(cx "systemctl is-active $UNIT")" = active ]; then
  ok "2 busctl Health activates the service through D-Bus activation"
  echo "#   Health: ${out:0:160}..."
else
  not_ok "2 busctl Health activates the service through D-Bus activation" "$out" "$(cx "systemctl status $UNIT --no-pager -n 20" 2>&1)"
fi

# ---- 3: socket activation (varlink) ------------------------------------
# (systemctl warns that the socket can still activate it: that is the point)
stop3=$(cx "systemctl stop $UNIT 2>/dev/null; systemctl is-active $UNIT" 2>&1)
VARLINK_PY='
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(15)
s.connect(sys.argv[1])
s.sendall(json.dumps({"method": "org.varlink.service.GetInfo"}).encode() + b"\0")
buf = b""
try:
    while not buf.endswith(b"\0"):
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
except socket.timeout:
    print("no reply within 15 s"); sys.exit(1)
if not buf:
    print("connection closed without a reply"); sys.exit(1)
reply = json.loads(buf.rstrip(b"\0"))
print(json.dumps(reply)[:300])
sys.exit(1 if "error" in reply else 0)
'
if [ "$stop3" = inactive ]; then
  out=$($X python3 -c "$VARLINK_PY" "$SOCK" 2>&1); rc=$?
  act=$(cx "systemctl is-active $UNIT")
  if [ $rc = 0 ] && [ "$act" = active ]; then
    ok "3 varlink GetInfo on the socket activates the service and is answered"
    echo "#   reply: $out"
  else
    not_ok "3 varlink GetInfo on the socket activates the service and is answered" \
      "reply: $out" "service after the connection: $act"
  fi
else
  not_ok "3 varlink GetInfo on the socket activates the service and is answered" "could not stop the service first: $stop3"
fi
# make sure it runs for the rest (activation through D-Bus again if step 3 did not)
$X busctl --timeout=30 call $A Health >/dev/null 2>&1

# ---- 4: STATUS= ---------------------------------------------------------
out=$(cx "systemctl status $UNIT --no-pager -n 0" 2>&1)
if printf '%s\n' "$out" | grep -Eq 'Status: "[0-9]+ networks, [0-9]+ idle taps, [0-9]+ free addresses'; then
  ok "4 systemctl status shows the STATUS= line"
  printf '%s\n' "$out" | grep 'Status:' | sed 's/^ */#   /'
else
  not_ok "4 systemctl status shows the STATUS= line" "$out"
fi

# ---- hardening actually applied -----------------------------------------
pid=$(prop MainPID)
capeff=$(cx "awk '/^CapEff/{print \$2}' /proc/$pid/status" 2>&1)
# CAP_NET_ADMIN (12), CAP_PERFMON (38), CAP_BPF (39)
if [ "$capeff" = 000000c000001000 ]; then
  ok "hardening: the agent runs with exactly CAP_NET_ADMIN CAP_PERFMON CAP_BPF"
else
  not_ok "hardening: the agent runs with exactly CAP_NET_ADMIN CAP_PERFMON CAP_BPF" "CapEff of pid $pid: $capeff"
fi

# ---- 5: EnsureNetwork, journald fields -----------------------------------
ens=$($X busctl --timeout=30 call $A EnsureNetwork 'sa{sv}' sbx-1 0 2>&1); ens_rc=$?
echo "#   EnsureNetwork sbx-1: ${ens:0:200}"
NET1=$(get_network)
echo "#   sbx-1: $NET1"
n=0
for i in $(seq 20); do
  n=$(cx 'journalctl --sync 2>/dev/null; journalctl -u cube-network-agent SANDBOX_ID=sbx-1 -o json --no-pager | wc -l')
  [ "${n:-0}" -gt 0 ] && break; sleep 0.2
done
if [ $ens_rc = 0 ] && [ "${n:-0}" -gt 0 ]; then
  ok "5 journalctl -u cube-network-agent SANDBOX_ID=sbx-1 returns the sandbox's lines ($n)"
  cx "journalctl -u cube-network-agent SANDBOX_ID=sbx-1 -o json --no-pager | head -3" |
    python3 -c 'import json,sys
for l in sys.stdin:
    d = json.loads(l); print("#   ", {k: v for k, v in d.items() if k in ("MESSAGE", "SANDBOX_ID", "TAP", "SANDBOX_IP", "PRIORITY")})'
else
  not_ok "5 journalctl -u cube-network-agent SANDBOX_ID=sbx-1 returns the sandbox's lines" \
    "EnsureNetwork rc=$ens_rc; $n journal entries with SANDBOX_ID=sbx-1; the agent's last lines:" \
    "$(cx 'journalctl -u cube-network-agent -o verbose --no-pager -n 1 | grep -E "^ +[A-Z_]+=" | cut -c1-120' 2>&1)"
fi

nfd=$(prop NFileDescriptorStore)
if [ "${nfd:-0}" -gt 0 ]; then
  ok "fd store: the TAP fds are parked in the service manager's fd store ($nfd)"
else
  not_ok "fd store: the TAP fds are parked in the service manager's fd store" "NFileDescriptorStore=$nfd after EnsureNetwork sbx-1"
fi

# ---- 6: kill -9 -> Restart=on-failure -> same network ---------------------
pid0=$(prop MainPID); nr0=$(prop NRestarts)
cx "systemctl kill -s KILL $UNIT"
restarted=no
for i in $(seq 150); do
  p=$(prop MainPID); st=$(prop SubState)
  if [ -n "$p" ] && [ "$p" != 0 ] && [ "$p" != "$pid0" ] && [ "$st" = running ]; then restarted=yes; break; fi
  sleep 0.1
done
nr1=$(prop NRestarts)
NET2=$(get_network)
if [ $restarted = yes ] && [ -n "$NET1" ] && [ "$NET1" = "$NET2" ] && [ "$nr1" = $((nr0 + 1)) ]; then
  ok "6 kill -9: systemd restarts it (NRestarts $nr0 -> $nr1), GetNetwork sbx-1 unchanged ($NET2)"
else
  not_ok "6 kill -9: systemd restarts it, GetNetwork sbx-1 unchanged" \
    "restarted=$restarted pid $pid0 -> $(prop MainPID), NRestarts $nr0 -> $nr1" "before: $NET1" "after:  $NET2"
fi
nfd2=$(prop NFileDescriptorStore)
if [ "${nfd:-0}" -gt 0 ] && [ "$nfd2" = "$nfd" ]; then
  ok "6b fd store: the TAP fds survive the restart ($nfd before, $nfd2 after)"
else
  not_ok "6b fd store: the TAP fds survive the restart" "NFileDescriptorStore $nfd before the kill, $nfd2 after the restart"
fi
echo "#   recovery: $(cx 'journalctl -u cube-network-agent --no-pager -o cat -n 50 | grep -i "recovery finished" | tail -1' | cut -c1-200)"

# ---- watchdog: the agent pings, so it outlives WatchdogSec ------------------
wd=$(prop WatchdogUSec)
pid1=$(prop MainPID); nr1=$(prop NRestarts)
since=$(prop ExecMainStartTimestampMonotonic)
# Same clock as ExecMainStartTimestampMonotonic (CLOCK_MONOTONIC; /proc/uptime
# is CLOCK_BOOTTIME, which differs on VMs that were suspended or snapshotted).
now=$(cx "python3 -c 'import time; print(int(time.monotonic() * 1000000))'")
left=$(( (12000000 - (now - since)) / 1000000 + 1 ))
[ $left -gt 13 ] && left=13
[ $left -gt 0 ] && sleep $left
if [ "$(prop MainPID)" = "$pid1" ] && [ "$(prop NRestarts)" = "$nr1" ] &&
   ! cx "journalctl -u cube-network-agent --no-pager -o cat | grep -q 'Watchdog timeout'"; then
  ok "watchdog: alive 12 s into WatchdogSec=$wd (WATCHDOG=1 pings arrive)"
else
  not_ok "watchdog: alive 12 s into WatchdogSec=$wd (WATCHDOG=1 pings arrive)" \
    "pid $pid1 -> $(prop MainPID), NRestarts $nr1 -> $(prop NRestarts)" \
    "$(cx "journalctl -u cube-network-agent --no-pager -o cat | grep -i watchdog | tail -3" 2>&1)"
fi

# ---- 7: clean stop, TAP stays ---------------------------------------------
TAP=${NET2#* }
out=$(cx "systemctl stop $UNIT" 2>&1); rc=$?
res=$(prop Result); st=$(prop ActiveState)
links=$(cx "ip -br link show dev '$TAP'" 2>&1)
if [ $rc = 0 ] && [ "$res" = success ] && [ "$st" = inactive ] && [ -n "$TAP" ] && [ "${links%% *}" = "$TAP" ]; then
  ok "7 systemctl stop is clean (Result=success) and TAP $TAP of sbx-1 stays"
  echo "#   NFileDescriptorStore after the stop: $(prop NFileDescriptorStore) (systemd 252 empties the store on stop)"
else
  not_ok "7 systemctl stop is clean (Result=success) and TAP of sbx-1 stays" \
    "stop rc=$rc $out; Result=$res ActiveState=$st; tap '$TAP': $links"
fi
if [ "$(cx 'systemctl is-active cube-network-agent.socket')" = active ] && cx "test -S $SOCK"; then
  ok "7b the socket unit and $SOCK survive the service's stop (RuntimeDirectoryPreserve=yes)"
else
  not_ok "7b the socket unit and $SOCK survive the service's stop" "$(cx "systemctl is-active cube-network-agent.socket; ls -l /run/cube-network-agent" 2>&1)"
fi

# ---- 8: verify the installed units ----------------------------------------
out=$(cx 'systemd-analyze verify /usr/lib/systemd/system/cube-network-agent.socket /usr/lib/systemd/system/cube-network-agent.service 2>&1; echo "rc=$?"')
if [ "$out" = "rc=0" ]; then
  ok "8 systemd-analyze verify of the installed units is clean"
else
  not_ok "8 systemd-analyze verify of the installed units is clean" "$out"
fi

echo "# $(( $(date +%s) - T0 )) s"
[ $FAIL -gt 0 ] && printf '# failed: %s\n' "${FAILED[@]}"
echo "$PASS passed, $FAIL failed"
[ $FAIL = 0 ]
