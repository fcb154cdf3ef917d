"""The small kernels (data, loss, elementwise): launcher checks and signatures on the CPU, values on the GPU.

GPU tests compare against float64 numpy on fresh random inputs, with outputs poisoned (0xFF bytes: NaN)
first, and guard bytes around outputs to catch writes past the end. Exact where the result is exact.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pytest

from rawgpu.runtime import driver
from rawgpu.model import master, optimizer
from rawgpu.contract import OPTIM_WORDS
from rawgpu.runtime.compiler import SOURCE_DIR
from rawgpu.kernels import Kernels
from rawgpu.kernels import gather as kd
from rawgpu.kernels import elementwise as ke
from rawgpu.kernels import loss as kl
from rawgpu.runtime.memory import Arena, Tensor
from rawgpu.model.recipe import Recipe

from optim_reference import OPTIMIZERS, update_reference
import kernel_params  # beside this file: the kernels' parameters, read from their declarations

gpu = pytest.mark.gpu


# --- CPU: launchers against the kernel sources ------------------------------------------------------------------

class _Recorder:
    """Stands in for Kernels on the CPU: records what a launcher would bind, never compiles or loads."""

    def __init__(self):
        self.calls = []
        self.arch = "sm_86"  # no launch asks the driver about the GPU (loss.logits_xent's shared memory on sm_90+)

    def get(self, source, name):
        rec, signature = self, kernel_params.signature(source, name, integers=True)

        class _K:
            def bind(self, grid, block, smem, *args):
                rec.calls.append((source, name, signature, driver._dim3(grid), driver._dim3(block), smem, args))
                return rec.calls[-1]

        return _K()


class _NoKernels:
    def get(self, *args):
        raise AssertionError("the launcher must refuse bad arguments before it looks a kernel up")


def _plan():
    """Unallocated tensors of a typical layer: enough for every launcher's checks, no GPU needed."""
    a = Arena()
    t = dict(
        images=a.tensor("images", (100, 784), np.uint8), labels8=a.tensor("labels8", 100, np.uint8),
        perm=a.tensor("perm", 100, np.int32), step=a.tensor("step", 1, np.int64),
        x=a.tensor("x", (10, 800), np.float16), y=a.tensor("y", 10, np.int32),
        optim=a.tensor("optim", OPTIM_WORDS, np.float32), logits=a.tensor("logits", (10, 16), np.float16),
        dlogits=a.tensor("dlogits", (10, 16), np.float16), loss=a.tensor("loss", 1, np.float64),
        correct=a.tensor("correct", 1, np.int32), w32=a.tensor("w32", (784, 256), np.float32),
        wlo=a.tensor("wlo", (784, 256), np.int16),
        w16=a.tensor("w16", (784, 256), np.float16), bias=a.tensor("bias", 256, np.float32),
        mom=a.tensor("mom", 256, np.float32), dy=a.tensor("dy", (10, 264), np.float16),
        total=a.tensor("total", (10, 264), np.float32), act=a.tensor("act", (10, 264), np.float16),
        bias264=a.tensor("bias264", 264, np.float32), grad264=a.tensor("grad264", 264, np.float32),
        g32=a.tensor("g32", (784, 256), np.float32), big_logits=a.tensor("big_logits", (4096, 16), np.float16),
        big_y=a.tensor("big_y", 4096, np.int32), big_dy=a.tensor("big_dy", (4096, 264), np.float16),
        sums=a.tensor("sums", 264, np.int64), sum_tickets=a.tensor("sum_tickets", 33, np.int32),
        head_w=a.tensor("head_w", (800, 16), np.float16), head_b=a.tensor("head_b", 16, np.float32),
    )
    return t


def _valid_calls(k, t):
    kd.gather_batch(k, t["images"], t["labels8"], t["perm"], t["step"], t["x"], t["y"], 10, 10)
    kd.step_increment(k, t["step"])
    kd.set_i64(k, t["step"], -5)
    kd.gather_batch(k, t["images"], t["labels8"], t["perm"], t["step"], t["x"], t["y"], 10, 10, optim=t["optim"],
                    schedule=kd.Schedule(0.1, 0.001, 1000, 10, "cosine"))
    kl.softmax_xent(k, t["logits"], t["y"], t["dlogits"], t["loss"], t["correct"], 10)
    kl.softmax_xent(k, t["logits"], t["y"], None, t["loss"], t["correct"], 7)
    kl.zero_metrics(k, t["loss"], t["correct"])
    kl.logits_xent(k, t["x"], t["head_w"], t["head_b"], t["y"], t["logits"], t["dlogits"], t["loss"], t["correct"], 10,
                   10, grad_scale=32.0, mean_over=20)
    ke.axpby_f32(k, t["bias"], t["mom"], 1.0, 2.0)
    ke.copy_f16_if_odd(k, t["w16"], t["w16"], t["step"])
    ke.copy_f16_if_odd(k, t["w16"], t["w16"], None)
    ke.increment_i64(k, t["step"])
    ke.fill_f32(k, t["mom"], 0.0)
    ke.bias_update(k, t["dy"], t["bias"], t["mom"], t["mom"], t["optim"], 10)
    ke.bias_update(k, t["dy"], t["bias"], None, None, t["optim"], 3)
    ke.init_uniform(k, t["w32"], 0.05, 2**64 - 1)
    ke.init_uniform_master(k, t["w16"], t["wlo"], 0.05, 7)
    ke.finish_sum(k, t["total"], t["dy"], 10, "bias", bias=t["bias264"])
    ke.finish_sum(k, t["total"], t["dy"], 3, "bias_act", bias=t["bias264"])
    ke.finish_sum(k, t["total"], t["dy"], 0, "dact", act=t["act"])
    ke.bias_grad(k, t["dy"], t["grad264"], 10)
    kl.softmax_xent(k, t["big_logits"], t["big_y"], None, t["loss"], t["correct"], 4096, scratch=t["sums"],
                    ticket=t["sum_tickets"])
    ke.bias_update(k, t["big_dy"], t["bias264"], None, None, t["optim"], 4096, t["sums"], t["sum_tickets"])
    ke.apply_update(k, t["g32"], t["bias"], t["w16"], t["wlo"], None, None, t["bias"], None, None, t["optim"], "sgd")
    ke.apply_update(k, t["g32"], t["bias"], t["w16"], t["wlo"], t["w32"], t["w32"], t["bias"], t["mom"], t["mom"],
                    t["optim"], "adam")


def test_the_loss_gives_one_block_a_warp_per_row_and_spread_blocks_eight_warps():
    """A batch in one block runs its rows one after another per warp: it gets the most warps. Blocks that spread a
    larger batch (or a sweep's models) over the GPU keep 8 warps, one row a warp unless the caller gives the rows."""
    k, t = _Recorder(), _plan()
    kl.softmax_xent(k, t["logits"], t["y"], t["dlogits"], t["loss"], t["correct"], 10)
    kl.softmax_xent(k, t["big_logits"], t["big_y"], None, t["loss"], t["correct"], 4096, scratch=t["sums"],
                    ticket=t["sum_tickets"])
    kl.softmax_xent(k, t["big_logits"], t["big_y"], None, t["loss"], t["correct"], 4096, scratch=t["sums"],
                    ticket=t["sum_tickets"], block_rows=64)
    assert [(c[3][0], c[4][0]) for c in k.calls] == [(1, 1024), (512, 256), (64, 256)]


def test_softmax_xent_spreads_long_rows_over_blocks_of_eight():
    """Above 16 classes a row is long (1000 classes: a lane's 32 values): blocks of 8 rows spread any batch over the
    SMs; up to 16 the batch takes one block up to 256 rows, and above it blocks of 8 rows too."""
    assert [kl.xent_blocks(b, 10) for b in (1, 128, 256, 257)] == [1, 1, 1, 33]
    assert [kl.xent_blocks(b, 1000) for b in (1, 8, 128, 10000)] == [1, 1, 16, 1250]
    assert kl.xent_rows_per_block(128, 17) == kl.WIDE_ROWS and kl.xent_rows_per_block(128, 16) is None


def test_launchers_match_the_kernel_sources():
    k = _Recorder()
    _valid_calls(k, _plan())
    assert len(k.calls) == 25
    for source, name, signature, grid, block, smem, args in k.calls:
        assert name in (SOURCE_DIR / source).read_text(), f"{name} is not in {source}"
        assert len(args) == len(signature), f"{name}: the launcher binds {len(args)} arguments, it takes {signature}"
        for i, (kind, arg) in enumerate(zip(signature, args)):
            if kind == "p":
                assert isinstance(arg, Tensor) or arg == 0, f"{name} argument {i} must be a tensor or null"
            else:
                driver._convert(kind, arg, i)  # in range for its C type
        assert block[0] * block[1] * block[2] <= 1024 and smem <= driver.STATIC_SHARED_LIMIT
    names = {c[1] for c in k.calls}
    assert names >= {"gather_batch", "step_increment", "set_i64", "softmax_xent", "logits_xent", "zero_metrics",
                     "copy_f16_if_odd", "fill_f32", "bias_update", "init_uniform", "init_uniform_master",
                     "finish_sum_bias", "finish_sum_bias_act", "finish_sum_dact", "apply_update_sgd",
                     "apply_update_adam"}


def test_softmax_xent_is_one_block_and_eval_passes_null():
    k, t = _Recorder(), _plan()
    kl.softmax_xent(k, t["logits"], t["y"], None, t["loss"], t["correct"], 7)
    (_, _, _, grid, block, _, args), = k.calls
    assert grid == (1, 1, 1) and args[6] == 0 and args[3] == 7 and args[1] == 16
    assert args[5] == pytest.approx(1 / 7)


@pytest.mark.parametrize("cols", [1, 10, 13, 256, 784, 1000, 4096, 16384])
def test_bias_grad_geometry_covers_every_column(cols):
    a = Arena()
    dy, bias = a.tensor("dy", (4, cols + 8), np.float16), a.tensor("b", cols, np.float32)
    optim = a.tensor("optim", OPTIM_WORDS, np.float32)
    k = _Recorder()
    ke.bias_update(k, dy, bias, None, None, optim, 4)
    (_, _, _, grid, block, _, _), = k.calls
    tx, ty, _ = block
    assert tx * ty == 256 and grid[0] * tx * 8 >= cols and (grid[0] - 1) * tx * 8 < cols


def test_bias_sums_spread_long_batches_over_about_256_blocks():
    """Up to 256 rows one range; above, ranges of 64-256 rows (a multiple of the block's 32 row threads) that make
    about 256 blocks with the column tiles."""
    assert ke.bias_blocks(256, 256) == (8, 4, 1, 256)
    assert ke.bias_blocks(256, 1024) == (8, 4, 16, 64)     # 64 blocks: no range below 64 rows
    assert ke.bias_blocks(256, 4096) == (8, 4, 64, 64)     # 256 blocks
    assert ke.bias_blocks(1024, 4096) == (8, 16, 16, 256)  # 256 blocks
    assert ke.bias_blocks(4096, 4096) == (8, 64, 16, 256)  # no range above 256 rows
    assert ke.bias_blocks(10, 60000) == (2, 1, 235, 256)
    assert ke.bias_blocks(16, 1000) == (2, 1, 16, 64)


def test_launchers_refuse_bad_buffers_before_compiling():
    t, k = _plan(), _NoKernels()
    a = Arena()
    f32_x = a.tensor("f32x", (10, 800), np.float32)
    with pytest.raises(TypeError, match="x_out"):
        kd.gather_batch(k, t["images"], t["labels8"], t["perm"], t["step"], f32_x, t["y"], 10, 10)
    with pytest.raises(ValueError, match="perm"):  # 100 entries, 11 x 10 needed
        kd.gather_batch(k, t["images"], t["labels8"], t["perm"], t["step"], t["x"], t["y"], 10, 11)
    with pytest.raises(ValueError, match="multiple of 8"):
        kd.gather_batch(k, t["images"], t["labels8"], t["perm"], t["step"], a.tensor("x2", (10, 790), np.float16),
                        t["y"], 10, 10)
    with pytest.raises(ValueError, match="row stride"):
        kd.gather_batch(k, t["images"], t["labels8"], t["perm"], t["step"], a.tensor("x3", (10, 776), np.float16),
                        t["y"], 10, 10)
    with pytest.raises(ValueError, match="x_out"):  # fewer rows than the batch
        kd.gather_batch(k, t["images"], t["labels8"], t["perm"], t["step"], t["x"], t["y"], 11, 9)
    with pytest.raises(TypeError, match="labels"):
        kd.gather_batch(k, t["images"], t["y"], t["perm"], t["step"], t["x"], t["y"], 10, 10)
    with pytest.raises(TypeError, match="step"):
        kd.step_increment(k, t["correct"])
    gather = functools.partial(kd.gather_batch, k, t["images"], t["labels8"], t["perm"], t["step"], t["x"], t["y"],
                               10, 10)
    with pytest.raises(ValueError, match="optim"):
        gather(optim=a.tensor("lr2", 2, np.float32), schedule=kd.Schedule(0.1, 0.0, 10, 0, 0))
    with pytest.raises(ValueError, match="unknown lr schedule"):
        gather(optim=t["optim"], schedule=kd.Schedule(0.1, 0.0, 10, 0, "exponential"))
    with pytest.raises(ValueError, match="must be >= 0"):
        gather(optim=t["optim"], schedule=kd.Schedule(0.1, 0.0, -1, 0, 0))
    with pytest.raises(ValueError, match="together"):
        gather(optim=t["optim"])
    with pytest.raises(TypeError, match="logits"):
        kl.softmax_xent(k, a.tensor("l32", (10, 16), np.float32), t["y"], None, t["loss"], t["correct"], 10)
    with pytest.raises(ValueError, match="dlogits"):
        kl.softmax_xent(k, t["logits"], t["y"], a.tensor("d2", (10, 24), np.float16), t["loss"], t["correct"], 10)
    with pytest.raises(TypeError, match="loss_sum"):
        kl.softmax_xent(k, t["logits"], t["y"], None, a.tensor("l1", 1, np.float32), t["correct"], 10)
    with pytest.raises(ValueError, match="logits"):
        kl.softmax_xent(k, t["logits"], t["y"], None, t["loss"], t["correct"], 11)
    with pytest.raises(ValueError, match="copy output"):
        ke.copy_f16_if_odd(k, a.tensor("w16b", (256, 784), np.float16), t["w16"], None)
    with pytest.raises(TypeError, match="step counter"):
        ke.copy_f16_if_odd(k, t["w16"], t["w16"], t["optim"])
    with pytest.raises(ValueError, match="init target \\(lo\\)"):
        ke.init_uniform_master(k, t["w16"], a.tensor("lo2", (256, 784), np.int16), 0.1, 0)
    with pytest.raises(ValueError, match="softmax_xent over 257 rows: its blocks' sums need the exact-sum scratch"):
        kl.softmax_xent(k, t["big_logits"], t["big_y"], None, t["loss"], t["correct"], 257)
    with pytest.raises(ValueError, match="bias sums over 4096 rows: needs 264 scratch words and 5 tickets, got 100"):
        ke.bias_update(k, t["big_dy"], t["bias264"], None, None, t["optim"], 4096, t["sums"].view((100,)),
                       t["sum_tickets"])
    with pytest.raises(TypeError, match="exact-sum scratch"):
        ke.bias_update(k, t["big_dy"], t["bias264"], None, None, t["optim"], 4096, t["grad264"], t["sum_tickets"])
    with pytest.raises(TypeError, match="bias dy"):
        ke.bias_update(k, a.tensor("dy32", (10, 264), np.float32), t["bias"], None, None, t["optim"], 10)
    with pytest.raises(ValueError, match="bias dy"):  # 10 rows only
        ke.bias_update(k, t["dy"], t["bias"], None, None, t["optim"], 11)
    with pytest.raises(ValueError, match="bias first moment"):
        ke.bias_update(k, t["dy"], t["bias"], a.tensor("m2", 255, np.float32), None, t["optim"], 10)
    with pytest.raises(ValueError, match="optim"):
        ke.bias_update(k, t["dy"], t["bias"], None, None, a.tensor("lr1", 1, np.float32), 10)
    with pytest.raises(TypeError, match="init target"):
        ke.init_uniform(k, t["w16"], 0.1, 0)


@pytest.mark.parametrize("rows,cols", [(0, 8), (1, 8), (10, 264), (1000, 4096), (3, 65536)])
def test_finish_sum_covers_every_piece_of_8_columns(rows, cols):
    a, k = Arena(), _Recorder()
    total, out = a.tensor("total", (rows + 1, cols), np.float32), a.tensor("out", (rows + 1, cols), np.float16)
    act = a.tensor("act", (rows + 1, cols), np.float16)
    ke.finish_sum(k, total, out, rows, "dact", act=act)
    (_, name, _, grid, block, _, args), = k.calls
    assert name == "finish_sum_dact" and args == (total, out, rows, cols, 0, act)  # no bias: null
    assert block == (ke.THREADS, 1, 1) and grid[0] * block[0] * 8 >= rows * cols  # a thread per 8 columns
    assert grid[0] == 1 or (grid[0] - 1) * block[0] * 8 < rows * cols


def test_finish_sum_refuses_bad_arguments_in_one_line():
    a, k = Arena(), _NoKernels()
    total, out = a.tensor("total", (10, 264), np.float32), a.tensor("out", (10, 264), np.float16)
    bias, act = a.tensor("bias", 264, np.float32), a.tensor("act", (10, 264), np.float16)
    halves = a.tensor("halves", 11 * 264, np.float16)
    floats = a.tensor("floats", 272, np.float32)
    bad = [
        (dict(epilogue="relu"), ValueError, "finish_sum: epilogue must be one of"),
        (dict(epilogue="store"), ValueError, "finish_sum: epilogue must be one of"),
        (dict(total=a.tensor("t16", (10, 264), np.float16)), TypeError, "finish_sum total: expected dtype float32"),
        (dict(total=a.tensor("t1", 2640, np.float32), out=a.tensor("o1", 2640, np.float16)), ValueError,
         "cols a multiple of 8"),
        (dict(total=a.tensor("t2", (10, 260), np.float32), out=a.tensor("o2", (10, 260), np.float16)), ValueError,
         "cols a multiple of 8"),
        (dict(out=a.tensor("o3", (10, 264), np.float32)), TypeError, "finish_sum out: expected dtype float16"),
        (dict(out=a.tensor("o4", (11, 264), np.float16)), ValueError, "finish_sum out: expected shape \\(10, 264\\)"),
        (dict(rows=11), ValueError, "rows=11 is outside 0..10"),
        (dict(rows=-1), ValueError, "rows=-1 is outside 0..10"),
        (dict(bias=None), ValueError, "bias_act takes a bias$"),
        (dict(act=a.tensor("a9", (10, 256), np.float16)), ValueError,
         "finish_sum act \\(the saved slope\\): expected shape"),
        (dict(epilogue="bias", bias=None), ValueError, "bias takes a bias and no act"),
        (dict(epilogue="bias", act=act), ValueError, "bias takes a bias and no act"),
        (dict(bias=a.tensor("b16", 264, np.float16)), TypeError, "finish_sum bias: expected dtype float32"),
        (dict(bias=a.tensor("b256", 256, np.float32)), ValueError, "finish_sum bias: 256 values, 264 needed"),
        (dict(epilogue="dact"), ValueError, "dact takes act .* and no bias"),  # a bias, no act
        (dict(epilogue="dact", bias=None), ValueError, "dact takes act"),
        (dict(epilogue="dact", bias=None, act=a.tensor("a2", (10, 256), np.float16)), ValueError,
         "finish_sum act: expected shape"),
        (dict(epilogue="dact", bias=None, act=a.tensor("a3", (10, 264), np.float32)), TypeError,
         "finish_sum act: expected dtype float16"),
        (dict(out=halves.view((10, 264), offset_bytes=8)), ValueError, "halves must start 16-byte aligned"),
        (dict(bias=floats.view((264,), offset_bytes=4)), ValueError, "floats must start 16-byte aligned"),
    ]
    base = dict(total=total, out=out, rows=10, epilogue="bias_act", bias=bias, act=None)
    for change, error, message in bad:
        with pytest.raises(error, match=message) as info:
            ke.finish_sum(k, **{**base, **change})
        assert "\n" not in str(info.value)


# --- CPU: host references -------------------------------------------------------------------------------------

def test_lr_at_constant_cosine_linear():
    lr0, lr_min, total, warm = 0.1, 0.001, 110, 10
    f = lambda s, kind: kd.lr_at(s, lr0, lr_min, total, warm, kind)  # noqa: E731
    for s in (0, 5, 109, 500):
        assert f(s, "constant") == f(s, 0) == pytest.approx(lr0, rel=1e-7)
    for kind in ("cosine", "linear"):
        assert f(0, kind) == pytest.approx(lr0 / 10, rel=1e-6)
        assert f(4, kind) == pytest.approx(lr0 / 2, rel=1e-6)
        assert f(9, kind) == pytest.approx(lr0, rel=1e-6)
        assert f(10, kind) == pytest.approx(lr0, rel=1e-6)  # t = 0
        assert f(60, kind) == pytest.approx((lr0 + lr_min) / 2, rel=1e-6)  # t = 1/2 for both shapes
        assert f(110, kind) == pytest.approx(lr_min, rel=1e-6)
        assert f(10_000, kind) == pytest.approx(lr_min, rel=1e-6)  # clamped past the end
    assert f(35, "cosine") == pytest.approx(lr_min + 0.5 * (lr0 - lr_min) * (1 + math.cos(math.pi / 4)), rel=1e-6)
    assert f(35, "linear") == pytest.approx(lr0 + (lr_min - lr0) * 0.25, rel=1e-6)
    # no warmup; total <= warmup does not divide by zero
    assert kd.lr_at(0, lr0, 0.0, 100, 0, "cosine") == pytest.approx(lr0, rel=1e-7)
    assert kd.lr_at(5, lr0, 0.0, 5, 5, "linear") == pytest.approx(lr0, rel=1e-7)
    assert kd.lr_at(6, lr0, 0.0, 5, 5, "linear") == 0.0
    vals = [f(s, "cosine") for s in range(10, 111)]
    assert all(a >= b for a, b in zip(vals, vals[1:])), "cosine decay must not increase"
    with pytest.raises(ValueError):
        kd.lr_at(0, lr0, 0.0, 10, 0, 3)


def test_init_uniform_reference_statistics():
    n, bound = 1 << 20, 0.05
    w = ke.init_uniform_reference(n, bound, 1234)
    assert w.dtype == np.float32 and w.shape == (n,)
    assert w.min() >= -bound and w.max() < bound
    assert w.min() < -0.999 * bound and w.max() > 0.999 * bound
    sigma = bound / math.sqrt(3)
    assert abs(float(w.mean(dtype=np.float64))) < 5 * sigma / math.sqrt(n)
    assert float(w.std(dtype=np.float64)) == pytest.approx(sigma, rel=0.01)
    hist, _ = np.histogram(w, bins=20, range=(-bound, bound))
    assert np.all(np.abs(hist / (n / 20) - 1) < 0.03), "not uniform"
    assert abs(np.corrcoef(w[:-1], w[1:])[0, 1]) < 0.01, "neighbours correlated"
    assert np.array_equal(ke.init_uniform_reference(n, bound, 1234), w), "same seed, same values"
    assert np.array_equal(ke.init_uniform_reference(1000, bound, 1234), w[:1000]), "a prefix does not depend on n"
    other = ke.init_uniform_reference(n, bound, 1235)
    assert np.mean(other == w) < 1e-3, "neighbouring seeds must give unrelated values"
    big = ke.init_uniform_reference(1000, bound, 2**64 - 1)
    assert np.isfinite(big).all() and not np.array_equal(big, ke.init_uniform_reference(1000, bound, 0))
    assert np.array_equal(ke.init_uniform_reference(100, 2 * bound, 7), 2 * ke.init_uniform_reference(100, bound, 7))
    rows, cols = np.arange(3, 40, dtype=np.uint64), np.arange(100, 164, dtype=np.uint64)  # a slice of a 1024-wide W
    index = rows[:, None] * 1024 + cols[None, :]
    assert np.array_equal(ke.init_uniform_at(index, bound, 1234), w[index.astype(np.intp)]), "values at indices"


# --- GPU ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kern(device):
    return Kernels(device.arch)


def _rel_to(got, ref, scale) -> float:
    """||got - ref|| over ||scale||: for results that are small differences of larger terms."""
    got, ref, scale = (np.asarray(a, np.float64) for a in (got, ref, scale))
    den = np.linalg.norm(scale)
    return float(np.linalg.norm(got - ref) / (den if den > 0 else 1.0))


def _rel(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(got - ref) / (den if den > 0 else 1.0))


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


@gpu
@pytest.mark.parametrize("row_bytes,ld", [(784, 784), (784, 800), (13, 16), (20, 24), (100, 128)])
@pytest.mark.parametrize("batch,spe", [(1, 1), (7, 3), (32, 5), (128, 2), (1000, 4)])
@pytest.mark.parametrize("early", [False, True])  # the loads before the wait for the kernel before, or after it
def test_gather_batch(kern, device, stream, rng, row_bytes, ld, batch, spe, early):
    n = 1500
    images = rng.integers(0, 256, size=(n, row_bytes), dtype=np.uint8)
    images[0, :] = 255  # the extremes are always present
    images[1, :] = 0
    labels = rng.integers(0, 10, size=n, dtype=np.uint8)
    perm = rng.integers(0, n, size=batch * spe, dtype=np.int32)
    step_value = 4 * spe - 1  # three epochs in: wraps to position spe - 1
    p = (step_value % spe) * batch
    assert p == (spe - 1) * batch
    perm[p], perm[p + min(1, batch - 1)] = 1, 0  # the all-0 and all-255 rows are in the batch
    got_step = _gather_and_check(kern, device, stream, images, labels, perm, step_value, batch, spe, ld, early=early)
    assert got_step == step_value, "gather must not move the step"


def _gather_and_check(kern, device, stream, images, labels, perm, step_value, batch, spe, ld, **options) -> int:
    """gather_batch at `step_value` into a poisoned fp16 batch one row taller than `batch`: the same pixels / 255 and
    labels as numpy, padding columns zero, nothing past the batch. The step counter afterwards."""
    row_bytes, p = images.shape[1], (step_value % spe) * batch
    with Arena() as arena:
        t_img, t_lab = arena.tensor("images", images.shape, np.uint8), arena.tensor("labels", len(labels), np.uint8)
        t_perm, t_step = arena.tensor("perm", perm.shape, np.int32), arena.tensor("step", 1, np.int64)
        x, y = arena.tensor("x", (batch + 1, ld), np.float16), arena.tensor("y", batch + 1, np.int32)
        arena.allocate()
        t_img.upload(images), t_lab.upload(labels), t_perm.upload(perm)
        t_step.upload(np.array([step_value], np.int64))
        x.fill_bytes(0xFF), y.fill_bytes(0xFF)
        device.synchronize()
        kd.gather_batch(kern, t_img, t_lab, t_perm, t_step, x, y, batch, spe, **options).run(stream)
        got_x, got_y, got_step = x.download(), y.download(), t_step.download()
    src = perm[p:p + batch]
    ref = (images[src] / 255).astype(np.float16)
    assert np.array_equal(got_x[:batch, :row_bytes].view(np.uint16), ref.view(np.uint16)), "pixels differ"
    assert np.all(got_x[:batch, row_bytes:].view(np.uint16) == 0), "padding columns must be zero"
    assert np.all(got_x[batch].view(np.uint16) == 0xFFFF), "wrote past the batch"
    assert np.array_equal(got_y[:batch], labels[src].astype(np.int32)) and got_y[batch] == -1
    return int(got_step[0])


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90"])
@pytest.mark.parametrize("source", ["gather.cu", "gather_models.cu"])
def test_gather_batch_fits_its_largest_block(arch, source):
    """The launcher gives gather_batch up to MAX_THREADS threads (wide rows): its registers must fit a block that
    size on every GPU (64K a block), or a launch fails for want of them. Checked on CPU."""
    from rawgpu.runtime import compiler

    r = compiler.compile_source(source, arch).resources["gather_batch"]
    assert r.registers * kd.MAX_THREADS <= 65536, f"{r.registers} registers x {kd.MAX_THREADS} threads"
    assert r.spill_stores == 0 and r.spill_loads == 0


@gpu
@pytest.mark.parametrize("row_bytes,ld,batch,blocks", [(16384, 16384, 5, None), (16000, 16008, 3, 2),
                                                       (4100, 4104, 4, 1), (784, 784, 1000, 7), (784, 800, 128, 16),
                                                       (13, 16, 9, 1)])
def test_gather_batch_wide_rows_and_shared_blocks(kern, device, stream, rng, row_bytes, ld, batch, blocks):
    """Rows wider than the largest block (each thread takes several 16-column steps, the last one partial), and
    fewer blocks than rows, give the same bytes as numpy, nothing past the batch."""
    n, spe = 40, 2
    images = rng.integers(0, 256, size=(n, row_bytes), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n, dtype=np.uint8)
    perm = rng.integers(0, n, size=batch * spe, dtype=np.int32)
    step_value = spe + 1  # the second batch of the second epoch
    assert _gather_and_check(kern, device, stream, images, labels, perm, step_value, batch, spe, ld,
                             blocks=blocks) == step_value


@gpu
def test_gather_batch_follows_the_device_step_counter(kern, device, stream, rng):
    n, batch, spe = 300, 4, 5
    images = rng.integers(0, 256, size=(n, 784), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n, dtype=np.uint8)
    perm = rng.permutation(n)[: batch * spe].astype(np.int32)
    with Arena() as arena:
        t_img, t_lab = arena.tensor("images", images.shape, np.uint8), arena.tensor("labels", n, np.uint8)
        t_perm, t_step = arena.tensor("perm", perm.shape, np.int32), arena.tensor("step", 1, np.int64)
        x, y = arena.tensor("x", (batch, 784), np.float16), arena.tensor("y", batch, np.int32)
        arena.allocate()
        t_img.upload(images), t_lab.upload(labels), t_perm.upload(perm)
        device.synchronize()
        gather = kd.gather_batch(kern, t_img, t_lab, t_perm, t_step, x, y, batch, spe)
        kd.set_i64(kern, t_step, 0).run(stream)
        for s in range(2 * spe + 2):
            gather.run(stream)
            kd.step_increment(kern, t_step).run(stream)
            src = perm[(s % spe) * batch:(s % spe + 1) * batch]
            assert np.array_equal(y.download(), labels[src].astype(np.int32)), f"step {s}"
            assert np.array_equal(x.download(), (images[src] / 255).astype(np.float16)), f"step {s}"
        assert t_step.download()[0] == 2 * spe + 2


@gpu
def test_counters(kern, device, stream):
    with Arena() as arena:
        c = arena.tensor("c", 1, np.int64)
        arena.allocate()
        kd.set_i64(kern, c, 2**40 + 5).run(stream)
        for _ in range(3):
            kd.step_increment(kern, c).run(stream)
        ke.increment_i64(kern, c, 10).run(stream)
        assert c.download()[0] == 2**40 + 18
        kd.set_i64(kern, c, -(2**62)).run(stream)
        assert c.download()[0] == -(2**62)


@gpu
@pytest.mark.parametrize("kind", ["constant", "cosine", "linear"])
def test_gather_writes_the_scheduled_lr(kern, device, stream, rng, kind):
    """The step's optimiser values ride on the gather: lr_at's value for the counter and, for Adam and AdamW, the
    bias corrections and the decoupled decay of that step (optimizer.step_values), the hyperparameters untouched; the
    batch is unchanged."""
    cases = [(0.1, 0.001, 1000, 50), (3e-3, 0.0, 17, 0), (0.5, 0.05, 10, 10), (1.0, 0.25, 1, 3)]
    n, batch, spe = 64, 3, 5
    images = rng.integers(0, 256, size=(n, 784), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n, dtype=np.uint8)
    perm = rng.permutation(n)[: batch * spe].astype(np.int32)
    tables = [optimizer.hyperparameters(r) for r in (Recipe(), Recipe(optimizer="adamw", weight_decay=0.1),
                                                     Recipe(optimizer="adam", beta1=0.5, beta2=0.9))]
    with Arena() as arena:
        t_img, t_lab = arena.tensor("images", images.shape, np.uint8), arena.tensor("labels", n, np.uint8)
        t_perm, step = arena.tensor("perm", perm.shape, np.int32), arena.tensor("step", 1, np.int64)
        x, y = arena.tensor("x", (batch, 784), np.float16), arena.tensor("y", batch, np.int32)
        optim = arena.tensor("optim", OPTIM_WORDS, np.float32)
        arena.allocate()
        t_img.upload(images), t_lab.upload(labels), t_perm.upload(perm)
        for (lr0, lr_min, total, warm), hyper in itertools.product(cases, tables):
            schedule = kd.Schedule(lr0, lr_min, total, warm, kind)
            for s in sorted({0, 1, warm - 1, warm, warm + 1, (total + warm) // 2, total - 1, total, total + 5, 10**6}):
                if s < 0:
                    continue
                step.upload(np.array([s], np.int64))
                poisoned = optimizer.words(hyper)
                poisoned[:4] = np.nan  # the step's values
                optim.upload(poisoned), x.fill_bytes(0xFF)
                device.synchronize()
                kd.gather_batch(kern, t_img, t_lab, t_perm, step, x, y, batch, spe, optim=optim,
                                schedule=schedule).run(stream)
                got, ref = optim.download(), kd.lr_at(s, lr0, lr_min, total, warm, kind)
                assert np.isfinite(got).all()
                assert float(got[0]) == pytest.approx(ref, rel=1e-6, abs=1e-12), (lr0, lr_min, total, warm, s)
                expect = optimizer.words(optimizer.step_values(hyper, s, ref))
                np.testing.assert_allclose(got[:4], expect[:4], rtol=1e-6, err_msg=f"step {s}")
                assert np.array_equal(got[4:].view(np.uint32), expect[4:].view(np.uint32)), "hyperparameters moved"
                src = perm[(s % spe) * batch:(s % spe + 1) * batch]
                assert np.array_equal(x.download(), (images[src] / 255).astype(np.float16)), f"step {s}"
                assert step.download()[0] == s, "gather must not move the step"


def _xent_reference(logits: np.ndarray, labels: np.ndarray, classes: int):
    z = logits[:, :classes].astype(np.float64)
    m = z.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))
    rows = np.arange(len(labels))
    loss = lse - z[rows, labels]
    p = np.exp(z - lse[:, None])
    p[rows, labels] -= 1.0
    return loss.sum(), int((z.argmax(axis=1) == labels).sum()), p / len(labels)


@gpu
@pytest.mark.parametrize("classes,ld", [(10, 16), (10, 10), (13, 24), (40, 48), (1000, 1000)])
@pytest.mark.parametrize("batch", [1, 7, 32, 128, 256, 257, 1000, 4096])
def test_softmax_xent(kern, device, stream, rng, batch, classes, ld):
    """Loss, hits and dlogits against float64; one block up to 256 rows, above it blocks of 16 rows whose sums meet
    exactly (the scratch and ticket left zero); above 16 classes blocks of 8 rows at any batch; metrics accumulate
    over launches; bitwise repeatable."""
    logits = (rng.standard_normal((batch + 2, ld)) * 3).astype(np.float16)
    labels = rng.integers(0, classes, size=batch).astype(np.int32)
    if batch >= 2:  # an exact tie: the first max (column 3) is the prediction, so label 7 is a miss
        logits[1, :classes] = -1.0
        logits[1, 3] = logits[1, 7] = 2.0
        labels[1] = 7
    loss_ref, correct_ref, d_ref = _xent_reference(logits[:batch], labels, classes)
    with Arena() as arena:
        t_z, t_lab = arena.tensor("z", logits.shape, np.float16), arena.tensor("lab", batch, np.int32)
        t_d = arena.tensor("d", logits.shape, np.float16)
        t_loss, t_corr = arena.tensor("loss", 1, np.float64), arena.tensor("corr", 1, np.int32)
        sums, tickets = arena.tensor("sums", 2, np.int64), arena.tensor("tickets", 1, np.int32)
        arena.allocate()
        arena.zero()
        t_z.upload(logits), t_lab.upload(labels)
        t_d.fill_bytes(0xFF), t_loss.fill_bytes(0xFF), t_corr.fill_bytes(0xFF)
        device.synchronize()
        zero = kl.zero_metrics(kern, t_loss, t_corr)
        train = kl.softmax_xent(kern, t_z, t_lab, t_d, t_loss, t_corr, batch, classes, scratch=sums, ticket=tickets)
        assert kl.xent_blocks(batch, classes) == (-(-batch // 8) if classes > 16 else 1 if batch <= 256
                                                  else -(-batch // 8))
        zero.run(stream)
        train.run(stream)
        d1, loss1, corr1 = t_d.download(), t_loss.download(), t_corr.download()

        # the gradient and the metrics
        assert corr1[0] == correct_ref
        assert abs(loss1[0] - loss_ref) <= 1e-5 * abs(loss_ref)
        assert np.isfinite(d1[:batch]).all()
        # against the reference as fp16 stores it: at 1000 classes and 4096 rows most of the gradient is fp16
        # subnormal (below 6e-5), where a half step of rounding is a large share of a value
        assert _rel(d1[:batch, :classes], d_ref.astype(np.float16)) <= 1e-3
        assert np.all(d1[:batch, classes:].view(np.uint16) == 0), "padding columns must be zero"
        assert np.all(d1[batch:].view(np.uint16) == 0xFFFF), "wrote past the batch"
        assert not sums.download().any() and not tickets.download().any(), "the exact-sum buffers must end at zero"

        # the metrics accumulate over launches; zero_metrics resets them
        train.run(stream)
        loss2, corr2 = t_loss.download(), t_corr.download()
        assert loss2[0] == 2 * loss1[0] and corr2[0] == 2 * corr1[0]
        zero.run(stream)
        assert t_loss.download()[0] == 0.0 and t_corr.download()[0] == 0

        # bitwise repeatable
        train.run(stream)
        assert np.array_equal(_bits(t_d.download()), _bits(d1))
        assert _bits(t_loss.download()).tobytes() == _bits(loss1).tobytes() and t_corr.download()[0] == corr1[0]

        # evaluation: the same metrics, dlogits untouched
        t_d.fill_bytes(0xFF)
        device.synchronize()
        zero.run(stream)
        kl.softmax_xent(kern, t_z, t_lab, None, t_loss, t_corr, batch, classes, scratch=sums,
                        ticket=tickets).run(stream)
        assert np.all(t_d.download().view(np.uint16) == 0xFFFF), "evaluation must not write dlogits"
        assert _bits(t_loss.download()).tobytes() == _bits(loss1).tobytes() and t_corr.download()[0] == corr1[0]


@gpu
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 4099, 784 * 1000])
@pytest.mark.parametrize("misaligned", [False, True])
def test_copy_f16_if_odd(kern, device, stream, rng, n, misaligned):
    """Copies every element (16-byte path and scalar tail) when there is no counter or it is odd; nothing when even."""
    x = rng.standard_normal(n).astype(np.float16)
    shift = 2 if misaligned else 0  # a 2-byte shift takes the scalar path
    with Arena() as arena:
        xb, ob = arena.tensor("xb", n + 8, np.float16), arena.tensor("ob", n + 16, np.float16)
        step = arena.tensor("step", 1, np.int64)
        t_x, t_o = xb.view((n,), offset_bytes=shift), ob.view((n,), offset_bytes=shift)
        arena.allocate()
        t_x.upload(x)
        for counter, copies in ((None, True), (4, False), (7, True)):
            ob.fill_bytes(0xFF)
            if counter is not None:
                step.upload(np.array([counter], np.int64))
            device.synchronize()
            ke.copy_f16_if_odd(kern, t_o, t_x, None if counter is None else step).run(stream)
            got = ob.download().view(np.uint16)
            lo = shift // 2
            want = x.view(np.uint16) if copies else np.full(n, 0xFFFF, np.uint16)
            assert np.array_equal(got[lo:lo + n], want), f"counter {counter}"
            assert np.all(got[:lo] == 0xFFFF) and np.all(got[lo + n:] == 0xFFFF), "wrote outside the view"


@gpu
@pytest.mark.parametrize("n", [1, 5, 1000, 4099])
@pytest.mark.parametrize("misaligned", [False, True])
def test_fill_f32(kern, device, stream, n, misaligned):
    shift = 4 if misaligned else 0
    with Arena() as arena:
        buf = arena.tensor("buf", n + 8, np.float32)
        t = buf.view((n,), offset_bytes=shift)
        arena.allocate()
        buf.fill_bytes(0xFF)
        device.synchronize()
        ke.fill_f32(kern, t, -1.25).run(stream)
        got = buf.download()
    lo = shift // 4
    assert np.all(got[lo:lo + n] == np.float32(-1.25))
    assert np.all(got[:lo].view(np.uint32) == 0xFFFFFFFF) and np.all(got[lo + n:].view(np.uint32) == 0xFFFFFFFF)


@gpu
def test_axpby_launcher(kern, device, stream, rng):
    n = 1001
    x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    with Arena() as arena:
        tx, ty = arena.tensor("x", n, np.float32), arena.tensor("y", n, np.float32)
        arena.allocate()
        tx.upload(x), ty.upload(y)
        device.synchronize()
        ke.axpby_f32(kern, ty, tx, 2.0, -0.5).run(stream)
        got = ty.download()
    assert _rel(got, 2.0 * x.astype(np.float64) - 0.5 * y) <= 1e-6


@gpu
@pytest.mark.parametrize("n", [1, 7, 1000, 784 * 256 + 5])
@pytest.mark.parametrize("seed", [0, 42, 2**64 - 1])
def test_init_uniform_is_bit_exact_and_grid_independent(kern, device, stream, n, seed):
    bound = 1 / math.sqrt(784)
    ref = ke.init_uniform_reference(n, bound, seed)
    with Arena() as arena:
        buf = arena.tensor("w", n + 4, np.float32)
        w = buf.view((n,))
        arena.allocate()
        buf.fill_bytes(0xFF)
        device.synchronize()
        launch = ke.init_uniform(kern, w, bound, seed)
        launch.run(stream)
        got = buf.download()
        assert np.array_equal(got[:n].view(np.uint32), ref.view(np.uint32)), "differs from the host reference"
        assert np.all(got[n:].view(np.uint32) == 0xFFFFFFFF)
        w.fill_bytes(0xFF)
        device.synchronize()
        args = [v.value for v in launch.args.values[1:]]
        kern.get("elementwise.cu", "init_uniform").bind(3, 32, 0, w, *args).run(stream)
        assert np.array_equal(w.download().view(np.uint32), ref.view(np.uint32)), "depends on the grid"


@gpu
@pytest.mark.parametrize("n", [1, 1000, 784 * 256 + 5])
def test_init_uniform_master_is_the_host_split_of_the_same_values(kern, device, stream, n):
    """The master weights' init: init_uniform's values split on the device exactly as rawgpu/model/master.py splits them
    (the values themselves checked bit for bit above); poisoned first."""
    bound, seed = 1 / math.sqrt(100), 12345
    hi_ref, lo_ref = master.split(ke.init_uniform_reference(n, bound, seed))
    with Arena() as arena:
        hi, lo = arena.tensor("hi", n, np.float16), arena.tensor("lo", n, np.int16)
        arena.allocate()
        hi.fill_bytes(0xFF)
        lo.fill_bytes(0x7F)
        device.synchronize()
        ke.init_uniform_master(kern, hi, lo, bound, seed).run(stream)
        assert np.array_equal(hi.download().view(np.uint16), hi_ref.view(np.uint16))
        assert np.array_equal(lo.download(), lo_ref)


WINDOWS = [  # target shape, window: a whole layer, padded, one GPU's column or row slice of a layer, a bias slice
    ((784, 256), ke.Window((784, 256))),
    ((104, 16), ke.Window((100, 10))),
    ((784, 136), ke.Window((784, 130), (0, 130), 260)),
    ((56, 4096), ke.Window((50, 4096), (4050, 0), 4096)),
    ((264,), ke.Window((1, 259), (0, 1000), 4096)),
    ((8, 16), ke.Window((0, 0))),
]


@gpu
@pytest.mark.parametrize("shape,window", WINDOWS)
def test_init_uniform_window_draws_the_whole_layers_values(kern, device, stream, shape, window):
    """A window of a layer (padding, one rank's slice) holds, bit for bit, the values the whole layer holds at the
    same places, and zero padding: both init kernels, poisoned first; the master split as master.py's."""
    bound, seed = 1 / math.sqrt(784), 99
    ref = ke.init_uniform_window_reference(shape, window, bound, seed)
    whole_cols = window.whole_cols or window.true_shape[1]
    (r0, c0), (rows, cols) = window.origin, window.true_shape
    if rows and cols:
        whole = ke.init_uniform_reference((r0 + rows) * whole_cols, bound, seed).reshape(-1, whole_cols)
        assert np.array_equal(ref.reshape(-1, shape[-1])[:rows, :cols], whole[r0:r0 + rows, c0:c0 + cols])
    assert not ref.reshape(-1, shape[-1])[rows:].any() and not ref.reshape(-1, shape[-1])[:, cols:].any()
    with Arena() as arena:
        w, hi, lo = (arena.tensor(name, shape, dt) for name, dt in
                     (("w", np.float32), ("hi", np.float16), ("lo", np.int16)))
        arena.allocate()
        for t in (w, hi, lo):
            t.fill_bytes(0x7F)
        device.synchronize()
        ke.init_uniform(kern, w, bound, seed, window).run(stream)
        ke.init_uniform_master(kern, hi, lo, bound, seed, window).run(stream)
        hi_ref, lo_ref = master.split(ref)
        assert np.array_equal(w.download().view(np.uint32), ref.view(np.uint32))
        assert np.array_equal(hi.download().view(np.uint16), hi_ref.view(np.uint16))
        assert np.array_equal(lo.download(), lo_ref)


def test_init_window_must_fit_its_target():
    assert ke.Window((8, 10), (3, 5), 40).args((8, 16)) == (8, 16, 8, 10, 125, 40)
    assert ke.Window.whole((264,)).args((264,)) == (1, 264, 1, 264, 0, 264)
    with pytest.raises(ValueError, match=r"init window of \(9, 16\) values does not fit the \(8, 16\) target"):
        ke.Window((9, 16)).args((8, 16))


@gpu
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("cols,pad", [(1, 7), (10, 6), (13, 3), (256, 0), (784, 16), (1000, 8), (4096, 8), (10, 0), (13, 0)])
@pytest.mark.parametrize("rows", [1, 7, 32, 128, 1000])
def test_bias_update(kern, device, stream, rng, rows, cols, pad, opt):
    """Every optimiser's bias step on exact column sums: against float64 from fresh state, poisoned tails, bitwise
    repeatable."""
    ld = cols + pad  # pad 0 with cols 10 or 13: ld not a multiple of 8, the scalar path
    dy = rng.standard_normal((rows + 1, ld)).astype(np.float16)
    g = dy[:rows, :cols].astype(np.float64).sum(axis=0)
    sentinel = np.float32(7.0)
    recipe = OPTIMIZERS[opt]
    states = recipe._state_tensors
    table = optimizer.step_values(optimizer.hyperparameters(recipe), 2, 0.05)
    bias0 = rng.standard_normal(cols).astype(np.float32)
    m0 = rng.standard_normal(cols).astype(np.float32)
    v0 = rng.uniform(0, rows, cols).astype(np.float32)
    with Arena() as arena:
        t_dy, t_opt = arena.tensor("dy", dy.shape, np.float16), arena.tensor("optim", OPTIM_WORDS, np.float32)
        bufs = [arena.tensor(n, cols + 8, np.float32) for n in ("b", "m", "v")]
        sums, tickets = arena.tensor("sums", cols, np.int64), arena.tensor("tickets", cols, np.int32)
        arena.allocate()
        arena.zero()
        t_dy.upload(dy), t_opt.upload(optimizer.words(table))
        tail = np.full(8, sentinel, np.float32)

        def reset():
            for buf, start in zip(bufs, (bias0, m0, v0)):
                buf.upload(np.concatenate([start, tail]))
            device.synchronize()

        reset()
        views = [buf.view((cols,)) for buf in bufs]
        launch = ke.bias_update(kern, t_dy, views[0], views[1] if states else None, views[2] if states > 1 else None,
                                t_opt, rows, sums, tickets)
        launch.run(stream)
        got = [buf.download() for buf in bufs]
        reset()
        launch.run(stream)
        for buf, first in zip(bufs, got):
            assert np.array_equal(_bits(buf.download()), _bits(first)), "not bitwise repeatable"
        assert not sums.download().any() and not tickets.download().any(), "the exact-sum buffers must end at zero"
    assert all(np.all(x[cols:] == sentinel) for x in got), "wrote past the end"
    got_b, got_m, got_v = (x[:cols] for x in got)
    assert np.isfinite(got_b).all()
    ref_b, ref_m, ref_v = update_reference(table, bias0, g, m0, v0)
    # b - step in fp32 can cancel (one column, fresh random data): its error is measured against the terms' size
    assert _rel_to(got_b, ref_b, np.abs(bias0) + np.abs(ref_b - bias0)) <= 1e-5
    if states:
        assert _rel_to(got_m, ref_m, np.abs(m0) + np.abs(g)) <= 1e-5
    else:
        assert np.array_equal(got_m, m0), "no state: the momentum buffer must be untouched"
    if states > 1:
        assert _rel(got_v, ref_v) <= 1e-5
    else:
        assert np.array_equal(got_v, v0)


@gpu
def test_bias_update_many_rows(kern, device, stream, rng):
    """60000 rows (the whole training set at once), few columns: 235 row ranges whose exact sums give the float64
    sum rounded once, bit for bit."""
    rows, cols, ld = 60000, 10, 16
    dy = (rng.standard_normal((rows, ld)) * 0.01).astype(np.float16)
    g = dy[:, :cols].astype(np.float64).sum(axis=0)
    with Arena() as arena:
        t_dy, t_opt, bias = (arena.tensor("dy", dy.shape, np.float16), arena.tensor("optim", OPTIM_WORDS, np.float32),
                             arena.tensor("b", cols, np.float32))
        sums, tickets = arena.tensor("sums", cols, np.int64), arena.tensor("tickets", 2, np.int32)
        arena.allocate()
        arena.zero()
        plain = optimizer.step_values(optimizer.hyperparameters(Recipe(momentum=0.0)), 0, 1.0)
        t_dy.upload(dy), t_opt.upload(optimizer.words(plain)), bias.upload(np.zeros(cols, np.float32))
        device.synchronize()
        ke.bias_update(kern, t_dy, bias, None, None, t_opt, rows, sums, tickets).run(stream)
        got = bias.download()
    assert (-got).tobytes() == g.astype(np.float32).tobytes()


@gpu
@pytest.mark.parametrize("epilogue", ke.FINISH_EPILOGUES)
@pytest.mark.parametrize("R,C,rows", [(1, 8, 1), (7, 24, 5), (32, 1024, 32), (130, 4096, 128), (1000, 136, 999),
                                      (256, 264, 200), (64, 264, 0)])
def test_finish_sum(kern, device, stream, rng, R, C, rows, epilogue):
    """A store32 GEMM's summed output finished: against float64, and bit for bit the GEMM epilogue's arithmetic (an
    fp32 add, ReLU, round to nearest fp16: numpy's float32 ops give the same); out poisoned first, rows from `rows`
    on left alone, columns of the bias past C unread."""
    total = (rng.standard_normal((R, C)) * 8).astype(np.float32)
    bias = rng.uniform(-4, 4, C + 8).astype(np.float32)  # more values than columns: the first C count
    act = rng.standard_normal((R, C)).astype(np.float16)  # negative, positive and (below) zeros of both signs
    act[::3, ::5] = 0.0
    act[1::4, 2::7] = -0.0
    with Arena() as arena:
        t_total, t_out = arena.tensor("total", (R, C), np.float32), arena.tensor("out", (R, C), np.float16)
        t_bias, t_act = arena.tensor("bias", C + 8, np.float32), arena.tensor("act", (R, C), np.float16)
        arena.allocate()
        t_total.upload(total), t_bias.upload(bias), t_act.upload(act)
        t_out.fill_bytes(0xFF)
        device.synchronize()
        extra = {"act": t_act} if epilogue == "dact" else {"bias": t_bias}
        launch = ke.finish_sum(kern, t_total, t_out, rows, epilogue, **extra)
        launch.run(stream)
        got = t_out.download()
        t_out.fill_bytes(0xFF)
        device.synchronize()
        launch.run(stream)
        again = t_out.download()
    assert np.all(got[rows:].view(np.uint16) == 0xFFFF), "wrote rows from `rows` on"
    assert np.array_equal(_bits(again), _bits(got)), "not bitwise repeatable"
    got, t, a = got[:rows], total[:rows], act[:rows]
    if epilogue == "dact":
        ref = np.where(a > 0, t.astype(np.float64), 0.0)
        exact = np.where(a > 0, t, np.float32(0)).astype(np.float16)
    else:
        ref = t.astype(np.float64) + bias[:C]
        exact = t + bias[:C]  # float32, as the kernel adds
        if epilogue == "bias_act":
            ref, exact = np.maximum(ref, 0.0), np.maximum(exact, np.float32(0))
        exact = exact.astype(np.float16)
    assert np.isfinite(got).all()
    assert _rel(got, ref) <= 1e-3  # rounding to fp16: about 2e-4
    assert np.array_equal(got.view(np.uint16), exact.view(np.uint16)), "not the GEMM epilogue's rounding"
