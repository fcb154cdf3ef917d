"""Your own data on the GPU: float, half and byte features (standardized or not), 5 to 1000 classes and regression
(mse, l1, huber; 1 to 3 outputs) trained by the layered step, every step against the float64 reference
(tests/mlp_reference.py, the bounds of tests/test_mlp.py's docstring), the evaluation's metrics against a numpy
forward of the GPU's own parameters; a model trained from arrays equals the one trained from the same images as IDX,
bit for bit; a resumed run equals the uninterrupted one, bit for bit; the CLI end to end on a CSV file.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mlp_reference as ref
from rawgpu.data.datasets import Dataset
from rawgpu.kernels import Kernels
from rawgpu.model.mlp import feature_scaling
from rawgpu.model.recipe import Recipe, loss_scale
from rawgpu.steps import StepOptions, plan_model
from rawgpu.training.trainer import Trainer, fit_to_data

gpu = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent
STEP_TOLERANCE = 3e-2  # tests/test_mlp.py's, fp32 accumulation: one step from the GPU's own parameters
TRAJECTORY_TOLERANCE = 5e-2  # ten steps from the shared init
ADAM_ARITHMETIC = ref.ADAM_ARITHMETIC
METRIC_TOLERANCE = 2e-3  # the evaluation's sums against numpy on the same fp16 outputs: summation order only


def fake_table(rng, rows: int, features: int, dtype: str, classes: int = 0, outputs: int = 1,
               test_rows: int = 700) -> Dataset:
    """Random features with their own scale and offset per column (what standardization is for) and targets a
    linear teacher gives them: class labels (classes > 0) or values."""
    n = rows + test_rows
    if dtype == "uint8":
        x = rng.integers(0, 256, (n, features), dtype=np.uint8)
        z = (x - 127.5) / 74.0
    else:
        z = rng.standard_normal((n, features))
        x = (z * rng.uniform(0.5, 4.0, features) + rng.normal(0.0, 2.0, features)).astype(dtype)
    teacher = rng.standard_normal((features, max(classes, outputs))) / math.sqrt(features)
    if classes:
        y = (z @ teacher + 0.3 * rng.standard_normal((n, classes))).argmax(1)
        return Dataset.from_arrays(x[:rows], y[:rows], x[rows:], y[rows:], classes=classes)
    y = (np.tanh(z @ teacher) * 3.0 + 1.0).astype(np.float32)
    return Dataset.from_arrays(x[:rows], y[:rows], x[rows:], y[rows:], regression=True)


def gathered(model, x: np.ndarray) -> np.ndarray:
    """What the table gather writes for rows x as the device keeps them: bytes / 255 in fp32, the standardization
    (v - mean) * inv_std in fp32, then fp16."""
    kept = model.device_features(x, "x")  # bytes kept as fp16 or fp32 are already / 255
    f = kept.astype(np.float32) * (np.float32(1.0 / 255.0) if kept.dtype == np.uint8 else np.float32(1.0))
    if model.mean is not None:
        mean, inv = model.scaling()
        f = (f - mean) * inv
    return f.astype(np.float16)


MOMENTUM, PLAIN = dict(momentum=0.9), dict(momentum=0.0)
# 3000 raw bytes into 100 classes at batch 33 train at lr 0.002: at lr 0.05 that model's own ten steps amplify a
# gradient's rounding into the trajectory far more than the other cases' do, so the trajectory would measure the
# data, not the kernels (docs/design.md; dev/trajectory_gain.py: the float64 reference against itself).
SLOW_MOMENTUM = dict(momentum=0.9, lr=0.002)
ADAM, ADAMW = dict(optimizer="adam", lr=1e-3), dict(optimizer="adamw", lr=2e-3, weight_decay=0.05)
CASES = [  # hidden, batch, optimiser, features (count, dtype, input_dtype, standardize), task, short form
    (256, 128, MOMENTUM, (54, "float32", "fp16", True), dict(classes=7), True),
    (128, 32, PLAIN, (13, "float32", "fp32", False), dict(classes=5), True),
    (512, 64, ADAM, (100, "uint8", "u8", True), dict(classes=300), True),
    (256, 128, MOMENTUM, (8, "float32", "fp16", True), dict(loss="mse", outputs=1), True),
    (256, 256, ADAMW, (20, "float32", "fp32", False), dict(loss="huber", outputs=3), True),
    (128, 64, MOMENTUM, (16, "float16", "fp16", True), dict(loss="l1", outputs=2), False),
    (1024, 128, ADAM, (768, "float16", "fp16", False), dict(classes=1000), True),
    (256, 512, MOMENTUM, (28, "float32", "fp16", True), dict(classes=2), True),
    (256, 512, MOMENTUM, (8, "float32", "fp32", True), dict(loss="mse", outputs=1), True),
    (100, 33, SLOW_MOMENTUM, (3000, "uint8", "fp16", False), dict(classes=100), False),
]


@pytest.fixture(scope="module")
def kernels(device):
    return Kernels(device.arch)


@gpu
@pytest.mark.parametrize("hidden,batch,opt,feat,task,short", CASES)
def test_table_steps_match_float64_reference(device, stream, kernels, rng, hidden, batch, opt, feat, task, short):
    features, dtype, input_dtype, standardize = feat
    loss = task.get("loss", "xent")
    data = fake_table(rng, 4096, features, dtype, classes=task.get("classes", 0), outputs=task.get("outputs", 1))
    recipe = fit_to_data(Recipe(hidden=hidden, layers=2, batch=batch, **{"lr": 0.05, **opt}, schedule="constant",
                                loss=loss, input_dtype=input_dtype, standardize=standardize,
                                seed=int(rng.integers(1 << 30))), data)
    model = plan_model(recipe, "layered", kernels=kernels, sm_count=device.sm_count,
                       options=StepOptions(short=short)).allocate()
    try:
        model.upload_data(data)
        if standardize:
            model.set_scaling(*feature_scaling(model.device_features(data.train_images, "x")))
        model.init_parameters(stream)
        perm = rng.permutation(recipe.train_rows).astype(np.int32)
        model.set_permutation(perm)
        step, scale, adam = model.step_launches(), loss_scale(batch), recipe.optimizer != "sgd"
        init = trajectory = model.parameters()
        trajectory_state = None
        for s in range(10):
            before, state_before = model.parameters(), model.optimizer_state()
            for launch in step:
                launch.run(stream)
            after, state_after = model.parameters(), model.optimizer_state()
            at = s % recipe.steps_per_epoch  # the epoch's order starts again after its last step
            rows = perm[at * batch:(at + 1) * batch]
            x, y = gathered(model, data.train_images[rows]), data.train_labels[rows]
            _, _, grads = ref.loss_and_grads(before, x, y, fp16_storage=True, grad_scale=scale, loss=loss)
            expect, expect_state = ref.optimizer_step(before, grads, recipe, recipe.lr, state_before, s)
            errors, applied = ref.step_errors(before, after, state_before, state_after, expect, expect_state, recipe,
                                              recipe.lr, s)
            if applied is not None:  # Adam: the weights' change as its moments make it (module docstring)
                assert max(applied) <= ADAM_ARITHMETIC, (f"step {s}: weight change vs its moments: {applied}; "
                                                         + ref.applied_detail(before, after, state_after, recipe, s))
            assert max(errors) <= STEP_TOLERANCE, f"step {s}, per layer: {errors}"
            trajectory, trajectory_state = ref.optimizer_step(trajectory, ref.loss_and_grads(
                trajectory, x, y, fp16_storage=True, grad_scale=scale, loss=loss)[2], recipe, recipe.lr,
                trajectory_state, s)
        if not adam:
            errors = ref.update_errors(model.parameters(), trajectory, init)
            assert max(errors) <= TRAJECTORY_TOLERANCE, f"10-step trajectory, per layer: {errors}"
        assert model.step_count() == 10 and model.padding_is_zero()
        # the training metrics of the 10 steps, and the evaluation against numpy on the GPU's own parameters
        sums = model.train_metrics()
        assert all(math.isfinite(v) for v in sums)
        for launch in model.eval_launches():
            launch.run(stream)
        stream.synchronize()
        params = model.parameters()
        out = ref.forward(params, gathered(model, data.test_images), fp16_storage=True)[-1]
        test_loss, accuracy = model.eval_metrics()
        n = recipe.test_rows
        if loss == "xent":
            labels = data.test_labels.astype(np.int64)
            shifted = out - out.max(axis=1, keepdims=True)
            expect_loss = float(-(shifted - np.log(np.exp(shifted).sum(1, keepdims=True)))[np.arange(n), labels].mean())
            assert abs(accuracy - float((out.argmax(1) == labels).mean())) <= 2 / n  # ties rounded otherwise
        else:
            got_loss_sum, sq, ab = ref.regression_metrics(out, data.test_labels, loss)
            expect_loss = got_loss_sum / n
            rmse, mae, r2 = model.eval_errors()
            values = n * recipe.classes
            assert math.isnan(accuracy)
            assert abs(rmse - math.sqrt(sq / values)) <= METRIC_TOLERANCE * math.sqrt(sq / values)
            assert abs(mae - ab / values) <= METRIC_TOLERANCE * ab / values
            y = data.test_labels.astype(np.float64)
            assert abs(r2 - (1 - sq / ((y - y.mean(0)) ** 2).sum())) <= 1e-3
        assert abs(test_loss - expect_loss) <= METRIC_TOLERANCE * max(1.0, abs(expect_loss))
    finally:
        model.arena.close()


@gpu
@pytest.mark.parametrize("how", ["bytes", "fp32 table", "fp16 table"])
def test_a_model_trained_from_arrays_equals_the_one_from_idx_bit_for_bit(device, mnist, how):
    """The same images through from_arrays: as bytes (gather_batch), and as the floats v / 255 the pixel gather
    computes (the table gather of fp32 and of fp16 features): the same parameters and metrics, bit for bit."""
    recipe = Recipe(hidden=128, layers=2, seed=3)
    x, xt = mnist.train_images, mnist.test_images
    if how != "bytes":
        dtype = np.float32 if how.startswith("fp32") else np.float16
        x, xt = ((a * np.float32(1.0 / 255.0)).astype(dtype) for a in (x, xt))
        recipe = Recipe(hidden=128, layers=2, seed=3, input_dtype=how[:4])
    arrays = Dataset.from_arrays(x, mnist.train_labels, xt, mnist.test_labels)
    with Trainer(Recipe(hidden=128, layers=2, seed=3), data=mnist, steps=300, step="layered") as idx, \
            Trainer(recipe, data=arrays, steps=300, step="layered") as own:
        assert own.recipe._pixels == (how == "bytes")
        a, b = idx.fit(), own.fit()
        for (w1, b1), (w2, b2) in zip(idx.parameters(), own.parameters()):
            assert np.array_equal(w1, w2) and np.array_equal(b1, b2)
        assert [(h.train_loss, h.test_accuracy) for h in a] == [(h.train_loss, h.test_accuracy) for h in b]


@gpu
@pytest.mark.parametrize("task", [dict(classes=7), dict(loss="mse")])
def test_a_resumed_table_run_ends_bit_identical(device, rng, tmp_path, task):
    """Standardized fp16 features: a run saved inside its second epoch and resumed ends with the uninterrupted run's
    parameters and history; the checkpoint keeps the scaling and the columns."""
    data = fake_table(rng, 6000, 12, "float32", classes=task.get("classes", 0))
    data = Dataset.from_arrays(data.train_images, data.train_labels, data.test_images, data.test_labels,
                               regression=data.regression, features=[f"f{j}" for j in range(12)])
    recipe = Recipe(hidden=64, layers=2, batch=100, standardize=True, loss=task.get("loss", "xent"), seed=5)
    with Trainer(recipe, data=data, epochs=3) as whole:
        history = whole.fit()
        expect = whole.parameters()
    path = tmp_path / "run.safetensors"
    with Trainer(recipe, data=data, epochs=3) as first:
        first.fit(stop_at=90, save_to=path)
    with Trainer.load(path, data=data) as resumed:
        assert resumed.steps_done == 90
        assert resumed.model.scaling() is not None
        again = resumed.fit()
        for (w1, b1), (w2, b2) in zip(expect, resumed.parameters()):
            assert np.array_equal(w1, w2) and np.array_equal(b1, b2)
        assert [h.train_loss for h in again] == [h.train_loss for h in history]
        assert [h.test_loss for h in again] == [h.test_loss for h in history]
        if data.regression:
            assert all(h.test_rmse is not None and h.test_r2 is not None for h in again)
    from rawgpu.training.checkpoint import load

    ckpt = load(path)
    assert ckpt.dataset["columns"]["features"] == [f"f{j}" for j in range(12)]
    assert ckpt.scaling is not None and ckpt.recipe.standardize


@gpu
def test_regression_and_1000_classes_learn(device):
    """The benchmark's workloads, fewer rows: a regression reaches R^2 > 0.9, 1000 classes of embeddings far above
    chance (0.1%)."""
    from benchmarks.workloads import WORKLOADS, generate

    x, y, xt, yt = generate(WORKLOADS["regression"], rows=200_000)
    with Trainer(Recipe(hidden=256, layers=3, loss="mse", standardize=True), data=(x, y, xt, yt), epochs=3) as t:
        last = t.fit()[-1]
        assert last.test_r2 > 0.9, last
        result = t.evaluate()
        assert result.rmse == pytest.approx(last.test_rmse) and result.confusion is None
        values = t.predict(xt[:1000])
        assert values.shape == (1000, 1)
        assert np.sqrt(((values - yt[:1000]) ** 2).mean()) == pytest.approx(last.test_rmse, rel=0.2)
    data = Dataset.from_arrays(*generate(WORKLOADS["embeddings"], rows=100_000), classes=1000)
    with Trainer(Recipe(hidden=1024, layers=2, optimizer="adam"), data=data, epochs=3) as t:
        last = t.fit()[-1]
        assert t.recipe.classes == 1000 and last.test_accuracy > 0.05, last
        p = t.predict(data.test_images[:64])
        assert p.shape == (64, 1000) and np.allclose(p.sum(1), 1.0)


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", f"rawgpu.{module}", *args], capture_output=True, text=True, env=env,
                          timeout=600)


@gpu
def test_the_cli_trains_evaluates_and_predicts_a_csv_file(device, rng, tmp_path):
    """train --data FILE.csv --target --standardize, evaluate --data, predict FILE --out: the evaluation's accuracy is
    the predictions' own, row for row."""
    pytest.importorskip("pyarrow")
    n, f = 12000, 6
    z = rng.standard_normal((n, f))
    label = (z @ rng.standard_normal((f, 3))).argmax(1)
    x = z * rng.uniform(1, 50, f) + rng.uniform(-100, 100, f)

    def write(path: Path, rows: slice) -> None:
        with open(path, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["kind", *(f"x{j}" for j in range(f))])
            w.writerows([int(label[i]), *(f"{v:.6g}" for v in x[i])] for i in range(n)[rows])

    write(tmp_path / "train.csv", slice(0, 10000))
    write(tmp_path / "test.csv", slice(10000, n))
    ckpt = tmp_path / "model.safetensors"
    run = _run("train", "--data", str(tmp_path / "train.csv"), "--target", "kind", "--standardize", "--hidden", "64",
               "--epochs", "3", "--save", str(ckpt), "--json")
    assert run.returncode == 0, run.stderr
    epochs = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(epochs) == 3 and epochs[-1]["test_accuracy"] > 0.85, epochs
    run = _run("evaluate", str(ckpt), "--data", str(tmp_path / "test.csv"), "--json")
    assert run.returncode == 0, run.stderr
    scored = json.loads(run.stdout)
    assert scored["test_rows"] == 2000 and scored["test_accuracy"] > 0.85
    out = tmp_path / "p.csv"
    run = _run("predict", str(ckpt), str(tmp_path / "test.csv"), "--out", str(out))
    assert run.returncode == 0, run.stderr
    with open(out) as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 2000 and len(rows[0]) == 2 + 3
    hits = sum(int(r["predicted"]) == int(label[10000 + i]) for i, r in enumerate(rows))
    assert hits / 2000 == pytest.approx(scored["test_accuracy"], abs=1e-12)
    # a table of other columns is refused in one line, exit 1
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    run = _run("evaluate", str(ckpt), "--data", str(bad))
    assert run.returncode == 1 and run.stderr.count("\n") == 1 and "no column" in run.stderr, run.stderr


@gpu
def test_the_cli_regresses_scores_the_test_set_once_and_predicts_in_the_targets_units(device, rng, tmp_path):
    """train --data FILE.npz --loss mse --standardize --val-fraction: every epoch on the validation rows, then one
    {"test": ...} record; evaluate --json: the same RMSE; predict: values in the targets' units (far from 0), whose
    RMSE against the test targets is evaluate's."""
    n = 8000
    x = rng.standard_normal((n, 5)) * [1, 10, 100, 0.1, 3] + [0, 50, -20, 1, 0]
    y = np.tanh(x[:, 0]) * 20 + x[:, 1] + 300.0
    path = tmp_path / "t.npz"
    np.savez(path, x_train=x[:7000].astype(np.float32), y_train=y[:7000], x_test=x[7000:].astype(np.float32),
             y_test=y[7000:])
    ckpt = tmp_path / "r.safetensors"
    run = _run("train", "--data", str(path), "--loss", "mse", "--standardize", "--hidden", "64", "--epochs", "4",
               "--val-fraction", "0.1", "--save", str(ckpt), "--json")
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in run.stdout.splitlines()]
    epochs, final = records[:-1], records[-1]["test"]
    assert len(epochs) == 4 and all(e["test_rmse"] is not None for e in epochs)
    assert final["test_rows"] == 1000 and final["test_r2"] > 0.9, final
    run = _run("evaluate", str(ckpt), "--data", str(path), "--json")
    assert run.returncode == 0, run.stderr
    scored = json.loads(run.stdout)
    assert scored["test_rows"] == 1000 and scored["test_rmse"] == pytest.approx(final["test_rmse"], rel=1e-9)
    out = tmp_path / "p.json"
    run = _run("predict", str(ckpt), str(path), "--out", str(out))
    assert run.returncode == 0, run.stderr
    values = np.array([r["values"][0] for r in json.loads(out.read_text())])
    assert len(values) == 1000 and abs(values.mean() - y[7000:].mean()) < 0.5 * y[7000:].std()  # about 350
    assert math.sqrt(((values - y[7000:]) ** 2).mean()) == pytest.approx(scored["test_rmse"], rel=1e-3)


@gpu
@pytest.mark.parametrize("kind", ["tensor", "data"])
@pytest.mark.parametrize("task", [dict(loss="mse", outputs=2), dict(classes=300)])
def test_a_table_on_two_ranks_trains_as_on_one_gpu(device, stream, kernels, rng, kind, task):
    """Standardized fp16 features, a regression's values or 300 classes: two ranks of a tensor- or data-parallel
    model (their all-reduces summed on the host, tests/test_sharded.py) train 5 steps to the one-GPU model's
    parameters within the 10-step trajectory bound, and evaluate to its metrics."""
    from rawgpu.model.mlp import target_scaling
    from rawgpu.steps.sharded import join_parameters
    from test_sharded import HostGroup, run_lockstep

    data = fake_table(rng, 4096, 40, "float32", classes=task.get("classes", 0), outputs=task.get("outputs", 1))
    recipe = fit_to_data(Recipe(hidden=256, layers=2, batch=128, momentum=0.9, lr=0.05, schedule="constant",
                                loss=task.get("loss", "xent"), standardize=True, seed=int(rng.integers(1 << 30))),
                         data)
    perm = rng.permutation(recipe.train_rows).astype(np.int32)

    def ready(model):
        model.allocate()
        if recipe.regression:
            model.set_target_scaling(*target_scaling(data.train_labels))
        model.upload_data(data)
        model.compute_scaling(stream)
        model.init_parameters(stream)
        model.set_permutation(perm)
        return model

    # the ranks gather apart from their first GEMM: so does the one-GPU model (its fold sums in another order)
    one = ready(plan_model(recipe, "layered", kernels=kernels, sm_count=device.sm_count,
                           options=StepOptions(fold=False)))
    ranks = []
    try:
        for rank in range(2):
            ranks.append(ready(plan_model(recipe, kind, kernels=kernels, ranks=2, rank=rank, group=HostGroup(),
                                          sm_count=device.sm_count)))
        joined = (lambda: join_parameters(ranks[0].plan, [m.parameters() for m in ranks])) if kind == "tensor" \
            else (lambda: ranks[0].parameters())
        init = one.parameters()
        for (w, b), (ow, ob) in zip(joined(), init):
            assert np.array_equal(w, ow) and np.array_equal(b, ob)
        assert all(np.array_equal(m.scaling()[0], one.scaling()[0]) for m in ranks)
        steps = [m.step_launches() for m in ranks]
        for _ in range(5):
            for launch in one.step_launches():
                launch.run(stream)
            run_lockstep(steps, stream)
        errors = ref.update_errors(joined(), one.parameters(), init)
        assert max(errors) <= TRAJECTORY_TOLERANCE, errors
        for launch in one.eval_launches():
            launch.run(stream)
        run_lockstep([m.eval_launches() for m in ranks], stream)
        expect = one.eval_errors() if recipe.regression else one.eval_metrics()
        for m in ranks:
            got = m.eval_errors() if recipe.regression else m.eval_metrics()
            assert got[0] == pytest.approx(expect[0], rel=2e-2) and got[1] == pytest.approx(expect[1], rel=2e-2)
    finally:
        for m in [one, *ranks]:
            m.arena.close()
