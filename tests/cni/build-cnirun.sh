#!/usr/bin/env bash
# Builds tests/cni/cnirun (a small libcni + go-cni client) offline:
#
#   tests/cni/build-cnirun.sh OUT
#
# GOPATH mode (GO111MODULE=off, GOPROXY=off) against Debian's Go sources in
# /usr/share/gocode: golang-go, golang-github-appc-cni-dev (libcni 1.1.2),
# golang-github-containerd-go-cni-dev (go-cni 1.1.7); scripts/deps.sh
# installs them. No network. The Go build cache lives in $GOCACHE if set,
# else in target/cnirun-gocache next to cargo's output (cargo clean drops
# it). Up to date (OUT.stamp matches the source, the Go version and the two
# -dev package versions): returns at once. Static binary (CGO_ENABLED=0).
# Exit status: 0 built or up to date; 1 build failed; 2 usage or a missing
# prerequisite (each with a message on stderr).
set -euo pipefail

if [ $# -ne 1 ] || [ -z "$1" ]; then
    echo "usage: $0 OUT" >&2
    exit 2
fi
out=$1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
src=$here/cnirun/main.go

command -v go >/dev/null || { echo "build-cnirun: go not found (apt-get install golang-go; see scripts/deps.sh)" >&2; exit 2; }
for d in github.com/containernetworking/cni/libcni github.com/containerd/go-cni; do
    [ -d "/usr/share/gocode/src/$d" ] || {
        echo "build-cnirun: /usr/share/gocode/src/$d missing (golang-github-appc-cni-dev, golang-github-containerd-go-cni-dev; see scripts/deps.sh)" >&2
        exit 2
    }
done

stamp=$( {
    sha256sum "$src"
    go version
    dpkg-query -W -f='${Package} ${Version}\n' golang-github-appc-cni-dev golang-github-containerd-go-cni-dev 2>/dev/null || true
} | sha256sum | cut -d' ' -f1)
if [ -x "$out" ] && [ -f "$out.stamp" ] && [ "$(cat "$out.stamp")" = "$stamp" ]; then
    exit 0
fi

mkdir -p "$(dirname "$out")"
gp=$(mktemp -d)
trap 'rm -rf "$gp"' EXIT
mkdir -p "$gp/src/cnirun"
cp "$src" "$gp/src/cnirun/main.go"
cache=${GOCACHE:-$root/target/cnirun-gocache}
mkdir -p "$cache"
if ! (cd "$gp/src/cnirun" &&
    env GO111MODULE=off GOPROXY=off GOFLAGS= GOENV=off CGO_ENABLED=0 GOPATH="$gp:/usr/share/gocode" GOCACHE="$cache" \
        go build -trimpath -o "$gp/cnirun" .); then
    echo "build-cnirun: go build failed (GOPATH mode over /usr/share/gocode; see the compiler output above)" >&2
    exit 1
fi
mv -f "$gp/cnirun" "$out"
echo "$stamp" >"$out.stamp"
