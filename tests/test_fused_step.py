"""The fused step (cu/fused_step.cu): when it is chosen, what it plans, and on the GPU the properties its design
rests on. Its numerics against the float64 reference are in test_mlp.py (the `fused` cases)."""

from __future__ import annotations

import numpy as np
import pytest

from rawgpu.kernels import fused as kf
from rawgpu.model.recipe import TRAIN_ROWS, Recipe
from rawgpu.steps import StepOptions, plan_model

gpu = pytest.mark.gpu


@pytest.mark.parametrize("recipe,fused", [
    (Recipe(), True), (Recipe(hidden=512, batch=32), True), (Recipe(hidden=1024, batch=32), True),
    (Recipe(hidden=1024, batch=32, momentum=0.0), False), (Recipe(hidden=1025), False), (Recipe(hidden=2048), False),
    (Recipe(hidden=8192, batch=32), False), (Recipe(accum="fp16"), False), (Recipe(layers=64), True)])
def test_auto_picks_the_fused_step_where_it_applies(recipe, fused):
    assert (plan_model(recipe).kind == "fused") is fused


def test_forcing_the_fused_step_where_it_cannot_run_says_why():
    with pytest.raises(ValueError, match="fp32 only"):
        plan_model(Recipe(accum="fp16"), "fused")
    assert plan_model(Recipe(hidden=8192), "fused").kind == "fused"  # too wide for auto, still correct
    assert plan_model(Recipe(), "layered").kind == "layered"


def test_fused_model_plans_its_extra_buffers_and_no_layered_workspace():
    fused = plan_model(Recipe(hidden=1024, batch=32), "fused")
    layered = plan_model(Recipe(hidden=1024, batch=32), "layered")
    assert len(fused.step.w16_next) == 4 and not hasattr(layered.step, "w16_next")
    assert fused.step.table.shape == (kf.table_words(4),)
    assert fused.workspace.size <= layered.workspace.size


@pytest.mark.parametrize("arch,stages,smem", [("sm_80", 4, 163840), ("sm_86", 2, 92672), ("sm_89", 2, 92672),
                                              ("sm_90", 4, 163840)])
def test_shared_memory_fits_each_arch(arch, stages, smem):
    assert kf.stages(arch) == stages and kf.smem_bytes(arch) == smem
    assert smem <= {"sm_80": 163 << 10, "sm_86": 99 << 10, "sm_89": 99 << 10, "sm_90": 227 << 10}[arch]


def test_phase_plan_matches_the_kernel():
    phases = kf.phase_tasks(32, [784, 256, 256, 256, 16])
    assert [p[0] for p in phases] == ["forward 0", "forward 1", "forward 2", "head", "below head", "backward 2",
                                      "backward 1", "backward 0"]
    assert phases[0] == ("forward 0", 8, 0)  # one row block x 256 / 32 column blocks
    assert phases[3] == ("head", 1, 0)
    assert phases[4] == ("below head", 0, 8 + 8 + 2)  # dx blocks, the head's dW blocks, its bias, the metrics
    assert phases[5] == ("backward 2", 8, 64 + 8)  # dx of layer 2 (8 blocks); dW 8x8 + bias 8
    assert phases[7] == ("backward 0", 0, 25 * 8 + 8)  # layer 0 has no dx


@gpu
def test_fused_step_is_the_same_on_any_grid_and_keeps_its_fp16_copies(device, stream, rng):
    """Every task sums in a fixed order whichever block runs it, so the grid size cannot change a bit; after an odd
    number of steps the current fp16 copy is the second one and equals fp16(master); eval makes the first equal to
    it."""
    from rawgpu.kernels import Kernels
    from test_mlp import FakeMNIST

    kernels, data = Kernels(device.arch), FakeMNIST(rng)
    perm = rng.permutation(TRAIN_ROWS).astype(np.int32)
    recipe = Recipe(hidden=192, layers=2, batch=48, lr=0.05, momentum=0.9, schedule="cosine", total_steps=40)
    results = []
    for grid in (device.sm_count, 7, 1):
        model = plan_model(recipe, "fused", kernels=kernels, sm_count=device.sm_count,
                           options=StepOptions(fused_grid=grid)).allocate()
        try:
            model.upload_data(data)
            model.init_parameters(stream)
            model.set_permutation(perm)
            model.zero_metrics().run(stream)
            for launch in model.step_launches(13):
                launch.run(stream)
            stream.synchronize()
            assert model.step_count() == 13
            for i, nxt in enumerate(model.step.w16_next):  # after an odd number of steps the master's high half is copy 1
                current = model.master_weights(i).astype(np.float16)
                assert np.array_equal(nxt.download().view(np.uint16), current.view(np.uint16))
            for launch in model.eval_launches():
                launch.run(stream)
            for lay, nxt in zip(model.layers, model.step.w16_next):  # evaluation reads copy 0, made equal to it
                assert np.array_equal(lay.w16.download().view(np.uint16), nxt.download().view(np.uint16))
            results.append((model.parameters(), model.train_metrics(), model.eval_metrics()))
        finally:
            model.arena.close()
    first = results[0]
    for other in results[1:]:
        for (w0, b0), (w1, b1) in zip(first[0], other[0]):
            assert np.array_equal(w0.view(np.uint32), w1.view(np.uint32))
            assert np.array_equal(b0.view(np.uint32), b1.view(np.uint32))
        assert first[1] == other[1] and first[2] == other[2]


def test_fused_phases_script_rejects_bad_arguments_in_one_line():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}  # the checkout's rawgpu, as dev/README.md runs the scripts
    for argv, message in ((["--steps", "5"], "must be >= 30, got 5"), (["--hidden", "0"], "must be >= 1, got 0")):
        result = subprocess.run([sys.executable, "dev/fused_phases.py", *argv], capture_output=True, text=True,
                                cwd=root, timeout=60, env=env)
        assert result.returncode == 2 and message in result.stderr.strip().splitlines()[-1], result.stderr
