"""``gpunet doctor``: the host self-check a volunteer runs before joining, like GPU marketplaces ask of their hosts.

Each check passes, warns, fails or is skipped, always with a line of advice. Nothing here contacts any address beyond
the ``--initial-peers`` the user gave (which, asked to, connect back to this host to test its reachability).
"""

from __future__ import annotations

import asyncio
import enum
import fcntl
import ipaddress
import platform
import shutil
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rich.table import Table

from gpunet.config import DEFAULT_HOST_MADDRS, DEFAULT_NETWORK, resolve_data_dir
from gpunet.errors import GpunetError
from gpunet.worker import hardware as hw

GiB = 2**30
#: hivemind refuses records from peers whose clocks are more than this far apart.
MAX_CLOCK_OFFSET = 3.0


class Verdict(str, enum.Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


@dataclass(frozen=True)
class Check:
    name: str
    outcome: Verdict
    detail: str
    advice: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "outcome": self.outcome.value, "detail": self.detail, "advice": self.advice}


def check_gpu(device: str, report: hw.NvmlReport | None) -> list[Check]:
    if report is None:
        outcome = Verdict.FAIL if device.startswith("cuda") else Verdict.WARN
        return [
            Check(
                "gpu",
                outcome,
                "no NVIDIA GPU or driver visible through NVML",
                "install the NVIDIA driver to serve GPU jobs; without one this host serves CPU jobs only",
            )
        ]
    names = ", ".join(f"{g.index}: {g.name} ({g.memory_total / GiB:.0f} GiB)" for g in report.gpus)
    checks = [Check("gpu", Verdict.PASS, f"{len(report.gpus)} GPU(s): {names}; driver {report.driver}, CUDA {report.cuda}")]
    import torch

    if torch.cuda.is_available():
        checks.append(Check("torch-cuda", Verdict.PASS, f"torch {torch.__version__} sees {torch.cuda.device_count()} GPU(s)"))
    else:
        checks.append(
            Check(
                "torch-cuda",
                Verdict.FAIL,
                f"torch {torch.__version__} was built without CUDA or cannot load it",
                "install a CUDA build of torch matching the driver (pip install torch)",
            )
        )
    return checks


def check_cpu() -> Check:
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return Check("cpu", Verdict.PASS, f"{hw.cpu_model()} ({machine}); AVX is an x86 requirement")
    flags = hw.cpu_flags()
    if "avx512f" in flags:
        bf16 = " (bf16)" if "avx512_bf16" in flags else ""
        return Check("cpu", Verdict.PASS, f"{hw.cpu_model()} with AVX-512{bf16}")
    if "avx2" in flags:
        return Check("cpu", Verdict.PASS, f"{hw.cpu_model()} with AVX2")
    if "avx" in flags:
        return Check("cpu", Verdict.WARN, f"{hw.cpu_model()} has AVX but not AVX2", "CPU-side work will be slow")
    return Check("cpu", Verdict.FAIL, f"{hw.cpu_model()} lacks AVX", "PyTorch needs AVX on x86; use another host")


def check_ram(gpu_count: int, gpu_memory: int) -> Check:
    total, available = hw.memory_bytes()
    detail = f"{total / GiB:.1f} GiB RAM ({available / GiB:.1f} GiB available)"
    if gpu_count:
        per_gpu = total / gpu_count
        detail += f", {per_gpu / GiB:.1f} GiB per GPU"
        if per_gpu < gpu_memory:
            return Check("ram", Verdict.WARN, detail, "marketplaces expect at least as much RAM per GPU as GPU memory")
    elif total < 4 * GiB:
        return Check("ram", Verdict.WARN, detail, "under 4 GiB leaves little room for jobs")
    return Check("ram", Verdict.PASS, detail)


def check_disk(data_dir: Path) -> Check:
    try:
        resolve_data_dir(data_dir, writable=True)
    except GpunetError as e:
        return Check("disk", Verdict.FAIL, str(e), "make the data dir writable, or pass another --data-dir")
    free = shutil.disk_usage(data_dir).free
    detail = f"{free / GiB:.1f} GiB of disk free in {data_dir}"
    if free < 1 * GiB:
        return Check("disk", Verdict.FAIL, detail, "the program cache and ledger need space; free some disk")
    if free < 10 * GiB:
        return Check("disk", Verdict.WARN, detail, "10 GiB or more lets the worker cache large programs")
    return Check("disk", Verdict.PASS, detail)


def _ipv4_addresses() -> list[str]:
    """The host's IPv4 addresses, read from the kernel (no DNS, no traffic)."""
    addrs = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue
            addrs.append(socket.inet_ntoa(packed[20:24]))
    return addrs


def check_models(data_dir: Path, models_dirs: Sequence[Path]) -> Check:
    """The checkpoints a worker would serve from its models dirs (indexed into the worker's own index file), and the
    disk the weights clients sent take (the tensor store beside the program cache)."""
    from gpunet.job.checkpoints import CheckpointIndex

    store = data_dir / "programs" / "tensors"
    stored = sum(f.stat().st_size for f in store.glob("*.tensor")) if store.is_dir() else 0
    kept = f"weights from clients: {stored / GiB:.2f} GiB in {store}"
    if not models_dirs:
        return Check("models", Verdict.SKIP, f"no --models-dir given; {kept}")
    missing = [str(d) for d in models_dirs if not Path(d).is_dir()]
    if missing:
        return Check("models", Verdict.FAIL, f"not a folder: {', '.join(missing)}", "give the folder that holds your "
                     "checkpoints (Hugging Face layout: config.json and *.safetensors)")
    index = CheckpointIndex(models_dirs, cache=data_dir / "models-index.json").scan()
    held = index.checkpoints()
    detail = (f"{len(held)} checkpoint(s), {index.total_bytes / GiB:.2f} GiB of safetensors in "
              f"{', '.join(map(str, models_dirs))}; {kept}")
    if index.skipped:
        return Check("models", Verdict.WARN, f"{detail}; not indexed: {index.skipped[0]}"
                     + (f" (and {len(index.skipped) - 1} more)" if len(index.skipped) > 1 else ""),
                     "files outside the folder (symlinks out) and unreadable files are never served")
    if not held:
        return Check("models", Verdict.WARN, detail, "no *.safetensors files there: nothing to serve from disk")
    return Check("models", Verdict.PASS, detail)


def check_reachability(host_maddrs: Sequence[str] | None) -> Check:
    maddrs = list(host_maddrs or DEFAULT_HOST_MADDRS)
    ips = []
    for maddr in maddrs:
        parts = maddr.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            ips.extend(_ipv4_addresses() if parts[2] == "0.0.0.0" else [parts[2]])
    parsed = [ipaddress.ip_address(ip) for ip in ips]
    public = [ip for ip in parsed if ip.is_global]
    private = [ip for ip in parsed if ip.is_private and not ip.is_loopback]
    if public:
        return Check("reachability", Verdict.PASS, f"listening on public address(es) {', '.join(map(str, public))}")
    if private:
        return Check(
            "reachability",
            Verdict.WARN,
            f"only private address(es) {', '.join(map(str, private))}",
            "peers outside your LAN reach you only through a port forward (--host-maddrs with a fixed port) or a relay",
        )
    return Check(
        "reachability", Verdict.FAIL, "listening on loopback only", "others cannot reach this node; use --host-maddrs"
    )


def check_inbound(dht, network: str, peers: Sequence[str], host_maddrs: Sequence[str] | None) -> Check:
    """A real inbound test: listen on the port a worker here would use and ask an initial peer to connect back to it
    (the ``reach`` door, the same check a worker runs at start). Not reachable: try what a worker would do next,
    a circuit-relay reservation on the initial peers, and say whether one was granted."""
    from gpunet.dht import reachability
    from gpunet.rpc import RPC

    ports = reachability.tcp_ports(host_maddrs or ())
    ips = [m.split("/")[2] for m in host_maddrs or () if m.startswith("/ip4/")]
    try:  # where a worker given the same --host-maddrs would listen (all interfaces by default)
        listener = socket.create_server((ips[0] if ips else "0.0.0.0", ports[0] if ports else 0))
    except OSError as e:
        return Check("reachability", Verdict.FAIL, f"cannot listen on TCP port {ports[0] if ports else 0}: {e}",
                     "free the port, or pick another in --host-maddrs")
    with listener:
        port = listener.getsockname()[1]

        async def ask():
            rpc = RPC(await dht.replicate_p2p(), network)
            return await reachability.check(rpc, peers, [f"/ip4/0.0.0.0/tcp/{port}"])

        found, result = asyncio.run(ask())
    if found == reachability.UNKNOWN:
        return Check("reachability", Verdict.WARN,
                     f"no initial peer answered a dial-back check in network {network!r} (an older gpunet, or "
                     "another --network?)", "a worker here announces its addresses as they are")
    if found == reachability.DIRECT:
        return Check("reachability", Verdict.PASS,
                     f"directly reachable: a peer connected back to {result.observed or 'this host'}, TCP port {port}")
    relay = next((r for _ in range(reachability.RELAY_TRIES)
                  if (r := _relay_reservation(network, peers, reachability.RELAY_WAIT))), None)
    where = f"{result.observed or 'this host'}, TCP port {port}"
    forward = (f"for direct connections, forward TCP port {port} on your router to this machine and run the worker "
               f"with --host-maddrs /ip4/0.0.0.0/tcp/{port} --announce-maddrs /ip4/<your public IP>/tcp/{port}")
    if relay:
        from gpunet.dht import observers

        seen = len(observers.candidates(peers, public_only=True))
        punch = (f"; other home workers are reached directly by hole punching once peers at "
                 f"{observers.CONFIRMING} distinct public IP addresses see this host (its initial peers give {seen}, "
                 "directly reachable workers add theirs)")
        return Check("reachability", Verdict.WARN,
                     f"not directly reachable (a peer could not connect back to {where}); reachable through relay "
                     f"{relay}: works, slower{punch}", forward)
    return Check("reachability", Verdict.FAIL,
                 f"not directly reachable (a peer could not connect back to {where}), and no initial peer granted a "
                 "relay reservation", forward + "; or join through a bootstrap node that relays (`gpunet bootstrap`)")


def _relay_reservation(network: str, peers: Sequence[str], wait: float) -> str | None:
    """The relay that grants this host a reservation, tried the way a worker behind NAT does; None if none does."""
    from gpunet.dht import network as net

    try:
        dht = net.join(network, peers, host_maddrs=["/ip4/0.0.0.0/tcp/0"], client_mode=True, reachability="private")
    except GpunetError:
        return None
    try:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            relayed = [m for m in net.visible_maddrs(dht, latest=True) if "/p2p-circuit" in m]
            if relayed:
                return relayed[0].split("/p2p-circuit")[0]
            time.sleep(0.5)
        return None
    finally:
        dht.shutdown()


def check_network(network: str, initial_peers: Sequence[str] | None, host_maddrs: Sequence[str] | None = None
                  ) -> list[Check]:
    from gpunet.dht import network as net
    from gpunet.dht.status import StatusReader

    try:
        peers = net.resolve_initial_peers(initial_peers)
    except GpunetError as e:
        return [Check("network", Verdict.FAIL, str(e), "pass the multiaddr printed by `gpunet bootstrap`")]
    if not peers:
        advice = "pass --initial-peers to check joining and clock offset against a network"
        return [Check("network", Verdict.SKIP, "no initial peers given", advice),
                Check("clock", Verdict.SKIP, "no peers to compare with", advice)]
    try:
        reader = StatusReader(network, peers)
    except GpunetError as e:
        return [Check("network", Verdict.FAIL, str(e), "check the address and that the peer is up and reachable")]
    with reader:
        workers = reader.read().workers
        offsets = asyncio.run(_clock_offsets(reader.dht, network, [w.id for w in workers[:5]]))
        inbound = check_inbound(reader.dht, network, peers, host_maddrs)
    if workers:
        checks = [Check("network", Verdict.PASS, f"joined {network!r}; {len(workers)} worker(s) visible"), inbound]
    else:  # joined, but nobody there: most often another network's name
        checks = [Check("network", Verdict.WARN, f"joined {network!r}; no workers visible in it",
                        "is --network the name the workers use? (`gpunet demo` runs 'gpunet-demo')"), inbound]
    if not offsets:
        checks.append(Check("clock", Verdict.SKIP, "no worker answered a ping to compare clocks with"))
        return checks
    # offset = peer's clock minus ours, measured at the midpoint of a round trip (error at most half the RTT)
    worst = max(offsets, key=abs)
    detail = f"clock offset to {len(offsets)} worker(s): up to {worst if abs(worst) >= 0.005 else 0.0:+.2f} s"
    if abs(worst) > MAX_CLOCK_OFFSET:
        return checks + [Check("clock", Verdict.FAIL, detail, "sync your clock (enable NTP: timedatectl set-ntp true)")]
    if abs(worst) > 1.0:
        return checks + [Check("clock", Verdict.WARN, detail, "enable NTP: hivemind refuses peers over 3 s apart")]
    return checks + [Check("clock", Verdict.PASS, detail)]


async def _clock_offsets(dht, network: str, worker_ids: list[str]) -> list[float]:
    from gpunet.rpc import RPC

    rpc = RPC(await dht.replicate_p2p(), network)  # not closed: hivemind keeps one replica per DHT, used again next
    offsets = []
    for worker_id in worker_ids:
        try:
            before = time.time()
            reply = await asyncio.wait_for(rpc.ping(worker_id), 5)
            after = time.time()
        except Exception:
            continue  # an unreachable worker says nothing about our clock
        offsets.append(reply.time - (before + after) / 2)
    return offsets


def check_connections(data_dir: Path) -> Check | None:
    """How a worker running from ``data_dir`` reaches its peers now (asked of its own dashboard, on this machine):
    directly, hole-punched (to another worker behind NAT) or through a relay. None when no worker runs there."""
    import json
    import urllib.request

    from gpunet.worker.dashboard import URL_FILE

    data_dir = Path(data_dir)
    try:
        url = (data_dir / URL_FILE).read_text().strip()
    except OSError:
        return None
    base, _, fragment = url.partition("#")
    if not base.startswith("http://127.0.0.1:"):  # the dashboard serves on loopback alone: its key goes nowhere else
        return Check("connections", Verdict.SKIP, f"{data_dir / URL_FILE} names {base!r}, not this machine's dashboard",
                     "restart the worker (it writes the file afresh)")
    request = urllib.request.Request(base.rstrip("/") + "/api/status",
                                     headers={"X-Gpunet-Token": fragment.removeprefix("token=")})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            conns = json.loads(answer.read()).get("connections", [])
    except Exception as e:  # a worker that stopped without removing its address, or one of an older version
        return Check("connections", Verdict.SKIP, f"the worker of {data_dir} did not answer ({e})",
                     "is it running? (`gpunet worker` writes its dashboard's address there)")
    by = {path: sum(1 for c in conns if c.get("path") == path) for path in ("direct", "punched", "relayed")}
    detail = (f"the worker running here is connected to {len(conns)} peer(s): {by['direct']} direct, "
              f"{by['punched']} hole-punched (workers behind NAT), {by['relayed']} through relays")
    return Check("connections", Verdict.PASS, detail,
                 "relayed peers still work; each relayed leg costs a transit (docs/reachability.md)")


def run_checks(
    *,
    data_dir=None,
    device: str = "auto",
    network: str = DEFAULT_NETWORK,
    initial_peers: Sequence[str] | None = None,
    host_maddrs: Sequence[str] | None = None,
    nvml=None,
    models_dirs: Sequence[Path] = (),
) -> list[Check]:
    data_dir = resolve_data_dir(data_dir)
    report = hw.read_nvml(nvml)
    checks = check_gpu(device, report)
    gpu_count = len(report.gpus) if report else 0
    gpu_memory = max((g.memory_total for g in report.gpus), default=0) if report else 0
    checks += [check_cpu(), check_ram(gpu_count, gpu_memory), check_disk(data_dir), check_models(data_dir, models_dirs)]
    network_checks = check_network(network, initial_peers, host_maddrs)
    if not any(c.name == "reachability" for c in network_checks):  # no peer to test with: what the addresses say
        checks.append(check_reachability(host_maddrs))
    running = check_connections(data_dir)  # a worker already running from this data dir: its paths now
    return checks + network_checks + ([running] if running is not None else [])


_STYLE = {Verdict.PASS: "green", Verdict.WARN: "yellow", Verdict.FAIL: "bold red", Verdict.SKIP: "dim"}


def render_checks(checks: list[Check]) -> Table:
    table = Table(title="gpunet doctor")
    for column in ("check", "result", "detail", "advice"):
        table.add_column(column)
    for c in checks:
        table.add_row(c.name, f"[{_STYLE[c.outcome]}]{c.outcome.value}[/]", c.detail, c.advice)
    return table
