"""Sweeps (rawgpu/sweep.py, rawgpu/training/sweep.py): bad input is one line before any GPU work; results are written and
resumed on CPU; on the GPU every model of a sweep ends with the bits `Trainer` gives it alone, and a resumed sweep
ends as the uninterrupted one."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rawgpu.cli import sweep as cli
from rawgpu.training.stats import EpochStats
from rawgpu.training.grid import Grid
from rawgpu.model.recipe import Recipe
from rawgpu.training.sweep import Sweep

gpu = pytest.mark.gpu


@pytest.mark.parametrize("argv, message", [
    (["--batch", "32", "64"], "argument --batch: one architecture, batch and dataset per sweep, got 2 values"),
    (["--hidden", "256", "512", "--layers", "2"], "argument --layers: a width list sets the layer count"),
    (["--hidden", "0", "512"], "argument --hidden: must be >= 1, got 0"),
    (["--dataset", "mnist", "kmnist"], "argument --dataset: one architecture, batch and dataset per sweep"),
    (["--lr", "0.1", "0.1"], "the grid: lr: 0.1 is given twice"),
    (["--seeds", "0-3", "2"], "the grid: seeds: 2 is given twice"),
    (["--lr", "0.1", "--betas", "0.9,0.99", "--optimizer", "sgd"], "the grid: betas: applies to --optimizer adam"),
    (["--betas", "0.9"], "argument --betas: expected B1,B2 (two numbers), got '0.9'"),
    (["--lr", "0"], "argument --lr: must be > 0, got 0"),
    (["--save-best", "2"], "the checkpoints go to --out DIR"),
    (["--resume", "/nonexistent-sweep", "--out", "/tmp/elsewhere"], "--resume DIR writes to DIR"),
    (["--resume", "/nonexistent-sweep"], "argument --resume: no sweep folder /nonexistent-sweep"),
    (["--data-dir", "/nonexistent-data"], "argument --data-dir: no directory /nonexistent-data"),
    (["--dataset", "idx"], "argument --dataset: idx needs --data-dir DIR"),
    (["--warmup", "0", "50", "--schedule", "constant"], "the grid: warmup 50, schedule constant, seed 0: a warm-up"),
    (["--warmup", "100", "--steps", "100"], "the grid: warmup 100, seed 0: 100 warm-up steps is not shorter"),
    (["--target", "y"], "argument --target: picks from a table; add --data PATH"),
    (["--data", "t.csv", "--dataset", "kmnist"], "argument --dataset: --data names your own table; drop one of them"),
    (["--loss", "mse"], "argument --loss: mse is a regression's loss; mnist has class labels"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_gpu_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and message in err[-1], err


def _stats(epoch: int, epochs: int, loss: float, acc: float) -> EpochStats:
    return EpochStats(epoch=epoch, epochs=epochs, steps=10, train_loss=loss, train_accuracy=0.5, test_loss=loss,
                      test_accuracy=acc, seconds=0.1, eval_seconds=0.01, steps_per_s=100.0, samples_per_s=1e4,
                      tflops=1.0, gbps=1.0, lr=0.01, total_seconds=0.1 * epoch)


def _sweep(out, rng, **kw):
    from test_trainer import synthetic

    grid = Grid((("lr", (0.01, 0.05)), ("momentum", (0.0, 0.9))), seeds=(0, 1))
    return Sweep(grid, Recipe(hidden=32, batch=64), data=synthetic(rng, 640, 100), epochs=2, out=out, **kw)


def test_results_rank_the_models_and_are_written_atomically_after_each(tmp_path, rng):
    sweep = _sweep(tmp_path, rng)
    assert len(sweep.results) == 8 and sweep.epochs_per_model() == 2
    for r in sweep.results[:5]:  # five trained, three not yet
        r.history = [_stats(1, 2, 1.0, 0.5), _stats(2, 2, 0.5, 0.5 + 0.01 * ((r.index * 3) % 5))]
    sweep.write()
    assert [r.index for r in sweep.best(3)] == [3, 1, 4]
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [row["model"] for row in rows] == [str(i) for i in range(8)]
    assert rows[1] == {"model": "1", "lr": "0.01", "momentum": "0.0", "seed": "1", "best_accuracy": "0.5300",
                       "best_epoch": "2", "final_train_loss": "0.500000", "final_accuracy": "0.5300", "checkpoint": ""}
    assert rows[7]["best_accuracy"] == ""
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["sweep"]["grid"] == [["lr", [0.01, 0.05]], ["momentum", [0.0, 0.9]]] and len(doc["models"]) == 8
    assert doc["models"][2]["epochs"][1] == {"epoch": 2, "train_loss": 0.5, "test_accuracy": 0.51, "test_loss": 0.5}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary files left


def _regression_stats(epoch: int, epochs: int, rmse: float) -> EpochStats:
    nan = float("nan")
    return EpochStats(epoch=epoch, epochs=epochs, steps=10, train_loss=rmse ** 2, train_accuracy=nan,
                      test_loss=rmse ** 2, test_accuracy=nan, seconds=0.1, eval_seconds=0.01, steps_per_s=100.0,
                      samples_per_s=1e4, tflops=1.0, gbps=1.0, lr=0.01, total_seconds=0.1 * epoch, test_rmse=rmse,
                      test_mae=rmse / 2, test_r2=1 - rmse)


def test_a_regression_sweep_ranks_by_the_lowest_test_rmse_and_resumes(tmp_path, rng):
    from rawgpu.data.datasets import Dataset

    x = rng.standard_normal((700, 4)).astype(np.float32)
    data = Dataset.from_arrays(x, x @ rng.standard_normal((4, 1)), regression=True)
    grid = Grid((("lr", (0.01, 0.05)),), seeds=(0, 1))
    sweep = Sweep(grid, Recipe(hidden=32, batch=64, loss="mse"), data=data, epochs=2, out=tmp_path)
    rmse = {0: (0.5, 0.3), 1: (0.4, 0.45), 2: (0.9, 0.2)}  # model 1's best is its first epoch
    for i, (a, b) in rmse.items():
        sweep.results[i].history = [_regression_stats(1, 2, a), _regression_stats(2, 2, b)]
    sweep.write()
    assert [r.index for r in sweep.best(3)] == [2, 0, 1] and sweep.results[1].best_epoch == 1
    assert sweep.results[1].best_text() == "RMSE 0.4" and sweep.results[1].regression and np.isnan(sweep.results[1].best_accuracy)
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert rows[1] == {"model": "1", "lr": "0.01", "seed": "1", "best_rmse": "0.4", "best_epoch": "1",
                       "final_train_loss": "0.202500", "final_rmse": "0.45", "final_r2": "0.5500", "checkpoint": ""}
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["models"][2]["best_rmse"] == 0.2 and doc["models"][2]["epochs"][1]["test_r2"] == 0.8
    assert "RMSE" in cli.ranking(sweep, 10) and "best RMSE" in cli.ranking(sweep, 10)
    again = Sweep(grid, Recipe(hidden=32, batch=64, loss="mse"), data=data, epochs=2, out=tmp_path)
    assert again.resume_from(tmp_path) == 3
    assert [r.index for r in again.best(3)] == [2, 0, 1] and again.results[0].history[1].test_rmse == 0.3


def test_a_resumed_sweep_keeps_the_finished_models_and_refuses_another_sweeps_results(tmp_path, rng):
    first = _sweep(tmp_path, rng)
    for r in first.results[:3]:
        r.history = [_stats(1, 2, 1.0, 0.4), _stats(2, 2, 0.5, 0.6)]
    first.results[3].history = [_stats(1, 2, 1.0, 0.4)]  # interrupted inside: it trains again
    first.write()
    again = _sweep(tmp_path, rng)
    assert again.resume_from(tmp_path) == 3
    assert [r.done for r in again.results] == [True] * 3 + [False] * 5
    assert again.results[1].history[1].test_accuracy == 0.6
    other = Sweep(Grid((("lr", (0.01, 0.05)),), seeds=(0, 1)), Recipe(hidden=32, batch=64), data=first.data,
                  epochs=2, out=tmp_path)
    with pytest.raises(ValueError, match="another sweep's"):
        other.resume_from(tmp_path)
    with pytest.raises(ValueError, match="holds no results.json"):
        other.resume_from(tmp_path / "nothing")


def test_a_sweep_of_recipes_shares_one_architecture_and_names_each_model(tmp_path, rng):
    from test_trainer import synthetic

    data = synthetic(rng, 640, 100)
    recipes = [Recipe(hidden=32, batch=64, lr=lr, seed=s) for lr, s in ((0.01, 3), (0.05, 4))]
    sweep = Sweep(recipes, data=data, epochs=1)
    assert [r.describe() for r in sweep.results] == ["model 0, seed 3", "model 1, seed 4"]
    with pytest.raises(ValueError, match="share one architecture and one batch"):
        Sweep(recipes + [Recipe(hidden=64, batch=64)], data=data)
    with pytest.raises(ValueError, match="keep checkpoints in `out`"):
        Sweep(recipes, data=data, save_all=True)
    with pytest.raises(ValueError, match="model 1's weights were not kept"):
        sweep.trainer(1)


def test_the_plot_has_a_panel_per_swept_setting(tmp_path, rng):
    pytest.importorskip("matplotlib")
    sweep = _sweep(tmp_path, rng)
    for r in sweep.results:
        r.history = [_stats(1, 2, 1.0, 0.5 + 0.01 * r.index)]
    sweep.plot(tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit) as exc:
        cli.main(["--lr", "0.1", "--plot", str(tmp_path / "sweep.jpg")])
    assert exc.value.code == 2


def test_the_live_view_ranks_the_trained_models_and_shows_the_one_in_training(tmp_path, rng):
    sweep = _sweep(tmp_path, rng)
    view = cli.LiveView(sweep, top=2)
    try:
        for r in sweep.results[:4]:
            view.start(r)
            r.history = [_stats(1, 2, 1.0, 0.5 + 0.01 * r.index)]
            view.epoch(r, r.history[-1])
            view.model(r)
    finally:
        view.close()
    assert view.now.startswith("model 4/8 done: best test acc 53.00%")
    text = cli.ranking(sweep, 2)
    assert "4 of 8 models by best test accuracy (top 2 and the worst)" in text
    rows = [[cell.strip() for cell in line.split("│")[1:3]] for line in text.splitlines() if "lr 0." in line]
    assert rows == [["1", "4"], ["2", "3"], ["4", "1"]]  # rank, model: the two best and the worst


def test_the_size_line_comes_before_any_gpu_work(tmp_path, capsys, monkeypatch):
    from rawgpu.runtime import driver

    try:
        driver.Device(0)
        pytest.skip("a GPU is here: the GPU tests run the sweep")
    except Exception:  # noqa: BLE001 - no usable GPU, as on CI
        pass
    from test_trainer import synthetic, write_idx

    idx = write_idx(tmp_path / "idx", synthetic(np.random.default_rng(0), 640, 100))
    code = cli.main(["--hidden", "32", "--lr", "0.01", "0.05", "--seeds", "0-3", "--dataset", "idx", "--data-dir",
                     str(idx), "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert out.splitlines()[0].startswith("sweep: 8 models: 2 lr x 4 seeds, 784-32-32-32-10, batch 128, ")
    assert code == 1 and err.startswith("rawgpu: error: ") and len(err.strip().splitlines()) == 1


def test_a_sweep_splits_its_models_into_steps_that_fit_the_gpus_memory(rng):
    from test_trainer import synthetic

    from rawgpu.training.stack_trainer import stack_bytes, stack_recipes

    data = synthetic(rng, 1280, 200)
    sweep = Sweep(Grid((("lr", (0.02, 0.05)),), seeds=(0, 1, 2)), Recipe(hidden=64, batch=64), data=data, epochs=1)
    recipes = stack_recipes(sweep.recipes, data, 1, None)
    one, two = stack_bytes(recipes[:1]), stack_bytes(recipes[:2])
    room_for_two = int((one + 1.5 * (two - one)) / 0.9) + 1
    assert sweep.models_that_fit(room_for_two) == 2
    assert sweep.chunks(list(range(6)), room_for_two) == [[0, 1], [2, 3], [4, 5]]
    sweep.chunk = 4
    with pytest.raises(ValueError, match="at most 2 fit"):
        sweep.chunks(list(range(6)), room_for_two)
    with pytest.raises(ValueError, match="one model needs"):
        sweep.models_that_fit(one // 2)
    sweep.chunk = 5
    assert sweep.chunks(list(range(6))) == [[0, 1, 2, 3, 4], [5]]


# --- GPU -----------------------------------------------------------------------------------------------------------


@gpu
def test_every_model_ends_with_the_bits_it_gets_alone_and_a_resumed_sweep_ends_the_same(device, rng, tmp_path):
    from test_trainer import state_of, synthetic

    from rawgpu.training import checkpoint as ck
    from rawgpu.training.trainer import Trainer

    data = synthetic(rng, 1280, 200)
    grid = Grid((("lr", (0.02, 0.05)),), seeds=(3, 4))
    base = Recipe(hidden=64, batch=64)
    sweep = Sweep(grid, base, data=data, epochs=2, out=tmp_path / "a", save_all=True, together=False)
    sweep.fit()
    for result, recipe in zip(sweep.results, grid.recipes(base)):
        with Trainer(recipe, data=data, epochs=2) as alone:
            alone.fit()
            assert [h.test_accuracy for h in alone.history] == [h.test_accuracy for h in result.history]
            saved = Trainer.load(ck.load(result.checkpoint), data=data)
            assert all(np.array_equal(a, b) for a, b in zip(state_of(alone), state_of(saved)))
            saved.close()
    # an interrupted sweep: its last two models never finished; resumed, it ends as the uninterrupted one
    doc = json.loads((tmp_path / "a" / "results.json").read_text())
    for m in doc["models"][2:]:
        m["epochs"] = m["epochs"][:1]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "results.json").write_text(json.dumps(doc))
    resumed = Sweep(grid, base, data=data, epochs=2, out=tmp_path / "b", together=False)
    assert resumed.resume_from(tmp_path / "b") == 2
    trained = []
    resumed.fit(on_start=lambda r: trained.append(r.index))
    assert trained == [2, 3]
    assert [[h.test_accuracy for h in r.history] for r in resumed.results] == \
        [[h.test_accuracy for h in r.history] for r in sweep.results]
    assert os.path.exists(tmp_path / "b" / "results.csv")
    assert Path(sweep.results[0].checkpoint).parent == tmp_path / "a" / "checkpoints"


@gpu
@pytest.mark.parametrize("task", ["classes", "regression"])
def test_a_tables_models_end_with_the_bits_they_get_alone(device, rng, tmp_path, task):
    """A sweep of a table (float features, standardized; 40 classes, or a regression of 2 values) from the CLI with
    --data an .npz file, ranked in results.csv: a regression's models one by one, each with the metrics Trainer
    gives it alone; the classes' together (the models step), each within 4 of the 200 test rows of its accuracy
    alone (the models step's sums meet in another order)."""
    from rawgpu.data.datasets import Dataset
    from rawgpu.training.trainer import Trainer

    n, f = 1200, 6
    x = rng.standard_normal((n, f)).astype(np.float32) * 5 + 3
    z = x @ rng.standard_normal((f, 2))
    y = z.astype(np.float32) if task == "regression" else (np.abs(z[:, 0]) * 6).astype(np.int64) % 40
    path = tmp_path / "t.npz"
    np.savez(path, x_train=x[:1000], y_train=y[:1000], x_test=x[1000:], y_test=y[1000:])
    loss = ["--loss", "mse"] if task == "regression" else []
    out = tmp_path / "sweep"
    assert cli.main(["--data", str(path), *loss, "--standardize", "--hidden", "32", "--batch", "50", "--lr", "0.01",
                     "0.03", "--seeds", "0", "1", "--epochs", "2", "--out", str(out)]) == 0
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == 4
    data = Dataset.from_tables(path, regression=task == "regression")
    for row in rows:
        recipe = Recipe(hidden=32, batch=50, lr=float(row["lr"]), seed=int(row["seed"]), standardize=True,
                        loss="mse" if task == "regression" else "xent")
        with Trainer(recipe, data=data, epochs=2) as alone:
            alone.fit()
            last = alone.history[-1]
            if task == "regression":
                assert row["final_rmse"] == f"{last.test_rmse:.6g}"
            else:
                assert abs(float(row["final_accuracy"]) - last.test_accuracy) <= 4 / 200


@gpu
def test_models_trained_together_keep_checkpoints_train_evaluate_and_resume_take(device, rng, tmp_path):
    """Trained in one step: each model's checkpoint loads as a model trained alone (its evaluation gives the sweep's
    accuracy, train --resume's Trainer continues it), and a sweep resumed with half its models done ends with the
    uninterrupted one's bits (each model's arithmetic is its own, whoever shares its step)."""
    from test_trainer import synthetic

    from rawgpu.training.trainer import Trainer

    data = synthetic(rng, 1280, 200)
    grid = Grid((("lr", (0.02, 0.05)), ("momentum", (0.9, 0.5))), seeds=(3, 4))
    base = Recipe(hidden=64, batch=64)
    sweep = Sweep(grid, base, data=data, epochs=2, out=tmp_path / "a", save_all=True)
    assert sweep.together_problem() is None
    started = []
    sweep.fit(on_start=lambda r: started.append(r.index))
    assert started == list(range(8))
    for result in sweep.results:
        assert [h.epoch for h in result.history] == [1, 2]
        with Trainer.load(result.checkpoint, data=data) as saved:
            assert saved.done and saved.model.kind != "models"
            # its own evaluation's GEMM tiles: the same logits up to summation order
            assert abs(saved.evaluate().accuracy - result.history[-1].test_accuracy) <= 0.01
    doc = json.loads((tmp_path / "a" / "results.json").read_text())
    for m in doc["models"][4:]:
        m["epochs"] = m["epochs"][:1]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "results.json").write_text(json.dumps(doc))
    resumed = Sweep(grid, base, data=data, epochs=2, out=tmp_path / "b", chunk=3)
    assert resumed.resume_from(tmp_path / "b") == 4
    trained = []
    resumed.fit(on_start=lambda r: trained.append(r.index))
    assert trained == [4, 5, 6, 7]
    assert [[(h.train_loss, h.test_accuracy) for h in r.history] for r in resumed.results] == \
        [[(h.train_loss, h.test_accuracy) for h in r.history] for r in sweep.results]


@gpu
def test_models_spread_over_two_gpus_end_as_on_one(device, rng, tmp_path):
    from test_trainer import synthetic

    from rawgpu.runtime import driver

    if driver.device_count() < 2:
        pytest.skip("needs two GPUs")
    data = synthetic(rng, 1280, 200)
    grid = Grid((("lr", (0.02, 0.05)),), seeds=(3, 4, 5))
    base = Recipe(hidden=64, batch=64)
    one = Sweep(grid, base, data=data, epochs=2).fit()
    two = Sweep(grid, base, data=data, epochs=2, out=tmp_path, save_best=2)
    finished = []
    two.fit(on_model=lambda r: finished.append(r.index), gpus=2)
    assert sorted(finished) == list(range(6))
    assert [[h.test_accuracy for h in r.history] for r in two.results] == \
        [[h.test_accuracy for h in r.history] for r in one]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == sorted(
        f"model-{r.index}.safetensors" for r in two.best(2))


@gpu
@pytest.mark.parametrize("sig,how", [("SIGINT", "--one-at-a-time"), ("SIGTERM", "--chunk=2")])
def test_a_signal_keeps_the_finished_models_and_resume_ends_as_the_uninterrupted_sweep(device, rng, tmp_path, sig,
                                                                                       how):
    """The CLI stopped after its first model (one at a time) or its first step of two (two at a time): exit 130/143,
    one line saying how to continue, the finished models in results.json; `--resume DIR` then trains the rest and
    ends with the uninterrupted sweep's results."""
    import signal

    from gpu_checks import interrupt_train
    from test_trainer import synthetic, write_idx

    idx = write_idx(tmp_path / "idx", synthetic(rng, 1280, 200))
    args = ["--hidden", "64", "--batch", "64", "--lr", "0.02", "0.05", "--seeds", "0-1", "--epochs", "2",
            "--dataset", "idx", "--data-dir", str(idx), how]
    root = Path(__file__).resolve().parent.parent
    command = [sys.executable, "-m", "rawgpu.sweep"]
    code, _, err, _ = interrupt_train(args + ["--out", str(tmp_path / "cut")], "model 1/4", root,
                                      getattr(signal, sig), command)
    assert code == (130 if sig == "SIGINT" else 143), err
    assert err.strip().splitlines()[-1].startswith("rawgpu: interrupted after") and "--resume" in err
    saved = json.loads((tmp_path / "cut" / "results.json").read_text())["models"]
    assert 1 <= sum(len(m["epochs"]) == 2 for m in saved) < 4
    resumed = subprocess.run(command + args + ["--resume", str(tmp_path / "cut")], cwd=root, capture_output=True,
                             text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert resumed.returncode == 0 and "resumed: " in resumed.stdout, resumed.stderr
    whole = subprocess.run(command + args + ["--out", str(tmp_path / "whole")], cwd=root, capture_output=True,
                           text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert whole.returncode == 0, whole.stderr
    cells = lambda folder: [row[:6] for row in csv.reader((tmp_path / folder / "results.csv").open())]  # noqa: E731
    assert cells("cut") == cells("whole")


@pytest.mark.parametrize("stop,status", [(KeyboardInterrupt, 130), ("terminated", 143)])
def test_ctrl_c_or_sigterm_during_the_set_up_is_one_line_not_a_traceback(monkeypatch, capsys, stop, status):
    from rawgpu.runtime import errors
    from rawgpu.cli import sweep

    def interrupted(*args):
        raise errors.Terminated() if stop == "terminated" else KeyboardInterrupt()

    monkeypatch.setattr(sweep, "check_data_options", interrupted)  # while the data is being looked for
    assert sweep.main(["--lr", "0.1"]) == status
    assert capsys.readouterr().err == "rawgpu: interrupted before the sweep started\n"
