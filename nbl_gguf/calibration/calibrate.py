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


def select(layers: list[dict], settings: Settings, m: int | None, budget: float | None, evaluator) -> dict:
    """The artifact's selection: a local ranking cut at m, or (best, greedy, --m auto) choices measured
    by ``evaluator`` (variants.StreamedEvaluator) on the held-out windows."""
    from nbl_gguf.calibration.artifact import METHOD_TARGET
    from nbl_gguf.calibration.select import DEFAULT_CANDIDATES, best_of, greedy, walk
    from nbl_gguf.calibration.solve import ranking, select_layers

    target = METHOD_TARGET[settings.method]
    local = settings.criterion if settings.criterion in CRITERIA else LOCAL_DEFAULT
    scores = [entry[target][local] for entry in layers]
    selection = {"method": settings.method, "criterion": settings.criterion}
    if evaluator is None:
        return {**selection, "m": m, "layers": select_layers(scores, m)}
    rankings = {c: ranking([entry[target][c] for entry in layers]) for c in CRITERIA}
    compared = None
    if settings.criterion == "greedy":
        trace = greedy(evaluator, [rankings["cosine"], rankings["nmse"]], m, budget, settings.candidates or DEFAULT_CANDIDATES)
    elif settings.criterion == "best":
        chosen, trace, compared = best_of(evaluator, rankings, m, budget, walk_first=LOCAL_DEFAULT)
        selection["chosen"] = chosen
    else:
        trace = walk(evaluator, ranking(scores), settings.criterion, m, budget)
    selection.update(m=len(trace.order), layers=sorted(trace.order), heldout=trace.as_report())
    if compared is not None:
        selection["heldout"]["compared"] = {c: {"layers": layers_c, "ppl_increase_pct": inc}
                                            for c, (layers_c, inc) in compared.items()}
    if budget is not None:
        selection["max_ppl_increase"] = budget
    return selection


def run_streamed(settings: Settings, source, stream, calib, heldout_ids, targets, m_fixed, budget, stats_device, meter, log):
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
    plan = plan_hidden(stream, calib.nsamples, calib.seqlen, held, settings.batch_size, targets, memory_budget_bytes(settings),
                       taps=settings.taps)
    log(f"calibration: {stream.name}, {stream.num_layers} layers streamed one at a time, "
        f"{str(stream.dtype).replace('torch.', '')} on {stream.device}; {plan.reason}")
    inputs = {"tokens": tokens_digest(calib.input_ids, heldout_ids),
              "settings": {"dtype": str(stream.dtype), "device": stream.device.split(":")[0], "targets": list(targets),
                           "batch_size": settings.batch_size, "stats_device": str(stats_device).split(":")[0],
                           "save_covariances": bool(settings.save_covariances), "partial": STATISTICS_PARTIAL,
                           "taps": settings.taps, "taps_rank": settings.taps_rank},
              "version": __version__}
    state = CalibrationState.for_model(model_identity(source), inputs, log=log)
    state.open()
    try:
        state.check_space(estimated_state_bytes(stream, calib.nsamples, held, calib.seqlen, targets, settings.taps))
        times = StreamTimes()
        with meter("layers"):
            entries = calibrate_layers(stream, calib.input_ids, heldout_ids, state, batch_size=settings.batch_size,
                                       targets=targets, stats_device=stats_device,
                                       save_covariances=settings.save_covariances, plan=plan,
                                       progress=not settings.no_progress, times=times, taps=settings.taps,
                                       taps_rank=settings.taps_rank)
        evaluator = None
        with meter("selection"):
            if heldout_ids is not None:
                layer_type = ATTN_TAPS if settings.taps > 1 else METHOD_LAYER_TYPE[settings.method]
                evaluator = StreamedEvaluator.from_state(stream, state, heldout_ids, layer_type, settings.batch_size,
                                                         settings.taps)
            try:
                selection = select(entries, settings, m_fixed, budget, evaluator)
                selection["taps"] = settings.taps
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


def calibrate(settings: Settings) -> Path:
    """Calibrate as ``settings`` says and write the artifact; returns its directory."""
    import torch

    from nbl_gguf.calibration import dataset
    from nbl_gguf.calibration.artifact import plot_scores, write_artifact
    from nbl_gguf.calibration.report import kv_report
    from nbl_gguf.calibration.resume import tokens_digest
    from nbl_gguf.calibration.solve import ranking
    from nbl_gguf.model_source import resolve_model
    from nbl_gguf.usage import StageMeter

    def log(text):
        print(text, file=sys.stderr)

    targets, m_fixed, budget, needs_heldout = check_arguments(settings)
    # the artifact is written last: a folder it cannot be written in must not cost a calibration first
    if settings.output:
        check_output_dir(settings.output, "-o", renamed_into_place=True)
    else:
        check_output_dir(DEFAULT_OUTPUT_ROOT, "the default -o")
    if settings.threads is not None:
        if settings.threads < 1:
            raise NblError(f"--threads must be at least 1, got {settings.threads}")
        torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    meter = StageMeter()
    if settings.whole_model:
        log("note: --whole-model is deprecated and changes nothing: every calibration runs one layer at a time "
            "(the same results, with one layer in memory)")
    with meter("load_model"):
        from nbl_gguf.calibration.stream import LayerStream

        source = resolve_model(settings.model)
        device = models.resolve_device(settings.device)
        stream = LayerStream(source, models.resolve_dtype(settings.dtype, device, log=log), device)
    num_layers, d, config = stream.num_layers, stream.hidden_size, stream.config
    if m_fixed is None and settings.m != "auto":
        m_fixed = default_m(num_layers)
    if m_fixed is not None and not 0 <= m_fixed <= num_layers:
        raise NblError(f"--m {m_fixed} is out of range: the model has {num_layers} layers")
    nsamples = settings.nsamples
    if nsamples is None:
        nsamples = DEFAULT_NSAMPLES["cuda" if stream.device.startswith("cuda") else "cpu"]
    with meter("load_data"):
        calib, heldout_ids, heldout_text = dataset.load_windows(settings, stream, needs_heldout, nsamples)

    stats_device = settings.stats_device or stream.device
    entries, selection, tensors, details, state = run_streamed(
        settings, source, stream, calib, heldout_ids, targets, m_fixed, budget, stats_device, meter, log)
    written = False
    try:
        if heldout_text:
            selection["heldout_text"] = {key: heldout_text[key] for key in ("selection_text", "windows")}
        selection["kv_cache"] = kv_report(config, selection, settings.ctx_size, settings.kv_type, settings.ubatch_size)
        report = {
            "format_version": 1,
            "model": {"name": stream.name, "path": stream.path, "architecture": (config.architectures or ["?"])[0],
                      "model_type": config.model_type, "hidden_size": d, "num_layers": num_layers,
                      "dtype": str(stream.dtype).replace("torch.", ""), "device": stream.device,
                      **({"gguf": source.gguf.provenance()} if source.gguf is not None else {})},
            "data": {"dataset": settings.dataset or dataset.DEFAULT_DATASET, "dataset_config": settings.dataset_config,
                     "split": settings.split, "text_field": settings.text_field, "nsamples": calib.nsamples,
                     "nsamples_requested": nsamples,
                     "selection_windows": 0 if heldout_ids is None else int(heldout_ids.shape[0]),
                     **({"selection_text": heldout_text} if heldout_text else {}),
                     "seqlen": calib.seqlen, "tokens": calib.tokens, "documents": calib.documents,
                     "sha256": calib.sha256, "seed": settings.seed,
                     # the fit windows' tokens (sha256 is of the documents read, held-out windows included)
                     "windows_sha256": tokens_digest(calib.input_ids),
                     # the held-out windows', so that best measured again at another m is checked to use them
                     **({"selection_sha256": tokens_digest(heldout_ids)} if heldout_ids is not None else {})},
            "statistics": {"device": str(stats_device), "tokens_per_layer": calib.tokens,
                           "covariances_saved": settings.save_covariances, "partial_sums": STATISTICS_PARTIAL,
                           "streamed": True, **details},
            "layers": entries,
            "targets": list(targets),
            "ranking": {t: {c: ranking([e[t][c] for e in entries]) for c in CRITERIA} for t in targets},
            "selection": selection,
            "timings_s": meter.timings,
            "resources": meter.stages,
            "versions": _versions(),
        }
        output = Path(settings.output or DEFAULT_OUTPUT_ROOT / stream.name)
        write_artifact(output, report, tensors, plot=lambda path: plot_scores(path, report))
        written = True
    finally:
        state.close(finished=written)
    return output
