"""What the serving tests share: a small model with a real byte-level tokenizer, its checkpoint, and a
server running on a free loopback port in a thread of the test process."""

from __future__ import annotations

import contextlib
import sysconfig
import threading
import time
from pathlib import Path

import torch
import uvicorn

from lm import ModelConfig, Transformer, generate
from lm.attention import layer_specs
from lm.data.tokenizer import EOT, train_tokenizer
from lm.formats.checkpoint import save_checkpoint
from lm.serving.app import Limits, Server, build_app
from lm.serving.chat import ChatTemplate
from lm.serving.engine import Engine
from lm.serving.run import bind

VOCAB = 300
# The shape of a chat template as Hugging Face folders carry them (tokenizer_config.json's chat_template).
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tokenizer():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text(encoding="utf-8") for name in ("textwrap.py", "string.py", "bisect.py")]
    return train_tokenizer(iter(texts), VOCAB)


def model(kind: str = "softmax", n_kv_head: int = 2, max_seq_len: int = 256, **options) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, n_layer=2, d_model=32, n_head=4, n_kv_head=n_kv_head, d_ff=64,
                      max_seq_len=max_seq_len, attention=layer_specs(kind, 2, options), init_std=0.2)
    return Transformer(cfg).eval()


def write_checkpoint(path: Path, net: Transformer, tok) -> Path:
    return save_checkpoint(path, net.state_dict(), net.config, tok.to_str())


def greedy_tokens(net: Transformer, tok, prompt: str, max_tokens: int) -> list[int]:
    """The new tokens lm.generate continues `prompt` with alone: the reference every response is held to."""
    ids = tok.encode(prompt).ids
    return generate(net, [ids], max_tokens, eos_id=tok.token_to_id(EOT))[0][len(ids):]


def greedy_text(net: Transformer, tok, prompt: str, max_tokens: int) -> str:
    return tok.decode(greedy_tokens(net, tok, prompt, max_tokens))


@contextlib.contextmanager
def running(server: uvicorn.Server, sock):
    """Run the uvicorn server on the bound socket in a thread; yields the base URL; stops it after."""
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(500):  # at most 5 s for uvicorn to start
        if server.started:
            break
        time.sleep(0.01)
    host, port = sock.getsockname()[:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@contextlib.contextmanager
def served(net: Transformer, tok, max_batch=4, max_queue=64, max_new_tokens=400, max_prompt_tokens=512,
           api_key=None, chat=True, name="tiny"):
    """A server of `net` on a free loopback port: (base URL, engine)."""
    engine = Engine(net, tok, max_batch, max_queue, tok.token_to_id(EOT)).start()
    template = ChatTemplate(CHAT_TEMPLATE, EOT) if chat else None
    server = Server(engine, tok, name, Limits(max_new_tokens, max_prompt_tokens), template)
    app = build_app(server, api_key, on_shutdown=lambda: engine.stop(timeout=0))
    http = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    with running(http, bind("127.0.0.1", 0)) as url:
        yield url, engine
