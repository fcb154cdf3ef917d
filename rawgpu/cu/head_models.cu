// head.cu's head step with a model axis (HEAD_MODELS): one launch runs the classifier head's forward, loss, backward
// and update for every model of a sweep, one cluster per model, each the arithmetic it gets from head.cu (the models
// step, rawgpu/steps/models.py; instances: rawgpu/contract/head.py's, as head.cu's).
#define HEAD_MODELS 1
#include "head.cu"
