"""The benchmarks (scripts/bench.py): what each command measures, read from its --json results; the
attention benchmark's table, CSV and plot from one command; the FLOP counts and ops they time."""

import csv
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.attention_bench import attention_layer
from benchmarks.bench import build_parser
from benchmarks.bench_models import attention_rows
from benchmarks.train_bench import variant_spec
from lm.attention import LayerShape, SlidingSpec, SoftmaxSpec, available_kinds
from lm.attention.lowrank import LowRankSpec
from lm.util.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def bench(tmp_path: Path, *args: str, timeout: int = 300) -> tuple[dict, str]:
    """(the --json results, the printed tables) of `scripts/bench.py <args>`."""
    out = tmp_path / "results.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), *args, "--json", str(out)],
                            capture_output=True, text=True, timeout=timeout, check=True)
    return json.loads(out.read_text()), result.stdout


@pytest.mark.slow
def test_bench_attention_writes_table_csv_and_plot(tmp_path):
    results, printed = bench(tmp_path, "attention", "--lengths", "128", "256", "--repeats", "1", "--d-model", "64",
                             "--heads", "4", "--out", str(tmp_path))
    rows = list(csv.DictReader(open(tmp_path / "attention.csv")))
    assert rows == [{key: str(value) for key, value in row.items()} for row in results["rows"]]  # one table, twice
    kinds = {r["kind"] for r in results["rows"]}
    assert set(attention_rows()) | {"mha-1head", "linear-1head"} == kinds
    specs = {**{name: spec for name, (spec, _) in attention_rows().items()},
             "mha-1head": SoftmaxSpec(), "linear-1head": attention_rows()["linear"][0]}
    for r in results["rows"]:  # the GFLOP/s column is the kind's own FLOP count over the measured forward time
        flops = specs[r["kind"]].flops(r["seq_len"], r["n_head"], r["n_kv_head"], 64 // r["n_head"])
        assert r["forward_gflops"] * 1e9 * r["forward_s"] == pytest.approx(flops, rel=1e-9)
        assert r["forward_of_peak"] == pytest.approx(r["forward_gflops"] * 1e9 / results["measured_peak_flops"])
    assert set(results["whole_layer_forward_s"]) == {"softmax-mha", "sliding", "linear"}
    assert (tmp_path / "attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert results["png"] == str(tmp_path / "attention.png")
    assert "against full causal softmax" in printed
    assert results["benchmark"] == "attention" and results["settings"]["lengths"] == [128, 256]


@pytest.mark.slow
def test_bench_generate_gives_a_row_per_kind(tmp_path):
    results, printed = bench(tmp_path, "generate", "--prompt", "4", "--new-tokens", "6", "--positions", "8", "24",
                             "--repeats", "1", "--no-compare")
    rows = results["rows"]
    assert [row["kind"] for row in rows] == list(attention_rows()) and results["transformers"] is None
    for row in rows:  # the cache column is what each kind declares it keeps after prompt + new tokens
        spec, example = attention_rows()[row["kind"]]
        state = spec.build(LayerShape(384, 6, row["n_kv_head"], 64)).generation_state()
        assert row["cache_tokens"] == 4 + 6 and row["cache_bytes"] == 6 * 4 * state.numel(4 + 6)  # 6 layers, fp32
        assert row["cache_bytes_per_token"] == row["cache_bytes"] / 10
        assert set(row["tokens_per_s"]) == {"6"} and set(row["step_s"]) == {"8", "24"}
        assert row["latency_ratio"] == pytest.approx(row["step_s"]["24"] / row["step_s"]["8"])
        assert f"{row['cache_bytes']:14,}" in printed  # the table shows what the JSON holds


def test_bench_json_holds_the_settings_the_machine_and_what_the_table_shows(tmp_path, capsys):
    """`--json PATH` in `make test`: one kind's decoding row at a few tokens, the table printed as ever."""
    from benchmarks.bench import main

    out = tmp_path / "results" / "generate.json"  # its folder made
    main(["generate", "--prompt", "4", "--new-tokens", "3", "--positions", "4", "8", "--repeats", "1",
          "--no-compare", "--kinds", "softmax-gqa", "--json", str(out)])
    printed = capsys.readouterr().out.splitlines()
    results = json.loads(out.read_text())
    assert results["benchmark"] == "generate" and results["settings"]["kinds"] == ["softmax-gqa"]
    assert set(results["machine"]) == {"cpu", "threads", "gpu", "torch"}
    (row,) = results["rows"]
    assert (row["kind"], row["n_kv_head"], row["cache_tokens"]) == ("softmax-gqa", 2, 4 + 3)
    assert row["cache_bytes"] == 6 * 2 * 2 * 64 * 4 * 7  # 6 layers of K and V, 2 K/V heads of 64, fp32, 7 positions
    assert len(printed) == 3 and printed[2].split()[:2] == ["softmax-gqa", "2"]
    assert printed[2].endswith(f"{row['latency_ratio']:15.2f}{row['cache_bytes_per_token']:19,.0f}"
                               f"{row['cache_bytes']:14,}")


def test_bench_json_where_no_folder_can_be_made_is_one_line_before_measuring(tmp_path, capsys):
    from benchmarks.bench import main

    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit) as exit_:
        main(["kernels", "--json", str(tmp_path / "a-file" / "kernels.json")])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""  # the table's header is not printed: nothing was measured
    assert err.startswith(f"error: cannot create the folder '{tmp_path / 'a-file'}'") and err.count("\n") == 1


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
def test_bench_decode_gives_every_contender_with_the_same_tokens(tmp_path):
    results, printed = bench(tmp_path, "decode", "--new-tokens", "4", "--rounds", "1", "--batches", "3",
                             "--batch-rounds", "1", "--contexts", "64", "256", "--context-batches", "1", "2",
                             "--context-steps", "2", "--eager-long", "--context-kinds", "softmax-mha", "linear",
                             "sliding", timeout=900)
    rows = {row["name"]: row for row in results["rows"]}
    ours = {"lm eager", "lm compiled", "lm int8 dequant", "lm int8 dequant compiled",
            *int8_rows_here(("native", "dynamic"), ("", " compiled"))}
    llama_cpp = {"llama.cpp F32", "llama.cpp Q8_0"} if importlib.util.find_spec("llama_cpp") else set()
    assert set(rows) == {"transformers eager", "transformers static+compile", *ours, *llama_cpp}
    # transformers and lm decode the same weights: the same greedy tokens, eager and compiled
    assert all(rows[name]["same_tokens"] for name in ("transformers eager", "transformers static+compile",
                                                      "lm compiled"))
    assert rows["lm eager"]["vs_lm_eager"] == 1 and rows["transformers eager"]["vs_transformers"] == 1
    assert rows["lm int8 dequant"]["weight_mb"] < rows["lm eager"]["weight_mb"]  # int8 weights, float embedding
    (batched,) = results["batched"]
    assert batched["batch"] == 3 and batched["prompt_lengths"] == [16, 32, 48]
    assert "\n\nbatch 3, prompts of 16 to 48 tokens" in printed
    rows = {row["name"]: row for row in batched["rows"]}
    assert set(rows) == {"transformers eager", "transformers static+compile", "lm eager", "lm compiled",
                         "lm int8 dequant compiled", *int8_rows_here(("native", "dynamic"), (" compiled",))}
    # rows of different lengths, left-padded for transformers, ragged for lm: the same tokens
    assert all(rows[name]["same_tokens"] and rows[name]["rows_equal"] == 3
               for name in ("transformers eager", "transformers static+compile", "lm compiled"))
    for name, row in rows.items():  # the column shows what the JSON holds
        assert re.search(rf"^{re.escape(name)} .* {row['rows_equal']} of 3$", printed, re.MULTILINE), name
    # every kind asked for at every context x batch, and its ratio to MHA's
    long_context = results["long_context"]
    assert long_context["cells"] == [{"context": c, "batch": b} for c in (64, 256) for b in (1, 2)]
    rates = {row["kind"]: row for row in long_context["rows"]}
    assert list(rates) == ["softmax-mha", "linear", "sliding"]
    assert all(len(row["tokens_per_s"]) == 4 and all(r > 0 for r in row["tokens_per_s"]) for row in rates.values())
    assert rates["softmax-mha"]["vs_mha"] == [1.0] * 4
    # the linear kind's state is fixed-size: less cache at 256 positions than MHA's keys and values
    assert rates["linear"]["cache_mb"] < rates["softmax-mha"]["cache_mb"]


def int8_rows_here(kernels: tuple[str, ...], suffixes: tuple[str, ...]) -> list[str]:
    """The rows bench.py decode and kernels give `kernels` here: none for dynamic where torch._int_mm's
    sums are inexact, none for native without a C compiler to build it."""
    from conftest import int8_kernels_here

    return [f"lm int8 {kernel}{suffix}" for kernel in int8_kernels_here(kernels) for suffix in suffixes]


def test_train_variants_are_softmax_options_checked_before_any_model_is_built(capsys):
    assert variant_spec("gate=elementwise,qk_norm=true,softcap=30") == SoftmaxSpec(gate="elementwise", qk_norm=True,
                                                                                   softcap=30)
    assert variant_spec("softcap=2.5").softcap == 2.5
    for bad, message in [("gate=sigmoid", "gate='sigmoid' is not one of"), ("qk_norm", "must be option=value"),
                         ("window=8", "attention kind 'softmax' does not take option(s) ['window']")]:
        with pytest.raises(ConfigError) as refused:  # scripts/bench.py says it in one line, exit code 2
            build_parser().parse_args(["train", "--variants", bad])
        assert message in str(refused.value)


def test_the_chunked_loss_contender_takes_the_plain_contenders_step():
    """bench.py train's "lm chunked loss" row trains what the "lm" row does, the loss made a chunk of
    positions at a time: from the same weights and batch, the same loss and the same weights after
    the AdamW step (float64; 7-position chunks that do not divide the 72 positions)."""
    from benchmarks.train_bench import chunked_loss_step_fn
    from lm import ModelConfig, Transformer
    from lm.studies.train_step import train_step_fn

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64, max_seq_len=24)
    plain = Transformer(cfg).double()
    chunked = Transformer(cfg).double()
    chunked.load_state_dict(plain.state_dict())
    before = {name: t.clone() for name, t in plain.state_dict().items()}
    batch = torch.randint(0, cfg.vocab_size, (3, cfg.max_seq_len + 1))
    plain_loss = train_step_fn(plain, lambda m, x: m(x))(batch)
    chunked_loss = chunked_loss_step_fn(chunked, chunk=7)(batch)
    torch.testing.assert_close(chunked_loss, plain_loss)
    for (name, after_plain), after_chunked in zip(plain.state_dict().items(), chunked.state_dict().values(),
                                                  strict=True):
        torch.testing.assert_close(after_chunked, after_plain, msg=name)
        assert not torch.equal(after_plain, before[name]), f"{name}: the step left it as it was"


def test_bench_train_times_the_chunked_loss_beside_the_plain_one(tmp_path, monkeypatch):
    """`--json` of a small `bench.py train` (the matmul peak not measured): the chunked-loss row beside
    ours and the peer, counted with our FLOPs; `--loss-chunk 0` builds no such contender."""
    from argparse import Namespace

    from benchmarks import train_bench
    from benchmarks.bench import main

    monkeypatch.setattr(train_bench, "matmul_peak_flops", lambda device: 1e9)
    main(["train", "--model", "tiny", "--seq", "32", "--batch", "2", "--steps", "1", "--warmup", "0", "--no-compile",
          "--loss-chunk", "16", "--json", str(tmp_path / "chunked.json")])
    rows = {row["name"]: row for row in json.loads((tmp_path / "chunked.json").read_text())["rows"]}
    assert {"lm", "transformers", "lm chunked loss"} <= set(rows)
    assert rows["lm chunked loss"]["flops_per_step"] == rows["lm"]["flops_per_step"]
    assert rows["lm chunked loss"]["tokens_per_s"] > 0
    cfg = train_bench.bench_shape(Namespace(model="tiny", vocab=64, seq=16))
    models, _, _ = train_bench.train_contenders(cfg, Namespace(loss_chunk=0, compile=True, compile_peers=False,
                                                               variants=[]), None)
    assert not any("chunked" in name for name in models) and "lm compiled" in models


def test_the_chunked_loss_contender_scores_as_training_does_under_bf16_autocast():
    """Under bf16 autocast (as bf16-mixed trains) the chunked contender's loss is the one training's
    Scorer takes with the same chunk, on the same weights and batch."""
    from benchmarks.train_bench import chunked_loss_step_fn
    from lm import ModelConfig, Transformer
    from lm.training.scoring import Scorer

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64, max_seq_len=24)
    model = Transformer(cfg)
    batch = torch.randint(0, cfg.vocab_size, (3, cfg.max_seq_len + 1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trained, _, _ = Scorer(model, loss_chunk=7)(batch, "mean", accuracy=False)
    stepped = chunked_loss_step_fn(model, 7, autocast=torch.bfloat16)(batch)  # the weights before
    assert trained.dtype == stepped.dtype == torch.float32
    torch.testing.assert_close(stepped, trained.detach())


def test_the_int4_contender_is_the_product_with_its_4_bit_weights():
    """bench.py kernels times PyTorch's int4 CPU kernel; what it times must be the matmul it claims:
    x times the weight rounded to 16 levels per group of 32, in float64."""
    from benchmarks.kernel_bench import INT4_GROUP, int4_kernel

    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 48, bias=False)
    x = torch.randn(3, 128)
    groups = linear.weight.detach().double().reshape(48, -1, INT4_GROUP)  # (N, K/32, 32)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-6)
    rounded = (torch.round((groups - low) / scale).clamp(0, 15) * scale + low).reshape(48, 128)
    torch.testing.assert_close(int4_kernel(linear)(x).double(), x.double() @ rounded.T, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_bench_kernels_times_every_kernel_at_every_shape(tmp_path):
    from benchmarks.kernel_bench import PER_STEP, SHAPES

    results, _ = bench(tmp_path, "kernels", "--rounds", "1", "--repeats", "1", timeout=900)
    rows = {row["kernel"]: row for row in results["rows"]}
    assert {"fp32", "lm int8 dequant", "lm int8 int8pack", "aten int4 (group 32)",
            *int8_rows_here(("native", "dynamic"), ("", " compiled"))} <= set(rows)
    shapes = [f"{k}x{n}" for k, n in SHAPES]
    for row in rows.values():  # a step: each matmul as often as the 6-layer model runs it
        assert list(row["us"]) == shapes and all(us > 0 for us in row["us"].values())
        assert row["per_step_us"] == pytest.approx(sum(n * row["us"][s] for n, s in zip(PER_STEP, shapes, strict=True)))
    assert rows["fp32"]["vs_fp32"] == 1


@pytest.mark.slow
def test_bench_int8_scores_a_trained_checkpoint_on_the_built_in_corpus(tmp_path, small_corpus):
    from conftest import int8_kernels_here, train_small_run

    ckpt = train_small_run(tmp_path, small_corpus, "trainer.max_steps=20")
    for kernel in int8_kernels_here(("native", "dynamic", "dequant")):
        results, printed = bench(tmp_path, "int8", "--ckpt", str(ckpt), "--tokens", "3000", "--int8-kernel", kernel,
                                 timeout=900)
        assert f"validation tokens of the built-in corpus, int8 kernel {kernel}" in printed.splitlines()[0]
        assert results["int8_kernel"] == kernel and 3000 - 32 < results["tokens"] <= 3000  # whole windows of 32
        assert 0.8 <= results["agreement"] <= 1
        assert abs(results["loss_fp32"] - results["loss_int8"]) < 0.1
        assert results["weight_bytes_int8"] < results["weight_bytes_fp32"]


def all_options() -> list[tuple[str, object]]:
    """(subcommand, argparse action) of every option of every subcommand."""
    # argparse keeps a parser's options only in _actions, with no public reader: read here, never changed
    subcommands = next(a for a in build_parser()._actions if a.dest == "what").choices
    return [(name, action) for name, sub in subcommands.items() for action in sub._actions if action.option_strings]


def numeric_options() -> list[tuple[str, str, object, int]]:
    """(subcommand, option, its argparse type, values it takes at once) for every option of every
    subcommand that takes a number."""
    return [(name, action.option_strings[0], action.type, action.nargs if isinstance(action.nargs, int) else 1)
            for name, action in all_options() if getattr(action.type, "__name__", "") in ("integer", "number")]


def test_no_option_takes_a_bare_int_or_float():
    """A count or a target through int or float alone would let 0, nan or inf reach the work."""
    assert [(name, a.option_strings[0]) for name, a in all_options() if a.type in (int, float)] == []


REQUIRED = {"int8": ["--ckpt", "x.ckpt"]}


@pytest.mark.parametrize(("command", "option", "kind", "values"), numeric_options(),
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_every_count_and_target_is_checked_before_any_work(command, option, kind, values):
    """The family of `--rounds 0` (minutes of work, then a StatisticsError) and `--targets nan` (a target
    no run reaches): each numeric option refuses a value its work cannot use in one line naming it."""
    from benchmarks.bench import COUNT, NONNEGATIVE

    bad = {COUNT: ["0", "-1"], NONNEGATIVE: ["-1"]}.get(kind, ["nan", "inf", "0"])
    for value in bad:
        line = rf"^\S+ {command}: argument {option}(/\S+)?: {re.escape(value)} must"
        with pytest.raises(ConfigError, match=line):
            build_parser().parse_args([command, *REQUIRED.get(command, []), option, *[value] * values])
