"""PyTorch peers: the same training step run eagerly, as one captured CUDA graph, and through torch.compile.

All three share one setup (data, init, optimizer, loss) so they differ only in how the step is launched.
The dataset, the batch order and every step's learning rate live on the GPU; each step gathers its batch and
sets its lr there, so the timed loop copies nothing from the host and never waits for the GPU. The optimizer is
torch.optim.SGD, Adam or AdamW with fused=True and a tensor lr (the form CUDA graphs capture).
"""

from __future__ import annotations

import time
import warnings

from .common import LOSS_TAIL, PeerResult, Workload, step_indices

SYSTEMS = ("torch-eager", "torch-graph", "torch-compile")
GRAPH_WARMUP = 3  # eager side-stream iterations before capture, as the PyTorch CUDA-graph docs prescribe


def available() -> str | None:
    """None if torch can run on a CUDA GPU here, else why not."""
    try:
        import torch
    except ImportError as exc:
        return f"torch is not importable: {exc}"
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        return f"torch {torch.__version__} ({build}) sees no usable CUDA device"
    return None


def run(system: str, w: Workload, data) -> PeerResult:
    """Warm up, re-initialise, then time w.steps steps of `system`; data is common.mnist_arrays(), or a table's
    (x_train, y_train, x_test, y_test) of w's shape."""
    if system not in SYSTEMS:
        raise ValueError(f"unknown torch system {system!r}; expected one of {', '.join(SYSTEMS)}")
    w.check_data(data)
    if (reason := available()) is not None:
        raise RuntimeError(f"{system}: {reason}")
    import torch

    setup = _Setup(w, data)
    try:
        driver = {"torch-eager": _eager, "torch-graph": _graph, "torch-compile": _compiled}[system]
        with warnings.catch_warnings():
            # Adam's capturable=True warns when stepped outside a capture; the fused path it takes ignores the flag
            # (see _optimizer), so there is nothing to impair.
            warnings.filterwarnings("ignore", message="This instance was constructed with capturable=True")
            us, note = driver(setup, w)
        accuracy, rmse = setup.test_quality()
        return PeerResult(system, w.hidden, w.steps, us, accuracy, setup.final_loss(w.steps),
                          f"torch {torch.__version__}{note}", test_rmse=rmse)
    finally:
        del setup
        if system == "torch-compile":
            # Drop compiled code and its CUDA-graph pool: otherwise each new hidden size adds a recompile to the
            # same code object, and past torch._dynamo's recompile limit torch silently falls back to eager.
            torch.compiler.reset()
        torch.cuda.empty_cache()  # give the memory back, so a peer that runs next in this process (JAX) gets it



def mlp(nn, widths, activation: str = "relu"):
    """nn.Sequential of Linear layers of these widths (inputs ... classes), the activation between them."""
    make = {"relu": nn.ReLU, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "silu": nn.SiLU,
            "tanh": nn.Tanh}[activation]
    layers = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        layers += [nn.Linear(fan_in, fan_out), make()]
    return nn.Sequential(*layers[:-1])

class _Setup:
    """Device-resident data, the seeded model and its saved init, optimizer, loss buffer: identical per variant."""

    def __init__(self, w: Workload, data) -> None:
        import torch
        from torch import nn

        train_x, train_y, test_x, test_y = data
        dev = torch.device("cuda")
        self.w = w
        self.x = _upload(train_x, dev)  # in the data's dtype (uint8, fp16, fp32): converted per batch, like rawgpu
        # converted once: cross_entropy wants int64 labels; a regression's values standardized as rawgpu's
        self.y = _upload(w.targets(train_y), dev)
        self.test_x, self.test_y = _upload(test_x, dev), _upload(w.targets(test_y), dev)
        if not w.regression:
            self.y, self.test_y = self.y.long(), self.test_y.long()
        self.mean, self.inv_std = (_upload(a, dev) for a in w.scaling) if w.scaling is not None else (None, None)
        order = step_indices(w.index_steps, w.batch, w.seed, w.train_rows)
        self.order = _upload(order, dev).long().view(w.index_steps, w.batch)  # row s: the rows of step s
        torch.manual_seed(w.seed)
        self.model = mlp(nn, w.widths, w.activation).to(dev)  # fp32 masters
        if w.init is not None:  # the shared init: nn.Linear stores W as [fan_out, fan_in]
            with torch.no_grad():
                for layer, (wt, b) in zip(self.model[::2], w.init):
                    layer.weight.copy_(torch.from_numpy(wt.T.copy()))
                    layer.bias.copy_(torch.from_numpy(b))
        self.init = [p.detach().clone() for p in self.model.parameters()]
        self.lrs = _upload(w.learning_rates(), dev)  # step s's lr, as rawgpu computes it
        self.lr = self.lrs[0].clone()  # the optimizer's lr: each step copies its own into it on the device
        self.scheduled = w.schedule != "constant"  # a constant lr needs no copy
        self.opt = _optimizer(self.model.parameters(), self.lr, w)
        self.losses = torch.zeros(w.index_steps, device=dev)  # per-step loss, read once after timing
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)  # step counter on the device (graph variant)

    def features(self, x):
        """A batch of features as the model reads them (common.features): float32, bytes / 255, then standardized
        where the workload is (out of place: a float32 table's .float() is the table itself)."""
        import torch

        pixels = x.dtype == torch.uint8
        x = x.float()
        if pixels:
            x = x.div_(255)
        if self.mean is not None:
            x = (x - self.mean) * self.inv_std
        return x

    def loss(self, model, idx):
        """Mean cross-entropy (a regression's mean squared error) of the batch at rows idx (a device tensor), fp16
        compute via autocast.

        No GradScaler: none is needed for this comparison, and every torch variant runs the same numerics.
        cache_enabled=False: the autocast weight-cast cache must not outlive a CUDA-graph capture, and each
        weight is cast once per step anyway, so the cache saves nothing here.
        """
        import torch
        import torch.nn.functional as F

        x = self.features(self.x.index_select(0, idx))
        y = self.y.index_select(0, idx)
        with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):
            if self.w.regression:
                return F.mse_loss(model(x).float(), y)
            return F.cross_entropy(model(x), y)

    def reset(self) -> None:
        """Back to the seeded init and step 0, in place, so captured graphs keep valid pointers."""
        import torch

        with torch.no_grad():
            for p, p0 in zip(self.model.parameters(), self.init):
                p.copy_(p0)
                # SGD's momentum buffer, Adam's moments and step count: zero is what a fresh state gives (SGD's
                # first step sets v = g, and v = mu 0 + g is the same; Adam counts from step 0 and zero moments).
                for t in self.opt.state.get(p, {}).values():
                    if torch.is_tensor(t):
                        t.zero_()
            self.pos.zero_()
            self.losses.zero_()

    def test_quality(self) -> tuple[float | None, float | None]:
        """(fraction of the test rows classified right, None), or a regression's (None, test RMSE in the targets'
        units); fp16 autocast forward on the eager module."""
        import torch

        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):
            out = self.model(self.features(self.test_x))
        if self.w.regression:
            mse = (out.double() - self.test_y.double()).square().mean().item()
            return None, mse ** 0.5 * self.w.target_scale
        return (out.argmax(dim=1) == self.test_y).float().mean().item(), None

    def final_loss(self, steps: int) -> float:
        """Mean training loss of the last LOSS_TAIL timed steps (one host read, after timing)."""
        return self.losses[max(0, steps - LOSS_TAIL):steps].mean().item()


def _optimizer(params, lr, w: Workload):
    """torch.optim's SGD, Adam or AdamW for w, fused, with the device tensor lr that every step sets.

    Adam and AdamW need capturable=True only because step() refuses a CUDA-graph capture without it: the fused
    kernel keeps the step count on the device and reads lr from the tensor whatever the flag, so all three torch
    variants run this one construction and the same arithmetic.
    """
    import torch

    if w.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=w.momentum, nesterov=w.nesterov, weight_decay=w.weight_decay,
                               fused=True)
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[w.optimizer]
    return cls(params, lr=lr, betas=w.betas, eps=w.eps, weight_decay=w.weight_decay, fused=True, capturable=True)


def _upload(array, dev):
    import torch

    return torch.from_numpy(array).to(dev)


def _time(run_steps, steps: int) -> float:
    """Microseconds per step of run_steps(steps), CUDA events on the current stream around the whole run."""
    import torch

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run_steps(steps)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / steps


def _loop(setup: _Setup, model, steps: int) -> None:
    """The plain training loop a user writes; records the loss of the last LOSS_TAIL steps on the device."""
    tail = steps - LOSS_TAIL
    for s in range(steps):
        setup.opt.zero_grad(set_to_none=True)
        loss = setup.loss(model, setup.order[s])  # a view: no copy, no kernel
        loss.backward()
        if setup.scheduled:
            setup.lr.copy_(setup.lrs[s])  # on the device, like a scheduler that keeps its lr there
        setup.opt.step()
        if s >= tail:
            setup.losses[s] = loss.detach().float()  # a device copy, no host read


def _eager(setup: _Setup, w: Workload) -> tuple[float, str]:
    _loop(setup, setup.model, w.warmup_steps)
    setup.reset()
    return _time(lambda n: _loop(setup, setup.model, n), w.steps), ""


def _compiled(setup: _Setup, w: Workload) -> tuple[float, str]:
    """torch.compile(max-autotune) model (which also uses CUDA graphs), eager optimizer; compile is warm-up."""
    import torch

    model = torch.compile(setup.model, mode="max-autotune")
    t0 = time.perf_counter()
    _loop(setup, model, w.warmup_steps)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    setup.reset()
    return _time(lambda n: _loop(setup, model, n), w.steps), f", mode=max-autotune, warm-up+compile {compile_s:.0f}s"


def _graph_step(setup: _Setup) -> None:
    """One step whose batch position comes from the device counter, so the captured graph walks the order."""
    idx = setup.order.index_select(0, setup.pos).view(-1)
    loss = setup.loss(setup.model, idx)
    loss.backward()
    if setup.scheduled:
        setup.lr.copy_(setup.lrs.index_select(0, setup.pos).view(()))
    setup.opt.step()
    setup.losses.index_copy_(0, setup.pos, loss.detach().float().view(1))
    setup.pos.add_(1)


def _graph(setup: _Setup, w: Workload) -> tuple[float, str]:
    """Whole-step CUDA graph (forward, backward, optimizer step), captured after side-stream warm-up, replayed per
    step."""
    import torch

    side = min(GRAPH_WARMUP, w.warmup_steps)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(side):
            setup.opt.zero_grad(set_to_none=True)
            _graph_step(setup)
    torch.cuda.current_stream().wait_stream(stream)
    # Grads set to None before capture: backward then allocates them from the graph's private pool, and every
    # replay overwrites them in place, so no zero_grad is needed between replays.
    setup.opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _graph_step(setup)
    for _ in range(w.warmup_steps - side):
        graph.replay()
    setup.reset()

    def replay(n: int) -> None:
        for _ in range(n):
            graph.replay()

    return _time(replay, w.steps), ""
