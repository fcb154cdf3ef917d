"""CPU tests for the many-model peers (scripts/peers/sweeps.py) and the benchmark's sweep grid: each model of a sweep
trains on its own seed's batch order and its own learning rates, the very ones a one-model peer run would use."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from peers.common import Workload, step_indices  # scripts/ is on pytest's pythonpath
from peers.sweeps import Sweep, floor_bytes_per_weight, lr_grid, parameters


def _bench():
    path = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"
    spec = importlib.util.spec_from_file_location("bench_sweep_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_model_walks_its_own_seeds_order_with_its_own_rates():
    base = Workload(hidden=64, steps=40, batch=128, lr=0.05, momentum=0.9, schedule="cosine", warmup_steps=10)
    sweep = Sweep(base, seeds=(0, 0, 3), lrs=(0.05, 0.2, 0.05))
    orders, rates = sweep.orders(), sweep.learning_rates()
    assert orders.shape == (3, 40, 128) and rates.shape == (3, 40)
    for i, (seed, lr) in enumerate(zip(sweep.seeds, sweep.lrs)):
        np.testing.assert_array_equal(orders[i].reshape(-1), step_indices(40, 128, seed))
        np.testing.assert_array_equal(rates[i], Workload(hidden=64, steps=40, batch=128, lr=lr, momentum=0.9,
                                                         schedule="cosine", warmup_steps=10).learning_rates())
    assert not np.array_equal(orders[0], orders[2]) and np.array_equal(orders[0], orders[1])
    np.testing.assert_allclose(rates[1], 4 * rates[0], rtol=1e-6)


def test_a_sweep_needs_a_seed_and_a_rate_per_model():
    with pytest.raises(ValueError, match="one seed and one lr per model"):
        Sweep(Workload(hidden=8), seeds=(0, 1), lrs=(0.1,))
    with pytest.raises(ValueError, match="one seed and one lr per model"):
        Sweep(Workload(hidden=8), seeds=(), lrs=())


def test_the_grid_spreads_rates_around_the_recipes_and_fills_the_rest_with_seeds():
    assert lr_grid(0.05, 1) == [0.05]
    grid = lr_grid(0.05, 4)
    np.testing.assert_allclose([grid[0], grid[-1]], [0.0125, 0.2])
    np.testing.assert_allclose(np.diff(np.log(grid)), np.log(16) / 3)  # log-even
    bench = _bench()
    assert [bench.sweep_grid(n) for n in (1, 2, 8, 32, 128)] == [(1, 1), (2, 1), (4, 2), (4, 8), (4, 32)]


def test_the_floor_counts_every_weight_and_its_optimiser_state():
    assert parameters(256) == 784 * 256 + 256 + 2 * (256 * 256 + 256) + 256 * 10 + 10
    assert floor_bytes_per_weight(Workload(hidden=8)) == 12  # plain SGD
    assert floor_bytes_per_weight(Workload(hidden=8, momentum=0.9)) == 20
    assert floor_bytes_per_weight(Workload(hidden=8, optimizer="adam")) == 28


def test_the_sweep_benchmark_refuses_a_bad_count_before_any_gpu_work(capsys):
    with pytest.raises(SystemExit) as exc:
        _bench().main(["sweep", "--models", "0"])
    assert exc.value.code == 2 and "--models" in capsys.readouterr().err
