"""A WAN in the lab: latency, jitter and loss on a namespace's traffic, and named profiles of home links.

Linux's own emulator (``tc qdisc ... netem``) is the usual tool, but kernels built without it (``CONFIG_NET_SCH_NETEM``
unset, as on this project's machines) refuse it, so latency is added in user space instead: the packets arriving
at the namespace are queued to this module (``iptables -j NFQUEUE``, netfilter's queue to user space)
over a netlink socket, and each is let through (accepted) once its delay has passed, or dropped for loss. Only
packet ids cross (metadata copy mode): the bytes stay in the kernel. Bandwidth stays with the kernel's token bucket
(``tc tbf``, gpunet.testing.netns). Pure Python, no library: the nfnetlink queue messages are a handful of structs.

A profile's ``one_way_ms`` is the latency between two homes: each home delays what arrives at it by that much (see
:func:`rules` for why arriving packets only), so home to home is one_way_ms each way, and a round trip between a
home and the lab's public side (the bootstrap node, standing for a well-connected server) is one_way_ms, half that
of two homes.

Run as a process inside the namespace (the lab does it): ``python -m gpunet.testing.wan DELAY_MS JITTER_MS LOSS_PCT
QUEUE...``; it prints ``ready`` once bound, and lets everything through unqueued when it ends (the rules' ``bypass``).
"""

from __future__ import annotations

import heapq
import os
import random
import select
import socket
import struct
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    """A home link: latency between two homes (half each way at each home), its jitter and loss, and the uplink
    and downlink of every home."""

    name: str
    one_way_ms: float
    jitter_ms: float = 0.0
    loss_pct: float = 0.0
    up_mbit: float | None = None
    down_mbit: float | None = None

    def floor_token_s(self, transits: int) -> float:
        """The physical floor of one step that crosses ``transits`` home-to-home links one after another."""
        return transits * self.one_way_ms / 1e3


#: The lab's named profiles: a LAN, then homes in one city, on one continent, and around the world, each home on a
#: 20 Mbit/s uplink and a 100 Mbit/s downlink (a common cable or fibre plan).
PROFILES = {
    "lan": Profile("lan", 0.0),
    "city": Profile("city", 10.0, 1.0, 0.0, 20.0, 100.0),
    "continent": Profile("continent", 40.0, 2.0, 0.0, 20.0, 100.0),
    "world": Profile("world", 120.0, 5.0, 0.0, 20.0, 100.0),
}

# nfnetlink_queue (include/uapi/linux/netfilter/nfnetlink_queue.h)
NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_FAIL_OPEN, NFQA_CFG_F_GSO = 1, 4
NF_DROP, NF_ACCEPT = 0, 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
QUEUE_MAXLEN = 65536


def _attr(kind: int, payload: bytes) -> bytes:
    head = struct.pack("=HH", 4 + len(payload), kind)
    return head + payload + b"\0" * (-len(payload) % 4)


def _message(msg: int, queue: int, attrs: bytes, family: int = socket.AF_INET, flags: int = 0) -> bytes:
    body = struct.pack("=BBH", family, 0, socket.htons(queue)) + attrs
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg, NLM_F_REQUEST | flags, 0, 0) + body


def _bind(sock: socket.socket, queue: int) -> None:
    """Bind ``queue`` to this socket, each request acknowledged (an error raises OSError): a delayer that says
    ``ready`` delays, rather than leaving the rules' bypass to let everything through undelayed."""
    for attrs in (_attr(NFQA_CFG_CMD, struct.pack("=BBH", NFQNL_CFG_CMD_BIND, 0, 0)),
                  _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
                  + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN))
                  + _attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO))
                  + _attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO))):
        sock.send(_message(NFQNL_MSG_CONFIG, queue, attrs, flags=NLM_F_ACK))
        reply = sock.recv(65536)
        length, kind = struct.unpack_from("=IH", reply)
        code = -struct.unpack_from("=i", reply, 16)[0] if kind == NLMSG_ERROR else -1
        if code:
            raise OSError(code, f"binding nfnetlink queue {queue}: " + (os.strerror(code) if code > 0 else
                                                                        f"unexpected reply type {kind}"))


def _verdict(queue: int, packet_id: int, verdict: int) -> bytes:
    return _message(NFQNL_MSG_VERDICT, queue, _attr(NFQA_VERDICT_HDR, struct.pack("!II", verdict, packet_id)),
                    socket.AF_UNSPEC)


def _packets(data: bytes):
    """(queue, packet id) of every packet message in one read."""
    at = 0
    while at + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, at)
        if length < 16:
            return
        if kind == NLMSG_ERROR:  # a verdict refused (its packet timed out of the queue, say): said, not fatal
            code = -struct.unpack_from("=i", data, at + 16)[0]
            if code:
                print(f"nfnetlink queue: {os.strerror(code)}", file=sys.stderr, flush=True)
        elif kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            queue = socket.ntohs(struct.unpack_from("=H", data, at + 18)[0])
            a = at + 20
            while a + 4 <= at + length:
                alen, atype = struct.unpack_from("=HH", data, a)
                if alen < 4:
                    break
                if atype & 0x7FFF == NFQA_PACKET_HDR:
                    yield queue, struct.unpack_from("!I", data, a + 4)[0]
                    break
                a += (alen + 3) & ~3
        at += (length + 3) & ~3


def run(delay_ms: float, jitter_ms: float, loss_pct: float, queues: list[int]) -> None:
    """Delay (and drop) the packets of ``queues`` until killed."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    try:
        sock.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE (root): bursts of a fast sender
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
    sock.bind((0, 0))
    for q in queues:
        _bind(sock, q)
    sock.setblocking(False)
    print("ready", flush=True)
    due: list[tuple[float, int, int, int]] = []  # (when, order, queue, id)
    order = 0
    rng = random.Random()
    while True:
        now = time.monotonic()
        wait = max(0.0, due[0][0] - now) if due else None
        readable, _, _ = select.select([sock], [], [], wait)
        if readable:
            while True:
                try:
                    data = sock.recv(1 << 20)
                except BlockingIOError:
                    break
                except OSError:  # ENOBUFS: this socket missed messages (their packets went on undelayed, fail-open)
                    continue
                now = time.monotonic()
                for queue, packet_id in _packets(data):
                    if loss_pct and rng.random() * 100 < loss_pct:
                        sock.send(_verdict(queue, packet_id, NF_DROP))
                        continue
                    delay = delay_ms + (rng.gauss(0, jitter_ms) if jitter_ms else 0.0)
                    order += 1
                    heapq.heappush(due, (now + max(0.0, delay) / 1e3, order, queue, packet_id))
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, queue, packet_id = heapq.heappop(due)
            sock.send(_verdict(queue, packet_id, NF_ACCEPT))


def rules(queue: int) -> list[list[str]]:
    """The iptables commands (run in the namespace) that queue what arrives at it from outside to the delayer;
    ``bypass``: without a delayer bound, packets pass. Arriving packets only: a packet held on its way out would
    still count against its socket's bytes below it (TCP small queues), and a sender that holds 20 ms of them would
    crawl (0.28 MB/s measured), where a real path's delay lies beyond the sender's host."""
    return [["iptables", "-A", "INPUT", "!", "-i", "lo", "-j", "NFQUEUE", "--queue-num", str(queue), "--queue-bypass"]]


if __name__ == "__main__":
    run(float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), [int(q) for q in sys.argv[4:]])
