#!/usr/bin/python3
"""The "world" side of the flow checks of tests/systemd/run.sh; runs in the
world network namespace (ip netns exec cna-world-NAME world.py ...).

* echo server on --echo IP:PORT: every datagram (the guest's numbered
  "out N" flow, arriving through the agent's SNAT) goes back to its source;
* sender to --target IP:PORT (the node's uplink address and the host port
  of the sandbox's UDP port mapping): a numbered datagram "in N" every
  --interval-ms from one fixed source port, whose echoes (the guest echoes
  its container port) are matched by sequence number.

Every 100 ms --status FILE is rewritten (atomically) with one line:
  pid=P echo_rx=E echo_tx=T echo_peers=ADDR,... sent=N echoed=M lost=L pending=K lost_seqs=...
`lost` counts datagrams sent more than --lost-after-ms ago whose echo has
not arrived (a late echo takes it back); `pending` the more recent ones.
"""
import argparse
import os
import select
import socket
import time


def hostport(s):
    h, p = s.rsplit(":", 1)
    return h, int(p)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--status", required=True)
    ap.add_argument("--echo", required=True, type=hostport)
    ap.add_argument("--target", type=hostport)
    ap.add_argument("--interval-ms", type=float, default=10)
    ap.add_argument("--lost-after-ms", type=float, default=1000)
    a = ap.parse_args()

    echo = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    echo.bind(a.echo)
    echo.setblocking(False)
    send = None
    if a.target:
        send = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        send.bind((a.echo[0], 0))
        send.setblocking(False)

    interval = a.interval_ms / 1000.0
    lost_after = a.lost_after_ms / 1000.0
    sent = []          # [send time, echoed?] per sequence number
    echoed = 0
    decided = 0
    lost = []
    dup = 0
    echo_rx = echo_tx = 0
    peers = set()
    tmp = a.status + ".tmp"
    now = time.monotonic()
    next_send = now
    next_status = now
    socks = [echo] + ([send] if send else [])
    while True:
        now = time.monotonic()
        if send and now >= next_send:
            seq = len(sent)
            try:
                send.sendto(b"in %d" % seq, a.target)
            except OSError:
                pass  # e.g. ECONNREFUSED from an ICMP error: the datagram still counts as sent
            sent.append([now, False])
            next_send += interval
            if next_send < now:
                next_send = now + interval
        if now >= next_status:
            while decided < len(sent) and now - sent[decided][0] >= lost_after:
                if not sent[decided][1]:
                    lost.append(decided)
                decided += 1
            pending = sum(1 for s in sent[decided:] if not s[1])
            line = ("pid=%d echo_rx=%d echo_tx=%d echo_peers=%s sent=%d echoed=%d lost=%d pending=%d dup=%d lost_seqs=%s\n"
                    % (os.getpid(), echo_rx, echo_tx, ",".join(sorted(peers)) or "-", len(sent), echoed,
                       len(lost), pending, dup, ",".join(map(str, lost[:20])) or "-"))
            with open(tmp, "w") as f:
                f.write(line)
            os.rename(tmp, a.status)
            next_status = now + 0.1
        deadline = min(next_send if send else next_status, next_status)
        r, _, _ = select.select(socks, [], [], max(0.0, deadline - time.monotonic()))
        for s in r:
            while True:
                try:
                    data, src = s.recvfrom(65536)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    break
                if s is echo:
                    echo_rx += 1
                    peers.add("%s:%d" % src)
                    try:
                        echo.sendto(data, src)
                        echo_tx += 1
                    except OSError:
                        pass
                else:
                    try:
                        n = int(data.split(b" ", 1)[1]) if data.startswith(b"in ") else -1
                    except ValueError:
                        n = -1
                    if 0 <= n < len(sent):
                        if sent[n][1]:
                            dup += 1
                        else:
                            sent[n][1] = True
                            echoed += 1
                            if n < decided and n in lost:
                                lost.remove(n)


if __name__ == "__main__":
    main()
