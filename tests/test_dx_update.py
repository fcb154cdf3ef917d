"""The one-pass backward with any optimiser (dx_update.cu): the plan and the launcher's checks on CPU; dx (fp16
masked, or fp32 raw sums) and every optimiser's step against float64 on GPU."""

from __future__ import annotations

import numpy as np
import pytest

from rawgpu import contract
from rawgpu.model import master, optimizer
from rawgpu.contract import OPTIM_WORDS
from rawgpu.kernels import dx_update as U

from optim_reference import OPTIMIZERS, check_layer_update, fresh_layer, rel, table
from test_dx_sgd import Bound, check_dx_operand, check_raw_dx

# --- CPU ---------------------------------------------------------------------------------------------------------


def test_plan_fills_the_sms_with_whole_column_chunks():
    for sms in (108, 132):
        for B in (1, 32, 100, 128, 256):
            for IN, N in [(8192, 8192), (4096, 4096), (1024, 1024), (8192, 16), (520, 1000), (64, 8), (784, 256)]:
                p = U.plan_dx_update(B, IN, N, "adam", "sm_90", sm_count=sms)
                assert p.n_chunk % U.BN == 0 and p.rows >= B
                assert (p.splits - 1) * p.n_chunk < N <= p.splits * p.n_chunk, "a column range would be empty"
                assert p.roles * p.bands * p.splits <= max(sms, p.bands), "one block per SM, both parts counted"
                assert p.workspace_floats == (p.splits * p.bands * p.rows * 64 if p.splits > 1 and not p.cluster
                                              else 0)
    assert U.plan_dx_update(128, 8192, 8192, "sgd", "sm_90").splits == 1
    assert U.plan_dx_update(128, 4096, 4096, "sgd", "sm_90").splits == 2


def test_column_ranges_add_in_a_cluster_where_every_bands_cluster_is_resident():
    from rawgpu.kernels.dx_sgd import reduce_in_cluster

    cap = (0, 0, 60, 40, 30, 24, 20, 16, 14)  # clusters of s blocks resident at once
    assert reduce_in_cluster(8, 8, "sm_90", cap, 132) and reduce_in_cluster(14, 8, "sm_90", cap, 132)
    assert not reduce_in_cluster(16, 8, "sm_90", cap, 132), "a second wave of clusters"
    assert not reduce_in_cluster(2, 1, "sm_90", cap, 132), "one range: nothing to add"
    assert not reduce_in_cluster(2, 9, "sm_90", cap, 132), "past the portable cluster"
    assert not reduce_in_cluster(2, 4, "sm_86", None, 132), "no clusters before sm_90"
    p = U.plan_dx_update(128, 512, 512, "sgd", "sm_90", capacity=cap, roles=1)  # one pass (roles: below)
    assert p.cluster and p.splits == 8 and p.workspace_floats == p.tickets == 0
    assert p.cluster_dims == (1, 1, 8)
    w = U.plan_dx_update(128, 512, 512, "sgd", "sm_90", capacity=cap, cluster=False, roles=1)
    assert not w.cluster and w.workspace_floats == 8 * 8 * 128 * 64 and w.tickets == 8 and w.cluster_dims == (1, 1, 1)
    assert not U.plan_dx_update(128, 512, 512, "sgd", "sm_80").cluster
    with pytest.raises(ValueError, match="cannot add their dx in a cluster"):
        U.plan_dx_update(128, 8192, 8192, "sgd", "sm_90", cluster=True)
    h100 = (0, 0, 66, 39, 30, 22, 17, 15, 15)  # what the driver said on an H100
    p = U.plan_dx_update(128, 1024, 1024, "sgd", "sm_90", capacity=h100, roles=1)
    assert (p.splits, p.n_chunk, p.cluster) == (6, 192, True), "16 bands of 8 ranges do not fit: 6 ranges of 3 chunks"
    p = U.plan_dx_update(128, 2048, 2048, "sgd", "sm_90", capacity=h100)
    assert (p.splits, p.cluster) == (4, False), "ranges of 8 chunks are not traded for a cluster"
    assert U.plan_dx_update(128, 1024, 1024, "sgd", "sm_90", splits=8, capacity=h100).splits == 8, "asked for"
    assert U.plan_dx_update(32, 1024, 1024, "sgd", "sm_90", capacity=h100, roles=1).splits == 8, "small tiles keep theirs"
    p = U.plan_dx_update(128, 784, 1024, "sgd", "sm_90", capacity=h100, dx=False)
    assert not p.cluster and p.splits == 8 and p.cluster_dims == (1, 1, 1), "the update alone adds no dx"


def test_dx_and_the_update_run_apart_on_layers_of_up_to_a_million_weights():
    h100 = (0, 0, 66, 39, 30, 22, 17, 15, 15)
    plan = lambda *a, **kw: U.plan_dx_update(*a, "sm_90", capacity=h100, **kw)  # noqa: E731
    p = plan(128, 256, 256, "sgd")
    assert (p.roles, p.grid, p.cluster, p.cluster_dims) == (2, (4, 2, 4), False, (1, 2, 1)), "pairs; the workspace"
    assert plan(128, 128, 128, "adam").grid == (2, 2, 2)
    p = plan(128, 512, 512, "sgd")
    assert (p.grid, p.n_chunk, p.cluster) == ((8, 2, 4), 128, False), "4 ranges of 2 chunks"
    p = plan(128, 1024, 1024, "adam")
    assert (p.grid, p.cluster, p.cluster_dims) == ((16, 2, 4), False, (1, 2, 1))
    assert p.workspace_floats == 4 * 16 * 128 * 64 and p.tickets == 16
    assert plan(128, 2048, 2048, "sgd").roles == 1, "4M weights: one pass"
    assert plan(128, 8192, 128, "sgd").roles == 1, "128 bands: the doubled grid does not fit"
    assert plan(128, 784, 256, "sgd", dx=False).roles == 1, "no dx: one part"
    assert U.plan_dx_update(32, 256, 256, "sgd", "sm_86").grid == (4, 1, 4), "no clusters to pair the parts"
    assert plan(128, 256, 256, "sgd", roles=1).grid == (4, 1, 4)
    assert plan(128, 512, 512, "sgd", roles=2, splits=8).grid == (8, 2, 8)
    with pytest.raises(ValueError, match="roles must be 1, or 2 with dx"):
        plan(128, 784, 256, "sgd", dx=False, roles=2)


def test_the_instance_is_the_smallest_batch_tile_and_the_optimisers_family():
    assert U.plan_dx_update(1, 64, 64, "sgd", "sm_90").kernel == "dx_update_b32_sgd"
    assert U.plan_dx_update(33, 64, 64, "sgd", "sm_90").kernel == "dx_update_b64_sgd"
    assert U.plan_dx_update(128, 64, 64, "adam", "sm_90").kernel == "dx_update_b128_adam"
    assert U.plan_dx_update(200, 64, 64, "adamw", "sm_90").kernel == "dx_update_b256_adam"
    assert set(contract.dxu_kernels("sm_90")) == set(contract.split_kernels(U.SOURCE))


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90"])
def test_every_instance_built_for_a_part_fits_its_shared_memory_twice_over(arch):
    for name in contract.dxu_kernels(arch):
        bb, family = int(name.split("_")[2][1:]), name.split("_")[3]
        assert contract.dxu_stages(bb, family, arch) >= 2
        assert contract.dxu_smem_bytes(bb, family, arch) + 1024 <= contract.block_smem_limit(arch)
    assert len(contract.dxu_kernels("sm_90")) == 8, "sm_90 builds every batch tile and family"


def test_the_weight_gradient_runs_on_warpgroup_mma_on_sm_90_from_64_rows():
    wg = {bb: contract.dxu_wgmma(bb, "sm_90") for bb in contract.DXU_BATCHES}
    assert wg == {32: False, 64: True, 128: True, 256: True}
    assert not any(contract.dxu_wgmma(bb, arch) for bb in contract.DXU_BATCHES for arch in ("sm_80", "sm_86", "sm_89"))
    assert contract.nvrtc_arch(U.SOURCE, "sm_90") == "sm_90a", "wgmma is an sm_90a feature"
    assert contract.nvrtc_arch(contract.DX_UPDATE_MODELS_SOURCE, "sm_90") == "sm_90a"
    assert contract.nvrtc_arch(U.SOURCE, "sm_86") == "sm_86"
    _, headers = contract.build(U.SOURCE, "sm_90")
    made = headers["dx_update_instances.cuh"]
    for bb in contract.DXU_BATCHES:  # X(name, BB, ADAM, STAGES, SMEM, WARPS, WG): the flag the kernel compiles
        assert f"X(dx_update_b{bb}_sgd, {bb}, false, " in made
        assert made.split(f"X(dx_update_b{bb}_sgd, ")[1].split(")")[0].endswith("true" if wg[bb] else "false")
    # the swizzled x and dy tiles are 64 halves a row where the padded ones are 72, plus 1 KB to align them
    padded = 2 * 64 * 72 * 2 + 64 * 72 * 4 + 128 * 72 * 2
    assert contract.dxu_stage_bytes(128, "sgd", "sm_90") == padded - 128 * 8 * 2
    assert contract.dxu_stage_bytes(128, "sgd", "sm_86") == padded


def test_what_runs_where():
    assert U.unsupported_reason(256, "adam", "f32", "sm_90") is None
    assert U.unsupported_reason(128, "sgd", "f32", "sm_80") is None
    assert "batch <= 256" in U.unsupported_reason(257, "sgd", "f32", "sm_90")
    assert "fp32" in U.unsupported_reason(32, "sgd", "f16", "sm_90")
    assert "shared memory" in U.unsupported_reason(128, "adam", "f32", "sm_86")


@pytest.mark.parametrize("kw,msg", [(dict(B=257, IN=64, N=64), "batch <= 256"), (dict(B=8, IN=60, N=64), "multiple of 8"),
                                    (dict(B=8, IN=64, N=256, splits=5), "splits")])
def test_bad_plans_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        U.plan_dx_update(optimizer="sgd", arch="sm_90", **kw)


def test_dx_is_fp16_masked_or_fp32_raw_sums():
    from rawgpu.runtime.memory import Arena

    a, k = Arena(), Bound()
    x, dy = a.tensor("x", (32, 520), np.float16), a.tensor("dy", (32, 1000), np.float16)
    wlo, w16 = a.tensor("wlo", (520, 1000), np.int16), a.tensor("w16", (520, 1000), np.float16)
    mw, vw = a.tensor("mw", (520, 1000), np.float32), a.tensor("vw", (520, 1000), np.float32)
    optim, ws = a.tensor("optim", OPTIM_WORDS, np.float32), a.tensor("ws", 1 << 20, np.float32)
    tickets = a.tensor("t", 64, np.int32)
    plan = U.plan_dx_update(32, 520, 1000, "adam", "sm_90", splits=3, cluster=False, roles=1)
    check_dx_operand(lambda dx: U.dx_update(k, plan, x, dy, wlo, w16, mw, vw, dx, optim, ws, tickets), 6, 14)


# --- GPU ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernels(device):
    from rawgpu.kernels import Kernels

    return Kernels(device.arch)


@pytest.mark.gpu
@pytest.mark.parametrize("B,IN,N,splits,with_dx,opt", [
    (128, 192, 328, None, True, "momentum"), (7, 64, 128, None, True, "adam"), (128, 520, 1000, 3, True, "adamw"),
    (64, 1024, 16, None, True, "nesterov"), (100, 136, 2056, None, True, "momentum"), (128, 2048, 2048, None, True, "adam"),
    (256, 4096, 1024, 1, True, "momentum"), (128, 784, 4096, None, False, "momentum"), (200, 784, 520, 3, False, "adam"),
    (32, 1024, 1024, None, True, "adamw"), (33, 256, 256, None, True, "plain"), (256, 1000, 256, 2, True, "adam"),
    (128, 8192, 256, None, True, "plain")])
def test_against_float64(device, stream, kernels, rng, B, IN, N, splits, with_dx, opt):
    """dx = (dy @ W16^T) * (x > 0), the optimiser's step with G = x^T dy on the master (W16, lo; rawgpu/model/master.py)
    and its state, and on b with colsum(dy): partial bands, chunks and batch tiles, column ranges, the update alone
    (no dx: the first layer), every optimiser; dx poisoned first, every weight whose step is not tiny moved (the
    master is read and rewritten in place), bitwise equal across two runs."""
    if U.unsupported_reason(B, OPTIMIZERS[opt].optimizer, "f32", device.arch):
        pytest.skip(U.unsupported_reason(B, OPTIMIZERS[opt].optimizer, "f32", device.arch))
    check_against_float64(device, stream, kernels, rng, B, IN, N, splits, with_dx, opt)


@pytest.mark.gpu
@pytest.mark.parametrize("B,IN,N,splits,opt", [(128, 512, 512, None, "momentum"), (256, 1024, 1024, None, "adam"),
                                               (64, 520, 1000, 3, "adamw"), (33, 256, 256, None, "plain"),
                                               (128, 136, 2056, 8, "nesterov")])
def test_column_ranges_sum_to_the_same_bits_in_a_cluster_and_in_the_workspace(device, stream, kernels, rng, B, IN,
                                                                              N, splits, opt):
    """The two ways a band's column ranges add their dx (cu/one_pass.cuh): each against float64, then every output
    (dx, master, state, bias) byte for byte the same."""
    from rawgpu.kernels.gemm import sm90_or_later

    if not sm90_or_later(device.arch):
        pytest.skip(f"clusters need sm_90, this GPU is {device.arch}")
    seed = int(rng.integers(1 << 30))
    runs = [check_against_float64(device, stream, kernels, np.random.default_rng(seed), B, IN, N, splits, True, opt,
                                  cluster=cluster, roles=1) for cluster in (True, False)]
    for i, (a, b) in enumerate(zip(runs[0][0], runs[1][0])):
        if i != 3:  # the tickets, which only the workspace's sums take
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"output {i}: cluster and workspace sums differ"


@pytest.mark.gpu
@pytest.mark.parametrize("B,IN,N,splits,opt,cluster", [(128, 256, 256, None, "momentum", None),
                                                       (7, 192, 328, None, "adam", None),
                                                       (128, 512, 512, 4, "adamw", False),
                                                       (256, 136, 1000, 3, "nesterov", True),
                                                       (33, 1024, 128, None, "plain", None)])
def test_dx_and_the_update_in_blocks_of_their_own_give_the_same_bits(device, stream, kernels, rng, B, IN, N, splits,
                                                                      opt, cluster):
    """Roles (grid y = 2: dx blocks beside update blocks) against one block doing both: each against float64, then
    every output (dx, master, state, bias, tickets) byte for byte the same."""
    from rawgpu.kernels.gemm import sm90_or_later

    if cluster and not sm90_or_later(device.arch):
        pytest.skip(f"clusters need sm_90, this GPU is {device.arch}")
    if splits is None:  # both ways over the same column ranges (other ranges group dx's sums otherwise)
        splits = U.plan_dx_update(B, IN, N, OPTIMIZERS[opt].optimizer, device.arch, device.sm_count, roles=2).splits
    seed = int(rng.integers(1 << 30))
    runs = [check_against_float64(device, stream, kernels, np.random.default_rng(seed), B, IN, N, splits, True, opt,
                                  cluster=cluster if roles == 1 else None, roles=roles) for roles in (1, 2)]
    for i, (a, b) in enumerate(zip(runs[0][0], runs[1][0])):
        if i != 3:  # the tickets, which only the workspace's sums take (apart, fewer clusters fit: the workspace)
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"output {i}: roles 1 and 2 differ"


@pytest.mark.gpu
@pytest.mark.parametrize("B,IN,N,opt", [(128, 256, 256, "momentum"), (128, 1024, 1024, "adam"), (32, 512, 512, "plain"),
                                        (256, 520, 1000, "adamw")])
def test_a_late_dx_block_still_reads_the_old_weights(device, stream, kernels, rng, B, IN, N, opt):
    """dx and the update apart with every dx block started 200 us late (gpu_checks.LateDxKernels): its update
    partner waits for it, so every output is byte for byte that of one block doing both."""
    from gpu_checks import LateDxKernels
    from rawgpu.kernels.gemm import sm90_or_later

    if not sm90_or_later(device.arch):
        pytest.skip(f"dx and the update run apart on sm_90 only; this GPU is {device.arch}")
    splits = U.plan_dx_update(B, IN, N, OPTIMIZERS[opt].optimizer, device.arch, device.sm_count, roles=2).splits
    seed = int(rng.integers(1 << 30))
    runs = [check_against_float64(device, stream, k, np.random.default_rng(seed), B, IN, N, splits, True, opt,
                                  roles=roles) for k, roles in ((kernels, 1), (LateDxKernels(device.arch), 2))]
    for i, (a, b) in enumerate(zip(runs[0][0], runs[1][0])):
        if i != 3:  # the tickets
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"output {i}: a late dx block changed it"


@pytest.mark.gpu
@pytest.mark.parametrize("B,IN,N,splits,opt,cluster,roles", [
    (256, 4096, 1024, 1, "momentum", None, 1), (7, 192, 328, None, "adam", None, 1),
    (128, 520, 1000, 3, "adamw", False, 1), (32, 520, 1000, 3, "plain", True, 1),
    (256, 1024, 1024, 4, "adam", True, 1), (128, 136, 2056, 7, "nesterov", False, 1),
    (128, 256, 256, None, "momentum", None, 2), (256, 520, 1000, 4, "adamw", False, 2),
    (32, 512, 512, 4, "plain", None, 2)])
def test_fp32_dx_is_the_raw_sums_of_the_fp16_dx(device, stream, kernels, rng, B, IN, N, splits, opt, cluster, roles):
    """dx as fp32 partial sums (a column-split layer's, rawgpu/steps/sharded.py) at batch tiles 32, 128 and 256 with
    every optimiser family: one range, several added through the workspace or in a cluster, dx and the update in
    one block or apart, a partial last band (IN 520, 136) and batch: check_raw_dx (test_dx_sgd.py) against float64
    and against the fp16 dx of the same launch."""
    from rawgpu.kernels.gemm import sm90_or_later

    optim_name = OPTIMIZERS[opt].optimizer
    if why := U.unsupported_reason(B, optim_name, "f32", device.arch):
        pytest.skip(why)
    if cluster and not sm90_or_later(device.arch):
        pytest.skip(f"clusters need sm_90, this GPU is {device.arch}")
    plan = U.plan_dx_update(B, IN, N, optim_name, device.arch, device.sm_count, splits, cluster=cluster, roles=roles)
    assert plan.roles == roles and cluster in (None, plan.cluster) and splits in (None, plan.splits)
    check_against_float64(device, stream, kernels, rng, B, IN, N, splits, True, opt, cluster=cluster, roles=roles,
                          raw_dx=True)


def check_against_float64(device, stream, kernels, rng, B, IN, N, splits, with_dx, opt, cluster=None, roles=None,
                          raw_dx=False):
    """test_against_float64's checks for one plan (cluster: how the ranges add their dx, roles: dx and the update in
    one block or apart; None: the rules' way; raw_dx: the same launch with fp32 dx too, check_raw_dx); returns both
    runs' outputs."""
    from gpu_checks import assert_same_bytes, run_twice

    from rawgpu.runtime.memory import Arena

    plan = U.plan_dx_update(B, IN, N, OPTIMIZERS[opt].optimizer, device.arch, device.sm_count, splits, cluster=cluster,
                            dx=with_dx, roles=roles)
    assert plan.splits > 1 or not cluster
    assert roles is None or plan.roles == roles
    o, w, b, held = fresh_layer(rng, opt, B, IN, N)
    x = np.maximum(rng.uniform(-1, 1, (B, IN)), 0).astype(np.float16)  # a ReLU output: about half zero
    dy = rng.uniform(-1, 1, (B, N)).astype(np.float16)
    with Arena() as arena:
        tx, tdy = arena.tensor("x", (B, IN), np.float16), arena.tensor("dy", (B, N), np.float16)
        twlo, tw16 = arena.tensor("wlo", (IN, N), np.int16), arena.tensor("w16", (IN, N), np.float16)
        tdx, topt = arena.tensor("dx", (B, IN), np.float16), arena.tensor("optim", (OPTIM_WORDS,), np.float32)
        tb = arena.tensor("b", (N,), np.float32)
        tdx32 = arena.tensor("dx32", (B + 1, IN + 8), np.float32)  # a row and 8 columns to spare: none written
        tstate = {name: arena.tensor(name, a.shape, np.float32) for name, a in held}
        ws = arena.tensor("ws", (max(1, plan.workspace_floats),), np.float32)
        tickets = arena.tensor("tickets", (max(1, plan.tickets),), np.int32)
        arena.allocate()
        tx.upload(x)
        tdy.upload(dy)
        topt.upload(optimizer.words(o))
        tickets.upload(np.zeros(tickets.shape, np.int32))
        ws.fill_bytes(0xFF)
        launch = lambda dx: U.dx_update(kernels, plan, tx, tdy, twlo, tw16, tstate.get("mw"),  # noqa: E731
                                        tstate.get("vw"), dx, topt, ws, tickets, bias=tb, mb=tstate.get("mb"),
                                        vb=tstate.get("vb"))
        hi, lo = master.split(w)
        state = [(twlo, lo), (tw16, hi), (tb, b)] + [(tstate[name], a) for name, a in held]
        outputs = [twlo, tw16, tdx, tickets, tb] + [tstate[name] for name, _ in held]
        runs = run_twice(launch(tdx if with_dx else None), stream, state, [tdx], outputs)
        if raw_dx:  # the same layer from the same state, dx as fp32 sums
            raw = run_twice(launch(tdx32), stream, state, [tdx32], [tdx32 if t is tdx else t for t in outputs])
    x64, dy64, w16_old = x.astype(np.float64), dy.astype(np.float64), w.astype(np.float16).astype(np.float64)
    ref_sum = dy64 @ w16_old.T
    ref_dx = ref_sum * (x64 > 0)
    for wlo, w16, dx, t, b_new, *got_state in runs:
        if with_dx:
            assert rel(dx, ref_dx) <= 2e-3, f"dx rel err {rel(dx, ref_dx):.2e}"
        else:
            assert (dx.view(np.uint16) == 0xFFFF).all(), "no dx asked for, none written"
        check_layer_update(o, x, dy, w, b, held, wlo, w16, b_new, got_state)
        assert not t.any(), "tickets must be reset for the next launch"
    assert_same_bytes(runs)
    if raw_dx:
        assert with_dx, "raw sums of a dx the launch computes"
        check_raw_dx(runs, raw, x, ref_sum, 2)
    return runs


@pytest.mark.gpu
def test_lr_zero_keeps_every_master_bit_with_plain_sgd(device, stream, kernels, rng):
    """At lr 0 plain SGD's step is w - 0 g: the master's halves come back bit for bit (the split is exact), for
    masters in the form split gives (below 2^-16 a weight split from fp32 can tie between two fp16 subnormals, and
    the update writes the other, equal, form: cu/master.cuh)."""
    from rawgpu.runtime.memory import Arena

    B, IN, N = 128, 256, 320
    plan = U.plan_dx_update(B, IN, N, "sgd", device.arch, device.sm_count)
    w = rng.uniform(-1, 1, (IN, N)).astype(np.float32)
    w[::7] *= 1e-6  # small weights too, below 2^-16
    hi, lo = master.split(master.join(*master.split(w)))
    with Arena() as arena:
        tx, tdy = arena.tensor("x", (B, IN), np.float16), arena.tensor("dy", (B, N), np.float16)
        twlo, tw16 = arena.tensor("wlo", (IN, N), np.int16), arena.tensor("w16", (IN, N), np.float16)
        topt, tb = arena.tensor("optim", (OPTIM_WORDS,), np.float32), arena.tensor("b", (N,), np.float32)
        arena.allocate()
        tx.upload(rng.uniform(0, 1, (B, IN)).astype(np.float16))
        tdy.upload(rng.uniform(-1, 1, (B, N)).astype(np.float16))
        topt.upload(optimizer.words(table("plain", lr=0.0)))
        twlo.upload(lo)
        tw16.upload(hi)
        tb.upload(np.ones(N, np.float32))
        U.dx_update(kernels, plan, tx, tdy, twlo, tw16, None, None, None, topt, bias=tb).run(stream)
        assert np.array_equal(twlo.download(), lo) and np.array_equal(tw16.download().view(np.uint16), hi.view(np.uint16))
        assert (tb.download() == 1.0).all()
