// elementwise.cu's bias update with a model axis (BIAS_MODELS): one launch updates a layer's bias in every model of a
// sweep, each with its own optimiser row (the models step, rawgpu/steps/models.py).
#define BIAS_MODELS 1
#include "elementwise.cu"
