"""CPU tests of checkpoints and of the checks the checkpoint CLIs make before any GPU work."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from rawgpu.training import checkpoint as ck
from rawgpu.cli import evaluate, predict, train
from rawgpu.model import optimizer
from rawgpu.model.recipe import Recipe


def make(rng, recipe: Recipe, steps_done: int = 7) -> ck.Checkpoint:
    widths = recipe.widths
    weights, state = [], {}
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        w = rng.standard_normal((a, b)).astype(np.float32)
        weights.append((w, rng.standard_normal(b).astype(np.float32)))
        state[f"layers.{i}.w16"] = w.astype(np.float16)
        state[f"layers.{i}.wlo"] = rng.integers(-2**15, 2**15, (a, b)).astype(np.int16)
        for name in optimizer.state_names(recipe):
            state[f"layers.{i}.{name}_weight"] = rng.standard_normal((a, b)).astype(np.float32)
            state[f"layers.{i}.{name}_bias"] = rng.standard_normal(b).astype(np.float32)
    shape = [3, 4] if recipe.inputs == 12 else [1, recipe.inputs]  # the image shape of the first layer's width
    return ck.Checkpoint(recipe, "fused", {"name": "idx", "image_shape": shape, "classes": recipe.classes}, weights,
                         state, {"steps_done": steps_done, "history": []})


@pytest.mark.parametrize("opt", [dict(momentum=0.0), dict(momentum=0.9), dict(momentum=0.5, nesterov=True),
                                 dict(optimizer="adam"), dict(optimizer="adamw", weight_decay=0.1)])
def test_round_trip_keeps_every_bit_and_the_metadata(rng, tmp_path, opt):
    recipe = Recipe(hidden=24, layers=2, batch=10, **opt, inputs=12, classes=5, train_rows=100,
                    test_rows=30, total_steps=40, lr=0.125)
    saved = make(rng, recipe)
    path = ck.save(tmp_path / "a.safetensors", saved)
    back = ck.load(path)
    assert back.recipe == recipe and back.step_kind == "fused" and back.steps_done == 7
    assert back.dataset == saved.dataset
    for (w, b), (w2, b2) in zip(saved.weights, back.weights):
        np.testing.assert_array_equal(w, w2)
        np.testing.assert_array_equal(b, b2)
    assert sorted(back.state) == sorted(saved.state)
    assert len(back.state) == 2 * len(recipe.widths[1:]) * (1 + recipe._state_tensors)
    for name, value in saved.state.items():
        np.testing.assert_array_equal(value.view(np.uint8), back.state[name].view(np.uint8))
    assert [p.name for p in tmp_path.iterdir()] == ["a.safetensors"]  # no temp file left


def test_the_file_uses_torch_linear_layout(rng, tmp_path):
    from safetensors.numpy import load_file

    recipe = Recipe(hidden=8, layers=1, batch=4, inputs=6, classes=3, train_rows=20, test_rows=5)
    saved = make(rng, recipe)
    tensors = load_file(str(ck.save(tmp_path / "m.safetensors", saved)))
    assert tensors["layers.0.weight"].shape == (8, 6) and tensors["layers.1.weight"].shape == (3, 8)
    np.testing.assert_array_equal(tensors["layers.0.weight"], saved.weights[0][0].T)
    assert tensors["state.layers.0.w16"].dtype == np.float16 and tensors["state.layers.1.wlo"].dtype == np.int16


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(rng, tmp_path, monkeypatch):
    recipe = Recipe(hidden=8, layers=1, batch=4, inputs=6, classes=3, train_rows=20, test_rows=5)
    path = ck.save(tmp_path / "m.safetensors", make(rng, recipe))
    before = path.read_bytes()

    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "fsync", interrupted)  # write_atomic's, under the save
    with pytest.raises(KeyboardInterrupt):
        ck.save(path, make(rng, recipe, steps_done=9))
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


def _one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


def test_bad_files_are_one_line_errors(rng, tmp_path):
    recipe = Recipe(hidden=8, layers=1, batch=4, inputs=6, classes=3, train_rows=20, test_rows=5)
    good = ck.save(tmp_path / "good.safetensors", make(rng, recipe)).read_bytes()
    cases = {
        "missing": (None, "no such checkpoint file"),
        "garbage": (b"not a checkpoint at all", "not a readable safetensors file"),
        "truncated": (good[: len(good) // 2], "not a readable safetensors file"),
    }
    for name, (blob, needle) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        if blob is not None:
            path.write_bytes(blob)
        with pytest.raises(ck.CheckpointError) as info:
            ck.load(path)
        assert needle in _one_line(info) and str(path) in str(info.value), name
    with pytest.raises(ck.CheckpointError, match=r"is a directory, not a checkpoint file"):
        ck.load(tmp_path)


def test_another_format_a_wrong_tensor_and_nan_weights_are_refused(rng, tmp_path):
    from safetensors.numpy import save_file

    save_file({"x": np.zeros(3, np.float32)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ck.CheckpointError, match="not a rawgpu checkpoint"):
        ck.load(tmp_path / "other.safetensors")
    recipe = Recipe(hidden=8, layers=1, batch=4, inputs=6, classes=3, train_rows=20, test_rows=5)
    saved = make(rng, recipe)
    saved.weights[1] = (saved.weights[1][0][:, :2], saved.weights[1][1])
    with pytest.raises(ck.CheckpointError, match=r"tensor layers.1.weight is float32\[2, 8\], expected float32\[3, 8\]"):
        ck.load(ck.save(tmp_path / "shape.safetensors", saved))
    saved = make(rng, recipe)
    saved.weights[0][0][0, 0] = np.nan
    with pytest.raises(ck.CheckpointError, match="layer 0 holds NaN"):
        ck.load(ck.save(tmp_path / "nan.safetensors", saved))


def _with_metadata(path: Path, **changes: str) -> Path:
    """The checkpoint at `path` rewritten with some of its metadata strings replaced (the tensors as they were)."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(path), framework="np") as f:
        meta, arrays = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    save_file(arrays, str(path), metadata={**meta, **changes})
    return path


@pytest.mark.parametrize("field, text, message", [
    ("progress", json.dumps("steps 7"), "progress is a string, not an object"),
    ("progress", json.dumps([7]), "progress is an array, not an object"),
    ("progress", json.dumps({"steps_done": -1}), "progress steps_done is -1, not a step count"),
    ("progress", json.dumps({"steps_done": 41}), "progress steps_done 41 is past the run's 40 steps"),
    ("progress", json.dumps({"train_seconds": "1 s"}), 'progress train_seconds is "1 s", not a number'),
    ("progress", json.dumps({"history": [{"epoch": 1}]}), "progress history entry 0 is not an epoch's record"),
    ("dataset", json.dumps("idx"), "dataset is a string, not an object"),
    ("dataset", json.dumps({"name": "idx", "image_shape": [3, 5]}),
     "dataset image_shape 3x5 is 15 pixels, but the first layer takes 12"),
    ("dataset", json.dumps({"name": "idx", "image_shape": [12]}), "dataset image_shape is [12], not [rows, cols]"),
])
def test_metadata_that_cannot_be_the_model_s_is_one_line_naming_the_file_and_the_field(rng, tmp_path, field, text,
                                                                                       message):
    recipe = Recipe(hidden=8, layers=1, batch=4, inputs=12, classes=3, train_rows=20, test_rows=5, total_steps=40)
    path = _with_metadata(ck.save(tmp_path / "m.safetensors", make(rng, recipe)), **{field: text})
    with pytest.raises(ck.CheckpointError) as info:
        ck.load(path)
    assert str(info.value).startswith(f"{path}: corrupt checkpoint metadata: {message}")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("tool", ["evaluate", "predict", "Trainer.load", "train --resume"])
def test_a_checkpoint_whose_progress_is_a_string_is_one_line_and_exit_1_everywhere(rng, tmp_path, capsys,
                                                                                   monkeypatch, tool):
    monkeypatch.setattr("rawgpu.runtime.driver.init", lambda: pytest.fail("the GPU was opened"))
    recipe = Recipe(hidden=8, layers=1, batch=4, inputs=12, classes=3, train_rows=20, test_rows=5, total_steps=40)
    path = _with_metadata(ck.save(tmp_path / "m.safetensors", make(rng, recipe)), progress=json.dumps("x"))
    want = f"{path}: corrupt checkpoint metadata: progress is a string, not an object"
    if tool == "Trainer.load":
        from rawgpu import Trainer

        with pytest.raises(ck.CheckpointError) as info:
            Trainer.load(path, data=None)
        assert str(info.value) == want
        return
    np.save(tmp_path / "x.npy", np.zeros((1, 3, 4), np.uint8))
    argv = {"evaluate": [str(path)], "predict": [str(path), str(tmp_path / "x.npy")],
            "train --resume": ["--resume", str(path)]}[tool]
    assert {"evaluate": evaluate, "predict": predict, "train --resume": train}[tool].main(argv) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"rawgpu: error: {want}"]


def test_resume_checks_the_data_against_the_checkpoint_before_the_gpu(rng, tmp_path, capsys, monkeypatch):
    """A named set's shape is known from its table: checked before any file is read; the idx set's once read, still
    before the GPU. Both are the checkpoint's error (exit 1), naming the file."""
    from test_trainer import synthetic, write_idx

    monkeypatch.setattr("rawgpu.runtime.driver.init", lambda: pytest.fail("the GPU was opened"))
    monkeypatch.setattr("rawgpu.runtime.driver.init_in_background", lambda: None)
    recipe = Recipe(hidden=8, layers=1, batch=4, inputs=12, classes=3, train_rows=20, test_rows=5, total_steps=40)
    saved = make(rng, recipe)
    saved.dataset["name"] = "mnist"  # a model of 3x4 images that says it trained on MNIST (28x28)
    path = ck.save(tmp_path / "named.safetensors", saved)
    monkeypatch.setattr("rawgpu.data.datasets.load_dataset", lambda *a, **k: pytest.fail("the data was read"))
    assert train.main(["--resume", str(path)]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"rawgpu: error: {path}: trained on 20 images of 12 pixels and 3 classes; mnist has 60000 of 784 pixels and "
        "10 classes: --resume continues on the checkpoint's data"]
    monkeypatch.undo()
    monkeypatch.setattr("rawgpu.runtime.driver.init", lambda: pytest.fail("the GPU was opened"))
    monkeypatch.setattr("rawgpu.runtime.driver.init_in_background", lambda: None)
    path = ck.save(tmp_path / "idx.safetensors", make(rng, recipe))
    other = write_idx(tmp_path / "other", synthetic(rng, 20, 5, rows=4, cols=4, classes=3))
    assert train.main(["--resume", str(path), "--data-dir", str(other)]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"rawgpu: error: {path}: the model takes 3x4 images and 3 classes; idx has 4x4 images and 3 classes"]


def test_recipe_from_dict_refuses_unknown_and_badly_typed_fields():
    r = Recipe(hidden=100, inputs=35, classes=3, train_rows=500, test_rows=50, batch=20)
    assert Recipe.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    with pytest.raises(ValueError, match="unknown recipe fields colour"):
        Recipe.from_dict({**r.to_dict(), "colour": 1})
    with pytest.raises(ValueError, match="recipe field hidden has a bad value"):
        Recipe.from_dict({**r.to_dict(), "hidden": "wide"})
    with pytest.raises(ValueError, match="^batch: must be <= the 500 training images, got 501$"):
        Recipe(batch=501, train_rows=500)
    adam = Recipe(optimizer="adamw", beta1=0.8, eps=1e-6)
    assert Recipe.from_dict(json.loads(json.dumps(adam.to_dict()))) == adam
    old = {k: v for k, v in Recipe().to_dict().items()  # a checkpoint written before the optimiser fields
           if k not in ("optimizer", "nesterov", "beta1", "beta2", "eps", "weight_decay")}
    assert Recipe.from_dict(old) == Recipe()


@pytest.mark.parametrize("argv,message", [
    (["--save-every", "10"], "argument --save-every: needs --save PATH"),
    (["--save", "/nonexistent-dir/x.safetensors"], "argument --save: no directory /nonexistent-dir"),
    (["--plot", "curves.jpg"], "argument --plot:"),
    (["--dataset", "idx"], "argument --dataset: idx needs --data-dir DIR"),
    (["--dataset", "cifar"], "argument --dataset: invalid choice: 'cifar'"),
])
def test_checkpoint_and_data_options_are_checked_first(capsys, monkeypatch, argv, message):
    monkeypatch.setattr(train, "train", lambda *a, **k: pytest.fail("training started"))
    with pytest.raises(SystemExit) as info:
        train.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_resume_refuses_options_that_change_the_run(rng, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(train, "train", lambda *a, **k: pytest.fail("training started"))
    recipe = Recipe(hidden=24, layers=2, batch=10, inputs=12, classes=5, train_rows=100, test_rows=30, total_steps=40)
    path = ck.save(tmp_path / "r.safetensors", make(rng, recipe))
    for argv, message in ((["--hidden", "32"], "argument --hidden: 32 differs from the checkpoint's 24"),
                          (["--epochs", "9"], "argument --epochs: 9 differs from the checkpoint's 4"),
                          (["--dataset", "mnist"], "argument --dataset: mnist differs from the checkpoint's idx"),
                          (["--optimizer", "adam"], "argument --optimizer: adam differs from the checkpoint's sgd")):
        with pytest.raises(SystemExit) as info:
            train.main(["--resume", str(path), *argv])
        assert info.value.code == 2
        assert message in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("tool", [train, evaluate, predict])
def test_a_corrupt_checkpoint_is_one_line_and_exit_1_before_any_gpu_work(tool, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("rawgpu.runtime.driver.init", lambda: pytest.fail("the GPU was opened"))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 40)
    argv = {train: ["--resume", str(bad)], evaluate: [str(bad)], predict: [str(bad), str(bad)]}[tool]
    assert tool.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rawgpu: error:") and "not a readable safetensors file" in err[0]


def test_predict_refuses_images_of_another_size_before_any_gpu_work(rng, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("rawgpu.runtime.driver.init", lambda: pytest.fail("the GPU was opened"))
    recipe = Recipe(hidden=8, layers=1, batch=4, inputs=12, classes=3, train_rows=20, test_rows=5)
    path = ck.save(tmp_path / "m.safetensors", make(rng, recipe))
    np.save(tmp_path / "x.npy", np.zeros((2, 4, 4), np.uint8))
    assert predict.main([str(path), str(tmp_path / "x.npy")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "4x4" in err[0] and "3 x 4" in err[0].replace("3x4", "3 x 4")


def test_predict_out_must_be_csv_or_json(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        predict.main(["m.safetensors", "x.png", "--out", str(tmp_path / "p.txt")])
    assert info.value.code == 2 and "must end in .csv or .json" in capsys.readouterr().err


def test_evaluation_chunks_cover_any_test_set_size():
    from rawgpu.steps import plan_model

    for rows in (1, 7, 45, 10000, 12345):
        m = plan_model(Recipe(hidden=64, test_rows=rows), sm_count=132)
        assert m.eval_chunks * m.eval_batch + m.eval_tail == rows and m.eval_batch >= 1
    m = plan_model(Recipe(hidden=16384, layers=1), sm_count=132)
    assert (m.eval_batch, m.eval_chunks, m.eval_tail) == (5000, 2, 0)
    m = plan_model(Recipe(hidden=16384, layers=1, test_rows=10001), sm_count=132)
    assert m.eval_chunks == 1 and m.eval_tail == 10001 - m.eval_batch and m.eval_batch % 8 == 0
    assert Path(__file__).name == "test_checkpoint.py"
