from types import SimpleNamespace

import msgpack
import pytest
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from gpunet.dht.records import (
    MAX_RECORD_BYTES,
    WORKER_BUCKETS,
    DeviceInfo,
    WorkerRecord,
    worker_bucket,
    worker_key,
    worker_keys,
)
from gpunet.dht.validation import (
    MAX_RECORD_TTL,
    OwnerSignatureValidator,
    WorkerRecordValidator,
    key_id,
    network_validators,
)
from gpunet.errors import InvalidRecord, NetworkError
from gpunet.identity import Identity


def make_record(**overrides) -> WorkerRecord:
    fields = dict(version="0.1.0", state="online", device=DeviceInfo(kind="cpu", name="test cpu", cores=2), price=1.0)
    return WorkerRecord(**{**fields, **overrides})


def test_round_trip_and_unknown_fields_are_ignored():
    record = make_record(tflops={"fp32": 0.5}, programs=["ab" * 32])
    wire = record.to_wire()
    assert WorkerRecord.from_wire(wire) == record
    newer = {**wire, "some_future_field": {"nested": [1, 2]}, "device": {**wire["device"], "future": 1}}
    assert WorkerRecord.from_wire(newer) == record
    assert WorkerRecord.from_wire_bytes(msgpack.packb(wire)) == record


def test_a_format_1_record_is_read_with_its_price_per_tflop():
    """Format 1 quoted prices per PFLOP; a worker of an earlier release still routes at the price it meant."""
    old = {**make_record().to_wire(), "format": 1, "price": 2500.0}  # 2,500 credits/PFLOP
    assert WorkerRecord.from_wire(old).price == 2.5
    assert WorkerRecord.from_wire({**old, "format": 2}).price == 2500.0


@pytest.mark.parametrize(
    "patch, complaint",
    [
        ({"state": "sleeping"}, "state"),
        ({"price": "1.0"}, "price"),
        ({"price": -1.0}, "price"),
        ({"queue": 1.5}, "queue"),
        ({"device": {"kind": "tpu", "name": "x"}}, "device.kind"),
        ({"programs": ["x"] * 100}, "programs"),
        ({"format": 99}, "newer"),
        ({"version": None}, "version"),
        # From an attacker's review: text printed by readers, figures summed by them.
        ({"name": "\x1b[2Jcleared"}, "name"),
        ({"device": {"kind": "cuda", "name": "\x1b]8;;http://evil/\x1b\\GPU"}}, "device.name"),
        ({"pause_reason": "\x9bc"}, "pause_reason"),
        ({"name": "volunteer-\u202e1-reetnulov"}, "name"),  # shown backwards: another worker's name
        ({"credits_earned": 1e300}, "credits_earned"),
        ({"tflops": {"fp32": 1.5e308}}, "tflops"),
        ({"jobs_done": 2**64}, "jobs_done"),
    ],
)
def test_schema_violations_are_refused_with_the_field_named(patch, complaint):
    with pytest.raises(InvalidRecord, match=complaint):
        WorkerRecord.from_wire({**make_record().to_wire(), **patch})


@pytest.mark.parametrize("raw", [b"", b"\xc1", b"\x93\x01\x02", b"\xdf\xff\xff\xff\xff", b"x" * (MAX_RECORD_BYTES + 1)])
def test_malformed_bytes_are_a_clear_error(raw):
    with pytest.raises(InvalidRecord):
        WorkerRecord.from_wire_bytes(raw)


def test_buckets_spread_workers_and_stay_stable():
    ids = [Identity.generate().peer_id for _ in range(2000)]
    buckets = [worker_bucket(i) for i in ids]
    assert buckets == [worker_bucket(i) for i in ids]
    counts = [buckets.count(b) for b in range(WORKER_BUCKETS)]
    assert min(counts) > 0 and max(counts) < 3 * len(ids) / WORKER_BUCKETS
    assert worker_key("net", 3) == "net.workers.3" and len(worker_keys("net")) == WORKER_BUCKETS


# --- validators, exercised exactly as hivemind calls them ------------------------------------------------------------


def _dht_record(validator, owner: Identity, record: WorkerRecord, network="net", ttl=30.0, subkey=None) -> DHTRecord:
    subkey = subkey or owner.peer_id
    key = key_id(worker_key(network, worker_bucket(subkey)))
    plain = DHTRecord(key, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(record.to_wire()), get_dht_time() + ttl)
    return DHTRecord(plain.key, plain.subkey, validator.sign_value(plain), plain.expiration_time)


def test_owner_signed_record_validates_and_strips():
    owner = Identity.generate()
    validator = CompositeValidator(network_validators("net", [owner]))
    signed = _dht_record(validator, owner, make_record())
    assert validator.validate(signed)
    assert MSGPackSerializer.loads(validator.strip_value(signed)) == make_record().to_wire()


def test_forged_tampered_replayed_and_invalid_records_are_refused():
    owner, mallory = Identity.generate(), Identity.generate()
    honest = CompositeValidator(network_validators("net", [owner]))
    forger = CompositeValidator(network_validators("net", [mallory]))

    # Mallory writes under the owner's subkey: her validator cannot sign it, so it carries no signature.
    assert not honest.validate(_dht_record(forger, owner, make_record()))
    # Mallory signs with her key but claims the owner's subkey.
    class Impersonator(OwnerSignatureValidator):
        def sign_value(self, record):
            return record.value + b"\x00gpunet-sig-v1\x00" + mallory.sign(b"whatever")
    impostor = CompositeValidator([Impersonator(worker_keys("net")), WorkerRecordValidator("net")])
    assert not honest.validate(_dht_record(impostor, owner, make_record()))

    signed = _dht_record(honest, owner, make_record())
    # Any flipped byte in the value, or a replay with a later expiration, breaks the signature.
    for i in range(0, len(signed.value), 7):
        flipped = bytearray(signed.value)
        flipped[i] ^= 0x01
        assert not honest.validate(DHTRecord(signed.key, signed.subkey, bytes(flipped), signed.expiration_time))
    assert not honest.validate(DHTRecord(signed.key, signed.subkey, signed.value, signed.expiration_time + 100))
    # A correctly signed record that fails the schema.
    bad_schema = DHTRecord(signed.key, signed.subkey, MSGPackSerializer.dumps({"state": "online"}), signed.expiration_time)
    assert not honest.validate(
        DHTRecord(bad_schema.key, bad_schema.subkey, honest.sign_value(bad_schema), bad_schema.expiration_time)
    )
    # An owner cannot pin a record far into the future.
    assert not honest.validate(_dht_record(honest, owner, make_record(), ttl=MAX_RECORD_TTL + 60))
    # A subkey that is not a peer id.
    not_peer = DHTRecord(signed.key, MSGPackSerializer.dumps("bob"), signed.value, signed.expiration_time)
    assert not honest.validate(not_peer)


def test_other_keys_are_left_alone():
    validator = CompositeValidator(network_validators("net"))
    foreign = DHTRecord(key_id("other.workers.1"), MSGPackSerializer.dumps("x"), b"\x01", get_dht_time() + 10)
    assert validator.validate(foreign)
    assert validator.strip_value(foreign) == b"\x01"


def test_a_record_outside_its_owners_bucket_is_refused():
    """One record per worker: a copy in another bucket (perhaps with another state) is refused even if signed."""
    owner = Identity.generate()
    validator = CompositeValidator(network_validators("net", [owner]))
    wrong_bucket = (worker_bucket(owner.peer_id) + 1) % WORKER_BUCKETS
    plain = DHTRecord(key_id(worker_key("net", wrong_bucket)), MSGPackSerializer.dumps(owner.peer_id),
                      MSGPackSerializer.dumps(make_record().to_wire()), get_dht_time() + 30)
    signed = DHTRecord(plain.key, plain.subkey, validator.sign_value(plain), plain.expiration_time)
    assert not validator.validate(signed)


@pytest.mark.parametrize("extra", [
    msgpack.ExtType(0x51, b"\x00junk"),  # hivemind's reader raised on it inside its search: the bucket's search hung
    [[{"deep": msgpack.ExtType(1, b"")}]],
    msgpack.Timestamp(0),  # decoded without the ext hook
], ids=["ext", "nested-ext", "timestamp"])
def test_a_record_holding_a_msgpack_extension_type_is_refused_at_store_time(extra):
    """From an attacker's review: one signed record with an unknown field holding an extension type passed every
    validator, and every reader's search of its bucket then never returned (discovery hung for the whole network)."""
    owner = Identity.generate()
    validator = CompositeValidator(network_validators("net", [owner]))
    wire = {**make_record().to_wire(), "x": extra}
    with pytest.raises(InvalidRecord, match="extension type"):
        WorkerRecord.from_wire_bytes(msgpack.packb(wire))
    key = key_id(worker_key("net", worker_bucket(owner.peer_id)))
    plain = DHTRecord(key, MSGPackSerializer.dumps(owner.peer_id), msgpack.packb(wire, use_bin_type=True),
                      get_dht_time() + 60)
    assert not validator.validate(DHTRecord(plain.key, plain.subkey, validator.sign_value(plain), plain.expiration_time))


def test_a_bucket_whose_search_never_ends_costs_only_that_bucket(monkeypatch):
    import asyncio

    from gpunet.dht import registry

    monkeypatch.setattr(registry, "BUCKET_TIMEOUT", 0.2)

    class Node:  # hivemind's DHTNode.get_many(return_futures=True): a future per key, set as its search ends
        async def get_many(self, keys, sufficient_expiration_time=None, return_futures=False):
            assert return_futures and sufficient_expiration_time == float("inf")  # the latest value of each
            futures = {key: asyncio.get_running_loop().create_future() for key in keys}
            if "fine" in futures:
                futures["fine"].set_result(SimpleNamespace(value={"w": SimpleNamespace(value={"a": 1},
                                                                                       expiration_time=7.0)}))
            return futures  # the others: never set

    out = asyncio.run(registry._read_buckets(None, Node(), ["hung", "fine"]))
    assert out == [("w", {"a": 1}, 7.0)]
    # Every bucket's search hung: the listing fails and says so, rather than show an empty network.
    with pytest.raises(NetworkError, match="no bucket"):
        asyncio.run(registry._read_buckets(None, Node(), ["hung", "hung too"]))
