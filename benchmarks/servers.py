"""The servers `bench.py serve` drives, each in a process of its own: ours (scripts/serve.py) and
llama.cpp's `llama-server`, started, awaited until they answer, and stopped as a user stops them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from lm.util.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


class ServerProcess:
    """scripts/serve.py in a process of its own on a free port; `url` once it listens."""

    def __init__(self, ckpt: Path, slots: int, settings: list[str]):
        command = [sys.executable, str(ROOT / "scripts" / "serve.py"), f"ckpt={ckpt}", "port=0",
                   f"max_batch={slots}", "max_queue=1024", "drain_s=0", *settings]
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        banner = self.process.stderr.readline()
        if " at http://" not in banner:
            self.process.kill()
            raise ConfigError(f"the server did not start: {banner.strip() or self.process.stderr.read().strip()}")
        self.url = banner.split(" at ", 1)[1].split()[0].removesuffix("/v1")
        # What it writes later is read as it comes, so a full pipe never stops the server.
        threading.Thread(target=self.process.stderr.read, daemon=True).start()

    def close(self) -> None:
        stop(self.process)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM, as a user stops a server; SIGKILL if it has not exited within 30 s."""
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()


def find_llama_server(path: str | None) -> Path | None:
    """`--llama-server PATH`, else `llama-server` beside this Python (where `make llama-server` puts it) or
    on PATH; None where there is none. A path given that is not a program is an error, not a skip."""
    if path:
        found = shutil.which(path)
        if found is None:
            raise ConfigError(f"--llama-server {path}: not an executable file")
        return Path(found)
    beside = Path(sys.executable).parent / "llama-server"
    found = beside if os.access(beside, os.X_OK) else shutil.which("llama-server")
    return Path(found) if found else None


def free_port() -> int:
    """A loopback port free now (llama-server takes no port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServerProcess:
    """llama.cpp's `llama-server` on a GGUF file: `slots` parallel sequences of `context` tokens each,
    decoded together (its continuous batching), on `threads` threads; `url` once its model is loaded."""

    def __init__(self, binary: Path, gguf: Path, slots: int, context: int, threads: int,
                 cache_type: str | None = None, timeout: float = 300):
        port = free_port()
        command = [str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                   "--parallel", str(slots), "--ctx-size", str(slots * context), "--threads", str(threads),
                   "--threads-batch", str(threads), "--cont-batching", "--n-gpu-layers", "0"]
        if cache_type:
            command += ["--cache-type-k", cache_type, "--cache-type-v", cache_type]
        self.log = tempfile.TemporaryFile(mode="w+")  # its log, read back only to say why it did not start
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        try:
            self._wait_until_loaded(timeout)
        except BaseException:  # Ctrl-C while it loads too: no server is left running
            self.close()
            raise

    def _wait_until_loaded(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while True:  # /health answers 503 while the model loads, 200 once it serves
            if self.process.poll() is not None:
                self.log.seek(0)
                last = (self.log.read().strip().splitlines() or ["no output"])[-1]
                raise ConfigError(f"llama-server exited with {self.process.returncode}: {last}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise ConfigError(f"llama-server did not answer /health within {timeout:.0f} s")
            time.sleep(0.2)

    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        """Its greedy continuation of `prompt` as token ids (the native /completion route returns them)."""
        import httpx

        # ignore_eos: lm.generate, given no eos_id, runs on past the end-of-text token too
        body = {"prompt": prompt, "n_predict": new_tokens, "temperature": 0, "top_k": 1, "cache_prompt": False,
                "return_tokens": True, "ignore_eos": True}
        reply = httpx.post(f"{self.url}/completion", json=body, timeout=600)
        tokens = reply.json().get("tokens") if reply.status_code == 200 else None
        if not isinstance(tokens, list):
            raise ConfigError(f"llama-server's /completion answered {reply.status_code} without token ids "
                              f"(a llama-server too old for return_tokens?): {reply.text[:200]}")
        return tokens

    def close(self) -> None:
        stop(self.process)
        self.log.close()


def llama_server_version(binary: Path) -> str:
    """Its `--version` line ("version: 0.5.0-dev (build 1, commit 0c1e570)"), for the results."""
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("version:")]
    return lines[0].removeprefix("version:").strip() if lines else "unknown"
