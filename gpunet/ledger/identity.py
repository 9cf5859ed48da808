"""A node's one identity: an Ed25519 key that is at once its libp2p peer id, its DHT record signer and its receipt signer.

The key file is a libp2p protobuf ``PrivateKey`` (``key_type=Ed25519``, ``data`` = 32-byte seed + 32-byte public key),
the format go-libp2p reads, so the same file is handed to hivemind's p2p daemon as ``identity_path``. The peer id
(``12D3KooW…``) is the identity multihash of the protobuf ``PublicKey``: anyone can recover the public key from a peer
id alone, which is how signatures on records and receipts are checked without any key exchange.
"""

from __future__ import annotations

import base64
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PrivateFormat, PublicFormat, NoEncryption
from hivemind.proto import crypto_pb2

from gpunet.errors import ConfigError, IdentityError

KEY_FILENAME = "identity.key"
DEFAULT_DATA_DIR = "~/.gpunet"

_IDENTITY_MULTIHASH = 0x00  # multihash code for "identity": the digest is the data itself
_ED25519_PUBLIC_PROTO_LEN = 36  # protobuf PublicKey{key_type=Ed25519, data=<32 bytes>}


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The data dir from the argument, else ``GPUNET_DATA_DIR``, else ``~/.gpunet``; created if missing."""
    raw = data_dir if data_dir is not None else os.environ.get("GPUNET_DATA_DIR") or DEFAULT_DATA_DIR
    path = Path(raw).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise ConfigError(f"cannot create data dir {path}: {e.strerror}") from e
    return path


def peer_id_from_public_bytes(public: bytes) -> str:
    """The libp2p peer id (base58) of a raw 32-byte Ed25519 public key."""
    proto = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.Ed25519, data=public).SerializeToString()
    return base58.b58encode(bytes([_IDENTITY_MULTIHASH, len(proto)]) + proto).decode()


def public_key_from_peer_id(peer_id: str) -> Ed25519PublicKey:
    """Recover the Ed25519 public key inlined in a peer id; raises IdentityError for anything else."""
    try:
        raw = base58.b58decode(peer_id)
    except Exception as e:
        raise IdentityError(f"peer id {peer_id!r} is not base58") from e
    if len(raw) != 2 + _ED25519_PUBLIC_PROTO_LEN or raw[0] != _IDENTITY_MULTIHASH or raw[1] != len(raw) - 2:
        raise IdentityError(f"peer id {peer_id!r} does not inline an Ed25519 public key")
    try:
        proto = crypto_pb2.PublicKey.FromString(raw[2:])
    except Exception as e:
        raise IdentityError(f"peer id {peer_id!r} carries a malformed public key") from e
    if proto.key_type != crypto_pb2.KeyType.Ed25519 or len(proto.data) != 32:
        raise IdentityError(f"peer id {peer_id!r} is not an Ed25519 identity")
    return Ed25519PublicKey.from_public_bytes(proto.data)


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
        try:
            proto = crypto_pb2.PrivateKey.FromString(data)
        except Exception as e:
            raise IdentityError(f"identity key {path} is not a libp2p PrivateKey protobuf") from e
        if proto.key_type != crypto_pb2.KeyType.Ed25519 or len(proto.data) != 64:
            raise IdentityError(f"identity key {path} is not an Ed25519 key (a 64-byte seed+public pair)")
        private_key = Ed25519PrivateKey.from_private_bytes(proto.data[:32])
        if _public_bytes(private_key) != proto.data[32:]:
            raise IdentityError(f"identity key {path} is inconsistent: its public half does not match its seed")
        return cls(private_key, path)

    def save(self, path: str | os.PathLike) -> None:
        """Write the key atomically with mode 0600 (never readable by others, not even briefly)."""
        path = Path(path)
        seed = self.private_key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        proto = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=seed + self.public_bytes)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, proto.SerializeToString())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    @property
    def public_bytes(self) -> bytes:
        return _public_bytes(self.private_key)

    @property
    def peer_id(self) -> str:
        return peer_id_from_public_bytes(self.public_bytes)

    @property
    def short_id(self) -> str:
        return short_id(self.peer_id)

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)

    def fingerprint(self) -> str:
        return base64.b32encode(hashlib.sha256(self.public_bytes).digest()[:10]).decode().lower()


def short_id(peer_id: str) -> str:
    """The last characters of a peer id: the leading ``12D3KooW`` is the same for every Ed25519 peer."""
    return "…" + peer_id[-8:]


def _public_bytes(private_key: Ed25519PrivateKey) -> bytes:
    return private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
