#!/bin/bash
# polkit authorization of cube-network-agent against a real system bus and
# a real polkitd, in a private namespace (see harness.sh); as root:
#   cargo build --release --bin cube-network-agent && tests/polkit/run.sh
# Prints "ok - ..." / "not ok - ..." and finally "N passed, M failed";
# exits non-zero if anything failed. Nothing on the host changes: the agent
# runs in a fresh network namespace, its state lives on a tmpfs.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
AGENT=${AGENT:-$ROOT/target/release/cube-network-agent}
if [ "${1:-}" != --inner ]; then
  [ "$(id -u)" = 0 ] || { echo "run.sh: must run as root"; exit 2; }
  [ -x "$AGENT" ] || { echo "run.sh: $AGENT missing: cargo build --release --bin cube-network-agent"; exit 2; }
  exec "$HERE/harness.sh" "$HERE/run.sh" --inner
fi

# ---- inside the namespace: system bus + polkitd are up ----------------------
S=$HARNESS_DIR
install -m755 "$HERE/call.py" "$S/call.py"   # readable by the test users
CALL=$S/call.py; . "$HERE/callers.sh"         # as USER METHOD [ARG], listen, DENIED_*
A=(org.cube.NetworkAgent /org/cube/NetworkAgent org.cube.NetworkAgent)
PASS=0 FAIL=0
ok() { echo "ok - $*"; PASS=$((PASS + 1)); }
nok() { echo "not ok - $*"; FAIL=$((FAIL + 1)); }
# check DESC EXPECTED-REGEX OUTPUT
check() { if [[ "$3" =~ $2 ]]; then ok "$1"; else nok "$1 (got: $3)"; fi; }

# the agent, as root, in a fresh network namespace, on the system bus
ip netns add cubepk && ip -n cubepk link set lo up
start_agent() {
  ip netns exec cubepk "$AGENT" --bus system --config /dev/null \
    --state-dir "$S/state" --runtime-dir "$S/rt" --report-socket "$S/report.sock" --warm-pool 2 --log-level debug \
    >>"$S/agent.log" 2>&1 &
  AGENT_PID=$!
  for _ in $(seq 500); do
    busctl --system status org.cube.NetworkAgent >/dev/null 2>&1 && break
    kill -0 $AGENT_PID 2>/dev/null || break; sleep 0.02
  done
  if ! busctl --system status org.cube.NetworkAgent >/dev/null 2>&1; then
    echo "agent did not start:"; cat "$S/agent.log"; echo "0 passed, 1 failed"; exit 1
  fi
}
start_agent
alive() { kill -0 $AGENT_PID 2>/dev/null; }

echo "# 1. root"
check "root: EnsureNetwork" '^OK sbx-root ' "$(as root EnsureNetwork sbx-root)"
check "root: OpenTap returns a TAP fd" '^OK fd [0-9]+ /dev/net/tun' "$(as root OpenTap sbx-root)"

echo "# 2. cubeuser (group cube-network)"
check "cubeuser: EnsureNetwork" '^OK sbx-user ' "$(as cubeuser EnsureNetwork sbx-user)"
check "cubeuser: OpenTap returns a TAP fd" '^OK fd [0-9]+ /dev/net/tun' "$(as cubeuser OpenTap sbx-user)"
check "cubeuser: ReconcileNetwork" '^OK checked' "$(as cubeuser ReconcileNetwork sbx-user)"
check "cubeuser: ListNetworks" '^OK sbx-root,sbx-user$' "$(as cubeuser ListNetworks)"

echo "# 3. outsider (no group): mutations denied, nothing changes"
BEFORE=$(as root ListNetworks)
check "outsider: EnsureNetwork -> AccessDenied naming manage" "$DENIED_MANAGE" "$(as outsider EnsureNetwork sbx-out)"
check "outsider: ReleaseNetwork -> AccessDenied" "$DENIED_MANAGE" "$(as outsider ReleaseNetwork sbx-root)"
check "outsider: ReconcileNetwork -> AccessDenied" "$DENIED_MANAGE" "$(as outsider ReconcileNetwork '')"
check "outsider: OpenTap -> AccessDenied" "$DENIED_MANAGE" "$(as outsider OpenTap sbx-root)"
AFTER=$(as root ListNetworks)
check "networks unchanged after outsider's calls ($AFTER)" "^${BEFORE}\$" "$AFTER"
check "no sbx-out network exists" '^ERR org\.cube\.NetworkAgent\.Error\.NotFound' "$(as root GetNetwork sbx-out)"

echo "# 4. cubereader (group cube-network-readers): reads only"
check "cubereader: GetNetwork" '^OK [0-9.]+$' "$(as cubereader GetNetwork sbx-root)"
check "cubereader: ListNetworks" '^OK sbx-root,sbx-user$' "$(as cubereader ListNetworks)"
check "cubereader: Health" '^OK (True|False)$' "$(as cubereader Health)"
check "cubereader: EnsureNetwork -> AccessDenied" "$DENIED_MANAGE" "$(as cubereader EnsureNetwork sbx-reader)"
check "cubereader: ReleaseNetwork -> AccessDenied" "$DENIED_MANAGE" "$(as cubereader ReleaseNetwork sbx-root)"
check "cubereader: OpenTap -> AccessDenied" "$DENIED_MANAGE" "$(as cubereader OpenTap sbx-root)"
check "networks unchanged after cubereader's calls" "^${BEFORE}\$" "$(as root ListNetworks)"

echo "# 5. outsider: reads denied too, through every path (methods, objects, properties, signals)"
check "outsider: GetNetwork -> AccessDenied naming read" "$DENIED_READ" "$(as outsider GetNetwork sbx-root)"
check "outsider: ListNetworks -> AccessDenied" "$DENIED_READ" "$(as outsider ListNetworks)"
check "outsider: Health -> AccessDenied" "$DENIED_READ" "$(as outsider Health)"
check "outsider: manager property -> AccessDenied" "$DENIED_READ" "$(as outsider Property ActiveNetworks)"
check "outsider: manager GetAll -> AccessDenied" "$DENIED_READ" "$(as outsider ManagerGetAll)"
check "outsider: GetManagedObjects -> AccessDenied" "$DENIED_READ" "$(as outsider ManagedObjects)"
check "outsider: network object Get -> AccessDenied" "$DENIED_READ" "$(as outsider ObjectGet sbx-root SandboxIp)"
check "outsider: network object GetAll -> AccessDenied" "$DENIED_READ" "$(as outsider ObjectGetAll sbx-root)"
check "outsider: introspecting the network objects -> denied by the bus" \
  '^ERR org\.freedesktop\.DBus\.Error\.AccessDenied' "$(as outsider Introspect /org/cube/NetworkAgent/network)"
check "outsider: introspecting the manager -> denied (recursive: it lists every network)" \
  '^ERR org\.freedesktop\.DBus\.Error\.AccessDenied' "$(as outsider Introspect /org/cube/NetworkAgent)"
check "outsider: introspecting / -> denied" '^ERR org\.freedesktop\.DBus\.Error\.AccessDenied' "$(as outsider Introspect /)"
check "cubereader: manager property" '^OK 2$' "$(as cubereader Property ActiveNetworks)"
check "cubereader: GetManagedObjects" '^OK sbx-root,sbx-user$' "$(as cubereader ManagedObjects)"
check "cubereader: network object Get" '^OK [0-9.]+$' "$(as cubereader ObjectGet sbx-root SandboxIp)"
check "cubereader: network object GetAll" '^OK [0-9.]+$' "$(as cubereader ObjectGetAll sbx-root)"
check "root: network object Get" '^OK [0-9.]+$' "$(as root ObjectGet sbx-root SandboxIp)"
check "root: introspecting the network objects" '^OK sbx_2droot,sbx_2duser$' \
  "$(as root Introspect /org/cube/NetworkAgent/network)"
# Signals: listeners as outsider, cubereader and root while a network comes and goes.
listen outsider "$S/sig.outsider" 3; listen cubereader "$S/sig.reader" 3; listen root "$S/sig.root" 3
as root EnsureNetwork sbx-sig >/dev/null; as root ReleaseNetwork sbx-sig >/dev/null
wait_listeners "$S"/sig.*
check "root receives the agent's signals" '^OK n=[1-9][0-9]* .*NetworkEnsured.*NetworkReleased' "$(tail -1 "$S/sig.root")"
check "outsider receives none of them" '^OK n=0 -$' "$(tail -1 "$S/sig.outsider")"
check "cubereader receives none of them (bus policy: root only unless a group is added)" '^OK n=0 -$' \
  "$(tail -1 "$S/sig.reader")"

echo "# 5b. a restart announces nothing: the recovered networks' objects come back without a signal"
# Listeners with no sender filter: signals sent before the agent owns its
# name are outside the bus policy's receive_sender rule. zbus announces
# every object under a newly registered ObjectManager (InterfacesAdded with
# all its properties); the agent must not let it.
listen outsider "$S/all.outsider" 6 --all-signals; listen root "$S/all.root" 6 --all-signals
kill -9 $AGENT_PID; wait $AGENT_PID 2>/dev/null
start_agent
check "after the restart: the networks are back" '^OK sbx-root,sbx-user$' "$(as root ListNetworks)"
check "after the restart: GetManagedObjects lists them" '^OK sbx-root,sbx-user$' "$(as root ManagedObjects)"
as root EnsureNetwork sbx-late >/dev/null   # the root listener's witness
wait_listeners "$S"/all.*
check "root saw the new network announced, and no recovered one" '^OK n=[1-9][0-9]* .*InterfacesAdded.* added=sbx_2dlate$' \
  "$(tail -1 "$S/all.root")"
check "outsider received no signal of the restart (nor of the new network)" '^OK n=0 - added=-$' \
  "$(tail -1 "$S/all.outsider")"
check "root: ReleaseNetwork sbx-late" '^OK True$' "$(as root ReleaseNetwork sbx-late)"

echo "# extra: varlink (subject: the peer process, pid + start time + uid)"
VL="$S/rt/org.cube.NetworkAgent"
VDENIED='^ERR org\.cube\.NetworkAgent\.AccessDenied .*org\.cube\.NetworkAgent\.manage'
check "root, varlink: ListNetworks" '^OK sbx-root,sbx-user$' "$(as root --varlink "$VL" ListNetworks)"
check "cubeuser, varlink: EnsureNetwork" '^OK sbx-vl [0-9.]+$' "$(as cubeuser --varlink "$VL" EnsureNetwork sbx-vl)"
check "cubereader, varlink: GetNetwork" '^OK sbx-vl [0-9.]+$' "$(as cubereader --varlink "$VL" GetNetwork sbx-vl)"
check "cubereader, varlink: ReleaseNetwork -> AccessDenied" "$VDENIED" "$(as cubereader --varlink "$VL" ReleaseNetwork sbx-vl)"
check "outsider, varlink: EnsureNetwork -> AccessDenied" "$VDENIED" "$(as outsider --varlink "$VL" EnsureNetwork sbx-vl2)"
check "outsider, varlink: ListNetworks -> AccessDenied naming read" \
  '^ERR org\.cube\.NetworkAgent\.AccessDenied .*org\.cube\.NetworkAgent\.read' "$(as outsider --varlink "$VL" ListNetworks)"
check "cubeuser, varlink: ReleaseNetwork" '^OK .*"released": true' "$(as cubeuser --varlink "$VL" ReleaseNetwork sbx-vl)"
# The caller is the process that connected, identified once (pidfd + start
# time): after it exits, nothing on its connection is judged as another.
check "cubereader, varlink: a call after the connecting process exited -> AccessDenied" \
  '^ERR org\.cube\.NetworkAgent\.AccessDenied .*has exited' \
  "$(as cubereader --varlink-orphan "$VL" ListNetworks; sleep 0.5)"

echo "# 7. interactive authorization (polkitd running, no authentication agent)"
# outsider: polkit says plainly no (no challenge) -> AccessDenied even when interactive
# (busctl prints its own text for AccessDenied, "Access denied"; GDBus shows the name)
OUT=$(setpriv --reuid=outsider --regid=outsider --init-groups busctl --system \
  --allow-interactive-authorization=yes call "${A[@]}" EnsureNetwork 'sa{sv}' sbx-int 0 2>&1)
check "outsider, busctl --allow-interactive-authorization=yes: EnsureNetwork denied" \
  '^1 Call failed: Access denied' "$? $OUT"
check "outsider, interactive flag: AccessDenied (polkit: no, no challenge)" \
  "$DENIED_MANAGE" "$(as outsider --interactive EnsureNetwork sbx-int)"
# challenger: a rule answers AUTH_ADMIN -> polkit challenges a non-interactive call
check "challenger, non-interactive: InteractiveAuthorizationRequired" \
  '^ERR org\.freedesktop\.DBus\.Error\.InteractiveAuthorizationRequired .*org\.cube\.NetworkAgent\.manage' \
  "$(as challenger EnsureNetwork sbx-int)"
# challenger, interactive: nobody can authenticate (no authentication agent
# registered); polkit 122 still answers challenge -> denied either way
OUT=$(setpriv --reuid=challenger --regid=challenger --init-groups busctl --system \
  --allow-interactive-authorization=yes call "${A[@]}" EnsureNetwork 'sa{sv}' sbx-int 0 2>&1)
check "challenger, busctl --allow-interactive-authorization=yes: denied" \
  '^1 Call failed: (Access denied|.*interactive authorization is required for org\.cube\.NetworkAgent\.manage)' "$? $OUT"
check "challenger, interactive flag: AccessDenied or InteractiveAuthorizationRequired" \
  '^ERR org\.freedesktop\.DBus\.Error\.(AccessDenied|InteractiveAuthorizationRequired) .*org\.cube\.NetworkAgent\.manage' \
  "$(as challenger --interactive EnsureNetwork sbx-int)"
check "agent survived the interactive calls" '^OK True|^OK False' "$(alive && as root Health)"
check "no sbx-int network exists" '^ERR org\.cube\.NetworkAgent\.Error\.NotFound' "$(as root GetNetwork sbx-int)"

echo "# 6. polkitd stopped: fail closed for non-root, root unaffected"
kill "$POLKITD_PID"; wait "$POLKITD_PID" 2>/dev/null
for _ in $(seq 250); do busctl --system status org.freedesktop.PolicyKit1 >/dev/null 2>&1 || break; sleep 0.02; done
UNREACH='^ERR org\.freedesktop\.DBus\.Error\.AccessDenied .*polkit was unreachable'
check "cubeuser: EnsureNetwork denied, polkit unreachable" "$UNREACH" "$(as cubeuser EnsureNetwork sbx-nopk)"
check "cubereader: ListNetworks denied, polkit unreachable" "$UNREACH" "$(as cubereader ListNetworks)"
check "root: EnsureNetwork still works" '^OK sbx-root2 ' "$(as root EnsureNetwork sbx-root2)"
check "root: OpenTap still works" '^OK fd [0-9]+ /dev/net/tun' "$(as root OpenTap sbx-root2)"
check "root: ReleaseNetwork still works" '^OK True$' "$(as root ReleaseNetwork sbx-root2)"
check "no sbx-nopk network exists" '^ERR org\.cube\.NetworkAgent\.Error\.NotFound' "$(as root GetNetwork sbx-nopk)"
check "cubeuser, varlink: denied, polkit unreachable" \
  '^ERR org\.cube\.NetworkAgent\.AccessDenied .*polkit was unreachable' "$(as cubeuser --varlink "$VL" ListNetworks)"
check "root, varlink: still works" '^OK ' "$(as root --varlink "$VL" Health)"
# polkit back -> allowed again at once (no decision is cached)
/usr/lib/polkit-1/polkitd --no-debug >>"$S/polkitd.log" 2>&1 &
for _ in $(seq 250); do busctl --system status org.freedesktop.PolicyKit1 >/dev/null 2>&1 && break; sleep 0.02; done
check "polkitd restarted: cubeuser allowed again" '^OK True$' "$(as cubeuser ReleaseNetwork sbx-user)"
check "agent still running" '^yes$' "$(alive && echo yes)"

if [ "$FAIL" -gt 0 ] || [ -n "${VERBOSE:-}" ]; then
  echo "--- agent log (tail)"; tail -n 40 "$S/agent.log"
  echo "--- polkitd log"; cat "$S/polkitd.log"
fi
kill $AGENT_PID 2>/dev/null; wait $AGENT_PID 2>/dev/null
ip netns del cubepk 2>/dev/null
echo "$PASS passed, $FAIL failed"
[ "$FAIL" = 0 ]
