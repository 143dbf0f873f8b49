"""`convert`: HF model or GGUF file -> NBL GGUF in one command.

    HF model:   calibrate (or reuse --calibration)  ->  stock GGUF by the pinned llama.cpp converter
                (F32/F16/BF16)  ->  [llama-imatrix]  ->  llama-quantize of the stock file  ->  NBL surgery
                on the quantized stock file, as for a GGUF file
    GGUF file:  calibrate on the model transformers dequantizes from it  ->  NBL surgery on the file
                itself (selected layers: attn-nbl = W x + b, attn-drop = nothing; every other tensor keeps
                its bytes and type; W in --nbl-type)

Intermediate files live in a temp dir; the output appears only once complete (temp then rename),
so an interrupted or failed run leaves no partial GGUF. The same inputs and seed give the same bytes.

The stages it runs: nbl_gguf.calibration.calibrate, nbl_gguf.gguf (hf_to_gguf, from_artifact,
nbl_format / stock_layout, quantize) and llama-perplexity; what it prints: convert_summary.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from nbl_gguf import kv_cache
from nbl_gguf.calibration.settings import Settings, selection_budget
from nbl_gguf.commands import flags
from nbl_gguf.commands.convert_summary import Summary, resources_table
from nbl_gguf.errors import NblError
from nbl_gguf.gguf.from_artifact import (RUNTIMES, LayerChoice, TapsRequest, check_method, check_stock_runtime,
                                         check_taps, chosen_layers, gguf_notes, linear_map, provenance,
                                         recorded_scores, source_provenance, taps_maps, uses_refined, weight_notes,
                                         writer)
from nbl_gguf.gguf.quantize import FLOAT_TYPES, check_quant
from nbl_gguf.outputs import check_output_dir, check_output_file
from nbl_gguf.usage import StageMeter, peak_rss_bytes

DEFAULT_QUANT = "q4_k_m"
# the summary's held-out perplexity: a small slice, so that it costs seconds on a small model
EVAL_CTX = 512
EVAL_CHUNKS = 8
SUMMARY_CTX = 4096  # the summary's KV cache figures: at this context, and at the model's training context
# --kv-budget's measurement: llama-perplexity of each candidate at this context (or the budget's, if shorter),
# one chunk of each kind's selection text (a KV type's loss grows with the context: 512 tokens cannot see it)
BUDGET_CTX = 4096
BUDGET_CHUNKS = 1
# what the calibration takes from convert's own flags as they are (the rest: calibration_settings)
CALIBRATION_FLAGS = flags.group_names(flags.add_dataset_arguments, flags.add_compute_arguments,
                                      flags.add_selection_arguments) + ("batch_size", "method", "seed", "no_progress",
                                                                        "threads", "taps_rank")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_model(parser, "HF folder, hub id or GGUF file of a supported model (llama, mistral, qwen2/3, phi3, "
                            "gemma2/3, ...) (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--quant", default=None,
                        help="output type of a HF model: any llama-quantize type (q4_k_m, q5_k_m, q8_0, ...) or "
                             f"f32/f16/bf16 (default: {DEFAULT_QUANT}); a GGUF --model keeps its own types")
    parser.add_argument("--nbl-type", default=None, metavar="TYPE",
                        help="ggml type of the NBL weights (q8_0, q5_k, f16, ...; default: the type of each replaced "
                             "layer's attn_output in the (quantized) stock file, raised to at least 5.5 bits per weight)")
    parser.add_argument("--runtime", default="nbl", choices=list(RUNTIMES),
                        help="nbl (default): the NBL layout, W x + b, for the patched llama.cpp; stock: llama.cpp's "
                             "deci architecture with bias-free maps, which unmodified builds run (llama, mistral)")
    parser.add_argument("--method", default="attn-nbl",
                        help="attn-nbl (attention -> W x + b) or attn-drop (attention removed); "
                             "block-nbl is evaluated in PyTorch only")
    flags.add_selection_arguments(parser)
    flags.add_taps_arguments(parser, auto=True)
    parser.add_argument("--nbl-retrieval", type=flags.retrieval_tolerance, default=None, metavar="NATS",
                        help="check the selection for recall: walk its layers, then its criterion's next ones, on "
                             "facts hidden far back in the selection text, and replace a layer only while their "
                             "answer's loss rises by at most NATS per token over the unmodified model's (e.g. 0.15; "
                             "docs/results/recall.md) (default: off)")
    flags.add_window_arguments(parser)
    flags.add_dataset_arguments(parser)
    parser.add_argument("--nsamples", type=int, default=None,
                        help="calibration windows (default: calibrate's: 256 on CUDA, 32 on a CPU)")
    parser.add_argument("--seqlen", type=int, default=None, help="tokens per calibration window (default: calibrate's)")
    parser.add_argument("--batch-size", type=int, default=1, help="calibration windows per forward pass")
    flags.add_compute_arguments(parser)
    flags.add_calibration(parser, "reuse a calibration artifact directory (from `calibrate`) instead of calibrating")
    parser.add_argument("--save-calibration", default=None, metavar="DIR",
                        help="keep the calibration artifact made by this run in DIR")
    parser.add_argument("--imatrix", action="store_true",
                        help="quantize with an importance matrix (llama-imatrix over the calibration text)")
    parser.add_argument("--imatrix-chunks", type=int, default=64, help="imatrix chunks of 512 tokens (default: 64)")
    parser.add_argument("--intermediate", default=None, choices=["f32", "f16", "bf16"],
                        help="HF --model only: type of the stock conversion that is rewritten and quantized "
                             "(default: the checkpoint's own type when all its weights are f16 or bf16, else f32)")
    parser.add_argument("--stock-gguf", default=None, metavar="GGUF",
                        help="HF --model only: its stock file at --quant, already made by llama.cpp's converter and "
                             "llama-quantize without an imatrix (checked against the model's shape and --quant): the "
                             "NBL file is cut from it instead of converting the model again (bench --frontier passes "
                             "the stock file it measures)")
    flags.add_threads(parser, "of PyTorch while calibrating and of llama-quantize, llama-imatrix and "
                              "llama-perplexity (default: theirs)")
    flags.add_seed(parser, "the calibration and llama-imatrix")
    flags.add_no_progress(parser)
    flags.add_refine_arguments(parser, "on where the file carries fitted attn-nbl maps (--runtime nbl, no budget): "
                                       "at 8,192 tokens every kind of text gained, in under half the calibration's "
                                       "time; where it cannot run, the convert says why and writes the LMMSE maps")
    parser.add_argument("--kv-budget", default=None, metavar="SIZE",
                        help="the KV cache budget at --ctx-size (e.g. 640MiB, 1.5GiB): convert chooses the KV type "
                             "(f16, q8_0, q4_0) and m, each type with the fewest layers that fit, by measured held-out "
                             "perplexity at a long context (the stock file with a quantized cache among them)")
    parser.add_argument("--total-budget", default=None, metavar="SIZE",
                        help="the memory the model takes at --ctx-size (e.g. 6GiB): its weights, the file's tensors "
                             "as llama.cpp loads them, its KV cache as llama.cpp allocates it, and llama.cpp's "
                             "compute and output buffers as it reserves them at -ub (--ubatch-size: a smaller one "
                             "shrinks them); convert chooses as --kv-budget does, within what the stock file's "
                             "weights and buffers leave, and leaves out a candidate whose own take more")
    parser.add_argument("--kv-budget-passkey", choices=("on", "off"), default="on",
                        help="--kv-budget, --total-budget: also give each candidate and the stock file the passkey test at the "
                             "measurement's context, with the candidate's cache type; one that finds fewer keys "
                             "than stock ranks after those that find as many (default: on; off saves about 5 "
                             "prompts of that length per candidate)")
    parser.add_argument("--no-eval", action="store_true",
                        help="skip the held-out perplexity of the stock and NBL files (llama-perplexity)")
    parser.add_argument("--eval-chunks", type=int, default=EVAL_CHUNKS,
                        help=f"held-out chunks of {EVAL_CTX} tokens for that perplexity (default: {EVAL_CHUNKS})")
    flags.add_output(parser, "output GGUF (default: model-nbl.gguf)", default="model-nbl.gguf", metavar="GGUF")
    # --total-budget of a HF model: the stock file one weight type down, made from the same float file as the stock
    # file (convert_stock_first), for the budget's weight-type candidate; not an option
    parser.set_defaults(budget_weight_down=None)


# --- inputs ------------------------------------------------------------------------------------

def resolve_source(args):
    """--model as a ModelSource, with the options that only one kind of input takes checked first."""
    from nbl_gguf.gguf import nbl_format
    from nbl_gguf.model_source import is_gguf_file, resolve_model

    if not is_gguf_file(args.model):
        check_quant(args.quant or DEFAULT_QUANT)  # before a hub download
        return resolve_model(args.model)
    if args.quant is not None:
        raise NblError(f"--quant {args.quant} means nothing for a GGUF --model: the NBL file keeps every tensor of "
                       f"{Path(args.model).name} as it is; --nbl-type chooses the type of the NBL weights")
    if args.stock_gguf is not None:
        raise NblError(f"--stock-gguf means nothing for a GGUF --model: {Path(args.model).name} is the stock file")
    if args.imatrix:
        raise NblError("--imatrix means nothing for a GGUF --model: nothing is quantized again (the file's own "
                       "tensors, imatrix-quantized or not, are kept as they are)")
    if args.intermediate is not None:
        raise NblError(f"--intermediate {args.intermediate} means nothing for a GGUF --model: no stock conversion is "
                       f"made (the NBL file is {Path(args.model).name} itself with the replaced attention swapped)")
    return resolve_model(args.model, runnable=nbl_format.SUPPORTED_ARCHITECTURES, calibrating=not args.calibration)


def check_stock_gguf(args, source, quant: str, n_layer: int, hidden: int) -> None:
    """--stock-gguf: a GGUF of the HF --model's architecture and shape at --quant, without the options that
    would have made it another way."""
    from nbl_gguf.gguf.from_artifact import gguf_architecture
    from nbl_gguf.model_source import read_gguf

    if args.imatrix:
        raise NblError("--stock-gguf and --imatrix: the stock file is used as it is, quantized already (leave one out)")
    if args.intermediate is not None:
        raise NblError(f"--stock-gguf and --intermediate {args.intermediate}: no stock conversion is made (leave one out)")
    path = Path(args.stock_gguf)
    if not path.is_file():
        raise NblError(f"--stock-gguf {path}: no such file")
    stock = read_gguf(path, calibrating=False, flag="--stock-gguf")
    found = {"architecture": stock.architecture, "blocks": stock.n_layer, "embedding width": stock.n_embd,
             "type": stock.file_type.upper()}
    wanted = {"architecture": gguf_architecture(source), "blocks": n_layer, "embedding width": hidden,
              "type": quant.upper()}
    differ = [f"{key} {found[key]} (the model's: {wanted[key]})" for key in found if found[key] != wanted[key]]
    if differ:
        raise NblError(f"--stock-gguf {path} is not {source.name} at {quant}: {', '.join(differ)}")


def layer_choice(args, m=None) -> LayerChoice:
    """--m (or ``m``), --criterion and --max-ppl-increase, for from_artifact.chosen_layers."""
    return LayerChoice(args.m if m is None else m, args.criterion, args.max_ppl_increase)


def calibration_settings(args, directory: Path, model, taps: int) -> Settings:
    """The calibration that convert runs (with the same options as `calibrate`) into ``directory``;
    ``model`` is what calibrate's --model takes (a HF folder, or a GGUF file, which it streams from);
    ``taps``: --taps resolved (from_artifact.check_taps)."""
    settings = Settings(model=str(model), output=str(directory), taps=taps,
                        targets="attn")  # a GGUF replaces attention only: the block fits would cost a third more time
    for name in CALIBRATION_FLAGS:
        setattr(settings, name, getattr(args, name))
    if args.nsamples is not None:
        settings.nsamples = args.nsamples
    if args.seqlen is not None:
        settings.seqlen = args.seqlen
    return settings


def heldout_perplexities(stock: Path, nbl: Path, tmp: Path, args, kv_type: str = "f16", n_ctx: int = EVAL_CTX,
                         chunks: int | None = None) -> dict:
    """{kind: llama-perplexity of the stock and the NBL file} on the first chunks of each bundled kind's
    evaluation part (C4 web text, Python docs, Python code: text never calibrated or selected on)."""
    from nbl_gguf.calibration.dataset import KINDS, write_evaluation_text
    from nbl_gguf.llamacpp.perplexity import perplexity

    measured = {}
    for kind in KINDS:
        text = write_evaluation_text(kind, tmp / f"heldout-{kind}.txt")
        results = {name: perplexity(path, text, n_ctx=n_ctx, chunks=chunks or args.eval_chunks, threads=args.threads,
                                    cache_type=kv_type)  # both files with the file's cache type
                   for name, path in (("stock", stock), ("nbl", nbl))}
        measured[kind] = {"tokens": results["nbl"].tokens, "chunks": results["nbl"].chunks, "ctx": n_ctx,
                          "stock": results["stock"].ppl, "nbl": results["nbl"].ppl}
    return measured


def imatrix_context(artifact) -> int:
    """llama-imatrix's context: the calibration's window length, at most 512 (512 without a calibration)."""
    seqlen = int((artifact.report.get("data", {}).get("seqlen") if artifact is not None else None) or 512)
    return max(32, min(512, seqlen))


def calibration_texts(args, artifact, ctx: int) -> list[str]:
    """The calibration documents for llama-imatrix: enough for --imatrix-chunks windows of ``ctx`` tokens
    (llama-imatrix wants at least two windows), at most the whole source."""
    from nbl_gguf.calibration.dataset import DEFAULT_DATASET, iter_texts

    dataset = args.dataset
    if args.calibration and dataset is None:
        recorded = artifact.report.get("data", {}).get("dataset")
        dataset = None if recorded in (None, DEFAULT_DATASET) else recorded
    wanted_chars = 8 * ctx * (max(2, args.imatrix_chunks) + 1)  # ~4 characters per token, twice over
    texts, chars = [], 0
    for text in iter_texts(dataset, config=args.dataset_config, split=args.split, field=args.text_field):
        texts.append(text)
        chars += len(text)
        if chars >= wanted_chars:
            break
    return texts


# --- the pipeline ------------------------------------------------------------------------------

def intermediate_type(args, quant: str, model_dir: Path) -> str:
    """The type of the stock conversion that is rewritten and then quantized (or kept, for a float --quant)."""
    from nbl_gguf.gguf.hf_to_gguf import default_intermediate

    return quant.lower() if quant in FLOAT_TYPES else args.intermediate or default_intermediate(model_dir)


def make_stock(args, source, quant: str, artifact, tmp: Path, stage, also: str | None = None) -> tuple[Path, Path | None]:
    """(the stock GGUF of a HF model at ``quant``, in ``tmp``, the imatrix it was quantized with or None); each
    step in a ``stage(name)``. Only one float file is ever on disk. ``also``: another type quantized from the same
    float file, to tmp / stock-{also}.gguf."""
    from nbl_gguf.gguf.hf_to_gguf import convert_hf_to_gguf
    from nbl_gguf.gguf.quantize import compute_imatrix, quantize

    model_dir, imatrix = source.hf_folder(), None
    intermediate = intermediate_type(args, quant, model_dir)
    with stage("stock conversion"):
        stock = convert_hf_to_gguf(model_dir, tmp / f"stock-{intermediate}.gguf", intermediate)
    if quant in FLOAT_TYPES:
        return stock, None
    if args.imatrix:
        with stage("imatrix"):
            ctx = imatrix_context(artifact)
            imatrix = compute_imatrix(stock, calibration_texts(args, artifact, ctx), tmp / "imatrix.gguf", ctx=ctx,
                                      chunks=args.imatrix_chunks, threads=args.threads, seed=args.seed)
    with stage("quantize stock"):
        quantized = quantize(stock, tmp / f"stock-{quant}.gguf", quant, imatrix=imatrix, threads=args.threads)
        if also is not None:
            quantize(stock, tmp / f"stock-{also}.gguf", also, imatrix=imatrix, threads=args.threads)
    stock.unlink()
    return quantized, imatrix


def convert_stock_first(args, source, quant: str, output: Path) -> Summary:
    """--total-budget of a HF model: the budget is the stock file's weights, llama.cpp's buffers and a KV cache, and
    how many layers the calibration must go to depends on what the weights leave, so the stock file is made first;
    the rest runs as with that file for --stock-gguf."""
    from nbl_gguf.measurement.frontier import neighbour_types

    meter = StageMeter()
    print(f"total budget: the stock {quant} file first, whose weights and buffers decide the KV cache's share",
          file=sys.stderr)
    # llama.cpp's weight-type knob from the float file too, as a user would make it (weight_down_file)
    down = neighbour_types(quant)[0] if quant.upper() in WEIGHT_DOWN_FROM else None
    with tempfile.TemporaryDirectory(prefix=f".{output.name}.stock-", dir=output.parent) as tmp:
        stock, _ = make_stock(args, source, quant, None, Path(tmp), meter, also=down)  # no imatrix: refused
        summary = convert(argparse.Namespace(**(vars(args) | {
            "stock_gguf": str(stock), "intermediate": None,
            "budget_weight_down": str(Path(tmp) / f"stock-{down}.gguf") if down else None})))
    summary.resources = {**meter.stages, **summary.resources}
    return summary


def convert(args) -> Summary:
    from tqdm import tqdm

    from nbl_gguf.calibration.artifact import load_artifact
    from nbl_gguf.calibration.calibrate import calibrate
    from nbl_gguf.calibration.report import describe_artifact
    from nbl_gguf.gguf import nbl_format
    from nbl_gguf.gguf.hf_to_gguf import check_conversion_space, check_hf_folder, model_shape
    from nbl_gguf.gguf.metadata import kv_sizes, open_gguf, taps_state, training_context

    asked = args  # as given: the checks below fill in what a budget chooses
    # cheap checks first: a typo must not cost a calibration
    method = check_method(args.method)
    output = Path(args.output)
    if output.suffix.lower() != ".gguf":
        raise NblError(f"-o {output}: the output name must end in .gguf")
    check_output_file(output, "-o")
    if args.save_calibration:
        if args.calibration:
            raise NblError(f"--save-calibration keeps the calibration that this run makes; with --calibration "
                           f"{args.calibration} it makes none")
        check_output_dir(args.save_calibration, "--save-calibration", renamed_into_place=True)
    source = resolve_source(args)
    if source.gguf is not None:
        if output.resolve() == source.gguf.path.resolve():
            raise NblError(f"-o {output} is the --model file itself: the NBL file must go elsewhere")
        quant = source.gguf.file_type
        n_layer, hidden = source.gguf.n_layer, source.gguf.n_embd
    else:
        quant = check_quant(args.quant or DEFAULT_QUANT)
        check_hf_folder(source.hf_folder())
        n_layer, hidden = model_shape(source.hf_folder())
        if args.stock_gguf is not None:
            check_stock_gguf(args, source, quant, n_layer, hidden)
    if args.runtime == "stock":
        check_stock_runtime(source)
    if args.taps == "auto" and not args.calibration:
        from nbl_gguf import models

        device = models.resolve_device(args.device)
    else:
        device = "cpu"  # not asked: the count is given, or the artifact's
    taps = check_taps(TapsRequest(args.taps, runtime=args.runtime, taps_rank=args.taps_rank, nsamples=args.nsamples,
                                  seqlen=args.seqlen, from_artifact=bool(args.calibration)),
                      source, method, hidden, device)
    if source.gguf is None and args.stock_gguf is None:
        check_conversion_space(source.hf_folder(), intermediate_type(args, quant, source.hf_folder()),
                               output.resolve().parent, quantized=quant not in FLOAT_TYPES)
    if args.nbl_type is not None and method == "attn-nbl":
        nbl_format.parse_weight_type(args.nbl_type, hidden)
    budgeted = budget_flag(args)
    if budgeted is None:  # --windows' one size (the budget reads the list: budget_window_sizes)
        args = argparse.Namespace(**(vars(args) | {"window_size": flags.one_window_size(args.window_size)}))
    window_ctx = check_windows(args, source, n_layer)
    if budgeted is None and args.kv_budget_passkey != "on":
        raise NblError("--kv-budget-passkey means nothing without --kv-budget or --total-budget")
    # --total-budget of a HF model: the stock file's weights are known once it is made (convert_stock_first)
    stock_first = args.total_budget is not None and source.gguf is None and args.stock_gguf is None
    budget = check_kv_budget(args, source, n_layer, stock_first) if budgeted is not None else None
    if budget is not None and args.nbl_retrieval is not None:
        raise NblError(f"--nbl-retrieval with {budgeted}: the budget checks each candidate's recall itself "
                       f"(--kv-budget-passkey)")
    if budget is not None and budget.total is not None and not stock_first:
        from nbl_gguf.measurement.kv_budget import format_mib

        print(f"total budget: in the stock file {budget.held.describe()} leaving {format_mib(budget.bytes)} for the "
              f"KV cache at {budget.n_ctx:,} tokens", file=sys.stderr)
    if budget is not None:
        args = argparse.Namespace(**(vars(args) | {"m": budget.most_layers}))  # the calibration goes that far
    m, _ = selection_budget(args.m, args.max_ppl_increase)
    if m is not None and not 0 <= m <= n_layer:
        raise NblError(f"--m {m} is out of range: {source.name} has {n_layer} layers")
    flags.check_calibration(args.calibration)
    # a file whose only change is window layers fits no map: it needs no calibration (on SmolLM2 that was 251 s
    # of a 21-minute `--m 0 --windows 15`, the fit of every layer's map, none of them used)
    calibrating = not args.calibration and not (m == 0 and budget is None)
    if m == 0 and budget is None:
        if not args.windows:
            raise NblError("--m 0 replaces no layer: give --windows N (window layers alone) or --kv-budget, or the "
                           "output would be the stock file as it is")
        if args.refine:
            raise NblError("--refine tunes the maps of the replaced layers, and --m 0 replaces none")
        if args.save_calibration:
            raise NblError(f"--save-calibration {args.save_calibration}: --m 0 with window layers alone runs no "
                           f"calibration (no map is fitted)")
    if args.eval_chunks < 1:
        raise NblError(f"--eval-chunks must be at least 1, got {args.eval_chunks}")
    model = source.gguf.path if source.gguf is not None else source.hf_folder()  # what calibrate's --model takes
    refining = args.refine if args.refine is not None else m != 0 and refines_by_default(args, method)
    refine_plan = None
    if refining:
        from nbl_gguf.calibration.refine import planned

        check_refine(args, method)
        try:
            refine_plan = planned(source, calibration_settings(args, output.parent, model, taps),
                                  flags.refine_settings(args))
        except NblError as error:
            refining = not_refined(args, error)

    if stock_first:
        return convert_stock_first(asked, source, quant, output)

    steps = ["calibrate"] if calibrating else ["load calibration"] if args.calibration else []
    if source.gguf is None and args.stock_gguf is None:
        steps.append("stock conversion")
        if quant not in FLOAT_TYPES:
            steps += (["imatrix"] if args.imatrix else []) + ["quantize stock"]
    checking_recall = args.nbl_retrieval is not None and (calibrating or args.calibration) and m != 0
    if checking_recall:
        steps.insert(1, "retrieval check")  # right after the calibration
    if refining:
        steps.append("refine")
    if args.windows:
        steps.append("window layers")
    steps.append("NBL surgery")
    if not args.no_eval:
        steps.append("held-out perplexity")
    progress = tqdm(total=len(steps), desc="convert", unit="step", disable=args.no_progress, file=sys.stderr)
    meter = StageMeter()

    @contextmanager
    def stage(name):
        progress.set_postfix_str(name)
        with meter(name):
            yield
        progress.update()

    with tempfile.TemporaryDirectory(prefix=f".{output.name}.work-", dir=output.parent) as tmp:
        tmp = Path(tmp)
        # 1. calibration
        artifact, selected = None, []
        if calibrating or args.calibration:
            with stage(steps[0]):
                if args.calibration:
                    artifact = load_artifact(args.calibration)
                else:
                    target = Path(args.save_calibration) if args.save_calibration else tmp / "calibration"
                    artifact = load_artifact(calibrate(calibration_settings(args, target, model, taps)))
                    print(describe_artifact(artifact))
                if args.calibration and args.taps == "auto":
                    taps = artifact.taps
                if artifact.num_layers != n_layer:
                    raise NblError(f"the calibration has {artifact.num_layers} layers but {source.name} has "
                                   f"{n_layer}: it was made for another model")
                artifact_hidden = artifact.report.get("model", {}).get("hidden_size")
                if artifact_hidden is not None and int(artifact_hidden) != hidden:
                    raise NblError(f"the calibration is for hidden size {artifact_hidden}, {source.name} has {hidden}")
                if budget is None:
                    artifact = measure_best(artifact, args, source, method, n_layer, taps, meter)
                selected = chosen_layers(artifact, layer_choice(args), method, n_layer, taps)
        recall = None
        if checking_recall and selected:
            # 1a. the chosen layers walked on retrieval probes: a layer that recall needs is not replaced
            from nbl_gguf.calibration.recall import describe as describe_recall

            with stage("retrieval check"):
                recall = recall_layers(args, source, artifact, method, taps, selected)
                print(describe_recall(recall), file=sys.stderr)
            selected = list(recall.layers)
        if refining:
            # 1b. the chosen layers' maps tuned against the model's output, added to the artifact (unless it
            # holds them already)
            from nbl_gguf.calibration.refine import refine_artifact

            with stage("refine"):
                if selected and not artifact.refined_for(selected, taps):
                    try:
                        artifact = refine_artifact(artifact, source,
                                                   calibration_settings(args, artifact.path, model, taps),
                                                   selected, refine_plan, taps=taps)
                    except NblError as error:
                        not_refined(args, error)
        if artifact is not None:
            layers = nbl_layers(artifact, args, source, method, n_layer, taps, selected)
            if recall is not None:
                layers.calibration = {**layers.calibration, "recall": recall.report()}
        else:
            layers = nbl_format.NblLayers(types=[nbl_format.ATTENTION] * n_layer, method=method,
                                          criterion=args.criterion,
                                          calibration=source_provenance(Path(source.name), source.gguf))
        if calibrating:
            # the calibration's own stages, measured inside it (layers, selection, ...)
            meter.merge(artifact.report.get("resources", {}), prefix="calibrate: ")
        windows = None
        if args.windows:
            # 1c. the window layers, among the attention layers left, on top of the replaced ones
            with stage("window layers"):
                windows = kept_window_layers(args, source, layers, window_ctx)
            layers.windows = nbl_format.Windows(layers=windows.layers, size=args.window_size, sinks=args.window_sinks)

        imatrix = None
        if source.gguf is not None:
            stock_final = source.gguf.path  # the user's own file is the stock file of the comparison
        elif args.stock_gguf is not None:
            stock_final = Path(args.stock_gguf)  # made as below, by whoever asked (checked in check_stock_gguf)
        else:
            # 2. the stock conversion, quantized before the surgery: the NBL file keeps the stock file's tensor
            # types, as for a GGUF --model
            stock_final, imatrix = make_stock(args, source, quant, artifact, tmp, stage)

        kv_type, budget_report = args.kv_type, None
        if budget is not None:
            # 3a. the KV budget: each cache type's fewest layers, measured through llama.cpp
            with stage("KV budget"):
                chosen, budget_report, chosen_file = choose_for_budget(budget, artifact, args, source, method, n_layer,
                                                                       taps, stock_final, imatrix, tmp)
            selected, kv_type = list(chosen.layers), chosen.kv_type
            layers = budget_layers(chosen, artifact, args, source, method, n_layer, taps)

        # 3. the surgery: the replaced layers' attention out, their maps in
        with stage("NBL surgery"):
            if selected or layers.windows is not None:
                weights = surgery(stock_final, output, layers, args, imatrix)
                notes = gguf_notes(source.gguf, weights, args.nbl_type, args.runtime) if source.gguf is not None \
                    else weight_notes(weights, args.nbl_type)
            elif budget is not None and chosen.weight_type:  # llama.cpp's weight-type knob won: that file as it is
                copy_atomically(chosen_file, output)
                notes = [f"no layer replaced: the stock model at {chosen.weight_type} with a {kv_type} KV cache "
                         f"measured best within the budget"]
            else:  # the budget's winner is the stock file with a quantized cache: it is the output as it is
                copy_atomically(stock_final, output)
                notes = [f"no layer replaced: the stock file with a {kv_type} KV cache measured best within the budget"]
            if recall is not None:
                notes.insert(0, describe_recall(recall))
        heldout = None
        if not args.no_eval:
            with stage("held-out perplexity"):
                # a window only shows past its size: then the evaluation is at a long context (--window-ctx,
                # or the budget's)
                long_ctx = window_ctx or (budget.eval_ctx if budget is not None else None)
                heldout = heldout_perplexities(stock_final, output, tmp, args, kv_type,
                                               **({"n_ctx": long_ctx, "chunks": 1}
                                                  if layers.windows is not None and long_ctx else {}))
        progress.close()

        stock_reader = open_gguf(stock_final)
        # the KV cache at the summary's context and at the training context, llama-cli's default -c, if longer
        contexts = sorted({SUMMARY_CTX, max(SUMMARY_CTX, training_context(stock_reader) or 0)})
        if args.ctx_size:  # the context the selection reported its saving at
            contexts = sorted({SUMMARY_CTX, args.ctx_size})
        types = layers.types
        output_reader = open_gguf(output)
        if layers.windows is not None:  # the file's own window layers: its sliding cache beside the global one
            kv = {n_ctx: kv_sizes(output_reader, n_ctx, kv_type=kv_type, n_ubatch=args.ubatch_size) for n_ctx in contexts}
        else:
            kv = {n_ctx: kv_sizes(stock_reader, n_ctx, types, kv_type=kv_type, n_ubatch=args.ubatch_size)
                  for n_ctx in contexts}
        if (layers.calibration or {}).get("refine"):
            from nbl_gguf.calibration.report import describe_refine

            notes.append(describe_refine(artifact.report["refine"]))
        return Summary(heldout=heldout, notes=notes,
            # attn-taps where the maps read past tokens: what nbl.method says
            model=(artifact.report.get("model", {}).get("name") if artifact is not None else None) or source.name,
            quant=quant, method=layers.method,
            criterion=args.criterion, n_layer=n_layer, replaced=selected,
            scores=layers.scores if layers.scores_criterion == args.criterion else None,
            stock_bytes=stock_final.stat().st_size, nbl_bytes=output.stat().st_size,
            kv=kv, kv_type=kv_type, n_ubatch=args.ubatch_size, budget=budget_report, output=output, runtime=args.runtime,
            resources=meter.stages, output_type=chosen.weight_type if budget is not None else None,
            windows=window_report(windows, layers),
            taps_state_bytes=(taps_state(output_reader, types) or {}).get("state_bytes_per_sequence", 0),
        )


def measure_best(artifact, args, source, method: str, n_layer: int, taps: int, meter):
    """The artifact, with --criterion best measured at --m for these maps where its calibration chose for
    another m or maps (calibration.best_at: the criteria's winner at one m is not a prefix of another's)."""
    from nbl_gguf import models
    from nbl_gguf.calibration import best_at
    from nbl_gguf.calibration.settings import default_m

    choice = layer_choice(args)
    m = default_m(n_layer) if choice.m is None else choice.m
    if choice.criterion != "best" or m == "auto" or not artifact.best_unmeasured(m, method, taps):
        return artifact
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    with meter("best at m"):
        return best_at.measure_and_record(artifact, source, [m], method, taps, models.resolve_device(args.device),
                                          args.batch_size, log=lambda text: print(text, file=sys.stderr))


def refines_by_default(args, method: str) -> bool:
    """Whether a convert given neither --refine nor --no-refine refines its maps: where it writes fitted maps
    that --refine may tune (docs/results/refine.md: at 8,192 tokens every kind of text gained on SmolLM2 and
    Qwen 0.5B, in under half the calibration's time)."""
    return method == "attn-nbl" and args.runtime == "nbl" and budget_flag(args) is None


def not_refined(args, error: NblError) -> bool:
    """A refinement that cannot run: an error where --refine asked for it, else a note (the file carries the
    LMMSE maps, which the training-free path writes anyway). False: not refining."""
    if args.refine:
        raise error
    print(f"note: the maps are not refined ({error}); the file carries their LMMSE fit (--no-refine says so "
          f"without trying)", file=sys.stderr)
    return False


def check_refine(args, method: str) -> None:
    """--refine, checked before anything runs."""
    from nbl_gguf.calibration.refine import check_refinable

    flags.refine_settings(args).check()
    check_refinable(method)
    if args.runtime != "nbl":
        raise NblError("--refine tunes the NBL layout's maps (with bias); --runtime stock writes bias-free maps, which "
                       "are not refined: use --runtime nbl")
    if budget_flag(args) is not None:
        raise NblError(f"--refine with {budget_flag(args)}: the budget measures several sets of layers, and a "
                       f"refinement holds for one; choose the set with the budget first, then convert it with --m and "
                       f"--refine")


def nbl_layers(artifact, args, source, method: str, n_layer: int, taps: int, selected: list[int]):
    """The nbl_format.NblLayers of the file: ``selected`` replaced by the artifact's maps of ``method``
    (its refined maps where it holds them for these layers, unless --no-refine)."""
    from nbl_gguf.gguf import nbl_format

    scores, scores_criterion = recorded_scores(artifact, args.criterion, selected, method, taps)
    layer_type = nbl_format.DROPPED if method == "attn-drop" else nbl_format.TAPS if taps > 1 else nbl_format.LINEAR
    refined = (method == "attn-nbl" and args.refine is not False
               and uses_refined(artifact, selected, taps, args.runtime))
    types = [layer_type if i in selected else nbl_format.ATTENTION for i in range(n_layer)]
    linear = {i: linear_map(artifact, i, args.runtime, refined) for i in selected if layer_type == nbl_format.LINEAR}
    past = taps_maps(artifact, selected, taps, refined) if layer_type == nbl_format.TAPS else {}
    return nbl_format.NblLayers(types=types, linear=linear, taps=past, method="attn-taps" if past else method,
                                criterion=args.criterion, scores=scores, scores_criterion=scores_criterion,
                                calibration=provenance(artifact, Path(source.name), selected, gguf=source.gguf,
                                                       refined=refined, method=method, taps=taps))


def surgery(stock: Path, output: Path, layers, args, imatrix) -> dict:
    """The NBL file from the (quantized) stock file; the NBL weights' types."""
    from nbl_gguf.gguf import nbl_format

    weights = nbl_format.weight_types(stock, layers, args.nbl_type, imatrix=imatrix)
    writer(args.runtime)(stock, output, layers, weight_type=weights)
    return weights


def recall_layers(args, source, artifact, method: str, taps: int, selected: list[int]):
    """calibration.recall.keep_recall of ``selected`` with the artifact's maps, on each bundled kind's selection
    text at recall.DEFAULT_CTX tokens (the training context if shorter), walked in the ranking of the local
    criterion whose first layers they are (--criterion's own first; cosine's for a greedy choice)."""
    import torch

    from nbl_gguf import models
    from nbl_gguf.calibration.artifact import CRITERIA, LOCAL_DEFAULT, METHOD_TARGET
    from nbl_gguf.calibration.best_at import map_reader
    from nbl_gguf.calibration.dataset import KINDS, bundled_selection_windows
    from nbl_gguf.calibration.recall import DEFAULT_CTX, keep_recall
    from nbl_gguf.calibration.solve import ranking
    from nbl_gguf.calibration.stream import LayerStream

    rankings = {c: ranking(artifact.scores(c, METHOD_TARGET[method])) for c in CRITERIA}
    tried = sorted(CRITERIA, key=lambda c: c != args.criterion)
    criterion = next((c for c in tried if sorted(rankings[c][:len(selected)]) == sorted(selected)), LOCAL_DEFAULT)
    layer_type, maps = map_reader(artifact, method, taps)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = models.resolve_device(args.device)
    stream = LayerStream(source, models.resolve_dtype(args.dtype, device), device)
    ctx = min(DEFAULT_CTX, source_training_context(source) or DEFAULT_CTX)
    ids, _ = bundled_selection_windows(stream.tokenizer, {kind: 1 for kind in KINDS}, ctx)
    return keep_recall(stream, ids, selected, rankings[criterion], layer_type, maps, args.nbl_retrieval)


def source_training_context(source) -> int | None:
    """The model's training context (its GGUF's key, or its config's), None where neither says."""
    import json as _json

    if source.gguf is not None:
        from nbl_gguf.gguf.metadata import open_gguf, training_context

        return training_context(open_gguf(source.gguf.path))
    config = _json.loads((source.hf_folder() / "config.json").read_text(encoding="utf-8"))
    return kv_cache.training_context_from_config(config)


# --- --windows -----------------------------------------------------------------------------------------

def check_windows(args, source, n_layer: int) -> int | None:
    """--windows and its companions checked before any work; the context the choice is measured at."""
    from nbl_gguf.calibration.windows import DEFAULT_CTX
    from nbl_gguf.gguf import nbl_format

    if not args.windows:
        return None
    if args.runtime != "nbl":
        raise NblError(f"--windows and --runtime {args.runtime}: window layers need the patched llama.cpp "
                       f"(--runtime nbl)")
    if budget_flag(args) is not None:
        raise NblError(f"--windows and {budget_flag(args)}: the budget chooses its window layers itself (leave one "
                       f"out)")
    arch = source_architecture(source)
    trained = source_training_context(source)
    if arch not in nbl_format.WINDOW_ARCHITECTURES:
        raise NblError(f"--windows: the patched llama.cpp runs window layers for "
                       f"{', '.join(nbl_format.WINDOW_ARCHITECTURES)}; {source.name} is a '{arch}' model")
    if args.windows > n_layer:
        raise NblError(f"--windows {args.windows}: {source.name} has {n_layer} layers")
    ctx = args.window_ctx or min(DEFAULT_CTX, trained or DEFAULT_CTX)
    if ctx <= 2 * args.window_size:
        raise NblError(f"--window-size {args.window_size} at --window-ctx {ctx}: a window only shows past its size, "
                       f"so the choice needs a context above twice the window ({2 * args.window_size + 1} or more)")
    return ctx


def window_layers(args, source, layers, ctx: int, count: int | None = None, size: int | None = None,
                  recall_of: int | None = None):
    """calibration.windows.choose_windows of ``count`` layers (default --windows) of a window of ``size``
    tokens (default --window-size) on each bundled kind's selection text, on top of ``layers``' replaced
    layers (their maps as the file carries them). ``recall_of``: also the global_recall of the first that many
    of its order (no more than the retrieval walk kept), on probes in repeated filler (the choice's
    global_recall; none of fewer than two layers: nothing to trade)."""
    import torch

    from nbl_gguf import models
    from nbl_gguf.calibration.apply import ATTN_DROP, ATTN_LINEAR, ATTN_TAPS
    from nbl_gguf.calibration.dataset import KINDS, bundled_selection_windows
    from nbl_gguf.calibration.stream import LayerStream
    from nbl_gguf.calibration.windows import Window, choose_windows, global_recall, repeated_filler, retrieval_probes
    from nbl_gguf.gguf import nbl_format

    count = args.windows if count is None else count
    left = sum(1 for t in layers.types if t == nbl_format.ATTENTION)
    if count > left:
        raise NblError(f"--windows {count}: {left} attention layers are left after the {len(layers.types) - left} "
                       f"replaced")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = models.resolve_device(args.device)
    stream = LayerStream(source, models.resolve_dtype(args.dtype, device), device)
    ids, _ = bundled_selection_windows(stream.tokenizer, {kind: 1 for kind in KINDS}, ctx)
    kinds = {nbl_format.LINEAR: ATTN_LINEAR, nbl_format.TAPS: ATTN_TAPS, nbl_format.DROPPED: ATTN_DROP}
    replaced = {i: kinds[t] for i, t in enumerate(layers.types) if t != nbl_format.ATTENTION}

    def maps(layer: int, layer_type: int):
        return layers.linear[layer] if layer_type == ATTN_LINEAR else layers.taps[layer]

    window = Window(args.window_size if size is None else size, args.window_sinks)
    guard = {} if args.window_retrieval is None else \
        {"probes": retrieval_probes(stream.tokenizer, ids, window), "tolerance": args.window_retrieval}
    choice = choose_windows(stream, ids, count, window, replaced=replaced, maps=maps, ranking=args.window_ranking,
                            **guard)
    if recall_of and choice.retrieval is not None:
        recall_of = min(recall_of, len(choice.retrieval.kept))
    if recall_of and recall_of > 1:
        # the walk's seed 0 probes are in this text: other keys (seed 1) in filler of the same texts
        probes = retrieval_probes(stream.tokenizer, repeated_filler(ids), window, seed=1)
        choice.global_recall = global_recall(stream, probes, choice.order[:recall_of], window, replaced=replaced,
                                             maps=maps)
    return choice


def kept_window_layers(args, source, layers, ctx: int):
    """window_layers for --windows, kept on disk under everything it depends on (window_choice_key) as the budget's
    window order is: the same convert run again (another --quant, an interruption, a frontier's other work dir)
    takes the choice instead of measuring it again (12-15 min for SmolLM2 on 2 cores, most of a window file)."""
    from nbl_gguf.calibration.windows import WindowChoice
    from nbl_gguf.measurement.memo import Memo, memo_root

    report, was_kept = Memo(memo_root()).cached(window_choice_key(args, source, layers, ctx),
                                                lambda: window_layers(args, source, layers, ctx).report())
    choice = WindowChoice.from_report(report)
    if was_kept:
        print(f"window layers: {list(choice.layers)} (kept from an earlier run)", flush=True)
    return choice


def window_choice_key(args, source, layers, ctx: int) -> dict:
    """What --windows' choice depends on: the budget window order's settings, the count, and the replaced layers
    it is measured on top of (their types and maps)."""
    return window_order_key(args, source, ctx, args.window_size, None) | {
        "what": "window choice", "count": args.windows, "replaced": layers.maps_digest()}


def window_report(choice, layers) -> dict | None:
    """The summary's window layers: --windows' measured choice, or the ones a --kv-budget candidate had."""
    if choice is not None:
        return choice.report()
    if layers.windows is None:
        return None
    return {"layers": list(layers.windows.layers), "size": layers.windows.size, "sinks": layers.windows.sinks}


def source_architecture(source) -> str:
    """The GGUF architecture of --model (a GGUF's own; the one a HF folder converts to)."""
    import json as _json

    from nbl_gguf import models

    if source.gguf is not None:
        return source.gguf.architecture
    return models.get_adapter(_json.loads((source.hf_folder() / "config.json").read_text(encoding="utf-8"))).gguf_arch


def budget_window_sizes(args, source, ctx: int) -> tuple[int, ...]:
    """The window sizes --kv-budget chooses among: --window-size's, or each of BUDGET_WINDOW_SIZES that shows
    at the measuring context ``ctx`` (a window only shows past its size: above twice it); none where the file
    cannot carry window layers."""
    from nbl_gguf.calibration.windows import BUDGET_WINDOW_SIZES
    from nbl_gguf.gguf import nbl_format

    if args.runtime != "nbl" or source_architecture(source) not in nbl_format.WINDOW_ARCHITECTURES:
        return ()
    sizes = flags.given_window_sizes(args.window_size)
    if sizes is None:
        return tuple(size for size in BUDGET_WINDOW_SIZES if ctx > 2 * size)
    for size in sizes:
        if ctx <= 2 * size:
            raise NblError(f"--window-size {size} with {budget_flag(args)}: the candidates are measured at {ctx:,} tokens, "
                           f"and a window only shows past its size (at most {(ctx - 1) // 2:,} here)")
    return tuple(sorted(set(sizes)))


def budget_window_order(args, source, n_layer: int, ctx: int, size: int, needed: int | None = None):
    """(the layers in the order they are best made window layers of ``size`` tokens, how many of them the
    retrieval walk kept, the GlobalRecall of the largest set a candidate can take without a refused layer)
    (calibration.windows.WindowChoice.order: each measured alone on the stock model, and walked with the
    retrieval probes unless --window-retrieval off, as far as ``needed`` kept layers; the count and the recall
    are None without the walk)."""
    import time

    from nbl_gguf.calibration.windows import GlobalRecall
    from nbl_gguf.gguf import nbl_format
    from nbl_gguf.measurement.memo import Memo, memo_root

    stock = nbl_format.NblLayers(types=[nbl_format.ATTENTION] * n_layer)

    def measured() -> dict:
        # the longest silent stage of a budget (50 min for Qwen2.5-Coder-0.5B at 4,096 tokens on 2 cores): say what
        # it is
        walk = "" if args.window_retrieval is None else \
            f", then walking them with retrieval probes as far as {needed or n_layer} kept"
        print(f"kv budget: measuring each of the {n_layer} layers as a window layer of {size} tokens at {ctx:,} "
              f"tokens{walk}", flush=True)
        started = time.monotonic()
        if args.window_retrieval is None:
            found = {"order": window_layers(args, source, stock, ctx, count=1, size=size).order, "kept": None,
                     "recall": None}
        else:
            choice = window_layers(args, source, stock, ctx, count=needed or n_layer, size=size,
                                   recall_of=needed or n_layer)
            found = {"order": choice.order, "kept": len(choice.retrieval.kept),
                     "recall": choice.global_recall.report() if choice.global_recall is not None else None}
        return found | {"s": time.monotonic() - started}

    # kept on disk under everything it depends on: a budget run again after an interruption starts past it
    found, was_kept = Memo(memo_root()).cached(window_order_key(args, source, ctx, size, needed), measured)
    when = "kept from an earlier run" if was_kept else f"{found['s']:.0f} s"
    order, kept, recall = found["order"], found["kept"], GlobalRecall.from_report(found["recall"])
    walked = "" if kept is None else f", the walk kept {kept}"
    print(f"kv budget: window order {order}{walked} ({when})", flush=True)
    return order, kept, recall


def window_order_key(args, source, ctx: int, size: int, needed: int | None) -> dict:
    """What budget_window_order's result depends on: the model, the text (this package's, by its version), the
    window, the walk and how the stream computes."""
    from nbl_gguf import __version__, models
    from nbl_gguf.calibration.resume import model_identity

    device = models.resolve_device(args.device)
    return {"what": "budget window order", "model": model_identity(source), "ctx": ctx, "size": size,
            "sinks": args.window_sinks, "needed": needed, "ranking": args.window_ranking,
            "retrieval": args.window_retrieval, "device": device, "dtype": str(models.resolve_dtype(args.dtype, device)),
            "threads": args.threads, "version": __version__}


# --- --kv-budget, --total-budget ---------------------------------------------------------------------------

def budget_flag(args) -> str | None:
    """The budget option given (--kv-budget or --total-budget, one at the most), or None."""
    if args.kv_budget is not None and args.total_budget is not None:
        raise NblError(f"--kv-budget {args.kv_budget} and --total-budget {args.total_budget}: give one (the total "
                       f"holds the weights and the KV cache)")
    return "--kv-budget" if args.kv_budget is not None else "--total-budget" if args.total_budget is not None else None


@dataclass(frozen=True)
class KvBudget:
    bytes: int  # the KV cache's share: --kv-budget, or --total-budget less the stock file's weights
    n_ctx: int  # the context the budget holds at
    model: object  # kv_cache.KvModel of the stock model
    most_layers: int  # the calibration's m: no cache type needs more layers than this to fit
    eval_ctx: int  # the long context the candidates are measured at
    window_sizes: tuple[int, ...] = ()  # the window sizes of its window candidates (budget_window_sizes)
    n_ubatch: int = kv_cache.DEFAULT_UBATCH  # the micro-batch the file will run with (-ub): window caches hold one
    total: int | None = None  # --total-budget: weights, KV cache and llama.cpp's context buffers together
    held: object = None  # with it, kv_budget.Held: the stock file's weights and context buffers


def check_kv_budget(args, source, n_layer: int, weights_unknown: bool = False) -> KvBudget:
    """--kv-budget or --total-budget: parsed, its companions checked, and refused by name when nothing can meet
    it (before any calibration). ``weights_unknown``: a --total-budget whose stock file is not made yet
    (convert_stock_first), checked as if the weights took nothing; the run with that file checks it again."""
    import json as _json

    from nbl_gguf.measurement import kv_budget

    flag = budget_flag(args)
    if args.m is not None:
        raise NblError(f"--m {args.m} and {flag}: the budget chooses m (leave --m out)")
    if args.kv_type != "f16":
        raise NblError(f"--kv-type {args.kv_type} and {flag}: the budget chooses the KV type among "
                       f"{', '.join(kv_budget.KV_TYPES)} (leave --kv-type out)")
    if args.calibration:
        raise NblError(f"{flag} measures its candidates on a calibration made to their depth: leave out "
                       f"--calibration")
    if weights_unknown and args.imatrix:
        raise NblError("--total-budget and --imatrix: the budget needs the stock file's weights before the calibration "
                       "that the imatrix reads; quantize the stock file with llama-quantize --imatrix and give it as "
                       "--stock-gguf")
    if source.gguf is not None:
        from nbl_gguf.gguf.metadata import open_gguf, stock_kv_model, training_context

        reader = open_gguf(source.gguf.path)
        model, trained = stock_kv_model(reader), training_context(reader)
    else:
        config = _json.loads((source.hf_folder() / "config.json").read_text(encoding="utf-8"))
        model, trained = kv_cache.model_from_config(config), kv_cache.training_context_from_config(config)
    n_ctx = args.ctx_size or trained or SUMMARY_CTX
    total = held = None
    if flag == "--kv-budget":
        size = kv_budget.parse_size(args.kv_budget)
    else:
        total = kv_budget.parse_size(args.total_budget, flag)
        if not weights_unknown:
            held = stock_held(source.gguf.path if source.gguf is not None else args.stock_gguf, n_ctx, args.ubatch_size)
        size = total - (held.bytes if held else 0)
    most = kv_budget.check_reachable(model, n_ctx, size, n_layer - 1, args.ubatch_size,
                                     given=f"--total-budget {args.total_budget}" if total is not None else None,
                                     held=held)
    if most == 0 and not weights_unknown:
        stock_kv = kv_budget.kv_bytes(model, n_ctx, 'f16', n_ubatch=args.ubatch_size)
        with_held = (f" with its weights ({kv_budget.format_mib(held.weights)}) and llama.cpp's buffers "
                     f"({kv_budget.format_mib(held.buffers)})" if held else "")
        raise NblError(f"{flag} {args.kv_budget or args.total_budget} at {n_ctx:,} tokens is met by the stock model "
                       f"as it is{with_held} ({kv_budget.format_mib(stock_kv)} with an F16 cache): nothing to replace")
    eval_ctx = min(BUDGET_CTX, n_ctx, trained or n_ctx)
    return KvBudget(size, n_ctx, model, most, eval_ctx, budget_window_sizes(args, source, eval_ctx), args.ubatch_size,
                    total, held)


def stock_held(stock, n_ctx: int, n_ubatch: int):
    """kv_budget.Held of the stock file at a context: its weights and the largest of its context buffers over the
    cache types the budget chooses among (a quantized cache's flash attention takes a little more: the KV share
    must hold for each), as llama.cpp projects them without allocating."""
    from nbl_gguf.gguf.metadata import open_gguf, weight_bytes
    from nbl_gguf.measurement import kv_budget

    buffers = max(buffers_by_cache_type(stock, n_ctx, n_ubatch).values())
    return kv_budget.Held(weight_bytes(open_gguf(stock)), buffers, n_ubatch)


def buffers_by_cache_type(path, n_ctx: int, n_ubatch: int) -> dict[str, int]:
    """{cache type: the bytes of llama.cpp's compute and output buffers} of a file at a context, for each cache type
    a budget chooses among, as llama.cpp projects them without allocating."""
    from nbl_gguf.llamacpp.library import context_buffers
    from nbl_gguf.measurement import kv_budget

    return {kv_type: context_buffers(path, n_ctx=n_ctx, n_ubatch=n_ubatch, kv_type=kv_type).bytes
            for kv_type in kv_budget.KV_TYPES}


def choose_for_budget(budget: KvBudget, artifact, args, source, method, n_layer, taps, stock: Path, imatrix,
                      tmp: Path):
    """(the winning kv_budget.Candidate, the summary's report, its file): each cache type's candidate made (the
    stock file itself for m = 0) and measured."""
    from nbl_gguf.calibration.dataset import CHARS_PER_TOKEN_BOUND, KINDS, write_selection_text
    from nbl_gguf.measurement import kv_budget
    from nbl_gguf.measurement.memo import Memo, memo_root
    from nbl_gguf.measurement.passkey import DEPTHS

    # the order the layers join in as m grows (each m's set holds the last's, so that the candidates nest): best's
    # is the calibration's choice at the budget's deepest m, whose prefixes a smaller m's own best may beat
    order = artifact.nested_order(args.criterion, method, taps)[:budget.most_layers]
    windows_at = [(size, args.window_sinks) for size in budget.window_sizes]
    window_order, window_kept, recall = None, None, None
    if windows_at:
        # one order and one recall ranking, at the largest window (its retrieval walk keeps the most layers); a
        # smaller window's loss of recall is what the passkey test of each candidate sees (--kv-budget-passkey)
        largest = max(windows_at)
        window_order, window_kept, recall = budget_window_order(
            args, source, n_layer, budget.eval_ctx, largest[0],
            needed=kv_budget.windows_needed(budget.model, budget.n_ctx, budget.bytes, largest, budget.n_ubatch))
    found = kv_budget.candidates(budget.model, budget.n_ctx, budget.bytes, order, window_order, windows_at, window_kept,
                                 recall.ranking if recall is not None else (), budget.n_ubatch)
    if not found:
        deepest = kv_budget.kv_bytes(budget.model, budget.n_ctx, kv_budget.KV_TYPES[-1], order, n_ubatch=budget.n_ubatch)
        given = (f"--kv-budget {args.kv_budget}" if budget.total is None else
                 f"--total-budget {args.total_budget} ({kv_budget.format_mib(budget.bytes)} for the KV cache)")
        raise NblError(f"{given} at {budget.n_ctx:,} tokens: the layers the calibration chose "
                       f"reach {kv_budget.format_mib(deepest)} at the least ({kv_budget.KV_TYPES[-1]} cache, "
                       f"{budget.most_layers} layers replaced); raise the budget")
    files = {}
    for candidate in found:
        if candidate.is_stock:
            files[candidate] = stock
            continue
        # a prefix of its order: the same file serves that prefix at every cache type
        name = f"w{len(candidate.windows)}-{candidate.window[0]}" if candidate.windows else f"m{candidate.m}"
        if candidate.recall_globals:
            name += "-g" + "-".join(map(str, candidate.recall_globals))
        path = files[candidate] = tmp / f"budget-{name}.gguf"
        if not path.is_file():
            surgery(stock, path, budget_layers(candidate, artifact, args, source, method, n_layer, taps), args, imatrix)
    weights, buffers = {}, {}
    if budget.total is not None:
        from nbl_gguf.gguf.metadata import open_gguf, weight_bytes
        from nbl_gguf.llamacpp.library import context_buffers

        down = weight_down_file(budget, stock, args, imatrix, tmp, [c.kv_type for c in found if c.is_stock])
        if down is not None:
            files[down[0]] = down[1]
        weights = {candidate: weight_bytes(open_gguf(path)) for candidate, path in files.items()}
        buffers = {candidate: context_buffers(path, n_ctx=budget.n_ctx, n_ubatch=budget.n_ubatch,
                                              kv_type=candidate.kv_type).bytes for candidate, path in files.items()}
        files = kv_budget.within_total(files, weights, budget.total, buffers=buffers)
        if not files:
            raise NblError(f"--total-budget {args.total_budget}: no candidate's weights, buffers and KV cache fit (each "
                           f"is logged above); raise the budget or lower --ctx-size")
    files, outranked = kv_budget.without_outranked(files)
    # enough for the chunks at any tokenizer's length of token (llama-perplexity wants 2 x ctx tokens)
    chars = CHARS_PER_TOKEN_BOUND * 2 * budget.eval_ctx * BUDGET_CHUNKS
    texts = {kind: write_selection_text(kind, tmp / f"budget-{kind}.txt", chars) for kind in KINDS}
    depths = DEPTHS if args.kv_budget_passkey == "on" else ()  # eval --passkey's default depths
    base, measured, stock_found = kv_budget.measure(stock, files, texts, budget.eval_ctx, BUDGET_CHUNKS, args.threads,
                                                    recall_depths=depths, memo=Memo(memo_root()))
    report = {"bytes": budget.bytes, "total_bytes": budget.total,
              "weight_bytes": budget.held.weights if budget.held else None,
              "buffer_bytes": budget.held.buffers if budget.held else None, "n_ctx": budget.n_ctx, "n_ubatch": budget.n_ubatch, "eval_ctx": budget.eval_ctx,
              "chunks": BUDGET_CHUNKS,
              "stock_ppl": base, "passkey_depths": list(depths), "stock_passkey_found": stock_found,
              "window_recall": recall.report() if recall is not None else None,
              "candidates": [{"label": r.candidate.label, "kv_type": r.candidate.kv_type, "m": r.candidate.m,
                              "layers": list(r.candidate.layers), "windows": list(r.candidate.windows),
                              "window": list(r.candidate.window) if r.candidate.windows else None,
                              "refused_windows": list(r.candidate.refused),
                              "recall_globals": list(r.candidate.recall_globals),
                              "recall_windowed": list(r.candidate.recall_windowed),
                              "weight_type": r.candidate.weight_type,
                              "kv_bytes": r.candidate.kv_bytes, "weight_bytes": weights.get(r.candidate),
                              "buffer_bytes": buffers.get(r.candidate),
                              "passkey_found": r.found,
                              "perplexity": r.perplexity, "change_pct": r.change_pct} for r in measured],
              "unmeasured": [{"label": c.label, "kv_type": c.kv_type, "kv_bytes": c.kv_bytes,
                              "windows": list(c.windows), "refused_windows": list(c.refused)} for c in outranked]}
    return measured[0].candidate, report, Path(files[measured[0].candidate])


# the types whose step down the ladder (measurement.frontier) a total budget tries: the quantized ones of the ladder
# and the float ones (a step down from a legacy type such as Q4_1 is another family: the frontier's business)
WEIGHT_DOWN_FROM = ("Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "F16", "BF16", "F32")


def weight_down_file(budget: KvBudget, stock: Path, args, imatrix, tmp: Path, stock_types):
    """(kv_budget.Candidate, its file) of llama.cpp's weight-type knob within a total budget: the stock file one step
    down the ladder (Q4_K_M -> Q3_K_M), made from the float file for a HF model (convert_stock_first) and by
    llama-quantize --allow-requantize from the stock file otherwise (as the frontier makes it), with the largest
    cache type that fits what its weights and buffers leave (kv_budget.weight_down). None where the type has no
    step down, or it buys no larger cache than the stock file's own candidates have."""
    from nbl_gguf.gguf.metadata import file_type_name, open_gguf, read_field, weight_bytes
    from nbl_gguf.gguf.quantize import quantize
    from nbl_gguf.measurement import kv_budget
    from nbl_gguf.measurement.frontier import neighbour_types

    current = (file_type_name(read_field(open_gguf(stock), "general.file_type")) or "").upper()
    if current not in WEIGHT_DOWN_FROM:
        return None
    down = neighbour_types(current)[0]
    path = Path(args.budget_weight_down) if args.budget_weight_down else tmp / f"budget-stock-{down.lower()}.gguf"
    if not path.is_file():
        quantize(stock, path, down, imatrix=imatrix, threads=args.threads, extra_args=["--allow-requantize"])
    buffers = buffers_by_cache_type(path, budget.n_ctx, budget.n_ubatch)
    weights = weight_bytes(open_gguf(path))
    found = kv_budget.weight_down(budget.model, budget.n_ctx, budget.total, down, weights, buffers, stock_types,
                                  budget.n_ubatch)
    if found is None:
        print(f"kv budget: stock {down}: its weights ({kv_budget.format_mib(weights)}) leave room for no larger KV cache "
              f"than the stock file's candidates have: not a candidate")
        return None
    return found, path


def budget_layers(candidate, artifact, args, source, method: str, n_layer: int, taps: int):
    """The NblLayers of a --kv-budget candidate: its replaced layers and its window layers."""
    from nbl_gguf.gguf import nbl_format

    layers = nbl_layers(artifact, args, source, method, n_layer, taps, list(candidate.layers))
    if candidate.windows:
        size, sinks = candidate.window
        layers.windows = nbl_format.Windows(layers=candidate.windows, size=size, sinks=sinks)
    return layers


def copy_atomically(source: Path, target: Path) -> None:
    import shutil

    from nbl_gguf.outputs import atomic_write

    with atomic_write(target) as tmp:
        shutil.copyfile(source, tmp)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m nbl_gguf convert")
    add_arguments(parser)
    return parser


def options(**values) -> argparse.Namespace:
    """convert's options as its parser gives them, with ``values`` (by option name, typed as the parser
    types them) instead: for the commands that convert without a command line of their own (bench, the
    frontier). A name convert does not take is an error."""
    args = _parser().parse_args([])
    unknown = sorted(set(values) - set(vars(args)))
    if unknown:
        raise TypeError(f"convert takes no option {', '.join(unknown)}")
    for name, value in values.items():
        setattr(args, name, value)
    return args


def command_line(args: argparse.Namespace) -> str:
    """The `python -m nbl_gguf convert ...` that gives ``args`` (a shell's words): each option that differs
    from its default."""
    import shlex

    words = []
    for action in _parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction):
            words.append(flag)
        elif isinstance(action, argparse.BooleanOptionalAction):  # --flag / --no-flag
            words.append(action.option_strings[0] if value else action.option_strings[1])
        elif isinstance(value, (list, tuple)):  # one word per value, or one 'a,b' word for a single argument
            words += [flag, *map(str, value)] if action.nargs else [flag, ",".join(map(str, value))]
        else:
            words += [flag, str(value)]
    return " ".join(["python -m nbl_gguf convert", *map(shlex.quote, words)])


def run(args: argparse.Namespace) -> int:
    summary = convert(args)
    print(summary.table())
    if summary.resources:
        print(resources_table(summary.resources, process_peak=peak_rss_bytes()))
    return 0
