"""The head's step in one cluster kernel (head.cu): the plan on CPU; every output against float64 on GPU."""

from __future__ import annotations

import numpy as np
import pytest

from rawgpu import master
from rawgpu.kernels import head as H

# --- CPU ---------------------------------------------------------------------------------------------------------


def test_plan_covers_the_rows_with_whole_16_row_slices():
    for K in (8, 16, 104, 1000, 1024, 2048, 2056, 4096, 8192, 16384):
        p = H.plan_head(32, K)
        assert p.kc % 16 == 0 and p.kc <= H.MAX_KC
        assert (p.ctas - 1) * p.kc < K <= p.ctas * p.kc, "a CTA would hold no rows, or rows would be left over"
        assert p.ctas <= (H.PORTABLE_CTAS if K <= 2048 else H.MAX_CTAS)
        assert p.smem_bytes <= 227 * 1024
    assert H.plan_head(32, 16384 + 8) is None, "past 16 x MAX_KC rows the head runs as separate kernels"


def test_only_sm90_batch_sized_plain_sgd_with_16_padded_classes_fuses():
    assert H.supported(32, True, "f32", 16, "sm_90") and H.supported(1, True, "f32", 16, "sm_100")
    assert not H.supported(32, True, "f32", 16, "sm_86")
    assert not H.supported(33, True, "f32", 16, "sm_90")
    assert not H.supported(32, False, "f32", 16, "sm_90")
    assert not H.supported(32, True, "f16", 16, "sm_90")
    assert not H.supported(32, True, "f32", 24, "sm_90")


@pytest.mark.parametrize("kw,msg", [(dict(B=33, K=64), "batch rows"), (dict(B=8, K=60), "multiple of 8"),
                                    (dict(B=8, K=64, ctas=17), "1..16 CTAs")])
def test_bad_plans_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        H.plan_head(**kw)


def test_the_layered_step_uses_it_on_sm90_only():
    from rawgpu.mlp import MLP
    from rawgpu.recipe import Recipe

    r = Recipe(hidden=4096, layers=3, batch=32, lr=0.003, momentum=0.0)
    ours = MLP(None, r, arch="sm_90", step_kind="layered")
    assert ours.step.head is not None and ours.step.head.K == 4096
    assert MLP(None, r, arch="sm_86", step_kind="layered").step.head is None
    assert MLP(None, Recipe(hidden=4096, batch=32, momentum=0.9), arch="sm_90", step_kind="layered").step.head is None


# --- GPU ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernels(device):
    from rawgpu.kernels import Kernels

    return Kernels(device.arch)


def _reference_logits(h, w, b):
    """float64 logits from the fp16 inputs and W16 = fp16(master)."""
    return h.astype(np.float64) @ w.astype(np.float16).astype(np.float64) + b.astype(np.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("B,K,ctas", [(32, 4096, None), (32, 8192, None), (7, 104, None), (32, 1000, 8), (1, 16, 2),
                                      (17, 2056, None), (32, 256, 16), (32, 16384, None)])
def test_against_float64(device, stream, kernels, rng, B, K, ctas):
    """logits, metrics, d(logits), dh = (dlogits @ W16^T) * (h > 0), W -= lr h^T dlogits on the master, b -= lr
    colsum(dlogits): odd widths, partial batches, cluster sizes; outputs poisoned first, bitwise equal across two
    runs."""
    if int(device.arch.removeprefix("sm_")) < 90:
        pytest.skip(f"the head kernel needs thread-block clusters (sm_90+); this GPU is {device.arch}")
    from gpu_checks import assert_same_bytes, check_master_step, run_twice

    from rawgpu.memory import Arena

    classes, scale = 10, np.float32(512.0 / B)
    plan = H.plan_head(B, K, ctas)
    h = np.maximum(rng.uniform(-1, 1, (B, K)), 0).astype(np.float16)  # a ReLU output: about half zero
    w = np.zeros((K, 16), np.float32)
    w[:, :classes] = rng.uniform(-1, 1, (K, classes)) / np.sqrt(K) * 8
    b = np.zeros(16, np.float32)
    b[:classes] = rng.uniform(-0.5, 0.5, classes)
    labels = rng.integers(0, classes, B).astype(np.int32)
    lr = np.float32(0.01)
    with Arena() as arena:
        th, ty = arena.tensor("h", (B, K), np.float16), arena.tensor("y", (B,), np.int32)
        twlo, tw16 = arena.tensor("wlo", (K, 16), np.int16), arena.tensor("w16", (K, 16), np.float16)
        tb, tlr = arena.tensor("b", (16,), np.float32), arena.tensor("lr", (1,), np.float32)
        tz, td = arena.tensor("logits", (B, 16), np.float16), arena.tensor("dlogits", (B, 16), np.float16)
        tdh = arena.tensor("dh", (B, K), np.float16)
        tloss, tcorrect = arena.tensor("loss", (1,), np.float64), arena.tensor("correct", (1,), np.int32)
        arena.allocate()
        th.upload(h)
        ty.upload(labels)
        tlr.upload(np.array([lr], np.float32))
        launch = H.head_step(kernels, plan, th, ty, twlo, tw16, tb, tlr, tz, td, tdh, tloss, tcorrect, classes,
                             float(scale * B))
        hi, lo = master.split(w)
        state = [(twlo, lo), (tw16, hi), (tb, b), (tloss, np.array([1.5])), (tcorrect, np.array([3], np.int32))]
        runs = run_twice(launch, stream, state, [tz, td, tdh], [tz, td, tdh, twlo, tw16, tb, tloss, tcorrect])
    z_ref = _reference_logits(h, w, b)
    _, loss_ref, _, _ = _reference_from_logits(z_ref, labels, classes, 1.0)
    for z, d, dh, wlo, w16, b_new, loss, correct in runs:
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
        d64 = d.astype(np.float64)
        dh_ref = (d64 @ w.astype(np.float16).astype(np.float64).T) * (h > 0)
        err = np.linalg.norm(dh - dh_ref) / np.linalg.norm(dh_ref)
        assert err <= 2e-3, f"dh rel err {err:.2e}"
        check_master_step(w, w16, wlo, float(lr), h.astype(np.float64).T @ d64)
        b_ref = b.astype(np.float64) - float(lr) * d64.sum(axis=0)
        assert np.allclose(b_new, b_ref, rtol=1e-6, atol=1e-7), "bias update"
    assert_same_bytes(runs)


def _reference_from_logits(z16, labels, classes, scale):
    z = z16.astype(np.float64)[:, :classes]
    m = z.max(axis=1, keepdims=True)
    e = np.exp(z - m)
    loss = np.log(e.sum(axis=1)) + m[:, 0] - z[np.arange(len(labels)), labels]
    d = np.zeros((len(labels), 16))
    d[:, :classes] = (e / e.sum(axis=1, keepdims=True) - np.eye(classes)[labels]) * scale
    return z, loss, int((z.argmax(axis=1) == labels).sum()), d
