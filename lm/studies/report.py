"""What the studies write: results.json, results.md and their plots, from the arms' records.

One matplotlib set-up (`pyplot`) for every plot; the attention comparison's tables and plots
(lm/studies/compare.py), then the uptraining ablation's (lm/studies/uptrain_ablation.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from lm.training.uptraining import variant_name
from lm.util.files import write_atomically, write_folder_atomically

STYLE = {"axes.grid": True, "grid.alpha": 0.3, "legend.fontsize": 8, "savefig.dpi": 110}
MARKERS = "os^Dv<>PX*h"  # with the ten default colours: eleven or more lines stay distinguishable


def pyplot():
    """matplotlib.pyplot with the style of every study plot, on the Agg backend: files only, so
    no display is needed and a plot looks the same on every machine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(STYLE)
    return plt


def line_style(i: int) -> dict:
    return {"marker": MARKERS[i % len(MARKERS)], "color": f"C{i % 10}"}


def render(figure, path: Path) -> None:
    """The figure as a PNG at `path`, its memory released."""
    figure.tight_layout()
    figure.savefig(path, format="png")
    pyplot().close(figure)


def save_figure(figure, path: Path) -> None:
    """Written under a temporary name and renamed, like every file lm writes."""
    write_atomically(path, lambda tmp: render(figure, tmp))


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


# ---------------------------------------------------------------------------- the attention comparison


def by_kind(records: list[dict], task: str) -> dict[str, list[dict]]:
    kinds: dict[str, list[dict]] = {}
    for r in records:
        if r["task"] == task:
            kinds.setdefault(r["kind"], []).append(r)
    return kinds


def si_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def comparison_table(results: dict) -> str:
    records, settings, machine = results["records"], results["settings"], results["machine"]
    lines = [f"Machine: {machine['cpu']} ({machine['threads']} threads)"
             + (f", {machine['gpu']}" if machine["gpu"] else "") + f", torch {machine['torch']}; "
             f"its arms took {sum(r['seconds'] for r in records) / 60:.1f} min of training and measuring in all "
             f"(summed over the records, also those a repeated command reused).", ""]
    mqar = by_kind(records, "mqar")
    if mqar:
        m = settings["mqar"]
        grid = sorted({(r["width"], r["pairs"]) for rs in mqar.values() for r in rs})
        lines += [f"### MQAR accuracy (held-out answers; chance {1 / (m['vocab_size'] - m['vocab_size'] // 2):.3f})",
                  "",
                  f"{m['n_layer']} layers, {m['n_head']} heads, d_ff = {m['ff_mult']} x width, sequence length "
                  f"{m['seq_len']}, vocabulary {m['vocab_size']}, {m['steps']} steps of {m['batch_size']} examples, "
                  f"lr {m['lr']}; columns are model width / key-value pairs.", "",
                  "| kind | " + " | ".join(f"d{w} / {p}" for w, p in grid) + " |",
                  "| --- |" + " ---: |" * len(grid)]
        for kind, rs in mqar.items():
            cell = {(r["width"], r["pairs"]): r["val_accuracy"] for r in rs}
            lines.append(f"| {kind} | " + " | ".join(f"{cell[g]:.3f}" if g in cell else "" for g in grid) + " |")
        lines.append("")
    lm = by_kind(records, "lm")
    if lm:
        s = settings["lm"]
        contexts = settings["speed"]["contexts"]
        model = s["model"]
        lines += ["### Language modelling, speed and memory", "",
                  f"{model['n_layer']} layers, d_model {model['d_model']}, {model['n_head']} heads, "
                  f"d_ff {model['d_ff']}, context {model['max_seq_len']}; {s['steps']} steps of {s['batch_size']} "
                  f"sequences, lr {s['lr']}. Loss and bits per byte over the whole validation split. "
                  f"Decoding: batch 1, "
                  f"greedy, the last {settings['speed']['new_tokens']} tokens of each context, on a freshly "
                  f"initialised model of the same shape; cache bytes once the whole context is in.", "",
                  "| kind | parameters | val loss | bits/byte | train tokens/s | "
                  + " | ".join(f"decode tok/s @{c}" for c in contexts) + " | "
                  + " | ".join(f"cache @{c}" for c in contexts) + " |",
                  "| --- |" + " ---: |" * (4 + 2 * len(contexts))]
        for kind, (r, *_) in lm.items():
            speeds = {d["context"]: d for d in r["decode"]}
            lines.append(f"| {kind} | {r['params'] / 1e6:.2f}M | {r['eval_loss']:.4f} | {r['bits_per_byte']:.4f} | "
                         f"{r['train_tokens_per_s']:,.0f} | "
                         + " | ".join(f"{speeds[c]['tokens_per_s']:,.0f}" for c in contexts) + " | "
                         + " | ".join(si_bytes(speeds[c]["cache_bytes"]) for c in contexts) + " |")
        lines.append("")
    return "\n".join(lines)


def mqar_plot(records: list[dict]):
    """Accuracy against whichever of width and pairs the grid varies more (log2 axis), one panel
    per value of the other, one line per kind; None without recall records."""
    mqar = by_kind(records, "mqar")
    if not mqar:
        return None
    plt = pyplot()
    every = [r for rs in mqar.values() for r in rs]
    widths, pairs = sorted({r["width"] for r in every}), sorted({r["pairs"] for r in every})
    x_key, panel_key = ("pairs", "width") if len(pairs) >= len(widths) else ("width", "pairs")
    x_values, panels = (pairs, widths) if x_key == "pairs" else (widths, pairs)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), sharey=True, squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for i, (kind, rs) in enumerate(mqar.items()):
            points = sorted((r[x_key], r["val_accuracy"]) for r in rs if r[panel_key] == panel)
            if points:
                ax.plot(*zip(*points, strict=True), label=kind, **line_style(i))
        ax.set_xscale("log", base=2)
        ax.set_xticks(x_values, [str(v) for v in x_values])
        ax.set_title(f"{'model width' if panel_key == 'width' else 'key-value pairs'} {panel}")
        ax.set_xlabel("key-value pairs" if x_key == "pairs" else "model width (d_model)")
        ax.set_ylim(-0.02, 1.02)
    axes[0][0].set_ylabel("MQAR accuracy (held-out answers)")
    axes[0][-1].legend()
    return fig


def lm_loss_plot(records: list[dict]):
    """Validation loss against training wall-clock, one line per kind; None without language
    modelling records."""
    lm = by_kind(records, "lm")
    if not lm:
        return None
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for i, (kind, (r, *_)) in enumerate(lm.items()):
        seconds = [h[3] for h in r["history"]]  # history rows: (step, val loss, val accuracy, training seconds)
        losses = [h[1] for h in r["history"]]
        ax.plot(seconds, losses, markersize=3, label=kind, **line_style(i))
    ax.set_xlabel("training wall-clock (s, validation excluded)")
    ax.set_ylabel("validation loss")
    ax.legend()
    return fig


# ---------------------------------------------------------------------------- the uptraining ablation

INIT_COLOURS = {"mean": "tab:blue", "first": "tab:orange", "random": "tab:green", "scratch": "tab:gray",
                "aligned": "tab:purple", "mean + distill": "tab:cyan", "svd": "tab:red", "svd + distill": "tab:pink"}


def ablation_table(records: list[dict]) -> str:
    """One row per arm; the first record is the teacher, which the loss and cache columns compare with."""
    teacher = records[0]
    teacher_loss, mha_cache = teacher["val_loss_after"], teacher["cache_bytes_per_token"]
    lines = ["| arm | K/V heads | init | fraction | steps | val loss after conversion | val loss after | "
             "vs teacher | decode tokens/s | cache bytes/token (x MHA) |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in records:
        fraction = "" if r["fraction"] is None else f"{r['fraction']:.2f}"
        lines.append(
            f"| {r['arm']} | {r['kv_heads']} | {r['init']} | {fraction} | {r['steps']} | {r['val_loss_before']:.4f} | "
            f"{r['val_loss_after']:.4f} | {r['val_loss_after'] / teacher_loss - 1:+.1%} | "
            f"{r['decode_tokens_per_s']:.0f} | {r['cache_bytes_per_token']:,.0f} "
            f"({r['cache_bytes_per_token'] / mha_cache:.3f}) |")
    return "\n".join(lines) + "\n"


def target_name(r: dict) -> str:
    """gqaN, mqa or the MLA arm's target (records before MLA arms existed hold only kv_heads)."""
    return r.get("target") or variant_name(r["kv_heads"])


def uptraining_plot(records: list[dict]):
    """Validation loss against uptraining step, one panel per cache size (arms that keep as many
    bytes per token side by side: GQA-2 beside an MLA of the same cache), one line per arm (the
    largest fraction solid), the teacher's loss dotted."""
    teacher, arms = records[0], records[1:]
    if not arms:
        return None
    caches = sorted({r["cache_bytes_per_token"] for r in arms})
    largest = max(r["fraction"] for r in arms)
    fig, axes = pyplot().subplots(1, len(caches), figsize=(6 * len(caches), 4.5), sharey=True, squeeze=False)
    # Scale to the converted arms: from-scratch curves start near ln(vocab) and would flatten the rest.
    converted = [h[1] for r in arms if r["init"] != "scratch" for h in r["history"]]
    top = 1.03 * max(converted) if converted else None
    for ax, cache in zip(axes[0], caches, strict=True):
        in_panel = [r for r in arms if r["cache_bytes_per_token"] == cache and r["history"]]
        for r in in_panel:
            steps, losses = [h[0] for h in r["history"]], [h[1] for h in r["history"]]
            off_scale = f" (above the plot: ends at {losses[-1]:.2f})" if top and min(losses) > top else ""
            ax.plot(steps, losses, "-" if r["fraction"] == largest else "--", marker="o", markersize=3,
                    color=INIT_COLOURS.get(r["init"], "black"),
                    label=f"{target_name(r)} {r['init']}, alpha={r['fraction']}{off_scale}")
        if top:
            ax.set_ylim(0.99 * min(teacher["val_loss_after"], *converted), top)
        ax.axhline(teacher["val_loss_after"], color="black", linestyle=":", label="MHA teacher")
        targets = sorted({target_name(r) for r in in_panel})
        ax.set_title(f"{cache:,.0f} cache bytes/token: {', '.join(targets)}")
        ax.set_xlabel("uptraining step")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("validation loss")
    return fig
