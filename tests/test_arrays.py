"""Your own data before any GPU work: Dataset.from_arrays and from_tables (data/arrays.py), the features a prediction
reads (tables.read_features), the recipe's task settings, and the train CLI's data flags: every problem one line."""

from __future__ import annotations

import numpy as np
import pytest

from rawgpu.data.datasets import Dataset
from rawgpu.data.tables import read_features
from rawgpu.model.recipe import Recipe, SettingError
from rawgpu.runtime.errors import DataError
from rawgpu.training.trainer import as_dataset, fit_to_data


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_from_arrays_holds_out_a_seeded_test_split_and_keeps_the_features_dtype(rng):
    x = rng.standard_normal((1000, 5)).astype(np.float32)
    y = rng.integers(0, 3, 1000)
    a, b = Dataset.from_arrays(x, y, seed=4), Dataset.from_arrays(x, y, seed=4)
    assert len(a.train_images) == 900 and len(a.test_images) == 100
    assert np.array_equal(a.test_images, b.test_images) and a.train_images.dtype == np.float32
    assert a.classes == 3 and a.train_labels.dtype == np.int32 and not a.regression
    assert a.inputs == 5 and a.is_table and a.input_dtype == "fp16"
    assert sorted(np.concatenate([a.train_labels, a.test_labels])) == sorted(y)
    c = Dataset.from_arrays(x.astype(np.float64), y, classes=7)
    assert c.train_images.dtype == np.float32 and c.classes == 7


def test_from_arrays_values_are_a_regression_and_images_stay_bytes(rng):
    x = rng.integers(0, 256, (200, 4, 4), dtype=np.uint8)
    d = Dataset.from_arrays(x, rng.standard_normal(200), test_fraction=0.25)
    assert d.regression and d.classes == 1 and d.train_labels.shape == (150, 1) and d.train_labels.dtype == np.float32
    assert d.train_images.dtype == np.uint8 and d.inputs == 16 and d.input_dtype == "u8"
    two = Dataset.from_arrays(x, rng.standard_normal((200, 2)), regression=True)
    assert two.classes == 2 and "2 values" in two.describe()


class _DeviceArray:
    """A stand-in for an array on a device rawgpu cannot read, handed over by DLPack (device type 9: Vulkan)."""

    def __dlpack_device__(self):
        return (9, 0)

    def __dlpack__(self, **kw):
        raise AssertionError("must not be read")


@pytest.mark.parametrize("args,kwargs,message", [
    ((np.zeros((0, 3)), np.zeros(0)), {}, "x_train: no rows"),
    ((np.zeros((4, 3)), np.zeros(5)), {}, "y_train: expected 4 targets"),
    ((np.array([[1.0, np.nan]] * 20), np.zeros(20)), {}, "x_train: row 0, column 1: nan (every value must be finite)"),
    ((np.ones((20, 2)), np.array([0.5] * 20)), {"regression": False}, "label 0.5 is not a whole number"),
    ((np.ones((20, 2)), np.array([0, 1] * 9 + [-1, 1])), {}, "y_train: row 18: label -1 is out of range 0..999"),
    ((np.ones((20, 2)), np.arange(20) % 3), {"classes": 2}, "label 2 is out of range 0..1"),
    ((np.ones((20, 2)), np.zeros(20)), {"classes": 1001}, "classes must be an integer in 2..1000"),
    ((np.ones((20, 2)), np.zeros((20, 65))), {"regression": True}, "a regression has 1 to 64 values per row, got 65"),
    ((np.ones((20, 2)), np.zeros((20, 2))), {"regression": False}, "class labels are one per row, got 2"),
    ((np.array([["a", "b"]] * 20), np.zeros(20)), {}, "x_train: holds <U1, not real numbers"),
    ((np.ones((20, 16385), np.uint8), np.zeros(20)), {}, "16385 features per row; rawgpu takes 1 to 16384"),
    ((np.full((20, 2), 1e300), np.zeros(20)), {}, "does not fit float32"),
    ((np.ones((20, 2)), np.zeros(20), np.ones((5, 3)), np.zeros(5)), {}, "x_test: 3 features per row, x_train has 2"),
    ((np.ones((20, 2)), np.zeros(20), np.ones((5, 2))), {}, "give x_test and y_test together"),
    ((np.ones((20, 2), np.float16), np.zeros(20), np.array([[1.0, 7e4]] * 5, np.float32), np.zeros(5)), {},
     "x_test: row 0, column 1: 70000 does not fit float16, x_train's dtype"),
    ((np.ones((20, 2)), np.zeros(20)), {"test_fraction": 0.01}, "leaves no test rows"),
    ((_DeviceArray(), np.zeros(20)), {}, "x_train: an array on DLPack device type 9, which rawgpu cannot read"),
])
def test_from_arrays_refuses_bad_arrays_in_one_line(args, kwargs, message):
    with pytest.raises(DataError) as exc:
        Dataset.from_arrays(*args, **kwargs)
    assert message in _one_line(exc)


def test_a_host_dlpack_array_is_taken(rng):
    x = rng.standard_normal((50, 3)).astype(np.float32)

    class Host:
        def __dlpack_device__(self):
            return (1, 0)

        def __dlpack__(self, **kw):
            return x.__dlpack__(**kw)

    d = Dataset.from_arrays(Host(), np.arange(50) % 2, test_fraction=0.2)
    assert np.array_equal(np.sort(np.concatenate([d.train_images, d.test_images]), axis=0), np.sort(x, axis=0))


def test_the_recipe_takes_the_data_task_and_dtype(rng):
    table = Dataset.from_arrays(rng.standard_normal((100, 3)), np.arange(100) % 4)
    r = fit_to_data(Recipe(batch=10), table)
    assert (r.inputs, r.classes, r.input_dtype, r.train_rows, r.regression, r._pixels) == (3, 4, "fp16", 90, False,
                                                                                         False)
    assert fit_to_data(Recipe(batch=10, input_dtype="fp32"), table).input_dtype == "fp32"
    with pytest.raises(SettingError, match="input_dtype: u8 keeps bytes"):
        fit_to_data(Recipe(batch=10, input_dtype="u8"), table)
    with pytest.raises(SettingError, match="loss: mse is a regression's loss; the data has class labels"):
        fit_to_data(Recipe(batch=10, loss="mse"), table)
    values = Dataset.from_arrays(rng.standard_normal((100, 3)), rng.standard_normal((100, 2)))
    with pytest.raises(SettingError, match="loss: the data's targets are values"):
        fit_to_data(Recipe(batch=10), values)
    assert fit_to_data(Recipe(batch=10, loss="huber"), values).classes == 2
    with pytest.raises(SettingError, match="classes: a regression has 1 to 64 outputs, got 65"):
        Recipe(loss="mse", classes=65)
    with pytest.raises(SettingError, match="classes: a classification has 2 to 1000 classes, got 1"):
        Recipe(classes=1)
    with pytest.raises(SettingError, match="loss: must be one of xent, mse, l1, huber"):
        Recipe(loss="hinge")
    images = Dataset.from_arrays(rng.integers(0, 256, (100, 9), dtype=np.uint8), np.arange(100) % 10)
    assert fit_to_data(Recipe(batch=10), images)._pixels
    assert not fit_to_data(Recipe(batch=10, standardize=True), images)._pixels
    with pytest.raises(SettingError, match="data: a tuple of arrays is"):
        as_dataset((1, 2, 3))


def test_from_tables_reads_a_csv_with_its_test_file_and_the_columns(tmp_path):
    pytest.importorskip("pyarrow")
    (tmp_path / "train.csv").write_text("a,b,label\n" + "".join(f"{i},{i * 2.5},{i % 3}\n" for i in range(30)))
    (tmp_path / "test.csv").write_text("a,b,label\n1,2,0\n3,4,2\n")
    d = Dataset.from_tables(tmp_path / "train.csv", target="label", test=tmp_path / "test.csv")
    assert (len(d.train_images), len(d.test_images), d.classes, d.features, d.targets) == (30, 2, 3, ("a", "b"),
                                                                                          ("label",))
    (tmp_path / "other.csv").write_text("a,c,label\n1,2,0\n")
    with pytest.raises(DataError) as exc:
        Dataset.from_tables(tmp_path / "train.csv", test=tmp_path / "other.csv")
    assert "the test set's columns differ from the training set's (missing 'b'; extra 'c')" in _one_line(exc)
    (tmp_path / "four.csv").write_text("a,b,label\n1,2,7\n")
    with pytest.raises(DataError) as exc:
        Dataset.from_tables(tmp_path / "train.csv", test=tmp_path / "four.csv")
    assert "row 1, column 'label': label 7 is out of range 0..2" in _one_line(exc)
    r = Dataset.from_tables(tmp_path / "train.csv", target=["b"], features=["a"], regression=True, test_fraction=0.2)
    assert r.regression and r.train_labels.shape == (24, 1) and r.features == ("a",)


def test_the_rows_to_predict_on_are_the_models_feature_columns(tmp_path):
    pytest.importorskip("pyarrow")
    (tmp_path / "rows.csv").write_text("b,extra,a\n1,x,2\n3,y,4\n")
    x = read_features(tmp_path / "rows.csv", ["a", "b"], 2)
    assert x.tolist() == [[2, 1], [4, 3]] and x.dtype == np.float32
    with pytest.raises(DataError) as exc:
        read_features(tmp_path / "rows.csv", ["a", "c"], 2)
    assert "no column 'c', a feature of the model" in _one_line(exc)
    np.save(tmp_path / "rows.npy", np.arange(12.0).reshape(4, 3))
    assert read_features(tmp_path / "rows.npy", None, 2).tolist() == [[0, 1], [3, 4], [6, 7], [9, 10]]
    with pytest.raises(DataError) as exc:
        read_features(tmp_path / "rows.npy", None, 5)
    assert "3 columns; the model takes 5 features" in _one_line(exc)
    np.savez(tmp_path / "rows.npz", x_train=np.ones((3, 2)), x_test=np.zeros((2, 2)))
    assert read_features(tmp_path / "rows.npz", None, 2).tolist() == [[0, 0], [0, 0]]


@pytest.mark.parametrize("argv,message", [
    (["--target", "y"], "argument --target: picks from a table; add --data PATH"),
    (["--test-fraction", "0.2"], "argument --test-fraction: picks from a table; add --data PATH"),
    (["--data", "t.csv", "--dataset", "mnist"], "argument --dataset: --data names your own table; drop one of them"),
    (["--data", "t.csv", "--test", "u.csv", "--test-fraction", "0.2"], "argument --test-fraction: --test gives"),
    (["--data", "t.csv", "--test-fraction", "1.5"], "argument --test-fraction: must be between 0 and 1, got 1.5"),
    (["--loss", "mse"], "argument --loss: mse is a regression's loss; mnist has class labels"),
    (["--input-dtype", "fp64"], "argument --input-dtype: invalid choice"),
])
def test_the_train_clis_data_flags_are_usage_errors(capsys, argv, message):
    from rawgpu.cli.train import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_data_file_is_one_line_and_exit_1(capsys, tmp_path):
    from rawgpu.cli.train import main

    assert main(["--data", str(tmp_path / "none.csv")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "none.csv: no such file" in err


def test_a_data_set_that_does_not_fit_says_its_size_and_what_to_do(monkeypatch):
    from rawgpu.model.mlp import MLP
    from rawgpu.runtime.errors import OutOfMemoryError

    recipe = Recipe(hidden=64, layers=1, inputs=512, classes=3, train_rows=2_000_000, test_rows=1000,
                    input_dtype="fp32")
    model = MLP(recipe)

    def refuse(*a, **k):
        raise OutOfMemoryError("not enough GPU memory: need 4.1 GB (4100000000 B), 1.0 GB free of 80 GB")
    monkeypatch.setattr(model.arena, "allocate", refuse)
    with pytest.raises(OutOfMemoryError) as exc:
        model.allocate()
    text = _one_line(exc)
    assert "the data set takes 3.82 GiB of it: train on fewer rows, keep float features as fp16" in text, text


def test_an_unpicked_text_column_is_left_alone(tmp_path):
    pytest.importorskip("pyarrow")
    (tmp_path / "t.csv").write_text("id,a,label\nx1,1.5,0\nx2,2.5,1\nx3,0.5,1\n")
    d = Dataset.from_tables(tmp_path / "t.csv", features=["a"], test=tmp_path / "t.csv")
    assert d.features == ("a",) and d.train_images[:, 0].tolist() == [1.5, 2.5, 0.5]
    with pytest.raises(DataError) as exc:
        Dataset.from_tables(tmp_path / "t.csv", test=tmp_path / "t.csv")
    assert "row 1, column 'id': 'x1' is not a number" in _one_line(exc)


def test_a_sweep_of_a_tables_classes_trains_together_and_a_regressions_one_by_one(rng):
    """The models step gathers a table's rows and scores class labels: a classification's models train together; a
    regression's one by one (together=True says why); each recipe is checked against the data first."""
    from rawgpu import Grid, Sweep

    x = rng.standard_normal((1000, 5)).astype(np.float32)
    d = Dataset.from_arrays(x, np.arange(1000) % 3)
    assert Sweep(Grid(seeds=(0, 1)), Recipe(standardize=True), data=d, epochs=1).together_problem() is None
    values = Dataset.from_arrays(x, x[:, :2] @ np.ones((2, 1)), regression=True)
    regression = Sweep(Grid(seeds=(0, 1)), Recipe(loss="mse"), data=values, epochs=1)
    assert "scores class labels, not this data (regression (mse)" in regression.together_problem()
    with pytest.raises(ValueError, match="cannot train in one step: the models step scores class labels"):
        Sweep(Grid(seeds=(0, 1)), Recipe(loss="mse"), data=values, epochs=1, together=True)
    with pytest.raises(SettingError, match="loss: mse is a regression's loss; the data has class labels"):
        Sweep(Grid(seeds=(0, 1)), Recipe(loss="mse"), data=d, epochs=1)
    assert Sweep(Grid(seeds=(0,)), data=(d.train_images, d.train_labels), epochs=1).data.inputs == 5


def test_a_validation_split_holds_out_training_rows_and_keeps_the_test_set(rng):
    d = Dataset.from_arrays(rng.standard_normal((1000, 4)).astype(np.float32), np.arange(1000) % 5,
                            rng.standard_normal((50, 4)).astype(np.float32), np.arange(50) % 5)
    scored, final = d.validation_split(0.2, seed=3)
    assert (len(scored.train_images), len(scored.test_images)) == (800, 200)
    assert np.array_equal(scored.train_images, final.train_images) and final.test_images is d.test_images
    rows = {r.tobytes() for r in np.concatenate([scored.train_images, scored.test_images])}
    assert rows == {r.tobytes() for r in d.train_images}  # every training row once, in one part or the other
    again, _ = d.validation_split(0.2, seed=3)
    assert np.array_equal(again.test_images, scored.test_images)
    with pytest.raises(DataError) as exc:
        d.validation_split(0.0001, seed=3)
    assert "leaves no validation rows" in _one_line(exc)


def test_the_finished_models_test_score_is_one_line_or_one_json_object(capsys):
    import io
    import json

    from rawgpu.cli.console import JsonConsole, PlainConsole, format_result

    record = {"test_rows": 100, "test_loss": 0.25, "test_accuracy": 0.9}
    assert format_result(record) == "test set (100 rows): loss 0.25, accuracy 90.00%"
    regression = {"test_rows": 10, "test_loss": 0.5, "test_rmse": 1.5, "test_mae": 1.0, "test_r2": float("nan")}
    assert format_result(regression) == "test set (10 rows): loss 0.5, RMSE 1.5, MAE 1, R² nan"
    out = io.StringIO()
    JsonConsole(out).result(regression)
    assert json.loads(out.getvalue()) == {"test": {**regression, "test_r2": None}}
    out = io.StringIO()
    PlainConsole(out).result(record)
    assert out.getvalue() == "test set (100 rows): loss 0.25, accuracy 90.00%\n"


def test_an_npz_is_scored_on_its_test_arrays(rng, tmp_path):
    np.savez(tmp_path / "d.npz", x_train=np.ones((20, 3), np.float32), y_train=np.zeros(20),
             x_test=np.zeros((7, 3), np.float32), y_test=np.ones(7))
    d = Dataset.scored_table(tmp_path / "d.npz", None, regression=False, classes=2)
    assert len(d.test_images) == 7 and d.test_labels.tolist() == [1] * 7
    np.savez(tmp_path / "e.npz", x_train=np.ones((20, 3), np.float32), y_train=np.zeros(20))
    assert len(Dataset.scored_table(tmp_path / "e.npz", None, regression=False, classes=2).test_images) == 20


def test_a_regressions_epoch_shows_rmse_r2_and_mae():
    import io

    from rawgpu.cli import console as con
    from rawgpu.training.stats import EpochStats

    nan = float("nan")
    s = EpochStats(epoch=1, epochs=2, steps=10, train_loss=0.5, train_accuracy=nan, test_loss=0.4, test_accuracy=nan,
                   seconds=1.0, eval_seconds=0.1, steps_per_s=10.0, samples_per_s=1280.0, tflops=0.1, gbps=1.0,
                   lr=0.01, total_seconds=1.0, train_rmse=1.0, test_rmse=0.9, test_mae=0.7, test_r2=0.95)
    out = io.StringIO()
    con.PlainConsole(out).epoch_end(s)
    assert "train loss 0.5000  test RMSE 0.9 R² 0.950  MAE 0.7  10.0 steps/s" in out.getvalue()
    assert con.REGRESSION_COLUMNS[2] == "test" and con.epoch_cells(s)[2] == "RMSE 0.9 R² 0.950"
    summary = con.Summary(train_seconds=1.0, wall_seconds=2.0, steps=20, best_accuracy=nan, best_epoch=2,
                          time_to_98=None, interrupted=False, best_rmse=0.85)
    assert con.format_summary(summary) == "trained 20 steps in 1.00 s (wall 2.00 s); best test RMSE 0.85 (epoch 2)"


def test_a_log_says_once_that_a_file_is_read():
    import io

    from rawgpu.cli.console import PlainConsole

    out = io.StringIO()
    c = PlainConsole(out)
    for done in (1 << 20, 2 << 20, 3 << 20, 3 << 20):
        c.reading("t.csv", done, 3 << 20)
    assert out.getvalue() == "reading t.csv (3.00 MiB)\nread t.csv\n"


def test_the_live_view_shows_a_file_read_once_and_clears_its_bar():
    import io

    from rich.console import Console as RichTerminal

    from rawgpu.cli.console import RichConsole

    c = RichConsole(io.StringIO(), RichTerminal(file=io.StringIO(), force_terminal=True, width=100))
    for done in (1 << 20, 3 << 20, 3 << 20):  # the reader's last block, then its own end: one bar, stopped once
        c.reading("t.csv", done, 3 << 20)
    assert c._reads is None and c._reads_done == {"t.csv"}
    c.close()


def test_features_beyond_fp16_are_one_line_naming_the_row_and_what_to_do():
    from rawgpu.model.mlp import MLP

    model = MLP(Recipe(hidden=16, layers=1, inputs=3, classes=2, train_rows=10, test_rows=2, batch=5,
                       input_dtype="fp16"))
    x = np.ones((4, 3), np.float32)
    assert model.device_features(x, "t").dtype == np.float16
    x[2, 1] = 1e6
    with pytest.raises(DataError) as exc:
        model.device_features(x, "the training set")
    assert _one_line(exc) == ("the training set: row 2, column 1: 1e+06 is beyond fp16's range (65504); keep the "
                              "features as fp32 (input_dtype fp32, --input-dtype fp32)")
    bytes_ = np.full((2, 3), 255, np.uint8)
    assert np.array_equal(model.device_features(bytes_, "t"), np.ones((2, 3), np.float16))


def test_a_corrupt_npz_to_score_is_one_line(tmp_path):
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError) as exc:
        Dataset.scored_table(tmp_path / "bad.npz", None, regression=False, classes=2)
    assert "bad.npz: not a readable .npz file" in _one_line(exc)
    with pytest.raises(DataError) as exc:
        Dataset.scored_table(tmp_path / "none.npz", None, regression=False, classes=2)
    assert "none.npz: no such file" in _one_line(exc)
