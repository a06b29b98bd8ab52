"""Continuous batching: one decoding loop over a fixed number of rows, requests joining and leaving
row by row.

The engine owns one GenerationCache of `max_batch` rows and runs its loop on a thread of its own:

1. it admits waiting requests into free rows: `cache.prefill_row(row, prompt)` runs a prompt through a
   fresh single-row cache and copies it into the row while the other rows keep their state (the
   attention contract's row operations, so no kind needs code here); the prompt's last logits give
   the request's first token;
2. it runs one decoding step over every row (`model.decode_step`, fixed shapes, so one compiled graph
   serves every step), each row at its own slot (`cache.lengths`);
3. it picks each running request's next token with that request's own sampling, hands the request its
   newly settled text, and frees the row of a request that has finished or was cancelled.

A request joins at the step after its prefill and leaves as soon as it ends, so a long generation
never holds a short one back. Free rows ride along in the step (the shapes stay fixed); what they
hold is never read, and an admission replaces it whole.

Requests reach the engine from other threads (`submit`); what the engine produces for a request goes
to the request's `sink`, a callable taking each event, called on the engine's thread.

Shapes: B max_batch rows, T prompt tokens, V vocab size.
"""

from __future__ import annotations

import collections
import itertools
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from lm.generation.compiled import compiled_step
from lm.generation.decode import Sampling
from lm.generation.text import StreamedText
from lm.model.generation_cache import GenerationCache
from lm.model.transformer import Transformer

GREEDY = Sampling()


class Metrics(Protocol):
    """What the engine reports (lm.serving.metrics.ServingMetrics), called on its thread."""

    def first_token(self, seconds: float) -> None: ...

    def token_gap(self, seconds: float) -> None: ...

    def finished(self, prompt_tokens: int, generated_tokens: int) -> None: ...


@dataclass(frozen=True)
class Completion:
    """What one request asks for: a continuation of `prompt` (token ids) of at most `max_tokens`
    tokens, ending early at the end-of-text token or once its text holds a `stop` string."""

    prompt: list[int]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)  # greedy
    stop: Sequence[str] = ()
    seed: int | None = None


@dataclass(frozen=True)
class Piece:
    """Newly settled text of a running request."""

    text: str


@dataclass(frozen=True)
class Finished:
    """A request's end. reason: "stop" (end of text or a stop string), "length" (max_tokens) or
    "cancelled"; `tokens` the new token ids, `text` their whole text, cut before a stop string."""

    reason: str
    prompt_tokens: int
    tokens: list[int]
    text: str


@dataclass(frozen=True)
class Failed:
    """The request could not be decoded: an error inside the model (500; the engine goes on serving), or
    the server shutting down before it finished (503)."""

    message: str
    status: int = 500
    code: str | None = None  # OpenAI's error code: shutting_down for a 503


Event = Piece | Finished | Failed


class Busy(Exception):
    """Every row is taken and the waiting queue is full."""


class NeverFits(ValueError):
    """More completions in one request than the rows and the queue hold together: waiting frees nothing."""


class Ticket:
    """A submitted request: what it asks for, where its events go, and a way to withdraw it."""

    _ids = itertools.count()

    def __init__(self, completion: Completion, sink: Callable[[Event], None]):
        self.completion, self.sink = completion, sink
        self.id = next(self._ids)
        self.cancelled = threading.Event()
        self.submitted_at = time.perf_counter()

    def cancel(self) -> None:
        """Withdraw the request: a waiting one is never admitted, a running one frees its row at the next step."""
        self.cancelled.set()

    def send(self, event: Event) -> None:
        try:
            self.sink(event)
        except Exception:  # the receiver is gone (its event loop closed): nobody waits for the rest
            self.cancelled.set()


@dataclass
class Running:
    """A request in a row: the tokens it has so far and the text it has been given."""

    ticket: Ticket
    text: StreamedText
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    last_token_at: float | None = None  # when its last token was picked (None: none yet)


class Engine:
    """Continuous batching over `max_batch` rows of one model. `start()` runs the loop on its own thread;
    `submit` hands it requests from any thread; `stop()` ends it once the running requests have finished."""

    def __init__(self, model: Transformer, tokenizer, max_batch: int, max_queue: int, eos_id: int | None,
                 compile: bool = False, compile_mode: str = "default"):
        self.model, self.tokenizer, self.eos_id = model, tokenizer, eos_id
        self.max_batch, self.max_queue = max_batch, max_queue
        self.device = next(model.parameters()).device
        # Full attention reaches back at most max_seq_len positions, so that is each row's length; the other
        # kinds' caches hold a ring or a state of fixed size and never read max_len.
        self.max_len = model.config.max_seq_len
        self.cache = self._empty_cache()
        self.rows: list[Running | None] = [None] * max_batch
        self.next_ids = [0] * max_batch  # each row's last token: the next step's input
        # What sampling takes as the tokens already seen: none, as requests have no repetition penalty.
        self.unseen = torch.zeros(1, model.config.vocab_size, dtype=torch.bool, device=self.device)
        self.waiting: collections.deque[Ticket] = collections.deque()
        self.lock = threading.Condition()
        self.stopping = False
        self.aborting: str | None = None  # abort's message, once asked: the loop ends every request with it
        self.admitting = 0  # requests taken off the queue whose prefill has not yet put them in a row
        self.thread: threading.Thread | None = None
        # The weights stay as they are while the engine serves, as compile_mode=max-autotune's frozen step needs.
        self.step_fn = compiled_step(model, compile_mode) if compile else model.decode_step
        self.steps = 0
        self.metrics: Metrics | None = None  # report_to: token timings and counts, for /metrics

    def report_to(self, metrics: Metrics) -> Engine:
        """Send each completion's token timings and counts to `metrics` (lm.serving.metrics.ServingMetrics)."""
        self.metrics = metrics
        return self

    def _empty_cache(self) -> GenerationCache:
        pad = torch.zeros(self.max_batch, dtype=torch.long, device=self.device)
        return GenerationCache(self.model, pad=pad, max_len=self.max_len)

    # ------------------------------------------------------------------ the outside: any thread

    def room(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request of this size cannot be decoded, or None when it can."""
        if self.model.context_limited and prompt_tokens + max_tokens > self.max_len:
            return (f"the prompt's {prompt_tokens} tokens + max_tokens={max_tokens} exceed the model's context of "
                    f"{self.max_len} tokens (max_seq_len, full attention)")
        return None

    def submit(self, completions: Sequence[Completion], sink_for: Callable[[int], Callable[[Event], None]]
               ) -> list[Ticket]:
        """Queue the completions as one unit (all or none); `sink_for(i)` receives completion i's events.
        Raises Busy when they do not fit beside the rows taken and the requests already waiting, and
        NeverFits when they would not fit on an idle server either."""
        for c in completions:
            why = self.room(len(c.prompt), c.max_tokens)
            if why:
                raise ValueError(why)
            if not c.prompt:
                raise ValueError("the prompt is empty: give at least one token")
        if len(completions) > self.max_batch + self.max_queue:
            raise NeverFits(f"the request asks for {len(completions)} completions (prompts x n) at once, and this "
                            f"server holds at most {self.max_batch + self.max_queue} ({self.max_batch} slots and a "
                            f"queue of {self.max_queue}): send fewer prompts or a smaller n")
        tickets = [Ticket(c, sink_for(i)) for i, c in enumerate(completions)]
        with self.lock:
            if self.stopping:
                raise Busy("the server is shutting down")
            taken = sum(r is not None for r in self.rows) + len(self.waiting)
            if taken + len(tickets) > self.max_batch + self.max_queue:
                raise Busy(f"all {self.max_batch} slots are busy and {len(self.waiting)} requests are waiting")
            self.waiting.extend(tickets)
            self.lock.notify()
        return tickets

    def load(self) -> dict:
        """Rows in use, requests waiting, and steps run: what /health reports."""
        with self.lock:
            return {"running": sum(r is not None for r in self.rows), "waiting": len(self.waiting),
                    "slots": self.max_batch, "steps": self.steps}

    def start(self) -> Engine:
        self.thread = threading.Thread(target=self._loop, name="lm-engine", daemon=True)
        self.thread.start()
        return self

    def stop_admitting(self) -> None:
        """Admit no new request (submit raises Busy); the running and waiting ones go on."""
        with self.lock:
            self.stopping = True
            self.lock.notify()

    def busy(self) -> bool:
        """Whether a request is running, being admitted or waiting."""
        with self.lock:
            return bool(self.waiting) or self.admitting > 0 or any(r is not None for r in self.rows)

    def abort(self, message: str) -> None:
        """End every running and waiting request now with Failed(message, 503), and the loop with them:
        the end of a shutdown's drain. The loop ends them after the prefill or step it is in (no row is
        cut mid-step); a thread that has died, or never started, leaves them to this call."""
        with self.lock:
            self.stopping = True
            if self.aborting is None:  # the first abort's message stands
                self.aborting = message
            self.lock.notify()
        if self.thread is not None:
            self.thread.join()
        self._abort_all()  # ends nothing twice: the loop's own call emptied the rows and the queue

    def stop(self, timeout: float | None = None) -> None:
        """Let the running and waiting requests finish, then end the loop; past `timeout` seconds the
        ones still there end with a 503 (abort)."""
        self.stop_admitting()
        if self.thread is None:
            return
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.abort("the server stopped before this request finished")

    # ------------------------------------------------------------------ the loop: the engine's thread

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self.waiting and not any(self.rows) and not self.stopping:
                    self.lock.wait()
                if self.aborting is not None:
                    break
                if self.stopping and not self.waiting and not any(self.rows):
                    return
                free = [r for r, run in enumerate(self.rows) if run is None]
                admitted = [(free.pop(0), self.waiting.popleft()) for _ in range(min(len(free), len(self.waiting)))]
                self.admitting = len(admitted)  # off the queue, not yet in a row: still work (busy)
            with torch.inference_mode():
                for i, (row, ticket) in enumerate(admitted):
                    if self.aborting is not None:  # the drain has ended: the rest are not prefilled, only ended
                        with self.lock:
                            self.waiting.extendleft(t for _, t in reversed(admitted[i:]))
                        break
                    self._admit(row, ticket)
                with self.lock:
                    self.admitting = 0
                if self.aborting is None:
                    self._drop_cancelled()
                    if any(self.rows):
                        self._step()
        self._abort_all()

    def _abort_all(self) -> None:
        """Every running and waiting request ends with abort's message: its text so far was sent as it settled."""
        with self.lock:
            tickets = [*(r.ticket for r in self.rows if r is not None), *self.waiting]
            self.rows, self.waiting = [None] * self.max_batch, collections.deque()
        for ticket in tickets:
            ticket.send(Failed(self.aborting or "the server stopped", status=503, code="shutting_down"))

    def _admit(self, row: int, ticket: Ticket) -> None:
        if ticket.cancelled.is_set():  # withdrawn while it waited: it ends without a row
            ticket.send(Finished("cancelled", len(ticket.completion.prompt), [], ""))
            return
        c = ticket.completion
        try:
            logits = self.cache.prefill_row(row, torch.tensor(c.prompt, dtype=torch.long))[-1:]  # (1, V)
        except Exception as error:  # this request only: the other rows were not touched
            self._report(error)
            ticket.send(Failed(f"the prompt could not be decoded: {error}"))
            return
        generator = None
        if c.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(c.seed)
        self.rows[row] = Running(ticket, StreamedText(self.tokenizer, list(c.stop)), generator)
        self._take(row, self._pick([row], logits)[0])

    def _step(self) -> None:
        """One token for every running row, at each row's own slot."""
        ids = torch.tensor(self.next_ids, dtype=torch.long, device=self.device)[:, None]  # (B, 1)
        try:
            logits = self.step_fn(ids, self.cache, self.cache.lengths.clone())  # (B, V)
        except Exception as error:  # the whole batch is lost: its requests fail, the loop goes on
            self._report(error)
            for row, run in enumerate(self.rows):
                if run is not None:
                    run.ticket.send(Failed(f"decoding failed: {error}"))
                    self.rows[row] = None
            self.cache = self._empty_cache()
            return
        self.cache.advance(1)
        self.steps += 1
        running = [r for r, run in enumerate(self.rows) if run is not None]
        for row, token in zip(running, self._pick(running, logits[running]), strict=True):
            self._take(row, token)
        if self.model.context_limited:
            # A free row's slots still advance with the batch; before they run out it starts again empty.
            for row, run in enumerate(self.rows):
                if run is None and self.cache.row_slots[row] >= self.max_len - 1:
                    self.cache.reset_row(row)

    def _pick(self, rows: list[int], logits: torch.Tensor) -> list[int]:
        """The next token of each of `rows`, from their logits (len(rows), V): greedy rows in one argmax,
        sampled rows each with its own settings and generator. One read of the device per call."""
        unseen = self.unseen
        greedy = [i for i, r in enumerate(rows) if self.rows[r].ticket.completion.sampling.temperature == 0]
        sampled = sorted(set(range(len(rows))) - set(greedy))
        picks = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        if greedy:
            picks[greedy] = GREEDY.pick(logits[greedy], unseen.expand(len(greedy), -1), None)
        for i in sampled:
            run = self.rows[rows[i]]
            picks[i] = run.ticket.completion.sampling.pick(logits[i:i + 1], unseen, run.generator)[0]
        return picks.tolist()

    def _take(self, row: int, token: int) -> None:
        """Row `row`'s request gets `token`: its settled text now, and its end if it has come."""
        run = self.rows[row]
        if self.metrics is not None:
            now = time.perf_counter()
            if run.last_token_at is None:
                self.metrics.first_token(now - run.ticket.submitted_at)
            else:
                self.metrics.token_gap(now - run.last_token_at)
            run.last_token_at = now
        if token == self.eos_id:
            return self._finish(row, "stop")
        run.tokens.append(token)
        piece, stopped = run.text.update(run.tokens)
        if piece:
            run.ticket.send(Piece(piece))
        if stopped:
            return self._finish(row, "stop")
        if len(run.tokens) >= run.ticket.completion.max_tokens:
            return self._finish(row, "length")
        self.next_ids[row] = token

    def _finish(self, row: int, reason: str) -> None:
        run = self.rows[row]
        rest = run.text.finish(run.tokens)
        if rest and reason != "cancelled":
            run.ticket.send(Piece(rest))
        run.ticket.send(Finished(reason, len(run.ticket.completion.prompt), run.tokens, run.text.text))
        if self.metrics is not None:
            self.metrics.finished(len(run.ticket.completion.prompt), len(run.tokens))
        with self.lock:
            self.rows[row] = None

    def _drop_cancelled(self) -> None:
        """Cancelled requests leave: a running one frees its row, a waiting one the queue."""
        for row, run in enumerate(self.rows):
            if run is not None and run.ticket.cancelled.is_set():
                self._finish(row, "cancelled")
        with self.lock:
            withdrawn = [t for t in self.waiting if t.cancelled.is_set()]
            for ticket in withdrawn:
                self.waiting.remove(ticket)
        for ticket in withdrawn:
            ticket.send(Finished("cancelled", len(ticket.completion.prompt), [], ""))

    @staticmethod
    def _report(error: Exception) -> None:
        traceback.print_exception(error, file=sys.stderr)


__all__ = ["Busy", "Completion", "Engine", "Event", "Failed", "Finished", "Piece", "Ticket"]
