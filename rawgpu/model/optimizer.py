"""The optimiser table every update kernel reads (contract.Optim, cu/optim.cuh), made from the recipe.

The hyperparameters are set once; the step's values (lr, Adam's bias corrections, AdamW's decay rate) are written
on the device every step by the gather or the fused kernel (optim.cuh: optim_set_step). `step_values` is that
function's host twin, for kernels run alone and for tests.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np

from ..contract import OPTIM_WORDS, Optim
from ..contract.optim import update_family  # noqa: F401 - the rule's owner is the contract
from .recipe import Recipe, loss_scale


def state_names(recipe: Recipe) -> tuple[str, ...]:
    """The optimiser's fp32 values per parameter as torch.optim names them, in the order the kernels take them (m,
    then v): what checkpoints call them."""
    return ("momentum",)[:recipe._state_tensors] if recipe.optimizer == "sgd" else ("exp_avg", "exp_avg_sq")


def hyperparameters(recipe: Recipe) -> Optim:
    """The table with the recipe's settings and the values of step 0 at the peak lr."""
    r, s = recipe, loss_scale(recipe.batch)
    sgd = r.optimizer == "sgd"
    o = Optim(kind=r._optimizer_code, nesterov=int(r.nesterov), beta1=r.momentum if sgd else r.beta1,
              beta2=0.0 if sgd else r.beta2, m_rate=0.0 if sgd else 1.0 - r.beta1, v_rate=0.0 if sgd else 1.0 - r.beta2,
              eps=0.0 if sgd else r.eps * s, l2=0.0 if r.optimizer == "adamw" else r.weight_decay * s,
              wd=r.weight_decay if r.optimizer == "adamw" else 0.0, scale=s,
              beta1_d=0.0 if sgd else r.beta1, beta2_d=0.0 if sgd else r.beta2)
    return step_values(o, 0, r.lr / s)


def step_values(o: Optim, step: int, lr_scaled: float) -> Optim:
    """`o` with the values of step `step` (from 0) at learning rate lr_scaled (lr / the loss scale): what
    optim_set_step computes on the device, in the same double arithmetic, each rounded once to fp32."""
    out = Optim.from_buffer_copy(bytes(o))
    f32 = lambda x: float(np.float32(x))  # noqa: E731
    out.lr = f32(lr_scaled)
    if o.kind != 0:
        t, lr = step + 1, lr_scaled * float(np.float32(o.scale))
        out.step_size = f32(lr / (1.0 - o.beta1_d ** t))
        out.bias2 = f32(1.0 / math.sqrt(1.0 - o.beta2_d ** t))
        out.decay_rate = f32(lr * float(np.float32(o.wd)))
    else:
        out.step_size, out.bias2, out.decay_rate = 0.0, 0.0, 0.0
    return out


def words(o: Optim) -> np.ndarray:
    """The table as the arena holds it: OPTIM_WORDS float32."""
    return np.frombuffer(bytes(o), np.float32).copy()


assert ctypes.sizeof(Optim) == 4 * OPTIM_WORDS
