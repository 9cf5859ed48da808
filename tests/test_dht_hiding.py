"""Nobody can hide the network: attacks on the worker buckets by a hostile DHT peer, over a real local swarm.

hivemind validates a dictionary value all-or-nothing and does not bound it, so before gpunet hardened both, one
record with a non-canonically encoded subkey hid a whole bucket of workers, and a few hundred padded sybil records
pushed a bucket past the p2p daemon's 4 MiB reply cap (see gpunet/dht/hardening.py).
"""

from __future__ import annotations

import hashlib

import hivemind
import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.routing import DHTID
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time

from gpunet.dht.records import DeviceInfo, WorkerRecord, worker_bucket, worker_key, worker_keys
from gpunet.dht.validation import SIGNATURE_TAG, OwnerSignatureValidator, WorkerRecordValidator, signing_bytes
from gpunet.identity import Identity

pytestmark = pytest.mark.swarm

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def sybil(tag: str, index: int) -> Identity:
    return Identity(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"{tag}-{index}".encode()).digest()))


def sybils_in_bucket(tag: str, bucket: int, count: int) -> list[int]:
    """Indices of ``count`` free identities whose records land in ``bucket`` (1 in 64 does: grinding is cheap)."""
    found, i = [], 0
    while len(found) < count:
        if worker_bucket(sybil(tag, i).peer_id) == bucket:
            found.append(i)
        i += 1
    return found


def fake_record(name: str) -> dict:
    return WorkerRecord(version="6.6.6", state="online", device=DeviceInfo(kind="cuda", name="H100 (sybil)"),
                        price=0.0, name=name).to_wire()


class NoSchema(WorkerRecordValidator):
    def validate(self, record):
        return True


class SignAnything(OwnerSignatureValidator):
    def validate(self, record):
        return True


def hostile_node(swarm) -> hivemind.DHT:
    """A DHT peer of the attacker's, which sends hand-made store requests to the honest peers (in client mode: it
    stores and serves nothing itself, so what readers see is what the honest peers serve)."""
    return hivemind.DHT(initial_peers=[swarm.bootstrap_addr], start=True, host_maddrs=LOOPBACK, client_mode=True,
                        record_validators=[SignAnything(worker_keys(swarm.network)), NoSchema(swarm.network)])


def _signed(identity: Identity, key_id: bytes, subkey: bytes, record: dict, expiration: float) -> bytes:
    from hivemind.dht.validation import DHTRecord

    payload = msgpack.packb(record, use_bin_type=True)
    return payload + SIGNATURE_TAG + identity.sign(signing_bytes(DHTRecord(key_id, subkey, payload, expiration)))


async def _send_to_every_peer(node, key_id: bytes, subkeys: list[bytes], values: list[bytes], expiration: float) -> int:
    """Store requests straight to every peer the attacker knows, 50 records a request; how many entries were taken."""
    accepted = 0
    for lo in range(0, len(subkeys), 50):
        n = len(subkeys[lo:lo + 50])
        request = dht_pb2.StoreRequest(keys=[key_id] * n, subkeys=subkeys[lo:lo + 50], values=values[lo:lo + 50],
                                       expiration_time=[expiration] * n, in_cache=[False] * n,
                                       peer=node.protocol.node_info)
        for _node_id, peer_id in node.protocol.routing_table.get_nearest_neighbors(DHTID.from_bytes(key_id), k=64):
            response = await node.protocol.get_stub(peer_id).rpc_store(request, timeout=30)
            accepted += sum(response.store_ok)
    return accepted


async def _store_non_canonical(_dht, node, network: str, tag: str, index: int) -> int:
    """Inside the attacker's DHT process: a correctly signed record whose subkey is the attacker's own id, encoded
    as str16 where msgpack's canonical form is str8."""
    identity = sybil(tag, index)
    key_id = DHTID.generate(source=worker_key(network, worker_bucket(identity.peer_id))).to_bytes()
    raw_id = identity.peer_id.encode()
    subkey = b"\xda" + len(raw_id).to_bytes(2, "big") + raw_id  # str16
    assert msgpack.unpackb(subkey) == identity.peer_id
    expiration = get_dht_time() + 120
    value = _signed(identity, key_id, subkey, fake_record("non-canonical"), expiration)
    return await _send_to_every_peer(node, key_id, [subkey], [value], expiration)


async def _store_padded(_dht, node, network: str, tag: str, indices: list[int], padding: int) -> int:
    """Inside the attacker's DHT process: validly signed records of many sybils of one bucket, each padded with an
    unknown field."""
    identities = [sybil(tag, i) for i in indices]
    key_id = DHTID.generate(source=worker_key(network, worker_bucket(identities[0].peer_id))).to_bytes()
    expiration = get_dht_time() + 120
    subkeys = [msgpack.packb(i.peer_id, use_bin_type=True) for i in identities]
    record = {**fake_record("sybil"), "padding": "x" * padding}
    values = [_signed(i, key_id, k, record, expiration) for i, k in zip(identities, subkeys)]
    return await _send_to_every_peer(node, key_id, subkeys, values, expiration)


def wait_listed(swarm, names: list[str]) -> None:
    """Listings show exactly ``names`` (a heartbeat missed under load may hide a worker for a moment, no longer)."""
    swarm.wait_for_status(lambda s: sorted(w["name"] or "" for w in s["workers"]) == names, f"listing {names}",
                          timeout=30)


def test_a_non_canonically_encoded_record_cannot_hide_its_bucket(swarm):
    honest = swarm.start_worker("--public-name", "honest")
    bucket = worker_bucket(swarm.worker_id(honest))
    swarm.wait_for_status(lambda s: len(s["workers"]) == 1, "the honest worker")
    index = sybils_in_bucket("non-canonical", bucket, 1)[0]
    attacker = hostile_node(swarm)
    try:
        from functools import partial

        accepted = attacker.run_coroutine(partial(_store_non_canonical, network=swarm.network, tag="non-canonical",
                                                  index=index))
        assert accepted == 0  # every honest peer refuses a subkey that is not in canonical form
        wait_listed(swarm, ["honest"])
    finally:
        attacker.shutdown()


def test_padded_sybil_records_cannot_flood_a_bucket_out_of_sight(swarm):
    honest = swarm.start_worker("--public-name", "honest")
    bucket = worker_bucket(swarm.worker_id(honest))
    swarm.wait_for_status(lambda s: len(s["workers"]) == 1, "the honest worker")
    indices = sybils_in_bucket("padded", bucket, 600)
    attacker = hostile_node(swarm)
    try:
        from functools import partial

        accepted = attacker.run_coroutine(partial(_store_padded, network=swarm.network, tag="padded", indices=indices,
                                                  padding=7000), return_future=True).result(timeout=300)
        assert accepted == 0  # at most 512 bytes of unknown fields are allowed
        wait_listed(swarm, ["honest"])  # 600 x 7 KiB would be 4.2 MiB in one bucket: past the reply cap
    finally:
        attacker.shutdown()

