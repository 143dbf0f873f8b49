"""Running the patched ``llama-perplexity`` on a GGUF and parsing its perplexity.

The runtime's own measure of a file: `convert` reports it for the files it writes, and measurement
(eval, the sweep) builds its task accuracies on the same runner.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from nbl_gguf.errors import NblError
from nbl_gguf.llamacpp.cache_types import cache_type_flags

DEFAULT_CTX = 512
FLOAT = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|-?inf)"  # a number as llama.cpp prints it
_PPL_FINAL = re.compile(r"Final estimate: PPL = " + FLOAT + r" \+/- " + FLOAT)
_PPL_SETUP = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)")
# --ppl-output-type 1: "%8d  %.4lf  %4lf  %4lf" = position, running PPL, mean NLL, its standard error
_PPL_CHUNK = re.compile(r"^\s*(\d+)\s+" + FLOAT + r"\s+" + FLOAT + r"\s+" + FLOAT + r"\s*$", re.M)
# LOG_ERR lines, with or without the "M.s.ms.us E " prefix
_ERROR_LINE = re.compile(r"^(?:[\d.]+ )?E (.+)$", re.M)


@dataclass
class Perplexity:
    ppl: float
    error: float  # llama-perplexity's "+/-": ppl * standard error of the mean token NLL
    chunks: int
    n_ctx: int

    @property
    def tokens(self) -> int:
        """Scored tokens: n_ctx - n_ctx/2 - 1 per chunk."""
        return self.chunks * (self.n_ctx - self.n_ctx // 2 - 1)


class IncompleteOutput(NblError):
    """llama-perplexity ended without printing all of its results."""


def tool_errors(output: str) -> list[str]:
    return [m.group(1).strip() for m in _ERROR_LINE.finditer(output)]


def parse_perplexity(output: str) -> Perplexity:
    setup = _PPL_SETUP.search(output)
    if setup is None:
        errors = tool_errors(output)
        raise NblError("llama-perplexity computed no perplexity" + (": " + " | ".join(errors) if errors else ""))
    chunks, n_ctx = int(setup.group(1)), int(setup.group(2))
    final = _PPL_FINAL.search(output)
    if final:
        return Perplexity(float(final.group(1)), float(final.group(2)), chunks, n_ctx)
    # the running line after the last chunk carries the same numbers (with --ppl-output-type 1)
    lines = _PPL_CHUNK.findall(output)
    if len(lines) >= chunks:
        _, ppl, _, stderr = lines[chunks - 1]
        return Perplexity(float(ppl), float(ppl) * float(stderr), chunks, n_ctx)
    raise IncompleteOutput(f"llama-perplexity stopped after {len(lines)} of {chunks} chunks without a final estimate")


def run_perplexity_tool(model: str | os.PathLike, args: Sequence[str], parse, *, threads: int | None = None, cwd=None):
    """Run llama-perplexity on ``model`` and parse its output (IncompleteOutput if results are missing)."""
    from nbl_gguf.llamacpp.tools import run_measured, tool

    binary = tool("llama-perplexity")
    model = Path(model)
    if not model.is_file():
        raise NblError(f"{model} does not exist")
    command = [str(binary), "-m", str(model), *map(str, args)]
    if threads:
        command += ["-t", str(threads)]
    done = run_measured(command, "llama-perplexity", cwd=cwd, errors="replace")
    output = done.stdout + "\n" + done.stderr
    if done.returncode != 0:
        errors = tool_errors(output) or output.strip().splitlines()[-5:]
        raise NblError(f"llama-perplexity failed on {model.name} (exit {done.returncode}): " + " | ".join(errors))
    try:
        return parse(output)
    except IncompleteOutput as error:
        raise IncompleteOutput(f"{error} ({model.name})") from None


def perplexity(model, text_file, *, n_ctx: int = DEFAULT_CTX, chunks: int | None = None, batch: int | None = None,
               threads: int | None = None, cache_type: str = "f16") -> Perplexity:
    """``cache_type``: the KV cache's (-ctk/-ctv), llama.cpp's F16 by default."""
    args = ["-f", str(text_file), "-c", str(n_ctx), "--ppl-output-type", "1"]
    args += cache_type_flags(cache_type)
    if chunks:
        args += ["--chunks", str(chunks)]
    if batch:
        args += ["-b", str(batch)]
    return run_perplexity_tool(model, args, parse_perplexity, threads=threads)
