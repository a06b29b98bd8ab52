"""A study's arms as jobs of a Hydra launcher: in parallel on one machine, or on a cluster.

`python scripts/compare.py hydra/launcher=joblib hydra.launcher.n_jobs=2` (any launcher Hydra
has a plugin for: joblib from `hydra-joblib-launcher`, submitit_slurm from
`hydra-submitit-launcher`, ...) plans the study as usual, then starts one Hydra multirun of the
same command with `arm=<name>,<name>,...`: one job per arm whose record is not done yet, which runs
that arm alone and writes its record (lm.studies.engine). When the jobs are over, the study
gathers every record into the report as if it had run them itself. An arm that crashed or was
interrupted has no finished record, so the same command launches it, and only it, again.

Shapes of the records and the report do not depend on where an arm ran; each record names the
process and host that ran it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from lm.studies.engine import Arm, finished_records
from lm.util.checks import require_positive
from lm.util.errors import ConfigError, TrainingError


def chosen_launcher() -> str | None:
    """The hydra/launcher the command chose, when it is not Hydra's default (basic, in process)
    and the command is not itself one of the jobs; None otherwise."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode == RunMode.MULTIRUN:
        return None
    choice = HydraConfig.get().runtime.choices.get("hydra/launcher")
    return None if choice in (None, "basic") else choice


def check_launcher(launcher: str) -> None:
    """The chosen launcher's settings Hydra passes on unchecked, named as typed before any arm is
    planned or launched: joblib's n_jobs (a count of workers: 0 is none; -1 all cores, -2 all but one)
    and its timeout."""
    from hydra.core.hydra_config import HydraConfig

    settings = HydraConfig.get().launcher
    if launcher == "joblib":
        n_jobs = settings.get("n_jobs")
        if n_jobs is not None and (isinstance(n_jobs, bool) or not isinstance(n_jobs, int) or n_jobs == 0):
            raise ConfigError(f"hydra.launcher.n_jobs={n_jobs!r} must be a non-zero integer: the jobs at once "
                              "(-1: one per core, -2: all cores but one)")
        timeout = settings.get("timeout")
        if timeout is not None:
            require_positive("hydra.launcher.timeout", timeout)


def unfinished(arms: list[Arm], records: Path) -> list[int]:
    """Indexes of the arms without a finished record of their current settings."""
    _, left = finished_records(arms, records)
    names = {arm.name for arm in left}  # unique: the engine refuses repeated names
    return [i for i, arm in enumerate(arms) if arm.name in names]


def only_arm(arms: list[Arm], arm) -> int:
    """`arm=<i>` or `arm=<name>` of a job, checked: the index of one of the planned arms. The jobs are
    launched by name: a plan that grows with its records (the frontier's rate search) may number an
    arm differently by the time its job plans."""
    names = [a.name for a in arms]
    if isinstance(arm, str) and arm in names:
        return names.index(arm)
    if isinstance(arm, bool) or not isinstance(arm, int) or not 0 <= arm < len(arms):
        raise ConfigError(f"arm={arm!r} must be the index (0 to {len(arms) - 1}) or the name of one of the "
                          f"study's {len(arms)} arms")
    return arm


def run_as_jobs(arms: list[Arm], records: Path, launcher: str) -> None:
    """Launch every unfinished arm as a job of `launcher` and wait for them all."""
    from hydra.core.hydra_config import HydraConfig

    pending = unfinished(arms, records)
    if not pending:
        return
    overrides = HydraConfig.get().overrides
    command = [sys.executable, sys.argv[0], "--multirun", *overrides.task, *overrides.hydra,
               f"arm={','.join(arms[i].name for i in pending)}"]
    print(f"running {len(pending)} of {len(arms)} arms as jobs of hydra/launcher={launcher}", flush=True)
    done = subprocess.run(command, check=False)  # each job prints its arm's line; failures are read from the records
    failed = [arms[i].name for i in unfinished(arms, records) if i in pending]
    if failed:
        shown = ", ".join(failed[:3]) + (f" and {len(failed) - 3} more" if len(failed) > 3 else "")
        why = (f"their records under {records} and logs under the runs folder say why" if records.is_dir() else
               f"the launcher ended with exit code {done.returncode} before any arm wrote a record (its output "
               "above says why)")
        raise TrainingError(f"{len(failed)} of the {len(pending)} arms launched did not finish ({shown}): {why}; "
                            "the same command launches those again")
