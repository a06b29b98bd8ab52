"""The HTTP side of the server: OpenAI's routes over an Engine (lm.serving.engine), on FastAPI.

    POST /v1/completions        text or token ids to continue; several prompts, `n` choices each
    POST /v1/chat/completions   a conversation, rendered by the model's chat template (400 without one)
    GET  /v1/models             the one model served
    GET  /health                liveness and the engine's load: rows running, requests waiting

Every request is checked here, before it reaches the engine: a body that is not JSON, a wrong type,
a value out of range, a prompt too long for the model or a feature this server lacks is a 400 in
OpenAI's error shape naming the field; a full queue a 429 with Retry-After. `stream: true` answers
with server-sent events as tokens settle; a client that goes away cancels its requests, which frees
their rows at the next step. Responses carry token counts (`usage`); a stream carries them on its
last chunk (or, asked with `stream_options.include_usage`, as OpenAI's extra final chunk).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from lm.data.tokenizer import EOT
from lm.generation.decode import Sampling, stop_strings
from lm.serving.chat import ChatTemplate
from lm.serving.engine import Busy, Completion, Engine, Event, Failed, Finished, NeverFits, Piece, Ticket
from lm.serving.metrics import ServingMetrics
from lm.serving.requests import ChatRequest, CompletionRequest, Sampled
from lm.util.checks import require_seed
from lm.util.errors import GenerationError

TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat's default is what is left of the context


@dataclass(frozen=True)
class Limits:
    max_new_tokens: int  # the most max_tokens a request may ask for
    max_prompt_tokens: int


class RequestError(Exception):
    """A request this server refuses: its status, and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers
        self.body = {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(error: RequestError) -> JSONResponse:
    return JSONResponse(error.body, status_code=error.status, headers=error.headers)


class Inbox:
    """The events of one HTTP request's completions, carried from the engine's thread to the event loop."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    def sink_for(self, index: int) -> Callable[[Event], None]:
        return lambda event: self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))


class Server:
    """The routes' shared state: the engine, the tokenizer and what a request may ask for."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, limits: Limits,
                 chat_template: ChatTemplate | None = None):
        self.engine, self.tokenizer, self.model_name, self.limits = engine, tokenizer, model_name, limits
        self.chat_template = chat_template
        self.vocab_size = engine.model.config.vocab_size
        self.eot_id = tokenizer.token_to_id(EOT)
        self.created = int(time.time())

    # ------------------------------------------------------------------ checking a request

    def encode(self, prompt, field: str) -> list[int]:
        """One prompt's token ids: text encoded, ids checked against the vocabulary."""
        if isinstance(prompt, str):
            require_unicode(prompt, field)
            ids = self.tokenizer.encode(prompt).ids
            if not ids:  # nothing to continue from: start a new document, as training saw them start
                if self.eot_id is None:
                    raise RequestError(400, f"{field} is empty: give some text to continue", field)
                ids = [self.eot_id]
        else:
            ids = list(prompt)
            if not ids:
                raise RequestError(400, f"{field} is an empty list of token ids", field)
            outside = [t for t in ids if not 0 <= t < self.vocab_size]
            if outside:
                raise RequestError(400, f"{field} holds token id {outside[0]}, outside the model's vocabulary "
                                        f"(ids 0 to {self.vocab_size - 1})", field)
        if len(ids) > self.limits.max_prompt_tokens:
            raise RequestError(400, f"{field} has {len(ids)} tokens, more than this server's max_prompt_tokens="
                                    f"{self.limits.max_prompt_tokens}", field)
        return ids

    def completions(self, req: Sampled, prompts: list[list[int]], max_tokens: int | None, field: str,
                    default_max_tokens: int | None) -> list[Completion]:
        """The engine's completions for every prompt and choice, each checked to fit."""
        if req.model != self.model_name:
            raise RequestError(404, f"the model {req.model!r} does not exist: this server serves {self.model_name!r}",
                               "model", "model_not_found")
        unsupported = req.unsupported()
        if unsupported:
            raise RequestError(400, f"{unsupported} is not supported by this server", unsupported)
        try:
            stop = stop_strings([] if req.stop is None else req.stop)
        except GenerationError as e:
            raise RequestError(400, str(e), "stop") from None
        if len(stop) > 4:
            raise RequestError(400, f"stop holds {len(stop)} strings: at most 4", "stop")
        if req.seed is not None:
            try:
                require_seed("seed", req.seed, GenerationError)
            except GenerationError as e:
                raise RequestError(400, str(e), "seed") from None
        if max_tokens is not None and max_tokens > self.limits.max_new_tokens:
            raise RequestError(400, f"max_tokens={max_tokens} is more than this server's bound of "
                                    f"{self.limits.max_new_tokens}", "max_tokens")
        temperature = 1.0 if req.temperature is None else req.temperature
        sampling = Sampling(temperature, req.top_k, req.top_p)
        out = []
        for ids in prompts:
            budget = max_tokens or self._default_budget(len(ids), default_max_tokens, field)
            why = self.engine.room(len(ids), budget)
            if why:
                raise RequestError(400, why, "max_tokens" if self.engine.room(len(ids), 1) is None else field)
            for choice in range(req.n):
                seed = None if req.seed is None else req.seed + choice  # choices of one seed differ
                out.append(Completion(ids, budget, sampling, stop, seed))
        return out

    def _default_budget(self, prompt_tokens: int, default: int | None, field: str) -> int:
        """max_tokens when the request gives none: `default`, else all the context leaves (within the bound)."""
        budget = self.limits.max_new_tokens if default is None else default
        if self.engine.model.context_limited:
            room = self.engine.max_len - prompt_tokens
            if room < 1:
                raise RequestError(400, f"{field} fills the model's context of {self.engine.max_len} tokens "
                                        f"({prompt_tokens} tokens)", field)
            budget = min(budget, room) if default is None else budget
        return budget

    def chat_prompt(self, req: ChatRequest) -> list[int]:
        if self.chat_template is None:
            raise RequestError(400, f"the model {self.model_name!r} has no chat template (a model trained on plain "
                                    "text has none): use /v1/completions, or start the server with "
                                    "chat_template=<a Jinja file>", "messages")
        messages = [m.as_text() for m in req.messages]
        for i, message in enumerate(messages):
            require_unicode(message["content"], f"messages.{i}.content")
        try:
            text = self.chat_template.render(messages)
        except ValueError as e:
            raise RequestError(400, str(e), "messages") from None
        return self.encode(text, "messages")

    def submit(self, completions: list[Completion], inbox: Inbox) -> list[Ticket]:
        try:
            return self.engine.submit(completions, inbox.sink_for)
        except NeverFits as e:  # a 429 would have the client retry forever
            several_prompts = len({tuple(c.prompt) for c in completions}) > 1
            raise RequestError(400, str(e), "prompt" if several_prompts else "n") from None
        except Busy as e:
            if self.engine.stopping:
                raise RequestError(503, str(e), kind="server_error", code="shutting_down") from None
            raise RequestError(429, f"{e}: try again shortly", kind="rate_limit_error", code="busy",
                               headers={"Retry-After": "1"}) from None


def require_unicode(text: str, field: str) -> None:
    """A 400 for text no encoding holds: JSON's `\\ud800` escapes decode to lone surrogates, which the
    tokenizer refuses with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(400, f"{field} is not valid Unicode text: a lone surrogate "
                                f"(\\u{ord(text[e.start]):04x}) at character {e.start}", field) from None


def usage(prompts: list[list[int]], results: dict[int, Finished]) -> dict:
    prompt_tokens = sum(map(len, prompts))
    completion_tokens = sum(len(r.tokens) for r in results.values())
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finite_number(text: str) -> float:
    """A JSON number as Python reads it, refused where it is not finite (1e999 reads as infinity)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is beyond a float's range")
    return value


def no_constant(name: str):
    """JSON has no NaN or Infinity; Python's parser accepts them unless told not to, anywhere in a body."""
    raise ValueError(f"{name} is not a JSON number")


async def parse(request: Request, schema: type[BaseModel]) -> BaseModel:
    """The body as `schema`, or a 400 naming the first field that is wrong: bytes that are not JSON,
    numbers JSON has not (NaN, Infinity, a float past its range) and nesting past Python's recursion
    limit are refused here, whatever field holds them."""
    try:
        data = json.loads(await request.body(), parse_float=finite_number, parse_constant=no_constant)
    except UnicodeDecodeError:
        raise RequestError(400, "the request body is not valid JSON: it is not UTF-8 text") from None
    except RecursionError:
        raise RequestError(400, "the request body is not valid JSON here: it is nested too deeply") from None
    except ValueError as e:
        raise RequestError(400, f"the request body is not valid JSON: {str(e).splitlines()[0][:120]}") from None
    if not isinstance(data, dict):
        raise RequestError(400, "the request body must be a JSON object")
    try:
        return schema.model_validate(data)
    except RecursionError:
        raise RequestError(400, "the request body is nested too deeply") from None
    except ValidationError as e:
        first = e.errors()[0]
        # A union's errors name the member tried after the field ("prompt", "list[int]", 0): the field is
        # what the user typed, so the member's name is left out.
        names = [str(p) for p in first["loc"] if not (isinstance(p, str) and ("[" in p or p in TYPE_TAGS))]
        param = ".".join(names) or None
        value = f" (got {json.dumps(first.get('input'))[:60]})" if "input" in first and param else ""
        raise RequestError(400, f"{param or 'body'}: {first['msg']}{value}", param) from None


class Exchange:
    """One HTTP request's completions through the engine, answered whole or as a stream of chunks."""

    def __init__(self, server: Server, request: Request, prompts: list[list[int]], completions: list[Completion],
                 chat: bool, include_usage: bool):
        self.server, self.request, self.prompts = server, request, prompts
        self.chat, self.include_usage = chat, include_usage
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.object = "chat.completion" if chat else "text_completion"
        self.inbox = Inbox()
        self.tickets = server.submit(completions, self.inbox)

    def envelope(self, choices: list[dict], chunk: bool = False) -> dict:
        kind = f"{self.object}.chunk" if chunk and self.chat else self.object
        return {"id": self.id, "object": kind, "created": int(time.time()), "model": self.server.model_name,
                "choices": choices}

    def cancel(self) -> None:
        for ticket in self.tickets:
            ticket.cancel()

    async def whole(self) -> Response:
        """Every choice once all have finished; the requests are cancelled if the client leaves first."""
        results: dict[int, Finished] = {}
        collecting = asyncio.ensure_future(self._collect(results))
        try:
            while not collecting.done():
                await asyncio.wait({collecting}, timeout=0.5)
                if not collecting.done() and await self.request.is_disconnected():
                    collecting.cancel()
                    return Response(status_code=499)  # nobody reads it
            collecting.result()
        finally:
            self.cancel()
        choices = [self._choice(i, r.text, r.reason) for i, r in sorted(results.items())]
        return JSONResponse({**self.envelope(choices), "usage": usage(self.prompts, results)})

    async def _collect(self, results: dict[int, Finished]) -> None:
        while len(results) < len(self.tickets):
            index, event = await self.inbox.queue.get()
            if isinstance(event, Failed):
                raise RequestError(event.status, event.message, kind="server_error", code=event.code)
            if isinstance(event, Finished):
                results[index] = event

    def _choice(self, index: int, text: str, reason: str | None) -> dict:
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
        return {"index": index, "text": text, "finish_reason": reason, "logprobs": None}

    def _delta(self, index: int, text: str, reason: str | None, first: bool) -> dict:
        if not self.chat:
            return self._choice(index, text, reason)
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "finish_reason": reason}

    def stream(self) -> StreamingResponse:
        return StreamingResponse(self._events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self) -> AsyncIterator[str]:
        """Server-sent events: a chunk per settled piece of text, a last one per choice with its finish
        reason, then `[DONE]`. Leaving early (the client went away) cancels what is still decoding."""
        results: dict[int, Finished] = {}
        started = set()
        try:
            while len(results) < len(self.tickets):
                index, event = await self.inbox.queue.get()
                first = index not in started
                started.add(index)
                if isinstance(event, Failed):  # an error event, then the stream's end as every stream ends
                    yield sse({"error": {"message": event.message, "type": "server_error", "param": None,
                                         "code": event.code}})
                    yield "data: [DONE]\n\n"
                    return
                if isinstance(event, Piece):
                    yield sse(self.envelope([self._delta(index, event.text, None, first)], chunk=True))
                    continue
                results[index] = event
                chunk = self.envelope([self._delta(index, "", event.reason, first)], chunk=True)
                if len(results) == len(self.tickets) and not self.include_usage:
                    chunk["usage"] = usage(self.prompts, results)
                yield sse(chunk)
            if self.include_usage:
                yield sse({**self.envelope([], chunk=True), "usage": usage(self.prompts, results)})
            yield "data: [DONE]\n\n"
        finally:
            self.cancel()


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class CountResponses:
    """ASGI middleware: each response's route and status to the metrics, as its headers go out (a stream's
    status is fixed then). Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would sit between
    a stream and its client and change how a client's leaving is seen."""

    def __init__(self, app, metrics: ServingMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.answered(scope["path"], message["status"])
            await send(message)

        await self.app(scope, receive, counted)


async def drain_at_shutdown(engine: Engine, shutting_down: Callable[[], bool], drain_s: float) -> None:
    """Once `shutting_down()` (the HTTP server has stopped listening): the running and waiting requests get
    `drain_s` seconds to finish, then each one left ends with a 503 (a stream: an error event and `[DONE]`),
    so every client reads an end, and the HTTP server's own wait finds the responses complete."""
    while not shutting_down():
        await asyncio.sleep(0.1)
    engine.stop_admitting()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + drain_s
    while engine.busy() and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if engine.busy():
        # abort waits for the prefill or step in progress: off the event loop, which the streams need
        await asyncio.to_thread(engine.abort, f"the server is shutting down: its drain of {drain_s:g} s ended "
                                              "before this request finished")


def build_app(server: Server, api_key: str | None = None, on_shutdown: Callable[[], None] | None = None,
              shutting_down: Callable[[], bool] | None = None, drain_s: float = 30) -> FastAPI:
    """The FastAPI application serving `server`; with `api_key`, /v1 routes need `Authorization: Bearer <key>`.
    `shutting_down` (the HTTP server's exit flag) starts the drain of `drain_s` seconds (drain_at_shutdown)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app):
        drain = None
        if shutting_down is not None:
            drain = asyncio.create_task(drain_at_shutdown(server.engine, shutting_down, drain_s))
        yield
        if drain is not None:
            drain.cancel()
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="lm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServingMetrics(server.engine.load, server.engine.max_batch)
    server.engine.report_to(metrics)
    app.add_middleware(CountResponses, metrics=metrics)

    @app.get("/metrics")
    async def prometheus():
        """Prometheus's text format; open like /health (counts and timings, no request's content)."""
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    def authorized(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        # compare_digest: the time taken does not tell how much of a guessed key was right.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise RequestError(401, "a valid API key is needed: send `Authorization: Bearer <key>`",
                               code="invalid_api_key")

    @app.exception_handler(RequestError)
    async def refused(_request, error: RequestError):
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(_request, error: HTTPException):
        return error_response(RequestError(error.status_code, str(error.detail), code=None))

    @app.get("/health")
    async def health():
        return {"status": "stopping" if server.engine.stopping else "ok", "model": server.model_name,
                **server.engine.load()}

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "lm"}]}

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(request: Request):
        req = await parse(request, CompletionRequest)
        raw = req.prompt
        many = isinstance(raw, list) and bool(raw) and not isinstance(raw[0], int)
        prompts = [server.encode(p, "prompt") for p in (raw if many else [raw])]
        work = server.completions(req, prompts, req.max_tokens, "prompt", COMPLETION_MAX_TOKENS)
        exchange = Exchange(server, request, prompts, work, chat=False, include_usage=req.include_usage)
        return exchange.stream() if req.stream else await exchange.whole()

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(request: Request):
        req = await parse(request, ChatRequest)
        prompts = [server.chat_prompt(req)]
        work = server.completions(req, prompts, req.max_completion_tokens or req.max_tokens, "messages", None)
        exchange = Exchange(server, request, prompts, work, chat=True, include_usage=req.include_usage)
        return exchange.stream() if req.stream else await exchange.whole()

    return app


__all__ = ["Limits", "RequestError", "Server", "build_app"]
