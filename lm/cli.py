"""What the scripts share: turning a user's mistake into one line on stderr and exit code 2."""

from __future__ import annotations

import re
import sys
from contextlib import contextmanager

from omegaconf.errors import OmegaConfBaseException

from lm.errors import USER_ERRORS
from lm.interrupt import RunInterrupted


@contextmanager
def exit_on_user_error():
    """Bad input ends the program with `error: <what is wrong>` instead of a traceback."""
    try:
        yield
    except USER_ERRORS as e:
        sys.stderr.write(f"error: {e}\n")
        raise SystemExit(2) from None
    except RunInterrupted as e:
        sys.stderr.write(f"{e}\n")
        raise SystemExit(e.exit_code) from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        message = str(e).strip().splitlines()[0]
        sys.stderr.write(f"error: {key + ': ' if key else ''}{message}\n")
        raise SystemExit(2) from None


def quote_text_overrides(argv: list[str], keys: tuple[str, ...]) -> list[str]:
    """Let `prompt=def f(n):` through Hydra's override grammar as the plain text it is.

    The shell has already removed the user's quotes, and Hydra would read brackets, commas,
    `=` or `${...}` in free text as syntax; quoting the value for Hydra keeps it literal."""
    quoted = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in keys and not (value[:1] in "'\"" and value[-1:] == value[:1] and len(value) > 1):
            value = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, value)  # a backslash before a quote
            value = value.replace("'", "\\'").replace("${", "\\${")
            arg = f"{key}='{value}'"
        quoted.append(arg)
    return quoted
