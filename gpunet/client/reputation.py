"""This client's memory of each worker (the formulas are :mod:`gpunet.client.trust`'s), kept in its data dir as
``reputation.json``: read once, written after each verdict (atomically; a damaged file loses history, never the
client)."""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict
from pathlib import Path

from gpunet.client.trust import ALWAYS_CHECK_UNTIL, AVOID_BELOW, ESTABLISHED_AFTER, MIN_CHECK_PROBABILITY, WorkerTrust


class Reputation:
    """This client's view of each worker, from real outcomes only; persisted in its data dir."""

    FILENAME = "reputation.json"

    def __init__(self, path: Path | None = None, rng: random.Random | None = None):
        self.path = path
        self.workers: dict[str, WorkerTrust] = {}
        self._rng = rng or random.Random()
        if path is not None and path.exists():
            try:
                raw = json.loads(path.read_text())
                self.workers = {k: WorkerTrust(**v) for k, v in raw.get("workers", {}).items()}
            except (OSError, ValueError, TypeError):
                self.workers = {}  # a damaged file loses history, never the client

    @classmethod
    def load(cls, data_dir: str | os.PathLike) -> "Reputation":
        return cls(Path(data_dir) / cls.FILENAME)

    def _get(self, worker_id: str) -> WorkerTrust:
        trust = self.workers.setdefault(worker_id, WorkerTrust())
        trust.decay(time.time())
        return trust

    def score(self, worker_id: str) -> float:
        return (self._get(worker_id) if worker_id in self.workers else WorkerTrust()).score

    def honesty(self, worker_id: str) -> float:
        return self._get(worker_id).honesty if worker_id in self.workers else 1.0

    def streak(self, worker_id: str) -> int:
        return self.workers[worker_id].streak if worker_id in self.workers else 0

    def record(self, worker_id: str, outcome: str, checked: bool = False) -> None:
        """``outcome`` is valid, rejected, invalid, failure or timeout; ``checked`` says a valid result was verified."""
        trust = self._get(worker_id)
        if outcome == "valid":
            trust.valid += 1
            if checked:
                trust.streak += 1
        elif outcome == "rejected":
            trust.rejected += 1
            trust.streak = 0
        elif outcome == "invalid":
            trust.invalid += 1
            trust.streak = 0
        elif outcome == "failure":
            trust.failures += 1
        elif outcome == "timeout":
            trust.timeouts += 1
        else:
            raise ValueError(f"unknown outcome {outcome!r}")

    def should_check(self, worker_id: str) -> bool:
        """Adaptive replication: always check a worker with little history, then spot-check less and less."""
        streak = self.streak(worker_id)
        if streak < ALWAYS_CHECK_UNTIL:
            return True
        return self._rng.random() < max(1.0 / streak, MIN_CHECK_PROBABILITY)

    def established(self, worker_id: str) -> bool:
        """Has earned this client's trust by checked results (a new identity has not, whatever it claims)."""
        return self.streak(worker_id) >= ESTABLISHED_AFTER and not self.avoided(worker_id)

    def avoided(self, worker_id: str) -> bool:
        """Caught lying or cheating (outvoted, or answers that fail checks): not merely unavailable."""
        return self.honesty(worker_id) < AVOID_BELOW

    def save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"workers": {k: asdict(v) for k, v in self.workers.items()}}))
        tmp.replace(self.path)
