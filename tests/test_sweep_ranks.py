"""A sweep as a job on several hosts (issue 62): rank 0 hands out the shares, every rank sends each model's history and
checkpoint as it finishes, rank 0 writes them; a resumed sweep hands out only the unfinished models. The ranks here are
threads meeting over localhost, their training a stand-in that reports made-up epochs (no GPU); the real thing is in
tests/test_jobs_gpu.py."""

from __future__ import annotations

import json

import pytest

from rawgpu.jobs import sweep_ranks
from rawgpu.training import sweep as sweeper
from rawgpu.training.stats import EpochStats
from rawgpu.training.grid import Grid
from rawgpu.jobs.launchers import World
from rawgpu.model.recipe import Recipe
from rank_threads import run_ranks
from test_trainer import synthetic


def _stats(index: int, epoch: int) -> EpochStats:
    return EpochStats(epoch=epoch, epochs=2, steps=9, train_loss=1.0 / (index + epoch), train_accuracy=0.5,
                      test_loss=float("nan"), test_accuracy=0.1 * index + 0.01 * epoch, seconds=1.0,
                      eval_seconds=0.1, steps_per_s=9.0, samples_per_s=99.0, tflops=0.1, gbps=1.0, lr=0.01,
                      total_seconds=float(epoch))


def test_a_models_message_carries_its_history_and_checkpoint_bit_for_bit():
    history = [_stats(3, 1), _stats(3, 2)]
    index, got, checkpoint = sweep_ranks._read(sweep_ranks._message(3, history, b"\0safetensors\xff"))
    assert index == 3 and checkpoint == b"\0safetensors\xff"
    assert [json.dumps(h.__dict__) for h in got] == [json.dumps(h.__dict__) for h in history]  # NaN kept
    assert sweep_ranks._read(sweep_ranks._message(None))[0] is None
    with pytest.raises(ValueError, match="cut short"):
        sweep_ranks._read(sweep_ranks._message(1, history, b"abc")[:-1])


def _sweep(data, out, **kw):
    grid = Grid((("lr", (0.02, 0.05)),), seeds=(0, 1, 2))
    return sweeper.Sweep(grid, Recipe(hidden=32, batch=64), data=data, epochs=2, out=out, **kw)


@pytest.mark.parametrize("size", [2, 3])
def test_each_rank_trains_its_share_and_rank_0_writes_every_result_and_the_best_checkpoints(monkeypatch, rng,
                                                                                           tmp_path, size):
    import socket

    trained: dict[int, list[int]] = {}

    def fake_share(share, data, epochs, steps, keep, together, device, done):
        trained[device] = [i for i, _ in share]
        for index, _ in share:
            path = None
            if keep is not None:
                keep.mkdir(parents=True, exist_ok=True)
                (path := keep / f"model-{index}.safetensors").write_bytes(f"weights of {index}".encode())
            done(index, [_stats(index, 1), _stats(index, 2)], str(path) if path else None)
        return len(share)

    monkeypatch.setattr(sweeper, "train_share", fake_share)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = synthetic(rng, 640, 100)  # every host holds the same data (the rendezvous checks)
    sweeps = [_sweep(data, tmp_path / "out", save_best=2)] + [_sweep(data, None) for _ in range(size - 1)]
    sweeps[0].results[1].history = [_stats(1, 1), _stats(1, 2)]  # a resumed sweep: model 1 is done
    todo = [r.index for r in sweeps[0].results if not r.done]
    seen = []
    errors = run_ranks(lambda r: sweep_ranks.run(sweeps[r], World(r, size, r, "127.0.0.1", port, "test"), 10.0, None,
                                                 todo, lambda result: seen.append(result.index)), size)
    assert not errors
    assert {r: trained[r] for r in range(size)} == {r: todo[r::size] for r in range(size)}  # model 1 not again
    assert sorted(seen) == todo
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [m["best_accuracy"] for m in doc["models"]] == [pytest.approx(0.1 * i + 0.02) for i in range(6)]
    kept = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
    assert kept == ["model-4.safetensors", "model-5.safetensors"]  # the best two
    assert (tmp_path / "out" / "checkpoints" / "model-5.safetensors").read_bytes() == b"weights of 5"


# --- the CLI's ranks: every failure before the job is one line naming the rank, exit 1 (no GPU needed) ---------------


def _rank(tmp_path, rng, rank: int, port: int, *extra: str, **env: str):
    """`python -m rawgpu.sweep` as rank `rank` of 2 that a launcher started (its variables), on IDX files."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from test_trainer import write_idx

    data = tmp_path / "data"
    if not data.exists():
        write_idx(data, synthetic(rng, 300, 100))
    root = Path(__file__).resolve().parents[1]
    return subprocess.Popen([sys.executable, "-m", "rawgpu.sweep", "--dataset", "idx", "--data-dir", str(data),
                             "--lr", "0.1", "0.2", "--epochs", "1", *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root), "RANK": str(rank), "WORLD_SIZE": "2",
                                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **env})


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last_line(p, timeout: float = 60, said: list | None = None) -> tuple[int, str]:
    """The exit status and the last line on stderr (every line into `said`)."""
    out, err = p.communicate(timeout=timeout)
    assert "Traceback" not in err, err
    if said is not None:
        said += err.strip().splitlines()
    return p.returncode, err.strip().splitlines()[-1]


def test_a_port_in_use_a_master_nobody_runs_and_a_wrong_token_are_one_line_each(tmp_path, rng):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code, line = _last_line(_rank(tmp_path, rng, 0, port))
    assert code == 1 and line == (f"rawgpu: error: rank 0 of 2: rendezvous: rank 0 cannot listen at 127.0.0.1:{port}: "
                                  "Address already in use (another program holds it: give the job another port)")
    port = _port()
    code, line = _last_line(_rank(tmp_path, rng, 1, port, "--rendezvous-timeout", "1"))
    assert code == 1 and line == (f"rawgpu: error: rank 1 of 2: rendezvous: could not reach rank 0 at 127.0.0.1:"
                                  f"{port} in 1 s (Connection refused)")
    root = _rank(tmp_path, rng, 0, port, "--rendezvous-timeout", "3", RAWGPU_RENDEZVOUS_TOKEN="right")
    code, line = _last_line(_rank(tmp_path, rng, 1, port, RAWGPU_RENDEZVOUS_TOKEN="wrong"))
    assert code == 1 and line == ("rawgpu: error: rank 1 of 2: rendezvous: rank 0 refused this rank: a wrong token "
                                  "($RAWGPU_RENDEZVOUS_TOKEN differs from rank 0's)")
    said: list[str] = []
    code, line = _last_line(root, said=said)  # rank 0 logged the stranger and waited for its rank 1 until its timeout
    assert code == 1 and line == f"rawgpu: error: rank 0 of 2: rendezvous: rank 1 of 2 did not arrive at 127.0.0.1:" \
                                 f"{port} in 3 s"
    assert [x.split(": ", 3)[:2] + [x.split(": ")[-1]] for x in said[:-1]] == [
        ["rawgpu", "rank 0 of 2", "a wrong token ($RAWGPU_RENDEZVOUS_TOKEN differs from rank 0's)"]]


def test_a_sweeps_rank_refuses_gpus_and_device_in_one_line(tmp_path, rng):
    for extra, message in ((["--gpus", "2"], "argument --gpus: torchrun started this process as rank 1 of 2, one "
                                             "process per GPU; drop --gpus"),
                           (["--device", "1"], "argument --device: torchrun started this process as rank 1 of 2")):
        code, line = _last_line(_rank(tmp_path, rng, 1, 1, *extra))
        assert code == 2 and message in line
