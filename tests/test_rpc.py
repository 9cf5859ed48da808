"""gpunet/rpc.py's fix to hivemind's daemon client: each message to the p2p daemon in one write."""

import asyncio

import pytest
from hivemind.p2p.p2p_daemon_bindings import control, utils
from hivemind.proto import p2pd_pb2

from gpunet import rpc


class Writes:
    """A StreamWriter that records each write."""

    def __init__(self):
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    async def drain(self) -> None:
        pass


@pytest.mark.parametrize("size", [0, 1, 126, 127, 128, 16_383, 16_384, 3 << 20])
def test_a_daemon_message_goes_in_one_write_with_the_bytes_hivemind_would_send(size):
    message = p2pd_pb2.PersistentConnectionRequest(callId=b"c" * 16, callUnary=p2pd_pb2.CallUnaryRequest(
        peer=b"p" * 34, proto="/gpunet/x/run/1", data=b"d" * size))
    ours, theirs = Writes(), Writes()
    asyncio.run(rpc._write_pbmsg_whole(ours, message))
    asyncio.run(utils.write_pbmsg(theirs, message))
    assert len(ours.writes) == 1 and len(theirs.writes) > 1  # hivemind's: a write per byte of the length prefix
    assert ours.writes[0] == b"".join(theirs.writes)
    assert control.write_pbmsg is rpc._write_pbmsg_whole  # installed where the daemon client looks it up
