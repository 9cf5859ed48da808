"""`gpunet status` tables: figures are never cut on a narrow terminal (text columns give way instead)."""

import io
import time

from rich.console import Console

from gpunet.cli.status import render_table
from gpunet.dht.records import DeviceInfo, WorkerRecord
from gpunet.dht.records import WorkerEntry
from gpunet.dht.status import NetworkStatus
from gpunet.identity import Identity


def test_figures_are_whole_at_80_columns():
    record = WorkerRecord(version="0.1.0", state="online", name="a-volunteer-with-a-rather-long-public-name",
                          device=DeviceInfo(kind="cuda", name="NVIDIA GeForce RTX 4090 Laptop GPU", memory_total=2**34,
                                            memory_free=2**33),
                          tflops={"fp32": 0.0231, "bf16": 165.2}, price=12.5, jobs_done=123456,
                          credits_earned=1234.567891, started_at=time.time() - 3600)
    status = NetworkStatus("gpunet", [WorkerEntry(Identity.generate().peer_id, record, time.time() + 30)])
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(render_table(status, width=80))
    text = out.getvalue()
    for figure in ("165 bf16", "1234.567891", "12.5"):
        assert figure in text, text
    assert "too narrow" in text and "GiB free" in text  # what was left out is said
    wide = io.StringIO()
    Console(file=wide, width=160, color_system=None).print(render_table(status, width=160))
    assert "too narrow" not in wide.getvalue() and "123456" in wide.getvalue() and "8.0/16.0" in wide.getvalue()


def test_a_paused_worker_shows_why_and_a_reason_is_never_read_as_markup():
    record = WorkerRecord(version="0.1.0[/]", state="paused", pause_reason="[red]the owner is gaming[/red]",
                          name="[/]", reachability="[/x]",
                          device=DeviceInfo(kind="cpu", name="CPU", memory_total=2**34, memory_free=2**33, cores=8),
                          tflops={"fp32": 0.5}, price=1.0, started_at=time.time() - 60)
    status = NetworkStatus("gpunet", [WorkerEntry(Identity.generate().peer_id, record, time.time() + 30)])
    out = io.StringIO()
    Console(file=out, width=160, color_system=None).print(render_table(status, width=160))
    assert "paused" in out.getvalue() and "[red]the owner is gamin…" in out.getvalue(), out.getvalue()
    assert "[/]" in out.getvalue() and "[/x]" in out.getvalue()  # a peer's text, shown as it is


def test_a_peers_text_ending_in_a_backslash_shows_as_it_is():
    """rich's escape() doubles a trailing backslash (so that it cannot escape markup after it): peers' text is Text."""
    record = WorkerRecord(version="0.1.0\\", state="online", name="ends in \\", reachability="relayed\\",
                          device=DeviceInfo(kind="cuda", name="GPU\\", memory_total=2**34, memory_free=2**33),
                          tflops={"fp32": 0.5}, price=1.0, started_at=time.time() - 60)
    status = NetworkStatus("gpunet", [WorkerEntry(Identity.generate().peer_id, record, time.time() + 30)])
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(render_table(status, width=200))
    text = out.getvalue()
    for shown in ("ends in \\", "GPU\\", "relayed\\", "gpunet 0.1.0\\"):
        assert shown in text and shown + "\\" not in text, text
