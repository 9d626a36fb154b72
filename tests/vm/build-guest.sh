#!/usr/bin/env bash
# Builds the guest for tests/vm/run.sh and tests/vm/snapshot.sh: a stock
# Debian kernel and a busybox-static initramfs, cached under $CNA_VM_CACHE
# (default /var/cache/cube-network-agent-test-vm). Prints the cache
# directory on its last line of stdout.
#
# Debian packages (installed here if missing; needs root):
#   qemu-system-x86 busybox-static
# plus python3 and curl, which run.sh uses on the host side.
#
# Outputs in the cache directory:
#   vmlinux            uncompressed ELF kernel with the PVH entry note:
#                      `qemu -kernel vmlinux` boots it directly, skipping
#                      the real-mode setup and the xz decompression
#                      (about 2 s faster under TCG than the bzImage)
#   initramfs.cpio.gz  busybox + virtio-net modules + /init (below)
#   kernel-version     the kernel release the modules belong to
#
# The kernel (a ~70 MB .deb, `apt-get download`ed, never installed) is
# fetched once; the initramfs is rebuilt whenever this script is newer
# than it (about a second).
#
# The guest's /init: mounts proc/sys/dev, loads virtio-net, configures
# eth0 as 169.254.68.6/30 (MTU 1300, default route via 169.254.68.5),
# writes /www/index.html (a marker) and /www/big.bin (2 MiB of random
# bytes, CNA_BIG bytes if cna.big=N is on the command line), starts
# `httpd -p 80 -h /www` (with /cgi-bin/sum: md5sum + size of a POST body;
# /cgi-bin/snmp: /proc/net/snmp; /cgi-bin/fetch?TAG: the guest itself GETs
# http://WORLD/index.html?from=TAG and answers with that body, so the host
# can make a guest, e.g. one restored from a snapshot, dial the world;
# /cgi-bin/pull?F/PATH: the guest GETs PATH from WORLD (F=4) or WORLD6
# (F=6) and answers "rc=R size=N md5=M", so a transfer of the guest's
# can be kept in flight while the host kills the agent)
# and prints marker lines on the serial console:
#   GUEST-KERNEL-UP, GUEST-NET-UP, GUEST-BIG size=N md5=M,
#   GUEST-CHECK ipv6-slaac addr=<the SLAAC address or none> after=<s since link up>,
#   GUEST-CHECK <name> rc=<exit code> <facts...>  (one per guest-side check)
#   GUEST-DONE
# The guest-side checks need cna.world=HOST:PORT on the kernel command
# line (a web server with /index.html, /big.bin and POST /upload answering
# "<size> <md5>"): small GET, large GET (GSO towards the guest), large
# POST (TSO from the guest), ICMP echo, and the IPv6 link (echo to the
# gateway, whether a default route was advertised, a connection to an
# unrouted address failing at once); cna.world6=[ADDR]:PORT adds a GET
# over IPv6 (NAT66); cna.name6=NAME:PORT the same by name (an AAAA
# question to the gateway's resolver). Without cna.world the guest only serves
# (and /cgi-bin/fetch fails); cna.far=HOST:PORT (a server like WORLD's
# behind a narrower link) adds a large POST and GET there (path MTU
# discovery); cna.checks=0 skips these checks but keeps
# WORLD for /cgi-bin/fetch.
# cna.stale=HOST:PORT (opt-in, for tests/vm/snapshot.sh): after
# GUEST-NET-UP the guest also keeps one long-lived TCP connection to
# HOST:PORT open in the background, sending "tick N" every 0.3 s and
# reading nothing, and when it ends (reset, error) prints
#   GUEST-STALE-END rc=<nc's exit code> uptime=<seconds>
# A clone restored from a snapshot taken meanwhile resumes that
# connection (a pre-snapshot connection the node should end).
# After GUEST-DONE it keeps serving until QEMU is killed.
set -euo pipefail

CACHE=${CNA_VM_CACHE:-/var/cache/cube-network-agent-test-vm}
SELF=$(readlink -f "${BASH_SOURCE[0]}")
MODULES="virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci failover net_failover virtio_net"

need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
[ -x /bin/busybox ] && /bin/busybox --list >/dev/null 2>&1 || need+=(busybox-static)
if [ ${#need[@]} -gt 0 ]; then
    echo "build-guest: installing ${need[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends "${need[@]}" >&2 ||
        { apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends "${need[@]}" >&2; }
fi
# busybox must be static: it runs in a guest with no libc.
if ldd /bin/busybox >/dev/null 2>&1; then
    echo "build-guest: /bin/busybox is dynamically linked; install busybox-static" >&2
    exit 1
fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9

# --- kernel ---------------------------------------------------------------
if [ ! -s "$CACHE/vmlinux" ] || [ ! -d "$CACHE/kernel/lib/modules" ]; then
    echo "build-guest: fetching the Debian kernel" >&2
    PKG=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
    [ -n "$PKG" ] || { echo "build-guest: no linux-image-amd64 dependency found (apt-get update?)" >&2; exit 1; }
    D=$(mktemp -d "$CACHE/dl.XXXXXX")
    chmod 777 "$D"   # apt-get download runs as _apt
    (cd "$D" && apt-get download "$PKG" >&2) ||
        { apt-get update -qq >&2 && (cd "$D" && apt-get download "$PKG" >&2); }
    rm -rf "$CACHE/kernel"
    mkdir -p "$CACHE/kernel"
    # Only what we need: the bzImage and the virtio modules.
    dpkg-deb --fsys-tarfile "$D"/"$PKG"_*.deb |
        tar -x -C "$CACHE/kernel" --wildcards './boot/vmlinuz-*' './lib/modules/*/kernel/drivers/virtio/*' \
            './lib/modules/*/kernel/drivers/net/virtio_net.ko' './lib/modules/*/kernel/drivers/net/net_failover.ko' \
            './lib/modules/*/kernel/net/core/failover.ko' 2>/dev/null ||
        dpkg-deb -x "$D"/"$PKG"_*.deb "$CACHE/kernel"
    rm -rf "$D"
    python3 - "$CACHE/kernel"/boot/vmlinuz-* "$CACHE/vmlinux.tmp" <<'PY'
import lzma, sys
d = open(sys.argv[1], 'rb').read()
i = d.find(b'\xfd7zXZ\x00')
if i < 0:
    sys.exit("no xz payload in " + sys.argv[1])
open(sys.argv[2], 'wb').write(lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(d[i:]))
PY
    mv "$CACHE/vmlinux.tmp" "$CACHE/vmlinux"
    ls "$CACHE/kernel/lib/modules" >"$CACHE/kernel-version"
fi
KVER=$(cat "$CACHE/kernel-version")

# --- initramfs --------------------------------------------------------------
if [ ! -s "$CACHE/initramfs.cpio.gz" ] || [ "$SELF" -nt "$CACHE/initramfs.cpio.gz" ]; then
    R=$(mktemp -d)
    trap 'rm -rf "$R"' EXIT
    mkdir -p "$R"/{bin,sbin,proc,sys,dev,tmp,www/cgi-bin,lib/modules,etc}
    cp /bin/busybox "$R/bin/busybox"
    for m in $MODULES; do
        f=$(find "$CACHE/kernel/lib/modules/$KVER" -name "$m.ko" | head -1)
        # Built in on some kernels; /init ignores a missing module.
        [ -n "$f" ] && cp "$f" "$R/lib/modules/"
    done
    cat >"$R/www/cgi-bin/sum" <<'CGI'
#!/bin/sh
# POST body -> "<size> <md5>"
printf 'Content-Type: text/plain\r\n\r\n'
head -c "${CONTENT_LENGTH:-0}" >/tmp/upload
echo "$(wc -c </tmp/upload) $(md5sum </tmp/upload | cut -d' ' -f1)"
rm -f /tmp/upload
CGI
    cat >"$R/www/cgi-bin/snmp" <<'CGI'
#!/bin/sh
# the guest's protocol counters (checksum errors, retransmissions)
printf 'Content-Type: text/plain\r\n\r\n'
cat /proc/net/snmp
CGI
    cat >"$R/www/cgi-bin/fetch" <<'CGI'
#!/bin/sh
# GET /cgi-bin/fetch?TAG: the guest GETs http://WORLD/index.html?from=TAG
# (WORLD from cna.world=, written by /init) and answers with the body.
printf 'Content-Type: text/plain\r\n\r\n'
W=$(cat /etc/cna-world 2>/dev/null)
[ -n "$W" ] || { echo "fetch: no cna.world= on the kernel command line"; exit 0; }
timeout 15 wget -q -O /tmp/fetch.$$ "http://$W/index.html?from=$QUERY_STRING"; r=$?
if [ $r = 0 ]; then cat /tmp/fetch.$$; else echo "fetch: wget http://$W/ failed rc=$r"; fi
rm -f /tmp/fetch.$$
CGI
    cat >"$R/www/cgi-bin/pull" <<'CGI'
#!/bin/sh
# GET /cgi-bin/pull?F/PATH: the guest GETs http://WORLD/PATH (F=4) or
# http://WORLD6/PATH (F=6, from cna.world6=) and answers
# "rc=<wget's exit code> size=<bytes> md5=<of the body>".
printf 'Content-Type: text/plain\r\n\r\n'
f=${QUERY_STRING%%/*}
W=$(cat /etc/cna-world$([ "$f" = 6 ] && echo 6) 2>/dev/null)
[ -n "$W" ] || { echo "pull: no world for family '$f' on the kernel command line"; exit 0; }
timeout 60 wget -q -O /tmp/pull.$$ "http://$W/${QUERY_STRING#*/}"; r=$?
echo "rc=$r size=$(wc -c </tmp/pull.$$) md5=$(md5sum </tmp/pull.$$ | cut -d' ' -f1)"
rm -f /tmp/pull.$$
CGI
    chmod +x "$R/www/cgi-bin/sum" "$R/www/cgi-bin/snmp" "$R/www/cgi-bin/fetch" "$R/www/cgi-bin/pull"
    cat >"$R/init" <<INIT
#!/bin/busybox sh
MODULES="$MODULES"
INIT
    cat >>"$R/init" <<'INIT'
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $MODULES; do [ -e /lib/modules/$m.ko ] && insmod /lib/modules/$m.ko 2>/dev/null; done
echo "GUEST-KERNEL-UP uptime=$(cut -d' ' -f1 /proc/uptime)"
WORLD= BIG=2097152 STALE= CHECKS=1 FAR= WORLD6= NAME6=
for a in $(cat /proc/cmdline); do
    case $a in
    cna.world=*) WORLD=${a#cna.world=} ;;
    cna.big=*) BIG=${a#cna.big=} ;;
    cna.stale=*) STALE=${a#cna.stale=} ;;
    cna.checks=*) CHECKS=${a#cna.checks=} ;;
    cna.far=*) FAR=${a#cna.far=} ;;
    cna.world6=*) WORLD6=${a#cna.world6=} ;;
    cna.name6=*) NAME6=${a#cna.name6=} ;;
    esac
done
echo "$WORLD" >/etc/cna-world
echo "$WORLD6" >/etc/cna-world6
i=0
while [ ! -e /sys/class/net/eth0 ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
ip link set lo up
ip link set eth0 mtu 1300
ip addr add 169.254.68.6/30 dev eth0
ip link set eth0 up
LINKUP=$(cut -d' ' -f1 /proc/uptime)
ip route add default via 169.254.68.5
# IPv6 by Router Advertisement alone (the kernel's defaults): when the
# SLAAC address of the gateway's prefix is usable (DAD done), how long
# after link up.
(
    i=0 a=
    while [ $i -lt 200 ]; do
        a=$(ip -6 addr show dev eth0 scope global | grep -v tentative | grep -o 'fd63:7562:6500:[0-9a-f:]*/64')
        [ -n "$a" ] && break
        sleep 0.05; i=$((i + 1))
    done
    echo "GUEST-CHECK ipv6-slaac addr=${a:-none} after=$(awk -v a="$LINKUP" -v b="$(cut -d' ' -f1 /proc/uptime)" 'BEGIN{printf "%.2f", b-a}')"
    touch /tmp/slaac-done
) &
echo "cna-vm-guest-marker" >/www/index.html
head -c "$BIG" /dev/urandom >/www/big.bin
httpd -p 80 -h /www
echo "GUEST-NET-UP uptime=$(cut -d' ' -f1 /proc/uptime)"
echo "GUEST-BIG size=$(wc -c </www/big.bin) md5=$(md5sum </www/big.bin | cut -d' ' -f1)"
if [ -n "$STALE" ]; then
    # A long-lived connection that only sends: nc exits when it is reset
    # (or fails), then the writer dies of SIGPIPE at its next line.
    (
        (n=0; while :; do n=$((n + 1)); echo "tick $n"; sleep 0.3; done) | nc "${STALE%:*}" "${STALE##*:}" >/dev/null
        echo "GUEST-STALE-END rc=$? uptime=$(cut -d' ' -f1 /proc/uptime)"
    ) &
fi
if [ -n "$WORLD" ] && [ "$CHECKS" != 0 ]; then
    H=${WORLD%:*}
    # small GET (also the first packets: ARP for the gateway, SNAT setup)
    r=1; for t in 1 2 3; do
        timeout 10 wget -q -O /tmp/small "http://$WORLD/index.html" && { r=0; break; }; sleep 0.5
    done
    echo "GUEST-CHECK egress-get-small rc=$r body=$(head -n 1 /tmp/small 2>/dev/null | head -c 64 | tr -dc 'a-zA-Z0-9.:-')"
    # large GET: the world sends bulk data, TCP segments towards the guest
    timeout 30 wget -q -O /tmp/big "http://$WORLD/big.bin"; r=$?
    echo "GUEST-CHECK egress-get-large rc=$r size=$(wc -c </tmp/big) md5=$(md5sum </tmp/big | cut -d' ' -f1)"
    rm -f /tmp/big
    # large POST: the guest sends bulk data (TSO / partial checksums on the
    # TAP). busybox wget sends --post-file as a C string (stops at the first
    # NUL byte), so post the base64 text of the random file.
    base64 /www/big.bin >/tmp/up.b64
    timeout 30 wget -q -O /tmp/up --post-file /tmp/up.b64 "http://$WORLD/upload"; r=$?
    echo "GUEST-CHECK egress-post-large rc=$r sent=$(wc -c </tmp/up.b64)/$(md5sum </tmp/up.b64 | cut -d' ' -f1) got=$(tr ' ' / </tmp/up 2>/dev/null)"
    if [ -n "$FAR" ]; then
        # The same behind a narrower link (path MTU discovery).
        rm -f /tmp/up
        timeout 30 wget -q -O /tmp/up --post-file /tmp/up.b64 "http://$FAR/upload"; r=$?
        echo "GUEST-CHECK far-post-large rc=$r sent=$(wc -c </tmp/up.b64)/$(md5sum </tmp/up.b64 | cut -d' ' -f1) got=$(tr ' ' / </tmp/up 2>/dev/null)"
        timeout 30 wget -q -O /tmp/big "http://$FAR/big.bin"; r=$?
        echo "GUEST-CHECK far-get-large rc=$r size=$(wc -c </tmp/big) md5=$(md5sum </tmp/big | cut -d' ' -f1)"
        rm -f /tmp/big
    fi
    rm -f /tmp/up.b64
    ping -c 1 -W 3 "$H" >/tmp/ping 2>&1; r=$?
    echo "GUEST-CHECK egress-ping rc=$r"
    # IPv6 link: the gateway answers (NS, echo); whether a default route
    # is advertised (NAT66 on the node) and, with cna.world6, a GET over it.
    i=0; while [ ! -e /tmp/slaac-done ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i + 1)); done
    ping -6 -c 1 -W 3 fd63:7562:6500::5 >/tmp/ping 2>&1; r=$?
    echo "GUEST-CHECK ipv6-ping-gateway rc=$r"
    had=$(ip -6 route show default | grep -q . && echo present || echo none)
    echo "GUEST-CHECK ipv6-default-route $had"
    if [ -n "$WORLD6" ]; then
        r=1; for t in 1 2 3; do
            timeout 10 wget -q -O /tmp/small6 "http://$WORLD6/index.html" && { r=0; break; }; sleep 0.5
        done
        echo "GUEST-CHECK ipv6-egress-get rc=$r body=$(head -n 1 /tmp/small6 2>/dev/null | head -c 64 | tr -dc 'a-zA-Z0-9.:-')"
    fi
    if [ -n "$NAME6" ]; then
        # By name: the AAAA answer from the gateway's resolver, then a GET.
        n=${NAME6%:*}; p=${NAME6##*:}
        a=$(nslookup -type=aaaa "$n" 169.254.68.5 2>/dev/null | awk '/^Address:/ {print $2}' |
            grep -v '^169\.254\.68\.5' | grep : | tail -n 1)
        r=1; [ -n "$a" ] && for t in 1 2 3; do
            timeout 10 wget -q -O /tmp/name6 "http://[$a]:$p/index.html" && { r=0; break; }; sleep 0.5
        done
        echo "GUEST-CHECK ipv6-by-name rc=$r addr=${a:-none} body=$(head -n 1 /tmp/name6 2>/dev/null | head -c 64 | tr -dc 'a-zA-Z0-9.:-')"
    fi
    # Off the link to an address nobody routes: without NAT66 (a static
    # default route) refused by the gateway, with it the world's ICMPv6
    # error, translated; either way at once.
    [ "$had" = none ] && ip -6 route add default via fe80::2290:6fff:fecf:cfcf dev eth0
    t0=$(cut -d' ' -f1 /proc/uptime)
    nc -w 5 2001:db8::1 80 </dev/null >/tmp/nc 2>&1; r=$?
    t1=$(cut -d' ' -f1 /proc/uptime)
    [ "$had" = none ] && ip -6 route del default via fe80::2290:6fff:fecf:cfcf dev eth0
    echo "GUEST-CHECK ipv6-off-link rc=$r took=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.2f", b-a}') $(grep -o 'Connection refused\|timed out\|unreachable' /tmp/nc | head -n 1 | tr ' ' _)"
fi
echo "GUEST-DONE uptime=$(cut -d' ' -f1 /proc/uptime)"
while :; do sleep 3600; done
INIT
    chmod +x "$R/init"
    (cd "$R" && find . | /bin/busybox cpio -o -H newc 2>/dev/null | gzip -1) >"$CACHE/initramfs.cpio.gz.tmp"
    mv "$CACHE/initramfs.cpio.gz.tmp" "$CACHE/initramfs.cpio.gz"
fi
echo "$CACHE"
