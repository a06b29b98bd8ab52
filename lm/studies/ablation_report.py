"""The uptraining ablation's table and plot (lm/studies/uptrain_ablation.py) from its records."""

from __future__ import annotations

from lm.studies.plotting import pyplot

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
    """The arm's target as uptraining named it: gqaN, mqa or an MLA arm's. Records written before MLA
    arms existed hold only kv_heads; their arms were all softmax, named mqa (one K/V head) or gqaN
    then, so they read the same whatever uptraining names its targets today."""
    if r.get("target"):
        return r["target"]
    return "mqa" if r["kv_heads"] == 1 else f"gqa{r['kv_heads']}"


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
