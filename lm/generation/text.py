"""`generate_text(settings)`: what scripts/generate.py runs. Loads a checkpoint, decodes the prompt(s)
and streams the text to stdout; settings are checked before anything is loaded."""

from __future__ import annotations

import re
import sys
from typing import BinaryIO, TextIO

from lm.data.tokenizer import EOT
from lm.formats.checkpoint import load
from lm.generation.compiled import check_fits
from lm.generation.decode import Generation, Sampling, check_settings, stop_strings
from lm.generation.quantize import CHOICES, Int8Linear, quantize_int8, resolve_kernel, weight_bytes
from lm.generation.settings import GenerateSettings
from lm.util.checks import as_list, check_device, require_bool
from lm.util.errors import GenerationError
from lm.util.paths import resolve_path

# Free-text settings: scripts/generate.py quotes them for Hydra (lm.util.cli.quote_text_overrides).
PROMPT_KEYS = ("prompt", "prompt_file")


def read_prompts(settings: GenerateSettings, stdin: BinaryIO | None = None) -> list[str]:
    """The prompts as text: `prompt` alone, or `prompt_file`'s non-blank lines (`-`: standard input).
    Every source is held to UTF-8 alike: bytes that are not are refused in one line, never replaced."""
    if (settings.prompt is None) == (settings.prompt_file is None):
        raise GenerationError("give exactly one of prompt=... or prompt_file=...")
    if settings.prompt is not None:
        try:  # bytes the shell could not decode arrive as lone surrogates: back to those bytes
            raw = str(settings.prompt).encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            raise GenerationError("prompt is not valid UTF-8 text") from None
        prompts = [utf8_text(raw, "prompt")]
    else:
        text = utf8_text(prompt_file_bytes(settings.prompt_file, stdin), f"prompt_file={settings.prompt_file!s}")
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts or not all(prompts):
        raise GenerationError("the prompt is empty: give some text to continue")
    return prompts


def prompt_file_bytes(name: str, stdin: BinaryIO | None) -> bytes:
    if str(name) == "-":
        return (stdin or sys.stdin.buffer).read()
    path = resolve_path(name)
    if not path.is_file():
        raise GenerationError(f"prompt_file={str(name)!r} does not exist")
    return path.read_bytes()


def utf8_text(raw: bytes, source: str) -> str:
    """`raw` decoded as UTF-8, or one line naming the first byte that is not."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GenerationError(f"{source} is not valid UTF-8 text: byte 0x{raw[e.start]:02x} at offset "
                              f"{e.start}") from None


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def read_stop_strings(stop) -> list[str]:
    """The stop strings as the user meant them: `stop=["\\n\\n"]` reaches us as backslash, n
    (Hydra keeps escapes literal), so \\n, \\t, \\r and \\\\ are read as the characters they name;
    then checked as lm.generate checks them."""
    # Hydra reads `stop=[5]` as an int: on the command line every stop string is text.
    typed = [str(s) for s in as_list("stop", stop, GenerationError)]
    return stop_strings([re.sub(r"\\([ntr\\])", lambda m: ESCAPES[m.group(1)], s) for s in typed])


def check_run_settings(settings: GenerateSettings) -> tuple[Sampling, list[str]]:
    """Every setting, checked before the model is loaded, by the checks lm.generate makes; the
    sampling and the stop strings."""
    s = settings
    sampling = Sampling(s.temperature, s.top_k, s.top_p, s.min_p, s.repetition_penalty)
    stop = check_settings(s.max_new_tokens, read_stop_strings(s.stop), s.seed, s.truncate, s.use_cache, s.compile,
                          s.compile_mode)
    check_device(settings.device)
    if settings.quantize not in (None, "int8"):
        raise GenerationError(f"quantize={settings.quantize!r} must be null or int8")
    check_fits(settings.compile_mode, settings.device, settings.quantize is not None)
    if settings.int8_kernel not in CHOICES:
        raise GenerationError(f"int8_kernel={settings.int8_kernel!r} must be one of {list(CHOICES)}")
    if settings.quantize and settings.int8_kernel == "dynamic" and str(settings.device).startswith("cuda"):
        # torch._int_mm on CUDA needs more than 16 rows, which a decoding step does not have.
        raise GenerationError("int8_kernel=dynamic runs on the CPU; on cuda use int8_kernel=dequant")
    require_bool("stats", settings.stats, GenerationError)
    return sampling, stop


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """text up to the first stop string, and whether one was found."""
    cuts = [text.find(s) for s in stop if s in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


def generate_text(settings: GenerateSettings, out: TextIO | None = None, err: TextIO | None = None) -> list[str]:
    """Continue each prompt; returns the texts (prompt + continuation). Text goes to `out`
    (stdout), statistics to `err` (stderr)."""
    out, err = out or sys.stdout, err or sys.stderr
    sampling, stop = check_run_settings(settings)
    prompts = read_prompts(settings)
    model, tokenizer = load(resolve_path(settings.ckpt), device=settings.device)
    if settings.quantize is not None:
        kernel, why = resolve_kernel(settings.int8_kernel, next(model.parameters()).device)
        if why is not None:
            print(why, file=err)
        model = quantize_int8(model, kernel)
    ids = [tokenizer.encode(p).ids for p in prompts]
    run = Generation(model, ids, settings.max_new_tokens, sampling, stop=stop, tokenizer=tokenizer,
                     eos_id=tokenizer.token_to_id(EOT), use_cache=settings.use_cache, seed=settings.seed,
                     truncate=settings.truncate, compile=settings.compile, compile_mode=settings.compile_mode)
    if len(prompts) == 1:
        texts = [_stream_one(run, prompts[0], len(ids[0]), tokenizer, stop, out)]
    else:
        for _ in run:
            pass
        texts = []
        for i, (prompt, tokens) in enumerate(zip(prompts, run.tokens, strict=True)):
            continuation, _ = cut_at_stop(tokenizer.decode(tokens[len(ids[i]):]), stop)
            texts.append(prompt + continuation)
            out.write(f"=== {i + 1}/{len(prompts)} ===\n{texts[-1]}\n")
    if settings.stats:
        out.flush()  # the text first, then the statistics, also when both go to one terminal or file
        _print_stats(run, err)
    return texts


def _stream_one(run: Generation, prompt: str, n_prompt: int, tokenizer, stop: list[str], out: TextIO) -> str:
    """Write the prompt, then the continuation as it decodes (only text that is settled)."""
    out.write(prompt)
    out.flush()
    text = StreamedText(tokenizer, stop)
    for _ in run:
        settled, _ = text.update(run.tokens[0][n_prompt:])
        if settled:
            out.write(settled)
            out.flush()
    rest = text.finish(run.tokens[0][n_prompt:])
    out.write(rest + "\n")
    return prompt + text.text


class StreamedText:
    """A continuation's text as its tokens arrive, given out piece by piece as it settles.

    Text that could still turn into a stop string, or that ends in half a UTF-8 character (the
    tokenizer decodes it as U+FFFD until the rest arrives), waits until it is settled; a stop
    string ends the text before it. `text` is everything given out so far."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max(map(len, stop), default=1) - 1  # characters that may be the start of a stop string
        self.text = ""

    def update(self, ids: list[int]) -> tuple[str, bool]:
        """The newly settled text of the continuation `ids` (all its tokens so far), and whether it
        has reached a stop string (then nothing after it is ever given out)."""
        text, stopped = cut_at_stop(self.tokenizer.decode(ids), self.stop)
        settled = len(text) if stopped else max(len(self.text), len(text) - self.hold)
        if stopped or (settled > len(self.text) and not text[:settled].endswith("\ufffd")):
            piece, self.text = text[len(self.text):settled], text[:settled]
            return piece, stopped
        return "", False

    def finish(self, ids: list[int]) -> str:
        """The rest of the text once the continuation is complete, held-back characters included."""
        text, _ = cut_at_stop(self.tokenizer.decode(ids), self.stop)
        piece, self.text = text[len(self.text):], text
        return piece


def _int8_note(model) -> str:
    """' (int8, kernel dynamic)' for a quantized model, so the statistics say which kernel ran."""
    kernels = sorted({m.kernel for m in model.modules() if isinstance(m, Int8Linear)})
    return f" (int8, kernel {', '.join(kernels)})" if kernels else ""


def _print_stats(run: Generation, err: TextIO) -> None:
    s = run.stats
    decode_rate = s["new_tokens"] / s["decode_s"] if s.get("decode_s") else 0.0
    if run.compiled and s.get("first_step_s") and s["new_tokens"] > 2:
        # The first step compiles; the rate a user gets from then on leaves it out.
        decode_rate = (s["new_tokens"] - 2) / (s["decode_s"] - s["first_step_s"])
    tokens = s["prompt_tokens"] + s["new_tokens"]
    per_token = s["cache_bytes"] / tokens if tokens else 0.0
    err.write(f"prompt tokens {s['prompt_tokens']}, new tokens {s['new_tokens']}, prefill {s['prefill_s']:.3f} s, "
              f"decode {decode_rate:.1f} tokens/s, cache {s['cache_bytes']:,} bytes ({per_token:,.0f} per token), "
              f"weights {weight_bytes(run.model):,} bytes{_int8_note(run.model)}\n")
    if run.compiled and "first_step_s" in s:
        # on CUDA the prefill runs eagerly (lm.generation.decode.compiled_functions): nothing compiled there
        prefill = "" if run.prefill_fn is run.model else f"prefill {s['prefill_s']:.1f} s, "
        err.write(f"compiling: {prefill}first step {s['first_step_s']:.1f} s "
                  "(later runs of the same shapes in this process reuse the graphs)\n")


__all__ = ["StreamedText", "cut_at_stop", "generate_text"]
