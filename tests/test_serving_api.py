"""The server through real clients on the loopback: the official `openai` package (completions, chat,
streaming, errors) and 64 concurrent streaming requests, every answer equal to lm.generate's greedy
continuation of its prompt alone; bad requests as OpenAI-shaped 4xx that leave the server serving."""

import asyncio
import json

import pytest

httpx = pytest.importorskip("httpx")  # the serve and dev extras (`make install`)
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from serving import greedy_text, greedy_tokens, model, served, tokenizer  # noqa: E402

PROMPTS = ["def main(", "import os\n", "class Text", "    return ", "x = [", "# the", "if __name__", "for i in"]


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


@pytest.fixture(scope="module")
def net():
    # float64: a row decoded among 8 and alone differ by rounding only, far below the gap between the two
    # likeliest tokens, so equal greedy text is what the test can demand.
    return model("softmax", n_kv_head=2).double()


@pytest.fixture(scope="module")
def server(net, tok):
    with served(net, tok, max_batch=8, max_queue=64) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def test_completions_and_models_through_the_openai_client(client, net, tok):
    assert [m.id for m in client.models.list()] == ["tiny"]
    out = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=12, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for choice in out.choices:
        assert choice.text == greedy_text(net, tok, PROMPTS[choice.index // 2], 12)
        assert choice.finish_reason in ("length", "stop")
    prompt_tokens = sum(len(tok.encode(p).ids) for p in PROMPTS[:2])
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens == 2 * sum(len(greedy_tokens(net, tok, p, 12)) for p in PROMPTS[:2])
    assert out.usage.total_tokens == prompt_tokens + out.usage.completion_tokens


def test_streamed_text_equals_the_whole_answer(client, net, tok):
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=20, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == greedy_text(net, tok, PROMPTS[2], 20)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop") and chunks[-1].usage.completion_tokens > 0
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_renders_the_template_and_streams(client, net, tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f("}]
    rendered = "<|system|>Be brief.\n<|user|>def f(\n<|assistant|>"
    expected = greedy_text(net, tok, rendered, 10)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == expected
    assert out.usage.prompt_tokens == len(tok.encode(rendered).ids)
    assert out.usage.completion_tokens == len(greedy_tokens(net, tok, rendered, 10))
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == out.usage.total_tokens


def test_seeded_sampling_repeats_and_stop_strings_cut(client):
    ask = dict(model="tiny", prompt=PROMPTS[3], max_tokens=30, temperature=1.0, top_p=0.9, seed=7,
               extra_body={"top_k": 40})  # top_k: not in OpenAI's API, so the client sends it as an extra
    first, again = client.completions.create(**ask), client.completions.create(**ask)
    assert first.choices[0].text == again.choices[0].text
    text = first.choices[0].text
    assert len(text) >= 4
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = client.completions.create(**ask, stop=[stop]).choices[0]
    assert cut.text == text[:text.find(stop)] and cut.finish_reason == "stop"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"prompt": "x", "max_tokens": 401}, "max_tokens", "more than this server's bound of 400"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens", "valid integer"),
    ({"prompt": "x", "temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"prompt": "x", "top_p": 0}, "top_p", "greater than 0"),
    ({"prompt": "x", "n": True}, "n", "valid integer"),
    ({"prompt": 5}, "prompt", "valid string"),
    ({"prompt": [1, 2, 99999]}, "prompt", "outside the model's vocabulary"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": "x", "stop": [""]}, "stop", "empty string"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"prompt": "x", "seed": -3}, "seed", "seed=-3"),
    ({"prompt": "x", "logprobs": 2}, "logprobs", "not supported"),
    ({"prompt": "x " * 600}, "prompt", "max_prompt_tokens=512"),
    ({"prompt": "x " * 100, "max_tokens": 200}, "max_tokens", "exceed the model's context of 256"),
    ({"prompt": "x " * 200, "max_tokens": 1}, "prompt", "exceed the model's context of 256"),
    ({}, "prompt", "Field required"),
])
def test_bad_completions_get_a_400_naming_the_field(server, body, param, words):
    reply = httpx.post(f"{server[0]}/v1/completions", json={"model": "tiny", **body})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param and error["type"] == "invalid_request_error"
    assert words in error["message"]


NOT_JSON_NUMBERS = [b'"temperature": Infinity', b'"temperature": -Infinity', b'"top_p": NaN', b'"seed": 1e999',
                    b'"max_tokens": 2, "stop": [NaN]', b'"extra": {"deep": [1, 2, Infinity]}']


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
@pytest.mark.parametrize("raw", [
    *(b'{"model": "tiny", "prompt": "x", ' + field + b"}" for field in NOT_JSON_NUMBERS),
    b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # past the parser's recursion limit
    b"[" * 100_000 + b"]" * 100_000,
    b'{"model": "tiny", "prompt": "x", "n": ' + b"9" * 5000 + b"}",  # past int's digit limit
], ids=lambda raw: raw[:40].decode(errors="replace"))
def test_a_body_json_cannot_hold_is_a_400_in_openai_s_shape_and_the_server_keeps_serving(server, client, route, raw):
    """Numbers JSON has not (Python's parser reads NaN, Infinity and 1e999 unless told not to), in any
    field, and nesting past the recursion limit: each a 400 with OpenAI's error object, never a 500."""
    reply = httpx.post(f"{server[0]}/v1/{route}", content=raw, headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text[:200]
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and "not valid JSON" in error["message"]
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).usage.completion_tokens <= 2


@pytest.mark.parametrize(("route", "body", "param"), [
    ("completions", {"prompt": "a\ud800b"}, "prompt"),
    ("completions", {"prompt": ["ok", "\udfff"]}, "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "\udcff"}]}, "messages.0.content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"},
                                       {"role": "user", "content": [{"type": "text", "text": "x\ud800"}]}]},
     "messages.1.content"),
])
def test_text_no_encoding_holds_is_a_400_naming_the_field(server, client, route, body, param):
    """JSON's \\ud800 escapes decode to lone surrogates, which the tokenizer refuses with a TypeError: a
    400 naming the field, and the server keeps serving. (The official client cannot send them: it encodes
    its JSON as UTF-8 first and raises; json.dumps writes them as the escapes a raw client sends.)"""
    raw = json.dumps({"model": "tiny", "max_tokens": 2, **body}).encode()
    reply = httpx.post(f"{server[0]}/v1/{route}", content=raw, headers={"content-type": "application/json"})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param and error["type"] == "invalid_request_error"
    assert "not valid Unicode text: a lone surrogate" in error["message"]
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).usage.completion_tokens <= 2


def test_malformed_bodies_unknown_models_and_routes(server, client):
    url = server[0]
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        reply = httpx.post(f"{url}/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert reply.status_code == 400 and "error" in reply.json()
    with pytest.raises(openai.NotFoundError, match="this server serves 'tiny'"):
        client.completions.create(model="gpt-4", prompt="x")
    reply = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"
    reply = httpx.get(f"{url}/v1/nothing")
    assert reply.status_code == 404 and reply.json()["error"]["message"] == "Not Found"
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).usage.completion_tokens <= 2


def test_chat_without_a_template_is_a_400_that_says_why(net, tok):
    with served(net, tok, max_batch=1, chat=False) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="has no chat template"):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])


def test_an_api_key_is_checked_and_a_full_queue_answers_429(net, tok):
    with served(net, tok, max_batch=1, max_queue=1, api_key="s3cret") as (url, engine):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        assert httpx.get(f"{url}/health").status_code == 200  # no key needed to see it is alive
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        long = dict(model="tiny", prompt="x", max_tokens=250, temperature=0, stream=True)
        running, waiting = client.completions.create(**long), client.completions.create(**long)
        next(iter(running))  # the first holds the slot, the second waits
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model="tiny", prompt="y", max_tokens=2)
        assert refused.value.response.headers["retry-after"] == "1"
        running.close()
        waiting.close()
        assert wait_until_idle(url, engine)


def test_a_request_that_could_never_fit_is_a_400_not_a_retry(net, tok):
    """More completions than the slots and the queue hold together: a 429 would have the client retry
    forever on an idle server."""
    with served(net, tok, max_batch=1, max_queue=1) as (url, engine):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        for ask, param in ((dict(prompt=["a", "b", "c"]), "prompt"), (dict(prompt="a", n=3), "n")):
            with pytest.raises(openai.BadRequestError) as refused:
                client.completions.create(model="tiny", max_tokens=2, **ask)
            error = refused.value.body
            assert error["param"] == param and "asks for 3 completions" in error["message"]
            assert "at most 2 (1 slots and a queue of 1)" in error["message"]
        fits = client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=2, temperature=0)
        assert len(fits.choices) == 2  # two fit: one runs, one waits, and the server kept serving
        assert wait_until_idle(url, engine)


def wait_until_idle(url, engine) -> bool:
    """Whether /health reports no request running or waiting within 10 s (the engine frees a row at its
    next step after the client leaves)."""
    for _ in range(1000):
        health = httpx.get(f"{url}/health").json()
        if health["running"] == 0 and health["waiting"] == 0:
            return True
        asyncio.run(asyncio.sleep(0.01))
    return False


def test_a_client_leaving_mid_stream_frees_its_slot(server):
    url, engine = server
    with httpx.stream("POST", f"{url}/v1/completions",
                      json={"model": "tiny", "prompt": "x", "max_tokens": 250, "stream": True}) as reply:
        first = next(reply.iter_lines())
        assert first.startswith("data: ") and "choices" in json.loads(first[6:])
    assert wait_until_idle(url, engine)


def test_64_concurrent_streams_each_equal_generate_alone_and_no_slot_leaks(server, net, tok):
    """More clients than slots (8) and queue room: requests join rows as others leave; each stream's
    text equals the prompt's greedy continuation alone."""
    url, engine = server
    budgets = [5 + (i * 7) % 40 for i in range(64)]
    expected = {(p, m): greedy_text(net, tok, p, m) for i, m in enumerate(budgets) for p in [PROMPTS[i % 8]]}

    async def one(client, i):
        stream = await client.completions.create(model="tiny", prompt=PROMPTS[i % 8], max_tokens=budgets[i],
                                                 temperature=0, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def all_of_them():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        async with client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(64))), 300)

    steps_before = engine.steps
    texts = asyncio.run(all_of_them())
    assert texts == [expected[PROMPTS[i % 8], budgets[i]] for i in range(64)]
    assert engine.steps - steps_before < sum(budgets) / 4  # decoded side by side, not one after another
    assert wait_until_idle(url, engine)


def scraped(url: str) -> dict:
    """/metrics read by Prometheus's own text parser: {(sample name, labels as a sorted tuple): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    reply = httpx.get(f"{url}/metrics")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(reply.text) for s in family.samples}


def test_metrics_count_what_the_official_client_was_told(net, tok):
    """A fresh server; completions, chat and a stream through the official client, and two refusals: the
    request counts by route and status, the tokens in and out equal the usage each answer reported, and
    every token but each completion's first was one gap of the inter-token histogram."""
    with served(net, tok, max_batch=2) as (url, engine):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        answers = [client.completions.create(model="tiny", prompt=p, max_tokens=m, temperature=0, n=2)
                   for p, m in (("def main(", 6), ("import os\n", 3))]
        answers.append(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=4, temperature=0))
        chunks = list(client.completions.create(model="tiny", prompt="class Text", max_tokens=5, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        for bad in ({"prompt": "x", "max_tokens": "5"}, {"prompt": []}):
            assert httpx.post(f"{url}/v1/completions", json={"model": "tiny", **bad}).status_code == 400
        assert wait_until_idle(url, engine)
        metrics = scraped(url)
    usages = [a.usage for a in answers] + [chunks[-1].usage]
    finishes = [c.finish_reason for a in answers for c in a.choices] + [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert metrics[("lm_requests_total", (("route", "/v1/completions"), ("status", "200")))] == 3
    assert metrics[("lm_requests_total", (("route", "/v1/chat/completions"), ("status", "200")))] == 1
    assert metrics[("lm_requests_total", (("route", "/v1/completions"), ("status", "400")))] == 2
    # each completion prefills its prompt: n=2 twice, where the usage counts the prompt once per request
    choices = [len(a.choices) for a in answers] + [1]
    assert metrics[("lm_prompt_tokens_total", ())] == sum(u.prompt_tokens * n for u, n in zip(usages, choices,
                                                                                               strict=True))
    generated = sum(u.completion_tokens for u in usages)
    assert metrics[("lm_generation_tokens_total", ())] == generated
    completions = len(finishes)  # 2 + 2 + 1 + 1
    assert metrics[("lm_time_to_first_token_seconds_count", ())] == completions == 6
    # a completion ended by the end-of-text token picked one token more than it returned
    picks = generated + finishes.count("stop")
    assert metrics[("lm_inter_token_latency_seconds_count", ())] == picks - completions
    assert metrics[("lm_requests_running", ())] == metrics[("lm_requests_waiting", ())] == 0
    assert metrics[("lm_slots", ())] == 2
