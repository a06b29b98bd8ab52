"""Studies: runs of many arms and what they report. The attention comparison (compare, report),
the uptraining ablation, evaluation (perplexity, the harness adapter) and benchmarks (bench)."""
