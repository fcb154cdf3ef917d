"""The fused backward (dx_sgd.cu): the plan and the launcher's checks on CPU; dx (fp16 masked, or fp32 raw sums)
and the update against float64 on GPU."""

from __future__ import annotations

import numpy as np
import pytest

from rawgpu.model import master
from rawgpu.kernels import dx_sgd as D
from rawgpu.runtime.memory import Arena
import kernel_params  # beside this file: the kernels' parameters, read from their declarations

# --- CPU ---------------------------------------------------------------------------------------------------------


def test_plan_fills_the_sms_with_whole_column_chunks():
    for sms in (46, 108, 132):
        for IN, N in [(8192, 8192), (4096, 4096), (2048, 2048), (1024, 1024), (8192, 16), (520, 1000), (64, 8)]:
            p = D.plan_dx_sgd(32, IN, N, sm_count=sms)
            assert p.n_chunk % D.BN == 0
            assert (p.splits - 1) * p.n_chunk < N <= p.splits * p.n_chunk, "a column range would be empty"
            assert p.roles * p.bands * p.splits <= max(sms, p.bands), "one block per SM at most, both parts counted"
            assert p.workspace_floats == (p.splits * p.bands * 32 * 64 if p.splits > 1 and not p.cluster else 0)
    assert D.plan_dx_sgd(32, 8192, 8192).splits == 1
    assert D.plan_dx_sgd(32, 4096, 4096).splits == 2
    assert D.plan_dx_sgd(32, 512, 512, arch="sm_90", roles=1).cluster and not D.plan_dx_sgd(32, 512, 512).cluster


def test_dx_and_the_update_run_apart_on_layers_of_up_to_a_million_weights():
    h100 = (0, 0, 66, 39, 30, 22, 17, 15, 15)
    p = D.plan_dx_sgd(32, 256, 256, arch="sm_90", capacity=h100)
    assert (p.roles, p.grid, p.cluster, p.cluster_dims) == (2, (4, 2, 2), False, (1, 2, 1)), "pairs; the workspace"
    p = D.plan_dx_sgd(32, 1024, 1024, arch="sm_90", capacity=h100)
    assert (p.grid, p.cluster, p.cluster_dims) == ((16, 2, 4), False, (1, 2, 1))
    assert D.plan_dx_sgd(32, 256, 256, arch="sm_86").roles == 1, "no clusters to pair the parts before sm_90"
    assert D.plan_dx_sgd(32, 2048, 2048, arch="sm_90", capacity=h100).roles == 1, "4M weights: one pass"
    assert D.plan_dx_sgd(32, 784, 256, arch="sm_90", capacity=h100, dx=False).roles == 1, "no dx: one part"
    assert D.plan_dx_sgd(32, 256, 256, arch="sm_90", capacity=h100, roles=1).grid == (4, 1, 2)
    with pytest.raises(ValueError, match="roles must be 1, or 2 with dx"):
        D.plan_dx_sgd(32, 784, 256, dx=False, roles=2)
    with pytest.raises(ValueError, match="pair their blocks in clusters: sm_90, not sm_86"):
        D.plan_dx_sgd(32, 256, 256, arch="sm_86", roles=2)
    assert D.plan_dx_sgd(32, 256, 256, arch="sm_90", cluster=True).roles == 1, "range clusters asked for: one pass"
    with pytest.raises(ValueError, match="through the workspace: their clusters are pairs"):
        D.plan_dx_sgd(32, 256, 256, arch="sm_90", roles=2, cluster=True)


@pytest.mark.parametrize("arch,limit_kb", [("sm_80", 163), ("sm_86", 99), ("sm_89", 99), ("sm_90", 227)])
def test_pipeline_fits_the_parts_shared_memory(arch, limit_kb):
    assert D.stages(arch) >= 2 and D.smem_bytes(arch) <= limit_kb * 1024


def test_only_batch_sized_plain_sgd_fuses():
    assert D.supported(32, True, "f32") and D.supported(1, True, "f32")
    assert not D.supported(33, True, "f32") and not D.supported(32, False, "f32") and not D.supported(32, True, "f16")


@pytest.mark.parametrize("kw,msg", [(dict(B=33, IN=64, N=64), "batch rows"), (dict(B=8, IN=60, N=64), "multiple of 8"),
                                    (dict(B=8, IN=64, N=256, splits=3), "splits")])
def test_bad_plans_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        D.plan_dx_sgd(**kw)


class Bound:
    """Stands in for Kernels on the CPU: each launch is (signature, arguments) as the launcher would bind them;
    nothing compiled."""

    arch, activation = "sm_90", "relu"

    def get(self, source, name):
        signature = kernel_params.signature(source, name)
        return type("K", (), {"bind": lambda _, grid, block, smem, *args, **kw: (signature, args)})()


def check_dx_operand(launch, dx_at: int, lddx_at: int) -> None:
    """A one-pass launcher's dx, with launch(dx) -> (signature, args) binding one layer's launch around it (dx at
    argument dx_at, lddx and the kernel's dx_f32 flag at lddx_at and after): fp16 stored masked (flag 0), fp32 the
    raw sums (flag 1), the stride in elements either way; other dtypes, a stride not a multiple of 8, too few rows
    and a start that breaks the pair stores refused in one line."""
    from rawgpu.runtime import driver

    a = Arena()
    dx = lambda shape, dtype: a.tensor(f"dx{len(a.slots)}", shape, dtype)  # noqa: E731
    for dtype, flag in ((np.float16, 0), (np.float32, 1)):
        for shape in ((32, 520), (40, 528)):
            t = dx(shape, dtype)
            signature, args = launch(t)
            assert len(signature) == len(args) and signature[lddx_at:lddx_at + 2] == "ii"
            assert args[dx_at] is t and (args[lddx_at], args[lddx_at + 1]) == (shape[1], flag)
            for i, (kind, arg) in enumerate(zip(signature, args)):
                if kind != "p":
                    driver._convert(kind, arg, i)
    _, args = launch(None)
    assert (args[dx_at], args[lddx_at], args[lddx_at + 1]) == (0, 0, 0), "no dx: null, no stride, no flag"
    with pytest.raises(TypeError, match=r"^dx: expected dtype float16 \(times act'\) or float32 \(raw partial sums\), "
                                        r"got int16$"):
        launch(dx((32, 520), np.int16))
    with pytest.raises(TypeError, match="got float64"):
        launch(dx((32, 520), np.float64))
    with pytest.raises(ValueError, match="stride multiple of 8"):
        launch(dx((32, 524), np.float32))
    with pytest.raises(ValueError, match="cannot hold 32 x 520"):
        launch(dx((31, 520), np.float32))
    with pytest.raises(ValueError, match="8-byte aligned"):
        launch(dx((33 * 520,), np.float32).view((32, 520), offset_bytes=4))


def test_dx_is_fp16_masked_or_fp32_raw_sums():
    a, k = Arena(), Bound()
    x, dy = a.tensor("x", (32, 520), np.float16), a.tensor("dy", (32, 1000), np.float16)
    wlo, w16 = a.tensor("wlo", (520, 1000), np.int16), a.tensor("w16", (520, 1000), np.float16)
    lr, ws, tickets = a.tensor("lr", 1, np.float32), a.tensor("ws", 1 << 20, np.float32), a.tensor("t", 64, np.int32)
    plan = D.plan_dx_sgd(32, 520, 1000, splits=3, arch="sm_90", cluster=False, roles=1)
    check_dx_operand(lambda dx: D.dx_sgd(k, plan, x, dy, wlo, w16, dx, lr, ws, tickets), 4, 12)


# --- GPU ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernels(device):
    from rawgpu.kernels import Kernels

    return Kernels(device.arch)


@pytest.mark.gpu
@pytest.mark.parametrize("B,IN,N,splits,with_dx", [(32, 192, 328, None, True), (7, 64, 128, None, True),
                                                   (32, 520, 1000, 3, True), (32, 1024, 16, None, True),
                                                   (17, 136, 2056, None, True), (32, 2048, 2048, None, True),
                                                   (32, 8192, 1024, 1, True), (32, 784, 4096, None, False),
                                                   (5, 784, 520, 3, False)])
def test_against_float64(device, stream, kernels, rng, B, IN, N, splits, with_dx):
    """dx = (dy @ W16^T) * (x > 0), W -= lr x^T dy on the master (W16, lo; rawgpu/model/master.py) and b -= lr colsum(dy):
    partial bands and chunks, batch below 32, column ranges, the update alone (no dx: the first layer); dx poisoned
    first, every weight whose step is not tiny moved (the master is read and rewritten in place), bitwise equal
    across two runs."""
    check_against_float64(device, stream, kernels, rng, B, IN, N, splits, with_dx)


@pytest.mark.gpu
@pytest.mark.parametrize("B,IN,N,splits", [(32, 512, 512, None), (17, 520, 1000, 3), (32, 136, 2056, 8)])
def test_column_ranges_sum_to_the_same_bits_in_a_cluster_and_in_the_workspace(device, stream, kernels, rng, B, IN,
                                                                              N, splits):
    """The two ways a band's column ranges add their dx (cu/one_pass.cuh): each against float64, then every output
    byte for byte the same."""
    from rawgpu.kernels.gemm import sm90_or_later

    if not sm90_or_later(device.arch):
        pytest.skip(f"clusters need sm_90, this GPU is {device.arch}")
    seed = int(rng.integers(1 << 30))
    runs = [check_against_float64(device, stream, kernels, np.random.default_rng(seed), B, IN, N, splits, True,
                                  cluster=cluster, roles=1) for cluster in (True, False)]
    for i, (a, b) in enumerate(zip(runs[0][0], runs[1][0])):
        if i != 3:  # the tickets, which only the workspace's sums take
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"output {i}: cluster and workspace sums differ"


@pytest.mark.gpu
@pytest.mark.parametrize("B,IN,N,splits", [(32, 256, 256, None), (7, 192, 328, None), (32, 1024, 1024, None),
                                           (17, 520, 1000, 3)])
def test_dx_and_the_update_in_blocks_of_their_own_give_the_same_bits(device, stream, kernels, rng, B, IN, N, splits):
    """Roles (grid y = 2: dx blocks beside update blocks) against one block doing both, over the same column ranges:
    each against float64, then every output byte for byte the same."""
    if splits is None:  # both ways over the same column ranges (other ranges group dx's sums otherwise)
        splits = D.plan_dx_sgd(B, IN, N, device.sm_count, arch=device.arch, roles=2).splits
    seed = int(rng.integers(1 << 30))
    runs = [check_against_float64(device, stream, kernels, np.random.default_rng(seed), B, IN, N, splits, True,
                                  roles=roles) for roles in (1, 2)]
    for i, (a, b) in enumerate(zip(runs[0][0], runs[1][0])):
        if i != 3:  # the tickets, which only the workspace's sums take (apart, fewer clusters fit: the workspace)
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"output {i}: roles 1 and 2 differ"


@pytest.mark.gpu
@pytest.mark.parametrize("B,IN,N", [(32, 256, 256), (17, 1024, 1024)])
def test_a_late_dx_block_still_reads_the_old_weights(device, stream, kernels, rng, B, IN, N):
    """dx and the update apart with every dx block started 200 us late (gpu_checks.LateDxKernels): its update
    partner waits for it, so every output is byte for byte that of one block doing both."""
    from gpu_checks import LateDxKernels
    from rawgpu.kernels.gemm import sm90_or_later

    if not sm90_or_later(device.arch):
        pytest.skip(f"dx and the update run apart on sm_90 only; this GPU is {device.arch}")
    splits = D.plan_dx_sgd(B, IN, N, device.sm_count, arch=device.arch, roles=2).splits
    seed = int(rng.integers(1 << 30))
    runs = [check_against_float64(device, stream, k, np.random.default_rng(seed), B, IN, N, splits, True, roles=roles)
            for k, roles in ((kernels, 1), (LateDxKernels(device.arch), 2))]
    for i, (a, b) in enumerate(zip(runs[0][0], runs[1][0])):
        if i != 3:  # the tickets
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"output {i}: a late dx block changed it"


@pytest.mark.gpu
@pytest.mark.parametrize("B,IN,N,splits,cluster,roles", [(32, 8192, 1024, 1, None, 1), (7, 64, 128, None, None, 1),
                                                         (32, 520, 1000, 3, False, 1), (17, 512, 512, None, True, 1),
                                                         (32, 136, 2056, 6, True, 1), (32, 256, 256, None, None, 2),
                                                         (32, 1024, 1024, 4, False, 2)])
def test_fp32_dx_is_the_raw_sums_of_the_fp16_dx(device, stream, kernels, rng, B, IN, N, splits, cluster, roles):
    """dx as fp32 partial sums (a column-split layer's, rawgpu/steps/sharded.py): one range, several added through
    the workspace or in a cluster, dx and the update in one block or apart, a partial last band (IN 520, 136) and batch:
    check_raw_dx against float64 and against the fp16 dx of the same launch."""
    from rawgpu.kernels.gemm import sm90_or_later

    if cluster and not sm90_or_later(device.arch):
        pytest.skip(f"clusters need sm_90, this GPU is {device.arch}")
    plan = D.plan_dx_sgd(B, IN, N, device.sm_count, splits, arch=device.arch, cluster=cluster, roles=roles)
    assert plan.roles == roles and cluster in (None, plan.cluster) and splits in (None, plan.splits)
    check_against_float64(device, stream, kernels, rng, B, IN, N, splits, True, cluster=cluster, roles=roles,
                          raw_dx=True)


def check_against_float64(device, stream, kernels, rng, B, IN, N, splits, with_dx, cluster=None, roles=None,
                          raw_dx=False):
    """test_against_float64's checks for one plan (cluster: how the ranges add their dx, roles: dx and the update in
    one block or apart; None: the rules' way; raw_dx: the same launch with fp32 dx too, check_raw_dx); returns both
    runs' outputs."""
    from gpu_checks import assert_same_bytes, check_master_step, run_twice

    plan = D.plan_dx_sgd(B, IN, N, device.sm_count, splits, arch=device.arch, cluster=cluster, dx=with_dx, roles=roles)
    assert plan.splits > 1 or not cluster
    assert roles is None or plan.roles == roles
    x = np.maximum(rng.uniform(-1, 1, (B, IN)), 0).astype(np.float16)  # a ReLU output: about half zero
    dy = rng.uniform(-1, 1, (B, N)).astype(np.float16)
    w = rng.uniform(-1, 1, (IN, N)).astype(np.float32)
    lr = np.float32(0.05)
    b = rng.uniform(-1, 1, N).astype(np.float32)
    with Arena() as arena:
        tx, tdy = arena.tensor("x", (B, IN), np.float16), arena.tensor("dy", (B, N), np.float16)
        twlo, tw16 = arena.tensor("wlo", (IN, N), np.int16), arena.tensor("w16", (IN, N), np.float16)
        tdx, tlr = arena.tensor("dx", (B, IN), np.float16), arena.tensor("lr", (1,), np.float32)
        tb = arena.tensor("b", (N,), np.float32)
        tdx32 = arena.tensor("dx32", (B + 1, IN + 8), np.float32)  # a row and 8 columns to spare: none written
        ws = arena.tensor("ws", (max(1, plan.workspace_floats),), np.float32)
        tickets = arena.tensor("tickets", (max(1, plan.tickets),), np.int32)
        arena.allocate()
        tx.upload(x)
        tdy.upload(dy)
        tlr.upload(np.array([lr], np.float32))
        tickets.upload(np.zeros(tickets.shape, np.int32))
        ws.fill_bytes(0xFF)
        launch = D.dx_sgd(kernels, plan, tx, tdy, twlo, tw16, tdx if with_dx else None, tlr, ws, tickets, bias=tb)
        hi, lo = master.split(w)
        state, outputs = [(twlo, lo), (tw16, hi), (tb, b)], [twlo, tw16, tdx, tickets, tb]
        runs = run_twice(launch, stream, state, [tdx], outputs)
        if raw_dx:  # the same layer from the same state, dx as fp32 sums
            launch = D.dx_sgd(kernels, plan, tx, tdy, twlo, tw16, tdx32, tlr, ws, tickets, bias=tb)
            raw = run_twice(launch, stream, state, [tdx32], [tdx32 if t is tdx else t for t in outputs])
    x64, dy64, w16_old = x.astype(np.float64), dy.astype(np.float64), w.astype(np.float16).astype(np.float64)
    ref_sum = dy64 @ w16_old.T
    ref_dx = ref_sum * (x64 > 0)
    ref_step = x64.T @ dy64
    for wlo, w16, dx, t, b_new in runs:
        if with_dx:
            assert np.isfinite(dx.astype(np.float64)).all(), "dx not written everywhere"
            err = np.linalg.norm(dx - ref_dx) / np.linalg.norm(ref_dx)
            assert err <= 2e-3, f"dx rel err {err:.2e}"
        else:
            assert (dx.view(np.uint16) == 0xFFFF).all(), "no dx asked for, none written"
        assert np.allclose(b_new, b - float(lr) * dy64.sum(axis=0), rtol=1e-6, atol=1e-7), "bias update"
        check_master_step(w, w16, wlo, float(lr), ref_step)
        assert not t.any(), "tickets must be reset for the next launch"
    assert_same_bytes(runs)
    if raw_dx:
        assert with_dx, "raw sums of a dx the launch computes"
        check_raw_dx(runs, raw, x, ref_sum, 2)
    return runs


def check_raw_dx(runs, raw, x, ref_sum, at):
    """A one-pass launch with fp32 dx (`raw`: run_twice's outputs, dx at index `at` in a buffer a row and 8 columns
    larger) against the same launch with fp16 dx from the same state (`runs`): the fp32 dx is the raw sums
    dy @ W16^T (ref_sum, float64) within a store32 GEMM's bound and not rounded on the way, written nowhere past
    [B, IN]; masked by x > 0 and rounded to fp16 on the host (numpy: to nearest even, as pack_f16x2), what
    finish_sum's dact makes of the GPUs' total, it is the fp16 dx bit for bit; every other output (master, state,
    bias, tickets) is byte for byte the same; and the fp32 runs repeat to the bit."""
    from gpu_checks import assert_same_bytes
    from optim_reference import rel

    B, IN = x.shape
    assert_same_bytes(raw)
    full = raw[0][at]
    assert (full[B:].view(np.uint32) == 0xFFFFFFFF).all() and (full[:, IN:].view(np.uint32) == 0xFFFFFFFF).all(), \
        "fp32 dx written past [B, IN]"
    dx32 = full[:B, :IN]
    err = rel(dx32, ref_sum)
    assert err <= 1e-4, f"fp32 dx rel err {err:.2e}"
    halves = np.mean(dx32 == dx32.astype(np.float16).astype(np.float32))
    assert halves < 0.5, f"{halves:.0%} of the fp32 dx are fp16 values: rounded on the way"
    finished = np.where(x > 0, dx32, np.float32(0)).astype(np.float16)
    off = finished.view(np.uint16) != runs[0][at].view(np.uint16)
    assert not off.any(), f"{int(off.sum())} of the fp32 dx, masked and rounded, differ from the fp16 dx"
    for i, (a, b) in enumerate(zip(runs[0], raw[0])):
        if i != at:
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"output {i}: fp32 and fp16 dx runs differ"
