"""A model on several GPUs, one process per GPU.

  split.py       how a model is split over the ranks (tensor or data parallel) and why: plain Python
  sharded.py     one rank's part of a tensor-parallel model (the step: steps/tensor.py)
  replicated.py  one rank's copy of a data-parallel model (the step: steps/data.py)
  ranks.py       the ranks' processes: start them, hand them one communicator id, collect their results
  nccl.py        NCCL, checked: the communicator and the collectives a step captures into its graph
  launchers.py   a job on several hosts: which rank this process is, from torchrun's, SLURM's or Open MPI's variables
  rendezvous.py  the ranks meet over TCP before any GPU work: rank 0 hands out NCCL's id once all agree

The split's rules are the package's interface (`parallel.choose`, `parallel.plan_tensor_parallel`, ...); which step
kind a split runs is decided with every other kind's, by `steps.choose`.
"""

from .split import (ACTIVATION_BYTES, GRADIENT_BYTES, MODES, SPLITS, LayerShard, ParallelChoice, TensorParallelPlan,
                    choose, data_parallel_reason, gather, plan_tensor_parallel, shard, shard_width)

__all__ = ["ACTIVATION_BYTES", "GRADIENT_BYTES", "MODES", "SPLITS", "LayerShard", "ParallelChoice",
           "TensorParallelPlan", "choose", "data_parallel_reason", "gather", "plan_tensor_parallel", "shard",
           "shard_width"]
