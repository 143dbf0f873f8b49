"""`soak`: llama-server with an NBL GGUF under many concurrent greedy clients for minutes; every response
must equal a single client's and the server's memory must stay flat (nbl_gguf.measurement.soak).

    python -m nbl_gguf soak                      # the embedded SmolLM2, --m 4, q4_k_m, 5 minutes
    python -m nbl_gguf soak --model F.gguf --duration 30 -o out/soak.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path

from nbl_gguf.commands import flags
from nbl_gguf.measurement.soak import CONVERT_DEFAULT, DEFAULT_MODEL, SoakSettings, print_summary, soak


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_model(parser, f"NBL GGUF (default: {DEFAULT_MODEL}, made by convert {' '.join(CONVERT_DEFAULT[:4])} "
                            f"if missing)")
    d = SoakSettings  # the defaults are the settings' own
    parser.add_argument("--duration", type=float, default=d.duration,
                        help=f"seconds of concurrent load (default: {d.duration:g})")
    parser.add_argument("--clients", type=int, default=d.clients,
                        help=f"concurrent clients and server slots (default: {d.clients})")
    parser.add_argument("--max-requests", type=int, default=d.max_requests,
                        help=f"request bound (default: {d.max_requests})")
    parser.add_argument("--n-predict", type=int, default=d.n_predict,
                        help=f"tokens generated per request (default: {d.n_predict})")
    parser.add_argument("--prompt-scale", type=float, default=d.prompt_scale,
                        help="prompt lengths relative to the default set (a byte-vocabulary test model: 0.25)")
    parser.add_argument("--ctx-per-slot", type=int, default=d.ctx_per_slot,
                        help=f"context per slot (default: {d.ctx_per_slot})")
    parser.add_argument("--cache-reuse", type=int, default=d.cache_reuse,
                        help=f"llama-server --cache-reuse: shortest chunk reused by KV shifting (default: {d.cache_reuse})")
    parser.add_argument("--no-cache-prompt", action="store_true",
                        help="requests with cache_prompt false: every prompt is evaluated whole, as in the reference "
                             "(isolates the concurrent decoding from the prompt cache's numerics)")
    flags.add_threads(parser, "of llama-server, its -t (default: its own)")
    flags.add_seed(parser, "the clients' orders of the prompts and of the server's sampling")
    parser.add_argument("--warmup", type=float, default=d.warmup,
                        help="seconds of the concurrent phase before memory must be flat (default: 20%% of --duration)")
    parser.add_argument("--rss-tolerance-mib", type=float, default=d.rss_tolerance_mib,
                        help=f"allowed RSS growth from the end of the warm-up to the end (default: {d.rss_tolerance_mib:g} MiB)")
    parser.add_argument("--request-timeout", type=float, default=d.request_timeout)
    parser.add_argument("--port", type=int, default=d.port, help="default: a free port")
    parser.add_argument("--server-arg", action="append", default=[], help="extra llama-server argument (repeatable)")
    parser.add_argument("--server-log", default=d.server_log, help="write llama-server's log here")
    flags.add_output(parser, "write the result here as JSON", metavar="FILE")


def run(args: argparse.Namespace) -> int:
    """Exits 1 when a request failed, a response differed from the reference or the memory grew by more
    than --rss-tolerance-mib after the warm-up."""
    from nbl_gguf.outputs import atomic_write, check_output_file

    output = check_output_file(args.output) if args.output else None  # before minutes of load, not after
    values = {f.name: getattr(args, f.name) for f in fields(SoakSettings)}
    settings = SoakSettings(**(values | {"server_arg": tuple(args.server_arg)}))
    command = flags.invocation("soak")
    result = soak(Path(args.model) if args.model else None, settings, command)
    if output is not None:
        with atomic_write(output) as tmp:
            tmp.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print_summary(result)
    return 0 if result["soak"]["passed"] else 1
