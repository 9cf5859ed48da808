"""Which network does a peer run? Asked of the initial peers, so a node given the wrong ones says so.

Networks share the DHT's machinery but not its records or doors (every door is named ``/gpunet/<network>/...``), so a
worker started with ``--network gpunett`` against a ``gpunet`` bootstrap joined, went "online" and never got a job;
its only hint was a failed dial-back check. Every node (worker and bootstrap) serves one door outside any network,
``hello``, answering the network it runs (:class:`~gpunet.protocol.Greeting`). A node that joined through initial
peers asks them; if some answered and none runs its network, it stops before it is listed, naming what each runs.
Peers that do not answer (an older gpunet, a peer still starting) decide nothing: the node goes on as before.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

from gpunet import protocol
from gpunet._version import __version__
from gpunet.errors import ConfigError, GpunetError
from gpunet.protocol import Door, Greeting, Hello

logger = logging.getLogger(__name__)

#: Seconds an initial peer has to say which network it runs.
ASK_TIMEOUT = 5.0


async def serve(rpc, network: str, role: str) -> None:
    """Answer ``hello`` on this node: ``network`` and ``role`` (worker, bootstrap)."""
    greeting = protocol.encode(Greeting(network, role, __version__))

    async def answer(request: bytes, peer_id: str) -> bytes:
        try:
            protocol.decode(request, Hello)
        except GpunetError as e:
            return protocol.encode(protocol.Error.of(e))
        return greeting

    await rpc.serve_unary(Door.HELLO, answer)


async def ask(rpc, peer_id: str) -> Greeting | None:
    """What ``peer_id`` says it runs; None if it does not say (an older gpunet, no answer in time, a garbled reply)."""
    try:
        return await asyncio.wait_for(rpc.call(peer_id, Door.HELLO, Hello(), Greeting), ASK_TIMEOUT)
    except (GpunetError, asyncio.TimeoutError) as e:
        logger.debug("peer %s did not say which network it runs: %s", peer_id[-8:], e)
        return None


async def check_initial_peers(rpc, network: str, peers: Sequence[str]) -> None:
    """ConfigError if an initial peer answered and none runs ``network`` (``peers``: multiaddrs ending in /p2p/ID)."""
    answers = await asyncio.gather(*(ask(rpc, peer_id(m)) for m in peers))
    problem = mismatch(network, list(zip(peers, answers)))
    if problem:
        raise ConfigError(problem)


def mismatch(network: str, answers: Sequence[tuple[str, Greeting | None]]) -> str | None:
    """What is wrong with initial peers that answered ``answers``, for a node of ``network``; None: nothing known.
    Only when every one answered, and none runs ``network``: one that did not answer may run it (a peer still
    starting, an older gpunet), and one wrong entry in a list of public peers must not stop a node."""
    said = [(maddr, g) for maddr, g in answers if g is not None]
    if not said or any(g.network == network for _, g in said):
        return None
    if len(said) < len(answers):
        logger.warning("Initial peer(s) %s run another network, not %r; joining through the others",
                       ", ".join(f"{maddr} ({g.network!r})" for maddr, g in said), network)
        return None
    others = sorted({g.network for _, g in said})
    each = "; ".join(f"{maddr} runs {g.network!r}" + (f" (a {g.role})" if g.role else "") for maddr, g in said)
    fix = (f"to join that network, pass --network {others[0]}" if len(others) == 1
           else f"pass --network NAME for one of {', '.join(repr(o) for o in others)}")
    return (f"none of the initial peers runs network {network!r}: {each}. Networks with different names never mix, so "
            f"this node would get no jobs; {fix}, or give the address of a node of {network!r}")


def peer_id(maddr: str) -> str:
    return str(maddr).rsplit("/p2p/", 1)[-1]
