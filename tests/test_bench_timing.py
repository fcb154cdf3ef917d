"""CPU tests of the benchmark's timing options (scripts/benchmarks/timing.py, `bench.py gemm --sustained`): how long a
graph replays before it is timed, and the bad values refused in one line."""

from __future__ import annotations

import pytest

import bench  # scripts/bench.py
from benchmarks.timing import settle


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
