"""Benchmarks, measured side by side in one process and reported as ratios.

    python scripts/bench.py train       # training tokens/s vs transformers' LlamaForCausalLM, and MFU
    python scripts/bench.py attention   # time and peak memory of each attention kind vs sequence length
    python scripts/bench.py generate    # decode tokens/s, per-token latency and cache bytes per kind vs transformers
    python scripts/bench.py decode      # eager, compiled, int8 and llama.cpp decoding vs transformers, batch 1 and
                                        # ragged batches (benchmarks.decode_bench)
    python scripts/bench.py kernels     # one decoding matmul through every int8/int4 kernel (benchmarks.kernel_bench)
    python scripts/bench.py int8 --ckpt ...  # int8 against fp32 on a trained model
    python scripts/bench.py serve       # the server under 1 to 64 concurrent clients, per kind (benchmarks.serve_bench)
    python scripts/bench.py recipe      # two training recipes in turns: time to a held-out bits per byte
    python scripts/bench.py frontier    # CPU seconds per training step of the recall frontier's arms, per kind

The machine may be shared and noisy, so the contenders run in alternating rounds and each
reports its median step time; compare the ratio, not a single absolute figure. `--json PATH`
writes what the tables show, unrounded, with the settings and the machine, for a program to read.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from benchmarks.attention_bench import bench_attention
from benchmarks.bench_models import add_device_argument, attention_rows
from benchmarks.decode_bench import LONG_CONTEXT_KINDS, bench_decode
from benchmarks.frontier_bench import add_frontier_parser
from benchmarks.generate_bench import bench_generate
from benchmarks.int8_bench import bench_int8
from benchmarks.kernel_bench import bench_kernels
from benchmarks.recipe_bench import BASELINE, bench_recipe
from benchmarks.serve_bench import SERVE_KINDS, bench_serve
from benchmarks.train_bench import bench_train, checked_variant, model_shapes
from lm.config.train import TrainSettings
from lm.generation.quantize import AUTO, CHOICES, KERNELS


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its own refusals (an unknown option, a value that is not a number) as the one-line
    error every script gives (lm.util.cli) instead of the usage text and exit code 2 of its own."""

    def error(self, message: str):
        from lm.util.errors import ConfigError

        raise ConfigError(f"{self.prog}: {message}")


def at_least(minimum: int):
    """An argparse type: an integer of at least `minimum`, so a count the work cannot use (0 rounds: minutes
    of work and no median) is one line before any work starts."""

    def parse(text: str) -> int:
        value = int(text)  # not an integer: argparse's own one line
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be at least {minimum}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its line: "invalid integer value: 'x'"
    return parse


COUNT = at_least(1)  # rounds, steps, tokens, sizes
NONNEGATIVE = at_least(0)  # where 0 means "none of these"


def finite_positive(text: str) -> float:
    """An argparse type: a finite number above 0 (a target score: nan or inf would never be reached)."""
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a finite number above 0")
    return value


finite_positive.__name__ = "number"


def build_parser() -> argparse.ArgumentParser:
    """The command line of scripts/bench.py: one subcommand per benchmark."""
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    train = sub.add_parser("train", help="training tokens/s and MFU against transformers' Llama")
    train.add_argument("--steps", type=COUNT, default=10, help="measured steps per contender")
    train.add_argument("--warmup", type=NONNEGATIVE, default=2, help="unmeasured steps per contender first")
    train.add_argument("--batch", type=COUNT, default=8)
    train.add_argument("--model", default="reference", choices=model_shapes(),
                       help="the reference shape (GQA, 6 layers, d_model 384) or a conf/model shape as MHA")
    train.add_argument("--vocab", type=COUNT, default=None, help="vocabulary size (default: the corpus's, 8192)")
    train.add_argument("--seq", type=COUNT, default=None, help="sequence length (default: the shape's max_seq_len)")
    add_device_argument(train, "bf16-mixed there")
    train.add_argument("--no-compile", dest="compile", action="store_false", help="skip the compiled contender")
    train.add_argument("--compile-peers", action="store_true",
                       help="compiled copies of transformers' and litgpt's models too")
    train.add_argument("--loss-chunk", type=NONNEGATIVE, default=TrainSettings.loss_chunk, metavar="N",
                       help="also time ours with the loss made N positions at a time, as training does "
                            "(loss_chunk; default: training's, %(default)s); 0: no such rows")
    train.add_argument("--variants", nargs="+", type=checked_variant, default=[], metavar="OPTIONS",
                       help="more contenders: the same model with softmax options, e.g. gate=elementwise,qk_norm=true")
    train.set_defaults(run=bench_train)
    attention = sub.add_parser("attention", help="time and peak memory of each attention kind against N")
    attention.add_argument("--lengths", type=COUNT, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    attention.add_argument("--d-model", type=COUNT, default=512)
    attention.add_argument("--heads", type=COUNT, default=8)
    attention.add_argument("--repeats", type=COUNT, default=2, help="measured runs per case; the best is kept")
    attention.add_argument("--rounds", type=NONNEGATIVE, default=0,
                           help="then the forwards again in this many alternating rounds per N: medians and ratios")
    attention.add_argument("--no-single-head", dest="single_head", action="store_false",
                           help="skip the one-head comparison at the longest N")
    attention.add_argument("--out", default="bench", help="folder for attention.csv and attention.png")
    add_device_argument(attention, "bf16 there")
    attention.add_argument("--kinds", nargs="+", choices=list(attention_rows()), default=list(attention_rows()),
                           help="rows to time (default: every registered kind's benchmark settings)")
    attention.set_defaults(run=bench_attention)
    gen = sub.add_parser("generate", help="decode tokens/s, per-token latency and cache bytes of each kind")
    gen.add_argument("--prompt", type=COUNT, default=32, help="prompt tokens")
    gen.add_argument("--new-tokens", type=COUNT, nargs="+", default=[128, 1024])
    gen.add_argument("--positions", type=NONNEGATIVE, nargs=2, default=[64, 4096],
                     help="where per-token latency is taken")
    gen.add_argument("--repeats", type=COUNT, default=2)
    gen.add_argument("--no-compare", dest="compare", action="store_false", help="skip transformers' generate")
    gen.add_argument("--kinds", nargs="+", choices=list(attention_rows()), default=list(attention_rows()),
                     help="rows to time (default: every registered kind's benchmark settings)")
    gen.set_defaults(run=bench_generate)
    dec = sub.add_parser("decode", help="eager, compiled, int8 and llama.cpp decoding beside transformers")
    dec.add_argument("--prompt", type=COUNT, default=32, help="prompt tokens (batches: from half to 1.5x this)")
    dec.add_argument("--new-tokens", type=COUNT, default=128)
    dec.add_argument("--rounds", type=COUNT, default=5, help="alternating measured rounds; the median is kept")
    dec.add_argument("--int8-kernels", nargs="*", choices=KERNELS, default=["native", "dynamic", "dequant"],
                     help="int8 rows, eager and compiled, one pair per kernel")
    dec.add_argument("--max-autotune", action="store_true",
                     help="on the CPU, our fp32 compiled row again with compile_mode=max-autotune (frozen "
                          "weights, inductor's autotuned matmuls; a longer first call)")
    dec.add_argument("--batches", type=COUNT, nargs="*", default=[16, 64], help="batch sizes of ragged prompts")
    dec.add_argument("--batch-rounds", type=COUNT, default=3, help="alternating rounds of each batched table")
    dec.add_argument("--contexts", type=COUNT, nargs="*", default=[8192, 32768],
                     help="long-context table: decoding at these cache fill levels (none: no table)")
    dec.add_argument("--context-batches", type=COUNT, nargs="+", default=[1, 8])
    dec.add_argument("--context-kinds", nargs="+", choices=list(attention_rows()), default=LONG_CONTEXT_KINDS)
    dec.add_argument("--context-steps", type=COUNT, default=16, help="timed steps per cell (the median is kept)")
    add_device_argument(dec, "bf16 there, no int8 or llama.cpp rows")
    dec.add_argument("--eager-long", dest="compile_long", action="store_false",
                     help="the long-context table with the eager step (default: compiled, as compile=true decodes)")
    dec.set_defaults(run=bench_decode)
    kernels = sub.add_parser("kernels", help="one decoding matmul through every int8/int4 kernel to choose from")
    kernels.add_argument("--rows", type=COUNT, default=1, help="rows of input (tokens decoded at once)")
    kernels.add_argument("--rounds", type=COUNT, default=5)
    kernels.add_argument("--repeats", type=COUNT, default=20, help="calls per timing")
    kernels.set_defaults(run=bench_kernels)
    q8 = sub.add_parser("int8", help="a trained checkpoint against its int8 copy on the built-in corpus")
    q8.add_argument("--ckpt", required=True, help="a training checkpoint or export folder")
    q8.add_argument("--tokens", type=COUNT, default=50_000, help="validation tokens scored")
    q8.add_argument("--int8-kernel", choices=CHOICES, default=AUTO, help="auto: the kernel generate would choose")
    q8.set_defaults(run=bench_int8)
    serve = sub.add_parser("serve", help="scripts/serve.py under concurrent streaming clients, per kind")
    serve.add_argument("--kinds", nargs="+", default=SERVE_KINDS, help="kinds (bench.py attention's names) or "
                                                                       "hybrid-gated_delta-softmax")
    serve.add_argument("--int8", nargs="*", default=["softmax-gqa"], help="kinds also served with quantize=int8")
    serve.add_argument("--clients", type=COUNT, nargs="+", default=[1, 8, 32, 64])
    serve.add_argument("--slots", type=COUNT, default=32, help="the server's max_batch: the clients, up to this")
    serve.add_argument("--requests", type=COUNT, default=2, help="completions each client sends in turn")
    serve.add_argument("--prompt-tokens", type=COUNT, default=64)
    serve.add_argument("--new-tokens", type=COUNT, default=128)
    serve.add_argument("--compile", action="store_true", help="lm's servers with compile=true (one graph for "
                                                                  "every step; compiled before the timing)")
    serve.add_argument("--llama-server", default=None, metavar="PATH",
                       help="llama.cpp's server program (default: llama-server beside this Python, as "
                            "`make llama-server` builds it, or on PATH; rows left out where there is none)")
    serve.add_argument("--llama-kind", default=None, help="the kind whose weights llama-server serves (a softmax "
                                                          "kind of --kinds; default: the first of --int8, else "
                                                          "of --kinds)")
    serve.add_argument("--out", default="bench", help="folder for serve.png")
    serve.set_defaults(run=bench_serve)
    recipe = sub.add_parser("recipe", help="training recipes in turns: tokens and seconds to held-out bits per byte")
    recipe.add_argument("--a", default=None, help=f"the first recipe's train.py overrides (default: {BASELINE}, "
                                                  "the AdamW recipe)")
    recipe.add_argument("--b", default=None, help="the second recipe's overrides (default: none, today's default "
                                                  "recipe)")
    recipe.add_argument("--recipe", action="append", metavar="NAME=OVERRIDES", default=None,
                        help="a named recipe, repeated for two or more in turns instead of --a and --b; the first "
                             "is the one the others' times compare with")
    recipe.add_argument("--eval-every", type=COUNT, default=200_000, help="training tokens between evaluations")
    recipe.add_argument("--held-out-tokens", type=COUNT, default=60_000,
                        help="the held-out text: the first whole documents of data=pystdlib_tests' validation "
                             "split holding this many tokens of the first recipe's tokenizer; every recipe scores "
                             "those documents")
    recipe.add_argument("--targets", type=finite_positive, nargs="*", default=None,
                        help="bits per byte to time (default: the first recipe's scores at 1/2, 3/4 and the end of "
                             "its run)")
    recipe.add_argument("--out", default="bench", help="folder for recipe.png")
    recipe.set_defaults(run=bench_recipe)
    add_frontier_parser(sub, COUNT)
    for command in sub.choices.values():
        add_json_argument(command)
    return parser


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the results as JSON to PATH: the benchmark, its settings, the machine, "
                             "and every figure of the tables unrounded")


def write_results(path: str, args: argparse.Namespace, results: dict) -> None:
    """--json: the figures a benchmark returned, under its name, settings and machine."""
    from lm.studies.engine import machine
    from lm.util.files import write_atomically

    settings = {key: value for key, value in vars(args).items() if key not in ("run", "what", "json")}
    document = {"benchmark": args.what, "settings": settings, "machine": machine(), **results}
    text = json.dumps(document, indent=1, default=str) + "\n"
    write_atomically(path, lambda tmp: Path(tmp).write_text(text))


def main(argv: list[str] | None = None) -> None:
    from lm.util.cli import exit_on_user_error
    from lm.util.files import make_folder
    from lm.util.hardware import inductor_cache_per_capability

    inductor_cache_per_capability()  # before anything compiles
    args = build_parser().parse_args(argv)
    with exit_on_user_error():
        if args.json:  # a folder that cannot be made is one line before any measuring
            make_folder(Path(args.json).resolve().parent)
        results = args.run(args)
        if args.json:
            write_results(args.json, args, results)
