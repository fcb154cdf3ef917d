"""What a finished epoch reports: the training history a Trainer keeps, a checkpoint stores, a sweep ranks and the
console shows."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EpochStats:
    """One finished epoch. Times are GPU time of the training steps (CUDA events), so they exclude eval."""

    epoch: int
    epochs: int
    steps: int  # run in this epoch
    train_loss: float
    train_accuracy: float  # a fraction, 0..1
    test_loss: float
    test_accuracy: float
    seconds: float
    eval_seconds: float
    steps_per_s: float
    samples_per_s: float
    tflops: float
    gbps: float
    lr: float  # at the end of the epoch
    total_seconds: float  # cumulative, this epoch included
    # a regression's errors over every value (the accuracies are then NaN); None for a classification
    train_rmse: float | None = None
    test_rmse: float | None = None
    test_mae: float | None = None
    test_r2: float | None = None  # 1 - squared error / the test targets' sum of squares about their mean
