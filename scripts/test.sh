#!/usr/bin/env bash
# Runs the whole test suite: unit tests, and (as root) the end-to-end tests
# that run the real agent in throw-away network namespaces over private
# dbus-daemons, including the kill -9 crash-injection loop.
# CRASH_ITERATIONS=N and CRASH_SEED=S tune the crash test.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
    echo "note: not root: kernel and bus tests will report themselves skipped" >&2
else
    scripts/deps.sh
fi
cargo test --all-targets "$@"
