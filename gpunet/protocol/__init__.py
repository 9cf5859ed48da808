"""Every message of the job protocol, defined once for both ends: typed, with one encoder and one strict parser each.

``from gpunet.protocol import X`` is how the rest of gpunet (and tests) reach any of it; the modules say where each
thing lives:

* :mod:`~gpunet.protocol.doors` -- the doors (one libp2p protocol each) and each door's bounds;
* :mod:`~gpunet.protocol.fields` -- the :class:`Message` base, its registry, and the checked fields parsers read;
* :mod:`~gpunet.protocol.jobs` -- a job's path: Submit, Send, Payload, Result, Countersign, Refuse, SettleBatch,
  Cancel, Ok, UseStream, and the market's lanes;
* :mod:`~gpunet.protocol.sessions` -- inference sessions: SessionStep, PushTo, Push, CloseSession, SessionClosed;
* :mod:`~gpunet.protocol.peers` -- a program fetched from peers: the piece list, Pieces, GetPiece, PieceData;
  TensorHolders (weights named by reference, fetched from workers that keep their checkpoint);
* :mod:`~gpunet.protocol.holding` -- the proof that a client holds a program's bytes (both ends compute it);
* :mod:`~gpunet.protocol.probes` -- asking a node about itself: Ping, GetInfo, ProveSpeed, OpenProof, Hello,
  CheckReach and their answers;
* :mod:`~gpunet.protocol.errors` -- :class:`Error` and the one table between gpunet's errors and their wire codes;
* :mod:`~gpunet.protocol.framing` -- unary bodies, stream frames and payloads: encode, decode, read, write;
* :mod:`~gpunet.protocol.tensorframe` -- the framing of tensor bytes (safetensors layout), without torch.

Jobs travel through *doors*, one libp2p protocol each (:class:`Door`):

* ``job`` (a stream, any size)::

      client -> Submit{job, program, inputs_size, [inputs], timeout, max_price}
      worker -> Error{busy | rejected | ...}            at once: admission, before any payload moves
      worker -> Send{program, inputs}                   only when it lacks the program or the inputs were not inline
      client -> Payload{program_size, inputs_size} + raw program + raw inputs
      worker -> Send{tensors}                            only for weights a program names by reference that the
      client -> Payload{tensors_size} + raw tensors       worker holds nowhere (docs/weights.md)
      worker -> Result{outputs_size, [outputs], receipt} + raw outputs   | Error{code, message}
      client -> Countersign{job, signature} | Refuse{job, reason}         (or nothing: the work stays unpaid)

* ``run`` (unary, one round trip): Submit with inline inputs and ride-along countersignatures -> Result | UseStream |
  Error; ``steps`` (a stream a client keeps open for its session steps to one worker): the same exchange, repeated,
  Submit -> Result (its outputs after it as a payload when they do not fit in its frame) | UseStream | Error, or
  StepGroup (several sessions' steps in one frame) -> StepGroupAnswer (a reply each), until the client closes it or
  sends nothing for STEPS_IDLE seconds; ``settle`` (unary): Countersign | Refuse |
  SettleBatch -> Ok; ``cancel`` (unary): Cancel -> Ok, CloseSession -> SessionClosed; ``push`` (unary): Push (a
  session step's output, to the next span's worker) -> Ok | Error; ``pushes`` (a stream a worker keeps open to the
  next span's worker): Push or PushGroup -> Ok | Error, repeated, for pushes that fit in a frame;
  ``piece`` (a stream): GetPiece -> PieceData + bytes (or Have: not here yet), repeated;
  ``ping`` (unary): Ping -> Pong; ``info`` (a stream): GetInfo -> Info; ``prove`` (unary, see
  :mod:`gpunet.speedproof`): ProveSpeed -> SpeedCommitment, then OpenProof -> ProofOpening; ``reach`` (a stream,
  served by every node, see :mod:`gpunet.dht.reachability`): CheckReach -> ReachResult; ``hello`` (unary, outside
  every network): Hello -> Greeting.

On a stream a *frame* is a 4-byte big-endian length then a msgpack map whose ``"t"`` names the message, at most
64 KiB; a *payload* is raw bytes whose size a preceding frame declared, checked against the reader's cap before
anything is allocated and read in 1 MiB chunks. A unary body is the same msgpack map (hivemind caps it at 4 MiB).
Nothing read from the wire is ever unpickled or evaluated; unknown fields are ignored, so either end may add some.
"""

from __future__ import annotations

from gpunet.errors import (  # the errors the messages carry
    GpunetError,
    JobFailed,
    JobPreempted,
    JobRaised,
    JobRejected,
    JobTimeout,
    PayFirst,
    ProgramNotCached,
    ProtocolError,
    SessionLost,
    WorkerBusy,
    WorkerDraining,
)
from gpunet.protocol.doors import (
    PROTOCOL_VERSION,
    Door,
)
from gpunet.protocol.errors import (
    CROSSING,
    Error,
    error_named,
)
from gpunet.protocol.fields import (
    JOB_ID_RE,
    MESSAGES,
    PEER_ID_RE,
    PROGRAM_HASH_RE,
    M,
    Message,
)
from gpunet.protocol.framing import (
    CHUNK_BYTES,
    FRAME_TIMEOUT,
    MAX_FRAME_BYTES,
    MIN_PAYLOAD_RATE,
    check_payload_size,
    decode,
    encode,
    encode_frame,
    pack,
    payload_deadline,
    read,
    read_payload,
    write,
    write_payload,
)
from gpunet.protocol.holding import (
    PIECE,
    PROOF_BYTES,
    RUN,
    holding_key,
    proof,
    verifies,
)
from gpunet.protocol.jobs import (
    BACKGROUND,
    BATCH,
    CLIENT_LANES,
    CREDIT_LINE,
    INLINE_BYTES,
    INTERACTIVE,
    LANES,
    MAX_GROUP_ROWS,
    MAX_SETTLE_ITEMS,
    MAX_TENSORS_ASKED,
    UNARY_OUTPUT_BYTES,
    Cancel,
    Countersign,
    Ok,
    Payload,
    Refuse,
    Result,
    Send,
    SettleBatch,
    StepGroup,
    StepGroupAnswer,
    Submit,
    UseStream,
)
from gpunet.protocol.peers import (
    MAX_HOLDERS,
    MAX_HOLDER_MADDRS,
    MAX_PIECES,
    MIN_PIECE_BYTES,
    GetPiece,
    Have,
    PieceData,
    PieceList,
    Pieces,
    TensorHolders,
    piece_size_for,
)
from gpunet.protocol.probes import (
    MAX_PING_BYTES,
    MAX_REACH_PORTS,
    CheckReach,
    GetInfo,
    Greeting,
    Hello,
    Info,
    OpenProof,
    Ping,
    Pong,
    ProofOpening,
    ProveSpeed,
    ReachResult,
    SpeedCommitment,
)
from gpunet.protocol.sessions import (
    MAX_PUSH_BYTES,
    MAX_PUSH_GROUP,
    MAX_SESSION_STEP,
    MAX_SESSION_TTL,
    SESSION_ID_RE,
    STEPS_IDLE,
    STEPS_REUSE,
    CloseSession,
    Push,
    PushGroup,
    PushTo,
    SessionClosed,
    SessionStep,
)

__all__ = [
    "GpunetError",
    "JobFailed",
    "JobPreempted",
    "JobRaised",
    "JobRejected",
    "JobTimeout",
    "PayFirst",
    "ProgramNotCached",
    "ProtocolError",
    "SessionLost",
    "WorkerBusy",
    "WorkerDraining",
    "PROTOCOL_VERSION",
    "Door",
    "CROSSING",
    "Error",
    "error_named",
    "JOB_ID_RE",
    "MESSAGES",
    "PEER_ID_RE",
    "PROGRAM_HASH_RE",
    "M",
    "Message",
    "CHUNK_BYTES",
    "FRAME_TIMEOUT",
    "MAX_FRAME_BYTES",
    "MIN_PAYLOAD_RATE",
    "check_payload_size",
    "decode",
    "encode",
    "encode_frame",
    "payload_deadline",
    "read",
    "read_payload",
    "write",
    "write_payload",
    "PIECE",
    "PROOF_BYTES",
    "RUN",
    "holding_key",
    "proof",
    "verifies",
    "BACKGROUND",
    "BATCH",
    "CLIENT_LANES",
    "CREDIT_LINE",
    "INLINE_BYTES",
    "INTERACTIVE",
    "LANES",
    "MAX_SETTLE_ITEMS",
    "UNARY_OUTPUT_BYTES",
    "Cancel",
    "Countersign",
    "Ok",
    "Payload",
    "Refuse",
    "Result",
    "Send",
    "MAX_TENSORS_ASKED",
    "SettleBatch",
    "StepGroup",
    "StepGroupAnswer",
    "MAX_GROUP_ROWS",
    "Submit",
    "UseStream",
    "MAX_HOLDERS",
    "MAX_HOLDER_MADDRS",
    "MAX_PIECES",
    "MIN_PIECE_BYTES",
    "GetPiece",
    "Have",
    "PieceData",
    "PieceList",
    "Pieces",
    "TensorHolders",
    "piece_size_for",
    "MAX_PING_BYTES",
    "MAX_REACH_PORTS",
    "CheckReach",
    "GetInfo",
    "Greeting",
    "Hello",
    "Info",
    "OpenProof",
    "Ping",
    "Pong",
    "ProofOpening",
    "ProveSpeed",
    "ReachResult",
    "SpeedCommitment",
    "MAX_PUSH_BYTES",
    "STEPS_IDLE",
    "STEPS_REUSE",
    "MAX_SESSION_STEP",
    "MAX_SESSION_TTL",
    "SESSION_ID_RE",
    "CloseSession",
    "Push",
    "PushTo",
    "PushGroup",
    "MAX_PUSH_GROUP",
    "SessionClosed",
    "SessionStep",
]
