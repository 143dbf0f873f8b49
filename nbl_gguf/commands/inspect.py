"""`inspect`: the NBL layer map of a GGUF (stock files too), its provenance, tensors and KV cache cost
(as data and as text: nbl_gguf.gguf.inspect; the reading: nbl_gguf.gguf.metadata)."""

from __future__ import annotations

import argparse
import json

from nbl_gguf.commands import flags
from nbl_gguf.errors import NblError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="a GGUF file (NBL or stock)")
    parser.add_argument("--json", action="store_true",
                        help="print everything inspect knows (the whole calibration record, every tensor) as JSON")
    parser.add_argument("--tensors", action="store_true", help="also list every tensor (text output)")
    parser.add_argument("-c", "--ctx-size", type=flags.positive_int, default=None, metavar="N",
                        help="context of the KV cache figures (default: the model's training context, which "
                             "llama-cli and llama-server allocate when not given -c)")
    flags.add_ubatch_size(parser)


def run(args: argparse.Namespace) -> int:
    from nbl_gguf.gguf.inspect import describe, format_text

    if args.json and args.tensors:
        raise NblError("--tensors means nothing with --json: the JSON lists every tensor")
    info = describe(args.file, args.ctx_size, args.ubatch_size)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_text(info, with_tensors=args.tensors))
    return 0
