"""The calibration stage: run the model over calibration text, fit every layer, score, select, save
an artifact (``calibrate(Settings(...))``: calibration.settings; the `calibrate` command is
nbl_gguf.commands.calibrate; what it prints, calibration.report).

One engine (calibration.stream): the windows go through the model one decoder layer at a time,
hooks fold each layer's activations into float64 sums and the layer is solved before the next is
read (calibration.layer_fit). The artifact holds the maps for every layer, so the selection (m,
criterion, method) can be changed later without running the model again.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import numpy as np

from nbl_gguf import models
from nbl_gguf.calibration.artifact import CRITERIA, LOCAL_DEFAULT
from nbl_gguf.calibration.settings import (DEFAULT_NSAMPLES, DEFAULT_OUTPUT_ROOT, Settings, check_arguments, default_m,
                                           memory_budget_bytes)
from nbl_gguf.errors import NblError
from nbl_gguf.outputs import check_output_dir

# the statistics' per-batch products: float32 partial sums added to float64 totals (see statistics.py)
STATISTICS_PARTIAL = "float32"  # the name of statistics.CALIBRATION_PARTIAL, recorded in the report


def _versions() -> dict:
    import torch
    import transformers

    from nbl_gguf import __version__

    return {"nbl_gguf": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "numpy": np.__version__, "python": platform.python_version()}


def select(layers: list[dict], args, m: int | None, budget: float | None, evaluator) -> dict:
    """The artifact's selection: a local ranking cut at m, or (best, greedy, --m auto) choices measured
    by ``evaluator`` (variants.StreamedEvaluator) on the held-out windows."""
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


def run_streamed(args, source, stream, calib, heldout_ids, targets, m_fixed, budget, stats_device, meter, log):
    """The layer-streamed calibration and selection: (entries, selection, tensors, details, state). The
    tensors are read from the state, which the caller closes once the artifact is written."""
    from nbl_gguf.calibration.apply import ATTN_TAPS, METHOD_LAYER_TYPE
    from nbl_gguf.calibration.artifact import LazyTensors
    from nbl_gguf.calibration.resume import CalibrationState, model_identity, tokens_digest
    from nbl_gguf.calibration.layer_loop import StreamTimes, calibrate_layers
    from nbl_gguf.calibration.memory_plan import estimated_state_bytes, plan_hidden
    from nbl_gguf.calibration.variants import StreamedEvaluator
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


def calibrate(args: Settings) -> Path:
    """Calibrate as ``args`` says and write the artifact; returns its directory."""
    import torch

    from nbl_gguf.calibration import dataset
    from nbl_gguf.calibration.artifact import plot_scores, write_artifact
    from nbl_gguf.calibration.report import kv_report
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
    if args.whole_model:
        log("note: --whole-model is deprecated and changes nothing: every calibration runs one layer at a time "
            "(the same results, with one layer in memory)")
    with meter("load_model"):
        from nbl_gguf.calibration.stream import LayerStream

        source = resolve_model(args.model)
        device = models.resolve_device(args.device)
        stream = LayerStream(source, models.resolve_dtype(args.dtype, device, log=log), device)
    num_layers, d, config = stream.num_layers, stream.hidden_size, stream.config
    if m_fixed is None and args.m != "auto":
        m_fixed = default_m(num_layers)
    if m_fixed is not None and not 0 <= m_fixed <= num_layers:
        raise NblError(f"--m {m_fixed} is out of range: the model has {num_layers} layers")
    nsamples = args.nsamples
    if nsamples is None:
        nsamples = DEFAULT_NSAMPLES["cuda" if stream.device.startswith("cuda") else "cpu"]
    with meter("load_data"):
        calib, heldout_ids, heldout_text = dataset.load_windows(args, stream, needs_heldout, nsamples)

    stats_device = args.stats_device or stream.device
    entries, selection, tensors, details, state = run_streamed(
        args, source, stream, calib, heldout_ids, targets, m_fixed, budget, stats_device, meter, log)
    written = False
    try:
        if heldout_text:
            selection["heldout_text"] = {key: heldout_text[key] for key in ("selection_text", "windows")}
        selection["kv_cache"] = kv_report(config, selection, args.ctx_size, args.kv_type)
        report = {
            "format_version": 1,
            "model": {"name": stream.name, "path": stream.path, "architecture": (config.architectures or ["?"])[0],
                      "model_type": config.model_type, "hidden_size": d, "num_layers": num_layers,
                      "dtype": str(stream.dtype).replace("torch.", ""), "device": stream.device,
                      **({"gguf": source.gguf.provenance()} if source.gguf is not None else {})},
            "data": {"dataset": args.dataset or dataset.DEFAULT_DATASET, "dataset_config": args.dataset_config,
                     "split": args.split, "nsamples": calib.nsamples, "nsamples_requested": nsamples,
                     "selection_windows": 0 if heldout_ids is None else int(heldout_ids.shape[0]),
                     **({"selection_text": heldout_text} if heldout_text else {}),
                     "seqlen": calib.seqlen, "tokens": calib.tokens, "documents": calib.documents,
                     "sha256": calib.sha256, "seed": args.seed},
            "statistics": {"device": str(stats_device), "tokens_per_layer": calib.tokens,
                           "covariances_saved": args.save_covariances, "partial_sums": STATISTICS_PARTIAL,
                           "streamed": True, **details},
            "layers": entries,
            "targets": list(targets),
            "ranking": {t: {c: ranking([e[t][c] for e in entries]) for c in CRITERIA} for t in targets},
            "selection": selection,
            "timings_s": meter.timings,
            "resources": meter.stages,
            "versions": _versions(),
        }
        output = Path(args.output or DEFAULT_OUTPUT_ROOT / stream.name)
        write_artifact(output, report, tensors, plot=lambda path: plot_scores(path, report))
        written = True
    finally:
        state.close(finished=written)
    return output
