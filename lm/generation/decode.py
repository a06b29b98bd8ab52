"""Decoding: prefill the prompts through the model's caches, then sample one token per step.

Attention-agnostic: every layer brings its own cache (lm.attention.cache). Prompts of different
lengths are left-padded into one batch; each row's positions count from its first real token
and padding is never attended, so a row decodes the same tokens alone or in a batch.

Shapes: B batch, T tokens, V vocab size.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral

import torch

from lm.generation.compiled import check_compile_mode, compiled_functions
from lm.model.generation_cache import GenerationCache
from lm.model.transformer import Transformer
from lm.util.checks import as_list, require_bool, require_in_interval, require_int, require_seed
from lm.util.errors import GenerationError

IDS = "give a list of token-id lists or a (B, T) LongTensor"


def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x times a positive Python float that float32 may round to 0 or to inf: zeros stay zero and
    infinities stay what they are (0 x inf and inf x 0 would be NaN)."""
    return torch.where((x == 0) | x.isinf(), x, x * factor)


@dataclass
class Sampling:
    """How the next token is picked from the logits. temperature 0 is greedy."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def __post_init__(self) -> None:
        require_in_interval("temperature", self.temperature, 0, math.inf, open_high=True, error=GenerationError)
        if self.top_k is not None:
            require_int("top_k", self.top_k, 1, error=GenerationError)  # above the vocabulary: no filter
        if self.top_p is not None:
            require_in_interval("top_p", self.top_p, 0, 1, open_low=True, error=GenerationError)
        if self.min_p is not None:
            require_in_interval("min_p", self.min_p, 0, 1, error=GenerationError)
        if self.repetition_penalty is not None:
            require_in_interval("repetition_penalty", self.repetition_penalty, 0, math.inf, open_low=True,
                                open_high=True, error=GenerationError)

    def pick(self, logits: torch.Tensor, seen: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Next ids (B,) from logits (B, V); `seen` (B, V) marks tokens already in each row."""
        if self.temperature == 0:
            return self.shifted_scores(logits.float(), seen).argmax(dim=-1)
        return torch.multinomial(self.distribution(logits, seen), 1, generator=generator)[:, 0]

    def distribution(self, logits: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """(B, V) probabilities of the next token, for a temperature above 0.

        The scores are shifted so each row's best is exactly 0 and scaled with `scaled`, so every
        accepted value gives its limit rather than NaN: a temperature of 1e-300 is greedy, one of
        1e300 uniform, and a penalty of 1e300 leaves a seen token with a negative logit no chance."""
        scores = scaled(self.shifted_scores(logits.float(), seen), 1 / self.temperature)  # (B, V), best at 0
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, dim=-1).values[:, -1:]  # (B, 1)
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = scores.softmax(dim=-1)  # each row's best adds exp(0) = 1 to its sum: never 0/0
        if self.min_p is not None:
            # Keep tokens at least min_p times as likely as the most likely one (Nguyen et al. 2024).
            probs = probs.masked_fill(probs < self.min_p * probs.max(dim=-1, keepdim=True).values, 0)
        if self.top_p is not None and self.top_p < 1:
            # Nucleus (Holtzman et al. 2020): the smallest set whose mass reaches top_p.
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (B, V)
            drop = mass_before >= self.top_p
            drop[:, 0] = False  # the most likely token stays, also for a top_p float32 rounds to 0
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(drop, 0))
        return probs / probs.sum(dim=-1, keepdim=True)

    def shifted_scores(self, logits: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """(B, V) logits after the repetition penalty, minus each row's best: all <= 0, the best 0."""
        p = self.repetition_penalty
        if p is None or p == 1:
            return logits - logits.max(dim=-1, keepdim=True).values
        # CTRL (Keskar et al. 2019): a token already present has its logit divided by p if positive,
        # multiplied by p if not. An extreme p pushes those products out of float32, so each group of
        # tokens sharing a factor is shifted by its own best logit before it is scaled, and only the
        # groups' scaled bests are compared (at most one of them is +inf: the boosted one, p < 1).
        groups = [(~seen, 1.0), (seen & (logits > 0), 1 / p), (seen & (logits <= 0), p)]
        tops = [logits.masked_fill(~members, float("-inf")).amax(dim=-1, keepdim=True) for members, _ in groups]
        bests = [scaled(top, factor) for top, (_, factor) in zip(tops, groups, strict=True)]  # (B, 1) each
        row_best = torch.cat(bests, dim=-1).amax(dim=-1, keepdim=True)  # (B, 1)
        out = torch.zeros_like(logits)
        for (members, factor), top, best in zip(groups, tops, bests, strict=True):
            offset = torch.where(best == row_best, 0.0, best - row_best)  # (B, 1): inf - inf would be NaN
            out = torch.where(members, scaled(logits - top, factor) + offset, out)
        return out


def check_model(model) -> None:
    """An lm Transformer; what lm.load returns whole is the likeliest thing passed instead."""
    if isinstance(model, Transformer):
        return
    if isinstance(model, tuple) and model and isinstance(model[0], Transformer):
        raise GenerationError("model is a tuple: lm.load returns (model, tokenizer): pass the model "
                              "(model, tokenizer = lm.load(path))")
    what = "None" if model is None else f"a {type(model).__name__}"
    raise GenerationError(f"model is {what}, not an lm Transformer: pass the model lm.load returns")


def check_settings(max_new_tokens, stop, seed, truncate, use_cache, compile, compile_mode="default") -> list[str]:
    """The settings that need no model, checked alike for lm.generate/stream and for
    scripts/generate.py (before it loads the checkpoint); the stop strings as a list."""
    require_int("max_new_tokens", max_new_tokens, 0, error=GenerationError)
    require_seed("seed", seed, GenerationError)
    require_bool("use_cache", use_cache, GenerationError)
    require_bool("compile", compile, GenerationError)
    check_compile_mode(compile_mode, compile)
    if truncate not in (None, "left"):
        raise GenerationError(f"truncate={truncate!r} must be null or 'left'")
    if compile and not use_cache:
        raise GenerationError("compile=true compiles the cached decoding step: it needs use_cache=true")
    return stop_strings(stop)


def stop_strings(stop) -> list[str]:
    """The stop strings as a list; a bare string is one stop string, never its characters."""
    strings = as_list("stop", stop, GenerationError)
    for s in strings:
        if not isinstance(s, str):
            raise GenerationError(f"stop holds {s!r}, which is not a string")
    if not all(strings):
        raise GenerationError("stop=[...] holds an empty string, which would stop before the first token")
    return strings


def as_prompt_lists(idx, vocab_size: int | None = None) -> list[list[int]]:
    """A (B, T) integer tensor or a list of token-id lists as a list of lists, each non-empty and,
    given vocab_size, of ids the model has. A flat list of ints is refused rather than read as one
    prompt: the rows come back as a list of lists, which a caller of a flat list would misread."""
    if isinstance(idx, torch.Tensor):
        if idx.dim() != 2:
            raise GenerationError(f"idx of shape {tuple(idx.shape)} must be (B, T): {IDS}")
        if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            raise GenerationError(f"idx is a {idx.dtype} tensor, not token ids: {IDS}")
        prompts = idx.tolist()
    elif isinstance(idx, (str, bytes)):
        raise GenerationError(f"idx={idx!r:.40} is text: encode it (tokenizer.encode(text).ids), then {IDS}")
    elif idx is None or isinstance(idx, Mapping) or not isinstance(idx, Iterable):
        raise GenerationError(f"idx is {'None' if idx is None else 'a ' + type(idx).__name__}: {IDS}")
    else:
        prompts = [prompt_ids(i, p) for i, p in enumerate(idx)]
    if not prompts:
        raise GenerationError(f"no prompt given: {IDS}")
    for i, p in enumerate(prompts):
        if not p:
            raise GenerationError(f"prompt {i} is empty: give at least one token")
        outside = [t for t in p if vocab_size is not None and not 0 <= t < vocab_size]
        if outside:
            raise GenerationError(f"prompt {i} holds token id {outside[0]}, outside the model's vocabulary "
                                  f"(vocab_size={vocab_size}: ids 0 to {vocab_size - 1})")
    return prompts


def prompt_ids(i: int, prompt) -> list[int]:
    """Prompt i of a list as plain ints."""
    if isinstance(prompt, Integral):
        raise GenerationError(f"idx is a flat list of ints: {IDS} ([[1, 2, 3]] for one prompt)")
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
            raise GenerationError(f"prompt {i} is a {prompt.dtype} tensor of shape {tuple(prompt.shape)}, "
                                  f"not a row of token ids: {IDS}")
        return prompt.tolist()
    if isinstance(prompt, (str, bytes, Mapping)) or not isinstance(prompt, Iterable):
        raise GenerationError(f"prompt {i} is a {type(prompt).__name__}, not a list of token ids: {IDS}")
    ids = list(prompt)
    for t in ids:
        if not isinstance(t, Integral) or isinstance(t, bool):
            raise GenerationError(f"prompt {i} holds {t!r:.40}, not a token id (an int): {IDS}")
    return [int(t) for t in ids]


class Generation:
    """One decoding run. Iterate it to get, each step, the new token of every row (None once a
    row has finished); afterwards `tokens` holds prompt + new tokens per row and `stats` the
    timings and cache size."""

    def __init__(self, model: Transformer, idx, max_new_tokens: int, sampling: Sampling,
                 stop: Sequence[str] | None = None, tokenizer=None, eos_id: int | None = None,
                 use_cache: bool = True, seed: int | None = None, truncate: str | None = None,
                 prefill_chunk: int = 1024, compile: bool = False, compile_mode: str = "default"):
        check_model(model)
        stop = check_settings(max_new_tokens, stop, seed, truncate, use_cache, compile, compile_mode)
        if stop and tokenizer is None:
            raise GenerationError("stop strings need the tokenizer to read the text: pass tokenizer=")
        if not isinstance(sampling, Sampling):
            raise GenerationError(f"sampling is a {type(sampling).__name__}, not a Sampling")
        V = model.config.vocab_size
        if eos_id is not None:
            require_int("eos_id", eos_id, 0, V - 1, error=GenerationError)
        require_int("prefill_chunk", prefill_chunk, 1, error=GenerationError)
        self.model, self.sampling, self.max_new_tokens = model, sampling, max_new_tokens
        self.stop, self.tokenizer, self.eos_id = stop, tokenizer, eos_id
        self.use_cache, self.prefill_chunk = use_cache, prefill_chunk
        self.device = next(model.parameters()).device
        self.prompts = self._fit_context(as_prompt_lists(idx, V), truncate)
        self.tokens = [list(p) for p in self.prompts]
        self.generator = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
        self.stats: dict = {"prompt_tokens": sum(map(len, self.prompts)), "new_tokens": 0, "cache_bytes": 0}
        self.cache: GenerationCache | None = None
        self.compiled = compile
        eager = (model, model.decode_step)
        self.prefill_fn, self.step_fn = compiled_functions(model, compile_mode) if compile else eager

    def _fit_context(self, prompts: list[list[int]], truncate: str | None) -> list[list[int]]:
        """Full-attention models cannot look past max_seq_len: refuse, or drop the oldest tokens."""
        if not self.model.context_limited:
            return prompts
        limit = self.model.config.max_seq_len
        longest = max(map(len, prompts))
        if longest + self.max_new_tokens <= limit:
            return prompts
        if truncate != "left":
            raise GenerationError(
                f"prompt of {longest} tokens + max_new_tokens={self.max_new_tokens} exceeds the model's context of "
                f"{limit} (max_seq_len, full attention); shorten them or pass truncate=left"
            )
        room = limit - self.max_new_tokens
        if room < 1:
            raise GenerationError(f"max_new_tokens={self.max_new_tokens} leaves no room for a prompt in "
                                  f"the model's context of {limit}")
        return [p[-room:] for p in prompts]

    @torch.no_grad()
    def __iter__(self) -> Iterator[list[int | None]]:
        B, V = len(self.prompts), self.model.config.vocab_size
        seen = torch.zeros(B, V, dtype=torch.bool, device=self.device)
        for row, p in enumerate(self.prompts):
            seen[row, torch.tensor(p, device=self.device)] = True
        done = [False] * B
        started = time.perf_counter()
        logits = self._prefill() if self.use_cache else self._recompute(done)
        self.stats["prefill_s"] = time.perf_counter() - started
        started = time.perf_counter()
        for step in range(self.max_new_tokens):
            next_ids = self.sampling.pick(logits, seen, self.generator)  # (B,)
            seen[torch.arange(B, device=self.device), next_ids] = True
            out: list[int | None] = []
            for row, token in enumerate(next_ids.tolist()):
                if done[row] or token == self.eos_id:
                    done[row] = True
                    out.append(None)
                    continue
                self.tokens[row].append(token)
                self.stats["new_tokens"] += 1
                done[row] = self._hit_stop(row)
                out.append(token)
            yield out
            if all(done) or step == self.max_new_tokens - 1:
                break
            logits = self._decode(next_ids) if self.use_cache else self._recompute(done)
        self.stats["decode_s"] = time.perf_counter() - started
        if self.cache is not None:
            self.stats["cache_bytes"] = self.cache.nbytes()

    def _prefill(self) -> torch.Tensor:
        """Left-pad the prompts into one batch and run them through the caches in chunks."""
        lengths = torch.tensor([len(p) for p in self.prompts], device=self.device)
        width = int(lengths.max())
        batch = torch.zeros(len(self.prompts), width, dtype=torch.long, device=self.device)
        for row, p in enumerate(self.prompts):
            batch[row, width - len(p):] = torch.tensor(p, device=self.device)
        # Kinds with a context limit preallocate max_len slots, which _fit_context keeps within max_seq_len;
        # the others hold a state of fixed size, so max_new_tokens may be any size.
        self.cache = GenerationCache(self.model, pad=width - lengths, max_len=width + self.max_new_tokens)
        no_step = sorted({type(c).__name__ for c in self.cache.layers if not hasattr(c, "decode")})
        if no_step and self.compiled:
            raise GenerationError(f"compile=true needs every layer's cache to have decode(..., pos); {no_step} "
                                  "have only attend")
        for start in range(0, width, self.prefill_chunk):
            # Only the first chunk through the compiled prefill: the cache's fill level is a constant of
            # the compiled graph, so every later chunk would compile anew (seconds each) for one use.
            prefill = self.prefill_fn if start == 0 else self.model
            logits = prefill(batch[:, start:start + self.prefill_chunk], cache=self.cache)
        return logits[:, -1]  # (B, V)

    def _decode(self, next_ids: torch.Tensor) -> torch.Tensor:
        """One token per row through the fixed-shape step (lm.attention.cache), compiled or not."""
        # Each row's next slot, moved on in place by advance: the step takes it without a host sync, as a
        # tensor of its own (a CUDA graph copies it in).
        pos = self.cache.lengths.clone()
        first = "first_step_s" not in self.stats
        started = time.perf_counter()
        logits = self.step_fn(next_ids[:, None], self.cache, pos)  # (B, V)
        if first:  # with compile=true, mostly compilation
            self.stats["first_step_s"] = time.perf_counter() - started
        self.cache.advance(1)
        return logits

    def _recompute(self, done: list[bool]) -> torch.Tensor:
        """The reference path: each row's whole sequence through the plain forward, every step."""
        rows = []
        for row, tokens in enumerate(self.tokens):
            if done[row]:
                rows.append(torch.zeros(self.model.config.vocab_size, device=self.device))
            else:
                rows.append(self.model(torch.tensor([tokens], device=self.device))[0, -1])
        return torch.stack(rows)  # (B, V)

    def _hit_stop(self, row: int) -> bool:
        if not self.stop:
            return False
        new = self.tokens[row][len(self.prompts[row]):]
        # A stop string that just appeared ends within the last len(stop) tokens (a token is
        # at least one byte), so only that tail needs decoding each step.
        tail = self.tokenizer.decode(new[-(max(map(len, self.stop)) + 2):])
        return any(s in tail for s in self.stop)


def stream(model: Transformer, idx, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None, min_p: float | None = None, repetition_penalty: float | None = None,
           stop: Sequence[str] | None = None, use_cache: bool = True, seed: int | None = None,
           tokenizer=None, eos_id: int | None = None, truncate: str | None = None,
           compile: bool = False, compile_mode: str = "default") -> Generation:
    """A Generation to iterate: each step yields every row's new token (None once it has finished)."""
    sampling = Sampling(temperature, top_k, top_p, min_p, repetition_penalty)
    return Generation(model, idx, max_new_tokens, sampling, stop=stop, tokenizer=tokenizer, eos_id=eos_id,
                      use_cache=use_cache, seed=seed, truncate=truncate, compile=compile,
                      compile_mode=compile_mode)


def generate(model: Transformer, idx, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, min_p: float | None = None, repetition_penalty: float | None = None,
             stop: Sequence[str] | None = None, use_cache: bool = True, seed: int | None = None,
             tokenizer=None, eos_id: int | None = None, truncate: str | None = None,
             compile: bool = False, compile_mode: str = "default") -> list[list[int]]:
    """Token ids of each row, prompt followed by up to max_new_tokens new tokens.

    idx is a (B, T) tensor or a list of token-id lists of different lengths. A row ends early
    at `eos_id` (not included) or once its text contains a `stop` string (needs `tokenizer`).
    `use_cache=False` recomputes each row's whole sequence every step (the reference path).
    `compile=True` runs the one-token step, and on the CPU the prefill, through torch.compile (the
    first call compiles: seconds to minutes; `stream(...).stats["first_step_s"]` says how long);
    `compile_mode="max-autotune"` compiles the step with frozen weights and inductor's autotuned GEMMs on
    the CPU (lm.generation.compiled: faster steps, a longer first call).
    """
    run = stream(model, idx, max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty, stop,
                 use_cache, seed, tokenizer, eos_id, truncate, compile, compile_mode)
    for _ in run:
        pass
    return run.tokens
