"""A llama-server process on a free 127.0.0.1 port, for the tests that talk to it over HTTP."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from nbl_gguf.llamacpp import tools as llamacpp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


@contextmanager
def running_llama_server(model: Path, log: Path, *arguments: str, start_timeout: float = 60):
    """Yields the port once /health answers 200; stops the server on exit. Its stderr goes to ``log``,
    a file rather than a pipe that nobody reads while the server runs (a full pipe would stall it)."""
    port = free_port()
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            [str(llamacpp.tool("llama-server")), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
             *arguments], stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("llama-server did not start:\n" + Path(log).read_text(errors="replace")[-3000:])
            time.sleep(0.2)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=30)
