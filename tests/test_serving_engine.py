"""The serving engine's continuous batching against lm.generate on each prompt alone, for every kind:
requests joining and leaving rows while the others decode, stop strings, cancellation, a full queue,
and a failing request that leaves the loop serving."""

import queue

import pytest
import torch
from test_generation import KINDS, VOCAB
from test_generation import make_model as generation_model
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from lm import generate
from lm.generation.decode import Sampling
from lm.serving.engine import Busy, Completion, Engine, Failed, Finished, Piece

WITH_CONV = ["softmax-gqa+conv", "gated_delta+conv", "mla+conv"]


def make_model(name, max_seq_len=64):
    """The shared generation tests' model of the kind (2 layers, 4 heads), in float64: a row decoded in a
    batch of 3 and alone differ by rounding only, far below any gap between the two likeliest tokens,
    so greedy tokens are equal by construction, not by luck."""
    return generation_model(name, max_seq_len).double()


def word_tokenizer() -> Tokenizer:
    """A real tokenizers.Tokenizer over the test vocabulary: token i is the word w<i>."""
    return Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))


class Collector:
    """Each completion's events, gathered on the engine's thread; `wait(i)` blocks until i has ended."""

    def __init__(self, n):
        self.queues = [queue.SimpleQueue() for _ in range(n)]

    def sink_for(self, i):
        return self.queues[i].put

    def wait(self, i, timeout=60):
        events = []
        while not events or not isinstance(events[-1], (Finished, Failed)):
            events.append(self.queues[i].get(timeout=timeout))
        return events


def run_all(engine, completions):
    collector = Collector(len(completions))
    engine.submit(completions, collector.sink_for)
    return [collector.wait(i) for i in range(len(completions))]


@pytest.mark.parametrize("name", list(KINDS) + WITH_CONV)
def test_every_request_decodes_as_it_would_alone_while_others_join_and_leave(name):
    """7 requests over 3 rows: later ones join rows freed by shorter ones while the rest decode."""
    model, tokenizer = make_model(name), word_tokenizer()
    g = torch.Generator().manual_seed(2)
    lengths, budgets = (5, 17, 1, 9, 30, 2, 12), (3, 12, 8, 1, 6, 10, 7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    engine = Engine(model, tokenizer, max_batch=3, max_queue=8, eos_id=None).start()
    try:
        results = run_all(engine, [Completion(p, m) for p, m in zip(prompts, budgets, strict=True)])
    finally:
        engine.stop()
    for prompt, budget, events in zip(prompts, budgets, results, strict=True):
        done = events[-1]
        assert isinstance(done, Finished) and done.reason == "length"
        assert prompt + done.tokens == generate(model, [prompt], budget)[0]
        assert "".join(e.text for e in events if isinstance(e, Piece)) == done.text == tokenizer.decode(done.tokens)
    assert engine.load() == {"running": 0, "waiting": 0, "slots": 3, "steps": engine.steps}
    assert engine.steps < sum(budgets)  # rows decoded side by side, not one request after another


@pytest.mark.parametrize("name", ["softmax-mha", "sliding-wrapped", "gated_delta", "hybrid-gated-delta-softmax"])
def test_seeded_sampling_and_stop_strings_match_generate(name):
    model, tokenizer = make_model(name), word_tokenizer()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (4, 11, 7)]
    sampling = Sampling(temperature=0.9, top_k=20, top_p=0.95)
    engine = Engine(model, tokenizer, max_batch=2, max_queue=4, eos_id=7).start()
    try:
        sampled = run_all(engine, [Completion(p, 16, sampling, seed=100 + i) for i, p in enumerate(prompts)])
        stop = [tokenizer.decode([t]) for t in generate(model, [prompts[1]], 6)[0][-2:]]  # words it will reach
        stopped = run_all(engine, [Completion(p, 16, stop=stop) for p in prompts])
    finally:
        engine.stop()
    for i, (prompt, events) in enumerate(zip(prompts, sampled, strict=True)):
        expected = generate(model, [prompt], 16, temperature=0.9, top_k=20, top_p=0.95, seed=100 + i, eos_id=7)[0]
        assert prompt + events[-1].tokens == expected
        assert events[-1].reason == ("stop" if len(expected) < len(prompt) + 16 else "length")
    for prompt, events in zip(prompts, stopped, strict=True):
        expected = generate(model, [prompt], 16, stop=stop, tokenizer=tokenizer, eos_id=7)[0]
        assert prompt + events[-1].tokens == expected
    assert stopped[1][-1].reason == "stop" and not any(s in stopped[1][-1].text for s in stop)


def test_a_cancelled_request_frees_its_row_for_the_next():
    model, tokenizer = make_model("softmax-mha", max_seq_len=512), word_tokenizer()
    engine = Engine(model, tokenizer, max_batch=1, max_queue=1, eos_id=None).start()
    try:
        collector = Collector(2)
        [long] = engine.submit([Completion([1, 2, 3], 500)], collector.sink_for)
        assert isinstance(collector.queues[0].get(timeout=60), Piece)  # it is running
        [short] = engine.submit([Completion([4, 5], 3)], lambda i: collector.sink_for(1))
        with pytest.raises(Busy, match="1 slots are busy"):
            engine.submit([Completion([6], 3)], collector.sink_for)
        long.cancel()
        cancelled = collector.wait(0)
        assert cancelled[-1].reason == "cancelled" and len(cancelled[-1].tokens) < 500
        assert collector.wait(1)[-1].tokens == generate(model, [[4, 5]], 3)[0][2:]
        # withdrawn while it waits: it ends without ever taking a row
        [first, waiting] = engine.submit([Completion([1], 300), Completion([2], 3)], collector.sink_for)
        waiting.cancel()
        assert collector.wait(1)[-1] == Finished("cancelled", 1, [], "")
        first.cancel()
        assert collector.wait(0)[-1].reason == "cancelled"
    finally:
        engine.stop()


def test_a_request_too_long_for_full_attention_is_refused_before_it_queues():
    model, tokenizer = make_model("softmax-mha", max_seq_len=16), word_tokenizer()
    engine = Engine(model, tokenizer, max_batch=2, max_queue=2, eos_id=None)
    with pytest.raises(ValueError, match="exceed the model's context of 16"):
        engine.submit([Completion(list(range(10)), 7)], Collector(1).sink_for)
    assert engine.room(10, 6) is None
    assert Engine(make_model("linear", max_seq_len=16), tokenizer, 2, 2, None).room(10, 1000) is None


def test_a_failing_prompt_fails_alone_and_the_loop_keeps_serving(capsys):
    model, tokenizer = make_model("softmax-gqa"), word_tokenizer()
    engine = Engine(model, tokenizer, max_batch=2, max_queue=2, eos_id=None).start()
    try:
        bad, good = run_all(engine, [Completion([VOCAB + 5], 4), Completion([1, 2], 4)])
        assert isinstance(bad[-1], Failed) and "could not be decoded" in bad[-1].message
        assert good[-1].tokens == generate(model, [[1, 2]], 4)[0][2:]
        assert run_all(engine, [Completion([3], 2)])[0][-1].reason == "length"
    finally:
        engine.stop()
    assert "IndexError" in capsys.readouterr().err  # the server's log keeps the cause


@pytest.mark.slow
@pytest.mark.parametrize(("name", "mode"), [("softmax-gqa", "default"), ("gated_delta", "default"),
                                           ("hybrid-gated-delta-softmax", "default"), ("softmax-gqa", "max-autotune")])
def test_the_compiled_step_serves_the_same_tokens(name, mode):
    """compile=true: one graph for the step over all rows, whatever rows join and leave; max-autotune's
    frozen-weight step too."""
    model, tokenizer = make_model(name), word_tokenizer()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 13, 2, 9)]
    engine = Engine(model, tokenizer, max_batch=2, max_queue=4, eos_id=None, compile=True, compile_mode=mode).start()
    try:
        results = run_all(engine, [Completion(p, 8 + 3 * i) for i, p in enumerate(prompts)])
    finally:
        engine.stop()
    for i, (prompt, events) in enumerate(zip(prompts, results, strict=True)):
        assert prompt + events[-1].tokens == generate(model, [prompt], 8 + 3 * i)[0]
    assert not engine.step_fn.fell_back


def test_abort_ends_running_and_waiting_requests_with_a_503_after_the_text_they_had():
    """The end of a shutdown's drain: every request still there gets Failed(503, shutting_down) as its
    last event, the running ones after the text they had decoded, which is generate's own prefix."""
    model, tokenizer = make_model("softmax-gqa", max_seq_len=4096), word_tokenizer()
    prompt = [3, 1, 4, 1, 5]
    engine = Engine(model, tokenizer, max_batch=1, max_queue=4, eos_id=None).start()
    collector = Collector(2)
    engine.submit([Completion(prompt, 4000), Completion(prompt, 4000)], collector.sink_for)  # one runs, one waits
    first = collector.queues[0].get(timeout=60)  # the first is decoding
    engine.abort("the drain ended")
    assert not engine.thread.is_alive() and not engine.busy()
    running, waiting = [first, *collector.wait(0)], collector.wait(1)
    assert waiting == [Failed("the drain ended", status=503, code="shutting_down")]
    assert running[-1] == Failed("the drain ended", status=503, code="shutting_down")
    text = "".join(e.text for e in running[:-1])
    ids = generate(model, [prompt], len(text.split()))[0][len(prompt):]
    assert text.split() == [f"w{i}" for i in ids]
    with pytest.raises(Busy, match="shutting down"):
        engine.submit([Completion(prompt, 4)], collector.sink_for)


def test_abort_without_a_running_loop_still_ends_every_request():
    """An engine whose thread never started (or has died) leaves its requests to abort itself."""
    engine = Engine(make_model("softmax-gqa"), word_tokenizer(), max_batch=1, max_queue=4, eos_id=None)
    collector = Collector(2)
    engine.submit([Completion([1, 2], 3), Completion([3], 3)], collector.sink_for)
    engine.abort("stopped")
    engine.abort("a second abort")  # ends nothing twice, and the first message stands
    assert [collector.wait(i) for i in range(2)] == [[Failed("stopped", status=503, code="shutting_down")]] * 2
    assert all(q.empty() for q in collector.queues) and not engine.busy()
