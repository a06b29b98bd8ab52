"""lm-evaluation-harness's command line with lm's checkpoints available as `--model lm`:

    python scripts/harness.py --model lm --model_args ckpt=checkpoints/<run>/last.ckpt --tasks <tasks>

Everything after the script name is the harness's own arguments (`--include_path` for local task
YAMLs, `--limit`, `--output_path` ...). Importing lm.evaluation.harness registers the model: the harness
(0.4) finds models in its own registry, not through installed plug-ins. A mistake the harness or the
model refuses before scoring (a missing checkpoint, an unknown task, a task whose data cannot be
loaded, a bad --model_args value) is one line `error: ...` on stderr and exit code 2."""

import sys

from lm.attention import load_outside_kinds
from lm.evaluation.harness import run_cli
from lm.util.cli import exit_on_user_error

if __name__ == "__main__":
    with exit_on_user_error():
        load_outside_kinds()  # the kinds outside lm/ (entry points, LM_ATTENTION_KINDS): a checkpoint may hold them
    sys.exit(run_cli())
