#!/bin/bash
# Restart time of the agent with N networks (default 10,000) under a real
# systemd, TAP fds coming back from the service manager's fd store (no
# reopen). A measurement, not a test: the timings are informational; it
# fails (exit 1, "FAIL: ...") only when the setup or the fd hand-back does
# not work.
#
#   scripts/restart-fdstore.sh [-n N] [-c CONNS] [-w WINDOW] [-b BATCH] [-k]
#
#   -n N       networks to create (default 10000; the default /18 pool has 16381)
#   -c CONNS   varlink connections used in parallel for the fill (default 4)
#   -w WINDOW  EnsureNetwork calls pipelined per connection (default 8)
#   -b BATCH   after every BATCH ensures, wait until systemd's fd store has
#              caught up (default 1000; 0 = never wait, see below)
#   -k         keep the container (prints how to enter and remove it)
#
# Needs root and systemd-nspawn (tests/systemd/nspawn_up.sh installs it),
# and the release binaries in target/release (it never builds them).
#
# How (the same way tests/systemd/run.sh does it): boots a throw-away
# systemd container (tests/systemd/nspawn_up.sh: tmpfs overlay of "/", its
# own network namespaces, bpffs), installs the agent with `make install
# NO_BUILD=1 DESTDIR=/proc/<container pid 1>/root` (the shipped units,
# unchanged), starts cube-network-agent.service, then
#   1. fills it with N networks over varlink (EnsureNetwork {"sandbox_id"}),
#      CONNS connections with WINDOW calls in flight each, in batches of
#      BATCH with a wait for systemd's fd store after each; prints the rates;
#   2. `systemctl kill -s KILL`: Restart=on-failure (RestartSec=500ms)
#      starts a new agent, which gets every TAP fd back from the fd store;
#   3. `systemctl restart` (SIGTERM path; systemd 252 keeps the fd store
#      across a restart job);
#   4. checks Health (first value true) and ActiveNetworks == N.
# For each restart it reads the unit's monotonic timestamps (systemctl
# show, checked to belong to the new process: ExecMainPID == MainPID, a new
# pid, timestamps after the event) and the new process's journal
# ("TAP fds handed back by the fd store" FDS=, "recovery finished"
# ADOPTED=, ELAPSED_MS=, ...). Reported per restart:
#   spawn->READY     ActiveEnterTimestamp - ExecMainStartTimestamp (the
#                    agent's own start: exec, fd adoption, recovery, serve)
#   job->spawn       ExecMainStartTimestamp - InactiveExitTimestamp: the
#                    start job up to the fork of the main process
#                    (ExecStartPre=, collecting the stored fds); compared
#                    with the first start, which had an empty store
#   spawn->fds log   ExecMainStartTimestamp to the journal's receive time of
#                    "TAP fds handed back" (fork + the child's fd shuffle,
#                    sandbox setup, exec, agent init up to that line)
#   down->READY      ActiveExitTimestamp (death noticed / stop begins) to
#                    ActiveEnterTimestamp; includes RestartSec=500ms after
#                    SIGKILL and the agent's stop after systemctl restart
# BATCH: systemd 252 stores an fd only after comparing it with every fd
# already in the unit's store (service_add_fd_store(): same_fd() on each),
# so FDSTORE=1 costs O(store size) in PID 1 and filling 10k is O(n^2):
# near 10k PID 1 takes a few ms per fd, far slower than EnsureNetwork. The
# agent queues notifications systemd has no room for (src/systemd.rs, at
# most 4096, then the oldest are dropped), so an unthrottled fill (-b 0)
# loses store entries and the post-fill check fails. Waiting for the store
# after each batch keeps that queue short; the fill prints both rates.
# The container's journald gets RateLimitIntervalSec=0 (a drop-in in the
# container's overlay only): the agent logs one line per EnsureNetwork, and
# journald's default 10000/30 s limit would otherwise swallow the lines of
# the restarted agent that this script reads.
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
SYSD=$ROOT/tests/systemd
cd "$ROOT"

N=10000 CONNS=4 WINDOW=8 BATCH=1000 KEEP=0
while getopts n:c:w:b:kh opt; do
  case $opt in
    n) N=$OPTARG;; c) CONNS=$OPTARG;; w) WINDOW=$OPTARG;; b) BATCH=$OPTARG;; k) KEEP=1;;
    h) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0;;
    *) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2;;
  esac
done
case "$N$CONNS$WINDOW$BATCH" in *[!0-9]*|"") echo "-n, -c, -w, -b take numbers" >&2; exit 2;; esac
[ "$N" -ge 1 ] && [ "$CONNS" -ge 1 ] && [ "$WINDOW" -ge 1 ] || { echo "-n, -c, -w must be >= 1" >&2; exit 2; }

die() { echo "FAIL: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "needs root (systemd-nspawn, network namespaces)"
for b in cube-network-agent cubenetctl; do
  [ -x "target/release/$b" ] || die "target/release/$b is not built (cargo build --release --bins)"
done

NAME=cna-fds-$$
X="$SYSD/nspawn_exec.sh $NAME"
UNIT=cube-network-agent.service
SOCK=/run/cube-network-agent/org.cube.NetworkAgent
A="org.cube.NetworkAgent /org/cube/NetworkAgent org.cube.NetworkAgent"

cleanup() {
  rc=$?
  if [ "$KEEP" = 1 ]; then
    echo "# kept: $SYSD/nspawn_exec.sh $NAME bash   /   $SYSD/nspawn_down.sh $NAME"
  else
    "$SYSD/nspawn_down.sh" "$NAME" >/dev/null 2>&1 || true
  fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

cx() { $X bash -c "$1"; }
# props P1 P2...: "P1=v1 P2=v2 ..." of the unit in one systemctl call
# (for eval into shell variables: every value here is a number or a word).
props() {
  local a=() p
  for p in "$@"; do a+=(-p "$p"); done
  $X systemctl show "${a[@]}" "$UNIT" | sed -n 's/^\([A-Za-z]*\)=\(.*\)$/\1="\2"/p'
}
prop() { $X systemctl show -P "$1" "$UNIT"; }
pid1_cpu_ms() { $X cat /proc/1/stat | awk -v hz="$(getconf CLK_TCK)" '{ print int(($14 + $15) * 1000 / hz) }'; }
ms() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", (b - a) / 1000 }'; }  # ms from µs a to µs b
journal_tail() { cx "journalctl -u $UNIT --no-pager -o cat -n ${1:-15}" 2>&1 | sed 's/^/#   /' >&2; }

# ---- container, install, start -------------------------------------------
echo "# binary: target/release/cube-network-agent ($(stat -c %y target/release/cube-network-agent | cut -d. -f1)), N=$N"
up=$("$SYSD/nspawn_up.sh" "$NAME" 2>&1) || die "container did not boot: $up"
echo "# $up"
L=$(cat "${CNA_NSPAWN_DIR:-/tmp/cube-network-agent-nspawn}/state-$NAME/leader.pid")
R=/proc/$L/root
mkdir -p "$R/etc/systemd/journald.conf.d"
printf '[Journal]\nRateLimitIntervalSec=0\n' > "$R/etc/systemd/journald.conf.d/90-restart-fdstore.conf"
cx 'systemctl restart systemd-journald' || die "restarting journald in the container"
out=$(make -s install NO_BUILD=1 DESTDIR="$R" 2>&1) || die "make install into the container: $out"
out=$(cx "systemctl daemon-reload && systemctl enable $UNIT && systemctl start cube-network-agent.socket && systemctl start $UNIT" 2>&1) ||
  { journal_tail 20; die "starting $UNIT: $out"; }
[ "$(prop ActiveState)" = active ] || { journal_tail 20; die "$UNIT is $(prop ActiveState) after systemctl start"; }
eval "$(props MainPID InactiveExitTimestampMonotonic ExecMainStartTimestampMonotonic ActiveEnterTimestampMonotonic)"
FIRST_JOB_SPAWN=$(ms "$InactiveExitTimestampMonotonic" "$ExecMainStartTimestampMonotonic")
FIRST_SPAWN_READY=$(ms "$ExecMainStartTimestampMonotonic" "$ActiveEnterTimestampMonotonic")
echo "# first start (empty fd store, no networks): job->spawn $FIRST_JOB_SPAWN ms, spawn->READY $FIRST_SPAWN_READY ms (pid $MainPID)"

# ---- fill -------------------------------------------------------------------
# argv: socket N CONNS WINDOW BATCH UNIT. Batches of BATCH sandboxes; in a
# batch, connection k ensures sandboxes k, k+CONNS, ... keeping WINDOW calls
# in flight. After each batch it waits until the unit's NFileDescriptorStore
# has caught up (>= its value before the fill + networks made so far): see
# "BATCH" at the top. Prints "ok=.. errors=.. ensure_s=.. wait_s=.. rate=..
# wall_rate=.. store=..".
FILL_PY='
import json, socket, subprocess, sys, threading, time
path, n, conns, window, batch, unit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
ids = ["fds-%05d" % i for i in range(n)]
errors, lock, done = [], threading.Lock(), [0]
def store():
    return int(subprocess.run(["systemctl", "show", "-P", "NFileDescriptorStore", unit],
                              capture_output=True, text=True).stdout.strip() or 0)
def worker(mine, k):
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(60)
        s.connect(path)
        buf, sent, got = b"", 0, 0
        while got < len(mine):
            out = []
            while sent < len(mine) and sent - got < window:
                out.append(json.dumps({"method": "org.cube.NetworkAgent.EnsureNetwork",
                                       "parameters": {"sandbox_id": mine[sent]}}).encode() + b"\0")
                sent += 1
            if out:
                s.sendall(b"".join(out))
            chunk = s.recv(1 << 20)
            if not chunk:
                raise RuntimeError("connection closed after %d replies" % got)
            buf += chunk
            *msgs, buf = buf.split(b"\0")
            for m in msgs:
                r = json.loads(m)
                if "error" in r:
                    with lock:
                        errors.append("%s: %s" % (mine[got], json.dumps(r)[:200]))
                got += 1
            with lock:
                done[0] += len(msgs)
        s.close()
    except Exception as e:
        with lock:
            errors.append("connection %d: %r" % (k, e))
base = store()
t_ensure = t_wait = 0.0
nfd = base
for b0 in range(0, n, batch or n):
    part = ids[b0:b0 + (batch or n)]
    t0 = time.monotonic()
    ts = [threading.Thread(target=worker, args=(part[k::conns], k)) for k in range(conns)]
    for t in ts: t.start()
    for t in ts: t.join()
    t1 = time.monotonic()
    t_ensure += t1 - t0
    if errors:
        break
    if batch:   # wait for the fd store to catch up (at most 120 s)
        want = base + b0 + len(part)
        while True:
            nfd = store()
            if nfd >= want or time.monotonic() - t1 > 120:
                break
            time.sleep(0.05)
        t_wait += time.monotonic() - t1
        print("#   %d/%d: ensures %.2f s, fd store %d after %.2f s more" % (b0 + len(part), n, t1 - t0, nfd, time.monotonic() - t1),
              file=sys.stderr, flush=True)
        if nfd < want:
            errors.append("fd store stuck at %d after 120 s, want >= %d" % (nfd, want))
            break
    else:
        print("#   %d/%d in %.2f s (no waits for the fd store)" % (b0 + len(part), n, t1 - t0), file=sys.stderr, flush=True)
ok = done[0] - sum(1 for e in errors if not e.startswith(("connection", "fd store")))
for e in errors[:5]: print("#   error: " + e, file=sys.stderr)
print("ok=%d errors=%d ensure_s=%.2f wait_s=%.2f rate=%.0f wall_rate=%.0f store=%d"
      % (ok, len(errors), t_ensure, t_wait, ok / t_ensure, ok / (t_ensure + t_wait), store()))
sys.exit(1 if errors else 0)
'
echo "# filling: $N x EnsureNetwork over varlink ($CONNS connections x $WINDOW in flight, batches of $BATCH)"
fill=$($X python3 -c "$FILL_PY" "$SOCK" "$N" "$CONNS" "$WINDOW" "$BATCH" "$UNIT") || { journal_tail; die "fill: $fill"; }
echo "# fill: $fill"
kv() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<< " $fill"; }
FILL_RATE=$(kv rate) FILL_WALL=$(kv wall_rate) FILL_ENSURE_S=$(kv ensure_s) FILL_WAIT_S=$(kv wait_s)

active_networks() { $X busctl --timeout=30 get-property $A ActiveNetworks 2>&1 | awk '{print $2}'; }
an=$(active_networks)
[ "$an" = "$N" ] || die "ActiveNetworks is $an after the fill, want $N"
# The fd store: one fd per network plus the warm pool's TAPs; wait until
# it has at least N and the pool refill has settled (two equal reads).
nfd=0 last=-1
for i in $(seq 100); do
  nfd=$(prop NFileDescriptorStore)
  [ "$nfd" -ge "$N" ] && [ "$nfd" = "$last" ] && break
  last=$nfd; sleep 0.3
done
[ "$nfd" -ge "$N" ] || die "NFileDescriptorStore is $nfd after the fill, want >= $N"
echo "# fd store after the fill: NFileDescriptorStore=$nfd (ActiveNetworks=$an)"

# ---- restart measurement ------------------------------------------------------
# JOURNAL_PY: the new process's journal (-o json on stdin) -> shell
# assignments J_FDS, J_ADOPTED, J_ELAPSED, J_FD_LOST, J_REPAIRED,
# J_QUARANTINED, J_FDS_MONO (µs), J_RECOV_MONO (µs); empty when missing;
# J_SOCKS: how many of the resolver's and proxy's sockets came back.
JOURNAL_PY='
import json, sys
want = {"TAP fds handed back by the fd store": ("FDS",),
        "recovery finished": ("ADOPTED", "ELAPSED_MS", "FD_LOST", "REPAIRED", "QUARANTINED", "POOL_ADOPTED")}
got = {}
socks = 0
for line in sys.stdin:
    try: e = json.loads(line)
    except ValueError: continue
    m = e.get("MESSAGE")
    if m == "socket handed back by the fd store":
        socks += 1
    if m in want and m not in got:
        got[m] = e
f = got.get("TAP fds handed back by the fd store", {})
r = got.get("recovery finished", {})
out = {"J_FDS": f.get("FDS", ""), "J_FDS_MONO": f.get("__MONOTONIC_TIMESTAMP", ""),
       "J_ADOPTED": r.get("ADOPTED", ""), "J_ELAPSED": r.get("ELAPSED_MS", ""),
       "J_FD_LOST": r.get("FD_LOST", ""), "J_REPAIRED": r.get("REPAIRED", ""),
       "J_QUARANTINED": r.get("QUARANTINED", ""), "J_POOL_ADOPTED": r.get("POOL_ADOPTED", ""),
       "J_RECOV_MONO": r.get("__MONOTONIC_TIMESTAMP", ""), "J_SOCKS": str(socks)}
for k, v in out.items():
    print("%s=%s" % (k, v if str(v).isdigit() else ""))
'
# measure LABEL CMD: runs CMD in the container, waits for the new agent,
# checks and prints the timings; sets R_SPAWN_READY, R_FDS, R_ELAPSED, R_NFD.
measure() {
  local label=$1 cmd=$2 pid0 ems0 nfd0 i p st
  eval "$(props MainPID ExecMainStartTimestampMonotonic NFileDescriptorStore NRestarts)"
  pid0=$MainPID ems0=$ExecMainStartTimestampMonotonic nfd0=$NFileDescriptorStore
  local nr0=$NRestarts cpu0
  cpu0=$(pid1_cpu_ms)
  cx "$cmd" || die "$label: '$cmd' failed"
  # until a new main process runs and is READY (TimeoutStartSec=90s)
  for ((i = 0; i < 1200; i++)); do
    eval "$(props MainPID SubState ActiveState)"
    [ "$MainPID" != 0 ] && [ "$MainPID" != "$pid0" ] && [ "$ActiveState" = active ] && [ "$SubState" = running ] && break
    sleep 0.1
  done
  [ "$ActiveState" = active ] && [ "$MainPID" != "$pid0" ] && [ "$MainPID" != 0 ] ||
    { journal_tail 20; die "$label: no new agent became active within 120 s (pid $pid0 -> $MainPID, $ActiveState/$SubState)"; }
  eval "$(props MainPID ExecMainPID ActiveExitTimestampMonotonic InactiveEnterTimestampMonotonic \
               InactiveExitTimestampMonotonic ExecMainStartTimestampMonotonic ActiveEnterTimestampMonotonic \
               NFileDescriptorStore NRestarts)"
  # the timestamps must be the new process's
  [ "$ExecMainPID" = "$MainPID" ] || die "$label: ExecMainPID $ExecMainPID is not MainPID $MainPID"
  [ "$ExecMainStartTimestampMonotonic" -gt "$ems0" ] || die "$label: ExecMainStartTimestamp did not move ($ems0)"
  [ "$ActiveEnterTimestampMonotonic" -gt "$ExecMainStartTimestampMonotonic" ] ||
    die "$label: ActiveEnterTimestamp $ActiveEnterTimestampMonotonic is not after ExecMainStartTimestamp $ExecMainStartTimestampMonotonic"
  [ "$ActiveExitTimestampMonotonic" -gt "$ems0" ] && [ "$InactiveExitTimestampMonotonic" -ge "$ActiveExitTimestampMonotonic" ] &&
    [ "$ExecMainStartTimestampMonotonic" -ge "$InactiveExitTimestampMonotonic" ] ||
    die "$label: timestamps out of order: ActiveExit $ActiveExitTimestampMonotonic InactiveExit $InactiveExitTimestampMonotonic ExecMainStart $ExecMainStartTimestampMonotonic (old start $ems0)"
  # the new process's journal lines (READY came after them; journald may lag a little)
  local j=""
  for ((i = 0; i < 50; i++)); do
    j=$(cx "journalctl --sync 2>/dev/null; journalctl _PID=$MainPID -o json --no-pager" | python3 -c "$JOURNAL_PY")
    eval "$j"
    [ -n "$J_RECOV_MONO" ] && break
    sleep 0.2
  done
  [ -n "$J_RECOV_MONO" ] || { journal_tail 20; die "$label: no 'recovery finished' line from pid $MainPID in the journal"; }
  R_PID1_CPU=$(( $(pid1_cpu_ms) - cpu0 ))
  echo "# $label: pid $pid0 -> $MainPID, NRestarts $nr0 -> $NRestarts, NFileDescriptorStore $nfd0 -> $NFileDescriptorStore," \
       "container PID 1 CPU from the event to now: $R_PID1_CPU ms"
  echo "#   down->stopped $(ms "$ActiveExitTimestampMonotonic" "$InactiveEnterTimestampMonotonic") ms," \
       "stopped->job $(ms "$InactiveEnterTimestampMonotonic" "$InactiveExitTimestampMonotonic") ms," \
       "job->spawn $(ms "$InactiveExitTimestampMonotonic" "$ExecMainStartTimestampMonotonic") ms" \
       "(first start, empty store: $FIRST_JOB_SPAWN ms)"
  R_SPAWN_READY=$(ms "$ExecMainStartTimestampMonotonic" "$ActiveEnterTimestampMonotonic")
  local tf="(no line)"
  [ -n "$J_FDS_MONO" ] && tf="$(ms "$ExecMainStartTimestampMonotonic" "$J_FDS_MONO") ms"
  echo "#   spawn->\"fds handed back\" $tf," \
       "spawn->\"recovery finished\" $(ms "$ExecMainStartTimestampMonotonic" "$J_RECOV_MONO") ms," \
       "spawn->READY $R_SPAWN_READY ms, down->READY $(ms "$ActiveExitTimestampMonotonic" "$ActiveEnterTimestampMonotonic") ms"
  echo "#   journal: TAP fds handed back by the fd store fds=${J_FDS:-none}; recovery finished adopted=$J_ADOPTED" \
       "pool_adopted=$J_POOL_ADOPTED repaired=$J_REPAIRED quarantined=$J_QUARANTINED fd_lost=$J_FD_LOST elapsed_ms=$J_ELAPSED"
  # The fds must have come back from the store: every network's TAP plus
  # the idle pool's, i.e. what the store held before but the agent's own 4
  # sockets for sandboxes (systemd::SOCKET_FD_NAMES: the resolver's UDP and
  # TCP, the proxy's two listeners), and nothing reopened.
  [ -n "$J_FDS" ] || die "$label: the new agent got no TAP fds from the fd store (no 'TAP fds handed back' line)"
  [ "$J_FDS" -ge "$N" ] || die "$label: only $J_FDS TAP fds handed back, want >= N=$N"
  # The resolver's UDP and TCP sockets and the proxy's two listeners, on
  # the gateway device's IPv4 address and (host <-> sandbox over IPv6) its
  # IPv6 one.
  case $J_SOCKS in 4|8) ;; *) die "$label: $J_SOCKS of the resolver's and proxy's sockets handed back, want 4 (IPv4) or 8 (both families)" ;; esac
  [ "$((J_FDS + J_SOCKS))" = "$nfd0" ] || die "$label: $J_FDS TAP fds and $J_SOCKS sockets handed back, but the store held $nfd0 before"
  [ "$J_ADOPTED" = "$N" ] || die "$label: recovery adopted $J_ADOPTED networks, want $N"
  [ "${J_FD_LOST:-0}" = 0 ] || die "$label: recovery reports fd_lost=$J_FD_LOST"
  [ "$NFileDescriptorStore" -ge "$N" ] || die "$label: NFileDescriptorStore is $NFileDescriptorStore after the restart"
  echo "#   ok: all $J_FDS TAP fds came back from the fd store (N=$N + $((J_FDS - N)) idle pool TAPs), $J_ADOPTED networks adopted, none lost"
  R_FDS=$J_FDS R_ELAPSED=$J_ELAPSED R_NFD=$NFileDescriptorStore
}

measure "SIGKILL (Restart=on-failure)" "systemctl kill -s KILL $UNIT"
K_SPAWN_READY=$R_SPAWN_READY K_FDS=$R_FDS K_ELAPSED=$R_ELAPSED K_NFD=$R_NFD
measure "systemctl restart" "systemctl restart $UNIT"
S_SPAWN_READY=$R_SPAWN_READY S_FDS=$R_FDS S_ELAPSED=$R_ELAPSED S_NFD=$R_NFD

# ---- afterwards: Health, ActiveNetworks ------------------------------------------
HEALTH_PY='
import json, sys
raw = sys.stdin.read()
try:
    ok, checks = json.loads(raw)["data"]
except Exception:
    print("no Health reply: " + raw.strip()[:300]); sys.exit(1)
print("true" if ok is True else "false")
for n, good, d in checks:
    if not good: print("#   %s: %s" % (n, d[:300]))
'
health=""
for i in $(seq 25); do   # the TAP counts come from a 2 s reaper pass after the start
  health=$($X busctl --timeout=60 --json=short call $A Health 2>&1 | python3 -c "$HEALTH_PY") || true
  [ "${health%%$'\n'*}" = true ] && break
  sleep 0.4
done
HEALTH=${health%%$'\n'*}
an=$(active_networks)
echo "# after both restarts: Health=$HEALTH ActiveNetworks=$an NFileDescriptorStore=$(prop NFileDescriptorStore)"

printf '\n%-50s %s\n' "networks (N)" "$N"
printf '%-50s %s\n' "fill rate (EnsureNetwork/s, varlink)" "$FILL_RATE ($N in ${FILL_ENSURE_S} s of ensures)"
printf '%-50s %s\n' "  with waits for systemd's fd store" "$FILL_WALL (+${FILL_WAIT_S} s waiting, batches of $BATCH)"
printf '%-50s %s\n' "first start, empty store: spawn->READY ms" "$FIRST_SPAWN_READY"
printf '%-50s %s\n' "restart after SIGKILL: spawn->READY ms" "$K_SPAWN_READY"
printf '%-50s %s\n' "restart after systemctl restart: spawn->READY ms" "$S_SPAWN_READY"
printf '%-50s %s\n' "TAP fds handed back (SIGKILL / restart)" "$K_FDS / $S_FDS"
printf '%-50s %s\n' "NFileDescriptorStore (fill / SIGKILL / restart)" "$nfd / $K_NFD / $S_NFD"
printf '%-50s %s\n' "recovery elapsed_ms (SIGKILL / restart)" "$K_ELAPSED / $S_ELAPSED"
printf '%-50s %s\n' "Health" "$HEALTH"
printf '%-50s %s\n' "ActiveNetworks" "$an"

[ "$HEALTH" = true ] || { printf '%s\n' "$health" | tail -n +2 >&2; die "Health is not true after the restarts"; }
[ "$an" = "$N" ] || die "ActiveNetworks is $an after the restarts, want $N"
echo "ok: $N networks, both restarts took every TAP fd back from the fd store"
