"""Studies: the comparisons users run, as runs of many arms and what they report. The attention
comparison and its frontier (compare, report) and the uptraining ablation, on one engine (records,
resume, launchers, plots). Evaluation lives in lm.evaluation; the benchmarks against peers in the
repository's benchmarks/ folder, outside the package."""
