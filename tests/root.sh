# Sourced by the shell suites (tests/vm/run.sh, tests/systemd/run.sh,
# scripts/test.sh): the same rule as `require_root!` in tests/common/mod.rs.
#
#   require_root NAME WHY
#
# Root: returns. Not root and not in CI (a developer run): prints
# "SKIPPED NAME: needs root (WHY)" and exits 0. Not root under CI (the
# environment variable CI set to anything but "", "0" or "false"; .ci/run
# runs with CI=true): prints "FAILED NAME: needs root (WHY); CI must run as
# root" and exits 2 (a setup failure), so CI never counts a skip as a pass.
in_ci() {
    case "${CI:-}" in
    "" | 0 | false) return 1 ;;
    *) return 0 ;;
    esac
}
require_root() {
    [ "$(id -u)" = 0 ] && return 0
    if in_ci; then
        echo "FAILED $1: needs root ($2); CI must run as root" >&2
        exit 2
    fi
    echo "SKIPPED $1: needs root ($2)"
    exit 0
}
