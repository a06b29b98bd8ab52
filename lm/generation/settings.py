"""scripts/generate.py's settings (what `generate_text` takes): each one's default and meaning,
declared once here, beside the generation they drive.

conf/generate.yaml composes them (`generate_settings`, stored by lm.config.generate) and its --help
lists them. Every value is checked, before the checkpoint is read, by the checks lm.generate makes
with the same names (lm.generation.text.check_run_settings: Sampling, check_settings, the
quantisation kernels), so a setting's bound has one home, shared by the script and the Python API.
"""

from __future__ import annotations

from dataclasses import dataclass

from lm.util.settings import Checked, setting


@dataclass(kw_only=True)
class GenerateSettings(Checked):
    ckpt: str = setting(help="a training checkpoint (last.ckpt / best.ckpt)")
    prompt: str | None = setting(None, "the text to continue (or prompt_file)")
    prompt_file: str | None = setting(None, "one prompt per line, decoded together as one batch; -: standard input")
    max_new_tokens: int = setting(200, "tokens to add")
    temperature: float = setting(0.8, "0 is greedy")
    top_k: int | None = setting(50, "keep the k likeliest tokens; null: no top-k filter")
    top_p: float | None = setting(None, "nucleus sampling, in (0, 1]")
    min_p: float | None = setting(None, "keep tokens at least min_p x as likely as the best one")
    repetition_penalty: float | None = setting(None, "> 1 makes tokens already in the text less likely")
    stop: list[str] = setting(help="stop strings, e.g. 'stop=[\"\\n\\n\"]'; the text is cut before them",
                              factory=list)
    seed: int | None = setting(None, "an int makes sampling reproducible")
    use_cache: bool = setting(True, "false recomputes the whole prefix every step (slow; for checking)")
    truncate: str | None = setting(None, "left: drop the oldest prompt tokens when a full-attention context is full")
    stats: bool = setting(False, "true: prompt/new tokens, tokens/s and cache bytes on stderr at the end")
    compile: bool = setting(False, "true: torch.compile the one-token step, and on the CPU the prefill "
                                   "(the first run compiles)")
    compile_mode: str = setting("default", "with compile=true: default, or max-autotune (the CPU: the step compiled "
                                           "with frozen weights and inductor's autotuned matmuls; faster steps, a "
                                           "first call of up to a minute)")
    quantize: str | None = setting(None, "int8: int8 matmul weights (per-channel scales), a quarter of the bytes")
    int8_kernel: str = setting("auto", "with quantize=int8: auto (chosen by the device's int8 instructions, and "
                                       "said), dynamic (activations int8 too, per token; torch._int_mm), native "
                                       "(the same in lm's C kernel, exact on AVX2 without VNNI), dequant or "
                                       "int8pack (weights only)")
    device: str = setting("cpu", "cpu, cuda[:n] or mps")


__all__ = ["GenerateSettings"]
