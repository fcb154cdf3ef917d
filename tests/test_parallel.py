"""The split of a model over several GPUs (rawgpu/steps/split.py): the plan's shapes and collectives, the choice
between tensor and data parallelism, and, in float64, that a training step run shard by shard with the plan's
all-reduces (sums over the ranks) gives the one-GPU step's weights."""

from __future__ import annotations

import numpy as np
import pytest

from rawgpu.steps import split as P


def test_layers_alternate_columns_and_rows_and_the_head_follows_the_last_hidden_layer():
    p = P.plan_tensor_parallel([784, 8192, 8192, 8192, 16], batch=32, ranks=4)
    assert [s.split for s in p.shards] == ["columns", "rows", "columns", "rows"]
    assert [(s.fan_in, s.fan_out) for s in p.shards] == [(784, 2048), (2048, 8192), (8192, 2048), (2048, 16)]
    assert p.collectives() == [("forward", 1, 32 * 8192), ("forward", 3, 32 * 16), ("backward", 2, 32 * 8192)]
    assert p.weights_per_rank() * 4 == sum(a * b for a, b in zip(p.widths, p.widths[1:]))
    assert p.wire_bytes() == int(2 * 3 * (2 * 32 * 8192 + 32 * 16) * 4 / 4)
    even = P.plan_tensor_parallel([784, 1000, 1000, 10], batch=64, ranks=3)
    assert [s.split for s in even.shards] == ["columns", "rows", "whole"]
    assert even.widths == (784, 1008, 1008, 10), "1000 over 3 ranks: 336 columns each"
    assert [s.sharded_bias for s in even.shards] == [True, False, False]
    assert even.collectives() == [("forward", 1, 64 * 1008)], "a whole head needs no exchange"


def test_the_choice_moves_fewer_bytes_and_says_so():
    wide = P.choose([784, 8192, 8192, 8192, 16], batch=32, ranks=8)
    assert wide.kind == "tensor" and "all-reduces of activations" in wide.reason
    small = P.choose([784, 256, 256, 256, 16], batch=4096, ranks=8)
    assert small.kind == "data" and "gradients move" in small.reason
    assert P.choose([784, 256, 256, 256, 16], batch=4095, ranks=8).kind == "tensor", "the batch must split"
    assert P.choose([784, 256, 16], batch=128, ranks=1).kind == "one GPU"


def test_shards_gather_back_to_the_whole_layer_and_replicas_must_agree(rng):
    plan = P.plan_tensor_parallel([20, 30, 30, 30, 5], batch=4, ranks=3)
    for i, s in enumerate(plan.shards):
        w = rng.standard_normal((plan.widths[i], plan.widths[i + 1]))
        b = rng.standard_normal(plan.widths[i + 1])
        parts = [P.shard(plan, i, r, w, b) for r in range(3)]
        assert all(p[0].shape == (s.fan_in, s.fan_out) for p in parts)
        got_w, got_b = P.gather(plan, i, [p[0] for p in parts], [p[1] for p in parts])
        assert np.array_equal(got_w, w) and np.array_equal(got_b, b)
        if not s.sharded_bias:
            with pytest.raises(ValueError, match="copies of its bias differ"):
                P.gather(plan, i, [p[0] for p in parts], [parts[0][1], parts[1][1] + 1, parts[2][1]])
    with pytest.raises(ValueError, match="not the plan's"):
        P.shard(plan, 0, 0, np.zeros((20, 30)), np.zeros(30))


@pytest.mark.parametrize("kw,msg", [(dict(widths=[784, 10], batch=8, ranks=2), "has none"),
                                    (dict(widths=[784, 64, 10], batch=8, ranks=0), "ranks must be")])
def test_bad_plans_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        P.plan_tensor_parallel(**kw)


# --- the plan's step in float64 ----------------------------------------------------------------------------------


def softmax_grad(logits: np.ndarray, y: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    return p / len(y)


def full_step(x, y, W, b, lr):
    acts = [x]
    for i in range(len(W)):
        z = acts[-1] @ W[i] + b[i]
        acts.append(np.maximum(z, 0) if i < len(W) - 1 else z)
    dy = softmax_grad(acts[-1], y)
    W, b = [w.copy() for w in W], [v.copy() for v in b]
    for i in reversed(range(len(W))):
        dx = (dy @ W[i].T) * (acts[i] > 0)
        W[i] -= lr * acts[i].T @ dy
        b[i] -= lr * dy.sum(axis=0)
        dy = dx
    return W, b


def sharded_step(plan, x, y, W, b, lr):
    """The step as the ranks run it: rank r holds its shards only; `sum(...)` over ranks is an all-reduce."""
    R = plan.ranks
    parts = [[P.shard(plan, i, r, W[i], b[i]) for r in range(R)] for i in range(len(W))]
    Ws = [[w for w, _ in layer] for layer in parts]
    bs = [[v for _, v in layer] for layer in parts]
    last = len(W) - 1
    inputs = [[x] * R]  # inputs[i][r]: what layer i reads on rank r
    for i, s in enumerate(plan.shards):
        a = inputs[i]
        act = (lambda z: z) if i == last else (lambda z: np.maximum(z, 0))
        if s.split == "columns":
            inputs.append([act(a[r] @ Ws[i][r] + bs[i][r]) for r in range(R)])
        elif s.split == "rows":
            z = sum(a[r] @ Ws[i][r] for r in range(R))  # all-reduce, then the whole bias
            inputs.append([act(z + bs[i][r]) for r in range(R)])
        else:
            inputs.append([act(a[r] @ Ws[i][r] + bs[i][r]) for r in range(R)])
    dlogits = [softmax_grad(inputs[-1][r], y) for r in range(R)]
    assert all(np.array_equal(d, dlogits[0]) for d in dlogits), "every rank has the whole logits"
    dy = dlogits
    for i in reversed(range(len(W))):
        s, a = plan.shards[i], inputs[i]
        if s.split == "columns":
            dx = sum(dy[r] @ Ws[i][r].T for r in range(R))  # all-reduce (the first layer needs none)
            dx = [dx * (a[r] > 0) for r in range(R)]
        else:  # rows: each rank's input slice; whole: the whole input
            dx = [(dy[r] @ Ws[i][r].T) * (a[r] > 0) for r in range(R)]
        for r in range(R):
            Ws[i][r] -= lr * a[r].T @ dy[r]
            bs[i][r] -= lr * dy[r].sum(axis=0)
        dy = dx
    gathered = [P.gather(plan, i, Ws[i], bs[i]) for i in range(len(W))]  # checks the replicas agree
    return [w for w, _ in gathered], [v for _, v in gathered]


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("hidden", [[13], [13, 21], [20, 13, 17], [9, 30, 9, 30]])
def test_the_plans_step_is_the_one_gpu_step(rng, ranks, hidden):
    widths = [11] + hidden + [5]
    plan = P.plan_tensor_parallel(widths, batch=7, ranks=ranks)
    full = plan.widths
    W, b = [], []
    for i, (a, c) in enumerate(zip(widths, widths[1:])):  # true weights, zero in the padding (as on one GPU)
        w = np.zeros((full[i], full[i + 1]))
        w[:a, :c] = rng.standard_normal((a, c))
        v = np.zeros(full[i + 1])
        v[:c] = rng.standard_normal(c) * 0.1
        W.append(w)
        b.append(v)
    x = np.zeros((7, full[0]))
    x[:, :widths[0]] = rng.standard_normal((7, widths[0]))
    y = rng.integers(0, widths[-1], 7)
    want_W, want_b = full_step(x, y, W, b, 0.1)
    got_W, got_b = sharded_step(plan, x, y, W, b, 0.1)
    for i in range(len(W)):
        np.testing.assert_allclose(got_W[i], want_W[i], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got_b[i], want_b[i], rtol=1e-12, atol=1e-12)
        assert not (want_W[i] == W[i]).all(), "the step moved the weights"
