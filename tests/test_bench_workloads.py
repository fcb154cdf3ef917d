"""CPU tests of `bench.py train --workload` (scripts/benchmarks/tables.py) and of the peers' tables
(scripts/peers/common.py): the options and what each workload sets, the batch order over N rows, the peers' Workload
of a table, the preprocessing rawgpu and the peers share, the targets, and the command's table and JSON with the GPU
work stood in for."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

import bench  # scripts/bench.py
from benchmarks import tables
from benchmarks.training import HIDDEN
from benchmarks.workloads import WORKLOADS
from peers import jax_peers, torch_peers
from peers.common import TRAIN_ROWS, Workload, features, step_indices
from rawgpu.model.mlp import MLP, feature_scaling, kept_features, target_scaling


def small(name: str, rows: int = 4000, args=("--workload", "all")):
    """A workload's table of `rows` rows, its recipe at its first width, and the scalings every system trains with."""
    w = WORKLOADS[name]
    data = tables.load(w, 0, rows)
    sizes, _, recipe = tables.settings(bench.parse_args(list(args)), w)
    rr = tables.table_recipe(sizes[0], recipe, 100, 0, w, data)
    return w, data, rr, tables.scalings(data, rr)


# --- the options ------------------------------------------------------------------------------------------------

def test_workload_takes_its_widths_recipe_batch_and_2000_steps():
    args = bench.parse_args(["train", "--workload", "covertype-like"])
    assert (args.workload, args.steps, args.recipe, args.sizes) == ("covertype-like", 2000, None, None)
    got = {n: tables.settings(args, w) for n, w in WORKLOADS.items()}
    assert {n: (sizes, name, r["batch"], r["optimizer"]) for n, (sizes, name, r) in got.items()} == {
        "covertype-like": ([256, 1024], "default", 128, "sgd"), "higgs-like": ([512], "default", 1024, "sgd"),
        "embeddings": ([1024], "adam", 128, "adam"), "cifar100-like": ([1024], "default", 128, "sgd"),
        "regression": ([256], "default", 128, "sgd")}
    assert all("steps" not in r and "epochs" not in r and r["activation"] == "relu" for _, _, r in got.values())
    assert tables.selected("all") == list(WORKLOADS.values()) and tables.selected("higgs-like") == [WORKLOADS["higgs-like"]]


def test_given_options_beat_the_workloads():
    args = bench.parse_args(["--workload", "higgs-like", "--sizes", "64", "128", "--recipe", "adam", "--batch", "256",
                             "--steps", "30", "--activation", "gelu"])
    sizes, name, r = tables.settings(args, WORKLOADS["higgs-like"])
    assert (sizes, name, r["batch"], r["optimizer"], r["activation"], args.steps) == ([64, 128], "adam", 256, "adam",
                                                                                      "gelu", 30)
    args = bench.parse_args(["--workload", "embeddings", "--hidden", "512", "256", "--optimizer", "sgd"])
    sizes, name, r = tables.settings(args, WORKLOADS["embeddings"])
    assert sizes == [(512, 256)] and name == "adam" and r["optimizer"] == "sgd" and r["lr"] == 0.05
    assert tables.settings(bench.parse_args(["--workload", "regression", "--hidden", "64"]),
                           WORKLOADS["regression"])[0] == [64]
    quick = bench.parse_args(["--workload", "all", "--quick"])
    assert quick.steps == 1000 and quick.sizes is None and quick.peers == ["torch-graph", "jax-fori"]


@pytest.mark.parametrize("argv, message", [
    (["--workload", "mnist"], "invalid choice: 'mnist'"),
    (["--workload", "regression", "--gpus", "2"], "argument --workload: --gpus times MNIST only"),
    (["--workload", "regression", "--rawgpu-variants", "fused"], "--rawgpu-variants times MNIST only"),
    (["--workload", "all", "--batch", "50000"], "argument --batch: at most the 45000 training rows of --workload all"),
])
def test_bad_workload_options_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_mnist_runs_keep_their_defaults():
    args = bench.parse_args([])
    assert (args.cmd, args.workload, args.recipe, args.sizes, args.steps) == ("train", None, "seed", list(HIDDEN), 5000)
    assert args.train_recipe == dict(batch=32, optimizer="sgd", lr=0.003, momentum=0.0, schedule="constant",
                                     activation="relu")
    args = bench.parse_args(["--recipe", "default", "--batch", "60000"])
    assert args.steps == 8 and args.train_recipe["batch"] == 60000
    assert bench.parse_args(["--quick"]).sizes == [256, 4096]


# --- the batch order and the peers' Workload -----------------------------------------------------------------------

def test_step_indices_over_n_rows():
    np.testing.assert_array_equal(step_indices(4000, 32, 5, rows=TRAIN_ROWS), step_indices(4000, 32, 5))
    rows, batch = 1003, 100  # 10 steps an epoch, 3 rows left out of each
    idx = step_indices(25, batch, 2, rows=rows)
    rng = np.random.default_rng(2)
    want = np.concatenate([rng.permutation(rows)[:1000] for _ in range(3)])[:2500]
    np.testing.assert_array_equal(idx, want)  # timed_run's epochs: rng.permutation(recipe.train_rows)
    assert idx.dtype == np.int32 and len(np.unique(idx[:1000])) == 1000
    with pytest.raises(ValueError, match="batch must be in 1..1003"):
        step_indices(1, 1004, rows=1003)
    with pytest.raises(ValueError, match="rows must be >= 1"):
        step_indices(1, 1, rows=0)


def test_the_peers_workload_takes_a_table():
    w = Workload(hidden=512, batch=1024, inputs=28, classes=2, train_rows=10_900_000)
    assert w.widths == (28, 512, 512, 512, 2) and not w.regression and w.target_scale == 1.0
    r = Workload(hidden=(64, 32), inputs=8, classes=1, train_rows=900, loss="mse",
                 scaling=(np.zeros(8), np.ones(8)), target_scaling=(np.array([2.0]), 4.0))
    assert r.widths == (8, 64, 32, 1) and r.regression and r.target_scale == 4.0
    assert all(a.dtype == np.float32 and a.shape == (8,) for a in r.scaling)
    np.testing.assert_array_equal(r.targets(np.array([[2.0], [10.0]], np.float32)), [[0.0], [2.0]])
    assert r.targets(np.array([6.0])).shape == (1, 1)
    labels = np.array([1, 0], np.int32)
    assert w.targets(labels) is labels
    assert Workload(hidden=256).widths == (784, 256, 256, 256, 10)  # MNIST's, as before


@pytest.mark.parametrize("fields, message", [
    ({"loss": "l1"}, "Workload.loss must be one of xent, mse, got 'l1'"),
    ({"classes": 1}, "Workload.classes must be >= 2, got 1"),
    ({"classes": 0, "loss": "mse"}, "Workload.classes must be >= 1, got 0"),
    ({"inputs": 0}, "Workload.inputs must be >= 1, got 0"),
    ({"train_rows": 100}, "Workload.batch must be <= 100, got 128"),
    ({"scaling": (np.zeros(7), np.ones(8))}, r"Workload.scaling must be \(mean, inv_std\) of 8 finite values each"),
    ({"scaling": (np.zeros(8), np.full(8, np.inf))}, "of 8 finite values"),
    ({"scaling": (np.zeros(8),)}, "Workload.scaling must be"),
    ({"target_scaling": (np.zeros(1), 1.0)}, "target_scaling is a regression's"),
    ({"loss": "mse", "classes": 1, "target_scaling": (np.zeros(2), 1.0)}, "mean of 1 values, scale > 0"),
    ({"loss": "mse", "classes": 1, "target_scaling": (np.zeros(1), 0.0)}, "scale > 0"),
    ({"loss": "mse", "classes": 1, "target_scaling": (np.zeros(1),)}, "target_scaling must be"),
])
def test_the_peers_workload_refuses_a_bad_table_in_one_line(fields, message):
    with pytest.raises(ValueError, match=message) as exc:
        Workload(**{"hidden": 16, "batch": 128, "inputs": 8, "classes": 3, "train_rows": 1000, **fields})
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("module", [torch_peers, jax_peers], ids=["torch", "jax"])
def test_a_peer_refuses_data_not_of_its_workload_before_any_gpu_work(module):
    w = Workload(hidden=16, batch=8, inputs=4, classes=3, train_rows=50)
    good = (np.zeros((50, 4), np.float32), np.zeros(50, np.int32), np.zeros((5, 4), np.float32), np.zeros(5, np.int32))
    w.check_data(good)
    for bad, what in [((np.zeros((49, 4), np.float32), *good[1:]), "features are (49, 4)"),
                      ((good[0], good[1], np.zeros((5, 3), np.float32), good[3]), "wants 50 training rows of 4"),
                      ((*good[:3], np.zeros(6, np.int32)), "targets are (50,) and (6,)"),
                      ((good[0], np.zeros((50, 2), np.float32), *good[2:]), "a label per row")]:
        with pytest.raises(ValueError, match=what.replace("(", r"\(").replace(")", r"\)")):
            module.run(module.SYSTEMS[0], w, bad)
    r = Workload(hidden=16, batch=8, inputs=4, classes=2, train_rows=50, loss="mse")
    with pytest.raises(ValueError, match="2 value"):
        r.check_data((good[0], np.zeros(50, np.float32), good[2], np.zeros((5, 2), np.float32)))
    Workload(hidden=16, batch=8, inputs=4, classes=1, train_rows=50, loss="mse").check_data(
        (good[0], np.zeros(50, np.float32), good[2], np.zeros((5, 1), np.float32)))


# --- the preprocessing rawgpu and the peers share ---------------------------------------------------------------------

@pytest.mark.parametrize("name", list(WORKLOADS))
def test_the_peers_standardize_as_rawgpu(name):
    """The scalings are rawgpu's feature_scaling of the features as its model keeps them (MLP.device_features of the
    same recipe, planned without a GPU) and target_scaling; the peers' per-batch features are rawgpu's gather's."""
    w, data, rr, (feat, targ) = small(name)
    assert rr.standardize == (w.dtype == "float32") and rr.regression == (w.loss == "mse")
    assert rr.input_dtype == ("u8" if w.dtype == "uint8" else "fp16")
    assert (rr.inputs, rr.classes, rr.train_rows, rr.test_rows) == (w.features, w.classes or w.outputs, 3600, 400)
    model = MLP(rr)  # the plan only: device_features and device_targets need no GPU
    kept = model.device_features(data.train_images, "training")
    np.testing.assert_array_equal(kept_features(data.train_images, rr.input_dtype, "training"), kept)
    if rr.standardize:
        for got, want in zip(feat, feature_scaling(kept)):
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, want)
    else:
        assert feat is None
    pw = tables.peer_workload(rr, 100, None, (feat, targ))
    x = data.train_images[:64]
    v = x.astype(np.float64) / 255.0 if x.dtype == np.uint8 else x.astype(np.float64)  # the gather, float64
    if feat is not None:
        v = (v - feat[0]) * feat[1]
    got = features(np, x, pw.scaling)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, v, rtol=1e-5, atol=1e-5)
    if feat is not None:  # the standardized training features: mean 0, std 1 (up to fp16's rounding)
        all_x = features(np, data.train_images, pw.scaling).astype(np.float64)
        np.testing.assert_allclose(all_x.mean(axis=0), 0, atol=2e-3)
        np.testing.assert_allclose(all_x.std(axis=0), 1, atol=2e-3)
    if rr.regression:
        assert targ == target_scaling(data.train_labels) and pw.target_scaling[1] == targ[1]
        model.set_target_scaling(*targ)
        np.testing.assert_array_equal(pw.targets(data.train_labels), model.device_targets(data.train_labels, 3600))
        t = pw.targets(data.train_labels).astype(np.float64)
        assert abs(t.mean()) < 1e-6 and abs(t.std() - 1) < 1e-5
    else:
        assert targ is None and pw.target_scaling is None


def test_the_peers_train_the_recipe_rawgpu_trains():
    _, _, rr, scaling = small("embeddings")
    pw = tables.peer_workload(rr, 300, [("w", "b")], scaling)
    assert pw.widths == tuple(rr.widths) == (768, 1024, 1024, 1024, 1000)
    assert (pw.batch, pw.lr, pw.optimizer, pw.betas, pw.eps, pw.schedule, pw.steps, pw.seed, pw.loss) == (
        rr.batch, rr.lr, "adam", (rr.beta1, rr.beta2), rr.eps, "cosine", 300, 0, "xent")
    assert pw.train_rows == 3600 and pw.init == [("w", "b")] and pw.scaling is None
    _, _, rr, scaling = small("regression", args=("--workload", "regression", "--hidden", "64", "32"))
    pw = tables.peer_workload(rr, 50, None, scaling)
    assert pw.widths == (8, 64, 32, 1) and pw.loss == "mse" and pw.momentum == 0.9 and pw.target_scale == scaling[1][1]


# --- the targets --------------------------------------------------------------------------------------------------

def test_the_targets_compare_with_the_fastest_and_the_best_peer():
    ours = dict(us_per_step=100.0, test_accuracy=0.950)
    peers = [dict(system="torch-graph", us_per_step=140.0, test_accuracy=0.951),
             dict(system="jax-fori", us_per_step=131.0, test_accuracy=0.9505),
             dict(system="torch-eager", us_per_step=None, test_accuracy=None)]
    t = tables.targets(ours, peers, regression=False)
    assert t["fastest_peer"] == "jax-fori" and t["speedup"] == pytest.approx(1.31) and t["speedup_met"]
    assert t["best_peer_quality"] == 0.951 and t["quality_met"] and t["passed"]
    assert tables.verdict(t).startswith("PASS: 1.31x over jax-fori")
    t = tables.targets(dict(ours, test_accuracy=0.948), peers, regression=False)
    assert not t["quality_met"] and not t["passed"] and tables.verdict(t).startswith("FAIL")
    t = tables.targets(dict(ours, us_per_step=110.0), peers, regression=False)
    assert not t["speedup_met"] and t["quality_met"] and not t["passed"]
    assert tables.targets(ours, peers[2:], regression=False) is None
    assert tables.verdict(None) == "n/a (no peer ran)"
    reg = [dict(system="a", us_per_step=200.0, test_rmse=0.50), dict(system="b", us_per_step=150.0, test_rmse=math.nan)]
    assert tables.targets(dict(us_per_step=100.0, test_rmse=0.505), reg, regression=True)["passed"]
    t = tables.targets(dict(us_per_step=100.0, test_rmse=0.506), reg, regression=True)
    assert t["best_peer_quality"] == 0.50 and not t["quality_met"] and "RMSE 0.5060 vs best peer 0.5000" in tables.verdict(t)
    assert not tables.targets(dict(us_per_step=100.0, test_rmse=math.nan), reg, regression=True)["passed"]


# --- the command, its GPU work stood in for --------------------------------------------------------------------------

class FakeDevice:
    name, arch, sm_count = "Fake GPU", "sm_90", 132

    def __init__(self, index):
        pass

    def make_current(self):
        pass


def test_the_command_prints_each_row_and_writes_the_json(monkeypatch, tmp_path, capsys):
    load, calls = tables.load, []
    monkeypatch.setattr(bench, "drv", SimpleNamespace(Device=FakeDevice, driver_version=lambda: (12, 8)))
    monkeypatch.setattr(bench, "available_peers", lambda wanted: (["torch-graph", "jax-fori"], {"torch-eager": "no"}))
    monkeypatch.setattr(tables, "load", lambda w, seed, rows=None: load(w, seed, 3000))

    def rawgpu(recipe, steps, data, device_index, scaling, steps_per_launch):
        calls.append(("rawgpu", recipe.name, steps, scaling))
        quality = dict(test_accuracy=None, test_rmse=0.5) if recipe.regression else dict(test_accuracy=0.9,
                                                                                         test_rmse=None)
        return dict(system="rawgpu", us_per_step=100.0, **quality, init=["init"], note="")

    def peer(system, recipe, steps, data, init, scaling):
        calls.append((system, recipe.name, init, scaling))
        if system == "jax-fori":
            raise RuntimeError("XLA says\n  out of memory")
        quality = dict(test_accuracy=None, test_rmse=0.499) if recipe.regression else dict(test_accuracy=0.91,
                                                                                           test_rmse=None)
        return dict(system=system, us_per_step=150.0, **quality, final_loss=0.1, note="torch")

    monkeypatch.setattr(tables, "bench_rawgpu", rawgpu)
    monkeypatch.setattr(tables, "run_peer", peer)
    assert bench.main(["--workload", "all", "--steps", "7", "--out", str(tmp_path), "--sizes", "32"]) == 0
    out = capsys.readouterr().out
    assert "# peer torch-eager skipped: no" in out and "# Fake GPU (sm_90, 132 SMs), driver CUDA 12.8" in out
    assert "# regression: 2700 + 300 rows of 8 float32 features, 1 value" in out
    assert "   32         rawgpu     100.0     10000    1280000        1.50x    0.5000" in out  # batch 128
    assert "   32    torch-graph     150.0      6667     853333 1.50x slower    0.4990" in out
    assert "   32       jax-fori    failed         -          -            -         -  failed: RuntimeError: XLA says " \
           "out of memory" in out
    assert "#   regression H=32: PASS: 1.50x over torch-graph (>= 1.3x); RMSE 0.5000 vs best peer 0.4990" in out
    assert "#   covertype-like H=32: FAIL: 1.50x over torch-graph (>= 1.3x); accuracy 90.00% vs best peer 91.00%" in out
    assert "   32         rawgpu     100.0     10000   10240000        1.50x    90.00%" in out  # higgs-like: batch 1024
    assert [c[1] for c in calls if c[0] == "rawgpu"] == ["54-32-32-32-7", "28-32-32-32-2", "768-32-32-32-1000",
                                                         "3072-32-32-32-100", "8-32-32-32-1"]
    assert all(c[2] == ["init"] for c in calls if c[0] != "rawgpu") and all(c[2] == 7 for c in calls if c[0] == "rawgpu")
    scaled = {c[1]: c[3] for c in calls if c[0] == "rawgpu"}
    assert scaled["768-32-32-32-1000"] == (None, None) and scaled["54-32-32-32-7"][1] is None
    assert scaled["8-32-32-32-1"][0][0].shape == (8,) and scaled["8-32-32-32-1"][1][1] > 0
    results = json.loads((tmp_path / "bench_workload.json").read_text())
    assert (results["device"], results["steps"], len(results["workloads"])) == ("Fake GPU", 7, 5)
    reg = results["workloads"][-1]
    assert (reg["name"], reg["loss"], reg["standardize"], reg["input_dtype"], reg["batch"]) == ("regression", "mse", True,
                                                                                             "fp16", 128)
    row = reg["rows"][0]
    assert row["hidden"] == 32 and row["speedup"] == 1.5 and row["targets"]["passed"] is True
    assert [s["system"] for s in row["systems"]] == ["rawgpu", "torch-graph", "jax-fori"]
    assert row["systems"][0]["samples_per_s"] == 1280000.0 and "init" not in row["systems"][0]
    assert row["systems"][2]["note"].startswith("failed: RuntimeError: XLA says out of memory")
