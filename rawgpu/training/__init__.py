"""Training: the session (GPU, kernels, model and step), the Trainer (the Python API), the many-model trainer, the
sweep API and its grid, checkpoints, the epoch record and the plots.
"""
