"""Data parallelism (rawgpu/steps/replicated.py, steps/data.py): each rank's rows and buffers (CPU); its two kernels
against float64 (elementwise.bias_grad, elementwise.apply_update); and on one GPU every rank of a 1-, 2-, 3- or 4-way
run side by side, their all-reduces done in lockstep on the host (test_sharded.py's runner): one rank is the one-GPU
long-form step bit for bit, several ranks together train as one GPU does (float64 reference) and keep the same copy."""

from __future__ import annotations

import numpy as np
import pytest

from optim_reference import OPTIMIZERS, check_master_update, random_state, rel, table, update_reference
from rawgpu.model import master
from rawgpu.contract import OPTIM_WORDS
from rawgpu.kernels import elementwise as ke
from rawgpu.runtime.memory import Arena
from rawgpu.model.recipe import TRAIN_ROWS, Recipe
from rawgpu.steps import StepOptions, plan_model
from test_mlp import FakeMNIST
from test_sharded import (ADAM, MOMENTUM, HostGroup, assert_evaluated_as_reference, assert_three_steps_are_the_long_forms,
                          check_reference_step, ranks_side_by_side, run_lockstep)

gpu = pytest.mark.gpu


# --- CPU: the rows, the buffers, the plans ------------------------------------------------------------------------


@pytest.mark.parametrize("batch,ranks", [(256, 2), (96, 3), (4096, 8), (32, 1)])
def test_each_rank_takes_its_share_of_every_batch_in_one_gpus_order(batch, ranks, rng):
    recipe = Recipe(hidden=256, batch=batch)
    models = [plan_model(recipe, "data", ranks=ranks, rank=r, arch="sm_90") for r in range(ranks)]
    perm = rng.permutation(TRAIN_ROWS)
    orders = [m.rank_order(perm).reshape(recipe.steps_per_epoch, batch // ranks) for m in models]
    assert np.array_equal(np.concatenate(orders, axis=1).reshape(-1), perm[:recipe.steps_per_epoch * batch])
    for m in models:
        assert m.rows == batch // ranks and m.acts[0].shape[0] == m.rows and m.y.shape == (m.rows,)
        assert m.perm.shape == (recipe.steps_per_epoch * m.rows,)
        assert [lay.w16.shape for lay in m.layers] == list(zip(recipe._padded_widths, recipe._padded_widths[1:]))


@pytest.mark.parametrize("arch,opt", [("sm_90", MOMENTUM), ("sm_86", ADAM), ("sm_90", dict(momentum=0.0))])
def test_the_step_writes_every_gradient_into_one_buffer_on_one_gpus_update_tiles(arch, opt):
    """One all-reduce a step: each layer's weight gradient (fp32, the tile and splits of one GPU's fused update) and
    bias gradient are views of one buffer, 8-byte aligned for the update's pairs."""
    from rawgpu.kernels import gemm as kg

    recipe = Recipe(hidden=256, layers=3, batch=256, **{"lr": 0.05, **opt})
    m = plan_model(recipe, "data", ranks=2, rank=1, arch=arch)
    step, padded = m.step, recipe._padded_widths
    assert step.kind == "data" and "data parallel over 2 GPUs: 128 of the batch's 256 rows each" in step.describe()
    assert step.gradients.size == sum(a * b + b for a, b in zip(padded, padded[1:]))
    assert [g.shape for g in step.grad_w] == list(zip(padded, padded[1:]))
    assert [g.shape for g in step.grad_b] == [(b,) for b in padded[1:]]
    views = sorted(step.grad_w + step.grad_b, key=lambda t: t.offset)
    assert views[0].offset == step.gradients.offset and all(t.offset % 8 == 0 for t in views)
    assert all(a.offset + a.nbytes == b.offset for a, b in zip(views, views[1:])), "the views tile the buffer"
    family = "adam" if recipe.optimizer != "sgd" else "sgd"
    for (pin, pout), dw in zip(zip(padded, padded[1:]), step.dw):
        update = kg.plan_gemm(pin, pout, m.rows, "cr", family, arch=arch, states=recipe._state_tensors)
        assert dw.epilogue == "store32" and (dw.config, dw.splits) == (update.config, update.splits)
    # gather, 3 forwards, the head's with the loss (logits_xent), 3 input gradients, 4 x (weight gradient, bias
    # gradient, update), the counter; with the head's GEMM and softmax_xent apart, one more
    assert step.kernel_count() == 1 + 3 + 1 + 3 + 12 + 1
    apart = plan_model(recipe, "data", ranks=2, rank=1, arch=arch, options=StepOptions(fuse_loss=False))
    assert apart.step.kernel_count() == step.kernel_count() + 1


@pytest.mark.parametrize("opt", [MOMENTUM, ADAM])
def test_a_wide_layers_gradient_on_the_ping_pong_tile_is_stored_by_the_tile_of_its_sums(opt):
    """Where one GPU's update runs on the ping-pong tile (a wide layer over at most PINGPONG_MAX_K rows), which
    stores no fp32 sum, the step plans the weight gradient on the tile whose sums are the ping-pong tile's (it
    failed to plan: no store32 instance of wgpp)."""
    from rawgpu.kernels import gemm as kg

    recipe = Recipe(hidden=4096, layers=2, batch=2048, **{"lr": 0.05, **opt})
    m = plan_model(recipe, "data", ranks=2, rank=0, arch="sm_90", sm_count=132)
    family = "adam" if recipe.optimizer != "sgd" else "sgd"
    planned = []
    for (pin, pout), dw in zip(zip(recipe._padded_widths, recipe._padded_widths[1:]), m.step.dw):
        update = kg.plan_gemm(pin, pout, m.rows, "cr", family, arch="sm_90", states=recipe._state_tensors,
                              sm_count=132)
        planned.append(update.config.name)
        same_sums = ("wg128x2", "wg128") if update.config.pingpong else (update.config.name,)
        assert dw.epilogue == "store32" and dw.config.name in same_sums and dw.splits == update.splits == 1
    assert kg.PINGPONG_CONFIG in planned


def test_joining_takes_rank_0s_copy_and_refuses_copies_that_differ(rng):
    m = plan_model(Recipe(hidden=64, layers=1, batch=64), "data", ranks=2, rank=0)
    weights = [(rng.standard_normal((784, 64)).astype(np.float32), rng.standard_normal(64).astype(np.float32))]
    state = {"layers.0.w16": rng.standard_normal((784, 64)).astype(np.float16)}
    assert m.join([(weights, state), ([(w.copy(), b.copy()) for w, b in weights], dict(state))]) == (weights, state)
    other = {"layers.0.w16": state["layers.0.w16"] + np.float16(1)}
    with pytest.raises(ValueError, match="rank 1's copy of the model differs from rank 0's"):
        m.join([(weights, state), (weights, other)])


def test_bad_ranks_and_batches_are_refused():
    with pytest.raises(ValueError, match="rank must be in 0..1"):
        plan_model(Recipe(batch=128), "data", ranks=2, rank=2)
    with pytest.raises(ValueError, match="the batch of 100 does not split over 3 ranks"):
        plan_model(Recipe(batch=100), "data", ranks=3, rank=0)


def test_the_loss_is_the_mean_over_the_whole_batch():
    from rawgpu.kernels import loss as kl

    class Recorder:
        def get(self, source, name):
            class K:
                def bind(self, grid, block, smem, *args):
                    return args
            return K()

    a = Arena()
    logits, y = a.tensor("z", (64, 16), np.float16), a.tensor("y", 64, np.int32)
    d, s, c = a.tensor("d", (64, 16), np.float16), a.tensor("s", 1, np.float64), a.tensor("c", 1, np.int32)
    assert kl.softmax_xent(Recorder(), logits, y, d, s, c, 64, 10, grad_scale=512.0, mean_over=256)[5] == 2.0
    with pytest.raises(ValueError, match="mean_over \\(32\\) must be at least the batch \\(64\\)"):
        kl.softmax_xent(Recorder(), logits, y, d, s, c, 64, 10, mean_over=32)


def test_the_gradient_launchers_refuse_wrong_buffers_by_name():
    class NoKernels:
        def get(self, *args):
            raise AssertionError("a refused launch must not look a kernel up")

    k, a = NoKernels(), Arena()
    t = {name: a.tensor(name, shape, dtype) for name, shape, dtype in [
        ("g", (784, 256), np.float32), ("gb", 256, np.float32), ("w16", (784, 256), np.float16),
        ("wlo", (784, 256), np.int16), ("m", (784, 256), np.float32), ("b", 256, np.float32),
        ("mb", 256, np.float32), ("optim", OPTIM_WORDS, np.float32), ("dy", (8, 264), np.float16),
        ("g16", (784, 256), np.float16), ("odd", (784, 255), np.float32)]}
    sgd = (t["g"], t["gb"], t["w16"], t["wlo"], None, None, t["b"], None, None, t["optim"])
    for args, family, error, match in [
            (sgd, "lamb", ValueError, "family must be 'sgd' or 'adam'"),
            ((t["g16"],) + sgd[1:], "sgd", TypeError, "weight gradient"),
            ((t["odd"],) + sgd[1:], "sgd", ValueError, "cols even"),
            (sgd[:2] + (t["g16"].view((784, 256), np.float16, name="x"), t["w16"]) + sgd[4:], "sgd", TypeError,
             "wlo"),
            (sgd, "adam", ValueError, "Adam needs the first moment"),
            (sgd[:4] + (t["m"],) + sgd[5:], "sgd", ValueError, "the same optimiser state"),
            (sgd[:1] + (t["g"].view((128,), name="short"),) + sgd[2:], "sgd", ValueError, "bias gradient")]:
        with pytest.raises(error, match=match):
            ke.apply_update(k, *args, family)
    with pytest.raises(ValueError, match="bias dy: rows=9"):
        ke.bias_grad(k, t["dy"], t["gb"], 9)
    with pytest.raises(TypeError, match="bias gradient"):
        ke.bias_grad(k, t["dy"], t["w16"].view((256,), name="h"), 8)


def test_data_parallelism_that_cannot_split_the_batch_is_one_line_before_any_gpu_work(capsys):
    from test_sharded import _bench
    from test_trainer import cli

    assert _bench().main(["train", "--gpus", "1", "3", "--parallel", "data", "--recipe", "default"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "bench: error: argument --parallel: data parallelism cannot run here: the batch of 128 does not split over 3 "
        "ranks"]
    from rawgpu.runtime import nccl

    out = cli("rawgpu.train", "--gpus", "3", "--parallel", "data", "--steps", "5")
    # without NCCL (rawgpu[multi]) --gpus is refused first, as the installation's failing (exit 1)
    status, expect = ((1, f"rawgpu: error: --gpus 3: {nccl.available()}") if nccl.available() else
                      (2, "argument --parallel: data parallelism cannot run here: the batch of 128 does not split "
                          "over 3 ranks"))
    assert out.returncode == status and out.stderr.strip().splitlines()[-1].endswith(expect), out.stderr


# --- GPU: the kernels ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kernels(device):
    from rawgpu.kernels import Kernels

    return Kernels(device.arch)


@gpu
@pytest.mark.parametrize("rows,cols,ld", [(1, 8, 8), (7, 13, 16), (128, 264, 264), (1000, 16, 24), (64, 1024, 1024)])
def test_bias_grad_is_the_exact_column_sum_rounded_once(kernels, device, stream, rng, rows, cols, ld):
    """fp16 values are multiples of 2^-24, so bias_update's fixed-point sums are exact: the fp32 result is the float64
    sum rounded once, bit for bit; the output poisoned first, nothing past it written."""
    dy = rng.standard_normal((rows + 3, ld)).astype(np.float16)
    want = dy[:rows, :cols].astype(np.float64).sum(axis=0).astype(np.float32)
    with Arena() as arena:
        t_dy, out = arena.tensor("dy", dy.shape, np.float16), arena.tensor("g", cols + 8, np.float32)
        sums, tickets = arena.tensor("sums", cols, np.int64), arena.tensor("tickets", cols, np.int32)
        arena.allocate()
        arena.zero()
        t_dy.upload(dy)
        out.fill_bytes(0xFF)
        device.synchronize()
        ke.bias_grad(kernels, t_dy, out.view((cols,)), rows, sums, tickets).run(stream)
        got = out.download()
    assert got[:cols].tobytes() == want.tobytes()
    assert np.isnan(got[cols:]).all(), "wrote past the end"


@gpu
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("rows,cols", [(1, 2), (784, 264), (17, 16), (256, 1024)])
def test_apply_update_against_float64(kernels, device, stream, rng, rows, cols, opt):
    """Every optimiser's step from summed gradients, on the split master and on the bias, against float64 from fresh
    state; bitwise repeatable; the state an optimiser lacks left alone."""
    o, recipe = table(opt), OPTIMIZERS[opt]
    states, family = recipe._state_tensors, "adam" if recipe.optimizer != "sgd" else "sgd"
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    b = (rng.standard_normal(cols) * 0.05).astype(np.float32)
    g, gb = (rng.standard_normal((rows, cols)) * 4).astype(np.float32), (rng.standard_normal(cols) * 4).astype(np.float32)
    m, v = random_state(rng, (rows, cols), states, 4.0)
    mb, vb = random_state(rng, cols, states, 4.0)
    hi, lo = master.split(w)
    with Arena() as arena:
        t = {name: arena.tensor(name, shape, dtype) for name, shape, dtype in [
            ("g", (rows, cols), np.float32), ("gb", cols, np.float32), ("w16", (rows, cols), np.float16),
            ("wlo", (rows, cols), np.int16), ("m", (rows, cols), np.float32), ("v", (rows, cols), np.float32),
            ("b", cols, np.float32), ("mb", cols, np.float32), ("vb", cols, np.float32),
            ("optim", OPTIM_WORDS, np.float32)]}
        arena.allocate()
        from rawgpu.model import optimizer

        t["optim"].upload(optimizer.words(o))
        t["g"].upload(g), t["gb"].upload(gb)

        def reset():
            for name, value in [("w16", hi), ("wlo", lo), ("m", m), ("v", v), ("b", b), ("mb", mb), ("vb", vb)]:
                t[name].upload(value)
            device.synchronize()

        launch = ke.apply_update(kernels, t["g"], t["gb"], t["w16"], t["wlo"], t["m"] if states else None,
                                 t["v"] if states > 1 else None, t["b"], t["mb"] if states else None,
                                 t["vb"] if states > 1 else None, t["optim"], family)
        reset()
        launch.run(stream)
        got = {name: t[name].download() for name in ("w16", "wlo", "m", "v", "b", "mb", "vb")}
        reset()
        launch.run(stream)
        for name, first in got.items():
            assert t[name].download().tobytes() == first.tobytes(), f"{name}: not bitwise repeatable"
    w_ref, m_ref, v_ref = update_reference(o, w, g, m, v)
    check_master_update(w, got["w16"], got["wlo"], w_ref, bound=1e-5, what=f"apply_update {opt}")
    b_ref, mb_ref, vb_ref = update_reference(o, b, gb, mb, vb)
    assert rel(got["b"] - b, b_ref - b) <= 1e-5
    for key, ref_value, start in [("m", m_ref, m), ("mb", mb_ref, mb), ("v", v_ref, v), ("vb", vb_ref, vb)]:
        if states > ("v" in key):
            assert rel(got[key], ref_value) <= 1e-5, key
        else:
            assert got[key].tobytes() == start.tobytes(), f"{key}: no such state, must be left alone"


# --- GPU: the ranks side by side on one GPU ----------------------------------------------------------------------


def _ranks(kernels, device, stream, recipe, ranks, data, perm):
    return ranks_side_by_side(lambda rank: plan_model(recipe, "data", kernels=kernels, ranks=ranks, rank=rank,
                                                      group=HostGroup(), sm_count=device.sm_count),
                              ranks, stream, data, perm)


@gpu
@pytest.mark.parametrize("hidden,layers,batch,opt", [(256, 3, 256, MOMENTUM), (100, 2, 64, ADAM),
                                                     (200, 3, 32, dict(momentum=0.0)), (4096, 2, 512, MOMENTUM),
                                                     (4096, 2, 384, ADAM)])
def test_one_rank_is_the_one_gpu_long_form_bit_for_bit(device, stream, kernels, rng, hidden, layers, batch, opt):
    """With one rank the sums are one GPU's: the store32 weight gradients on the update's tiles, bias_grad and
    apply_update give the fused updates' bits, so three steps and an evaluation match the layered step's long form
    byte for byte (gradients and activations poisoned first). At H = 4096 on sm_90 one GPU updates the hidden layer
    on the ping-pong tile, and the rank stores its gradient on the tile of the same sums."""
    data, perm = FakeMNIST(rng), rng.permutation(TRAIN_ROWS).astype(np.int32)
    recipe = Recipe(hidden=hidden, layers=layers, batch=batch, **{"lr": 0.05, **opt}, seed=int(rng.integers(1 << 30)))
    [rep] = _ranks(kernels, device, stream, recipe, 1, data, perm)
    try:
        assert_three_steps_are_the_long_forms(rep, kernels, device, stream, data, perm,
                                              rep.acts[1:] + rep.grads[1:] + [rep.step.gradients],
                                              rep.metrics_launches())
    finally:
        rep.arena.close()


@gpu
@pytest.mark.parametrize("hidden,layers,batch,ranks,opt,activation", [
    (256, 3, 256, 2, MOMENTUM, "relu"), (100, 3, 96, 3, ADAM, "relu"), (520, 2, 128, 4, MOMENTUM, "relu"),
    (64, 1, 64, 2, ADAM, "relu"), (256, 3, 64, 2, dict(momentum=0.0), "relu"),
    ((1024, 512, 256), None, 256, 2, MOMENTUM, "gelu"), (100, 3, 96, 3, ADAM, "tanh"),
    ((256, 128), None, 64, 2, MOMENTUM, "silu")])
def test_ranks_together_train_as_one_gpu(device, stream, kernels_for, rng, hidden, layers, batch, ranks, opt,
                                         activation):
    """N ranks, each a share of every batch: each of 5 steps is the float64 reference's step over the whole batch
    from the same parameters within one GPU's bounds; every rank holds the same bits after every step; the metrics
    summed over the ranks are one GPU's within rounding, the test accuracy every rank's."""

    kernels = kernels_for(activation)
    data, perm = FakeMNIST(rng), rng.permutation(TRAIN_ROWS).astype(np.int32)
    recipe = Recipe(hidden=hidden, layers=layers, batch=batch, **{"lr": 0.05, **opt}, schedule="constant",
                    activation=activation, seed=int(rng.integers(1 << 30)))
    models = _ranks(kernels, device, stream, recipe, ranks, data, perm)
    one = plan_model(recipe, "layered", kernels=kernels, sm_count=device.sm_count,
                     options=StepOptions(short=False)).allocate()
    try:
        one.upload_data(data)
        one.init_parameters(stream)
        one.set_permutation(perm)
        steps = [m.step_launches() for m in models]
        for s in range(5):
            before = models[0].parameters()
            state_before = models[0].optimizer_state()
            run_lockstep(steps, stream)
            after = models[0].parameters()
            for m in models[1:]:
                assert all(w.tobytes() == w0.tobytes() and b.tobytes() == b0.tobytes()
                           for (w, b), (w0, b0) in zip(m.parameters(), after)), f"step {s}: the copies parted"
            check_reference_step(recipe, data, perm, s, before, state_before, after, models[0].optimizer_state)
        for launch in one.step_launches(5):
            launch.run(stream)
        run_lockstep([m.eval_launches() + m.metrics_launches() for m in models], stream)
        loss, correct = one.train_metrics()
        for m in models:
            got_loss, got_correct = m.train_metrics()
            assert abs(got_loss - loss) <= 1e-3 * loss and abs(got_correct - correct) <= 2
        assert len({m.eval_metrics() for m in models}) == 1
        assert_evaluated_as_reference(models[0].parameters(), models, data, 5)
    finally:
        for m in models:
            m.arena.close()
        one.arena.close()


# --- the product: one rank through NCCL in the step's CUDA graph -------------------------------------------------


@gpu
def test_one_rank_through_nccl_trains_as_one_gpu_and_resumes_from_its_checkpoint(device, rng, tmp_path):
    """A Trainer of rank 0 of 1 asked for data parallelism: its all-reduce is NCCL's, captured in the step graphs,
    and its metrics are summed through NCCL; the run ends with the one-GPU long form's bits, its history's accuracy
    is one GPU's, and its checkpoint (saved inside an epoch) resumed as a rank ends there too."""
    from rawgpu import Trainer
    from rawgpu.runtime import nccl
    from rawgpu.runtime.ranks import Rank
    from test_trainer import state_of, synthetic

    if (why := nccl.available()) is not None:
        pytest.skip(why)
    data = synthetic(rng, 3000, 500)
    recipe = Recipe(hidden=256, batch=64, momentum=0.9, lr=0.05, seed=int(rng.integers(1 << 30)))
    total, mid = 2 * (3000 // 64) - 3, tmp_path / "dp.safetensors"

    def rank():
        return Rank(1, 0, nccl.new_unique_id(), "data")

    with Trainer._make(recipe, data=data, steps=total, steps_per_graph=4, step="layered",
                       options=StepOptions(short=False)) as one:
        one.fit()
        expect, history = state_of(one), one.history
    with Trainer._make(recipe, data=data, steps=total, steps_per_graph=4, rank=rank()) as dp:
        assert dp.model.kind == "data" and "data parallel over 1 GPU" in dp.session.step_description
        dp.fit(stop_at=3000 // 64 + 11, save_to=mid)
    with Trainer._load(mid, data=data, steps_per_graph=4, rank=rank()) as resumed:
        assert resumed.model.kind == "data"
        resumed.fit()
        for g, e in zip(state_of(resumed), expect):
            np.testing.assert_array_equal(g.view(np.uint8), e.view(np.uint8))
        assert [(h.train_loss, h.test_accuracy) for h in resumed.history] == [(h.train_loss, h.test_accuracy)
                                                                              for h in history]


@gpu
def test_what_each_cli_and_bench_rank_runs_with_data_parallelism(device, rng, tmp_path, capsys):
    """`--gpus N --parallel data` runs train.train in each process, `bench.py train --gpus N --parallel data`
    bench_rank: as the one rank of one, the first trains, reports its JSON epochs and writes a checkpoint that loads;
    the second times the run with and without its all-reduce."""
    import json
    import time

    from rawgpu.training import checkpoint
    from rawgpu.cli import train
    from rawgpu.cli.console import make_console
    from rawgpu.runtime import nccl
    from rawgpu.runtime.ranks import Rank
    from test_sharded import _bench
    from test_trainer import synthetic

    if (why := nccl.available()) is not None:
        pytest.skip(why)
    data, path = synthetic(rng, 3000, 500), tmp_path / "cli.safetensors"
    parser = train.build_parser()
    args = parser.parse_args(["--hidden", "128", "--epochs", "2", "--json", "--save", str(path), "--parallel", "data"])
    recipe = train.check_run(parser, args, dict(inputs=784, classes=10, train_rows=3000, test_rows=500))
    rank = Rank(1, 0, nccl.new_unique_id(), args.parallel)
    assert train.train(args, data, recipe, make_console("json"), time.perf_counter(), None, rank) == 0
    epochs = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [e["epoch"] for e in epochs] == [1, 2] and epochs[-1]["test_accuracy"] > 0.5
    assert checkpoint.load(path).step_kind == "data"
    bench = _bench()
    out = bench.bench_rank(0, 1, nccl.new_unique_id(), 256, 300, 0, FakeMNIST(rng), bench.RECIPES["default"],
                           steps_per_launch=10, warmup=5, mode="data")
    assert out["split"] == "data" and "data parallel over 1 GPU" in out["note"]
    assert 0 < out["us_per_step"] < 1e5 and 0 < out["us_without_sums"] < 1e5 and out["test_accuracy"] > 0.15
