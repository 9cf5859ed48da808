"""Records nobody may write: forged, badly signed or schema-invalid records never reach a reader."""

import hivemind
import pytest
from hivemind.utils import get_dht_time

from gpunet.dht import network, registry
from gpunet.dht.records import (
    DeviceInfo,
    WorkerRecord,
    worker_bucket,
    worker_key,
    worker_keys,
)
from gpunet.dht.validation import (
    SIGNATURE_TAG,
    OwnerSignatureValidator,
    WorkerRecordValidator,
)
from gpunet.identity import Identity

pytestmark = pytest.mark.swarm


class AcceptEverything(OwnerSignatureValidator):
    """A malicious node: stores whatever it is given, and signs with the wrong key."""

    def __init__(self, network_name, mallory):
        super().__init__(worker_keys(network_name))
        self.mallory = mallory

    def validate(self, record):
        return True

    def sign_value(self, record):
        return record.value + SIGNATURE_TAG + self.mallory.sign(b"not the record")


class NoSchema(WorkerRecordValidator):
    def validate(self, record):
        return True


def test_forged_badly_signed_and_invalid_records_are_never_shown(swarm, tmp_path):
    honest = swarm.start_worker("--public-name", "honest")
    honest_id = swarm.worker_id(honest)
    swarm.wait_for_status(lambda s: [w["id"] for w in s["workers"]] == [honest_id], "the honest worker")

    mallory = Identity.load_or_create(tmp_path / "mallory")
    fake = WorkerRecord(version="6.6.6", state="online", device=DeviceInfo(kind="cuda", name="H100 (fake)"),
                        price=0.0, name="forged")
    expiration = get_dht_time() + 20

    # 1. An ordinary node of Mallory's writes under the honest worker's subkey: it cannot sign it, and peers refuse.
    attacker = network.join(swarm.network, [swarm.bootstrap_addr], identity=mallory, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        assert not registry.announce(attacker, swarm.network, honest_id, fake, expiration)
    finally:
        attacker.shutdown()

    # A malicious node stores anything (it validates nothing) and signs with the wrong key.
    evil = hivemind.DHT(
        initial_peers=[swarm.bootstrap_addr], start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        record_validators=[AcceptEverything(swarm.network, mallory), NoSchema(swarm.network)],
    )
    try:
        # 2. A record under the honest id signed by the wrong key; 3. one under Mallory's own id that breaks the schema.
        evil.store(worker_key(swarm.network, worker_bucket(honest_id)), fake.to_wire(), expiration, subkey=honest_id)
        evil.store(worker_key(swarm.network, worker_bucket(mallory.peer_id)), {"state": "online", "price": "free"},
                   expiration, subkey=mallory.peer_id)
        # Both sit in the evil node's own storage, but every honest reader validates what it reads.
        status = swarm.status()
        assert [w["id"] for w in status["workers"]] == [honest_id]
        assert status["workers"][0]["name"] == "honest"
        reader = network.join(swarm.network, [swarm.bootstrap_addr], client_mode=True,
                              host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            seen = registry.discover(reader, swarm.network)
        finally:
            reader.shutdown()
        assert [(e.id, e.record.name) for e in seen] == [(honest_id, "honest")]
    finally:
        evil.shutdown()
