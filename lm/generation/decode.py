"""Decoding: prefill the prompts through the model's caches, then sample one token per step.

Attention-agnostic: every layer brings its own cache (lm.attention.cache). Prompts of different
lengths are left-padded into one batch; each row's positions count from its first real token
and padding is never attended, so a row decodes the same tokens alone or in a batch.

Shapes: B batch, T tokens, V vocab size.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from lm.attention.cache import GenerationCache
from lm.model.transformer import Transformer
from lm.util.errors import GenerationError


@dataclass
class Sampling:
    """How the next token is picked from the logits. temperature 0 is greedy."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0 <= self.temperature < math.inf:
            raise GenerationError(f"temperature={self.temperature!r} must be a finite number >= 0")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise GenerationError(f"top_k={self.top_k!r} must be an integer >= 1")
        if self.top_p is not None and (not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1):
            raise GenerationError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.min_p is not None and (not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1):
            raise GenerationError(f"min_p={self.min_p!r} must be in [0, 1]")
        if self.repetition_penalty is not None and (not isinstance(self.repetition_penalty, (int, float))
                                                    or not 0 < self.repetition_penalty < math.inf):
            raise GenerationError(f"repetition_penalty={self.repetition_penalty!r} must be > 0")

    def pick(self, logits: torch.Tensor, seen: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Next ids (B,) from logits (B, V); `seen` (B, V) marks tokens already in each row."""
        logits = logits.float()
        if self.repetition_penalty is not None and self.repetition_penalty != 1.0:
            # CTRL (Keskar et al. 2019): make every token already present less likely.
            penalised = torch.where(logits > 0, logits / self.repetition_penalty, logits * self.repetition_penalty)
            logits = torch.where(seen, penalised, logits)
        if self.temperature == 0:
            return logits.argmax(dim=-1)
        logits = logits / self.temperature
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[:, -1:]  # (B, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(dim=-1)
        if self.min_p is not None:
            # Keep tokens at least min_p times as likely as the most likely one (Nguyen et al. 2024).
            probs = probs.masked_fill(probs < self.min_p * probs.max(dim=-1, keepdim=True).values, 0)
        if self.top_p is not None and self.top_p < 1:
            # Nucleus (Holtzman et al. 2020): the smallest set whose mass reaches top_p.
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (B, V)
            sorted_probs = sorted_probs.masked_fill(mass_before >= self.top_p, 0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]


def as_prompt_lists(idx) -> list[list[int]]:
    """A (B, T) tensor or a list of token-id lists as a list of lists, each non-empty."""
    if isinstance(idx, torch.Tensor):
        if idx.dim() != 2:
            raise GenerationError(f"idx of shape {tuple(idx.shape)} must be (B, T)")
        prompts = idx.tolist()
    else:
        prompts = [list(map(int, p)) for p in idx]
    if not prompts:
        raise GenerationError("no prompt given")
    for i, p in enumerate(prompts):
        if not p:
            raise GenerationError(f"prompt {i} is empty: give at least one token")
    return prompts


class Generation:
    """One decoding run. Iterate it to get, each step, the new token of every row (None once a
    row has finished); afterwards `tokens` holds prompt + new tokens per row and `stats` the
    timings and cache size."""

    def __init__(self, model: Transformer, idx, max_new_tokens: int, sampling: Sampling,
                 stop: Sequence[str] | None = None, tokenizer=None, eos_id: int | None = None,
                 use_cache: bool = True, seed: int | None = None, truncate: str | None = None,
                 prefill_chunk: int = 1024, compile: bool = False):
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
        if stop and tokenizer is None:
            raise GenerationError("stop strings need the tokenizer to read the text: pass tokenizer=")
        if truncate not in (None, "left"):
            raise GenerationError(f"truncate={truncate!r} must be null or 'left'")
        if not isinstance(compile, bool):
            raise GenerationError(f"compile={compile!r} must be true or false")
        if compile and not use_cache:
            raise GenerationError("compile=true compiles the cached decoding step: it needs use_cache=true")
        self.model, self.sampling, self.max_new_tokens = model, sampling, max_new_tokens
        self.stop, self.tokenizer, self.eos_id = list(stop or []), tokenizer, eos_id
        self.use_cache, self.prefill_chunk = use_cache, prefill_chunk
        self.device = next(model.parameters()).device
        self.prompts = self._fit_context(as_prompt_lists(idx), truncate)
        self.tokens = [list(p) for p in self.prompts]
        self.generator = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
        self.stats: dict = {"prompt_tokens": sum(map(len, self.prompts)), "new_tokens": 0, "cache_bytes": 0}
        self.cache: GenerationCache | None = None
        self.compiled = compile
        self.prefill_fn, self.step_fn = compiled_functions(model) if compile else (model, model.decode_step)

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
            seen[row, torch.tensor(p, device=self.device).clamp(max=V - 1)] = True
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
        self.cache = GenerationCache(self.model, pad=width - lengths, max_len=width + self.max_new_tokens)
        no_step = sorted({type(c).__name__ for c in self.cache.layers if not hasattr(c, "decode")})
        if no_step and self.compiled:
            raise GenerationError(f"compile=true needs every layer's cache to have decode(q, k, v, pos); {no_step} "
                                  "have only attend")
        for start in range(0, width, self.prefill_chunk):
            logits = self.prefill_fn(batch[:, start:start + self.prefill_chunk], cache=self.cache)
        return logits[:, -1]  # (B, V)

    def _decode(self, next_ids: torch.Tensor) -> torch.Tensor:
        """One token per row through the fixed-shape step (lm.attention.cache), compiled or not."""
        pos = self.cache.slots[self.cache.seen].clone()  # a 0-dim tensor of its own, never synced: the step's input
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


def compiled_functions(model: Transformer):
    """(prefill, step) compiled: the one-token step as one graph with no breaks (fullgraph), and on
    CUDA captured as a CUDA graph ("reduce-overhead"); the prefill separately, with static shapes:
    each prompt width compiles once (symbolic chunk counts break inductor's views in the chunkwise
    kinds), and past torch's recompile limit a width simply runs eagerly. torch.compile keeps its
    graphs with the code, so later generations of the same shapes reuse them."""
    on_cuda = next(model.parameters()).is_cuda
    step = torch.compile(model.decode_step, fullgraph=True, mode="reduce-overhead" if on_cuda else None)
    prefill = torch.compile(model, dynamic=False)
    return prefill, step


def stream(model: Transformer, idx, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None, min_p: float | None = None, repetition_penalty: float | None = None,
           stop: Sequence[str] | None = None, use_cache: bool = True, seed: int | None = None,
           tokenizer=None, eos_id: int | None = None, truncate: str | None = None,
           compile: bool = False) -> Generation:
    """A Generation to iterate: each step yields every row's new token (None once it has finished)."""
    sampling = Sampling(temperature, top_k, top_p, min_p, repetition_penalty)
    return Generation(model, idx, max_new_tokens, sampling, stop=stop, tokenizer=tokenizer, eos_id=eos_id,
                      use_cache=use_cache, seed=seed, truncate=truncate, compile=compile)


def generate(model: Transformer, idx, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, min_p: float | None = None, repetition_penalty: float | None = None,
             stop: Sequence[str] | None = None, use_cache: bool = True, seed: int | None = None,
             tokenizer=None, eos_id: int | None = None, truncate: str | None = None,
             compile: bool = False) -> list[list[int]]:
    """Token ids of each row, prompt followed by up to max_new_tokens new tokens.

    idx is a (B, T) tensor or a list of token-id lists of different lengths. A row ends early
    at `eos_id` (not included) or once its text contains a `stop` string (needs `tokenizer`).
    `use_cache=False` recomputes each row's whole sequence every step (the reference path).
    `compile=True` runs the prefill and the one-token step through torch.compile (the first call
    compiles: seconds to minutes; `stream(...).stats["first_step_s"]` says how long).
    """
    run = stream(model, idx, max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty, stop,
                 use_cache, seed, tokenizer, eos_id, truncate, compile)
    for _ in run:
        pass
    return run.tokens
