"""The messages that ask a node about itself rather than run a job: ``ping`` (Ping -> Pong: liveness, clock and an
echo), ``info`` (GetInfo -> Info: the live record), ``prove`` (ProveSpeed -> SpeedCommitment, then OpenProof ->
ProofOpening: a speed challenge, :mod:`gpunet.speedproof`), ``hello`` (Hello -> Greeting: which network a node runs,
gpunet.dht.hello) and ``reach`` (CheckReach -> ReachResult: dial the caller back, gpunet.dht.reachability).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from gpunet.config import NETWORK_NAME
from gpunet.errors import ProtocolError
from gpunet.protocol.fields import Message, is_index, text_field, time_field, typed_field
from gpunet.speedproof import (
    COMMIT_BYTES,
    MAX_PRODUCTS,
    PICK_PRODUCTS,
    PICK_ROWS,
    SEED_BYTES,
    SIZES,
    Challenge,
    Opening,
)

#: An Ed25519 signature.
SIGNATURE_BYTES = 64
#: The most a ping echoes: a session step's hidden state (d_model 16,384 in fp32), so a raw round trip can stand beside
#: a step of the same size (scripts/bench_pipeline.py's baseline).
MAX_PING_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Ping(Message):
    """A liveness and clock probe (and the raw-RPC baseline in benchmarks): the echo comes back."""

    T: ClassVar[str] = "ping"
    echo: bytes = b""

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "echo": self.echo}

    @classmethod
    def from_wire(cls, d: dict) -> "Ping":
        return cls(typed_field(d, "echo", bytes, optional=True) or b"")


@dataclass(frozen=True, slots=True)
class Pong(Message):
    T: ClassVar[str] = "pong"
    time: float
    echo: bytes = b""

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "time": self.time, "echo": self.echo}

    @classmethod
    def from_wire(cls, d: dict) -> "Pong":
        return cls(time_field(d, "time"), typed_field(d, "echo", bytes, optional=True) or b"")


@dataclass(frozen=True, slots=True)
class GetInfo(Message):
    T: ClassVar[str] = "get_info"

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T}

    @classmethod
    def from_wire(cls, d: dict) -> "GetInfo":
        return cls()


@dataclass(frozen=True, slots=True)
class Info(Message):
    """A worker's live record (as in the DHT) and its clock, straight from the worker."""

    T: ClassVar[str] = "info"
    time: float
    record: dict

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "time": self.time, "record": self.record}

    @classmethod
    def from_wire(cls, d: dict) -> "Info":
        return cls(time_field(d, "time"), typed_field(d, "record", dict))


@dataclass(frozen=True, slots=True)
class ProveSpeed(Message):
    """A speed challenge (:mod:`gpunet.speedproof`): multiply the seed's products for up to ``seconds``, then commit.
    ``bind``: compute the matrices for the prover's own peer id and sign the commitment (the form that cannot be
    relayed); without it, the unbound form older clients send. The message never names the id: the worker uses its
    own."""

    T: ClassVar[str] = "prove_speed"
    seed: bytes
    n: int
    seconds: float
    dtype: str = "fp32"
    bind: bool = False

    def to_wire(self) -> dict[str, Any]:
        d = {"t": self.T, "seed": self.seed, "n": self.n, "seconds": float(self.seconds), "dtype": self.dtype}
        if self.bind:
            d["bind"] = True
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "ProveSpeed":
        challenge = Challenge(typed_field(d, "seed", bytes), typed_field(d, "n", int), time_field(d, "seconds"),
                              typed_field(d, "dtype", str, optional=True) or "fp32")
        try:
            challenge.check()
        except ValueError as e:
            raise ProtocolError(f"speed challenge: {e}") from None
        bind = typed_field(d, "bind", bool, optional=True) or False
        return cls(challenge.seed, challenge.n, challenge.seconds, challenge.dtype, bind)


@dataclass(frozen=True, slots=True)
class SpeedCommitment(Message):
    """The products done within the challenge's time, as one commitment each (in order, concatenated); for a bound
    challenge, the prover's Ed25519 signature over the challenge, its id and the commitments
    (:meth:`gpunet.speedproof.Challenge.statement`)."""

    T: ClassVar[str] = "speed_commitment"
    commitments: tuple[bytes, ...]
    signature: bytes = b""

    def to_wire(self) -> dict[str, Any]:
        d = {"t": self.T, "commitments": b"".join(self.commitments)}
        if self.signature:
            d["signature"] = self.signature
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "SpeedCommitment":
        raw = typed_field(d, "commitments", bytes)
        if not raw or len(raw) % COMMIT_BYTES or len(raw) > MAX_PRODUCTS * COMMIT_BYTES:
            raise ProtocolError(f"a speed commitment is 1 to {MAX_PRODUCTS} hashes of {COMMIT_BYTES} bytes")
        signature = typed_field(d, "signature", bytes, optional=True) or b""
        if len(signature) > SIGNATURE_BYTES:
            raise ProtocolError(f"a speed commitment's signature is {SIGNATURE_BYTES} bytes")
        return cls(tuple(raw[i:i + COMMIT_BYTES] for i in range(0, len(raw), COMMIT_BYTES)), signature)


@dataclass(frozen=True, slots=True)
class OpenProof(Message):
    """Open these products of a challenge this client sent: ``picks`` maps a product to the rows wanted."""

    T: ClassVar[str] = "open_proof"
    seed: bytes
    n: int
    picks: dict[int, list[int]]

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "seed": self.seed, "n": self.n, "picks": [[j, list(r)] for j, r in self.picks.items()]}

    @classmethod
    def from_wire(cls, d: dict) -> "OpenProof":
        seed, n, raw = typed_field(d, "seed", bytes), typed_field(d, "n", int), typed_field(d, "picks", list)
        if len(seed) != SEED_BYTES or n not in SIZES or not 0 < len(raw) <= PICK_PRODUCTS:
            raise ProtocolError("an opening names its challenge and 1 to %d products" % PICK_PRODUCTS)
        picks: dict[int, list[int]] = {}
        for item in raw:
            ok = (isinstance(item, list) and len(item) == 2 and is_index(item[0], MAX_PRODUCTS)
                  and isinstance(item[1], list) and 0 < len(item[1]) <= PICK_ROWS
                  and all(is_index(i, n) for i in item[1]) and item[0] not in picks)
            if not ok:
                raise ProtocolError(f"an opening asks for up to {PICK_ROWS} rows < {n} of distinct products")
            picks[item[0]] = sorted(set(item[1]))
        return cls(seed, n, picks)


@dataclass(frozen=True, slots=True)
class ProofOpening(Message):
    """Per opened product: its digest vector and the rows asked for (see :class:`gpunet.speedproof.Opening`)."""

    T: ClassVar[str] = "proof_opening"
    openings: tuple  # of speedproof.Opening

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "openings": [[o.product, o.digests, [[i, r] for i, r in o.rows.items()]]
                                          for o in self.openings]}

    @classmethod
    def from_wire(cls, d: dict) -> "ProofOpening":
        raw = typed_field(d, "openings", list)
        if len(raw) > PICK_PRODUCTS:
            raise ProtocolError(f"a proof opening opens at most {PICK_PRODUCTS} products")
        openings = []
        for item in raw:
            ok = (isinstance(item, list) and len(item) == 3 and is_index(item[0], MAX_PRODUCTS)
                  and isinstance(item[1], bytes) and isinstance(item[2], list) and len(item[2]) <= PICK_ROWS
                  and all(isinstance(r, list) and len(r) == 2 and is_index(r[0], 1 << 16) and isinstance(r[1], bytes)
                          for r in item[2]))
            if not ok:
                raise ProtocolError("a proof opening is [product, digests, [[row, bytes], ...]] per product")
            openings.append(Opening(item[0], item[1], {r[0]: r[1] for r in item[2]}))
        return cls(tuple(openings))


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """"Which network do you run?" (the ``hello`` door, outside every network)."""

    T: ClassVar[str] = "hello"

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T}

    @classmethod
    def from_wire(cls, d: dict) -> "Hello":
        return cls()


@dataclass(frozen=True, slots=True)
class Greeting(Message):
    """A node's answer to Hello: the network it runs, its role (worker, bootstrap) and gpunet version."""

    T: ClassVar[str] = "greeting"
    network: str
    role: str = ""
    version: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "network": self.network, "role": self.role, "version": self.version}

    @classmethod
    def from_wire(cls, d: dict) -> "Greeting":
        network = typed_field(d, "network", str)
        if not NETWORK_NAME.match(network):  # it is shown in a command to type: nothing but a network name
            raise ProtocolError("a greeting names a network: 1-64 letters, digits, '-' or '_'")
        return cls(network, text_field(d, "role", 32), text_field(d, "version", 32))


#: Ports one reachability check may ask to be dialled on.
MAX_REACH_PORTS = 4


@dataclass(frozen=True, slots=True)
class CheckReach(Message):
    """"Dial me back": open a TCP connection to each of these ports at the address you see me coming from."""

    T: ClassVar[str] = "check_reach"
    ports: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "ports": list(self.ports)}

    @classmethod
    def from_wire(cls, d: dict) -> "CheckReach":
        ports = typed_field(d, "ports", list)
        if not 0 < len(ports) <= MAX_REACH_PORTS or not all(is_index(p, 65536) and p > 0 for p in ports):
            raise ProtocolError(f"a reachability check names 1 to {MAX_REACH_PORTS} TCP ports")
        return cls(tuple(dict.fromkeys(ports)))


@dataclass(frozen=True, slots=True)
class ReachResult(Message):
    """The address the caller was seen at, and which of its ports a fresh connection from here reached."""

    T: ClassVar[str] = "reach_result"
    observed: str
    open: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "observed": self.observed, "open": list(self.open)}

    @classmethod
    def from_wire(cls, d: dict) -> "ReachResult":
        ports = typed_field(d, "open", list)
        if len(ports) > MAX_REACH_PORTS or not all(is_index(p, 65536) for p in ports):
            raise ProtocolError("a reachability result names at most a few TCP ports")
        return cls(text_field(d, "observed", 64), tuple(ports))
