"""NVRTC compiler: every kernel source builds for sm_80/86/90 with no spills; the cache hits, misses, heals.

Every source is built whole once per test session for each arch, on as many threads as there are CPUs, into the
session's kernel cache (conftest.py's `whole_builds`, started as the session begins); the tests of PTX read what those
builds kept."""

from __future__ import annotations

import os
import types
import re

import pytest

from rawgpu.runtime import compiler
from rawgpu import contract
from rawgpu.runtime.errors import CompileError

from whole_builds import ARCHS  # what the session builds whole


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAWGPU_CACHE", str(tmp_path))
    return tmp_path / "kernels"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", compiler.all_sources())
def test_every_kernel_compiles_without_spills(source, arch, whole_builds):
    mod = whole_builds[(source, arch)]
    assert mod.cubin[:4] == b"\x7fELF", "NVRTC must give a cubin (ELF), never PTX"
    assert mod.resources, f"no kernels reported in {source}"
    for r in mod.resources.values():
        assert r.spill_stores == 0 and r.spill_loads == 0, f"{r.name} spills on {arch}: {r}"
        assert r.stack_frame == 0, f"{r.name} uses local memory on {arch}: {r}"
        assert 0 < r.registers <= 255


# Every kernel the layered step launches (steps/layered.py: LayeredStep._one_step), which on sm_90 it launches
# overlapping the one before: each must wait for the prior grid, and only then let its own dependent start
# (ptx/pdl.cuh).
OVERLAPPED = {"gather.cu": ["gather_batch", "step_increment"],
              "elementwise.cu": ["bias_update", "finish_sum_bias", "finish_sum_bias_act", "finish_sum_dact",
                                 "apply_update_sgd", "apply_update_adam"],
              "loss.cu": ["softmax_xent", "logits_xent"], "dx_sgd.cu": ["dx_sgd"], "dx_update.cu": None,
              "head.cu": None,
              "gemm.cu": None, "gemm_tma.cu": None,  # None: all
              # the fp16-accumulating twins trap: the planner never launches them
              "gemm_wgmma.cu": [n for n in contract.all_kernel_names(contract.GEMM_WGMMA_SOURCE) if n.endswith("_f32")]}


@pytest.mark.parametrize("source", sorted(OVERLAPPED))
def test_every_overlapped_kernel_waits_for_the_prior_grid_first(source, whole_builds):
    entries = compiler.ptx_of(source, "sm_90")
    names = OVERLAPPED[source] or list(entries)
    assert names and set(names) <= set(entries)
    for name in names:
        body = entries[name]
        wait, trigger = body.find("griddepcontrol.wait"), body.find("griddepcontrol.launch_dependents")
        assert 0 < wait < trigger, f"{name}: griddepcontrol.wait must come before launch_dependents ({wait}, {trigger})"
    assert "griddepcontrol" not in "".join(compiler.ptx_of(source, "sm_86").values()), "sm_86 has no such instruction"


@pytest.mark.parametrize("arch", ARCHS)
def test_store32_never_rounds_to_fp16(arch, whole_builds):
    """store32 leaves the sum in fp32 on every path (the pair epilogue, split-K through the workspace or a cluster):
    its kernels hold no fp32 -> fp16 conversion, where their fp16 twins (store; staged32 has none) do, and they
    write fp32 pairs."""
    to_fp16 = re.compile(r"cvt\.rn\.f16(x2)?\.f32")
    sources = [contract.GEMM_SOURCE] + ([contract.GEMM_TMA_SOURCE] if arch == "sm_90" else [])  # tma: a trap below
    for source in sources:
        entries = compiler.ptx_of(source, arch)
        names = [n for n in entries if "_store32_" in n]
        assert names, source
        for name in names:
            assert not to_fp16.search(entries[name]) and "st.global.v2.f32" in entries[name], f"{name} on {arch}"
            twin = name.replace("_store32_", "_store_")
            assert twin in entries or "staged32" in name, name
            assert twin not in entries or to_fp16.search(entries[twin]), name


def test_ptxas_report_is_parsed():
    log = """ptxas info    : 4 bytes gmem
ptxas info    : Compiling entry function 'gemm_a' for 'sm_86'
ptxas info    : Function properties for gemm_a
ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 1024 bytes smem, 360 bytes cmem[0]
ptxas info    : Compiling entry function 'b' for 'sm_86'
ptxas info    : Function properties for b
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 0 barriers, 360 bytes cmem[0]
ptxas info    : Compiling entry function 'c' for 'sm_90'
ptxas info    : Function properties for c
ptxas         .     40 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 40 bytes cumulative stack size, 896 bytes smem
"""
    r = compiler.parse_ptxas_report(log)
    assert r["gemm_a"] == compiler.KernelResources("gemm_a", 168, 8, 4, 1024, 16, 1)
    assert r["b"] == compiler.KernelResources("b", 10, 0, 0, 0, 0, 0)
    assert r["c"] == compiler.KernelResources("c", 168, 0, 0, 896, 40, 1)  # NVRTC 13's form, with the stack size


def test_cache_miss_then_hit(cache):
    first = compiler.compile_source("elementwise.cu", "sm_86")
    assert not first.cached
    entries = list(cache.glob("*.cubin"))
    assert len(entries) == 1
    second = compiler.compile_source("elementwise.cu", "sm_86")
    assert second.cached and second.cubin == first.cubin and second.resources == first.resources
    assert not list(cache.glob(".tmp-*")), "atomic write left a temporary file"


def test_cache_key_changes_with_source_options_and_arch():
    texts = compiler.source_texts()
    base = compiler.cache_key("elementwise.cu", "sm_86", (), texts)
    edited = dict(texts)
    edited["ptx/common.cuh"] = texts["ptx/common.cuh"] + b"\n// edit\n"
    assert compiler.cache_key("elementwise.cu", "sm_86", (), edited) != base
    assert compiler.cache_key("elementwise.cu", "sm_90", (), texts) != base
    assert compiler.cache_key("elementwise.cu", "sm_86", ("-DX=1",), texts) != base
    assert compiler.cache_key("elementwise.cu", "sm_86", (), texts) == base


def test_generated_headers_and_defines_are_part_of_the_cache_key(monkeypatch):
    texts = compiler.source_texts()
    defines, headers = contract.build("gemm.cu", "sm_86")
    base = compiler.cache_key("gemm.cu", "sm_86", (), texts, (defines, headers))
    assert compiler.cache_key("gemm.cu", "sm_86", (), texts) == base, "by default the key asks the contract"
    changed = tuple(d.replace("STREAM_STAGES=7", "STREAM_STAGES=6") for d in defines)
    assert changed != defines and compiler.cache_key("gemm.cu", "sm_86", (), texts, (changed, headers)) != base
    edited = {name: text + "// edit\n" for name, text in headers.items()}
    assert compiler.cache_key("gemm.cu", "sm_86", (), texts, (defines, edited)) != base
    monkeypatch.setattr(contract.gemm, "PERSIST_BLOCKS_PER_SM", 3)  # a contract value changed: the key follows
    assert compiler.cache_key("gemm.cu", "sm_86", (), texts) != base


def test_a_changed_contract_is_not_served_from_the_cache(cache, monkeypatch):
    compiler.compile_source("elementwise.cu", "sm_86")
    assert compiler.is_cached("elementwise.cu", "sm_86")
    monkeypatch.setattr(contract.elementwise, "EW_THREADS", 128)
    assert not compiler.is_cached("elementwise.cu", "sm_86")
    assert not compiler.compile_source("elementwise.cu", "sm_86").cached


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "garbage"])
def test_corrupt_cache_entry_is_detected_and_rebuilt(cache, damage):
    good = compiler.compile_source("elementwise.cu", "sm_86")
    (entry,) = cache.glob("*.cubin")
    data = bytearray(entry.read_bytes())
    if damage == "flip_byte":
        data[-100] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray(b"not a cache entry at all")
    entry.write_bytes(bytes(data))
    again = compiler.compile_source("elementwise.cu", "sm_86")
    assert not again.cached, "a corrupt entry must not be loaded"
    assert again.cubin == good.cubin
    assert compiler.compile_source("elementwise.cu", "sm_86").cached, "the rebuilt entry is stored again"


def test_compile_error_carries_the_nvrtc_log_and_source_line(cache, tmp_path, monkeypatch):
    src_dir = tmp_path / "cu"
    src_dir.mkdir()
    (src_dir / "broken.cu").write_text('extern "C" __global__ void k(float* x) {\n    x[0] = undefined_name;\n}\n')
    monkeypatch.setattr(compiler, "SOURCE_DIR", src_dir)
    with pytest.raises(CompileError) as info:
        compiler.compile_source("broken.cu", "sm_86")
    msg = str(info.value)
    assert "broken.cu(2)" in msg and "undefined_name" in msg and "sm_86" in msg


def test_a_source_outside_the_package_builds_with_our_headers_and_fails_with_its_log(tmp_path):
    """compile_file: what dev/ experiments build with (the PTX headers on the include path, no contract defines)."""
    good = tmp_path / "exp.cu"
    good.write_text('#include "common.cuh"\nextern "C" __global__ void k(half_t* x) { x[0] = f32_to_f16(1.f); }\n')
    module = compiler.compile_file(good, "sm_90")
    assert module.cubin[:4] == b"\x7fELF" and list(module.resources) == ["k"] and not module.cached
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void k(float* x) {\n    x[0] = undefined_name;\n}\n')
    with pytest.raises(CompileError) as info:
        compiler.compile_file(bad, "sm_86")
    assert "bad.cu(2)" in str(info.value) and "undefined_name" in str(info.value) and "sm_86" in str(info.value)
    with pytest.raises(CompileError, match="no kernel source"):
        compiler.compile_file(tmp_path / "missing.cu", "sm_90")


@pytest.mark.parametrize("arch,expected", [("sm_86", "sm_86"), ("86", "sm_86"), ((9, 0), "sm_90"), ("SM_80", "sm_80")])
def test_arch_names_are_normalized(arch, expected):
    assert compiler.normalize_arch(arch) == expected


@pytest.mark.parametrize("arch", ["sm_10", "compute_86", "banana", "sm_999"])
def test_unsupported_arch_is_refused_clearly(arch):
    with pytest.raises(CompileError) as info:
        compiler.normalize_arch(arch)
    assert "sm_" in str(info.value)


def test_missing_source_is_clear(cache):
    with pytest.raises(CompileError, match="no kernel source"):
        compiler.compile_source("nope.cu", "sm_86")


def test_signatures_are_read_from_the_kernels_ptx():
    """A launcher packs its arguments by what the build read from the kernel's own PTX entry (nothing is typed twice):
    8-byte values p, int32 i, float f, a 128-byte tensor map t; another PTX type is a clear error."""
    ptx = """.visible .entry k(
	.param .u64 k_param_0,
	.param .u32 k_param_1,
	.param .f32 k_param_2,
	.param .align 64 .b8 k_param_3[128],
	.param .s64 k_param_4
)
{ ret; }
.visible .entry none()
{ ret; }
"""
    assert compiler.entry_signatures(ptx) == {"k": "piftp", "none": ""}
    with pytest.raises(CompileError, match=r"kernel bad: a parameter of PTX type \.f64"):
        compiler.entry_signatures(".entry bad(\n\t.param .f64 bad_param_0\n)\n{ ret; }")


def _launchers():
    from rawgpu.kernels import gemm

    yield "dx_sgd.cu", "dx_sgd", "ppppppiiiiiiiiippfffpp"
    yield "cluster_step.cu", "cluster_steps_1", "pi"
    yield "gemm.cu", gemm.kernel_name("stream", "rr", "store32", "f32"), "pppiiiiiiippipppppp"
    yield "gemm_tma.cu", gemm.kernel_name("tma128x64", "rr", "store32", "f16"), "ttpiiiiippippppppf"
    yield "elementwise.cu", "axpby_f32", "ppffp"


@pytest.mark.parametrize("source,kernel,signature", list(_launchers()))
def test_a_build_keeps_each_kernels_signature_and_the_cache_too(source, kernel, signature, whole_builds):
    """The signatures come with the build and with a cache hit alike (kept in the entry's header)."""
    fresh = compiler.compile_source(source, "sm_90")
    again = compiler.compile_source(source, "sm_90")
    assert again.cached and fresh.signatures == again.signatures
    assert again.signatures[kernel] == signature
    assert set(again.signatures) == set(compiler.ptx_of(source, "sm_90"))


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90"])
def test_the_tests_reading_of_the_declarations_agrees_with_every_build(arch, whole_builds):
    """The CPU stand-ins for Kernels check what launchers bind by kernel_params (the declarations read as text): it
    must say what the build read from the PTX for every kernel of every source."""
    import kernel_params

    for source in compiler.all_sources():
        for name, signature in compiler.compile_source(source, arch).signatures.items():
            assert kernel_params.signature(source, name) == signature, (source, name)


@pytest.fixture
def fake_builds(monkeypatch):
    """Kernels with NVRTC and the driver faked: (built [(source, kernel, arch, on the main thread)], loaded [on the
    main thread])."""
    import threading

    import rawgpu.kernels as K

    built, loaded, main = [], [], threading.current_thread()

    class FakeCompiled:
        resources, signatures, cached = {}, {}, False

        def __init__(self, source, kernel):
            self.cubin = f"{source}:{kernel}".encode()

    def fake_compile(source, arch, kernel=None, activation="relu"):
        built.append((source, kernel, arch, threading.current_thread() is main))
        return FakeCompiled(source, kernel)

    class FakeModule:
        def __init__(self, cubin, resources):
            loaded.append(threading.current_thread() is main)
            self.cubin = cubin

        @classmethod
        def of(cls, compiled):
            return cls(compiled.cubin, compiled.resources)

        def kernel(self, name):
            return types.SimpleNamespace(func=(self.cubin, name), resources=None, signature="p")

    monkeypatch.setattr(K, "compile_source", fake_compile)
    monkeypatch.setattr(K, "Module", FakeModule)
    return K, built, loaded


def test_load_all_builds_on_threads_and_loads_in_the_calling_thread(fake_builds, monkeypatch):
    """Builds go on worker threads (NVRTC releases the GIL); the modules are loaded in the calling thread (its
    context is current), each source once; a build error reaches the caller."""
    K, built, loaded = fake_builds
    k = K.Kernels("sm_90")
    k.load_all()
    sources = compiler.all_sources()
    assert sorted(s for s, _, _, _ in built) == sorted(sources) and {a for _, _, a, _ in built} == {"sm_90"}
    assert {kernel for _, kernel, _, _ in built} == {None}, "load_all builds whole sources"
    assert loaded == [True] * len(sources) and set(k.modules) == {(s, None) for s in sources}
    if (os.cpu_count() or 1) > 1:
        assert not any(on_main for *_, on_main in built), "the builds must run on worker threads"
    k.load_all()
    assert len(built) == len(sources), "loaded sources are not built again"

    def failing(source, arch, kernel=None, activation="relu"):
        raise CompileError(f"{source}: boom")

    monkeypatch.setattr(K, "compile_source", failing)
    with pytest.raises(CompileError, match="boom"):
        K.Kernels("sm_90").load_all(["gemm.cu", "gather.cu"])


def test_get_builds_only_the_kernels_unit_and_loads_it_when_first_needed(fake_builds):
    """A kernel of a many-instance source builds alone; `get` returns at once and the module is loaded, in the
    calling thread, when the function is first needed; progress counts units built of units asked for."""
    K, built, loaded = fake_builds
    progress = []
    k = K.Kernels("sm_90", on_progress=lambda done, total: progress.append((done, total)))
    gemm = contract.all_kernel_names("gemm.cu")[0]
    k.prefetch([("gather.cu", None)])
    kernel = k.get("gemm.cu", gemm)
    same = k.get("gemm.cu", gemm)
    assert same is kernel and kernel.signature is None  # known once built
    assert kernel.func == (f"gemm.cu:{gemm}".encode(), gemm) and loaded == [True]
    k.wait()
    assert sorted((s, n) for s, n, _, _ in built) == [("gather.cu", None), ("gemm.cu", gemm)]
    assert set(k.modules) == {("gather.cu", None), ("gemm.cu", gemm)} and loaded == [True, True]
    assert progress[-1] == (2, 2) and all(d <= t for d, t in progress)
    k.module("gemm.cu")  # the whole source, for tools: once loaded, get() takes kernels from it
    assert k.get("gemm.cu", contract.all_kernel_names("gemm.cu")[1]).func[0] == b"gemm.cu:None"


def test_a_failed_build_drops_the_queued_ones(fake_builds, monkeypatch):
    """After a build error (or Ctrl-C) the builds not yet begun are cancelled, so the process can end."""
    import threading

    K, built, _ = fake_builds
    gate, started = threading.Event(), []

    def slow_or_failing(source, arch, kernel=None, activation="relu"):
        started.append(source)
        if source == "gather.cu":
            raise CompileError("gather.cu: boom")
        gate.wait(5)
        return types.SimpleNamespace(cubin=b"", resources={}, cached=False)

    monkeypatch.setattr(K, "compile_source", slow_or_failing)
    monkeypatch.setattr(K.os, "cpu_count", lambda: 2)
    k = K.Kernels("sm_90")
    k.prefetch([("gather.cu", None)])  # fails first, while the two workers then hold two of the six below
    k.prefetch([("gemm.cu", name) for name in contract.all_kernel_names("gemm.cu")[:6]])
    with pytest.raises(CompileError, match="boom"):
        k.wait()
    gate.set()
    assert len(started) <= 3, f"the queued builds must be cancelled, not run: {started}"


def test_units_are_each_split_kernel_alone_and_every_other_source_whole():
    units = compiler.all_units()
    split = {s for s in compiler.all_sources() if contract.split_kernels(s)}
    assert split == {"gemm.cu", "gemm_tma.cu", "gemm_wgmma.cu", "gemm_models.cu", "cluster_step.cu", "fused_step.cu",
                     "dx_update.cu", "head.cu", "dx_update_models.cu", "head_models.cu"}
    assert compiler.unit_of("fused_step.cu", "fused_steps_adam") == ("fused_step.cu", "fused_steps_adam")
    assert len(units) == len(set(units)) == sum(len(contract.split_kernels(s)) or 1 for s in compiler.all_sources())
    assert compiler.unit_of("gemm.cu", "gemm_stream_rr_store_f32") == ("gemm.cu", "gemm_stream_rr_store_f32")
    assert compiler.unit_of("gather.cu", "gather_batch") == ("gather.cu", None)
    with pytest.raises(ValueError, match="no kernel"):
        contract.build("gather.cu", "sm_90", "gather_batch")


# --- the contract (rawgpu/contract/): what every build gets --------------------------------------------------------


class _Inner(contract.CStruct):
    """A test struct's member."""

    c_fields = (("p", "const float*", "a pointer"), ("k", "int"), ("h", "short", 3))


class _Outer(contract.CStruct):
    """A test struct: mixed sizes, so there is padding to agree on."""

    c_fields = (("a", "u8"), ("x", "double"), ("inner", _Inner, 2), ("n", "i64", "the last"), ("f", "float"))


def test_declare_writes_the_struct_and_asserts_ctypes_layout():
    import ctypes

    text = contract.declare(_Outer)
    assert "struct _Outer {" in text and "_Inner inner[2];" in text and re.search(r"i64 n; +// the last", text)
    assert "// A test struct: mixed sizes" in text
    assert f"static_assert(sizeof(_Outer) == {ctypes.sizeof(_Outer)}," in text
    for name, offset in [("a", 0), ("x", 8), ("inner", 16), ("n", 16 + 2 * 24), ("f", 72)]:
        assert getattr(_Outer, name).offset == offset
        assert f"__builtin_offsetof(_Outer, {name}) == {offset}," in text
    assert ctypes.sizeof(_Inner) == 24 and ctypes.sizeof(_Outer) == 80
    assert [f for f, _ in _Outer._fields_] == ["a", "x", "inner", "n", "f"]


def _compile_probe(tmp_path, monkeypatch, header: str) -> compiler.CompiledModule:
    """Build a kernel that includes `header` as a generated header of the probe source."""
    src_dir = tmp_path / "cu"
    src_dir.mkdir(exist_ok=True)
    (src_dir / "probe.cu").write_text('#include "common.cuh"\n#include "probe_abi.cuh"\n'
                                      'extern "C" __global__ void probe(_Outer* o) { o->n = o->inner[1].h[2]; }\n')
    monkeypatch.setattr(compiler, "SOURCE_DIR", src_dir)
    monkeypatch.setitem(contract.SOURCES, "probe.cu", (lambda arch: ({"PROBE": 1}, {"probe_abi.cuh": header}),))
    return compiler.compile_source("probe.cu", "sm_86", use_cache=False)


def test_the_generated_layout_compiles_and_a_c_layout_that_differs_fails_the_build(tmp_path, monkeypatch):
    header = contract.declare(_Inner) + contract.declare(_Outer)
    assert "probe" in _compile_probe(tmp_path, monkeypatch, header).resources
    wrong_size = header.replace("    short h[3];", "    short h[7];")  # C now disagrees with ctypes: every NVRTC sees it
    assert wrong_size != header
    with pytest.raises(CompileError, match=r"_Inner: its size in (tests/)?test_compiler\.py"):
        _compile_probe(tmp_path, monkeypatch, wrong_size)
    wrong_offset = header.replace("    int k;", "    i64 k;")  # the same size, h 4 bytes further on
    assert wrong_offset != header
    try:
        _compile_probe(tmp_path, monkeypatch, "#if !__has_builtin(__builtin_offsetof)\n#error none\n#endif\n")
    except CompileError:
        return  # an NVRTC without __builtin_offsetof (13.0) checks sizes only; the CPU tests' NVRTC checks offsets
    with pytest.raises(CompileError, match=r"_Inner.h: its offset in (tests/)?test_compiler\.py"):
        _compile_probe(tmp_path, monkeypatch, wrong_offset)


@pytest.mark.parametrize("arch", ARCHS)
def test_build_is_deterministic_and_names_no_file_of_the_package(arch):
    files = {p.name for p in (*compiler.SOURCE_DIR.iterdir(), *compiler.INCLUDE_DIR.iterdir())}
    for source in compiler.all_sources():
        defines, headers = contract.build(source, arch)
        assert (defines, headers) == contract.build(source, arch)
        assert all(d.startswith("-D") and "=" in d for d in defines), defines
        assert len({d.split("=")[0] for d in defines}) == len(defines), "a define given twice"
        assert not set(headers) & files, "a generated header would shadow a file"
    assert contract.build("no_such.cu", arch) == ((), {})


def test_every_shared_struct_is_whole_words_and_the_tables_fields_are_counted():
    import ctypes

    for struct, layer, header_fields, layer_fields in [
            (contract.FsParams, contract.FsLayer, contract.FS_HEADER_FIELDS, contract.FS_LAYER_FIELDS),
            (contract.CsParams, contract.CsLayer, contract.CS_HEADER_FIELDS, contract.CS_LAYER_FIELDS)]:
        assert ctypes.sizeof(layer) == 8 * layer_fields and struct.layer.offset == 8 * header_fields
        assert ctypes.sizeof(struct) % 8 == 0
    assert (contract.FS_HEADER_FIELDS, contract.FS_LAYER_FIELDS) == (28, 14)
    assert ctypes.sizeof(contract.Optim) == 4 * contract.OPTIM_WORDS == 72
    assert contract.Optim.lr.offset == 0  # plain-SGD kernels read the table as `const float* lr`
    assert (contract.CS_HEADER_FIELDS, contract.CS_LAYER_FIELDS) == (27, 8)
    assert [contract.fs_smem_bytes(a) for a in ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a")] == \
        [163840, 92672, 92672, 163840, 163840]


def test_a_table_is_uploaded_up_to_its_last_layer():
    import ctypes

    p = contract.FsParams()
    p.images, p.batch, p.lr0 = 0xDEAD0000, 32, 0.25
    p.layer[1].in_p = 784
    data = contract.table_bytes(p, 2)
    assert len(data) == 8 * (contract.FS_HEADER_FIELDS + 2 * contract.FS_LAYER_FIELDS)
    words = (ctypes.c_uint64 * (len(data) // 8)).from_buffer_copy(data)
    assert words[0] == 0xDEAD0000 and words[contract.FsParams.batch.offset // 8] == 32
    assert words[contract.FsParams.lr0.offset // 8] == 0x3FD0000000000000  # 0.25
    assert words[contract.FS_HEADER_FIELDS + contract.FS_LAYER_FIELDS + contract.FsLayer.in_p.offset // 8] == 784
    with pytest.raises(ValueError, match="0..65"):
        contract.table_bytes(p, 66)


def test_contract_main_prints_what_nvrtc_gets(capsys):
    assert contract.main(["fused_step.cu", "--arch", "sm_86"]) == 0
    out = capsys.readouterr().out
    assert "-DFS_STAGES=2" in out and "---- fused_step_abi.cuh" in out and "struct FsParams {" in out


@pytest.mark.parametrize("argv,message", [(["nosuch.cu"], "no kernel source nosuch.cu"),
                                          (["--arch", "banana"], "expected a name like sm_86")])
def test_contract_cli_refuses_bad_arguments_in_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        contract.main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err.strip().splitlines()[-1]


def test_nvrtc_of_another_cuda_stack_than_the_bindings_is_refused(monkeypatch):
    """A CUDA 12 install beside a CUDA 13 one can hand the 12.x bindings NVRTC 13: one line, not wrong cubins."""
    import cuda.bindings

    real_major = compiler._check(compiler._nvrtc().nvrtcVersion(), "nvrtcVersion")[0]
    other = "12.9.10" if real_major != 12 else "13.0.0"
    compiler.nvrtc_version.cache_clear()
    monkeypatch.setattr(cuda.bindings, "__version__", other)
    try:
        with pytest.raises(CompileError, match=rf'two CUDA stacks are installed; .*"\.\[cu{other.split(".")[0]}\]"'):
            compiler.nvrtc_version()
    finally:
        compiler.nvrtc_version.cache_clear()
