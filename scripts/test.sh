#!/usr/bin/env bash
# Runs the whole test suite: unit tests, and (as root) the end-to-end tests
# that run the real agent in throw-away network namespaces over private
# dbus-daemons, including the kill -9 crash-injection loop; then the polkit
# suite (real system bus + polkitd) and the systemd suite (systemd as PID 1
# in nspawn: activation, notify, watchdog, fd store, journald) and a real
# Linux guest under QEMU/TCG on an agent TAP (tests/vm).
# CRASH_ITERATIONS=N and CRASH_SEED=S tune the crash test.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
    echo "note: not root: kernel and bus tests will report themselves skipped" >&2
else
    scripts/deps.sh
fi
cargo test --all-targets --no-fail-fast "$@"
if [ "$(id -u)" = 0 ]; then
    # Real system bus + real polkitd (private namespaces), then real systemd
    # as PID 1 in a throw-away nspawn container. Both need the release build.
    cargo build --release --bins
    tests/polkit/run.sh
    tests/vm/run.sh
    CNA_BUILD=0 tests/systemd/run.sh
fi
