"""Features handed over on the GPU by DLPack (runtime/dlpack.py): read from the capsule, kept where they are,
copied device to device into the arena and checked there. CPU: the capsule's reading and every refusal, with host
memory described as CUDA memory; GPU: PyTorch tensors on the GPU, trained on bit for bit as the same host arrays."""

from __future__ import annotations

import numpy as np
import pytest

from rawgpu.data.datasets import Dataset
from rawgpu.runtime.dlpack import DeviceArray, _DLManagedTensor, _get_pointer
from rawgpu.model.recipe import Recipe, SettingError
from rawgpu.runtime.errors import DataError
from rawgpu.training.trainer import Trainer, fit_to_data
from test_arrays import _one_line


class OnGpu:
    """Host memory whose DLPack capsule says CUDA device `device` (type 2): what DeviceArray reads of a GPU array,
    without a GPU (nothing here copies from it)."""

    def __init__(self, a: np.ndarray, device: int = 0):
        self.a, self.device = a, device

    def __dlpack_device__(self):
        return (2, self.device)

    def __dlpack__(self, stream=None, **kw):
        capsule = self.a.__dlpack__()
        t = _DLManagedTensor.from_address(_get_pointer(capsule, b"dltensor")).dl_tensor
        t.device.device_type, t.device.device_id = 2, self.device
        return capsule


def test_the_capsule_gives_address_shape_dtype_and_device(rng):
    a = rng.standard_normal((30, 7)).astype(np.float16)
    d = DeviceArray(OnGpu(a, device=1), "x")
    assert (d.shape, d.dtype, d.device_id, len(d), d.nbytes) == ((30, 7), np.float16, 1, 30, a.nbytes)
    assert d.ptr == a.ctypes.data
    flat = d.reshape(-1)
    assert flat.shape == (210,) and flat.ptr == d.ptr and d.reshape(30, -1).shape == (30, 7)
    with pytest.raises(ValueError, match="cannot reshape"):
        d.reshape(7, 31)
    row = a[3:]  # a view: the capsule's byte offset or data address lands on its first row
    assert DeviceArray(OnGpu(row), "x").ptr == row.ctypes.data


@pytest.mark.parametrize("a,message", [
    (np.zeros((4, 3), np.int64), "x_train: a GPU array of int64; rawgpu takes uint8, float16 or float32 features on "
                                 "the GPU (convert it there first"),
    (np.zeros((4, 3), np.float64), "x_train: a GPU array of float64; rawgpu takes"),
    (np.zeros((3, 4), np.float32).T, "x_train: a GPU array that is not C-contiguous (strides (1, 4)); pass "
                                     "x.contiguous()"),
])
def test_gpu_features_rawgpu_cannot_use_as_they_are_are_refused_in_one_line(a, message):
    with pytest.raises(DataError) as exc:
        Dataset.from_arrays(OnGpu(a), np.arange(len(a)) % 2, OnGpu(a), np.arange(len(a)) % 2)
    assert message in _one_line(exc)


def test_a_gpu_array_of_any_number_type_is_read():
    """Targets (int64 labels, float64 values) come as any numbers: the capsule's type is read as NumPy's."""
    for dtype in (np.int64, np.int32, np.uint16, np.float64, np.bool_):
        assert DeviceArray(OnGpu(np.zeros((5, 2), dtype)), "y").dtype == dtype


def test_features_on_the_gpu_stay_there_and_keep_their_dtype(rng):
    x, xt = rng.standard_normal((100, 5)).astype(np.float32), rng.standard_normal((20, 5)).astype(np.float32)
    y, yt = np.arange(100) % 3, np.arange(20) % 3
    data = Dataset.from_arrays(OnGpu(x), y, OnGpu(xt), yt)
    assert isinstance(data.train_images, DeviceArray) and isinstance(data.test_images, DeviceArray)
    assert data.on_gpu and data.input_dtype == "fp32" and data.inputs == 5 and data.classes == 3
    assert data.train_images.ptr == x.ctypes.data, "no copy: the array's own memory"
    assert "100 + 20 rows of 5 float32 features, 3 classes" in data.describe()
    r = fit_to_data(Recipe(batch=10), data)
    assert r.input_dtype == "fp32" and r.train_rows == 100
    with pytest.raises(SettingError, match="input_dtype: the features are on the GPU as float32 and are used as they"):
        fit_to_data(Recipe(batch=10, input_dtype="fp16"), data)
    half = Dataset.from_arrays(OnGpu(x.astype(np.float16)), y, OnGpu(xt.astype(np.float16)), yt)
    assert half.input_dtype == "fp16"
    # a 1-D feature column is one feature per row, as for host arrays
    assert Dataset.from_arrays(OnGpu(x[:, 0].copy()), y, OnGpu(xt[:, 0].copy()), yt).inputs == 1


@pytest.mark.parametrize("case,message", [
    ("no test set", "x_train is on the GPU: pass x_test and y_test too"),
    ("test dtype", "x_test: float16 features, x_train's are float32 (features on the GPU are used as they are"),
    ("test width", "x_test: 4 features per row, x_train has 5"),
    ("too wide", "16385 features per row; rawgpu takes 1 to 16384"),
])
def test_what_a_gpu_array_cannot_do_is_one_line(rng, case, message):
    x, y = rng.standard_normal((40, 5)).astype(np.float32), np.arange(40) % 2
    xt, yt = OnGpu(x[:10].copy()), y[:10]
    args = {"no test set": (OnGpu(x), y),
            "test dtype": (OnGpu(x), y, OnGpu(x[:10].astype(np.float16)), yt),
            "test width": (OnGpu(x), y, OnGpu(x[:10, :4].copy()), yt),
            "too wide": (OnGpu(np.zeros((4, 16385), np.float16)), y[:4], xt, yt)}[case]
    with pytest.raises(DataError) as exc:
        Dataset.from_arrays(*args)
    assert message in _one_line(exc)


def test_a_dataset_on_the_gpu_refuses_splits_and_ranks(rng):
    x, y = rng.standard_normal((40, 5)).astype(np.float32), np.arange(40) % 2
    data = Dataset.from_arrays(OnGpu(x), y, OnGpu(x[:8].copy()), y[:8])
    with pytest.raises(DataError, match="the training features are on the GPU; rawgpu draws a validation split"):
        data.validation_split(0.2, 0)
    with pytest.raises(DataError, match="features on the GPU train on this process's GPU only"):
        data.digest()
    on_one = Dataset.from_arrays(OnGpu(x, device=1), y, OnGpu(x[:8].copy(), device=1), y[:8])
    with pytest.raises(SettingError) as exc:  # before any GPU work: no device is needed to say so
        Trainer(Recipe(batch=8), data=on_one, steps=1)
    assert "the features are on GPU 1; they train where they are, on that one GPU (device=1" in _one_line(exc)


# --- GPU ---------------------------------------------------------------------------------------------------------


def _torch_on(device):
    torch = pytest.importorskip("torch", reason="PyTorch makes the GPU arrays of this test")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no GPU")
    return torch


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,loss", [("float16", "xent"), ("float32", "mse"), ("uint8", "xent")])
def test_torch_gpu_tensors_train_as_the_same_host_arrays_bit_for_bit(device, rng, dtype, loss):
    """A model trained on PyTorch tensors on the GPU (features kept there: fp16 as fp16, fp32 as fp32, bytes as
    pixels) equals the one trained on the same arrays from the host, bit for bit: parameters, metrics, predictions."""
    torch = _torch_on(device)
    n, f = 3000, 37
    x = (rng.integers(0, 256, (n, f)) if dtype == "uint8" else rng.standard_normal((n, f)) * 3).astype(dtype)
    y = (rng.standard_normal((n, 2)).astype(np.float32) if loss == "mse" else (x[:, :3].astype(np.float64).sum(1) > 0)
         .astype(np.int64) + (np.arange(n) % 3 == 0))
    split = 2500
    host = (x[:split], y[:split], x[split:], y[split:])
    on_gpu = tuple(torch.from_numpy(np.ascontiguousarray(a)).cuda() for a in host)  # targets too: read to the host
    recipe = Recipe(hidden=64, layers=2, batch=50, loss=loss, standardize=dtype != "uint8",
                    input_dtype="fp32" if dtype == "float32" else None)
    with Trainer(recipe, data=host, steps=120) as a, Trainer(recipe, data=on_gpu, steps=120) as b:
        assert b.data.on_gpu and not a.data.on_gpu
        a.fit()
        b.fit()
        for (wa, ba), (wb, bb) in zip(a.model.parameters(), b.model.parameters()):
            assert np.array_equal(wa, wb) and np.array_equal(ba, bb)
        ea, eb = a.evaluate(), b.evaluate()
        assert ea.loss == eb.loss and (ea.accuracy == eb.accuracy or np.isnan(ea.accuracy))
        assert np.array_equal(a.predict(x[split:]), b.predict(on_gpu[2]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("shape,bad", [((1, 1), (0, 0)), ((999, 13), (998, 12)), ((4096, 300), (1234, 5)),
                                       ((70000, 8), None)])
def test_a_value_that_is_not_finite_is_found_on_the_gpu(device, rng, dtype, shape, bad):
    """first_nonfinite over fresh random features: the first NaN or infinity by row and column, in one line; none
    where every value is finite (and a later bad value never hides an earlier one)."""
    torch = _torch_on(device)
    x = rng.standard_normal(shape).astype(dtype)
    if bad is not None:
        x[-1, -1] = np.inf  # after the NaN (or the same value, at one row and column): never the one found first
        x[bad] = np.nan
    t = torch.from_numpy(x).cuda()
    data = Dataset.from_arrays(t, np.arange(shape[0]) % 2, t, np.arange(shape[0]) % 2, classes=2)
    recipe = Recipe(hidden=32, layers=1, batch=1)
    if bad is None:
        with Trainer(recipe, data=data, steps=1) as tr:
            assert tr.data.on_gpu
        return
    with pytest.raises(DataError) as exc:
        Trainer(recipe, data=data, steps=1)
    assert f"the training set: row {bad[0]}, column {bad[1]}: nan (every value must be finite)" in _one_line(exc)
