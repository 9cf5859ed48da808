"""The worker's dashboard and the network explorer in a real headless browser (Debian's chromium) against a running
swarm: what a person would see, the pause buttons, and what a hostile page or script cannot do."""

import contextlib
import json
import re
import os
import signal
import subprocess
import urllib.error
import urllib.request

import pytest
import torch

from gpunet.testing import browser

expect = browser.expect
from tests.swarm import free_port, gpunet_cmd, run_cli, wait_for
from tests.test_market import spin_job
from tests.test_volunteer import wait_state

pytestmark = [pytest.mark.swarm, pytest.mark.skipif(browser.missing() is not None, reason=str(browser.missing()))]


def dashboard_url(proc) -> str:
    """The address with its key, as the worker wrote it for its owner."""
    path = proc.data_dir / "dashboard.url"
    wait_for(path.exists, 30, "the worker to write its dashboard's address")
    assert path.stat().st_mode & 0o777 == 0o600
    return path.read_text().strip()


def worker_earnings(proc) -> dict:
    shown = run_cli("earnings", "--data-dir", str(proc.data_dir), "--json")
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


def test_the_dashboard_shows_the_worker_its_jobs_and_earnings_and_pauses_it(swarm, client_for, tmp_path):
    port = free_port()
    worker = swarm.start_worker("--dashboard-port", str(port), "--public-name", "alice-desktop")
    client = client_for(swarm)
    model, job, x = spin_job(64, k=8)
    futures = [client.submit(job, x) for _ in range(5)]
    paid = {f.result(timeout=120) is not None and f.receipt.job_id for f in futures}
    client.close()  # every countersignature delivered: the worker's ledger holds them all
    wait_for(lambda: worker_earnings(worker)["total"]["jobs"] == 5, 30, "the worker's ledger to hold the 5 receipts")
    total = worker_earnings(worker)["total"]["credits"]
    url = dashboard_url(worker)
    assert url.startswith(f"http://127.0.0.1:{port}/#token=") and url in worker.output  # in its log, for its owner
    with browser.browser_page() as page:  # the page's CSP forbids eval: waits go through locators
        page.goto(url)
        expect(page).to_have_title("gpunet worker alice-desktop")
        expect(page.locator("#state")).to_have_text("online", timeout=30_000)
        expect(page.locator("#earned-total")).to_have_text(total, timeout=30_000)  # the ledger's figure, exactly
        for job_id in paid:
            expect(page.locator("#recent tbody")).to_contain_text(job_id)
        expect(page.locator("#chart svg rect")).to_have_count(14)  # one bar a day, days without jobs too
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        page.fill("#pause-reason", "gaming tonight")
        page.click("#pause")
        expect(page.locator("#state")).to_have_text("paused", timeout=30_000)
        expect(page.locator("#reason")).to_contain_text("gaming tonight")
        assert wait_state(swarm, worker, "paused") == "its owner paused it: gaming tonight"
        page.click("#resume")
        expect(page.locator("#state")).to_have_text("online", timeout=30_000)
    wait_state(swarm, worker, "online")
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000


def test_the_dashboard_answers_only_its_owner_and_refuses_what_another_site_would_do(swarm):
    port = free_port()
    worker = swarm.start_worker("--dashboard-port", str(port))
    base = f"http://127.0.0.1:{port}"
    token = dashboard_url(worker).split("#token=")[1]

    def call(path, body=None, headers=None):
        request = urllib.request.Request(base + path, data=body, method="GET" if body is None else "POST",
                                         headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status
        except urllib.error.HTTPError as e:
            return e.code

    def post(path, body=b"{}", headers=None):
        return call(path, body, headers)

    page = urllib.request.urlopen(base + "/", timeout=10)
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    assert token not in page.read().decode()  # the page holds no key: another user of the machine learns nothing
    assert call("/api/status") == call("/api/jobs") == call("/api/earnings") == 403  # nor from the API
    assert call("/api/status", headers={"X-Gpunet-Token": token}) == 200
    request = urllib.request.Request(base + "/api/status", headers={"X-Gpunet-Token": token})
    with urllib.request.urlopen(request, timeout=10) as response:  # which way each of its connections goes
        connections = json.loads(response.read())["connections"]
    assert connections and all(c["path"] == "direct" and c["addresses"][0].startswith("/ip4/127.0.0.1/tcp/")
                               for c in connections), connections
    doctor = subprocess.run(gpunet_cmd("doctor", "--data-dir", str(worker.data_dir), "--device", "cpu", "--json"),
                            capture_output=True, text=True, timeout=120)  # on the worker's machine: says the same
    said = next(c for c in json.loads(doctor.stdout) if c["name"] == "connections")
    assert said["outcome"] == "pass" and f"connected to {len(connections)} peer(s): {len(connections)} direct" \
        in said["detail"], said
    assert post("/api/pause") == 403  # no key: a cross-site form cannot learn it
    assert post("/api/pause", headers={"X-Gpunet-Token": token, "Origin": "http://evil.example"}) == 403
    assert post("/api/pause", headers={"X-Gpunet-Token": token}, body=b"not json") == 400
    assert post("/api/pause", headers={"X-Gpunet-Token": token}, body=b'{"reason": 5}') == 400  # said, not dropped
    assert post("/api/pause", headers={"X-Gpunet-Token": token, "Host": f"evil.example:{port}"}) == 421  # rebinding
    assert wait_state(swarm, worker, "online") is None  # none of them paused it
    with browser.browser_page() as page:  # the page opened without its key says so, once, and offers no buttons
        page.goto(base + "/")
        expect(page.locator("#error")).to_have_text(re.compile(r"^This page shows nothing without its key: open the "
                                                               r"address the worker logged"), timeout=30_000)
        expect(page.locator("#error")).not_to_contain_text("((")
        for control in ("#pause", "#resume", "#pause-reason"):
            expect(page.locator(control)).to_be_disabled()
    assert post("/api/pause", headers={"X-Gpunet-Token": token}) == 200
    wait_state(swarm, worker, "paused")


def test_the_explorer_shows_every_worker_and_the_network_totals(swarm, client_for, tmp_path):
    workers = swarm.start_workers(2, "--price", "1.5")
    swarm.start_worker("--public-name", "<b>bob</b>")  # a hostile name is shown as text, never as markup
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 3, 30, "three workers")
    model, job, x = spin_job(64, k=8)
    client.submit(job, x).result(timeout=120)
    port = free_port()
    explorer = subprocess.Popen(
        gpunet_cmd("status", "--network", swarm.network, "--initial-peers", swarm.bootstrap_addr, "--serve", str(port),
                   "--interval", "1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        assert "Network explorer: http://127.0.0.1:" in explorer.stdout.readline()
        with browser.browser_page() as page:
            page.goto(f"http://127.0.0.1:{port}/")
            expect(page.locator("#workers tbody tr:not(.empty)")).to_have_count(3, timeout=60_000)
            rows = page.locator("#workers tbody").inner_text()
            assert all(w.id[-8:] in rows for w in workers) and "<b>bob</b>" in rows
            expect(page.locator("#workers b")).to_have_count(0)  # shown as text, never as markup
            expect(page.locator("#online")).to_have_text("3 online")
            assert "/ batch 0.75" in rows  # the price per lane: interactive / the batch floor
            expect(page.locator("#programs")).to_contain_text(job.program_hash, timeout=60_000)
            page.screenshot(path=str(tmp_path / "explorer.png"), full_page=True)
        refused = urllib.request.Request(f"http://127.0.0.1:{port}/api/network", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(refused, timeout=10)
        assert e.value.code == 405  # read-only: it has nothing to change
        explorer.terminate()  # SIGTERM, as `systemctl stop` would
        assert explorer.wait(timeout=30) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):  # its DHT process and p2p daemon too, whatever happened
            os.killpg(explorer.pid, signal.SIGKILL)
        explorer.wait(timeout=30)
