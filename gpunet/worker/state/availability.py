"""Whether a volunteer's machine is the worker's to use right now: the owner comes first.

A pure state machine (time and readings passed in, nothing read or slept here), like :mod:`gpunet.worker.state.admission`:
the worker feeds it what its probe saw (:mod:`gpunet.worker.probe`) and whether its owner paused it by hand, and it
answers whether the worker takes jobs, and if not, why. Rules (docs/volunteer.md):

* paused by hand (``gpunet worker pause``, or the dashboard): until resumed by hand;
* outside ``--active-hours``: until the next active hour begins;
* ``--max-temperature``: above it, until the hottest GPU is 5 °C below it again;
* ``--pause-when-busy``: while other processes use the GPU (a GPU worker), or keep more than ``busy_load`` of the
  CPU busy (a CPU worker), and until the machine has been free for ``resume_after`` seconds (so a game's loading
  screen does not hand the GPU back for ten seconds).

The first reason that holds is the one given; the worker resumes only when none holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime

from gpunet.errors import ConfigError

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
#: Below the limit by this much before a worker paused for heat takes jobs again.
COOL_DOWN_C = 5.0


@dataclass(frozen=True)
class Reading:
    """What the machine looked like at ``at`` (unix time), apart from the worker's own processes."""

    at: float
    gpu: bool = False  # a GPU machine: busy means other processes on the GPU; else, others' CPU load
    other_gpu_processes: int = 0
    others_cpu_load: float = 0.0  # share of all cores kept busy by other processes, 0..1
    temperature: float | None = None  # hottest GPU, degrees C (None: not known)


@dataclass(frozen=True)
class Window:
    """Active on ``days`` (weekday numbers, Monday 0) from ``start`` to ``end`` minutes after midnight; a window that
    ends before it starts runs past midnight into the next day."""

    days: frozenset[int]
    start: int
    end: int

    def holds(self, when: datetime) -> bool:
        minute = when.hour * 60 + when.minute
        day = when.weekday()
        if self.start < self.end:
            return day in self.days and self.start <= minute < self.end
        # Past midnight: the evening part belongs to its day, the morning part to the day before.
        return (day in self.days and minute >= self.start) or ((day - 1) % 7 in self.days and minute < self.end)


def parse_active_hours(text: str) -> tuple[Window, ...]:
    """``22:00-08:00``, ``Mon-Fri 18:00-08:00``, several joined by commas (``Mon-Fri 18:00-08:00,Sat-Sun
    00:00-24:00``); local time. ConfigError saying what is wrong otherwise."""
    windows = []
    for part in (p.strip() for p in text.split(",")):
        m = re.fullmatch(r"(?:([A-Za-z]{3})(?:-([A-Za-z]{3}))?\s+)?(\d{1,2}):(\d{2})-(\d{1,2}):(\d{2})", part)
        if not m:
            raise ConfigError(f"--active-hours {text!r}: each window is HH:MM-HH:MM, optionally after days (Mon-Fri "
                              "22:00-08:00); join several with commas")
        first, last, h1, m1, h2, m2 = m.groups()
        start, end = int(h1) * 60 + int(m1), int(h2) * 60 + int(m2)
        if not (0 <= start < 24 * 60 and 0 <= end <= 24 * 60 and int(m1) < 60 and int(m2) < 60) or start == end:
            raise ConfigError(f"--active-hours {part!r}: times run from 00:00 to 24:00, and a window is not empty")
        days = range(7)
        if first:
            try:
                a, b = DAYS.index(first.lower()), DAYS.index((last or first).lower())
            except ValueError:
                raise ConfigError(f"--active-hours {part!r}: days are {', '.join(d.title() for d in DAYS)}") from None
            days = [(a + i) % 7 for i in range((b - a) % 7 + 1)]
        windows.append(Window(frozenset(days), start, end % (24 * 60) if end != 24 * 60 else 24 * 60))
    return tuple(windows)


@dataclass(frozen=True)
class OwnerRules:
    """What the volunteer asked for (``gpunet worker`` flags)."""

    pause_when_busy: bool = False
    busy_load: float = 0.5  # a CPU worker is busy while others use more than this share of all cores
    resume_after: float = 60.0  # seconds the machine must be free before a worker paused for it resumes
    busy_readings: int = 2  # readings in a row that must find the machine busy (one odd reading pauses nothing)
    active_hours: tuple[Window, ...] = ()
    max_temperature: float | None = None

    def __post_init__(self):
        if not 0 < self.busy_load <= 1:
            raise ConfigError("the busy threshold is a share of the CPU between 0 and 1")
        if self.resume_after < 0:
            raise ConfigError("--resume-after is a number of seconds (0 or more)")
        if self.max_temperature is not None and not 30 <= self.max_temperature <= 110:
            raise ConfigError("--max-temperature is in degrees Celsius, between 30 and 110")


@dataclass
class Availability:
    """The worker's availability to others; :meth:`update` after every reading."""

    rules: OwnerRules = field(default_factory=OwnerRules)
    reason: str | None = None  # why the worker is paused now; None: it takes jobs
    _busy: str | None = None  # the machine was busy, and has not been free for resume_after since
    _free_since: float | None = None
    _streak: int = 0  # busy readings in a row
    _hot: bool = False

    @property
    def paused(self) -> bool:
        return self.reason is not None

    def update(self, reading: Reading, manual: str | None = None) -> bool:
        """Take a reading (and the owner's hand pause: its reason, or None); returns whether the state changed."""
        before = self.reason
        self.reason = self._why(reading, manual)
        return self.reason != before

    def _why(self, r: Reading, manual: str | None) -> str | None:
        rules = self.rules
        if manual is not None:
            return f"its owner paused it{': ' + manual if manual else ''}"
        if rules.active_hours and not any(w.holds(datetime.fromtimestamp(r.at)) for w in rules.active_hours):
            return "outside its active hours"
        if rules.max_temperature is not None and r.temperature is not None:
            limit = rules.max_temperature - (COOL_DOWN_C if self._hot else 0.0)
            self._hot = r.temperature > limit
            if self._hot:  # the same words while it lasts: a reason that changed every reading would republish
                return (f"the GPU is too hot (over {rules.max_temperature:.0f} °C; resuming below "
                        f"{rules.max_temperature - COOL_DOWN_C:.0f} °C)")
        if rules.pause_when_busy:
            busy = self._busy_now(r)
            self._streak = self._streak + 1 if busy is not None else 0
            if busy is not None and (self._busy is not None or self._streak >= rules.busy_readings):
                self._busy, self._free_since = busy, None
                return busy
            if self._busy is not None:  # free again: wait a while before giving the machine back to others
                self._free_since = r.at if self._free_since is None else self._free_since
                if r.at - self._free_since < rules.resume_after:
                    return f"{self._busy}; resuming once it has been free for {rules.resume_after:.0f} s"
                self._busy = self._free_since = None
        return None

    def _busy_now(self, r: Reading) -> str | None:
        """Why the machine is busy, in words that stay the same while it lasts (each change is republished)."""
        if r.gpu and r.other_gpu_processes:
            return "the owner is using the GPU"
        if not r.gpu and r.others_cpu_load > self.rules.busy_load:
            return f"the owner is using the machine (over {self.rules.busy_load:.0%} of the CPU busy)"
        return None
