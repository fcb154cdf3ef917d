// gather.cu's gather with a model axis (GATHER_MODELS): one launch gathers every model's batch of a sweep, each in its
// own order, with its own schedule and optimiser row (the models step, rawgpu/steps/models.py).
#define GATHER_MODELS 1
#include "gather.cu"
