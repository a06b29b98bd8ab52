"""Benchmarks: python scripts/bench.py {train,attention,generate,decode,int8} [options] (lm.studies.bench)."""

from lm.studies.bench import main

if __name__ == "__main__":
    main()
