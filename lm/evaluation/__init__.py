"""Evaluation: a model scored on text. perplexity.py: perplexity and bits per byte on a corpus (what
scripts/eval.py runs, and what the studies score with); harness.py: the lm-evaluation-harness model
registered as `--model lm` (the `eval` extra; what scripts/harness.py runs)."""
