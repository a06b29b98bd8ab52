"""The attention comparison's tables (results.md, lm/studies/compare.py) from its records: the
recall grid and its learning-rate sweep, language modelling, decoding and training speed. A cell's
number is the best learning rate's mean over seeds, with its spread."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable


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
    waiting = results.get("waiting") or []  # finished arms of entries whose other arms have not: their time counts
    records = results["records"] + waiting
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
            "in all (summed over the records, also those a repeated command reused"
            + (f", and the {len(waiting)} finished arms of entries still waiting for others" if waiting else "")
            + ")." + arms_machines)


def planned_cells(m: dict) -> set[tuple]:
    """(width, pairs) of every cell the settings plan (a bare value is a list of one)."""
    return {(w, p) for w in as_values(m.get("widths", [])) for p in as_values(m.get("pairs", []))}


def as_values(value) -> list:
    return value if isinstance(value, list) else [value]


def own_cells(settings: dict, kind: str) -> set[tuple]:
    """The cells the settings plan for one kind: its per_kind mqar widths and pairs where it has them."""
    own = ((settings.get("per_kind") or {}).get(kind) or {}).get("mqar") or {}
    return planned_cells({**settings["mqar"], **{k: v for k, v in own.items() if k in ("widths", "pairs")}})


def recall_tables(records: list[dict], settings: dict) -> list[str]:
    cells = sweep(records, "mqar", recall_cell)
    if not cells:
        return []
    m = settings["mqar"]
    # A cell the settings plan but no record holds yet (a cell added to the preset after these records
    # were written) is shown as not yet run, not left out.
    grid = sorted({c for by_cell in cells.values() for c in by_cell} | planned_cells(m))
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
    unrun = False
    for kind, by_cell in cells.items():
        shown = {c: with_spread([accuracy(r) for r in by_lr[best_lr(by_lr, accuracy, True)]], 3)
                 for c, by_lr in by_cell.items()}
        missing = own_cells(settings, kind) - set(shown)
        unrun |= bool(missing)
        shown.update(dict.fromkeys(missing, "not yet run"))
        lines.append(f"| {kind} | " + " | ".join(shown.get(c, "") for c in grid) + " |")
    lines.append("")
    if unrun:
        lines += ["*not yet run*: a cell the settings plan whose arms have no finished record here; the same "
                  "command (or records_from=<this results.json>) runs only those.", ""]
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
