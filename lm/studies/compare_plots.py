"""The attention comparison's plots: MQAR accuracy over the grid, validation loss against training
tokens and time."""

from __future__ import annotations

from lm.studies.compare_tables import accuracy, best_lr, diverged, eval_loss, mean_and_spread, recall_cell, sweep
from lm.studies.plotting import line_style, pyplot


def mqar_plot(records: list[dict]):
    """Accuracy (the best learning rate's mean over seeds, bars one standard deviation) against
    whichever of width and pairs the grid varies more (log2 axis), one panel per value of the
    other, one line per kind; None without recall records."""
    cells = sweep(records, "mqar", recall_cell)
    if not cells:
        return None
    plt = pyplot()
    widths = sorted({w for by_cell in cells.values() for w, _ in by_cell})
    pairs = sorted({p for by_cell in cells.values() for _, p in by_cell})
    x_key, panel_key = ("pairs", "width") if len(pairs) >= len(widths) else ("width", "pairs")
    x_values, panels = (pairs, widths) if x_key == "pairs" else (widths, pairs)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), sharey=True, squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for i, (kind, by_cell) in enumerate(cells.items()):
            points = []
            for (w, p), by_lr in sorted(by_cell.items()):
                cell = {"width": w, "pairs": p}
                if cell[panel_key] == panel:
                    points.append((cell[x_key], *mean_and_spread([accuracy(r) for r in by_lr[best_lr(by_lr, accuracy,
                                                                                                         True)]])))
            if points:
                x, mean, spread = zip(*points, strict=True)
                ax.errorbar(x, mean, yerr=spread, label=kind, capsize=3, **line_style(i))
        ax.set_xscale("log", base=2)
        ax.set_xticks(x_values, [str(v) for v in x_values])
        ax.set_title(f"{'model width' if panel_key == 'width' else 'key-value pairs'} {panel}")
        ax.set_xlabel("key-value pairs" if x_key == "pairs" else "model width (d_model)")
        ax.set_ylim(-0.02, 1.02)
    axes[0][0].set_ylabel("MQAR accuracy (held-out answers)")
    # One legend for every panel: a kind run at some widths only (per_kind, or a study reported
    # before it finished) has no line in the last panel, but must still be named.
    handles = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    named = sorted(handles, key=list(cells).index)
    axes[0][-1].legend([handles[kind] for kind in named], named, fontsize="small")
    return fig


def validation_label(settings: dict) -> str:
    """What the curves' loss is measured on: training validates on the first `limit_val_batches`
    batches of the split, which on a corpus ordered by document need not read like the whole split
    the tables score (docs/studies.md)."""
    limit = settings["trainer"].get("limit_val_batches")
    if isinstance(limit, int) and not isinstance(limit, bool):
        tokens = limit * settings["data"]["batch_size"] * settings["model"]["max_seq_len"]
        return f"validation loss (the split's first {tokens / 1e3:.0f}k tokens)"
    return "validation loss"


def lm_loss_plot(records: list[dict]):
    """Validation loss against training tokens and against training wall-clock, one line per kind
    (the best learning rate, the mean over seeds); None without language modelling records."""
    cells = sweep(records, "lm", lambda r: ())
    if not cells:
        return None
    fig, (by_tokens, by_time) = pyplot().subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for i, (kind, by_cell) in enumerate(cells.items()):
        by_lr = by_cell[()]
        rs = [r for r in by_lr[best_lr(by_lr, eval_loss, False)] if not diverged(r)]
        if not rs:
            continue
        steps = min(len(r["history"]) for r in rs)  # history rows: (step, val loss, val accuracy, training seconds)
        s = rs[0]["settings"]
        tokens = [rs[0]["history"][j][0] * s["data"]["batch_size"] * s["model"]["max_seq_len"] / 1e6
                  for j in range(steps)]
        losses = [mean_and_spread([r["history"][j][1] for r in rs])[0] for j in range(steps)]
        seconds = [mean_and_spread([r["history"][j][3] for r in rs])[0] for j in range(steps)]
        by_tokens.plot(tokens, losses, markersize=3, label=kind, **line_style(i))
        by_time.plot(seconds, losses, markersize=3, label=kind, **line_style(i))
    by_tokens.set_xlabel("training tokens (millions)")
    by_time.set_xlabel("training wall-clock (s, validation excluded)")
    # every language-modelling arm of a study validates on the same batches
    by_tokens.set_ylabel(validation_label(next(r for r in records if r["task"] == "lm")["settings"]))
    by_time.legend()
    return fig
