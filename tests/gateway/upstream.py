#!/usr/bin/env python3
"""An upstream for tests/gateway.rs, run in the world's namespace.

usage: upstream.py ADDR PORT LOG [CERT KEY]

Answers every request 200 with its method, path, the names (never the
values) of the headers it got and the value of x-probe; appends each
request as one JSON line (method, path, headers with values, body length)
(and the peer's address) to LOG, which the test reads to see what reached the upstream. With CERT
and KEY it speaks TLS. Prints "ready" once it listens.
"""

import http.server
import json
import socket
import ssl
import sys

addr, port, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cert = sys.argv[4] if len(sys.argv) > 5 else None
key = sys.argv[5] if len(sys.argv) > 5 else None


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def answer(self):
        length = int(self.headers.get("content-length") or 0)
        body = b""
        while len(body) < length:
            chunk = self.rfile.read(min(65536, length - len(body)))
            if not chunk:
                break
            body += chunk
        with open(log, "a") as f:
            f.write(
                json.dumps(
                    {
                        "method": self.command,
                        "path": self.path,
                        "headers": {k.lower(): v for k, v in self.headers.items()},
                        "body": len(body),
                        "peer": "{}:{}".format(*self.client_address[:2]),
                    }
                )
                + "\n"
            )
        if "/redirect?to=" in self.path:
            self.send_response(302)
            self.send_header("location", self.path.split("/redirect?to=", 1)[1])
            self.send_header("content-length", "0")
            self.end_headers()
            return
        names = sorted({k.lower() for k in self.headers.keys()})
        out = "upstream {} {} headers={} probe={}\n".format(
            self.command, self.path, ",".join(names), self.headers.get("x-probe", "")
        ).encode()
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = answer

    def log_message(self, *args):
        pass


class Server(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET


server = Server((addr, port), Handler)
if cert:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
print("ready", flush=True)
server.serve_forever()
