"""``gpunet worker``: run a worker on this machine (its options are WorkerConfig's fields, whose defaults they show),
and ``gpunet worker pause`` / ``resume`` to control the one that runs from a data dir."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

import typer

from gpunet.cli.exits import handle_errors
from gpunet.cli.options import (
    AnnounceMaddrs,
    DataDir,
    Device,
    HostMaddrs,
    InitialPeers,
    Network,
    Verbose,
    setup_logging,
)
from gpunet.config import WorkerConfig

#: The worker's defaults, shown and used by its options: WorkerConfig is their one source.
_WORKER = WorkerConfig()

worker_app = typer.Typer(
    name="worker",
    invoke_without_command=True,  # `gpunet worker [OPTIONS]` runs a worker; `gpunet worker pause` talks to one
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


# Longer than 120 lines on purpose: one typer option per WorkerConfig field, each with its help, then the config built
# from them; the body that does anything is the last three lines. Grouping the options into objects would hide them
# from Typer, which reads the signature.
@worker_app.callback()
@handle_errors
def worker(
    ctx: typer.Context,
    initial_peers: Optional[List[str]] = InitialPeers,
    network: str = Network,
    device: str = Device,
    price: float = typer.Option(_WORKER.price, "--price", metavar="CREDITS", min=0,
                                help="Credits per TFLOP of counted work, interactive lane (default 1)."),
    batch_price: Optional[float] = typer.Option(
        None, "--batch-price", metavar="CREDITS", min=0,
        help="The batch lane's floor: the least batch work sells for here, credits per TFLOP (default: half of "
             "--price). It rises toward --price while interactive work is wanted; see docs/market.md."),
    max_concurrent: int = typer.Option(
        _WORKER.max_concurrent, "--max-concurrent", metavar="N", min=1, help="Jobs executing at once."),
    threads: Optional[int] = typer.Option(
        _WORKER.threads, "--threads", metavar="N", min=1,
        help="CPU threads a job may use (default: the cores, shared among --max-concurrent jobs). Fewer leave cores "
             "free for you; the speed advertised is measured with them."),
    max_queue: int = typer.Option(
        _WORKER.max_queue, "--max-queue", metavar="N", min=0, help="Jobs waiting; beyond this the worker answers busy."),
    public_name: Optional[str] = typer.Option(
        _WORKER.public_name, "--public-name", metavar="NAME", help="A name shown in `gpunet status`."),
    host_maddrs: Optional[List[str]] = HostMaddrs,
    data_dir: Optional[Path] = DataDir,
    heartbeat: float = typer.Option(
        _WORKER.heartbeat, "--heartbeat", metavar="SECONDS", min=0.5, help="Seconds between record refreshes."),
    drain_timeout: float = typer.Option(
        _WORKER.drain_timeout, "--drain-timeout", metavar="SECONDS", min=0, help="Seconds running jobs get after SIGTERM."),
    rebenchmark: bool = typer.Option(_WORKER.rebenchmark, "--rebenchmark", help="Measure the device's speed again."),
    remeasure_every: float = typer.Option(
        _WORKER.remeasure_every, "--remeasure-every", metavar="SECONDS", min=0,
        help="Measure the speed again after this long, when no job is running (0: never)."),
    memory_budget_gb: Optional[float] = typer.Option(
        _WORKER.memory_budget_gb, "--memory-budget-gb", metavar="GIB", min=0.1, help="Memory per executor."),
    buffer_gb: Optional[float] = typer.Option(
        _WORKER.buffer_gb, "--buffer-gb", metavar="GIB", min=0.01,
        help="Job payloads held in memory at once (default: a quarter of RAM, at least 1 GiB)."),
    sandbox: bool = typer.Option(
        _WORKER.sandbox, "--sandbox/--no-sandbox",
        help="Lock executors down (Landlock, seccomp, rlimits; see docs/security.md). Turn off only if your kernel or "
             "GPU driver refuses it."),
    metrics_port: int = typer.Option(
        _WORKER.metrics_port, "--metrics-port", metavar="PORT", min=0, max=65535, help="Serve Prometheus metrics on 127.0.0.1:PORT."),
    announce_maddrs: Optional[List[str]] = AnnounceMaddrs,
    relay_service: bool = typer.Option(
        _WORKER.relay_service, "--relay-service/--no-relay-service",
        help="When directly reachable, relay for workers behind NAT (circuit relay v2). Off by default: a relay "
             "carries anyone's traffic, a stranger's too, as fast as your uplink allows (docs/reachability.md). "
             "Bootstrap nodes relay for the network."),
    relay_circuit_mb: float = typer.Option(
        _WORKER.relay_circuit_mb, "--relay-circuit-mb", metavar="MIB", min=0.0625,
        help="With --relay-service: bytes each way one relayed connection carries before it is reset."),
    relay_circuit_minutes: float = typer.Option(
        _WORKER.relay_circuit_minutes, "--relay-circuit-minutes", metavar="MIN", min=0.1,
        help="With --relay-service: how long one relayed connection lives."),
    relay_circuits: int = typer.Option(
        _WORKER.relay_circuits, "--relay-circuits", metavar="N", min=1,
        help="With --relay-service: relayed connections open at once, per peer."),
    relay_reservations: int = typer.Option(
        _WORKER.relay_reservations, "--relay-reservations", metavar="N", min=1,
        help="With --relay-service: peers behind NAT it holds a relay slot for (in all, and per peer and address)."),
    peer_upload_mbps: float = typer.Option(
        _WORKER.peer_upload_mbps, "--peer-upload-mbps", metavar="MB/S", min=0.0,
        help="Serve programs to other workers (so a client uploads each once) at most this fast, in all; 0: no cap."),
    models_dirs: Optional[list[Path]] = typer.Option(
        None, "--models-dir", metavar="DIR", file_okay=False,
        help="A folder of Hugging Face checkpoints (safetensors) you keep: models served from them need no upload, "
             "and their tensors may be loaded for anyone's job (docs/weights.md). Repeatable."),
    session_memory_gb: Optional[float] = typer.Option(
        _WORKER.session_memory_gb, "--session-memory-gb", metavar="GIB", min=0.0,
        help="Memory for inference sessions' state (KV caches), all together; default: a quarter of the executor "
             "memory budget; 0: no sessions."),
    max_sessions_per_client: int = typer.Option(
        _WORKER.max_sessions_per_client, "--max-sessions-per-client", metavar="N", min=0,
        help="Inference sessions one client may hold open here."),
    session_ttl: float = typer.Option(
        _WORKER.session_ttl, "--session-ttl", metavar="SECONDS", min=1.0,
        help="The longest a session may stay idle before its state is freed (a client may ask for less)."),
    batch_sessions: bool = typer.Option(
        _WORKER.batch_sessions, "--batch-sessions/--no-batch-sessions",
        help="Run the waiting steps of sessions of one span as one forward (more tokens/s for everyone; results "
             "equal to float rounding, docs/sessions.md)."),
    cuda_graphs: bool = typer.Option(
        _WORKER.cuda_graphs, "--cuda-graphs/--no-cuda-graphs",
        help="On a CUDA GPU, capture runs that repeat their shapes (decode steps, equal batches) as CUDA graphs and "
             "replay them: the same results, far less time per step. Turn off if your driver misbehaves."),
    background_job: Optional[Path] = typer.Option(
        _WORKER.background_job, "--background-job", metavar="FILE", exists=True, dir_okay=False,
        help="A job of your own (saved with gpunet.Job.save) to run whenever no paying job wants this machine; any "
             "paying job stops it. Outputs go to <data dir>/background/."),
    background_inputs: Optional[Path] = typer.Option(
        _WORKER.background_inputs, "--background-inputs", metavar="FILE", exists=True, dir_okay=False,
        help="The background job's inputs: a safetensors file with tensors input_0, input_1, ..."),
    pause_when_busy: bool = typer.Option(
        _WORKER.pause_when_busy, "--pause-when-busy",
        help="Pause while other processes use the GPU (on a CPU worker: keep more than half the CPU busy); resume "
             "once the machine has been free for --resume-after seconds."),
    active_hours: Optional[str] = typer.Option(
        _WORKER.active_hours, "--active-hours", metavar="HOURS",
        help="Take jobs only in these local hours: 22:00-08:00, Mon-Fri 18:00-08:00, several joined by commas."),
    max_temperature: Optional[float] = typer.Option(
        _WORKER.max_temperature, "--max-temperature", metavar="CELSIUS",
        help="Pause while the hottest GPU is above this (NVML); resume 5 degrees below."),
    resume_after: float = typer.Option(
        _WORKER.resume_after, "--resume-after", metavar="SECONDS", min=0,
        help="With --pause-when-busy: how long the machine must be free before the worker takes jobs again."),
    pause_grace: float = typer.Option(
        _WORKER.pause_grace, "--pause-grace", metavar="SECONDS", min=0,
        help="When the worker pauses, running jobs get this long to finish; then they are stopped (their clients "
             "run them elsewhere)."),
    dashboard_port: int = typer.Option(
        _WORKER.dashboard_port, "--dashboard-port", metavar="PORT", min=0, max=65535,
        help="Serve this worker's dashboard (state, jobs, earnings, pause) on http://127.0.0.1:PORT."),
    fake_gpu_probe: Optional[Path] = typer.Option(
        _WORKER.fake_gpu_probe, "--fake-gpu-probe", metavar="FILE", hidden=True,
        help="FAKE HARDWARE for tests: read the GPU's use by others and its temperature from this JSON file."),
    fake_cuda_graphs: bool = typer.Option(
        _WORKER.fake_cuda_graphs, "--fake-cuda-graphs", hidden=True,
        help="FAKE HARDWARE for tests: a CPU stand-in for CUDA graphs (gpunet.worker.executor.graphs.FakeCudaGraphs)."),
    fault_corrupt_fraction: float = typer.Option(
        _WORKER.fault_corrupt_fraction, "--fault-corrupt-fraction", metavar="F", min=0.0, max=1.0, hidden=True,
        help="FAULT INJECTION for tests: return corrupted outputs for this fraction of jobs."),
    fault_corrupt_pieces: bool = typer.Option(
        _WORKER.fault_corrupt_pieces, "--fault-corrupt-pieces", hidden=True,
        help="FAULT INJECTION for tests: serve other workers program pieces with one byte wrong."),
    fault_corrupt_pushes: bool = typer.Option(
        _WORKER.fault_corrupt_pushes, "--fault-corrupt-pushes", hidden=True,
        help="FAULT INJECTION for tests: push the next span's worker a session step output with one byte wrong "
             "(and answer the client rightly)."),
    fault_drop_pushes: bool = typer.Option(
        _WORKER.fault_drop_pushes, "--fault-drop-pushes", hidden=True,
        help="FAULT INJECTION for tests: never push a session step's output to the next span's worker."),
    fault_answer_late: float = typer.Option(
        _WORKER.fault_answer_late, "--fault-answer-late", metavar="SECONDS", min=0.0, hidden=True,
        help="FAULT INJECTION for tests: hold each job's answer until SECONDS before the client's timeout."),
    verbose: int = Verbose,
) -> None:
    """Join a network (or start one) and serve jobs on this machine's GPU or CPU; `gpunet worker pause` / `resume`
    control one that runs."""
    if ctx.invoked_subcommand is not None:
        return
    # Before torch loads (the imports below), whose OpenMP reads it then: threads that sleep between jobs rather than
    # spin, here and in the executors forked from this process (gpunet/worker/executor/preload.py says why).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from gpunet.worker.executor import forkserver
    from gpunet.worker.server import Worker

    setup_logging(verbose)
    config = WorkerConfig(
        network=network,
        initial_peers=list(initial_peers or []),
        device=device,
        price=price,
        batch_price=batch_price,
        max_concurrent=max_concurrent,
        threads=threads,
        max_queue=max_queue,
        public_name=public_name,
        data_dir=data_dir,
        heartbeat=heartbeat,
        drain_timeout=drain_timeout,
        rebenchmark=rebenchmark,
        remeasure_every=remeasure_every,
        memory_budget_gb=memory_budget_gb,
        buffer_gb=buffer_gb,
        sandbox=sandbox,
        metrics_port=metrics_port,
        announce_maddrs=list(announce_maddrs or []),
        relay_service=relay_service,
        relay_circuit_mb=relay_circuit_mb,
        relay_circuit_minutes=relay_circuit_minutes,
        relay_circuits=relay_circuits,
        relay_reservations=relay_reservations,
        peer_upload_mbps=peer_upload_mbps,
        models_dirs=list(models_dirs or []),
        session_memory_gb=session_memory_gb,
        max_sessions_per_client=max_sessions_per_client,
        session_ttl=session_ttl,
        batch_sessions=batch_sessions,
        cuda_graphs=cuda_graphs,
        background_job=background_job,
        background_inputs=background_inputs,
        pause_when_busy=pause_when_busy,
        active_hours=active_hours,
        max_temperature=max_temperature,
        resume_after=resume_after,
        pause_grace=pause_grace,
        dashboard_port=dashboard_port,
        fake_gpu_probe=fake_gpu_probe,
        fake_cuda_graphs=fake_cuda_graphs,
        fault_corrupt_fraction=fault_corrupt_fraction,
        fault_corrupt_pieces=fault_corrupt_pieces,
        fault_corrupt_pushes=fault_corrupt_pushes,
        fault_drop_pushes=fault_drop_pushes,
        fault_answer_late=fault_answer_late,
    )
    if host_maddrs:
        config.host_maddrs = list(host_maddrs)
    # The executors' fork server, forked now (this process has imported torch, and has read no key or data dir yet)
    # rather than spawned later to import it again. Nothing here has run a parallel torch op yet: OpenMP's threads,
    # once started, do not survive a fork.
    forkserver.start_forkserver(from_here=True)
    raise typer.Exit(Worker(config).run())


@worker_app.command("pause")
@handle_errors
def worker_pause(
    data_dir: Optional[Path] = DataDir,
    reason: str = typer.Option("", "--reason", metavar="TEXT", help="Why (shown in its record and dashboard)."),
) -> None:
    """Pause the worker of this data dir: it takes no new jobs, and running ones get --pause-grace to finish. It
    stays paused, across restarts too, until `gpunet worker resume`."""
    from gpunet.config import resolve_data_dir
    from gpunet.worker.control import set_pause

    where = resolve_data_dir(data_dir)
    pid = set_pause(where, reason)
    print(f"Paused the worker of {where} (pid {pid}); it finishes running jobs and takes no new ones." if pid else
          f"No worker runs from {where} now; the next one started there starts paused.")


@worker_app.command("resume")
@handle_errors
def worker_resume(data_dir: Optional[Path] = DataDir) -> None:
    """Let a worker paused by `gpunet worker pause` take jobs again (its other rules still apply)."""
    from gpunet.config import resolve_data_dir
    from gpunet.worker.control import set_pause

    where = resolve_data_dir(data_dir)
    pid = set_pause(where, None)
    print(f"Resumed the worker of {where} (pid {pid})." if pid else f"No worker runs from {where} now; the next one "
          "started there will not start paused.")
