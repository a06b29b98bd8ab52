"""The errors that mean "the user's input is wrong". Scripts print their one-line message and
exit with code 2 instead of showing a traceback (lm.util.cli)."""

from __future__ import annotations

import signal
from pathlib import Path


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and the value in one line."""


class DataError(ValueError):
    """The corpus or a data setting cannot work; the message says which, in one line."""


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable or incompatible; the message says which, in one line."""


class GenerationError(ValueError):
    """A generation setting or prompt is unusable; the message names it, in one line."""


class TrainingError(ValueError):
    """Training cannot go on (a non-finite loss); the message names the step, in one line."""


class Interrupted(Exception):
    """Work stopped on a signal (SIGINT, SIGTERM); scripts print the message and exit with
    128 + the signal's number, as a shell reports a process a signal ended."""

    def __init__(self, signum: int, message: str):
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(message)


class RunInterrupted(Interrupted):
    """A training run stopped on a signal after saving `saved` at `step`."""

    def __init__(self, signum: int, step: int, saved: Path, how_to_continue: str = "resume=true continues the run"):
        self.step, self.saved = step, saved
        super().__init__(signum, f"stopped by {signal.Signals(signum).name} at step {step}; {saved} holds it, "
                                 f"{how_to_continue}")


def one_line(error: BaseException, limit: int = 120) -> str:
    """An exception's message squeezed onto one line, cut at `limit` characters, for quoting
    a library's error inside ours."""
    return " ".join(str(error).split())[:limit]


USER_ERRORS = (ConfigError, DataError, CheckpointError, GenerationError, TrainingError)
