"""Thin command-line front end: each sub-command lives in its own pipeline module.

A module registered here exposes ``add_arguments(parser)`` and ``run(args) -> int``. Modules are
imported only when their command runs, so ``inspect`` does not pay for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from nbl_gguf.errors import NblError

COMMANDS = {
    "calibrate": ("nbl_gguf.calibration.calibrate", "collect statistics, solve NBL weights, score and select layers"),
    "convert": ("nbl_gguf.gguf.convert", "HF model -> NBL GGUF (calibrate, convert, rewrite, quantize)"),
    "inspect": ("nbl_gguf.gguf.inspect", "show the NBL layer map, scores and tensors of a GGUF"),
    "bench": ("nbl_gguf.measurement.bench", "speed and memory of NBL GGUFs against stock with llama-bench"),
    "eval": ("nbl_gguf.measurement.eval", "perplexity and multiple-choice accuracy with llama-perplexity"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="nbl_gguf", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    name = argv[0]
    if name not in COMMANDS:
        parser.parse_args(argv)  # prints the usage error and exits
    module_name, help_text = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name == module_name:
            print(f"nbl_gguf: the '{name}' command is not available in this build", file=sys.stderr)
            return 2
        raise
    command_parser = argparse.ArgumentParser(prog=f"nbl_gguf {name}", description=help_text)
    module.add_arguments(command_parser)
    args = command_parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except NblError as error:
        print(f"nbl_gguf {name}: error: {error}", file=sys.stderr)
        return 2
