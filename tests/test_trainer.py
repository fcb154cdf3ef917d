"""GPU tests of the Python API and the checkpoint CLIs: resume bit-identity for every step kind, checkpoints the
standard loaders read, evaluate and predict against a float64 reference, data of other shapes, and the README
example."""

from __future__ import annotations

import gzip
import json
import os
import re
import struct
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpu_checks import interrupt_train
from rawgpu.data.datasets import Dataset
from rawgpu.model.recipe import Recipe

gpu = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent


def synthetic(rng, train: int, test: int, rows: int = 28, cols: int = 28, classes: int = 10,
              name: str = "idx") -> Dataset:
    """A learnable set: each class is a random prototype image plus noise."""
    protos = rng.integers(0, 256, (classes, rows * cols))

    def draw(n):
        y = rng.integers(0, classes, n)
        x = np.clip(protos[y] * 0.6 + rng.integers(0, 102, (n, rows * cols)), 0, 255).astype(np.uint8)
        return x, y.astype(np.uint8)
    (xtr, ytr), (xte, yte) = draw(train), draw(test)
    return Dataset(name, xtr, ytr, xte, yte, (rows, cols), classes, Path("."), ())


def write_idx(directory: Path, data: Dataset) -> Path:
    """The four standard IDX files of `data` (gzipped), as --dataset idx reads them."""
    directory.mkdir(parents=True, exist_ok=True)
    r, c = data.image_shape
    for stem, images, labels in (("train", data.train_images, data.train_labels),
                                 ("t10k", data.test_images, data.test_labels)):
        n = len(labels)
        (directory / f"{stem}-images-idx3-ubyte.gz").write_bytes(
            gzip.compress(struct.pack(">IIII", 0x803, n, r, c) + images.tobytes()))
        (directory / f"{stem}-labels-idx1-ubyte.gz").write_bytes(
            gzip.compress(struct.pack(">II", 0x801, n) + labels.tobytes()))
    return directory


def cli(module: str, *args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    env = {**os.environ, "PYTHONPATH": path, **(env or {})}  # keeps wheels installed beside the tree (nccl4py)
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


def state_of(trainer):
    weights, state = trainer.model.state()
    return [w for pair in weights for w in pair] + [state[k] for k in sorted(state)]


def test_auto_steps_per_graph_is_one_progress_tick_within_bounds():
    from rawgpu.training.trainer import MAX_AUTO_STEPS_PER_GRAPH, PROGRESS_TICKS, auto_steps_per_graph

    assert auto_steps_per_graph(60000 // 128) == 10  # the default recipe on MNIST: 468 steps, 50 ticks
    assert auto_steps_per_graph(60000 // 32) == 38
    assert auto_steps_per_graph(1) == 1 and auto_steps_per_graph(PROGRESS_TICKS) == 1
    assert auto_steps_per_graph(PROGRESS_TICKS + 1) == 2
    assert auto_steps_per_graph(10**7) == MAX_AUTO_STEPS_PER_GRAPH


@pytest.mark.parametrize("make, kind, message", [
    (lambda T: T(epochs=0), ValueError, "epochs: must be >= 1, got 0"),
    (lambda T: T(epochs=-1), ValueError, "epochs: must be >= 1, got -1"),
    (lambda T: T(epochs=2.5), TypeError, "epochs: must be an integer >= 1, got 2.5"),
    (lambda T: T(steps=0), ValueError, "steps: must be >= 1, got 0"),
    (lambda T: T(device=-1), ValueError, "device: must be >= 0, got -1"),
    (lambda T: T(device="0"), TypeError, "device: must be an integer >= 0, got '0'"),
    (lambda T: T(data=42), TypeError, "data: must be a Dataset, a tuple of arrays (x, y), one of mnist, fashion-mnist, kmnist, idx or None, "
                                      "got 42"),
    (lambda T: T(data="cifar"), ValueError, "data: must be a Dataset, a tuple of arrays (x, y), one of mnist, fashion-mnist, kmnist, idx or "
                                            "None, got 'cifar'"),
    (lambda T: T("notarecipe"), TypeError, "recipe: must be a Recipe (rawgpu.Recipe(hidden=..., ...)), got "
                                           "'notarecipe'"),
    (lambda T: T(step="fast"), ValueError, "step: must be one of auto, cluster, fused, layered, got 'fast'"),
    (lambda T: T(steps_per_graph=0), ValueError, "steps_per_graph: must be >= 1, got 0"),
    (lambda T: T(graphs="no"), TypeError, "graphs: must be True or False, got 'no'"),
    (lambda T: T(on_compile=3), TypeError, "on_compile: must be a function or None, got 3"),
    (lambda T: T(Recipe(warmup_steps=10, schedule="constant"), data=None), ValueError,
     "warmup_steps: a warm-up ramps up to a decaying schedule: use schedule cosine or linear"),
    (lambda T: T(Recipe(warmup_steps=100), data=None, steps=100), ValueError,
     "warmup_steps: 100 steps is not shorter than the run (100 steps)"),
    (lambda T: T(Recipe(batch=600), data=synthetic(np.random.default_rng(0), 500, 10)), ValueError,
     "batch: must be <= the 500 training images, got 600"),
    (lambda T: T.load(42), TypeError, "source: must be a checkpoint's path or a Checkpoint, got 42"),
    (lambda T: T.load("x.safetensors", data=3.5), TypeError,
     "data: must be a Dataset, one of checkpoint, mnist, fashion-mnist, kmnist, idx or None, got 3.5"),
])
def test_bad_arguments_are_one_line_naming_the_parameter_before_the_data_or_the_gpu(monkeypatch, make, kind,
                                                                                      message):
    """The API checks what the CLI checks, by the same rules (recipe.py), and names the parameter, not a flag."""
    from rawgpu import SettingError, Trainer

    monkeypatch.setattr("rawgpu.training.trainer.load_dataset", lambda *a, **k: pytest.fail("the data was read"))
    monkeypatch.setattr("rawgpu.training.session.Session", lambda *a, **k: pytest.fail("the GPU was opened"))
    with pytest.raises(kind) as info:
        make(Trainer)
    assert str(info.value) == message and isinstance(info.value, SettingError)


def test_the_public_signatures_show_the_public_parameters_alone():
    """rank, options and the checkpoint to start from are the package's business (Trainer._make, Trainer._load)."""
    import inspect

    from rawgpu import Trainer

    public = ["recipe", "data", "data_dir", "epochs", "steps", "device", "step", "steps_per_graph", "graphs",
              "on_compile", "download_progress"]
    assert list(inspect.signature(Trainer).parameters) == public
    assert list(inspect.signature(Trainer.load).parameters) == ["source", "data", "data_dir", "device",
                                                                "steps_per_graph", "graphs", "on_compile",
                                                                "download_progress"]
    for hidden in ("rank", "options", "checkpoint", "_checkpoint"):
        assert hidden not in inspect.signature(Trainer).parameters


def test_the_recipe_keeps_the_kernels_codes_out_of_its_public_surface():
    r = Recipe(hidden=100, optimizer="adam", activation="gelu")
    internals = ("padded_widths", "kernel_accum", "activation_code", "saves_slope", "schedule_code", "optimizer_code",
                 "uses_momentum", "plain_sgd", "state_tensors", "scaled_lr", "step_flops", "step_bytes")
    assert not set(internals) & {name for name in dir(r) if not name.startswith("_")}
    assert r._padded_widths == [784, 104, 104, 104, 16] and r._activation_code == 1 and r._optimizer_code == 1
    assert r._padded_widths == r._padded_widths  # the old names still resolve for rawgpu/steps, kernels, parallel
    with pytest.raises(AttributeError, match="'Recipe' object has no attribute 'colour'"):
        r.colour


# Each kind where it runs on this GPU: the fused step (momentum), the layered step in 17 kernels (momentum, fp16
# accumulation) and in its short form, and the cluster step (batch 32, plain SGD, sm_90).
KINDS = [
    ("fused", dict(hidden=96, batch=64, momentum=0.9)),
    ("layered", dict(hidden=128, batch=64, momentum=0.9, accum="fp16")),
    ("layered", dict(hidden=256, batch=32, momentum=0.0)),
    ("cluster", dict(hidden=64, batch=32, momentum=0.0)),
]


@gpu
@pytest.mark.parametrize("kind,options", KINDS, ids=[f"{k}-{o['hidden']}" for k, o in KINDS])
def test_a_run_resumed_mid_epoch_ends_bit_identical(device, rng, tmp_path, kind, options):
    from rawgpu import Trainer
    from rawgpu.steps import unsupported_reason

    data = synthetic(rng, 3000, 500)
    recipe = Recipe(lr=0.05, seed=int(rng.integers(1 << 30)), schedule="cosine", warmup_steps=7, **options)
    if (why := unsupported_reason(kind, recipe, device.arch)) is not None:
        pytest.skip(f"{kind} does not run here: {why}")
    total = 3 * (3000 // recipe.batch) - 5  # the last epoch is partial
    with Trainer(recipe, data=data, steps=total, step=kind, steps_per_graph=4) as full:
        full.fit()
        expect, expect_history = state_of(full), full.history
    path = tmp_path / "half.safetensors"
    k = 3000 // recipe.batch + 17  # inside the second epoch
    with Trainer(recipe, data=data, steps=total, step=kind) as first:
        first.fit(stop_at=k, save_to=path)
        assert first.steps_done == k
    with Trainer.load(path, data=data) as resumed:
        assert resumed.steps_done == k and resumed.model.kind == kind
        resumed.fit()
        got = state_of(resumed)
        assert resumed.steps_done == total
        assert [h.epoch for h in resumed.history] == [h.epoch for h in expect_history]
        for h, e in zip(resumed.history, expect_history):
            assert h.test_accuracy == e.test_accuracy  # the same weights give the same evaluation
            assert h.train_loss == pytest.approx(e.train_loss, rel=1e-9)  # summed by atomics: order may differ
    for g, e in zip(got, expect):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_array_equal(g.view(np.uint8), e.view(np.uint8))


@gpu
def test_checkpoints_load_in_numpy_and_torch_with_the_standard_loaders(device, rng, tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    from rawgpu import Trainer

    data = synthetic(rng, 2000, 300, rows=5, cols=7, classes=3)
    path = tmp_path / "m.safetensors"
    with Trainer(Recipe(hidden=40, layers=2, batch=50), data=data, epochs=1) as t:
        t.fit(save_to=path)
        params = t.parameters()
    tensors = load_file(str(path))
    widths = [35, 40, 40, 3]
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        assert tensors[f"layers.{i}.weight"].dtype == np.float32 and tensors[f"layers.{i}.weight"].shape == (b, a)
        assert tensors[f"layers.{i}.bias"].dtype == np.float32 and tensors[f"layers.{i}.bias"].shape == (b,)
        np.testing.assert_array_equal(tensors[f"layers.{i}.weight"], params[i][0].T)
        np.testing.assert_array_equal(tensors[f"layers.{i}.bias"], params[i][1])
        assert tensors[f"state.layers.{i}.w16"].dtype == np.float16
        assert tensors[f"state.layers.{i}.momentum_weight"].shape == (a, b)
    with safe_open(str(path), framework="np") as f:
        meta = f.metadata()
    assert meta["format"] == "rawgpu-mlp" and json.loads(meta["recipe"])["inputs"] == 35
    assert json.loads(meta["dataset"]) == {"name": "idx", "image_shape": [5, 7], "classes": 3}
    torch = pytest.importorskip("torch")  # the device has it; CPU machines skip this part only
    from safetensors.torch import load_file as torch_load

    layers = torch.nn.Sequential(torch.nn.Linear(35, 40), torch.nn.ReLU(), torch.nn.Linear(40, 40),
                                 torch.nn.ReLU(), torch.nn.Linear(40, 3))
    sd = {f"{2 * int(k.split('.')[1])}.{k.split('.')[2]}": v for k, v in torch_load(str(path)).items()
          if k.startswith("layers.")}
    layers.load_state_dict(sd)
    x = torch.tensor(data.test_images[:200], dtype=torch.float32) / 255
    with Trainer.load(path, data=data) as t:
        ours = t.predict(data.test_images[:200]).argmax(1)
    assert (layers(x).argmax(1).numpy() == ours).mean() >= 0.97  # fp16 forward on the GPU, fp32 in torch


@gpu
def test_evaluate_and_predict_match_a_float64_reference_with_a_ragged_last_chunk(device, rng, monkeypatch):
    from rawgpu import Trainer
    from rawgpu.model import mlp

    monkeypatch.setattr(mlp, "EVAL_ACTIVATION_BUDGET", 300 * 2 * (792 + 2 * 64 + 16))  # 300-row chunks
    data = synthetic(rng, 4000, 1001)
    with Trainer(Recipe(hidden=64, batch=100), data=data, epochs=2) as t:
        assert (t.model.eval_batch, t.model.eval_chunks, t.model.eval_tail) == (256, 3, 233)
        t.fit()
        result = t.evaluate()
        probs = t.predict(data.test_images)
        params = t.parameters()
        assert result.accuracy == t.history[-1].test_accuracy
    x = data.test_images.astype(np.float64) / 255
    for i, (w, b) in enumerate(params):
        x = x @ w.astype(np.float64) + b
        x = np.maximum(x, 0) if i < len(params) - 1 else x
    ref = np.exp(x - x.max(1, keepdims=True))
    ref /= ref.sum(1, keepdims=True)
    assert probs.shape == (1001, 10) and np.allclose(probs.sum(1), 1)
    assert np.abs(probs - ref).max() < 0.02  # fp16 weights and activations on the GPU
    assert (probs.argmax(1) == ref.argmax(1)).mean() >= 0.99
    loss_ref = -np.log(ref[np.arange(1001), data.test_labels]).mean()
    assert result.loss == pytest.approx(loss_ref, rel=0.02, abs=2e-3)
    assert result.confusion.sum() == 1001 and result.confusion.shape == (10, 10)
    assert np.trace(result.confusion) / 1001 == pytest.approx(result.accuracy, abs=1e-9)
    np.testing.assert_array_equal(result.confusion.sum(1), np.bincount(data.test_labels, minlength=10))


@gpu
def test_other_image_sizes_and_classes_train_on_the_layered_step(device, rng, tmp_path):
    data_dir = write_idx(tmp_path / "small", synthetic(rng, 1230, 457, rows=5, cols=7, classes=3))
    result = cli("rawgpu.train", "--dataset", "idx", "--data-dir", str(data_dir), "--hidden", "64", "--batch", "32",
                 "--epochs", "4", "--json", "--save", str(tmp_path / "s.safetensors"))
    assert result.returncode == 0, result.stderr
    epochs = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(epochs) == 4 and epochs[-1]["test_accuracy"] > 0.9
    shown = cli("rawgpu.evaluate", str(tmp_path / "s.safetensors"), "--data-dir", str(data_dir), "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["test_accuracy"] == epochs[-1]["test_accuracy"]


@gpu
def test_fashion_mnist_shaped_idx_set_trains_saves_evaluates_and_predicts(device, rng, tmp_path):
    data = synthetic(rng, 60000, 10000)
    data_dir = write_idx(tmp_path / "fashion", data)
    ckpt = tmp_path / "fashion.safetensors"
    plot = tmp_path / "curves.png"
    result = cli("rawgpu.train", "--dataset", "idx", "--data-dir", str(data_dir), "--epochs", "2", "--save",
                 str(ckpt), "--plot", str(plot))
    assert result.returncode == 0, result.stderr
    assert "idx: 60000 + 10000 images of 28x28, 10 classes, structural checks only" in result.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    shown = cli("rawgpu.evaluate", str(ckpt), "--data-dir", str(data_dir))
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"test accuracy \d+\.\d\d%", shown.stdout) and "confusion matrix" in shown.stdout
    np.save(tmp_path / "three.npy", data.test_images[:3].reshape(3, 28, 28))
    out = tmp_path / "p.json"
    predicted = cli("rawgpu.predict", str(ckpt), str(tmp_path / "three.npy"), str(data_dir / "t10k-images-idx3-ubyte.gz"),
                    "--out", str(out))
    assert predicted.returncode == 0, predicted.stderr
    rows = json.loads(out.read_text())
    assert len(rows) == 3 + 10000
    first = [r["predicted"] for r in rows[:3]]
    assert first == [r["predicted"] for r in rows[3:6]]  # the same images from both files
    assert all(abs(sum(r["probabilities"]) - 1) < 1e-6 for r in rows[:10])
    wrong = tmp_path / "wrong.npy"
    np.save(wrong, np.zeros((2, 27, 28), np.uint8))
    bad = cli("rawgpu.predict", str(ckpt), str(wrong))
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1 and "27x28" in bad.stderr


def _json_epochs(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@gpu
@pytest.mark.parametrize("sig,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl_c", "sigterm"])
def test_a_signal_saves_within_2_s_and_resume_finishes_bit_identical_to_the_uninterrupted_run(sig, status, device, rng,
                                                                                               tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    data_dir = write_idx(tmp_path / "d", synthetic(rng, 20000, 1000))
    common = ["--dataset", "idx", "--data-dir", str(data_dir), "--hidden", "512", "--epochs", "40", "--json"]
    full = cli("rawgpu.train", *common, "--save", str(tmp_path / "full.safetensors"))
    assert full.returncode == 0, full.stderr
    part = tmp_path / "part.safetensors"
    got, out, err, seconds = interrupt_train([*common, "--save", str(part)], "{", ROOT, sig)  # after the first epoch
    assert got == status, err
    assert seconds < 2.0, f"the run took {seconds:.2f} s to stop and save"
    assert "Traceback" not in err
    with safe_open(str(part), "np") as f:
        saved_at = json.loads(f.metadata()["progress"])["steps_done"]
    assert 0 < saved_at < 40 * (20000 // 128)
    resumed = cli("rawgpu.train", "--resume", str(part), "--data-dir", str(data_dir), "--json")
    assert resumed.returncode == 0, resumed.stderr
    a, b = load_file(str(tmp_path / "full.safetensors")), load_file(str(part))
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name].view(np.uint8), b[name].view(np.uint8), err_msg=name)
    assert _json_epochs(resumed.stdout)[-1]["test_accuracy"] == _json_epochs(full.stdout)[-1]["test_accuracy"]
    conflict = cli("rawgpu.train", "--resume", str(part), "--lr", "0.1")
    assert conflict.returncode == 2 and "differs from the checkpoint's 0.05" in conflict.stderr


@gpu
def test_a_diverging_run_keeps_the_last_good_checkpoint(device, rng, tmp_path):
    data_dir = write_idx(tmp_path / "d", synthetic(rng, 5000, 500))
    path = tmp_path / "good.safetensors"
    common = ["--dataset", "idx", "--data-dir", str(data_dir), "--hidden", "64", "--epochs", "2", "--save", str(path)]
    assert cli("rawgpu.train", *common).returncode == 0
    before = path.read_bytes()
    bad = cli("rawgpu.train", *common, "--lr", "100", "--save-every", "10")
    assert bad.returncode == 1 and "training diverged in epoch 1" in bad.stderr.strip().splitlines()[-1]
    assert path.read_bytes() == before


@gpu
def test_the_readme_example_runs(device, tmp_path, monkeypatch):
    text = (ROOT / "README.md").read_text()
    example = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    if os.environ.get("RAWGPU_DATA"):
        monkeypatch.setenv("RAWGPU_DATA", str(Path(os.environ["RAWGPU_DATA"]).resolve()))  # the example runs elsewhere
    else:
        from rawgpu.data.datasets import DataError, load_mnist

        try:
            load_mnist(download=False)
        except DataError as exc:
            pytest.skip(f"MNIST not available offline (set RAWGPU_DATA): {exc}")
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "README.md", "exec"), {})
    assert (tmp_path / "mnist.safetensors").stat().st_size > 0
