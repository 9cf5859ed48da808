"""The job protocol without a network: every message round-trips, bad bytes are ProtocolErrors, errors keep their
family across the wire, payload sizes are checked before anything is allocated."""

import asyncio

import msgpack
import pytest

from gpunet import protocol
from gpunet.speedproof import Opening
from gpunet.errors import (
    DeadlineUnreachable,
    DryRunTooLong,
    ExecutorDied,
    JobPreempted,
    JobFailed,
    JobRaised,
    JobRejected,
    JobTimeout,
    PayFirst,
    ProgramNotCached,
    ProtocolError,
    SessionLost,
    UsageError,
    WorkerBusy,
    WorkerDraining,
)
from gpunet.protocol import (
    PushGroup,
    StepGroup,
    StepGroupAnswer,
    MAX_FRAME_BYTES,
    MESSAGES,
    Cancel,
    CloseSession,
    CheckReach,
    Countersign,
    Door,
    Error,
    GetInfo,
    Info,
    Ok,
    OpenProof,
    GetPiece,
    Have,
    Payload,
    PieceData,
    Pieces,
    Ping,
    Pong,
    Greeting,
    Hello,
    ProofOpening,
    ProveSpeed,
    Push,
    PushTo,
    ReachResult,
    Refuse,
    Result,
    Send,
    SettleBatch,
    SpeedCommitment,
    Submit,
    TensorHolders,
    UseStream,
    encode_frame,
    error_named,
    read,
    read_payload,
    SessionClosed,
    SessionStep,
)

H = "ab" * 32
EXAMPLES = [
    Submit("job-1", H, 3, b"abc", 30.0, 7, (("job-0", b"s" * 64),)),
    Submit("job-2", H, 10**9),
    Submit("job-3", H, 0, lane="batch", deadline=1.8e9, max_price=5),
    Send(True, False),
    Payload(10, None),
    Result(3, b"receipt", b"xyz"),
    Result(10**6, b"receipt"),
    Countersign("job-1", b"s" * 64),
    Refuse("job-1", "outvoted"),
    SettleBatch((("a", b"1"), ("b", b"2"))),
    Cancel("job-1"),
    CloseSession("s-1"),
    SessionClosed(True, b"receipt"),
    SessionClosed(False),
    Submit("s-1.4", H, 3, b"abc", session=SessionStep("s-1", 4, fresh=False, close=True, ttl=20.0)),
    Submit("s-1.4p", H, 0, b"", session=SessionStep(
        "s-1", 4, input_from="12D3KooWDQ7JTbgYFKtUSC8rdubCNYT3hECSK7ZzhqjbGMkB7Zds",
        push_to=PushTo("12D3KooWDQ7JTbgYFKtUSC8rdubCNYT3hECSK7ZzhqjbGMkB7Zds", "s-2", 4))),
    Push("12D3KooWDQ7JTbgYFKtUSC8rdubCNYT3hECSK7ZzhqjbGMkB7Zds", "s-2", 4, b"inputs"),
    Push("12D3KooWDQ7JTbgYFKtUSC8rdubCNYT3hECSK7ZzhqjbGMkB7Zds", "s-2", 4, None),
    PushGroup((Push("12D3KooWDQ7JTbgYFKtUSC8rdubCNYT3hECSK7ZzhqjbGMkB7Zds", "s-2", 4, b"inputs"),
               Push("12D3KooWDQ7JTbgYFKtUSC8rdubCNYT3hECSK7ZzhqjbGMkB7Zds", "s-3", 9, None))),
    StepGroup((Submit("s-1.4", H, 3, b"abc", session=SessionStep("s-1", 4)),
               Submit("s-2.4p", H, 0, b"", session=SessionStep(
                   "s-2", 4, input_from="12D3KooWDQ7JTbgYFKtUSC8rdubCNYT3hECSK7ZzhqjbGMkB7Zds")))),
    StepGroupAnswer((Result(3, b"", b"out", "ab" * 32), Error("busy", "full", 3), UseStream())),
    Result(3, b"", b"xyz", "ab" * 32),
    Ok(),
    Ok(cancelled=True),
    UseStream(),
    Ping(b"hello"),
    Pong(1.5, b"hello"),
    GetInfo(),
    Info(2.0, {"state": "online"}),
    ProveSpeed(b"s" * 16, 1024, 1.0),
    SpeedCommitment((b"c" * 16, b"d" * 16)),
    OpenProof(b"s" * 16, 1024, {0: [3, 7], 1: [1]}),
    ProofOpening((Opening(0, b"\0" * 8, {3: b"\1" * 4}),)),
    CheckReach((31337, 4001)),
    ReachResult("/ip4/198.51.100.7", (31337,)),
    Error("busy", "full", 3),
    Send(True, True, pieces=True),
    Send(True, False, missing=(0, 3, 1023)),
    Have(b"\x05\x80"),
    Have(b"\x05\x80", b"\x04"),
    PieceData(4 << 20, b"\x07"),
    PieceData(4 << 20, b"\x07", b"\x01"),
    Have(),
    Pieces(5 << 20, 4 << 20, b"d" * 64, (("12D3KooWDQ7JTbgYFKtUSC8rdubCNYT3hECSK7ZzhqjbGMkB7Zds", ("/ip4/1.2.3.4/tcp/5",)),)),
    Pieces(1, 4 << 20, b"d" * 32, (("12D3KooWDQ7JTbgYFKtUSC8rdubCNYT3hECSK7ZzhqjbGMkB7Zds", ()),),
           frozenset({"12D3KooWDQ7JTbgYFKtUSC8rdubCNYT3hECSK7ZzhqjbGMkB7Zds"})),
    GetPiece(H, 1, 4 << 20),
    GetPiece(H, 0, 4 << 20, tensor=True),
    GetPiece(H, 2, 4 << 20, have=True),
    GetPiece(H, 2, 4 << 20, have=True, sent=True),
    PieceData(1024),
    Send(False, False, tensors=(H, "cd" * 32)),
    Send(False, False, tensors=(H,), again=True),
    Payload(None, None, tensors_size=4096),
    Payload(10, None, token=b"t" * 32),
    Pieces(1, 4 << 20, b"d" * 32, (("12D3KooWDQ7JTbgYFKtUSC8rdubCNYT3hECSK7ZzhqjbGMkB7Zds", ()),), token=b"t" * 32),
    TensorHolders(("12D3KooWDQ7JTbgYFKtUSC8rdubCNYT3hECSK7ZzhqjbGMkB7Zds",)),
    TensorHolders(("12D3KooWDQ7JTbgYFKtUSC8rdubCNYT3hECSK7ZzhqjbGMkB7Zds",),
                  (("12D3KooWDQ7JTbgYFKtUSC8rdubCNYT3hECSK7ZzhqjbGMkB7Zds", b"g" * 32),), b"t" * 32),
    Hello(),
    Greeting("gpunet", "bootstrap", "0.1.0"),
]


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def test_every_message_has_an_example_here():
    assert {type(m) for m in EXAMPLES} == set(MESSAGES.values())


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_messages_round_trip_and_ignore_unknown_fields(message):
    assert protocol.decode(protocol.encode(message)) == message
    extended = msgpack.packb({**message.to_wire(), "from_the_future": [1, 2]}, use_bin_type=True)
    assert protocol.decode(extended, type(message)) == message


def test_doors_name_one_protocol_each():
    names = {door.protocol("net") for door in Door}
    assert len(names) == len(Door) and all(n.startswith("/gpunet/net/") for n in names - {"/gpunet/hello/1"})
    assert Door.HELLO.protocol("a") == Door.HELLO.protocol("b")  # the one door outside every network


@pytest.mark.parametrize("wire", [{"t": "greeting"}, {"t": "greeting", "network": ""}, {"t": "greeting", "network": 7},
                                  {"t": "greeting", "network": "x" * 65}, {"t": "greeting", "network": "a\x1b[2J"}])
def test_a_greeting_without_a_printable_network_is_refused(wire):
    with pytest.raises(ProtocolError):
        protocol.decode(msgpack.packb(wire), Greeting)


@pytest.mark.parametrize("error", [WorkerBusy("full", 3), JobRejected("op aten.from_file"), JobFailed("boom"),
                                   JobTimeout("slow"), ProtocolError("bad"), ProgramNotCached(H),
                                   WorkerDraining("leaving", 3), JobPreempted("an interactive job took its slot", 3),
                                   JobRaised("node 'x' (aten.embedding.default) raised IndexError"),
                                   PayFirst("this client holds 64 results not yet countersigned")])
def test_errors_cross_the_wire_as_the_same_family(error):
    back = protocol.decode(protocol.encode(Error.of(error, queue=3)), Error).exception()
    assert type(back) is type(error)
    if isinstance(error, ProgramNotCached):
        assert back.program_hash == error.program_hash
    if isinstance(error, WorkerBusy):
        assert back.queue_length == 3


@pytest.mark.parametrize("error, family", [(SessionLost("gone"), SessionLost), (DryRunTooLong("slow"), JobRejected),
                                           (DeadlineUnreachable("late"), JobRejected), (ExecutorDied("oom"), JobFailed),
                                           (UsageError("what"), JobFailed)])
def test_an_error_without_a_code_of_its_own_crosses_as_its_family(error, family):
    back = protocol.decode(protocol.encode(Error.of(error)), Error).exception()
    assert type(back) is family and str(back) == str(error)


def test_pay_first_reads_as_a_refusal_to_a_peer_that_does_not_know_it():
    wire = msgpack.unpackb(protocol.encode(Error.of(PayFirst("holds 64 results not yet countersigned"))))
    assert wire["code"] == "rejected" and wire["pay_first"] is True  # an older client: a plain refusal
    del wire["pay_first"]
    back = protocol.decode(msgpack.packb(wire), Error).exception()
    assert type(back) is JobRejected and back.reason == "holds 64 results not yet countersigned"


def test_an_unknown_error_code_reads_as_a_failure():
    assert type(Error("melted", "it melted").exception()) is JobFailed


@pytest.mark.parametrize("name, kind", [("JobRejected", JobRejected), ("JobFailed", JobFailed),
                                        ("SessionLost", SessionLost), ("JobPreempted", JobPreempted),
                                        ("DryRunTooLong", DryRunTooLong), ("JobRaised", JobRaised),
                                        ("DeadlineUnreachable", JobFailed), ("ExecutorDied", JobFailed),
                                        ("NoSuchError", JobFailed), (None, JobFailed), (["JobRejected"], JobFailed)])
def test_an_error_named_by_its_class_is_that_class_or_a_failure(name, kind):
    error = error_named(name, "it said so")
    assert type(error) is kind and str(error) == "it said so"


@pytest.mark.parametrize("fields, match", [
    ({"job": 7, "program": H, "inputs_size": 1}, "'job' must be str"),
    ({"job": "../../etc", "program": H, "inputs_size": 1}, "job id"),
    ({"job": "ok\n", "program": H, "inputs_size": 1}, "job id"),
    ({"job": "j", "program": H.upper(), "inputs_size": 1}, "program hash"),
    ({"job": "j", "program": H, "inputs_size": -1}, "non-negative"),
    ({"job": "j", "program": H, "inputs_size": True}, "must be int"),
    ({"job": "j", "program": H, "inputs_size": 9, "inputs": b"abc"}, "inline inputs"),
    ({"job": "j", "program": H, "inputs_size": 1, "timeout": -1.0}, "timeout"),
    ({"job": "j", "program": H, "inputs_size": 1, "timeout": float("nan")}, "timeout"),
    ({"job": "j", "program": H, "inputs_size": 1, "lane": "spot"}, "unknown lane"),
    ({"job": "j", "program": H, "inputs_size": 1, "lane": "background"}, "unknown lane"),  # the volunteer's own
    ({"job": "j", "program": H, "inputs_size": 1, "lane": 3}, "'lane' must be str"),
    ({"job": "j", "program": H, "inputs_size": 1, "deadline": float("inf")}, "deadline"),
    ({"job": "j", "program": H, "inputs_size": 1, "deadline": -5}, "deadline"),
])
def test_a_malformed_submit_is_a_protocol_error(fields, match):
    with pytest.raises(ProtocolError, match=match):
        protocol.decode(msgpack.packb({"t": "submit", **fields}, use_bin_type=True))


@pytest.mark.parametrize("fields, match", [
    ({"t": "send", "program": True, "inputs": False, "missing": [2, 1]}, "ascending"),
    ({"t": "send", "program": True, "inputs": False, "missing": [1, 1]}, "ascending"),
    ({"t": "send", "program": True, "inputs": False, "missing": [-1]}, "ascending"),
    ({"t": "send", "program": True, "inputs": False, "missing": [1024]}, "ascending"),
    ({"t": "send", "program": True, "inputs": False, "missing": [True]}, "ascending"),
    ({"t": "send", "program": True, "inputs": False, "missing": list(range(1025))}, "ascending|not valid msgpack"),
    ({"t": "send", "program": False, "inputs": False, "missing": [0]}, "pieces of the program"),
    ({"t": "send", "program": False, "inputs": False, "again": True}, "asked for again"),
    ({"t": "send", "program": False, "inputs": False, "tensors": ["ab" * 32], "again": 1}, "again"),
    ({"t": "have", "pieces": b"x" * 129}, "at most 1024"),
    ({"t": "have", "pieces": [1]}, "must be bytes"),
    ({"t": "piece_data", "size": 1, "have": b"x" * 129}, "at most 1024"),
])
def test_malformed_piece_bookkeeping_is_a_protocol_error(fields, match):
    with pytest.raises(ProtocolError, match=match):
        protocol.decode(msgpack.packb(fields, use_bin_type=True))


def test_a_have_bitmap_names_its_pieces():
    assert Have.of({0, 9, 1023}, 1024).indices() == {0, 9, 1023} and len(Have.of((), 20).pieces) == 3
    assert Have(b"\x05\x80").indices() == {0, 2, 15}
    assert Have.of({0, 2}, 16, sent={2}).sent_indices() == {2} and Have.of({0}, 16).sent == b""


def test_a_submit_without_a_lane_is_interactive_as_workers_before_lanes_sold_it():
    plain = protocol.decode(msgpack.packb({"t": "submit", "job": "j", "program": H, "inputs_size": 0}), Submit)
    assert plain.lane == "interactive" and plain.deadline is None
    assert "lane" not in Submit("j", H, 0).to_wire()  # the same bytes older workers always read
    batch = Submit("j", H, 0, lane="batch", deadline=1.8e9)
    assert protocol.decode(protocol.encode(batch), Submit) == batch


def test_malformed_countersignatures_riding_along_never_spoil_the_job():
    raw = {"t": "submit", "job": "j", "program": H, "inputs_size": 0,
           "settle": [["good", b"sig"], ["bad"], [7, b"x"], ["../x", b"y"], "nonsense"]}
    submit = protocol.decode(msgpack.packb(raw, use_bin_type=True), Submit)
    assert submit.settle == (("good", b"sig"),) and submit.settle_malformed == 4


def test_frames_round_trip_and_bad_frames_are_protocol_errors():
    async def go():
        assert await read(_reader(encode_frame(GetInfo())), GetInfo) == GetInfo()
        for raw in [b"", b"\x00\x00", (MAX_FRAME_BYTES + 1).to_bytes(4, "big"), b"\x00\x00\x00\x01\xc1",
                    b"\x00\x00\x00\x01\x01", encode_frame(Ping()), b"\x00\x00\x00\x03\x92\x01\x02",
                    b"\x00\x00\x00\x0b" + msgpack.packb({"t": "nonsense"})]:
            with pytest.raises(ProtocolError):
                await read(_reader(raw), GetInfo)

    asyncio.run(go())


def test_a_silent_peer_is_a_protocol_error_after_the_timeout():
    async def go():
        reader = asyncio.StreamReader()  # never fed: the peer sends nothing
        with pytest.raises(ProtocolError, match="sent nothing"):
            await read(reader, GetInfo, timeout=0.05)
        with pytest.raises(ProtocolError, match="too slowly"):
            await read_payload(reader, 10, 100, "inputs", timeout=0.05)

    asyncio.run(go())


def test_payload_sizes_are_checked_before_reading_and_buffers_grow_with_the_data():
    async def go():
        assert await read_payload(_reader(b"abc"), 3, 10, "x") == b"abc"
        with pytest.raises(ProtocolError, match="exceeds"):
            await read_payload(_reader(b""), 11, 10, "x")
        with pytest.raises(ProtocolError, match="non-negative"):
            await read_payload(_reader(b""), -1, 10, "x")
        with pytest.raises(ProtocolError, match="after 2 of 2000000000"):
            await read_payload(_reader(b"ab"), 2_000_000_000, 4_000_000_000, "x")  # no 2 GB allocated for it

    asyncio.run(go())


def test_hostile_field_values_never_escape_as_anything_but_protocol_errors():
    nested: list = []
    for _ in range(900):
        nested = [nested]
    raw = msgpack.packb({"t": "refuse", "job": "j", "reason": nested}, use_bin_type=True)
    assert protocol.decode(raw, Refuse) == Refuse("j", "")  # a reason that is not text is no reason
    err = protocol.decode(msgpack.packb({"t": "error", "code": nested, "message": 7, "queue": -5,
                                         "program": "../../x"}, use_bin_type=True), Error)
    assert err == Error("failed", "", 0, None)
    for t in (float("nan"), float("inf")):
        with pytest.raises(ProtocolError, match="finite"):
            protocol.decode(msgpack.packb({"t": "pong", "time": t}), Pong)
    with pytest.raises(ProtocolError, match="'record' must be dict"):
        protocol.decode(msgpack.packb({"t": "info", "time": 1.0, "record": nested}), Info)


def test_a_broken_stream_on_write_is_a_protocol_error():
    class Broken:
        def write(self, data):
            raise ConnectionResetError("peer reset")

        async def drain(self):
            pass

    async def go():
        with pytest.raises(ProtocolError, match="stream broke"):
            await protocol.write(Broken(), Ok())
        with pytest.raises(ProtocolError, match="stream broke"):
            await protocol.write_payload(Broken(), b"x" * 10)

    asyncio.run(go())


def test_a_payload_that_stops_coming_frees_its_slot_quickly(monkeypatch):
    monkeypatch.setattr(protocol, "FRAME_TIMEOUT", 0.1)

    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(b"x" * 10)  # ten bytes of a declared gigabyte, then nothing
        with pytest.raises(ProtocolError, match="too slowly"):
            await read_payload(reader, 10**9, 2 * 10**9, "program", timeout=protocol.payload_deadline(10**9))

    asyncio.run(go())


def test_many_tiny_containers_are_refused_before_they_cost_parsing_time():
    body = msgpack.packb({"t": "ping", "echo": b"", "junk": [[]] * 100_000})
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        protocol.decode(body)
    assert Door.RUN.max_request < 1 << 20 and Door.PING.max_request <= Door.RUN.max_request


def test_peer_text_cannot_forge_log_lines_or_drive_the_terminal():
    raw = msgpack.packb({"t": "refuse", "job": "j", "reason": "ok\n12:00 INFO forged line\x1b[2J"})
    assert protocol.decode(raw, Refuse).reason == "ok?12:00 INFO forged line?[2J"


def test_a_reachability_check_names_a_few_real_ports_only():
    for ports in ([], [0], [70000], list(range(1, 10)), ["80"], [True]):
        with pytest.raises(ProtocolError, match="TCP ports"):
            protocol.decode(msgpack.packb({"t": "check_reach", "ports": ports}))
    assert protocol.decode(protocol.encode(CheckReach((5, 5, 6)))).ports == (5, 6)


def test_a_piece_list_must_match_its_program_size_and_name_few_well_formed_holders():
    peer = "12D3KooWDQ7JTbgYFKtUSC8rdubCNYT3hECSK7ZzhqjbGMkB7Zds"
    good = {"t": "pieces", "size": 5 << 20, "piece_size": 4 << 20, "hashes": b"d" * 64, "holders": [[peer, []]]}
    assert protocol.decode(msgpack.packb(good, use_bin_type=True)).holders == ((peer, ()),)
    bad = [{"hashes": b"d" * 32}, {"piece_size": 1 << 20}, {"size": -1}, {"holders": [[peer, []]] * 9},
           {"holders": [["not a peer id!", []]]}, {"holders": [[peer, ["x" * 300]]]}, {"holders": [[peer]]},
           {"holders": [[peer, ["/ip4/1.2.3.4/tcp/1"] * 5]]}]
    for change in bad:
        with pytest.raises(ProtocolError):
            protocol.decode(msgpack.packb({**good, **change}, use_bin_type=True))


_STEP = {"t": "submit", "job": "s-1.1", "program": H, "inputs_size": 1, "inputs": b"x",
         "session": {"id": "s-1", "step": 1}}


@pytest.mark.parametrize("wire", [
    {"t": "step_group", "submits": []},
    {"t": "step_group", "submits": [_STEP] * 65},
    {"t": "step_group", "submits": [_STEP, _STEP]},  # one job twice
    {"t": "step_group", "submits": [_STEP, {**_STEP, "job": "s-1.2"}]},  # one session twice
    {"t": "step_group", "submits": [{**_STEP, "session": None}]},  # not a session step
    {"t": "step_group", "submits": [{k: v for k, v in _STEP.items() if k != "inputs"} | {"inputs_size": 0}]},
    {"t": "step_group", "submits": [7]},
    {"t": "step_group", "submits": "x"},
    {"t": "step_group_answer", "replies": []},
    {"t": "step_group_answer", "replies": [{"t": "result", "outputs_size": 3, "receipt": b""}]},  # not inline
    {"t": "step_group_answer", "replies": [{"t": "ok"}]},
    {"t": "step_group_answer", "replies": [3]},
    {"t": "push_group", "pushes": []},
    {"t": "push_group", "pushes": [{"t": "push"}]},
    {"t": "push_group", "pushes": [1]},
])
def test_groups_refuse_what_is_malformed(wire):
    with pytest.raises(ProtocolError):
        protocol.decode(msgpack.packb(wire, use_bin_type=True))


def test_group_frames_are_packed_in_order_within_their_room_and_count():
    """What a client's group steps and a worker's group pushes go in: runs in order, each within its bytes and its
    count; one too big for any run, or one meant to go alone, is a run of its own."""
    sizes = [10, 10, 10, 25, 5, 40, 1, 1]
    runs = protocol.pack(range(len(sizes)), lambda i: sizes[i], room=30, most=3)
    assert runs == [[0, 1, 2], [3, 4], [5], [6, 7]]
    assert sum(runs, []) == list(range(len(sizes)))
    runs = protocol.pack(range(len(sizes)), lambda i: sizes[i], room=100, most=3, alone=lambda i: sizes[i] > 20)
    assert runs == [[0, 1, 2], [3], [4], [5], [6, 7]]
    assert protocol.pack([], len, room=10, most=2) == []
