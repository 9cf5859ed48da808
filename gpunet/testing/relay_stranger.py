"""A stranger who uses a public node's relay as free transit: two plain libp2p peers (hivemind's p2pd, no gpunet
identity, no network name), one holding a reservation on the relay, the other pushing bytes to it through the relay
as fast as it can, dialling a fresh circuit whenever the relay resets one. Used by tests/test_nat.py and
scripts/bench_relay_abuse.py; each role runs as its own process, inside a NAT lab namespace.

    python -m gpunet.testing.relay_stranger hold RELAY_MADDR            (prints "ready PEER_ID MADDR", then one
                                                                          "circuit BYTES" line per circuit that ended)
    python -m gpunet.testing.relay_stranger hold --direct LISTEN_MADDR  (the baseline: a peer dialled directly)
    python -m gpunet.testing.relay_stranger push PEER_ID MADDR --seconds S [--streams N]
                                                                         (prints one JSON line: bytes, seconds, resets)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

#: The network name the stranger's two peers speak under (any protocol crosses a relay; gpunet's stream adapter is
#: only the tool at hand).
NETWORK = "stranger"
CHUNK = 1 << 16


#: How long a stranger's p2p daemon may take to start (hivemind's default, 15 s, was not enough on a loaded CI machine).
STARTUP_SECONDS = 60.0


async def hold(relay: str | None, direct: str | None, wait: float = 60.0) -> None:
    """Hold a reservation on ``relay`` (or listen on ``direct``) and count what arrives, per stream (each stream the
    pusher opens rides one circuit: it reopens a stream only when its circuit was reset)."""
    from hivemind.p2p import P2P, P2PDaemonError

    from gpunet.dht import network
    from gpunet.dht.reachability import is_relayed
    from gpunet.protocol import Door
    from gpunet.rpc import RPC

    dialling = time.monotonic() + wait
    if direct:
        p2p = await P2P.create(host_maddrs=[direct], startup_timeout=STARTUP_SECONDS)
    else:
        while True:  # a loaded relay can miss the daemon's one bootstrap dial: dial again until the wait is over
            try:
                p2p = await P2P.create(initial_peers=[relay], no_listen=True, startup_timeout=STARTUP_SECONDS,
                                       **network._reachability_options("private", [relay]))
                break
            except P2PDaemonError as e:
                if "bootstrap" not in str(e) or time.monotonic() > dialling:
                    raise
                await asyncio.sleep(1.0)

    async def sink(_peer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _host: str = "") -> None:
        total = 0
        try:
            while chunk := await reader.read(CHUNK):
                total += len(chunk)
        except Exception:  # a reset circuit: what arrived before it counts
            pass
        finally:
            print(f"circuit {total}", flush=True)
            writer.close()

    await RPC(p2p, NETWORK).serve_stream(Door.RELAY_PROBE, sink)
    deadline = time.monotonic() + wait
    while True:
        try:
            addrs = [str(m) for m in await p2p.get_visible_maddrs(latest=True)]
        except ValueError:  # no address at all yet
            addrs = []
        mine = [m for m in addrs if is_relayed(m)] if relay else [m for m in addrs if direct.split("/tcp/")[0] in m]
        if mine:
            break
        if time.monotonic() > deadline:
            print(f"refused: no reservation on {relay} within {wait:.0f} s (addresses: {addrs})", flush=True)
            await p2p.shutdown()
            return
        await asyncio.sleep(0.2)
    print(f"ready {p2p.peer_id.to_base58()} {mine[0]}", flush=True)
    await asyncio.Event().wait()  # until killed


#: The longest a pusher tries to open its first stream to the holder.
FIRST_OPEN_SECONDS = 30.0


async def push(peer_id: str, maddr: str, seconds: float, streams: int) -> dict:
    """Push zeros to the holder for ``seconds`` (from the first stream that opens) over ``streams`` streams at once,
    each reopened (a new circuit when the relay reset the old one) as soon as it fails. Returns the bytes the pusher
    wrote (the holder counts what arrived) and the seconds it pushed, the streams it opened, and how many failed (a
    failure on a circuit already reset counts too)."""
    from hivemind.p2p import P2P

    from gpunet.protocol import Door
    from gpunet.rpc import RPC

    # Through a relay: join at the relay, whose routing knows the holder's relayed address (the daemon's own DHT
    # finds it, as it finds a relayed gpunet worker). Direct: join at the holder.
    via = maddr.split("/p2p-circuit")[0] if "/p2p-circuit" in maddr else maddr
    p2p = await P2P.create(host_maddrs=["/ip4/0.0.0.0/tcp/0"], initial_peers=[via], startup_timeout=STARTUP_SECONDS)
    rpc = RPC(p2p, NETWORK)
    # ``seconds`` of pushing, from the first stream that opens: under load, finding the holder through the relay can
    # take longer than the push itself (CI saw a 5 s push open nothing). At most FIRST_OPEN_SECONDS for that.
    began = time.monotonic()  # when pushing began: reset when the first stream opens
    deadline = began + max(seconds, FIRST_OPEN_SECONDS)
    written, resets, refused, opened = 0, 0, 0, 0
    errors: list[str] = []
    block = bytes(CHUNK)

    async def one_lane() -> None:
        nonlocal written, resets, refused, opened, deadline, began
        while time.monotonic() < deadline:
            try:
                _reader, writer = await rpc.open(peer_id, Door.RELAY_PROBE)
            except Exception as e:
                refused += 1
                errors.append(str(e)[:300])
                await asyncio.sleep(0.05)
                continue
            if not opened:
                began = time.monotonic()
                deadline = min(deadline, began + seconds)
            opened += 1
            try:
                while time.monotonic() < deadline:
                    writer.write(block)
                    await writer.drain()
                    written += len(block)
                writer.close()
            except Exception as e:
                resets += 1
                errors.append(str(e)[:300])
    try:
        await asyncio.gather(*(one_lane() for _ in range(streams)))
    finally:
        ended = time.monotonic()
        await p2p.shutdown()
    return {"written": written, "seconds": ended - began, "resets": resets, "refused": refused,
            "opened": opened, "errors": sorted(set(errors))[:3]}


class NoReservation(RuntimeError):
    """The relay gave the stranger's holder no reservation."""


class Holder:
    """The holding peer, run inside a lab namespace: its address, and what it counted per circuit so far."""

    def __init__(self, argv: list[str]):
        import subprocess
        import threading

        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True)
        self.circuits: list[int] = []
        first = self.popen.stdout.readline()
        line = first.split()
        if line and line[0] == "refused:":
            self.stop()
            raise NoReservation(first.strip())
        if not line or line[0] != "ready":
            self.stop()
            raise RuntimeError(f"the stranger's holder did not come up: {line} {self.popen.stderr.read()[-2000:]}")
        self.peer_id, self.maddr = line[1], line[2]
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in iter(self.popen.stdout.readline, ""):
            if line.startswith("circuit "):
                self.circuits.append(int(line.split()[1]))

    def stop(self) -> None:
        import os
        import signal

        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()


def start_holder(lab, ns: str, relay: str | None = None, direct: str | None = None, wait: float = 60.0) -> Holder:
    """The holding peer in namespace ``ns`` of ``lab`` (a gpunet.testing.netns.NatLab); raises NoReservation when
    ``relay`` grants none within ``wait`` seconds."""
    args = ["hold", relay, "--wait", str(wait)] if relay else ["hold", "--direct", direct]
    return Holder(lab.exec_argv(ns, [sys.executable, "-m", "gpunet.testing.relay_stranger", *args]))


def run_pusher(lab, ns: str, holder: Holder, seconds: float, streams: int = 1) -> dict:
    """Push at ``holder`` from namespace ``ns`` for ``seconds``; the pusher's JSON line."""
    import subprocess

    argv = lab.exec_argv(ns, [sys.executable, "-m", "gpunet.testing.relay_stranger", "push", holder.peer_id,
                              holder.maddr, "--seconds", str(seconds), "--streams", str(streams)])
    run = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + FIRST_OPEN_SECONDS + 120)
    if run.returncode != 0:
        raise RuntimeError(f"the stranger's pusher failed: {run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="role", required=True)
    h = sub.add_parser("hold")
    h.add_argument("relay", nargs="?")
    h.add_argument("--direct")
    h.add_argument("--wait", type=float, default=60.0, help="seconds to wait for a reservation")
    p = sub.add_parser("push")
    p.add_argument("peer_id")
    p.add_argument("maddr")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--streams", type=int, default=1)
    args = parser.parse_args()
    if args.role == "hold":
        if not (args.relay or args.direct):
            parser.error("hold needs a relay address or --direct LISTEN_MADDR")
        asyncio.run(hold(args.relay, args.direct, args.wait))
    else:
        print(json.dumps(asyncio.run(push(args.peer_id, args.maddr, args.seconds, args.streams))), flush=True)


if __name__ == "__main__":
    sys.exit(main())
