"""Hash every file of a token cache against the SHA-256 its meta.json recorded:

    python scripts/verify_cache.py .cache/tokens/<corpus>-<key>

Runs only check each file's size and modification time when they open a cache, so bytes changed
behind an unchanged size and a restored time are found only here. Prints one line: `ok ...` and
exit code 0 for a whole cache, `error: ...` and exit code 2 for a damaged one or a folder that is
not a cache."""

import argparse
import sys

from lm.data.token_cache import verify_token_cache
from lm.util.cli import exit_on_user_error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cache", help="a cache folder: tokenizer.json, train.bin, val.bin and meta.json")
    args = parser.parse_args(argv)
    with exit_on_user_error():
        cache = verify_token_cache(args.cache)
        meta = cache.meta
        print(f"ok {cache.path}: {', '.join(meta['files'])} match their SHA-256 "
              f"({meta['train_tokens']} train and {meta['val_tokens']} val tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
