"""Where the patched llama.cpp lives: its source tree (converter, gguf-py) and its binaries.

scripts/build_llama.sh (driving the top-level CMakeLists.txt) fills ``build/``:
``build/llama.cpp-src`` is the pinned upstream tree with patches/ applied, ``build/bin`` holds
libllama and the tools. ``NBL_GGUF_BUILD`` points elsewhere, e.g. at a CUDA build.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from nbl_gguf.errors import NblError

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


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
    completed = subprocess.run([str(tool(name)), *map(str, args)], capture_output=True, text=True, errors="replace", **kwargs)
    if completed.returncode != 0:
        tail = "\n".join((completed.stdout + completed.stderr).strip().splitlines()[-15:])
        raise NblError(f"{name} failed (exit {completed.returncode}):\n{tail}")
    return completed
