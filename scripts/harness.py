"""lm-evaluation-harness's command line with lm's checkpoints available as `--model lm`:

    python scripts/harness.py --model lm --model_args ckpt=checkpoints/<run>/last.ckpt --tasks <tasks>

Everything after the script name is the harness's own arguments (`--include_path` for local task
YAMLs, `--limit`, `--output_path` ...). Importing lm.studies.harness registers the model: the harness
(0.4) finds models in its own registry, not through installed plug-ins. A mistake the harness or the
model refuses before scoring (a missing checkpoint, an unknown task, a task whose data cannot be
loaded, a bad --model_args value) is one line `error: ...` on stderr and exit code 2."""

import sys

from lm.studies.harness import run_cli

if __name__ == "__main__":
    sys.exit(run_cli())
