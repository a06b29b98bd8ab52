"""What the studies write: results.json, results.md and their plots, from the arms' records.

`write_results` writes them together. The tables and plots are the studies' own: the attention
comparison's in compare_tables and compare_plots (its recall-memory frontier's in frontier_report),
the uptraining ablation's in ablation_report;
they and the plot set-up (plotting) are importable from here as well.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from lm.studies.ablation_report import ablation_table, uptraining_plot
from lm.studies.compare_plots import lm_loss_plot, mqar_plot, validation_label
from lm.studies.compare_tables import comparison_table, language_table, machine_line, recall_tables
from lm.studies.frontier_report import frontier_plot, frontier_tables
from lm.studies.plotting import pyplot, render, save_figure
from lm.util.files import write_folder_atomically

__all__ = ["write_results", "ablation_table", "uptraining_plot", "lm_loss_plot", "mqar_plot", "validation_label",
           "comparison_table", "language_table", "machine_line", "recall_tables", "frontier_plot", "frontier_tables",
           "pyplot", "save_figure"]


def write_results(out: Path, results: dict, table: str, plots: dict[str, Callable[[list[dict]], object]]) -> None:
    """results.json, results.md and each plot that has something to show, written together: all
    are rendered first, so a failing plot leaves the previous files as they were, and a plot left
    from an earlier run that now has nothing to show is removed. Then the table and what was
    written, on the terminal."""
    text = json.dumps(results, indent=1) + "\n"
    figures = {name: plot(results["records"]) for name, plot in plots.items()}

    def write_into(folder: Path) -> None:
        (folder / "results.json").write_text(text)
        (folder / "results.md").write_text(table)
        for name, figure in figures.items():
            if figure is not None:
                render(figure, folder / name)

    write_folder_atomically(out, write_into)
    written = ["results.json", "results.md", *(name for name, figure in figures.items() if figure is not None)]
    for name in (name for name, figure in figures.items() if figure is None):
        (out / name).unlink(missing_ok=True)  # it would show arms these results no longer hold
    print(table)
    print(f"this command took {results['seconds'] / 60:.1f} min; wrote {', '.join(written)} under {out}")
