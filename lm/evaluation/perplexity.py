"""Perplexity and bits per byte of a model on a corpus: what scripts/eval.py runs.

The documents of the chosen split are tokenized with the *model's* tokenizer and joined into one
stream, each preceded by <|endoftext|> as in training. The stream is scored in windows of
max_seq_len + 1 tokens that overlap by one, so every token after the first is predicted exactly
once, from the window's earlier tokens. The <|endoftext|> targets are left out, so

    perplexity    = exp(sum of -log p(token) / number of document tokens)
    bits per byte = sum of -log2 p(token) / number of UTF-8 bytes of the documents

Bits per byte does not depend on the tokenizer, which makes models with different vocabularies
comparable; perplexity does.

The JSON record goes to `out`, or else beside the checkpoint as eval-<corpus>-<split>.json: in the
run folder for a training checkpoint (or a run folder given as ckpt), and next to an exported or
transformers folder as <folder>.eval-<corpus>-<split>.json, so the folder stays exactly what the
export wrote.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from lm.config.eval import SPLITS, EvalRun
from lm.data.corpora import Corpus, is_validation
from lm.data.recall_task import IGNORE
from lm.data.tokenizer import EOT
from lm.model.transformer import Transformer
from lm.training.scoring import evaluate_loss
from lm.util.errors import DataError


@dataclass
class Score:
    tokens: int  # document tokens scored
    bytes: int  # UTF-8 bytes of the documents
    nll_nats: float  # summed -log p over those tokens
    documents: int

    @property
    def loss(self) -> float:
        return self.nll_nats / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def bits_per_byte(self) -> float:
        return self.nll_nats / math.log(2) / self.bytes

    def record(self) -> dict:
        return {**asdict(self), "loss": self.loss, "perplexity": self.perplexity, "bits_per_byte": self.bits_per_byte}


def split_documents(corpus: Corpus, split: str, val_fraction: float) -> Iterator[str]:
    """The texts of one split, chosen by the same hash of the document id that training uses."""
    if split not in SPLITS:
        raise DataError(f"split={split!r} is not one of {list(SPLITS)}")
    for doc_id, text in corpus.documents():
        if split == "all" or is_validation(doc_id, val_fraction) == (split == "val"):
            yield text


def token_stream(texts: Iterator[str], tokenizer: Tokenizer) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(ids (N,), is_document_token (N,) bool, bytes, documents) of the texts joined as in training."""
    eot = tokenizer.token_to_id(EOT)
    if eot is None:
        raise DataError(f"the model's tokenizer has no {EOT} token to separate documents")
    ids, counted, n_bytes, documents = [], [], 0, 0
    for text in texts:
        doc = tokenizer.encode(text).ids
        ids += [eot, *doc]
        counted += [False] + [True] * len(doc)
        n_bytes += len(text.encode("utf-8"))
        documents += 1
    if documents == 0 or n_bytes == 0:
        raise DataError("the chosen split holds no text to score")
    return torch.tensor(ids), torch.tensor(counted), n_bytes, documents


def scoring_windows(ids: torch.Tensor, counted: torch.Tensor, T: int, batch_size: int
                    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches (inputs, targets) of windows of T + 1 tokens that overlap by one, so every token
    after the first is a target exactly once; targets that do not count (<|endoftext|>, the
    padding of a short last window) are IGNORE."""
    starts = list(range(0, len(ids) - 1, T))
    for first in range(0, len(starts), batch_size):
        chosen = starts[first:first + batch_size]
        windows = [ids[s:s + T + 1] for s in chosen]
        width = max(len(w) for w in windows)
        batch = torch.stack([F.pad(w, (0, width - len(w))) for w in windows])  # (b, width)
        # (b, width - 1): whether each target counts, a short window's padding never
        weight = torch.stack([F.pad(counted[s + 1:s + T + 1], (0, width - len(w)))
                              for s, w in zip(chosen, windows, strict=True)])
        yield batch[:, :-1], batch[:, 1:].masked_fill(~weight, IGNORE)


def score(model: Transformer, ids: torch.Tensor, counted: torch.Tensor, n_bytes: int, documents: int,
          batch_size: int = 8, progress: bool = True) -> Score:
    """Sum of -log p over the counted tokens of the stream, in windows of max_seq_len + 1."""
    T = model.config.max_seq_len
    batches = scoring_windows(ids, counted, T, batch_size)
    total_batches = math.ceil(math.ceil((len(ids) - 1) / T) / batch_size)
    shown = tqdm(batches, total=total_batches, desc="scoring", unit="batch", disable=not progress)
    totals = evaluate_loss(model, shown)
    return Score(tokens=totals.targets, bytes=n_bytes, nll_nats=totals.nll, documents=documents)


def default_record_path(ckpt: Path, corpus_name: str, split: str) -> Path:
    """Where the record goes without `out`: see the module's docstring."""
    from lm.formats.checkpoint import checkpoint_file

    name = f"eval-{corpus_name.replace(':', '_').replace('/', '_')}-{split}.json"
    resolved = checkpoint_file(ckpt)  # a run folder stands for its last.ckpt
    if resolved.is_dir():  # an export is copied or uploaded whole: a record inside would travel with it
        folder = resolved.resolve()
        return folder.parent / f"{folder.name}.{name}"
    return resolved.parent / name


def evaluate(run: EvalRun) -> dict:
    """What scripts/eval.py runs (its settings checked as they were built): load, score, print one line,
    write the JSON record."""
    import json

    from lm.data.corpora import build_corpus
    from lm.formats.checkpoint import load
    from lm.util.checks import check_device
    from lm.util.files import write_atomically
    from lm.util.paths import resolve_path

    if run.data.source == "mqar":
        raise DataError("data=mqar has no text to score: eval.py scores a text corpus (data=pystdlib, text or hf); "
                        "recall on data=mqar is measured by training (train.py data=mqar reports val/accuracy) and "
                        "by compare.py")
    val_fraction = run.data.val_fraction
    check_device(run.device)
    corpus = build_corpus(run.data)  # lists the files only: a data.paths mistake is refused before loading
    path = resolve_path(run.ckpt)
    model, tokenizer = load(path, device=run.device)
    texts = split_documents(corpus, run.split, float(val_fraction))
    result = score(model, *token_stream(texts, tokenizer), batch_size=run.batch_size, progress=run.progress_bar)
    if not math.isfinite(result.loss):  # weights that overflow in fp32: no number to report
        raise DataError(f"the loss on {corpus.name} is {result.loss}: the model's outputs overflow, so there is "
                        "no perplexity to write")
    record = {"checkpoint": str(path), "corpus": corpus.name, "split": run.split, **result.record()}
    out = resolve_path(run.out) if run.out else default_record_path(path, corpus.name, run.split)
    write_atomically(out, lambda tmp: tmp.write_text(json.dumps(record, indent=2) + "\n"))
    print(f"{corpus.name} {run.split}: {result.tokens:,} tokens, {result.bytes:,} bytes, loss {result.loss:.4f}, "
          f"perplexity {result.perplexity:.2f}, {result.bits_per_byte:.4f} bits per byte -> {out}")
    return record
