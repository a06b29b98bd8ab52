"""An lm-evaluation-harness model for any lm checkpoint, of any attention kind, as `--model lm`.

    python scripts/harness.py --model lm --model_args ckpt=checkpoints/<run>/last.ckpt --tasks ...

The harness's own TemplateLM splits each (context, continuation) the way its `hf` model does
(encode both together, cut at the context's length, trailing spaces moved to the continuation),
so an exported Llama folder scored through `hf` and the checkpoint scored here see the same
tokens. Scoring runs batches of right-padded sequences through the plain forward (padding after
a sequence cannot change its causal logits); rolling log-likelihoods use the harness's own
windows; generation goes through lm's cached decoding with the task's stop strings.

Shapes: B batch, T tokens, V vocab size.
"""

from __future__ import annotations

import lm_eval.models  # noqa: F401  (the harness's own models first: it skips them once its registry is non-empty)
import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from lm.data.tokenizer import EOT
from lm.formats.checkpoint import load
from lm.generation.decode import Generation, Sampling
from lm.util.paths import resolve_path


@register_model("lm")
class HarnessModel(TemplateLM):
    def __init__(self, ckpt: str, device: str = "cpu", batch_size: int | str = 8, max_gen_toks: int = 256,
                 **_ignored):
        super().__init__()
        self.model, self.tokenizer = load(resolve_path(ckpt), device=device)
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8  # "auto" -> a fixed batch
        self.max_gen_toks = int(max_gen_toks)
        self._device = torch.device(device)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.token_to_id(EOT)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string).ids

    def _context_limit(self) -> int | None:
        return self.model.config.max_seq_len + 1 if self.model.context_limited else None

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = []
        limit = self._context_limit()
        for first in tqdm(range(0, len(requests), self.batch_size), desc="loglikelihood", disable=disable_tqdm):
            chunk = requests[first:first + self.batch_size]
            # The continuation whole, the context cut from the left when the model's window is full.
            sequences = [(ctx + cont)[-limit:] if limit else ctx + cont for _, ctx, cont in chunk]
            width = max(map(len, sequences))
            batch = torch.tensor([s + [0] * (width - len(s)) for s in sequences], device=self.device)  # (B, width)
            logprobs = F.log_softmax(self.model(batch[:, :-1]).float(), dim=-1)  # (B, width - 1, V)
            for row, (sequence, (_, _, cont)) in enumerate(zip(sequences, chunk, strict=True)):
                n = len(cont)
                positions = torch.arange(len(sequence) - 1 - n, len(sequence) - 1, device=self.device)
                picked = logprobs[row, positions]  # (n, V): the predictions of the continuation's tokens
                target = torch.tensor(cont, device=self.device)
                results.append((float(picked.gather(1, target[:, None]).sum()),
                                bool((picked.argmax(-1) == target).all())))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document on its own, after <|endoftext|>, cut into the harness's own rolling windows of
        max_seq_len predictions (the last one with as much earlier context as fits), as its `hf` model does."""
        out = []
        for request in tqdm(requests, desc="loglikelihood_rolling", disable=disable_tqdm):
            (text,) = request.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.model.config.max_seq_len, context_len=1)]
            scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows], disable_tqdm=True)
            out.append(sum(logprob for logprob, _ in scores))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for request in tqdm(requests, desc="generate_until", disable=disable_tqdm):
            context, gen_kwargs = request.args
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            if self.model.context_limited:  # leave room for at least one token of context
                max_new = min(max_new, self.model.config.max_seq_len - 1)
            sampling = Sampling(temperature=float(gen_kwargs.get("temperature", 0.0)))
            ids = self.tok_encode(context) or [self.eot_token_id]
            run = Generation(self.model, [ids], max_new, sampling, stop=until, tokenizer=self.tokenizer,
                             eos_id=self.eot_token_id, truncate="left" if self.model.context_limited else None)
            for _ in run:
                pass
            text = self.tokenizer.decode(run.tokens[0][len(run.prompts[0]):])
            cuts = [text.find(s) for s in until if s in text]
            out.append(text[: min(cuts)] if cuts else text)
        return out
