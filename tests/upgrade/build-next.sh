#!/usr/bin/env bash
# Builds "the next release" for tests/upgrade.rs: a copy of this tree whose
# eBPF programs differ (DP_BUILD_SALT 1 in ebpf/datapath.bpf.c: every
# program gets another tag, nothing behaves differently), compiled like a
# release would be. Prints the agent binary's path on its last line.
#
#   tests/upgrade/build-next.sh [debug|release]    (default: debug)
#
# The copy lives in target/next-src and builds into target/next, seeded
# with hard links to this tree's compiled dependencies (target/<profile>),
# so only the agent's own crate compiles (~1-2 min instead of a full build).
# Needs clang-19 (the copy's build.rs compiles the changed program).
set -euo pipefail
cd "$(dirname "$0")/../.."
profile=${1:-debug}
case $profile in debug) flag=() ;; release) flag=(--release) ;; *)
    echo "build-next.sh: profile must be debug or release" >&2
    exit 2
    ;;
esac
command -v clang-19 >/dev/null || {
    echo "build-next.sh: clang-19 is needed to compile the changed program (scripts/deps.sh --build)" >&2
    exit 1
}
root=$PWD
src=target/next-src
rm -rf "$src"
mkdir -p "$src"
# The tracked files as they are in the work tree (edits included).
git ls-files -z | xargs -0 cp --parents -t "$src"
sed -i 's/^#define DP_BUILD_SALT 0$/#define DP_BUILD_SALT 1/' "$src/ebpf/datapath.bpf.c"
grep -q '^#define DP_BUILD_SALT 1$' "$src/ebpf/datapath.bpf.c" || {
    echo "build-next.sh: DP_BUILD_SALT not found in ebpf/datapath.bpf.c" >&2
    exit 1
}
out=$root/target/next
if [ -d "target/$profile/deps" ] && [ ! -d "$out/$profile/deps" ]; then
    mkdir -p "$out/$profile"
    # Dependencies only: cargo writes new files (another crate hash for the
    # copy's own crate), it never rewrites a dependency's artifacts.
    for d in deps build .fingerprint; do
        [ -d "target/$profile/$d" ] && cp -al "target/$profile/$d" "$out/$profile/"
    done
    # The original tree's own crate must not be taken for the copy's.
    find "$out/$profile" -maxdepth 2 -name '*cube*network*agent*' -exec rm -rf {} + 2>/dev/null || true
    find "$out/$profile" -maxdepth 2 -name '*cube_network_agent*' -exec rm -rf {} + 2>/dev/null || true
fi
(cd "$src" && CARGO_TARGET_DIR="$out" cargo build -q "${flag[@]}" --bin cube-network-agent)
echo "$out/$profile/cube-network-agent"
