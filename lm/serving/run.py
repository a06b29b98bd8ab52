"""`serve(settings)`: what scripts/serve.py runs. Checks the settings, loads the checkpoint, binds the port,
then serves with uvicorn until SIGINT or SIGTERM: the listening socket closes, the running and waiting
requests get `drain_s` seconds to finish, each one left then ends with a 503, and the process ends as the
signal ends a process."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import TextIO

from lm.attention import load_outside_kinds
from lm.config.serve import ServeSettings
from lm.data.tokenizer import EOT
from lm.formats.checkpoint import checkpoint_file, load
from lm.generation.compiled import check_compile_mode, check_fits
from lm.generation.quantize import CHOICES, quantize_int8, resolve_kernel
from lm.serving.chat import ChatTemplate, read_chat_template
from lm.serving.engine import Engine
from lm.util.checks import check_device
from lm.util.cli import quiet_known_warnings
from lm.util.errors import ConfigError
from lm.util.paths import resolve_path

API_KEY_VARIABLE = "LM_API_KEY"
DRAIN_GRACE_S = 5  # past drain_s: for the last events to be written before uvicorn cancels what remains


def check_run_settings(settings: ServeSettings) -> None:
    """What each setting's bound (checked as the settings were built) does not say: the device this torch
    reaches, and the compile mode and kernel this device runs."""
    check_device(settings.device)
    check_compile_mode(settings.compile_mode, settings.compile)
    check_fits(settings.compile_mode, settings.device, settings.quantize is not None)
    if settings.int8_kernel not in CHOICES:
        raise ConfigError(f"int8_kernel={settings.int8_kernel!r} must be one of {list(CHOICES)}")
    if settings.model_name is not None and not str(settings.model_name).strip():
        raise ConfigError("model_name='' is empty: give a name or null")


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads, so a port in use is one line, not a traceback."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)  # from now on connections wait in the backlog, even while the model loads
    except OSError as e:
        raise ConfigError(f"cannot listen on host={host} port={port}: {e.strerror or e}") from None
    return sock


def model_name_of(settings: ServeSettings, checkpoint: Path) -> str:
    """The name clients pass as `model`: the setting, else the run folder's (checkpoints/<run>/last.ckpt)."""
    if settings.model_name is not None:
        return str(settings.model_name)
    return checkpoint.name if checkpoint.is_dir() else checkpoint.parent.name or checkpoint.stem


def serve(settings: ServeSettings, out: TextIO | None = None) -> None:
    """Serve until SIGINT or SIGTERM: the drain (lm.serving.app.drain_at_shutdown), then the process ends
    as that signal ends a process (uvicorn raises it again once it has shut down). A second Ctrl-C
    stops at once: uvicorn skips its wait, and the signal, back at its default action, ends the
    process without Python's KeyboardInterrupt unwinding the event loop's tasks."""
    server, sock = prepare(settings, out or sys.stderr)
    if threading.current_thread() is not threading.main_thread():  # no signals reach this thread: uvicorn's too
        return server.run(sockets=[sock])
    previous = signal.signal(signal.SIGINT, signal.SIG_DFL)  # what uvicorn restores and raises again at its end
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGINT, previous)


def prepare(settings: ServeSettings, out: TextIO):
    """(uvicorn server, bound socket), the engine started: `server.run(sockets=[sock])` serves.
    The server's start: the known warnings quieted and the kinds outside lm/ loaded, as at a script's
    (both done once a process; scripts/serve.py has done them already)."""
    try:
        import uvicorn

        from lm.serving.app import Limits, Server, build_app
    except ModuleNotFoundError as e:
        raise ConfigError(f"serving needs {e.name}, which is not installed: pip install -e '.[serve]'") from None
    quiet_known_warnings()
    load_outside_kinds()  # the checkpoint may hold a kind of an installed distribution's
    check_run_settings(settings)
    checkpoint = checkpoint_file(resolve_path(settings.ckpt))
    template_source = read_chat_template(settings.chat_template, checkpoint)
    api_key = settings.api_key if settings.api_key is not None else os.environ.get(API_KEY_VARIABLE) or None
    sock = bind(settings.host, settings.port)
    model, tokenizer = load(checkpoint, device=settings.device)
    kernel_choice = None
    if settings.quantize is not None:
        kernel, kernel_choice = resolve_kernel(settings.int8_kernel, next(model.parameters()).device)
        model = quantize_int8(model, kernel)
    chat_template = ChatTemplate(template_source, EOT) if template_source is not None else None
    engine = Engine(model, tokenizer, settings.max_batch, settings.max_queue, tokenizer.token_to_id(EOT),
                    settings.compile, settings.compile_mode)
    name = model_name_of(settings, checkpoint)
    server = Server(engine, tokenizer, name, Limits(settings.max_new_tokens, settings.max_prompt_tokens), chat_template)
    # uvicorn's exit flag (set by SIGINT or SIGTERM) starts the drain; `http` is bound below, before any signal
    app = build_app(server, api_key, on_shutdown=lambda: engine.stop(timeout=0),
                    shutting_down=lambda: http.should_exit, drain_s=settings.drain_s)
    host, port = sock.getsockname()[:2]
    out.write(f"serving {name!r} ({model.config.describe_attention()}; {model.num_params():,} parameters) at "
              f"http://{host}:{port}/v1 with {settings.max_batch} slots{'; API key required' if api_key else ''}\n")
    if kernel_choice is not None:  # after the line above, which clients starting a server wait for first
        out.write(f"{kernel_choice}\n")
    out.flush()
    engine.start()
    # uvicorn cancels what is still running DRAIN_GRACE_S after our drain: by then every response has its end
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=settings.drain_s + DRAIN_GRACE_S,
                            access_log=False)
    http = uvicorn.Server(config)
    return http, sock


__all__ = ["API_KEY_VARIABLE", "bind", "prepare", "serve"]
