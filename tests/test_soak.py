"""Churn (issue 11): five workers, all but one SIGKILLed and restarted at random while a client maps 1,000 jobs.
``scripts/soak.py`` runs longer soaks with the same code (gpunet/testing/soak.py)."""

import pytest

from gpunet.testing.soak import soak

pytestmark = pytest.mark.swarm


def test_every_job_returns_once_and_right_while_workers_are_killed_and_restarted(tmp_path):
    report = soak(tmp_path, workers=5, jobs=1000, kill_every=(0.3, 1.5), seed=1, min_kills=5)
    assert report.kills >= 5, report  # the churn really happened
    assert not report.stuck, "\n\n".join(report.stuck)  # every worker left within a minute of SIGTERM
    assert (report.missing, report.wrong, report.paid_twice) == (0, 0, 0), report
    assert report.client_receipts == report.jobs + 50, report  # one receipt per job, warm-up included: none twice
    assert not report.ledger_errors and report.ledgers_verified == 6, report
    before, after = report.steady_rss_mb
    assert after < before + 200, report  # the worker never killed served ~1/5 of the jobs without growing
