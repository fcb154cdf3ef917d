"""A job a launcher started, on the CPU (issue 43): the links the ranks keep after the rendezvous (fake ranks as
threads on localhost), what goes over them (a checkpoint's parts as safetensors bytes; BYE; STOP), how a lost rank
ends every other, rawgpu.launch's own checks and environments, and rawgpu.train's checks as one rank of a job. The
same on GPUs for real: tests/test_jobs_gpu.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from rawgpu.runtime import files
from rawgpu.jobs import job as jb
from rawgpu.jobs import rendezvous as rv
from rawgpu.jobs.launchers import World

UID = bytes(range(128))
SAME = rv.Identity.of("recipe", "data", "0.1")


def _jobs(size: int) -> list[jb.Job]:
    """`size` ranks met on localhost, each a Job whose end is recorded (job.ended) instead of exiting."""
    links: dict[int, object] = {}
    port: list[int] = []
    ready = threading.Event()

    def serve():
        links[0] = rv.serve("127.0.0.1", 0, size, SAME, UID, 10.0, ready=lambda p: (port.append(p), ready.set()))

    server = threading.Thread(target=serve)
    server.start()
    assert ready.wait(10)

    def join(r):
        links[r] = {0: rv.join("127.0.0.1", port[0], r, size, SAME, 10.0)[1]}

    joiners = [threading.Thread(target=join, args=(r,)) for r in range(1, size)]
    for t in joiners:
        t.start()
    for t in [server] + joiners:
        t.join(15)
    jobs = []
    for r in range(size):
        job = jb.Job(World(r, size, r, "127.0.0.1", port[0], "test"), UID, links[r], 0.0)
        job.ended = []
        job.exit = job.ended.append
        jobs.append(job)
    return jobs


def _wait_for(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def _part(rng, layers: int = 3):
    weights = [(rng.standard_normal((5, 7)).astype(np.float32), rng.standard_normal(7).astype(np.float32))
               for _ in range(layers)]
    state = {"layers.0.w16": rng.standard_normal((5, 7)).astype(np.float16),
             "layers.2.exp_avg_bias": rng.standard_normal(7).astype(np.float32)}
    return weights, state


def test_a_part_goes_over_as_safetensors_and_comes_back_bit_for_bit():
    rng = np.random.default_rng(1)
    weights, state = _part(rng)
    blob = jb.pack_part((weights, state))
    assert b"pickle" not in blob and blob[8:9] == b"{"  # safetensors: a length, then a JSON header
    w2, s2 = jb.unpack_part(blob)
    assert [(a.tobytes(), b.tobytes()) for a, b in w2] == [(a.tobytes(), b.tobytes()) for a, b in weights]
    assert {k: (v.dtype, v.tobytes()) for k, v in s2.items()} == {k: (v.dtype, v.tobytes()) for k, v in state.items()}


@pytest.mark.parametrize("size", [3, 8])
def test_rank_0_gathers_every_ranks_part_in_rank_order_over_the_links(size):
    rng = np.random.default_rng(2)
    jobs = _jobs(size)
    parts = [_part(rng) for _ in jobs]
    for r in reversed(range(1, size)):
        assert jobs[r].gather(parts[r]) is None
    got = jobs[0].gather(parts[0])
    assert [g[0][0][0].tobytes() for g in got] == [p[0][0][0].tobytes() for p in parts]
    for job in jobs[1:] + jobs[:1]:
        job.finish()
    for job in jobs:
        job.close()
    time.sleep(0.3)
    assert all(job.ended == [] for job in jobs)  # links closed after BYE: nobody failed


@pytest.mark.parametrize("size,dead", [(3, 2), (8, 5)])
def test_a_rank_that_dies_ends_every_other_rank_with_a_line_naming_it(capfd, size, dead):
    jobs = _jobs(size)
    jobs[dead].links[0].conn.shutdown(socket.SHUT_RDWR)  # its process dies: its socket closes without BYE
    others = [job for r, job in enumerate(jobs) if r != dead]
    assert _wait_for(lambda: all(job.ended for job in others))
    assert all(job.ended == [jb.FAILED] for job in others)
    err = capfd.readouterr().err
    for r in range(size):
        line = (f"rawgpu: rank {r} of {size}: error: rank {dead} of {size} ended without a word (it died or was "
                "killed); the job stopped")
        assert (line in err) == (r != dead), line
    for job in jobs:
        job.close()


def test_a_rank_that_fails_or_is_interrupted_stops_the_job_from_where_it_is(capfd):
    jobs = _jobs(3)
    with jobs[1].guard():
        raise RuntimeError("out of luck")
    assert jobs[1].ended == [jb.FAILED]
    assert _wait_for(lambda: jobs[0].ended and jobs[2].ended)
    err = capfd.readouterr().err
    assert "rawgpu: rank 1 of 3: error: rank 1 of 3 failed: RuntimeError: out of luck\n" in err
    assert "rawgpu: rank 2 of 3: error: rank 1 of 3 failed: RuntimeError: out of luck; the job stopped" in err
    for job in jobs:
        job.close()

    jobs = _jobs(2)
    with jobs[1].guard():
        os.kill(os.getpid(), 2)  # Ctrl-C in this rank: its handler ends the job (exit 130)
        time.sleep(0.5)
    assert jobs[1].ended == [130]
    assert _wait_for(lambda: jobs[0].ended == [jb.FAILED])
    assert "rank 1 of 2 was stopped by SIGINT; the job stopped" in capfd.readouterr().err
    for job in jobs:
        job.close()


def test_a_failure_while_another_thread_ends_the_job_waits_for_that_end(capfd):
    """Rank 0 dies; rank 1's link thread begins the job's end (its abort then fails the run in the main thread):
    the guard must not return before that end has left the process (here: recorded it), or the run would go on to a
    traceback after the job's line."""
    jobs = _jobs(2)
    slow_exit = threading.Event()

    def exit_slowly(status):  # as os._exit after ncclCommAbort: a while after the line
        time.sleep(0.5)
        jobs[1].ended.append(status)
        slow_exit.set()

    jobs[1].exit = exit_slowly
    jobs[0].links[1].conn.shutdown(socket.SHUT_RDWR)  # rank 0's process dies: its socket closes without BYE
    assert _wait_for(lambda: jobs[1].end_status is not None)
    with jobs[1].guard():
        raise RuntimeError("ncclCommAbort'ed under the step")
    assert slow_exit.is_set() and jobs[1].ended == [jb.FAILED] and jobs[1].end_status == jb.FAILED
    err = capfd.readouterr().err
    assert "rawgpu: rank 1 of 2: error: rank 0 of 2 ended without a word (it died or was killed); the job stopped" in err
    assert "out of luck" not in err and "ncclCommAbort'ed" not in err, "the first end's line is the only one"
    for job in jobs:
        job.close()


def test_a_malformed_message_on_a_link_ends_the_job_naming_the_rank(capfd):
    jobs = _jobs(2)
    jobs[1].links[0].conn.sendall(b"GARBAGE!" * 4)
    assert _wait_for(lambda: jobs[0].ended == [jb.FAILED])
    assert "rank 1 sent a malformed message" in capfd.readouterr().err
    for job in jobs:
        job.close()


def test_files_half_written_when_a_job_ends_are_removed(tmp_path):
    tmp = tmp_path / ".run.safetensors.abc.tmp"
    tmp.write_bytes(b"half")
    files._unfinished.add(tmp)
    files.remove_unfinished()
    assert not tmp.exists() and files.write_atomic(tmp_path / "x", b"1").read_bytes() == b"1"
    assert not files._unfinished and [p.name for p in tmp_path.iterdir()] == ["x"]


# --- rawgpu.launch -----------------------------------------------------------------------------------------------


def _run(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_launch_gives_each_local_rank_torchruns_variables():
    from rawgpu.cli.launch import build_parser
    from rawgpu.jobs.processes import rank_environment

    args = build_parser().parse_args(["--nnodes", "3", "--node-rank", "2", "--master-addr", "node0:1234",
                                      "--nproc-per-node", "4", "--", "--hidden", "256"])
    assert rank_environment(args.nnodes, args.node_rank, args.master_addr, args.nproc_per_node, 1) == dict(
        RANK="9", WORLD_SIZE="12", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4", MASTER_ADDR="node0", MASTER_PORT="1234")
    second_of_two_eights = [rank_environment(2, 1, ("node0", 1234), 8, local) for local in range(8)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for e in second_of_two_eights] == [
        (str(8 + local), str(local), "16") for local in range(8)]
    assert build_parser().parse_args(["--master-addr", "[::1]:7", "--nproc-per-node", "1"]).master_addr == ("::1", 7)


@pytest.mark.parametrize("args,message", [
    (["--nnodes", "2", "--node-rank", "2", "--nproc-per-node", "1"], "--node-rank: 2 is not below --nnodes 2"),
    (["--master-addr", "node0", "--nproc-per-node", "1"], "expected HOST:PORT"),
    (["--master-addr", "node0:0", "--nproc-per-node", "1"], "expected HOST:PORT"),
    (["--nproc-per-node", "2", "--", "--gpus", "2"], "--gpus is not for the ranks"),
    (["--nproc-per-node", "2", "--", "--hidden", "0"], "rawgpu.train: error: argument --hidden: must be >= 1"),
    ([], "the following arguments are required: --nproc-per-node"),
])
def test_launch_refuses_bad_arguments_in_one_line_before_starting_a_rank(args, message):
    p = _run("rawgpu.launch", *args)
    assert p.returncode == 2 and message in p.stderr.strip().splitlines()[-1] and "Traceback" not in p.stderr


def test_launch_waits_for_its_ranks_and_kills_those_left_after_a_failure(monkeypatch, capsys):
    from rawgpu.jobs import processes as launch

    monkeypatch.setattr(launch, "GRACE_SECONDS", 0.5)
    procs = [launch.ForkedRank(lambda: time.sleep(60), {}), launch.ForkedRank(lambda: 3, {})]
    t = time.monotonic()
    assert launch.supervise(procs, 4) == 3 and time.monotonic() - t < 10
    assert procs[0].returncode == -9 and "rawgpu.launch: rank 5 exited with status 3" in capsys.readouterr().err
    ok = [launch.ForkedRank(lambda: None, {}) for _ in range(2)]
    assert launch.supervise(ok, 0) == 0


def _ended(rank, seconds: float = 30) -> int | None:
    """The forked rank's status once it has ended (None if it has not within `seconds`)."""
    deadline = time.monotonic() + seconds
    while rank.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return rank.returncode


def _exit_with(code):
    raise SystemExit(code)


@pytest.mark.parametrize("main,status", [
    (lambda: 0 if os.environ.get("RAWGPU_TEST_RANK") == "7" else 5, 0),  # the rank's variables reach it
    (lambda: _exit_with(2), 2),  # argparse's usage errors keep their status
    (lambda: _exit_with("a message"), 1),  # printed, as Python prints it
    (lambda: 1 / 0, 1),  # a bug is a traceback and status 1, never a return into the launcher
    (lambda: os.kill(os.getpid(), signal.SIGINT), 130),  # Ctrl-C is the rank's, not the launcher's handler
])
def test_a_forked_rank_runs_main_with_its_variables_and_exits_with_its_status(main, status):
    from rawgpu.jobs import processes as launch

    previous = signal.signal(signal.SIGINT, lambda *_: None)  # the launcher's own handler must not reach the rank
    try:
        rank = launch.ForkedRank(main, {"RAWGPU_TEST_RANK": "7"})
    finally:
        signal.signal(signal.SIGINT, previous)
    assert _ended(rank) == status and "RAWGPU_TEST_RANK" not in os.environ


def test_a_forked_rank_prints_the_message_it_exits_with(capfd):
    from rawgpu.jobs import processes as launch

    rank = launch.ForkedRank(lambda: _exit_with("rawgpu: error: a message"), {})
    assert _ended(rank) == 1 and "rawgpu: error: a message" in capfd.readouterr().err


def test_a_check_in_a_fork_returns_its_answer_and_leaves_what_it_loads_out_of_this_process():
    from rawgpu.jobs import processes as launch

    def load() -> list:
        sys.rawgpu_test_loaded = True  # as a library's state would be
        return [os.getpid(), "loaded"]

    assert launch.in_fork(load)[1] == "loaded" and launch.in_fork(load)[0] != os.getpid()
    assert not hasattr(sys, "rawgpu_test_loaded") and launch.in_fork(lambda: None) is None
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        launch.in_fork(lambda: 1 / 0)
    with pytest.raises(RuntimeError, match="died"):
        launch.in_fork(lambda: os._exit(3))


# --- rawgpu.train as one rank of a job ------------------------------------------------------------------------------

TORCHRUN = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")


@pytest.mark.parametrize("env,args,message", [
    (TORCHRUN, ["--gpus", "3"], "argument --gpus: torchrun started this process as rank 1 of 2, one process per GPU; "
                                "drop --gpus"),
    (TORCHRUN, ["--device", "1"], "argument --device: torchrun started this process as rank 1 of 2; its local rank"),
    (TORCHRUN, ["--step", "fused"], "argument --step: torchrun started this process as rank 1 of 2: a model on 2 GPUs "
                                    "runs the tensor- or data-parallel step, not --step fused"),
    (dict(RANK="1", MASTER_ADDR="h"), [], "the launcher's environment: $WORLD_SIZE is not set, but RANK is"),
    (dict(SLURM_PROCID="3", SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_JOB_NODELIST="n1"), [],
     "the launcher's environment: $SLURM_PROCID: rank 3 is not below $SLURM_NTASKS = 2"),
])
def test_train_as_one_rank_refuses_what_does_not_go_with_it_in_one_line(env, args, message):
    p = _run("rawgpu.train", *args, env=env)
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr
    assert message in p.stderr.strip().splitlines()[-1]


def test_train_as_one_rank_without_nccl_says_how_to_install_it():
    from rawgpu.runtime import nccl

    if nccl.available() is None:
        pytest.skip("NCCL is installed here: the ranks of a job run (tests/test_jobs_gpu.py)")
    p = _run("rawgpu.train", env=TORCHRUN)
    line = p.stderr.strip().splitlines()[-1]  # the environment's failing, not the arguments': exit 1
    assert p.returncode == 1 and line.startswith("rawgpu: error: rank 1 of 2: several GPUs need NCCL")
    one = _run("rawgpu.train", "--no-graph", "--steps-per-graph", "5", env=dict(RANK="0", WORLD_SIZE="1",
                                                                             MASTER_ADDR="h"))
    assert one.returncode == 2 and "--steps-per-graph needs graphs" in one.stderr  # a world of one runs as today


def test_a_check_whose_process_dies_is_one_line_not_a_traceback(monkeypatch, capsys):
    """Loading NCCL or NVML may kill the process that checks it: --gpus N says so in one line; the GPU count is
    then unknown (the ranks find out themselves)."""
    from rawgpu.cli import train
    from rawgpu.jobs import processes as launch
    from rawgpu.runtime import nccl

    monkeypatch.setattr(nccl, "available", lambda: os._exit(11))
    with pytest.raises(SystemExit) as stop:
        train.main(["--gpus", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 1 and err[-1].startswith("rawgpu: error: --gpus 2: NCCL could not be loaded")
    assert not any("Traceback" in line for line in err)
    monkeypatch.setattr(launch, "_nvml_gpus", lambda: os._exit(11))
    assert launch.visible_gpus() is None
