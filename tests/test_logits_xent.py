"""The head's forward and softmax cross-entropy in one launch (cu/loss.cu: logits_xent; kernels/loss.py): the logits
against float64, the loss, hits and dlogits softmax_xent's own on those logits, what a step takes it for."""

from __future__ import annotations

import numpy as np
import pytest

from rawgpu.kernels import Kernels
from rawgpu.kernels import loss as kl
from rawgpu.runtime.memory import Arena

gpu = pytest.mark.gpu
C = kl.LX_CLASSES


class _NoKernels:
    def get(self, *args):
        raise AssertionError("the launcher must refuse bad arguments before it looks a kernel up")


def _tensors(batch=10, K=64, classes_w=C):
    a = Arena()
    return dict(h=a.tensor("h", (batch, K), np.float16), w=a.tensor("w", (K, classes_w), np.float16),
                b=a.tensor("b", classes_w, np.float32), y=a.tensor("y", batch, np.int32),
                z=a.tensor("z", (batch, classes_w), np.float16), d=a.tensor("d", (batch, classes_w), np.float16),
                loss=a.tensor("loss", 1, np.float64), correct=a.tensor("correct", 1, np.int32))


def test_the_launcher_refuses_what_the_kernel_cannot_take():
    t = _tensors()
    call = lambda **kw: kl.logits_xent(_NoKernels(), **{**dict(  # noqa: E731
        h=t["h"], w16=t["w"], bias=t["b"], labels=t["y"], logits=t["z"], dlogits=t["d"], loss_sum=t["loss"],
        correct=t["correct"], batch=10, classes=10), **kw})
    with pytest.raises(ValueError, match="1..16 classes"):
        call(classes=17)
    with pytest.raises(ValueError, match="needs dlogits"):
        call(dlogits=None)
    with pytest.raises(ValueError, match=r"h: expected \[>= 11"):
        call(batch=11)
    wide = _tensors(classes_w=24)
    with pytest.raises(ValueError, match="w16"):
        call(w16=wide["w"])
    with pytest.raises(ValueError, match="scratch"):
        big = _tensors(batch=40)
        kl.logits_xent(_NoKernels(), big["h"], big["w"], big["b"], big["y"], big["z"], big["d"], big["loss"],
                       big["correct"], 40, 10)


@pytest.fixture(scope="module")
def kern(device):
    return Kernels(device.arch)


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16 if a.dtype == np.float16 else np.uint64)


@gpu
@pytest.mark.parametrize("classes", [2, 10, 16])
@pytest.mark.parametrize("batch,K", [(1, 8), (15, 24), (16, 512), (300, 1000), (1024, 512), (4096, 256)])
def test_logits_xent_against_float64_and_softmax_xent(kern, device, stream, rng, batch, K, classes):
    """logits = fp16(h @ W + b) within fp32 accumulation of float64; on those logits the loss, hits and dlogits are
    softmax_xent's (dlogits and hits bit for bit); padding columns zero, nothing past the batch written; the exact-sum
    buffers end at zero; mean_over scales dlogits; bitwise repeatable."""
    h = (rng.standard_normal((batch + 3, K)) * 0.5).astype(np.float16)
    w = np.zeros((K, C), np.float16)
    w[:, :classes] = (rng.standard_normal((K, classes)) * 2 / np.sqrt(K)).astype(np.float16)
    b = np.zeros(C, np.float32)
    b[:classes] = rng.standard_normal(classes).astype(np.float32)
    y = rng.integers(0, classes, batch + 3).astype(np.int32)
    scale = 64.0
    with Arena() as arena:
        t_h, t_w = arena.tensor("h", h.shape, np.float16), arena.tensor("w", w.shape, np.float16)
        t_b, t_y = arena.tensor("b", C, np.float32), arena.tensor("y", len(y), np.int32)
        t_z, t_d = arena.tensor("z", (batch + 3, C), np.float16), arena.tensor("d", (batch + 3, C), np.float16)
        t_d2 = arena.tensor("d2", (batch + 3, C), np.float16)
        t_loss, t_corr = arena.tensor("loss", 1, np.float64), arena.tensor("corr", 1, np.int32)
        t_loss2, t_corr2 = arena.tensor("loss2", 1, np.float64), arena.tensor("corr2", 1, np.int32)
        sums, tickets = arena.tensor("sums", 2, np.int64), arena.tensor("tickets", 1, np.int32)
        arena.allocate()
        arena.zero()
        t_h.upload(h), t_w.upload(w), t_b.upload(b), t_y.upload(y)
        t_z.fill_bytes(0xFF), t_d.fill_bytes(0xFF), t_d2.fill_bytes(0xFF)
        fused = kl.logits_xent(kern, t_h, t_w, t_b, t_y, t_z, t_d, t_loss, t_corr, batch, classes, grad_scale=scale,
                               scratch=sums, ticket=tickets)
        fused.run(stream)
        z, d, loss, hits = t_z.download(), t_d.download(), t_loss.download()[0], int(t_corr.download()[0])

        # the logits: float64 of the same fp16 inputs, fp32 sums, one fp16 rounding
        ref = h[:batch].astype(np.float64) @ w.astype(np.float64) + b
        size = np.abs(h[:batch]).astype(np.float64) @ np.abs(w).astype(np.float64) + np.abs(b)
        assert np.all(np.abs(z[:batch] - ref) <= 2.0 ** -11 * np.abs(ref) + 1e-5 * size + 1e-7)
        assert not z[:batch, classes:].any(), "padding columns 0"
        assert np.all(_bits(z[batch:]) == 0xFFFF), "nothing past the batch written"

        # softmax_xent on those logits: the same dlogits and hits, the loss up to the blocks' 2^-32 fixed point
        kl.softmax_xent(kern, t_z, t_y, t_d2, t_loss2, t_corr2, batch, classes, grad_scale=scale, scratch=sums,
                        ticket=tickets).run(stream)
        assert np.array_equal(_bits(d[:batch]), _bits(t_d2.download()[:batch])) and hits == t_corr2.download()[0]
        loss2 = t_loss2.download()[0]
        assert abs(loss - loss2) <= -(-batch // kl.LX_ROWS) * 2.0 ** -32 + 1e-12 * abs(loss2)
        assert np.all(_bits(d[batch:]) == 0xFFFF) and not d[:batch, classes:].any()
        # and float64's softmax cross-entropy of them
        zz = z[:batch, :classes].astype(np.float64)
        e = np.exp(zz - zz.max(axis=1, keepdims=True))
        rows = np.arange(batch)
        want_loss = float(np.sum(np.log(e.sum(axis=1)) + zz.max(axis=1) - zz[rows, y[:batch]]))
        assert abs(loss - want_loss) <= 1e-5 * abs(want_loss) + 1e-6
        assert hits == int(np.sum(np.argmax(zz, axis=1) == y[:batch]))
        p = e / e.sum(axis=1, keepdims=True)
        p[rows, y[:batch]] -= 1.0
        unit = scale / batch
        assert np.allclose(d[:batch, :classes].astype(np.float64), p * unit, rtol=2e-3, atol=2e-3 * unit)
        assert not sums.download().any() and not tickets.download().any(), "the exact-sum buffers must end at zero"

        # repeatable, accumulating; mean_over as softmax_xent's (fp32 math rounded once: halving the fp16 result
        # would round subnormal gradients twice)
        fused.run(stream)
        assert np.array_equal(_bits(t_d.download()), _bits(d)) and t_corr.download()[0] == 2 * hits
        kl.logits_xent(kern, t_h, t_w, t_b, t_y, t_z, t_d, t_loss, t_corr, batch, classes, grad_scale=scale,
                       mean_over=2 * batch, scratch=sums, ticket=tickets).run(stream)
        kl.softmax_xent(kern, t_z, t_y, t_d2, t_loss2, t_corr2, batch, classes, grad_scale=scale,
                        mean_over=2 * batch, scratch=sums, ticket=tickets).run(stream)
        assert np.array_equal(_bits(t_d.download()[:batch]), _bits(t_d2.download()[:batch]))
        assert np.allclose(t_d.download()[:batch].astype(np.float64), d[:batch] / 2, rtol=2e-3, atol=2e-3 * unit)
