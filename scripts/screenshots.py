#!/usr/bin/env python
"""Screenshots of the worker dashboard and the network explorer, for docs/ (docs/volunteer.md, the README).

A local network (a bootstrap node, three workers, one of them with a dashboard, one paused by its owner), a client
that runs interactive and batch jobs through it, then both pages in headless chromium.

    python scripts/screenshots.py [--out docs]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import gpunet  # noqa: E402
from gpunet import Requirements  # noqa: E402
from gpunet.testing import LocalNetwork, free_port, gpunet_cmd, wait_for  # noqa: E402
from gpunet.testing import browser  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs")
    args = parser.parse_args()
    if browser.missing():
        sys.exit(f"cannot take screenshots: {browser.missing()}")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).eval()
    job = gpunet.Job.from_module(model, (torch.randn(64, 256),))
    dash, explore = free_port(), free_port()
    with LocalNetwork(network="screenshots", heartbeat=1.0) as net:
        bootstrap = net.start_bootstrap()
        mine = net.start_worker("--dashboard-port", str(dash), "--public-name", "alice-desktop", "--price", "1")
        net.start_worker("--public-name", "bob-4090", "--price", "1.5")
        away = net.start_worker("--public-name", "carol-laptop", "--price", "1.2")
        subprocess.run(gpunet_cmd("worker", "pause", "--data-dir", str(away.data_dir), "--reason", "gaming"),
                       check=True, capture_output=True)
        with gpunet.Client(initial_peers=[bootstrap], network=net.network, data_dir=net.root / "client") as client:
            wait_for(lambda: len(client.workers(refresh=True)) == 3, 60, "three workers")
            futures = [client.submit(job, torch.randn(64, 256), requirements=Requirements(prefer="cheapest"))
                       for _ in range(40)]
            futures += [client.submit(job, torch.randn(64, 256), requirements=Requirements(priority="batch"))
                        for _ in range(20)]
            for f in futures:
                f.result(timeout=300)
        explorer = subprocess.Popen(gpunet_cmd("status", "--network", net.network, "--initial-peers", bootstrap,
                                               "--serve", str(explore), "--interval", "1"),
                                    stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            explorer.stdout.readline()
            with browser.browser_page(1280, 1000) as page:
                page.goto((mine.data_dir / "dashboard.url").read_text().strip())
                browser.expect(page.locator("#recent tbody tr:not(.empty)").first).to_be_visible(timeout=60_000)
                page.screenshot(path=str(args.out / "dashboard.png"), full_page=True)
                page.goto(f"http://127.0.0.1:{explore}/")
                browser.expect(page.locator("#workers tbody tr:not(.empty)")).to_have_count(3, timeout=60_000)
                page.wait_for_timeout(20_000)  # some history for the charts (each read of the DHT takes a while)
                page.screenshot(path=str(args.out / "explorer.png"), full_page=True)
        finally:
            explorer.terminate()
            explorer.wait(timeout=30)
        assert mine.popen.poll() is None
    print(f"wrote {args.out / 'dashboard.png'} and {args.out / 'explorer.png'}")


if __name__ == "__main__":
    main()
