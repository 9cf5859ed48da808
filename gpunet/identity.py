"""A node's one identity: an Ed25519 key that is at once its libp2p peer id, its DHT record signer and its receipt signer.

The key file is a libp2p protobuf ``PrivateKey`` (``key_type=Ed25519``, ``data`` = 32-byte seed + 32-byte public key),
the format go-libp2p reads, so the same file is handed to hivemind's p2p daemon as ``identity_path``. The peer id
(``12D3KooW…``) is the identity multihash of the protobuf ``PublicKey``: anyone can recover the public key from a peer
id alone, which is how signatures on records and receipts are checked without any key exchange.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from gpunet.config import resolve_data_dir
from gpunet.errors import IdentityError

KEY_FILENAME = "identity.key"

_IDENTITY_MULTIHASH = 0x00  # multihash code for "identity": the digest is the data itself

# libp2p's crypto.proto messages are {1: KeyType key_type, 2: bytes data}; for Ed25519 (KeyType 1) with fixed-size
# data their canonical encoding is a fixed 4-byte prefix. Encoding them by hand keeps this module free of hivemind's
# (torch-importing) package, so ledger commands start fast; tests check the bytes against hivemind's protobuf classes.
_ED25519_PUBLIC_PREFIX = bytes([0x08, 0x01, 0x12, 32])
_ED25519_PRIVATE_PREFIX = bytes([0x08, 0x01, 0x12, 64])
_ED25519_PUBLIC_PROTO_LEN = len(_ED25519_PUBLIC_PREFIX) + 32


def peer_id_from_public_bytes(public: bytes) -> str:
    """The libp2p peer id (base58) of a raw 32-byte Ed25519 public key."""
    proto = _ED25519_PUBLIC_PREFIX + public
    return base58.b58encode(bytes([_IDENTITY_MULTIHASH, len(proto)]) + proto).decode()


@functools.lru_cache(maxsize=65536)
def public_key_from_peer_id(peer_id: str) -> Ed25519PublicKey:
    """Recover the Ed25519 public key inlined in a peer id; raises IdentityError for anything else."""
    try:
        raw = base58.b58decode(peer_id)
    except Exception as e:
        raise IdentityError(f"peer id {peer_id!r} is not base58") from e
    if len(raw) != 2 + _ED25519_PUBLIC_PROTO_LEN or raw[0] != _IDENTITY_MULTIHASH or raw[1] != len(raw) - 2:
        raise IdentityError(f"peer id {peer_id!r} does not inline an Ed25519 public key")
    if raw[2:6] != _ED25519_PUBLIC_PREFIX:
        raise IdentityError(f"peer id {peer_id!r} is not an Ed25519 identity")
    return Ed25519PublicKey.from_public_bytes(raw[6:])


def verify(peer_id: str, signature: bytes, message: bytes) -> bool:
    """Whether ``signature`` over ``message`` was made by the key behind ``peer_id``. Never raises on bad input."""
    try:
        public_key_from_peer_id(peer_id).verify(signature, message)
        return True
    except (IdentityError, InvalidSignature, ValueError, TypeError):
        return False


@dataclass(frozen=True)
class Identity:
    """A node's private key with its derived peer id."""

    private_key: Ed25519PrivateKey
    path: Path | None = None

    @classmethod
    def generate(cls) -> "Identity":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, data_dir: str | os.PathLike | None = None) -> "Identity":
        """Read ``<data_dir>/identity.key``, creating it (mode 0600) on first run."""
        path = resolve_data_dir(data_dir) / KEY_FILENAME
        if path.exists():
            return cls.load(path)
        identity = cls.generate()
        identity.save(path)
        return cls(identity.private_key, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Identity":
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise IdentityError(f"cannot read identity key {path}: {e.strerror}") from e
        if len(data) != len(_ED25519_PRIVATE_PREFIX) + 64 or not data.startswith(_ED25519_PRIVATE_PREFIX):
            raise IdentityError(f"identity key {path} is not a libp2p Ed25519 PrivateKey (seed + public key)")
        key_data = data[len(_ED25519_PRIVATE_PREFIX) :]
        private_key = Ed25519PrivateKey.from_private_bytes(key_data[:32])
        if _public_bytes(private_key) != key_data[32:]:
            raise IdentityError(f"identity key {path} is inconsistent: its public half does not match its seed")
        return cls(private_key, path)

    def save(self, path: str | os.PathLike) -> None:
        """Write the key atomically with mode 0600 (never readable by others, not even briefly)."""
        path = Path(path)
        seed = self.private_key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        proto = _ED25519_PRIVATE_PREFIX + seed + self.public_bytes
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, proto)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    @functools.cached_property
    def public_bytes(self) -> bytes:
        return _public_bytes(self.private_key)

    @functools.cached_property  # every receipt and record names it: derive it once
    def peer_id(self) -> str:
        return peer_id_from_public_bytes(self.public_bytes)

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)


def short_id(peer_id: str) -> str:
    """The last characters of a peer id: the leading ``12D3KooW`` is the same for every Ed25519 peer."""
    return "…" + peer_id[-8:]


def _public_bytes(private_key: Ed25519PrivateKey) -> bytes:
    return private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
