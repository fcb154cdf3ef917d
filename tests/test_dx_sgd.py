"""The fused backward (dx_sgd.cu): the plan on CPU; dx and the update against float64 on GPU."""

from __future__ import annotations

import numpy as np
import pytest

from rawgpu import master
from rawgpu.kernels import dx_sgd as D

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
    assert D.plan_dx_sgd(32, 512, 512, arch="sm_90").cluster and not D.plan_dx_sgd(32, 512, 512).cluster


def test_dx_and_the_update_run_apart_on_layers_of_up_to_a_million_weights():
    h100 = (0, 0, 66, 39, 30, 22, 17, 15, 15)
    p = D.plan_dx_sgd(32, 256, 256, arch="sm_90", capacity=h100)
    assert (p.roles, p.grid, p.cluster, p.cluster_dims) == (2, (4, 2, 2), True, (1, 1, 2))
    p = D.plan_dx_sgd(32, 1024, 1024, arch="sm_90", capacity=h100)
    assert (p.grid, p.cluster) == ((16, 2, 4), False), "32 clusters of 4 do not fit: the workspace"
    assert D.plan_dx_sgd(32, 2048, 2048, arch="sm_90", capacity=h100).roles == 1, "4M weights: one pass"
    assert D.plan_dx_sgd(32, 784, 256, arch="sm_90", capacity=h100, dx=False).roles == 1, "no dx: one part"
    assert D.plan_dx_sgd(32, 256, 256, arch="sm_90", capacity=h100, roles=1).grid == (4, 1, 2)
    with pytest.raises(ValueError, match="roles must be 1, or 2 with dx"):
        D.plan_dx_sgd(32, 784, 256, dx=False, roles=2)


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
    """dx = (dy @ W16^T) * (x > 0), W -= lr x^T dy on the master (W16, lo; rawgpu/master.py) and b -= lr colsum(dy):
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
    from rawgpu.kernels.gemm import has_tma

    if not has_tma(device.arch):
        pytest.skip(f"clusters need sm_90, this GPU is {device.arch}")
    seed = int(rng.integers(1 << 30))
    runs = [check_against_float64(device, stream, kernels, np.random.default_rng(seed), B, IN, N, splits, True,
                                  cluster=cluster) for cluster in (True, False)]
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


def check_against_float64(device, stream, kernels, rng, B, IN, N, splits, with_dx, cluster=None, roles=None):
    """test_against_float64's checks for one plan (cluster: how the ranges add their dx, roles: dx and the update in
    one block or apart; None: the rules' way); returns both runs' outputs."""
    from gpu_checks import assert_same_bytes, check_master_step, run_twice

    from rawgpu.memory import Arena

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
        runs = run_twice(launch, stream, [(twlo, lo), (tw16, hi), (tb, b)], [tdx], [twlo, tw16, tdx, tickets, tb])
    x64, dy64, w16_old = x.astype(np.float64), dy.astype(np.float64), w.astype(np.float16).astype(np.float64)
    ref_dx = (dy64 @ w16_old.T) * (x64 > 0)
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
    return runs
