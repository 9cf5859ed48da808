#!/usr/bin/env python
"""Churn soak: N workers on loopback, all but one SIGKILLed and restarted at random while a client maps jobs.

Checks what must hold whatever dies when (every job back exactly once and correct, nothing paid twice, every ledger
verifies) and prints the figures, including the memory of the one worker never killed (it should not grow).

    python scripts/soak.py                            # 5 workers, 1,000 jobs (what CI runs)
    python scripts/soak.py --workers 8 --jobs 20000 --kill-every 0.5 3 --json

Exit status 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--kill-every", type=float, nargs=2, default=(0.3, 1.5), metavar=("MIN", "MAX"),
                        help="seconds between kills, drawn uniformly (default 0.3 1.5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.workers < 2:
        parser.error("--workers must be at least 2 (one is never killed)")

    from gpunet.testing.soak import soak

    with tempfile.TemporaryDirectory(prefix="gpunet-soak-") as root:
        report = soak(Path(root), workers=args.workers, jobs=args.jobs, kill_every=tuple(args.kill_every),
                      seed=args.seed, log=(lambda line: None) if args.json else print)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        before, after = report.steady_rss_mb
        print(f"{report.jobs} jobs on {report.workers} workers in {report.seconds:.1f} s with {report.kills} kills "
              f"({report.slow_exits} slow to exit): "
              f"{report.wrong} wrong, {report.missing} missing, {report.paid_twice} paid twice; "
              f"{report.client_receipts} client receipts; {report.ledgers_verified} ledgers verified"
              f"{', errors: ' + '; '.join(report.ledger_errors) if report.ledger_errors else ''}; "
              f"never-killed worker RSS {before:.0f} -> {after:.0f} MiB")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
