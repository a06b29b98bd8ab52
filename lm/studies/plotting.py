"""One matplotlib set-up for every plot the studies and benchmarks draw, and how a figure is written."""

from __future__ import annotations

from pathlib import Path

from lm.util.files import write_atomically

STYLE = {"axes.grid": True, "grid.alpha": 0.3, "legend.fontsize": 8, "savefig.dpi": 110}
MARKERS = "os^Dv<>PX*h"


def pyplot():
    """matplotlib.pyplot with the style of every study plot, on the Agg backend: files only, so
    no display is needed and a plot looks the same on every machine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(STYLE)
    return plt


def line_style(i: int) -> dict:
    """The i-th line's look: the ten default colours with a marker each; from the eleventh line on
    the colours come round again, dashed and with another marker, so no two of 20 lines look alike."""
    style = {"marker": MARKERS[i % len(MARKERS)], "color": f"C{i % 10}"}
    return style if i < 10 else {**style, "linestyle": "--"}


def render(figure, path: Path) -> None:
    """The figure as a PNG at `path`, its memory released."""
    figure.tight_layout()
    figure.savefig(path, format="png")
    pyplot().close(figure)


def save_figure(figure, path: Path) -> None:
    """Written under a temporary name and renamed, like every file lm writes."""
    write_atomically(path, lambda tmp: render(figure, tmp))
