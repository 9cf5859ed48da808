"""Direct connections between nodes behind NAT: keep enough public peers watching this node's address.

The p2p daemon hole-punches (libp2p's DCUtR, on with ``-autonat``, hivemind's default): when a peer behind NAT reaches
another through a relay, the one reached opens a hole-punch stream over the relayed connection, the two swap their
public addresses and dial each other at once, so both NATs see an outgoing connection and let the other's in. After
that their streams go straight, one transit instead of two legs through a relay. go-libp2p (the daemon's v0.32) does
this only once it knows its own public address: identify observations from 4 peers of distinct IP addresses must
agree on it (and both sides must know theirs). A worker behind NAT talks to its two relays and little else, so it
never got there. :class:`ObserverKeeper` keeps it connected to up to :data:`OBSERVERS` public peers of distinct
public addresses: its initial peers first, then directly reachable workers from the records (in random order, one
address each; one that could not be dialled is left alone for :data:`DIAL_RETRY`, twice that after a second failure,
and so on up to :data:`DIAL_BACKOFF`: a dial can time out on a loaded machine, and an initial peer left alone for
minutes after one such dial kept a worker from ever punching), looked at again each heartbeat.

The daemon tries a hole punch only when a relayed connection comes in after it knows its public address; a relayed
connection to another worker made before that (both starting at once) would stay relayed for good. So once this node
has its observers, it closes such a connection and dials the worker again through its relays, one worker at a time,
at most :data:`PUNCH_TRIES` times per worker (:data:`PUNCH_AGAIN` apart): the other side then sees a fresh relayed
connection and punches (or, if that side does not know its own address yet, it does the same when it does). A pair
that does not punch (a symmetric NAT) then stays relayed; closing costs the streams open on that connection, which
their senders retry.

:func:`paths` says which way each of a node's connections goes (``direct`` or ``relayed``), from the daemon's list of
connections (one entry per connection, with the remote address it uses).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import time
from dataclasses import dataclass
from typing import Iterable

from hivemind.utils.multiaddr import Multiaddr

from gpunet.rpc import connections, dial, disconnect, peer
from gpunet.utils import LRU

logger = logging.getLogger(__name__)

#: Public peers of distinct addresses a node behind NAT keeps connections to: go-libp2p confirms an observed address
#: at 4; a few more ride out ones that leave between heartbeats.
OBSERVERS = 8
#: What go-libp2p needs before it hole-punches (``identify.ActivationThresh``).
CONFIRMING = 4
#: How long one dial may take; how long a candidate that could not be dialled is left alone after its first failure
#: (doubled after each further one), and at most.
DIAL_TIMEOUT = 5.0
DIAL_RETRY = 10.0
DIAL_BACKOFF = 300.0
#: Times a relayed connection to one NATed worker is closed and dialled again to punch, and the least time between.
PUNCH_TRIES = 2
PUNCH_AGAIN = 600.0


@dataclass(frozen=True)
class Candidate:
    peer_id: str
    maddr: str  # a direct TCP address (no relay)
    ip: str


def candidates(addresses: Iterable[str], public_only: bool = False) -> list[Candidate]:
    """Peers to keep as observers, from full multiaddrs (``/ip4/A/tcp/P/p2p/ID``), in the order given, one per IP
    address and one per peer: relayed addresses and loopback are no use (a relay's observation is the relay's;
    loopback's is nobody's). ``public_only``: globally routable addresses alone (for addresses other peers published:
    a record may name any, this machine's LAN among them). An address that does not parse is skipped."""
    found: list[Candidate] = []
    seen: set[str] = set()
    for address in addresses:
        address = str(address)
        if "/p2p-circuit" in address or "/p2p/" not in address:
            continue
        where, _, peer_id = address.rpartition("/p2p/")
        parts = where.split("/")
        if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
            continue
        try:
            ip = ipaddress.ip_address(parts[2])
        except ValueError:
            continue
        if ip.is_loopback or ip.is_unspecified or (public_only and not ip.is_global) or str(ip) in seen \
                or peer_id in seen:
            continue
        seen |= {str(ip), peer_id}
        found.append(Candidate(peer_id, where, str(ip)))
    return found


def paths(conns: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Which way each connected peer is reached: ``direct`` if any of its connections is (a hole-punched one
    included), else ``relayed``."""
    found: dict[str, str] = {}
    for peer_id, addr in conns:
        path = "relayed" if "/p2p-circuit" in addr else "direct"
        if found.get(peer_id) != "direct":
            found[peer_id] = path
    return found


class ObserverKeeper:
    """Keeps a node behind NAT connected to public peers of distinct addresses (see the module's docstring)."""

    def __init__(self, p2p, own_id: str, want: int = OBSERVERS, clock=time.monotonic):
        self.p2p = p2p
        self.own_id = own_id
        self.want = want
        self.clock = clock
        self.observers: int | None = None  # distinct public addresses of peers connected at the last look
        self.paths: dict[str, str] = {}  # each connected peer's path at the last look (see paths())
        #: Workers behind NAT, by their records (peer id: their relayed addresses): those to punch to.
        self.natted: dict[str, list[str]] = {}
        #: Candidates that could not be dialled: until when each is left alone, and its failures in a row.
        self._failed: LRU[str, tuple[float, int]] = LRU(4096)
        self._punches: LRU[str, tuple[int, float]] = LRU(4096)  # NATed workers dialled again: times, when last

    def punched(self) -> list[str]:
        """The workers behind NAT reached by a direct connection at the last look."""
        return sorted(p for p, path in self.paths.items() if path == "direct" and p in self.natted)

    async def keep(self, trusted: Iterable[str], published: Iterable[str] = ()) -> int:
        """Dial candidates not connected now, until ``want`` distinct public addresses are; returns how many are.
        ``trusted``: full multiaddrs this node was given (its initial peers), ``published``: those of other peers'
        records (public addresses alone, in random order). Then, with enough observers, punch to one NATed worker
        still relayed (see the module)."""
        trusted, published = list(trusted), list(published)
        random.shuffle(published)  # no record's place in the listing (sorted by id) decides who is dialled
        now = self.clock()
        conns = await connections(self.p2p)
        self.paths = paths(conns)
        connected = {p for p, path in self.paths.items() if path == "direct"}
        # Only a public address observes ours: a peer on this LAN sees only the LAN address.
        held = {c.ip for c in candidates((f"{a}/p2p/{p}" for p, a in conns if p in connected), public_only=True)}
        offered = candidates(trusted)
        taken = {c.ip for c in offered} | {c.peer_id for c in offered}
        offered += [c for c in candidates(published, public_only=True) if not {c.ip, c.peer_id} & taken]
        todo = [c for c in offered if c.peer_id != self.own_id and c.peer_id not in connected and c.ip not in held
                and self._failed.get(c.peer_id, (0.0, 0))[0] <= now][:max(0, self.want - len(held))]
        if todo:
            dialled = await asyncio.gather(*(self._dial(c) for c in todo))
            for c, ok in zip(todo, dialled):
                if not ok:
                    failures = min(self._failed.get(c.peer_id, (0.0, 0))[1] + 1, 32)  # (2**n stays a float)
                    self._failed.put(c.peer_id, (now + min(DIAL_BACKOFF, DIAL_RETRY * 2.0 ** (failures - 1)), failures))
                    continue
                self._failed.pop(c.peer_id, None)
                if ipaddress.ip_address(c.ip).is_global:
                    held.add(c.ip)
        if self.observers is None or (self.observers < CONFIRMING) != (len(held) < CONFIRMING):
            logger.info("Connected to %d public peer(s) of distinct addresses%s", len(held),
                        "" if len(held) >= CONFIRMING else
                        f" (hole punching to other NATed workers needs {CONFIRMING}: relayed until then; more "
                        "initial peers, or directly reachable workers in the network, give more)")
        self.observers = len(held)
        if self.observers >= CONFIRMING:
            await self._punch_again(trusted, now)
        return self.observers

    async def _punch_again(self, trusted: list[str], now: float) -> None:
        """Close the relayed-only connection to one NATed worker and dial it again through its relays: its side sees
        a new relayed connection and hole-punches. Only through relays this node was given (the same address) or at
        public addresses (a record may name any)."""
        for peer_id, path in sorted(self.paths.items()):
            if path != "relayed" or peer_id not in self.natted:
                continue
            tries, last = self._punches.get(peer_id, (0, -PUNCH_AGAIN))
            via = [m for m in self.natted[peer_id] if _relay_ok(m, trusted)][:2]
            if tries >= PUNCH_TRIES or now - last < PUNCH_AGAIN or not via:
                continue
            self._punches.put(peer_id, (tries + 1, now))
            logger.info("Dialling worker %s again through its relays, to hole-punch a direct connection",
                        peer_id[-8:])
            try:
                await asyncio.wait_for(disconnect(self.p2p, peer(peer_id)), DIAL_TIMEOUT)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.debug("Could not close the relayed connection to %s: %s", peer_id[-8:], e)
                return
            for m in via:
                if await self._dial(Candidate(peer_id, m.rpartition("/p2p/")[0], "")):
                    break
            return  # one a look: each costs its streams a retry

    async def _dial(self, c: Candidate) -> bool:
        try:
            await asyncio.wait_for(dial(self.p2p, peer(c.peer_id), [Multiaddr(c.maddr)]), DIAL_TIMEOUT)
            return True
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.debug("Could not dial peer %s at %s: %s", c.peer_id[-8:], c.maddr, e)
            return False


def _relay_ok(maddr: str, trusted: list[str]) -> bool:
    """Whether a relayed address (``/ip4/A/tcp/P/p2p/RELAY/p2p-circuit/p2p/ID``) goes through a relay this node may
    dial: exactly one of its own initial peers, or one at a public address."""
    if "/p2p-circuit" not in maddr:
        return False
    relay = maddr.split("/p2p-circuit")[0]
    return relay in trusted or bool(candidates([relay], public_only=True))
