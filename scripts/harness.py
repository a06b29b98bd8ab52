"""lm-evaluation-harness's command line with lm's checkpoints available as `--model lm`:

    python scripts/harness.py --model lm --model_args ckpt=checkpoints/<run>/last.ckpt --tasks <tasks>

Everything after the script name is the harness's own arguments (`--include_path` for local task
YAMLs, `--limit`, `--output_path` ...). This wrapper only imports lm.studies.harness first, which registers
the model: the harness (0.4) finds models in its own registry, not through installed plug-ins."""

import sys

from lm_eval.__main__ import cli_evaluate

import lm.studies.harness  # noqa: F401  (registers --model lm)

if __name__ == "__main__":
    sys.exit(cli_evaluate())
