"""What the scripts share: turning a user's mistake into one line on stderr and exit code 2."""

from __future__ import annotations

import sys
from contextlib import contextmanager

from omegaconf.errors import OmegaConfBaseException

from lm.checkpoint import CheckpointError
from lm.config import ConfigError
from lm.data import DataError
from lm.generation import GenerationError

USER_ERRORS = (ConfigError, DataError, CheckpointError, GenerationError)


@contextmanager
def exit_on_user_error():
    """Bad input ends the program with `error: <what is wrong>` instead of a traceback."""
    try:
        yield
    except USER_ERRORS as e:
        sys.stderr.write(f"error: {e}\n")
        raise SystemExit(2) from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        message = str(e).strip().splitlines()[0]
        sys.stderr.write(f"error: {key + ': ' if key else ''}{message}\n")
        raise SystemExit(2) from None
