import os
import stat

import pytest

from gpunet.errors import IdentityError
from gpunet.identity import Identity, public_key_from_peer_id, verify


def test_key_is_created_private_and_reused(tmp_path):
    first = Identity.load_or_create(tmp_path)
    mode = stat.S_IMODE(os.stat(tmp_path / "identity.key").st_mode)
    assert mode == 0o600
    again = Identity.load_or_create(tmp_path)
    assert again.peer_id == first.peer_id
    assert first.peer_id.startswith("12D3KooW")


def test_env_var_selects_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUNET_DATA_DIR", str(tmp_path / "node"))
    ident = Identity.load_or_create()
    assert (tmp_path / "node" / "identity.key").exists()
    assert Identity.load_or_create(tmp_path / "node").peer_id == ident.peer_id


def test_peer_id_carries_the_public_key():
    ident = Identity.generate()
    sig = ident.sign(b"hello")
    assert verify(ident.peer_id, sig, b"hello")
    assert not verify(ident.peer_id, sig, b"hellO")
    assert not verify(Identity.generate().peer_id, sig, b"hello")
    assert public_key_from_peer_id(ident.peer_id).public_bytes_raw() == ident.public_bytes


@pytest.mark.parametrize("bad", ["", "not-base58-0OIl", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"])
def test_non_ed25519_peer_ids_are_refused(bad):
    with pytest.raises(IdentityError):
        public_key_from_peer_id(bad)
    assert not verify(bad, b"x" * 64, b"m")


def test_corrupt_key_file_is_a_clear_error(tmp_path):
    (tmp_path / "identity.key").write_bytes(b"\x00garbage")
    with pytest.raises(IdentityError):
        Identity.load_or_create(tmp_path)


def test_peer_id_matches_libp2p_daemon(tmp_path):
    """The daemon, given our key file, announces exactly the peer id we compute."""
    import hivemind

    ident = Identity.load_or_create(tmp_path)
    dht = hivemind.DHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(ident.path), check_if_identity_free=False
    )
    try:
        assert dht.peer_id.to_base58() == ident.peer_id
    finally:
        dht.shutdown()


def test_hand_encoded_keys_match_libp2p_protobuf(tmp_path):
    from hivemind.proto import crypto_pb2

    ident = Identity.load_or_create(tmp_path)
    parsed = crypto_pb2.PrivateKey.FromString((tmp_path / "identity.key").read_bytes())
    assert parsed.key_type == crypto_pb2.KeyType.Ed25519 and parsed.data[32:] == ident.public_bytes
    public = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.Ed25519, data=ident.public_bytes).SerializeToString()
    import base58

    assert base58.b58decode(ident.peer_id)[2:] == public
