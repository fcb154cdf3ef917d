"""One process per GPU (rawgpu/runtime/ranks.py), on CPU: results in rank order, one id for every rank, NVLink
multicast off in every rank, and a failing or vanishing rank stops the others and is named."""

from __future__ import annotations

import os
import time

import pytest

from rawgpu.runtime.errors import RawgpuError
from rawgpu.runtime import ranks as ranks_module
from rawgpu.runtime.ranks import Rank, RankError, gather_to_root, run_ranks

UID = bytes(range(128))


def report(rank, ranks, unique_id, scale):
    return rank * scale, ranks, unique_id, os.environ.get("NCCL_NVLS_ENABLE"), os.getpid()


def gather_three_times(rank, ranks, unique_id):
    """Rank 2 sends its second value before rank 0 has asked for the first: each gather still gets its own."""
    me = Rank(ranks, rank, unique_id)
    if rank == 2:
        return [gather_to_root((0, rank), me), gather_to_root((1, rank), me), gather_to_root((2, rank), me)]
    if rank == 0:
        time.sleep(0.5)
    return [gather_to_root((seq, rank), me) for seq in range(3)]


def report_each(rank, ranks, unique_id, pieces):
    for piece in range(pieces):
        ranks_module.report((rank, piece))
    return pieces


def fail_on_one(rank, ranks, unique_id):
    if rank == 1:
        raise ValueError("boom")
    time.sleep(60)  # the others would run on: they must be stopped


def rawgpu_error(rank, ranks, unique_id):
    raise RawgpuError("not enough GPU memory")


def vanish(rank, ranks, unique_id):
    if rank == 2:
        os._exit(3)
    time.sleep(60)


def test_each_rank_runs_in_its_own_process_with_the_same_id_and_nvlink_multicast_off(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    out = run_ranks(report, 3, 10, unique_id=UID)
    assert [o[0] for o in out] == [0, 10, 20] and {o[1] for o in out} == {3}
    assert all(o[2] == UID for o in out) and {o[3] for o in out} == {"0"}
    assert len({o[4] for o in out} | {os.getpid()}) == 4, "a process per rank"


def test_gather_to_root_brings_every_ranks_value_to_rank_0_in_order():
    out = run_ranks(gather_three_times, 3, unique_id=UID)
    assert out[0] == [[(seq, r) for r in range(3)] for seq in range(3)]
    assert out[1] == out[2] == [None] * 3
    assert gather_to_root("alone", Rank(1, 0, UID)) == ["alone"]
    with pytest.raises(RankError, match="run_ranks"):
        gather_to_root("x", Rank(2, 0, UID))


def test_a_failing_rank_is_named_and_the_others_are_stopped():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 of 3: ValueError: boom") as info:
        run_ranks(fail_on_one, 3, unique_id=UID)
    assert time.monotonic() - start < 30, "the sleeping ranks were stopped"
    assert "Traceback" in info.value.details and isinstance(info.value, RawgpuError)
    with pytest.raises(RankError, match=r"^rank 0 of 1: not enough GPU memory$"):
        run_ranks(rawgpu_error, 1, unique_id=UID)


def test_a_rank_that_dies_without_reporting_is_named():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 2 of 3 exited with code 3 before reporting"):
        run_ranks(vanish, 3, unique_id=UID)
    assert time.monotonic() - start < 30


def test_bad_rank_counts_are_refused():
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        run_ranks(report, 0, 1, unique_id=UID)


def sleep_and_say(rank, ranks, unique_id, folder):
    with open(os.path.join(folder, f"new{rank}"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(folder, f"new{rank}"), os.path.join(folder, f"rank{rank}"))  # never read half-written
    time.sleep(60)


def test_ctrl_c_stops_every_rank(tmp_path):
    import signal
    import subprocess
    import sys

    # A foreground run gets Ctrl-C; pytest itself may run with SIGINT ignored (`pytest &` from a script), which the
    # child would inherit, so the child puts Python's own handler back, as an interactive start has it.
    code = ("import signal, sys, test_ranks; from rawgpu.runtime.ranks import run_ranks\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "try:\n    run_ranks(test_ranks.sleep_and_say, 2, sys.argv[1], unique_id=bytes(128))\n"
            "except KeyboardInterrupt:\n    sys.exit(130)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__),
                                                         os.path.dirname(os.path.dirname(__file__))])}
    # Its own process group: whatever fails below, the child, its ranks and multiprocessing's resource tracker
    # are killed together in the finally clause, and nothing outlives the test.
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("rank*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [int(p.read_text()) for p in sorted(tmp_path.glob("rank*"))]
        assert len(pids) == 2, "both ranks started"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 130
        for pid in pids:
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.05)
            else:
                pytest.fail(f"rank process {pid} still runs after Ctrl-C")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def test_each_rank_reports_its_pieces_as_they_finish_and_needs_no_communicator():
    got = []
    done = run_ranks(report_each, 3, 4, unique_id=b"", on_report=lambda rank, value: got.append((rank, value)))
    assert done == [4] * 3
    assert sorted(value for _, value in got) == [(r, p) for r in range(3) for p in range(4)]
    assert all(rank == value[0] for rank, value in got)
    for r in range(3):  # each rank's pieces arrive in the order it sent them
        assert [p for rank, (_, p) in got if rank == r] == list(range(4))
    with pytest.raises(RankError, match="report works in the processes run_ranks starts"):
        ranks_module.report(1)
