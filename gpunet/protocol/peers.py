"""A program fetched from peers: its bytes cut into pieces, each with its own hash, so a worker can fetch it from
peers and catch a peer that serves one wrong byte at that piece (BitTorrent's idea; the client that sends the job
vouches for the list).

The pieces are of the container bytes (what ``program_hash`` is computed from): piece ``i`` is
``data[i * piece_size:(i + 1) * piece_size]``, its hash the sha256 of those bytes. ``piece_size`` is a power of two
from :data:`MIN_PIECE_BYTES`, chosen so a program has at most :data:`MAX_PIECES` (its hash list then fits in one
protocol frame).

The messages: the client's :class:`Pieces` (who holds the program and every piece's digest, answering a worker's
``Send(pieces=True)``), then on the ``piece`` door, from worker to holder, :class:`GetPiece` -> :class:`PieceData` +
the piece's bytes (or :class:`Have`, from a holder still getting the program), repeated (gpunet.worker.peers serves and fetches; docs/weights.md).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from gpunet.errors import ProtocolError
from gpunet.protocol.fields import PEER_ID_RE, Message, program_hash_field, proof_field, size_field, typed_field
from gpunet.protocol.holding import PROOF_BYTES

MIN_PIECE_BYTES = 4 << 20
MAX_PIECES = 1024
DIGEST = 32


def piece_size_for(size: int) -> int:
    """The piece size of a program of ``size`` bytes."""
    piece = MIN_PIECE_BYTES
    while size > piece * MAX_PIECES:
        piece *= 2
    return piece


def count(size: int, piece_size: int) -> int:
    return max(1, math.ceil(size / piece_size))


def digests(data: bytes | memoryview, piece_size: int | None = None) -> bytes:
    """The concatenated sha256 digests of ``data``'s pieces."""
    view = memoryview(data).cast("B")
    piece_size = piece_size or piece_size_for(view.nbytes)
    return b"".join(hashlib.sha256(view[i:i + piece_size]).digest()
                    for i in range(0, max(view.nbytes, 1), piece_size))


@dataclass(frozen=True)
class PieceList:
    """What a fetcher checks each piece against: the program's size, the piece size and every piece's digest."""

    size: int
    piece_size: int
    hashes: bytes

    def __post_init__(self):
        if self.piece_size != piece_size_for(self.size):
            raise ValueError(f"a {self.size}-byte program has pieces of {piece_size_for(self.size)} bytes, "
                             f"not {self.piece_size}")
        if len(self.hashes) != DIGEST * count(self.size, self.piece_size):
            raise ValueError("the piece list does not have one digest per piece")

    @classmethod
    def of(cls, data: bytes | memoryview) -> "PieceList":
        size = memoryview(data).nbytes
        return cls(size, piece_size_for(size), digests(data))

    def __len__(self) -> int:
        return len(self.hashes) // DIGEST

    def span(self, index: int) -> tuple[int, int]:
        """Start and length of piece ``index``."""
        start = index * self.piece_size
        return start, min(self.piece_size, self.size - start)

    def matches(self, index: int, data: bytes | memoryview) -> bool:
        return hashlib.sha256(data).digest() == self.hashes[index * DIGEST:(index + 1) * DIGEST]


#: Peers one Pieces message may name, and addresses per peer.
MAX_HOLDERS = 8
MAX_HOLDER_MADDRS = 4


@dataclass(frozen=True, slots=True)
class Pieces(Message):
    """The client's answer to ``Send(pieces=True)``: fetch the program from these peers, checking each piece against
    these digests (:class:`PieceList`); a :class:`Payload` with the inputs, if asked for, follows. The client vouches
    for the list: it is the one whose job runs on the bytes.

    Holders are named by peer id; the addresses beside them are what older workers dialled and are never dialled now
    (a client could name any address, the worker's own loopback or its owner's LAN among them): a worker reaches a
    holder through the p2p layer, by its id. ``grants``: per holder, the client's proof that it holds the program
    (gpunet.protocol.holding, purpose PIECE, that holder the verifier, this worker the prover), which the worker
    presents to it: a holder serves a program that is not shared only to a fetcher some holder of its bytes sent.
    ``holds``: the client's own proof for this worker (purpose RUN), checked against the fetched bytes before they run
    for it (without it, or wrong, the worker asks the client for the program after all)."""

    T: ClassVar[str] = "pieces"
    size: int
    piece_size: int
    hashes: bytes
    holders: tuple[tuple[str, tuple[str, ...]], ...]
    #: Those of the holders the client vouches for (it is sending them the program right now, or they ran it for
    #: this client): worth waiting for while they say "busy".
    coming: frozenset[str] = frozenset()
    grants: tuple[tuple[str, bytes], ...] = ()
    holds: bytes | None = None
    #: The client's upload token for the program (gpunet.protocol.holding): while the worker fetches it, it serves
    #: the pieces it has to other workers against grants made with it.
    token: bytes | None = None

    @property
    def holder_ids(self) -> tuple[str, ...]:
        return tuple(peer for peer, _ in self.holders)

    def piece_list(self) -> PieceList:
        return PieceList(self.size, self.piece_size, self.hashes)

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "size": self.size, "piece_size": self.piece_size, "hashes": self.hashes,
                "holders": [[peer, list(maddrs)] for peer, maddrs in self.holders],
                "coming": sorted(self.coming), "grants": [[peer, grant] for peer, grant in self.grants],
                **({"holds": self.holds} if self.holds is not None else {}),
                **({"token": self.token} if self.token is not None else {})}

    @classmethod
    def from_wire(cls, d: dict) -> "Pieces":
        raw = typed_field(d, "holders", list)
        ok = len(raw) <= MAX_HOLDERS and all(
            isinstance(h, list) and len(h) == 2 and isinstance(h[0], str) and PEER_ID_RE.match(h[0])
            and isinstance(h[1], list) and len(h[1]) <= MAX_HOLDER_MADDRS
            and all(isinstance(m, str) and 0 < len(m) <= 256 for m in h[1]) for h in raw)
        if not ok:
            raise ProtocolError(f"pieces: holders must be at most {MAX_HOLDERS} [peer id, [multiaddr, ...]] pairs")
        holders = tuple((h[0], tuple(h[1])) for h in raw)
        coming = d.get("coming") or []
        if not isinstance(coming, list) or not all(isinstance(c, str) for c in coming):
            raise ProtocolError("pieces: coming must list holders' peer ids")
        named = {peer for peer, _ in holders}
        grants = _grants(d, named, "pieces")
        message = cls(size_field(d, "size"), size_field(d, "piece_size"), typed_field(d, "hashes", bytes), holders,
                      frozenset(coming) & named, grants, proof_field(d, "holds", "pieces"), proof_field(d, "token", "pieces"))
        try:
            message.piece_list()
        except ValueError as e:
            raise ProtocolError(f"pieces: {e}") from None
        return message


@dataclass(frozen=True, slots=True)
class TensorHolders(Message):
    """The client's answer to ``Send(tensors=...)`` when other workers have those weights: ones that keep their
    checkpoint (their records list it), and ones this client sent them to, or pointed at holders of them, for its
    job (those serve what they have to a fetcher presenting the grant made for them with the client's upload token:
    gpunet.protocol.holding). Fetch them from these peers (by id), each checked against its hash; ask again for what
    they do not deliver, and the client sends it (docs/weights.md)."""

    T: ClassVar[str] = "tensor_holders"
    holders: tuple[str, ...]
    grants: tuple[tuple[str, bytes], ...] = ()
    token: bytes | None = None  # the client's upload token: the worker grants on what it fetches with it

    def to_wire(self) -> dict[str, Any]:
        d = {"t": self.T, "holders": list(self.holders)}
        if self.grants:
            d["grants"] = [[peer, grant] for peer, grant in self.grants]
        if self.token is not None:
            d["token"] = self.token
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "TensorHolders":
        raw = typed_field(d, "holders", list)
        if not (0 < len(raw) <= MAX_HOLDERS and all(isinstance(h, str) and PEER_ID_RE.match(h) for h in raw)):
            raise ProtocolError(f"tensor_holders: holders must be 1 to {MAX_HOLDERS} peer ids")
        holders = tuple(dict.fromkeys(raw))
        return cls(holders, _grants(d, set(holders), "tensor_holders"), proof_field(d, "token", "tensor_holders"))


def _grants(d: dict, named: set[str], what: str) -> tuple[tuple[str, bytes], ...]:
    """A message's ``grants``: [holder's peer id, proof] pairs, each holder one the message names."""
    grants = d.get("grants") or []
    if not (isinstance(grants, list) and len(grants) <= MAX_HOLDERS and all(
            isinstance(g, list) and len(g) == 2 and g[0] in named and isinstance(g[1], bytes)
            and len(g[1]) == PROOF_BYTES for g in grants)):
        raise ProtocolError(f"{what}: grants must be [holder's peer id, {PROOF_BYTES}-byte proof] pairs")
    return tuple((g[0], g[1]) for g in grants)



@dataclass(frozen=True, slots=True)
class GetPiece(Message):
    """Ask a peer for piece ``index`` of a program it holds (pieces of ``piece_size`` bytes). ``grant``: the proof the
    job's client gave for this holder (:class:`Pieces`), needed unless the program is shared. ``tensor``: ``program``
    is the sha256 of a tensor of a checkpoint the peer keeps in its models dirs (public: no grant), its pieces of
    ``piece_size_for`` its length. ``have``: the fetcher takes a :class:`Have` for a piece the holder is still
    getting (an older fetcher hears "busy", and the stream ends). ``sent``: it also takes a :class:`Have` naming the
    piece among those sent already (a holder whose copy comes from its client sends each piece once while it comes;
    to an older fetcher, which would ask again at once, it sends them as often as asked)."""

    T: ClassVar[str] = "get_piece"
    program: str
    index: int
    piece_size: int
    grant: bytes | None = None
    tensor: bool = False
    have: bool = False
    sent: bool = False

    def to_wire(self) -> dict[str, Any]:
        d = {"t": self.T, "program": self.program, "index": self.index, "piece_size": self.piece_size}
        if self.grant is not None:
            d["grant"] = self.grant
        if self.tensor:
            d["tensor"] = True
        if self.have:
            d["have"] = True
        if self.sent:
            d["sent"] = True
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "GetPiece":
        program = program_hash_field(d)
        grant = proof_field(d, "grant", "get_piece")
        return cls(program, size_field(d, "index"), size_field(d, "piece_size"), grant,
                   bool(typed_field(d, "tensor", bool, optional=True)),
                   bool(typed_field(d, "have", bool, optional=True)),
                   bool(typed_field(d, "sent", bool, optional=True)))


@dataclass(frozen=True, slots=True)
class Have(Message):
    """A holder still getting the program answers a piece it does not have yet with the pieces it has (a bitmap,
    piece ``i`` in bit ``i % 8`` of byte ``i // 8``; short: the rest are not here), after waiting a moment for that
    one; the stream stays open (BitTorrent's "have"). The fetcher asks it for pieces it has, and sees whether its
    copy is still growing.

    ``sent`` (same form): of those, the pieces it already sent to another fetcher while its copy still comes from
    the client itself. Such a holder has one copy of its client's uplink to hand on, so each piece leaves it once
    (BitTorrent's super-seeding); a request for one of them is answered with this message, naming the piece among
    ``pieces`` and ``sent``: get it from the fetchers that have it."""

    T: ClassVar[str] = "have"
    pieces: bytes = b""
    sent: bytes = b""

    def to_wire(self) -> dict[str, Any]:
        d = {"t": self.T, "pieces": self.pieces}
        if self.sent:
            d["sent"] = self.sent
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "Have":
        return cls(_bitmap(d, "pieces"), _bitmap(d, "sent", optional=True))

    @classmethod
    def of(cls, indices, count: int, sent=()) -> "Have":
        return cls(_bits(indices, count), _bits(sent, count) if sent else b"")

    def indices(self) -> set[int]:
        return _indices(self.pieces)

    def sent_indices(self) -> set[int]:
        return _indices(self.sent)


def _bits(indices, count: int) -> bytes:
    bits = bytearray(-(-count // 8))
    for i in indices:
        bits[i // 8] |= 1 << (i % 8)
    return bytes(bits)


def _indices(bits: bytes) -> set[int]:
    return {8 * k + b for k, byte in enumerate(bits) if byte for b in range(8) if byte >> b & 1}


def _bitmap(d: dict, name: str, optional: bool = False) -> bytes:
    bits = typed_field(d, name, bytes, optional=optional) or b""
    if len(bits) > -(-MAX_PIECES // 8):
        raise ProtocolError(f"{d.get('t')}: {name!r} is a bitmap of at most {MAX_PIECES} pieces")
    return bits


@dataclass(frozen=True, slots=True)
class PieceData(Message):
    """Announces the piece's raw bytes, which follow on the stream. ``have``: from a holder still getting the program,
    to a fetcher that takes :class:`Have`, the pieces it has (the same bitmap): fetchers learn what each other has as
    they fetch, and ask the holder nearest the client only for what no one else has yet. ``sent``: as
    :attr:`Have.sent`."""

    T: ClassVar[str] = "piece_data"
    size: int
    have: bytes | None = None
    sent: bytes = b""

    def to_wire(self) -> dict[str, Any]:
        d = {"t": self.T, "size": self.size}
        if self.have is not None:
            d["have"] = self.have
        if self.sent:
            d["sent"] = self.sent
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "PieceData":
        have = d.get("have")
        if have is not None:
            have = _bitmap(d, "have")
        return cls(size_field(d, "size"), have, _bitmap(d, "sent", optional=True))
