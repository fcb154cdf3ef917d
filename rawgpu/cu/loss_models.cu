// loss.cu's softmax cross-entropy with a model axis (XENT_MODELS): one launch over every model's logits of a sweep,
// each model its own metrics (the models step, rawgpu/steps/models.py).
#define XENT_MODELS 1
#include "loss.cu"
