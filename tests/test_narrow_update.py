"""A narrow first layer's update (cu/narrow_update.cu, kernels/narrow_update.py): the plan, the launcher's checks and
the layered step's use of it on the CPU; every optimiser's step on the master, its state and the bias against float64
on the GPU, bitwise repeatable."""

from __future__ import annotations

import numpy as np
import pytest

from rawgpu.contract import OPTIM_WORDS
from rawgpu.kernels import narrow_update as kn
from rawgpu.model import master, optimizer
from rawgpu.model.recipe import Recipe
from rawgpu.runtime import driver
from rawgpu.runtime.memory import Arena, Tensor
from rawgpu.steps import plan_model

from optim_reference import OPTIMIZERS, check_layer_update, fresh_layer
from test_gather_table import _Recorder
from test_steps import _BindingKernels

gpu = pytest.mark.gpu


def test_the_plan_takes_narrow_layers_at_the_short_forms_batches():
    assert kn.plan_narrow_update(128, 16, 256, "sgd", 132) == kn.NarrowPlan(128, 16, 256, "sgd")
    assert kn.plan_narrow_update(256, 64, 512, "adamw", 132).family == "adam"  # 16 x 8 blocks
    for B, K, N in [(257, 16, 256), (0, 16, 256), (128, 72, 256), (128, 12, 256), (128, 16, 250)]:
        assert kn.plan_narrow_update(B, K, N, "sgd", 132) is None, (B, K, N)
    assert kn.plan_narrow_update(128, 56, 1024, "sgd", 132) is None, "32 x 7 blocks: a second wave"
    assert kn.plan_narrow_update(128, 56, 1024, "sgd", 224) is not None
    p = kn.plan_narrow_update(256, 64, 256, "sgd", 132)
    assert p.smem_bytes == 2 * 256 * (8 + 32) <= 48 * 1024, "the block's x and dy columns fit without an opt-in"
    assert kn.plan_narrow_update(16, 8, 256, "sgd", 132).smem_bytes == kn.SUMS_BYTES <= 48 * 1024
    assert p.workspace_floats == p.tickets == 0


def _layer(a: Arena, B=10, K=16, N=64, states=1):
    t = dict(x=a.tensor("x", (B, K), np.float16), dy=a.tensor("dy", (B, N), np.float16),
             wlo=a.tensor("wlo", (K, N), np.int16), w16=a.tensor("w16", (K, N), np.float16),
             optim=a.tensor("optim", OPTIM_WORDS, np.float32), bias=a.tensor("bias", N, np.float32))
    for i, name in enumerate(("mw", "vw")[:states]):
        t[name] = a.tensor(name, (K, N), np.float32)
        t[name.replace("w", "b")] = a.tensor(name.replace("w", "b"), N, np.float32)
    return t


@pytest.mark.parametrize("family,states", [("sgd", 0), ("sgd", 1), ("adam", 2)])
def test_each_family_binds_its_kernels_parameters(family, states):
    a = Arena()
    t = _layer(a, states=states)
    plan = kn.NarrowPlan(10, 16, 64, family)
    name, signature, args, block = kn.narrow_update(_Recorder(), plan, t["x"], t["dy"], t["wlo"], t["w16"],
                                                    t["optim"], mw=t.get("mw"), vw=t.get("vw"), bias=t["bias"],
                                                    mb=t.get("mb"), vb=t.get("vb"))
    assert name == f"narrow_update_{family}" and len(args) == len(signature) and block == kn.NU_THREADS
    for i, (letter, arg) in enumerate(zip(signature, args)):
        if letter == "p":
            assert isinstance(arg, Tensor) or arg == 0, (name, i, arg)
        else:
            driver._convert(letter, arg, i)
    assert args[1:7] == (16, t["dy"], 64, 10, 16, 64)  # ldx, dy, lddy, B, K, N
    assert (args[9] != 0) == (states > 0) and (args[10] != 0) == (states > 1)


def test_bad_tensors_are_refused_naming_the_argument():
    a = Arena()
    t = _layer(a, states=2)
    sgd, adam = kn.NarrowPlan(10, 16, 64, "sgd"), kn.NarrowPlan(10, 16, 64, "adam")
    call = lambda plan=sgd, **kw: kn.narrow_update(_Recorder(), plan, **{  # noqa: E731
        **dict(x=t["x"], dy=t["dy"], wlo=t["wlo"], w16=t["w16"], optim=t["optim"]), **kw})
    call()
    refused = [(dict(x=a.tensor("x8", (10, 8), np.float16)), ValueError, r"x: expected \[>= 10, 16\]"),
               (dict(dy=a.tensor("dy9", (9, 64), np.float16)), ValueError, r"dy: expected \[>= 10, 64\]"),
               (dict(w16=a.tensor("w16b", (16, 72), np.float16)), ValueError, r"w16: expected shape \(16, 64\)"),
               (dict(wlo=a.tensor("wlo32", (16, 64), np.float32)), TypeError, "wlo: expected dtype int16"),
               (dict(plan=adam, mw=t["mw"]), ValueError, "Adam's rule needs both moments"),
               (dict(mw=t["mw"], vw=t["vw"]), ValueError, "SGD's rule keeps no second moment"),
               (dict(mb=t["mb"]), ValueError, "a bias state without the bias")]
    for kw, error, message in refused:
        with pytest.raises(error, match=message):
            call(**kw)


def _table(inputs: int, **kw) -> Recipe:
    return Recipe(**{**dict(hidden=256, batch=128, inputs=inputs, classes=7, input_dtype="fp16", train_rows=10_000,
                            test_rows=100), **kw})


@pytest.mark.parametrize("recipe,narrow", [
    (_table(8, classes=1, loss="mse"), True), (_table(54, optimizer="adam"), True),
    (_table(28, batch=32, momentum=0.0), True),  # instead of dx_sgd's pass
    (_table(64, hidden=(96, 32)), True), (_table(72), False), (_table(8, batch=512), False),  # no short form
    (_table(54, hidden=1024), False),  # 32 x 7 blocks: more than one wave of 132 SMs
    (Recipe(hidden=256), False)])  # MNIST's 784 inputs
def test_the_short_forms_narrow_first_layer_updates_in_one_small_kernel(monkeypatch, recipe, narrow):
    """On sm_90's short form a first layer of at most 64 padded inputs takes narrow_update (its unit named, the
    launch count unchanged); elsewhere the first layer keeps its one pass or its GEMMs."""
    monkeypatch.setattr("rawgpu.runtime.driver.tensor_map_2d", lambda *a: bytes(128))
    model = plan_model(recipe, "layered", arch="sm_90")
    assert isinstance(model.step.plans[0].bwd, kn.NarrowPlan) == narrow
    assert any(u[0] == kn.SRC for u in model.step.kernel_units()) == narrow
    model.arena.base, model.arena._allocated = 1 << 40, True
    model.k = _BindingKernels("sm_90")
    names = [b[0] for b in model.step._one_step()]
    assert len(names) == model.step.kernel_count()
    assert (names[-1].startswith("narrow_update_")) == narrow, names
    if narrow:
        assert sum(n.startswith("narrow_update_") for n in names) == 1


@pytest.fixture(scope="module")
def kernels(device):
    from rawgpu.kernels import Kernels

    return Kernels(device.arch)


@gpu
@pytest.mark.parametrize("B,K,N,opt", [(128, 16, 256, "momentum"), (128, 56, 1024, "adam"), (32, 32, 520, "plain"),
                                       (256, 64, 64, "nesterov"), (37, 8, 40, "adamw"), (128, 16, 256, "adam")])
def test_against_float64(device, stream, kernels, rng, B, K, N, opt):
    """The master, its state and the bias after one step against float64 (the tolerances of dx_update's test: the
    same rule, x^T @ dy summed in fp32), twice from the same state to the same bytes."""
    from gpu_checks import assert_same_bytes, run_twice

    plan = kn.plan_narrow_update(B, K, N, OPTIMIZERS[opt].optimizer, 1 << 20)
    o, w, b, held = fresh_layer(rng, opt, B, K, N)
    x = rng.normal(0, 1, (B, K)).astype(np.float16)  # standardized table features
    dy = rng.uniform(-1, 1, (B, N)).astype(np.float16)
    with Arena() as arena:
        tx, tdy = arena.tensor("x", (B, K), np.float16), arena.tensor("dy", (B, N), np.float16)
        twlo, tw16 = arena.tensor("wlo", (K, N), np.int16), arena.tensor("w16", (K, N), np.float16)
        topt, tb = arena.tensor("optim", (OPTIM_WORDS,), np.float32), arena.tensor("b", (N,), np.float32)
        tstate = {name: arena.tensor(name, a.shape, np.float32) for name, a in held}
        arena.allocate()
        tx.upload(x)
        tdy.upload(dy)
        topt.upload(optimizer.words(o))
        launch = kn.narrow_update(kernels, plan, tx, tdy, twlo, tw16, topt, mw=tstate.get("mw"), vw=tstate.get("vw"),
                                  bias=tb, mb=tstate.get("mb"), vb=tstate.get("vb"))
        hi, lo = master.split(w)
        state = [(twlo, lo), (tw16, hi), (tb, b)] + [(tstate[name], a) for name, a in held]
        runs = run_twice(launch, stream, state, [], [twlo, tw16, tb] + [tstate[name] for name, _ in held])
    for wlo, w16, b_new, *got_state in runs:
        check_layer_update(o, x, dy, w, b, held, wlo, w16, b_new, got_state)
    assert_same_bytes(runs)
