"""What the scripts share: what each does at its start (run_script: never on import), and turning a
user's mistake into one line on stderr and exit code 2."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable
from contextlib import contextmanager

from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lm.util.errors import USER_ERRORS, Interrupted
from lm.util.files import run_folder_name

FAILED_ARMS: list[str] = []  # arms of a -m sweep that ended in a user error, in order

# Warnings of the libraries lm runs that say nothing a user of lm can act on, as (message, module) patterns
# of warnings.filterwarnings: quiet_known_warnings filters them out.
KNOWN_WARNINGS = (
    # Lightning's own use of a deprecated torch API.
    (r".*isinstance\(treespec, LeafSpec\).*", ""),
    # The run folder always holds tokenizer.json before the first checkpoint; train() says itself when an
    # earlier run's checkpoints are about to be replaced.
    (r"Checkpoint directory .* exists and is not empty", ""),
    # Resuming mid-epoch is exact here: the data module restarts its shuffle at the checkpoint's batch.
    (r"You're resuming from a checkpoint that ended before the epoch ended", ""),
    # inductor's autotuning (torch 2.13; compile_mode=max-autotune) calls a deprecated storage method once
    # per matmul it times: torch's own code.
    ("TypedStorage is deprecated", "torch._inductor.select_algorithm"),
)


class DropAdverts(logging.Filter):
    """Lightning logs an advert for its cloud logger at every run ("💡 Tip: ..."): not about this run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("💡 Tip")


def quiet_known_warnings() -> None:
    """Filter out KNOWN_WARNINGS and Lightning's advert. Process-wide, so called where a process starts
    to do lm's work, never on import: at every script's start (run_script, scripts/bench.py), the
    server's (lm.serving.run.prepare) and a training run's (lm.training.run.train). Calling it again
    changes nothing (warnings.filterwarnings replaces an equal filter)."""
    for message, module in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, module=module)
    adverts = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # a name: Lightning is not imported
    if not any(isinstance(f, DropAdverts) for f in adverts.filters):
        adverts.addFilter(DropAdverts())


@contextmanager
def exit_on_user_error():
    """Bad input ends the program with `error: <what is wrong>` instead of a traceback. Entered
    first thing in every script's main, after Hydra has set up logging, so it also keeps Hydra's
    console from repeating what a library already printed."""
    show_each_log_record_once()
    try:
        yield
    except USER_ERRORS as e:
        arm = sweep_arm()
        if arm is not None:  # one bad arm of a -m sweep: say so, and let the others run
            sys.stderr.write(f"error: [{arm}] {e}\n")
            FAILED_ARMS.append(arm)
            return
        sys.stderr.write(f"error: {e}\n")
        raise SystemExit(2) from None
    except Interrupted as e:
        sys.stderr.write(f"{e}\n")
        raise SystemExit(e.exit_code) from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        message = str(e).strip().splitlines()[0]
        sys.stderr.write(f"error: {key + ': ' if key else ''}{message}\n")
        raise SystemExit(2) from None


def is_console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)


class AlreadyShown(logging.Filter):
    """Drops a record that a logger below the root has already printed with a console handler
    of its own (Lightning, huggingface_hub, ... each install one): Hydra's console handler on the
    root would show it a second time. A library's NullHandler or log file prints nothing, so
    its records still reach the console."""

    def filter(self, record: logging.LogRecord) -> bool:
        logger = logging.getLogger(record.name)
        while logger is not logging.root:
            if any(is_console(h) and record.levelno >= h.level for h in logger.handlers):
                return False
            if not logger.propagate:
                break
            logger = logger.parent
        return True


def show_each_log_record_once() -> None:
    """Filter the root's console handlers (Hydra's); its log file keeps every record."""
    for handler in logging.root.handlers:
        if is_console(handler) and not any(isinstance(f, AlreadyShown) for f in handler.filters):
            handler.addFilter(AlreadyShown())


def sweep_arm() -> str | None:
    """The overrides of the running -m sweep arm, or None outside a sweep."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return " ".join(HydraConfig.get().overrides.task) or "(no overrides)"


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


# ------------------------------------------------------------------ Hydra's own errors

def run_script(main, start: Callable[[], object] | None = None) -> int:
    """Run a `@hydra.main` function, after what every script does first: inductor's cache folder
    (lm.util.hardware), quiet_known_warnings, the run_folder_name resolver, then the script's own
    `start` (lm.config.attn.load_attention_kinds: the kinds outside lm/ and their schemas, which Hydra
    needs before it composes); a user error of `start` is one line too. Hydra's own errors (an unknown
    key or group option, an override it cannot parse) become one line naming the close matches, and
    exit code 2; a -m sweep runs every arm and lists the ones that failed at the end."""
    # Hydra's exceptions must reach us, not its own printed trace or short form: forced whatever the
    # user's environment says (HYDRA_FULL_ERROR=0, a common setting, would print three lines or fail
    # while formatting), and put back afterwards. Either way the user sees one line.
    from hydra.core.hydra_config import HydraConfig

    from lm.util.hardware import inductor_cache_per_capability

    inductor_cache_per_capability()  # before anything compiles
    quiet_known_warnings()
    # Hydra makes its run folder (hydra.run.dir, hydra.sweep.subdir) before the script's main runs, so a
    # run_name that leaves outputs/ is refused while the path is resolved: `${run_folder_name:${run_name}}`
    # in the configs. (Hydra's launchers carry OmegaConf's resolvers to the processes they start.)
    OmegaConf.register_new_resolver("run_folder_name", run_folder_name, replace=True)
    if start is not None:
        try:
            start()
        except USER_ERRORS as e:
            sys.stderr.write(f"error: {e}\n")
            return 2
    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    FAILED_ARMS.clear()
    try:
        main()
    except HydraException as e:
        sys.stderr.write(f"error: {hydra_error_line(e)}\n")
        return 2
    except OmegaConfBaseException as e:  # resolving Hydra's own settings, before main's code runs
        refused = user_error_behind(e)
        sys.stderr.write(f"error: {refused if refused is not None else str(e).strip().splitlines()[0]}\n")
        return 2
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous
        # Hydra keeps the last run's config in a singleton: left set after a -m sweep, every later user
        # error in this process (another script's main, a benchmark) would be taken for a sweep arm's,
        # said and let pass (exit_on_user_error).
        HydraConfig.instance().cfg = None
        failed = list(FAILED_ARMS)
        FAILED_ARMS.clear()
    if failed:
        sys.stderr.write(f"error: {len(failed)} arm(s) of the sweep failed: {'; '.join(failed)}\n")
        return 2
    return 0


def user_error_behind(error: BaseException) -> BaseException | None:
    """The user error (a run_name that the run_folder_name resolver refused) that a resolver
    raised and OmegaConf re-raised as its own InterpolationResolutionError, or None. OmegaConf
    keeps the original only as the context of its own exception (its cause is cleared unless
    OC_CAUSE=1), so both links are followed."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, USER_ERRORS):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def hydra_error_line(error: HydraException) -> str:
    message = str(error).strip()
    if isinstance(error, MissingConfigException):
        found = re.search(r"Could not find '([^']+)/([^'/]+)'", message)
        options = re.findall(r"^\t(\S+)$", message.split("Config search path:")[0], flags=re.M)
        if found and options:
            group, choice = found.groups()
            return f"{group}={choice} is not an option of {group}{close_matches(choice, options)} " \
                   f"(options: {', '.join(options)})"
    cause = error.__cause__
    if isinstance(error, ConfigCompositionException) and isinstance(cause, OmegaConfBaseException):
        key = cause.full_key or message
        parent = cause.parent_node
        root = parent._get_root() if parent is not None else None
        keys = dotted_keys(root) if root is not None else []
        close = close_keys(key, keys)
        if is_schema(parent) and parent is not root:
            # A schema (an attn kind's options, lm.config) holds every key it takes: name them.
            taken = ", ".join(str(k) for k in parent.keys())
            return f"{key} is not a setting{close or f'; {parent._get_full_key(None)} takes {taken}'}"
        return f"{key} is not a setting{close} (+{key}=... adds a new one)"
    if isinstance(error, OverrideParseException):
        return f"cannot read an override on the command line ({message.splitlines()[0]})"
    return message.splitlines()[0]


def is_schema(node) -> bool:
    """Whether a config node was made from a dataclass (a structured config in Hydra's ConfigStore)."""
    return isinstance(node, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(node))


def close_matches(word: str, candidates: list[str]) -> str:
    matches = difflib.get_close_matches(word, candidates, n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(matches)}?" if matches else ""


def close_keys(key: str, keys: list[str]) -> str:
    """Close matches for a dotted setting: among its siblings first, then anywhere by its last
    part, so `trainer.max_stepz` finds `trainer.max_steps` and `max_steps` finds it too."""
    parent, _, name = key.rpartition(".")
    siblings = [k for k in keys if k.rpartition(".")[0] == parent]
    for pool in (siblings, keys):
        leaves = {k.rpartition(".")[2]: k for k in pool}
        matches = [leaves[m] for m in difflib.get_close_matches(name, list(leaves), n=3, cutoff=0.75)]
        if matches:
            return f"; did you mean {' or '.join(matches)}?"
    return ""


def dotted_keys(node, prefix: str = "") -> list[str]:
    """Every setting of a config as a dotted name (hydra's own node excluded)."""
    keys = []
    for key in node.keys():
        if key == "hydra":
            continue
        child = node._get_node(key)
        name = f"{prefix}{key}"
        if isinstance(child, DictConfig):
            keys += dotted_keys(child, name + ".")
        else:
            keys.append(name)
    return keys
