"""Benchmarks: speed and quality measured against peers (transformers, litgpt, llama.cpp), run by
`python scripts/bench.py <benchmark>` (bench.py, one subcommand per module here).

A folder of the repository, not of the wheel: it imports `lm`, and nothing in `lm` imports it."""
