"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM (what schedulers send before preempting) without
losing it: the step in progress finishes, `last.ckpt` is written at that step (atomically, like
every checkpoint) and the run ends; `resume=true` continues exactly where it stopped. A second
Ctrl-C stops at once, as Ctrl-C normally does.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import lightning as L


class RunInterrupted(Exception):
    """The run stopped on a signal after saving; scripts exit with 128 + the signal's number."""

    def __init__(self, signum: int, step: int, saved: Path):
        self.exit_code = 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}; {saved} holds it, "
                         "resume=true continues the run")


class StopOnSignal(L.Callback):
    """Install with `with stop:` around `trainer.fit`; `stop.signum` says whether a signal came."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, last_path: Path):
        self.last_path = Path(last_path)
        self.signum: int | None = None
        self.saved_step: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            self._previous = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _on_signal(self, signum: int, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        self.signum = signum

    def _save(self, trainer: L.Trainer) -> None:
        if self.saved_step is None:
            trainer.save_checkpoint(self.last_path)
            self.saved_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # The step is complete here, the same point the periodic last.ckpt is written at, so
        # resuming from this file replays no batch and skips none.
        if self.signum is not None:
            self._save(trainer)
            trainer.should_stop = True

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # Lightning turns SIGTERM during validation into an exception before the next step ends.
        if self.signum is not None and not isinstance(exception, KeyboardInterrupt):
            self._save(trainer)

    def raise_if_stopped(self) -> None:
        if self.signum is not None and self.saved_step is not None:
            raise RunInterrupted(self.signum, self.saved_step, self.last_path)
