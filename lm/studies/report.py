"""What the studies write: results.json, results.md and their plots, from the arms' records.

One matplotlib set-up (`pyplot`) for every plot; the attention comparison's tables and plots
(lm/studies/compare.py), then the uptraining ablation's (lm/studies/uptrain_ablation.py).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
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


def lr_of(r: dict) -> float:
    """The arm's learning rate (records written before the sweep existed hold it in their settings only)."""
    return r["lr"] if "lr" in r else r["settings"]["optim"]["lr"]


def mean_and_spread(values: list[float]) -> tuple[float, float]:
    """The mean and the sample standard deviation (0 for a single value)."""
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def with_spread(values: list[float], digits: int) -> str:
    mean, spread = mean_and_spread(values)
    return f"{mean:.{digits}f}" + (f" ± {spread:.{digits}f}" if len(values) > 1 else "")


def sweep(records: list[dict], task: str, cell: Callable[[dict], tuple]) -> dict[str, dict[tuple, dict]]:
    """kind -> cell -> learning rate -> the records of its seeds, in the records' order."""
    kinds: dict[str, dict[tuple, dict]] = {}
    for kind, rs in by_kind(records, task).items():
        for r in rs:
            kinds.setdefault(kind, {}).setdefault(cell(r), {}).setdefault(lr_of(r), []).append(r)
    return kinds


def most_seeds(cells: dict[str, dict[tuple, dict]]) -> int:
    """The largest number of seeds any (kind, cell, learning rate) of a sweep ran."""
    return max(len(rs) for by_cell in cells.values() for by_lr in by_cell.values() for rs in by_lr.values())


def best_lr(by_lr: dict[float, list[dict]], score: Callable[[dict], float], higher: bool) -> float:
    """The learning rate with the best mean score over its seeds (the smaller on a tie)."""
    means = {lr: mean_and_spread([score(r) for r in rs])[0] for lr, rs in by_lr.items()}
    return sorted(means, key=lambda lr: (-means[lr] if higher else means[lr], lr))[0]


def recall_cell(r: dict) -> tuple:
    return r["width"], r["pairs"]


def diverged(r: dict) -> bool:
    return "diverged" in r


def accuracy(r: dict) -> float:
    """Held-out accuracy; a run that diverged recalls nothing (it counts as 0 in the means)."""
    return 0.0 if diverged(r) else r["val_accuracy"]


def sweep_entry(rs: list[dict], score: Callable[[dict], float], digits: int, steps: bool) -> str:
    """One learning rate's mean score over its seeds (and mean steps taken); which seeds diverged."""
    kept = [r for r in rs if not diverged(r)]
    if not kept:
        return "diverged"
    text = f"{mean_and_spread([score(r) for r in kept])[0]:.{digits}f}"
    if steps:
        text += f" ({mean_and_spread([r['steps'] for r in kept])[0]:.0f})"
    return text + (f", {len(rs) - len(kept)} of {len(rs)} diverged" if len(kept) < len(rs) else "")


def per_kind_note(settings: dict, task: str, kinds) -> list[str]:
    """The kinds of the table (`kinds`) that ran with settings of their own for `task` (per_kind), as a
    line under it."""
    own = {kind: {**{f"{task}.{key}": value for key, value in (values.get(task) or {}).items()},
                  **({"seeds": values["seeds"]} if task != "speed" and "seeds" in values else {})}
           for kind, values in (settings.get("per_kind") or {}).items() if kind in kinds}
    own = {kind: values for kind, values in own.items() if values}
    if not own:
        return []
    named = "; ".join(f"{kind}: " + ", ".join(f"{key}={value}" for key, value in values.items())
                      for kind, values in own.items())
    return [f"Settings of their own (per_kind; a blank cell was not run): {named}.", ""]


def sequence_lengths(m: dict) -> str:
    """'64', or '64 / 128 / 256 for 4 / 8 / 16 pairs' where the length grows with the pairs."""
    if not isinstance(m["seq_len"], list):
        return str(m["seq_len"])
    pairs = m["pairs"] if isinstance(m["pairs"], list) else [m["pairs"]]
    return f"{' / '.join(map(str, m['seq_len']))} for {' / '.join(map(str, pairs))} pairs"


def machine_name(machine: dict) -> str:
    gpu = f", {machine['gpu']}" if machine.get("gpu") else ""
    return f"{machine['cpu']} ({machine['threads']} threads){gpu}, torch {machine['torch']}"


def machine_line(results: dict) -> str:
    """Where the report was rendered and, since arms may run elsewhere (jobs, records_from), where
    each of them ran, as far as their records say."""
    records = results["records"]
    minutes = sum(r["seconds"] for r in records) / 60
    ran_on = [r.get("ran_on", {}) for r in records]
    named = [machine_name(m) for m in ran_on if "cpu" in m]
    arms_machines = ""
    if named:
        counts = Counter(named)  # in the order the machines first appear
        unnamed = len(records) - len(named)
        arms_machines = (" Its arms ran on: " + "; ".join(f"{name}: {n} arms" for name, n in counts.items())
                         + (f"; {unnamed} arms recorded before records named their machine" if unnamed else "") + ".")
    return (f"Machine: {machine_name(results['machine'])}; its arms took {minutes:.1f} min of training and measuring "
            "in all (summed over the records, also those a repeated command reused)." + arms_machines)


def recall_tables(records: list[dict], settings: dict) -> list[str]:
    cells = sweep(records, "mqar", recall_cell)
    if not cells:
        return []
    m = settings["mqar"]
    grid = sorted({c for by_cell in cells.values() for c in by_cell})
    seeds = most_seeds(cells)
    lrs = sorted({lr for by_cell in cells.values() for by_lr in by_cell.values() for lr in by_lr})
    recipe = ", ".join(f"{key} {m[key]}" for key in ("filler", "query_power", "short_conv", "stop_at_accuracy")
                       if key in m)
    lines = [f"### MQAR accuracy (held-out answers; chance {1 / (m['vocab_size'] - m['vocab_size'] // 2):.3f})", "",
             f"{m['n_layer']} layers, {m['n_head']} heads, d_ff = {m['ff_mult']} x width, sequence length "
             f"{sequence_lengths(m)}, vocabulary {m['vocab_size']}, at most {m['steps']} steps of "
             f"{m['batch_size']} examples"
             + (f"; {recipe}" if recipe else "") + ". "
             + (f"Each cell: the best of the learning rates {', '.join(f'{lr:g}' for lr in lrs)} by mean accuracy"
                if len(lrs) > 1 else f"Learning rate {lrs[0]:g}")
             + (f", mean ± standard deviation over {seeds} seeds" if seeds > 1 else ", one seed")
             + "; columns are model width / key-value pairs.", "",
             "| kind | " + " | ".join(f"d{w} / {p}" for w, p in grid) + " |",
             "| --- |" + " ---: |" * len(grid)]
    for kind, by_cell in cells.items():
        shown = {c: with_spread([accuracy(r) for r in by_lr[best_lr(by_lr, accuracy, True)]], 3)
                 for c, by_lr in by_cell.items()}
        lines.append(f"| {kind} | " + " | ".join(shown.get(c, "") for c in grid) + " |")
    lines.append("")
    lines += per_kind_note(settings, "mqar", cells)
    if len(lrs) > 1:
        lines += ["#### Every learning rate of the sweep", "",
                  "Mean accuracy over the seeds (mean steps taken, after early stopping"
                  + ("; a diverged run counts as 0 in the means above" if any(map(diverged, records)) else "")
                  + "); the best of each cell in bold.", "",
                  "| kind | cell | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |",
                  "| --- | --- |" + " ---: |" * len(lrs)]
        for kind, by_cell in cells.items():
            for (w, p), by_lr in sorted(by_cell.items()):
                best = best_lr(by_lr, accuracy, True)
                row = []
                for lr in lrs:
                    if lr not in by_lr:
                        row.append("")
                        continue
                    text = sweep_entry(by_lr[lr], accuracy, 3, steps=True)
                    row.append(f"**{text}**" if lr == best else text)
                lines.append(f"| {kind} | d{w} / {p} | " + " | ".join(row) + " |")
        lines.append("")
    return lines


def eval_loss(r: dict) -> float:
    """Loss over the validation split; a run that diverged has none (it is never the best)."""
    return float("inf") if diverged(r) else r["eval_loss"]


def language_table(records: list[dict], settings: dict) -> list[str]:
    cells = sweep(records, "lm", lambda r: ())
    if not cells:
        return []
    s = settings["lm"]
    model = s["model"]
    seeds = most_seeds(cells)
    lines = ["### Language modelling", "",
             f"{model['n_layer']} layers, d_model {model['d_model']}, {model['n_head']} heads, d_ff {model['d_ff']}, "
             f"context {model['max_seq_len']}; {s['steps']} steps of {s['batch_size']} sequences "
             f"({s['steps'] * s['batch_size'] * model['max_seq_len'] / 1e6:.2f}M tokens). Loss and bits per byte over "
             "the whole validation split, at the best learning rate by mean loss"
             + (f", mean ± standard deviation over {seeds} seeds." if seeds > 1 else ", one seed."), "",
             "| kind | parameters | lr | val loss | bits/byte | train tokens/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for kind, by_cell in cells.items():
        by_lr = by_cell[()]
        lr = best_lr(by_lr, eval_loss, False)
        rs = [r for r in by_lr[lr] if not diverged(r)]
        if not rs:
            lines.append(f"| {kind} | | | diverged at every learning rate | | |")
            continue
        loss, bits = with_spread([eval_loss(r) for r in rs], 4), with_spread([r["bits_per_byte"] for r in rs], 4)
        failed = len(by_lr[lr]) - len(rs)
        lines.append(f"| {kind} | {rs[0]['params'] / 1e6:.2f}M | {lr:g} | {loss}"
                     + (f" ({failed} of {len(by_lr[lr])} diverged)" if failed else "")
                     + f" | {bits} | {mean_and_spread([r['train_tokens_per_s'] for r in rs])[0]:,.0f} |")
    lines.append("")
    return lines + per_kind_note(settings, "lm", cells)


def speed_table(records: list[dict], settings: dict) -> list[str]:
    """Decoding figures (the speed arms', or in results written before they existed, the first
    language-modelling record's of each kind), then training tokens/s where the arms measured it."""
    measured, left_out, training, first_step_timed = {}, {}, {}, False
    for r in records:
        if "decode" in r and r["kind"] not in measured:
            first_step_timed |= "decode_left_out" not in r  # records from before the first step was left out
            measured[r["kind"]] = {(d.get("batch", 1), d["context"]): d for d in r["decode"]}
            left_out[r["kind"]] = {tuple(row) for row in r.get("decode_left_out", [])}
            training[r["kind"]] = {t["context"]: t for t in r.get("train", [])}
    if not measured:
        return []
    columns = sorted({key for kind in measured for key in (*measured[kind], *left_out[kind])})
    contexts = sorted({c for _, c in columns})
    model, speed = settings["lm"]["model"], settings["speed"]

    def decoded(kind: str, key: tuple) -> str:
        if key in measured[kind]:
            return f"{measured[kind][key]['tokens_per_s']:,.0f}"
        return "left out" if key in left_out[kind] else ""

    def per_row_cache(by_key: dict, context: int) -> str:
        rows = [(b, d) for (b, c), d in by_key.items() if c == context]
        if not rows:
            return ""
        batch, d = min(rows, key=lambda row: row[0])
        return si_bytes(d["cache_bytes"] / batch)

    cap = speed.get("max_batch_tokens")
    lines = ["### Decoding speed and memory", "",
             f"The language-modelling shape ({model['n_layer']} layers, d_model {model['d_model']}), freshly "
             f"initialised, {'compiled (torch.compile)' if speed.get('compile') else 'eager'}: greedy, the last "
             f"{speed['new_tokens']} tokens of each context in every row of the batch "
             + ("(tokens/s counts every row's tokens)" if first_step_timed else
                "(tokens/s over the steps after the first, counting every row's tokens)")
             + "; cache bytes per row once the whole context is in."
             + (f" Rows of more than {cap:,} tokens (batch x context) are left out." if cap else ""), "",
             "| kind | " + " | ".join(f"tok/s batch {b} @{c}" for b, c in columns) + " | "
             + " | ".join(f"cache/row @{c}" for c in contexts) + " |",
             "| --- |" + " ---: |" * (len(columns) + len(contexts)),
             *(f"| {kind} | " + " | ".join(decoded(kind, k) for k in columns)
               + " | " + " | ".join(per_row_cache(by_key, c) for c in contexts) + " |"
               for kind, by_key in measured.items()),
             ""]
    lines += per_kind_note(settings, "speed", measured)
    trained = sorted({c for by_context in training.values() for c in by_context})
    if trained:
        lines += ["### Training speed", "",
                  f"The same shape, freshly initialised, eager fp32: forward, loss, backward and AdamW on "
                  f"{speed['train_tokens']:,} tokens a step (the batch is that over the context), the median of "
                  f"{speed['train_steps']} steps after one untimed.", "",
                  "| kind | " + " | ".join(f"tok/s @{c} (batch {max(1, speed['train_tokens'] // c)})"
                                          for c in trained) + " |",
                  "| --- |" + " ---: |" * len(trained),
                  *(f"| {kind} | " + " | ".join(f"{by_context[c]['tokens_per_s']:,.0f}" if c in by_context else ""
                                               for c in trained) + " |"
                    for kind, by_context in training.items()),
                  ""]
    return lines


def unfinished_line(results: dict) -> list[str]:
    """Under `report_only=true`, how much of the study the tables hold."""
    unfinished = results.get("unfinished")
    if unfinished is None:
        return []
    return [f"**Not finished:** {unfinished['planned'] - len(unfinished['arms'])} of {unfinished['planned']} arms "
            f"have run (rendered with report_only=true); a cell, or a kind's language modelling or speed, shows once "
            f"every one of its arms has, so the {len(unfinished['arms'])} others (named in results.json) leave "
            "theirs out.", ""]


def comparison_table(results: dict) -> str:
    records, settings = results["records"], results["settings"]
    return "\n".join([machine_line(results), "", *unfinished_line(results), *recall_tables(records, settings),
                      *language_table(records, settings), *speed_table(records, settings)])


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
