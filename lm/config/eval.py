"""scripts/eval.py's settings: each one's default, meaning and bound, declared once here.

conf/eval.yaml composes them (`eval_settings`) beside the `data` group (the corpus, as training
reads it), its --help lists them, and scripts/eval.py builds them (EvalRun, each setting checked as it
is built) before the checkpoint is read. `device` is checked by lm.util.checks.check_device, which
knows what this torch can reach.
"""

from __future__ import annotations

from dataclasses import dataclass

from lm.config.data import CorpusSettings, DataSettings, data_source
from lm.config.settings import store
from lm.util.settings import Checked, boolean, choice, integer, required_group, setting

# val: the documents training held out (the same hash of the document id, lm.data.corpora); train: the
# others; all: every document.
SPLITS = ("val", "train", "all")


@dataclass(kw_only=True)
class EvalSettings(Checked):
    ckpt: str = setting(help="a training checkpoint, an exported folder, or a transformers Llama/Mistral folder")
    split: str = setting("val", "the documents training held out (val), the others (train) or every one (all)",
                         choice(SPLITS))
    batch_size: int = setting(8, "windows of max_seq_len + 1 tokens scored at once", integer(1))
    device: str = setting("cpu", "cpu, cuda[:n] or mps")
    out: str | None = setting(None, "the JSON record; null: eval-<corpus>-<split>.json beside the checkpoint")
    progress_bar: bool = setting(True, "a progress bar over the batches on stderr", boolean())


@dataclass(kw_only=True)
class EvalRun(EvalSettings):
    """What scripts/eval.py runs: its settings and the `data` group, the corpus as training reads it."""

    data: DataSettings = required_group(CorpusSettings, "the corpus (data=<option>)", choose=data_source)


store("eval_settings", EvalSettings)

__all__ = ["SPLITS", "EvalRun", "EvalSettings"]
