"""Prometheus metrics a worker exposes (``gpunet worker --metrics-port N``), defined once."""

from __future__ import annotations

import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import Counter, Gauge, Histogram, make_wsgi_app

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
SESSIONS = Gauge("gpunet_sessions", "Inference sessions open (their state held in executors)")
SESSION_BYTES = Gauge("gpunet_session_state_bytes", "Bytes of inference sessions' state held")
BATCHED_FORWARDS = Counter("gpunet_batched_forwards_total", "Forwards that ran several sessions' steps at once")
BATCHED_STEPS = Counter("gpunet_batched_steps_total", "Sessions' steps run in those forwards")
# CUDA graphs (gpunet.worker.executor.graphs)
GRAPH_RUNS = Counter("gpunet_graph_runs_total", "Runs by what CUDA graphs did: replayed, captured, warming (plain, "
                     "before a capture), refused (plain: not capturable)", ["outcome"])
GRAPH_REFUSALS = Counter("gpunet_graph_refusals_total", "Programs or shapes not captured as CUDA graphs, by reason",
                         ["reason"])
GRAPH_BYTES = Gauge("gpunet_graph_bytes", "Device memory the executors' captured CUDA graphs hold")


class GraphReports:
    """What executors' CUDA graphs did (gpunet.worker.executor.graphs, in each reply) into these metrics; why a run
    was not captured into the log (each reason at info the first time, then at debug: a client can vary shapes)."""

    def __init__(self):
        self._bytes: dict[object, int] = {}  # per executor: device memory its graphs hold
        self._said: set[str] = set()

    def count(self, executor: object, report, alive: list) -> None:
        """``report`` as ``executor`` sent it (checked: it is another process's word); ``alive``: the executors now."""
        import logging

        from gpunet.worker.executor.graphs import OUTCOMES, REASONS

        if not isinstance(report, dict):
            return
        for outcome, n in (report.get("runs") or {}).items():
            if outcome in OUTCOMES and isinstance(n, int) and n > 0:
                GRAPH_RUNS.labels(outcome).inc(n)
        for item in (report.get("refused") or [])[:16]:
            if isinstance(item, list) and len(item) == 2 and item[0] in REASONS and isinstance(item[1], str):
                GRAPH_REFUSALS.labels(item[0]).inc()
                first = item[0] not in self._said
                self._said.add(item[0])
                log = logging.getLogger(__name__)
                (log.info if first else log.debug)("A run was not captured as a CUDA graph (%s): %s", item[0],
                                                   item[1][:400])
        if isinstance(report.get("bytes"), int):
            self._bytes[executor] = report["bytes"]
            for gone in [e for e in self._bytes if e not in alive]:
                del self._bytes[gone]
            GRAPH_BYTES.set(sum(self._bytes.values()))
# The market (gpunet.worker.state.lanes, docs/market.md)
BACKGROUND_RUNS = Counter("gpunet_background_runs_total", "Runs of the volunteer's own background job, by outcome "
                          "(done, or stopped for paying work)", ["outcome"])
TOP_CLIENTS = 10  # clients per lane shown by their share (labels stay bounded however many clients come)
BATCH_FLOOR = Gauge("gpunet_batch_floor", "The batch lane's floor price now, credits per TFLOP")
LANE_JOBS = Gauge("gpunet_lane_jobs", "Jobs per lane, running or waiting", ["lane", "state"])
LANE_LOAD = Gauge("gpunet_lane_load", "Share of the slots a lane kept busy lately (0-1)", ["lane"])
CLIENT_SHARE = Gauge("gpunet_client_share", "A client's share of its lane's executor time lately (the top clients "
                     "per lane, by the last 8 characters of their id; the rest as 'others')", ["lane", "client"])


def count_lanes(lanes) -> None:
    """Publish the floor and the jobs per lane (a moment after a change, and at each heartbeat)."""
    from gpunet.protocol import LANES

    BATCH_FLOOR.set(lanes.floor / 1e9)
    for lane in LANES:
        LANE_JOBS.labels(lane, "running").set(lanes.count(lane, waiting=False))
        LANE_JOBS.labels(lane, "waiting").set(lanes.count(lane, running=False))


def show_lanes(lanes) -> None:
    """Publish the lanes' load and each client's share (at each heartbeat: they change slowly)."""
    from gpunet.protocol import LANES

    count_lanes(lanes)
    CLIENT_SHARE.clear()
    for lane in LANES:
        LANE_LOAD.labels(lane).set(lanes.load(lane))
        shares = sorted(lanes.shares(lane).items(), key=lambda kv: -kv[1])
        for client, share in shares[:TOP_CLIENTS]:
            CLIENT_SHARE.labels(lane, client[-8:]).set(share)
        if len(shares) > TOP_CLIENTS:
            CLIENT_SHARE.labels(lane, "others").set(sum(v for _, v in shares[TOP_CLIENTS:]))


def serve(port: int, host: str = "127.0.0.1") -> WSGIServer:
    """Expose /metrics over HTTP on loopback, in a thread. Only to requests addressed to it by a loopback name: a web
    page of another site that resolves its own name to 127.0.0.1 (DNS rebinding) sends its own Host, and would
    otherwise read the lanes and the top clients' ids. Returns the server (``shutdown()`` stops it)."""
    app = make_wsgi_app()
    allowed = {"127.0.0.1", "localhost", "[::1]", host}

    def guarded(environ, start_response):
        # The name only, whatever the port (a scrape through an SSH tunnel names its own); no Host at all is no
        # browser's request.
        if _host_name(environ.get("HTTP_HOST", host)).lower() not in allowed:
            start_response("421 Misdirected Request", [("Content-Type", "text/plain")])
            return [b"this server answers requests for its own address only\n"]
        return app(environ, start_response)

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args) -> None:  # scrapes are not news
            pass

    server = make_server(host, port, guarded, _ThreadingServer, handler_class=Quiet)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


def _host_name(header: str) -> str:
    """The name part of a Host header: ``[::1]:9100`` -> ``[::1]``, ``localhost:9100`` -> ``localhost``."""
    if header.startswith("["):
        return header[: header.find("]") + 1]
    return header.split(":", 1)[0]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
