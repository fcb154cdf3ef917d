"""Several GPUs for real: a process per GPU, NCCL between them, every split (tensor and data parallel). These need a
machine with 2 GPUs or more and NCCL (rawgpu[multi]); elsewhere each skips, saying which it lacks. On one GPU the
same code is checked by tests/test_sharded.py and tests/test_replicated.py (the ranks side by side, their sums on
the host, and one rank through NCCL)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rawgpu.model.recipe import Recipe

pytestmark = pytest.mark.gpu
SPLITS = ("tensor", "data")


def _need_gpus(n: int) -> None:
    from rawgpu.runtime import driver
    from rawgpu.runtime import nccl

    if (why := nccl.available()) is not None:
        pytest.skip(why)
    if (count := driver.device_count()) < n:
        pytest.skip(f"needs {n} GPUs, this machine has {count}")


def _train_rank(rank, ranks, unique_id, recipe, data, steps, mode):
    """One rank's run (a process of ranks.run_ranks): rank 0 returns the whole model and the history."""
    from rawgpu import Trainer
    from rawgpu.runtime.ranks import Rank

    with Trainer._make(recipe, data=data, steps=steps, rank=Rank(ranks, rank, unique_id, mode)) as t:
        t.fit()
        ckpt = t.checkpoint()  # every rank takes part; rank 0 gets the joined model
        return (t.model.kind, [h.test_accuracy for h in t.history],
                None if ckpt is None else [(w.copy(), b.copy()) for w, b in ckpt.weights])


@pytest.mark.parametrize("batch", [128, 1024])
@pytest.mark.parametrize("mode", SPLITS)
def test_two_gpus_train_as_one_does(device, rng, mode, batch):
    """Two processes on two GPUs, each split: they start from the one-GPU model and after 20 steps their joined
    parameters have moved as one GPU's long-form step moved them (the sums over the GPUs round in another order:
    within 5% of the change), to the same test accuracy within a point. At batch 1024 each data-parallel rank's 512
    rows take the large-batch weight gradients (on sm_90 warpgroup MMA, K split over a cluster)."""
    from rawgpu import Trainer
    from rawgpu.runtime.ranks import run_ranks
    from rawgpu.steps import StepOptions
    from test_trainer import synthetic

    _need_gpus(2)
    data = synthetic(rng, 3000, 500)
    recipe = Recipe(hidden=256, batch=batch, momentum=0.9, lr=0.05, seed=int(rng.integers(1 << 30)))
    kind, history, weights = run_ranks(_train_rank, 2, recipe, data, 20, mode)[0]
    assert kind == mode
    with Trainer._make(recipe, data=data, steps=20, step="layered", options=StepOptions(short=False)) as one:
        init = [(w.copy(), b.copy()) for w, b in one.parameters()]
        one.fit()
        expect, accuracy = one.parameters(), one.history[-1].test_accuracy
    for (w, b), (ew, eb), (w0, b0) in zip(weights, expect, init):
        for got, want, start in ((w, ew, w0), (b, eb, b0)):
            change = np.linalg.norm(want.astype(np.float64) - start)
            assert np.linalg.norm(got.astype(np.float64) - want) <= 0.05 * change
    assert abs(history[-1] - accuracy) <= 0.01


@pytest.mark.parametrize("mode", SPLITS)
def test_the_cli_trains_on_two_gpus_and_saves_a_one_gpu_checkpoint(device, rng, tmp_path, mode):
    """`python -m rawgpu.train --gpus 2 --parallel MODE`: rank 0 reports every epoch, the checkpoint is the one-GPU
    format and loads on one GPU to the accuracy the run reported."""
    from rawgpu import Trainer
    from rawgpu.training import checkpoint
    from test_trainer import cli, synthetic, write_idx

    _need_gpus(2)
    data = synthetic(rng, 3000, 500)
    path = tmp_path / f"{mode}.safetensors"
    out = cli("rawgpu.train", "--gpus", "2", "--parallel", mode, "--dataset", "idx", "--data-dir",
              str(write_idx(tmp_path / "data", data)), "--hidden", "256", "--epochs", "2", "--json", "--save", str(path))
    assert out.returncode == 0, out.stderr
    epochs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [e["epoch"] for e in epochs] == [1, 2] and epochs[-1]["test_accuracy"] > 0.5
    assert checkpoint.load(path).step_kind == mode
    with Trainer.load(path, data=data) as loaded:
        assert abs(loaded.evaluate().accuracy - epochs[-1]["test_accuracy"]) <= 0.002


@pytest.mark.parametrize("mode", SPLITS)
@pytest.mark.parametrize("task", ["regression", "classes"])
def test_a_table_trains_on_two_gpus_from_the_cli(device, rng, tmp_path, mode, task):
    """`python -m rawgpu.train --data t.npz --standardize --gpus 2 --parallel MODE`: float features, a regression of 2
    values or 100 classes (a head beyond the one-tile kernel's); rank 0 reports every epoch, and the one-GPU
    checkpoint (its scaling with it) evaluates on one GPU to the score the run reported."""
    from rawgpu import Trainer
    from rawgpu.data.datasets import Dataset
    from test_trainer import cli

    _need_gpus(2)
    x = (rng.standard_normal((9000, 40)) * rng.uniform(0.5, 4, 40) + rng.normal(0, 2, 40)).astype(np.float32)
    z = np.tanh(x @ rng.standard_normal((40, 8)) / 12) @ rng.standard_normal((8, 2))
    regression = task == "regression"
    teacher = rng.standard_normal((40, 100)) / np.sqrt(40)  # 100 classes a linear model of x separates
    y = z.astype(np.float32) if regression else ((x - x.mean(0)) / x.std(0) @ teacher).argmax(1).astype(np.int64)
    data_path, path = tmp_path / "t.npz", tmp_path / f"{mode}.safetensors"
    np.savez(data_path, x_train=x[:8000], y_train=y[:8000], x_test=x[8000:], y_test=y[8000:])
    loss = ["--loss", "mse"] if regression else []
    out = cli("rawgpu.train", "--gpus", "2", "--parallel", mode, "--data", str(data_path), *loss, "--standardize",
              "--hidden", "256", "--epochs", "5", "--json", "--save", str(path))
    assert out.returncode == 0, out.stderr
    epochs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [e["epoch"] for e in epochs] == [1, 2, 3, 4, 5]
    data = Dataset.from_tables(data_path, regression=regression)
    with Trainer.load(path, data=data) as loaded:
        scored = loaded.evaluate()
    if regression:
        assert epochs[-1]["test_r2"] > 0.5 and scored.rmse == pytest.approx(epochs[-1]["test_rmse"], rel=2e-3)
    else:
        assert epochs[-1]["test_accuracy"] > 0.15 and abs(scored.accuracy - epochs[-1]["test_accuracy"]) <= 0.002


@pytest.mark.parametrize("mode", SPLITS)
def test_a_parquet_table_trains_on_two_gpus_as_the_same_rows_from_an_npz(device, rng, tmp_path, mode):
    """`--data train.parquet --test test.parquet --gpus 2 --parallel MODE` (each rank reads the float columns, made
    into rows on the GPU) against the same rows in an .npz: the same epochs reported (losses, accuracy) and the same
    one-GPU checkpoint's parameters, bit for bit."""
    pa = pytest.importorskip("pyarrow", reason="pyarrow (the tables extra) reads Parquet")
    import pyarrow.parquet as pq

    from rawgpu import Trainer
    from rawgpu.data.datasets import Dataset
    from test_trainer import cli

    _need_gpus(2)
    x = (rng.standard_normal((9000, 40)) * rng.uniform(0.5, 30.0, 40)).astype(np.float32)
    y = (x[:, :3].sum(1) > 0).astype(np.int64) + (x[:, 3] > 1)  # 3 classes
    for name, rows in (("train", slice(0, 8000)), ("test", slice(8000, None))):
        table = pa.table({**{f"f{j}": x[rows, j] for j in range(40)}, "label": y[rows]})
        pq.write_table(table, tmp_path / f"{name}.parquet", row_group_size=1000)
    np.savez(tmp_path / "t.npz", x_train=x[:8000], y_train=y[:8000], x_test=x[8000:], y_test=y[8000:])
    sources = {"parquet": ["--data", str(tmp_path / "train.parquet"), "--test", str(tmp_path / "test.parquet")],
               "npz": ["--data", str(tmp_path / "t.npz")]}
    epochs, parameters = {}, {}
    for name, data in sources.items():
        path = tmp_path / f"{name}.safetensors"
        out = cli("rawgpu.train", "--gpus", "2", "--parallel", mode, *data, "--standardize", "--hidden", "256",
                  "--epochs", "3", "--json", "--save", str(path))
        assert out.returncode == 0, out.stderr
        epochs[name] = [tuple(json.loads(line)[k] for k in ("epoch", "train_loss", "test_loss", "test_accuracy"))
                        for line in out.stdout.splitlines() if line.startswith("{")]
        loaded_data = Dataset.from_tables(tmp_path / "train.parquet", test=tmp_path / "test.parquet") \
            if name == "parquet" else Dataset.from_tables(tmp_path / "t.npz")
        with Trainer.load(path, data=loaded_data) as loaded:
            parameters[name] = loaded.parameters()
    assert [e[0] for e in epochs["parquet"]] == [1, 2, 3] and epochs["parquet"] == epochs["npz"]
    assert epochs["parquet"][-1][3] > 0.6  # it learned
    for (w1, b1), (w2, b2) in zip(parameters["parquet"], parameters["npz"], strict=True):
        assert np.array_equal(w1, w2) and np.array_equal(b1, b2)


def test_the_benchmark_times_every_split_on_two_gpus(device, tmp_path):
    """`python scripts/bench.py train --gpus 1 2 --parallel MODE` (a script: its ranks' processes import it as the
    main module): a row per width with the 2-GPU time, the time in the sums and the test accuracy."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from rawgpu.data.datasets import load_mnist

    _need_gpus(2)
    try:
        load_mnist(download=False)
    except Exception as exc:  # noqa: BLE001 - the benchmark trains on MNIST
        pytest.skip(f"MNIST is not here: {exc}")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root)] + ([os.environ["PYTHONPATH"]]
                                                                       if os.environ.get("PYTHONPATH") else []))}
    for mode in SPLITS:
        out = tmp_path / mode
        run = subprocess.run([sys.executable, "scripts/bench.py", "train", "--gpus", "1", "2", "--parallel", mode,
                              "--sizes", "256", "--steps", "200", "--recipe", "default", "--out", str(out)],
                             capture_output=True, text=True, timeout=600, cwd=root, env=env)
        assert run.returncode == 0, run.stderr
        [row] = json.loads((out / "bench_train_gpus.json").read_text())["rows"]
        [split] = row["split"]
        assert split["gpus"] == 2 and split["parallel"] == mode and split["us_per_step"] > 0
        assert split["test_accuracy"] > 0.5
