"""The attention benchmark's outputs: one command gives the table, the CSV and the plot."""

import csv
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lm.attention import LayerShape, SlidingSpec, SoftmaxSpec, available_kinds
from lm.attention.lowrank import LowRankSpec
from lm.studies.bench import attention_layer, attention_rows, build_parser, variant_spec

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_attention_writes_table_csv_and_plot(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "attention", "--lengths", "128", "256",
         "--repeats", "1", "--d-model", "64", "--heads", "4", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=True,
    )
    rows = list(csv.DictReader(open(tmp_path / "attention.csv")))
    kinds = {r["kind"] for r in rows}
    assert set(attention_rows()) | {"mha-1head", "linear-1head"} == kinds
    specs = {**{name: spec for name, (spec, _) in attention_rows().items()},
             "mha-1head": SoftmaxSpec(), "linear-1head": attention_rows()["linear"][0]}
    for r in rows:  # the GFLOP/s column is the kind's own FLOP count over the measured forward time
        flops = specs[r["kind"]].flops(int(r["seq_len"]), int(r["n_head"]), int(r["n_kv_head"]), 64 // int(r["n_head"]))
        assert float(r["forward_gflops"]) * 1e9 * float(r["forward_s"]) == pytest.approx(flops, rel=1e-3)
        assert float(r["forward_of_peak"]) == pytest.approx(float(r["forward_gflops"]) / peak_gflops(result), rel=0.02)
    assert (tmp_path / "attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "against full causal softmax" in result.stdout


def peak_gflops(result) -> float:
    """The measured matmul peak the benchmark printed in its header."""
    return float(result.stdout.split("matmul peak ")[1].split()[0])


@pytest.mark.slow
def test_bench_generate_prints_a_row_per_kind():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "generate", "--prompt", "4", "--new-tokens", "6",
         "--positions", "8", "24", "--repeats", "1", "--no-compare"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    rows = [line.split() for line in result.stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == list(attention_rows())
    for row in rows:  # the cache column is what each kind declares it keeps after prompt + new tokens
        spec, example = attention_rows()[row[0]]
        n_kv_head = int(row[1])
        state = spec.build(LayerShape(384, 6, n_kv_head, 64)).generation_state()
        assert int(row[-1].replace(",", "")) == 6 * 4 * state.numel(4 + 6)  # 6 layers, fp32


def test_attention_flops_count_the_keys_each_query_sees():
    """Against the visible (query, key) pairs counted one by one: 4 * hs FLOPs per pair per head."""
    T, hs, heads = 37, 8, 2
    pairs = {
        "causal": sum(1 for i in range(T) for j in range(T) if j <= i),
        "window 5": sum(1 for i in range(T) for j in range(T) if i - 5 < j <= i),
        "lowrank 8/2": sum(i % 8 + 1 + 2 * (i // 8) for i in range(T)),
    }
    assert SoftmaxSpec().flops(T, heads, heads, hs) == 4 * heads * hs * pairs["causal"]
    assert SlidingSpec(window=5).flops(T, heads, heads, hs) == 4 * heads * hs * pairs["window 5"]
    assert LowRankSpec(block=8, rank=2).flops(T, heads, heads, hs) == 4 * heads * hs * pairs["lowrank 8/2"]


def test_every_kind_has_benchmark_rows_and_a_flop_count():
    rows = attention_rows()
    assert {spec.kind for spec, _ in rows.values()} == set(available_kinds())
    for spec, _ in rows.values():  # more positions, more work: a count, not a constant
        assert 0 < spec.flops(64, 4, 2, 16) < spec.flops(128, 4, 2, 16)


@pytest.mark.parametrize("row", list(attention_rows()))
def test_every_benchmark_row_times_its_op_on_the_inputs_it_names(row):
    """What the attention benchmark runs for a row, at N = 96: the op's output has a query head's
    shape at every position, and the backward reaches every input."""
    spec, example = attention_rows()[row]
    module, shape = attention_layer(spec, example.kv_heads(4, 4), 128, 4)  # head size 32: room for MLA's defaults
    op, inputs = module.benchmark_op(96, requires_grad=True)
    out = op(*inputs)
    assert out.shape == (1, 4, 96, 32)
    out.sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in inputs)


@pytest.mark.slow
def test_bench_decode_prints_every_contender_with_the_same_tokens():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "decode", "--new-tokens", "4", "--rounds", "1",
         "--batches", "3", "--batch-rounds", "1", "--contexts", "64", "256", "--context-batches", "1", "2",
         "--context-steps", "2", "--eager-long", "--context-kinds", "softmax-mha", "linear", "sliding"],
        capture_output=True, text=True, timeout=900, check=True,
    )
    batch_one, rest = result.stdout.split("\n\nbatch 3, prompts of 16 to 48 tokens")
    batched, long_context, ratios = rest.split("\n\n")
    # the table's rows, without the notes under it (llama.cpp missing, or its tokens differing)
    table = [line for line in batch_one.splitlines()[2:] if not line.startswith(("llama.cpp rows:", "llama.cpp F32'"))]
    rows = {line[:34].strip(): line[34:].split() for line in table}
    ours = {"lm eager", "lm compiled", "lm int8 dynamic", "lm int8 dynamic compiled", "lm int8 dequant",
            "lm int8 dequant compiled"}
    llama_cpp = {"llama.cpp F32", "llama.cpp Q8_0"} if importlib.util.find_spec("llama_cpp") else set()
    assert set(rows) == {"transformers eager", "transformers static+compile", *ours, *llama_cpp}
    # transformers and lm decode the same weights: the same greedy tokens, eager and compiled
    assert all(rows[name][-1] == "True" for name in ("transformers eager", "transformers static+compile",
                                                     "lm compiled"))
    rows = {line[:34].strip(): line[34:].split() for line in batched.splitlines()[2:]}
    assert set(rows) == {"transformers eager", "transformers static+compile", "lm eager", "lm compiled",
                         "lm int8 dynamic compiled", "lm int8 dequant compiled"}
    # rows of different lengths, left-padded for transformers, ragged for lm: the same tokens
    assert all(rows[name][-1] == "True" for name in ("transformers eager", "transformers static+compile",
                                                     "lm compiled"))
    # every kind asked for at every context x batch, and its ratio to MHA's
    lines = long_context.splitlines()
    assert all(cell in lines[1] for cell in ("64 x 1", "64 x 2", "256 x 1", "256 x 2", "cache MB @256"))
    rates = {line.split()[0]: [float(v) for v in line.split()[2:6]] for line in lines[2:]}
    assert set(rates) == {"softmax-mha", "linear", "sliding"} and all(r > 0 for row in rates.values() for r in row)
    ratio_rows = {line.split()[0]: line.split()[1:] for line in ratios.splitlines()[1:]}
    assert ratio_rows["softmax-mha"] == ["1.00x"] * 4 and set(ratio_rows) == set(rates)


def test_train_variants_are_softmax_options_checked_before_any_model_is_built(capsys):
    assert variant_spec("gate=elementwise,qk_norm=true,softcap=30") == SoftmaxSpec(gate="elementwise", qk_norm=True,
                                                                                   softcap=30)
    assert variant_spec("softcap=2.5").softcap == 2.5
    for bad, message in [("gate=sigmoid", "gate='sigmoid' is not one of"), ("qk_norm", "must be option=value"),
                         ("window=8", "attention kind 'softmax' does not take option(s) ['window']")]:
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(["train", "--variants", bad])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_int4_contender_is_the_product_with_its_4_bit_weights():
    """bench.py kernels times PyTorch's int4 CPU kernel; what it times must be the matmul it claims:
    x times the weight rounded to 16 levels per group of 32, in float64."""
    from lm.studies.kernel_bench import INT4_GROUP, int4_kernel

    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 48, bias=False)
    x = torch.randn(3, 128)
    groups = linear.weight.detach().double().reshape(48, -1, INT4_GROUP)  # (N, K/32, 32)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-6)
    rounded = (torch.round((groups - low) / scale).clamp(0, 15) * scale + low).reshape(48, 128)
    torch.testing.assert_close(int4_kernel(linear)(x).double(), x.double() @ rounded.T, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_bench_kernels_times_every_kernel_at_every_shape():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "kernels", "--rounds", "1",
                             "--repeats", "1"], capture_output=True, text=True, timeout=900, check=True)
    lines = result.stdout.splitlines()
    rows = {line[:34].strip(): line[34:].split() for line in lines[2:-1]}
    assert {"fp32", "lm int8 dynamic", "lm int8 dequant", "lm int8 int8pack", "lm int8 dynamic compiled",
            "aten int4 (group 32)"} <= set(rows)
    assert all(len(cells) == 7 and all(float(c.rstrip("x")) > 0 for c in cells) for cells in rows.values())
    assert rows["fp32"][-1] == "1.00x"


@pytest.mark.slow
def test_bench_int8_scores_a_trained_checkpoint_on_the_built_in_corpus(tmp_path, small_corpus):
    from conftest import train_small_run

    ckpt = train_small_run(tmp_path, small_corpus, "trainer.max_steps=20")
    for kernel in ("dynamic", "dequant"):
        result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "int8", "--ckpt", str(ckpt),
                                 "--tokens", "3000", "--int8-kernel", kernel],
                                capture_output=True, text=True, timeout=900, check=True)
        lines = result.stdout.splitlines()
        assert f"validation tokens of the built-in corpus, int8 kernel {kernel}" in lines[0]
        agreement = float(lines[1].split(": ")[1].rstrip("%"))
        assert 80 <= agreement <= 100
        fp32_loss, int8_loss = (float(part.split()[-1]) for part in lines[3].split(", "))
        assert abs(fp32_loss - int8_loss) < 0.1
