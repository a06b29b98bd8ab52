"""scripts/serve.py: a port in use refused in one line, a checkpoint served as the script serves it, and
SIGTERM letting the running requests finish before the process exits. Every other setting's refusal
is a row of tests/test_command_fuzz.py's SERVE table."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")  # the serve and dev extras (`make install`)
pytest.importorskip("fastapi")
from conftest import compose_config  # noqa: E402
from serving import CHAT_TEMPLATE, greedy_text, model, running, tokenizer, write_checkpoint  # noqa: E402

from benchmarks.servers import find_llama_server  # noqa: E402
from lm.config.serve import ServeSettings  # noqa: E402
from lm.config.settings import typed  # noqa: E402
from lm.serving.run import prepare  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run") / "tiny-run"
    folder.mkdir()
    return write_checkpoint(folder / "last.ckpt", model("gated_delta", n_kv_head=4), tokenizer())


def run_script(*args, env=None):
    return subprocess.run([sys.executable, str(ROOT / "scripts/serve.py"), *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


def test_a_port_in_use_is_one_line(checkpoint):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        result = run_script(f"ckpt={checkpoint}", f"port={taken.getsockname()[1]}")
    finally:
        taken.close()
    assert result.returncode == 2 and result.stderr.startswith("error: cannot listen on host=127.0.0.1")


def test_a_checkpoint_served_as_the_script_serves_it(checkpoint, tmp_path):
    """The settings composed from conf/serve.yaml, the checkpoint loaded, its run folder the model's name."""
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    cfg = compose_config("serve", [f"ckpt={checkpoint}", "port=0", "max_batch=2", f"chat_template={template}"])
    server, sock = prepare(typed(ServeSettings, cfg), open(os.devnull, "w"))
    with running(server, sock) as url:
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny-run"
        reply = httpx.post(f"{url}/v1/chat/completions", json={
            "model": "tiny-run", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 5


def wait_for(condition, seconds: float = 30) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def open_requests(url: str, streams: int, max_tokens: int) -> tuple[dict, list]:
    """`streams` streamed completions and one whole one, each on a thread of its own: (what each got, threads)."""
    import threading

    got: dict = {}
    body = {"model": "tiny-run", "prompt": "def f(", "max_tokens": max_tokens, "temperature": 0}

    def stream(i: int) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as reply:
                got[i] = [line for line in reply.iter_lines() if line]
        except httpx.HTTPError as e:  # cut off: what the test then says it got
            got[i] = [repr(e)]

    def whole() -> None:
        try:
            got["whole"] = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        except httpx.HTTPError as e:
            got["whole"] = e

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)] + [threading.Thread(target=whole)]
    for t in threads:
        t.start()
    return got, threads


def test_shutdown_past_the_drain_ends_every_stream_with_an_error_event_and_done(checkpoint, tmp_path):
    """Requests that outlast the drain, running and waiting, streamed and whole, on both routes: each
    stream's last events are an error (code shutting_down) and [DONE], the whole one a 503 in OpenAI's
    error shape, and none is cut off; the official client raises the error it reads. The drain starts
    as a signal starts it, from uvicorn's exit flag."""
    import threading

    openai = pytest.importorskip("openai")
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    cfg = compose_config("serve", [f"ckpt={checkpoint}", "port=0", "max_batch=2", "drain_s=1",
                                   "max_new_tokens=1000000", f"chat_template={template}"])
    server, sock = prepare(typed(ServeSettings, cfg), open(os.devnull, "w"))
    with running(server, sock) as url:
        got, threads = open_requests(url, streams=4, max_tokens=1000000)  # 2 rows: 3 requests wait
        wait_for(lambda: httpx.get(f"{url}/health").json()["waiting"] == 3)

        def chat() -> None:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            try:
                for _ in client.chat.completions.create(model="tiny-run", messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=1000000, stream=True):
                    pass
            except openai.APIError as e:
                got["chat"] = e

        threads.append(threading.Thread(target=chat))
        threads[-1].start()
        wait_for(lambda: httpx.get(f"{url}/health").json()["waiting"] == 4)
        server.should_exit = True
        for t in threads:
            t.join(60)
    assert "shutting down" in got["chat"].message, got.get("chat")
    for i in range(4):
        lines = got[i]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == "shutting_down" and "drain of 1 s ended" in error["message"]
    whole = got["whole"]
    assert whole.status_code == 503 and whole.json()["error"]["code"] == "shutting_down"


def start_server(checkpoint, *settings) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, str(ROOT / "scripts/serve.py"), f"ckpt={checkpoint}", "port=0",
                                *settings], stderr=subprocess.PIPE, text=True)
    banner = process.stderr.readline()
    return process, banner.split(" at ")[1].split()[0].removesuffix("/v1")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_past_the_drain_ends_every_stream_then_the_process_as_the_signal_does(checkpoint, signum):
    process, url = start_server(checkpoint, "max_batch=2", "drain_s=1", "max_new_tokens=1000000")
    try:
        got, threads = open_requests(url, streams=3, max_tokens=1000000)
        wait_for(lambda: httpx.get(f"{url}/health").json()["waiting"] == 2)
        process.send_signal(signum)
        for t in threads:
            t.join(60)
        assert process.wait(60) == -signum  # a shell reports 128 + the signal: 143, 130
    finally:
        process.kill()
    assert all(got[i][-1] == "data: [DONE]" and '"shutting_down"' in got[i][-2] for i in range(3)), got
    assert got["whole"].status_code == 503, got["whole"]
    assert "Traceback" not in process.stderr.read()


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_and_quietly(checkpoint):
    import time

    process, url = start_server(checkpoint, "max_batch=2", "drain_s=600", "max_new_tokens=1000000")
    try:
        got, threads = open_requests(url, streams=2, max_tokens=1000000)
        wait_for(lambda: httpx.get(f"{url}/health").json()["running"] == 2)
        process.send_signal(signal.SIGINT)
        time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        assert process.wait(10) == -signal.SIGINT  # not the 600 s drain
    finally:
        process.kill()
    assert process.stderr.read() == ""


@pytest.mark.slow
def test_sigterm_lets_the_running_requests_finish_then_exits(checkpoint):
    from lm import load

    process = subprocess.Popen([sys.executable, str(ROOT / "scripts/serve.py"), f"ckpt={checkpoint}", "port=0",
                                "drain_s=60"], stderr=subprocess.PIPE, text=True)
    try:
        banner = process.stderr.readline()
        url = banner.split(" at ")[1].split()[0].removesuffix("/v1")
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "model": "tiny-run", "prompt": "def f(", "max_tokens": 200, "temperature": 0, "stream": True}) as reply:
            lines = reply.iter_lines()
            first = next(lines)
            process.send_signal(signal.SIGTERM)  # mid-stream: the request goes on to its end
            rest = [line for line in lines if line]
        # Drained, it ends as SIGTERM ends a process (a shell reports 143), so a supervisor sees why.
        assert process.wait(60) == -signal.SIGTERM
    finally:
        process.kill()
    chunks = [json.loads(line[6:]) for line in [first, *rest] if line != "data: [DONE]"]
    assert rest[-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    net, tok = load(checkpoint)
    assert "".join(c["choices"][0]["text"] for c in chunks) == greedy_text(net, tok, "def f(", 200)


@pytest.mark.slow
def test_bench_serve_measures_each_kind_at_each_concurrency(tmp_path):
    out = tmp_path / "results.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts/bench.py"), "serve", "--kinds", "softmax-gqa",
                             "linear", "--int8", "softmax-gqa", "--clients", "1", "3", "--slots", "2", "--requests",
                             "1", "--prompt-tokens", "8", "--new-tokens", "6", "--out", str(tmp_path), "--json",
                             str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    kinds = json.loads(out.read_text())["kinds"]
    llama = ["llama.cpp F32", "llama.cpp Q8_0"] if find_llama_server(None) else []  # where `make llama-server` ran
    assert list(kinds) == ["softmax-gqa", "linear", "softmax-gqa int8", *llama]
    for rows in kinds.values():
        assert [(r["clients"], r["slots"], r["requests"]) for r in rows] == [(1, 1, 1), (3, 2, 3)]
        # random weights may end a completion at the end-of-text token; most run to --new-tokens
        assert all(0 < r["tokens"] <= 6 * r["requests"] and r["tokens_per_s"] > 0 for r in rows)
        assert all(r["ttft_p50"] <= r["ttft_p95"] for r in rows)
    assert (tmp_path / "serve.png").stat().st_size > 0


@pytest.mark.slow
def test_bench_serve_puts_llama_cpps_server_beside_ours_on_the_same_weights(tmp_path):
    if find_llama_server(None) is None:
        pytest.skip("no llama-server here (make llama-server)")
    out = tmp_path / "results.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts/bench.py"), "serve", "--kinds", "softmax-gqa",
                             "--int8", "--clients", "1", "2", "--requests", "1", "--prompt-tokens", "16",
                             "--new-tokens", "8", "--out", "", "--json", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    results = json.loads(out.read_text())
    assert list(results["kinds"]) == ["softmax-gqa", "llama.cpp F32", "llama.cpp Q8_0"]
    for label in ("llama.cpp F32", "llama.cpp Q8_0"):
        rows = results["kinds"][label]
        assert [(r["clients"], r["slots"]) for r in rows] == [(1, 1), (2, 2)]
        assert all(0 < r["tokens"] <= 8 * r["requests"] for r in rows)
    # The same weights in f32, with llama-server's K/V cache in f32: its greedy tokens are ours up to a
    # near-tie (weights scaled so that the blocks, not the embedding, pick tokens: they vary)
    f32 = results["greedy"]["llama.cpp F32"]
    assert f32["prompts"] == 4 and min(f32["distinct_tokens"]) > 1, f32
    assert all(margin < 0.05 for margin in f32["margins_at_difference"]), f32
    assert "llama.cpp F32: " in result.stdout and "prompts equal over 8 tokens" in result.stdout


def test_bench_serve_refuses_an_unknown_kind_before_serving(capsys):
    from benchmarks.bench import main

    with pytest.raises(SystemExit) as exit_code:
        main(["serve", "--kinds", "nope"])
    assert exit_code.value.code == 2 and "--kinds holds 'nope'" in capsys.readouterr().err
