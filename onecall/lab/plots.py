"""Small matplotlib helpers the lab's experiments share: one look for every plot in the report.

Every plot is a PNG of the same size and dpi (FIGSIZE at DPI), written to the path given, and the
path is returned so an experiment can put it straight into `ExperimentResult.plots`. The Agg
backend is chosen before pyplot is imported, so nothing here needs a display.

    line_plot(path, x, {"cache on": [...], "cache off": [...]}, title=..., xlabel=..., ylabel=...)
    bar_plot(path, ["layer 0", ...], {"control share": [...]}, title=..., xlabel=..., ylabel=...)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display, no GUI toolkit

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

FIGSIZE = (7.0, 4.0)  # inches
DPI = 110  # 770 x 440 pixels: readable inline in report.html, small as base64

Number = int | float


def line_plot(
    path: str | Path,
    x: Sequence[Number],
    series: Mapping[str, Sequence[Number | None]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logy: bool = False,
    logx: bool = False,
    markers: bool = True,
) -> Path:
    """One line per series, all over the same x; a None value leaves a gap. Returns `path`."""
    fig, ax = _figure()
    for label, ys in series.items():
        if len(ys) != len(x):
            raise ValueError(f"series {label!r} has {len(ys)} values for {len(x)} x values")
        values = [float("nan") if y is None else y for y in ys]
        ax.plot(list(x), values, marker="o" if markers else None, markersize=4, label=label)
    if logy:
        ax.set_yscale("log")
    if logx:
        ax.set_xscale("log", base=2)
    if all(isinstance(v, int) for v in x) and 0 < len(x) <= 24:
        ax.set_xticks(list(x), [str(v) for v in x])  # turns, layers, lengths: no 1.5 ticks
    return _finish(fig, ax, path, title=title, xlabel=xlabel, ylabel=ylabel, legend=len(series) > 1)


def bar_plot(
    path: str | Path,
    labels: Sequence[str | Number],
    series: Mapping[str, Sequence[Number]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logy: bool = False,
    horizontal_line: float | None = None,
) -> Path:
    """Grouped bars: one group per label, one bar per series in each group. `horizontal_line`
    draws a dashed reference line (e.g. an average). Returns `path`."""
    fig, ax = _figure()
    num_series = max(len(series), 1)
    width = 0.8 / num_series
    positions = list(range(len(labels)))
    for k, (label, ys) in enumerate(series.items()):
        if len(ys) != len(labels):
            raise ValueError(f"series {label!r} has {len(ys)} values for {len(labels)} labels")
        offset = (k - (num_series - 1) / 2) * width
        ax.bar([p + offset for p in positions], list(ys), width=width, label=label)
    if horizontal_line is not None:
        ax.axhline(horizontal_line, linestyle="--", linewidth=1, color="gray")
    ax.set_xticks(positions, [str(label) for label in labels])
    if len(labels) > 12:  # e.g. 30 layers: thin the tick labels out, rotated
        for i, tick in enumerate(ax.get_xticklabels()):
            tick.set_visible(i % max(len(labels) // 12, 1) == 0)
            tick.set_rotation(45)
    if logy:
        ax.set_yscale("log")
    return _finish(fig, ax, path, title=title, xlabel=xlabel, ylabel=ylabel, legend=len(series) > 1)


def _figure() -> tuple[Figure, plt.Axes]:
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _finish(
    fig: Figure, ax: plt.Axes, path: str | Path, *, title: str, xlabel: str, ylabel: str, legend: bool
) -> Path:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if legend:
        ax.legend(fontsize="small")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)  # figures are not garbage-collected while pyplot tracks them
    return path
