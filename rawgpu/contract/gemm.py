"""The GEMMs (gemm.cu, gemm_tma.cu, gemm_wgmma.cu; kernels/gemm.py): tile configurations and compiled instances."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .abi import header
from .arch import deepest_pipeline
from .optim import UPDATE_FAMILIES

GEMM_SOURCE = "gemm.cu"
GEMM_TMA_SOURCE = "gemm_tma.cu"
GEMM_WGMMA_SOURCE = "gemm_wgmma.cu"
# On sm_90 the splits of a tile can meet in one thread-block cluster (gemm_epilogue.cuh: finish_cluster_splits): up
# to the portable cluster size.
MAX_CLUSTER_SPLITS = 8
# The persistent tile's resident grid: this many blocks per SM (its __launch_bounds__ promises the registers; its
# shared memory, 44 KB, fits twice even in sm_86's 99 KB).
PERSIST_BLOCKS_PER_SM = 2
STREAM_CONFIG = "stream"  # the config whose pipeline depth is stream_stages(arch)


@dataclass(frozen=True)
class GemmConfig:
    """One CTA tile shape: a `Config<BM, BN, BK, WM, WN, STAGES[, STAGED]>` of gemm.cu, or with `tma`, a
    `TmaConfig<BM, BN, STAGES>` of gemm_tma.cu (BK 64 and 4 consumer warps: the template's own; they split K at
    BM 32, the rows above)."""

    name: str
    bm: int
    bn: int
    bk: int
    warps_m: int
    warps_n: int
    stages: int
    staged: bool = False  # the epilogue goes through shared memory (Config<..., STAGED_> in gemm.cu)
    tma: bool = False  # fed by the sm_90 tensor copy engine (TmaConfig in gemm_tma.cu): one more warp, the producer
    persistent: bool = False  # a resident grid walks the tiles (gemm_persistent_store in gemm.cu)
    wgmma: bool = False  # Hopper's warpgroup MMA (WgConfig in gemm_wgmma.cu, sm_90a): three warpgroups, one producing
    ctas_per_sm: int = 1  # wgmma: the CTAs an SM runs, by __launch_bounds__ (one's epilogue beside another's MMA)
    split_k: str = ""  # wgmma: the layout whose K may split over a cluster ("cr": x^T @ dy, "rr": x @ W; only these
    # instances carry the fix-up)
    multicast: int = 1  # wgmma: CTAs along M in a cluster, each loading its share of B's k-tile into all
    pingpong: bool = False  # wgmma: the persistent ping-pong tile (PpConfig): one CTA an SM walks the tiles, its two
    # consumer warpgroups owning whole tiles by turns, the update fed and stored by TMA (PINGPONG_BUFFERS)
    note: str = field(default="", compare=False, repr=False)  # why the tile exists (a comment in the header)

    @property
    def threads(self) -> int:
        if self.wgmma:  # its warps_m x warps_n are consumer warpgroups, beside a producing warpgroup (or warp)
            return 128 * self.warps_m * self.warps_n + (128 if self.ctas_per_sm == 1 else 32)
        return 32 * (self.warps_m * self.warps_n + self.tma)

    @property
    def source(self) -> str:
        return GEMM_WGMMA_SOURCE if self.wgmma else GEMM_TMA_SOURCE if self.tma else GEMM_SOURCE

    @property
    def c_name(self) -> str:
        """The typedef in the generated header."""
        return f"Cfg_{self.name}"

    def smem_bytes(self, layout: str, epilogue: str = "store", states: int = 0) -> int:
        """Dynamic shared memory: STAGES x (A tile + B tile), each row padded by 8 halves; a staged update epilogue
        adds the weight tile (W16 and lo: as much as an fp32 tile) and one fp32 tile per optimiser state (`states`:
        momentum, or Adam's two moments), rows padded by 8 floats; the persistent tile adds its fp16 output tile,
        rows padded by 8 halves. TMA tiles are swizzled, not padded, and need 1 KB of slack to align them. (The
        kernels trap on less.)"""
        if self.pingpong:  # + its ring of epilogue buffers (a 64 x 64 chunk of every array the update rewrites)
            buffers, nbytes = PINGPONG_BUFFERS.get(epilogue, (0, 0))
            return self.stages * (self.bm + self.bn) * self.bk * 2 + buffers * nbytes + 1024
        if self.tma:
            return self.stages * (self.bm + self.bn) * self.bk * 2 + 1024
        a = self.bm * (self.bk + 8) if layout[0] == "r" else self.bk * (self.bm + 8)
        b = self.bk * (self.bn + 8) if layout[1] == "r" else self.bn * (self.bk + 8)
        staged = (1 + states) * self.bm * (self.bn + 8) * 4 if self.staged and epilogue in UPDATE_EPILOGUES else 0
        out = self.bm * (self.bn + 8) * 2 if self.persistent else 0
        return self.stages * (a + b) * 2 + staged + out


# The ping-pong tile's epilogue buffers per update family: (how many, bytes each: W16 and lo 8 KB each, an fp32 state
# 16 KB). Beside its 4 stages of 32 KB they fill sm_90's 227 KB; 3 of SGD's beat 2, and 4 at 3 stages lose
# (`PYTHONPATH=.:scripts python dev/pingpong/run.py`).
PINGPONG_BUFFERS = {"sgd": (3, 32768), "adam": (2, 49152)}


STREAM_MAX_STAGES = 15  # the streaming tile's deepest pipeline (sm_90 would fit 16)


def stream_stages(arch: str) -> int:
    """STREAM_STAGES, the streaming tile's pipeline depth: what fits a block's shared memory in every layout."""
    cfg = CONFIGS[STREAM_CONFIG]
    worst = lambda s: max(replace(cfg, stages=s).smem_bytes(lay) for lay in ("rr", "rc", "cr", "cc"))  # noqa: E731
    return deepest_pipeline(arch, worst, STREAM_MAX_STAGES)


CONFIGS = {c.name: c for c in (
    GemmConfig("32x128", 32, 128, 32, 1, 4, 6, note="batch-sized M (<= 32): streams a wide B"),
    GemmConfig("32x128k64", 32, 128, 64, 2, 4, 4, note="M <= 32, longer K runs: 128-byte rows of a column-major B"),
    GemmConfig("64x128", 64, 128, 64, 2, 4, 3, note="M <= 64"),
    GemmConfig("128x128", 128, 128, 32, 2, 4, 4, note="large M"),
    GemmConfig("outer", 128, 128, 32, 2, 4, 2, note="K = batch: little to pipeline, much to write"),
    GemmConfig("outer64", 64, 128, 32, 2, 4, 2, note="the same with half the accumulators: more CTAs per SM"),
    GemmConfig(STREAM_CONFIG, 32, 64, 64, 2, 4, 7,  # stages: stream_stages(arch)
               note="M <= 32: a block per SM streams 64 columns (or a K range), as deep as shared memory allows"),
    GemmConfig("staged", 64, 128, 32, 2, 4, 2, staged=True,
               note="K = batch: weight update staged in shared memory"),
    GemmConfig("staged32", 32, 128, 32, 1, 4, 2, staged=True,
               note="the same, 32 rows, for Adam: its two moment tiles fit sm_86's shared memory"),
    GemmConfig("persist", 64, 128, 32, 2, 4, 2, persistent=True,
               note="K = batch, plain store: a resident grid walks the tiles"),
    GemmConfig("tma", 32, 64, 64, 1, 4, 16, tma=True,  # warps: 4 consumers (+ the producer)
               note="64 columns per block: 128 blocks stream an 8192-wide weight without split-K"),
    GemmConfig("tma128", 32, 128, 64, 1, 4, 10, tma=True, note="128 columns: half the re-reads of A, split-K to fill "
                                                               "the SMs"),
    GemmConfig("tma128x64", 128, 64, 64, 4, 1, 8, tma=True, note="a batch of up to 128 rows reads each weight tile "
                                                                 "once"),
    GemmConfig("wg128", 128, 128, 64, 2, 1, 6, tma=True, wgmma=True, split_k="cr",  # warps_m: 2 consumer warpgroups
               note="batches above 256 on sm_90a: warpgroup MMA, 128 columns"),
    GemmConfig("wg256", 128, 256, 64, 2, 1, 4, tma=True, wgmma=True,
               note="the same, 256 columns: half the re-reads of A where the tiles still fill the GPU"),
    GemmConfig("wg128x2", 128, 128, 64, 2, 1, 3, tma=True, wgmma=True, ctas_per_sm=2,
               note="wg128 in 3 stages, with a producing warp for a warpgroup: two CTAs an SM"),
    GemmConfig("wg256mc", 128, 256, 64, 2, 1, 4, tma=True, wgmma=True, multicast=2,
               note="wg256 in pairs along M sharing B's loads (TMA multicast), for long K"),
    GemmConfig("wg64", 128, 64, 64, 2, 1, 8, tma=True, wgmma=True,
               note="64 columns: twice wg128's tiles, for GEMMs whose 128-column tiles leave SMs idle"),
    GemmConfig("wg64k", 128, 64, 64, 2, 1, 8, tma=True, wgmma=True, split_k="rr",
               note="wg64 whose K splits over a cluster: x @ W of a batch of at most 256 rows"),
    GemmConfig("wgpp", 128, 128, 64, 2, 1, 4, tma=True, wgmma=True, pingpong=True,
               note="x^T @ dy with its update, persistent: one warpgroup's update under the other's multiply"),
)}
LAYOUTS = ("rr", "rc", "cr", "cc")  # A then B: r = row-major, c = column-major
EPILOGUES = ("store", "bias", "bias_act", "dact", "sgd", "adam", "store32")
UPDATE_EPILOGUES = UPDATE_FAMILIES  # the weight update fused into x^T @ dy, one per family (EPI_SGD, EPI_ADAM)
ACCUMULATORS = ("f32", "f16")
TMA_ROLES = [("rr", "store"), ("rr", "bias_act"), ("rc", "store"), ("rc", "dact")]
WG_DW_ROLES = [("cr", "store"), ("cr", "sgd"), ("cr", "adam"), ("cr", "store32")]  # the weight gradient, its updates
# (layout, epilogue) pairs every general tile compiles
_ROLE_INSTANCES = [("rr", "store"), ("rc", "store"), ("cr", "store"), ("cc", "store"),
                   ("rr", "bias"), ("rr", "bias_act"), ("rc", "dact"), ("cr", "sgd"), ("cr", "adam")]
# (config, layout, epilogue) triples compiled, each for f32 and f16 accumulation (and store32's, below)
_BASE_INSTANCES = frozenset([(c, lay, epi) for c in ("32x128", "64x128", "128x128") for lay, epi in _ROLE_INSTANCES]
                             + [(c, "cr", e) for c in ("outer", "outer64") for e in ("sgd", "store")]
                             + [("32x128k64", lay, epi) for lay, epi in [("rr", "store"), ("rc", "store"),
                                                                         ("rr", "bias_act"), ("rc", "dact")]]
                             + [(STREAM_CONFIG, lay, epi) for lay, epi in [("rr", "store"), ("rr", "bias"),
                                                                           ("rr", "bias_act"), ("rc", "store"),
                                                                           ("rc", "dact")]]
                             + [("staged", "cr", e) for e in ("sgd", "store")] + [("staged32", "cr", "adam")]
                             + [("persist", "cr", "store")]
                             + [(c, lay, epi) for c in ("tma", "tma128") for lay, epi in TMA_ROLES]
                             + [("tma128x64", "rr", epi) for epi in ("store", "bias_act")]
                             + [(c, lay, epi) for c in ("wg128", "wg256", "wg128x2")
                                for lay, epi in TMA_ROLES + WG_DW_ROLES]
                             + [(c, lay, epi) for c in ("wg256mc", "wg64") for lay, epi in TMA_ROLES + WG_DW_ROLES]
                             + [("wg64k", "rr", epi) for epi in ("store", "bias", "bias_act")]
                             + [("wgpp", "cr", epi) for epi in UPDATE_EPILOGUES])
# store32, an fp32 sum other GPUs add to (rawgpu/steps/split.py): a tensor-parallel layer's partial sum on every tile
# that stores x @ W or dy @ W^T, which the planner gives it as it gives "store"; a data-parallel weight gradient on
# every tile the planner gives a weight update, which it runs as one GPU's update would (kernels/gemm.py)
INSTANCES = (_BASE_INSTANCES
             | {(c, lay, "store32") for c, lay, epi in _BASE_INSTANCES if epi == "store" and lay in ("rr", "rc")}
             | {(c, "cr", "store32") for c in ("32x128", "64x128", "128x128", "staged", "staged32")})


def config_for(name: str, arch: str) -> GemmConfig:
    """CONFIGS[name] with its pipeline depth for this GPU."""
    cfg = CONFIGS[name]
    return replace(cfg, stages=stream_stages(arch)) if name == STREAM_CONFIG else cfg


def instance_name(config: str, layout: str, epilogue: str) -> str:
    """gemm_<config>_<layout A><layout B>_<epilogue>: an instance's kernels are this + _f32 and _f16."""
    return f"gemm_{config}_{layout}_{epilogue}"


def kernel_name(config: str, layout: str, epilogue: str, accum: str) -> str:
    """The extern "C" name of one kernel."""
    return f"{instance_name(config, layout, epilogue)}_{accum}"


def all_kernel_names(source: str = GEMM_SOURCE) -> list[str]:
    """The instances one source file compiles."""
    return sorted(kernel_name(c, lay, e, acc) for c, lay, e in INSTANCES for acc in ACCUMULATORS
                  if CONFIGS[c].source == source)


def _instances_of(source: str) -> list[tuple[GemmConfig, str, str]]:
    order = list(CONFIGS)
    found = sorted(((c, lay, e) for c, lay, e in INSTANCES if CONFIGS[c].source == source),
                   key=lambda t: (order.index(t[0]), LAYOUTS.index(t[1]), EPILOGUES.index(t[2])))
    return [(CONFIGS[c], lay, e) for c, lay, e in found]


_C_LAYOUT = {"r": "ROW", "c": "COL"}


def _one_kernel(name: str, accs_line: str, kernel: str | None) -> str | None:
    """An instance's line of a generated header: the macro making its _f32 and _f16 kernels (kernel None), the
    single-kernel macro when `kernel` is one of the two, else None (left out)."""
    if kernel is None:
        return accs_line
    for acc in ACCUMULATORS:
        if kernel == f"{name}_{acc}":
            macro, args = accs_line.split("(", 1)
            args = args.rsplit(")", 1)[0].split(", ", 1)[1]
            return f"{macro.replace('_ACCS', '_INSTANCE')}({kernel}, {args}, {'true' if acc == 'f16' else 'false'})"
    return None


def config_typedef(c: GemmConfig) -> list[str]:
    """gemm.cu's typedef of tile config `c` (Cfg_<name>) and the check that its threads are the table's."""
    stages = "STREAM_STAGES" if c.name == STREAM_CONFIG else str(c.stages)
    args = f"{c.bm}, {c.bn}, {c.bk}, {c.warps_m}, {c.warps_n}, {stages}" + (", true" if c.staged else "")
    return [f"typedef Config<{args}> {c.c_name};  // {c.note}",
            f'static_assert({c.c_name}::THREADS == {c.threads}, "{c.name}: its threads in rawgpu/contract/gemm.py");']


def _gemm_header(kernel: str | None = None) -> str:
    """gemm.cu's Config typedefs and instances: GEMM_ACCS / PERSIST_ACCS (gemm.cu's macros) per (config, layout,
    epilogue), each making the _f32 and _f16 kernels; with `kernel`, that one kernel alone."""
    lines = []
    for c in (c for c in CONFIGS.values() if c.source == GEMM_SOURCE):
        lines += config_typedef(c)
    lines.append("")
    for c, lay, epi in _instances_of(GEMM_SOURCE):
        name = instance_name(c.name, lay, epi)
        operands = f"{_C_LAYOUT[lay[0]]}, {_C_LAYOUT[lay[1]]}"
        if c.persistent:
            if epi != "store":
                raise ValueError(f"the persistent tile only stores, not {epi}")
            line = f"PERSIST_ACCS({name}, {c.c_name}, {operands})"
        else:
            line = f"GEMM_ACCS({name}, {c.c_name}, {operands}, EPI_{epi.upper()})"
        if (line := _one_kernel(name, line, kernel)) is not None:
            lines.append(line)
    return "\n".join(lines) + "\n"


def _row_a_instances(source: str, accs: str, kernel: str | None) -> list[str]:
    """The instance lines of gemm_tma.cu, whose A is always row-major: the macro `accs` (name, config, B's layout,
    epilogue) per (config, layout, epilogue); with `kernel`, that one kernel alone."""
    lines = []
    for c, lay, epi in _instances_of(source):
        if lay[0] != "r":
            raise ValueError(f"{source}'s tiles read a row-major A, not layout {lay}")
        name = instance_name(c.name, lay, epi)
        line = _one_kernel(name, f"{accs}({name}, {c.c_name}, {_C_LAYOUT[lay[1]]}, EPI_{epi.upper()})", kernel)
        if line is not None:
            lines.append(line)
    return lines


def _gemm_tma_header(kernel: str | None = None) -> str:
    """gemm_tma.cu's TmaConfig typedefs (with asserts that the template's fixed shape is the table's) and
    instances: TMA_ACCS (gemm_tma.cu's macro) per (config, layout, epilogue), A always row-major; with `kernel`,
    that one kernel alone."""
    lines = []
    for c in (c for c in CONFIGS.values() if c.source == GEMM_TMA_SOURCE):
        lines.append(f"typedef TmaConfig<{c.bm}, {c.bn}, {c.stages}> {c.c_name};  // {c.note}")
        lines.append(f"static_assert({c.c_name}::BM == {c.bm} && {c.c_name}::BK == {c.bk} && {c.c_name}::CONSUMERS == "
                     f'{c.warps_m * c.warps_n} && {c.c_name}::THREADS == {c.threads}, "{c.name}: its shape in '
                     'rawgpu/contract/gemm.py");')
    return "\n".join(lines + [""] + _row_a_instances(GEMM_TMA_SOURCE, "TMA_ACCS", kernel)) + "\n"


def _gemm_wgmma_header(kernel: str | None = None) -> str:
    """gemm_wgmma.cu's WgConfig typedefs (with asserts that the template's fixed shape is the table's) and instances:
    WG_ACCS (gemm_wgmma.cu's macro: name, config, A's and B's layouts, epilogue) per (config, layout, epilogue), the
    ping-pong tile's PpConfig and WGPP_ACCS (x^T @ dy alone: name, config, epilogue); with `kernel`, that one kernel
    alone."""
    lines = []
    for c in (c for c in CONFIGS.values() if c.source == GEMM_WGMMA_SOURCE):
        if c.pingpong:
            sgd, adam = PINGPONG_BUFFERS["sgd"][0], PINGPONG_BUFFERS["adam"][0]
            lines.append(f"typedef PpConfig<{c.stages}, {sgd}, {adam}> {c.c_name};  // {c.note}")
            lines.append(f"static_assert({c.c_name}::BM == {c.bm} && {c.c_name}::BN == {c.bn} && {c.c_name}::BK == "
                         f"{c.bk} && {c.c_name}::THREADS == {c.threads} && {c.c_name}::smem(EPI_SGD) == "
                         f"{c.smem_bytes('cr', 'sgd')} && {c.c_name}::smem(EPI_ADAM) == {c.smem_bytes('cr', 'adam')}, "
                         f'"{c.name}: its shape in rawgpu/contract/gemm.py");')
            continue
        split = _C_LAYOUT[c.split_k[0]] if c.split_k else "NO_SPLIT"
        lines.append(f"typedef WgConfig<{c.bn}, {c.stages}, {c.ctas_per_sm}, {split}, "
                     f"{c.multicast}> {c.c_name};  // {c.note}")
        lines.append(f"static_assert({c.c_name}::BM == {c.bm} && {c.c_name}::BK == {c.bk} && {c.c_name}::THREADS == "
                     f'{c.threads}, "{c.name}: its shape in rawgpu/contract/gemm.py");')
    lines.append("")
    for c, lay, epi in _instances_of(GEMM_WGMMA_SOURCE):
        name = instance_name(c.name, lay, epi)
        line = (f"WGPP_ACCS({name}, {c.c_name}, EPI_{epi.upper()})" if c.pingpong else
                f"WG_ACCS({name}, {c.c_name}, {_C_LAYOUT[lay[0]]}, {_C_LAYOUT[lay[1]]}, EPI_{epi.upper()})")
        if (line := _one_kernel(name, line, kernel)) is not None:
            lines.append(line)
    return "\n".join(lines) + "\n"


def epilogue_facts(arch: str):  # gemm_epilogue.cuh
    return {"GEMM_MAX_CLUSTER_SPLITS": MAX_CLUSTER_SPLITS}, {}


def gemm_facts(arch: str, kernel: str | None = None):
    defines = {"STREAM_STAGES": stream_stages(arch), "PERSIST_BLOCKS_PER_SM": PERSIST_BLOCKS_PER_SM}
    return defines, {"gemm_instances.cuh": header(__name__, GEMM_SOURCE, _gemm_header(kernel))}


def gemm_tma_facts(arch: str, kernel: str | None = None):
    return {}, {"gemm_tma_instances.cuh": header(__name__, GEMM_TMA_SOURCE, _gemm_tma_header(kernel))}


def gemm_wgmma_facts(arch: str, kernel: str | None = None):
    return {}, {"gemm_wgmma_instances.cuh": header(__name__, GEMM_WGMMA_SOURCE, _gemm_wgmma_header(kernel))}
