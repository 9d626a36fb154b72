#!/usr/bin/env bash
# The egress gateway's benchmark (tests/gateway_bench.rs, docs/benchmarks.md
# "Egress gateway") with the exit codes of the other benchmarks: 0 = ran,
# every target met; 3 = ran, a target missed (a note); anything else =
# broken. Usage: scripts/gateway-bench.sh [--quick]. Root.
set -u
cd "$(dirname "$0")/.."
quick=0
[ "${1:-}" = --quick ] && quick=1
verdict=$(mktemp)
trap 'rm -f "$verdict"' EXIT
env GATEWAY_BENCH_QUICK=$quick GATEWAY_BENCH_VERDICT="$verdict" \
    cargo test --release --test gateway_bench gateway_bench -- --ignored --nocapture || exit 1
case $(cat "$verdict") in
met) exit 0 ;;
missed) exit 3 ;;
*) echo "gateway-bench: the benchmark wrote no verdict" >&2; exit 1 ;;
esac
