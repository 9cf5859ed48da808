"""The doors: one libp2p protocol each, ``/gpunet/<network>/<door>/<PROTOCOL_VERSION>``, and each door's bounds
beside its name (a unary door refuses a bigger request body unread). Which messages go through which door: the
package's docstring (:mod:`gpunet.protocol`).
"""

from __future__ import annotations

import enum

from gpunet.protocol.framing import MAX_FRAME_BYTES
from gpunet.protocol.probes import MAX_PING_BYTES
from gpunet.protocol.sessions import MAX_PUSH_BYTES

PROTOCOL_VERSION = 1


class Door(enum.Enum):
    """A way into a worker: one libp2p protocol name each, and whether it is a stream or a unary call."""

    JOB = ("job", True)
    INFO = ("info", True)
    RUN = ("run", False, 256 * 1024)  # inline inputs (32 KiB) and up to 256 ride-along countersignatures
    SETTLE = ("settle", False, 256 * 1024)
    CANCEL = ("cancel", False, 4096)
    PING = ("ping", False, 2 * MAX_PING_BYTES)
    PROVE = ("prove", False, 4096)
    REACH = ("reach", True)  # a stream: the answering node must see the caller's address
    RELAY_PROBE = ("relay-probe", True)  # a bootstrap node's own check of its relay (gpunet.dht.reachability)
    PIECE = ("piece", True)  # a worker fetching a program it lacks from a peer that holds it (gpunet.worker.peers)
    PUSH = ("push", False, MAX_PUSH_BYTES + 4096)  # a session step's output, straight to the next span's worker
    STEPS = ("steps", True)  # a session's steps over one stream kept open: no stream set-up per step
    PUSHES = ("pushes", True)  # pushes to one worker over one stream kept open (small ones; bigger: the push door)
    HELLO = ("hello", False, 1024)  # which network a node runs: the one door outside any network (gpunet.dht.hello)

    def __init__(self, slug: str, stream: bool, max_request: int = MAX_FRAME_BYTES):
        """``max_request``: the largest request body this door reads (a unary door refuses bigger ones unread)."""
        self.slug, self.stream, self.max_request = slug, stream, max_request

    def protocol(self, network: str) -> str:
        if self is Door.HELLO:  # asked of a node whatever network it runs, to learn which
            return f"/gpunet/{self.slug}/{PROTOCOL_VERSION}"
        return f"/gpunet/{network}/{self.slug}/{PROTOCOL_VERSION}"
