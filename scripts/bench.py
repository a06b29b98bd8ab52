"""Benchmarks: python scripts/bench.py {train,attention,generate,decode,kernels,int8,serve,recipe} [options]
(benchmarks.bench).

A count, size or length that cannot be measured (zero, negative), or a width the heads do not divide,
is one line on stderr and exit code 2 before anything is built or timed, as every script's mistakes are."""

import sys
from pathlib import Path

# benchmarks/ is a folder of the repository, not of the installed package, and `python scripts/bench.py`
# puts scripts/ first on sys.path, not the repository root: so the root, explicitly
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench import build_parser, main  # noqa: E402
from lm.attention import load_outside_kinds  # noqa: E402
from lm.util.cli import exit_on_user_error, quiet_known_warnings  # noqa: E402
from lm.util.errors import ConfigError  # noqa: E402


def check_arguments(argv: list[str]) -> None:
    """The parser's own checks (every count at least 1, 0 where it means something, each target a finite
    number: benchmarks.bench's argument types), and attention's --d-model split by --heads into an even
    head size (RoPE rotates pairs)."""
    args = build_parser().parse_args(argv)
    if args.what == "attention":
        if args.d_model % args.heads:
            raise ConfigError(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
        if (args.d_model // args.heads) % 2:
            raise ConfigError(f"--d-model {args.d_model} over --heads {args.heads} is a head size of "
                              f"{args.d_model // args.heads}; RoPE needs an even head size")


def run(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with exit_on_user_error():
        quiet_known_warnings()  # what every script does at its start (lm.util.cli.run_script)
        load_outside_kinds()  # the kinds outside lm/ (entry points, LM_ATTENTION_KINDS): --kinds may name them
        check_arguments(argv)
    main(argv)  # its own exit_on_user_error around the measuring
    return 0


if __name__ == "__main__":
    sys.exit(run())
