#!/bin/bash
# A real SYSTEM dbus-daemon and a real polkitd without touching the host,
# adapted from /work/shared/recipes/systemd-dbus-polkit/q3/sysbus_ns.sh.
#
# Usage (as root): tests/polkit/harness.sh CMD [ARGS...]
#
# Runs CMD as root inside a private mount + pid namespace in which
#   /run                              is a fresh tmpfs (system bus socket),
#   /etc, /usr/share/polkit-1/actions are overlays on tmpfs (users, groups,
#                                     bus policy, polkit rule and action),
#   /usr/share/dbus-1/system-services is an empty tmpfs (nothing is bus-
#                                     activated: a killed polkitd stays dead),
# with `dbus-daemon --system` and `/usr/lib/polkit-1/polkitd` running and
# the agent's .policy, example rule (as 50-cube-network-agent.rules) and bus
# policy installed. Test users: cubeuser (group cube-network), cubereader
# (group cube-network-readers), outsider (no group), challenger (a
# test-only rule answers AUTH_ADMIN for it, to provoke a polkit challenge).
#
# Exported to CMD: HARNESS_DIR (tmpfs scratch dir), POLKITD_PID.
# When CMD exits, the namespace's init (this script) exits, the kernel kills
# dbus-daemon, polkitd and whatever CMD left, and every mount vanishes.
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
if [ "${CUBE_PK_INNER:-}" != 1 ]; then
  [ "$(id -u)" = 0 ] || { echo "harness.sh: must run as root" >&2; exit 2; }
  [ $# -gt 0 ] || { echo "usage: $0 CMD [ARGS...]" >&2; exit 2; }
  if [ ! -x /usr/lib/polkit-1/polkitd ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y polkitd >/dev/null
  fi
  command -v dbus-daemon >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y dbus-daemon >/dev/null
  S=$(mktemp -d /tmp/cube-polkit-test.XXXXXX)
  set +e
  env -u DBUS_SYSTEM_BUS_ADDRESS CUBE_PK_INNER=1 CUBE_PK_DIR="$S" \
    unshare --mount --propagation private --pid --fork --mount-proc "$0" "$@"
  RC=$?
  rmdir "$S" 2>/dev/null
  exit $RC
fi

S=$CUBE_PK_DIR
mount -t tmpfs tmpfs "$S"
ovl() { # make directory $1 writable through an overlay whose upper layer lives in tmpfs
  local n; n=$(echo "$1" | tr / _)
  mkdir -p "$S/$n.up" "$S/$n.wk"
  mount -t overlay overlay -o "lowerdir=$1,upperdir=$S/$n.up,workdir=$S/$n.wk" "$1"
}
mount -t tmpfs -o mode=755 tmpfs /run
ovl /etc
mkdir -p /usr/share/polkit-1/actions && ovl /usr/share/polkit-1/actions
mount -t tmpfs -o mode=755 tmpfs /usr/share/dbus-1/system-services
mkdir -p /run/dbus /run/user /etc/polkit-1/rules.d /etc/dbus-1/system.d

# users and groups (only in the /etc overlay)
groupadd -f cube-network
groupadd -f cube-network-readers
useradd -M -G cube-network cubeuser
useradd -M -G cube-network-readers cubereader
useradd -M outsider
useradd -M challenger

# our files
install -m644 "$ROOT/polkit/org.cube.NetworkAgent.policy" /usr/share/polkit-1/actions/
install -m644 -o root "$ROOT/polkit/50-cube-network-agent.rules.example" \
  /etc/polkit-1/rules.d/50-cube-network-agent.rules
install -m644 "$ROOT/dbus/org.cube.NetworkAgent.conf" /etc/dbus-1/system.d/
# test-only: "challenger" must authenticate as admin (polkit answers challenge)
cat > /etc/polkit-1/rules.d/60-cube-test-challenge.rules <<'JS'
polkit.addRule(function(action, subject) {
    if (action.id.indexOf("org.cube.NetworkAgent.") == 0 && subject.user == "challenger")
        return polkit.Result.AUTH_ADMIN;
});
JS

dbus-daemon --system --nofork --nopidfile --syslog-only 2>/dev/null &
for _ in $(seq 250); do [ -S /run/dbus/system_bus_socket ] && break; sleep 0.02; done
[ -S /run/dbus/system_bus_socket ] || { echo "harness: system bus did not start" >&2; exit 1; }
/usr/lib/polkit-1/polkitd --no-debug >"$S/polkitd.log" 2>&1 &
POLKITD_PID=$!
for _ in $(seq 250); do
  busctl --system status org.freedesktop.PolicyKit1 >/dev/null 2>&1 && break; sleep 0.02
done
busctl --system status org.freedesktop.PolicyKit1 >/dev/null 2>&1 ||
  { echo "harness: polkitd did not start:" >&2; cat "$S/polkitd.log" >&2; exit 1; }

export HARNESS_DIR=$S POLKITD_PID
set +e
"$@"
exit $?
