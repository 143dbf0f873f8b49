"""What the scripts that compare convert's files on the bundled evaluation text share: convert from an
argument list, the stock file they are compared with, a fresh copy of a calibration artifact, the long-context
perplexity of each kind, and a JSON line written with its row's files removed after."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def add_evaluation_arguments(parser: argparse.ArgumentParser) -> None:
    """--eval-chunks (convert's own held-out perplexity at 512), --long-ctx, --long-chunks and --threads."""
    parser.add_argument("--eval-chunks", type=int, default=64, help="chunks of 512 (64: all of each kind's text)")
    parser.add_argument("--long-ctx", type=int, default=4096)
    parser.add_argument("--long-chunks", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)


def convert(argv: list[str]):
    """`python -m nbl_gguf convert ARGV`, in this process: its Summary."""
    from nbl_gguf.commands import convert as convert_command

    command = argparse.ArgumentParser()
    convert_command.add_arguments(command)
    return convert_command.convert(command.parse_args(argv))


def stock_file(model: str, quant: str, directory: Path, threads: int | None) -> Path:
    """The stock file convert's files of ``model`` at ``quant`` are cut from: a GGUF model itself (its own types:
    quant "default"), a HF folder converted and quantized (convert's --m 0 writes none: it asks what to replace)."""
    from nbl_gguf.commands.convert import DEFAULT_QUANT
    from nbl_gguf.commands.model_files import resolve_model_dir, stock_ladder
    from nbl_gguf.model_source import is_gguf_file

    if is_gguf_file(model):
        if quant != "default":
            raise SystemExit(f"{model} is a GGUF file: its stock file keeps its own types (--quants default)")
        return Path(model)
    quant = (DEFAULT_QUANT if quant == "default" else quant).upper()
    return stock_ladder(resolve_model_dir(model), [quant], Path(directory), threads, print)[quant]


def fresh_copy(calibration: Path, copy: Path) -> Path:
    """The artifact's maps and report copied into ``copy``: whatever a row adds to it stays out of the original."""
    from nbl_gguf.calibration.artifact import REPORT, WEIGHTS

    copy.mkdir()
    for name in (WEIGHTS, REPORT):
        shutil.copy2(Path(calibration) / name, copy / name)
    return copy


def long_perplexities(path: Path, texts: dict, n_ctx: int, chunks: int, threads: int | None) -> dict:
    """{kind: llama-perplexity of ``path`` on that kind's text at ``n_ctx``}."""
    from nbl_gguf.llamacpp.perplexity import perplexity

    return {kind: perplexity(path, text, n_ctx=n_ctx, chunks=chunks, threads=threads).ppl for kind, text in texts.items()}


def write_row(out, row: dict, files, copy: Path) -> None:
    """``row`` printed and appended to ``out`` as one JSON line; then the row's files and artifact copy removed."""
    print(json.dumps(row), flush=True)
    out.write(json.dumps(row) + "\n")
    out.flush()
    for path in files:
        Path(path).unlink(missing_ok=True)
    shutil.rmtree(copy, ignore_errors=True)
