"""Where the patched llama.cpp lives: its source tree (converter, gguf-py) and its binaries.

scripts/build_llama.sh (driving the top-level CMakeLists.txt) fills ``build/``:
``build/llama.cpp-src`` is the pinned upstream tree with patches/ applied, ``build/bin`` holds
libllama and the tools. ``NBL_GGUF_BUILD`` points elsewhere, e.g. at a CUDA build.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

from nbl_gguf.errors import NblError

# peak resident sizes of the tools that exited, in order: [(tool, bytes)] (nbl_gguf.usage reads them)
CHILD_PEAKS: list[tuple[str, int]] = []

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
POLL_S = 0.02  # how often run_measured reads a running tool's peak


def build_dir() -> Path:
    return Path(os.environ.get("NBL_GGUF_BUILD", REPO_ROOT / "build")).resolve()


def source_dir() -> Path:
    return build_dir() / "llama.cpp-src"


def bin_dir() -> Path:
    return build_dir() / "bin"


def tool(name: str) -> Path:
    """Path of a patched llama.cpp tool such as ``llama-quantize``."""
    path = bin_dir() / name
    if not path.is_file():
        raise NblError(
            f"{name} not found in {bin_dir()}: build the patched llama.cpp first (bash scripts/build_llama.sh)"
        )
    return path


def run_tool(name: str, args: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run a llama.cpp tool; a non-zero exit becomes an NblError carrying the tool's last output."""
    # generated text from a random test model need not be valid UTF-8
    completed = run_measured([str(tool(name)), *map(str, args)], name, errors="replace", **kwargs)
    if completed.returncode != 0:
        tail = "\n".join((completed.stdout + completed.stderr).strip().splitlines()[-15:])
        raise NblError(f"{name} failed (exit {completed.returncode}):\n{tail}")
    return completed


def high_water_mark(pid: int | str = "self") -> int | None:
    """A process's peak resident set (its VmHWM, which starts afresh at exec), or None where /proc cannot
    say (another system, a process gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def run_measured(command: list[str], label: str, *, timeout: float | None = None, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True)`` that also records the child's peak
    resident memory (CHILD_PEAKS: the tools map their model files, so their peaks are reported apart
    from the Python process's). The peak is the child's VmHWM, read every POLL_S while it runs: the
    kernel's figure when it is reaped (ru_maxrss) also counts the parent's own peak at the fork, so a
    tool started by a 4 GiB Python process would read 4 GiB (measured: /bin/true read 813 MiB). Where
    /proc cannot be read, ru_maxrss is kept, with that caveat."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs) as process:
        streams = {}
        readers = [threading.Thread(target=lambda name=name, pipe=pipe: streams.__setitem__(name, pipe.read()))
                   for name, pipe in (("stdout", process.stdout), ("stderr", process.stderr))]
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        own_peak = None  # Popen returns once the exec has succeeded: from here /proc shows the tool's own memory
        try:
            while True:
                peak = high_water_mark(process.pid)
                if peak is not None:
                    own_peak = peak
                pid, status, usage = os.wait4(process.pid, os.WNOHANG)
                if pid:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(command, timeout)
                time.sleep(POLL_S)
        except BaseException:
            process.kill()
            process.wait()
            raise
        finally:
            for reader in readers:
                reader.join()
        process.returncode = os.waitstatus_to_exitcode(status)
    CHILD_PEAKS.append((label, own_peak if own_peak is not None else usage.ru_maxrss * 1024))
    return subprocess.CompletedProcess(command, process.returncode, streams.get("stdout", ""), streams.get("stderr", ""))
