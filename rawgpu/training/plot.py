"""PNGs: a training run's train loss and test accuracy per epoch, side by side; a sweep's best test accuracy against
each swept setting.

matplotlib is optional (the `plot` extra: install.hint says how). It is drawn through a Figure and the Agg canvas directly,
never pyplot, so no global backend is chosen or changed and nothing needs a display.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

from ..runtime.errors import RawgpuError
from ..runtime.files import cannot_create_in, write_atomic


class PlotUnavailable(RawgpuError):
    """matplotlib is not installed."""

    def __init__(self) -> None:
        from ..runtime.install import hint

        super().__init__(f"--plot needs matplotlib: {hint('plot')}")


def plot_available() -> bool:
    """Whether write_plot can draw, so a CLI can refuse --plot before training rather than after."""
    try:
        _matplotlib()
    except PlotUnavailable:
        return False
    return True


def check_plot_path(path: str | Path) -> str | None:
    """The one-line reason write_plot could not write `path`, or None; for rejecting --plot before training."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        return f"{path}: the plot is a PNG, so its name must end in .png"
    if path.is_dir():
        return f"{path}: is a directory"
    parent = path.parent
    if not parent.is_dir():
        return f"{path}: directory {parent} does not exist"
    if problem := cannot_create_in(parent):
        return f"{path}: {problem}"
    return None


def write_plot(path: str | Path, epochs: list[int], train_loss: list[float], test_accuracy: list[float],
               title: str = "", test_rmse: list[float] | None = None) -> None:
    """Draw loss and accuracy against epoch into the PNG `path`, atomically (a temp file, then os.replace).

    ``test_accuracy`` holds fractions (0..1, as training reports them) and is drawn in percent; a regression gives
    ``test_rmse`` instead, drawn as it is. The loss axis is logarithmic when every loss is positive and finite; NaN
    or infinite losses are left out of the line.
    """
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"{path}: the plot is a PNG, so its name must end in .png")
    if not len(epochs) == len(train_loss) == len(test_accuracy):
        raise ValueError(f"{len(epochs)} epochs, {len(train_loss)} losses and {len(test_accuracy)} accuracies: "
                         "expected one of each per epoch")
    Figure, FigureCanvasAgg, MaxNLocator = _matplotlib()
    figure = Figure(figsize=(10, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    loss_axes, accuracy_axes = figure.subplots(1, 2)
    loss_axes.plot(epochs, train_loss, marker="o", color="tab:blue")
    loss_axes.set(xlabel="epoch", ylabel="train loss", title="train loss")
    if train_loss and all(math.isfinite(v) and v > 0 for v in train_loss):
        loss_axes.set_yscale("log")
    if test_rmse is not None:
        accuracy_axes.plot(epochs, test_rmse, marker="o", color="tab:green")
        accuracy_axes.set(xlabel="epoch", ylabel="test RMSE", title="test RMSE")
    else:
        accuracy_axes.plot(epochs, [100.0 * a for a in test_accuracy], marker="o", color="tab:green")
        accuracy_axes.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy")
    for axes in (loss_axes, accuracy_axes):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(True, which="both", alpha=0.3)
    _save(figure, path, title)


def write_sweep_plot(path: str | Path, axes: dict[str, list], accuracies: list[float], title: str = "",
                     regression: bool = False) -> None:
    """One panel per swept setting: every model's best test accuracy (fractions, drawn in percent), or with
    regression its best test RMSE, against its value of that setting. axes: setting -> each model's value (numbers on a log axis where all are positive and they
    span a decade or more; betas as their first value; words as categories)."""
    path = Path(path)
    if problem := check_plot_path(path):
        raise ValueError(problem)
    Figure, FigureCanvasAgg, _ = _matplotlib()
    panels = axes or {"model": list(range(len(accuracies)))}
    figure = Figure(figsize=(4.5 * len(panels), 4), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    for ax, (name, values) in zip(figure.subplots(1, len(panels), squeeze=False)[0], panels.items()):
        xs = [v[0] if isinstance(v, (tuple, list)) else v for v in values]
        if all(isinstance(x, str) for x in xs):
            names = sorted(set(xs))
            xs = [names.index(x) for x in xs]
            ax.set_xticks(range(len(names)), names)
        elif all(x > 0 for x in xs) and max(xs) >= 10 * min(xs):
            ax.set_xscale("log")
        ax.scatter(xs, accuracies if regression else [100.0 * a for a in accuracies], alpha=0.7)
        ax.set(xlabel=name + (" (beta1)" if name == "betas" else ""),
               ylabel="best test RMSE" if regression else "best test accuracy (%)")
        ax.grid(True, which="both", alpha=0.3)
    _save(figure, path, title)


def _save(figure, path: Path, title: str) -> None:
    """The figure, titled, as a PNG at `path`, atomically."""
    if title:
        figure.suptitle(title)
    png = io.BytesIO()
    figure.savefig(png, format="png")
    try:
        write_atomic(path, png.getvalue())
    except OSError as e:
        raise RawgpuError(f"{path}: cannot write the plot: {e.strerror or e}") from None


def _matplotlib():
    try:  # `import a.b as c` also imports `a`, so a missing or blocked matplotlib fails even with submodules cached
        import matplotlib.backends.backend_agg as agg
        import matplotlib.figure as figure
        import matplotlib.ticker as ticker
    except ImportError:
        raise PlotUnavailable() from None
    return figure.Figure, agg.FigureCanvasAgg, ticker.MaxNLocator
