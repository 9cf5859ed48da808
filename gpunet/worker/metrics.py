"""Prometheus metrics a worker exposes (``gpunet worker --metrics-port N``), defined once."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

JOBS = Counter("gpunet_jobs_total", "Jobs by outcome", ["outcome"])
JOB_SECONDS = Histogram(
    "gpunet_job_seconds", "Wall time of executed jobs", buckets=(0.005, 0.02, 0.1, 0.5, 2, 10, 60, 300, 1800)
)
BYTES_IN = Counter("gpunet_bytes_received_total", "Program and input bytes received")
BYTES_OUT = Counter("gpunet_bytes_sent_total", "Output bytes sent")
PEER_BYTES_SERVED = Counter("gpunet_peer_bytes_served_total", "Program bytes served to other workers")
PEER_BYTES_FETCHED = Counter("gpunet_peer_bytes_fetched_total", "Program bytes fetched from other workers")
QUEUE = Gauge("gpunet_queue_length", "Jobs admitted and waiting for an executor")
RUNNING = Gauge("gpunet_running_jobs", "Jobs executing now")


def serve(port: int, host: str = "127.0.0.1") -> None:
    """Expose /metrics over HTTP; on loopback unless the volunteer asks otherwise."""
    start_http_server(port, addr=host)
