"""Settings that tune behaviour, with the defaults the CLI exposes, in one place."""

from __future__ import annotations

import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from gpunet.errors import ConfigError


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity (taskset, a container's cpuset), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


DEFAULT_NETWORK = "gpunet"
#: What a network name may be: it is part of every door's protocol name and of DHT keys, and shown in commands.
NETWORK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}\Z")
INITIAL_PEERS_ENV = "GPUNET_INITIAL_PEERS"
DATA_DIR_ENV = "GPUNET_DATA_DIR"
DEFAULT_DATA_DIR = "~/.gpunet"
#: Volunteers must be reachable by others, so long-lived nodes listen on every interface unless told otherwise.
DEFAULT_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/0",)
#: Nodes that only read the network (status, doctor) and local test networks listen on loopback alone.
LOOPBACK_MADDR = "/ip4/127.0.0.1/tcp/0"


def resolve_data_dir(data_dir: str | os.PathLike | None = None, *, writable: bool = False) -> Path:
    """The data dir from the argument, else ``GPUNET_DATA_DIR``, else ``~/.gpunet``; created if missing.

    ``writable``: a node is about to keep its key, ledger and caches there; ConfigError now, with the reason, rather
    than a traceback from whichever write comes first.
    """
    raw = data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR
    path = Path(raw).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise ConfigError(f"cannot create data dir {path}: {e.strerror}") from e
    if writable:
        try:
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as e:
            raise ConfigError(f"data dir {path} is not writable ({e.strerror}): gpunet keeps its key, ledger and "
                              "caches there; pass a writable --data-dir (or GPUNET_DATA_DIR)") from None
    return path


#: The most a worker may charge, in credits per TFLOP (10,000 times the default): a receipt's amount is a 64-bit count
#: of nano-credits, so at this price one job can bill up to 1.8 EFLOP (about half an hour of a 1 PFLOPS accelerator).
MAX_PRICE = 1e4


#: The lowest cap on serving programs to peers: each of a worker's 4 serving streams must stay above the 1 MiB/s a
#: fetcher holds a stream to (gpunet.protocol.MIN_PAYLOAD_RATE).
MIN_PEER_UPLOAD_MBPS = 5.0


@dataclass
class WorkerConfig:
    """Everything ``gpunet worker`` can be told."""

    network: str = DEFAULT_NETWORK
    initial_peers: list[str] = field(default_factory=list)
    device: str = "auto"
    price: float = 1.0  # credits per TFLOP of counted work (the interactive lane)
    #: The batch lane's floor when no interactive work is wanted (docs/market.md); None: half of ``price``, the
    #: discount batch APIs usually give. Never above ``price``.
    batch_price: float | None = None
    max_concurrent: int = 1  # jobs executing at once
    #: CPU threads one job's ops may use (torch's intra-op threads, and the speed measured with them); None: the
    #: cores shared among the ``max_concurrent`` executors. Fewer leave cores to the owner (and to other workers on
    #: the same machine).
    threads: int | None = None
    max_queue: int = 8  # jobs waiting beyond those; more are refused with "busy"
    public_name: str | None = None
    host_maddrs: list[str] = field(default_factory=lambda: list(DEFAULT_HOST_MADDRS))
    data_dir: Path | None = None
    heartbeat: float = 10.0  # seconds between record refreshes; records live three heartbeats
    drain_timeout: float = 30.0  # seconds running jobs get to finish after SIGTERM
    rebenchmark: bool = False
    remeasure_every: float = 600.0  # seconds between idle speed re-measurements (0: never); see worker.throughput
    memory_budget_gb: float | None = None  # per executor; default: a share of free device memory
    buffer_gb: float | None = None  # job payloads held in the worker at once; default: a quarter of RAM (>= 1 GiB)
    sandbox: bool = True  # executors lock themselves down (gpunet.worker.executor.sandbox); off only for a kernel that balks
    metrics_port: int = 0  # 0: no Prometheus endpoint
    announce_maddrs: list[str] = field(default_factory=list)  # addresses to announce (a forwarded port), checked
    # A directly reachable worker relays for workers behind NAT only when asked to (--relay-service): a relay carries
    # anyone's traffic, and nothing in the p2p daemon bounds how often a circuit is opened again (docs/reachability.md).
    relay_service: bool = False
    relay_circuit_mb: float = 1024.0  # bytes each way one relayed connection carries before the relay resets it
    relay_circuit_minutes: float = 10.0  # how long one relayed connection lives
    relay_circuits: int = 8  # relayed connections open at once per peer
    relay_reservations: int = 32  # peers it holds relay slots for (the daemon: in all, and per peer and per address)
    peer_upload_mbps: float = 0.0  # MB/s it serves programs to other workers at, in all (0: no cap)
    #: Folders of Hugging Face-layout checkpoints (safetensors) the volunteer keeps: weights programs name by content
    #: hash are loaded from them instead of uploaded (docs/weights.md). Never followed outside each folder.
    models_dirs: list[Path] = field(default_factory=list)
    session_memory_gb: float | None = None  # inference sessions' state, all together; default: a quarter of the budget
    max_sessions_per_client: int = 8
    session_ttl: float = 600.0  # the longest a session may stay idle before its state is freed
    #: Sessions' steps of one batched span that wait together run as one forward (docs/sessions.md, batching).
    batch_sessions: bool = True
    #: Runs that repeat their shapes (sessions' decode steps, a map over equal batches) are captured as CUDA graphs
    #: and replayed, on a CUDA device (gpunet.worker.executor.graphs).
    cuda_graphs: bool = True
    #: The volunteer's own job, run whenever no paying job wants the machine (gpunet.worker.background), and its
    #: inputs (a safetensors file: input_0, input_1, ...).
    background_job: Path | None = None
    background_inputs: Path | None = None
    # The owner comes first (gpunet.worker.state.availability, docs/volunteer.md).
    pause_when_busy: bool = False  # pause while other processes use the GPU (or the CPU, on a CPU worker)
    active_hours: str | None = None  # e.g. "22:00-08:00" or "Mon-Fri 18:00-08:00,Sat-Sun 00:00-24:00", local time
    max_temperature: float | None = None  # degrees C, hottest GPU (NVML)
    resume_after: float = 60.0  # seconds the machine must be free before a worker paused for its owner resumes
    pause_grace: float = 30.0  # seconds running jobs get to finish when the worker pauses
    dashboard_port: int = 0  # the local dashboard on 127.0.0.1 (0: none)
    fake_gpu_probe: Path | None = None  # FAKE HARDWARE for tests: GPU use and temperature read from this JSON file
    fake_cuda_graphs: bool = False  # FAKE HARDWARE for tests: CUDA graphs played by a CPU stand-in (FakeCudaGraphs)
    fault_corrupt_fraction: float = 0.0  # FAULT INJECTION for tests/benchmarks: corrupt this share of outputs
    fault_corrupt_pieces: bool = False  # FAULT INJECTION for tests: serve other workers corrupted program pieces
    fault_corrupt_pushes: bool = False  # FAULT INJECTION for tests: push the next span's worker a wrong input
    fault_drop_pushes: bool = False  # FAULT INJECTION for tests: push the next span's worker nothing (a lost push)
    fault_answer_late: float = 0.0  # FAULT INJECTION for tests: hold each answer until this many seconds before the
    # client's timeout (a stall meant to leave the client no time to check it)

    def __post_init__(self):
        if self.threads is not None and not (type(self.threads) is int and 1 <= self.threads <= usable_cpus()):
            raise ConfigError(f"--threads must be from 1 to the {usable_cpus()} CPU(s) this worker may use, not "
                              f"{self.threads!r}: more threads than CPUs only slow each job and take the machine "
                              "from its owner")
        if self.public_name is not None and (len(self.public_name) > 64 or not self.public_name.isprintable()):
            raise ConfigError(f"--public-name must be at most 64 printable characters, not {self.public_name!r}: "
                              "it is shown in every `gpunet status` table")
        if self.peer_upload_mbps and self.peer_upload_mbps < MIN_PEER_UPLOAD_MBPS:
            raise ConfigError(f"--peer-upload-mbps must be 0 (no cap) or at least {MIN_PEER_UPLOAD_MBPS} MB/s: a peer "
                              "fetching from this worker gives up on a stream slower than about 1 MB/s")
        for folder in self.models_dirs:
            if not Path(folder).is_dir():
                raise ConfigError(f"--models-dir {folder}: not a folder (give the folder that holds your checkpoints)")
        if self.dashboard_port and self.dashboard_port == self.metrics_port:
            raise ConfigError(f"--dashboard-port and --metrics-port are both {self.dashboard_port}: give each its own")
        if not (isinstance(self.price, (int, float)) and math.isfinite(self.price) and 0 <= self.price <= MAX_PRICE):
            raise ConfigError(f"--price must be a number from 0 to {MAX_PRICE:g} credits per TFLOP, not {self.price!r}")
        if self.batch_price is None:
            self.batch_price = self.price / 2
        if not (isinstance(self.batch_price, (int, float)) and math.isfinite(self.batch_price)
                and 0 <= self.batch_price <= self.price):
            raise ConfigError(f"--batch-price must be a number from 0 to the interactive --price ({self.price:g}), not "
                              f"{self.batch_price!r}: batch work is the cheaper, preemptible lane")
