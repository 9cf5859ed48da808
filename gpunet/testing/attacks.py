"""ATTACKS, for tests and benchmarks of trust: identities that lie about themselves, run in this process against a
real local network (:mod:`gpunet.testing.localnet`). Nothing here is part of a worker.

:class:`ProofRelay` is the relayed speed proof (issue 38): identities with no device that advertise a big one and
pass every speed challenge they get on to an honest worker, answering with what it answered. Four ways to relay:

* ``"forward"``: the challenge's bytes as they came, the answer's as they came back;
* ``"resign"``: the same, with the commitment signed again by the relay's own key (so a signature alone proves
  nothing: the matrices must be its own);
* ``"unbind"``: the challenge sent on as the unbound form (``bind`` dropped: the honest worker computes from the bare
  seed, not for its own id) and re-signed;
* ``"derive"``: the unbound form again, its seed the relay's own bound key (the matrices a bound challenge to the relay
  is made of), re-signed; refused that (a bound key is longer than a seed), the bare seed as ``"unbind"``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Sequence

from gpunet import protocol, speedproof
from gpunet.dht import network as dht_network
from gpunet.dht import registry
from gpunet.dht.records import DeviceInfo, WorkerRecord, WorkerState
from gpunet.identity import Identity
from gpunet.protocol import OpenProof, ProveSpeed, SpeedCommitment
from gpunet.protocol.doors import Door
from gpunet.rpc import RPC

MODES = ("forward", "resign", "unbind", "derive")
#: What a relay claims, in the target's best dtype: just under the figure from which a challenge is 4096 x 4096, so the
#: challenge it gets (2048) is one the honest worker takes (speedproof.fits) and the relay is not refused outright.
CLAIM_TFLOPS = 49.0


class ProofRelay:
    """Relays with no device, one per mode in ``modes``, relaying challenges to ``target`` (an honest worker's id,
    whose record claims ``target_tflops``). Use as a context manager; ``ids[mode]`` is each relay's peer id and
    ``relayed[mode]`` how many challenges it passed on."""

    def __init__(self, root: Path, network: str, initial_peers: Sequence[str], target: str,
                 target_tflops: dict[str, float], modes: Sequence[str] = MODES, heartbeat: float = 2.0):
        """``root``: a folder for the relays' keys (the p2p daemon reads a node's key from a file)."""
        assert all(m in MODES for m in modes), modes
        self.network, self.initial_peers, self.target, self.heartbeat = network, list(initial_peers), target, heartbeat
        dtype = max(target_tflops, key=target_tflops.get) if target_tflops else "fp32"
        self.claim = {dtype: CLAIM_TFLOPS}
        self.identities = {m: Identity.load_or_create(Path(root) / f"relay-{m}") for m in modes}
        self.ids = {m: i.peer_id for m, i in self.identities.items()}
        self.relayed = {m: 0 for m in modes}
        self._dhts: dict[str, object] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="proof-relay", daemon=True)
        self._task: asyncio.Task | None = None
        self._rpcs: dict[str, RPC] = {}

    def __enter__(self) -> "ProofRelay":
        for mode, identity in self.identities.items():
            self._dhts[mode] = dht_network.join(self.network, self.initial_peers, identity=identity,
                                                host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        self._thread.start()
        ready: Future = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
        ready.result(timeout=60)
        return self

    def __exit__(self, *exc) -> None:
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=30)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()
        for dht in self._dhts.values():
            dht.shutdown()

    async def _close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*(rpc.close() for rpc in self._rpcs.values()), return_exceptions=True)

    async def _serve(self) -> None:
        self._lock = asyncio.Lock()
        rpcs = self._rpcs
        for mode, dht in self._dhts.items():
            rpc = rpcs[mode] = RPC(await dht.replicate_p2p(), self.network)
            await rpc.serve_unary(Door.PING, self._pong)
            await rpc.serve_unary(Door.PROVE, self._relay(mode, rpc))
        await asyncio.gather(*(self._announce(mode) for mode in self._dhts))
        self._task = asyncio.ensure_future(self._heartbeats())

    async def _pong(self, request: bytes, client_id: str) -> bytes:
        return protocol.encode(protocol.Pong(time.time(), protocol.decode(request, protocol.Ping).echo))

    def _relay(self, mode: str, rpc: RPC):
        identity = self.identities[mode]

        async def relay(request: bytes, client_id: str) -> bytes:
            message = protocol.decode(request, ProveSpeed, OpenProof)
            if isinstance(message, ProveSpeed):
                self.relayed[mode] += 1
                if mode == "unbind":
                    request = protocol.encode(ProveSpeed(message.seed, message.n, message.seconds, message.dtype))
                elif mode == "derive":  # the relay's own bound key, asked of the honest worker as an unbound seed
                    key = speedproof.Challenge(message.seed, message.n, message.seconds, message.dtype,
                                               identity.peer_id).key
                    request = protocol.encode(ProveSpeed(key, message.n, message.seconds, message.dtype))
            async with self._lock:  # one at a time: the honest worker takes one challenge at a time
                reply = await rpc.call_raw(self.target, Door.PROVE, request)
                if mode == "derive" and isinstance(message, ProveSpeed) and isinstance(
                        protocol.decode(reply, SpeedCommitment, protocol.Error), protocol.Error):
                    # Refused (a bound key is no seed): the bare seed then, as "unbind" does, to have an answer at all.
                    reply = await rpc.call_raw(self.target, Door.PROVE, protocol.encode(
                        ProveSpeed(message.seed, message.n, message.seconds, message.dtype)))
            if mode != "forward" and isinstance(message, ProveSpeed):
                answer = protocol.decode(reply, SpeedCommitment, protocol.Error)
                if isinstance(answer, SpeedCommitment):  # signed as if it had computed them itself
                    ch = speedproof.Challenge(message.seed, message.n, message.seconds, message.dtype, identity.peer_id)
                    reply = protocol.encode(SpeedCommitment(answer.commitments,
                                                            identity.sign(ch.statement(answer.commitments))))
            return reply

        return relay

    def _record(self) -> WorkerRecord:
        now = time.time()
        return WorkerRecord(version="9.9.9", state=WorkerState.ONLINE, tflops=self.claim, price=1.0, started_at=now,
                            updated_at=now, device=DeviceInfo(kind="cuda", name="NVIDIA H200 (relayed)",
                                                              memory_total=141 << 30, memory_free=140 << 30))

    async def _announce(self, mode: str) -> None:
        expiration = time.time() + 3 * self.heartbeat + 5
        await registry.announce_async(self._dhts[mode], self.network, self.ids[mode], self._record(), expiration)

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat)
            await asyncio.gather(*(self._announce(mode) for mode in self._dhts), return_exceptions=True)
