"""The pieces of `eval --sweep` (the command: nbl_gguf.commands.eval_sweep): baseline vs Attn NBL-m vs
Attn DROP-m (GGUF, through llama.cpp, and PyTorch float32) vs Block NBL-m (PyTorch only: the GGUF
format has no block-level type), for a list of m.

One calibration artifact serves every configuration. The stock model is converted to an F32 GGUF
once and quantized once per type; each configuration is the NBL surgery on the stock file of its type
(nbl_format.write_nbl_gguf: the stock tensor types, the NBL weights in their attn_output's type raised
to 5.5 bits, as `convert` does). A GGUF --model is its own stock file. Results are cached in the work dir under a key of everything that
determines them, so an interrupted sweep resumes where it stopped. The tables, CSV and plot are written by sweep_report.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from nbl_gguf.calibration.artifact import CRITERIA, LOCAL_DEFAULT
from nbl_gguf.errors import NblError
from nbl_gguf.measurement.sweep_report import METHOD_LABELS

DEFAULT_QUANTS = ("q8_0", "q4_k_m")  # of a HF model; a GGUF model is measured in its own types


@dataclass
class Config:
    method: str  # baseline | attn-nbl | attn-drop | block-nbl
    m: int
    criterion: str
    layers: list[int] = field(default_factory=list)
    variant: str = ""  # set when the selection differs from the sweep's main criterion
    chosen_by: str = ""  # "best" when the held-out windows chose this criterion's layers for the main rows

    @property
    def series(self) -> str:
        return self.method + (f" ({self.variant})" if self.variant else "")

    @property
    def key(self) -> str:
        return "baseline" if self.method == "baseline" else f"{self.method}-{self.criterion}-m{self.m}"

    @property
    def label(self) -> str:
        if self.method == "baseline":
            return "Baseline"
        note = self.variant or (f"{self.chosen_by}: {self.criterion} layers" if self.chosen_by else "")
        return f"{METHOD_LABELS[self.method]}-{self.m}" + (f" ({note})" if note else "")

    @property
    def gguf(self) -> bool:
        return self.method != "block-nbl"

    def apply_types(self, n_layer: int) -> list[int]:
        """apply_nbl codes (0 keep, 1 attn-nbl, 2 attn-drop, 3 block-nbl)."""
        from nbl_gguf.calibration.apply import METHOD_LAYER_TYPE

        code = METHOD_LAYER_TYPE.get(self.method, 0)
        return [code if i in self.layers else 0 for i in range(n_layer)]


class Cache:
    def __init__(self, path: Path, fresh: bool):
        self.path = path
        self.data = {} if fresh or not path.is_file() else json.loads(path.read_text(encoding="utf-8"))

    def get(self, key):
        return self.data.get(key)

    def put(self, key, value):
        self.data[key] = value
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n", encoding="utf-8")
        tmp.replace(self.path)
        return value


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


def _file_sha(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:12]


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- inputs --------------------------------------------------------------------------------------

def best_choices(artifact, source, methods: list[str], ms: list[int], cache, calib_tag: str) -> dict:
    """What `--criterion best` picks at each (method, m): the local criterion whose m layers cost the model
    least on held-out windows: those calibrate measured (the calibration text's windows after the artifact's
    fit windows and the bundled kinds' windows, as its report records them), or the default 8k tokens' worth
    of the default --selection-text when it held none out (calibration.select.best_of)."""
    # measured for Attn NBL only: each choice costs about two passes of the model over the held-out windows,
    # and the Attn DROP rows show every criterion anyway
    methods = [method for method in methods if method == "attn-nbl"]
    keys = {(method, m): f"best|{calib_tag}|{method}|m{m}" for method in methods for m in ms}
    if all(cache.get(key) for key in keys.values()):
        return {pair: cache.get(key)["chosen"] for pair, key in keys.items()}
    from nbl_gguf.calibration import best_at

    choices = {}
    for method in methods:
        for record in best_at.measure(artifact, source, ms, method, 1, log=_log):
            compared = {c: (entry["layers"], entry["ppl_increase_pct"]) for c, entry in record["heldout"]["compared"].items()}
            cache.put(keys[(method, record["m"])], {"chosen": record["chosen"], "compared": compared})
            choices[(method, record["m"])] = record["chosen"]
    return choices


def build_configs(artifact, ms: list[int], methods: list[str], criterion: str, extra_criteria: list[str] = (),
                  criteria_m: int = 0, best: dict | None = None) -> tuple[list[Config], list[Config]]:
    """(main sweep, criteria comparison) configurations with their selected layers: each method at each m
    by ``criterion`` and by each of ``extra_criteria``, and at ``criteria_m`` (0: none) each criterion's
    layers for Attn NBL and DROP. With --criterion best, ``best`` maps (method, m) to the local criterion
    that the held-out calibration windows chose (and every other criterion's layers are shown beside)."""
    main = [Config("baseline", 0, criterion)]
    for m in ms:
        for method in methods:
            # block NBL has no held-out selection: it keeps the local default
            chosen = (best or {}).get((method, m), criterion if criterion in CRITERIA else LOCAL_DEFAULT)
            main.append(Config(method, m, chosen, artifact.select(m, chosen, method),
                               chosen_by="best" if (method, m) in (best or {}) else ""))
            if method in ("attn-nbl", "attn-drop"):
                extra = CRITERIA if best else extra_criteria
                for other in [c for c in extra if c != chosen]:
                    main.append(Config(method, m, other, artifact.select(m, other, method), variant=f"{other} layers"))
    criteria = []
    if criteria_m:
        for method in ("attn-nbl", "attn-drop"):
            for other in CRITERIA:
                criteria.append(Config(method, criteria_m, other, artifact.select(criteria_m, other, method)))
    return main, criteria


# --- GGUFs ----------------------------------------------------------------------------------------

class GgufFactory:
    """Stock F32 conversion once, quantized once per type; per configuration the NBL surgery on the stock
    file of its type. Given a GGUF file (``gguf``, a model_source.GgufFile), that file is the stock."""

    def __init__(self, source, artifact, directory: Path, threads: int | None):
        self.source = source  # model_source.ModelSource
        self.gguf = source.gguf
        self.artifact = artifact
        self.directory = directory
        self.threads = threads
        directory.mkdir(parents=True, exist_ok=True)
        self._stock = None if self.gguf is None else self.gguf.path

    @property
    def stock(self) -> Path:
        from nbl_gguf.gguf.hf_to_gguf import convert_hf_to_gguf

        if self._stock is None:
            path = self.directory / "stock-f32.gguf"
            if not path.is_file():
                _log("stock F32 conversion")
                convert_hf_to_gguf(self.source.hf_folder(), path, "f32")
            self._stock = path
        return self._stock

    def path(self, config: Config, quant: str) -> Path:
        """The GGUF of ``config`` in ``quant``, made as `convert` makes it: the stock file in that type
        (llama-quantize of the F32 conversion, or the GGUF --model itself), then the NBL surgery on it."""
        from nbl_gguf.gguf import nbl_format
        from nbl_gguf.gguf.from_artifact import provenance
        from nbl_gguf.gguf.quantize import quantize

        if self.gguf is not None or quant.upper() == "F32":
            stock = self.stock
        else:
            stock = self.directory / f"baseline-{quant.lower()}.gguf"
            if not stock.is_file():
                _log(f"llama-quantize stock -> {quant}")
                quantize(self.stock, stock, quant, threads=self.threads)
        if config.method == "baseline":
            return stock
        target = self.directory / f"{config.key}-{quant.lower()}.gguf"
        if not target.is_file():
            _log(f"NBL surgery {config.key} {quant}")
            n_layer = self.artifact.num_layers
            code = nbl_format.LINEAR if config.method == "attn-nbl" else nbl_format.DROPPED
            types = [code if i in config.layers else nbl_format.ATTENTION for i in range(n_layer)]
            linear = {i: self.artifact.linear(i, "attn") for i in config.layers if code == nbl_format.LINEAR}
            layers = nbl_format.NblLayers(types=types, linear=linear, method=config.method,
                                          criterion=config.criterion,
                                          scores=[float(s) for s in self.artifact.scores(config.criterion, "attn")],
                                          calibration=provenance(self.artifact, Path(self.source.name), gguf=self.gguf))
            nbl_format.write_nbl_gguf(stock, target, layers)
        return target


def bench_pair(baseline: Path, model: Path, bench_args: str, threads: int | None) -> dict:
    """llama-bench of the baseline and the model in one process: {"baseline": ..., "model": ...}."""
    from nbl_gguf.llamacpp.tools import run_tool

    args = ["-m", str(baseline), "-m", str(model), *shlex.split(bench_args), "-o", "json"]
    if threads:
        args += ["-t", str(threads)]
    done = run_tool("llama-bench", args)
    try:
        entries = json.loads(done.stdout)
    except json.JSONDecodeError as error:
        raise NblError(f"llama-bench printed no JSON for {model.name}: {error}") from error
    result = {"baseline": {}, "model": {}}
    for entry in entries:
        who = "baseline" if Path(entry["model_filename"]).resolve() == baseline.resolve() else "model"
        kind = "tg" if entry.get("n_gen", 0) else "pp"
        result[who][kind] = (float(entry["avg_ts"]), float(entry["stddev_ts"]))
    return result
