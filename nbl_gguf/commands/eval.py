"""`eval`: perplexity and multiple-choice accuracy of GGUFs through the patched ``llama-perplexity``.

    python -m nbl_gguf eval A.gguf B.gguf [--text FILE] [--hellaswag F] [--winogrande F] [--multiple-choice F]
    python -m nbl_gguf eval --sweep --m 2 4 8 12 --quant q8_0 q4_k_m -o docs/results

The first form evaluates the given GGUFs; the sweep (eval_sweep) builds baseline / Attn NBL-m /
Attn DROP-m GGUFs from one calibration artifact, evaluates them, evaluates the same configurations
(and Block NBL-m) in PyTorch float32 with llama-perplexity's chunking, benchmarks speed with
llama-bench, and writes a markdown table, a CSV and a plot.

The stages: llama-perplexity and its tasks (nbl_gguf.measurement.perplexity, tasks), the sweep's
pieces (nbl_gguf.measurement.sweep, sweep_report, torch_ppl).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from nbl_gguf.calibration.artifact import CRITERIA, DEFAULT_CRITERION
from nbl_gguf.commands import flags
from nbl_gguf.errors import NblError
from nbl_gguf.measurement.perplexity import DEFAULT_CTX

SWEEP_GROUP = "sweep (--sweep)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("models", nargs="*", metavar="GGUF", help="GGUF files to evaluate (not with --sweep)")
    parser.add_argument("--text", default=None,
                        help="perplexity text file (default: the held-out part of the bundled C4 sample)")
    parser.add_argument("--no-ppl", action="store_true", help="skip perplexity")
    parser.add_argument("-c", "--ctx-size", type=flags.positive_int, default=DEFAULT_CTX, metavar="N",
                        help=f"llama-perplexity context: perplexity chunk size, and the context that "
                             f"multiple-choice tasks are packed into (default: {DEFAULT_CTX})")
    parser.add_argument("--chunks", type=int, default=None, help="perplexity chunks (default: all the text)")
    parser.add_argument("-b", "--batch-size", type=int, default=None, help="llama-perplexity batch size")
    flags.add_threads(parser, "of llama.cpp, and of PyTorch in the sweep (default: the tools' own)")
    parser.add_argument("--hellaswag", default=None, metavar="FILE", help="HellaSwag file (llama.cpp text format)")
    parser.add_argument("--hellaswag-tasks", type=int, default=None, help="HellaSwag tasks (default: all)")
    parser.add_argument("--winogrande", default=None, metavar="FILE", help="Winogrande CSV (llama.cpp format)")
    parser.add_argument("--winogrande-tasks", type=int, default=None, help="Winogrande tasks (default: all)")
    parser.add_argument("--multiple-choice", default=None, metavar="FILE",
                        help="binary multiple-choice file (llama.cpp format: ARC, MMLU, TruthfulQA, ...)")
    parser.add_argument("--multiple-choice-tasks", type=int, default=None, help="tasks (default: all)")
    parser.add_argument("--cache-type", default="f16", metavar="TYPE",
                        help="KV cache type (llama.cpp's -ctk/-ctv: f16, q8_0, q4_0, ...) of the perplexity and the "
                             "passkey test: the one the file is to run with (default: f16)")
    parser.add_argument("--passkey", type=flags.int_list, default=None, metavar="N[,N]",
                        help="passkey retrieval at these prompt lengths in tokens (a number hidden in filler text "
                             "at each --passkey-depths, asked for at the end): what window and replaced layers "
                             "lose shows here when perplexity barely moves")
    parser.add_argument("--passkey-depths", default=None, metavar="D[,D]",
                        help="--passkey: where the number sits, 0 (start) to 1 (end) (default: 0.1,0.3,0.5,0.7,0.9)")
    flags.add_output(parser, "also write the results as JSON to this file; with --sweep: the folder that gets "
                             "quality.md, quality.csv and quality.png (default: the --work folder)")
    flags.add_no_progress(parser)
    sweep = parser.add_argument_group(SWEEP_GROUP)
    sweep.add_argument("--sweep", action="store_true",
                       help="baseline, Attn NBL-m, Attn DROP-m (GGUF and PyTorch) and Block NBL-m (PyTorch) for each m")
    flags.add_model(sweep, "HF model or GGUF file (default: embedded SmolLM2-135M-Instruct); a GGUF is the baseline "
                           "itself and each configuration the NBL surgery on it, in its own types")
    flags.add_calibration(sweep, "calibration artifact to use (default: calibrate once into the work dir)")
    sweep.add_argument("--nsamples", type=int, default=32, help="calibration windows when calibrating (default: 32)")
    sweep.add_argument("--seqlen", type=int, default=512, help="calibration window length (default: 512)")
    flags.add_device(sweep, "while the sweep calibrates")
    flags.add_dtype(sweep, "while the sweep calibrates")
    flags.add_m_list(sweep, "layers replaced (default: 2 4 8 12)", default=[2, 4, 8, 12])
    sweep.add_argument("--quant", nargs="+", default=None,
                       help="GGUF types of a HF model (default: q8_0 q4_k_m; not with a GGUF --model)")
    sweep.add_argument("--methods", nargs="+", default=["attn-nbl", "attn-drop", "block-nbl"],
                       choices=["attn-nbl", "attn-drop", "block-nbl"], help="methods (default: all three)")
    sweep.add_argument("--criterion", default=DEFAULT_CRITERION, choices=("best",) + CRITERIA,
                       help="layer selection of the main sweep: best (the default of calibrate and convert: for each "
                            "m, the criterion whose layers cost least on held-out calibration windows; every "
                            "criterion then gets its rows) or one local criterion")
    sweep.add_argument("--extra-criteria", nargs="*", default=["cca", "nmse"], choices=CRITERIA,
                       help="also run Attn NBL-m and Attn DROP-m with these criteria's layers (default: cca, the NBL "
                            "paper's, and nmse; give none for no extra rows)")
    sweep.add_argument("--criteria-first-quant", action="store_true",
                       help="measure the rows of the other criteria in the first --quant type only (a large model's "
                            "sweep: the main rows keep every type)")
    sweep.add_argument("--criteria-m", type=int, default=8,
                       help="compare the cca, nmse and cosine selections at this m (Attn NBL and Attn DROP, "
                            "first --quant; 0 = skip; default: 8)")
    sweep.add_argument("--no-pytorch", action="store_true", help="skip the PyTorch float32 evaluations")
    sweep.add_argument("--no-bench", action="store_true", help="skip the llama-bench speed measurement")
    sweep.add_argument("--bench-args", default="-p 128 -n 32 -r 2",
                       help="llama-bench arguments for the speed-up (default: '-p 128 -n 32 -r 2')")
    sweep.add_argument("--work", default="out/eval", help="GGUFs, calibration and cached results (default: out/eval)")
    sweep.add_argument("--fresh", action="store_true", help="ignore cached results in the work dir")
    # the spelling before -o, kept for the commands recorded in docs/results
    sweep.add_argument("--out", dest="out_alias", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.ctx_size < 8:
        raise NblError(f"--ctx-size {args.ctx_size} is too small")
    if args.out_alias is not None:
        if not args.sweep:
            raise NblError(f"--out {args.out_alias} is the sweep's report folder: give -o FILE for the JSON results")
        if args.output is not None:
            raise NblError("give -o or --out, not both")
        args.output = args.out_alias
    if args.sweep:
        if args.cache_type.lower() != "f16" or args.passkey or args.passkey_depths is not None:
            raise NblError("--cache-type and --passkey measure the GGUF files given; the sweep's files run with an "
                           "F16 cache and no passkey test")
        if args.models:
            raise NblError("--sweep builds its own GGUFs: pass no GGUF files with it")
        from nbl_gguf.commands.eval_sweep import run_sweep

        return run_sweep(args)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sweep_only = [flag for flag in flags.explicitly_given(parser, args, SWEEP_GROUP) if flag != "--out"]
    if sweep_only:
        raise NblError(f"{', '.join(sweep_only)} {'means' if len(sweep_only) == 1 else 'mean'} nothing without "
                       f"--sweep: eval measures the GGUF files given as they are")
    return run_files(args)


def run_files(args: argparse.Namespace) -> int:
    """llama-perplexity and the task files on each GGUF given; the table on stdout, -o: JSON too."""
    from nbl_gguf.calibration.dataset import write_heldout_text
    from nbl_gguf.gguf.metadata import open_model_gguf
    from nbl_gguf.measurement.passkey import check_prompts, passkey
    from nbl_gguf.measurement.perplexity import evaluate, format_results
    from nbl_gguf.measurement.tasks import check_task_files, check_text
    from nbl_gguf.outputs import check_output_file

    if not args.models:
        raise NblError("no GGUF files given (or use --sweep)")
    for model in args.models:
        open_model_gguf(model)  # missing, truncated, not a GGUF: said here, not by llama-perplexity's log
    if args.output:
        check_output_file(args.output, "-o")
    task_files = check_task_files(flags.task_files(args))
    cache_type, depths = check_passkey_and_cache(args)
    for model in args.models if args.passkey else ():
        check_prompts(model, args.passkey)
    if args.no_ppl and not task_files and not args.passkey:
        raise NblError("nothing to evaluate: --no-ppl and no task file nor --passkey")
    results = []
    with tempfile.TemporaryDirectory(prefix="nbl-eval-") as tmp:
        text_file = None
        if not args.no_ppl:
            if args.text:
                text_file = Path(args.text)
                check_text(text_file, args.ctx_size)
            else:
                text_file = write_heldout_text(Path(tmp) / "heldout.txt")
        for model in args.models:
            print(f"evaluating {model} ...", file=sys.stderr)
            result = evaluate(model, text_file=text_file, n_ctx=args.ctx_size, chunks=args.chunks,
                              batch=args.batch_size, threads=args.threads, task_files=task_files, cache_type=cache_type)
            if args.passkey:
                result["passkey"] = passkey(model, tuple(args.passkey), depths, kv_type=cache_type,
                                            threads=args.threads).report()
            results.append(result)
    if text_file is not None and results:
        p = results[0]["perplexity"]
        print(f"perplexity: {p['chunks']} chunks of {p['n_ctx']} tokens, {p['tokens']} scored tokens "
              f"({'held-out C4' if not args.text else args.text})")
    if cache_type != "f16":
        print(f"KV cache: {cache_type} (-ctk {cache_type} -ctv {cache_type})")
    if args.passkey:
        print(f"passkey: found / asked, one prompt per depth ({', '.join(map(str, depths))})")
    print(format_results(results))
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


def check_passkey_and_cache(args: argparse.Namespace) -> tuple[str, tuple[float, ...]]:
    """(the KV cache type, the passkey depths) of --cache-type and --passkey/--passkey-depths, checked before
    any work."""
    from nbl_gguf.measurement.passkey import DEPTHS

    cache_type = flags.cache_type(f"--cache-type {args.cache_type}", args.cache_type)
    if args.passkey_depths is not None and not args.passkey:
        raise NblError("--passkey-depths means nothing without --passkey")
    for n in args.passkey or ():
        if n < 64:
            raise NblError(f"--passkey {n}: a prompt of {n} tokens leaves no room for filler (give 64 or more)")
    if args.passkey_depths is None:
        return cache_type, DEPTHS
    try:
        depths = tuple(float(d) for d in args.passkey_depths.split(","))
    except ValueError:
        raise NblError(f"--passkey-depths {args.passkey_depths!r}: expected numbers from 0 to 1, e.g. 0.1,0.5,0.9") \
            from None
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad:
        raise NblError(f"--passkey-depths {args.passkey_depths}: {bad[0]} is outside 0 (start) to 1 (end)")
    return cache_type, depths
