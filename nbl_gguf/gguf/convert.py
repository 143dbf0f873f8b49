"""`convert`: HF model or GGUF file -> NBL GGUF in one command.

    HF model:   calibrate (or reuse --calibration)  ->  stock GGUF by the pinned llama.cpp converter
                (F32/F16)  ->  NBL rewrite (selected layers: attn-nbl = W x + b, attn-drop = nothing)
                ->  llama-quantize
    GGUF file:  calibrate on the model transformers dequantizes from it  ->  NBL surgery on the file
                itself (every other tensor keeps its bytes and type; W in --nbl-type)

Intermediate files live in a temp dir; the output appears only once complete (temp then rename),
so an interrupted or failed run leaves no partial GGUF. The same inputs and seed give the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from nbl_gguf.calibration.artifact import CRITERIA
from nbl_gguf.calibration.calibrate import (add_compute_arguments, add_dataset_arguments, add_selection_arguments,
                                            selection_budget)
from nbl_gguf.errors import NblError
from nbl_gguf.outputs import check_output_dir, check_output_file
from nbl_gguf.usage import StageMeter

METHODS = ("attn-nbl", "attn-drop")
# --runtime: which llama.cpp runs the file, and so its layout (docs/gguf-format.md)
RUNTIMES = {
    "nbl": "NBL layout: runs on the patched llama.cpp (build/)",
    "stock": "stock layout (deci architecture, bias-free maps): runs on unmodified llama.cpp builds (deci is upstream "
             "since 2024-12); the KV saving above needs flash attention (llama.cpp's -fa auto turns it on for CPU)",
}
FLOAT_OUTPUTS = ("F32", "F16", "BF16")
DEFAULT_QUANT = "q4_k_m"
# --intermediate by default: the checkpoint's own float type when every weight has it (a 16-bit model
# converts losslessly at half the bytes of f32: 16 GB instead of 32 for an 8B model, twice over), else f32
INTERMEDIATE_OF = {"F16": "f16", "BF16": "bf16"}
# the summary's held-out perplexity: a small slice, so that it costs seconds on a small model
EVAL_CTX = 512
EVAL_CHUNKS = 8
SUMMARY_CTX = 4096  # the summary's KV cache figures: at this context, and at the model's training context


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF folder, hub id or GGUF file of a supported model (llama, mistral, qwen2/3, phi3, "
                             "gemma2/3, ...) (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--quant", default=None,
                        help="output type of a HF model: any llama-quantize type (q4_k_m, q5_k_m, q8_0, ...) or "
                             f"f32/f16/bf16 (default: {DEFAULT_QUANT}); a GGUF --model keeps its own types")
    parser.add_argument("--nbl-type", default=None, metavar="TYPE",
                        help="GGUF --model only: ggml type of the NBL weights (q8_0, q4_k, f16, ...; default: the type "
                             "of each replaced layer's attn_output, q8_0 where that cannot hold an n_embd x n_embd matrix)")
    parser.add_argument("--runtime", default="nbl", choices=list(RUNTIMES),
                        help="nbl (default): the NBL layout, W x + b, for the patched llama.cpp; stock: llama.cpp's "
                             "deci architecture with bias-free maps, which unmodified builds run (llama, mistral)")
    parser.add_argument("--method", default="attn-nbl",
                        help="attn-nbl (attention -> W x + b) or attn-drop (attention removed); "
                             "block-nbl is evaluated in PyTorch only")
    add_selection_arguments(parser)
    add_dataset_arguments(parser)
    parser.add_argument("--nsamples", type=int, default=None,
                        help="calibration windows (default: calibrate's: 256 on CUDA, 32 on a CPU)")
    parser.add_argument("--seqlen", type=int, default=None, help="tokens per calibration window (default: calibrate's)")
    parser.add_argument("--batch-size", type=int, default=1, help="calibration windows per forward pass")
    add_compute_arguments(parser)
    parser.add_argument("--calibration", default=None, metavar="ARTIFACT",
                        help="reuse a calibration artifact directory (from `calibrate`) instead of calibrating")
    parser.add_argument("--save-calibration", default=None, metavar="DIR",
                        help="keep the calibration artifact made by this run in DIR")
    parser.add_argument("--imatrix", action="store_true",
                        help="quantize with an importance matrix (llama-imatrix over the calibration text)")
    parser.add_argument("--imatrix-chunks", type=int, default=64, help="imatrix chunks of 512 tokens (default: 64)")
    parser.add_argument("--intermediate", default=None, choices=["f32", "f16", "bf16"],
                        help="HF --model only: type of the stock conversion that is rewritten and quantized "
                             "(default: the checkpoint's own type when all its weights are f16 or bf16, else f32)")
    parser.add_argument("--threads", type=int, default=None, help="threads for llama-quantize / llama-imatrix")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--no-eval", action="store_true",
                        help="skip the held-out perplexity of the stock and NBL files (llama-perplexity)")
    parser.add_argument("--eval-chunks", type=int, default=EVAL_CHUNKS,
                        help=f"held-out chunks of {EVAL_CTX} tokens for that perplexity (default: {EVAL_CHUNKS})")
    parser.add_argument("-o", "--output", default="model-nbl.gguf", help="output GGUF (default: model-nbl.gguf)")


# --- inputs ------------------------------------------------------------------------------------

def resolve_model_dir(model: str | None) -> Path:
    """A local HF folder for ``model``: the embedded default, a folder, or a hub snapshot (for the
    commands that take no GGUF file)."""
    from nbl_gguf.model_source import is_gguf_file, resolve_model

    if is_gguf_file(model):
        raise NblError(f"--model {model} is a file: this command takes a HF model folder or a hub id "
                       f"(calibrate, convert and eval --sweep take GGUF files)")
    return resolve_model(model).hf_folder()


def resolve_source(args, method: str):
    """--model as a ModelSource, with the options that only one kind of input takes checked first."""
    from nbl_gguf.gguf import nbl_format
    from nbl_gguf.model_source import is_gguf_file, resolve_model

    if not is_gguf_file(args.model):
        if args.nbl_type is not None:
            raise NblError("--nbl-type goes with a GGUF --model (a HF model's NBL weights take --quant's types)")
        check_quant(args.quant or DEFAULT_QUANT)  # before a hub download
        return resolve_model(args.model)
    if args.quant is not None:
        raise NblError(f"--quant {args.quant} means nothing for a GGUF --model: the NBL file keeps every tensor of "
                       f"{Path(args.model).name} as it is; --nbl-type chooses the type of the NBL weights")
    if args.imatrix:
        raise NblError("--imatrix means nothing for a GGUF --model: nothing is quantized again (the file's own "
                       "tensors, imatrix-quantized or not, are kept as they are)")
    if args.intermediate is not None:
        raise NblError(f"--intermediate {args.intermediate} means nothing for a GGUF --model: no stock conversion is "
                       f"made (the NBL file is {Path(args.model).name} itself with the replaced attention swapped)")
    source = resolve_model(args.model, runnable=nbl_format.SUPPORTED_ARCHITECTURES, calibrating=not args.calibration)
    if args.nbl_type is not None and method == "attn-nbl":
        nbl_format.parse_weight_type(args.nbl_type, source.gguf.n_embd)
    return source


def model_shape(model_dir: Path) -> tuple[int, int]:
    """(layers, hidden size) from config.json, after checking that the architecture is one we can
    calibrate and llama.cpp can run with NBL layers, so bad inputs fail before any heavy work."""
    from nbl_gguf.models import get_adapter

    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise NblError(f"{model_dir} is not a HF model folder: it has no config.json")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise NblError(f"{config_path} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise NblError(f"{config_path} is not a JSON object")
    get_adapter(config)
    config = config.get("text_config", config)
    try:
        return int(config["num_hidden_layers"]), int(config["hidden_size"])
    except KeyError as error:
        raise NblError(f"{config_path} has no {error.args[0]}") from error


def default_intermediate(model_dir: Path) -> str:
    """f16 or bf16 when every float tensor of the checkpoint is stored so, else f32."""
    from nbl_gguf.calibration.weights import safetensors_dtypes

    stored = {dtype for dtype in safetensors_dtypes(model_dir) if dtype.startswith(("F", "BF"))}
    return INTERMEDIATE_OF.get(stored.pop(), "f32") if len(stored) == 1 else "f32"


def check_method(method: str) -> str:
    if method == "block-nbl":
        raise NblError("--method block-nbl replaces whole decoder layers, which the NBL GGUF format does not "
                       "represent: block-level NBL is evaluated in PyTorch only (calibrate / eval); "
                       "use attn-nbl or attn-drop for a GGUF")
    if method not in METHODS:
        raise NblError(f"unknown --method '{method}' (use {', '.join(METHODS)})")
    return method


def check_quant(quant: str) -> str:
    """The llama-quantize spelling of ``quant`` (f32/f16/bf16 need no tool)."""
    if quant.upper() in FLOAT_OUTPUTS:
        return quant.upper()
    from nbl_gguf.gguf.quantize import normalize_quant

    return normalize_quant(quant)


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


def provenance(artifact, model_dir: Path, layers: list[int] | None = None, gguf=None) -> dict:
    """What the GGUF records about its calibration (no paths or timings: the bytes must be reproducible);
    ``gguf``: the GGUF file (model_source.GgufFile) the NBL file was made from, by name and sha256."""
    from nbl_gguf import __version__
    from nbl_gguf.calibration.dataset import FILE_SUFFIXES

    report = artifact.report
    data = dict(report.get("data", {}))
    model = report.get("model", {})
    dataset = data.get("dataset")
    if dataset and Path(dataset).suffix.lower() in FILE_SUFFIXES:
        dataset = Path(dataset).name  # a local file: where it lay is no part of it (text_sha256 is)
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
        "versions": {**report.get("versions", {}), "nbl_gguf": __version__, "gguf": _gguf_py_version(),
                     "llama.cpp": llama_cpp_commit(), "llama.cpp patches": llama_cpp_patches_sha256()},
        **_measured_selection(report.get("selection", {}), layers),
        **({"source_gguf": gguf.provenance()} if gguf is not None else {}),
    }


def _measured_selection(selection: dict, layers: list[int] | None) -> dict:
    """Why these layers, when they are the calibration's --m auto or greedy choice (held-out losses)."""
    if layers is None or "heldout" not in selection or sorted(selection.get("layers", [])) != sorted(layers):
        return {}
    keys = ("method", "criterion", "m", "max_ppl_increase", "heldout")
    return {"selection": {key: selection[key] for key in keys if key in selection}}


def calibrate_into(directory: Path, model, args) -> Path:
    """Run the calibrator (its Python entry point, same options as `calibrate`) into ``directory``;
    ``model`` is what calibrate's --model takes (a HF folder, or a GGUF file, which it streams from)."""
    from nbl_gguf.calibration import calibrate

    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    cargs = parser.parse_args([])
    cargs.model = str(model)
    for name in ("dtype", "memory_budget", "whole_model", "no_progress"):  # callers' namespaces may lack them
        if hasattr(args, name):
            setattr(cargs, name, getattr(args, name))
    cargs.dataset = args.dataset
    cargs.dataset_config = args.dataset_config
    cargs.split = args.split
    cargs.text_field = args.text_field
    if args.nsamples is not None:
        cargs.nsamples = args.nsamples
    if args.seqlen is not None:
        cargs.seqlen = args.seqlen
    cargs.batch_size = args.batch_size
    cargs.device = args.device
    cargs.m = args.m
    cargs.max_ppl_increase = args.max_ppl_increase
    cargs.selection_windows = args.selection_windows
    cargs.candidates = args.candidates
    cargs.method = args.method
    cargs.criterion = args.criterion
    cargs.seed = args.seed
    cargs.targets = "attn"  # a GGUF replaces attention only: the block fits would cost a third more time
    cargs.output = str(directory)
    calibrate.run(cargs)
    return directory


def chosen_layers(artifact, args, method: str, n_layer: int) -> list[int]:
    """The layers to replace: the calibration's own choice (made in this run, or --m auto), else the
    artifact's maps re-ranked for --m / --criterion."""
    from nbl_gguf.calibration.calibrate import default_m

    selection = artifact.report["selection"]
    if args.m == "auto":
        if "max_ppl_increase" not in selection or selection["criterion"] != args.criterion:
            raise NblError(f"--m auto is decided while calibrating; the calibration in {artifact.path} chose a fixed "
                           f"m by {selection['criterion']}: calibrate with --m auto --criterion {args.criterion}")
        if args.max_ppl_increase is not None and args.max_ppl_increase != selection["max_ppl_increase"]:
            raise NblError(f"the calibration in {artifact.path} chose m within +{selection['max_ppl_increase']:g}%, "
                           f"not +{args.max_ppl_increase:g}%: calibrate again with that budget")
        return sorted(artifact.select(None, args.criterion, method))
    m = default_m(n_layer) if args.m is None else args.m
    return sorted(artifact.select(m, args.criterion, method))


def recorded_scores(artifact, criterion: str) -> tuple[list[float] | None, str | None]:
    """(nbl.scores, the local criterion they are under): a local criterion's own; with best, those of the
    criterion it chose (best keeps that criterion's ranking); greedy has none (no per-layer score: its
    reasons are the held-out losses in the provenance)."""
    if criterion == "best":
        criterion = artifact.report["selection"].get("chosen")
    if criterion not in CRITERIA:
        return None, None
    return [float(s) for s in artifact.scores(criterion, "attn")], criterion


def heldout_perplexities(stock: Path, nbl: Path, tmp: Path, args) -> dict:
    """llama-perplexity of the stock and the NBL file on the first chunks of the bundled held-out text
    (documents never used for calibration)."""
    from nbl_gguf.calibration.dataset import write_heldout_text
    from nbl_gguf.llamacpp.perplexity import perplexity

    text = write_heldout_text(tmp / "heldout.txt")
    results = {name: perplexity(path, text, n_ctx=EVAL_CTX, chunks=args.eval_chunks, threads=args.threads)
               for name, path in (("stock", stock), ("nbl", nbl))}
    return {"tokens": results["nbl"].tokens, "chunks": results["nbl"].chunks, "ctx": EVAL_CTX,
            "stock": results["stock"].ppl, "nbl": results["nbl"].ppl}


def imatrix_context(artifact) -> int:
    seqlen = int(artifact.report.get("data", {}).get("seqlen") or 512)
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


def linear_map(artifact, layer: int, runtime: str):
    """(W, b) for a linear layer: the fit with bias for the NBL layout, the bias-free one (b = 0) for the
    stock layout, whose slot has no bias."""
    if runtime == "stock":
        import numpy as np

        weight = artifact.linear_without_bias(layer)
        return weight, np.zeros(weight.shape[0], dtype=np.float32)
    return artifact.linear(layer, "attn")


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


# --- summary -----------------------------------------------------------------------------------

@dataclass
class Summary:
    model: str
    quant: str
    method: str
    criterion: str
    n_layer: int
    replaced: list[int]
    scores: list[float] | None
    stock_bytes: int
    nbl_bytes: int
    kv: dict  # context -> (stock, NBL) kv_cache.KvSize, as llama-cli allocates the cache
    output: Path
    heldout: dict | None = None  # heldout_perplexities(), or None with --no-eval
    runtime: str = "nbl"
    extra: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # printed under the table
    resources: dict = field(default_factory=dict)  # usage.StageMeter.stages of the run

    def table(self) -> str:
        from nbl_gguf.gguf.inspect import human_bytes

        def change(before, after):
            return f"{(after - before) / before:+.1%}" if before else ""

        rows = [
            ("", f"stock {self.quant}", f"NBL {self.quant}", "change"),
            ("attention layers", str(self.n_layer), str(self.n_layer - len(self.replaced)), f"-{len(self.replaced)}"),
            ("file size", human_bytes(self.stock_bytes), human_bytes(self.nbl_bytes),
             change(self.stock_bytes, self.nbl_bytes)),
        ]
        for n_ctx, (stock, nbl) in self.kv.items():
            rows.append((f"KV cache at {n_ctx:,} tokens (F16)", human_bytes(stock.bytes), human_bytes(nbl.bytes),
                         change(stock.bytes, nbl.bytes)))
            if "sliding" in stock.caches:
                # llama.cpp keeps two caches: the window's cells for the sliding layers, every token for the others
                for name, what in (("global", "global layers"), ("sliding", "sliding-window layers")):
                    before, after = stock.caches[name], nbl.caches[name]
                    rows.append((f"  {what}: {after.cells:,} cells", human_bytes(before.bytes), human_bytes(after.bytes),
                                 change(before.bytes, after.bytes)))
        if self.heldout:
            rows.append((f"held-out perplexity ({self.heldout['tokens']:,} tokens)", f"{self.heldout['stock']:.3f}",
                         f"{self.heldout['nbl']:.3f}", change(self.heldout["stock"], self.heldout["nbl"])))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [f"{self.model}: {self.method} by {self.criterion}, {len(self.replaced)} of {self.n_layer} layers "
                 f"replaced: {', '.join(map(str, self.replaced)) or 'none'}"]
        if self.scores is not None:
            lines.append("  layer scores (" + self.criterion + "): "
                         + ", ".join(f"{i}={self.scores[i]:.4f}" for i in self.replaced))
        for index, row in enumerate(rows):
            lines.append("  " + "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                                          for i, (cell, w) in enumerate(zip(row, widths))))
            if index == 0:
                lines.append("  " + "  ".join("-" * w for w in widths))
        if self.heldout:
            lines.append(f"  held-out perplexity: llama-perplexity, {self.heldout['chunks']} chunks of "
                         f"{self.heldout['ctx']} tokens of the bundled C4 documents never used for calibration")
        lines += [f"  {note}" for note in self.notes]
        lines.append(f"  layout: {RUNTIMES[self.runtime]}")
        lines.append(f"  output: {self.output}")
        return "\n".join(lines)


# --- the pipeline ------------------------------------------------------------------------------

def convert(args) -> Summary:
    import gguf
    from tqdm import tqdm

    from nbl_gguf.gguf import nbl_format
    from nbl_gguf.calibration.artifact import load_artifact
    from nbl_gguf.gguf.hf_to_gguf import check_hf_folder, convert_hf_to_gguf
    from nbl_gguf.gguf.inspect import kv_sizes, training_context
    from nbl_gguf.gguf.quantize import compute_imatrix, quantize

    # cheap checks first: a typo must not cost a calibration
    method = check_method(args.method)
    output = Path(args.output)
    if output.suffix.lower() != ".gguf":
        raise NblError(f"-o {output}: the output name must end in .gguf")
    check_output_file(output, "-o")
    if args.save_calibration:
        check_output_dir(args.save_calibration, "--save-calibration", renamed_into_place=True)
    source = resolve_source(args, method)
    if source.gguf is not None:
        if output.resolve() == source.gguf.path.resolve():
            raise NblError(f"-o {output} is the --model file itself: the NBL file must go elsewhere")
        quant = source.gguf.file_type
        n_layer, hidden = source.gguf.n_layer, source.gguf.n_embd
    else:
        quant = check_quant(args.quant or DEFAULT_QUANT)
        check_hf_folder(source.hf_folder())
        n_layer, hidden = model_shape(source.hf_folder())
    if args.runtime == "stock":
        check_stock_runtime(source)
    m, _ = selection_budget(args.m, args.max_ppl_increase)
    if m is not None and not 0 <= m <= n_layer:
        raise NblError(f"--m {m} is out of range: {source.name} has {n_layer} layers")
    if args.calibration and not Path(args.calibration).is_dir():
        raise NblError(f"--calibration {args.calibration}: no such artifact directory")
    if args.eval_chunks < 1:
        raise NblError(f"--eval-chunks must be at least 1, got {args.eval_chunks}")

    steps = ["calibrate" if not args.calibration else "load calibration"]
    if source.gguf is not None:
        steps.append("NBL surgery")
    else:
        steps += ["stock conversion", "NBL rewrite"]
        if quant not in FLOAT_OUTPUTS:
            steps += (["imatrix"] if args.imatrix else []) + ["quantize stock", "quantize NBL"]
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
        with stage(steps[0]):
            if args.calibration:
                artifact = load_artifact(args.calibration)
            else:
                target = Path(args.save_calibration) if args.save_calibration else tmp / "calibration"
                model = source.gguf.path if source.gguf is not None else source.hf_folder()
                artifact = load_artifact(calibrate_into(target, model, args))
            if artifact.num_layers != n_layer:
                raise NblError(f"the calibration has {artifact.num_layers} layers but {source.name} has {n_layer}: "
                               f"it was made for another model")
            artifact_hidden = artifact.report.get("model", {}).get("hidden_size")
            if artifact_hidden is not None and int(artifact_hidden) != hidden:
                raise NblError(f"the calibration is for hidden size {artifact_hidden}, {source.name} has {hidden}")
            selected = chosen_layers(artifact, args, method, n_layer)
            scores, scores_criterion = recorded_scores(artifact, args.criterion)
            layer_type = nbl_format.LINEAR if method == "attn-nbl" else nbl_format.DROPPED
            types = [layer_type if i in selected else nbl_format.ATTENTION for i in range(n_layer)]
            linear = {i: linear_map(artifact, i, args.runtime) for i in selected if layer_type == nbl_format.LINEAR}
            layers = nbl_format.NblLayers(types=types, linear=linear, method=method, criterion=args.criterion,
                                          scores=scores, scores_criterion=scores_criterion,
                                          calibration=provenance(artifact, Path(source.name), selected, gguf=source.gguf))
        if not args.calibration:
            # the calibration's own stages, measured inside it (layers, selection, ...)
            meter.merge(artifact.report.get("resources", {}), prefix="calibrate: ")

        notes = []
        if source.gguf is not None:
            # 2. surgery on the user's own file: it is the stock file of the comparison
            with stage("NBL surgery"):
                weights = nbl_format.weight_types(source.gguf.path, layers, args.nbl_type)
                writer(args.runtime)(source.gguf.path, output, layers, weight_type=weights)
                stock_final = source.gguf.path
                notes = gguf_notes(source.gguf, weights, args.nbl_type, args.runtime)
        else:
            # 2. stock conversion
            model_dir = source.hf_folder()
            intermediate = quant.lower() if quant in FLOAT_OUTPUTS else args.intermediate or default_intermediate(model_dir)
            with stage(steps[1]):
                stock = convert_hf_to_gguf(model_dir, tmp / f"stock-{intermediate}.gguf", intermediate)

            # 3. NBL rewrite
            final_float = quant in FLOAT_OUTPUTS
            nbl_path = output if final_float else tmp / f"nbl-{intermediate}.gguf"
            with stage(steps[2]):
                writer(args.runtime)(stock, nbl_path, layers, weight_type=intermediate.upper())

            # 4. quantization of both (the stock one only for the size comparison)
            if final_float:
                stock_final = stock
            else:
                imatrix = None
                if args.imatrix:
                    with stage("imatrix"):
                        ctx = imatrix_context(artifact)
                        imatrix = compute_imatrix(nbl_path, calibration_texts(args, artifact, ctx),
                                                  tmp / "imatrix.gguf", ctx=ctx, chunks=args.imatrix_chunks,
                                                  threads=args.threads, seed=args.seed)
                with stage("quantize stock"):
                    stock_final = quantize(stock, tmp / f"stock-{quant}.gguf", quant, threads=args.threads)
                with stage("quantize NBL"):
                    quantize(nbl_path, output, quant, imatrix=imatrix, threads=args.threads)
        heldout = None
        if not args.no_eval:
            with stage("held-out perplexity"):
                heldout = heldout_perplexities(stock_final, output, tmp, args)
        progress.close()
        _default_permissions(output)

        stock_reader = gguf.GGUFReader(stock_final)
        # the KV cache at the summary's context and at the training context, llama-cli's default -c, if longer
        contexts = sorted({SUMMARY_CTX, max(SUMMARY_CTX, training_context(stock_reader) or 0)})
        kv = {n_ctx: kv_sizes(stock_reader, n_ctx, types) for n_ctx in contexts}
        return Summary(heldout=heldout, notes=notes,
            model=artifact.report.get("model", {}).get("name") or source.name, quant=quant, method=method,
            criterion=args.criterion, n_layer=n_layer, replaced=selected,
            scores=scores if scores_criterion == args.criterion else None,
            stock_bytes=stock_final.stat().st_size, nbl_bytes=output.stat().st_size,
            kv=kv, output=output, runtime=args.runtime, resources=meter.stages,
        )


def gguf_notes(source, weights: dict, requested: str | None, runtime: str = "nbl") -> list[str]:
    """What the summary says about a GGUF input: what was kept, and the NBL weights' types and why."""
    keys = "all its keys" if runtime == "nbl" else "all its keys (llama.* renamed deci.*)"
    notes = [f"stock: {source.path.name} itself; the NBL file keeps {keys} and every tensor but the "
             f"replaced attention, byte for byte"]
    by_type: dict[tuple, list[int]] = {}
    for layer, weight in weights.items():
        by_type.setdefault((weight.name, weight.instead_of, weight.reason), []).append(layer)
    for (name, instead_of, reason), layers in by_type.items():
        why = ("--nbl-type" if requested is not None else "their attn_output's type" if instead_of is None else
               f"their attn_output's {instead_of} cannot hold the {source.n_embd} x {source.n_embd} matrix: {reason}")
        notes.append(f"NBL weights: {name} in layers {', '.join(map(str, layers))} ({why})")
    return notes


def _default_permissions(path: Path) -> None:
    """Temp files are created 0600; the finished GGUF gets the usual 0666 & ~umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def resources_table(stages: dict) -> str:
    """Wall time and peak memory of each stage (the calibration's own stages indented under it)."""
    from nbl_gguf.gguf.inspect import human_bytes

    lines = ["  time and memory (peak resident set of this process; the llama.cpp tools apart):"]
    for name, record in stages.items():
        tools = record.get("tools_peak_rss_bytes") or {}
        extra = "".join(f", {tool} {human_bytes(peak)}" for tool, peak in tools.items())
        gpu = f", GPU {human_bytes(record['peak_gpu_bytes'])}" if "peak_gpu_bytes" in record else ""
        lines.append(f"    {name:<32} {record['wall_s']:>9.1f} s  {human_bytes(record['peak_rss_bytes']):>11}{gpu}{extra}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    summary = convert(args)
    print(summary.table())
    if summary.resources:
        print(resources_table(summary.resources))
    return 0
