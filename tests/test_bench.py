"""The attention benchmark's outputs: one command gives the table, the CSV and the plot."""

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench import ATTENTION_KINDS, GENERATE_KINDS  # noqa: E402


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
