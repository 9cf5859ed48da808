"""The worker's Prometheus endpoint answers its own loopback address only (DNS rebinding)."""

import http.client
import socket
import urllib.request

from gpunet.worker import metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_answer_their_loopback_names_and_refuse_another_sites_host():
    """From an attacker's review: a page of another site resolving its own name to 127.0.0.1 could read the lanes'
    load and the top clients' ids."""
    port = _free_port()
    server = metrics.serve(port)
    try:
        _check_hosts(port)
    finally:
        server.shutdown()
        server.server_close()


def _check_hosts(port: int) -> None:
    for name in ("127.0.0.1", "localhost", "LOCALHOST:19100"):  # any port: a scrape through an SSH tunnel
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/metrics", headers={"Host": name if ":" in name else f"{name}:{port}"})
        assert conn.getresponse().status == 200
    assert b"gpunet_jobs_total" in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", "/metrics", headers={"Host": f"rebound.example:{port}"})
    answer = conn.getresponse()
    assert answer.status == 421 and b"gpunet" not in answer.read()
