"""From a calibration artifact to the NBL layers of a GGUF: which layers (chosen_layers), their maps
(linear_map) and scores, what the file records about its calibration (provenance), and the writer of
each layout (--runtime). The `convert` command (nbl_gguf.commands.convert) runs these in order.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from nbl_gguf.calibration.artifact import CRITERIA
from nbl_gguf.errors import NblError

METHODS = ("attn-nbl", "attn-drop")
# --runtime: which llama.cpp runs the file, and so its layout (docs/gguf-format.md)
RUNTIMES = {
    "nbl": "NBL layout: runs on the patched llama.cpp (build/)",
    "stock": "stock layout (deci architecture, bias-free maps): runs on unmodified llama.cpp builds (deci is upstream "
             "since 2024-12); the KV saving above needs flash attention (llama.cpp's -fa auto turns it on for CPU)",
}


def check_method(method: str) -> str:
    if method == "block-nbl":
        raise NblError("--method block-nbl replaces whole decoder layers, which the NBL GGUF format does not "
                       "represent: block-level NBL is evaluated in PyTorch only (calibrate / eval); "
                       "use attn-nbl or attn-drop for a GGUF")
    if method not in METHODS:
        raise NblError(f"unknown --method '{method}' (use {', '.join(METHODS)})")
    return method


# convert's --taps auto where the file can carry taps layers: the low-rank K = 4 map of
# docs/results/taps.md, chosen there by held-out perplexity against bytes
DEFAULT_TAPS = 4
# ... but not on a CPU above this width: one layer's taps fit at d = 4096 (the 8B shape) took 208 s and
# 9.7 GiB here (docs/results/taps.md, "At the 8B shape"), against the 6 GB a streamed 8B conversion keeps to
AUTO_TAPS_CPU_MAX_WIDTH = 2048


@dataclass(frozen=True)
class TapsRequest:
    """convert's --taps and what decides it: the asked count ('auto' or K), the layout the file is written
    in (--runtime), the calibration it would be fitted on (--nsamples x --seqlen; None: the device's
    default count / not given) or an artifact given (--calibration, which carries its own fit)."""

    taps: int | str
    runtime: str = "nbl"
    taps_rank: int | None = None
    nsamples: int | None = None
    seqlen: int | None = None
    from_artifact: bool = False


def check_taps(request: TapsRequest, source, method: str, hidden: int | None = None, device: str = "cpu") -> int:
    """--taps K: past-token maps (GGUF layer type 3) need the NBL layout, the attention's maps and a
    graph that builds them, and more fit tokens than stacked inputs; checked before calibrating. Returns
    K; 'auto' is DEFAULT_TAPS where the file can carry them and the calibration (on ``device``, width
    ``hidden``, its tokens) fits them cheaply, else 1 (with --calibration, convert takes the artifact's
    instead)."""
    from nbl_gguf.calibration.settings import DEFAULT_NSAMPLES, check_taps as check_calibration_taps
    from nbl_gguf.gguf import nbl_format

    # the fit tokens asked for; their stacked inputs (K x hidden) need more tokens than that to be solved
    nsamples = request.nsamples
    if nsamples is None and request.taps == "auto":
        nsamples = DEFAULT_NSAMPLES["cuda" if device.startswith("cuda") else "cpu"]
    tokens = nsamples * request.seqlen if nsamples is not None and request.seqlen else None
    if request.taps == "auto":
        fits = request.runtime == "nbl" and method == "attn-nbl" \
            and gguf_architecture(source) in nbl_format.TAPS_ARCHITECTURES
        cheap = device.startswith("cuda") or hidden is None or hidden <= AUTO_TAPS_CPU_MAX_WIDTH
        enough = tokens is None or hidden is None or tokens > DEFAULT_TAPS * hidden
        return DEFAULT_TAPS if fits and cheap and enough else 1
    taps = int(request.taps)
    check_calibration_taps(taps, request.taps_rank, method)  # the count, the rank, the method
    if taps < 2:
        return taps
    if tokens is not None and hidden is not None and not request.from_artifact and tokens <= taps * hidden:
        raise NblError(f"--taps {taps} stacks {taps} x {hidden} = {taps * hidden} inputs a layer, and --nsamples "
                       f"{nsamples} x --seqlen {request.seqlen} is {tokens} tokens: fit on more than {taps * hidden} "
                       f"tokens, or use --taps 1")
    if request.runtime == "stock":
        raise NblError(f"--taps {taps} writes taps layers, which keep the inputs of earlier tokens in a state per "
                       f"sequence: stock llama.cpp's deci layers cannot, so use --runtime nbl (the patched llama.cpp) "
                       f"or --taps 1")
    arch = gguf_architecture(source)
    if arch not in nbl_format.TAPS_ARCHITECTURES:
        raise NblError(f"--taps {taps}: the patched llama.cpp builds taps layers for "
                       f"{', '.join(nbl_format.TAPS_ARCHITECTURES)} models, and {source.name} is a '{arch}' model; "
                       f"use --taps 1")
    return taps


def gguf_architecture(source) -> str | None:
    """The GGUF architecture of --model (for a HF folder, the one the converter will write: the adapter
    table's)."""
    from nbl_gguf import models

    if source.gguf is not None:
        return source.gguf.architecture
    return models.get_adapter(json.loads((source.hf_folder() / "config.json").read_text(encoding="utf-8"))).gguf_arch


def taps_maps(artifact, layers: list[int], taps: int, refined: bool = False) -> dict:
    """The past-token maps of ``layers``, from an artifact calibrated with the same --taps (``refined``:
    its refined maps of these layers)."""
    artifact.require_taps(taps)
    return {layer: artifact.taps_map(layer, refined) for layer in layers}


def uses_refined(artifact, layers: list[int], taps: int, runtime: str) -> bool:
    """Whether the file gets the artifact's refined maps: refined for exactly these layers and maps, and
    the NBL layout (the stock layout's bias-free maps are never refined)."""
    return runtime == "nbl" and artifact.refined_for(layers, taps)


@dataclass(frozen=True)
class LayerChoice:
    """Which layers convert replaces: --m (a count, 'auto', or None for the default), --criterion, and
    --max-ppl-increase (with --m auto)."""

    m: int | str | None
    criterion: str
    max_ppl_increase: float | None = None


def chosen_layers(artifact, choice: LayerChoice, method: str, n_layer: int, taps: int = 1) -> list[int]:
    """The layers to replace: the calibration's own choice (made in this run, or --m auto), else the
    artifact's maps re-ranked for --m / --criterion."""
    from nbl_gguf.calibration.settings import default_m

    selection = artifact.report["selection"]
    if choice.m == "auto":
        if "max_ppl_increase" not in selection or selection["criterion"] != choice.criterion:
            raise NblError(f"--m auto is decided while calibrating; the calibration in {artifact.path} chose a fixed "
                           f"m by {selection['criterion']}: calibrate with --m auto --criterion {choice.criterion}")
        if choice.max_ppl_increase is not None and choice.max_ppl_increase != selection["max_ppl_increase"]:
            raise NblError(f"the calibration in {artifact.path} chose m within +{selection['max_ppl_increase']:g}%, "
                           f"not +{choice.max_ppl_increase:g}%: calibrate again with that budget")
        return sorted(artifact.select(None, choice.criterion, method, taps))
    m = default_m(n_layer) if choice.m is None else choice.m
    return sorted(artifact.select(m, choice.criterion, method, taps))


def recorded_scores(artifact, criterion: str, layers: list[int] | None = None, method: str | None = None,
                    taps: int | None = None) -> tuple[list[float] | None, str | None]:
    """(nbl.scores, the local criterion they are under): a local criterion's own; with best, those of the
    criterion it chose for ``layers`` with ``method`` and ``taps``-token maps (best keeps that criterion's
    ranking: the calibration's choice, or the one measured since at that m); greedy has none (no per-layer
    score: its reasons are the held-out losses in the provenance)."""
    if criterion == "best":
        record = _measured_record(artifact, layers, method, taps)
        criterion = (record or artifact.report["selection"]).get("chosen")
    if criterion not in CRITERIA:
        return None, None
    return [float(s) for s in artifact.scores(criterion, "attn")], criterion


def linear_map(artifact, layer: int, runtime: str, refined: bool = False):
    """(W, b) for a linear layer: the fit with bias for the NBL layout (``refined``: its refined map), the
    bias-free one (b = 0) for the stock layout, whose slot has no bias."""
    if runtime == "stock":
        import numpy as np

        weight = artifact.linear_without_bias(layer)
        return weight, np.zeros(weight.shape[0], dtype=np.float32)
    return artifact.linear(layer, "attn", refined)


def check_stock_runtime(source) -> None:
    """--runtime stock: refuse, before calibrating, a model that llama.cpp's deci graph cannot run."""
    from nbl_gguf.gguf import stock_layout

    if source.gguf is None:
        config = json.loads((source.hf_folder() / "config.json").read_text(encoding="utf-8"))
        stock_layout.check_source_model_type(config.get("model_type"))
    elif source.gguf.architecture not in stock_layout.SOURCE_ARCHITECTURES:
        raise NblError(f"--runtime stock writes llama.cpp's deci architecture, which runs llama GGUFs only; "
                       f"{source.gguf.path.name} is a '{source.gguf.architecture}' model: use --runtime nbl "
                       f"(the patched llama.cpp)")


def writer(runtime: str):
    from nbl_gguf.gguf import nbl_format, stock_layout

    return {"nbl": nbl_format.write_nbl_gguf, "stock": stock_layout.write_stock_gguf}[runtime]


def gguf_notes(source, weights: dict, requested: str | None, runtime: str = "nbl") -> list[str]:
    """What the summary says about a GGUF input: what was kept, and the NBL weights' types and why."""
    keys = "all its keys" if runtime == "nbl" else "all its keys (llama.* renamed deci.*)"
    return [f"stock: {source.path.name} itself; the NBL file keeps {keys} and every tensor but the "
            f"replaced attention, byte for byte", *weight_notes(weights, requested)]


def weight_notes(weights: dict, requested: str | None = None) -> list[str]:
    """One summary line per type of the NBL weights: which layers, and why that type."""
    by_type: dict[tuple, list[int]] = {}
    for layer, weight in weights.items():
        by_type.setdefault((weight.name, weight.instead_of, weight.reason), []).append(layer)
    notes = []
    for (name, instead_of, reason), layers in by_type.items():
        why = ("--nbl-type" if requested is not None else "their attn_output's type" if instead_of is None else
               f"their attn_output's {instead_of} {reason}")
        notes.append(f"NBL weights: {name} in layers {', '.join(map(str, layers))} ({why})")
    return notes


def llama_cpp_commit() -> str | None:
    from nbl_gguf.llamacpp.tools import REPO_ROOT

    cmake = REPO_ROOT / "CMakeLists.txt"
    if cmake.is_file():
        match = re.search(r'NBL_LLAMA_COMMIT\s+"([0-9a-f]+)"', cmake.read_text(encoding="utf-8"))
        if match:
            return match.group(1)
    return None


def llama_cpp_patches_sha256() -> str | None:
    """sha256 over the patch series (each file's name and bytes, in order): with the commit, it names
    the llama.cpp that this package's tools and the GGUF's reader were built from."""
    import hashlib

    from nbl_gguf.llamacpp.tools import REPO_ROOT

    patches = sorted((REPO_ROOT / "patches").glob("*.patch"))
    if not patches:
        return None
    digest = hashlib.sha256()
    for patch in patches:
        digest.update(patch.name.encode("utf-8") + b"\0" + patch.read_bytes() + b"\0")
    return digest.hexdigest()


def _gguf_py_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("gguf")
    except metadata.PackageNotFoundError:
        return None


def provenance(artifact, model_dir: Path, layers: list[int] | None = None, gguf=None, refined: bool = False,
               method: str | None = None, taps: int | None = None) -> dict:
    """What the GGUF records about its calibration (no paths or timings: the bytes must be reproducible);
    ``layers``, ``method``, ``taps``: the file's replaced layers and their maps (the calibration's when None),
    whose measured selection, if any, it records; ``gguf``: the GGUF file (model_source.GgufFile) the NBL file
    was made from, by name and sha256; ``refined``: the maps are the artifact's refined ones (what was refined,
    and how far it moved)."""
    report = artifact.report
    data = dict(report.get("data", {}))
    model = report.get("model", {})
    dataset = _dataset_name(data.get("dataset"))
    return {
        "model": model.get("name") or model_dir.name,
        "model_type": model.get("model_type"),
        "dtype": model.get("dtype"),
        "dataset": dataset,
        "dataset_config": data.get("dataset_config"),
        "split": data.get("split"),
        "nsamples": data.get("nsamples"),
        "seqlen": data.get("seqlen"),
        "tokens": data.get("tokens"),
        "documents": data.get("documents"),
        "text_sha256": data.get("sha256"),
        "seed": data.get("seed"),
        "versions": {**report.get("versions", {}), **_tool_versions()},
        **_measured_selection(artifact, layers, method, taps),
        **({"source_gguf": gguf.provenance()} if gguf is not None else {}),
        **({"refine": _refine_record(report["refine"])} if refined else {}),
    }


def source_provenance(model_dir: Path, gguf=None) -> dict:
    """What a file made without a calibration records (window layers alone: no map was fitted): the model,
    the tools' versions, and the GGUF it was made from (by name and sha256), as provenance() records them."""
    return {"model": model_dir.name, "versions": _tool_versions(),
            **({"source_gguf": gguf.provenance()} if gguf is not None else {})}


def _tool_versions() -> dict:
    from nbl_gguf import __version__

    return {"nbl_gguf": __version__, "gguf": _gguf_py_version(), "llama.cpp": llama_cpp_commit(),
            "llama.cpp patches": llama_cpp_patches_sha256()}


def _dataset_name(dataset: str | None) -> str | None:
    """A --dataset as the GGUF records it: a local file by its name (where it lay is no part of it; the
    record's text_sha256 is), a hub name as it is."""
    from nbl_gguf.calibration.dataset import FILE_SUFFIXES

    if dataset and Path(dataset).suffix.lower() in FILE_SUFFIXES:
        return Path(dataset).name
    return dataset


def _refine_record(refine: dict) -> dict:
    """The refinement as the GGUF keeps it: what, how, and the held-out losses (not its time, file or the
    path of its text)."""
    record = {key: value for key, value in refine.items() if key not in ("seconds", "weights", "history", "device")}
    heldout = (record.get("windows") or {}).get("heldout")
    if isinstance(heldout, dict) and heldout.get("calibration_text"):
        record["windows"] = {**record["windows"],
                             "heldout": {**heldout, "calibration_text": _dataset_name(heldout["calibration_text"])}}
    return record


def _measured_selection(artifact, layers: list[int] | None, method: str | None, taps: int | None) -> dict:
    """Why these layers, when they are the calibration's measured choice (best, greedy, --m auto) or best
    measured since at their m (calibration.best_at), for these maps: the held-out losses."""
    record = _measured_record(artifact, layers, method, taps)
    if record is None:
        return {}
    if record is artifact.report["selection"]:
        keys = ("method", "criterion", "m", "max_ppl_increase", "heldout")
        return {"selection": {key: record[key] for key in keys if key in record}}
    return {"selection": {"method": record["method"], "criterion": "best", "m": record["m"],
                          "measured_after_calibration": True, "heldout": record["heldout"]}}


def _measured_record(artifact, layers: list[int] | None, method: str | None, taps: int | None) -> dict | None:
    """The record of the held-out measurement that chose ``layers`` for ``method`` with ``taps``-token maps
    (None: the calibration's): the calibration's own selection, or a best measured since (best_at), or None.
    A measurement holds for the maps it was measured with: the same layers with other maps were not measured."""
    if layers is None:
        return None
    selection = artifact.report.get("selection", {})
    method = method or selection.get("method")
    taps = artifact.taps if taps is None else int(taps)
    if ("heldout" in selection and sorted(selection.get("layers", [])) == sorted(layers)
            and method == selection.get("method") and taps == artifact.taps):
        return selection  # the calibration's own choice answers first
    measured = artifact.measured_best(len(layers), method, taps)
    return measured if measured is not None and measured["layers"] == sorted(layers) else None
