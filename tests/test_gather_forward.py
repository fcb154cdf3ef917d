"""The table gather with the first layer's forward in one launch (cu/gather_forward.cu, kernels/gather_forward.py):
what the launcher binds and refuses on the CPU, the rule that folds a step's gather and first layer, and on the GPU
every feature dtype, target kind and standardization at several widths against a float64 reference and against
gather_table's own bits, outputs poisoned first."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from rawgpu import contract
from rawgpu.kernels import gather as kd
from rawgpu.kernels import gather_forward as kgf
from rawgpu.model.recipe import Recipe
from rawgpu.runtime import driver
from rawgpu.runtime.memory import Arena, Tensor
from rawgpu.steps import StepOptions, plan_model

import mlp_reference as ref  # beside this file
from test_gather_table import DTYPES, _Recorder, _reference, _tensors
from test_steps import _BindingKernels

gpu = pytest.mark.gpu


def _layer(a: Arena, ld: int, n: int, rows: int = 10):
    return dict(w16=a.tensor("w16", (ld, n), np.float16), bias=a.tensor("bias", n, np.float32),
                h=a.tensor("h", (rows, n), np.float16), slope=a.tensor("slope", (rows, n), np.float16))


@pytest.mark.parametrize("dtype,values,std", list(itertools.product(DTYPES, (False, True), (False, True))))
def test_each_variant_binds_its_kernels_parameters(dtype, values, std):
    a, t = _tensors(dtype)
    lay = _layer(a, 24, 520)
    name, signature, args, block = kgf.gather_forward(
        _Recorder(), t["x"], t["values"] if values else t["labels"], t["perm"], t["step"], t["x_out"],
        t["y_values"] if values else t["y_labels"], 10, 4, lay["w16"], lay["bias"], lay["h"], slope=lay["slope"],
        mean=t["mean"] if std else None, inv_std=t["inv_std"] if std else None, optim=t["optim"],
        schedule=kd.Schedule(0.1, 0.0, 40, 0, "cosine"), early=True)
    kind = {np.uint8: "u8", np.float16: "f16", np.float32: "f32"}[dtype]
    assert name == f"gather_forward_{kind}_{'values' if values else 'labels'}" + ("_std" if std else "")
    assert len(args) == len(signature) and block == contract.GF_THREADS
    for i, (letter, arg) in enumerate(zip(signature, args)):
        if letter == "p":
            assert isinstance(arg, Tensor) or arg == 0, (name, i, arg)
        else:
            driver._convert(letter, arg, i)
    assert args[2] == (3 if values else 1) and args[7] == 20 and args[8] == 24 and args[19] == 1  # early
    assert args[20] is lay["w16"] and args[22] == 520 and args[23] is lay["h"] and args[24] is lay["slope"]


def test_the_contract_names_every_instance_the_source_builds():
    from rawgpu.runtime import compiler

    built = compiler.compile_source(kgf.SRC, "sm_90").signatures
    assert sorted(built) == sorted(contract.gather_forward_kernels()) and len(built) == 12
    # a thread gathers 8 entries of a row: every entry of the block's rows has a thread
    assert contract.GF_ROWS * contract.GF_MAX_INPUTS // 8 <= contract.GF_THREADS


def test_bad_tensors_are_refused_naming_the_argument():
    a, t = _tensors(np.float32)
    lay = _layer(a, 24, 64)
    base = dict(x=t["x"], targets=t["labels"], perm=t["perm"], step=t["step"], x_out=t["x_out"], y_out=t["y_labels"],
                batch=10, steps_per_epoch=4, **{k: lay[k] for k in ("w16", "bias", "h")})
    call = lambda **kw: kgf.gather_forward(_Recorder(), **{**base, **kw})  # noqa: E731
    call()
    with pytest.raises(ValueError, match=r"w16: expected \[24, N\] with N even, got shape \(16, 64\)"):
        call(w16=a.tensor("w_short", (16, 64), np.float16))
    with pytest.raises(ValueError, match=r"w16: expected \[24, N\] with N even"):
        call(w16=a.tensor("w_odd", (24, 63), np.float16))
    with pytest.raises(ValueError, match=r"bias"):
        call(bias=a.tensor("b_short", 32, np.float32))
    with pytest.raises(ValueError, match=r"h: expected \[>= 10, 64\]"):
        call(h=a.tensor("h_short", (9, 64), np.float16))
    with pytest.raises(ValueError, match=r"slope: expected \[>= 10, 64\]"):
        call(slope=a.tensor("s_wide", (10, 72), np.float16))
    with pytest.raises(ValueError, match=r"rows of at most 64 inputs, got x_out's stride 72"):
        call(x=a.tensor("x72", (50, 72), np.float32), x_out=a.tensor("xo72", (10, 72), np.float16),
             w16=a.tensor("w72", (72, 64), np.float16))
    with pytest.raises(ValueError, match="gather_forward: give mean and inv_std together"):
        call(mean=t["mean"])
    with pytest.raises(TypeError, match="x: expected uint8, float16 or float32 features"):
        call(x=a.tensor("xi", (50, 20), np.int32))


def _table(inputs: int, **kw) -> Recipe:
    return Recipe(**{**dict(hidden=256, batch=128, inputs=inputs, classes=7, input_dtype="fp16", train_rows=10_000,
                            test_rows=100), **kw})


@pytest.mark.parametrize("arch", ["sm_86", "sm_90"])
@pytest.mark.parametrize("recipe,folds", [
    (_table(8, classes=1, loss="mse"), True), (_table(54, hidden=1024), True),
    (_table(28, hidden=512, batch=1024, classes=2, standardize=True), True), (_table(64, hidden=(96, 32)), True),
    (_table(72), False),  # wider than GF_MAX_INPUTS
    (_table(64, hidden=4096, batch=1024), False),  # more multiply-adds than MAX_MACS
    (_table(32, hidden=1024, batch=1024), False),  # 2^25: past MAX_MACS, where higgs-like's 2^24 is
    (_table(8, accum="fp16"), False),  # the kernel accumulates in fp32
    (_table(8, layers=1), "sm_86"),  # on sm_90 the head kernel would follow it, reading the targets before its wait
    (_table(8, layers=1, batch=512), True),  # no head kernel above batch 256
    (Recipe(hidden=256), False)])  # MNIST's pixels: gather_batch
def test_a_narrow_tables_gather_and_first_layer_are_one_launch(monkeypatch, arch, recipe, folds):
    """The layered step folds where kgf.folds says: its first launch is gather_forward (no gather, no first forward
    GEMM), one launch fewer, its units name gather_forward.cu; StepOptions(fold=False) keeps the two launches."""
    monkeypatch.setattr("rawgpu.runtime.driver.tensor_map_2d", lambda *a: bytes(128))
    folds = folds is True or folds == arch
    names = {}
    for fold in (True, False):
        model = plan_model(recipe, "layered", arch=arch, options=StepOptions(fold=fold))
        model.arena.base, model.arena._allocated = 1 << 40, True
        model.k = _BindingKernels(arch)
        step = model.step._one_step()
        names[fold] = [b[0] for b in step]
        assert model.step.kernel_count() == len(step)
        assert ((kgf.SRC, None) in model.step.kernel_units()) == (fold and folds)
        if fold and folds:
            assert names[fold][0].startswith("gather_forward_"), names[fold]
            packed = step[0][1].values
            assert packed[20].value == model.layers[0].w16.ptr and packed[23].value == model.acts[1].ptr
    if folds:
        assert len(names[True]) == len(names[False]) - 1
        assert names[False][0].startswith("gather_table") and names[True][1:] == names[False][2:]
    else:
        assert names[True] == names[False]


def _run(k, stream, x, targets, values, mean, inv_std, perm, step_value, batch, spe, ld, w, b, early) -> dict:
    """gather_forward's outputs (x_out, y_out, optim, h, slope) and gather_table's (x_out, y_out, optim) from the same
    state, every output poisoned first (the optimiser table's step values NaN, its kind SGD)."""
    std = mean is not None
    with Arena() as arena:
        tx = arena.tensor("x", x.shape, x.dtype)
        tt = arena.tensor("t", targets.shape, targets.dtype)
        tp, ts = arena.tensor("perm", perm.shape, np.int32), arena.tensor("step", 1, np.int64)
        tm = arena.tensor("mean", x.shape[1], np.float32) if std else None
        ti = arena.tensor("inv_std", x.shape[1], np.float32) if std else None
        tw, tb = arena.tensor("w16", w.shape, np.float16), arena.tensor("b", w.shape[1], np.float32)
        made = {who: dict(x_out=arena.tensor(f"x_out_{who}", (batch + 1, ld), np.float16),
                          y_out=arena.tensor(f"y_{who}", (batch + 1,) + targets.shape[1:], targets.dtype),
                          optim=arena.tensor(f"optim_{who}", contract.OPTIM_WORDS, np.float32))
                for who in ("fold", "gather")}
        made["fold"]["h"] = arena.tensor("h", (batch + 1, w.shape[1]), np.float16)
        made["fold"]["slope"] = arena.tensor("slope", (batch + 1, w.shape[1]), np.float16)
        arena.allocate()
        tx.upload(x), tt.upload(targets), tp.upload(perm), tw.upload(w), tb.upload(b)
        ts.upload(np.array([step_value], np.int64))
        if std:
            tm.upload(mean), ti.upload(inv_std)
        table = np.zeros(contract.OPTIM_WORDS, np.float32)
        table[:4] = np.nan  # lr, step_size, bias2, decay_rate: the step's values the gathers write
        for m in made.values():
            for t in m.values():
                t.fill_bytes(0xFF)  # poisoned: NaN / -1
            m["optim"].upload(table)
        schedule = kd.Schedule(0.1, 0.001, 50, 3, "cosine")
        f, g = made["fold"], made["gather"]
        kgf.gather_forward(k, tx, tt, tp, ts, f["x_out"], f["y_out"], batch, spe, tw, tb, f["h"], slope=f["slope"],
                           mean=tm, inv_std=ti, optim=f["optim"], schedule=schedule, early=early).run(stream)
        kd.gather_table(k, tx, tt, tp, ts, g["x_out"], g["y_out"], batch, spe, mean=tm, inv_std=ti, optim=g["optim"],
                        schedule=schedule).run(stream)
        stream.synchronize()
        return {who: {name: t.download() for name, t in m.items()} for who, m in made.items()}


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("values,std", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("features,ld,n,batch", [(1, 8, 16, 37), (7, 8, 256, 128), (28, 32, 520, 300),
                                                 (54, 56, 1024, 128), (64, 64, 72, 9)])
@pytest.mark.parametrize("activation,early", [("relu", False), ("relu", True), ("gelu", True)])
def test_gather_forward_against_float64(kernels_for, device, stream, rng, dtype, values, std, features, ld, n, batch,
                                        activation, early):
    """x_out, y_out and the optimiser's step values are gather_table's, bit for bit; h is act(x_out W + b) within
    fp16's rounding of the float64 value and fp32's sum of ld products; where the activation saves its slope
    (gelu), the slope is act'(z) likewise; rows past the batch are not written."""
    spe, outputs, rows = 3, 5, 400
    x = (rng.integers(0, 256, (rows, features)) if dtype == np.uint8
         else rng.normal(0, 3, (rows, features))).astype(dtype)
    targets = rng.normal(size=(rows, outputs)).astype(np.float32) if values else \
        rng.integers(0, 1000, rows).astype(np.int32)
    mean = rng.normal(size=features).astype(np.float32) if std else None
    inv_std = rng.uniform(0.2, 3.0, features).astype(np.float32) if std else None
    perm = rng.permutation(rows)[:batch * spe].astype(np.int32) if batch * spe <= rows else \
        rng.integers(0, rows, batch * spe).astype(np.int32)
    w = np.zeros((ld, n), np.float16)
    w[:features] = rng.normal(0, 1 / np.sqrt(features), (features, n))
    b = rng.normal(0, 0.5, n).astype(np.float32)
    got = _run(kernels_for(activation), stream, x, targets, values, mean, inv_std, perm, 2 * spe + 1, batch, spe, ld,
               w, b, early)
    fold, gather = got["fold"], got["gather"]
    for name in ("x_out", "y_out", "optim"):
        assert fold[name].tobytes() == gather[name].tobytes(), f"{name} differs from gather_table's"
    assert np.isfinite(fold["optim"][:4]).all()
    src = perm[(2 * spe + 1) % spe * batch:][:batch]
    xs = fold["x_out"][:batch].astype(np.float64)
    assert np.allclose(xs[:, :features], _reference(x[src], mean, inv_std), rtol=2.0 ** -10, atol=2.0 ** -14)
    z = xs @ w.astype(np.float64) + b.astype(np.float64)
    act, slope = ref.ACTIVATIONS[activation]
    want = act(z)
    # fp32 sums of ld exact products and the bias: each step's rounding at most 2^-24 of the running magnitude
    err = (ld + 2) * 2.0 ** -24 * (np.abs(xs) @ np.abs(w.astype(np.float64)) + np.abs(b))
    lip = 1.2  # |act'| <= 1.13 for gelu, 1 for relu
    h = fold["h"][:batch].astype(np.float64)
    tol = np.abs(want) * 2.0 ** -11 + 2.0 ** -25 + lip * err + 1e-6 * (activation != "relu")
    assert np.all(np.abs(h - want) <= tol), float(np.max(np.abs(h - want) / tol))
    assert np.all(fold["h"][batch].view(np.uint16) == 0xFFFF), "wrote past the batch"
    if activation == "gelu":  # act' saved: within fp16 and the slope's own change over the sum's error
        d = slope(z, want)
        s = fold["slope"][:batch].astype(np.float64)
        assert np.all(np.abs(s - d) <= np.abs(d) * 2.0 ** -11 + 2.0 ** -24 + 0.5 * err + 1e-6)
        assert np.all(fold["slope"][batch].view(np.uint16) == 0xFFFF)
    else:
        assert np.all(fold["slope"].view(np.uint16) == 0xFFFF), "relu saves no slope"


@gpu
@pytest.mark.parametrize("task", [dict(loss="mse", outputs=1), dict(classes=7)])
def test_a_graph_of_folded_steps_trains_as_steps_launched_one_at_a_time(device, stream, kernels_for, rng, task):
    """gather_forward reads the first layer's weight and bias, which the kernel before it updates while it is already
    resident (overlapping launch): a graph of 100 such steps, each starting under the one before, ends with the bits
    of the same steps launched one at a time with a synchronize between them (a read of a step-old copy would not)."""
    from rawgpu.kernels.gemm import sm90_or_later
    from rawgpu.model.mlp import target_scaling
    from rawgpu.runtime.graph import capture
    from rawgpu.training.trainer import fit_to_data
    from test_tables_gpu import fake_table

    data = fake_table(rng, 4096, 8, "float32", classes=task.get("classes", 0), outputs=task.get("outputs", 1))
    recipe = fit_to_data(Recipe(hidden=256, layers=3, batch=128, momentum=0.9, lr=0.05, schedule="constant",
                                loss=task.get("loss", "xent"), input_dtype="fp16", standardize=True,
                                seed=int(rng.integers(1 << 30))), data)
    model = plan_model(recipe, "layered", kernels=kernels_for("relu"), sm_count=device.sm_count).allocate()
    try:
        assert model.step.fold and model.step.overlap == sm90_or_later(device.arch)
        if recipe.regression:
            model.set_target_scaling(*target_scaling(data.train_labels))
        model.upload_data(data)
        model.compute_scaling(stream)
        model.set_permutation(rng.permutation(recipe.train_rows).astype(np.int32))
        runs = []
        for graphed in (False, True):
            model.init_parameters(stream)
            if graphed:
                launches = model.step_launches(100)
                graph = capture(stream, lambda: [launch.run(stream) for launch in launches])
                for _ in range(2):
                    graph.launch(stream)
                graph.close()
            else:
                for _ in range(200):
                    for launch in model.step_launches(1):
                        launch.run(stream)
                    stream.synchronize()
            stream.synchronize()
            runs.append((model.parameters(), model.optimizer_state(), model.step_count()))
        (p0, s0, n0), (p1, s1, n1) = runs
        assert n0 == n1 == 200
        for i, ((w0, b0), (w1, b1)) in enumerate(zip(p0, p1)):
            assert w0.tobytes() == w1.tobytes() and b0.tobytes() == b1.tobytes(), f"layer {i} differs"
        assert set(s0) == set(s1)
        for name in s0:
            for (a0, c0), (a1, c1) in zip(s0[name], s1[name]):
                assert a0.tobytes() == a1.tobytes() and c0.tobytes() == c1.tobytes(), f"{name} differs"
    finally:
        model.arena.close()
