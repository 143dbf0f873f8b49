"""`--criterion best` measured again from a calibration artifact: at an m, a method or a kind of map that the
calibration did not choose for.

Best is the local criterion whose first m layers cost the model least on the held-out windows
(select.best_of). The calibration measures it at its own m; the criteria's rankings are nested, their
winner is not: on SmolLM2 the m = 12 choice was cosine's, and the first 4 of it cost +22.0% at 4,096
tokens where nmse's own 4 cost +11.6% (docs/results/frontier.md). So an m below (or above) the
calibration's is measured here, on the same held-out windows (recreated from what the report records and
checked against its digests) with the artifact's maps, and recorded in the artifact (artifact.measured_best),
so that a second conversion at that m reads it back.
"""

from __future__ import annotations

import time

from nbl_gguf.calibration.artifact import CRITERIA, METHOD_TARGET, save_measured_best
from nbl_gguf.errors import NblError


def selection_windows(artifact, stream):
    """The held-out windows the calibration chose its layers on, cut again with ``stream``'s tokenizer: the
    calibration text's windows after the fit windows, then each bundled kind's (as dataset.load_windows cuts
    them), or the default 8k tokens' worth of the default --selection-text when it held none out. Refused by
    name when the calibration text now reads differently from the report's record of it."""
    import torch

    from nbl_gguf.calibration.dataset import (CALIBRATION_KIND, bundled_selection_windows, load_calibration,
                                              mix_windows, parse_selection_text)
    from nbl_gguf.calibration.resume import tokens_digest
    from nbl_gguf.calibration.settings import DEFAULT_SELECTION_TEXT, DEFAULT_SELECTION_TOKENS
    from nbl_gguf.models import max_context

    data = artifact.report["data"]
    seqlen, fit_windows = int(data["seqlen"]), int(data["nsamples"])
    held = int(data.get("selection_windows") or 0)
    # an artifact from before the mix held out calibration windows only
    counts = (data.get("selection_text") or {}).get("windows") or ({CALIBRATION_KIND: held} if held else mix_windows(
        parse_selection_text(DEFAULT_SELECTION_TEXT), -(-DEFAULT_SELECTION_TOKENS // seqlen)))
    own = counts.get(CALIBRATION_KIND, 0)
    windows = load_calibration(stream.tokenizer, data.get("dataset"), fit_windows + own, seqlen,
                               config=data.get("dataset_config"), split=data.get("split") or "train",
                               field=data.get("text_field") or "text", max_positions=max_context(stream.config))
    if own and windows.nsamples <= fit_windows:
        raise NblError(f"--criterion best: the calibration text has no windows left after the {fit_windows} fit "
                       f"windows to choose the layers on")
    recorded = data.get("windows_sha256")
    if recorded is not None and tokens_digest(windows.input_ids[:fit_windows]) != recorded:
        raise NblError(f"--criterion best: the calibration text ({data.get('dataset') or 'the default'}) reads "
                       f"differently now from when {artifact.path} was made, so its held-out windows cannot be cut "
                       f"again; calibrate again at this m (or choose by --criterion cosine, nmse or cca)")
    bundled, _ = bundled_selection_windows(stream.tokenizer, {k: n for k, n in counts.items() if k != CALIBRATION_KIND},
                                           seqlen)
    heldout = torch.cat([windows.input_ids[fit_windows:], bundled])
    recorded = data.get("selection_sha256")
    if recorded is not None and tokens_digest(heldout) != recorded:
        raise NblError(f"--criterion best: the held-out windows cut again differ from those {artifact.path} was "
                       f"selected on; calibrate again at this m (or choose by --criterion cosine, nmse or cca)")
    return heldout


def map_reader(artifact, method: str, taps: int):
    """(apply.py's layer type, linear(k, type)) of the artifact's maps as a file of ``method`` with maps of
    ``taps`` tokens carries them (its LMMSE maps: best is measured as the calibration measured it)."""
    from nbl_gguf.calibration.apply import ATTN_TAPS, METHOD_LAYER_TYPE

    if taps > 1:
        if method != "attn-nbl":
            raise NblError(f"--taps {taps} goes with attn-nbl, not {method}")
        artifact.require_taps(taps)
        return ATTN_TAPS, lambda k, _type: artifact.taps_map(k)
    target = METHOD_TARGET[method]
    return METHOD_LAYER_TYPE[method], lambda k, _type: artifact.linear(k, target)


def measure(artifact, source, ms: list[int], method: str, taps: int, device: str = "cpu", batch_size: int = 1,
            log=None) -> list[dict]:
    """Best at each m of ``ms`` for ``method`` with maps of ``taps`` tokens, on the calibration's held-out
    windows: one record per m (artifact.measured_best's form), not yet saved."""
    import torch

    from nbl_gguf.calibration.report import describe_selection
    from nbl_gguf.calibration.select import best_of
    from nbl_gguf.calibration.solve import ranking
    from nbl_gguf.calibration.stream import LayerStream
    from nbl_gguf.calibration.variants import StreamedEvaluator

    layer_type, linear = map_reader(artifact, method, taps)
    target = METHOD_TARGET[method]
    rankings = {c: ranking(artifact.scores(c, target)) for c in CRITERIA}
    for m in ms:
        if not 0 < m <= artifact.num_layers:
            raise NblError(f"--m {m} is out of range: the model has {artifact.num_layers} layers")
    started = time.perf_counter()
    # the calibration's own compute type, so that the losses (and the choice) repeat calibrate's
    dtype = getattr(torch, artifact.report["model"].get("dtype") or "float32")
    stream = LayerStream(source, dtype, device)
    heldout = selection_windows(artifact, stream)
    evaluator = StreamedEvaluator(stream, heldout, layer_type, linear, batch_size)
    records = []
    try:
        for m in ms:
            if log is not None:
                log(f"best: {method} m = {m} with {taps}-token maps, on the calibration's {evaluator.tokens} held-out "
                    f"tokens")
            chosen, trace, compared = best_of(evaluator, rankings, m)
            records.append({"m": m, "method": method, "criterion": "best", "taps": taps, "chosen": chosen,
                            "layers": sorted(trace.order),
                            "heldout": {**trace.as_report(),
                                        "compared": {c: {"layers": layers, "ppl_increase_pct": increase}
                                                     for c, (layers, increase) in compared.items()}},
                            "device": str(stream.device), "dtype": str(dtype).replace("torch.", "")})
            if log is not None:
                log(describe_selection(records[-1], artifact.num_layers))
    finally:
        evaluator.close()
    seconds = time.perf_counter() - started
    for record in records:
        record["seconds"] = seconds / len(records)
    return records


def measure_and_record(artifact, source, ms: list[int], method: str, taps: int, device: str = "cpu",
                       batch_size: int = 1, log=None):
    """measure, the records saved in the artifact; the artifact, reloaded."""
    from nbl_gguf.calibration.artifact import load_artifact

    save_measured_best(artifact, measure(artifact, source, ms, method, taps, device, batch_size, log))
    return load_artifact(artifact.path)
