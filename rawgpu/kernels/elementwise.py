"""Launchers for cu/elementwise.cu: casts, fills, init, counters, the bias update, and what finishes sums over GPUs
(the epilogue of summed GEMMs, the update from summed gradients).

Each checks its tensors (so a wrong buffer fails here, by name) and returns a bound Launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import contract
from ..contract import EW_THREADS, OPTIM_WORDS
from ..runtime.driver import Launch
from ..runtime.memory import Tensor
from . import Kernels, blocks_for, require, require_exact_sums

SRC = "elementwise.cu"
THREADS = EW_THREADS  # every launch's block; bias_update's shared partials are compiled for it


def axpby_f32(k: Kernels, y: Tensor, x: Tensor, a: float, b: float) -> Launch:
    """y = a*x + b*y (fp32, same shape)."""
    require(y, np.float32, what="axpby y")
    require(x, np.float32, y.shape, what="axpby x")
    return k.get(SRC, "axpby_f32").bind(blocks_for(y.size, THREADS), THREADS, 0, y, x, a, b, y.size)


def copy_f16_if_odd(k: Kernels, dst: Tensor, src: Tensor, step: Tensor | None) -> Launch:
    """dst = src (fp16, same shape) when step is None or the device counter step[0] is odd: the fused step's two
    working copies made equal to the current one, copy (steps done) & 1."""
    require(src, np.float16, what="copy input")
    require(dst, np.float16, src.shape, what="copy output")
    if step is not None:
        require(step, np.int64, (1,), what="step counter")
    return k.get(SRC, "copy_f16_if_odd").bind(blocks_for(src.size, THREADS, 8), THREADS, 0, dst, src,
                                                      src.size, 0 if step is None else step)


def increment_i64(k: Kernels, counter: Tensor, by: int = 1) -> Launch:
    """counter[0] += by on the device (graph-replayable step counter)."""
    require(counter, np.int64, (1,), what="counter")
    return k.get(SRC, "increment_i64").bind(1, 32, 0, counter, by)


def fill_f32(k: Kernels, t: Tensor, value: float) -> Launch:
    """Every element of an fp32 tensor = value (e.g. zero the momentum inside a graph)."""
    require(t, np.float32, what="fill target")
    return k.get(SRC, "fill_f32").bind(blocks_for(t.size, THREADS, 4), THREADS, 0, t, t.size, value)


# bias_update's rows per block: above BIAS_SPLIT_ROWS rows, ranges of rows run in blocks of their own, whose sums meet
# exactly; enough ranges for about BIAS_BLOCKS blocks (a block's 32 row threads each add their rows one after another:
# few long ranges leave the SMs idle, many short ones queue on the sums), from BIAS_MIN_RANGE to BIAS_SPLIT_ROWS rows.
BIAS_SPLIT_ROWS = 256
BIAS_MIN_RANGE = 64
BIAS_BLOCKS = 256


def bias_update(k: Kernels, dy: Tensor, bias: Tensor, m: Tensor | None, v: Tensor | None, optim: Tensor,
                rows: int, scratch: Tensor | None = None, tickets: Tensor | None = None) -> Launch:
    """g = column sums of dy[:rows, :cols] (fp16 [B, ld], cols = bias size); the optimiser's step (the table
    `optim`, contract.Optim) on the fp32 bias, with its state m (momentum or Adam's first moment) and v (Adam's
    second), each None where the optimiser keeps none. The sums are exact (fixed point), so the result's bits depend
    on nothing but the data. Above BIAS_SPLIT_ROWS rows, ranges of rows run in blocks of their own and meet through
    scratch (int64, a word per column) and tickets (int32, one per column tile), both zero and left zero (the model's
    exact-sum buffers).
    """
    require(bias, np.float32, what="bias")
    if len(bias.shape) != 1:
        raise ValueError(f"bias: expected a 1-D tensor, got shape {bias.shape}")
    for state, what in ((m, "bias first moment"), (v, "bias second moment")):
        if state is not None:
            require(state, np.float32, bias.shape, what=what)
    require(optim, np.float32, (OPTIM_WORDS,), what="optim")
    return _bias_sums(k, dy, bias.shape[0], rows, bias, m, v, optim, None, scratch, tickets)


def bias_grad(k: Kernels, dy: Tensor, grad: Tensor, rows: int, scratch: Tensor | None = None,
              tickets: Tensor | None = None) -> Launch:
    """grad = column sums of dy[:rows, :cols] (cols = grad's size) as bias_update sums them, without the update: data
    parallelism adds them up over the GPUs first (apply_update)."""
    require(grad, np.float32, what="bias gradient")
    if len(grad.shape) != 1:
        raise ValueError(f"bias gradient: expected a 1-D tensor, got shape {grad.shape}")
    return _bias_sums(k, dy, grad.shape[0], rows, None, None, None, None, grad, scratch, tickets)


def bias_blocks(cols: int, rows: int) -> tuple[int, int, int, int]:
    """bias_update's block columns (tx), column tiles, row ranges and rows per range for a layer: the block shape
    depends only on cols; above BIAS_SPLIT_ROWS rows the row ranges need the exact-sum buffers (a word per column, a
    ticket per tile)."""
    groups = -(-cols // 8)  # 8 columns per thread
    tx = 1
    while tx < min(groups, 8):
        tx *= 2
    tiles = max(1, -(-cols // (8 * tx)))
    if rows <= BIAS_SPLIT_ROWS:
        return tx, tiles, 1, BIAS_SPLIT_ROWS
    per_range = 32 * -(-rows * tiles // (32 * BIAS_BLOCKS))  # a multiple of the block's 32 row threads
    per_range = min(BIAS_SPLIT_ROWS, max(BIAS_MIN_RANGE, per_range))
    return tx, tiles, -(-rows // per_range), per_range


def _bias_sums(k: Kernels, dy: Tensor, cols: int, rows: int, bias: Tensor | None, m: Tensor | None,
               v: Tensor | None, optim: Tensor | None, grad: Tensor | None, scratch: Tensor | None,
               tickets: Tensor | None) -> Launch:
    require(dy, np.float16, what="bias dy")
    if len(dy.shape) != 2 or dy.shape[1] < cols:
        raise ValueError(f"bias dy: expected shape [rows, ld >= {cols}], got {dy.shape}")
    if not 0 <= rows <= dy.shape[0]:
        raise ValueError(f"bias dy: rows={rows} is outside 0..{dy.shape[0]}")
    tx, tiles, ranges, per_range = bias_blocks(cols, rows)
    if ranges > 1:
        require_exact_sums(scratch, tickets, cols, tiles, f"bias sums over {rows} rows")
    return k.get(SRC, "bias_update").bind(
        (tiles, ranges), (tx, THREADS // tx), 0, dy, dy.shape[1], rows, cols,
        *(0 if t is None else t for t in (bias, m, v, optim, grad)), per_range,
        *((scratch, tickets) if ranges > 1 else (0, 0)))


def apply_update(k: Kernels, g: Tensor, gb: Tensor, w16: Tensor, wlo: Tensor, mw: Tensor | None, vw: Tensor | None,
                 bias: Tensor, mb: Tensor | None, vb: Tensor | None, optim: Tensor, family: str) -> Launch:
    """One layer's optimiser step from its gradients g (fp32, the weights' shape [rows, cols], cols even) and gb
    (fp32 [cols]), summed over the GPUs (data parallelism): the master weights (w16, wlo) and their state (mw: momentum
    or Adam's first moment, vw: Adam's second; None where the optimiser keeps none) by the GEMM's own update
    epilogue, the bias and its state (mb, vb) as bias_update does it: with one GPU, the bits of the fused updates.
    family: "sgd" or "adam" (the GEMM epilogue's, contract.UPDATE_EPILOGUES)."""
    if family not in contract.UPDATE_FAMILIES:
        raise ValueError(f"apply_update: family must be {' or '.join(map(repr, contract.UPDATE_FAMILIES))}, got "
                         f"{family!r}")
    require(g, np.float32, what="weight gradient")
    if len(g.shape) != 2 or g.shape[1] % 2:
        raise ValueError(f"weight gradient: expected [rows, cols] with cols even, got {g.shape}")
    rows, cols = g.shape
    require(w16, np.float16, g.shape, what="w16")
    require(wlo, np.int16, g.shape, what="wlo")
    require(gb, np.float32, (cols,), what="bias gradient")
    require(bias, np.float32, (cols,), what="bias")
    adam = family == "adam"
    for t, shape, what, needed in ((mw, g.shape, "first moment", adam), (vw, g.shape, "second moment", adam),
                                   (mb, (cols,), "bias first moment", adam), (vb, (cols,), "bias second moment", adam)):
        if t is not None:
            require(t, np.float32, shape, what=what)
        elif needed:
            raise ValueError(f"apply_update: Adam needs the {what}")
    if (mw is None) != (mb is None) or (not adam and vw is not None):
        raise ValueError("apply_update: the weights and the bias keep the same optimiser state")
    for t in (g, w16, wlo, mw, vw):
        if t is not None and t.offset % 8:
            raise ValueError(f"apply_update: {t.name} must start 8-byte aligned for pair access (offset {t.offset})")
    require(optim, np.float32, (OPTIM_WORDS,), what="optim")
    return k.get(SRC, f"apply_update_{family}").bind(
        blocks_for(rows * cols // 2 + cols, THREADS), THREADS, 0, g, gb, w16, wlo,
        *(0 if t is None else t for t in (mw, vw)), bias, *(0 if t is None else t for t in (mb, vb)), optim, rows, cols)


FINISH_EPILOGUES = ("bias", "bias_act", "dact")  # the GEMM epilogues finish_sum runs (finish_sum_<epilogue>)


def finish_sum(k: Kernels, total: Tensor, out: Tensor, rows: int, epilogue: str, bias: Tensor | None = None,
               act: Tensor | None = None) -> Launch:
    """out[:rows] = the GEMM epilogue `epilogue` on total[:rows], a store32 GEMM's fp32 sums after the GPUs added
    them up (rawgpu/steps/split.py): fp16(total + bias) (bias), fp16(act(total + bias)) (bias_act, with act'
    to `act` when given: where the activation's backward reads it), fp16(total x act'), act' from the
    value the forward saved in `act` (dact). total fp32 and out fp16 [R, C], C a multiple of 8; bias fp32 of C
    values at least; act fp16 [R, C]. Rows from `rows` on are left alone. It rounds as the GEMM's epilogue does
    (gemm_epilogue.cuh: fp16_epilogue2): with one partial sum, the bits of the GEMM with that epilogue."""
    if epilogue not in FINISH_EPILOGUES:
        raise ValueError(f"finish_sum: epilogue must be one of {FINISH_EPILOGUES}, got {epilogue!r}")
    require(total, np.float32, what="finish_sum total")
    if len(total.shape) != 2 or total.shape[1] % 8:
        raise ValueError(f"finish_sum total: expected [rows, cols] with cols a multiple of 8, got {total.shape}")
    require(out, np.float16, total.shape, what="finish_sum out")
    R, C = total.shape
    if not 0 <= rows <= R:
        raise ValueError(f"finish_sum: rows={rows} is outside 0..{R}")
    if epilogue == "dact":
        if bias is not None or act is None:
            raise ValueError("finish_sum: dact takes act (the saved forward output) and no bias")
        require(act, np.float16, total.shape, what="finish_sum act")
    else:
        if bias is None or (act is not None and epilogue == "bias"):
            raise ValueError(f"finish_sum: {epilogue} takes a bias" + (" and no act" if epilogue == "bias" else ""))
        if act is not None:
            require(act, np.float16, total.shape, what="finish_sum act (the saved slope)")
        require(bias, np.float32, what="finish_sum bias")
        if bias.size < C:
            raise ValueError(f"finish_sum bias: {bias.size} values, {C} needed")
    for t in (total, out, bias, act):
        if t is not None and t.offset % 16:
            raise ValueError(f"finish_sum: {t.name} must start 16-byte aligned for vector access (offset {t.offset})")
    return k.get(SRC, f"finish_sum_{epilogue}").bind(blocks_for(rows * (C // 8), THREADS), THREADS, 0,
                                                               total, out, rows, C, 0 if bias is None else bias,
                                                               0 if act is None else act)


def _seed_i64(seed: int) -> int:
    """A seed as the signed 64-bit pattern the launch packs (the kernel reads it as u64)."""
    s = int(seed) & (2**64 - 1)
    return s - 2**64 if s >= 2**63 else s


@dataclass(frozen=True)
class Window:
    """Where a tensor sits in the whole layer init_uniform draws: its element (r, c) is the layer's (row0 + r,
    col0 + c), of a layer `whole_cols` wide; past `true_shape` it is padding (zero). A bias is one row."""

    true_shape: tuple[int, int]
    origin: tuple[int, int] = (0, 0)
    whole_cols: int | None = None  # default: true_shape's columns (the tensor is the whole layer)

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> "Window":
        return cls(_as_rows(shape))

    def args(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The kernel's rows, cols, true_rows, true_cols, first, stride for a target of this shape."""
        rows, cols = _as_rows(shape)
        true_rows, true_cols = self.true_shape
        if not (0 <= true_rows <= rows and 0 <= true_cols <= cols):
            raise ValueError(f"init window of {self.true_shape} values does not fit the {tuple(shape)} target")
        stride = true_cols if self.whole_cols is None else self.whole_cols
        return rows, cols, true_rows, true_cols, self.origin[0] * stride + self.origin[1], stride


def _as_rows(shape: tuple[int, ...]) -> tuple[int, int]:
    return (1, shape[0]) if len(shape) == 1 else (shape[0], shape[1])


def init_uniform(k: Kernels, w: Tensor, bound: float, seed: int, window: Window | None = None) -> Launch:
    """w = uniform(-bound, bound) from a hash of (seed, index in the whole layer): reproducible for a seed, on any
    grid, for any window of the layer (padding zero)."""
    require(w, np.float32, what="init target")
    window = window or Window.whole(w.shape)
    return k.get(SRC, "init_uniform").bind(blocks_for(w.size, THREADS, 4), THREADS, 0, w,
                                                        *window.args(w.shape), bound, _seed_i64(seed))


def init_uniform_master(k: Kernels, hi: Tensor, lo: Tensor, bound: float, seed: int,
                        window: Window | None = None) -> Launch:
    """The master weights (hi fp16, lo int16; rawgpu/model/master.py) of init_uniform's values."""
    require(hi, np.float16, what="init target (hi)")
    require(lo, np.int16, hi.shape, what="init target (lo)")
    window = window or Window.whole(hi.shape)
    return k.get(SRC, "init_uniform_master").bind(blocks_for(hi.size, THREADS, 4), THREADS, 0, hi,
                                                                lo, *window.args(hi.shape), bound, _seed_i64(seed))


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic), as in elementwise.cu."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def init_uniform_reference(n: int, bound: float, seed: int) -> np.ndarray:
    """The exact float32 values init_uniform writes, computed on the host (tests compare bit for bit)."""
    return init_uniform_at(np.arange(n, dtype=np.uint64), bound, seed)


def init_uniform_window_reference(shape: tuple[int, ...], window: Window, bound: float, seed: int) -> np.ndarray:
    """The exact float32 tensor init_uniform writes into a target of `shape` through `window` (tests)."""
    rows, cols, true_rows, true_cols, first, stride = window.args(shape)
    r, c = np.arange(true_rows, dtype=np.uint64), np.arange(true_cols, dtype=np.uint64)
    out = np.zeros((rows, cols), np.float32)
    out[:true_rows, :true_cols] = init_uniform_at(np.uint64(first) + r[:, None] * np.uint64(stride) + c[None, :],
                                                  bound, seed)
    return out.reshape(shape)


def init_uniform_at(index: np.ndarray, bound: float, seed: int) -> np.ndarray:
    """init_uniform's values at these flat indices only (any shape): a slice of a layer without the rest of it."""
    with np.errstate(over="ignore"):
        key = _mix64(np.array([int(seed) & (2**64 - 1)], np.uint64))[0]
        z = _mix64(key + np.asarray(index, dtype=np.uint64) * _GOLDEN)
    t = ((z >> np.uint64(40)).astype(np.int64) - (1 << 23)).astype(np.float32) * np.float32(1.0 / 8388608.0)
    return t * np.float32(bound)
