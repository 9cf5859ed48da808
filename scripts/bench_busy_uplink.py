#!/usr/bin/env python
"""One libp2p stream into a host whose uplink is full, beside raw TCP over the same links.

Why: in a cold start the client's one copy reaches the first worker at 60-70% of the link once that worker serves
what it has to others (README, "cold start ... at 25 Mbit/s"), with the cores far from busy. This isolates it: three
hosts in a ``LinkLab`` behind links of ``--mbit`` up and down; host A sends ``--mib`` to host B over raw TCP (the
baseline) and over hivemind/libp2p streams (p2pd, as gpunet's doors are; ``--streams``: the bytes split over that many
at once, each count timed in turn), while B sends ``--flows`` raw TCP flows of its own out to host C (0: B's uplink
idle). Needs root, ``ip`` and ``tc``.

    python scripts/bench_busy_uplink.py [--flows 0 4 8] [--streams 1 2 4] [--mbit 25] [--mib 32] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time


async def _receive(addr: str) -> None:
    from hivemind.p2p import P2P

    p2p = await P2P.create(host_maddrs=[f"/ip4/{addr}/tcp/0"])

    async def handler(_info, reader, writer) -> None:
        left = int.from_bytes(await reader.readexactly(8), "big")
        while left > 0:
            left -= len(await reader.read(min(left, 1 << 20)))
        writer.write(b"k")  # every byte is here
        await writer.drain()
        writer.close()

    await p2p.add_binary_stream_handler("bench", handler)
    print((await p2p.get_visible_maddrs())[0], flush=True)
    await asyncio.Event().wait()  # until killed


async def _send(maddr: str, nbytes: int, streams: int = 1) -> None:
    from hivemind.p2p import P2P, PeerID

    p2p = await P2P.create(initial_peers=[maddr])
    peer = PeerID.from_base58(maddr.split("/p2p/")[1])
    opened = [await p2p.call_binary_stream_handler(peer, "bench") for _ in range(streams)]
    block = bytes(1 << 20)

    async def one(reader, writer, size: int) -> None:
        left = size
        writer.write(size.to_bytes(8, "big"))
        while left > 0:
            writer.write(block[:min(left, len(block))])
            left -= len(block)
            await writer.drain()
        await reader.readexactly(1)  # the receiver has every byte of this stream

    share = -(-nbytes // streams)
    t0 = time.perf_counter()
    await asyncio.gather(*(one(reader, writer, min(share, nbytes - i * share))
                           for i, (_, reader, writer) in enumerate(opened)))
    print(time.perf_counter() - t0, flush=True)
    await p2p.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flows", type=int, nargs="+", default=[0, 4, 8])
    parser.add_argument("--mbit", type=float, default=25.0)
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--streams", type=int, nargs="+", default=[1],
                        help="the libp2p measurement's bytes split over this many streams at once")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from gpunet.testing.netns import _SEND, _SINK, LinkLab

    nbytes, me = args.mib << 20, [sys.executable, __file__]
    out: dict = {"mbit": args.mbit, "bytes": nbytes, "line_rate_s": round(nbytes * 8 / args.mbit / 1e6, 2), "runs": []}
    with LinkLab(3, up_mbit=args.mbit, down_mbit=args.mbit) as lab:
        (a, b, c), (_, b_addr, c_addr) = lab.hosts, lab.addrs
        receiver = subprocess.Popen(lab.exec_argv(b, [*me, "_receive", b_addr]), stdout=subprocess.PIPE, text=True)
        try:
            maddr = receiver.stdout.readline().strip()
            for flows in args.flows:
                busy = []  # B's own uploads to C, running through both measurements
                try:
                    for _ in range(flows):
                        sink = subprocess.Popen(lab.exec_argv(c, [sys.executable, "-c", _SINK, c_addr]),
                                                stdout=subprocess.PIPE, text=True)
                        busy.append(sink)
                        port = sink.stdout.readline().strip()
                        busy.append(subprocess.Popen(lab.exec_argv(b, [sys.executable, "-c", _SEND, c_addr, port,
                                                                       str(1 << 40)]), stdout=subprocess.DEVNULL))
                    if flows:
                        time.sleep(2.0)  # (their queues fill: what is measured is a full uplink, not its start)
                    tcp = lab.tcp_seconds(a, b, b_addr, nbytes)
                    run = {"flows_out_of_b": flows, "tcp_s": round(tcp, 2), "p2p": []}
                    for streams in args.streams:  # (one figure per entry: a count given twice is timed twice)
                        sent = subprocess.run(lab.exec_argv(a, [*me, "_send", maddr, str(nbytes), str(streams)]),
                                              capture_output=True, text=True, timeout=600, check=True)
                        run["p2p"].append({"streams": streams, "s": round(float(sent.stdout.split()[-1]), 2)})
                finally:
                    for proc in busy:
                        proc.kill()
                        proc.wait()
                out["runs"].append(run)
                if not args.json:
                    p2p = ", ".join(f"{r['streams']} libp2p stream(s) {r['s']} s" for r in run["p2p"])
                    print(f"B sending {flows} flow(s) out: A->B raw TCP {run['tcp_s']} s, {p2p} "
                          f"(line rate {out['line_rate_s']} s)", flush=True)
        finally:
            receiver.kill()
            receiver.wait()
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_receive":
        asyncio.run(_receive(sys.argv[2]))
    elif len(sys.argv) > 4 and sys.argv[1] == "_send":
        asyncio.run(_send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    else:
        main()
