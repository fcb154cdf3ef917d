"""The gather for tables of your own (cu/gather.cu: gather_table_*, kernels/gather.py: gather_table): what the
launcher binds on the CPU, and on the GPU every feature dtype, target kind and standardization against a float64
numpy reference, outputs poisoned first."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from rawgpu.contract import OPTIM_WORDS
from rawgpu.kernels import Kernels
from rawgpu.kernels import gather as kd
from rawgpu.runtime import driver
from rawgpu.runtime.memory import Arena, Tensor

import kernel_params  # beside this file: the kernels' parameters, read from their declarations

gpu = pytest.mark.gpu
DTYPES = (np.uint8, np.float16, np.float32)


class _Recorder:
    """Kernels on the CPU: each bind is (name, signature by the declaration, arguments)."""

    arch, activation = "sm_90", "relu"

    def get(self, source, name):
        signature = kernel_params.signature(source, name, integers=True)
        return type("K", (), {"bind": lambda _, grid, block, smem, *args, **kw: (name, signature, args, block)})()


def _tensors(dtype, features=20, n=50, outputs=None):
    a = Arena()
    return a, dict(
        x=a.tensor("x", (n, features), dtype),
        labels=a.tensor("labels", n, np.int32),
        values=a.tensor("values", (n, outputs or 3), np.float32),
        perm=a.tensor("perm", 40, np.int32), step=a.tensor("step", 1, np.int64),
        x_out=a.tensor("x_out", (10, 24), np.float16), y_labels=a.tensor("y_labels", 10, np.int32),
        y_values=a.tensor("y_values", (10, outputs or 3), np.float32),
        mean=a.tensor("mean", features, np.float32), inv_std=a.tensor("inv_std", features, np.float32),
        optim=a.tensor("optim", OPTIM_WORDS, np.float32))


@pytest.mark.parametrize("dtype,values,std", list(itertools.product(DTYPES, (False, True), (False, True))))
def test_each_variant_binds_its_kernels_parameters(dtype, values, std):
    _, t = _tensors(dtype)
    name, signature, args, block = kd.gather_table(
        _Recorder(), t["x"], t["values"] if values else t["labels"], t["perm"], t["step"], t["x_out"],
        t["y_values"] if values else t["y_labels"], 10, 4, mean=t["mean"] if std else None,
        inv_std=t["inv_std"] if std else None, optim=t["optim"], schedule=kd.Schedule(0.1, 0.0, 40, 0, "cosine"))
    kind = {np.uint8: "u8", np.float16: "f16", np.float32: "f32"}[dtype]
    assert name == f"gather_table_{kind}_{'values' if values else 'labels'}" + ("_std" if std else "")
    assert len(args) == len(signature) and block == 32
    for i, (letter, arg) in enumerate(zip(signature, args)):
        if letter == "p":
            assert isinstance(arg, Tensor) or arg == 0, (name, i, arg)
        else:
            driver._convert(letter, arg, i)
    assert args[2] == (3 if values else 1) and args[7] == 20 and args[8] == 24  # outputs, features, ld_out


def test_the_contract_names_every_instance_the_source_builds():
    from rawgpu import contract
    from rawgpu.runtime import compiler

    built = compiler.compile_source("gather.cu", "sm_90").signatures
    assert sorted(n for n in built if n.startswith("gather_table")) == sorted(contract.gather_table_kernels())
    assert len(contract.gather_table_kernels()) == 12
    assert sorted(n for n in built if n.startswith("column_")) == sorted(contract.column_kernels())


def test_bad_tensors_are_refused_naming_the_argument():
    a, t = _tensors(np.float32)
    k = _Recorder()
    call = lambda **kw: kd.gather_table(k, **{**dict(x=t["x"], targets=t["labels"], perm=t["perm"],  # noqa: E731
                                                      step=t["step"], x_out=t["x_out"], y_out=t["y_labels"],
                                                      batch=10, steps_per_epoch=4), **kw})
    call()
    with pytest.raises(TypeError, match="x: expected uint8, float16 or float32 features, got int32"):
        call(x=a.tensor("xi", (50, 20), np.int32))
    with pytest.raises(ValueError, match=r"x_out: row stride 16 must be >= 20"):
        call(x_out=a.tensor("narrow", (10, 16), np.float16))
    with pytest.raises(ValueError, match="give mean and inv_std together"):
        call(mean=t["mean"])
    with pytest.raises(ValueError, match=r"y_out: expected \[>= 10, 3\]"):
        call(targets=t["values"], y_out=a.tensor("yv", (10, 2), np.float32))
    with pytest.raises(TypeError, match="y_out"):
        call(targets=t["values"], y_out=t["y_labels"])
    with pytest.raises(ValueError, match=r"perm: needs 50 entries"):
        call(steps_per_epoch=5)
    assert kd.gather_table(k, t["x"], t["labels"], t["perm"], t["step"], a.tensor("w", (10, 16392), np.float16),
                           t["y_labels"], 10, 4)[3] == 1024  # wide rows: the threads loop over the columns


@pytest.fixture(scope="module")
def kern(device):
    return Kernels(device.arch)


def _reference(x: np.ndarray, mean, inv_std) -> np.ndarray:
    """The kernel's arithmetic in float64: u8 / 255, then (v - mean) * inv_std."""
    v = x.astype(np.float64) / 255.0 if x.dtype == np.uint8 else x.astype(np.float64)
    return v if mean is None else (v - mean.astype(np.float64)) * inv_std.astype(np.float64)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("values", [False, True])
@pytest.mark.parametrize("std", [False, True])
@pytest.mark.parametrize("features,ld", [(1, 8), (7, 8), (28, 32), (54, 56), (768, 768), (3072, 3072), (9000, 9000)])
@pytest.mark.parametrize("early", [False, True])
def test_gather_table_against_float64(kern, device, stream, rng, dtype, values, std, features, ld, early):
    n, batch, spe, outputs = 300, 37, 3, 5
    x = (rng.integers(0, 256, (n, features)) if dtype == np.uint8 else rng.normal(0, 3, (n, features))).astype(dtype)
    labels = rng.integers(0, 1000, n).astype(np.int32)
    targets = rng.normal(size=(n, outputs)).astype(np.float32)
    mean = rng.normal(size=features).astype(np.float32) if std else None
    inv_std = rng.uniform(0.2, 3.0, features).astype(np.float32) if std else None
    perm = rng.permutation(n)[:batch * spe].astype(np.int32)
    step_value = 2 * spe + 1
    with Arena() as arena:
        tx = arena.tensor("x", x.shape, dtype)
        tt = arena.tensor("t", targets.shape, np.float32) if values else arena.tensor("t", n, np.int32)
        tp, ts = arena.tensor("perm", perm.shape, np.int32), arena.tensor("step", 1, np.int64)
        tm = arena.tensor("mean", features, np.float32) if std else None
        ti = arena.tensor("inv_std", features, np.float32) if std else None
        x_out = arena.tensor("x_out", (batch + 1, ld), np.float16)
        y_out = arena.tensor("y", (batch + 1, outputs), np.float32) if values else arena.tensor("y", batch + 1, np.int32)
        arena.allocate()
        tx.upload(x), tt.upload(targets if values else labels), tp.upload(perm)
        ts.upload(np.array([step_value], np.int64))
        if std:
            tm.upload(mean), ti.upload(inv_std)
        x_out.fill_bytes(0xFF), y_out.fill_bytes(0xFF)  # poisoned: NaN / -1
        device.synchronize()
        kd.gather_table(kern, tx, tt, tp, ts, x_out, y_out, batch, spe, mean=tm, inv_std=ti, early=early).run(stream)
        got_x, got_y = x_out.download(), y_out.download()
    src = perm[(step_value % spe) * batch:][:batch]
    ref = _reference(x[src], mean, inv_std)
    got = got_x[:batch, :features].astype(np.float64)
    # fp16 output: within half an fp16 ulp of the float64 value (2^-25 in fp16's subnormal range), plus the fp32
    # steps before it: each a few 2^-24 of the terms it combined (v and mean before the subtraction cancels them)
    v = _reference(x[src], None, None)
    terms = np.abs(ref) if not std else (np.abs(v) + np.abs(mean)) * inv_std + np.abs(ref)
    tol = np.maximum(np.abs(ref) * 2.0 ** -11 * 1.001, 2.0 ** -25) + terms * 2.0 ** -22
    assert np.all(np.abs(got - ref) <= tol), float(np.max(np.abs(got - ref) / tol))
    if not std:  # without standardization the value is exact before the one rounding to fp16: bit for bit
        exact = (x[src].astype(np.float32) * np.float32(1 / 255) if dtype == np.uint8 else x[src].astype(np.float32))
        assert np.array_equal(got_x[:batch, :features].view(np.uint16), exact.astype(np.float16).view(np.uint16))
    assert np.all(got_x[:batch, features:].view(np.uint16) == 0), "padding columns must be zero"
    assert np.all(got_x[batch].view(np.uint16) == 0xFFFF), "wrote past the batch"
    if values:
        assert np.array_equal(got_y[:batch], targets[src]) and np.all(np.isnan(got_y[batch]))
    else:
        assert np.array_equal(got_y[:batch], labels[src]) and got_y[batch] == -1


def test_column_scaling_binds_its_kernels_parameters_and_checks_its_tensors():
    a = Arena()
    x, mean, inv = a.tensor("x", (5000, 40), np.float16), a.tensor("m", 40, np.float32), a.tensor("i", 40, np.float32)
    partial = a.tensor("p", (3, 2, 40), np.float64)
    sums, scaling = kd.column_scaling(_Recorder(), x, mean, inv, partial)
    for name, signature, args, block in (sums, scaling):
        assert len(args) == len(signature) and block == kd.COLUMN_THREADS
    assert (sums[0], scaling[0]) == ("column_sums_f16", "column_scaling_f16")
    assert scaling[2][3] == 3  # the chunks the sums were cut into
    with pytest.raises(ValueError, match=r"partial: expected \[chunks, 2, 40\]"):
        kd.column_scaling(_Recorder(), x, mean, inv, a.tensor("q", (3, 40), np.float64))
    with pytest.raises(TypeError, match="mean"):
        kd.column_scaling(_Recorder(), x, a.tensor("m64", 40, np.float64), inv, partial)
    assert kd.column_chunks(10, 5, 132) == 1 and kd.column_chunks(10**7, 28, 132) == 528
    assert kd.column_chunks(10**6, 16384, 132) == 2


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,features", [(1, 1), (5, 7), (4097, 33), (100_000, 28), (20_000, 768)])
def test_column_scaling_against_float64(kern, device, stream, rng, dtype, rows, features):
    """Mean and 1 / std of every column over every row (columns far from 0, and a constant one), within float32's
    rounding of the float64 values; the same bits twice (the sums' order is fixed)."""
    if dtype == np.uint8:
        x = rng.integers(0, 256, (rows, features)).astype(np.uint8)
    else:
        x = (rng.normal(0, 1, (rows, features)) * rng.uniform(0.01, 50, features)
             + rng.normal(0, 300, features)).astype(dtype)
    x[:, 0] = x[0, 0]  # a constant column: its std is 0, its inv_std 1
    v = x.astype(np.float32) * np.float32(1 / 255) if dtype == np.uint8 else x.astype(np.float32)
    v = v.astype(np.float64)
    mean, std = v.mean(axis=0), v.std(axis=0)
    chunks = kd.column_chunks(rows, features, device.sm_count)
    with Arena() as arena:
        tx = arena.tensor("x", x.shape, dtype)
        tm, ti = arena.tensor("mean", features, np.float32), arena.tensor("inv", features, np.float32)
        partial = arena.tensor("partial", (chunks, 2, features), np.float64)
        arena.allocate()
        tx.upload(x)
        got = []
        for _ in range(2):
            tm.fill_bytes(0xFF), ti.fill_bytes(0xFF), partial.fill_bytes(0xFF)  # poisoned: NaN
            for launch in kd.column_scaling(kern, tx, tm, ti, partial):
                launch.run(stream)
            stream.synchronize()
            got.append((tm.download(), ti.download()))
    (m, inv), (m2, inv2) = got
    assert np.array_equal(m.view(np.uint32), m2.view(np.uint32)) and np.array_equal(inv.view(np.uint32),
                                                                                    inv2.view(np.uint32))
    assert np.all(np.abs(m - mean) <= np.abs(mean) * 2.0 ** -23 + std * 1e-9 + 1e-30), np.max(np.abs(m - mean))
    expect = np.where(std > 0, 1.0 / np.where(std > 0, std, 1.0), 1.0)
    assert inv[0] == 1.0
    assert np.allclose(inv, expect, rtol=2.0 ** -22, atol=0), np.max(np.abs(inv / expect - 1))
