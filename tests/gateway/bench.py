#!/usr/bin/env python3
"""The client of tests/gateway_bench.rs, run in a container's namespace.

usage: bench.py HOST CAFILE MODE N RULE

Times N HTTPS requests (GET /small) to HOST:443, verifying the server's
certificate against CAFILE: MODE "keepalive" sends them on one kept-alive
connection (opened, and warmed by a few requests, before the timing),
"new" opens a new TLS connection for each (connect + handshake + request
+ response, then close). HOST is resolved once, before the timing, so no
DNS lookup is timed. Every answer must be 200 with the body the bench
server sends ("small rule=1" when the egress rule's header reached it,
"small rule=0" otherwise); RULE (0/1) is the one expected, so a request
that took another path than the one benchmarked fails. Prints the
latencies in microseconds, one JSON list on one line; exits non-zero on
any failure.
"""

import http.client
import json
import socket
import ssl
import sys
import time

host, cafile, mode, n, rule = (
    sys.argv[1],
    sys.argv[2],
    sys.argv[3],
    int(sys.argv[4]),
    sys.argv[5],
)
expected = ("small rule=%s\n" % rule).encode()
addr = socket.getaddrinfo(host, 443, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
ctx = ssl.create_default_context(cafile=cafile)


def connection():
    c = http.client.HTTPSConnection(host, 443, context=ctx, timeout=10)
    # Dial the address resolved above, with HOST as SNI and Host.
    c._create_connection = lambda a, timeout, source: socket.create_connection(
        (addr, a[1]), timeout, source
    )
    return c


def get(c):
    c.request("GET", "/small")
    r = c.getresponse()
    body = r.read()
    if r.status != 200 or body != expected:
        sys.exit("GET https://%s/small: %d %r (expected %r)" % (host, r.status, body, expected))


out = []
if mode == "keepalive":
    c = connection()
    for _ in range(5):
        get(c)
    for _ in range(n):
        t = time.perf_counter()
        get(c)
        out.append((time.perf_counter() - t) * 1e6)
    c.close()
elif mode == "new":
    # One untimed connection first (caches, leaf for the SNI).
    c = connection()
    get(c)
    c.close()
    for _ in range(n):
        t = time.perf_counter()
        c = connection()
        get(c)
        c.close()
        out.append((time.perf_counter() - t) * 1e6)
else:
    sys.exit("mode: keepalive or new")
print(json.dumps([round(x, 1) for x in out]), flush=True)
