"""The head's step in one cluster kernel (head.cu): the plan on CPU; every output against float64 on GPU."""

from __future__ import annotations

import numpy as np
import pytest

from rawgpu import contract
from rawgpu.model import master, optimizer
from rawgpu.contract import OPTIM_WORDS
from rawgpu.kernels import head as H

from optim_reference import OPTIMIZERS, check_master_update, random_state, rel, table, update_reference

# --- CPU ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss,task", [("xent", "xent"), ("mse", "regression")])
def test_plan_covers_the_rows_with_whole_16_row_slices_that_fit(loss, task):
    kc_of = lambda K, ctas: -(-(-(-K // ctas)) // 16) * 16  # noqa: E731
    for B in (1, 32, 33, 100, 128, 200, 256):
        for K in (8, 16, 104, 1000, 1024, 2048, 2056, 4096, 8192, 16384):
            p = H.plan_head(B, K, loss=loss)
            ctas = H.PORTABLE_CTAS if K <= 2048 else H.MAX_CTAS
            if K <= 2048 and contract.head_smem_bytes(H.batch_tile(B), kc_of(K, ctas), task) > H.SMEM_LIMIT:
                ctas = H.MAX_CTAS  # the portable cluster's rows do not fit: 16 CTAs
            if p is None:
                assert contract.head_smem_bytes(H.batch_tile(B), kc_of(K, ctas), task) > H.SMEM_LIMIT, (B, K)
                continue
            assert p.task == task
            assert p.rows >= B and p.kc % 16 == 0 and p.smem_bytes <= H.SMEM_LIMIT
            if K > 16:
                assert (p.ctas - 1) * p.kc < K <= p.ctas * p.kc, "a CTA would hold no rows, or rows would be left over"
            else:
                assert (p.ctas, p.kc) == (H.MIN_CTAS, 16), "a cluster launch, its second CTA without rows"
            assert p.ctas <= ctas
    assert H.plan_head(256, 2048, loss="mse").ctas == H.MAX_CTAS, "a regression's targets take more shared memory"
    assert H.plan_head(32, 16384) is not None and H.plan_head(128, 8192) is not None
    assert H.plan_head(32, 24576) is None, "past what 16 CTAs hold the head runs as separate kernels"
    assert H.plan_head(256, 8192) is None


def test_the_instance_is_the_smallest_batch_tile_and_the_optimisers_family():
    assert H.plan_head(1, 256).kernel == "head_step_b32_sgd"
    assert H.plan_head(33, 256, "sgd").kernel == "head_step_b64_sgd"
    assert H.plan_head(128, 256, "adam").kernel == "head_step_b128_adam"
    assert H.plan_head(129, 256, "adamw").kernel == "head_step_b256_adam"
    assert H.plan_head(128, 256, "adam", loss="huber").kernel == "head_step_b128_adam_regression"
    assert set(contract.head_kernels()) == set(contract.split_kernels(H.SOURCE))
    # the models step's build (head_models.cu) makes cross-entropy's instances only
    assert set(contract.split_kernels(contract.HEAD_MODELS_SOURCE)) == set(contract.head_kernels(("xent",)))


def test_a_regression_head_holds_its_targets_and_error_sums():
    """The regression's instance keeps each row's 16 fp32 targets and two error sums where cross-entropy keeps a label
    and a hit; the rest of the layout is the same."""
    for rows in contract.HEAD_BATCHES:
        extra = rows * 4 * (contract.HEAD_CLASSES - 1) + rows * 4
        assert contract.head_smem_fixed(rows, "regression") == contract.head_smem_fixed(rows) + extra
        assert contract.head_smem_per_row(rows, "regression") == contract.head_smem_per_row(rows)
    with pytest.raises(ValueError, match="unknown loss"):
        H.plan_head(32, 64, loss="hinge")


def test_only_sm90_fp32_batches_up_to_256_with_16_padded_classes_fuse():
    assert H.unsupported_reason(32, "f32", 16, "sm_90") is None and H.unsupported_reason(256, "f32", 16, "sm_100") is None
    assert "sm_90" in H.unsupported_reason(32, "f32", 16, "sm_86")
    assert "batch <= 256" in H.unsupported_reason(257, "f32", 16, "sm_90")
    assert "fp32" in H.unsupported_reason(32, "f16", 16, "sm_90")
    assert "16 padded classes" in H.unsupported_reason(32, "f32", 24, "sm_90")


@pytest.mark.parametrize("kw,msg", [(dict(B=257, K=64), "batch rows"), (dict(B=0, K=64), "batch rows"),
                                    (dict(B=8, K=60), "multiple of 8"), (dict(B=8, K=64, ctas=17), "1..16 CTAs")])
def test_bad_plans_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        H.plan_head(**kw)


def test_the_layered_step_uses_it_on_sm90_only():
    from rawgpu.steps import plan_model
    from rawgpu.model.recipe import Recipe

    r = Recipe(hidden=4096, layers=3, batch=32, lr=0.003, momentum=0.0)
    ours = plan_model(r, "layered", arch="sm_90")
    assert ours.step.head is not None and ours.step.head.K == 4096
    assert plan_model(r, "layered", arch="sm_86").step.head is None
    adam = plan_model(Recipe(hidden=4096, batch=128, optimizer="adam"), "layered", arch="sm_90")
    assert adam.step.head.kernel == "head_step_b128_adam"
    assert plan_model(Recipe(hidden=4096, batch=257), "layered", arch="sm_90").step.head is None


# --- GPU ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernels(device):
    from rawgpu.kernels import Kernels

    return Kernels(device.arch)


def _reference_logits(h, w, b):
    """float64 logits from the fp16 inputs and W16 = fp16(master)."""
    return h.astype(np.float64) @ w.astype(np.float16).astype(np.float64) + b.astype(np.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("B,K,ctas,opt", [
    (32, 4096, None, "plain"), (32, 8192, None, "plain"), (7, 104, None, "plain"), (32, 1000, 8, "plain"),
    (1, 16, 2, "plain"), (17, 2056, None, "plain"), (32, 256, 16, "plain"), (32, 16384, None, "plain"),
    (32, 1024, None, "momentum"), (33, 256, None, "plain"), (64, 520, 4, "adamw"), (100, 1000, None, "nesterov"),
    (128, 4096, None, "momentum"), (128, 8192, None, "adam"), (128, 256, None, "adam"), (200, 4096, None, "momentum"),
    (256, 2048, None, "adam"), (256, 104, None, "plain")])
def test_against_float64(device, stream, kernels, rng, B, K, ctas, opt):
    """logits, metrics, d(logits), dh = (dlogits @ W16^T) * (h > 0), the optimiser's step on the master (W16, lo)
    and its state with G = h^T dlogits, and on b with colsum(dlogits): odd widths, partial batches and batch tiles,
    cluster sizes, every optimiser; outputs poisoned first, bitwise equal across two runs."""
    if int(device.arch.removeprefix("sm_")) < 90:
        pytest.skip(f"the head kernel needs thread-block clusters (sm_90+); this GPU is {device.arch}")
    from gpu_checks import assert_same_bytes, run_twice

    from rawgpu.runtime.memory import Arena

    classes, scale = 10, np.float32(512.0 / B)
    plan = H.plan_head(B, K, OPTIMIZERS[opt].optimizer, ctas)
    states, o, h, w, b, (mw, vw, mb, vb) = _head_inputs(rng, B, K, classes, opt, 8)
    labels = rng.integers(0, classes, B).astype(np.int32)
    with Arena() as arena:
        held = [("mw", mw), ("mb", mb), ("vw", vw), ("vb", vb)][:2 * states]
        th, ty, twlo, tw16, tb, topt, tz, td, tdh, tstate = _head_buffers(arena, B, K, ty_shape=(B,), y_dtype=np.int32,
                                                                          held=held)
        tloss, tcorrect = arena.tensor("loss", (1,), np.float64), arena.tensor("correct", (1,), np.int32)
        _upload(arena, th, h, ty, labels, topt, o)
        launch = H.head_step(kernels, plan, th, ty, twlo, tw16, tb, topt, tz, td, tdh, tloss, tcorrect, classes,
                             float(scale * B), **{n: tstate.get(n) for n in ("mw", "vw", "mb", "vb")})
        hi, lo = master.split(w)
        state = [(twlo, lo), (tw16, hi), (tb, b), (tloss, np.array([1.5])), (tcorrect, np.array([3], np.int32))]
        state += [(tstate[name], a) for name, a in held]
        outs = [tz, td, tdh, twlo, tw16, tb, tloss, tcorrect] + [tstate[name] for name, _ in held]
        runs = run_twice(launch, stream, state, [tz, td, tdh], outs)
    z_ref = _reference_logits(h, w, b)
    _, loss_ref, _, _ = _reference_from_logits(z_ref, labels, classes, 1.0)
    for z, d, dh, wlo, w16, b_new, loss, correct, *got_state in runs:
        for name, out in (("logits", z), ("dlogits", d), ("dh", dh)):
            assert np.isfinite(out.astype(np.float64)).all(), f"{name} not written everywhere"
        err = np.linalg.norm(z - z_ref) / np.linalg.norm(z_ref)
        assert err <= 2e-3, f"logits rel err {err:.2e}"
        # the rest follows from the logits as stored (fp16), as in the separate kernels
        _, loss_z, hits_z, d_ref = _reference_from_logits(z, labels, classes, float(scale))
        assert abs(loss[0] - 1.5 - loss_z.sum()) <= 1e-5 * max(1.0, loss_z.sum()), "loss sum"
        assert abs(loss_z.sum() - loss_ref.sum()) <= 2e-2 * max(1.0, loss_ref.sum())
        assert correct[0] - 3 == hits_z
        err = np.linalg.norm(d - d_ref) / np.linalg.norm(d_ref)
        assert err <= 2e-3, f"dlogits rel err {err:.2e}"
        _check_backward_and_step(d, dh, h, w, b, o, (mw, vw, mb, vb), (wlo, w16, b_new),
                                 dict(zip([name for name, _ in held], got_state)), states)
    assert_same_bytes(runs)


def _head_inputs(rng, B, K, cols, opt, w_scale):
    """Fresh inputs of a head step: the optimiser's state count and table, h (a ReLU output: about half zero), the
    master W and b (cols live columns of 16, W at w_scale / sqrt(K)), and the optimiser's state (mw, vw, mb, vb)."""
    states = OPTIMIZERS[opt]._state_tensors
    h = np.maximum(rng.uniform(-1, 1, (B, K)), 0).astype(np.float16)
    w = np.zeros((K, 16), np.float32)
    w[:, :cols] = rng.uniform(-1, 1, (K, cols)) / np.sqrt(K) * w_scale
    b = np.zeros(16, np.float32)
    b[:cols] = rng.uniform(-0.5, 0.5, cols)
    mw, vw = random_state(rng, (K, 16), states, 2.0)
    mb, vb = random_state(rng, 16, states, 2.0)
    return states, table(opt, lr=0.01), h, w, b, (mw, vw, mb, vb)


def _head_buffers(arena, B, K, ty_shape, y_dtype, held):
    """The head step's operands in `arena`: h, the labels or targets, W as lo and W16, b, the optimiser table, the
    outputs and their gradient, dh, and the optimiser's state tensors held (by name)."""
    return (arena.tensor("h", (B, K), np.float16), arena.tensor("y", ty_shape, y_dtype),
            arena.tensor("wlo", (K, 16), np.int16), arena.tensor("w16", (K, 16), np.float16),
            arena.tensor("b", (16,), np.float32), arena.tensor("optim", (OPTIM_WORDS,), np.float32),
            arena.tensor("z", (B, 16), np.float16), arena.tensor("dz", (B, 16), np.float16),
            arena.tensor("dh", (B, K), np.float16),
            {name: arena.tensor(name, a.shape, np.float32) for name, a in held})


def _upload(arena, th, h, ty, y, topt, o) -> None:
    arena.allocate()
    th.upload(h)
    ty.upload(y)
    topt.upload(optimizer.words(o))


def _check_backward_and_step(d, dh, h, w, b, o, state, after, got: dict, states: int) -> None:
    """What follows from the head's gradient d as stored (fp16), against float64: dh = (d @ W16^T) * (h > 0), the
    optimiser's step on the master and its state with G = h^T d, and on b with colsum(d). state: (mw, vw, mb, vb)
    before; after: the kernel's (W lo, W16, b); got: its new state by name."""
    mw, vw, mb, vb = state
    wlo, w16, b_new = after
    d64 = d.astype(np.float64)
    dh_ref = (d64 @ w.astype(np.float16).astype(np.float64).T) * (h > 0)
    err = np.linalg.norm(dh - dh_ref) / np.linalg.norm(dh_ref)
    assert err <= 2e-3, f"dh rel err {err:.2e}"
    w_ref, mw_ref, vw_ref = update_reference(o, w, h.astype(np.float64).T @ d64, mw, vw)
    check_master_update(w, w16, wlo, w_ref)
    b_ref, mb_ref, vb_ref = update_reference(o, b, d64.sum(axis=0), mb, vb)
    assert rel(b_new - b, b_ref - b) <= 1e-5, "bias update"
    if states:
        assert rel(got["mw"], mw_ref) <= 2e-3 and rel(got["mb"], mb_ref) <= 1e-5, "first state"
    if states > 1:
        assert rel(got["vw"], vw_ref) <= 4e-3 and rel(got["vb"], vb_ref) <= 1e-5, "second moment"


def _reference_from_logits(z16, labels, classes, scale):
    z = z16.astype(np.float64)[:, :classes]
    m = z.max(axis=1, keepdims=True)
    e = np.exp(z - m)
    loss = np.log(e.sum(axis=1)) + m[:, 0] - z[np.arange(len(labels)), labels]
    d = np.zeros((len(labels), 16))
    d[:, :classes] = (e / e.sum(axis=1, keepdims=True) - np.eye(classes)[labels]) * scale
    return z, loss, int((z.argmax(axis=1) == labels).sum()), d


@pytest.mark.gpu
@pytest.mark.parametrize("B,K,outputs,loss,opt", [
    (128, 256, 1, "mse", "plain"), (7, 104, 3, "l1", "momentum"), (32, 1000, 16, "huber", "adam"),
    (256, 2048, 5, "mse", "adamw"), (100, 520, 2, "huber", "nesterov"), (64, 4096, 1, "l1", "adam")])
def test_regression_against_float64(device, stream, kernels, rng, B, K, outputs, loss, opt):
    """A regression's head: predictions, the three sums (loss, squared and absolute errors), d(pred) = l'(pred - y) x
    scale / (B outputs), dh, the step on W and b, against float64 from fresh inputs; outputs poisoned first, the same
    bits across two runs."""
    if int(device.arch.removeprefix("sm_")) < 90:
        pytest.skip(f"the head kernel needs thread-block clusters (sm_90+); this GPU is {device.arch}")
    from gpu_checks import assert_same_bytes, run_twice

    from rawgpu.runtime.memory import Arena

    grad_scale = 512.0
    plan = H.plan_head(B, K, OPTIMIZERS[opt].optimizer, loss=loss)
    assert plan.task == "regression"
    states, o, h, w, b, (mw, vw, mb, vb) = _head_inputs(rng, B, K, outputs, opt, 4)
    y = rng.normal(0.0, 1.5, (B, outputs)).astype(np.float32)  # errors both within and past Huber's delta
    before = np.array([1.5, 2.5, 3.5])
    with Arena() as arena:
        held = [("mw", mw), ("mb", mb), ("vw", vw), ("vb", vb)][:2 * states]
        th, ty, twlo, tw16, tb, topt, tz, td, tdh, tstate = _head_buffers(arena, B, K, ty_shape=(B, outputs),
                                                                          y_dtype=np.float32, held=held)
        tsums = arena.tensor("sums", (3,), np.float64)
        _upload(arena, th, h, ty, y, topt, o)
        launch = H.head_step(kernels, plan, th, ty, twlo, tw16, tb, topt, tz, td, tdh, tsums, None, outputs,
                             grad_scale, loss=loss, **{n: tstate.get(n) for n in ("mw", "vw", "mb", "vb")})
        hi, lo = master.split(w)
        state = [(twlo, lo), (tw16, hi), (tb, b), (tsums, before)] + [(tstate[name], a) for name, a in held]
        outs = [tz, td, tdh, twlo, tw16, tb, tsums] + [tstate[name] for name, _ in held]
        runs = run_twice(launch, stream, state, [tz, td, tdh], outs)
    z_ref = _reference_logits(h, w, b)
    for z, d, dh, wlo, w16, b_new, sums, *got_state in runs:
        for name, out in (("pred", z), ("dpred", d), ("dh", dh)):
            assert np.isfinite(out.astype(np.float64)).all(), f"{name} not written everywhere"
        err = np.linalg.norm(z[:, :outputs] - z_ref[:, :outputs]) / np.linalg.norm(z_ref[:, :outputs])
        assert err <= 2e-3, f"pred rel err {err:.2e}"
        # the rest follows from the predictions as stored (fp16), as in the separate kernels
        e = z.astype(np.float64)[:, :outputs] - y
        a = np.abs(e)
        per = {"mse": e * e, "l1": a, "huber": np.where(a <= 1, 0.5 * e * e, a - 0.5)}[loss]
        grad = {"mse": 2 * e, "l1": np.sign(e), "huber": np.clip(e, -1, 1)}[loss]
        want = np.array([per.mean(axis=1).sum(), (e * e).sum(), a.sum()])
        assert np.allclose(sums - before, want, rtol=1e-5, atol=1e-5), (sums - before, want)
        d_ref = np.zeros((B, 16))
        d_ref[:, :outputs] = grad * grad_scale / (B * outputs)
        err = np.linalg.norm(d - d_ref) / np.linalg.norm(d_ref)
        assert err <= 2e-3 and not d[:, outputs:].any(), f"dpred rel err {err:.2e}"
        _check_backward_and_step(d, dh, h, w, b, o, (mw, vw, mb, vb), (wlo, w16, b_new),
                                 dict(zip([name for name, _ in held], got_state)), states)
    assert_same_bytes(runs)
