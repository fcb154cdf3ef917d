"""CPU checks of the float64 MLP reference, so GPU tests can trust it as ground truth."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import mlp_reference as ref
from mlp_reference import forward, loss_and_grads, sgd_step, train_steps

SIZES = [12, 7, 5, 4]  # two hidden layers
BATCH = 6
EPS = 1e-6


def _random_mlp(rng, sizes=SIZES):
    return [
        (rng.standard_normal((fi, fo)) / np.sqrt(fi), 0.1 * rng.standard_normal(fo))
        for fi, fo in itertools.pairwise(sizes)
    ]


def _min_abs_preactivation(params, x):
    """Smallest |pre-ReLU value|: FD across a ReLU kink would disagree with the analytic gradient."""
    acts = forward(params, x)
    return min(np.abs(acts[i] @ w + b).min() for i, (w, b) in enumerate(params[:-1]))


def _kink_free_problem(seed):
    """Random MLP and batch whose hidden pre-activations all stay far from 0 (resampled until so)."""
    rng = np.random.default_rng(seed)
    while True:
        params = _random_mlp(rng)
        x = rng.standard_normal((BATCH, SIZES[0]))
        if _min_abs_preactivation(params, x) > 1e-3:
            return params, x, rng.integers(0, SIZES[-1], BATCH)


def _copy(params):
    return [(w.copy(), b.copy()) for w, b in params]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gradients_match_central_finite_differences(seed):
    params, x, labels = _kink_free_problem(seed)
    _, _, grads = loss_and_grads(params, x, labels)
    for layer in range(len(params)):
        for slot in (0, 1):  # W, then b
            analytic = grads[layer][slot]
            numeric = np.zeros_like(analytic)
            for idx in np.ndindex(analytic.shape):
                plus, minus = _copy(params), _copy(params)
                plus[layer][slot][idx] += EPS
                minus[layer][slot][idx] -= EPS
                numeric[idx] = (loss_and_grads(plus, x, labels)[0] - loss_and_grads(minus, x, labels)[0]) / (2 * EPS)
            assert analytic.shape == params[layer][slot].shape
            rel = np.abs(analytic - numeric).max() / max(np.abs(numeric).max(), 1e-12)
            assert rel <= 1e-6, f"layer {layer} {'Wb'[slot]}: relative error {rel:.2e}"


def test_relu_derivative_is_zero_at_exactly_zero():
    # Hidden pre-activation is exactly 0 for the single unit, so no gradient may reach W1/b1.
    params = [(np.array([[1.0]]), np.array([-1.0])), (np.array([[2.0, -1.0]]), np.zeros(2))]
    _, _, grads = loss_and_grads(params, np.array([[1.0]]), np.array([0]))
    assert grads[0][0][0, 0] == 0.0 and grads[0][1][0] == 0.0
    assert np.any(grads[1][1] != 0.0)  # the output bias still learns


def test_forward_shapes_and_relu():
    rng = np.random.default_rng(3)
    params = _random_mlp(rng)
    acts = forward(params, rng.standard_normal((BATCH, SIZES[0])).astype(np.float32))
    assert [a.shape for a in acts] == [(BATCH, s) for s in SIZES]
    assert all(a.dtype == np.float64 for a in acts)
    assert all((h >= 0).all() for h in acts[1:-1])
    assert (acts[-1] < 0).any()  # no ReLU on the logits


def test_loss_matches_naive_softmax_and_handles_large_logits():
    params, x, labels = _kink_free_problem(4)
    logits = forward(params, x)[-1]
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    naive = -np.log(probs[np.arange(BATCH), labels]).mean()
    loss, _, _ = loss_and_grads(params, x, labels)
    assert loss == pytest.approx(naive, rel=1e-12)

    # Logits of ~1000 overflow a naive exp; the stable form must still be finite and exact.
    big = [(np.eye(2), np.array([1000.0, 0.0]))]
    loss, _, grads = loss_and_grads(big, np.zeros((1, 2)), np.array([1]))
    assert loss == pytest.approx(1000.0, rel=1e-12)
    assert np.isfinite(grads[0][0]).all() and grads[0][1] == pytest.approx([1.0, -1.0])


def test_correct_counts_argmax_hits_with_first_index_on_ties():
    # Single identity layer: logits are the inputs themselves.
    params = [(np.eye(3), np.zeros(3))]
    x = np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 2.0], [0.0, 2.0, 2.0], [1.0, 1.0, 5.0]])
    labels = np.array([0, 1, 2, 0])  # hit, tie -> index 1 hit, tie -> index 1 miss, miss
    _, correct, _ = loss_and_grads(params, x, labels)
    assert correct == 2


def _toy():
    params = [(np.array([[1.0, 2.0]]), np.array([0.5, -0.5]))]
    g1 = [(np.array([[0.1, -0.2]]), np.array([1.0, 2.0]))]
    g2 = [(np.array([[0.3, 0.4]]), np.array([-1.0, 0.5]))]
    return params, g1, g2


def test_sgd_step_plain_two_steps():
    params, g1, g2 = _toy()
    before = _copy(params)
    p1, v1 = sgd_step(params, g1, lr=0.5)
    p2, v2 = sgd_step(p1, g2, lr=0.5)
    assert v1 is None and v2 is None
    np.testing.assert_allclose(p2[0][0], [[1.0 - 0.5 * 0.4, 2.0 - 0.5 * 0.2]], rtol=0, atol=1e-15)
    np.testing.assert_allclose(p2[0][1], [0.5 - 0.5 * 0.0, -0.5 - 0.5 * 2.5], rtol=0, atol=1e-15)
    assert all((a == c).all() for (w, b), (wb, bb) in zip(params, before) for a, c in ((w, wb), (b, bb)))


def test_sgd_step_momentum_two_steps():
    params, g1, g2 = _toy()
    before, g1_before = _copy(params), _copy(g1)
    lr, mu = 0.5, 0.9
    p1, v1 = sgd_step(params, g1, lr, momentum=mu)
    vel_before = _copy(v1)
    p2, v2 = sgd_step(p1, g2, lr, momentum=mu, velocity=v1)
    # Step 1: V = G1.  Step 2: V = 0.9*G1 + G2.  W = W0 - lr*G1 - lr*V2.
    np.testing.assert_allclose(v2[0][0], [[0.09 + 0.3, -0.18 + 0.4]], rtol=0, atol=1e-15)
    np.testing.assert_allclose(v2[0][1], [0.9 - 1.0, 1.8 + 0.5], rtol=0, atol=1e-15)
    np.testing.assert_allclose(p2[0][0], [[1.0 - 0.05 - 0.195, 2.0 + 0.1 - 0.11]], rtol=0, atol=1e-15)
    np.testing.assert_allclose(p2[0][1], [0.5 - 0.5 + 0.05, -0.5 - 1.0 - 1.15], rtol=0, atol=1e-15)
    for orig, saved in ((params, before), (g1, g1_before), (v1, vel_before)):
        assert all(np.array_equal(a, c) for pair, spair in zip(orig, saved) for a, c in zip(pair, spair))


def test_train_steps_loss_falls_on_separable_problem():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((32, 2))
    labels = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    params = _random_mlp(rng, [2, 8, 2])
    lrs = []
    final, velocity, losses = train_steps(
        params, [(x, labels)] * 50, lr=0.0, momentum=0.9, lr_fn=lambda s: lrs.append(s) or 0.1
    )
    assert lrs == list(range(50))  # lr_fn sees every step index and overrides lr=0
    assert len(losses) == 50 and velocity is not None
    assert losses[-1] < 0.5 * losses[0]
    assert loss_and_grads(final, x, labels)[1] >= 30


def _clear_of_relu_kinks(params, x, margin: float) -> bool:
    """Whether every hidden pre-activation is at least `margin` away from 0, so rounding cannot flip a ReLU."""
    h = x
    for w, b in params[:-1]:
        z = h @ w + b
        if np.abs(z).min() < margin:
            return False
        h = np.maximum(z, 0)
    return True


def test_fp16_storage_reference_stays_close_to_float64_and_ignores_the_scale_without_rounding():
    # Fresh inputs, drawn again while a pre-activation lies within 2e-3 of a ReLU's kink: there fp16 rounding may
    # flip the unit on or off, a different function rather than a rounding error (1.7% of unfiltered draws moved
    # one layer's gradient by 2-27%).
    rng = np.random.default_rng()
    sizes = [20, 16, 16, 10]
    while True:
        params = [(rng.uniform(-0.3, 0.3, (a, b)), rng.uniform(-0.3, 0.3, b)) for a, b in zip(sizes, sizes[1:])]
        x, y = rng.uniform(0, 1, (8, 20)), rng.integers(0, 10, 8)
        if _clear_of_relu_kinks(params, x, 2e-3):
            break
    _, _, exact = loss_and_grads(params, x, y)
    _, _, scaled = loss_and_grads(params, x, y, grad_scale=512.0)
    _, _, rounded = loss_and_grads(params, x, y, fp16_storage=True, grad_scale=512.0)
    for (gw, gb), (sw, sb), (rw, rb) in zip(exact, scaled, rounded):
        np.testing.assert_allclose(sw, gw, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(sb, gb, rtol=1e-12, atol=1e-15)
        assert np.linalg.norm(rw - gw) <= 2e-2 * np.linalg.norm(gw)
        assert not np.array_equal(rw, gw)  # the rounding really happened


def test_adams_applied_change_is_held_to_1e5_or_to_what_fp32_can_hold():
    """applied_errors: a change of many ulps is held to ADAM_ARITHMETIC of itself; a change of a few thousand ulps
    (fp32's own rounding above the bound) passes as the correctly rounded float64 result and fails one ulp off it."""
    rng = np.random.default_rng(7)
    start = [(rng.uniform(-0.1, 0.1, (4, 3)).astype(np.float32), np.array([0.0662, -0.05, 0.03], np.float32))]
    big = [(start[0][0] + 1e-3, start[0][1] + np.array([2e-3, -1e-3, 1e-3]))]  # float64 results, far from rounding
    off = [(big[0][0] * (1 + 2e-6), big[0][1])]  # the plain relative error, unscaled
    assert ref.applied_errors(off, big, start)[0] == pytest.approx(ref.relative(off[0][0] - start[0][0],
                                                                                 big[0][0] - start[0][0]), rel=1e-6)
    bad = [(big[0][0], big[0][1] + np.array([0.0, 0.0, 1e-7]))]
    assert ref.applied_errors(bad, big, start)[0] > ref.ADAM_ARITHMETIC
    # a settled bias: 7e-5 is about 10^4 ulps of 0.066, so fp32's nearest value misses 1e-5 of it
    small = [(big[0][0], start[0][1].astype(np.float64) + np.array([7.384e-5, 1e-5, -2e-5]) + 1e-12)]
    nearest = [(big[0][0], small[0][1].astype(np.float32))]
    assert ref.relative(nearest[0][1] - start[0][1], small[0][1] - start[0][1]) > ref.ADAM_ARITHMETIC
    assert ref.applied_errors(nearest, small, start)[0] <= ref.ADAM_ARITHMETIC
    one_off = [(big[0][0], np.nextafter(nearest[0][1], np.float32(1)))]
    assert ref.applied_errors(one_off, small, start)[0] > ref.ADAM_ARITHMETIC


def test_the_device_decides_only_a_relu_at_its_kink():
    """device_hidden sets the slope where |z| < KINK_MARGIN sum |h w| alone: a unit on the kink is on if the device's
    h > 0; one clear of it keeps the reference's slope whatever the device stored."""
    w0 = np.array([[1.0, 1.0, -1.0], [-1.0, 1.0, 1.0]])
    params = [(w0, np.array([0.0, 0.5, 0.0])), (np.ones((3, 1)), np.zeros(1))]
    d = 0.25 * ref.KINK_MARGIN  # z = +-2d against a margin of 2 KINK_MARGIN (sum |h w| = 2)
    x = np.array([[1.0 + d, 1.0 - d], [1.0 - d, 1.0 + d]])  # units 0 and 2 at the kink, unit 1 clear of it
    plain: list = []
    forward(params, x, slopes=plain)
    np.testing.assert_array_equal(plain[1], [[1, 1, 0], [0, 1, 1]])
    device = [np.array([[0.0, 0.0, 1e-5], [1e-5, 0.0, 0.0]])]  # the kink units the other way; unit 1 "off"
    taken: list = []
    forward(params, x, slopes=taken, device_hidden=device)
    np.testing.assert_array_equal(taken[1], [[0, 1, 1], [1, 1, 0]])
    far: list = []
    forward(params, x * [[1.0, 0.9], [0.9, 1.0]], slopes=far, device_hidden=device)  # z 0.1 from the kink
    np.testing.assert_array_equal(far[1], [[1, 1, 0], [0, 1, 1]])
