"""The calibration stage: run the model over calibration text, fit every layer, score, select, save
an artifact (``calibrate(Settings(...))``; the `calibrate` command is nbl_gguf.commands.calibrate).

One forward pass feeds all layers' statistics at once (hooks fold each batch into float64 sums),
then each layer is solved independently. The artifact holds the maps for every layer, so the
selection (m, criterion, method) can be changed later without running the model again.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from nbl_gguf import models
from nbl_gguf.calibration.artifact import CRITERIA, DEFAULT_CRITERION, LOCAL_DEFAULT, TARGETS
from nbl_gguf.errors import NblError
from nbl_gguf.outputs import check_output_dir

METHODS = ("attn-nbl", "attn-drop", "block-nbl")
DEFAULT_M = 12
# Calibration windows: 256 on a GPU (the paper's 256 x 2048); on a CPU 32 x 2048 = 65k tokens: 4x fewer
# tokens (16k) already gave nearly the same maps and held-out perplexity (docs/results/quality.md,
# "Calibration size"), and it leaves time for the held-out selection within the old main job's budget
DEFAULT_NSAMPLES = {"cuda": 256, "cpu": 32}
DEFAULT_SELECTION_TOKENS = 8192  # held out for best/greedy/auto: 4 windows of 2048 by default
KIND_NAMES = {"calibration": "the calibration text", "prose": "Python docs", "code": "Python code"}
DEFAULT_KV_CTX = 4096  # the selection's KV figures for a model whose config names no training context
# of the held-out windows: the mix chose the same layers as C4 alone at m = 4 and 8 on both models we have,
# and with --m auto on Qwen kept the budget on docs and code where C4 alone did not (docs/results/selection-text.md)
DEFAULT_SELECTION_TEXT = "mix"
DEFAULT_MAX_PPL_INCREASE = 10.0
DEFAULT_TAPS = 1  # tokens a replaced layer reads: 1 is the per-token NBL map (calibration.taps for more)
MAX_TAPS = 64  # what the patched llama.cpp's taps layers read at most (nbl_format.MAX_TAPS)
DEFAULT_OUTPUT_ROOT = Path("out") / "calibration"
# the statistics' per-batch products: float32 partial sums added to float64 totals (see statistics.py)
STATISTICS_PARTIAL = "float32"  # the name of statistics.CALIBRATION_PARTIAL, recorded in the report


def selection_budget(m, max_ppl_increase) -> tuple[int | None, float | None]:
    """(m or None for auto, budget or None); a budget needs --m auto."""
    if m == "auto":
        return None, DEFAULT_MAX_PPL_INCREASE if max_ppl_increase is None else max_ppl_increase
    if max_ppl_increase is not None:
        raise NblError("--max-ppl-increase goes with --m auto (a fixed --m ignores it)")
    return m, None


def parse_targets(text: str) -> tuple[str, ...]:
    """'attn' or 'attn,block' (the attention statistics are always collected: they choose the layers)."""
    targets = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or "attn" not in targets:
        raise NblError(f"--targets {text!r}: use 'attn' or 'attn,block'")
    return tuple(t for t in TARGETS if t in targets)


def _versions() -> dict:
    import torch
    import transformers

    from nbl_gguf import __version__

    return {"nbl_gguf": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "numpy": np.__version__, "python": platform.python_version()}


def collect_statistics(model, adapter, input_ids, batch_size: int, device: str, stats_device: str,
                       progress: bool = True, targets=TARGETS, partial=None):
    """The whole-model reference: one pass over the windows with every layer hooked; returns per-layer
    (attn, block) MomentAccumulators and cosine means (the block lists are empty when ``targets``
    leaves the block out)."""
    import torch
    from tqdm import tqdm

    from nbl_gguf.calibration.capture import capture_activations
    from nbl_gguf.models import base_model, decoder_layers, text_config
    from nbl_gguf.calibration.statistics import CosineAccumulator, MomentAccumulator

    d = text_config(model.config).hidden_size
    count = len(decoder_layers(model))
    from nbl_gguf.calibration.statistics import CALIBRATION_PARTIAL

    partial = partial or CALIBRATION_PARTIAL
    attn = [MomentAccumulator(d, d, stats_device, f"layer {i} attention", partial) for i in range(count)]
    with_block = "block" in targets
    block_count = count if with_block else 0
    block = [MomentAccumulator(d, d, stats_device, f"layer {i} block", partial) for i in range(block_count)]
    attn_cos = [CosineAccumulator(stats_device) for _ in range(count)]
    block_cos = [CosineAccumulator(stats_device) for _ in range(block_count)]

    def on_attention(i, h, x, y):
        attn[i].update(x, y)
        attn_cos[i].update(h, h + y)  # block input vs. hidden state after the attention residual

    def on_block(i, h, out):
        block[i].update(h, out)
        block_cos[i].update(h, out)

    batch_size = max(1, batch_size)
    body = base_model(model)
    with torch.no_grad(), capture_activations(model, adapter, on_attention, on_block if with_block else None):
        batches = range(0, input_ids.shape[0], batch_size)
        for start in tqdm(batches, desc="calibration forward", unit="batch", disable=not progress):
            body(input_ids=input_ids[start:start + batch_size].to(device), use_cache=False)
            for acc in attn + block:
                acc.check_finite()
    return attn, block, [c.value() for c in attn_cos], [c.value() for c in block_cos]


def default_m(num_layers: int) -> int:
    return max(0, min(DEFAULT_M, num_layers - 1))


def select(layers: list[dict], args, m: int | None, budget: float | None, evaluator) -> dict:
    """The artifact's selection: a local ranking cut at m, or (best, greedy, --m auto) choices measured
    by ``evaluator`` (select.NestedEvaluator or stream.StreamedEvaluator) on the held-out windows."""
    from nbl_gguf.calibration.artifact import METHOD_TARGET
    from nbl_gguf.calibration.select import DEFAULT_CANDIDATES, best_of, greedy, walk
    from nbl_gguf.calibration.solve import ranking, select_layers

    target = METHOD_TARGET[args.method]
    local = args.criterion if args.criterion in CRITERIA else LOCAL_DEFAULT
    scores = [entry[target][local] for entry in layers]
    selection = {"method": args.method, "criterion": args.criterion}
    if evaluator is None:
        return {**selection, "m": m, "layers": select_layers(scores, m)}
    rankings = {c: ranking([entry[target][c] for entry in layers]) for c in CRITERIA}
    compared = None
    if args.criterion == "greedy":
        trace = greedy(evaluator, [rankings["cosine"], rankings["nmse"]], m, budget, args.candidates or DEFAULT_CANDIDATES)
    elif args.criterion == "best":
        chosen, trace, compared = best_of(evaluator, rankings, m, budget, walk_first=LOCAL_DEFAULT)
        selection["chosen"] = chosen
    else:
        trace = walk(evaluator, ranking(scores), args.criterion, m, budget)
    selection.update(m=len(trace.order), layers=sorted(trace.order), heldout=trace.as_report())
    if compared is not None:
        selection["heldout"]["compared"] = {c: {"layers": layers_c, "ppl_increase_pct": inc}
                                            for c, (layers_c, inc) in compared.items()}
    if budget is not None:
        selection["max_ppl_increase"] = budget
    return selection


def kv_report(config, selection: dict, n_ctx: int | None, kv_type: str = "f16") -> dict:
    """The KV cache llama.cpp allocates at ``n_ctx`` (default: the training context) for the model
    as it is and with the chosen layers replaced, and for each set that `best` compared: a
    sliding-window layer frees only its window's cells, a global one a cache as long as the context."""
    from nbl_gguf.kv_cache import Context, kv_size, model_from_config, training_context_from_config

    if n_ctx is None:
        n_ctx = training_context_from_config(config) or DEFAULT_KV_CTX
    model = model_from_config(config)
    context = Context(n_ctx=n_ctx, type_k=kv_type, type_v=kv_type)

    def size(layers) -> dict:
        kv = kv_size(model.without(layers), context)
        return {"bytes": kv.bytes, "caches": {name: {"cells": cache.cells, "layers": cache.layers, "bytes": cache.bytes}
                                              for name, cache in kv.caches.items()}}

    report = {"n_ctx": n_ctx, "type": kv_type, "stock": size([]), "nbl": size(selection["layers"])}
    compared = (selection.get("heldout") or {}).get("compared")
    if compared:
        report["compared"] = {c: size(entry["layers"])["bytes"] for c, entry in compared.items()}
    return report


def _mib(value: int) -> str:
    return f"{value / 2**20:,.2f} MiB"


def _change(before: int, after: int) -> str:
    return f"{(after - before) / before:+.1%}" if before else "+0.0%"


def describe_kv(kv: dict) -> list[str]:
    stock, nbl = kv["stock"], kv["nbl"]
    lines = [f"  KV cache at {kv['n_ctx']:,} tokens ({kv.get('type', 'f16').upper()}, as llama-cli allocates it): "
             f"{_mib(stock['bytes'])} -> "
             f"{_mib(nbl['bytes'])} ({_change(stock['bytes'], nbl['bytes'])})"]
    if "sliding" in stock["caches"]:
        for name, what in (("global", "global layers"), ("sliding", "sliding-window layers")):
            before, after = stock["caches"][name], nbl["caches"][name]
            lines.append(f"    {what} ({before['cells']:,} cells each): {before['layers']} -> {after['layers']} layers, "
                         f"{_mib(before['bytes'])} -> {_mib(after['bytes'])}")
    return lines


def describe_selection(selection: dict, num_layers: int) -> str:
    """What was chosen and, for auto and greedy, why (the held-out perplexity along the way)."""
    taps = int(selection.get("taps", 1))
    maps = f" with past-token maps of {taps} tokens" if taps > 1 else ""
    lines = [f"{selection['method']}{maps} by {selection['criterion']}: replace layers {selection['layers']} of {num_layers}"]
    heldout = selection.get("heldout")
    if heldout:
        increases = heldout["ppl_increase_pct"]
        if len(increases) == len(heldout["order"]):  # one loss per added layer (walk, greedy)
            steps = ", ".join(f"layer {layer} {inc:+.1f}%" for layer, inc in zip(heldout["order"], increases))
        else:  # the set measured at once (best at a fixed m)
            steps = f"{len(heldout['order'])} layers together {increases[-1]:+.1f}%" if increases else ""
        text = selection.get("heldout_text")
        made_of = ""
        if text:
            made_of = ": " + ", ".join(f"{n} {'window' if n == 1 else 'windows'} of {KIND_NAMES.get(kind, kind)}"
                                       for kind, n in text["windows"].items())
        lines.append(f"  held-out perplexity ({heldout['heldout_tokens']} tokens{made_of}; unmodified "
                     f"{heldout['base_ppl']:.3f}): {steps or 'no layer added'}")
    kv = selection.get("kv_cache")
    sliding = kv is not None and "sliding" in kv["stock"]["caches"]
    if "chosen" in selection:
        def saving(c):  # which layers a set holds matters to the KV cache only where some slide
            if not sliding or c not in kv.get("compared", {}):
                return ""
            return f" (KV {_change(kv['stock']['bytes'], kv['compared'][c])})"

        lines.append("  best on the held-out windows: " + ", ".join(
            f"{c} {len(v['layers'])} layers {v['ppl_increase_pct']:+.1f}%{saving(c)}" for c, v in heldout["compared"].items())
            + f" -> {selection['chosen']}")
    if kv is not None:
        lines += describe_kv(kv)
    if "max_ppl_increase" in selection:
        reason = heldout.get("stopped") or f"all {len(heldout['order'])} candidate layers fit the budget"
        lines.append(f"  --m auto: m = {selection['m']} within +{selection['max_ppl_increase']:g}%: {reason}")
    return "\n".join(lines)


@dataclass
class Prepared:
    """What both calibration paths share once the model is open and the text is cut into windows."""

    name: str
    path: str
    config: object
    tokenizer: object
    device: str
    dtype: object
    num_layers: int
    hidden_size: int


def check_arguments(args) -> tuple[tuple[str, ...], int | None, float | None, bool]:
    """(targets, m or None, budget or None, whether the selection needs held-out windows): every check
    that needs no model, so that a typo costs nothing."""
    targets = parse_targets(args.targets)
    m_fixed, budget = selection_budget(args.m, args.max_ppl_increase)
    needs_heldout = args.m == "auto" or args.criterion in ("greedy", "best")
    if needs_heldout and args.method == "block-nbl":
        raise NblError("--m auto and --criterion greedy/best replace attention layers: use --method attn-nbl or "
                       "attn-drop, or a fixed --m with --criterion cosine, nmse or cca")
    if needs_heldout and args.selection_windows is not None and args.selection_windows < 1:
        raise NblError(f"--selection-windows must be at least 1, got {args.selection_windows}")
    from nbl_gguf.calibration.artifact import METHOD_TARGET

    if METHOD_TARGET[args.method] not in targets:
        raise NblError(f"--method {args.method} needs the block statistics: use --targets attn,block")
    if args.memory_budget is not None and args.memory_budget <= 0:
        raise NblError(f"--memory-budget must be a positive number of GiB, got {args.memory_budget:g}")
    check_taps(args)
    return targets, m_fixed, budget, needs_heldout


def check_taps(args) -> None:
    """--taps K (and --taps-rank): the past-token maps are fitted by the streamed calibrator, for the
    attention of attn-nbl."""
    if args.taps < 1:
        raise NblError(f"--taps must be at least 1 (1: today's per-token maps), got {args.taps}")
    if args.taps > MAX_TAPS:
        raise NblError(f"--taps {args.taps}: a taps layer reads at most {MAX_TAPS} tokens")
    if args.taps_rank is not None and args.taps_rank < 1:
        raise NblError(f"--taps-rank must be at least 1, got {args.taps_rank}")
    if args.taps > 1:
        if args.method != "attn-nbl":
            raise NblError(f"--taps {args.taps} fits past-token maps of the attention: it goes with --method attn-nbl, "
                           f"not {args.method}")
        if args.whole_model:
            raise NblError(f"--taps {args.taps} is fitted by the layer-streamed calibrator; leave out --whole-model")


def load_windows(args, prepared: Prepared, needs_heldout: bool, nsamples: int):
    """(calibration windows, held-out windows or None, what the held-out windows are made of or None).
    The held-out windows follow --selection-text: the calibration text's windows after the fit
    windows, then those of each bundled kind's selection part."""
    import torch

    from nbl_gguf.calibration import dataset

    counts = {}
    if needs_heldout:
        seqlen = dataset.effective_seqlen(args.seqlen, models.max_context(prepared.config))
        total = args.selection_windows or -(-DEFAULT_SELECTION_TOKENS // seqlen)
        counts = dataset.mix_windows(dataset.parse_selection_text(args.selection_text), total)
    held = counts.get(dataset.CALIBRATION_KIND, 0)
    calib = dataset.load_calibration(prepared.tokenizer, args.dataset, nsamples + held, args.seqlen,
                                     config=args.dataset_config, split=args.split, field=args.text_field,
                                     max_positions=models.max_context(prepared.config))
    parts = []
    if held:
        if calib.nsamples <= held:
            asked = (f"--selection-windows {held}" if held == sum(counts.values()) else
                     f"{held} of --selection-windows {sum(counts.values())} (its share in --selection-text "
                     f"{args.selection_text})")
            raise NblError(f"{args.dataset or dataset.DEFAULT_DATASET} gives {calib.nsamples} windows of {calib.seqlen} "
                           f"tokens: too few to hold out {asked} for layer selection and still fit (use more text, a "
                           f"shorter --seqlen or fewer --selection-windows; or a fixed --m with --criterion cosine, "
                           f"which needs none)")
        calib, own = calib.split_last(held)
        parts.append(own)
    if calib.nsamples < nsamples:
        print(f"note: {args.dataset or dataset.DEFAULT_DATASET} gives {calib.nsamples} windows of {calib.seqlen} tokens "
              f"for the fit, fewer than the {nsamples} requested; calibrating on {calib.tokens} tokens", file=sys.stderr)
    if calib.tokens <= prepared.hidden_size:
        raise NblError(f"only {calib.tokens} calibration tokens for hidden size {prepared.hidden_size}; need more than "
                       f"{prepared.hidden_size} (raise --nsamples/--seqlen or use more text)")
    stacked = args.taps * prepared.hidden_size  # a taps map's inputs: the token's and its taps - 1 predecessors'
    if args.taps > 1 and calib.tokens <= stacked:
        raise NblError(f"only {calib.tokens} calibration tokens for --taps {args.taps}, which stacks {args.taps} x "
                       f"{prepared.hidden_size} = {stacked} inputs a layer; need more than {stacked} (raise "
                       f"--nsamples/--seqlen, or use --taps 1)")
    if not counts:
        return calib, None, None
    bundled, kinds = dataset.bundled_selection_windows(
        prepared.tokenizer, {kind: n for kind, n in counts.items() if kind != dataset.CALIBRATION_KIND}, calib.seqlen)
    if bundled.shape[0]:
        parts.append(bundled)
    composition = {"selection_text": args.selection_text,
                   "windows": {kind: n for kind, n in counts.items() if n},
                   "calibration_text": args.dataset or dataset.DEFAULT_DATASET, "bundled": kinds}
    return calib, torch.cat(parts), composition


def memory_budget_bytes(args) -> int:
    """--memory-budget, or half of the memory available now."""
    if args.memory_budget is not None:
        return int(args.memory_budget * 2**30)
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        available = 8 * 2**30
    return available // 2


def model_identity(source) -> dict:
    """What names the model's weights for the resume state (content hash of a GGUF; names, sizes and
    modification times of a folder's files)."""
    from nbl_gguf.calibration.weights import folder_identity

    if source.gguf is not None:
        return {"gguf_sha256": source.gguf.sha256}
    folder = source.hf_folder()
    return {"folder": str(Path(folder).resolve()), "files": folder_identity(folder)}


def run_streamed(args, source, stream, calib, heldout_ids, targets, m_fixed, budget, stats_device, meter, log):
    """The layer-streamed calibration and selection: (entries, selection, tensors, details, state). The
    tensors are read from the state, which the caller closes once the artifact is written."""
    from nbl_gguf.calibration.apply import ATTN_TAPS, METHOD_LAYER_TYPE
    from nbl_gguf.calibration.artifact import LazyTensors
    from nbl_gguf.calibration.resume import CalibrationState, tokens_digest
    from nbl_gguf.calibration.stream import (StreamedEvaluator, StreamTimes, calibrate_layers, estimated_state_bytes,
                                             plan_hidden)
    from nbl_gguf import __version__

    held = 0 if heldout_ids is None else int(heldout_ids.shape[0])
    plan = plan_hidden(stream, calib.nsamples, calib.seqlen, held, args.batch_size, targets, memory_budget_bytes(args),
                       taps=args.taps)
    log(f"calibration: {stream.name}, {stream.num_layers} layers streamed one at a time, "
        f"{str(stream.dtype).replace('torch.', '')} on {stream.device}; {plan.reason}")
    inputs = {"tokens": tokens_digest(calib.input_ids, heldout_ids),
              "settings": {"dtype": str(stream.dtype), "device": stream.device.split(":")[0], "targets": list(targets),
                           "batch_size": args.batch_size, "stats_device": str(stats_device).split(":")[0],
                           "save_covariances": bool(args.save_covariances), "partial": STATISTICS_PARTIAL,
                           "taps": args.taps, "taps_rank": args.taps_rank},
              "version": __version__}
    state = CalibrationState.for_model(model_identity(source), inputs, log=log)
    state.open()
    try:
        state.check_space(estimated_state_bytes(stream, calib.nsamples, held, calib.seqlen, targets, args.taps))
        times = StreamTimes()
        with meter("layers"):
            entries = calibrate_layers(stream, calib.input_ids, heldout_ids, state, batch_size=args.batch_size,
                                       targets=targets, stats_device=stats_device,
                                       save_covariances=args.save_covariances, plan=plan,
                                       progress=not args.no_progress, times=times, taps=args.taps,
                                       taps_rank=args.taps_rank)
        evaluator = None
        with meter("selection"):
            if heldout_ids is not None:
                layer_type = ATTN_TAPS if args.taps > 1 else METHOD_LAYER_TYPE[args.method]
                evaluator = StreamedEvaluator.from_state(stream, state, heldout_ids, layer_type, args.batch_size,
                                                         args.taps)
            try:
                selection = select(entries, args, m_fixed, budget, evaluator)
                selection["taps"] = args.taps
            finally:
                if evaluator is not None:
                    evaluator.close()
        tensors = LazyTensors([state.layer_tensors(i) for i in range(len(entries))])
        details = {"stream": times.as_report(), "hidden_states": plan.reason,
                   "selection_passes": evaluator.passes if evaluator is not None else 0}
    except BaseException:
        state.close(finished=False)
        raise
    return entries, selection, tensors, details, state


def run_whole_model(args, prepared: Prepared, loaded, calib, heldout_ids, targets, m_fixed, budget, stats_device,
                    meter) -> tuple[list[dict], dict, dict]:
    """The reference path: the whole model in memory, one forward with every layer hooked."""
    from nbl_gguf.calibration.apply import METHOD_LAYER_TYPE
    from nbl_gguf.calibration.select import NestedEvaluator
    from nbl_gguf.calibration.solve import solve_layer

    with meter("forward_and_statistics"):
        attn, block, attn_cos, block_cos = collect_statistics(loaded.model, loaded.adapter, calib.input_ids,
                                                              args.batch_size, loaded.device, stats_device,
                                                              progress=not args.no_progress, targets=targets)
    entries, tensors = [], {}
    with meter("solve"):
        for i in range(len(attn)):
            entry, layer_tensors = solve_layer(i, attn[i], block[i] if block else None, attn_cos[i],
                                               block_cos[i] if block else None, args.save_covariances)
            entries.append(entry)
            tensors.update(layer_tensors)
    del attn, block
    with meter("selection"):
        evaluator = None
        if heldout_ids is not None:
            linear = {i: (tensors[f"attn.{i}.weight"], tensors[f"attn.{i}.bias"]) for i in range(len(entries))}
            evaluator = NestedEvaluator(loaded.model, heldout_ids, METHOD_LAYER_TYPE[args.method], linear,
                                        args.batch_size)
        selection = select(entries, args, m_fixed, budget, evaluator)
    return entries, selection, tensors


@dataclass
class Settings:
    """What a calibration is asked for: the `calibrate` command's options, under the same names (the
    command's parser gives these defaults; tests/test_command_flags.py holds them equal)."""

    model: str | None = None  # HF folder, hub id or GGUF file (None: the embedded model)
    dataset: str | None = None
    dataset_config: str | None = None
    split: str = "train"
    text_field: str = "text"
    nsamples: int | None = None  # None: DEFAULT_NSAMPLES of the device
    seqlen: int = 2048
    batch_size: int = 1
    dtype: str = "auto"
    device: str = "auto"
    memory_budget: float | None = None  # GiB; None: half the available memory
    whole_model: bool = False
    stats_device: str | None = None
    m: int | str | None = None  # a layer count, "auto", or None for default_m
    max_ppl_increase: float | None = None
    criterion: str = DEFAULT_CRITERION
    selection_windows: int | None = None
    candidates: int | None = None
    selection_text: str = DEFAULT_SELECTION_TEXT
    ctx_size: int | None = None  # the context of the KV figures; None: the model's training context
    kv_type: str = "f16"  # the cache type of the KV figures (llama.cpp's -ctk/-ctv)
    method: str = "attn-nbl"
    taps: int = DEFAULT_TAPS
    taps_rank: int | None = None  # None: calibration.taps.default_rank
    output: str | None = None  # the artifact directory; None: DEFAULT_OUTPUT_ROOT / the model's name
    seed: int = 0
    targets: str = "attn,block"
    save_covariances: bool = False
    no_progress: bool = False
    threads: int | None = None  # PyTorch's CPU threads; None: its default

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def calibrate(args: Settings) -> Path:
    """Calibrate as ``args`` says and write the artifact; returns its directory."""
    import torch

    from nbl_gguf.calibration import dataset
    from nbl_gguf.calibration.artifact import plot_scores, write_artifact
    from nbl_gguf.calibration.solve import ranking
    from nbl_gguf.model_source import resolve_model
    from nbl_gguf.usage import StageMeter

    def log(text):
        print(text, file=sys.stderr)

    targets, m_fixed, budget, needs_heldout = check_arguments(args)
    # the artifact is written last: a folder it cannot be written in must not cost a calibration first
    if args.output:
        check_output_dir(args.output, "-o", renamed_into_place=True)
    else:
        check_output_dir(DEFAULT_OUTPUT_ROOT, "the default -o")
    if args.threads is not None:
        if args.threads < 1:
            raise NblError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    meter = StageMeter()
    loaded = stream = None
    with meter("load_model"):
        source = resolve_model(args.model)
        device = models.resolve_device(args.device)
        dtype = models.resolve_dtype(args.dtype, device, log=log)
        if args.whole_model:
            loaded = models.load_model(str(source.hf_folder()), args.dtype, device, name=source.name)
            prepared = Prepared(loaded.name, loaded.path, loaded.config, loaded.tokenizer, loaded.device, loaded.dtype,
                                len(models.decoder_layers(loaded.model)), models.text_config(loaded.config).hidden_size)
        else:
            from nbl_gguf.calibration.stream import LayerStream

            stream = LayerStream(source, dtype, device)
            prepared = Prepared(stream.name, stream.path, stream.config, stream.tokenizer, device, dtype,
                                stream.num_layers, stream.hidden_size)
    num_layers, d, config = prepared.num_layers, prepared.hidden_size, prepared.config
    if m_fixed is None and args.m != "auto":
        m_fixed = default_m(num_layers)
    if m_fixed is not None and not 0 <= m_fixed <= num_layers:
        raise NblError(f"--m {m_fixed} is out of range: the model has {num_layers} layers")
    nsamples = args.nsamples
    if nsamples is None:
        nsamples = DEFAULT_NSAMPLES["cuda" if prepared.device.startswith("cuda") else "cpu"]
    with meter("load_data"):
        calib, heldout_ids, heldout_text = load_windows(args, prepared, needs_heldout, nsamples)

    stats_device = args.stats_device or prepared.device
    state, details = None, {}
    if args.whole_model:
        entries, selection, tensors = run_whole_model(args, prepared, loaded, calib, heldout_ids, targets, m_fixed,
                                                      budget, stats_device, meter)
    else:
        entries, selection, tensors, details, state = run_streamed(
            args, source, stream, calib, heldout_ids, targets, m_fixed, budget, stats_device, meter, log)
    written = False
    try:
        if heldout_text:
            selection["heldout_text"] = {key: heldout_text[key] for key in ("selection_text", "windows")}
        selection["kv_cache"] = kv_report(config, selection, args.ctx_size, args.kv_type)
        report = {
            "format_version": 1,
            "model": {"name": prepared.name, "path": prepared.path, "architecture": (config.architectures or ["?"])[0],
                      "model_type": config.model_type, "hidden_size": d, "num_layers": num_layers,
                      "dtype": str(prepared.dtype).replace("torch.", ""), "device": prepared.device,
                      **({"gguf": source.gguf.provenance()} if source.gguf is not None else {})},
            "data": {"dataset": args.dataset or dataset.DEFAULT_DATASET, "dataset_config": args.dataset_config,
                     "split": args.split, "nsamples": calib.nsamples, "nsamples_requested": nsamples,
                     "selection_windows": 0 if heldout_ids is None else int(heldout_ids.shape[0]),
                     **({"selection_text": heldout_text} if heldout_text else {}),
                     "seqlen": calib.seqlen, "tokens": calib.tokens, "documents": calib.documents,
                     "sha256": calib.sha256, "seed": args.seed},
            "statistics": {"device": str(stats_device), "tokens_per_layer": calib.tokens,
                           "covariances_saved": args.save_covariances, "partial_sums": STATISTICS_PARTIAL,
                           "streamed": not args.whole_model, **details},
            "layers": entries,
            "targets": list(targets),
            "ranking": {t: {c: ranking([e[t][c] for e in entries]) for c in CRITERIA} for t in targets},
            "selection": selection,
            "timings_s": meter.timings,
            "resources": meter.stages,
            "versions": _versions(),
        }
        output = Path(args.output or DEFAULT_OUTPUT_ROOT / prepared.name)
        write_artifact(output, report, tensors, plot=lambda path: plot_scores(path, report))
        written = True
    finally:
        if state is not None:
            state.close(finished=written)
    return output


def describe_artifact(artifact) -> str:
    """What a calibration says when it is done: its selection and where the artifact went."""
    report = artifact.report
    return (describe_selection(report["selection"], artifact.num_layers) + "\n"
            + f"artifact: {artifact.path}  ({report['data']['tokens']} tokens, timings {report['timings_s']})")
