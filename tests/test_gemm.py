"""Tensor-core GEMM: the plan on CPU; every MLP shape, layout, epilogue and accumulator against float64 on GPU."""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest

from rawgpu.model import master, optimizer
from rawgpu.contract import OPTIM_WORDS
from rawgpu.model.recipe import Recipe
from rawgpu.kernels import gemm as G

from optim_reference import OPTIMIZERS, TABLE_STEP, update_reference
import kernel_params  # beside this file: the kernels' parameters, read from their declarations

# --- CPU: plan and instance table ------------------------------------------------------------------------------


def test_python_instance_table_matches_the_compiled_kernels(whole_builds):
    for source in (G.SOURCE, G.TMA_SOURCE):
        compiled = whole_builds[(source, "sm_86")].resources
        assert sorted(n for n in compiled if n.startswith("gemm_")) == G.all_kernel_names(source)
        assert G.all_kernel_names(source), source


def test_the_generated_instance_lists_are_the_python_table():
    """gemm.cu and gemm_tma.cu compile exactly the contract's instances; the launcher plans from the same objects."""
    import re

    from rawgpu import contract

    for source, header in ((G.SOURCE, "gemm_instances.cuh"), (G.TMA_SOURCE, "gemm_tma_instances.cuh")):
        text = contract.build(source, "sm_90")[1][header]
        stems = re.findall(r"^(?:GEMM|PERSIST|TMA)_ACCS\((\w+),", text, re.M)
        assert sorted(f"{s}_{acc}" for s in stems for acc in ("f32", "f16")) == G.all_kernel_names(source)
    assert G.CONFIGS is contract.CONFIGS and G.INSTANCES is contract.INSTANCES and G.GemmConfig is contract.GemmConfig
    assert "-DSTREAM_STAGES=15" in contract.build(G.SOURCE, "sm_90")[0]
    assert [G.stream_stages(a) for a in ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a")] == [11, 7, 7, 15, 15]


def test_smem_matches_the_cuda_formula():
    cfg = G.CONFIGS["32x128"]
    assert cfg.smem_bytes("rr") == 6 * (32 * 40 + 32 * 136) * 2
    assert cfg.smem_bytes("cc") == 6 * (32 * 40 + 128 * 40) * 2
    for c in G.CONFIGS.values():
        for lay in G.LAYOUTS:
            assert c.tma or c.smem_bytes(lay) <= 99 * 1024, "must fit sm_86's 99 KB per block"
    tma = G.CONFIGS["tma"]
    assert tma.smem_bytes("rr") == 16 * (32 * 64 + 64 * 64) * 2 + 1024  # swizzled, unpadded, + alignment slack
    assert tma.threads == 5 * 32  # 4 consumer warps and the producer


@pytest.mark.parametrize("M,K,epi,expected", [(1, 784, "bias_act", "stream"), (32, 8192, "store", "stream"),
                                              (33, 64, "dact", "64x128"), (64, 64, "store", "stream"),
                                              (128, 256, "bias", "stream"), (257, 256, "bias", "128x128"),
                                              (8192, 32, "sgd", "staged"),
                                              (784, 128, "sgd", "staged"), (784, 1024, "sgd", "128x128"),
                                              (32, 32, "sgd", "32x128")])
def test_config_choice(M, K, epi, expected):
    assert G.choose_config(M, K, epi, "cr" if epi == "sgd" else "rr") == expected
    if epi == "sgd":  # Adam's epilogue: the same tiles, the staged one in its 32-row form
        assert G.choose_config(M, K, "adam", "cr") == expected.replace("staged", "staged32")


def test_batch_sized_gemms_stream():
    for layout, epi in [("rr", "bias_act"), ("rc", "dact"), ("rr", "store"), ("rc", "store"), ("rr", "bias")]:
        for N, K in [(8192, 8192), (2048, 2048), (8192, 784), (256, 256), (16, 8192)]:
            assert G.plan_gemm(32, N, K, layout, epi).config.name == "stream"
            assert G.plan_gemm(1, N, K, layout, epi).config.name == "stream"
        batch_forward = layout == "rr"  # x @ W streams up to 256 rows, dy @ W^T up to 32
        assert (G.plan_gemm(64, 8192, 8192, layout, epi).config.name == "stream") == batch_forward
        assert G.plan_gemm(257, 8192, 8192, layout, epi).config.name != "stream"
    assert G.plan_gemm(32, 64, 64, "cc", "store").config.name == "32x128"  # no streaming instance
    assert G.plan_gemm(8192, 8192, 32, "cr", "store").config.name == "persist"  # x^T @ dy with a plain store...
    assert G.plan_gemm(2048, 2048, 32, "cr", "store", sm_count=132).config.name == "persist"  # 512 tiles, 264 blocks
    assert G.plan_gemm(784, 2048, 32, "cr", "store", sm_count=132).config.name == "staged"  # ... fewer: one pass
    assert G.plan_gemm(1024, 16, 32, "cr", "store").config.name == "32x128"  # ... into a head-sized output
    assert G.plan_gemm(1024, 16, 32, "cr", "sgd").config.name == "staged"
    assert G.plan_gemm(8192, 16, 32, "cr", "store").config.name == "staged"


def test_tma_streams_large_weights_on_sm90_only():
    for layout, epi in [("rr", "bias_act"), ("rc", "dact"), ("rr", "store"), ("rc", "store")]:
        for N, K in [(8192, 8192), (4096, 4096), (2048, 2048), (8192, 784)]:
            p = G.plan_gemm(32, N, K, layout, epi, arch="sm_90")
            assert p.config.name == "tma" and p.source == G.TMA_SOURCE
            assert p.grid[0] * p.grid[1] * p.grid[2] <= 132
            assert G.plan_gemm(32, N, K, layout, epi, arch="sm_86").config.name != "tma"
        assert G.plan_gemm(32, 1024, 1024, layout, epi, arch="sm_90").config.name == "stream"  # latency-bound
        assert G.plan_gemm(64, 8192, 8192, layout, epi, arch="sm_90").config.name != "tma"  # M > 32
    # the forward at batch size: with fp32 accumulation the warpgroup-MMA tile, K split over a cluster, from 512 KB of
    # weight to 32 MB, the grid one resident wave
    for M in (33, 128, 256):
        assert G.plan_gemm(M, 256, 784, "rr", "bias_act", arch="sm_90").config.name == "stream"
        for N, K in [(512, 512), (1024, 784), (1024, 3072), (2048, 2048), (4096, 784), (4096, 4096)]:
            p = G.plan_gemm(M, N, K, "rr", "bias_act", arch="sm_90", capacity=H100_CLUSTERS)
            assert p.config.name == G.FORWARD_WGMMA and p.cluster == (p.splits > 1), (M, N, K)
            assert p.grid[0] * p.grid[1] * p.grid[2] <= 132 and p.splits <= G.MAX_CLUSTER_SPLITS
        assert G.plan_gemm(M, 8192, 8192, "rr", "bias_act", arch="sm_90").config.name == G.ROW_TILE
        p = G.plan_gemm(M, 1024, 1024, "rr", "bias_act", arch="sm_90", cluster=False)  # no cluster: whole K
        assert (p.config.name, p.splits, p.cluster) == (G.FORWARD_WGMMA, 1, False)
        assert G.plan_gemm(M, 1024, 1024, "rr", "bias_act", arch="sm_86").config.name != G.FORWARD_WGMMA
    # fp16 accumulation (gemm.cu's and the copy engine's tiles alone): the copy engine from 1 MB, its 128-column tile on
    # 4096 columns, its 128-row tile from 12 MB, one block per SM
    for M in (33, 128, 256):
        f16 = {"arch": "sm_90", "accum": "f16"}
        assert G.plan_gemm(M, 1024, 784, "rr", "bias_act", **f16).config.name == "tma"
        assert G.plan_gemm(M, 2048, 2048, "rr", "bias_act", **f16).config.name == "tma"
        assert G.plan_gemm(M, 4096, 784, "rr", "bias_act", **f16).config.name == "tma128"
        for N, K, splits in [(8192, 784, 1), (4096, 4096, 2), (8192, 8192, 1)]:
            p = G.plan_gemm(M, N, K, "rr", "bias_act", capacity=H100_CLUSTERS, **f16)
            assert p.config.name == G.ROW_TILE and p.config.bm == 128
            assert p.splits == (1 if M > 128 else splits)  # two row tiles fill the SMs unsplit
            assert M > 128 or p.grid[0] * p.grid[1] * p.grid[2] <= 132
        assert G.plan_gemm(M, 4096, 4096, "rc", "dact", arch="sm_90").config.name in ("64x128", "128x128")
    assert G.plan_gemm(8192, 8192, 32, "cr", "sgd", arch="sm_90").config.name == "staged"
    assert G.sm90_or_later("sm_90") and G.sm90_or_later("sm_90a") and not G.sm90_or_later("sm_89")


def test_streaming_fills_each_sm_once():
    for sms in (46, 108, 132):
        for N, K in [(8192, 8192), (4096, 4096), (2048, 2048), (4096, 784), (8192, 784)]:
            p = G.plan_gemm(32, N, K, "rr", "bias_act", sm_count=sms, arch="sm_86", config="stream")
            blocks = p.grid[0] * p.grid[1] * p.grid[2]
            assert p.config.name == "stream"
            assert blocks <= max(sms, p.tiles[0] * p.tiles[1]), "more streaming blocks than SMs"
            assert p.splits == 1 or blocks > sms // 2
            assert p.k_chunk // p.config.bk >= G.STREAM_MIN_K_TILES_PER_SPLIT
            assert p.splits == 1 or -(-K // p.config.bk) >= G.STREAM_SPLIT_MIN_K_TILES
    # latency-bound shapes spread over more SMs, two k-tiles a split at least: 13 k-tiles of 64 -> 6 asked, so 3 per
    # split and 5 splits (none empty)
    assert G.plan_gemm(32, 128, 784, "rr", "bias_act", arch="sm_86").splits == 5
    assert G.plan_gemm(32, 512, 512, "rc", "dact", arch="sm_86").splits == 4
    assert G.plan_gemm(32, 256, 256, "rr", "bias_act", arch="sm_86").splits == 1  # 4 k-tiles: not worth a fix-up


H100_CLUSTERS = (0, 0, 66, 39, 30, 22, 17, 15, 15)  # cluster_capacity on an H100 SXM (132 SMs): clusters of s at once


def test_cluster_splits_keep_every_cluster_resident():
    for N, K in [(8192, 8192), (4096, 4096), (2048, 2048), (2048, 784), (1024, 1024), (512, 512), (16, 2048)]:
        p = G.plan_gemm(32, N, K, "rr", "bias_act", arch="sm_90", capacity=H100_CLUSTERS)
        assert p.splits == 1 or (p.cluster and p.tiles[0] * p.tiles[1] <= H100_CLUSTERS[p.splits]), (N, K)
        assert (p.splits - 1) * p.k_chunk < K, "a split would be empty"
    plan = functools.partial(G.plan_gemm, arch="sm_90", capacity=H100_CLUSTERS)
    # as many splits as fit at once, down to one k-tile each: 13 k-tiles -> 8 asked, 2 per split, 7 splits
    assert plan(32, 128, 784, "rr", "bias_act").splits == 7
    assert plan(32, 512, 512, "rc", "dact").splits == 8
    assert plan(32, 1024, 1024, "rr", "bias_act").splits == 6  # 16 tiles: 15 clusters of 8 or 7 fit, 17 of 6
    assert plan(32, 2048, 784, "rr", "bias_act").splits == 3  # 32 tiles: 30 clusters of 4 fit, 39 of 3
    assert plan(32, 256, 256, "rr", "bias_act").splits == 1  # 4 k-tiles: not worth a fix-up
    assert plan(32, 8192, 8192, "rr", "bias_act").splits == 1  # 128 tiles already fill the GPU
    assert plan(32, 4096, 4096, "rr", "bias_act").splits == 1  # the tensor-copy tile from a quarter of the SMs on
    assert plan(32, 2048, 2048, "rr", "bias_act").splits == 1  # 32 tensor-copy tiles: unsplit
    few = plan(32, 1024, 2048, "rr", "bias_act")  # 16 tensor-copy tiles: split, 17 clusters of 6 fit
    assert few.config.tma and few.splits == 6 and few.cluster
    # one tile of long K: 16 splits through the workspace, not 8 long ones in a cluster; 32 k-tiles stay in one
    long = plan(32, 16, 8192, "rr", "bias")
    assert long.splits == 16 and not long.cluster and long.workspace_floats > 0
    assert plan(32, 16, 2048, "rr", "bias").splits == 8 and plan(32, 16, 2048, "rr", "bias").cluster


@pytest.mark.parametrize("arch,limit_kb", [("sm_80", 163), ("sm_86", 99), ("sm_89", 99), ("sm_90", 227)])
def test_every_plan_fits_the_parts_shared_memory(arch, limit_kb):
    assert G.stream_stages(arch) >= 7
    for name in G.CONFIGS:
        cfg = G.config_for(name, arch)
        if cfg.tma and not G.sm90_or_later(arch):
            continue  # never planned there (test_bad_plans_are_refused)
        for lay in G.LAYOUTS:
            for epi in G.EPILOGUES:
                states = {"sgd": 1, "adam": 2}.get(epi, 0) if (name, lay, epi) in G.INSTANCES else 0
                assert cfg.smem_bytes(lay, epi, states) <= limit_kb * 1024, (name, lay, epi)


def test_persistent_tile_plans_a_resident_grid():
    p = G.plan_gemm(8192, 8192, 32, "cr", "store", config="persist", sm_count=132)
    assert p.config.persistent and p.splits == 1 and p.grid == (G.PERSIST_BLOCKS_PER_SM * 132, 1, 1)
    assert p.tiles == (128, 64)  # 8192 tiles walked by 264 blocks
    assert G.plan_gemm(128, 256, 32, "cr", "store", config="persist").grid == (4, 1, 1)  # fewer tiles than blocks
    assert G.plan_gemm(200, 264, 1000, "cr", "store", config="persist").splits == 1  # long K: still one pass
    assert p.smem_bytes == 2 * (32 * 72 + 32 * 136) * 2 + 64 * 136 * 2  # pipeline + the fp16 output tile
    with pytest.raises(ValueError, match="no split-K"):
        G.plan_gemm(8192, 8192, 64, "cr", "store", config="persist", splits=2)
    with pytest.raises(ValueError, match="no compiled GEMM instance"):
        G.plan_gemm(8192, 8192, 32, "cr", "sgd", config="persist")


def test_the_update_of_a_wide_layer_over_a_batch_of_at_most_2048_takes_the_ping_pong_tile():
    """x^T @ dy with SGD's or Adam's update, from 4096 rows over at most 2048 of batch in two waves of 128 x 128 tiles
    or more, on sm_90: the persistent ping-pong tile, one CTA an SM (fewer where the tiles are fewer), never split, its
    shared memory the pipeline's 4 stages and the family's epilogue buffers; its fp32 gradient (store32, which it does
    not compile) on wg128x2 or wg128, whose sums are its own. Elsewhere the tiles before."""
    for M, N, K in ((4096, 4096, 1024), (8192, 8192, 512), (4096, 4096, 2048), (4096, 8192, 300), (8200, 4104, 1000)):
        for states in (0, 1):
            p = G.plan_gemm(M, N, K, "cr", "sgd", arch="sm_90", states=states, sm_count=132, capacity=H100_CLUSTERS)
            tiles = -(-M // 128) * -(-N // 128)
            assert (p.config.name, p.splits, p.config.threads, p.source) == ("wgpp", 1, 384, "gemm_wgmma.cu"), (M, N, K)
            assert p.grid == (132, 1, 1) and p.cluster_dims == (1, 1, 1) and tiles >= 2 * 132
            assert p.smem_bytes == 4 * 32768 + 3 * 32768 + 1024 <= 227 * 1024
        adam = G.plan_gemm(M, N, K, "cr", "adam", arch="sm_90", states=2, sm_count=132, capacity=H100_CLUSTERS)
        assert (adam.config.name, adam.splits, adam.grid) == ("wgpp", 1, (132, 1, 1)), (M, N, K)
        assert adam.smem_bytes == 4 * 32768 + 2 * 49152 + 1024 <= 227 * 1024
        fp32 = G.plan_gemm(M, N, K, "cr", "store32", arch="sm_90", sm_count=132, capacity=H100_CLUSTERS)
        assert fp32.config.name == ("wg128x2" if K <= G.WGMMA_PAIR_MAX_K else "wg128") and fp32.splits == 1
    assert G.plan_gemm(4096, 4096, 1024, "cr", "sgd", config="wgpp", arch="sm_90", sm_count=2000).grid == (1024, 1, 1)
    with pytest.raises(ValueError, match="no split-K"):
        G.plan_gemm(4096, 4096, 1024, "cr", "sgd", config="wgpp", arch="sm_90", splits=2)
    for epi in ("store", "store32", "bias_act"):
        with pytest.raises(ValueError, match="no compiled GEMM instance"):
            G.plan_gemm(4096, 4096, 1024, "cr" if epi != "bias_act" else "rr", epi, config="wgpp", arch="sm_90")
    with pytest.raises(ValueError, match="needs the tensor copy engine of sm_90"):
        G.plan_gemm(4096, 4096, 1024, "cr", "sgd", config="wgpp", arch="sm_86")
    for M, N, K in ((4096, 4096, 4096), (4096, 16, 1024), (2048, 4096, 1024), (4096, 256, 1024)):  # few tiles, long K
        assert G.plan_gemm(M, N, K, "cr", "sgd", arch="sm_90", states=1).config.name != "wgpp", (M, N, K)
        assert G.plan_gemm(M, N, K, "cr", "adam", arch="sm_90", states=2).config.name != "wgpp", (M, N, K)
    assert G.plan_gemm(4096, 4096, 1024, "cr", "sgd", arch="sm_86", states=1).config.name == "128x128"


def test_staged_update_reserves_one_tile_per_optimiser_state():
    plain = G.plan_gemm(8192, 8192, 32, "cr", "sgd")
    mom = G.plan_gemm(8192, 8192, 32, "cr", "sgd", states=1)
    assert mom.smem_bytes - plain.smem_bytes == 64 * (128 + 8) * 4
    adam = G.plan_gemm(8192, 8192, 32, "cr", "adam", states=2)
    assert adam.config.name == "staged32" and adam.smem_bytes <= 99 * 1024  # fits sm_86
    assert adam.smem_bytes == 2 * (32 * 40 + 32 * 136) * 2 + 3 * 32 * (128 + 8) * 4
    for epi, states in (("store", 1), ("sgd", 2), ("adam", 1)):
        with pytest.raises(ValueError, match=f"the {epi} epilogue keeps"):
            G.plan_gemm(8192, 8192, 32, "cr", epi, states=states)


def test_split_k_fills_the_gpu_and_never_makes_empty_splits():
    for M, N, K in [(32, 8192, 8192), (32, 256, 784), (32, 16, 8192), (128, 1024, 1024), (8192, 8192, 32),
                    (1, 8, 8), (32, 10 * 8, 4096)]:
        for sms in (46, 108, 132):
            p = G.plan_gemm(M, N, K, "rr", sm_count=sms, config=None if M > 32 else "32x128")
            tm, tn = p.tiles
            assert 1 <= p.splits <= G.MAX_SPLITS
            assert (p.splits - 1) * p.k_chunk < K <= p.splits * p.k_chunk, "a split would be empty"
            assert p.k_chunk % p.config.bk == 0
            if p.splits > 1:
                assert p.k_chunk // p.config.bk >= G.MIN_K_TILES_PER_SPLIT - 1
                assert tm * tn * (p.splits - 1) < 2 * sms, "split more than needed to fill the GPU"
                assert K * (p.config.bm + p.config.bn) * 2 >= G.SPLIT_MIN_BYTES, "split a latency-bound GEMM"
                assert p.workspace_floats == p.splits * tm * tn * p.config.bm * p.config.bn
            else:
                assert p.workspace_floats == 0 and p.tickets == 0
    big = G.plan_gemm(32, 8192, 8192, "rr", sm_count=132, config="32x128")
    assert big.grid[0] * big.grid[1] * big.grid[2] >= 132
    assert G.plan_gemm(8192, 8192, 32, "cr", "sgd").splits == 1


def test_splits_meet_in_a_cluster_on_sm90_only():
    fwd = G.plan_gemm(32, 128, 784, "rr", "bias_act", arch="sm_90")
    assert fwd.splits > 1 and fwd.cluster and fwd.cluster_dims == (1, 1, fwd.splits)
    assert fwd.workspace_floats == 0 and fwd.tickets == 0  # no scratch: the partials stay on chip
    old = G.plan_gemm(32, 128, 784, "rr", "bias_act", arch="sm_86")
    assert old.splits > 1 and not old.cluster and old.cluster_dims == (1, 1, 1) and old.workspace_floats > 0
    l2 = G.plan_gemm(32, 128, 784, "rr", "bias_act", arch="sm_90", cluster=False)
    assert not l2.cluster and l2.workspace_floats > 0
    # beyond the portable cluster size, and on the staged tile, the workspace still takes them
    assert not G.plan_gemm(32, 128, 8192, "rr", "store", arch="sm_90", splits=12).cluster
    assert not G.plan_gemm(104, 136, 256, "cr", "store", config="staged", splits=3, arch="sm_90").cluster
    assert not G.plan_gemm(32, 128, 64, "rr", "store", arch="sm_90", cluster=True).cluster  # one split: nothing to meet
    # gemm.cu keeps the partial tile in the pipeline's memory, grown where that is smaller (128 x 136 floats)
    big = G.plan_gemm(296, 136, 520, "cc", "store", config="128x128", splits=6, arch="sm_90")
    assert big.cluster and big.smem_bytes == max(big.config.smem_bytes("cc"), 128 * 136 * 4)


STORE32_SHAPES = [(1, 256, 784), (32, 256, 256), (32, 1024, 4096), (32, 4096, 1024), (32, 4096, 4096),
                  (32, 8192, 8192), (64, 1024, 1024), (100, 264, 1000), (128, 256, 1024), (128, 1024, 1024),
                  (128, 4096, 784), (128, 4096, 4096), (256, 1024, 4096), (256, 4096, 4096), (257, 1024, 1024),
                  (2048, 1024, 1024)]


@pytest.mark.parametrize("arch", ["sm_86", "sm_90"])
@pytest.mark.parametrize("layout", ["rr", "rc"])
def test_store32_is_planned_as_store(arch, layout):
    """A tensor-parallel GEMM's fp32 partial sum runs the tile, splits and cluster a plain store of that shape gets:
    at batch 128 and 256 on sm_90 the tensor-copy tiles."""
    chosen = set()
    for M, N, K in STORE32_SHAPES:
        store = G.plan_gemm(M, N, K, layout, "store", arch=arch, capacity=H100_CLUSTERS)
        fp32 = G.plan_gemm(M, N, K, layout, "store32", arch=arch, capacity=H100_CLUSTERS)
        assert G.choose_config(M, K, "store32", layout, N, arch) == store.config.name
        assert fp32.kernel == store.kernel.replace("_store_", "_store32_"), (M, N, K)
        assert replace(fp32, epilogue="store") == store, (M, N, K)
        chosen.add(fp32.config.name)
    assert chosen == {("sm_86", "rr"): {"stream", "128x128"}, ("sm_86", "rc"): {"stream", "64x128", "128x128"},
                      ("sm_90", "rr"): {"stream", "tma", G.FORWARD_WGMMA, "wg64", "wg128"},
                      ("sm_90", "rc"): {"stream", "tma", "64x128", "128x128", "wg64", "wg128"}}[arch, layout]
    if arch == "sm_90" and layout == "rr":  # batch 128: the warpgroup-MMA tile, K split over a cluster
        for N, K in ((4096, 4096), (1024, 1024), (4096, 784)):
            p = G.plan_gemm(128, N, K, "rr", "store32", arch=arch)
            assert (p.config.name, p.cluster) == (G.FORWARD_WGMMA, p.splits > 1)


def test_store32_is_compiled_wherever_x_at_w_and_dy_at_wt_store_and_a_weight_is_updated():
    store = {(c, lay) for c, lay, e in G.INSTANCES if e == "store" and lay in ("rr", "rc")}
    assert {(c, lay) for c, lay, e in G.INSTANCES if e == "store32" and lay != "cr"} == store
    assert {c for c, _ in store} == {"32x128", "64x128", "128x128", "32x128k64", "stream", "tma", "tma128", G.ROW_TILE,
                                     "wg128", "wg256", "wg128x2", "wg256mc", "wg64", "wg64k"}
    assert {c for c, lay, e in G.INSTANCES if e == "store32" and lay == "cr"} == {
        "32x128", "64x128", "128x128", "staged", "staged32", "wg128", "wg128x2", "wg256", "wg256mc", "wg64"}
    with pytest.raises(ValueError, match="no compiled GEMM instance"):
        G.plan_gemm(8192, 8192, 32, "cc", "store32")


@pytest.mark.parametrize("arch", ["sm_86", "sm_90"])
def test_a_weight_gradient_in_fp32_runs_the_tile_and_splits_of_one_gpus_update(arch):
    """Data parallelism's weight gradient (cr, store32) is planned as the SGD update of that shape, so with one GPU
    its sums are the fused update's."""
    for M, N, K in [(784, 256, 32), (256, 16, 128), (4096, 4096, 64), (784, 1024, 512), (64, 256, 128),
                    (1024, 1024, 2048)]:
        update = G.plan_gemm(M, N, K, "cr", "sgd", arch=arch, states=1, capacity=H100_CLUSTERS)
        fp32 = G.plan_gemm(M, N, K, "cr", "store32", arch=arch, capacity=H100_CLUSTERS)
        assert (fp32.config, fp32.splits, fp32.cluster) == (update.config, update.splits, update.cluster), (M, N, K)


def test_batches_above_256_take_the_warpgroup_mma_tiles_on_sm_90_alone():
    """x @ W and dy @ W^T of more than 256 rows run on the sm_90a warpgroup-MMA tiles (256 columns where those still
    fill half the SMs; in multicast pairs from 12 k-tiles on), never split, with fp32 accumulation, N >= 128 and
    K >= 64 (dy @ W^T below one k-tile too into 2048 columns or more: the head's dx, two CTAs an SM), and so does
    x^T @ dy of a batch above 256 at any N, split over a cluster where its tiles are few; elsewhere the tiles
    before."""
    for layout, epi in (("rr", "bias_act"), ("rc", "dact"), ("rr", "store32"), ("rc", "store")):
        for K, config, cluster in ((704, "wg256", (1, 1, 1)), (768, "wg256mc", (2, 1, 1)),
                                   (1024, "wg256mc", (2, 1, 1))):
            p = G.plan_gemm(4096, 1024, K, layout, epi, arch="sm_90")
            assert (p.config.name, p.splits, p.config.threads, p.source) == (config, 1, 384, "gemm_wgmma.cu"), layout
            assert p.smem_bytes == 4 * (128 + 256) * 64 * 2 + 1024 and p.cluster_dims == cluster
    p = G.plan_gemm(600, 4096, 1024, "rr", "bias_act", arch="sm_90")
    assert (p.config.name, p.tiles) == ("wg256mc", (6, 16))  # 5 row tiles: the pair past M writes nothing
    assert G.plan_gemm(128, 32768, 4096, "cr", "store", arch="sm_90").config.name == "wg256"  # one row tile: no pair
    # few tiles: the 64-column tile while its tiles are one wave (the head's dy @ W^T of K = 16 too), else wg128
    for M, N, K, layout, epi in ((1024, 256, 256, "rr", "store"), (257, 1024, 1024, "rc", "dact"),
                                 (1024, 1024, 784, "rr", "bias_act"), (4096, 256, 256, "rc", "dact"),
                                 (1024, 1024, 16, "rc", "dact"), (4096, 256, 16, "rc", "store")):
        p = G.plan_gemm(M, N, K, layout, epi, arch="sm_90", sm_count=132)
        assert (p.config.name, p.splits, p.config.threads, p.tiles[0] * p.tiles[1] <= 132) == ("wg64", 1, 384, True)
    for M, N, K in ((1024, 2048, 2048), (2048, 1024, 1024), (4096, 512, 512)):  # 256 tiles of 64 columns: two waves
        assert G.plan_gemm(M, N, K, "rr", "bias_act", arch="sm_90", sm_count=132).config.name == "wg128", (M, N, K)
    # the head's dx (K under one k-tile) into 2048 columns or more over more tiles than a wave of wg64's: two CTAs an
    # SM, one's epilogue beside the other's; into fewer columns the mma.sync tile
    for M, N, epi in ((1024, 2048, "dact"), (1024, 4096, "dact"), (4096, 4096, "store"), (2048, 8192, "store32")):
        p = G.plan_gemm(M, N, 16, "rc", epi, arch="sm_90", sm_count=132)
        assert (p.config.name, p.splits, p.config.ctas_per_sm) == ("wg128x2", 1, 2), (M, N, epi)
    assert G.plan_gemm(4096, 1024, 16, "rc", "dact", arch="sm_90", sm_count=132).config.name == "128x128"
    assert G.plan_gemm(4096, 1024, 16, "rc", "dact", arch="sm_90", accum="f16").config.name == "128x128"
    assert G.plan_gemm(4096, 1024, 16, "rc", "dact", arch="sm_86").config.name == "128x128"
    for args, kw in [((256, 256, 784, "rr", "store"), {}),  # a batch the streaming tiles take
                     ((4096, 1024, 1024, "rr", "store"), {"accum": "f16"}),
                     ((4096, 1024, 16, "rr", "bias_act"), {}),
                     ((4096, 104, 1024, "rr", "bias_act"), {}),
                     ((4096, 4096, 128, "cr", "sgd"), {"states": 1}), ((4096, 4096, 256, "cr", "adam"), {"states": 2})]:
        assert not G.plan_gemm(*args, arch="sm_90", **kw).config.wgmma, (args, kw)
    # x^T @ dy of a batch above 256 with its update, its fp32 gradient alike; K split over a cluster while the tiles
    # leave SMs idle (one CTA per SM, two k-tiles a split at least)
    p = G.plan_gemm(4096, 1024, 4096, "cr", "sgd", arch="sm_90", states=1)
    assert (p.config.name, p.splits) == ("wg256mc", 1)
    for epi, states in (("sgd", 1), ("adam", 2), ("store32", 0)):
        # 128 tiles of 64 columns over 16 k-tiles: whole; over 64 k-tiles: 64 tiles of 128 in 2 splits of 32
        p = G.plan_gemm(1024, 1024, 1024, "cr", epi, arch="sm_90", states=states, capacity=H100_CLUSTERS)
        assert (p.config.name, p.splits, p.cluster) == ("wg64", 1, False), epi
        p = G.plan_gemm(1024, 1024, 4096, "cr", epi, arch="sm_90", states=states, capacity=H100_CLUSTERS)
        assert (p.config.name, p.splits, p.cluster) == ("wg128", 2, True), epi
    assert G.plan_gemm(784, 1024, 512, "cr", "sgd", arch="sm_90", states=1).config.name == "wg64"  # 112 tiles
    assert G.plan_gemm(256, 1024, 1024, "cr", "sgd", arch="sm_90", states=1).config.name == "wg128"  # 32: too few
    # as many splits as leave every tile's cluster resident: 14 tiles in clusters of 8, 32 of 3 (4 would not fit)
    for (M, N, K), splits in (((784, 256, 1024), 8), ((256, 256, 4096), 8), ((256, 256, 512), 4),
                              ((784, 1024, 4096), 2), ((4096, 4096, 4096), 1), ((256, 16, 4096), 8),
                              ((4096, 16, 4096), 3), ((8192, 16, 4096), 2)):
        p = G.plan_gemm(M, N, K, "cr", "sgd", arch="sm_90", states=1, capacity=H100_CLUSTERS)
        assert p.config.wgmma and p.splits == splits and p.cluster == (splits > 1), (M, N, K)
        assert p.grid[2] == splits and p.cluster_dims == ((1, 1, splits) if splits > 1 else (p.config.multicast, 1, 1))
        assert p.workspace_floats == 0 and p.tickets == 0  # the splits meet in distributed shared memory
    # a weight of 4096 rows or more over a batch of at most 1024 whose tiles are too few for the ping-pong tile (the
    # head's), and every such weight's fp32 gradient: two CTAs an SM, whole tiles
    for M, N, K, epi in ((4096, 16, 1024, "sgd"), (8192, 16, 300, "sgd"), (4096, 4096, 1024, "store32"),
                         (8192, 8192, 512, "store32")):
        p = G.plan_gemm(M, N, K, "cr", epi, arch="sm_90", states=int(epi == "sgd"), capacity=H100_CLUSTERS)
        assert (p.config.name, p.splits, p.config.threads) == ("wg128x2", 1, 288), (M, N, K)
        assert p.smem_bytes == 3 * (128 + 128) * 64 * 2 + 1024  # twice fits an SM
    for M, N, K in ((4096, 4096, 4096), (2048, 2048, 1024), (784, 4096, 1024)):
        assert G.plan_gemm(M, N, K, "cr", "sgd", arch="sm_90", states=1).config.name not in ("wg128x2", "wgpp")
    for arch in ("sm_86", "sm_80", "sm_100"):
        assert G.plan_gemm(4096, 1024, 1024, "rr", "bias_act", arch=arch).config.name == "128x128"
        assert G.plan_gemm(4096, 16, 1024, "rr", "bias", arch=arch).config.name == "128x128"  # measured on sm_90
    # narrower than WGMMA_MIN_N, x @ W streams on sm_90 while its 32-row tiles are one wave (the head's 16 columns);
    # dy @ W^T does not
    for M, N, K in ((257, 16, 256), (4096, 16, 1024), (132 * 32, 16, 8192), (1024, 64, 784)):
        p = G.plan_gemm(M, N, K, "rr", "bias" if N == 16 else "bias_act", arch="sm_90", sm_count=132)
        assert p.config.name == "stream" and p.grid[0] == -(-M // 32), (M, N, K)
    for M, N, sms in ((4096, 72, 132), (132 * 32 + 1, 16, 132), (60000, 16, 132), (4096, 16, 108)):
        assert G.plan_gemm(M, N, 1024, "rr", "bias_act", arch="sm_90", sm_count=sms).config.name == "128x128"
    assert G.plan_gemm(4096, 16, 1024, "rc", "dact", arch="sm_90").config.name == "128x128"
    with pytest.raises(ValueError, match="needs the warpgroup MMA of sm_90, not sm_100"):
        G.plan_gemm(4096, 1024, 1024, "rr", "store", config="wg128", arch="sm_100")
    with pytest.raises(ValueError, match="split K only as wg128's x\\^T @ dy"):
        G.plan_gemm(4096, 1024, 1024, "rr", "store", config="wg128", arch="sm_90", splits=2)
    with pytest.raises(ValueError, match="config wg256"):
        G.plan_gemm(256, 256, 4096, "cr", "store", config="wg256", arch="sm_90", splits=2)
    assert G.plan_gemm(256, 256, 4096, "cr", "store", config="wg256", arch="sm_90").splits == 1
    with pytest.raises(ValueError, match="in a cluster of at most 8"):
        G.plan_gemm(256, 256, 4096, "cr", "store", config="wg128", arch="sm_90", splits=16)
    with pytest.raises(ValueError, match="no cluster"):
        G.plan_gemm(256, 256, 4096, "cr", "store", config="wg128", arch="sm_90", splits=4, cluster=False)


class _NoKernels:
    def get(self, *args):
        raise AssertionError("gemm() must refuse bad arguments before it looks a kernel up")


class _Recorder:
    def __init__(self):
        self.calls = []

    def get(self, source, name):
        calls, signature = self.calls, kernel_params.signature(source, name)

        class _K:
            def bind(self, grid, block, smem, *args, cluster=None):
                calls.append((source, name, signature, args))

        return _K()


def test_store32_binds_an_fp32_output_and_refuses_others():
    from rawgpu.runtime.memory import Arena

    a = Arena()  # planned, never allocated: no GPU needed
    M, N, K = 32, 264, 1000
    A, B = a.tensor("A", (M, K), np.float16), a.tensor("B", (K, N), np.float16)
    Bt = a.tensor("Bt", (N, K), np.float16)
    plan = G.plan_gemm(M, N, K, "rr", "store32", config="32x128", splits=1)
    k = _Recorder()
    out = a.tensor("C32", (M, N), np.float32)
    G.gemm(k, plan, A, B, out)
    wide = a.tensor("D", (40, 272), np.float32)  # more rows and columns than the product: ldc is its row
    G.gemm(k, G.plan_gemm(M, N, K, "rc", "store32", config="64x128", splits=1), A, Bt, wide)
    (_, name, sig, args), (_, name_rc, _, args_rc) = k.calls
    assert name == "gemm_32x128_rr_store32_f32" and name_rc == "gemm_64x128_rc_store32_f32"
    assert len(args) == len(sig) and args[2] is out and args[8] == N and args_rc[8] == 272  # ldc: floats a row
    no = _NoKernels()
    with pytest.raises(TypeError, match=r"C \(store32: an fp32 partial sum\): expected dtype float32, got float16"):
        G.gemm(no, plan, A, B, a.tensor("C16", (M, N), np.float16))
    with pytest.raises(TypeError, match="C: expected dtype float16, got float32"):  # and the fp16 store keeps fp16
        G.gemm(no, G.plan_gemm(M, N, K, "rr", "store", config="32x128"), A, B, out)
    for shape in [(M, N + 4), (M - 1, N), (M, N - 8), (M * N,)]:
        with pytest.raises(ValueError, match=r"cannot hold 32 x 264 \(stride multiple of 8\)"):
            G.gemm(no, plan, A, B, a.tensor(f"bad{shape}", shape, np.float32))


def test_the_ping_pong_tile_refuses_update_arrays_its_copy_engine_cannot_address():
    """The ping-pong tile reads and writes the master's halves and the optimiser's state by TMA, from 16-byte aligned
    starts: a view 8 bytes in is refused in one line before anything is bound; the other tiles take it as before."""
    from rawgpu.runtime.memory import Arena

    a = Arena()  # planned, never allocated: no GPU needed
    M, N, K = 4096, 4096, 1024
    A, B = a.tensor("A", (K, M), np.float16), a.tensor("B", (K, N), np.float16)
    lo, optim = a.tensor("lo", (M, N), np.int16), a.tensor("optim", (OPTIM_WORDS,), np.float32)
    hi = a.tensor("hi", (M + 1, N), np.float16)
    mom = a.tensor("mom", (M + 1, N), np.float32)
    plan = G.plan_gemm(M, N, K, "cr", "sgd", arch="sm_90", states=1, sm_count=132)
    assert plan.config.pingpong
    shifted = {"w16": hi.view((M, N), offset_bytes=8, name="hi+8"), "mom": mom.view((M, N), offset_bytes=8,
                                                                                     name="mom+8")}
    for bad in shifted:
        kw = {"w16": hi.view((M, N)), "mom": mom.view((M, N)), bad: shifted[bad]}
        with pytest.raises(ValueError, match=r"\+8 starts \d+ bytes into the arena: it must be 16-byte aligned"):
            G.gemm(_NoKernels(), plan, A, B, lo, optim=optim, **kw)
    k = _Recorder()
    G.gemm(k, G.plan_gemm(M, N, K, "cr", "sgd", config="128x128", arch="sm_90", states=1), A, B, lo, optim=optim,
           w16=shifted["w16"], mom=mom.view((M, N)))
    assert k.calls[0][1] == "gemm_128x128_cr_sgd_f32"


def test_plan_is_deterministic():
    a = G.plan_gemm(32, 1024, 1024, "rc", "dact", sm_count=132)
    assert a == G.plan_gemm(32, 1024, 1024, "rc", "dact", sm_count=132)


@pytest.mark.parametrize("kw,msg", [
    (dict(M=32, N=10, K=64), "contiguous dimension is 10"),
    (dict(M=32, N=16, K=12), "A's contiguous dimension is 12"),
    (dict(M=0, N=16, K=16), "positive"),
    (dict(M=8, N=16, K=16, layout="xx"), "layout"),
    (dict(M=8, N=16, K=16, epilogue="gelu"), "epilogue"),
    (dict(M=8, N=16, K=16, layout="cc", epilogue="sgd"), "no compiled GEMM instance"),
    (dict(M=8, N=16, K=16, splits=99), "splits"),
    (dict(M=8, N=16, K=16, config="tma", arch="sm_86"), "tensor copy engine"),
    (dict(M=8, N=16, K=16, layout="cr", config="tma", arch="sm_90"), "no compiled GEMM instance"),
    (dict(M=32, N=128, K=4096, splits=4, cluster=True, arch="sm_86"), "within a cluster needs sm_90"),
    (dict(M=32, N=128, K=4096, splits=12, cluster=True, arch="sm_90"), "at most 8 splits"),
    (dict(M=104, N=136, K=256, layout="cr", config="staged", splits=3, cluster=True, arch="sm_90"), "staged"),
])
def test_bad_plans_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        G.plan_gemm(**kw)


# --- GPU -------------------------------------------------------------------------------------------------------

def _f16(rng, shape, scale=1.0):
    return (rng.uniform(-1, 1, shape) * scale).astype(np.float16)


def _bound(accum: str, K: int, epilogue: str = "store") -> float:
    """fp32 accumulation: 2e-3 (the fp16 output rounding dominates); into store32's fp32 output, 1e-4, half of what
    rounding to fp16 alone costs (about 2e-4). fp16 accumulation rounds the running sum once per k16 step, a random
    walk of sqrt(K / 16) roundings of 2^-11 relative."""
    if accum == "f32":
        return 1e-4 if epilogue == "store32" else 2e-3
    return max(2e-3, 1e-3 * np.sqrt(K / 16))


def _rel(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(got).all(), "output has NaN/inf: not every element was written"
    return np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)


def run_case(device, stream, kernels, rng, M, N, K, layout="rr", epilogue="store", accum="f32", splits=None,
             opt="plain", repeat=1, config=None, cluster=None):
    """Build fresh random operands, run the GEMM (poisoned outputs), return (outputs, references). opt: the update
    epilogue's optimiser (OPTIMIZERS)."""
    from rawgpu.runtime.memory import Arena

    recipe = OPTIMIZERS[opt]
    states = 0
    if epilogue == "update":  # the optimiser's own epilogue
        epilogue, states = ("adam" if recipe.optimizer != "sgd" else "sgd"), recipe._state_tensors
    plan = G.plan_gemm(M, N, K, layout, epilogue, accum, sm_count=device.sm_count, splits=splits, config=config,
                       arch=device.arch, states=states, cluster=cluster, capacity=G.cluster_capacity(kernels))
    a = _f16(rng, (M, K) if layout[0] == "r" else (K, M))
    b = _f16(rng, (K, N) if layout[1] == "r" else (N, K))
    a_mk = (a if layout[0] == "r" else a.T).astype(np.float64)
    b_kn = (b if layout[1] == "r" else b.T).astype(np.float64)
    acc_ref = a_mk @ b_kn
    table = optimizer.step_values(optimizer.hyperparameters(recipe), TABLE_STEP, 0.05)
    with Arena() as arena:
        tA, tB = arena.tensor("A", a.shape, np.float16), arena.tensor("B", b.shape, np.float16)
        extra, host = {}, {}
        if epilogue in G.UPDATE_EPILOGUES:  # the master weights: W16 and lo (rawgpu/model/master.py), read and rewritten
            out = arena.tensor("Wlo", (M, N), np.int16)
            extra["w16"] = arena.tensor("W16", (M, N), np.float16)
            extra["optim"] = arena.tensor("optim", (OPTIM_WORDS,), np.float32)
            host["W32"] = rng.uniform(-1, 1, (M, N)).astype(np.float32)
            host["W16"], host["Wlo"] = master.split(host["W32"])
            for name in ("mom", "var")[:states]:  # Adam's second moment is positive, of the squared sums' size
                extra[name] = arena.tensor(name, (M, N), np.float32)
                host[name] = (rng.uniform(-1, 1, (M, N)) if name == "mom" else rng.uniform(0, K, (M, N))).astype(np.float32)
        else:
            out = arena.tensor("C", (M, N), np.float32 if epilogue == "store32" else np.float16)
        if epilogue in ("bias", "bias_act"):
            extra["bias"] = arena.tensor("bias", (N,), np.float32)
            host["bias"] = rng.uniform(-2, 2, N).astype(np.float32)
        if epilogue == "dact":
            extra["act"] = arena.tensor("act", (M, N), np.float16)
            host["act"] = np.maximum(_f16(rng, (M, N)), 0).astype(np.float16)  # a ReLU output: about half zero
        if plan.splits > 1 and not plan.cluster:
            extra["workspace"] = arena.tensor("ws", (plan.workspace_floats,), np.float32)
            extra["tickets"] = arena.tensor("tickets", (plan.tickets,), np.int32)
        arena.allocate()
        tA.upload(a)
        tB.upload(b)
        if "optim" in extra:
            extra["optim"].upload(optimizer.words(table))
        if "tickets" in extra:
            extra["tickets"].upload(np.zeros(plan.tickets, np.int32))
            extra["workspace"].fill_bytes(0xFF)
        kernels_launch = G.gemm(kernels, plan, tA, tB, out, **extra)
        results = []
        for _ in range(repeat):
            for name, t in [("Wlo", out), ("W16", extra.get("w16")), ("mom", extra.get("mom")),
                            ("var", extra.get("var")), ("bias", extra.get("bias")), ("act", extra.get("act"))]:
                if t is not None and name in host:
                    t.upload(host[name])
            if epilogue not in G.UPDATE_EPILOGUES:
                out.fill_bytes(0xFF)
            kernels_launch.run(stream)
            got = {"out": out.download()}
            for name in ("w16", "mom", "var", "tickets"):
                if name in extra:
                    got[name] = extra[name].download()
            results.append(got)
    ref = {"acc": acc_ref}
    if epilogue == "bias":
        ref["out"] = acc_ref + host["bias"]
    elif epilogue == "bias_act":
        ref["out"] = np.maximum(acc_ref + host["bias"], 0)
    elif epilogue == "dact":
        ref["out"] = acc_ref * (host["act"] > 0)
    elif epilogue in ("store", "store32"):
        ref["out"] = acc_ref
    else:
        zero = np.zeros_like(acc_ref)
        w1, m1, v1 = update_reference(table, host["W32"], acc_ref, host.get("mom", zero), host.get("var", zero))
        ref["W32_before"] = host["W32"].astype(np.float64)
        ref["W32"] = w1
        ref.update({"mom": m1, "var": v1} if states > 1 else {"mom": m1} if states else {})
    return plan, results, ref


def check_case(plan, got, ref):
    bound = _bound(plan.accum, plan.K, plan.epilogue)
    if plan.epilogue in G.UPDATE_EPILOGUES:
        # The update itself, recovered from the joined master (its change is small next to W, so compare the step).
        w = master.join(got["w16"], got["out"])
        change, ref_change = w.astype(np.float64) - ref["W32_before"], ref["W32"] - ref["W32_before"]
        assert _rel(change, ref_change) <= bound, f"{plan.kernel}: update error {_rel(change, ref_change):.2e}"
        # Written everywhere (the master is read and rewritten in place, so it cannot be poisoned): every weight
        # whose change is not tiny has moved.
        big = np.abs(ref_change) > 1e-3 * np.abs(ref_change).max()
        assert (w[big] != ref["W32_before"][big].astype(np.float32)).all(), f"{plan.kernel}: weights left unwritten"
        # W16 is fp16 of the master, except where the master's 2^-39 grid below 2^-16 (cu/master.cuh) rounds a
        # value to the midpoint between two fp16 subnormals (|lo| = 2^14): W16 is then fp16 of the value before
        # that rounding, one subnormal step (2^-24) from fp16 of the joined master.
        tie = (np.abs(w) < 2.0**-16) & (np.abs(got["out"].astype(np.int32)) == 2**14)
        off = np.argwhere((w.astype(np.float16).view(np.uint16) != got["w16"].view(np.uint16)) & ~tie)
        assert not len(off), (f"{plan.kernel}: W16 must be fp16(master) exactly; {len(off)} differ, e.g. "
                              + "; ".join(f"({r},{c}) hi={got['w16'][r, c].view(np.uint16):#06x} lo={got['out'][r, c]} "
                                          f"master={w[r, c]!r} before={ref['W32_before'][r, c]!r}" for r, c in off[:4]))
        assert np.abs(got["out"].astype(np.int32)).max() <= 2**14, "lo out of its range: not split by master.cuh"
        for name in ("mom", "var"):
            assert (name in ref) == (name in got), f"{plan.kernel}: {name} passed without a state to hold"
            if name in ref:
                assert _rel(got[name], ref[name]) <= bound, f"{plan.kernel}: {name} error {_rel(got[name], ref[name]):.2e}"
    else:
        err = _rel(got["out"], ref["out"])
        assert err <= bound, f"{plan.kernel} {plan.M}x{plan.N}x{plan.K} splits={plan.splits}: rel err {err:.2e} > {bound:.1e}"
        if plan.epilogue == "store32" and plan.accum == "f32":  # fp32 sums are almost never fp16 values
            halves = np.mean(got["out"] == got["out"].astype(np.float16).astype(np.float32))
            assert halves < 0.5, f"{plan.kernel}: {halves:.0%} of the outputs are fp16 values: rounded on the way"
    if "tickets" in got:
        assert not got["tickets"].any(), "split-K tickets must be reset for the next launch"


def mlp_cases():
    """Every GEMM of the MLP 784 -> h -> h -> 10 (padded to 16) at batch 32 and 128, in its three roles."""
    cases = []
    for h in (128, 256, 1000, 1024, 4096, 8192):
        for b in (32, 128):
            for fin, fout, last in [(784, h, False), (h, h, False), (h, 16, True)]:
                cases.append((f"fwd-h{h}-b{b}-{fin}x{fout}", b, fout, fin, "rr", "bias" if last else "bias_act"))
                if fin != 784:
                    cases.append((f"dx-h{h}-b{b}-{fout}x{fin}", b, fin, fout, "rc", "dact"))
                cases.append((f"dw-h{h}-b{b}-{fin}x{fout}", fin, fout, b, "cr", "update"))
    # a tensor-parallel layer's fp32 partial sums (store32), x @ W and dy @ W^T of a hidden layer's shard at batch 32,
    # 128 and 256: the planner's tiles for a plain store (on sm_90 the tensor-copy ones from batch 128 on)
    for h in (256, 1024, 4096):
        for b in (32, 128, 256):
            for fin in (784, h):
                cases.append((f"tp-fwd-h{h}-b{b}-{fin}x{h}", b, h, fin, "rr", "store32"))
            cases.append((f"tp-dx-h{h}-b{b}-{h}x{h}", b, h, h, "rc", "store32"))
    return cases


MLP_CASES = mlp_cases()


@pytest.fixture(scope="module")
def kernels(device):
    from rawgpu.kernels import Kernels

    return Kernels(device.arch)


@pytest.mark.gpu
@pytest.mark.parametrize("name,M,N,K,layout,epi", MLP_CASES, ids=[c[0] for c in MLP_CASES])
def test_mlp_shapes_fp32_accumulation(device, stream, kernels, rng, name, M, N, K, layout, epi):
    """Updates with momentum at batch 32, Adam at batch 128 (the seed-sized and the default recipes' shapes)."""
    opt = "plain" if epi != "update" else "momentum" if "b32" in name else "adam"
    plan, (got,), ref = run_case(device, stream, kernels, rng, M, N, K, layout, epi, "f32", opt=opt)
    check_case(plan, got, ref)


F16_CASES = [c for c in MLP_CASES if "-h256-" in c[0] or "-h1024-" in c[0] or c[0] in ("fwd-h8192-b32-8192x8192",)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,M,N,K,layout,epi", F16_CASES, ids=[c[0] for c in F16_CASES])
def test_mlp_shapes_fp16_accumulation(device, stream, kernels, rng, name, M, N, K, layout, epi):
    plan, (got,), ref = run_case(device, stream, kernels, rng, M, N, K, layout, epi, "f16")
    check_case(plan, got, ref)


ODD = [("m1-n16-k8", 1, 16, 8, "rr", "bias_act"), ("m1-n104-k784", 1, 104, 784, "rr", "bias_act"),
       ("hidden100", 32, 104, 104, "rr", "bias_act"), ("hidden100-dx", 32, 104, 104, "rc", "dact"),
       ("hidden100-dw", 104, 104, 32, "cr", "update"), ("n10pad16", 32, 16, 104, "rr", "bias"),
       ("dx-to-784", 32, 784, 104, "rc", "dact"), ("dw-784", 784, 104, 7, "cr", "update"),
       ("m1000-k8", 1000, 24, 8, "rr", "store"), ("k1-col", 40, 24, 1, "cr", "store"),
       ("tp-m1", 1, 72, 200, "rr", "store32"), ("tp-fwd-odd", 100, 264, 1000, "rr", "store32"),
       ("tp-dx-odd", 33, 136, 200, "rc", "store32")]


@pytest.mark.gpu
@pytest.mark.parametrize("accum", ["f32", "f16"])
@pytest.mark.parametrize("name,M,N,K,layout,epi", ODD, ids=[c[0] for c in ODD])
def test_odd_shapes(device, stream, kernels, rng, name, M, N, K, layout, epi, accum):
    plan, (got,), ref = run_case(device, stream, kernels, rng, M, N, K, layout, epi, accum)
    check_case(plan, got, ref)


LAYOUT_CASES = [(config, M, lay, epi)
                for config, M in [("32x128", 17), ("64x128", 50), ("128x128", 300), ("32x128k64", 17)]
                for lay in G.LAYOUTS for epi in ("store", "store32") if (config, lay, epi) in G.INSTANCES]


@pytest.mark.gpu
@pytest.mark.parametrize("accum", ["f32", "f16"])
@pytest.mark.parametrize("config,M,layout,epi", LAYOUT_CASES)
def test_every_layout_and_config(device, stream, kernels, rng, layout, config, M, epi, accum):
    M = M if layout[0] == "r" else -(-M // 8) * 8  # column-major A: M is its contiguous dimension
    plan, (got,), ref = run_case(device, stream, kernels, rng, M, 136, 200, layout, epi, accum, config=config)
    assert plan.config.name == config
    check_case(plan, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,layout,epi", [(32, 1024, 4096, "rr", "bias_act"), (32, 4096, 1024, "rc", "dact"),
                                              (128, 256, 8192, "rr", "store"), (64, 128, 2048, "cr", "store"),
                                              (256, 256, 2048, "cr", "update"), (128, 256, 8192, "rr", "store32"),
                                              (32, 4096, 1024, "rc", "store32")])
@pytest.mark.parametrize("accum", ["f32", "f16"])
def test_split_k_matches_no_split_and_is_bitwise_reproducible(device, stream, kernels, rng, M, N, K, layout, epi, accum):
    seed = int(rng.integers(2**31))
    plan1, (one,), ref = run_case(device, stream, kernels, np.random.default_rng(seed), M, N, K, layout, epi, accum, splits=1)
    planS, runs, _ = run_case(device, stream, kernels, np.random.default_rng(seed), M, N, K, layout, epi, accum,
                              splits=5, repeat=3)
    assert plan1.splits == 1 and planS.splits >= 4  # 5 asked; fewer where 5 would leave a split empty
    check_case(plan1, one, ref)
    for got in runs:
        check_case(planS, got, ref)
    for got in runs[1:]:
        for key in got:
            assert np.array_equal(got[key], runs[0][key]), f"split-K result {key} differs between identical runs"
    if epi != "update":
        assert _rel(runs[0]["out"], one["out"].astype(np.float64)) <= _bound(accum, K, epi)


@pytest.mark.gpu
@pytest.mark.parametrize("accum", ["f32", "f16"])
@pytest.mark.parametrize("layout,epi", [("rr", "store"), ("rr", "bias"), ("rr", "bias_act"), ("rc", "store"),
                                        ("rc", "dact"), ("rr", "store32"), ("rc", "store32")])
@pytest.mark.parametrize("M,N,K,splits", [(1, 72, 200, None), (17, 136, 1000, None), (32, 520, 4104, 3),
                                          (32, 64, 64, None), (600, 16, 1024, None), (4096, 16, 4096, 2)])
def test_streaming_config(device, stream, kernels, rng, M, N, K, splits, layout, epi, accum):
    """The deep-pipeline tile on shapes with partial tiles, short K (fewer k-tiles than stages) and split-K, and over
    many row tiles (the head's forward at a large batch)."""
    plan, (got,), ref = run_case(device, stream, kernels, rng, M, N, K, layout, epi, accum, splits=splits,
                                 config="stream")
    assert plan.config.stages == G.stream_stages(device.arch)
    check_case(plan, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["wg128", "wg256", "wg128x2", "wg64"])
@pytest.mark.parametrize("layout,epi", [("rr", "store"), ("rr", "bias_act"), ("rc", "store"), ("rc", "dact"),
                                        ("rr", "store32"), ("rc", "store32")])
@pytest.mark.parametrize("M,N,K", [(300, 136, 200), (257, 264, 784), (1024, 1024, 1024), (4096, 512, 64),
                                   (600, 264, 16)])
def test_warpgroup_mma_tiles(device, stream, kernels, rng, M, N, K, layout, epi, config):
    """The sm_90a tiles against float64: partial tiles in M, N (below and above the tile's columns) and K (a k-tile
    the copy engine zero-fills, K below one k-tile as the head's dx), every epilogue they take; bitwise repeatable.
    sm_90 only."""
    if not G.has_wgmma(device.arch):
        pytest.skip(f"the warpgroup MMA is sm_90's, this GPU is {device.arch}")
    plan, runs, ref = run_case(device, stream, kernels, rng, M, N, K, layout, epi, "f32", config=config, repeat=2)
    assert plan.config.name == config and plan.splits == 1
    for got in runs:
        check_case(plan, got, ref)
    for key in runs[0]:
        assert np.array_equal(runs[0][key], runs[1][key]), f"{key} differs between identical runs"


@pytest.mark.gpu
@pytest.mark.parametrize("epi", ["store", "bias", "bias_act", "store32"])
@pytest.mark.parametrize("M,N,K,splits", [(128, 1024, 3072, None), (128, 1024, 1024, None), (100, 136, 1000, 3),
                                          (256, 264, 1000, 8), (128, 64, 200, 2), (64, 1024, 768, None),
                                          (130, 520, 4104, 5), (128, 256, 256, 1)])
def test_batch_forward_splits_k_over_a_cluster_on_the_warpgroup_mma(device, stream, kernels, rng, M, N, K, splits, epi):
    """wg64k: x @ W of a batch of at most 256 rows, K split over a cluster (the planner's splits, or as asked: a
    ragged last split, partial tiles in M and N, one split) against float64, every epilogue it takes; bitwise
    repeatable. sm_90 only."""
    if not G.has_wgmma(device.arch):
        pytest.skip(f"the warpgroup MMA is sm_90's, this GPU is {device.arch}")
    plan, runs, ref = run_case(device, stream, kernels, rng, M, N, K, "rr", epi, "f32", config="wg64k",
                               splits=splits, repeat=2)
    planned = G.wgmma_splits(plan.tiles[0] * plan.tiles[1], -(-K // 64), device.sm_count, G.cluster_capacity(kernels))
    assert plan.config.name == "wg64k" and plan.splits == (splits or planned) and plan.cluster == (plan.splits > 1)
    for got in runs:
        check_case(plan, got, ref)
    for key in runs[0]:
        assert np.array_equal(runs[0][key], runs[1][key]), f"{key} differs between identical runs"


MULTICAST_ROLES = [("rr", "store", "plain"), ("rr", "bias_act", "plain"), ("rr", "store32", "plain"),
                   ("rc", "store", "plain"), ("rc", "dact", "plain"), ("rc", "store32", "plain"),
                   ("cr", "store", "plain"), ("cr", "store32", "plain"), ("cr", "update", "momentum"),
                   ("cr", "update", "adam")]


@pytest.mark.gpu
@pytest.mark.parametrize("layout,epi,opt", MULTICAST_ROLES)
@pytest.mark.parametrize("M,N,K", [(300, 136, 200), (257, 264, 784), (1024, 1024, 1024), (4096, 512, 64),
                                   (600, 264, 16), (130, 512, 1000), (4096, 1024, 1024)])
def test_multicast_pair_gives_the_single_tiles_bits(device, stream, kernels, M, N, K, layout, epi, opt):
    """wg256mc (wg256 in clusters of two CTAs along M that share B's loads) gives wg256's bits (the same products in
    the same order) for x @ W, dy @ W^T and x^T @ dy with its updates, on odd tile counts too (the pair's CTA past M
    writes nothing)."""
    if not G.has_wgmma(device.arch):
        pytest.skip(f"the warpgroup MMA is sm_90's, this GPU is {device.arch}")
    M = M if layout[0] == "r" else -(-M // 8) * 8  # column-major A: M is its contiguous dimension
    runs = {}
    for config in ("wg256", "wg256mc"):
        plan, runs[config], ref = run_case(device, stream, kernels, np.random.default_rng(M * N + K), M, N, K, layout,
                                           epi, "f32", config=config, repeat=2, opt=opt)
        for got in runs[config]:
            check_case(plan, got, ref)
    assert plan.cluster_dims == (2, 1, 1) and plan.grid[0] % 2 == 0
    for got in runs["wg256mc"]:
        for key, value in runs["wg256"][0].items():
            assert np.array_equal(got[key].view(np.uint8), value.view(np.uint8)), key


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["wg128", "wg256", "wg128x2", "wg64"])
@pytest.mark.parametrize("epi,opt", [("store", "plain"), ("store32", "plain"), ("update", "plain"),
                                     ("update", "momentum"), ("update", "nesterov"), ("update", "adam"),
                                     ("update", "adamw")])
@pytest.mark.parametrize("M,N,K,splits", [(304, 136, 200, 1), (264, 264, 784, 1), (1024, 1024, 1024, 1),
                                          (136, 520, 4104, 1), (304, 136, 200, None), (264, 264, 1000, None),
                                          (256, 256, 4096, None), (136, 520, 4104, 3), (264, 16, 1000, None)])
def test_warpgroup_mma_weight_gradients(device, stream, kernels, rng, M, N, K, splits, epi, opt, config):
    """x^T @ dy on the sm_90a tiles (A column-major: wgmma's transposed A) against float64, with every optimiser's
    update fused: partial tiles in M and N (a head's 16 columns), K below a k-tile's multiple and longer than the
    pipeline, whole and split over a cluster (the planner's splits, or 3 with a shorter last split); bitwise
    repeatable. sm_90 only."""
    if not G.has_wgmma(device.arch):
        pytest.skip(f"the warpgroup MMA is sm_90's, this GPU is {device.arch}")
    if not G.CONFIGS[config].split_k and splits not in (None, 1):
        with pytest.raises(ValueError, match="split K only as"):
            run_case(device, stream, kernels, rng, M, N, K, "cr", epi, "f32", opt=opt, config=config, splits=splits)
        return
    plan, runs, ref = run_case(device, stream, kernels, rng, M, N, K, "cr", epi, "f32", opt=opt, config=config,
                               splits=splits, repeat=2)
    assert plan.config.name == config and plan.cluster == (plan.splits > 1)
    planned = G.wgmma_splits(plan.tiles[0] * plan.tiles[1], -(-K // 64), device.sm_count, G.cluster_capacity(kernels))
    assert plan.splits == (splits or (planned if G.CONFIGS[config].split_k else 1))
    for got in runs:
        check_case(plan, got, ref)
    for key in runs[0]:
        assert np.array_equal(runs[0][key], runs[1][key]), f"{key} differs between identical runs"


@pytest.mark.gpu
@pytest.mark.parametrize("opt", ["plain", "momentum", "nesterov", "adam", "adamw"])
@pytest.mark.parametrize("M,N,K", [(304, 136, 200), (1000, 776, 200), (264, 16, 1000), (4104, 1032, 1000),
                                   (8200, 4104, 64), (4096, 4096, 1024), (2056, 520, 4104)])
def test_ping_pong_tile_weight_gradients(device, stream, kernels, M, N, K, opt):
    """The persistent ping-pong tile (x^T @ dy with every optimiser's update) against float64: fewer tiles than SMs
    (one warpgroup idle), partial tiles in M and N (a head's 16 columns), K below a k-tile's multiple, one k-tile,
    many tiles per CTA (8200 x 4104: 16 or 17 each, both rings wrapping many times), a long K; and bit for bit
    wg128's and wg128x2's results (the same sums in the same order, the same update: data parallelism's fp32 gradient
    of these shapes runs on wg128x2 or wg128), on a second run too."""
    if not G.has_wgmma(device.arch):
        pytest.skip(f"the warpgroup MMA is sm_90's, this GPU is {device.arch}")
    runs = {}
    for config in ("wgpp", "wg128", "wg128x2"):
        plan, runs[config], ref = run_case(device, stream, kernels, np.random.default_rng(M * N + K), M, N, K, "cr",
                                           "update", "f32", opt=opt, config=config, splits=1, repeat=2)
        for got in runs[config]:
            check_case(plan, got, ref)
        if config == "wgpp":
            tiles = -(-M // 128) * -(-N // 128)
            assert plan.grid == (min(tiles, device.sm_count), 1, 1) and plan.config.pingpong
    for got in runs["wgpp"] + runs["wg128x2"]:
        for key, value in runs["wg128"][0].items():
            assert np.array_equal(got[key].view(np.uint8), value.view(np.uint8)), key


@pytest.mark.gpu
@pytest.mark.parametrize("opt", ["momentum", "adam"])
@pytest.mark.parametrize("M,N", [(264, 136), (1024, 1024), (784, 16)])
def test_weight_gradient_over_the_whole_training_set(device, stream, kernels, M, N, opt):
    """x^T @ dy with its update over a batch of 60000 rows, the most a recipe allows (938 k-tiles, many rounds of the
    pipeline's stages), on the tile and splits the planner gives this GPU (warpgroup MMA on sm_90), against float64."""
    plan, (got,), ref = run_case(device, stream, kernels, np.random.default_rng(M + N), M, N, 60000, "cr", "update",
                                 "f32", opt=opt)
    assert plan.config.wgmma == G.has_wgmma(device.arch)
    check_case(plan, got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("accum", ["f32", "f16"])
@pytest.mark.parametrize("config,epi,opt", [("staged", "update", "plain"), ("staged", "update", "momentum"),
                                            ("staged", "update", "nesterov"), ("staged", "store", "plain"),
                                            ("staged32", "update", "adam"), ("staged32", "update", "adamw"),
                                            ("staged", "store32", "plain"), ("staged32", "store32", "plain")])
@pytest.mark.parametrize("M,N,K,splits", [(304, 136, 32, None), (72, 8, 7, None), (200, 264, 200, None),
                                          (104, 136, 256, 3)])
def test_staged_epilogue(device, stream, kernels, rng, M, N, K, splits, config, epi, opt, accum):
    """Weight-gradient tiles whose update goes through shared memory: partial tiles in M and N, K below and above
    one k-tile, every optimiser (no state, momentum, Adam's two moments), and split-K (the last split fetches the
    weight and state tiles after the fix-up); and the fp32 gradient data parallelism sums (store32), per pair."""
    plan, runs, ref = run_case(device, stream, kernels, rng, M, N, K, "cr", epi, accum, splits=splits, opt=opt,
                               config=config, repeat=2)
    assert plan.config.staged and plan.states == (OPTIMIZERS[opt]._state_tensors if epi == "update" else 0)
    for got in runs:
        check_case(plan, got, ref)
    for key in runs[0]:
        assert np.array_equal(runs[0][key], runs[1][key]), f"{key} differs between identical runs"


@pytest.mark.gpu
@pytest.mark.parametrize("accum", ["f32", "f16"])
@pytest.mark.parametrize("M,N,K", [(8200, 1032, 32), (304, 136, 32), (72, 8, 7), (200, 264, 200), (1000, 24, 1),
                                   (2056, 8200, 128)])
def test_persistent_store(device, stream, kernels, rng, M, N, K, accum):
    """The resident grid that walks the tiles: many tiles per block (8200x1032, 2056x8200: 8-16 each at two blocks
    per SM), fewer tiles than blocks, partial tiles in M and N, one k-tile or several per tile (the pipeline crosses
    tile boundaries), K below one k-tile; the output poisoned first, and the same bits on a second run."""
    plan, runs, ref = run_case(device, stream, kernels, rng, M, N, K, "cr", "store", accum, config="persist", repeat=2)
    tiles = plan.tiles[0] * plan.tiles[1]
    assert plan.config.persistent and plan.grid == (min(tiles, G.PERSIST_BLOCKS_PER_SM * device.sm_count), 1, 1)
    for got in runs:
        check_case(plan, got, ref)
    assert np.array_equal(runs[0]["out"], runs[1]["out"]), "results differ between identical runs"


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["staged", "outer64", "32x128", "wg128", "wg64", "wgpp"])
def test_update_at_lr_zero_keeps_every_master_bit(device, stream, kernels, rng, config):
    """The update joins the master's halves, steps and splits again (cu/master.cuh): at lr = 0 every bit must come
    back, for weights from random bit patterns across the whole fp16 range, tiny ones included. (Inputs in the form
    split gives; -0 becomes +0 under any update, as in an fp32 master.)"""
    from rawgpu.runtime.memory import Arena

    if config.startswith("wg") and not G.has_wgmma(device.arch):
        pytest.skip(f"the warpgroup MMA is sm_90's, this GPU is {device.arch}")
    M, N, K = 72, 136, 32
    w = rng.integers(0, 2**32, (M, N), dtype=np.uint64).astype(np.uint32).view(np.float32)
    w = np.where(np.isfinite(w) & (np.abs(w) < 60000), w, np.float32(0.5)).astype(np.float32)
    w[0, :8] = [0.0, -(2**-30), 2**-16, -(2**-16), 2**-14, 65504.0, -65504.0, 1 + 2**-23]
    w[w == 0] = 0.0
    hi, lo = master.split(master.join(*master.split(w)))
    plan = G.plan_gemm(M, N, K, "cr", "sgd", "f32", sm_count=device.sm_count, config=config, arch=device.arch)
    with Arena() as arena:
        tA, tB = arena.tensor("A", (K, M), np.float16), arena.tensor("B", (K, N), np.float16)
        t_lo, t_hi = arena.tensor("lo", (M, N), np.int16), arena.tensor("hi", (M, N), np.float16)
        table = arena.tensor("optim", (OPTIM_WORDS,), np.float32)
        arena.allocate()
        tA.upload(_f16(rng, (K, M)))
        tB.upload(_f16(rng, (K, N)))
        t_lo.upload(lo)
        t_hi.upload(hi)
        table.upload(optimizer.words(optimizer.step_values(optimizer.hyperparameters(Recipe(momentum=0.0)), 0, 0.0)))
        G.gemm(kernels, plan, tA, tB, t_lo, w16=t_hi, optim=table).run(stream)
        got_hi, got_lo = t_hi.download(), t_lo.download()
    assert np.array_equal(got_hi.view(np.uint16), hi.view(np.uint16)), f"{plan.kernel}: W16 changed at lr 0"
    assert np.array_equal(got_lo, lo), f"{plan.kernel}: lo changed at lr 0"


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["tma", "tma128"])
@pytest.mark.parametrize("accum", ["f32", "f16"])
@pytest.mark.parametrize("layout,epi", [("rr", "store"), ("rr", "bias_act"), ("rc", "store"), ("rc", "dact"),
                                        ("rr", "store32"), ("rc", "store32")])
@pytest.mark.parametrize("M,N,K,splits", [(1, 72, 200, None), (17, 136, 1000, None), (32, 520, 4104, 3),
                                          (32, 64, 64, None), (9, 8, 1032, 2), (32, 1000, 1160, None)])
def test_tma_config(device, stream, kernels, rng, M, N, K, splits, layout, epi, accum, config):
    """The tensor-copy tile (sm_90): partial tiles in M, N and K (the copy engine zero-fills), K shorter than the
    pipeline, more k-tiles than stages (stages reused), split-K bitwise equal across runs."""
    if not G.sm90_or_later(device.arch):
        pytest.skip(f"the tensor copy engine needs sm_90 or later; this GPU is {device.arch}")
    plan, runs, ref = run_case(device, stream, kernels, rng, M, N, K, layout, epi, accum, splits=splits,
                               config=config, repeat=2)
    assert plan.config.tma and plan.splits == (splits or plan.splits)
    for got in runs:
        check_case(plan, got, ref)
    assert np.array_equal(runs[0]["out"], runs[1]["out"]), "results differ between identical runs"


ROW_TILE_CASES = [(128, 256, 784, None), (100, 136, 1000, 3), (256, 520, 4104, 4), (33, 64, 64, None),
                  (128, 1000, 1160, 2), (200, 72, 200, None)]


@pytest.mark.gpu
@pytest.mark.parametrize("accum", ["f32", "f16"])
@pytest.mark.parametrize("epi", ["store", "bias_act", "store32"])
@pytest.mark.parametrize("M,N,K,splits", ROW_TILE_CASES)
def test_tma_row_tiles(device, stream, kernels, rng, M, N, K, splits, epi, accum):
    """The tensor-copy tile of 128 rows (sm_90), whose warps split the rows: partial tiles in M, N and K, two row
    tiles (256 rows), K shorter than the pipeline, more k-tiles than stages, split-K through the workspace (the
    cluster's is below), bitwise equal across runs."""
    if not G.sm90_or_later(device.arch):
        pytest.skip(f"the tensor copy engine needs sm_90 or later; this GPU is {device.arch}")
    plan, runs, ref = run_case(device, stream, kernels, rng, M, N, K, "rr", epi, accum, splits=splits,
                               config=G.ROW_TILE, cluster=False, repeat=2)
    assert plan.config.name == G.ROW_TILE and plan.splits == (splits or plan.splits) and not plan.cluster
    for got in runs:
        check_case(plan, got, ref)
    assert np.array_equal(runs[0]["out"], runs[1]["out"]), "results differ between identical runs"


CLUSTER_CASES = [(32, 128, 784, "rr", "bias_act", "stream", 5), (32, 520, 4104, "rc", "dact", "stream", 8),
                 (17, 136, 1000, "rr", "store", "tma", 3), (32, 1000, 1160, "rc", "dact", "tma128", 2),
                 (40, 264, 1000, "rr", "bias", "32x128", 4), (72, 136, 600, "cr", "update", "64x128", 3),
                 (296, 136, 520, "cc", "store", "128x128", 6), (9, 8, 1032, "rr", "store", "stream", 6),
                 (128, 264, 4096, "rr", "bias_act", "tma128x64", 4), (100, 136, 1000, "rr", "store", "tma128x64", 8),
                 (17, 136, 1000, "rr", "store32", "tma", 3), (32, 520, 4104, "rc", "store32", "stream", 8),
                 (32, 1000, 1160, "rc", "store32", "tma128", 2), (40, 264, 1000, "rr", "store32", "32x128", 4),
                 (296, 136, 520, "rc", "store32", "128x128", 6), (100, 136, 1000, "rr", "store32", "tma128x64", 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("accum", ["f32", "f16"])
@pytest.mark.parametrize("M,N,K,layout,epi,config,splits", CLUSTER_CASES,
                         ids=[f"{c[5]}-{c[3]}-{c[4]}-{c[0]}x{c[1]}x{c[2]}-s{c[6]}" for c in CLUSTER_CASES])
def test_cluster_split_k_gives_the_workspace_bits(device, stream, kernels, rng, M, N, K, layout, epi, config, splits,
                                                  accum):
    """sm_90: splits that meet in a cluster's shared memory add the same partials in the same order as the workspace
    fix-up, so every output bit is the same; each is also checked against float64 and across runs. Partial tiles in M
    and N, a ragged last split, Adam (on the update case)."""
    if not G.sm90_or_later(device.arch):
        pytest.skip(f"thread-block clusters need sm_90 or later; this GPU is {device.arch}")
    seed, opt = int(rng.integers(2**31)), "adam" if epi == "update" else "plain"
    runs = {}
    for cluster in (False, True):
        plan, got, ref = run_case(device, stream, kernels, np.random.default_rng(seed), M, N, K, layout, epi, accum,
                                  splits=splits, opt=opt, config=config, cluster=cluster, repeat=2)
        assert plan.cluster == cluster and plan.splits == splits and plan.config.name == config
        assert plan.cluster_dims == ((1, 1, splits) if cluster else (1, 1, 1))
        for g in got:
            check_case(plan, g, ref)
        for key in got[0]:
            assert np.array_equal(got[0][key], got[1][key]), f"{key} differs between identical runs"
        runs[cluster] = got[0]
    for key in ("out", "w16", "mom", "var"):
        if key in runs[True]:
            assert np.array_equal(runs[True][key], runs[False][key]), f"cluster split-K changed {key}"


FINISH_CASES = [(32, 1024, 4096, "rr"), (128, 1024, 1024, "rr"), (128, 4096, 4096, "rr"), (256, 4096, 784, "rr"),
                (100, 264, 1000, "rr"), (1, 256, 784, "rr"), (32, 4096, 1024, "rc"), (128, 1024, 1024, "rc"),
                (33, 136, 200, "rc"), (32, 520, 4104, "rc")]


@pytest.mark.gpu
@pytest.mark.parametrize("accum", ["f32", "f16"])
@pytest.mark.parametrize("M,N,K,layout", FINISH_CASES)
def test_store32_then_finish_sum_gives_the_fused_epilogues_bits(device, stream, kernels, rng, M, N, K, layout, accum):
    """One GPU's partial sum is the whole sum: store32 then finish_sum (bias_act after x @ W, dact after dy @ W^T)
    gives every bit of the GEMM with that epilogue, on the same plan (tile, splits, cluster: split-K cases included);
    the sum and the result also against float64, every output poisoned first."""
    from rawgpu.kernels import elementwise as ke
    from rawgpu.runtime.memory import Arena

    epi = "bias_act" if layout == "rr" else "dact"
    fused = G.plan_gemm(M, N, K, layout, epi, accum, sm_count=device.sm_count, arch=device.arch,
                        capacity=G.cluster_capacity(kernels))
    plan = G.plan_gemm(M, N, K, layout, "store32", accum, sm_count=device.sm_count, splits=fused.splits,
                       config=fused.config.name, arch=device.arch, cluster=fused.cluster)
    assert replace(plan, epilogue=epi) == fused
    a, b = _f16(rng, (M, K)), _f16(rng, (K, N) if layout == "rr" else (N, K))
    bias = rng.uniform(-2, 2, N).astype(np.float32)
    act = np.maximum(_f16(rng, (M, N)), 0).astype(np.float16)  # a ReLU output: about half zero
    with Arena() as arena:
        tA, tB = arena.tensor("A", a.shape, np.float16), arena.tensor("B", b.shape, np.float16)
        t_fused, t_fin = arena.tensor("fused", (M, N), np.float16), arena.tensor("finished", (M, N), np.float16)
        t_sum = arena.tensor("sum", (M, N), np.float32)
        extra = {"bias": arena.tensor("bias", (N,), np.float32)} if epi == "bias_act" else \
            {"act": arena.tensor("act", (M, N), np.float16)}
        scratch = {}
        if plan.splits > 1 and not plan.cluster:
            scratch = {"workspace": arena.tensor("ws", (plan.workspace_floats,), np.float32),
                       "tickets": arena.tensor("tickets", (plan.tickets,), np.int32)}
        arena.allocate()
        tA.upload(a)
        tB.upload(b)
        extra["bias" if epi == "bias_act" else "act"].upload(bias if epi == "bias_act" else act)
        if scratch:
            scratch["tickets"].upload(np.zeros(plan.tickets, np.int32))
        for t in (t_fused, t_fin, t_sum):
            t.fill_bytes(0xFF)
        G.gemm(kernels, fused, tA, tB, t_fused, **extra, **scratch).run(stream)
        G.gemm(kernels, plan, tA, tB, t_sum, **scratch).run(stream)
        ke.finish_sum(kernels, t_sum, t_fin, M, epi, **extra).run(stream)
        want, got, total = t_fused.download(), t_fin.download(), t_sum.download()
    acc = a.astype(np.float64) @ (b if layout == "rr" else b.T).astype(np.float64)
    ref = np.maximum(acc + bias, 0) if epi == "bias_act" else acc * (act > 0)
    assert _rel(total, acc) <= _bound(accum, K, "store32")
    assert _rel(got, ref) <= _bound(accum, K)
    diff = np.argwhere(got.view(np.uint16) != want.view(np.uint16))
    assert not len(diff), (f"{plan.kernel} + finish_sum differs from {fused.kernel} at {len(diff)} outputs, e.g. "
                           + "; ".join(f"({r},{c}) {got[r, c]!r} vs {want[r, c]!r}" for r, c in diff[:4]))
