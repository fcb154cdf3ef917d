"""The regression losses (cu/loss.cu: regression_loss, kernels/loss.py): what the launcher binds on the CPU, and on
the GPU the loss, the metrics' sums and the gradient against float64 numpy, outputs poisoned first."""

from __future__ import annotations

import numpy as np
import pytest

from rawgpu.kernels import Kernels
from rawgpu.kernels import loss as kl
from rawgpu.runtime import driver
from rawgpu.runtime.memory import Arena, Tensor

import kernel_params  # beside this file: the kernels' parameters, read from their declarations

gpu = pytest.mark.gpu


class _Recorder:
    arch, activation = "sm_90", "relu"

    def get(self, source, name):
        signature = kernel_params.signature(source, name, integers=True)
        return type("K", (), {"bind": lambda _, grid, block, smem, *args, **kw: (name, signature, grid, args)})()


def test_the_launcher_binds_the_kernels_parameters_and_refuses_bad_tensors():
    a = Arena()
    pred, dpred = a.tensor("pred", (300, 8), np.float16), a.tensor("dpred", (300, 8), np.float16)
    targets, sums = a.tensor("targets", (300, 3), np.float32), a.tensor("sums", 3, np.float64)
    scratch, ticket = a.tensor("scratch", 3, np.int64), a.tensor("ticket", 1, np.int32)
    for batch, loss in ((100, "mse"), (300, "huber")):
        name, signature, grid, args = kl.regression_loss(_Recorder(), pred, targets, dpred, sums, batch, 3, loss,
                                                         grad_scale=8.0, scratch=scratch, ticket=ticket)
        assert name == "regression_loss" and len(args) == len(signature) and grid == kl.xent_blocks(batch)
        for i, (letter, arg) in enumerate(zip(signature, args)):
            if letter == "p":
                assert isinstance(arg, Tensor) or arg == 0
            else:
                driver._convert(letter, arg, i)
        assert args[5] == kl.REGRESSION_LOSSES[loss] and args[6] == pytest.approx(8.0 / (batch * 3))
    with pytest.raises(ValueError, match="unknown regression loss 'cross'"):
        kl.regression_loss(_Recorder(), pred, targets, dpred, sums, 10, 3, "cross")
    with pytest.raises(ValueError, match=r"targets: expected \[>= 10, 2\]"):
        kl.regression_loss(_Recorder(), pred, targets, dpred, sums, 10, 2)
    with pytest.raises(ValueError, match="outputs must be in 1..64, got 65"):
        kl.regression_loss(_Recorder(), pred, targets, dpred, sums, 10, 65)
    with pytest.raises(ValueError, match="exact-sum|scratch"):
        kl.regression_loss(_Recorder(), pred, targets, dpred, sums, 300, 3)


def _reference(pred: np.ndarray, y: np.ndarray, loss: str):
    """(per-row losses summed, squared errors summed, absolute errors summed, dl/de) in float64."""
    e = pred.astype(np.float64) - y.astype(np.float64)
    a = np.abs(e)
    per = {"mse": e * e, "l1": a, "huber": np.where(a <= 1, 0.5 * e * e, a - 0.5)}[loss]
    grad = {"mse": 2 * e, "l1": np.sign(e), "huber": np.clip(e, -1, 1)}[loss]
    return per.mean(axis=1).sum(), (e * e).sum(), a.sum(), grad


@pytest.fixture(scope="module")
def kern(device):
    return Kernels(device.arch)


@gpu
@pytest.mark.parametrize("loss", ["mse", "l1", "huber"])
@pytest.mark.parametrize("batch,outputs,ld", [(1, 1, 8), (7, 3, 8), (128, 1, 8), (256, 64, 64), (1000, 5, 8)])
@pytest.mark.parametrize("train", [True, False])
def test_regression_loss_against_float64(kern, device, stream, rng, loss, batch, outputs, ld, train):
    pred = rng.normal(0, 2, (batch, ld)).astype(np.float16)
    y = rng.normal(0, 2, (batch, outputs)).astype(np.float32)
    scale = 1024.0
    with Arena() as arena:
        tp, tt = arena.tensor("pred", pred.shape, np.float16), arena.tensor("y", y.shape, np.float32)
        td = arena.tensor("dpred", pred.shape, np.float16)
        sums = arena.tensor("sums", 3, np.float64)
        scratch, ticket = arena.tensor("scratch", 3, np.int64), arena.tensor("ticket", 1, np.int32)
        arena.allocate()
        arena.zero()
        tp.upload(pred), tt.upload(y)
        td.fill_bytes(0xFF)  # poisoned: NaN
        device.synchronize()
        for _ in range(2):  # twice: the sums accumulate, the exact-sum scratch and ticket are left zero
            kl.regression_loss(kern, tp, tt, td if train else None, sums, batch, outputs, loss, grad_scale=scale,
                               scratch=scratch, ticket=ticket).run(stream)
        got_sums, got_d = sums.download(), td.download()
        assert not scratch.download().any() and ticket.download()[0] == 0
    ref_loss, ref_sq, ref_abs, grad = _reference(pred[:, :outputs], y, loss)
    np.testing.assert_allclose(got_sums, 2 * np.array([ref_loss, ref_sq, ref_abs]), rtol=1e-5, atol=1e-6)
    if train:
        ref_d = grad * scale / (batch * outputs)
        got = got_d[:, :outputs].astype(np.float64)
        # fp16 gradient: within an fp16 rounding of the float64 value, plus the fp32 steps before it
        terms = (np.abs(pred[:, :outputs]).astype(np.float64) + np.abs(y)) * 2.0 ** -22 * scale / (batch * outputs)
        tol = np.abs(ref_d) * (2.0 ** -11 + 2.0 ** -20) + 2.0 ** -24 + terms
        assert np.all(np.abs(got - ref_d) <= tol), float(np.max(np.abs(got - ref_d) - tol))
        assert np.all(got_d[:, outputs:].view(np.uint16) == 0), "padding columns must be zero"
    else:
        assert np.all(got_d.view(np.uint16) == 0xFFFF), "evaluation writes no gradient"
