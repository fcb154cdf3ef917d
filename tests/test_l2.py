"""The layered step's L2 plan (kernels/l2.py): which weight accesses keep their lines, on CPU."""

from __future__ import annotations

import pytest

from rawgpu.kernels.l2 import FIRST, NORMAL, LayerPolicy, plan_l2

MB = 1 << 20


def test_top_layers_keep_from_forward_to_backward_and_low_layers_from_backward_to_forward():
    # 784-4096-4096-4096 and a head that is not one pass: W16 of 6, 32, 32 MB; L2 50 MB, budget 30 MB
    p = plan_l2([6 * MB, 32 * MB, 32 * MB, MB // 8], [True, True, True, False], 50 * MB, budget=0.6)
    assert p[3] == LayerPolicy(), "a layer whose backward is not one pass reads and writes normally"
    assert p[2].forward == pytest.approx(30 / 32), "the top layer's forward keeps what fits"
    assert p[0].forward == p[1].forward == FIRST, "the others' forward reads are read once (and release set B)"
    assert p[0].hi == 1.0 and p[1].hi == pytest.approx(24 / 32) and p[2].hi == FIRST, "set B from the bottom"
    assert all(q.read == NORMAL and q.lo == FIRST for q in p[:3])


def test_a_model_inside_the_budget_keeps_everything():
    p = plan_l2([2 * MB, 4 * MB, 4 * MB], [True, True, True], 50 * MB)
    assert [q.forward for q in p] == [1.0] * 3 and [q.hi for q in p] == [1.0] * 3


@pytest.mark.parametrize("budget,l2,one_pass", [(0.0, 50 * MB, [True, True]), (0.6, 0, [True, True]),
                                                 (0.6, 50 * MB, [False, False]), (0.6, 50 * MB, [True, True])])
def test_no_hints_without_budget_cache_one_pass_layers_or_enough_kept(budget, l2, one_pass):
    # the last case: 128 MB layers, of which a budget keeps under half (measured: the hints then cost time)
    assert plan_l2([128 * MB, 128 * MB], one_pass, l2, budget) == [LayerPolicy()] * 2


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="one size"):
        plan_l2([MB], [True, True], 50 * MB)
    with pytest.raises(ValueError, match="fraction"):
        plan_l2([MB], [True], 50 * MB, budget=1.5)
