"""The receipt: what one finished job cost, signed by the worker that ran it and countersigned by the client that paid.

A receipt is valid anywhere by itself. Its worker id and client id are libp2p peer ids, which inline the Ed25519 public
keys, so checking both signatures needs no key exchange and no server.

Encoding (format version 3), chosen so a signature is reproducible byte for byte:

- the *body* is a msgpack array ``[FORMAT_VERSION, job_id, client_id, worker_id, program_hash, input_hash, output_hash,
  flops, wall_time_us, price, max_price, amount, started_at_us, ended_at_us, lane]`` in that fixed order, packed with
  msgpack's smallest-form rules (ints, str, nil only: no floats, no maps), so one set of fields has exactly one body;
- both parties sign ``signing_domain(version) + body`` (the domain keeps a receipt signature from ever doubling as a
  signature on a DHT record made by the same key, or as one on a receipt of another format);
- the stored form is the msgpack array ``[body, worker_signature, client_signature]``; decoding keeps the body bytes,
  so verification never re-encodes, and refuses a body that is not the canonical encoding of its own fields.

Money is integers only, so both sides compute the identical amount: a price is in nano-credits per TFLOP (10**12
floating-point operations) and an amount in nano-credits, ``amount = ceil(flops * price / 10**12)`` (see
:func:`compute_amount`, the one place that rule lives). Rounding up means paid work is never worth zero: at the default
price of 1 credit/TFLOP a 1 MFLOP job earns 0.000001 credits, and the rounding is at most one nano-credit a job.

Format 3 added ``lane`` (``interactive``, ``batch``, or ``background``: the volunteer's own work; see
docs/market.md), so a receipt says which market its ``price`` was charged in. Format 2 receipts, signed before lanes
existed, read as ``interactive``; they verify as they were signed.

Format 1 (micro-credits per PFLOP, amounts in micro-credits rounded down, so jobs under 1 GFLOP were worth 0 at the
default price) is still read and verified, so ledgers written before keep their value: its price is the same number in
either unit (1 micro-credit/PFLOP = 1 nano-credit/TFLOP) and its amount is held here in nano-credits (x 1000), so every
reader of :class:`Receipt` sees one unit; the body is re-encoded in the format's own terms for its signatures.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from dataclasses import dataclass, field
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from typing import Any

import msgpack
from cryptography.exceptions import InvalidSignature

from gpunet.errors import IdentityError, InvalidReceipt
from gpunet.identity import Identity, public_key_from_peer_id
from gpunet.utils import LRU

FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
NANO = 10**9  # nano-credits per credit
FLOPS_PER_TFLOP = 10**12
_V1_AMOUNT_SCALE = 1000  # format 1 amounts were micro-credits
MAX_RECEIPT_BYTES = 4096  # a real receipt is ~400 bytes; anything larger is refused before it is decoded
SIGNATURE_LEN = 64

_MAX_UINT = 2**64 - 1  # msgpack's widest integer
_MAX_TEXT = 128
_TEXT_FIELDS = ("job_id", "client_id", "worker_id", "program_hash", "input_hash", "output_hash")
_INT_FIELDS = ("flops", "wall_time_us", "price", "amount", "started_at_us", "ended_at_us")
#: A lane's name (docs/market.md); readers accept lanes newer than they know, as names.
_LANE_RE = re.compile(r"[a-z]{1,16}\Z")
DEFAULT_LANE = "interactive"


def signing_domain(version: int = FORMAT_VERSION) -> bytes:
    return f"gpunet/receipt/v{version}".encode() + b"\x00"


SIGNING_DOMAIN = signing_domain()


def compute_amount(flops: int, price: int, version: int = FORMAT_VERSION) -> int:
    """Nano-credits owed for ``flops`` operations at ``price`` nano-credits per TFLOP, rounded up (never 0 for paid
    work). ``version=1`` gives a format-1 receipt's amount, converted to nano-credits."""
    if version == 1:
        return flops * price // 10**15 * _V1_AMOUNT_SCALE
    return -(-flops * price // FLOPS_PER_TFLOP)


def price_to_nano(price: float | str | Decimal) -> int:
    """A price in credits per TFLOP (as a user types it, e.g. ``2.5``) as integer nano-credits per TFLOP.

    Goes through the decimal text of the number, so ``0.1`` becomes exactly 100000000; rounds half-even to a
    nano-credit.
    """
    try:
        value = Decimal(str(price))
    except InvalidOperation:
        raise InvalidReceipt(f"price {price!r} is not a number") from None
    if not value.is_finite() or value < 0:
        raise InvalidReceipt(f"price {price!r} must be a finite number >= 0")
    return int((value * NANO).to_integral_value(rounding=ROUND_HALF_EVEN))


def format_credits(nano: int) -> str:
    """Nano-credits as an exact decimal string of credits, never a float: at least two decimals, more only where they
    are not zero (``1_500_000_000`` → ``"1.50"``, ``1234`` → ``"0.000001234"``)."""
    sign = "-" if nano < 0 else ""
    whole, frac = divmod(abs(nano), NANO)
    digits = f"{frac:09d}".rstrip("0").ljust(2, "0")
    return f"{sign}{whole}.{digits}"


def _check_signature(peer_id: str, signature: bytes, message: bytes, who: str) -> None:
    try:
        public_key_from_peer_id(peer_id)  # cached per peer id
    except IdentityError:
        raise InvalidReceipt(f"{who} id {peer_id!r} is not an Ed25519 peer id") from None
    if not _signature_valid(peer_id, signature, message):
        raise InvalidReceipt(f"{who} signature does not verify against {who} id {peer_id}")


class _Verdicts:
    """Signature verdicts memoised on the exact bytes: a receipt passes through countersign, append and settle on one
    node, and each step checks it; the verdict on identical bytes cannot change, so the Ed25519 work is done once.
    A signature this process has just made with its own key is recorded as valid without being checked again."""

    def __init__(self, size: int = 8192):
        self._known: LRU[tuple[str, bytes, bytes], bool] = LRU(size)
        self._lock = threading.Lock()  # ledger verification checks receipts from several threads

    def valid(self, peer_id: str, signature: bytes, message: bytes) -> bool:
        key = (peer_id, signature, message)
        with self._lock:
            verdict = self._known.get(key)
        if verdict is None:
            try:
                public_key_from_peer_id(peer_id).verify(signature, message)
                verdict = True
            except InvalidSignature:
                verdict = False
            self._remember(key, verdict)
        return verdict

    def made_here(self, peer_id: str, signature: bytes, message: bytes) -> None:
        self._remember((peer_id, signature, message), True)

    def _remember(self, key: tuple[str, bytes, bytes], verdict: bool) -> None:
        with self._lock:
            self._known.put(key, verdict)


_verdicts = _Verdicts()
_signature_valid = _verdicts.valid


def _sign(identity: Identity, message: bytes) -> bytes:
    signature = identity.sign(message)
    _verdicts.made_here(identity.peer_id, signature, message)
    return signature


@dataclass(frozen=True)
class Receipt:
    """One finished job: who ran what for whom, what it cost, and both parties' signatures over that.

    Money fields are integers: ``price`` and ``max_price`` (the client's bound, ``None`` for none) in nano-credits
    per TFLOP, ``amount`` in nano-credits (for a format-1 receipt too; see the module docstring). Times are integer
    microseconds (``started_at_us``/``ended_at_us`` since the Unix epoch, ``wall_time_us`` of execution).
    Construction checks types and ranges; :meth:`verify` checks the rules and the signatures.
    """

    job_id: str
    client_id: str
    worker_id: str
    program_hash: str
    input_hash: str
    output_hash: str
    flops: int
    wall_time_us: int
    price: int
    max_price: int | None
    amount: int
    started_at_us: int
    ended_at_us: int
    lane: str = DEFAULT_LANE  # the market it was sold in (format 3; older formats: interactive)
    worker_signature: bytes = b""
    client_signature: bytes = b""
    version: int = FORMAT_VERSION  # the format it was signed in; new receipts are always FORMAT_VERSION
    body: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in _TEXT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, str) or not 0 < len(value) <= _MAX_TEXT or not value.isprintable():
                raise InvalidReceipt(f"{name} must be printable text of 1-{_MAX_TEXT} characters, got {value!r:.80}")
        for name in _INT_FIELDS:
            _check_uint(name, getattr(self, name))
        if self.max_price is not None:
            _check_uint("max_price", self.max_price)
        for name in ("worker_signature", "client_signature"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) not in (0, SIGNATURE_LEN):
                raise InvalidReceipt(f"{name} must be empty or {SIGNATURE_LEN} bytes")
        if type(self.version) is not int or self.version not in READABLE_VERSIONS:
            raise InvalidReceipt(f"receipt format version {self.version!r} unknown (this gpunet reads "
                                 f"{', '.join(map(str, READABLE_VERSIONS))})")
        if not isinstance(self.lane, str) or not _LANE_RE.match(self.lane):
            raise InvalidReceipt(f"lane must be 1-16 lowercase letters, got {self.lane!r:.40}")
        if self.version < 3 and self.lane != DEFAULT_LANE:
            raise InvalidReceipt(f"a format-{self.version} receipt has no lane (it reads as {DEFAULT_LANE})")
        names = body_fields(self.version)
        fields = [getattr(self, name) for name in names]
        if self.version == 1:
            if self.amount % _V1_AMOUNT_SCALE:
                raise InvalidReceipt("a format-1 receipt's amount is whole micro-credits")
            fields[names.index("amount")] = self.amount // _V1_AMOUNT_SCALE
        body = msgpack.packb([self.version, *fields], use_bin_type=True)
        object.__setattr__(self, "body", body)

    def _with_signature(self, name: str, signature: bytes) -> "Receipt":
        """A copy with one signature set. The body is unchanged, so its fields are not checked again."""
        if not isinstance(signature, bytes) or len(signature) != SIGNATURE_LEN:
            raise InvalidReceipt(f"{name} must be {SIGNATURE_LEN} bytes")
        copy = object.__new__(Receipt)
        copy.__dict__.update(self.__dict__)
        copy.__dict__[name] = signature
        return copy

    # --- encoding ----------------------------------------------------------------------------------------------------

    def signing_bytes(self) -> bytes:
        """What both the worker and the client sign."""
        return signing_domain(self.version) + self.body

    def to_bytes(self) -> bytes:
        return msgpack.packb([self.body, self.worker_signature, self.client_signature], use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> "Receipt":
        """Decode a stored receipt; raises InvalidReceipt for anything malformed or non-canonical (never verifies)."""
        if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) > MAX_RECEIPT_BYTES:
            raise InvalidReceipt(f"an encoded receipt is bytes, at most {MAX_RECEIPT_BYTES} of them")
        try:
            envelope = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
            body, worker_signature, client_signature = envelope
            fields = msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=True)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
            raise InvalidReceipt(f"not an encoded receipt: {e}") from None
        if not isinstance(fields, list) or not fields:
            raise InvalidReceipt("receipt body is not a msgpack array")
        version = fields[0]
        if type(version) is not int or version not in READABLE_VERSIONS:
            raise InvalidReceipt(f"receipt format version {version!r:.20} unknown (this gpunet reads "
                                 f"{', '.join(map(str, READABLE_VERSIONS))})")
        names = body_fields(version)
        if len(fields) != 1 + len(names):
            raise InvalidReceipt(f"receipt body has {len(fields) - 1} fields, format {version} has {len(names)}")
        values = dict(zip(names, fields[1:]))
        if version == 1 and type(values["amount"]) is int:
            values["amount"] *= _V1_AMOUNT_SCALE
        receipt = cls(**values, worker_signature=worker_signature, client_signature=client_signature, version=version)
        if receipt.body != body:
            raise InvalidReceipt("receipt body is not in canonical encoding")
        if receipt.to_bytes() != bytes(data):  # one receipt, one byte string: the envelope is canonical too
            raise InvalidReceipt("receipt envelope is not in canonical encoding")
        return receipt

    def to_dict(self) -> dict[str, Any]:
        """Plain fields (signatures as hex) for JSON and tables; the exact receipt is ``to_bytes()``."""
        out: dict[str, Any] = {"format_version": self.version}
        out.update({name: getattr(self, name) for name in body_fields(FORMAT_VERSION)})  # lane too, for any format
        out["worker_signature"] = self.worker_signature.hex()
        out["client_signature"] = self.client_signature.hex()
        return out

    # --- checks ------------------------------------------------------------------------------------------------------

    @property
    def is_countersigned(self) -> bool:
        return bool(self.client_signature)

    def check_terms(self) -> None:
        """The rules any honest receipt obeys, signatures aside; raises InvalidReceipt naming the broken one."""
        if self.worker_id == self.client_id:
            raise InvalidReceipt("worker and client are the same identity")
        owed = compute_amount(self.flops, self.price, self.version)
        if self.amount != owed:
            raise InvalidReceipt(f"amount {self.amount} is not flops x price = {owed} nano-credits")
        if self.max_price is not None and self.price > self.max_price:
            raise InvalidReceipt(f"price {self.price} is above the client's bound {self.max_price}")
        if self.ended_at_us < self.started_at_us:
            raise InvalidReceipt("job ended before it started")

    def verify_worker_signature(self) -> None:
        if not self.worker_signature:
            raise InvalidReceipt("receipt is not signed by its worker")
        _check_signature(self.worker_id, self.worker_signature, self.signing_bytes(), "worker")

    def verify(self) -> None:
        """Raise InvalidReceipt unless this is a complete receipt: sound terms and both signatures valid."""
        self.check_terms()
        self.verify_worker_signature()
        if not self.client_signature:
            raise InvalidReceipt("receipt is not countersigned by its client")
        _check_signature(self.client_id, self.client_signature, self.signing_bytes(), "client")


_NOT_IN_BODY = ("worker_signature", "client_signature", "version", "body")
_BODY_FIELDS = tuple(f.name for f in dataclasses.fields(Receipt) if f.name not in _NOT_IN_BODY)  # the fixed order


def body_fields(version: int) -> tuple[str, ...]:
    """The fields a receipt body of ``version`` holds, in order (``lane`` came with format 3)."""
    return _BODY_FIELDS if version >= 3 else _BODY_FIELDS[:-1]


def _check_uint(name: str, value: object) -> None:
    if type(value) is not int or not 0 <= value <= _MAX_UINT:
        raise InvalidReceipt(f"{name} must be an integer in [0, 2**64), got {value!r:.40}")


# --- the flow: worker signs, client checks and countersigns, worker attaches the countersignature --------------------


def sign_as_worker(
    worker: Identity,
    *,
    job_id: str,
    client_id: str,
    program_hash: str,
    input_hash: str,
    output_hash: str,
    flops: int,
    wall_time_us: int,
    price: int,
    max_price: int | None,
    started_at_us: int,
    ended_at_us: int,
    lane: str = DEFAULT_LANE,
) -> Receipt:
    """The worker's half: the receipt for a job it ran, amount computed here, signed by ``worker``."""
    _check_uint("flops", flops)
    _check_uint("price", price)
    if compute_amount(flops, price) > _MAX_UINT:
        raise InvalidReceipt(f"{flops:.3g} FLOPs at {format_credits(price)} credits/TFLOP come to more than one receipt "
                             "can bill (2**64 nano-credits); split the work into smaller jobs")
    receipt = Receipt(
        job_id=job_id,
        client_id=client_id,
        worker_id=worker.peer_id,
        program_hash=program_hash,
        input_hash=input_hash,
        output_hash=output_hash,
        flops=flops,
        wall_time_us=wall_time_us,
        price=price,
        max_price=max_price,
        amount=compute_amount(flops, price),
        started_at_us=started_at_us,
        ended_at_us=ended_at_us,
        lane=lane,
    )
    receipt.check_terms()
    return receipt._with_signature("worker_signature", _sign(worker, receipt.signing_bytes()))


def countersign(
    receipt: Receipt,
    client: Identity,
    *,
    output_hash: str,
    max_price: int | None,
    flops: int | None = None,
    lane: str | None = None,
    check_worker_signature: bool = True,
) -> Receipt:
    """The client's half: check the receipt against what the client actually got and agreed to, then countersign.

    ``output_hash`` is the hash of the outputs the client received, ``max_price`` its bound for this job (nano-credits
    per TFLOP, ``None`` for none), ``flops`` its own count from the dry run when it made one, ``lane`` the lane it
    asked for (a format-2 receipt, from a worker that predates lanes, reads as interactive and passes for any: the
    price bound is what the client agreed to). Raises InvalidReceipt
    naming the first mismatch; a refused receipt is simply not countersigned.

    ``check_worker_signature=False`` is for a caller that got the receipt over a channel authenticated as the worker
    (libp2p) and verifies the complete receipt before storing it (``Ledger.append`` does): the terms are what the
    client agrees to, and a bad worker signature only makes the receipt void, which the store then refuses.
    """
    if receipt.client_id != client.peer_id:
        raise InvalidReceipt(f"receipt names client {receipt.client_id}, not this client {client.peer_id}")
    if receipt.output_hash != output_hash:
        raise InvalidReceipt("receipt's output hash does not match the outputs received")
    if receipt.max_price != max_price:
        raise InvalidReceipt(f"receipt records price bound {receipt.max_price}, the client asked for {max_price}")
    if flops is not None and receipt.flops != flops:
        raise InvalidReceipt(f"receipt bills {receipt.flops} FLOPs, the client counted {flops}")
    if lane is not None and receipt.version >= 3 and receipt.lane != lane:
        raise InvalidReceipt(f"receipt bills the {receipt.lane} lane, the client asked for {lane}")
    receipt.check_terms()
    if check_worker_signature:
        receipt.verify_worker_signature()
    return receipt._with_signature("client_signature", _sign(client, receipt.signing_bytes()))


def attach_countersignature(receipt: Receipt, client_signature: bytes) -> Receipt:
    """The worker's last step: the receipt it signed plus the client's countersignature, checked complete."""
    complete = receipt._with_signature("client_signature", client_signature)
    complete.verify()
    return complete
