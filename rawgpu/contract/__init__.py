"""The contract between the Python launchers and the CUDA sources: every fact both sides use, written once.

A launcher packs a parameter table, sizes a block and its shared memory, and picks a compiled instance by name; the
kernel reads the same table, was compiled for the same block and tile shapes, and exists under that name. Copied by
hand, such facts drift apart silently. So they live here, and the compiler hands them to NVRTC with every build
(`build`): constants as `-DNAME=value` options, C struct declarations and instance lists as generated headers held
in memory. Each generated struct is followed by static_asserts of its size and every field offset, so a C compiler
that lays it out differently from ctypes fails the build instead of reading the wrong bytes.

One module per kernel family (as in kernels/) says what its sources get; abi.py alone renders C text, sources.py
says which families each source includes. Every public name is importable from the package itself. A leaf package
(the standard library and recipe.py, itself a leaf, only), so the launchers, the compiler and tools all import it
freely. A test or tool that changes a value patches the family module (`contract.gemm.PERSIST_BLOCKS_PER_SM`),
which is where the build reads it. `python -m rawgpu.contract [SOURCE] [--arch sm_90]` prints what NVRTC gets.
"""

# Re-exported, so that `contract.X` and `from rawgpu.contract import X` name any fact without knowing its family.
from .abi import CField, CStruct, declare, table_bytes  # noqa: F401
from .arch import block_smem_limit  # noqa: F401
from .cluster import (  # noqa: F401
    CS_ACT_PAD, CS_ALIGN, CS_CLASSES, CS_DLOGIT_LD, CS_DY_PAD, CS_HEAD_GROUPS, CS_HEAD_LD, CS_HEADER_FIELDS, CS_INPUTS,
    CS_LAYER_FIELDS, CS_MAX_COLUMNS, CS_MAX_LINEAR, CS_MISC, CS_ROWS, CS_THREADS, CS_TILE_COUNTS, CS_W_PAD, CS_WARPS,
    CS_X_LD, CsLayer, CsParams, cluster_kernel_name)
from .dx_sgd import (  # noqa: F401
    DX_SGD_BM, DX_SGD_BN, DX_SGD_MAX_BATCH, DX_SGD_THREADS, dx_sgd_smem_bytes, dx_sgd_stages)
from .dx_update import (  # noqa: F401
    DXU_BATCHES, DXU_BM, DXU_BN, DXU_FAMILIES, DXU_MAX_STAGES, DXU_WARPS, DXU_WGMMA_MIN_BATCH, dxu_kernel_name,
    dxu_kernels, dxu_smem_bytes, dxu_stage_bytes, dxu_stages, dxu_stream_kernel_name, dxu_stream_kernels,
    dxu_stream_smem_bytes, dxu_wgmma)
from .elementwise import EW_THREADS  # noqa: F401
from .fused import (  # noqa: F401
    FS_HEADER_FIELDS, FS_INPUTS, FS_KERNELS, FS_LAYER_FIELDS, FS_LD, FS_MAX_LAYERS, FS_PANEL_LD, FS_T, FS_THREADS,
    FS_WARPS, FsLayer, FsParams, fs_smem_bytes, fs_stages, fused_kernel_name)
from .gather import (COLUMNS_MAX, COLUMNS_THREADS, COLUMNS_TILE_ROWS, GATHER_MAX_THREADS,  # noqa: F401
                     GATHER_TABLE_DTYPES, GF_MAX_INPUTS, GF_ROWS, GF_THREADS, column_kernel, column_kernels,
                     columns_kernel, columns_kernels, gather_forward_kernel, gather_forward_kernels, gather_table_kernel,
                     gather_table_kernels)
from .gemm import (  # noqa: F401
    ACCUMULATORS, CONFIGS, EPILOGUES, GEMM_SOURCE, GEMM_TMA_SOURCE, GEMM_WGMMA_SOURCE, INSTANCES, LAYOUTS,
    MAX_CLUSTER_SPLITS, PERSIST_BLOCKS_PER_SM, STREAM_CONFIG, TMA_ROLES, UPDATE_EPILOGUES, GemmConfig, all_kernel_names,
    config_for, instance_name, kernel_name, stream_stages)
from .head import (  # noqa: F401
    HEAD_BATCHES, HEAD_CLASSES, HEAD_FAMILIES, HEAD_MAX_CTAS, HEAD_TASKS, HEAD_THREADS, head_kernel_name, head_kernels,
    head_smem_bytes, head_smem_fixed, head_smem_per_row)
from .loss import XENT_MAX_THREADS  # noqa: F401
from .model_axis import (  # noqa: F401
    GATHER_MODELS_SOURCE, DX_UPDATE_MODELS_SOURCE, ELEMENTWISE_MODELS_SOURCE, GEMM_MODELS_SOURCE,
    HEAD_MODELS_SOURCE, LOSS_MODELS_SOURCE, MODEL_ACCUM, MODEL_CONFIGS, MODEL_ROLES, gemm_model_kernels)
from .optim import OPTIM_WORDS, UPDATE_FAMILIES, Optim, update_family  # noqa: F401
from .shapes import HEAD_TILE_CLASSES, MAX_CLASSES  # noqa: F401
from .sources import SOURCES, build, main, nvrtc_arch, split_kernels  # noqa: F401
