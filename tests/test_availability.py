"""The owner comes first: availability as a pure state machine (readings and time passed in), the probes, and the
owner's hand (``gpunet worker pause|resume``) on its file."""

import os
import subprocess
import sys
from datetime import datetime

import pytest

from gpunet.errors import ConfigError
from gpunet.worker import control
from gpunet.worker.state.availability import Availability, OwnerRules, Reading, parse_active_hours
from gpunet.worker.probe import FakeGpuProbe, SystemProbe


def at(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def test_a_gpu_the_owner_uses_pauses_the_worker_until_it_has_been_free_a_while():
    a = Availability(OwnerRules(pause_when_busy=True, resume_after=60, busy_readings=2))
    t = at("2026-12-02T12:00:00")
    assert not a.update(Reading(t, gpu=True)) and not a.paused
    assert not a.update(Reading(t + 1, gpu=True, other_gpu_processes=1))  # one reading: maybe a blip
    assert a.update(Reading(t + 2, gpu=True, other_gpu_processes=1)) and "using the GPU" in a.reason
    a.update(Reading(t + 3, gpu=True))  # the game quit: wait before handing the GPU back
    assert a.paused and "resuming once" in a.reason
    assert not a.update(Reading(t + 30, gpu=True, others_cpu_load=0.9))  # a GPU worker goes by the GPU
    assert a.paused
    assert a.update(Reading(t + 64, gpu=True)) and not a.paused
    cpu = Availability(OwnerRules(pause_when_busy=True, resume_after=0, busy_readings=1))
    assert cpu.update(Reading(t, others_cpu_load=0.8)) and "over 50% of the CPU busy" in cpu.reason
    assert not cpu.update(Reading(t + 0.5, others_cpu_load=0.9))  # the same words while it lasts: no republish
    assert cpu.update(Reading(t + 1, others_cpu_load=0.1)) and not cpu.paused


def test_active_hours_temperature_and_the_owners_hand():
    night = Availability(OwnerRules(active_hours=parse_active_hours("Mon-Fri 22:00-08:00")))
    assert night.update(Reading(at("2026-12-02T12:00:00"))) and night.reason == "outside its active hours"  # a Wed
    assert night.update(Reading(at("2026-12-02T23:00:00"))) and not night.paused
    night.update(Reading(at("2026-12-03T07:59:00")))  # Thursday morning: Wednesday's window
    assert not night.paused
    night.update(Reading(at("2026-12-05T23:00:00")))  # Saturday night: not a listed day
    assert night.paused
    hot = Availability(OwnerRules(max_temperature=80))
    t = at("2026-12-02T12:00:00")
    assert hot.update(Reading(t, gpu=True, temperature=85)) and "too hot (over 80 °C" in hot.reason
    assert not hot.update(Reading(t + 1, gpu=True, temperature=78))  # not 5 degrees below yet
    assert hot.update(Reading(t + 2, gpu=True, temperature=74)) and not hot.paused
    hand = Availability()
    assert hand.update(Reading(t), manual="gaming tonight") and hand.reason == "its owner paused it: gaming tonight"
    assert hand.update(Reading(t + 1), manual=None) and not hand.paused


@pytest.mark.parametrize("text", ["25:00-08:00", "22:00", "Mon-Fry 22:00-08:00", "10:00-10:00", "10:61-11:00"])
def test_bad_active_hours_are_refused_with_the_reason(text):
    with pytest.raises(ConfigError, match="active-hours"):
        parse_active_hours(text)


def test_the_owners_hand_is_a_file_and_a_signal_only_to_a_running_worker(tmp_path):
    assert control.read_pause(tmp_path) is None
    assert control.set_pause(tmp_path, "away") is None  # nothing runs there: it will start paused
    assert control.read_pause(tmp_path) == "away"
    # A ready file left by a worker that died names a pid that is not a worker now: it is never signalled.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        from gpunet import readyfile

        readyfile.write_ready(tmp_path, role="worker", id="x", addresses=[], network="n", state="online")
        doc = readyfile.read_ready(tmp_path)
        doc["pid"] = bystander.pid
        readyfile.ready_path(tmp_path).write_text(__import__("json").dumps(doc))
        assert control.set_pause(tmp_path, None) is None and bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
    assert control.read_pause(tmp_path) is None


def test_the_system_probe_counts_others_load_and_never_the_workers_own_processes(tmp_path):
    # /proc as the probe reads it, two seconds apart: 2 cores (200 jiffies a second); the worker (pid 10) and its
    # executor (11) and p2p daemon (12, below its DHT process) busy, and a game (50) busy too.
    cpu = iter([(1000, 2000), (1000 + 300, 2000 + 400), (1300 + 100, 2400 + 400)])
    tables = iter([
        {10: (1, 100), 11: (10, 100), 13: (10, 0), 12: (13, 0), 50: (1, 500)},
        {10: (1, 110), 11: (10, 200), 13: (10, 0), 12: (13, 40), 50: (1, 650)},
        # The executor died and the worker reaped it: its 250 jiffies are in the worker's own count now.
        {10: (1, 110 + 250 + 30), 13: (10, 0), 12: (13, 40), 50: (1, 670)},
    ])
    probe = SystemProbe(10, cpu=lambda: next(cpu), processes=lambda: next(tables))
    assert probe.read().others_cpu_load == 0.0  # a first reading has nothing to compare with
    later = probe.read()
    assert later.others_cpu_load == pytest.approx((300 - 150) / 400)  # the game's 150 of 400, not the worker's 150
    assert not later.gpu
    assert probe.read().others_cpu_load == pytest.approx(20 / 400)  # a reaped executor is still the worker's
    real = SystemProbe(os.getpid())
    real.read()
    assert 0.0 <= real.read().others_cpu_load <= 1.0  # and it reads this machine's /proc
    fake = FakeGpuProbe(tmp_path / "gpu.json")
    assert fake.read().other_gpu_processes == 0
    (tmp_path / "gpu.json").write_text('{"other_gpu_processes": 2, "temperature": 91}')
    r = fake.read()
    assert r.gpu and r.other_gpu_processes == 2 and r.temperature == 91
