"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM (what schedulers send before preempting) without
losing it: the step in progress finishes, `last.ckpt` is written at that step (atomically, like
every checkpoint) and the run ends; `resume=true` continues exactly where it stopped. A second
Ctrl-C stops at once, as Ctrl-C normally does.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lm.util.errors import RunInterrupted


class StopOnSignal(ModelCheckpoint):
    """One of the trainer's callbacks; `stop.fit(...)` fits with it installed (or `with stop:` around
    `trainer.fit`); `stop.signum` says whether a signal came.

    A ModelCheckpoint that saves only once a signal has come: Lightning's own step-end save is
    the one whose loop state resumes exactly (the periodic last.ckpt is written the same way)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, last_path: Path):
        last_path = Path(last_path)
        super().__init__(dirpath=last_path.parent, filename=last_path.stem, monitor=None, save_top_k=1,
                         enable_version_counter=False, every_n_train_steps=1)
        self.last_path = last_path
        self.signum: int | None = None
        self.saved_step: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def state_key(self) -> str:
        return "StopOnSignal"  # never the same key as the run's other last.ckpt writers

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

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.signum is not None and self.saved_step is None:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            self.saved_step = trainer.global_step
            # Leave at once: stopping the loop gently would run the epoch-end saves, which rewrite
            # last.ckpt with an epoch-end loop state that resumes under shifted step numbers.
            raise RunInterrupted(self.signum, self.saved_step, self.last_path)

    def on_validation_end(self, trainer, pl_module) -> None:
        pass  # the run's other callbacks save at validation

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pass

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # Lightning turns SIGTERM during validation into an exception before the next step ends.
        if self.signum is not None and self.saved_step is None and not isinstance(exception, KeyboardInterrupt):
            trainer.save_checkpoint(self.last_path)
            self.saved_step = trainer.global_step

    def fit(self, trainer, module, datamodule, ckpt_path: str | None) -> None:
        """`trainer.fit` with the handlers installed; RunInterrupted once a signal's last.ckpt is written."""
        with self:
            try:
                trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
            except SIGTERMException:
                if self.signum is None:
                    raise
        self.raise_if_stopped()

    def raise_if_stopped(self) -> None:
        if self.signum is not None and self.saved_step is not None:
            raise RunInterrupted(self.signum, self.saved_step, self.last_path)
