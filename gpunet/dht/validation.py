"""DHT record validators: every gpunet record is signed by its owner and schema-checked, on store and on read.

Two hivemind ``RecordValidatorBase`` s, merged by priority as hivemind intends:

* :class:`OwnerSignatureValidator` (priority 10, runs first on validation, last on signing) protects every key of a
  network's namespace: the record's subkey must be a peer id, and the value must carry an Ed25519 signature by that
  peer over (key, subkey, value, expiration). Since an Ed25519 peer id *is* the public key, no key exchange is
  needed, a peer cannot write under another's subkey, and an old record cannot be replayed with a later expiration.
* :class:`WorkerRecordValidator` (priority 0) checks the signature-stripped value against :class:`WorkerRecord`.

hivemind hands validators the DHT *key id* (a hash), not the key; both validators therefore know the exact key ids of
their network's namespace, and leave other keys (another network's, hivemind's own) to their own validators.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Iterable

import msgpack
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time

from gpunet.dht.records import (
    MAX_RECORD_BYTES,
    WorkerRecord,
    worker_bucket,
    worker_keys,
)
from gpunet.errors import GpunetError
from gpunet.identity import Identity, verify
from gpunet.utils import LRU

#: Appended to a signed value, followed by the 64-byte Ed25519 signature.
SIGNATURE_TAG = b"\x00gpunet-sig-v1\x00"
_SIGNATURE_LEN = 64
_FOOTER_LEN = len(SIGNATURE_TAG) + _SIGNATURE_LEN

#: A record may not claim to live longer than this: bounds how long a dead peer's last record can linger.
MAX_RECORD_TTL = 600.0
_MAX_SUBKEY_BYTES = 128


class _VerdictCache:
    """Bounded LRU of verdicts on exact record bytes.

    A listing receives each record from several replicas, and clients list again and again; re-checking the same
    bytes would dominate discovery (Ed25519 verification is ~70 us a record). A verdict on identical bytes cannot
    change, so it is looked up by a digest of everything the check depends on.
    """

    def __init__(self, capacity: int = 200_000):
        self._verdicts: LRU[bytes, bool] = LRU(capacity)

    @staticmethod
    def digest(*parts: bytes) -> bytes:
        h = hashlib.blake2b(digest_size=20)
        for part in parts:
            h.update(len(part).to_bytes(4, "big"))
            h.update(part)
        return h.digest()

    def get(self, digest: bytes) -> bool | None:
        return self._verdicts.get(digest)

    def put(self, digest: bytes, verdict: bool) -> bool:
        self._verdicts.put(digest, verdict)
        return verdict


def key_id(key: str) -> bytes:
    """The bytes hivemind passes to validators as ``record.key`` for a given DHT key."""
    return DHTID.generate(source=key).to_bytes()


def signing_bytes(record: DHTRecord) -> bytes:
    """What an owner signs: the whole record, expiration included, domain-separated from any other signature."""
    return msgpack.packb([b"gpunet-dht-record", record.key, record.subkey, record.value, record.expiration_time])


def split_signed_value(value: bytes) -> tuple[bytes, bytes] | None:
    """(payload, signature) of a signed value, or None when it carries no well-formed signature footer."""
    if len(value) < _FOOTER_LEN or value[-_FOOTER_LEN:-_SIGNATURE_LEN] != SIGNATURE_TAG:
        return None
    return value[:-_FOOTER_LEN], value[-_SIGNATURE_LEN:]


def _subkey_owner(record: DHTRecord) -> str | None:
    """The peer id a record's subkey names, if the subkey is exactly its canonical encoding. Readers re-encode subkeys
    canonically before checking signatures, so a record signed over another encoding of the same id (str16 for str8)
    would pass here and fail for every reader: refused now, at store time."""
    if record.subkey is None or len(record.subkey) > _MAX_SUBKEY_BYTES:
        return None
    try:
        owner = msgpack.unpackb(record.subkey, raw=False)
    except Exception:
        return None
    if not isinstance(owner, str) or MSGPackSerializer.dumps(owner) != record.subkey:
        return None
    return owner


class OwnerSignatureValidator(RecordValidatorBase):
    """Only a subkey's owner may write it; signs records for the identities it holds (one, or many in benchmarks)."""

    def __init__(self, protected_keys: Iterable[str], identities: Iterable[Identity] = ()):
        self._protected = frozenset(key_id(k) for k in protected_keys)
        self._keyring = {identity.peer_id: identity for identity in identities}
        self._verdicts = _VerdictCache()

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in self._protected:
            return True
        if record.expiration_time > get_dht_time() + MAX_RECORD_TTL:
            return False
        digest = _VerdictCache.digest(record.key, record.subkey or b"", record.value, repr(record.expiration_time).encode())
        verdict = self._verdicts.get(digest)
        if verdict is None:
            verdict = self._verdicts.put(digest, self._check_signature(record))
        return verdict

    def _check_signature(self, record: DHTRecord) -> bool:
        owner = _subkey_owner(record)
        if owner is None:
            return False
        split = split_signed_value(record.value)
        if split is None:
            return False
        payload, signature = split
        return verify(owner, signature, signing_bytes(dataclasses.replace(record, value=payload)))

    def sign_value(self, record: DHTRecord) -> bytes:
        if record.key not in self._protected:
            return record.value
        identity = self._keyring.get(_subkey_owner(record))
        if identity is None:
            return record.value  # not ours to sign: every honest peer will refuse it
        return record.value + SIGNATURE_TAG + identity.sign(signing_bytes(record))

    def strip_value(self, record: DHTRecord) -> bytes:
        if record.key not in self._protected:
            return record.value
        split = split_signed_value(record.value)
        return split[0] if split is not None else record.value

    @property
    def priority(self) -> int:
        return 10  # validate (and strip) before the schema validator parses the value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, OwnerSignatureValidator):
            return False
        self._protected = self._protected | other._protected
        self._keyring.update(other._keyring)
        return True


class WorkerRecordValidator(RecordValidatorBase):
    """Values under a network's worker keys must parse as a :class:`WorkerRecord` of a format we understand."""

    def __init__(self, network: str):
        self._bucket_of = {key_id(k): bucket for bucket, k in enumerate(worker_keys(network))}
        self._verdicts = _VerdictCache()

    def validate(self, record: DHTRecord) -> bool:
        bucket = self._bucket_of.get(record.key)
        if bucket is None:
            return True
        if len(record.value) > MAX_RECORD_BYTES:
            return False
        owner = _subkey_owner(record)
        if owner is None or worker_bucket(owner) != bucket:
            return False  # one record per worker, in its own bucket: no duplicates with conflicting states
        digest = _VerdictCache.digest(record.value)
        verdict = self._verdicts.get(digest)
        if verdict is None:
            verdict = self._verdicts.put(digest, self._parses(record.value))
        return verdict

    @staticmethod
    def _parses(value: bytes) -> bool:
        try:
            WorkerRecord.from_wire_bytes(value)
        except GpunetError:
            return False
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, WorkerRecordValidator):
            return False
        self._bucket_of = {**self._bucket_of, **other._bucket_of}
        return True


def network_validators(network: str, identities: Iterable[Identity] = ()) -> list[RecordValidatorBase]:
    """The validators every node of ``network`` installs in its DHT."""
    return [OwnerSignatureValidator(worker_keys(network), identities), WorkerRecordValidator(network)]
