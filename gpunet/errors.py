"""Every error gpunet raises, in one place.

Callers catch the family they care about; everything derives from :class:`GpunetError`.
"""

from __future__ import annotations


class GpunetError(Exception):
    """Base class of every error raised by gpunet."""

    #: The workers a job went to, in order, before it failed with this error (``JobFuture.attempts``); set by the
    #: client as the error leaves a job's tries.
    attempts: tuple[str, ...] | list[str] = ()


# --- configuration and local state -------------------------------------------------------------------------------


class ConfigError(GpunetError):
    """A setting, flag or data directory is unusable."""


class DataDirInUse(ConfigError):
    """Another running node holds this data dir (one node per data dir: the dir holds the node's identity)."""


class IdentityError(ConfigError):
    """The node's key file is missing, unreadable or malformed."""


# --- network ---------------------------------------------------------------------------------------------------------


class NetworkError(GpunetError):
    """The node could not join the network or talk to a peer."""


class LocalNetworkDown(NetworkError):
    """This node's own p2p daemon is gone (a Ctrl-C to the whole process group stops it too): no peer is at fault."""


class PeersUnreachable(NetworkError):
    """None of the initial peers answered: they may be down or restarting (a node may wait and try again)."""


class ProtocolError(NetworkError):
    """A peer broke the job protocol: a malformed, oversized or unexpected message, or a stream cut mid-message."""


class StreamBroken(ProtocolError):
    """A stream ended or was reset mid-message: the path's doing as often as the peer's (the p2p daemon resets one
    now and then under a burst of streams; a relay resets its circuits)."""


class InvalidRecord(GpunetError):
    """A DHT record failed its signature or schema check."""


class NoWorkersAvailable(GpunetError):
    """No live worker meets the job's requirements (or every candidate failed)."""

    retry_at: float | None = None  # monotonic time a busy or banned worker becomes eligible again, if any


# --- jobs ------------------------------------------------------------------------------------------------------------


class JobError(GpunetError):
    """Something went wrong with a job."""


class JobRejected(JobError):
    """A job was refused before it ran (malformed, forbidden op, over a limit); ``reason`` says exactly why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class WeightsNotHeld(JobRejected):
    """(Client side) a worker asked this client for weights its program names by reference that the client holds
    only by hash (a slim checkpoint folder: docs/weights.md), and no worker the client could name delivered them:
    that worker cannot run it; one that keeps the checkpoint, or can fetch it from one that does, can."""


class PayFirst(JobRejected):
    """A worker holds this client (or its address) at its credit line: results delivered and not yet countersigned.
    A client that pays for what it receives waits for its countersignatures to land and asks the same worker again;
    to an older client it reads as a refusal like any other."""


class DryRunTooLong(JobRejected):
    """The dry run that counts a job's work (from shapes, before anything runs) took longer than the worker allows
    (``WorkerLimits.max_dry_run_seconds``): the program has too many nodes, or nodes too slow to count, for one job."""


class UsageError(GpunetError, TypeError):
    """gpunet was handed something it cannot use (a model where a Job belongs, a list where a tensor belongs); the
    message says what to pass instead."""


class UnsupportedProgram(JobError, ValueError):
    """A module or function cannot become a gpunet job (tracing failed, or it needs something the format cannot carry)."""


class ProgramNotCached(JobError):
    """The worker does not hold this program hash; resend the job with its program bytes."""

    def __init__(self, program_hash: str):
        super().__init__(f"program {program_hash} is not cached on this worker")
        self.program_hash = program_hash


class JobFailed(JobError):
    """A job started but did not produce a result (it raised, or its executor died)."""


class JobRaised(JobFailed):
    """An op of the job's own program raised on the job's values as it ran (an index out of range, offsets a guard
    refused): the same inputs raise the same way on any worker. A client does not take one worker's word for it (saying
    so gets rid of a job): it runs a small job itself, or asks a second worker drawn at random (docs/trust.md)."""

    #: The client ran the job itself and it raised the same: any result a worker gave for it was made up.
    confirmed_here: bool = False


class ExecutorDied(JobFailed):
    """(Worker side) the executor process died under a job — a kernel crash, the OOM killer. It costs the worker a
    fresh executor, so the worker counts it against the job's client; the client sees a JobFailed."""


class ExecutorStartFailed(JobFailed):
    """(Worker side) an executor process could not start its device (a GPU driver, or the executor sandbox, refusing
    it). Not the job's fault: the worker says it at start rather than failing every job."""


class SessionLost(JobFailed):
    """A session's state is no longer on the worker (it expired, was closed, or the worker or its executor restarted);
    the client rebuilds it elsewhere by replaying the session's past inputs (gpunet.client.sessions)."""


class WeightsMismatch(JobFailed):
    """(Worker side) weights a program names by reference (gpunet.job.format.WeightRef) did not match their hash as
    they loaded: a damaged or changed checkpoint file on the worker, not the job's fault. The worker forgets where it
    found them and brings them from elsewhere; ``hashes`` says which."""

    hashes: tuple[str, ...] = ()

    def __init__(self, message: str, hashes: tuple[str, ...] = ()):
        super().__init__(message)
        self.hashes = tuple(hashes)


class JobTimeout(JobError):
    """A job did not finish within its deadline."""


class WorkerBusy(JobError):
    """A worker's queue is full; it refused the job at once instead of queueing it."""

    def __init__(self, message: str, queue_length: int = 0):
        super().__init__(message)
        self.queue_length = queue_length


class WorkerDraining(WorkerBusy):
    """A worker is shutting down: it finishes what it runs and takes nothing new (a session on it moves elsewhere)."""


class JobPreempted(WorkerBusy):
    """A batch job was stopped to make room for an interactive one; it was not billed, and the client runs it again
    elsewhere or later (docs/market.md)."""


class DeadlineUnreachable(JobRejected):
    """No worker can run the job before its deadline (``Requirements.deadline``): said before it is sent, or once
    every worker that could take it refused it for that reason."""


class VerificationFailed(JobError):
    """Redundant results disagreed and no majority emerged, or a result failed its checks."""


class SpeedProofFailed(GpunetError):
    """A worker's answer to a speed challenge did not check out: it claimed matrix products it did not compute."""


# --- ledger ----------------------------------------------------------------------------------------------------------


class LedgerError(GpunetError):
    """The ledger could not be read, written or verified."""


class InvalidReceipt(LedgerError):
    """A receipt is malformed or one of its signatures does not verify."""


class LedgerCorrupted(LedgerError):
    """The stored hash chain or a stored receipt failed verification; ``entry`` names the first bad one."""

    def __init__(self, message: str, entry: int | None = None):
        super().__init__(message)
        self.entry = entry


class ReceiptConflict(LedgerError):
    """Two different valid-looking receipts exist for one job id: evidence of fraud."""


__all__ = [name for name, obj in globals().items() if isinstance(obj, type) and issubclass(obj, GpunetError)]
