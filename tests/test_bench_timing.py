"""CPU tests of the benchmark's timing options (scripts/benchmarks/timing.py, `bench.py gemm --sustained`): how long a
graph replays before it is timed, and the bad values refused in one line; and of its power readings
(scripts/benchmarks/power.py): what a span of NVML readings says, and no NVML, no readings."""

from __future__ import annotations

import pytest

import bench  # scripts/bench.py
from benchmarks.power import PowerLog, describe, span_seconds
from benchmarks.timing import settle
from rawgpu.cli.console import GpuReading


def test_gemm_times_bursts_unless_told_to_sustain():
    assert bench.parse_args(["gemm"]).sustained == 0.0
    assert bench.parse_args(["gemm", "--sustained", "2.5"]).sustained == 2.5


@pytest.mark.parametrize("value, message", [("-1", "must be >= 0, got -1"), ("soon", "expected a number"),
                                            ("4000", "must be <= 3600, got 4000"), ("nan", "must be finite")])
def test_bad_sustained_seconds_are_usage_errors(value, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["gemm", "--sustained", value])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and message in err[-1] and "Traceback" not in "\n".join(err)


def test_settle_replays_in_rounds_of_ten_until_its_time_is_up():
    calls = []
    settle(lambda: calls.append("replay"), lambda: calls.append("wait"), 0.0)
    assert calls == []  # a burst: nothing before the timing
    settle(lambda: calls.append("replay"), lambda: calls.append("wait"), 1e-3)
    rounds = calls.count("wait")
    assert rounds >= 1 and calls == (["replay"] * 10 + ["wait"]) * rounds


def reading(util, mhz, watts, capped):
    return GpuReading(power_w=watts, utilization_pct=util, sm_clock_mhz=mhz, power_capped=capped)


def test_a_span_of_readings_says_whether_the_power_limit_held_the_clock():
    log = PowerLog()
    log.readings = [(0.5, reading(100, 1980, 400.0, False)),  # before the span
                    (1.0, reading(100, 1830, 690.0, True)), (1.1, reading(0, 1980, 120.0, False)),  # idle: left out
                    (1.2, reading(97, 1710, 698.0, True)), (1.3, reading(100, 1980, 600.0, False)),
                    (2.0, reading(100, 1500, 700.0, True))]  # at the span's end: the next one's
    got = log.summary(1.0, 2.0)
    assert got == dict(readings=3, sm_mhz=(1830 + 1710 + 1980) / 3, sm_mhz_lowest=1710,
                       watts=(690.0 + 698.0 + 600.0) / 3, capped_pct=200 / 3)
    assert describe(got) == "1840 MHz (lowest 1710), 663 W, 67% of readings capped by power"
    assert log.summary(1.0, 2.0, loaded=lambda r: r.power_w >= 695) == dict(
        readings=1, sm_mhz=1710, sm_mhz_lowest=1710, watts=698.0, capped_pct=100.0)
    assert log.summary(3.0, 4.0) is None and describe(None) == "no readings"
    assert describe(log.summary(3.0, 3.4), span_seconds((3.0, 3.4))) == "no readings under load in its 0.4 s"
    no_clock = PowerLog()
    no_clock.readings = [(1.0, reading(100, None, 250.0, None))]
    assert describe(no_clock.summary(0.0, 2.0)) == "250 W"


def test_without_nvml_the_log_reads_nothing_and_stops(monkeypatch):
    import sys
    import types

    failing = types.ModuleType("pynvml")

    def no_library():
        raise RuntimeError("NVML Shared Library Not Found")

    failing.nvmlInit = no_library
    monkeypatch.setitem(sys.modules, "pynvml", failing)
    with PowerLog(interval=0.001) as log:
        pass
    assert log.readings == [] and log.summary(0.0, float("inf")) is None
