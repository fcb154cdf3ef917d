// dx_update.cu's one-pass backward with a model axis (DXU_MODELS): one launch runs a layer's backward and update for
// every model of a sweep, each model the arithmetic it gets from dx_update.cu (the models step,
// rawgpu/steps/models.py; instances: rawgpu/contract/dx_update.py's, as dx_update.cu's).
#define DXU_MODELS 1
#include "dx_update.cu"
