"""The experiment builds of dev/ (dev/variants.py): the product's kernels carry no experiment-only code, and the
variants dev/ makes of them still apply and compile (an experiment that rots cannot be rerun to check its numbers)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

from rawgpu import contract
from rawgpu.kernels import dx_update
from rawgpu.runtime import compiler

ROOT = Path(__file__).resolve().parent.parent
import variants  # dev/ is on the tests' path (pyproject.toml)

PROFILED = ("head.cu", "dx_update.cu", "cluster_step.cu", "fused_step.cu")


def load_dev(name: str, path: str):
    """A dev/ script as a module, under `name`, from its path below the checkout (not a package: loaded by file)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_product_kernels_carry_no_experiment_switches():
    """No profiling or ablation define, no timestamp buffer: the marks are comments, the variants are dev/'s."""
    texts = compiler.source_texts()
    for name, text in texts.items():
        body = text.decode()
        assert not re.search(r"\b\w+_(PROFILE|ABLATE)\b|globaltimer|clock64\(", body), name
    assert "ptx/profile.cuh" not in texts
    for struct in (contract.CsParams, contract.FsParams):
        assert "profile" not in [f[0] for f in struct._fields_]


def test_marks_parse_into_stamps_in_the_order_they_run():
    text = "\n".join(["#include \"common.cuh\"", "void f() {", "    // mark 0: entry", "    for (;;) {",
                      "        // mark 3 if c == 0: chunk 0 landed", "    }", "    if (x) {", "        // mark 9: early",
                      "    }", "    // mark 5: middle", "    // mark 9: the end", "}"])
    assert variants.marks(text) == {0: "entry", 3: "chunk 0 landed", 5: "middle", 9: "the end"}
    out = variants.instrument(text)
    assert "    RG_MARK(0);" in out and "        if (c == 0) RG_MARK(3);" in out and out.count("RG_MARK(9);") == 2
    assert out.index("#include") < out.index("__device__ unsigned long long rg_marks") < out.index("void f()")
    seq = variants.instrument("#include \"a.cuh\"\nvoid g() {\n    // mark next: start\n    // mark next\n}\n")
    assert "int rg_mark = 0; RG_MARK(rg_mark++);" in seq and seq.count("RG_MARK(rg_mark++);") == 2
    with pytest.raises(variants.VariantError, match="no '// mark' comments"):
        variants.instrument("#include \"a.cuh\"\n", "x.cu")


def test_patches_must_find_their_text_exactly_once():
    assert variants.patch("a b c", [("b", "B"), ("c", "C")]) == "a B C"
    for text in ("a c", "b b"):
        with pytest.raises(variants.VariantError, match="dx_update.cu: 'b' occurs [02] times \\(expected once\\)"):
            variants.patch(text, [("b", "B")], "dx_update.cu")


def test_the_profilers_marks_are_where_they_expect_them():
    """kernel_phases.py labels head.cu's and dx_update.cu's numbered marks by their comments; cluster_phases.py and
    fused_phases.py count `// mark next` per step."""
    import cluster_phases

    for source in ("head.cu", "dx_update.cu"):
        names = variants.marks(variants.source_text(source))
        assert list(names)[0] == 0 and list(names)[-1] == 15 and len(names) >= 10, source
    cluster = variants.source_text("cluster_step.cu")
    # the start, then per step: 2 per hidden layer (a loop), head loss and dy, 4 per backward layer (a loop), update 0
    assert cluster.count("// mark next") == 1 + 2 + 2 + 4 + 1
    for layers in (1, 2, 3, 5):
        assert len(cluster_phases.marks(layers)) == 2 * layers + 2 + 4 * (layers - 1) + 1
    assert variants.source_text("fused_step.cu").count("// mark next") == 1 + 1 + 2 + 1


@pytest.mark.parametrize("source", PROFILED)
def test_profiled_variants_build_for_sm_90(source):
    kernel = (contract.split_kernels(source, "sm_90") or [None])[0]
    text = variants.instrument(variants.source_text(source), source)
    if source == "fused_step.cu":
        import fused_phases
        text += fused_phases.GRID_BARRIERS
    built = variants.build(source, text, "sm_90", ("-DRG_MARKS=64",), kernel=kernel)
    assert built.cubin[:4] == b"\x7fELF"
    assert all(r.spill_stores == 0 for r in built.resources.values()), built.resources
    if source == "fused_step.cu":
        assert "grid_barriers" in built.resources


@pytest.mark.parametrize("mask", [1, 2, 4, 8, 16, 32, 63])
def test_backward_limits_experiment_builds_for_sm_90(mask):
    """dev/backward/limits.py: dx_update.cu with each part taken out still compiles, without spills; the stream
    reference too."""
    from backward import limits

    kernel = contract.dxu_kernel_name(128, "sgd")
    built = variants.build(limits.U.SOURCE, limits.ablated(mask), "sm_90", kernel=kernel)
    assert list(built.resources) == [kernel] and built.resources[kernel].spill_stores == 0
    if mask == 63:
        stream = compiler.compile_file(ROOT / "dev" / "backward" / "stream.cu", "sm_90")
        assert len(stream.resources) == 6 and all(r.spill_stores == 0 for r in stream.resources.values())


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90"])
@pytest.mark.parametrize("source, kernel", [("transpose_upload/columns_to_rows.cu", "columns_to_rows")])
def test_standalone_experiments_build(arch, source, kernel):
    """dev/transpose_upload (a table's columns into fp16 rows on the GPU) compiles without spills or local
    memory."""
    built = compiler.compile_file(ROOT / "dev" / source, arch)
    assert list(built.resources) == [kernel]
    assert built.resources[kernel].spill_stores == 0 and built.resources[kernel].stack_frame == 0


def test_logits_xent_experiments_reference_is_softmax_cross_entropy():
    """dev/logits_xent/run.py's float64 check: the loss of uniform logits is log(classes), the hits the first
    maxima, and the gradient (softmax - onehot) x inv with zero padding columns."""
    run = load_dev("logits_run", "dev/logits_xent/run.py")
    z = np.zeros((4, 16), np.float16)
    z[3, 1] = 2.0
    loss, hits, d = run.softmax_reference(z, np.array([0, 1, 2, 1]), 3, 0.5)
    p3 = np.exp(2.0) / (np.exp(2.0) + 2)
    assert np.isclose(loss, 3 * np.log(3) + np.log(np.exp(2.0) + 2) - 2.0)
    assert hits == 2  # rows 0 (all equal: the first, 0) and 3 (class 1)
    assert np.allclose(d[0, :3], 0.5 * (np.array([1, 1, 1]) / 3 - [1, 0, 0])) and not d[:, 3:].any()
    assert np.isclose(d[3, 1], 0.5 * (p3 - 1))


def test_transpose_upload_stages_every_chunk_of_rows_across_arrow_chunks(rng):
    """dev/transpose_upload/run.py's upload: each chunk of rows holds every column's own rows in order, whichever
    Arrow chunks they come from (the staging area here a host array, the kernel a copy of what it would read)."""
    run = load_dev("transpose_run", "dev/transpose_upload/run.py")
    rows, features, chunk = 50, 3, 16
    whole = [rng.standard_normal(rows).astype(np.float32) for _ in range(features)]
    cuts = [[0, 5, 6, 30, 50], [0, 50], [0, 16, 32, 33, 50]]
    views = [[w[a:b] for a, b in zip(c, c[1:])] for w, c in zip(whole, cuts)]
    staging = np.full(features * chunk, np.nan, np.float32)
    base = 1 << 20  # a pretend device address of the staging area
    seen = []

    def copy(address, piece):
        at = (address - base) // 4
        staging[at:at + len(piece)] = piece

    def launch(row0, n):
        seen.append((row0, staging.reshape(features, chunk)[:, :n].copy()))
    run.upload_columns(views, rows, base, chunk, launch, copy=copy)
    assert [r for r, _ in seen] == [0, 16, 32, 48]
    got = np.concatenate([block for _, block in seen], axis=1)
    assert np.array_equal(got, np.stack(whole))


def assert_usage_error(main, args, message, capsys):
    """An experiment's `main(args)` stops with argparse's exit 2 and `message` on its last stderr line, no
    traceback (checked before any GPU work)."""
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "\n".join(err)


def test_pingpong_experiment_builds_and_refuses_bad_shapes_in_one_line(capsys):
    """dev/pingpong (x^T @ dy with its update on a persistent ping-pong grid, appended to gemm_wgmma.cu) builds for
    sm_90a with every kernel its runner times; a shape the copy engine cannot take is one line, exit 2, before any
    GPU work."""
    run = load_dev("pingpong_run", "dev/pingpong/run.py")
    built = run.compile_experiment()
    assert set(run.KERNELS) <= set(built.resources)
    for args, message in ((["--shapes", "100x776x200"], "M and N must be multiples of 8"),
                          (["--check-shapes", "12x8"], "expected MxNxK, got '12x8'")):
        assert_usage_error(run.main, args, message, capsys)


def test_pingpong_layers_experiment_builds_and_refuses_bad_arguments_in_one_line(capsys):
    """dev/pingpong/layers.py (x @ W and dy @ W^T with their epilogues on the ping-pong grid, appended to
    gemm_wgmma.cu) builds for sm_90a every kernel its runner times, without spills, each with the kernel parameters
    the runner binds and a ring that fits a block's shared memory; bad shapes and periods are one line, exit 2, before
    any GPU work."""
    from rawgpu.contract.arch import STATIC_RESERVE, block_smem_limit

    layers = load_dev("pingpong_layers", "dev/pingpong/layers.py")
    built = layers.compile_experiment()
    for name, (_, epi, stages, ebufs) in layers.KERNELS.items():
        assert built.resources[name].spill_stores == 0 and built.signatures[name] == "ttttiiipi"
        assert stages * 32768 + ebufs * layers.EBUF[epi] + 1024 <= block_smem_limit("sm_90") - STATIC_RESERVE
    for args, message in ((["--shapes", "128x100x200"], "N and K must be multiples of 8"),
                          (["--check-shapes", "64x64x12"], "N and K must be multiples of 8"),
                          (["--sustained", "-1"], "must be >= 0, got -1"),
                          (["--kernels", "pp_cr_sgd"], "invalid choice")):
        assert_usage_error(layers.main, args, message, capsys)


def test_wgmma_timeline_builds_and_refuses_bad_arguments_in_one_line(capsys):
    """dev/wgmma/timeline.py: gemm_wgmma.cu with every CTA's stamps still compiles for sm_90, without spills, for the
    tiles x^T @ dy with an update runs on (SGD and Adam); a shape the copy engine cannot take, or the ping-pong tile
    (its own timeline), is one line, exit 2, before any GPU work."""
    timeline = load_dev("wgmma_timeline", "dev/wgmma/timeline.py")
    text = timeline.stamped_text()
    for kernel in ("gemm_wg256mc_cr_sgd_f32", "gemm_wg256mc_cr_adam_f32", "gemm_wg128x2_cr_sgd_f32"):
        built = variants.build(contract.GEMM_WGMMA_SOURCE, text, "sm_90", kernel=kernel)
        assert list(built.resources) == [kernel] and built.resources[kernel].spill_stores == 0
    for args, message in ((["--shapes", "100x776x200"], "M and N must be multiples of 8"),
                          (["--config", "wgpp"], "invalid choice: 'wgpp'")):
        assert_usage_error(timeline.main, args, message, capsys)


@pytest.mark.parametrize("mask", [1, 2, 4, 8, 16, 17, 14, 31, 32, 64, 128, 256, 512, 1024, 1792, 4096,
                                  8192, 8192 | 32, 8192 | 4096, 16384, 16384 | 4096, 32768 | 4096, 65536,
                                  65536 | 4096, 131072 | 262144 | 4096, 524288, 1048576 | 4096,
                                  524288 | 65536])
def test_pingpong_limits_experiment_builds_and_refuses_bad_masks_in_one_line(mask, capsys):
    """dev/pingpong/limits.py: the product's ping-pong tile with each part taken out, or with fewer compiler barriers
    or other L2 hints, or stamped, still compiles for sm_90 (SGD and Adam), without spills (but where its docstring
    says); masks that cannot combine are one line, exit 2, before any GPU work."""
    limits = load_dev("pingpong_limits", "dev/pingpong/limits.py")
    text = variants.masked(contract.GEMM_WGMMA_SOURCE, limits.EDITS, mask)
    for kernel in ("gemm_wgpp_cr_sgd_f32", "gemm_wgpp_cr_adam_f32"):
        built = variants.build(contract.GEMM_WGMMA_SOURCE, text, "sm_90", kernel=kernel)
        spilled = {16: 4, 4096: 16}.get(mask, 0) if "adam" in kernel else 0  # NVRTC 13.5: the variants that spill
        if mask & 8192:  # the cp.async loader within the loading warp's 24 registers: a few words a chunk
            spilled = 16
        assert list(built.resources) == [kernel] and built.resources[kernel].spill_stores <= spilled
    if mask == 31:
        for args, message in ((["--masks", "96"], "at most one of"), (["--masks", "2048"], "is not a sum"),
                              (["--masks", "264"], "hints what it takes out"), (["--shapes", "12x8x4"], "multiples"),
                              (["--masks", "2097152"], "is not a sum"),
                              (["--masks", "524296"], "prefetches twice"),
                              (["--masks", "131076"], "moves update traffic"),
                              (["--masks", "65568"], "changes the pairs' update twice"),
                              (["--masks", "32769"], "takes out half of the multiply"),
                              (["--masks", "16400"], "takes out part of the k-tiles"),
                              (["--masks", "8200"], "changes the update's loads"),
                              (["--buffers", "5", "2", "--optimizer", "adam"], "pass --optimizer sgd"),
                              (["--buffers", "6", "2"], "more than a block of sm_90 has"),
                              (["--buffers", "0", "2"], "--buffers")):
            assert_usage_error(limits.main, args, message, capsys)


@pytest.mark.parametrize("mask", [1, 2, 4, 8, 16, 31, 32, 41, 64, 128, 223, 256, 457])
def test_stream_limits_experiment_builds_and_refuses_bad_arguments_in_one_line(mask, capsys):
    """dev/sweep/stream_limits.py: the models step's streamed update with each part taken out, or written back by
    the bulk copy engine, still compiles for sm_90, without spills; unpaired --models and --hidden are one line,
    exit 2, before any GPU work."""
    limits = load_dev("stream_limits", "dev/sweep/stream_limits.py")
    kernel = contract.dxu_stream_kernel_name(128, "sgd")
    built = variants.build(contract.DX_UPDATE_MODELS_SOURCE, limits.ablated(mask), "sm_90", kernel=kernel)
    assert list(built.resources) == [kernel] and built.resources[kernel].spill_stores == 0
    if mask == 31:
        for args, message in ((["--models", "32", "--hidden", "256", "128"], "--models and --hidden pair up"),
                              (["--masks", "512"], "--masks are bit sets"), (["--masks", "36"], "combine with"),
                              (["--masks", "288"], "combine with")):
            assert_usage_error(limits.main, args, message, capsys)


def test_power_draw_refuses_a_missing_command_or_bad_periods_in_one_line(capsys):
    """dev/power_draw.py: no command after --, a period that is not positive: one line, exit 2, before NVML."""
    power_draw = load_dev("power_draw", "dev/power_draw.py")
    for args, message in (([], "give the command to run"), (["--"], "give the command to run"),
                          (["--interval-ms", "0", "--", "true"], "must be positive"),
                          (["--every", "-1", "--", "true"], "must be positive")):
        assert_usage_error(power_draw.main, args, message, capsys)


def _tensor_ops(built, kernel: str) -> int:
    if variants.nvdisasm() is None:
        pytest.skip("nvdisasm is not installed (pip install nvidia-cuda-nvdisasm, in the test extra)")
    return variants.tensor_ops(built.cubin)[kernel]


# experiment -> (source, kernel, the variant's text of a mask, the bits that take out a multiply, masks to check)
ABLATIONS = {
    "pingpong/limits.py": (contract.GEMM_WGMMA_SOURCE, "gemm_wgpp_cr_sgd_f32", "EDITS", 1 | 32768,
                           [2, 4, 8, 12, 14, 16, 65536, 131072 | 262144, 2 | 32768]),
    "backward/limits.py": (dx_update.SOURCE, contract.dxu_kernel_name(128, "sgd"), "ablated", 1 | 2,
                           [4, 8, 16, 5, 6]),
    "sweep/stream_limits.py": (contract.DX_UPDATE_MODELS_SOURCE, contract.dxu_stream_kernel_name(128, "sgd"),
                               "ablated", 1, [2, 4, 8, 64, 128]),
}


@pytest.mark.parametrize("experiment, mask", [(e, m) for e, spec in ABLATIONS.items() for m in spec[4]])
def test_an_ablation_keeps_every_multiply_it_does_not_take_out(experiment, mask):
    """A part taken out that leaves an accumulator unread lets the compiler drop the multiply behind it, and the
    experiment then times something else (dev/pingpong/limits.py's "multiply alone" once timed the k-tiles' loads
    alone): every mask keeps the tensor-core instructions of the mask's multiply cuts alone, in the machine code."""
    source, kernel, how, cuts, _ = ABLATIONS[experiment]
    module = load_dev(experiment.replace("/", "_")[:-3], f"dev/{experiment}")

    def count(m: int) -> int:
        text = variants.masked(source, module.EDITS, m) if how == "EDITS" else getattr(module, how)(m)
        return _tensor_ops(variants.build(source, text, "sm_90", kernel=kernel), kernel)

    assert count(mask) == count(mask & cuts) > 0


def test_the_ping_pong_layers_cuts_keep_the_multiply():
    """dev/pingpong/layers.py: every kernel, the cuts too (the multiply alone, no chunk writes), multiplies."""
    layers = load_dev("pingpong_layers_ops", "dev/pingpong/layers.py")
    built = layers.compile_experiment()
    counts = {name: _tensor_ops(built, name) for name in layers.KERNELS}
    assert len(set(counts.values())) == 1 and counts["pp_rr_store"] > 0, counts


def test_wgmma_prefetch_experiment_builds_and_refuses_bad_shapes_in_one_line(capsys):
    """dev/wgmma/prefetch.py: gemm_wgmma.cu with the update operands' L2 prefetch still compiles for sm_90, without
    spills, for the one-CTA-a-tile updates (SGD and Adam), every multiply in place; a shape the copy engine cannot
    take is one line, exit 2, before any GPU work."""
    prefetch = load_dev("wgmma_prefetch", "dev/wgmma/prefetch.py")
    assert prefetch.variant_text(0) is None
    text = prefetch.variant_text(16)
    for kernel in ("gemm_wg256mc_cr_sgd_f32", "gemm_wg256mc_cr_adam_f32"):
        built = variants.build(contract.GEMM_WGMMA_SOURCE, text, "sm_90", kernel=kernel)
        assert list(built.resources) == [kernel] and built.resources[kernel].spill_stores == 0
        product = variants.build(contract.GEMM_WGMMA_SOURCE, variants.source_text(contract.GEMM_WGMMA_SOURCE),
                                 "sm_90", kernel=kernel)
        assert _tensor_ops(built, kernel) == _tensor_ops(product, kernel) > 0
    for args, message in ((["--shapes", "100x776x200"], "M and N must be multiples of 8"),
                          (["--sustained", "-1"], "must be >= 0, got -1"), (["--ahead", "x"], "--ahead")):
        assert_usage_error(prefetch.main, args, message, capsys)


def test_the_variant_checks_compare_every_byte_of_the_update():
    """dev/pingpong/run.py's same_update (limits.py's and wgmma/prefetch.py's checks): a variant agrees only where
    every byte of every array matches and the update changed the master's low half at all."""
    run = load_dev("pingpong_run_same", "dev/pingpong/run.py")
    before = [np.zeros(4, np.float16), np.zeros(4, np.int16), np.zeros(4, np.float32)]
    after = [np.ones(4, np.float16), np.array([0, 1, 2, 0], np.int16), np.full(4, 0.5, np.float32)]
    assert run.same_update([after, [a.copy() for a in after]], before) == ([0, 0, 0], 2, True)
    other = [a.copy() for a in after]
    other[2][3] = np.float32(0.25)
    assert run.same_update([after, other], before) == ([0, 0, 2], 2, False)  # 0.5 and 0.25 differ in 2 bytes
    assert run.same_update([before, before], before)[2] is False  # no update at all is no check
