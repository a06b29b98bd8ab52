"""Which process of a distributed run speaks: rank 0 alone prints, so a run on 8 devices reads
like a run on one. Read from the environment the launchers set, because the first lines of a
run (its size, the tokenizer's progress) come before Lightning knows the ranks."""

from __future__ import annotations

import logging
import os


def is_main_process() -> bool:
    """Rank 0 of the run, or the only process. torchrun sets RANK; Lightning's own launcher sets
    LOCAL_RANK in the processes it starts and the user sets NODE_RANK on the other machines;
    under srun it is SLURM_PROCID (read last: it is also set in an interactive allocation, where
    Lightning's launcher starts the processes)."""
    env = os.environ
    if "RANK" in env:
        return int(env["RANK"]) == 0
    if "LOCAL_RANK" in env or "NODE_RANK" in env:
        return int(env.get("LOCAL_RANK", 0)) == 0 and int(env.get("NODE_RANK", 0)) == 0
    return int(env.get("SLURM_PROCID", 0)) == 0


def say(message: str) -> None:
    """print(), from rank 0 only."""
    if is_main_process():
        print(message)


def quiet_other_ranks() -> None:
    """Keep Lightning's information lines (one "Initializing distributed" per process, ...) to rank 0;
    warnings and errors still come from every process."""
    if not is_main_process():
        for name in ("lightning", "lightning.pytorch", "lightning.fabric"):  # each sets its own level
            logging.getLogger(name).setLevel(logging.WARNING)
