"""`bench --frontier`: the files of one model's frontier, made once and kept under the work dir, then
measured side by side (the measurement, tables and plot: nbl_gguf.measurement.frontier).

The variants, each with an F16 KV cache unless named:
- stock: the file at its type (a GGUF --model as given; a HF folder converted and quantized to --quant),
  and with each of llama.cpp's KV cache types of --kv-types (default q8_0, K q8_0 with V q4_0, q4_0);
- llama.cpp's weight-type knob: one step down the ladder of llama-quantize types and, where the source
  has the bits for it (a HF folder or a float GGUF), one step up;
- llama.cpp's layer pruning: `llama-quantize --prune-layers` of the N blocks ShortGPT's block influence
  (1 - cos of a block's input and output, recorded by the calibration) ranks least important;
- ours: `convert` at each --m with past-token maps and with per-token maps (one calibration: a past-token one
  holds the per-token maps too; `best` is measured at each m for each kind of map, since a selection holds for
  its maps only), each also with the KV types of --nbl-kv-types (default q8_0 and q4_0);
- ours, window layers: `convert --m 0 --windows N` for each --frontier-windows N (default: half the layers,
  where the patched llama.cpp runs window layers for the architecture and the training context is above
  twice the window), each also with those KV types, and once more on the weight type one step down (the same
  layers written into that stock file).

Each variant's perplexities take the same time whatever its cache type (patch 0020: the CPU flash attention's
tiled path for quantized caches too), so the number of variants is what sets the frontier's time. The
perplexities and passkeys are kept (measurement.kept_runs), so that a frontier interrupted and run again with the
same --work-dir measures only what it had not; the files under the work dir are made once.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from nbl_gguf.commands import flags
from nbl_gguf.errors import NblError

DEFAULT_M = (4, 8, 12)
DEFAULT_KV_TYPES = ("q8_0", "q8_0/q4_0", "q4_0")  # the stock file's: llama.cpp's own knobs
DEFAULT_NBL_KV_TYPES = ("q8_0", "q4_0")  # ours
LONG_CTX = 4096
FRONTIER_DEPTHS = (0, 4096)


def add_arguments(group) -> None:
    group.add_argument("--frontier", action="store_true",
                       help="the frontier of one --model against llama.cpp's own knobs: stock with quantized KV "
                            "caches (--kv-types), a weight type down and up, --prune-layers, NBL files at each --m "
                            "(default 4,8,12) with past-token and per-token maps and window files, each with the "
                            "--nbl-kv-types, the window files also on the weight type down; held-out perplexity at 512 "
                            "and a long context, KV bytes, llama-bench; markdown, CSV and a plot under -o")
    group.add_argument("--kv-types", default=",".join(DEFAULT_KV_TYPES),
                       help=f"--frontier: the stock file's KV cache types besides f16, K's/V's for a pair "
                            f"(default: {','.join(DEFAULT_KV_TYPES)})")
    group.add_argument("--nbl-kv-types", default=",".join(DEFAULT_NBL_KV_TYPES),
                       help=f"--frontier: our files' KV cache types besides f16 (default: "
                            f"{','.join(DEFAULT_NBL_KV_TYPES)}; '' for none)")
    group.add_argument("--prune-blocks", type=int, default=None, metavar="N",
                       help="--frontier: blocks that the --prune-layers baseline removes (default: the smallest --m; "
                            "0: none)")
    group.add_argument("--long-ctx", type=int, default=None,
                       help=f"--frontier: the long perplexity context (default: {LONG_CTX}, or the training context "
                            f"if smaller)")
    group.add_argument("-c", "--ctx-size", type=flags.positive_int, default=None, metavar="N",
                       help="--frontier: the context the KV bytes are given at (default: the training context)")
    group.add_argument("--frontier-windows", type=flags.int_list, default=None, metavar="N[,N]",
                       help="--frontier: files with N window layers each (convert --m 0 --windows N, the default "
                            "--window-size and --window-sinks) (default: half the layers where the model can carry "
                            "them; 0: none)")
    group.add_argument("--frontier-passkey", type=flags.int_list, default=None, metavar="N[,N]",
                       help="--frontier: also the passkey test of every variant at these prompt lengths in tokens, "
                            "with its cache type (eval --passkey; five depths): retrieval, which perplexity does not "
                            "show and a weight type can lose as well as a window layer (about 2.5 min a variant at "
                            "4,096 tokens for a 135M model on 2 cores) (default: none)")
    group.add_argument("--frontier-report", default=None, metavar="DIR",
                       help="write the markdown, CSV and plot of a finished frontier again from DIR/results.json, "
                            "as this version writes them (nothing is measured)")
    group.add_argument("--remeasure", action="store_true",
                       help="--frontier: measure every perplexity and passkey again, instead of taking those an "
                            "earlier run of the same files, text and llama.cpp build kept (under NBL_GGUF_CACHE; "
                            "speeds are measured again in every run)")
    group.add_argument("--ppl-chunks", type=_chunks, default=(4, 1), metavar="SHORT,LONG",
                       help="--frontier: perplexity chunks per kind of text at 512 and at the long context "
                            "(default: 4,1)")


def _chunks(text: str) -> tuple[int, int]:
    parts = text.split(",")
    try:
        short, long = (int(p) for p in parts)
    except ValueError:
        import argparse

        raise argparse.ArgumentTypeError(f"expected SHORT,LONG chunk counts, got {text!r}") from None
    return short, long


def check_arguments(args) -> None:
    """What --frontier takes and refuses, before any work."""
    if not args.frontier:
        for name, default in (("prune_blocks", None), ("long_ctx", None), ("ctx_size", None), ("ppl_chunks", (4, 1)),
                              ("kv_types", ",".join(DEFAULT_KV_TYPES)), ("frontier_windows", None),
                              ("frontier_passkey", None), ("remeasure", False),
                              ("nbl_kv_types", ",".join(DEFAULT_NBL_KV_TYPES))):
            if getattr(args, name) != default:
                raise NblError(f"--{name.replace('_', '-')} means nothing without --frontier")
        return
    for flag, given in (("--baseline/--nbl", args.baseline is not None or args.nbl is not None),
                        ("--shape", args.shape is not None), ("--quick", args.quick),
                        ("--hf-compare", args.hf_compare), ("--calibration", args.calibration is not None)):
        if given:
            why = " (it makes the one calibration its files are cut from)" if flag == "--calibration" else ""
            raise NblError(f"{flag} means nothing with --frontier{why}")
    if args.layers is not None:
        raise NblError("--layers means nothing with --frontier: the calibration chooses the layers")
    if args.model is None:
        raise NblError("--frontier measures one model: give --model (a HF folder, a hub id, 'embedded' or a GGUF file)")


def kv_types(text: str, flag: str = "--kv-types") -> list[str]:
    types = [flags.cache_type(flag, t) for t in flags.name_list(text)]
    return [t for t in dict.fromkeys(types) if t != "f16"]


# --- the files -------------------------------------------------------------------------------------------

@dataclass
class StockSide:
    """The model as the user has it, and llama.cpp's weight-type knobs on it."""

    source: object  # model_source.ModelSource
    name: str
    quant: str  # the stock file's type
    n_layer: int
    hidden: int
    directory: Path  # where this model's frontier files are kept
    stock: Path
    knobs: dict[str, Path]  # weight type -> the stock model at that type
    made: list[str]  # how the files were made
    notes: list[str]
    convert_model: str  # what `convert --model` takes to make the NBL files of this model
    convert_extra: dict  # and its other options for them ({name: value}, convert.options)
    suffix: str  # of the NBL files' names


def gguf_side(args, log) -> StockSide:
    """A GGUF --model: the file as given; one type down by requantizing it (none up: its bits are gone)."""
    from nbl_gguf.commands.model_files import work_dir
    from nbl_gguf.gguf.nbl_format import SUPPORTED_ARCHITECTURES
    from nbl_gguf.gguf.quantize import quantize
    from nbl_gguf.measurement.frontier import FLOAT_TYPES, neighbour_types
    from nbl_gguf.model_source import resolve_model

    if args.quant is not None:
        raise NblError(f"--quant {args.quant} means nothing for a GGUF --model: the stock side is "
                       f"{Path(args.model).name} as it is")
    source = resolve_model(args.model, runnable=SUPPORTED_ARCHITECTURES, calibrating=True)
    gguf_file = source.gguf
    name, quant = gguf_file.path.stem, gguf_file.file_type.upper()
    directory = work_dir(args) / "frontier" / "gguf" / gguf_file.sha256[:16] / name
    directory.mkdir(parents=True, exist_ok=True)
    stock, notes, made = gguf_file.path, [], [f"{gguf_file.path} as given (the stock side)"]
    down, up = neighbour_types(quant)
    if quant not in FLOAT_TYPES and up is not None:
        notes.append(f"No weight type one step up: requantizing the {quant} file up ({up}) cannot bring back "
                     f"what it lost, and the frontier has no float source for it.")
        up = None
    knobs = {}
    for q in (down, up):
        if q is not None:
            knobs[q] = directory / f"stock-{q.lower()}.gguf"
            if not knobs[q].is_file():
                log(f"{name}: llama-quantize --allow-requantize {quant} -> {q}")
                quantize(stock, knobs[q], q, threads=args.threads, extra_args=["--allow-requantize"])
            made.append(f"llama-quantize --allow-requantize {stock.name} {knobs[q].name} {q}")
    return StockSide(source, name, quant, gguf_file.n_layer, gguf_file.n_embd, directory, stock, knobs, made, notes,
                     convert_model=str(stock), convert_extra={}, suffix="")


def hf_side(args, log) -> StockSide:
    """A HF --model: converted once to F32, quantized to --quant and the types one down and one up."""
    from nbl_gguf.commands.model_files import resolve_model_dir, stock_ladder, work_dir
    from nbl_gguf.gguf.hf_to_gguf import check_hf_folder, model_shape
    from nbl_gguf.gguf.quantize import check_quant
    from nbl_gguf.measurement.frontier import neighbour_types
    from nbl_gguf.model_source import resolve_model

    model_dir = resolve_model_dir(args.model)
    check_hf_folder(model_dir)
    n_layer, hidden = model_shape(model_dir)
    name, quant = model_dir.name, check_quant(args.quant or "q4_k_m").upper()
    directory = work_dir(args) / "frontier" / "models" / name
    directory.mkdir(parents=True, exist_ok=True)
    down, up = neighbour_types(quant)
    ladder = stock_ladder(model_dir, [q for q in (quant, down, up) if q], directory, args.threads, log)
    made = [f"convert_hf_to_gguf.py {model_dir} --outtype f32 && llama-quantize ... {', '.join(ladder)} (one file each)"]
    return StockSide(resolve_model(str(model_dir)), name, quant, n_layer, hidden, directory, ladder[quant],
                     {q: ladder[q] for q in (down, up) if q}, made, [],
                     # the NBL files are cut from the stock file measured here, not from a conversion of their own
                     convert_model=str(model_dir), convert_extra={"quant": quant, "stock_gguf": str(ladder[quant])},
                     suffix=f"-{quant.lower()}")


def make_variants(args, log) -> tuple[str, list, list[str], list[str]]:
    """(model name, the frontier's Variants in table order, how the files were made, notes)."""
    from nbl_gguf.calibration.artifact import load_artifact
    from nbl_gguf.commands.model_files import nbl_by_convert
    from nbl_gguf.gguf.from_artifact import AUTO_TAPS_CPU_MAX_WIDTH, DEFAULT_TAPS, gguf_architecture
    from nbl_gguf.gguf.nbl_format import TAPS_ARCHITECTURES
    from nbl_gguf.gguf.quantize import prune_blocks
    from nbl_gguf.measurement.frontier import KNOB, NBL, STOCK, Variant, neighbour_types
    from nbl_gguf.measurement.passkey import check_prompts
    from nbl_gguf.model_source import is_gguf_file
    from nbl_gguf.models import resolve_device

    extra_kv, nbl_kv = kv_types(args.kv_types), kv_types(args.nbl_kv_types, "--nbl-kv-types")
    side = gguf_side(args, log) if is_gguf_file(args.model) else hf_side(args, log)
    name, n_layer, directory, stock, made, notes = (side.name, side.n_layer, side.directory, side.stock,
                                                    list(side.made), list(side.notes))
    m_list = sorted(set(args.m or DEFAULT_M))
    for m in m_list:
        if not 0 < m < n_layer:
            raise NblError(f"--m {m} is out of range: {name} has {n_layer} layers")
    prune = min(m_list) if args.prune_blocks is None else args.prune_blocks
    if not 0 <= prune < n_layer:
        raise NblError(f"--prune-blocks {prune} is out of range: {name} has {n_layer} blocks")
    if args.frontier_passkey:  # prompts that cannot be made are refused before the NBL files are
        check_prompts(stock, args.frontier_passkey)
    carries_taps = gguf_architecture(side.source) in TAPS_ARCHITECTURES
    # as convert's --taps auto: not on a CPU above its width limit, where one layer's taps fit takes minutes
    cheap = side.hidden <= AUTO_TAPS_CPU_MAX_WIDTH or resolve_device(args.device).startswith("cuda")
    taps_list = args.taps or ([DEFAULT_TAPS, 1] if carries_taps and cheap else [1])
    if not carries_taps and any(k > 1 for k in taps_list):
        raise NblError(f"--taps {','.join(map(str, taps_list))}: {name} is a '{gguf_architecture(side.source)}' model, whose "
                       f"files carry per-token maps only (--taps 1)")

    variants = [Variant("stock", STOCK, stock, made_by=made[0])]
    variants += [Variant(f"stock kv {t}", STOCK, stock, kv_type=t, made_by=made[0]) for t in extra_kv]
    for q, path in side.knobs.items():
        variants.append(Variant(f"stock {q}", KNOB, path, made_by=f"llama-quantize to {q}"))

    calibrations, by_kind = {}, {}
    # past-token maps first: their calibration also holds the per-token maps and scores (the same fit of the same
    # statistics, to the bit), so the per-token files are cut from it, `best` measured for their maps at each m,
    # instead of from a calibration of their own
    for k in sorted(taps_list, reverse=True):
        kind = f"taps{k}" if k > 1 else "per-token"
        (directory / kind).mkdir(exist_ok=True)
        shared = calibrations[max(calibrations)] if k == 1 and calibrations else None
        nbl_args = _with(args, m=m_list, calibration=None if shared is None else str(shared))
        nbl, commands = nbl_by_convert(nbl_args, side.convert_model, directory / kind, side.suffix,
                                       {**side.convert_extra, "taps": k, "no_eval": True}, log)
        made += commands
        calibrations[k] = shared or directory / kind / "calibration"
        by_kind[k] = []
        for m, candidate in zip(m_list, nbl):
            label = f"nbl-m{m}" + (f" taps{k}" if k > 1 else " per-token")
            command = next(c for c in commands if f" --m {m} " in c)
            by_kind[k].append(Variant(label, NBL, candidate.path, made_by=command))
            by_kind[k] += [Variant(f"{label} kv {t}", NBL, candidate.path, kv_type=t, made_by=command) for t in nbl_kv]
    for k in taps_list:  # the table in the order asked for
        variants += by_kind[k]

    # the window files again on the weight type one step down: that knob decodes fastest at depth 0, where a window
    # saves nothing; one shrinks the weights, the other the cache, so the two compose
    down = neighbour_types(side.quant)[0]
    for count in window_counts(args, side):
        (directory / f"windows{count}").mkdir(exist_ok=True)
        window_args = _with(args, m=[0], calibration=str(calibrations[taps_list[0]]))
        (candidate,), commands = nbl_by_convert(window_args, side.convert_model, directory / f"windows{count}",
                                                side.suffix, {**side.convert_extra, "windows": count, "no_eval": True},
                                                log)
        made += commands
        label = f"windows {count}"
        variants.append(Variant(label, NBL, candidate.path, made_by=commands[0]))
        variants += [Variant(f"{label} kv {t}", NBL, candidate.path, kv_type=t, made_by=commands[0]) for t in nbl_kv]
        if down in side.knobs:
            composed, how = windows_on_knob(candidate.path, side.knobs[down], side.n_layer, log)
            made.append(how)
            variants.append(Variant(f"{label} {down}", NBL, composed, made_by=how))

    if prune:
        influence = load_artifact(calibrations[taps_list[0]]).block_influence()
        blocks = sorted(int(i) for i in influence.argsort(kind="stable")[:prune])
        pruned = directory / f"stock-prune{prune}-{'-'.join(map(str, blocks))}.gguf"
        if not pruned.is_file():
            log(f"{name}: llama-quantize --prune-layers {','.join(map(str, blocks))}")
            prune_blocks(stock, pruned, blocks, threads=args.threads)
        command = f"llama-quantize --prune-layers {','.join(map(str, blocks))} {stock.name} {pruned.name} COPY"
        made.append(command + " (the blocks of least ShortGPT block influence in the calibration)")
        position = 1 + len(extra_kv) + len(side.knobs)
        variants.insert(position, Variant(f"stock prune {prune} blocks", KNOB, pruned, made_by=command))
        notes.append(f"Pruned blocks (least ShortGPT block influence, 1 - cos of a block's input and output on "
                     f"the calibration windows): {', '.join(map(str, blocks))}.")
    return f"{name} {side.quant}", variants, made, notes


def windows_on_knob(window_file: Path, knob: Path, n_layer: int, log) -> tuple[Path, str]:
    """(the path, how it was made) of the stock file ``knob`` (another weight type) with the window layers of
    ``window_file``: the same layers, not chosen again on it; kept beside the window file under a name that
    carries them."""
    from nbl_gguf.gguf.metadata import open_gguf
    from nbl_gguf.gguf.nbl_format import ATTENTION, NblLayers, read_windows, write_nbl_gguf

    windows = read_windows(open_gguf(window_file))
    if windows is None:
        raise NblError(f"{window_file} has no window layers to write into {knob.name}")
    path = window_file.with_name(f"{window_file.stem}-{knob.stem}-w{'-'.join(map(str, windows.layers))}.gguf")
    if not path.is_file():
        log(f"{knob.name}: the window layers of {window_file.name} ({', '.join(map(str, windows.layers))})")
        write_nbl_gguf(knob, path, NblLayers(types=[ATTENTION] * n_layer, windows=windows))
    return path, (f"the window layers of {window_file.name} ({', '.join(map(str, windows.layers))}, W = {windows.size}, "
                  f"{windows.sinks} sinks) written into {knob.name} (nbl_format.write_nbl_gguf; not chosen again)")


def window_counts(args, side: StockSide) -> list[int]:
    """--frontier-windows, or half the layers where the file can carry window layers at a context that shows
    them (above twice the default window); [] for none."""
    from nbl_gguf.calibration.windows import DEFAULT_SIZE
    from nbl_gguf.gguf.from_artifact import gguf_architecture
    from nbl_gguf.gguf.metadata import open_gguf, training_context
    from nbl_gguf.gguf.nbl_format import WINDOW_ARCHITECTURES

    if args.frontier_windows is not None:
        counts = sorted({n for n in args.frontier_windows if n})
        for n in counts:
            if not 0 < n <= side.n_layer:
                raise NblError(f"--frontier-windows {n} is out of range: {side.name} has {side.n_layer} layers")
        return counts
    trained = training_context(open_gguf(side.stock)) or 0
    if gguf_architecture(side.source) not in WINDOW_ARCHITECTURES or trained <= 2 * DEFAULT_SIZE:
        return []
    return [side.n_layer // 2]


def _with(args, **changes):
    import argparse

    return argparse.Namespace(**(vars(args) | changes))


# --- the command ---------------------------------------------------------------------------------------

def _report(args, out: Path, title: str, rows, settings, raw: dict, notes: list[str]) -> int:
    """The frontier's markdown, CSV, results.json and plot under ``out``; the markdown on stdout too."""
    from nbl_gguf.measurement import frontier

    written = frontier.write_outputs(out, title, rows, settings, raw, notes, not args.no_plot)
    print(frontier.markdown(title, rows, settings, notes))
    print("written: " + ", ".join(str(p) for p in written))
    return 0


def rewrite_report(args) -> int:
    """--frontier-report DIR: the report of a finished frontier written again from its results.json."""
    from nbl_gguf.measurement import frontier

    out = Path(args.frontier_report)
    title, rows, settings, notes, raw = frontier.read_results(out / "results.json")
    return _report(args, out, title, rows, settings, raw, notes)


def run_frontier(args) -> int:
    from nbl_gguf.calibration.dataset import CHARS_PER_TOKEN_BOUND, KINDS, write_evaluation_text
    from nbl_gguf.gguf.metadata import open_gguf, training_context
    from nbl_gguf.measurement import frontier
    from nbl_gguf.measurement.bench_report import machine_description
    from nbl_gguf.measurement.llama_bench import resolve_backends
    from nbl_gguf.measurement.memo import Memo, memo_root
    from nbl_gguf.outputs import check_output_dir

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    check_arguments(args)
    kv_types(args.kv_types)
    kv_types(args.nbl_kv_types, "--nbl-kv-types")
    out = check_output_dir(args.output, "-o")
    backends, devices = resolve_backends(args.backends)
    started = time.monotonic()
    name, variants, made, notes = make_variants(args, log)
    train_ctx = training_context(open_gguf(variants[0].path)) or LONG_CTX
    long_ctx = args.long_ctx or min(LONG_CTX, train_ctx)
    settings = frontier.FrontierSettings(
        short_chunks=args.ppl_chunks[0], long_ctx=long_ctx, long_chunks=args.ppl_chunks[1], kv_ctx=args.ctx_size or train_ctx,
        depths=tuple(args.depths or FRONTIER_DEPTHS), n_prompt=512 if args.n_prompt is None else args.n_prompt,
        n_gen=128 if args.n_gen is None else args.n_gen, repetitions=args.repetitions or 2, rounds=args.rounds or 1,
        threads=args.threads, backends=tuple(backends), bench_args=tuple(args.bench_args.split()),
        passkey=tuple(args.frontier_passkey or ()))
    made_s = time.monotonic() - started
    log(f"frontier of {name}: {len(variants)} variants on {', '.join(backends)}")
    with tempfile.TemporaryDirectory(prefix="nbl-frontier-") as tmp:
        tokens = max(2 * settings.short_ctx * settings.short_chunks, 2 * settings.long_ctx * settings.long_chunks)
        texts = {kind: write_evaluation_text(kind, Path(tmp) / f"heldout-{kind}.txt", CHARS_PER_TOKEN_BOUND * tokens)
                 for kind in KINDS}
        rows, raw = frontier.measure(variants, texts, settings, log,
                                     memo=None if args.remeasure else Memo(memo_root()))
    elapsed = time.monotonic() - started
    notes = [f"Command: `{flags.invocation('bench')}`" if sys.argv[1:2] == ["bench"] else "",
             f"Perplexity: llama-perplexity on the bundled held-out text of each kind (never calibrated or selected "
             f"on), {settings.short_chunks} chunks of {settings.short_ctx} and {settings.long_chunks} of "
             f"{settings.long_ctx} tokens per kind; the change is against the stock file with an F16 cache. "
             f"KV: as llama.cpp allocates it at {settings.kv_ctx:,} tokens (llama-cli's settings). Speed: "
             f"llama-bench -p {settings.n_prompt} -n {settings.n_gen} -r {settings.repetitions}, "
             f"{settings.rounds} round(s), tokens/s (x: against stock)."
             + (" Passkey: keys found of those asked, one prompt per depth (0.1 to 0.9 of the prompt), greedy "
                "answers, the variant's cache type (eval --passkey)." if settings.passkey else ""),
             f"Frontier: no other variant has at most its mean change at {settings.long_ctx} tokens and at most its KV "
             f"bytes (KV) or at least its decode speed at depth {max(settings.depths)} (decode).",
             *notes,
             kept_note(raw["kept"], len(variants)),
             f"Wall time: {elapsed / 60:.1f} min ({made_s / 60:.1f} min of it making the files). "
             f"Machine: {_machine_line(machine_description(), devices)}."]
    notes = [n for n in notes if n]
    raw = raw | {"made_by": made, "machine": machine_description(), "elapsed_s": round(elapsed, 1),
                 "making_files_s": round(made_s, 1)}
    title = f"Frontier: {name} against llama.cpp's own knobs"
    return _report(args, out, title, rows, settings, raw, notes)


def kept_note(kept: dict[str, list[str]], variants: int) -> str:
    """What of the measuring an earlier run did (the wall time does not count it); '' when nothing."""
    parts = [f"the {what} of {len(labels)} of the {variants} variants" for what, labels in
             (("perplexities", kept.get("perplexity", [])), ("passkeys", kept.get("passkey", []))) if labels]
    if not parts:
        return ""
    return (f"Kept from an earlier run of the same files, text and llama.cpp build, not measured in this one: "
            f"{' and '.join(parts)} (results.json names them); --remeasure measures them again. Speeds are measured "
            f"in every run.")


def _machine_line(machine: dict, devices: list[str]) -> str:
    cpu = machine.get("lscpu", {}).get("Model name", "CPU")
    simd = "/".join(machine.get("simd", []))
    return f"{cpu}, {machine.get('cpu_count')} cores" + (f" ({simd})" if simd else "") + \
        (f", devices {', '.join(devices)}" if devices else "")
