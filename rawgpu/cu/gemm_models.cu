// gemm.cu's tiles with a model axis (GEMM_MODELS): one launch runs a GEMM role of every model of a sweep, each model
// the arithmetic it gets from gemm.cu (the models step, rawgpu/steps/models.py; instances: rawgpu/contract/model_axis.py).
#define GEMM_MODELS 1
#include "gemm.cu"
