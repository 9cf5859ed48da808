"""What gpunet changes in hivemind's DHT nodes (gpunet/dht/hardening.py), against hivemind's own types, and the
record bounds that keep a bucket small. The attacks themselves, over a real swarm, are in test_dht_hiding.py."""

import asyncio

import msgpack
import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID, RoutingTable
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer, ValueWithExpiration, get_dht_time

from gpunet.dht import hardening
from gpunet.dht.records import (
    MAX_ADVERTISED_MADDRS,
    MAX_CACHED_PROGRAMS,
    MAX_CHECKPOINTS,
    MAX_DEVICE_NAME,
    MAX_MADDR_CHARS,
    MAX_PAUSE_REASON,
    MAX_RECORD_BYTES,
    MAX_UNKNOWN_FIELD_BYTES,
    DeviceInfo,
    WorkerRecord,
    worker_bucket,
    worker_keys,
)
from gpunet.dht.validation import OwnerSignatureValidator, key_id, network_validators
from gpunet.errors import InvalidRecord
from gpunet.identity import Identity

NETWORK = "hardening-test"


@pytest.fixture(autouse=True)
def installed():
    hardening.install()


def signed_entry(identity: Identity, key: str, record: dict, expiration: float):
    validator = CompositeValidator(network_validators(NETWORK, [identity]))
    subkey = MSGPackSerializer.dumps(identity.peer_id)
    value = validator.sign_value(DHTRecord(key_id(key), subkey, MSGPackSerializer.dumps(record), expiration))
    return identity.peer_id, value


def record(name="w", **extra) -> dict:
    return {**WorkerRecord(version="1", state="online", device=DeviceInfo(kind="cpu", name="cpu"), name=name).to_wire(),
            **extra}


def protocol() -> DHTProtocol:
    """A DHTProtocol with storage and validators but no network: enough for its store/find handlers."""
    proto = DHTProtocol.__new__(DHTProtocol)
    proto.record_validator = CompositeValidator(network_validators(NETWORK))
    proto.serializer = MSGPackSerializer
    proto.storage, proto.cache = DHTLocalStorage(), DHTLocalStorage()
    proto.bucket_size = 20
    proto.routing_table = RoutingTable(DHTID.generate(), bucket_size=20, depth_modulo=5)
    proto.node_info = dht_pb2.NodeInfo()
    return proto


def same_bucket_identities(count: int) -> tuple[str, list[Identity]]:
    found = []
    while len(found) < count:
        identity = Identity.generate()
        if worker_bucket(identity.peer_id) == 0:
            found.append(identity)
    return worker_keys(NETWORK)[0], found


def test_one_invalid_entry_no_longer_hides_the_others():
    key, (good, bad) = same_bucket_identities(2)
    expiration = get_dht_time() + 60
    dictionary = DictionaryDHTValue()
    dictionary.store(*signed_entry(good, key, record("good"), expiration), expiration)
    bad_id, bad_value = signed_entry(bad, key, record("bad"), expiration)
    dictionary.store(bad_id, bad_value[:-1] + bytes([bad_value[-1] ^ 1]), expiration)  # its signature broken
    dictionary.store("not even a peer id", b"garbage", expiration)
    assert hardening.validate_entries(protocol(), key_id(key), dictionary)
    assert [subkey for subkey, _ in dictionary.items()] == [good.peer_id]


def test_a_non_canonical_subkey_is_refused_at_store_time():
    key, (mallory,) = same_bucket_identities(1)
    raw = mallory.peer_id.encode()
    str16 = b"\xda" + len(raw).to_bytes(2, "big") + raw
    expiration = get_dht_time() + 60
    payload = MSGPackSerializer.dumps(record())
    validator = OwnerSignatureValidator(worker_keys(NETWORK), [mallory])
    canonical = DHTRecord(key_id(key), MSGPackSerializer.dumps(mallory.peer_id), payload, expiration)
    assert validator.validate(DHTRecord(canonical.key, canonical.subkey, validator.sign_value(canonical), expiration))
    odd = DHTRecord(key_id(key), str16, payload, expiration)
    from gpunet.dht.validation import SIGNATURE_TAG, signing_bytes

    signed_over_odd = payload + SIGNATURE_TAG + mallory.sign(signing_bytes(odd))
    assert not validator.validate(DHTRecord(odd.key, str16, signed_over_odd, expiration))


def test_a_full_bucket_takes_refreshes_but_no_newcomers(monkeypatch):
    monkeypatch.setattr(hardening, "MAX_BUCKET_ENTRIES", 3)
    storage, key = DHTLocalStorage(), DHTID.generate()
    expiration = get_dht_time() + 60
    assert all(storage.store_subkey(key, f"peer{i}", b"v", expiration) for i in range(3))
    assert not storage.store_subkey(key, "newcomer", b"v", expiration)
    assert storage.store_subkey(key, "peer1", b"v2", expiration + 1)  # a known worker's heartbeat
    assert sorted(s for s, _ in storage.get(key).value.items()) == ["peer0", "peer1", "peer2"]


def test_an_oversized_bucket_is_served_in_part_smallest_entries_first(monkeypatch):
    monkeypatch.setattr(hardening, "MAX_REPLY_VALUE_BYTES", 64 * 1024)
    proto, key = protocol(), DHTID.generate()
    expiration = get_dht_time() + 60
    proto.storage.store_subkey(key, "honest", b"h" * 500, expiration)
    for i in range(100):
        proto.storage.store_subkey(key, f"sybil{i}", b"s" * 3000, expiration)
    request = dht_pb2.FindRequest(keys=[key.to_bytes()], peer=dht_pb2.NodeInfo(node_id=DHTID.generate().to_bytes()))
    response = asyncio.run(DHTProtocol.rpc_find(proto, request, None))
    (result,) = response.results
    assert result.type == dht_pb2.FOUND_DICTIONARY and len(result.value) <= 64 * 1024
    served = MSGPackSerializer.loads(result.value)
    assert "honest" in dict(served.items()) and 10 < len(served) < 100


def test_every_field_at_its_maximum_fits_the_record_cap_with_room_for_unknown_fields():
    biggest = WorkerRecord(
        version="x" * 32, state="online",
        device=DeviceInfo(kind="cuda", name="n" * MAX_DEVICE_NAME, count=1024, memory_total=2**62, memory_free=2**62,
                          cores=2**30, driver="d" * 32, cuda="c" * 16, utilization=99.5),
        tflops={f"k{i:02d}".ljust(16, "x"): 1e18 for i in range(6)}, price=1e9, max_concurrent=4096,
        queue=2**62, jobs_done=2**62, started_at=1e12, updated_at=1e12,
        programs=["a" * 64] * MAX_CACHED_PROGRAMS, checkpoints=["c" * 32] * MAX_CHECKPOINTS, name="n" * 64, maddrs=["/ip4/" + "m" * (MAX_MADDR_CHARS - 5)] * MAX_ADVERTISED_MADDRS,
        ledger_count=2**62, ledger_head="h" * 64, credits_earned=1e18, peer_bytes_served=2**62,
        peer_bytes_fetched=2**62, batch_price=1e18, batch_floor=1e18, interactive_load=1.0, preemptions_per_hour=1e18,
        batch_queue=2**62,
        pause_reason="p" * MAX_PAUSE_REASON)
    assert len(msgpack.packb(biggest.to_wire())) + MAX_UNKNOWN_FIELD_BYTES <= MAX_RECORD_BYTES


def test_unknown_fields_beyond_the_allowance_are_refused():
    assert WorkerRecord.from_wire(record(newer_field="x" * 100)).name == "w"
    with pytest.raises(InvalidRecord, match="unknown fields"):
        WorkerRecord.from_wire(record(padding="x" * 1000))
    nested = record()
    nested["device"] = {**nested["device"], "padding": "x" * 1000}
    with pytest.raises(InvalidRecord, match="unknown fields"):
        WorkerRecord.from_wire(nested)


def test_a_peers_claimed_expiration_is_recomputed_from_the_valid_entries(monkeypatch):
    """An empty dictionary claimed to expire at +inf ended latest-value searches at once (and was cached forever)."""
    now = get_dht_time()
    full = DictionaryDHTValue()
    full.store("a", b"x", now + 30)
    full.store("b", b"y", now + 20)
    replies = {DHTID.generate(): (ValueWithExpiration(DictionaryDHTValue(), float("inf")), {}),
               DHTID.generate(): (ValueWithExpiration(full, float("inf")), {}),
               DHTID.generate(): (None, {})}

    async def lying_peer(self, peer, keys):
        return dict(replies)

    monkeypatch.setattr(hardening, "_original_call_find", lying_peer)
    empty_key, full_key, missing_key = replies
    out = asyncio.run(hardening._call_find(protocol(), None, list(replies)))
    assert out[empty_key][0] is None and out[missing_key][0] is None
    assert out[full_key][0].expiration_time == pytest.approx(now + 30)


def test_nothing_is_stored_in_the_cache(monkeypatch):
    """A cached copy with a later expiration used to answer finds instead of the stored bucket."""
    key, (identity,) = same_bucket_identities(1)
    proto = protocol()
    expiration = get_dht_time() + 500
    subkey, value = signed_entry(identity, key, record("sybil"), expiration)
    request = dht_pb2.StoreRequest(keys=[key_id(key)], subkeys=[MSGPackSerializer.dumps(subkey)], values=[value],
                                   expiration_time=[expiration], in_cache=[True])
    response = asyncio.run(DHTProtocol.rpc_store(proto, request, None))
    assert list(response.store_ok) == [True]
    assert proto.cache.get(DHTID.from_bytes(key_id(key))) is None
    assert proto.storage.get(DHTID.from_bytes(key_id(key))) is not None
