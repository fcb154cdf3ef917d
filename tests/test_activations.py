"""The hidden layers' activation (issue 46): the recipe and CLI values, which step kinds take it and what the launch
line says where one cannot, the kernels built for it, the launchers' checks of the slope the forward saves, and the
float64 reference's activations against torch's definitions. The GPU's steps against that reference, for every
activation on every kind that takes it: tests/test_mlp.py, test_models_step.py, test_sharded.py, test_replicated.py."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

import mlp_reference as ref
from rawgpu.runtime import compiler
from rawgpu import contract, steps
from rawgpu.runtime.errors import StepUnsupported
from rawgpu.runtime.memory import Arena
from rawgpu.model.recipe import ACTIVATIONS, SLOPE_SAVED, Recipe

NON_DEFAULT = [a for a in ACTIVATIONS if a != "relu"]


def test_a_recipe_takes_every_activation_and_refuses_others():
    assert Recipe().activation == "relu" and Recipe().name == "784-256-256-256-10"
    for act in ACTIVATIONS:
        r = Recipe(activation=act)
        assert Recipe.from_dict(r.to_dict()) == r
        assert r._saves_slope == (act in ("gelu", "gelu_tanh", "silu"))
    assert Recipe(activation="gelu").name == "784-256-256-256-10 gelu"
    with pytest.raises(ValueError, match="activation: must be one of relu, gelu, gelu_tanh, silu, tanh, got 'swish'"):
        Recipe(activation="swish")
    assert Recipe.from_dict({k: v for k, v in Recipe().to_dict().items() if k != "activation"}).activation == "relu"


@pytest.mark.parametrize("tool", ["train", "sweep", "compile"])
def test_an_unknown_activation_is_one_line_and_exit_2_before_any_gpu_work(tool):
    p = subprocess.run([sys.executable, "-m", f"rawgpu.{tool}", "--activation", "swish"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and p.stdout == ""
    last = p.stderr.strip().splitlines()[-1]
    assert "argument --activation: invalid choice: 'swish'" in last and "Traceback" not in p.stderr


def test_the_cluster_and_fused_steps_keep_relu_and_the_launch_line_says_so():
    gelu_small = Recipe(hidden=128, batch=32, momentum=0.0, activation="gelu")
    choice = steps.choose(gelu_small, "sm_90")
    assert choice.kind == "layered"
    assert choice.fallback_note() == "; not cluster: the cluster step applies ReLU only, not gelu"
    choice = steps.choose(Recipe(activation="tanh"), "sm_86")  # fused would run this width with ReLU here
    assert choice.kind == "layered"
    assert choice.fallback_note() == "; not fused: the fused step applies ReLU only, not tanh"
    assert steps.choose(Recipe(activation="silu"), "sm_90").fallback_note() == ""  # the short form takes it
    assert steps.choose(Recipe(), "sm_86").fallbacks == {}
    for kind in ("fused", "cluster"):
        with pytest.raises(StepUnsupported, match=f"{kind} cannot run this recipe: the {kind} step applies ReLU only"):
            steps.choose(Recipe(hidden=128, batch=32, momentum=0.0, activation="silu"), "sm_90", kind)
    assert "ReLU only" in steps.help_text()
    # a sweep's models step and the parallel kinds take every activation
    assert steps.choose(Recipe(activation="gelu"), "sm_90", models=4).kind == "models"
    assert steps.choose(Recipe(activation="gelu"), "sm_90", "tensor", ranks=2).kind == "tensor"


def test_a_build_applies_its_activation_where_the_source_has_one():
    for act, code in ACTIVATIONS.items():
        defines, _ = contract.build("head.cu", "sm_90", activation=act)
        assert f"-DACTIVATION={code}" in defines
        assert f"-DACT_SAVES_SLOPE={int(act in SLOPE_SAVED)}" in defines
    assert not any("ACTIVATION" in d for d in contract.build("loss.cu", "sm_90", activation="gelu")[0])
    key = lambda source, act: compiler.cache_key(source, "sm_90", (), activation=act)  # noqa: E731
    assert key("dx_sgd.cu", "relu") != key("dx_sgd.cu", "gelu") and key("loss.cu", "relu") == key("loss.cu", "gelu")
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        contract.build("head.cu", "sm_90", activation="swish")


@pytest.mark.parametrize("activation", NON_DEFAULT)
def test_every_kernel_a_step_launches_builds_for_each_activation(activation):
    """The units of the layered step (short form on sm_90, long on sm_86), the tensor-parallel sums' epilogues and
    the models step, built for the activation by NVRTC (no GPU needed)."""
    units = set()
    for arch in ("sm_90", "sm_86"):
        r = Recipe(hidden=(256, 128), batch=128, activation=activation)
        units |= {(u, arch) for u in steps.plan_model(r, arch=arch).kernel_units()}
        units |= {(u, arch) for u in steps.plan_model(r, arch=arch, models=[r, r]).kernel_units()}
        units |= {(u, arch) for u in steps.plan_model(Recipe(hidden=256, batch=32, momentum=0.0, activation=activation),
                                                      arch=arch).kernel_units()}
    for (source, kernel), arch in sorted(units, key=lambda u: (u[0][0], u[0][1] or "", u[1])):
        module = compiler.compile_source(source, arch, kernel=kernel, activation=activation)
        assert module.cubin


def test_the_saved_slope_goes_where_the_activation_reads_it():
    from rawgpu.kernels import dx_update as ku
    from rawgpu.kernels import head as kh

    class Bound:
        arch = "sm_90"

        def __init__(self, activation):
            self.activation = activation

        def get(self, source, name):
            return type("K", (), {"bind": lambda _, grid, block, smem, *args, **kw: args})()

    a = Arena()
    x, dy, dx = (a.tensor(n, (128, 256), np.float16) for n in ("x", "dy", "dx"))
    slope = a.tensor("slope", (128, 256), np.float16)
    wlo, w16 = a.tensor("wlo", (256, 256), np.int16), a.tensor("w16", (256, 256), np.float16)
    mw, optim = a.tensor("mw", (256, 256), np.float32), a.tensor("optim", contract.OPTIM_WORDS, np.float32)
    plan = ku.plan_dx_update(128, 256, 256, "sgd", "sm_90", splits=1)
    launch = lambda k, p: ku.dx_update(k, plan, x, dy, wlo, w16, mw, None, dx, optim, slope=p)  # noqa: E731
    assert launch(Bound("gelu"), slope)[-1] is slope and launch(Bound("relu"), None)[-1] == 0
    with pytest.raises(ValueError, match="dx_update: gelu's backward reads the slope the forward saved: pass slope"):
        launch(Bound("gelu"), None)
    with pytest.raises(ValueError, match="dx_update: pass no slope \\(tanh's backward reads the output\\)"):
        launch(Bound("tanh"), slope)
    with pytest.raises(ValueError, match="expected shape \\(128, 256\\)"):
        launch(Bound("silu"), a.tensor("short", (64, 256), np.float16))
    with pytest.raises(ValueError, match="pass no slope \\(no fp16 gradient to scale here\\)"):
        ku.dx_update(Bound("gelu"), plan, x, dy, wlo, w16, mw, None, None, optim, slope=slope)
    head = kh.plan_head(128, 256, "sgd")
    hw = (a.tensor("hlo", (256, 16), np.int16), a.tensor("h16", (256, 16), np.float16))
    args = (a.tensor("y", 128, np.int32), *hw, a.tensor("hb", 16, np.float32), optim,
            a.tensor("logits", (128, 16), np.float16), a.tensor("dlogits", (128, 16), np.float16), dx,
            a.tensor("loss", 1, np.float64), a.tensor("correct", 1, np.int32), 10, 512.0)
    with pytest.raises(ValueError, match="head_step: silu's backward reads the slope the forward saved"):
        kh.head_step(Bound("silu"), head, x, *args)
    assert kh.head_step(Bound("silu"), head, x, *args, slope=slope)[-2] is slope  # before the loss's code


def test_a_model_keeps_slopes_only_where_its_backward_reads_them():
    relu = steps.plan_model(Recipe(hidden=(256, 128)), arch="sm_90")
    assert relu.slopes == [None] * 4 and relu.saved_for_backward(2) is relu.acts[2]
    gelu = steps.plan_model(Recipe(hidden=(256, 128), activation="gelu"), arch="sm_90")
    assert gelu.slopes[0] is None and gelu.slopes[3] is None
    assert [t.shape for t in gelu.slopes[1:3]] == [gelu.acts[1].shape, gelu.acts[2].shape]
    assert gelu.saved_for_backward(1) is gelu.slopes[1]
    stack = steps.plan_model(Recipe(activation="silu"), arch="sm_90", models=[Recipe(activation="silu")] * 3)
    assert stack.slopes[1].shape == stack.acts[1].shape and stack.slopes[-1] is None


def test_the_reference_activations_are_torchs():
    """Values from torch's definitions (erf GELU, tanh GELU, SiLU), and each derivative against central differences."""
    z = np.array([-3.0, -1.0, -0.25, 0.0, 0.5, 1.0, 2.5])
    phi = np.array([0.5 * (1 + math.erf(v / math.sqrt(2))) for v in z])
    t = np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3))
    expect = {"relu": np.maximum(z, 0), "gelu": z * phi, "gelu_tanh": 0.5 * z * (1 + t),
              "silu": z / (1 + np.exp(-z)), "tanh": np.tanh(z)}
    assert ref.ACTIVATIONS["gelu"][0](np.array([1.0]))[0] == pytest.approx(0.8413447460685429, abs=1e-15)
    for name, (f, df) in ref.ACTIVATIONS.items():
        np.testing.assert_allclose(f(z), expect[name], rtol=1e-15, atol=1e-15)
        smooth = z[z != 0.0] if name == "relu" else z
        eps = 1e-6
        numeric = (f(smooth + eps) - f(smooth - eps)) / (2 * eps)
        np.testing.assert_allclose(df(smooth, f(smooth)), numeric, rtol=1e-7, atol=1e-8)


def test_the_benchmarks_peers_take_the_activation_by_torchs_name():
    from peers.common import ACTIVATIONS as PEER_ACTIVATIONS
    from peers.common import Workload

    assert PEER_ACTIVATIONS == tuple(ACTIVATIONS)
    assert Workload(hidden=256, activation="gelu_tanh").activation == "gelu_tanh"
    with pytest.raises(ValueError, match="Workload.activation must be one of relu, gelu, gelu_tanh, silu, tanh"):
        Workload(hidden=256, activation="swish")


def test_a_model_takes_only_kernels_built_for_its_arch_and_activation():
    from rawgpu.kernels import Kernels

    model = steps.plan_model(Recipe(activation="gelu"), arch="sm_90")
    with pytest.raises(ValueError, match="^the model applies gelu, the kernels were built for relu$"):
        model.bind(Kernels("sm_90"))
    with pytest.raises(ValueError, match="^the model was planned for sm_90, the kernels are sm_86's$"):
        model.bind(Kernels("sm_86", activation="gelu"))
    stack = steps.plan_model(Recipe(), arch="sm_90", models=[Recipe()] * 2)
    with pytest.raises(ValueError, match="^the stack applies relu, the kernels were built for silu$"):
        stack.bind(Kernels("sm_90", activation="silu"))
    assert model.bind(Kernels("sm_90", activation="gelu")).k.activation == "gelu"
