"""The uptraining ablation of Ainslie et al. 2023 from one multi-head teacher.

Arms: every (K/V heads, init, fraction) uptrained from the teacher, plus GQA trained from
random weights for each fraction's number of steps. For each: val loss right after conversion
and after uptraining (the same validation batches for all, and for the teacher), decode
tokens/s and cache bytes per token. Writes results.json, results.md and val_loss.png.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from lm.data.modules import TokenDataModule
from lm.formats.checkpoint import load, read_checkpoint
from lm.generation.decode import stream
from lm.model.transformer import Transformer
from lm.training.module import next_token_loss
from lm.training.run import train
from lm.training.uptraining import continued_run_config, uptrain, variant_name
from lm.util.files import make_folder
from lm.util.paths import resolve_path


def validation_data(source_run: dict, tokenizer_json: str) -> TokenDataModule:
    data = TokenDataModule.from_config(OmegaConf.create(source_run["data"]), source_run["model"]["max_seq_len"],
                                       tokenizer_json=tokenizer_json)
    data.setup()
    return data


@torch.no_grad()
def val_loss(model: Transformer, data: TokenDataModule, batches: int) -> float:
    """Token-weighted loss over the first `batches` validation batches, as training reports it."""
    total, count = 0.0, 0
    for i, batch in enumerate(data.val_dataloader()):
        if i == batches:
            break
        loss_sum, n = next_token_loss(model, batch, reduction="sum")
        total, count = total + loss_sum.item(), count + n
    return total / count


def decode_figures(model: Transformer, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(greedy decode tokens/s, cache bytes per token) for one prompt."""
    list(stream(model, [prompt], new_tokens))  # warm-up
    run = stream(model, [prompt], new_tokens)
    list(run)
    tokens = len(prompt) + run.stats["new_tokens"]
    return run.stats["new_tokens"] / run.stats["decode_s"], run.stats["cache_bytes"] / tokens


def run_study(cfg: DictConfig) -> list[dict]:
    started = time.perf_counter()
    out = resolve_path(cfg.study.out)
    make_folder(out)
    source = read_checkpoint(resolve_path(cfg.ckpt))
    source_run, tokenizer_json = source["lm"]["run_config"], source["lm"]["tokenizer"]
    source_steps = int(source["global_step"])
    batches = cfg.uptrain.limit_val_batches
    data = validation_data(source_run, tokenizer_json)
    prompt = data.val_set[0][: min(32, source_run["model"]["max_seq_len"] // 4)].tolist()

    teacher, _ = load(resolve_path(cfg.ckpt))
    teacher_loss = val_loss(teacher, data, batches)
    tok_s, cache = decode_figures(teacher, prompt, cfg.study.decode_tokens)
    records = [{"arm": "teacher", "kv_heads": teacher.config.n_kv_head, "init": "teacher", "fraction": None,
                "steps": source_steps, "val_loss_before": teacher_loss, "val_loss_after": teacher_loss,
                "decode_tokens_per_s": tok_s, "cache_bytes_per_token": cache, "history": []}]
    print(f"teacher: {teacher.config.n_kv_head} K/V heads, val loss {teacher_loss:.4f}, {source_steps} steps")

    for kv_heads in cfg.study.kv_heads:
        for init in cfg.study.inits:
            for fraction in cfg.study.fractions:
                name = f"{variant_name(kv_heads)}-{init}-{fraction}"
                arm = OmegaConf.merge(cfg, {"attn": {"n_kv_head": kv_heads}, "run_name": f"study-{name}",
                                            "checkpoint_dir": str(out / "runs"),
                                            "uptrain": {"init": init, "fraction": fraction, "steps": None}})
                result = uptrain(arm)
                records.append(_record(name, kv_heads, init, fraction, result, prompt, cfg))
                print(_summary(records[-1]))

    if cfg.study.scratch:
        kv_heads = max(cfg.study.kv_heads)
        for fraction in cfg.study.fractions:
            name = f"{variant_name(kv_heads)}-scratch-{fraction}"
            steps = math.ceil(fraction * source_steps)
            # Same steps, schedule and data as the uptrained arms; only the weights start random.
            run = continued_run_config(source_run, cfg, steps, kv_heads, f"study-{name}")
            with open_dict(run):
                run.checkpoint_dir = str(out / "runs")
                run.uptrain = {"init": "scratch", "steps": steps}
            result = train(run, tokenizer_json=tokenizer_json, validate_first=True)
            records.append(_record(name, kv_heads, "scratch", fraction, result, prompt, cfg))
            print(_summary(records[-1]))

    seconds = time.perf_counter() - started
    _write_outputs(out, records, teacher_loss, cfg, seconds)
    return records


def _record(name: str, kv_heads: int, init: str, fraction: float, result: dict, prompt: list[int],
            cfg: DictConfig) -> dict:
    model, _ = load(result["last"])
    tok_s, cache = decode_figures(model, prompt, cfg.study.decode_tokens)
    return {"arm": name, "kv_heads": kv_heads, "init": init, "fraction": fraction, "steps": result["steps"],
            "val_loss_before": result["val_loss_before"], "val_loss_after": result["val_loss"],
            "decode_tokens_per_s": tok_s, "cache_bytes_per_token": cache, "history": result["val_history"]}


def _summary(r: dict) -> str:
    return (f"{r['arm']:>22}: val loss {r['val_loss_before']:.4f} -> {r['val_loss_after']:.4f} in {r['steps']} steps, "
            f"{r['decode_tokens_per_s']:.0f} tokens/s, {r['cache_bytes_per_token']:,.0f} cache bytes/token")


def _write_outputs(out: Path, records: list[dict], teacher_loss: float, cfg: DictConfig, seconds: float) -> None:
    payload = {"source": str(cfg.ckpt), "seconds": round(seconds, 1), "records": records}
    (out / "results.json").write_text(json.dumps(payload, indent=2))
    (out / "results.md").write_text(markdown_table(records, teacher_loss))
    plot_histories(records, teacher_loss, out / "val_loss.png")
    print(markdown_table(records, teacher_loss))
    print(f"study took {seconds / 60:.1f} min; wrote {out / 'results.json'}, {out / 'results.md'}, "
          f"{out / 'val_loss.png'}")


def markdown_table(records: list[dict], teacher_loss: float) -> str:
    mha_cache = records[0]["cache_bytes_per_token"]
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


def plot_histories(records: list[dict], teacher_loss: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kv_values = sorted({r["kv_heads"] for r in records[1:]})
    fig, axes = plt.subplots(1, len(kv_values), figsize=(6 * len(kv_values), 4.5), sharey=True, squeeze=False)
    colours = {"mean": "tab:blue", "first": "tab:orange", "random": "tab:green", "scratch": "tab:gray"}
    for ax, kv_heads in zip(axes[0], kv_values, strict=True):
        for r in records[1:]:
            if r["kv_heads"] != kv_heads or not r["history"]:
                continue
            steps, losses = [h[0] for h in r["history"]], [h[1] for h in r["history"]]
            style = "-" if r["fraction"] == max(x["fraction"] for x in records[1:]) else "--"
            ax.plot(steps, losses, style, marker="o", markersize=3, color=colours.get(r["init"], "black"),
                    label=f"{r['init']}, alpha={r['fraction']}")
        ax.axhline(teacher_loss, color="black", linestyle=":", label="MHA teacher")
        ax.set_title(f"{variant_name(kv_heads)} ({kv_heads} K/V heads)")
        ax.set_xlabel("uptraining step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("validation loss")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
