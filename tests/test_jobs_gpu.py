"""Jobs a launcher starts, on GPUs for real (issues 43 and 62): two "nodes" of one 4-GPU host (CUDA_VISIBLE_DEVICES 0,1
and 2,3, NCCL's transport between all ranks forced onto sockets) train as the host's 4 GPUs do; ranks that die, are
killed or interrupted end every other rank within 10 s with a line naming them, leaving no half-written file; ranks
that differ or never come end the job at the rendezvous; real torchrun, on one host and as two, trains the model
`--gpus 2` trains; a sweep spread over two "hosts" writes what one GPU's sweep writes. Each rank is its own
`python -m rawgpu.train` / `rawgpu.sweep`, `rawgpu.launch` or torchrun process, under a hard timeout. On the CPU:
tests/test_job.py, tests/test_torchrun.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rawgpu.data.datasets import load_dataset

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
SOCKETS = dict(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1")  # the "nodes" reach each other as over a network
SAME_SUMS = dict(NCCL_ALGO="Ring", NCCL_PROTO="Simple", NCCL_MIN_NCHANNELS="2", NCCL_MAX_NCHANNELS="2")
FAULT_SECONDS = 10.0  # every other rank has exited this long after one died


def _need_gpus(n: int) -> None:
    from rawgpu.runtime import driver
    from rawgpu.runtime import nccl

    if (why := nccl.available()) is not None:
        pytest.skip(why)
    if (count := driver.device_count()) < n:
        pytest.skip(f"needs {n} GPUs, this machine has {count}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    return {**os.environ, "PYTHONPATH": path, **extra}


def _start(module: str, *args: str, env: dict[str, str], **popen) -> subprocess.Popen:
    """A process as a terminal starts one: Ctrl-C (SIGINT) not ignored, whatever this test's runner ignores."""
    return subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **popen)


def _finish(procs: list[subprocess.Popen], timeout: float = 300) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, stdout, stderr))
    return out


def _data(tmp_path: Path, rng) -> Path:
    from test_trainer import synthetic, write_idx

    return write_idx(tmp_path / "data", synthetic(rng, 3000, 500))


def _epochs(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _tensors(path: Path) -> dict[str, bytes]:
    from safetensors.numpy import load_file

    return {k: v.tobytes() for k, v in load_file(str(path)).items()}


def _nodes(nodes: list[str], per_node: int, train_args: list[str], extra_env: dict[str, str], **popen):
    """One rawgpu.launch per "node", node i on the GPUs nodes[i] names, meeting at a localhost port."""
    master = f"127.0.0.1:{_free_port()}"
    return [_start("rawgpu.launch", "--nnodes", str(len(nodes)), "--node-rank", str(i), "--master-addr", master,
                   "--nproc-per-node", str(per_node), "--", *train_args,
                   env=_env(CUDA_VISIBLE_DEVICES=gpus, **extra_env), **popen) for i, gpus in enumerate(nodes)]


@pytest.mark.parametrize("mode", ["tensor", "data"])
def test_two_nodes_of_two_gpus_train_as_one_host_of_four(device, rng, tmp_path, mode):
    """The same run as `--gpus 4` on one host, as two launches of 2 GPUs each over sockets: the same epochs and test
    accuracy, and (NCCL's sums made the same: ring, 2 channels) the same checkpoint bits. The checkpoint loads on one
    GPU."""
    from rawgpu import Trainer

    _need_gpus(4)
    data = _data(tmp_path, rng)
    args = ["--dataset", "idx", "--data-dir", str(data), "--hidden", "512", "--epochs", "2", "--json",
            "--parallel", mode, "--lr", "0.05"]
    one_host = tmp_path / "one.safetensors"
    [(code, stdout, stderr)] = _finish([_start("rawgpu.train", "--gpus", "4", *args, "--save", str(one_host),
                                               env=_env(**SAME_SUMS))])
    assert code == 0, stderr
    two = tmp_path / "two.safetensors"
    (c0, out0, err0), (c1, out1, err1) = _finish(_nodes(["0,1", "2,3"], 2, args + ["--save", str(two)],
                                                        {**SOCKETS, **SAME_SUMS}))
    assert c0 == 0 and c1 == 0, err0 + err1
    assert out1 == ""  # only rank 0 shows the run
    want, got = _epochs(stdout), _epochs(out0)
    assert [e["epoch"] for e in got] == [1, 2]
    assert [e["test_accuracy"] for e in got] == [e["test_accuracy"] for e in want]
    assert _tensors(two) == _tensors(one_host)
    with Trainer.load(two, data=load_dataset("idx", data)) as loaded:  # the one-GPU format
        assert abs(loaded.evaluate().accuracy - got[-1]["test_accuracy"]) <= 0.002


def test_a_checkpoint_moves_between_one_gpu_and_a_job_of_two_hosts(device, rng, tmp_path):
    """Saved on one GPU inside its run, resumed by two "hosts" of one GPU each; with two ranks the sums cannot round
    otherwise, so the job's checkpoint is bit for bit the one `--gpus 2` writes from the same start."""
    from rawgpu import Recipe, Trainer

    _need_gpus(2)
    data = _data(tmp_path, rng)
    with Trainer(Recipe(hidden=256), data=load_dataset("idx", data), epochs=3) as start:
        start.fit(stop_at=30)
        for name in ("host", "job"):
            start.save(tmp_path / f"{name}.safetensors")
    resume = ["--dataset", "idx", "--data-dir", str(data), "--parallel", "tensor", "--json"]
    [(code, host_out, stderr)] = _finish([_start("rawgpu.train", "--gpus", "2", "--resume",
                                                 str(tmp_path / "host.safetensors"), *resume, env=_env())])
    assert code == 0, stderr
    results = _finish(_nodes(["0", "1"], 1, ["--resume", str(tmp_path / "job.safetensors"), *resume], SOCKETS))
    assert all(code == 0 for code, _, _ in results), [err for _, _, err in results]
    assert _epochs(results[0][1]) and [e["test_accuracy"] for e in _epochs(results[0][1])] == \
        [e["test_accuracy"] for e in _epochs(host_out)]
    assert _tensors(tmp_path / "job.safetensors") == _tensors(tmp_path / "host.safetensors")


def _ranks(n: int, args: list[str], port: int, **env: str) -> list[subprocess.Popen]:
    """n ranks started as torchrun starts them (its variables), each on its own GPU."""
    return [_start("rawgpu.train", *args, env=_env(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r),
                                                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env))
            for r in range(n)]


def _long_run(tmp_path: Path, rng) -> tuple[list[str], Path]:
    save = tmp_path / "run.safetensors"
    return (["--dataset", "idx", "--data-dir", str(_data(tmp_path, rng)), "--hidden", "1024", "--epochs", "400",
             "--json", "--save", str(save), "--save-every", "7"], save)


def _wait_for_first_epoch(rank0: subprocess.Popen) -> None:
    line = rank0.stdout.readline()  # rank 0's first epoch: every rank is training
    assert line.startswith("{"), rank0.stderr.read() if rank0.poll() is not None else line


def _nothing_half_written(save: Path) -> None:
    from rawgpu.training import checkpoint

    assert [p.name for p in save.parent.iterdir() if p.name.endswith(".tmp")] == []
    if save.exists():
        checkpoint.load(save)  # whole, or not there


@pytest.mark.parametrize("victim,how", [(1, signal.SIGKILL), (0, signal.SIGKILL), (1, signal.SIGINT),
                                        (0, signal.SIGTERM)])
def test_a_rank_that_dies_or_is_stopped_ends_every_other_within_seconds(device, rng, tmp_path, victim, how):
    _need_gpus(2)
    args, save = _long_run(tmp_path, rng)
    procs = _ranks(2, args, _free_port())
    try:
        _wait_for_first_epoch(procs[0])
        procs[victim].send_signal(how)
        t = time.monotonic()
        other = procs[1 - victim]
        other.wait(FAULT_SECONDS + 5)
        took = time.monotonic() - t
        results = _finish(procs, 30)
    finally:
        for p in procs:
            p.kill()
    code, _, err = results[1 - victim]
    assert code == 1 and took <= FAULT_SECONDS, (took, err)
    said = err.strip().splitlines()[-1]
    expect = (f"rank {victim} of 2 ended without a word (it died or was killed)" if how == signal.SIGKILL
              else f"rank {victim} of 2 was stopped by {how.name}")
    assert said == f"rawgpu: rank {1 - victim} of 2: error: {expect}; the job stopped", err
    assert results[victim][0] == (-9 if how == signal.SIGKILL else 128 + how), results[victim][2]
    _nothing_half_written(save)


def test_ctrl_c_on_one_node_stops_the_job_on_every_node(device, rng, tmp_path):
    """Ctrl-C reaches node 1's launcher and its ranks (their process group, as a terminal sends it): node 0's ranks
    end too, and both launchers exit non-zero."""
    _need_gpus(2)
    args, save = _long_run(tmp_path, rng)
    nodes = _nodes(["0", "1"], 1, args, SOCKETS, start_new_session=True)
    try:
        _wait_for_first_epoch(nodes[0])
        os.killpg(nodes[1].pid, signal.SIGINT)
        t = time.monotonic()
        nodes[0].wait(FAULT_SECONDS + 5)
        took = time.monotonic() - t
        (c0, _, err0), (c1, _, err1) = _finish(nodes, 30)
    finally:
        for p in nodes:
            os.killpg(p.pid, signal.SIGKILL) if p.poll() is None else None
    assert took <= FAULT_SECONDS and c0 == 1 and c1 == 130, (took, err0, err1)
    assert "rawgpu: rank 0 of 2: error: rank 1 of 2 was stopped by SIGINT; the job stopped" in err0
    assert "rawgpu.launch: rank 0 exited with status 1" in err0
    _nothing_half_written(save)


def test_the_rendezvous_ends_a_job_whose_ranks_differ_or_never_come(device, rng, tmp_path):
    """Before any GPU work: a rank with another recipe ends the job at once, naming it; a rank that never comes is
    named after --rendezvous-timeout."""
    _need_gpus(1)
    data = ["--dataset", "idx", "--data-dir", str(_data(tmp_path, rng)), "--epochs", "1"]
    port = _free_port()
    env = dict(WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    procs = [_start("rawgpu.train", *data, "--lr", lr, env=_env(RANK=str(r), **env))
             for r, lr in ((0, "0.1"), (1, "0.2"))]
    for code, stdout, stderr in _finish(procs, 120):
        assert code == 1 and "rendezvous: rank 1 has another recipe than rank 0" in stderr.strip().splitlines()[-1]
    t = time.monotonic()
    [(code, _, stderr)] = _finish([_start("rawgpu.train", *data, "--rendezvous-timeout", "2",
                                          env=_env(RANK="0", **{**env, "WORLD_SIZE": "3"}))], 120)
    assert code == 1 and time.monotonic() - t < 60
    assert f"rendezvous: ranks 1, 2 of 3 did not arrive at 127.0.0.1:{port} in 2 s" in stderr.strip().splitlines()[-1]
    [(code, _, stderr)] = _finish([_start("rawgpu.train", *data, "--rendezvous-timeout", "1",
                                          env=_env(RANK="1", **env))], 120)
    assert code == 1 and stderr.strip().splitlines()[-1] == (
        f"rawgpu: error: rank 1 of 2: rendezvous: could not reach rank 0 at 127.0.0.1:{port} in 1 s "
        "(Connection refused)")


def test_a_local_rank_beyond_the_hosts_gpus_is_one_line(device, rng, tmp_path):
    from rawgpu.runtime import driver

    _need_gpus(1)
    n = driver.device_count()
    p = subprocess.run([sys.executable, "-m", "rawgpu.train", "--dataset", "idx", "--data-dir",
                        str(_data(tmp_path, rng))], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK=str(n), MASTER_ADDR="127.0.0.1"))
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert f"its local rank {n} names a GPU this host does not have" in p.stderr.strip().splitlines()[-1]




# --- real torchrun (issue 62) ---------------------------------------------------------------------------------------


def _need_torchrun() -> None:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        pytest.skip("torchrun comes with torch, which is not installed here")


def _torchrun(*args: str, env: dict[str, str], **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, **popen)


def test_torchrun_on_one_host_and_as_two_trains_the_model_gpus_2_trains(device, rng, tmp_path):
    """torchrun's agent holds MASTER_PORT with its own store: the ranks meet through it (jobs/torchrun_store.py).
    --standalone, and two torchruns of one GPU each meeting over c10d, end with exit 0 and --gpus 2's checkpoint."""
    _need_gpus(2)
    _need_torchrun()
    data = _data(tmp_path, rng)
    args = ["-m", "rawgpu.train", "--dataset", "idx", "--data-dir", str(data), "--hidden", "512", "--epochs", "2",
            "--json"]
    [(code, want, stderr)] = _finish([_start("rawgpu.train", *args[2:], "--gpus", "2", "--save",
                                             str(tmp_path / "gpus.safetensors"), env=_env())])
    assert code == 0, stderr
    [(code, got, stderr)] = _finish([_torchrun("--standalone", "--nproc-per-node", "2", *args, "--save",
                                               str(tmp_path / "standalone.safetensors"), env=_env())])
    assert code == 0, stderr
    assert [e["test_accuracy"] for e in _epochs(got)] == [e["test_accuracy"] for e in _epochs(want)]
    assert _tensors(tmp_path / "standalone.safetensors") == _tensors(tmp_path / "gpus.safetensors")
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [_torchrun("--nnodes", "2", "--node-rank", str(r), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", endpoint, "--rdzv-id", "test", *args, "--save",
                       str(tmp_path / "nodes.safetensors"), env=_env(CUDA_VISIBLE_DEVICES=str(r), **SOCKETS))
             for r in range(2)]
    results = _finish(nodes)
    assert all(code == 0 for code, _, _ in results), [err for _, _, err in results]
    outs = [out for _, out, _ in results if _epochs(out)]  # torchrun decides which node holds rank 0
    assert len(outs) == 1 and [e["test_accuracy"] for e in _epochs(outs[0])] == \
        [e["test_accuracy"] for e in _epochs(want)]
    assert _tensors(tmp_path / "nodes.safetensors") == _tensors(tmp_path / "gpus.safetensors")


def test_a_rank_killed_under_torchrun_ends_the_job_in_one_line(device, rng, tmp_path):
    _need_gpus(2)
    _need_torchrun()
    args, save = _long_run(tmp_path, rng)
    error_files = tmp_path / "logs"
    p = _torchrun("--standalone", "--nproc-per-node", "2", "--log-dir", str(error_files), "-m", "rawgpu.train",
                  *args, env=_env())
    try:
        _wait_for_first_epoch(p)
        ranks = subprocess.run(["pgrep", "-f", "-P", str(p.pid), "rawgpu.train"], capture_output=True, text=True)
        pids = [int(x) for x in ranks.stdout.split()]
        assert len(pids) == 2, ranks.stdout
        # rank 1: the worker whose environment says so
        victim = next(pid for pid in pids if "RANK=1" in Path(f"/proc/{pid}/environ").read_text().split("\0"))
        os.kill(victim, signal.SIGKILL)
        [(code, _, stderr)] = _finish([p], 60)
    finally:
        p.kill()
    assert code != 0
    assert "rawgpu: rank 0 of 2: error: rank 1 of 2 ended without a word (it died or was killed); the job stopped" \
        in stderr.splitlines()
    # torchrun's agent prints its own ChildFailedError traceback; no rank printed one (no frame of rawgpu's)
    assert not any(line.strip().startswith("File ") and "rawgpu" in line for line in stderr.splitlines()), stderr
    _nothing_half_written(save)


def _sweep_results(folder: Path) -> list[tuple]:
    doc = json.loads((folder / "results.json").read_text())
    return [(m["index"], m["best_accuracy"], [e["train_loss"] for e in m["epochs"]]) for m in doc["models"]]


@pytest.mark.parametrize("launcher", ["torchrun", "rawgpu.launch"])
def test_a_sweep_over_two_hosts_writes_what_one_gpu_writes_and_resumes_a_dead_ranks_models(device, rng, tmp_path,
                                                                                          launcher):
    _need_gpus(2)
    if launcher == "torchrun":
        _need_torchrun()
    data = _data(tmp_path, rng)
    grid = ["--dataset", "idx", "--data-dir", str(data), "--hidden", "256", "--lr", "0.02", "0.05", "--seeds", "0-2",
            "--epochs", "2", "--save-best", "2"]
    [(code, _, stderr)] = _finish([_start("rawgpu.sweep", *grid, "--out", str(tmp_path / "one"), env=_env())])
    assert code == 0, stderr
    out = tmp_path / "two"
    if launcher == "torchrun":
        endpoint = f"127.0.0.1:{_free_port()}"
        procs = [_torchrun("--nnodes", "2", "--node-rank", str(r), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                           "--rdzv-endpoint", endpoint, "--rdzv-id", "sweep", "-m", "rawgpu.sweep", *grid, "--out",
                           str(out), env=_env(CUDA_VISIBLE_DEVICES=str(r))) for r in range(2)]
    else:
        master = f"127.0.0.1:{_free_port()}"
        procs = [_start("rawgpu.launch", "--command", "sweep", "--nnodes", "2", "--node-rank", str(r),
                        "--master-addr", master, "--nproc-per-node", "1", "--", *grid, "--out", str(out),
                        env=_env(CUDA_VISIBLE_DEVICES=str(r))) for r in range(2)]
    results = _finish(procs)
    assert all(code == 0 for code, _, _ in results), [err for _, _, err in results]
    assert _sweep_results(out) == _sweep_results(tmp_path / "one")
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == sorted(p.name for p in (tmp_path / "one" / "checkpoints").iterdir()) and len(kept) == 2
    for name in kept:
        assert _tensors(out / "checkpoints" / name) == _tensors(tmp_path / "one" / "checkpoints" / name)


def test_a_sweeps_rank_that_dies_is_named_and_resume_trains_its_models_again(device, rng, tmp_path):
    _need_gpus(2)
    data = _data(tmp_path, rng)
    grid = ["--dataset", "idx", "--data-dir", str(data), "--hidden", "256", "--lr", "0.01", "0.02", "0.05", "0.1",
            "--seeds", "0-3", "--epochs", "3", "--one-at-a-time"]
    [(code, _, stderr)] = _finish([_start("rawgpu.sweep", *grid, "--out", str(tmp_path / "one"), env=_env())])
    assert code == 0, stderr
    out = tmp_path / "two"
    master = f"127.0.0.1:{_free_port()}"
    nodes = [_start("rawgpu.launch", "--command", "sweep", "--nnodes", "2", "--node-rank", str(r), "--master-addr",
                    master, "--nproc-per-node", "1", "--", *grid, "--out", str(out),
                    env=_env(CUDA_VISIBLE_DEVICES=str(r)), start_new_session=True) for r in range(2)]
    try:
        deadline = time.monotonic() + 120
        while not (out / "results.json").exists() or not any(
                m["epochs"] for m in json.loads((out / "results.json").read_text())["models"]):
            assert time.monotonic() < deadline and nodes[0].poll() is None, nodes[0].stderr.read()
            time.sleep(0.05)
        os.killpg(nodes[1].pid, signal.SIGKILL)  # node 1: its launcher and its rank
        (c0, _, err0), _ = _finish(nodes, 60)
    finally:
        for p in nodes:
            os.killpg(p.pid, signal.SIGKILL) if p.poll() is None else None
    assert c0 == 1 and "rawgpu: rank 0 of 2: error: rank 1 of 2 ended without a word (it died or was killed); the " \
                       "job stopped" in err0.splitlines(), err0
    finished = sum(bool(m["epochs"]) for m in json.loads((out / "results.json").read_text())["models"])
    assert 1 <= finished < 16
    [(code, stdout, stderr)] = _finish([_start("rawgpu.sweep", *grid, "--resume", str(out), env=_env())])
    assert code == 0, stderr
    assert f"resumed: {finished} of 16 models already trained" in stdout
    assert _sweep_results(out) == _sweep_results(tmp_path / "one")
