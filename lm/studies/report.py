"""The attention comparison's table and plots, from its records (lm/studies/compare.py)."""

from __future__ import annotations

from pathlib import Path


def _by_kind(records: list[dict], task: str) -> dict[str, list[dict]]:
    kinds: dict[str, list[dict]] = {}
    for r in records:
        if r["task"] == task:
            kinds.setdefault(r["kind"], []).append(r)
    return kinds


def _si_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def markdown(results: dict) -> str:
    records, settings, machine = results["records"], results["settings"], results["machine"]
    lines = [f"Machine: {machine['cpu']} ({machine['threads']} threads)"
             + (f", {machine['gpu']}" if machine["gpu"] else "") + f", torch {machine['torch']}; "
             f"its arms took {sum(r['seconds'] for r in records) / 60:.1f} min of training and measuring in all "
             f"(summed over the records, also those a repeated command reused).", ""]
    mqar = _by_kind(records, "mqar")
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
    lm = _by_kind(records, "lm")
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
                         + " | ".join(_si_bytes(speeds[c]["cache_bytes"]) for c in contexts) + " |")
        lines.append("")
    return "\n".join(lines)


MARKERS = "os^Dv<>PX*h"  # with the ten default colours: eleven or more kinds stay distinguishable


def _style(i: int) -> dict:
    return {"marker": MARKERS[i % len(MARKERS)], "color": f"C{i % 10}"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_mqar(records: list[dict], path: Path) -> None:
    """Accuracy against whichever of width and pairs the grid varies more (log2 axis), one panel
    per value of the other, one line per kind."""
    mqar = _by_kind(records, "mqar")
    if not mqar:
        return
    plt = _pyplot()
    every = [r for rs in mqar.values() for r in rs]
    widths, pairs = sorted({r["width"] for r in every}), sorted({r["pairs"] for r in every})
    x_key, panel_key = ("pairs", "width") if len(pairs) >= len(widths) else ("width", "pairs")
    panels = pairs if panel_key == "pairs" else widths
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), sharey=True, squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for i, (kind, rs) in enumerate(mqar.items()):
            points = sorted((r[x_key], r["val_accuracy"]) for r in rs if r[panel_key] == panel)
            if points:
                ax.plot(*zip(*points, strict=True), label=kind, **_style(i))
        ax.set_xscale("log", base=2)
        ax.set_xticks(pairs if x_key == "pairs" else widths, [str(v) for v in (pairs if x_key == "pairs" else widths)])
        ax.set_title(f"{'model width' if panel_key == 'width' else 'key-value pairs'} {panel}")
        ax.set_xlabel("key-value pairs" if x_key == "pairs" else "model width (d_model)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("MQAR accuracy (held-out answers)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_lm_loss(records: list[dict], path: Path) -> None:
    """Validation loss against training wall-clock, one line per kind."""
    lm = _by_kind(records, "lm")
    if not lm:
        return
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (kind, (r, *_)) in enumerate(lm.items()):
        seconds = [h[3] for h in r["history"]]
        losses = [h[1] for h in r["history"]]
        ax.plot(seconds, losses, markersize=3, label=kind, **_style(i))
    ax.set_xlabel("training wall-clock (s, validation excluded)")
    ax.set_ylabel("validation loss")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
