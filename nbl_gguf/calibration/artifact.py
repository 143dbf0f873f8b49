"""The calibration artifact: a directory that later stages (convert, eval) read without the model.

    nbl.safetensors  attn.{i}.weight/bias, block.{i}.weight/bias (float32, y = W x + b) and
                     attn.{i}.weight_nobias (y = W0 x) for every layer, plus float64 means and canonical correlations (and covariances when
                     calibrated with --save-covariances); no block.* when calibrated with --targets attn
    report.json      provenance, per-layer scores, ridge, ranking, selection, timings, versions
    scores.png       per-layer scores with the selection marked
    refined-*.safetensors  (after calibrate/convert --refine) the refined maps of one set of layers, under
                     the same names as their LMMSE maps, which stay; report.json's "refine" names the
                     file and says what was refined and how far the held-out loss moved
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from nbl_gguf.errors import NblError

WEIGHTS = "nbl.safetensors"
REPORT = "report.json"
PLOT = "scores.png"
CRITERIA = ("cca", "nmse", "cosine")  # per-layer scores, kept for every layer
# chosen by the held-out loss of the whole model (no per-layer score): best of the three, greedy
SELECTIONS = ("best",) + CRITERIA + ("greedy",)
DEFAULT_CRITERION = "best"
LOCAL_DEFAULT = "cosine"  # the local criterion that plots and greedy's candidates start from
TARGETS = ("attn", "block")
# the attention map fitted without bias (W0 = E[YX^T] E[XX^T]^-1), for a runtime slot that has none
NOBIAS_WEIGHT = "attn.{layer}.weight_nobias"
METHOD_TARGET = {"attn-nbl": "attn", "attn-drop": "attn", "block-nbl": "block"}


def report_targets(report: dict) -> tuple[str, ...]:
    """What was fitted: ('attn', 'block') or ('attn',) (artifacts older than the key have both)."""
    return tuple(report.get("targets", TARGETS))


class LazyTensors(Mapping):
    """name -> numpy array, read from safetensors files on access (an 8B model's maps for every layer
    are 4 GB: an artifact is never held in memory whole)."""

    def __init__(self, files):
        from safetensors import safe_open

        self.files = [Path(f) for f in files]
        self.where: dict[str, Path] = {}
        for path in self.files:
            with safe_open(str(path), framework="numpy") as handle:
                for name in handle.keys():
                    self.where[name] = path

    def __getitem__(self, name: str) -> np.ndarray:
        from safetensors import safe_open

        with safe_open(str(self.where[name]), framework="numpy") as handle:
            return handle.get_tensor(name)

    def info(self, name: str) -> tuple[str, list[int]]:
        """(safetensors dtype, shape) without reading the data."""
        from safetensors import safe_open

        with safe_open(str(self.where[name]), framework="numpy") as handle:
            piece = handle.get_slice(name)
            return piece.get_dtype(), list(piece.get_shape())

    def __iter__(self):
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)

    def __contains__(self, name) -> bool:
        return name in self.where


SAFETENSORS_NAMES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
                     np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.uint8): "U8"}


def save_safetensors(path: Path, tensors: Mapping, metadata: dict[str, str]) -> None:
    """A safetensors file written one tensor at a time (``tensors`` may be a LazyTensors)."""
    names = sorted(tensors)
    infos = {}
    for name in names:
        if isinstance(tensors, LazyTensors):
            infos[name] = tensors.info(name)
        else:
            array = np.asarray(tensors[name])
            infos[name] = (SAFETENSORS_NAMES[array.dtype], list(array.shape))
    sizes = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U8": 1}
    header, offset = {"__metadata__": metadata}, 0
    for name in names:
        dtype, shape = infos[name]
        nbytes = int(np.prod(shape)) * sizes[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little"))
        handle.write(encoded)
        for name in names:
            array = np.ascontiguousarray(tensors[name])
            if SAFETENSORS_NAMES.get(array.dtype) != infos[name][0] or list(array.shape) != infos[name][1]:
                raise NblError(f"tensor {name} changed while the artifact was written")
            handle.write(memoryview(array).cast("B"))


class CalibrationArtifact:
    def __init__(self, path: Path, report: dict, tensors: dict[str, np.ndarray], refined=None):
        self.path = path
        self.report = report
        self.tensors = tensors
        self.refined = refined  # the refined maps' tensors (report["refine"]), or None

    def refined_for(self, layers, taps: int) -> bool:
        """Whether the artifact holds maps refined for exactly these replaced layers with maps of ``taps``
        tokens (a refinement tunes a set of layers together: it holds for that set only)."""
        refine = self.report.get("refine")
        return bool(refine) and self.refined is not None and sorted(refine["layers"]) == sorted(layers) \
            and int(refine.get("taps", 1)) == int(taps)

    @property
    def num_layers(self) -> int:
        return int(self.report["model"]["num_layers"])

    @property
    def targets(self) -> tuple[str, ...]:
        return report_targets(self.report)

    def _check_target(self, target: str) -> None:
        if target not in TARGETS:
            raise NblError(f"unknown target '{target}' (use attn or block)")
        if target not in self.targets:
            raise NblError(f"the calibration in {self.path} has no {target} statistics: "
                           f"run calibrate again with --targets attn,block")

    def linear(self, layer: int, target: str = "attn", refined: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(W [d, d], b [d]) float32 with y = W x + b, for the attention or the whole block (``refined``:
        the refined attention map; check refined_for first)."""
        self._check_target(target)
        if not 0 <= layer < self.num_layers:
            raise NblError(f"layer {layer} out of range (the model has {self.num_layers})")
        d = self.report["model"].get("hidden_size")
        tensors = self._refined_tensors() if refined else None
        weight = self._tensor(f"{target}.{layer}.weight", None if d is None else (d, d), tensors)
        bias = self._tensor(f"{target}.{layer}.bias", None if d is None else (d,), tensors)
        return weight, bias

    def _refined_tensors(self):
        if self.refined is None:
            raise NblError(f"the calibration in {self.path} holds no refined maps: calibrate or convert with --refine")
        return self.refined

    @property
    def taps(self) -> int:
        """Tokens its past-token maps read (calibrate --taps); 1 when it has per-token maps only."""
        return int(self.report["selection"].get("taps", 1))

    def require_taps(self, taps: int) -> None:
        """Refuse a file of ``taps``-token maps (convert --taps) that this calibration has no maps for, by
        name: it holds per-token maps, and past-token maps of its own length only."""
        if self.taps != taps:
            held = "no past-token maps" if self.taps < 2 else f"maps of {self.taps} tokens"
            raise NblError(f"--taps {taps}: the calibration in {self.path} has {held}; calibrate with --taps {taps} "
                           f"(or convert with --taps {self.taps})")

    def taps_map(self, layer: int, refined: bool = False):
        """The calibration.taps.TapsMap of ``layer`` (float32 tensors), checked like the linear maps
        (``refined``: its refined map; check refined_for first)."""
        from nbl_gguf.calibration.taps import map_from_tensors

        if self.taps < 2:
            raise NblError(f"the calibration in {self.path} has no past-token maps: calibrate with --taps K (K > 1)")
        if not 0 <= layer < self.num_layers:
            raise NblError(f"layer {layer} out of range (the model has {self.num_layers})")
        tensors = self._refined_tensors() if refined else self.tensors
        return map_from_tensors(lambda name: self._tensor(name, None, tensors), layer, self.taps, tensors)

    def _tensor(self, name: str, shape: tuple[int, ...] | None, tensors=None) -> np.ndarray:
        """A map tensor, checked: an edited or damaged artifact must not reach a GGUF."""
        tensor = (self.tensors if tensors is None else tensors).get(name)
        if tensor is None:
            raise NblError(f"the calibration in {self.path} has no tensor {name} ({WEIGHTS} is incomplete)")
        if shape is not None and tuple(tensor.shape) != shape:
            raise NblError(f"the calibration in {self.path}: tensor {name} has shape {list(tensor.shape)}, "
                           f"expected {list(shape)} (hidden size {shape[0]})")
        if not np.isfinite(tensor).all():
            raise NblError(f"the calibration in {self.path}: tensor {name} is not finite (NaN or inf)")
        return tensor

    def linear_without_bias(self, layer: int) -> np.ndarray:
        """W0 [d, d] float32 with y = W0 x: the attention map fitted without bias (uncentered moments),
        for runtimes whose slot has no bias (stock llama.cpp's deci linear attention)."""
        if not 0 <= layer < self.num_layers:
            raise NblError(f"layer {layer} out of range (the model has {self.num_layers})")
        name = NOBIAS_WEIGHT.format(layer=layer)
        if name not in self.tensors:
            raise NblError(f"the calibration in {self.path} has no bias-free attention maps ({name}): it was made "
                           f"before they were added; run calibrate again (or convert without --calibration)")
        return self.tensors[name]

    def scores(self, criterion: str = "cca", target: str = "attn") -> np.ndarray:
        if criterion not in CRITERIA:
            raise NblError(f"unknown criterion '{criterion}' (use {', '.join(CRITERIA)})")
        self._check_target(target)
        return np.array([layer[target][criterion] for layer in self.report["layers"]], dtype=np.float64)

    def block_influence(self) -> np.ndarray:
        """ShortGPT's block influence of every decoder layer, 1 - cos(block input, block output): the lowest
        are the blocks that change the hidden state least, the ones a layer pruning removes first."""
        values = [layer.get("block_cosine", (layer.get("block") or {}).get("cosine")) for layer in self.report["layers"]]
        if any(value is None for value in values):
            raise NblError(f"the calibration in {self.path} has no block influence (1 - cos of each block): it was "
                           f"made before it was recorded; run calibrate again")
        return np.array(values, dtype=np.float64)

    def select(self, m: int | None = None, criterion: str | None = None, method: str | None = None,
               taps: int | None = None) -> list[int]:
        """Layers to replace; with no arguments, the selection made at calibration time. ``taps``: the
        maps they will get (a measured selection holds only for the maps it was measured with). Best at
        another m or kind of map than the calibration's is the one measured for it later (best_at)."""
        from nbl_gguf.calibration.solve import select_layers  # solve needs torch; reading an artifact does not

        chosen = self.report["selection"]
        m = chosen["m"] if m is None else m
        criterion = criterion or chosen["criterion"]
        method = method or chosen["method"]
        if method not in METHOD_TARGET:
            raise NblError(f"unknown method '{method}' (use {', '.join(METHOD_TARGET)})")
        if criterion == "best" and m == 0:
            return []
        if criterion == "best" and not self._calibrated_best(m, method, taps):
            measured = self.measured_best(m, method, taps)
            if measured is None:
                made = (f"the best selection in {self.path} was measured at m = {chosen.get('m')} for "
                        f"{chosen['method']} with {self.taps}-token maps, not" if chosen.get("criterion") == "best"
                        else f"the selection in {self.path} was made by {chosen.get('criterion')}, not by best")
                raise NblError(f"{made} at m = {m} for {method} with {self.taps if taps is None else taps}-token maps: "
                               f"convert --calibration {self.path} --m {m} measures it (or choose by --criterion "
                               f"cosine, nmse or cca)")
            return sorted(measured["layers"])
        if criterion in ("greedy", "best"):
            return self._recorded_prefix(m, method, criterion, taps)
        return select_layers(self.scores(criterion, METHOD_TARGET[method]), m)

    def _calibrated_best(self, m: int, method: str, taps: int | None) -> bool:
        """Whether the calibration's own best selection answers for (m, method, taps): best measured its m,
        or the m that --m auto's walk fitted, for its method and its maps. A smaller m is not a prefix of it: another
        criterion can cost less there (docs/results/frontier.md, "Best measured at each m")."""
        chosen = self.report["selection"]
        return (chosen.get("criterion") == "best" and method == chosen["method"] and m == chosen.get("m")
                and (taps is None or taps == self.taps))

    def best_unmeasured(self, m: int, method: str | None = None, taps: int | None = None) -> bool:
        """Whether best at (m, method, taps) is neither the calibration's choice nor measured since (best_at)."""
        method = method or self.report["selection"]["method"]
        return m != 0 and not self._calibrated_best(m, method, taps) and self.measured_best(m, method, taps) is None

    def measured_best(self, m: int, method: str | None = None, taps: int | None = None) -> dict | None:
        """The best selection measured after the calibration for (m, method, taps) (best_at.record), or None."""
        method = method or self.report["selection"]["method"]
        taps = self.taps if taps is None else int(taps)
        for entry in self.report["selection"].get("measured_best", []):
            if (entry["m"], entry["method"], entry["taps"]) == (m, method, taps):
                return entry
        return None

    def nested_order(self, criterion: str | None = None, method: str | None = None, taps: int | None = None) -> list[int]:
        """The layers in the order they join as m grows, each m's set holding the last's: a local criterion's
        ranking, or the order greedy or best recorded (up to the calibration's m). Best's own choice at a smaller
        m may differ from this order's prefix (select); a walk over growing sets (--kv-budget) reads this."""
        from nbl_gguf.calibration.solve import ranking

        chosen = self.report["selection"]
        criterion = criterion or chosen["criterion"]
        method = method or chosen["method"]
        if criterion in ("greedy", "best"):
            return self._recorded_order(method, criterion, taps)
        return ranking(self.scores(criterion, METHOD_TARGET[method]))

    def _recorded_prefix(self, m: int, method: str, criterion: str, taps: int | None = None) -> list[int]:
        """The first m layers of the order that greedy or best recorded at calibration time (their choice
        was measured on the model, so it cannot be redone from the scores)."""
        order = self._recorded_order(method, criterion, taps)
        if not 0 <= m <= len(order):
            raise NblError(f"the {criterion} selection in {self.path} goes to m = {len(order)}, not {m}: "
                           f"calibrate again with --criterion {criterion} --m {m}")
        return sorted(order[:m])

    def _recorded_order(self, method: str, criterion: str, taps: int | None = None) -> list[int]:
        """The order greedy or best recorded at calibration time, refused by name when it was made by another
        criterion, for another method or with other maps."""
        chosen = self.report["selection"]
        order = (chosen.get("heldout") or {}).get("order")
        if chosen.get("criterion") != criterion or order is None:
            raise NblError(f"the calibration in {self.path} made no {criterion} selection: calibrate with "
                           f"--criterion {criterion}")
        if method != chosen["method"]:
            raise NblError(f"the {criterion} selection in {self.path} was made for {chosen['method']}, not {method}")
        if taps is not None and taps != self.taps:
            raise NblError(f"the {criterion} selection in {self.path} was measured with {self.taps}-token maps, not "
                           f"{taps}: calibrate with --taps {taps} (or choose by --criterion cosine, nmse or cca)")
        return list(order)

    def layer_types(self, m: int | None = None, criterion: str | None = None, method: str | None = None) -> list[int]:
        """Per-layer codes for apply_nbl / the GGUF layer map (0 keep, 1 attn-nbl, 2 attn-drop, 3 block-nbl)."""
        from nbl_gguf.calibration.apply import METHOD_LAYER_TYPE

        method = method or self.report["selection"]["method"]
        types = [0] * self.num_layers
        for layer in self.select(m, criterion, method):
            types[layer] = METHOD_LAYER_TYPE[method]
        return types


def load_artifact(path: str | os.PathLike) -> CalibrationArtifact:
    path = Path(path)
    if not (path / REPORT).is_file() or not (path / WEIGHTS).is_file():
        raise NblError(f"{path} is not a calibration artifact (expected {REPORT} and {WEIGHTS}); run 'calibrate' first")
    try:
        report = json.loads((path / REPORT).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise NblError(f"{path / REPORT} is not valid JSON ({error})") from None
    missing = [key for key in ("model", "layers", "selection") if not isinstance(report, dict) or key not in report]
    if missing or "num_layers" not in report["model"] or len(report["layers"]) != report["model"]["num_layers"]:
        raise NblError(f"{path / REPORT} is not a calibration report (" + (
            f"no {', '.join(missing)}" if missing else "no model.num_layers or not one entry per layer") + ")")
    try:
        tensors = LazyTensors([path / WEIGHTS])
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error type for damaged files
        raise NblError(f"{path / WEIGHTS} is not a readable safetensors file ({error})") from error
    refined = None
    if report.get("refine"):
        name = report["refine"].get("weights")
        if not isinstance(name, str) or not (path / name).is_file():
            raise NblError(f"{path / REPORT} records refined maps in {name!r}, which is not in {path}")
        try:
            refined = LazyTensors([path / name])
        except Exception as error:  # noqa: BLE001 - as above
            raise NblError(f"{path / name} is not a readable safetensors file ({error})") from error
    return CalibrationArtifact(path, report, tensors, refined)


def save_refined(artifact: CalibrationArtifact, report: dict, tensors: dict[str, np.ndarray]) -> None:
    """Add refined maps to ``artifact``'s directory: their own file (named by its content, so that the
    report in place always names the file it was written with), then the report, each renamed into
    place; the refined maps of an earlier refinement are removed after."""
    import hashlib

    path = Path(artifact.path)
    content = hashlib.sha256()
    for name in sorted(tensors):
        content.update(name.encode() + np.ascontiguousarray(tensors[name]).tobytes())
    name = f"refined-{content.hexdigest()[:16]}.safetensors"
    tmp = path / f".{name}.tmp"
    try:
        save_safetensors(tmp, tensors, metadata={"format": "nbl-calibration-refined"})
        os.replace(tmp, path / name)
    finally:
        tmp.unlink(missing_ok=True)
    _replace_report(path, {**artifact.report, "refine": {**report, "weights": name}})
    for old in path.glob("refined-*.safetensors"):
        if old.name != name:
            old.unlink(missing_ok=True)


def save_measured_best(artifact: CalibrationArtifact, entries: list[dict]) -> None:
    """Record best selections measured after the calibration (calibration.best_at) in ``artifact``'s report,
    replacing those of the same (m, method, taps)."""
    keys = {(e["m"], e["method"], e["taps"]) for e in entries}
    kept = [e for e in artifact.report["selection"].get("measured_best", [])
            if (e["m"], e["method"], e["taps"]) not in keys]
    selection = {**artifact.report["selection"], "measured_best": kept + list(entries)}
    _replace_report(Path(artifact.path), {**artifact.report, "selection": selection})


def _replace_report(path: Path, report: dict) -> None:
    """The artifact's report replaced whole (written aside, then renamed into place)."""
    tmp = path / f".{REPORT}.tmp"
    try:
        tmp.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path / REPORT)
    finally:
        tmp.unlink(missing_ok=True)


def write_artifact(path: str | os.PathLike, report: dict, tensors: dict[str, np.ndarray], plot=None) -> Path:
    """Write into a sibling temp dir and rename, so readers never see a half-written artifact.

    plot(path) draws the scores figure into the temp dir (optional).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        save_safetensors(tmp / WEIGHTS, tensors,
                         metadata={"format": "nbl-calibration", "version": str(report.get("format_version", 1))})
        (tmp / REPORT).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        if plot is not None:
            plot(tmp / PLOT)
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old.{os.getpid()}"
            os.rename(path, old)
        os.rename(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def plot_scores(path: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = report["layers"]
    selection = report["selection"]
    target = METHOD_TARGET[selection["method"]]
    x = np.arange(len(layers))
    fig, axes = plt.subplots(len(CRITERIA), 1, figsize=(max(6, 0.25 * len(layers) + 2), 8), sharex=True)
    for ax, criterion in zip(axes, CRITERIA):
        for name, style in (("attn", "o-"), ("block", "s--")):
            if name not in report_targets(report):
                continue
            ax.plot(x, [layer[name][criterion] for layer in layers], style, ms=3, label=name)
        if criterion == selection.get("chosen", selection["criterion"] if selection["criterion"] in CRITERIA else LOCAL_DEFAULT):
            chosen = selection["layers"]
            ax.plot(chosen, [layers[i][target][criterion] for i in chosen], "r*", ms=12,
                    label=f"selected ({selection['method']})")
        ax.set_ylabel({"cca": "CCA bound", "nmse": "NMSE", "cosine": "1 - cos"}[criterion])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[-1].set_xlabel("layer")
    axes[0].set_title(f"{report['model']['name']}: per-layer redundancy (lower = more replaceable)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
