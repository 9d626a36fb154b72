#!/usr/bin/env bash
# Runs the whole test suite: unit tests, and (as root) the end-to-end tests
# that run the real agent in throw-away network namespaces over private
# dbus-daemons, including the kill -9 crash-injection loop; then `make
# install` into a throw-away root (tests/install), a newcomer's quick start
# with README's commands and --remove (tests/newcomer), the polkit
# suite (real system bus + polkitd) and the systemd suite (systemd as PID 1
# in nspawn: activation, notify, watchdog, fd store, journald, polkit, fd
# passing and signals through the bus) twice, with dbus-daemon and then with
# dbus-broker as the system bus, and a real Linux guest under QEMU/TCG on an
# agent TAP (tests/vm: run.sh, and snapshot.sh: a snapshot restored as
# three clones at once).
# CRASH_ITERATIONS=N and CRASH_SEED=S tune the crash test.
# Not root: a developer run skips the kernel and bus tests (they say so);
# under CI (CI set, see tests/root.sh) it fails at once, and so would every
# such test on its own (require_root! in tests/common/mod.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
. tests/root.sh
if [ "$(id -u)" != 0 ]; then
    if in_ci; then
        echo "FAILED scripts/test.sh: needs root; CI must run as root" >&2
        exit 2
    fi
    echo "note: not root: kernel and bus tests will report themselves skipped" >&2
else
    scripts/deps.sh
fi
cargo test --all-targets --no-fail-fast "$@"
if [ "$(id -u)" = 0 ]; then
    # Real system bus + real polkitd (private namespaces), then real systemd
    # as PID 1 in a throw-away nspawn container. Both need the release build.
    cargo build --release --bins
    tests/install/run.sh
    tests/newcomer/run.sh
    tests/polkit/run.sh
    tests/vm/run.sh
    CNA_BUILD=0 tests/vm/snapshot.sh
    # Both buses, each with its own "N passed, M failed"; either failing fails.
    sd=0
    CNA_BUILD=0 BUS=dbus-daemon tests/systemd/run.sh || sd=1
    CNA_BUILD=0 BUS=dbus-broker tests/systemd/run.sh || sd=1
    [ $sd = 0 ]
fi
