"""The recall-memory frontier's table and plot (lm.studies.frontier): per test cell, each kind's
accuracy against the bytes its decoding state holds at that length, and the Pareto frontier over
every kind (the points no other point beats with fewer or equal bytes).

A state size's number is the best learning rate's mean over seeds, the rate chosen by its first
seed's held-out accuracy on the training mix, as the rate search chose it (one model per point for
every test, not the best rate per test). A point is marked stopped by the budget when a seed of that
rate ran every step and its last held-out accuracy still rose by more than `frontier.still_learning`
over the one before: a fixed-state kind still learning at its last step has not shown its limit.
Nor has one that ran every step and never left MQAR's plateau (its last accuracy on the mix at most
`frontier.plateau`): the task is learnt in a jump after a flat stretch near chance, so the budget
may have ended before the jump, or the kind may never make it; those points are marked too, and
neither reading is claimed. Nor has one whose best rate is the highest or lowest it ran (*edge*).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lm.studies.compare_tables import best_lr, diverged, mean_and_spread, si_bytes
from lm.studies.plotting import line_style, pyplot


@dataclass
class StatePoint:
    """One kind at one state size, at its best learning rate."""

    kind: str
    label: str  # the knobs, "window=16"
    lr: float
    seeds: int
    diverged: int  # seeds of that rate that diverged (they count as accuracy 0)
    budget_stopped: bool  # still learning at its last step
    on_plateau: bool  # ran every step and never left the plateau near chance
    bracketed: bool  # its best rate lies between two rates it ran: a rate further out did worse each way
    accuracy: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)  # test -> (mean, spread)
    state_bytes: dict[tuple[int, int], int] = field(default_factory=dict)  # test -> bytes per sequence


def mix_accuracy(r: dict) -> float:
    return 0.0 if diverged(r) else r["val_accuracy"]


def ran_every_step(r: dict) -> bool:
    """Whether the run took every step its cap allowed without stopping for its accuracy (a run that
    passed trainer.stop_at_accuracy at the cap's own validation stopped for it)."""
    trainer = r["settings"]["trainer"]
    stop = trainer.get("stop_at_accuracy")
    return (not diverged(r) and r["steps"] >= trainer["max_steps"]
            and not (stop is not None and r["val_accuracy"] >= stop))


def best_rate(by_lr: dict[float, list[dict]]) -> float:
    """The rate whose first seed (the one the rate search ran) reached the highest accuracy on the
    mix: the other seeds run at the rate it chose, so their mean does not choose again."""
    return best_lr({lr: [min(rs, key=lambda r: r["seed"])] for lr, rs in by_lr.items()}, mix_accuracy, True)


def still_learning(r: dict, threshold: float) -> bool:
    """Whether the arm ran every step and its held-out accuracy rose by more than `threshold`
    between its last two validations."""
    if not ran_every_step(r) or len(r["history"]) < 2:
        return False
    return r["history"][-1][2] - r["history"][-2][2] > threshold


def on_plateau(r: dict, plateau: float) -> bool:
    """Whether the arm ran every step and ended with its held-out accuracy on the mix at most `plateau`."""
    return ran_every_step(r) and r["val_accuracy"] <= plateau


def state_points(records: list[dict], threshold: float, plateau: float) -> list[StatePoint]:
    """Every (kind, state size) of the frontier records, in the records' order."""
    grouped: dict[tuple[str, str], dict[float, list[dict]]] = {}
    for r in records:
        if r["task"] == "frontier":
            grouped.setdefault((r["kind"], r["point"]), {}).setdefault(r["lr"], []).append(r)
    points = []
    for (kind, label), by_lr in grouped.items():
        lr = best_rate(by_lr)
        rs = by_lr[lr]
        kept = [r for r in rs if not diverged(r)]
        point = StatePoint(kind, label, lr, len(rs), len(rs) - len(kept),
                           any(still_learning(r, threshold) for r in rs), any(on_plateau(r, plateau) for r in rs),
                           min(by_lr) < lr < max(by_lr))
        # the bytes do not depend on the rate or the seed: any finished record of the point says them
        measured = next((r for rates in by_lr.values() for r in rates if not diverged(r)), None)
        if measured is not None:
            for t in measured["tests"]:
                cell = (t["seq_len"], t["pairs"])
                point.state_bytes[cell] = t["state_bytes"]
                scores = [next(u["accuracy"] for u in r["tests"] if (u["seq_len"], u["pairs"]) == cell)
                          if not diverged(r) else 0.0 for r in rs]
                point.accuracy[cell] = mean_and_spread(scores)
        points.append(point)
    return points


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the (bytes, accuracy) points no other point dominates (fewer or equal bytes and
    higher or equal accuracy, one of them strictly), in order of bytes."""
    front = [i for i, (b, a) in enumerate(points)
             if not any(b2 <= b and a2 >= a and (b2 < b or a2 > a) for b2, a2 in points)]
    return sorted(front, key=lambda i: points[i])


def test_cells(points: list[StatePoint]) -> list[tuple[int, int]]:
    return sorted({cell for p in points for cell in p.state_bytes})


def panel(points: list[StatePoint], cell: tuple[int, int]) -> tuple[list[StatePoint], set[int]]:
    """The points measured at a test cell, sorted by bytes, and the positions of those on its front."""
    shown = sorted((p for p in points if cell in p.state_bytes), key=lambda p: (p.state_bytes[cell], p.kind))
    front = pareto_front([(p.state_bytes[cell], p.accuracy[cell][0]) for p in shown])
    return shown, set(front)


def frontier_tables(records: list[dict], settings: dict) -> list[str]:
    if not any(r["task"] == "frontier" for r in records):
        return []
    f = settings["frontier"]
    points = state_points(records, f["still_learning"], f["plateau"])
    train = " ".join(f"{s}/{p}" for s, p in f["train"])
    lrs = sorted({r["lr"] for r in records if r["task"] == "frontier"})
    seeds = max(p.seeds for p in points)
    lines = ["### Recall against decoding-state size (the frontier)", "",
             f"Trained on the mix (sequence/pairs) {train} together, vocabulary {f['vocab_size']}, {f['n_layer']} "
             f"layers unless the knob sets them, width {f['width']} unless the knob is the width, "
             f"{f['short_conv']}-tap short convolution, at most {f['steps']} steps of {f['batch_size']} examples"
             + (f", stopping at {f['stop_at_accuracy']} on the mix" if f.get("stop_at_accuracy") else "")
             + f"; tested on {f['test_examples']} fresh examples per cell. State bytes: the model's own "
             "generation cache for one sequence of the test's length (every layer's cache and short convolution). "
             f"Each point: the best of the learning rates it ran (of {', '.join(f'{lr:g}' for lr in lrs)}) by its "
             f"first seed's accuracy on the mix, mean ± standard deviation over up to {seeds} "
             f"seed{'s' if seeds > 1 else ''} at that rate. **front**: on the "
             "Pareto frontier of its test; *budget*: still learning at its last step (a seed ran every step and "
             "its held-out accuracy still rose), so its accuracy is not the kind's limit; *plateau*: a seed ran "
             f"every step and ended at most {f['plateau']:g} on the mix, still on the flat stretch before MQAR's "
             "jump, so the budget may have stopped it before the jump or the kind may never make it: not a "
             "measured limit either; *edge*: its best rate is the highest or lowest it ran, so a rate further "
             "out might do better (not bracketed).", ""]
    for cell in test_cells(points):
        shown, front = panel(points, cell)
        lines += [f"#### Sequence {cell[0]}, {cell[1]} pairs", "",
                  "| kind | state size | state bytes | accuracy | lr | |", "| --- | --- | ---: | ---: | ---: | --- |"]
        for i, p in enumerate(shown):
            mean, spread = p.accuracy[cell]
            notes = [n for n, on in (("**front**", i in front), ("*budget*", p.budget_stopped),
                                     ("*plateau*", p.on_plateau), ("*edge*", not p.bracketed),
                                     (f"{p.diverged} of {p.seeds} diverged", p.diverged)) if on]
            lines.append(f"| {p.kind} | {p.label} | {si_bytes(p.state_bytes[cell])} | {mean:.3f}"
                         + (f" ± {spread:.3f}" if p.seeds > 1 else "") + f" | {p.lr:g} | {', '.join(notes)} |")
        lines.append("")
    unmeasured = [f"{p.kind} ({p.label})" for p in points if not p.state_bytes]
    if unmeasured:
        lines += [f"Diverged at every learning rate, so not on the plot: {', '.join(unmeasured)}.", ""]
    return lines


def measured_limit(p: StatePoint) -> bool:
    """Whether the point's accuracy is the kind's limit at that state: not stopped by the budget while
    still learning, not still on the plateau, its rate bracketed."""
    return not (p.budget_stopped or p.on_plateau) and p.bracketed


def values_of(records: list[dict]) -> int | None:
    """How many value tokens the records' task draws answers from (the upper half of the vocabulary)."""
    vocab = next((r["settings"]["data"]["vocab_size"] for r in records
                  if r["task"] == "frontier" and "data" in r.get("settings", {})), None)
    return None if vocab is None else vocab - vocab // 2


def frontier_plot(records: list[dict], threshold: float, plateau: float):
    """One panel per test cell, and a summary panel of each point's mean over the test cells (as
    Based's Figure 2 averages its sequence lengths), at the longest test's state bytes: accuracy against
    state bytes (log axis), one line per kind joining its state sizes in order of bytes, hollow markers
    where a point is not a measured limit (still learning or on the plateau at its last step, or its
    rate not bracketed), the Pareto frontier as a black step line, chance (one value of all) and one
    value of the example's own (1 / pairs) as grey lines; None without frontier records."""
    points = state_points(records, threshold, plateau)
    cells = test_cells(points)
    if not cells:
        return None
    plt = pyplot()
    columns = min(len(cells) + 2, 4)  # the tests, the summary and the legend's slot
    rows = -(-(len(cells) + 2) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.9 * rows), sharey=True, squeeze=False)
    kinds = list(dict.fromkeys(p.kind for p in points))
    values = values_of(records)
    longest = cells[-1]
    summary = [StatePoint(p.kind, p.label, p.lr, p.seeds, p.diverged, p.budget_stopped, p.on_plateau, p.bracketed,
                          {longest: (sum(p.accuracy[c][0] for c in cells) / len(cells), 0.0)},
                          {longest: p.state_bytes[longest]})
               for p in points if all(c in p.state_bytes for c in cells)]
    panels = [(cell, points, f"sequence {cell[0]}, {cell[1]} pairs", [1 / cell[1]]) for cell in cells]
    panels.append((longest, summary, f"mean of the {len(cells)} tests (bytes at {longest[0]})",
                   [sum(1 / c[1] for c in cells) / len(cells)]))
    for ax, (cell, these, title, one_value) in zip(axes.flat, panels, strict=False):
        shown, front = panel(these, cell)
        for i, kind in enumerate(kinds):
            own = sorted((p for p in shown if p.kind == kind), key=lambda p: p.state_bytes[cell])
            if not own:
                continue
            style = line_style(i)
            x = [p.state_bytes[cell] for p in own]
            y = [p.accuracy[cell][0] for p in own]
            ax.plot(x, y, label=kind, linewidth=1, **style)
            open_points = [(xi, yi) for p, xi, yi in zip(own, x, y, strict=True) if not measured_limit(p)]
            if open_points:  # hollow: the same marker, filled white
                ax.plot(*zip(*open_points, strict=True), markerfacecolor="white", **{**style, "linestyle": "none"})
        edge = [shown[i] for i in sorted(front, key=lambda i: shown[i].state_bytes[cell])]
        ax.plot([p.state_bytes[cell] for p in edge], [p.accuracy[cell][0] for p in edge], color="black",
                linestyle="--", drawstyle="steps-post", linewidth=1.2, label="Pareto frontier")
        ax.axhline(one_value[0], color="grey", linestyle=":", linewidth=1, label="one value of its own (1 / pairs)")
        if values:
            ax.axhline(1 / values, color="grey", linestyle="-.", linewidth=1, label=f"chance (1 / {values} values)")
        ax.set_xscale("log", base=2)
        ax.set_title(title)
        ax.set_xlabel("decoding state per sequence (bytes)")
        ax.set_ylim(-0.02, 1.02)
    for row in axes:
        row[0].set_ylabel("MQAR accuracy")
    handles = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    spare = list(axes.flat)[len(panels):]
    for ax in spare:
        ax.axis("off")
    spare[0].legend(list(handles.values()), list(handles), loc="center", fontsize="small",
                    ncol=1 + len(handles) // 14,
                    title="hollow: not a measured limit (still\nlearning or on the plateau at the\nlast step, "
                          "or its rate at an edge)")
    return fig
