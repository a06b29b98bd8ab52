"""The attention benchmark's outputs: one command gives the table, the CSV and the plot."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from lm.attention import SlidingSpec, SoftmaxSpec
from lm.attention.lowrank import LowRankSpec
from lm.studies.bench import ATTENTION_KINDS, GENERATE_KINDS, attention_flops

ROOT = Path(__file__).resolve().parents[1]


def test_bench_attention_writes_table_csv_and_plot(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "attention", "--lengths", "128", "256",
         "--repeats", "1", "--d-model", "64", "--heads", "4", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=True,
    )
    rows = list(csv.DictReader(open(tmp_path / "attention.csv")))
    kinds = {r["kind"] for r in rows}
    assert set(ATTENTION_KINDS) | {"mha-1head", "linear-1head"} == kinds
    assert all(float(r["forward_s"]) > 0 and float(r["forward_backward_s"]) > 0 for r in rows)
    assert all(float(r["forward_gflops"]) > 0 and float(r["forward_peak_mb"]) >= 0 for r in rows)
    assert (tmp_path / "attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "against full causal softmax" in result.stdout


def test_bench_generate_prints_a_row_per_kind():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "generate", "--prompt", "4", "--new-tokens", "6",
         "--positions", "8", "24", "--repeats", "1", "--no-compare"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    rows = [line.split() for line in result.stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == list(GENERATE_KINDS)
    assert all(float(row[2]) > 0 and int(row[-1].replace(",", "")) > 0 for row in rows)  # tok/s, cache bytes


def test_attention_flops_count_the_keys_each_query_sees():
    """Against the visible (query, key) pairs counted one by one: 4 * hs FLOPs per pair per head."""
    T, hs, heads = 37, 8, 2
    pairs = {
        "causal": sum(1 for i in range(T) for j in range(T) if j <= i),
        "window 5": sum(1 for i in range(T) for j in range(T) if i - 5 < j <= i),
        "lowrank 8/2": sum(i % 8 + 1 + 2 * (i // 8) for i in range(T)),
    }
    assert attention_flops(SoftmaxSpec(), heads, heads, hs, T) == 4 * heads * hs * pairs["causal"]
    assert attention_flops(SlidingSpec(window=5), heads, heads, hs, T) == 4 * heads * hs * pairs["window 5"]
    assert attention_flops(LowRankSpec(block=8, rank=2), heads, heads, hs, T) == 4 * heads * hs * pairs["lowrank 8/2"]


@pytest.mark.slow
def test_bench_decode_prints_every_contender_with_the_same_tokens():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "decode", "--new-tokens", "4", "--rounds", "1"],
        capture_output=True, text=True, timeout=900, check=True,
    )
    rows = {line[:30].strip(): line[30:].split() for line in result.stdout.splitlines()[2:]}
    assert set(rows) == {"transformers eager", "transformers static+compile", "lm eager", "lm compiled", "lm int8",
                         "lm int8 compiled"}
    # transformers and lm decode the same weights: the same greedy tokens, eager and compiled
    assert all(rows[name][-1] == "True" for name in ("transformers eager", "transformers static+compile",
                                                     "lm compiled"))
