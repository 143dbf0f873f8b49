"""`soak`: llama-server with an NBL GGUF under many concurrent greedy clients for minutes; every response
must equal a single client's and the server's memory must stay flat (nbl_gguf.measurement.soak).

    python -m nbl_gguf soak                      # the embedded SmolLM2, --m 4, q4_k_m, 5 minutes
    python -m nbl_gguf soak --model F.gguf --duration 30 -o out/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields
from pathlib import Path

from nbl_gguf.commands import flags
from nbl_gguf.measurement.soak import CONVERT_DEFAULT, DEFAULT_MODEL, SoakSettings, print_summary, soak


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_model(parser, f"NBL GGUF (default: {DEFAULT_MODEL}, made by convert {' '.join(CONVERT_DEFAULT[:4])} "
                            f"if missing)")
    parser.add_argument("--duration", type=float, default=300, help="seconds of concurrent load (default: 300)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients and server slots (default: 8)")
    parser.add_argument("--max-requests", type=int, default=20000, help="request bound (default: 20000)")
    parser.add_argument("--n-predict", type=int, default=24, help="tokens generated per request (default: 24)")
    parser.add_argument("--prompt-scale", type=float, default=1.0,
                        help="prompt lengths relative to the default set (a byte-vocabulary test model: 0.25)")
    parser.add_argument("--ctx-per-slot", type=int, default=2048, help="context per slot (default: 2048)")
    parser.add_argument("--cache-reuse", type=int, default=64,
                        help="llama-server --cache-reuse: shortest chunk reused by KV shifting (default: 64)")
    parser.add_argument("--no-cache-prompt", action="store_true",
                        help="requests with cache_prompt false: every prompt is evaluated whole, as in the reference "
                             "(isolates the concurrent decoding from the prompt cache's numerics)")
    flags.add_threads(parser, "of llama-server, its -t (default: its own)")
    flags.add_seed(parser, "the clients' orders of the prompts and of the server's sampling")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds of the concurrent phase before memory must be flat (default: 20%% of --duration)")
    parser.add_argument("--rss-tolerance-mib", type=float, default=8.0,
                        help="allowed RSS growth from the end of the warm-up to the end (default: 8 MiB)")
    parser.add_argument("--request-timeout", type=float, default=300)
    parser.add_argument("--port", type=int, default=0, help="default: a free port")
    parser.add_argument("--server-arg", action="append", default=[], help="extra llama-server argument (repeatable)")
    parser.add_argument("--server-log", default=None, help="write llama-server's log here")
    flags.add_output(parser, "write the result here as JSON", metavar="FILE")


def run(args: argparse.Namespace) -> int:
    """Exits 1 when a request failed, a response differed from the reference or the memory grew by more
    than --rss-tolerance-mib after the warm-up."""
    from nbl_gguf.outputs import atomic_output, check_output_file

    output = check_output_file(args.output) if args.output else None  # before minutes of load, not after
    values = {f.name: getattr(args, f.name) for f in fields(SoakSettings)}
    settings = SoakSettings(**(values | {"server_arg": tuple(args.server_arg)}))
    command = "python -m nbl_gguf soak " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["soak"] else sys.argv[1:])
    result = soak(Path(args.model) if args.model else None, settings, command)
    if output is not None:
        tmp = atomic_output(output)
        tmp.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, output)
    print_summary(result)
    return 0 if result["soak"]["passed"] else 1
