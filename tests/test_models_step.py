"""The models step (steps/models.py over stack.py): many models in one chain of launches with a model axis.

GPU: every model of a stack, each with its own seed, learning rate, momentum or Adam settings, moves as the float64
reference (tests/mlp_reference.py) moves it over 10 steps; a model in a stack of several gets the very bits it gets
in a stack of its own (the model axis changes where its operands are, not its arithmetic); a sweep trained together
ends each model within 0.1 points of its test accuracy alone. CPU: planning, the kernels' units, the support rule.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import mlp_reference as ref
from rawgpu import steps
from rawgpu.steps import models as models_step
from rawgpu.runtime.errors import StepUnsupported
from rawgpu.kernels import Kernels
from rawgpu.kernels import dx_update as one_pass
from rawgpu.model.recipe import TEST_ROWS, TRAIN_ROWS, Recipe, loss_scale
from rawgpu.model.stack import ModelStack, stack_problem
from rawgpu.steps.base import StepOptions

gpu = pytest.mark.gpu
STEP_TOLERANCE = 3e-2  # one step from the GPU's own parameters (tests/test_mlp.py's fp32 tolerance)


def _recipes(n: int, **base) -> list[Recipe]:
    r = Recipe(**{"hidden": 64, "layers": 2, "batch": 32, "schedule": "constant", "total_steps": 10,
                  "train_rows": TRAIN_ROWS, "test_rows": TEST_ROWS, **base})
    sgd = r.optimizer == "sgd"
    momentum = {} if not (sgd and r.momentum) else lambda i: {"momentum": (0.9, 0.5, 0.8, 0.7)[i % 4]}
    return [replace(r, seed=11 + i, lr=r.lr * (1 + 0.5 * i), **(momentum(i) if momentum else {})) for i in range(n)]


# --- CPU ------------------------------------------------------------------------------------------------------


def test_a_sweep_chooses_the_models_step_and_plans_every_model():
    recipes = _recipes(5, hidden=256, layers=3, batch=128)
    choice = steps.choose(recipes[0], "sm_86", models=5)
    assert choice.kind == "models"
    stack = steps.plan_model(recipes[0], arch="sm_86", models=recipes)
    assert isinstance(stack, ModelStack) and stack.n == 5
    assert stack.step.kernel_count() == 4 * 4 + 2  # 4 layers
    assert stack.layers[1].w16.shape == (5 * 256, 256) and stack.acts[0].shape == (5 * 128, 784)
    units = stack.kernel_units()
    assert {("gemm_models.cu", "gemm_64x128_rr_bias_act_f32"), ("gather_models.cu", None)} <= units
    assert not any(u[0] == "gemm.cu" and u[1] and "tma" in u[1] for u in units)


def test_on_sm_90_the_models_step_is_the_layered_short_forms_kernels_over_models():
    for base, family in ((dict(momentum=0.9), "sgd"), (dict(optimizer="adam", lr=1e-3), "adam")):
        recipes = _recipes(32, hidden=256, layers=3, batch=128, **base)
        step = steps.plan_model(recipes[0], arch="sm_90", sm_count=132, models=recipes).step
        assert step.kernel_count() == 2 * 3 + 2 and "short form" in step.describe()
        units = step.kernel_units()
        assert {("head_models.cu", f"head_step_b128_{family}"), ("dx_update_models.cu", f"dx_update_b128_{family}")} \
            <= units and not any(s == "elementwise_models.cu" for s, _ in units)
        # no column ranges whose dx would meet in a workspace: a model's bits do not depend on N
        assert [p.splits for p in step.bwd[1:3]] == [1, 1] and step.bwd[0].IN == 784 and step.bwd[3] is None
        # every plan whose arithmetic a count could change is the same for 1 to 128 models (the first layer's
        # column ranges may differ: without dx each weight's update is its own)
        for n in (1, 8, 128):
            other = steps.plan_model(recipes[0], arch="sm_90", sm_count=132, models=recipes[:1] * n).step
            assert (other.head, other.fwd, other.bwd[1:]) == (step.head, step.fwd, step.bwd[1:])
    big = _recipes(2, hidden=256, layers=3, batch=300)
    long = steps.plan_model(big[0], arch="sm_90", models=big).step
    assert long.head is None and long.kernel_count() == 4 * 4 + 2
    assert "batch <= 256" in models_step.short_form_reason(big[0], "sm_90")
    assert "sm_90" in models_step.short_form_reason(big[0], "sm_86")


@pytest.mark.parametrize("arch,batch", [("sm_90", 128), ("sm_90", 300), ("sm_86", 128)])
def test_every_launch_of_the_models_step_binds_on_the_cpu(arch, batch, monkeypatch):
    """Each launch over the models packs its arguments as its kernel's declaration reads them (the model axis's
    strides included), short form and long, without a GPU."""
    from test_steps import _BindingKernels

    monkeypatch.setattr("rawgpu.runtime.driver.tensor_map_2d", lambda *a: bytes(128))
    recipes = _recipes(3, hidden=256, layers=2, batch=batch, momentum=0.9)
    stack = steps.plan_model(recipes[0], arch=arch, sm_count=132, models=recipes)
    stack.arena.base, stack.arena._allocated = 1 << 40, True
    stack.k = _BindingKernels(arch)
    names = [bound[0] for bound in stack.step._one_step()]
    assert names[0] == "gather_batch" and len(names) == stack.step.kernel_count(), names


def test_the_first_layer_streams_on_sm_90_and_its_launcher_refuses_what_it_cannot_run(monkeypatch):
    """sm_90's short form streams the first layer's update (update_stream_*, about one block an SM); the launcher
    refuses column ranges, two roles, a tile without a streamed instance and no blocks, each in one line."""
    from test_steps import _BindingKernels
    from rawgpu.kernels import model_axis as km

    monkeypatch.setattr("rawgpu.runtime.driver.tensor_map_2d", lambda *a: bytes(128))
    recipes = _recipes(3, hidden=256, layers=2, batch=128, momentum=0.9)
    stack = steps.plan_model(recipes[0], arch="sm_90", sm_count=132, models=recipes)
    stack.arena.base, stack.arena._allocated = 1 << 40, True
    stack.k = _BindingKernels("sm_90")
    step, lay = stack.step, stack.layers[0]
    assert step.stream_first and step.bwd[0].splits == 1
    assert [bound[0] for bound in step._one_step()][-1] == "update_stream_b128_sgd"
    assert ("dx_update_models.cu", "update_stream_b128_sgd") in step.kernel_units()

    def launch(plan, k=stack.k, blocks=132):
        return km.update_stream(k, 3, plan, stack.acts[0], stack.grads[1], lay.wlo, lay.w16, lay.mw, lay.vw,
                                stack.optim, lay.b, lay.mb, lay.vb, blocks)
    launch(step.bwd[0])
    for plan, k, blocks, message in ((replace(step.bwd[0], splits=2), stack.k, 132, "one column range"),
                                     (replace(step.bwd[0], roles=2), stack.k, 132, "one role"),
                                     (step.bwd[0], _BindingKernels("sm_86"), 132, "no streamed update"),
                                     (step.bwd[0], stack.k, 0, "at least one block")):
        with pytest.raises(ValueError, match=message) as err:
            launch(plan, k, blocks)
        assert "\n" not in str(err.value)
    sm86 = steps.plan_model(recipes[0], arch="sm_86", sm_count=84, models=recipes)
    assert not sm86.step.stream_first


@pytest.mark.parametrize("arch", ["sm_90", "sm_86"])
@pytest.mark.parametrize("table,gather", [(dict(inputs=54, classes=7, input_dtype="fp16", standardize=True),
                                           "gather_table_f16_labels_std"),
                                          (dict(inputs=30, classes=100, input_dtype="fp32"), "gather_table_f32_labels"),
                                          (dict(inputs=3072, classes=20, input_dtype="u8", standardize=True),
                                           "gather_table_u8_labels_std")])
def test_a_tables_stack_binds_its_table_gather_over_the_models(arch, table, gather, monkeypatch):
    """A table's classification over models: the table gather with a model axis (its dtype, standardized or not),
    and every other launch as for images; the evaluation's gather the table's too."""
    from test_steps import _BindingKernels

    monkeypatch.setattr("rawgpu.runtime.driver.tensor_map_2d", lambda *a: bytes(128))
    recipes = _recipes(3, hidden=256, layers=2, batch=128, momentum=0.9, **table)
    assert models_step.unsupported_reason(recipes[0], arch) is None
    stack = steps.plan_model(recipes[0], arch=arch, sm_count=132, models=recipes)
    stack.arena.base, stack.arena._allocated = 1 << 40, True
    stack.k = _BindingKernels(arch)
    names = [bound[0] for bound in stack.step._one_step()]
    assert names[0] == gather and len(names) == stack.step.kernel_count(), names
    assert [bound[0] for bound in stack.eval_launches()][1] == gather.replace("_labels", "_labels")
    regression = replace(recipes[0], loss="mse", classes=1)
    assert "scores class labels" in models_step.unsupported_reason(regression, arch)


def test_the_models_step_is_no_single_models_kind():
    assert "models" in steps.KINDS and "models" not in steps.ONE_GPU and "models" not in steps.CHOICES
    with pytest.raises(ValueError, match="give models"):
        steps.plan_model(Recipe(), steps.Choice("models", "test"), arch="sm_90")


def test_models_that_cannot_share_a_stack_say_why():
    a, b = _recipes(2)
    assert stack_problem([a, b]) is None
    assert "batch" in stack_problem([a, replace(b, batch=64)])
    assert "family" in stack_problem([a, replace(b, optimizer="adam", lr=1e-3, momentum=None)])  # adam: none
    with pytest.raises(StepUnsupported, match="fp16 accumulation"):
        steps.choose(replace(a, accum="fp16"), "sm_90", models=2)


# --- GPU ------------------------------------------------------------------------------------------------------


class FakeMNIST:
    """Random images with labels a linear teacher gives (coherent gradients), shaped like MNIST."""

    def __init__(self, rng):
        self.train_images = rng.integers(0, 256, (TRAIN_ROWS, 784), dtype=np.uint8)
        self.test_images = rng.integers(0, 256, (TEST_ROWS, 784), dtype=np.uint8)
        teacher = rng.standard_normal((784, 10))
        self.train_labels = (self.train_images @ teacher).argmax(1).astype(np.uint8)
        self.test_labels = (self.test_images @ teacher).argmax(1).astype(np.uint8)


def _stack(device, stream, kernels, data, recipes, perms, short: bool = True,
           sm_count: int | None = None) -> ModelStack:
    stack = steps.plan_model(recipes[0], kernels=kernels, sm_count=sm_count or device.sm_count, models=recipes,
                             options=StepOptions(short=short)).allocate()
    stack.upload_data(data)
    stack.init_parameters(stream)
    stack.set_permutations(perms)
    return stack


def _params(stack: ModelStack, m: int):
    weights, _ = stack.model_state(m)
    return weights


def _state(stack: ModelStack, m: int) -> dict:
    """Model m's optimiser state as MLP.optimizer_state gives it (units of the mean-loss gradient)."""
    s, (_, state) = float(loss_scale(stack.recipe.batch)), stack.model_state(m)
    out = {}
    for key, name, power in (("m", "momentum" if stack.recipe.optimizer == "sgd" else "exp_avg", 1),
                             ("v", "exp_avg_sq", 2)):
        if f"layers.0.{name}_weight" in state:
            out[key] = [(state[f"layers.{i}.{name}_weight"].astype(np.float64) / s ** power,
                         state[f"layers.{i}.{name}_bias"].astype(np.float64) / s ** power)
                        for i in range(len(stack.layers))]
    return out


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module")
def kernels(device):
    return Kernels(device.arch)


# The stacks each form is checked on: both forms, but the short form not past the one pass's batch (that stack would
# run the long form under the short form's name).
STACKS = [(3, dict(momentum=0.9)), (4, dict(hidden=256, layers=3, batch=128, momentum=0.9)),
          (2, dict(momentum=0.0, batch=33, hidden=100)),
          (3, dict(optimizer="adam", lr=1e-3, weight_decay=1e-4, hidden=128)),
          (2, dict(batch=300, hidden=72, momentum=0.9, nesterov=True, weight_decay=5e-4)),
          # planned for 8 SMs: the plans of many models per SM (the gather's blocks take 4 rows each, the head 2
          # CTAs, the first layer's one pass no column ranges)
          (4, dict(hidden=256, layers=3, batch=128, momentum=0.9, sm_count=8)),
          (2, dict(hidden=600, batch=64, momentum=0.9)),  # a head of 4 CTAs
          (3, dict(hidden=(512, 136, 256), layers=None, batch=64, momentum=0.9)),
          # activations whose backward reads the saved slope, and one that reads the output
          (3, dict(activation="gelu", momentum=0.9)),
          (2, dict(activation="silu", optimizer="adam", lr=1e-3, hidden=(256, 128), layers=None, batch=128)),
          (2, dict(activation="tanh", momentum=0.9, hidden=136, layers=3))]
FORMS = [pytest.param(n, base, short, id=f"{i}-{'short' if short else 'long'}")
         for i, (n, base) in enumerate(STACKS) for short in (True, False)
         if not short or base.get("batch", Recipe().batch) <= one_pass.MAX_BATCH]


@gpu
@pytest.mark.parametrize("n,base,short", FORMS)
def test_every_model_of_a_stack_follows_the_float64_reference(device, stream, kernels_for, rng, n, base, short):
    """Both forms where the short one runs (sm_90, batch <= 256): the head kernel and the one passes over models,
    and the long form's GEMMs, softmax and bias steps; the loss metric too."""
    data = FakeMNIST(rng)
    base = dict(base)
    sm_count = base.pop("sm_count", None)
    recipes = _recipes(n, **{"lr": 0.05, **base})
    perms = [rng.permutation(TRAIN_ROWS).astype(np.int32) for _ in recipes]
    activation = recipes[0].activation
    stack = _stack(device, stream, kernels_for(activation), data, recipes, perms, short, sm_count)
    try:
        if short and stack.step.head is None:
            pytest.skip(f"no short form here: {models_step.short_form_reason(recipes[0], device.arch)}")
        _follow_the_reference(stack, stream, recipes, perms, (data.train_images / 255.0).astype(np.float16),
                              data.train_labels)
    finally:
        stack.arena.close()


def _follow_the_reference(stack, stream, recipes, perms, x_all, labels, steps: int = 10) -> None:
    """`steps` steps of every model of the stack, each against the float64 reference from its own parameters and
    state before the step (x_all: the features as the gather writes them, fp16), hidden outputs poisoned first."""
    step, adam, n = stack.step_launches(), recipes[0].optimizer != "sgd", len(recipes)
    for s in range(steps):
        before = [(_params(stack, m), _state(stack, m)) for m in range(n)]
        poison = np.full(stack.acts[1].shape, np.nan, np.float16)
        stack.acts[1].upload(poison)  # every model's hidden activations are written by this step
        stack.grads[1].upload(poison)
        if stack.slopes[1] is not None:
            stack.slopes[1].upload(poison)
        stack.zero_metrics()
        for launch in step:
            launch.run(stream)
        stream.synchronize()
        loss_sums, _ = stack.train_metrics()
        hidden = [t.download() for t in stack.acts[1:-1]]  # every model's, for the ReLUs at their kink
        for m, r in enumerate(recipes):
            rows = perms[m][s * r.batch:(s + 1) * r.batch]
            params, state = before[m]
            mine = [h[m * r.batch:(m + 1) * r.batch] for h in hidden]
            loss, _, grads = ref.loss_and_grads(params, x_all[rows], labels[rows].astype(np.int64), fp16_storage=True,
                                                grad_scale=loss_scale(r.batch), activation=r.activation,
                                                device_hidden=mine)
            assert abs(loss_sums[m] / r.batch - loss) <= 1e-2 * max(loss, 1.0), f"model {m}, step {s}: loss"
            expect, expect_state = ref.optimizer_step(params, grads, r, r.lr, state or None, s)
            got = _params(stack, m)
            key = "m" if adam else None
            pairs = (zip(_state(stack, m)[key], expect_state[key], state[key]) if adam else
                     zip(got, expect, params))
            errors = [max(_rel(w - w0, ew - w0), _rel(b - b0, eb - b0)) for (w, b), (ew, eb), (w0, b0) in pairs]
            assert max(errors) <= STEP_TOLERANCE, f"model {m}, step {s}, per layer: {errors}"
    assert stack.step_count() == steps


@gpu
@pytest.mark.parametrize("table", [dict(features=54, dtype="float32", input_dtype="fp16", standardize=True, classes=7),
                                   dict(features=30, dtype="float32", input_dtype="fp32", standardize=False,
                                        classes=100),
                                   dict(features=200, dtype="uint8", input_dtype="u8", standardize=True, classes=20)])
@pytest.mark.parametrize("short", [True, False], ids=["short", "long"])
def test_every_model_of_a_tables_stack_follows_the_float64_reference(device, stream, kernels, rng, table, short):
    """A table's models together (the table gather over models: fp16, fp32 or bytes, standardized by the data's own
    scaling, computed once on the GPU for all; 100 classes: the long form's head over models): each moves as the
    float64 reference moves it over 10 steps, from the features as the gather writes them, and each evaluates to
    its own parameters' accuracy."""
    from test_tables_gpu import fake_table

    from rawgpu.model.mlp import feature_scaling, kept_features
    from rawgpu.training.trainer import fit_to_data

    table = dict(table)
    data = fake_table(rng, 4096, table.pop("features"), table.pop("dtype"), classes=table.pop("classes"))
    recipes = [fit_to_data(r, data) for r in _recipes(3, lr=0.05, hidden=128, batch=64, momentum=0.9, **table)]
    perms = [rng.permutation(recipes[0].train_rows).astype(np.int32) for _ in recipes]
    stack = steps.plan_model(recipes[0], kernels=kernels, sm_count=device.sm_count, models=recipes,
                             options=StepOptions(short=short)).allocate()
    try:
        stack.upload_data(data)
        kept = kept_features(data.train_images, recipes[0]._input_dtype, "x")
        if recipes[0].standardize:
            stack.compute_scaling(stream)
            mean, inv = stack.scaling()
            host_mean, host_inv = feature_scaling(kept)
            assert np.allclose(mean, host_mean, rtol=1e-5, atol=1e-6) and np.allclose(inv, host_inv, rtol=1e-5)
        stack.init_parameters(stream)
        stack.set_permutations(perms)
        f = kept.astype(np.float32) * (np.float32(1 / 255) if kept.dtype == np.uint8 else np.float32(1))
        if recipes[0].standardize:
            f = (f - mean) * inv
        if short and stack.step.head is None and recipes[0]._padded_classes == 16:
            pytest.skip(f"no short form here: {models_step.short_form_reason(recipes[0], device.arch)}")
        _follow_the_reference(stack, stream, recipes, perms, f.astype(np.float16), data.train_labels)
        stack.zero_eval_metrics()
        for launch in stack.eval_launches():
            launch.run(stream)
        stream.synchronize()
        _, accuracy = stack.eval_metrics()
        test = kept_features(data.test_images, recipes[0]._input_dtype, "x").astype(np.float32)
        test = test * (np.float32(1 / 255) if kept.dtype == np.uint8 else np.float32(1))
        if recipes[0].standardize:
            test = (test - mean) * inv
        for m in range(3):
            out = ref.forward(_params(stack, m), test.astype(np.float16), fp16_storage=True)[-1]
            assert abs(accuracy[m] - (out.argmax(1) == data.test_labels).mean()) <= 2 / len(test)
    finally:
        stack.arena.close()


@gpu
@pytest.mark.parametrize("base", [dict(hidden=256, layers=3, batch=128, momentum=0.9),
                                  dict(optimizer="adamw", lr=2e-3, weight_decay=0.05, batch=300, schedule="cosine",
                                       warmup_steps=3)])
def test_a_model_in_a_stack_gets_the_bits_of_a_stack_of_its_own(device, stream, kernels, rng, base):
    data = FakeMNIST(rng)
    recipes = _recipes(3, **base)
    perms = [rng.permutation(TRAIN_ROWS).astype(np.int32) for _ in recipes]
    together = _stack(device, stream, kernels, data, recipes, perms)
    try:
        for launch in together.step_launches(7):
            launch.run(stream)
        stream.synchronize()
        got = [together.model_state(m) for m in range(3)]
    finally:
        together.arena.close()
    for m in range(3):
        alone = _stack(device, stream, kernels, data, recipes[m:m + 1], perms[m:m + 1])
        try:
            for launch in alone.step_launches(7):
                launch.run(stream)
            stream.synchronize()
            weights, state = alone.model_state(0)
        finally:
            alone.arena.close()
        assert set(state) == set(got[m][1])
        for name, value in state.items():
            assert value.tobytes() == got[m][1][name].tobytes(), f"model {m}: {name} differs"
        for (w, b), (gw, gb) in zip(weights, got[m][0]):
            assert w.tobytes() == gw.tobytes() and b.tobytes() == gb.tobytes()


@gpu
def test_the_stacks_evaluation_is_each_models_own(device, stream, kernels, rng):
    data = FakeMNIST(rng)
    recipes = _recipes(3, hidden=128)
    perms = [rng.permutation(TRAIN_ROWS).astype(np.int32) for _ in recipes]
    stack = _stack(device, stream, kernels, data, recipes, perms)
    try:
        for launch in stack.step_launches(20):
            launch.run(stream)
        stack.zero_eval_metrics()
        stack.eval_logits.upload(np.full(stack.eval_logits.shape, np.nan, np.float16))
        for launch in stack.eval_launches():
            launch.run(stream)
        stream.synchronize()
        loss, accuracy = stack.eval_metrics()
        for m in range(3):
            logits = ref.forward(_params(stack, m), data.test_images / 255.0, fp16_storage=True)[-1]
            expect = float((logits.argmax(1) == data.test_labels).mean())
            # fp16 logits of random data: near-ties may fall either way
            assert abs(accuracy[m] - expect) <= 0.01, f"model {m}: {accuracy[m]} vs float64 {expect}"
            assert np.isfinite(loss[m])
    finally:
        stack.arena.close()


@gpu
@pytest.mark.parametrize("n,B,IN,N,opt", [(3, 128, 784, 256, dict(momentum=0.9)),
                                          (5, 100, 200, 136, dict(optimizer="adam")),
                                          (2, 64, 136, 72, dict(momentum=0.0)),
                                          (4, 32, 784, 128, dict(optimizer="adamw")),
                                          (2, 256, 520, 256, dict(momentum=0.9, nesterov=True))])
def test_the_streamed_first_layer_update_gives_the_band_kernels_bits(device, stream, kernels, rng, n, B, IN, N, opt):
    """The models step's first layer streamed (model_axis.update_stream: runs of every model's chunks, one block or
    seven, one an SM, more than there are chunks) against the band kernel over the models (model_axis.dx_update
    without dx: a block a band, which tests/test_dx_update.py checks against float64): every model's master halves,
    optimiser state, bias and its state bit for bit, each model with its own optimiser row; partial bands and chunks
    (IN, N not multiples of 64), a batch under its tile."""
    from rawgpu.contract import OPTIM_WORDS
    from rawgpu.kernels import dx_update as ku
    from rawgpu.kernels import model_axis as km
    from rawgpu.model import master, optimizer
    from rawgpu.runtime.memory import Arena

    recipe = Recipe(**opt)
    plan = ku.plan_dx_update(B, IN, N, recipe.optimizer, device.arch, splits=1, cluster=False, dx=False, roles=1)
    if not km.streams_update(device.arch, B, plan.family):
        pytest.skip(f"{device.arch} builds no streamed update for a {plan.rows}-row tile with {plan.family}")
    states = recipe._state_tensors
    with Arena() as arena:
        x = arena.tensor("x", (n * B, IN), np.float16)
        dy = arena.tensor("dy", (n * B, N), np.float16)
        w16, wlo = arena.tensor("w16", (n * IN, N), np.float16), arena.tensor("wlo", (n * IN, N), np.int16)
        sw = [arena.tensor(f"s{i}", (n * IN, N), np.float32) for i in range(states)]
        bias = arena.tensor("b", (n * N,), np.float32)
        sb = [arena.tensor(f"sb{i}", (n * N,), np.float32) for i in range(states)]
        optim = arena.tensor("optim", (n, OPTIM_WORDS), np.float32)
        arena.allocate()
        x.upload((rng.standard_normal((n * B, IN)) * 0.5).astype(np.float16))
        dy.upload((rng.standard_normal((n * B, N)) * 0.5).astype(np.float16))
        hi, lo = master.split((rng.standard_normal((n * IN, N)) * 0.05).astype(np.float32))
        w16.upload(hi)
        wlo.upload(lo)
        for t in sw + sb:
            t.upload(np.abs(rng.standard_normal(t.shape)).astype(np.float32) * 1e-3)
        bias.upload(rng.standard_normal(n * N).astype(np.float32) * 0.1)
        hyper = optimizer.hyperparameters(recipe)
        optim.upload(np.stack([optimizer.words(optimizer.step_values(hyper, 3, 1e-2 * (1 + m))) for m in range(n)]))
        arrays = [w16, wlo, bias, *sw, *sb]
        before = [t.download().copy() for t in arrays]
        m_, v_ = (sw + [None, None])[:2]
        mb, vb = (sb + [None, None])[:2]

        def run(launch):
            for t, v in zip(arrays, before):
                t.upload(v)
            launch.run(stream)
            stream.synchronize()
            return [t.download().copy() for t in arrays]

        want = run(km.dx_update(kernels, n, plan, x, dy, wlo, w16, m_, v_, None, optim, bias, mb, vb))
        assert np.count_nonzero(want[1] != before[1]) > n * IN * N // 2  # the update moved the low halves
        for blocks in (1, 7, device.sm_count, 1 << 20):
            got = run(km.update_stream(kernels, n, plan, x, dy, wlo, w16, m_, v_, optim, bias, mb, vb, blocks))
            for g, w, t in zip(got, want, arrays):
                assert g.tobytes() == w.tobytes(), f"{blocks} blocks: {t.name} differs from the band kernel's"
