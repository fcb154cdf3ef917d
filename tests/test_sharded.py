"""The tensor-parallel model (rawgpu/steps/sharded.py, steps/tensor.py): the shapes each rank holds (CPU), and on one
GPU every rank of a 1-, 2- or 3-way split run side by side, their all-reduces done in lockstep on the host: one rank is
the one-GPU long-form step bit for bit, several ranks together train as one GPU does (float64 reference)."""

from __future__ import annotations

import numpy as np
import pytest

import mlp_reference as ref
from rawgpu.steps import split as parallel
from rawgpu.model.recipe import TEST_ROWS, TRAIN_ROWS, Recipe, loss_scale
from rawgpu.steps.sharded import ShardedMLP, join_parameters, join_state
from rawgpu.steps import StepOptions, plan_model
from mlp_reference import relative as _rel
from test_mlp import FakeMNIST, _batch

gpu = pytest.mark.gpu
STEP_TOLERANCE = 3e-2  # one step from the ranks' own parameters, as tests/test_mlp.py allows one GPU
ADAM_ARITHMETIC = ref.ADAM_ARITHMETIC


# --- CPU: the shapes ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden,layers,ranks", [(256, 3, 1), (256, 3, 2), (100, 3, 3), (520, 2, 4), (64, 1, 2)])
def test_each_rank_holds_a_chain_of_slices_that_add_up_to_the_model(hidden, layers, ranks):
    recipe = Recipe(hidden=hidden, layers=layers, batch=128)
    models = [plan_model(recipe, "tensor", ranks=ranks, rank=r, arch="sm_90") for r in range(ranks)]
    for m in models:
        assert [lay.w16.shape for lay in m.layers] == list(zip(m.padded, m.padded[1:]))
        assert m.padded[0] == 784 and m.padded[-1] == 16
        assert m.step.kind == "tensor" and "tensor parallel" in m.step.describe()
        assert m.choice.reason in m.step.describe() and m.choice.kind == "tensor"
    for i, s in enumerate(models[0].plan.shards):  # the true columns (or rows) of the ranks add up to the layer
        true = [(m.layers[i].fan_in, m.layers[i].fan_out) for m in models]
        if s.split == "columns":
            assert sum(t[1] for t in true) == recipe.widths[i + 1] and {t[0] for t in true} == {recipe.widths[i]}
        elif s.split == "rows":
            assert sum(t[0] for t in true) == recipe.widths[i] and {t[1] for t in true} == {recipe.widths[i + 1]}
        else:
            assert set(true) == {(recipe.widths[i], recipe.widths[i + 1])}


@pytest.mark.parametrize("arch,short", [("sm_90", True), ("sm_90", False), ("sm_86", True)])
def test_the_gemms_write_fp32_where_the_ranks_sum(arch, short):
    """The forward of the row-split layers and the input gradient of the column-split one below the top are
    written in fp32: by the GEMM (store32), or by the short form's one pass (sm_90), which writes every dx."""
    m = plan_model(Recipe(hidden=256, layers=3, batch=128), "tensor", ranks=2, rank=0, arch=arch,
                   options=StepOptions(short=short))
    assert [lay.eval_fwd.epilogue for lay in m.layers] == ["bias_act", "store32", "bias_act", "store32"]
    assert [p.fwd.epilogue for p in m.step.plans] == ["bias_act", "store32", "bias_act", "store32"]
    one_pass = short and arch == "sm_90"
    assert [p.dx and p.dx.epilogue for p in m.step.plans] == ([None] * 4 if one_pass
                                                              else [None, "dact", "store32", "dact"])
    assert all((p.bwd is not None) == one_pass and (p.dw is None) == one_pass for p in m.step.plans)
    # gather, 4 forwards, the backward (4 one passes, or 3 input gradients and 4 updates), 3 epilogues after the
    # sums, the loss and the counter
    assert m.step.kernel_count() == 1 + 4 + (4 if one_pass else 3 + 8) + 3 + 2


@pytest.mark.parametrize("ranks", [3, 8])
def test_joining_the_ranks_parts_gives_the_whole_model_back(rng, ranks):
    recipe = Recipe(hidden=100, layers=3, batch=32)
    widths = recipe.widths
    plan = parallel.plan_tensor_parallel(widths, 32, ranks)
    whole = [(rng.standard_normal((a, b)), rng.standard_normal(b)) for a, b in zip(widths, widths[1:])]
    parts, states = [], []
    for rank in range(ranks):
        m = plan_model(recipe, "tensor", ranks=ranks, rank=rank)
        mine, state = [], {}
        for i, ((w, b), lay) in enumerate(zip(whole, m.layers)):
            wp = np.zeros((plan.widths[i], plan.widths[i + 1]))
            wp[:w.shape[0], :w.shape[1]] = w
            bp = np.zeros(plan.widths[i + 1])
            bp[:len(b)] = b
            ws, bs = parallel.shard(plan, i, rank, wp, bp)
            mine.append((ws[:lay.fan_in, :lay.fan_out], bs[:lay.fan_out]))
            assert np.array_equal(m._part(i, w), mine[-1][0]) and np.array_equal(m._part(i, b), mine[-1][1])
            state[f"layers.{i}.momentum_weight"], state[f"layers.{i}.momentum_bias"] = mine[-1]
        parts.append(mine)
        states.append(state)
    for (w, b), (jw, jb) in zip(whole, join_parameters(plan, parts)):
        assert np.array_equal(w, jw) and np.array_equal(b, jb)
    joined = join_state(plan, states)
    for i, (w, b) in enumerate(whole):
        assert np.array_equal(joined[f"layers.{i}.momentum_weight"], w)
        assert np.array_equal(joined[f"layers.{i}.momentum_bias"], b)
    states[1]["layers.1.momentum_bias"] = states[1]["layers.1.momentum_bias"] + 1  # a whole bias that differs
    with pytest.raises(ValueError, match="differ"):
        join_state(plan, states)


def test_the_ranks_split_moves_fewer_bytes_and_the_step_says_why():
    """steps.choose (through parallel.choose) picks the split; the rank's model and step are that split's, and the
    step's description carries the reason."""
    from rawgpu.steps.replicated import ReplicatedMLP

    def model(batch, ranks, mode="auto"):
        return plan_model(Recipe(hidden=256, batch=batch), mode, ranks=ranks, arch="sm_90")

    small_batch = model(128, 2)
    assert isinstance(small_batch, ShardedMLP) and small_batch.kind == "tensor"
    assert "3 all-reduces of activations move 0.27 MB per rank and step" in small_batch.step.describe()
    large_batch = model(4096, 2)
    assert isinstance(large_batch, ReplicatedMLP) and large_batch.kind == "data"
    assert "the gradients move 1.34 MB per rank and step" in large_batch.step.describe()
    assert model(4096, 3).kind == "tensor" and "does not split over 3 ranks" in model(4096, 3).step.describe()
    assert model(1, 1).kind == "tensor" and "(one rank)" in model(1, 1).step.describe()
    assert model(4096, 2, "tensor").kind == "tensor" and model(128, 2, "data").kind == "data"
    assert "asked for by name" in model(128, 2, "data").step.describe()
    with pytest.raises(ValueError, match="data parallelism cannot run here: the batch of 100 does not split over 3"):
        model(100, 3, "data")
    with pytest.raises(ValueError, match="parallel mode must be one of auto, tensor, data"):
        model(128, 2, "pipeline")


def test_a_bad_rank_is_refused():
    with pytest.raises(ValueError, match="rank must be in 0..1"):
        plan_model(Recipe(), "tensor", ranks=2, rank=2)


# --- GPU: the ranks side by side on one GPU ----------------------------------------------------------------------


class HostSum:
    """A stand-in for one all-reduce of nccl.Communicator: the lockstep runner sums the ranks' buffers on the host,
    in their dtype and rank order."""

    def __init__(self, send, recv, count):
        self.send, self.recv, self.count = send, recv, count

    def run(self, stream):
        raise AssertionError("a HostSum runs only in lockstep with the other ranks'")

    def overlapping(self):
        return self


class HostGroup:
    def all_reduce(self, send, recv, count):
        return HostSum(send, recv, count)


def run_lockstep(step_lists, stream):
    """Every rank's launches in turn; at each all-reduce (at the same place in every list) the ranks' sums."""
    for items in zip(*step_lists):
        if isinstance(items[0], HostSum):
            assert all(isinstance(x, HostSum) and x.count == items[0].count for x in items)
            stream.synchronize()
            total = np.zeros(items[0].count, items[0].send.dtype)
            for x in items:
                total += x.send.download().reshape(-1)[:x.count]
            for x in items:
                out = x.recv.download()
                out.reshape(-1)[:x.count] = total
                x.recv.upload(out)
        else:
            for launch in items:
                launch.run(stream)
    stream.synchronize()


@pytest.fixture(scope="module")
def kernels(device):
    from rawgpu.kernels import Kernels

    return Kernels(device.arch)


def ranks_side_by_side(make, ranks, stream, data, perm):
    """`ranks` models, make(rank) each, allocated with the data, their initial parameters and the epoch's order (all
    closed again if one fails)."""
    models = []
    try:
        for rank in range(ranks):
            m = make(rank).allocate()
            models.append(m)
            m.upload_data(data)
            m.init_parameters(stream)
            m.set_permutation(perm)
    except BaseException:
        for m in models:
            m.arena.close()
        raise
    return models


def _ranks(kernels, device, stream, recipe, ranks, data, perm, short=True):
    return ranks_side_by_side(lambda rank: plan_model(recipe, "tensor", kernels=kernels, ranks=ranks, rank=rank,
                                                      group=HostGroup(), sm_count=device.sm_count,
                                                      options=StepOptions(short=short)), ranks, stream, data, perm)


MOMENTUM = dict(momentum=0.9)
ADAM = dict(optimizer="adam", lr=1e-3, weight_decay=1e-4)


@gpu
@pytest.mark.parametrize("hidden,layers,batch,opt", [(256, 3, 128, MOMENTUM), (100, 2, 32, ADAM)])
def test_one_rank_is_the_one_gpu_long_form_bit_for_bit(device, stream, kernels, rng, hidden, layers, batch, opt):
    """With one rank each sum is its only part: store32 + finish_sum must give the fused epilogue's bits, so three
    steps and an evaluation of the long form match the layered step's long form byte for byte (outputs start
    poisoned)."""
    data, perm = FakeMNIST(rng), rng.permutation(TRAIN_ROWS).astype(np.int32)
    recipe = Recipe(hidden=hidden, layers=layers, batch=batch, **{"lr": 0.05, **opt}, seed=int(rng.integers(1 << 30)))
    [sharded] = _ranks(kernels, device, stream, recipe, 1, data, perm, short=False)
    try:
        assert_three_steps_are_the_long_forms(sharded, kernels, device, stream, data, perm,
                                              sharded.acts[1:] + sharded.grads[1:] + list(sharded.step.sums.values()))
    finally:
        sharded.arena.close()


@gpu
@pytest.mark.parametrize("hidden,layers,batch,ranks,opt,short,activation", [
    (256, 3, 128, 2, MOMENTUM, True, "relu"), (256, 3, 128, 2, MOMENTUM, False, "relu"),
    (100, 3, 32, 3, ADAM, True, "relu"), (520, 2, 64, 4, MOMENTUM, True, "relu"), (64, 1, 128, 2, ADAM, True, "relu"),
    (1024, 3, 32, 2, dict(momentum=0.0), True, "relu"),
    # a funnel, and activations whose backward reads the slope the forward saved (in the GEMMs, the sums' epilogues and
    # the one passes) or the output
    ((1024, 512, 256), None, 128, 2, MOMENTUM, True, "relu"), ((256, 128), None, 64, 2, ADAM, True, "gelu"),
    (256, 3, 128, 2, MOMENTUM, False, "silu"), (100, 3, 32, 3, dict(momentum=0.0), True, "tanh")])
def test_ranks_together_train_as_one_gpu(device, stream, kernels_for, rng, hidden, layers, batch, ranks, opt, short,
                                         activation):
    """N ranks start from the one-GPU model's very bits; each of 5 steps, joined, is the float64 reference's step
    from the same parameters within one GPU's bounds; every rank reports the same loss and test accuracy. short:
    the one-pass backward where it runs (sm_90), else the long form."""
    kernels = kernels_for(activation)
    data, perm = FakeMNIST(rng), rng.permutation(TRAIN_ROWS).astype(np.int32)
    recipe = Recipe(hidden=hidden, layers=layers, batch=batch, **{"lr": 0.05, **opt}, schedule="constant",
                    activation=activation, seed=int(rng.integers(1 << 30)))
    models = _ranks(kernels, device, stream, recipe, ranks, data, perm, short)
    plan = models[0].plan
    try:
        one = plan_model(recipe, "layered", kernels=kernels, sm_count=device.sm_count).allocate()
        try:
            one.init_parameters(stream)
            for (w, b), (ow, ob) in zip(join_parameters(plan, [m.parameters() for m in models]), one.parameters()):
                assert w.tobytes() == ow.tobytes() and b.tobytes() == ob.tobytes()
        finally:
            one.arena.close()
        steps = [m.step_launches() for m in models]
        for s in range(5):
            before = join_parameters(plan, [m.parameters() for m in models])
            state_before = _joined_optimizer_state(plan, models)
            run_lockstep(steps, stream)
            check_reference_step(recipe, data, perm, s, before, state_before,
                                 join_parameters(plan, [m.parameters() for m in models]),
                                 lambda: _joined_optimizer_state(plan, models))
        run_lockstep([m.eval_launches() for m in models], stream)
        metrics = {(m.train_metrics(), m.eval_metrics()) for m in models}
        assert len(metrics) == 1, metrics
        assert_evaluated_as_reference(join_parameters(plan, [m.parameters() for m in models]), models, data, 5)
    finally:
        for m in models:
            m.arena.close()


def assert_evaluated_as_reference(parameters, models, data, steps: int) -> None:
    """The ranks' evaluation: rank 0's test accuracy is the float64 forward's of the whole model `parameters`, and
    every rank ran `steps` steps with its padding still zero."""
    logits = ref.forward(parameters, data.test_images.reshape(TEST_ROWS, -1) / 255.0,
                         activation=models[0].recipe.activation)[-1]
    accuracy = float((logits.argmax(1) == data.test_labels).mean())
    assert abs(models[0].eval_metrics()[1] - accuracy) <= 0.005
    assert all(m.step_count() == steps and m.padding_is_zero() for m in models)


def check_reference_step(recipe, data, perm, s, before, state_before, after, state_after) -> None:
    """Step s took the parameters `before` (and the optimiser state `state_before`) to `after`: against the float64
    reference's step from the same parameters over the whole batch, within one GPU's bounds; with Adam, its first
    moment and, from the state the step left (`state_after()`), the update it applied."""
    x, y = _batch(data, perm, s, recipe.batch)
    _, _, grads = ref.loss_and_grads(before, x, y, fp16_storage=True, grad_scale=loss_scale(recipe.batch),
                                     activation=recipe.activation)
    expect, expect_state = ref.optimizer_step(before, grads, recipe, recipe.lr, state_before, s)
    if recipe.optimizer != "sgd":
        moments = state_after()
        errors = [_rel(m - m0, e - m0) for (m, _), (e, _), (m0, _) in
                  zip(moments["m"], expect_state["m"], state_before["m"])]
        applied = [_rel(w - w0, e - w0) for (w, _), (e, _), (w0, _) in
                   zip(after, ref.adam_apply(before, moments, recipe, recipe.lr, s), before)]
        assert max(applied) <= ADAM_ARITHMETIC, f"step {s}: {applied}"
    else:
        errors = [max(_rel(w - w0, ew - w0), _rel(b - b0, eb - b0))
                  for (w, b), (ew, eb), (w0, b0) in zip(after, expect, before)]
    assert max(errors) <= STEP_TOLERANCE, f"step {s}, per layer: {errors}"


def assert_three_steps_are_the_long_forms(model, kernels, device, stream, data, perm, poisoned, after_eval=()):
    """One rank's model (its sums in lockstep, on its own) trains 3 steps and evaluates as the one-GPU layered
    step's long form does, from the same seed and order, to the same bits; `poisoned` tensors start as NaN.
    after_eval: launches that end the evaluation on several GPUs (a replicated model's metric sums)."""
    # a tensor-parallel head is a sum over the ranks: its GEMM and softmax_xent stay apart (fuse_loss=False)
    one = plan_model(model.recipe, "layered", kernels=kernels, sm_count=device.sm_count,
                     options=StepOptions(short=False, fuse_loss=model.kind != "tensor")).allocate()
    try:
        one.upload_data(data)
        one.init_parameters(stream)
        one.set_permutation(perm)
        for t in poisoned:
            t.fill_bytes(0xFF)
        run_lockstep([model.step_launches(3)], stream)
        for launch in one.step_launches(3):
            launch.run(stream)
        run_lockstep([model.eval_launches() + list(after_eval)], stream)
        for launch in one.eval_launches():
            launch.run(stream)
        stream.synchronize()
        assert_same_bits(model, one)
        assert model.step_count() == 3
    finally:
        one.arena.close()


def assert_same_bits(model, one) -> None:
    """Two models' parameters, exact state (state()) and metrics are the same bits."""
    got, want = model.state(), one.state()
    for (w, b), (ow, ob) in zip(got[0], want[0]):
        assert w.tobytes() == ow.tobytes() and b.tobytes() == ob.tobytes()
    assert got[1].keys() == want[1].keys()
    for key in got[1]:
        assert got[1][key].tobytes() == want[1][key].tobytes(), key
    assert model.train_metrics() == one.train_metrics() and model.eval_metrics() == one.eval_metrics()


def _joined_optimizer_state(plan, models):
    """optimizer_state() of the whole model, from the ranks' parts."""
    parts = [m.optimizer_state() for m in models]
    return {key: join_parameters(plan, [p[key] for p in parts]) for key in parts[0]}


# --- the product: the CLI's checks (CPU), and one rank through NCCL in the step's CUDA graph (GPU) -------------------


def test_gpus_options_that_do_not_go_together_are_usage_errors():
    from test_trainer import cli

    for args, msg in [(["--gpus", "2", "--step", "fused"], "runs the tensor- or data-parallel step, not --step fused"),
                      (["--parallel", "data"], "argument --parallel: splits a model over several GPUs; add --gpus N"),
                      (["--gpus", "2", "--device", "1"], "takes GPUs 0..1; drop --device"),
                      (["--gpus", "0"], "must be >= 1")]:
        out = cli("rawgpu.train", *args, "--steps", "5")
        assert out.returncode == 2 and msg in out.stderr.strip().splitlines()[-1], out.stderr


@gpu
def test_more_gpus_than_the_machine_has_is_one_line(device, rng, tmp_path):
    from rawgpu.runtime import driver
    from rawgpu.runtime import nccl
    from test_trainer import cli, synthetic, write_idx

    if (why := nccl.available()) is not None:
        pytest.skip(why)
    n = driver.device_count() + 1
    data = write_idx(tmp_path / "d", synthetic(rng, 600, 100))
    out = cli("rawgpu.train", "--gpus", str(n), "--dataset", "idx", "--data-dir", str(data), "--steps", "5")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].endswith(f"{n} GPUs asked for, this machine has {n - 1}")


@gpu
def test_one_rank_through_nccl_trains_as_one_gpu_and_saves_a_one_gpu_checkpoint(device, rng, tmp_path):
    """A Trainer of rank 0 of 1: its all-reduces are NCCL's, captured in the step graphs; the run ends with the
    one-GPU long form's bits, and its checkpoint loads on one GPU's own step with the same parameters and accuracy."""
    from rawgpu import Trainer
    from rawgpu.runtime import nccl
    from rawgpu.runtime.ranks import Rank
    from test_trainer import state_of, synthetic

    if (why := nccl.available()) is not None:
        pytest.skip(why)
    data = synthetic(rng, 3000, 500)
    recipe = Recipe(hidden=256, batch=64, momentum=0.9, lr=0.05, seed=int(rng.integers(1 << 30)))
    total, path = 2 * (3000 // 64) - 3, tmp_path / "tp.safetensors"
    with Trainer._make(recipe, data=data, steps=total, steps_per_graph=4, rank=Rank(1, 0, nccl.new_unique_id()),
                       options=StepOptions(short=False)) as tp:
        assert tp.model.kind == "tensor" and "tensor parallel over 1 GPU" in tp.session.step_description
        tp.fit(save_to=path)
        got, history = state_of(tp), tp.history
    apart = StepOptions(short=False, fuse_loss=False)  # the head's GEMM and softmax_xent, as the tensor step's
    with Trainer._make(recipe, data=data, steps=total, steps_per_graph=4, step="layered", options=apart) as one:
        one.fit()
        expect, params = state_of(one), one.parameters()
        assert [h.test_accuracy for h in history] == [h.test_accuracy for h in one.history]
    for g, e in zip(got, expect):
        np.testing.assert_array_equal(g.view(np.uint8), e.view(np.uint8))
    with Trainer.load(path, data=data) as loaded:
        assert loaded.model.kind != "tensor" and loaded.done
        for (w, b), (ew, eb) in zip(loaded.parameters(), params):
            assert w.tobytes() == ew.tobytes() and b.tobytes() == eb.tobytes()
        assert loaded.evaluate().accuracy == history[-1].test_accuracy
    # and the other way: a one-GPU checkpoint from inside an epoch, resumed as a rank, ends where one GPU does
    mid = tmp_path / "mid.safetensors"
    with Trainer._make(recipe, data=data, steps=total, step="layered", options=apart) as first:
        first.fit(stop_at=3000 // 64 + 11, save_to=mid)
    with Trainer._load(mid, data=data, steps_per_graph=4, rank=Rank(1, 0, nccl.new_unique_id()),
                       options=StepOptions(short=False)) as resumed:
        assert resumed.model.kind == "tensor"
        resumed.fit()
        for g, e in zip(state_of(resumed), expect):
            np.testing.assert_array_equal(g.view(np.uint8), e.view(np.uint8))


def _bench():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench", Path(__file__).resolve().parents[1] / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@gpu
def test_bench_refuses_more_gpus_than_the_machine_has_in_one_line(device, capsys):
    from rawgpu.runtime import driver

    n = driver.device_count() + 1
    assert _bench().main(["train", "--gpus", "1", str(n), "--sizes", "256", "--steps", "10"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"bench: error: argument --gpus: {n} GPUs asked for, this machine has {n - 1}"]


@gpu
def test_bench_times_a_rank_through_nccl_with_and_without_its_sums(device, rng):
    """What `bench.py train --gpus N` runs in each process, here as the one rank of one: the timed run trains (test
    accuracy above chance) and both timings come back."""
    from rawgpu.runtime import nccl

    if (why := nccl.available()) is not None:
        pytest.skip(why)
    bench = _bench()
    out = bench.bench_rank(0, 1, nccl.new_unique_id(), 256, 300, 0, FakeMNIST(rng), bench.RECIPES["default"],
                           steps_per_launch=10, warmup=5)
    assert out["rank"] == 0 and "tensor parallel over 1 GPU" in out["note"]
    assert 0 < out["us_per_step"] < 1e5 and 0 < out["us_without_sums"] < 1e5
    assert out["test_accuracy"] > 0.15


@gpu
def test_what_each_cli_rank_runs_trains_reports_and_saves(device, rng, tmp_path, capsys):
    """`--gpus N` runs train.train in each process; as the one rank of one it trains, prints its JSON epochs
    (rank 0 reports) and writes the checkpoint, which loads."""
    import json
    import time

    from rawgpu.training import checkpoint
    from rawgpu.cli import train
    from rawgpu.cli.console import make_console
    from rawgpu.runtime import nccl
    from rawgpu.runtime.ranks import Rank
    from test_trainer import synthetic

    if (why := nccl.available()) is not None:
        pytest.skip(why)
    data, path = synthetic(rng, 3000, 500), tmp_path / "cli.safetensors"
    parser = train.build_parser()
    args = parser.parse_args(["--hidden", "128", "--epochs", "2", "--json", "--save", str(path)])
    recipe = train.check_run(parser, args, dict(inputs=784, classes=10, train_rows=3000, test_rows=500))
    rank = Rank(1, 0, nccl.new_unique_id(), args.parallel)
    assert train.train(args, data, recipe, make_console("json"), time.perf_counter(), None, rank) == 0
    epochs = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [e["epoch"] for e in epochs] == [1, 2] and epochs[-1]["test_accuracy"] > 0.5
    ckpt = checkpoint.load(path)
    assert ckpt.recipe.hidden == 128 and ckpt.step_kind == "tensor" and ckpt.steps_done == 2 * (3000 // 128)
