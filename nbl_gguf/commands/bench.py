"""`bench`: speed and KV cache of NBL GGUFs against the stock GGUF of the same model and quant, with
llama-bench (the measurement: nbl_gguf.measurement.bench; the tables, plots and report: bench_report).

Inputs: explicit files (``--baseline stock.gguf --nbl a.gguf b.gguf``), the embedded model or a HF
folder (``--model embedded --m 8,12 --quant q4_k_m``; converted with ``convert``, reusing one
calibration), a GGUF file (``--model model.Q4_K_M.gguf --m 4``: the file itself is the stock side, the
NBL files are ``convert --model model.Q4_K_M.gguf``'s surgery on it), or a synthetic model of a real
shape (``--shape llama-3.2-1b --m 6``).
Outputs under ``-o``: results.json, measurements.csv, speedups.csv, kv_cache.csv,
speedup-<backend>.png (speed-up against context, like figure 3 of the paper) and report.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

from nbl_gguf.commands import flags, frontier
from nbl_gguf.commands.model_files import nbl_by_convert, resolve_model_dir, stock_ladder, work_dir
from nbl_gguf.errors import NblError
from nbl_gguf.measurement.bench import BenchSettings, Candidate, ModelSet, check_models, measure
from nbl_gguf.model_source import is_gguf_file

DEFAULT_DEPTHS = (0, 2048, 8192, 32768)


QUICK = dict(model="embedded", m=[8, 12], depths=[0, 512], n_prompt=128, n_gen=32, rounds=2, repetitions=1,
             calib_nsamples=16, calib_seqlen=256)


DEFAULTS = dict(m=[12], depths=list(DEFAULT_DEPTHS), n_prompt=512, n_gen=128, rounds=2, repetitions=2,
                quant="q4_k_m")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("models (one of: explicit files, --model, --shape; default with --quick: embedded)")
    source.add_argument("--baseline", default=None, metavar="GGUF", help="the stock GGUF")
    source.add_argument("--nbl", nargs="+", default=None, metavar="GGUF", help="NBL GGUFs of the same model and quant")
    flags.add_model(source, "'embedded' (SmolLM2-135M-Instruct) or a HF folder: stock and NBL GGUFs are made "
                            "with convert; or a GGUF file: it is the stock file, the NBL files are convert's "
                            "surgery on it (its tensors and types kept)")
    source.add_argument("--shape", default=None,
                        help="synthetic random-weight model of a real shape: llama-3.1-8b, llama-3.2-1b, smollm2-135m")
    flags.add_m_list(source, "NBL layer counts for --model/--shape, e.g. 8,12 or 8 12 (default: 12; --quick: 8,12)")
    source.add_argument("--quant", default=None,
                        help="quantization for a HF --model or --shape (default: q4_k_m); a GGUF --model keeps its own")
    flags.add_calibration(source, "calibration artifact to reuse for --model (default: made once and cached)")
    source.add_argument("--calib-nsamples", type=int, default=None,
                        help="--model without a calibration: windows for the one calibration made (default: "
                             "calibrate's; --quick: 16; speed does not depend on the calibration's quality)")
    source.add_argument("--calib-seqlen", type=int, default=None,
                        help="--model without a calibration: tokens per window (default: calibrate's; --quick: 256)")
    source.add_argument("--layers", default=None,
                        help="--shape only: explicit NBL layers per m, e.g. '6:9,10,11,12,13,14' (default: the m "
                             "layers before the last)")
    flags.add_taps_list(source, "--shape: one NBL file per m and per count, 1 = per-token maps, K > 1 = taps "
                                "layers reading K tokens (random maps of the calibrator's default form), e.g. 1,4 "
                                "(default: 1); --frontier: the kinds of map, one calibration each (default: 4,1 where "
                                "the file can carry taps)")
    source.add_argument("--taps-forms", type=flags.name_list, default=None, metavar="FORMS",
                        help="--shape: the forms of the taps files, one file per form and count K > 1, e.g. "
                             "lowrank,channel,lowrank:256 (lowrank's rank defaults to n_embd/4; default: lowrank)")
    source.add_argument("--work-dir", default=None,
                        help="where generated GGUFs are kept and reused (default: ~/.cache/nbl-gguf/bench)")
    flags.add_seed(source, "a --shape model's weights and of --model's calibration")
    flags.add_device(source, "while calibrating a --model and for --hf-compare")
    flags.add_dtype(source, "while calibrating a --model and for --hf-compare")

    bench = parser.add_argument_group("measurement")
    bench.add_argument("--quick", action="store_true",
                       help="a few minutes on a CPU: embedded model, m=8,12, -p 128 -n 32, depths 0,512, 2 rounds")
    bench.add_argument("-p", "--n-prompt", type=int, default=None, help="prompt tokens of a pp test (default: 512)")
    bench.add_argument("-n", "--n-gen", type=int, default=None, help="generated tokens of a tg test (default: 128)")
    bench.add_argument("-d", "--depths", type=flags.int_list, default=None,
                       help=f"context depths, comma-separated (default: {','.join(map(str, DEFAULT_DEPTHS))})")
    bench.add_argument("-r", "--repetitions", type=int, default=None,
                       help="llama-bench repetitions per call (default: 2)")
    bench.add_argument("--rounds", type=int, default=None,
                       help="interleaved rounds: each runs every model at every depth, order alternating (default: 2)")
    flags.add_threads(bench, "of llama-bench, of the llama.cpp tools that make the GGUFs and of PyTorch for "
                             "--hf-compare (default: all cores)")
    bench.add_argument("--backends", default="auto",
                       help="cpu, cuda or both, comma-separated (default: auto = cpu, plus cuda if built and visible)")
    bench.add_argument("--cache-type", default="f16", help="K and V cache type (default: f16)")
    bench.add_argument("--bench-args", default="", help="extra llama-bench arguments, e.g. '-fa on -ub 256'")
    bench.add_argument("--hf-compare", action="store_true",
                       help="also time the HF transformers model with the same NBL layers (apply_nbl): prefill "
                            "and decode tokens/s against llama.cpp's pp and tg at depth 0")
    bench.add_argument("--hf-model", default=None,
                       help="HF folder for --hf-compare with explicit GGUFs (default: the --model / --shape model)")
    flags.add_output(bench, "results folder (default: bench-results)", default="bench-results", metavar="DIR")
    # the spellings before --device, --dtype and -o/--output, kept for the commands recorded in docs/results
    bench.add_argument("--hf-device", dest="device", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    bench.add_argument("--hf-dtype", dest="dtype", default=argparse.SUPPRESS, choices=flags.DTYPES,
                       help=argparse.SUPPRESS)
    bench.add_argument("--output-dir", dest="output", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    bench.add_argument("--no-plot", action="store_true", help="skip the PNG plots")
    flags.add_no_progress(bench)
    frontier.add_arguments(parser.add_argument_group("frontier (--frontier)"))


# --- inputs ------------------------------------------------------------------------------------

def apply_presets(args) -> None:
    explicit = args.baseline is not None or args.nbl is not None
    check_meaningful(args, explicit)
    if args.quick:
        if not explicit and args.model is None and args.shape is None:
            args.model = QUICK["model"]
        for key in ("m", "depths", "n_prompt", "n_gen", "rounds", "repetitions", "calib_nsamples", "calib_seqlen"):
            if getattr(args, key) is None:
                setattr(args, key, QUICK[key])
    if args.quant is not None and is_gguf_file(args.model):
        raise NblError(f"--quant {args.quant} means nothing for a GGUF --model: the stock side is "
                       f"{Path(args.model).name} as it is and its NBL files keep its tensors and types; quantize the "
                       f"file first (llama-quantize) to measure another type")
    for key, value in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    sources = sum([explicit, args.model is not None, args.shape is not None])
    if sources == 0:
        raise NblError("nothing to measure: give --baseline and --nbl, --model, --shape, or --quick")
    if sources > 1:
        raise NblError("give only one of: explicit GGUFs (--baseline/--nbl), --model, --shape")
    if explicit and (args.baseline is None or not args.nbl):
        raise NblError("explicit GGUFs need both --baseline STOCK.gguf and --nbl NBL.gguf [...]")
    for name in ("n_prompt", "n_gen"):
        if getattr(args, name) < 0:
            raise NblError(f"--{name.replace('_', '-')} must not be negative")
    if args.n_prompt == 0 and args.n_gen == 0:
        raise NblError("-p 0 and -n 0 leave nothing to measure")
    if args.rounds < 1 or args.repetitions < 1:
        raise NblError("--rounds and --repetitions must be at least 1")
    flags.cache_type(f"--cache-type {args.cache_type}", args.cache_type)


def check_meaningful(args, explicit: bool) -> None:
    """Options that the models asked for would not use, given explicitly (before --quick fills in its own)."""
    def refuse(flag: str, why: str) -> None:
        raise NblError(f"{flag} means nothing {why}")

    if args.taps is not None and args.shape is None:
        refuse(f"--taps {','.join(map(str, args.taps))}", "without --shape: the files of --model and --baseline/--nbl "
                                                          "say themselves what replaces their layers")
    if args.taps_forms is not None and not (args.shape is not None and any(k > 1 for k in args.taps or [])):
        refuse(f"--taps-forms {','.join(args.taps_forms)}", "without --shape and a --taps count above 1: it names "
                                                             "the forms of a synthetic model's taps files")
    if args.layers is not None and args.shape is None:
        refuse(f"--layers {args.layers}", "without --shape: it names the layers of a synthetic model")
    if args.hf_model is not None and not (explicit and args.hf_compare):
        refuse(f"--hf-model {args.hf_model}", "without --hf-compare and explicit GGUFs: --model and --shape are "
               "their own HF model")
    if args.calibration is not None and args.model is None:
        refuse(f"--calibration {args.calibration}", "without --model: only --model's GGUFs are made from a calibration")
    calibrates = args.model is not None or (args.quick and not explicit and args.shape is None)
    for name in ("calib_nsamples", "calib_seqlen"):
        value = getattr(args, name)
        if value is not None and (not calibrates or args.calibration is not None):
            refuse(f"--{name.replace('_', '-')} {value}", "without a calibration to make: it sizes the one that "
                   "--model without --calibration makes")
    if not args.hf_compare and (not calibrates or args.calibration is not None):
        for name in ("device", "dtype"):
            if getattr(args, name) != "auto":
                refuse(f"--{name} {getattr(args, name)}", "here: nothing runs in PyTorch (no calibration to make "
                       "and no --hf-compare)")


def _parse_layers(text: str | None) -> dict[int, list[int]]:
    if not text:
        return {}
    result = {}
    for part in text.split(";"):
        m, _, layers = part.partition(":")
        try:
            result[int(m)] = [int(v) for v in layers.split(",") if v.strip()]
        except ValueError:
            raise NblError(f"--layers '{text}': expected 'm:i,j,k[;m:...]'") from None
        if len(result[int(m)]) != int(m):
            raise NblError(f"--layers: {len(result[int(m)])} layers given for m={m}")
    return result


def explicit_models(args) -> ModelSet:
    stock = Candidate("stock", Path(args.baseline))
    nbl = []
    labels = set()
    for path in args.nbl:
        path = Path(path)
        label = path.stem
        while label in labels:
            label += "'"
        labels.add(label)
        nbl.append(Candidate(label, path))
    hf = {"kind": "folder", "path": args.hf_model} if args.hf_model else {}
    return ModelSet(Path(args.baseline).stem, "", stock, nbl, hf=hf)


def shape_models(args, log) -> ModelSet:
    from nbl_gguf.fixtures import synthetic

    shape = synthetic.get_shape(args.shape)
    layers = _parse_layers(args.layers)
    directory = work_dir(args) / "synthetic"
    taps = args.taps or [1]
    forms = args.taps_forms or []
    stock, nbl = synthetic.make_pair(shape, args.quant, args.m, directory, seed=args.seed, layers=layers,
                                     threads=args.threads, taps=taps, taps_forms=forms, log=log)
    return ModelSet(
        f"synthetic {shape.name}", args.quant, Candidate("stock", stock),
        [Candidate(f"nbl-m{m}" + (f"-{label}" if label else ""), path) for (m, label), path in nbl.items()],
        hf={"kind": "shape", "shape": shape.name, "seed": args.seed},
        commands=[f"synthetic.make_pair({shape.name!r}, {args.quant!r}, m={args.m}, seed={args.seed}, taps={taps}, taps_forms={forms}) "
                  f"(random Q8_0 weights by gguf-py -> llama-quantize --allow-requantize)"],
    )


def embedded_models(args, log) -> ModelSet:
    """Stock and NBL-m GGUFs of a HF model by `convert` (one calibration, made once or given)."""
    from nbl_gguf.gguf.hf_to_gguf import check_hf_folder, model_shape
    from nbl_gguf.gguf.quantize import check_quant

    model_dir = resolve_model_dir(args.model)
    check_hf_folder(model_dir)
    n_layer, _ = model_shape(model_dir)
    quant = check_quant(args.quant)
    for m in args.m:
        if not 0 < m < n_layer:
            raise NblError(f"--m {m} is out of range: {model_dir.name} has {n_layer} layers")
    directory = work_dir(args) / "models" / model_dir.name
    directory.mkdir(parents=True, exist_ok=True)
    commands = []

    stock = stock_ladder(model_dir, [quant], directory, args.threads, log)[quant]
    commands.append(f"convert_hf_to_gguf.py {model_dir} --outtype f32 && llama-quantize ... {quant}  -> {stock}")

    # cut from the stock file measured beside them, not from a conversion of their own
    nbl, converts = nbl_by_convert(args, str(model_dir), directory, f"-{quant.lower()}",
                                   {"quant": quant, "stock_gguf": str(stock)}, log)
    return ModelSet(model_dir.name, quant, Candidate("stock", stock), nbl,
                    hf={"kind": "folder", "path": str(model_dir)}, commands=commands + converts)


def gguf_models(args, log) -> ModelSet:
    """The user's GGUF as the stock side, and NBL-m files made from it by `convert --model FILE.gguf`
    (one calibration on the model transformers dequantizes from it; surgery on the file itself)."""
    from nbl_gguf.gguf.nbl_format import SUPPORTED_ARCHITECTURES
    from nbl_gguf.model_source import resolve_model

    source = resolve_model(args.model, runnable=SUPPORTED_ARCHITECTURES, calibrating=not args.calibration)
    model = source.gguf
    for m in args.m:
        if not 0 < m < model.n_layer:
            raise NblError(f"--m {m} is out of range: {model.path.name} has {model.n_layer} layers")
    # keyed by content: another file of the same name must not reuse these NBL files
    directory = work_dir(args) / "models" / "gguf" / model.sha256[:16] / model.path.stem
    directory.mkdir(parents=True, exist_ok=True)
    nbl, commands = nbl_by_convert(args, str(model.path), directory, "", {}, log)
    hf = {"kind": "folder", "path": str(source.hf_folder())} if args.hf_compare else {}
    return ModelSet(model.path.stem, model.file_type, Candidate("stock", model.path), nbl, hf=hf,
                    commands=[f"{model.path} as given (the stock side)"] + commands)


def resolve_models(args, log=print) -> ModelSet:
    if args.baseline is not None or args.nbl is not None:
        models = explicit_models(args)
    elif args.shape is not None:
        models = shape_models(args, log)
    elif is_gguf_file(args.model):
        models = gguf_models(args, log)
    else:
        models = embedded_models(args, log)
    return check_models(models)  # missing / not a GGUF / not a pair -> NblError


# --- the command -------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    from nbl_gguf.measurement.bench_report import format_summary, write_outputs
    from nbl_gguf.measurement.llama_bench import resolve_backends
    from nbl_gguf.measurement.speedup import kv_table, speedup_table
    from nbl_gguf.outputs import check_output_dir

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    if args.frontier_report:
        return frontier.rewrite_report(args)
    if args.frontier:
        return frontier.run_frontier(args)
    frontier.check_arguments(args)
    apply_presets(args)
    out = check_output_dir(args.output, "-o")  # before minutes of measuring, not after
    backends, devices = resolve_backends(args.backends)
    models = resolve_models(args, log)
    costs = {c.label: c.cost for c in models.all()}
    log(f"benchmarking {models.name} {models.quant} on {', '.join(backends)}: "
        + ", ".join(c.label for c in models.all()) + f"; depths {args.depths}, -p {args.n_prompt} -n {args.n_gen}, "
        f"{args.rounds} rounds x {args.repetitions} repetitions")
    started = time.monotonic()
    settings = bench_settings(args)
    measurements, commands = measure(models, backends, settings, log)
    rows = speedup_table(measurements, costs, args.cache_type)
    kv_rows = kv_table(measurements, costs, args.cache_type)

    hf = None
    if args.hf_compare:
        from nbl_gguf.measurement import hf_compare

        hf = hf_compare.compare(models, measurements, settings,
                                hf_compare.HfSettings(device=args.device, dtype=args.dtype, seed=args.seed), log)

    title = f"NBL vs stock llama.cpp: {models.name} {models.quant}"
    result = record(args, title, models, backends, devices, commands, rows, kv_rows, hf, measurements,
                    round(time.monotonic() - started, 1))
    written = write_outputs(out, result, rows, kv_rows, measurements, not args.no_plot, title)
    print(format_summary(title, rows, kv_rows, hf, written))
    return 0


def bench_settings(args) -> BenchSettings:
    return BenchSettings(n_prompt=args.n_prompt, n_gen=args.n_gen, depths=tuple(args.depths),
                         repetitions=args.repetitions, rounds=args.rounds, threads=args.threads,
                         cache_type=args.cache_type, bench_args=args.bench_args)


def record(args, title, models, backends, devices, commands, rows, kv_rows, hf, measurements, elapsed_s) -> dict:
    """results.json: what was measured, how, on what, and how the files were made."""
    from nbl_gguf.llamacpp.tools import bin_dir
    from nbl_gguf.measurement.bench_report import machine_description
    from nbl_gguf.measurement.roofline import file_type_name

    return {
        "title": title,
        "command": flags.invocation("bench"),
        "settings": {k: getattr(args, k) for k in ("n_prompt", "n_gen", "depths", "rounds", "repetitions", "threads",
                                                   "cache_type", "bench_args", "quick")},
        "backends": backends, "devices": devices,
        "build": str(bin_dir()),
        "models": [{"label": c.label, "path": str(c.path), "file_type": file_type_name(c.cost.file_type),
                    "bytes": c.path.stat().st_size, "n_layer": c.cost.n_layer,
                    "attention_layers": c.cost.attention_layers,
                    "replaced_layers": [i for i, t in enumerate(c.cost.layer_types) if t != 0],
                    "weight_bytes_per_token": c.cost.weight_bytes_per_token(),
                    "kv_bytes_per_token": c.cost.kv_bytes_per_token(args.cache_type),
                    "block_matmul_params": c.cost.block_matmul_params, "output_params": c.cost.output_params}
                   for c in models.all()],
        "made_by": models.commands,
        "llama_bench_commands": [" ".join(c) for c in commands],
        "speedups": [asdict(r) | {"meets_target": r.meets_target} for r in rows],
        "kv_cache": kv_rows,
        "hf_compare": hf,
        "measurements": measurements,
        "machine": machine_description() | {"llama_bench_cpu": measurements[0]["cpu_info"] if measurements else "",
                                            "llama_bench_gpu": measurements[0]["gpu_info"] if measurements else ""},
        "elapsed_s": elapsed_s,
    }
