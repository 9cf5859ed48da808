"""What a worker lends, typed: the limits its admission and its sessions are held to, and what the executor is told
of a session step (:class:`SessionRun`, frozen: the one description of a step that crosses to the executor)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ServiceLimits:
    """What the worker takes from each job and its client: payload sizes, buffers, stops, credit (see Admission)."""

    max_program_bytes: int = 2 * 1024**3
    max_input_bytes: int = 1024**3
    max_timeout: float = 3600.0
    # Finished results kept for retries of the same job id (one client's up to buffer_share of it).
    recent_results_bytes: int = 256 * 1024**2
    # Stopping a running job costs this worker a fresh executor (a torch import, the program cache): a client that
    # stops more than this many within the window gets its new jobs refused until older stops age out.
    max_stopped_jobs: int = 20
    stopped_jobs_window: float = 600.0
    # What payloads may hold in this process at once (declared sizes, charged before reading), and how many uploads
    # one identity and one network address may have in progress.
    max_buffered_bytes: int = 4 * 1024**3
    max_uploads_per_client: int = 4
    max_uploads_per_host: int = 32
    # Of the buffer, one identity and one address may hold at most this share (declared sizes are charged before the
    # bytes come, so without it one address could hold it all while sending almost nothing); of the kept results,
    # one identity.
    buffer_share: float = 0.5
    # An address (identities are free) may stop or crash this many times the per-client allowance.
    host_stops_factor: int = 4
    # The dry run's time is paid by no receipt (work is counted from shapes and billed by FLOPs): it counts one stop
    # per this many CPU seconds, fractions carried over (per client and per address) to the next, less
    # dry_run_free_seconds for a job that is billed. Honest models of up to 1,200 nodes take 15-120 ms, and an
    # earlier dry run for the same shapes answers at once.
    dry_run_seconds_per_stop: float = 1.0
    dry_run_free_seconds: float = 0.25
    # The credit line: results delivered but not countersigned within the grace (a countersignature rides on the
    # client's next job or comes in a batch soon after) count against their client for the window; at this many,
    # its jobs are refused. A refusal counts too: the client got the outputs and did not pay.
    max_unpaid_jobs: int = 16
    countersign_grace: float = 120.0
    unpaid_window: float = 3600.0
    # Every client of one address together may hold this many times one client's results uncountersigned at once
    # (1.5 x 64 = 96 by default), so fresh identities add few free answers: one identity that never pays takes 64,
    # all the others at its address 32 more. Honest clients sharing an address (an office's NAT) pay as they go and
    # hold a result uncountersigned for about a round trip: dozens fit, and clients at full speed on one worker pace
    # themselves to share the line (gpunet.client.settlement) instead of being refused.
    host_credit_factor: float = 1.5
    # Speed challenges: each keeps the device busy for up to speedproof.MAX_SECONDS.
    proof_interval: float = 300.0
    max_proofs_per_minute: int = 10


@dataclass(frozen=True)
class SessionLimits:
    """What a volunteer lends to sessions: memory for their state, how many, and for how long idle."""

    max_bytes: int = 1 << 30  # all sessions' state together
    max_client_share: float = 0.5  # of max_bytes, the most one client's sessions (or one address's) may hold
    max_sessions: int = 64
    max_per_client: int = 8
    #: Identities are free, addresses less so: the sessions (and the share of max_bytes) of all clients at one network
    #: address together, so that a few identities from one machine cannot hold every session place.
    max_per_host: int = 16
    max_ttl: float = 600.0  # a client may ask for less idle time, never more


@dataclass(frozen=True)
class SessionRun:
    """A session step as the executor runs it: which state (``key``), which step of it, whether it starts afresh or
    ends the session, and how many bytes of state the step may still take (``room``, checked by the child)."""

    key: str
    step: int
    fresh: bool = False
    close: bool = False
    room: int = 0

    def to_wire(self) -> dict:
        """For the executor's pipe (msgpack)."""
        return asdict(self)
