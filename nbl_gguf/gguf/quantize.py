"""Quantization with the patched llama.cpp tools: ``llama-quantize`` and, optionally, an importance
matrix from ``llama-imatrix`` over calibration text.

Both run on NBL GGUFs: the patched tools know the ``attn_nbl`` tensors and the layer map.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Iterable

from nbl_gguf.errors import NblError
from nbl_gguf.llamacpp.tools import run_tool, tool
from nbl_gguf.outputs import atomic_write

# "   15  or  Q4_K_M  :  4.58G, ..."   and   "          COPY    : only copy tensors"
_TYPE_LINE = re.compile(r"^\s+(?:\d+\s+or\s+)?([A-Z][A-Z0-9_]*)\s+:")
FLOAT_TYPES = ("F32", "F16", "BF16")


@functools.lru_cache(maxsize=None)
def _types_of(binary: str) -> tuple[str, ...]:
    completed = subprocess.run([binary, "--help"], capture_output=True, text=True)
    text = completed.stdout + completed.stderr
    start = text.find("allowed quantization types")
    names = []
    for line in text[start:].splitlines() if start >= 0 else []:
        match = _TYPE_LINE.match(line)
        if match and match.group(1) != "COPY":
            names.append(match.group(1))
    if not names:
        raise NblError(f"could not read the list of quantization types from {binary} --help")
    return tuple(names)


def check_quant(quant: str) -> str:
    """The llama-quantize spelling of ``quant`` (f32/f16/bf16 need no tool)."""
    if quant.upper() in FLOAT_TYPES:
        return quant.upper()
    return normalize_quant(quant)


def quant_types() -> tuple[str, ...]:
    """The type names llama-quantize offers (upper case, as it prints them; COPY left out)."""
    return _types_of(str(tool("llama-quantize")))


def normalize_quant(name: str) -> str:
    """``name`` as llama-quantize spells it (case-insensitive match), or a clear NblError."""
    wanted = name.strip().upper()
    types = quant_types()
    if wanted not in types:
        raise NblError(f"unknown quantization type '{name}'; llama-quantize offers: "
                       + ", ".join(t.lower() for t in types))
    return wanted


def quantize(src: str | os.PathLike, dst: str | os.PathLike, quant: str, *, imatrix: str | os.PathLike | None = None,
             threads: int | None = None, extra_args: Iterable[str] = ()) -> Path:
    """``llama-quantize [--imatrix FILE] src dst TYPE [threads]``; ``dst`` appears only once complete."""
    args, cwd = [*extra_args], None
    if imatrix is not None:
        # llama-quantize records the imatrix path in the GGUF: run next to it and pass the bare
        # name, so that the bytes do not depend on a temp dir's random name
        imatrix = Path(imatrix).resolve()
        cwd = str(imatrix.parent)
        args += ["--imatrix", imatrix.name]
    return _llama_quantize(src, dst, normalize_quant(quant), args, cwd=cwd, threads=threads)


def prune_blocks(src: str | os.PathLike, dst: str | os.PathLike, blocks: Iterable[int], *,
                 threads: int | None = None) -> Path:
    """``llama-quantize --prune-layers B,... src dst COPY``: the file without those decoder blocks, every
    other tensor's bytes kept (llama.cpp's own layer pruning, a baseline of ours)."""
    blocks = sorted(set(int(b) for b in blocks))
    if not blocks:
        raise NblError("no blocks to prune")
    return _llama_quantize(src, dst, "COPY", ["--prune-layers", ",".join(map(str, blocks))], threads=threads)


def _llama_quantize(src, dst, qtype: str, args: list[str], *, cwd=None, threads: int | None = None) -> Path:
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise NblError(f"{src} does not exist")
    if src.resolve() == dst.resolve():
        raise NblError("llama-quantize must not overwrite its input")
    with atomic_write(dst) as tmp:
        args = [*args, str(src.resolve()), str(tmp.resolve()), qtype]
        if threads:
            args.append(str(threads))
        run_tool("llama-quantize", args, cwd=cwd)
        if not tmp.is_file() or tmp.stat().st_size == 0:
            raise NblError(f"llama-quantize wrote no output for {src}")
    return dst


def compute_imatrix(model: str | os.PathLike, texts: Iterable[str] | str, output: str | os.PathLike, *,
                    ctx: int = 512, chunks: int | None = None, threads: int | None = None,
                    seed: int = 0) -> Path:
    """Run ``llama-imatrix`` of ``model`` (an F32/F16 GGUF) over ``texts``; writes ``output`` (GGUF imatrix)."""
    text = texts if isinstance(texts, str) else "\n\n".join(t for t in texts if t)
    if not text.strip():
        raise NblError("no calibration text for the importance matrix")
    output = Path(output)
    with atomic_write(output) as tmp_out:
        with tempfile.TemporaryDirectory(prefix="nbl-imatrix-") as tmpdir:
            text_file = Path(tmpdir) / "calibration.txt"
            text_file.write_text(text, encoding="utf-8")
            # the text file's name is recorded in the imatrix: run next to it with the bare name
            args = ["-m", str(Path(model).resolve()), "-f", text_file.name, "-o", str(tmp_out.resolve()),
                    "--output-format", "gguf",
                    "-c", str(ctx), "--no-ppl", "--output-frequency", "1000000", "--seed", str(seed)]
            if chunks:
                args += ["--chunks", str(chunks)]
            if threads:
                args += ["-t", str(threads)]
            run_tool("llama-imatrix", args, cwd=tmpdir)
        if not tmp_out.is_file() or tmp_out.stat().st_size == 0:
            raise NblError(f"llama-imatrix wrote no importance matrix for {model}")
    return output


def imatrix_columns(imatrix: str | os.PathLike, names: Iterable[str]):
    """The column weights llama-quantize takes from ``imatrix`` (llama-imatrix's GGUF) for the first of
    ``names`` it has: the summed squared activations over their count, float32 [n_per_row]; None when it
    has none of them."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(imatrix)
    tensors = {t.name: t for t in reader.tensors}
    for name in names:
        sums, counts = tensors.get(f"{name}.in_sum2"), tensors.get(f"{name}.counts")
        if sums is None or counts is None:
            continue
        counts, sums = np.asarray(counts.data).reshape(-1), np.asarray(sums.data, dtype=np.float32)
        if counts.size != 1 or (sums.ndim > 1 and sums.shape[0] != 1):
            raise NblError(f"{imatrix}: {name} has per-expert data; an NBL weight takes one row")
        sums = sums.reshape(-1)
        # llama-quantize's rule for an entry that saw no tokens: all ones
        return sums / float(counts[0]) if counts[0] > 0 else np.ones_like(sums)
    return None
