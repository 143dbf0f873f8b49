"""`bench`: speed and KV cache of NBL GGUFs against the stock GGUF of the same model and quant.

The patched ``llama-bench`` (the same binary runs stock GGUFs unchanged) measures prompt processing
(pp) and token generation (tg) at several context depths, on every backend built and visible: the
CPU, and CUDA when the build has it and a GPU shows up. Stock and NBL runs are interleaved (one
llama-bench call per model and depth, in alternating order per round), so that a noisy machine
slows both alike, and each speed-up is the ratio of the two means measured in the same run. Beside
it stands the speed-up that the roofline model (nbl_gguf.roofline) predicts from the GGUF files,
and measured / predicted.

Inputs: explicit files (``--baseline stock.gguf --nbl a.gguf b.gguf``), the embedded model or a HF
folder (``--model embedded --m 8,12 --quant q4_k_m``; converted with ``convert``, reusing one
calibration), or a synthetic model of a real shape (``--shape llama-3.2-1b --m 6``).
Outputs under ``--output-dir``: results.json, measurements.csv, speedups.csv, kv_cache.csv,
speedup-<backend>.png (speed-up against context, like figure 3 of the paper) and report.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nbl_gguf.errors import NblError
from nbl_gguf.measurement.roofline import ModelCost, check_pair, kv_type_bytes, model_cost, predicted_speedup

DEFAULT_DEPTHS = (0, 2048, 8192, 32768)
QUICK = dict(model="embedded", m=[8, 12], depths=[0, 512], n_prompt=128, n_gen=32, rounds=2, repetitions=1,
             calib_nsamples=16, calib_seqlen=256)
DEFAULTS = dict(m=[12], depths=list(DEFAULT_DEPTHS), n_prompt=512, n_gen=128, rounds=2, repetitions=2,
                quant="q4_k_m")
TARGET_EFFICIENCY = 0.9


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in re.split(r"[,\s]+", text.strip()) if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got '{text}'")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("models (one of: explicit files, --model, --shape; default with --quick: embedded)")
    source.add_argument("--baseline", default=None, metavar="GGUF", help="the stock GGUF")
    source.add_argument("--nbl", nargs="+", default=None, metavar="GGUF", help="NBL GGUFs of the same model and quant")
    source.add_argument("--model", default=None,
                        help="'embedded' (SmolLM2-135M-Instruct) or a HF folder: stock and NBL GGUFs are made "
                             "with convert")
    source.add_argument("--shape", default=None,
                        help="synthetic random-weight model of a real shape: llama-3.1-8b, llama-3.2-1b, smollm2-135m")
    source.add_argument("--m", type=_int_list, default=None,
                        help="NBL layer counts for --model/--shape, comma-separated (default: 12; --quick: 8,12)")
    source.add_argument("--quant", default=None, help="quantization for --model/--shape (default: q4_k_m)")
    source.add_argument("--calibration", default=None, metavar="ARTIFACT",
                        help="calibration artifact to reuse for --model (default: made once and cached)")
    source.add_argument("--calib-nsamples", type=int, default=None,
                        help="--model without a calibration: windows for the one calibration made (default: "
                             "calibrate's; --quick: 16; speed does not depend on the calibration's quality)")
    source.add_argument("--calib-seqlen", type=int, default=None,
                        help="--model without a calibration: tokens per window (default: calibrate's; --quick: 256)")
    source.add_argument("--layers", default=None,
                        help="--shape only: explicit NBL layers per m, e.g. '6:9,10,11,12,13,14' (default: the m "
                             "layers before the last)")
    source.add_argument("--work-dir", default=None,
                        help="where generated GGUFs are kept and reused (default: ~/.cache/nbl-gguf/bench)")
    source.add_argument("--seed", type=int, default=0)

    bench = parser.add_argument_group("measurement")
    bench.add_argument("--quick", action="store_true",
                       help="a few minutes on a CPU: embedded model, m=8,12, -p 128 -n 32, depths 0,512, 2 rounds")
    bench.add_argument("-p", "--n-prompt", type=int, default=None, help="prompt tokens of a pp test (default: 512)")
    bench.add_argument("-n", "--n-gen", type=int, default=None, help="generated tokens of a tg test (default: 128)")
    bench.add_argument("-d", "--depths", type=_int_list, default=None,
                       help=f"context depths, comma-separated (default: {','.join(map(str, DEFAULT_DEPTHS))})")
    bench.add_argument("-r", "--repetitions", type=int, default=None,
                       help="llama-bench repetitions per call (default: 2)")
    bench.add_argument("--rounds", type=int, default=None,
                       help="interleaved rounds: each runs every model at every depth, order alternating (default: 2)")
    bench.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    bench.add_argument("--backends", default="auto",
                       help="cpu, cuda or both, comma-separated (default: auto = cpu, plus cuda if built and visible)")
    bench.add_argument("--cache-type", default="f16", help="K and V cache type (default: f16)")
    bench.add_argument("--bench-args", default="", help="extra llama-bench arguments, e.g. '-fa on -ub 256'")
    bench.add_argument("--hf-compare", action="store_true",
                       help="also time the HF transformers model with the same NBL layers (apply_nbl): prefill "
                            "and decode tokens/s against llama.cpp's pp and tg at depth 0")
    bench.add_argument("--hf-model", default=None,
                       help="HF folder for --hf-compare with explicit GGUFs (default: the --model / --shape model)")
    bench.add_argument("--hf-device", default="auto", help="torch device for --hf-compare (default: cuda if available)")
    bench.add_argument("--hf-dtype", default="auto", help="torch dtype for --hf-compare (default: bf16 on GPU, fp32 on CPU)")
    bench.add_argument("-o", "--output-dir", default="bench-results", help="results folder (default: bench-results)")
    bench.add_argument("--no-plot", action="store_true", help="skip the PNG plots")


# --- inputs ------------------------------------------------------------------------------------

@dataclass
class Candidate:
    label: str
    path: Path
    cost: ModelCost | None = None


@dataclass
class ModelSet:
    name: str
    quant: str
    stock: Candidate
    nbl: list[Candidate]
    hf: dict = field(default_factory=dict)  # how to build the HF model for --hf-compare
    commands: list[str] = field(default_factory=list)  # how the GGUFs were made

    def all(self) -> list[Candidate]:
        return [self.stock, *self.nbl]


def file_type_name(file_type: int | None) -> str:
    import gguf

    if file_type is None:
        return "?"
    try:
        return gguf.LlamaFileType(int(file_type)).name.replace("MOSTLY_", "").replace("ALL_", "")
    except ValueError:
        return str(file_type)


def apply_presets(args) -> None:
    explicit = args.baseline is not None or args.nbl is not None
    if args.quick:
        if not explicit and args.model is None and args.shape is None:
            args.model = QUICK["model"]
        for key in ("m", "depths", "n_prompt", "n_gen", "rounds", "repetitions", "calib_nsamples", "calib_seqlen"):
            if getattr(args, key) is None:
                setattr(args, key, QUICK[key])
    for key, value in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    sources = sum([explicit, args.model is not None, args.shape is not None])
    if sources == 0:
        raise NblError("nothing to measure: give --baseline and --nbl, --model, --shape, or --quick")
    if sources > 1:
        raise NblError("give only one of: explicit GGUFs (--baseline/--nbl), --model, --shape")
    if explicit and (args.baseline is None or not args.nbl):
        raise NblError("explicit GGUFs need both --baseline STOCK.gguf and --nbl NBL.gguf [...]")
    for name in ("n_prompt", "n_gen"):
        if getattr(args, name) < 0:
            raise NblError(f"--{name.replace('_', '-')} must not be negative")
    if args.n_prompt == 0 and args.n_gen == 0:
        raise NblError("-p 0 and -n 0 leave nothing to measure")
    if args.rounds < 1 or args.repetitions < 1:
        raise NblError("--rounds and --repetitions must be at least 1")
    kv_type_bytes(args.cache_type)


def work_dir(args) -> Path:
    if args.work_dir:
        return Path(args.work_dir)
    from nbl_gguf.models import cache_dir

    return cache_dir() / "bench"


def _parse_layers(text: str | None) -> dict[int, list[int]]:
    if not text:
        return {}
    result = {}
    for part in text.split(";"):
        m, _, layers = part.partition(":")
        try:
            result[int(m)] = [int(v) for v in layers.split(",") if v.strip()]
        except ValueError:
            raise NblError(f"--layers '{text}': expected 'm:i,j,k[;m:...]'") from None
        if len(result[int(m)]) != int(m):
            raise NblError(f"--layers: {len(result[int(m)])} layers given for m={m}")
    return result


def explicit_models(args) -> ModelSet:
    stock = Candidate("stock", Path(args.baseline))
    nbl = []
    labels = set()
    for path in args.nbl:
        path = Path(path)
        label = path.stem
        while label in labels:
            label += "'"
        labels.add(label)
        nbl.append(Candidate(label, path))
    hf = {"kind": "folder", "path": args.hf_model} if args.hf_model else {}
    return ModelSet(Path(args.baseline).stem, "", stock, nbl, hf=hf)


def shape_models(args, log) -> ModelSet:
    from nbl_gguf.fixtures import synthetic

    shape = synthetic.get_shape(args.shape)
    layers = _parse_layers(args.layers)
    directory = work_dir(args) / "synthetic"
    stock, nbl = synthetic.make_pair(shape, args.quant, args.m, directory, seed=args.seed, layers=layers,
                                     threads=args.threads, log=log)
    return ModelSet(
        f"synthetic {shape.name}", args.quant, Candidate("stock", stock),
        [Candidate(f"nbl-m{m}", nbl[m]) for m in args.m],
        hf={"kind": "shape", "shape": shape.name, "seed": args.seed},
        commands=[f"synthetic.make_pair({shape.name!r}, {args.quant!r}, m={args.m}, seed={args.seed}) "
                  f"(random Q8_0 weights by gguf-py -> llama-quantize --allow-requantize)"],
    )


def embedded_models(args, log) -> ModelSet:
    """Stock and NBL-m GGUFs of a HF model by `convert` (one calibration, made once or given)."""
    from nbl_gguf.gguf import convert
    from nbl_gguf.gguf.hf_to_gguf import check_hf_folder, convert_hf_to_gguf
    from nbl_gguf.gguf.quantize import quantize

    model_dir = convert.resolve_model_dir(args.model)
    check_hf_folder(model_dir)
    n_layer, _ = convert.model_shape(model_dir)
    quant = convert.check_quant(args.quant)
    for m in args.m:
        if not 0 < m < n_layer:
            raise NblError(f"--m {m} is out of range: {model_dir.name} has {n_layer} layers")
    directory = work_dir(args) / "models" / model_dir.name
    directory.mkdir(parents=True, exist_ok=True)
    commands = []

    stock = directory / f"stock-{quant.lower()}.gguf"
    if not stock.is_file():
        log(f"{model_dir.name}: stock conversion and llama-quantize {quant}")
        intermediate = directory / ".stock-f32.gguf"
        try:
            convert_hf_to_gguf(model_dir, intermediate, "f32")
            if quant in convert.FLOAT_OUTPUTS:
                convert_hf_to_gguf(model_dir, stock, quant.lower())
            else:
                quantize(intermediate, stock, quant, threads=args.threads)
        finally:
            intermediate.unlink(missing_ok=True)
    commands.append(f"convert_hf_to_gguf.py {model_dir} --outtype f32 && llama-quantize ... {quant}  -> {stock}")

    calibration = Path(args.calibration) if args.calibration else directory / "calibration"
    if args.calibration and not calibration.is_dir():
        raise NblError(f"--calibration {calibration}: no such artifact directory")
    tag = "" if not args.calibration else f"-cal{abs(_stable_hash(str(calibration.resolve()))) % 100000:05d}"
    nbl = []
    for m in args.m:
        path = directory / f"nbl-m{m}{tag}-{quant.lower()}.gguf"
        argv = ["--model", str(model_dir), "--m", str(m), "--quant", quant, "-o", str(path), "--no-progress",
                "--seed", str(args.seed)]
        if calibration.is_dir():
            argv += ["--calibration", str(calibration)]
        else:
            argv += ["--save-calibration", str(calibration), "--device", "auto"]
            if args.calib_nsamples:
                argv += ["--nsamples", str(args.calib_nsamples)]
            if args.calib_seqlen:
                argv += ["--seqlen", str(args.calib_seqlen)]
        if args.threads:
            argv += ["--threads", str(args.threads)]
        commands.append("python -m nbl_gguf convert " + " ".join(argv))
        if not path.is_file():
            log(f"{model_dir.name}: python -m nbl_gguf convert {' '.join(argv)}")
            parser = argparse.ArgumentParser()
            convert.add_arguments(parser)
            summary = convert.convert(parser.parse_args(argv))
            log(summary.table())
        nbl.append(Candidate(f"nbl-m{m}", path))
    return ModelSet(model_dir.name, quant, Candidate("stock", stock), nbl,
                    hf={"kind": "folder", "path": str(model_dir)}, commands=commands)


def _stable_hash(text: str) -> int:
    import zlib

    return zlib.crc32(text.encode("utf-8"))


def resolve_models(args, log=print) -> ModelSet:
    if args.baseline is not None or args.nbl is not None:
        models = explicit_models(args)
    elif args.shape is not None:
        models = shape_models(args, log)
    else:
        models = embedded_models(args, log)
    for candidate in models.all():
        candidate.cost = model_cost(candidate.path)  # missing / not a GGUF -> NblError
    for candidate in models.nbl:
        check_pair(models.stock.cost, candidate.cost)
    if not models.quant:
        models.quant = file_type_name(models.stock.cost.file_type).lower()
    return models


# --- backends ----------------------------------------------------------------------------------

def list_devices() -> list[str]:
    """Device names llama-bench sees (e.g. 'CUDA0'); empty for a CPU-only build."""
    from nbl_gguf.llamacpp.tools import tool

    completed = subprocess.run([str(tool("llama-bench")), "--list-devices"], capture_output=True, text=True)
    devices = []
    for line in (completed.stdout + completed.stderr).splitlines():
        match = re.match(r"^\s+([A-Za-z]+\d+):", line)
        if match:
            devices.append(match.group(1))
    return devices


def resolve_backends(spec: str) -> tuple[list[str], list[str]]:
    """(backends to run, devices seen). 'auto' adds cuda when llama-bench lists a CUDA device."""
    devices = list_devices()
    has_cuda = any(d.upper().startswith("CUDA") for d in devices)
    if spec == "auto":
        return (["cpu", "cuda"] if has_cuda else ["cpu"]), devices
    wanted = [s.strip().lower() for s in spec.split(",") if s.strip()]
    for backend in wanted:
        if backend not in ("cpu", "cuda"):
            raise NblError(f"--backends: unknown backend '{backend}' (cpu, cuda)")
        if backend == "cuda" and not has_cuda:
            from nbl_gguf.llamacpp.tools import bin_dir

            raise NblError(f"--backends cuda: llama-bench in {bin_dir()} lists no CUDA device (devices: "
                           f"{', '.join(devices) or 'none'}); build with GGML_CUDA=ON into NBL_GGUF_BUILD=build-cuda "
                           f"and run on a machine with a visible GPU")
    return wanted, devices


def backend_args(backend: str) -> list[str]:
    """CPU: no layers offloaded and no device at all (a CUDA build would otherwise still offload
    large prompt matmuls to the GPU); CUDA: everything offloaded."""
    if backend == "cpu":
        return ["-ngl", "0", "-dev", "none"]
    return ["-ngl", "99"]


# --- llama-bench -------------------------------------------------------------------------------

def parse_bench_json(stdout: str) -> list[dict]:
    """The test records of ``llama-bench -o json`` (one per pp/tg test)."""
    text = stdout.strip()
    start = text.find("[")
    if start < 0:
        raise NblError(f"llama-bench printed no JSON results: {text[-500:]!r}")
    try:
        records = json.loads(text[start:])
    except json.JSONDecodeError as error:
        raise NblError(f"could not parse llama-bench JSON output: {error}") from error
    out = []
    for record in records:
        samples = [float(v) for v in record.get("samples_ts") or [record["avg_ts"]]]
        out.append({
            "test": "pp" if int(record["n_prompt"]) > 0 else "tg",
            "n_prompt": int(record["n_prompt"]), "n_gen": int(record["n_gen"]), "depth": int(record.get("n_depth", 0)),
            "avg_ts": float(record["avg_ts"]), "stddev_ts": float(record.get("stddev_ts", 0.0)),
            "samples_ts": samples, "n_threads": int(record.get("n_threads", 0)),
            "n_gpu_layers": int(record.get("n_gpu_layers", 0)), "backends": record.get("backends", ""),
            "cpu_info": record.get("cpu_info", ""), "gpu_info": record.get("gpu_info", ""),
            "model_size": int(record.get("model_size", 0)), "model_n_params": int(record.get("model_n_params", 0)),
            "model_type": record.get("model_type", ""), "build_commit": record.get("build_commit", ""),
            "type_k": record.get("type_k", ""), "flash_attn": record.get("flash_attn"),
        })
    return out


def parse_kv_log(stderr: str) -> list[dict]:
    """The KV cache of every context llama-bench created (``-v`` log), in test order."""
    from nbl_gguf.llamacpp.library import kv_caches

    return [{"kv_mib": kv.mib, "kv_cells": kv.cells, "kv_layers": kv.layers} for kv in kv_caches(stderr)]


def run_llama_bench(model: Path, *, n_prompt: int, n_gen: int, depth: int, repetitions: int, threads: int,
                    backend: str, cache_type: str = "f16", extra: list[str] = ()) -> tuple[list[dict], list[str]]:
    """One llama-bench call (pp and tg of one model at one depth); records carry the measured KV cache."""
    from nbl_gguf.llamacpp.tools import run_tool

    args = ["-m", str(model), "-p", str(n_prompt), "-n", str(n_gen), "-d", str(depth), "-r", str(repetitions),
            "-t", str(threads), "-o", "json", "-v", *backend_args(backend)]
    if cache_type != "f16":
        args += ["-ctk", cache_type, "-ctv", cache_type]
    args += list(extra)
    completed = run_tool("llama-bench", args)
    records = parse_bench_json(completed.stdout)
    kv = parse_kv_log(completed.stderr)
    if len(kv) == len(records):
        for record, info in zip(records, kv):
            record.update(info)
    return records, ["llama-bench", *args]


def schedule(models: list[Candidate], depths: list[int], rounds: int) -> list[tuple[int, int, Candidate]]:
    """(round, depth, model) in run order: every depth of a round runs each model once; the model order
    alternates between rounds (stock first, then NBL first, ...) so that drift hits both alike."""
    order = []
    for round_index in range(rounds):
        ordered = models if round_index % 2 == 0 else list(reversed(models))
        for depth in depths:
            for candidate in ordered:
                order.append((round_index, depth, candidate))
    return order


# --- aggregation -------------------------------------------------------------------------------

@dataclass
class Cell:
    backend: str
    label: str
    test: str
    n_tokens: int
    depth: int
    mean_ts: float
    std_ts: float
    samples: list[float]


def aggregate(measurements: list[dict]) -> dict[tuple, Cell]:
    """(backend, label, test, depth) -> mean and spread over every sample of every round."""
    groups: dict[tuple, list[dict]] = {}
    for record in measurements:
        key = (record["backend"], record["label"], record["test"], record["depth"])
        groups.setdefault(key, []).append(record)
    cells = {}
    for key, records in groups.items():
        samples = [s for r in records for s in r["samples_ts"]]
        n_tokens = records[0]["n_prompt"] if key[2] == "pp" else records[0]["n_gen"]
        cells[key] = Cell(*key[:3], n_tokens, key[3], statistics.fmean(samples),
                          statistics.stdev(samples) if len(samples) > 1 else 0.0, samples)
    return cells


def round_ratios(measurements: list[dict], backend: str, label: str, test: str, depth: int) -> list[float]:
    """Per-round speed-ups (NBL mean / stock mean of the same round): the spread of the ratio."""
    by_round: dict[int, dict[str, list[float]]] = {}
    for record in measurements:
        if (record["backend"], record["test"], record["depth"]) == (backend, test, depth) and \
                record["label"] in ("stock", label):
            by_round.setdefault(record["round"], {}).setdefault(record["label"], []).extend(record["samples_ts"])
    return [statistics.fmean(r[label]) / statistics.fmean(r["stock"])
            for _, r in sorted(by_round.items()) if "stock" in r and label in r]


@dataclass
class Speedup:
    backend: str
    model: str
    test: str
    n_tokens: int
    depth: int
    stock_ts: float
    nbl_ts: float
    measured: float
    predicted: float
    efficiency: float  # measured / predicted
    ratio_min: float
    ratio_max: float

    @property
    def meets_target(self) -> bool:
        return self.efficiency >= TARGET_EFFICIENCY


def speedup_table(measurements: list[dict], costs: dict[str, ModelCost], cache_type: str = "f16") -> list[Speedup]:
    """Every (backend, NBL model, test, depth) cell: measured ratio of mean t/s, roofline, and their ratio."""
    cells = aggregate(measurements)
    order = {label: index for index, label in enumerate(costs)}
    rows = []
    for (backend, label, test, depth), cell in sorted(
            cells.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], len(order)), kv[0][1], kv[0][2] != "pp", kv[0][3])):
        if label == "stock":
            continue
        stock = cells.get((backend, "stock", test, depth))
        if stock is None:
            raise NblError(f"no stock measurement for {backend} {test} at depth {depth}")
        measured = cell.mean_ts / stock.mean_ts
        predicted = predicted_speedup(costs["stock"], costs[label], test, depth, cell.n_tokens, cache_type)
        per_round = round_ratios(measurements, backend, label, test, depth) or [measured]
        rows.append(Speedup(backend, label, test, cell.n_tokens, depth, stock.mean_ts, cell.mean_ts, measured,
                            predicted, measured / predicted, min(per_round), max(per_round)))
    return rows


def kv_table(measurements: list[dict], costs: dict[str, ModelCost], cache_type: str = "f16") -> list[dict]:
    """Measured KV cache (llama.cpp's log) per model and depth against the GGUF's bytes/token."""
    rows = {}
    for record in measurements:
        if "kv_mib" not in record or record["test"] != "tg":
            continue
        key = (record["backend"], record["label"], record["depth"])
        cost = costs[record["label"]]
        per_token = cost.kv_bytes_per_token(cache_type)
        rows[key] = {
            "backend": record["backend"], "model": record["label"], "depth": record["depth"],
            "cells": record["kv_cells"], "kv_layers": record["kv_layers"], "measured_mib": record["kv_mib"],
            "predicted_mib": per_token * record["kv_cells"] / 2**20,
            "bytes_per_token": per_token,
            "at_depth_mib": per_token * record["depth"] / 2**20,
        }
    out = list(rows.values())
    stock = {(r["backend"], r["depth"]): r for r in out if r["model"] == "stock"}
    for row in out:
        base = stock.get((row["backend"], row["depth"]))
        row["vs_stock"] = row["bytes_per_token"] / base["bytes_per_token"] if base and base["bytes_per_token"] else None
    order = {label: index for index, label in enumerate(costs)}
    return sorted(out, key=lambda r: (r["backend"], order.get(r["model"], len(order)), r["model"], r["depth"]))


# --- reporting ---------------------------------------------------------------------------------

def format_table(rows: list[Speedup]) -> str:
    header = ["backend", "model", "test", "depth", "stock t/s", "NBL t/s", "speed-up", "(rounds)", "roofline",
              "meas/roof"]
    lines = [header]
    for r in rows:
        spread = f"{r.ratio_min:.3f}-{r.ratio_max:.3f}" if r.ratio_max > r.ratio_min else ""
        lines.append([r.backend, r.model, f"{r.test}{r.n_tokens}", str(r.depth), f"{r.stock_ts:.2f}",
                      f"{r.nbl_ts:.2f}", f"{r.measured:.3f}", spread, f"{r.predicted:.3f}",
                      f"{r.efficiency:.1%}" + ("" if r.meets_target else " *")])
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    text = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    if any(not r.meets_target for r in rows):
        text.append(f"* below {TARGET_EFFICIENCY:.0%} of the roofline prediction")
    return "\n".join(text)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(out)


def speedup_markdown(rows: list[Speedup]) -> str:
    return markdown_table(
        ["backend", "model", "test", "depth", "stock t/s", "NBL t/s", "speed-up (round min-max)", "roofline",
         "measured / roofline"],
        [[r.backend, r.model, f"{r.test}{r.n_tokens}", str(r.depth), f"{r.stock_ts:.2f}", f"{r.nbl_ts:.2f}",
          f"**{r.measured:.3f}** ({r.ratio_min:.3f}-{r.ratio_max:.3f})", f"{r.predicted:.3f}",
          f"{r.efficiency:.1%}" + ("" if r.meets_target else " ⚠")] for r in rows])


def kv_markdown(rows: list[dict]) -> str:
    from nbl_gguf.gguf.inspect import human_bytes

    return markdown_table(
        ["backend", "model", "depth", "KV bytes/token", "vs stock", "KV at depth", "llama.cpp KV buffer (cells)",
         "predicted buffer"],
        [[r["backend"], r["model"], str(r["depth"]), f"{r['bytes_per_token']:,.0f}",
          "" if r["vs_stock"] is None else f"{r['vs_stock']:.3f}", human_bytes(r["at_depth_mib"] * 2**20),
          f"{r['measured_mib']:.2f} MiB ({r['cells']})", f"{r['predicted_mib']:.2f} MiB"] for r in rows])


def plot_speedups(rows: list[Speedup], path_stem: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for backend in sorted({r.backend for r in rows}):
        mine = [r for r in rows if r.backend == backend]
        depths = sorted({r.depth for r in mine})
        x = {d: i for i, d in enumerate(depths)}
        tests = [t for t in ("pp", "tg") if any(r.test == t for r in mine)]
        fig, axes = plt.subplots(1, len(tests), figsize=(5.2 * len(tests), 4), squeeze=False)
        for ax, test in zip(axes[0], tests):
            for index, model in enumerate(sorted({r.model for r in mine})):
                cells = sorted((r for r in mine if r.model == model and r.test == test), key=lambda r: r.depth)
                color = f"C{index}"
                xs = [x[r.depth] for r in cells]
                ax.errorbar(xs, [r.measured for r in cells],
                            yerr=[[r.measured - r.ratio_min for r in cells], [r.ratio_max - r.measured for r in cells]],
                            fmt="o-", color=color, capsize=3, label=f"{model} measured")
                ax.plot(xs, [r.predicted for r in cells], "--", color=color, alpha=0.7, label=f"{model} roofline")
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xticks(range(len(depths)), [str(d) for d in depths])
            ax.set_xlabel("context depth (tokens)")
            n = next(r.n_tokens for r in mine if r.test == test)
            ax.set_ylabel(f"speed-up vs stock ({'prompt processing' if test == 'pp' else 'token generation'})")
            ax.set_title(f"{test}{n}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"{title} — {backend.upper()}", fontsize=10)
        fig.tight_layout()
        path = path_stem.parent / f"{path_stem.name}-{backend}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def machine_description() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count()}
    if shutil.which("lscpu"):
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        keep = ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "L2 cache",
                "L3 cache", "Hypervisor vendor")
        info["lscpu"] = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())
                         if k.strip() in keep}
        flags = next((line for line in text.splitlines() if line.startswith("Flags")), "")
        info["simd"] = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")
                        if f" {f}" in flags]
    try:
        with open("/proc/meminfo", encoding="utf-8") as handle:
            info["mem_total"] = handle.readline().split(":", 1)[1].strip()
    except OSError:
        pass
    if shutil.which("nvidia-smi"):
        completed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        info["gpus"] = completed.stdout.strip().splitlines() if completed.returncode == 0 else []
    return info


def write_outputs(out: Path, result: dict, rows: list[Speedup], kv_rows: list[dict], measurements: list[dict],
                  plot: bool, title: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    written.append(out / "results.json")
    with open(out / "measurements.csv", "w", newline="", encoding="utf-8") as handle:
        fields = ["backend", "model", "label", "round", "test", "n_prompt", "n_gen", "depth", "avg_ts", "stddev_ts",
                  "samples_ts", "kv_mib", "kv_cells", "n_threads", "n_gpu_layers", "backends"]
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for record in measurements:
            writer.writerow({**record, "samples_ts": " ".join(f"{s:.3f}" for s in record["samples_ts"])})
    written.append(out / "measurements.csv")
    with open(out / "speedups.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(asdict(rows[0]).keys()) if rows else ["backend"])
        writer.writeheader()
        for row in rows:
            writer.writerow(asdict(row))
    written.append(out / "speedups.csv")
    if kv_rows:
        with open(out / "kv_cache.csv", "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(kv_rows[0].keys()))
            writer.writeheader()
            writer.writerows(kv_rows)
        written.append(out / "kv_cache.csv")
    if plot and rows:
        written += plot_speedups(rows, out / "speedup", title)
    (out / "report.md").write_text(report_markdown(result, rows, kv_rows), encoding="utf-8")
    written.append(out / "report.md")
    return written


def report_markdown(result: dict, rows: list[Speedup], kv_rows: list[dict]) -> str:
    lines = [f"# {result['title']}", "", f"Command: `{result['command']}`", ""]
    lines.append("Models:")
    for model in result["models"]:
        lines.append(f"- {model['label']}: `{model['path']}` ({model['file_type']}, {model['bytes'] / 2**20:.1f} MiB, "
                     f"{model['attention_layers']}/{model['n_layer']} attention layers)")
    lines += ["", "## Speed-up, NBL vs stock (measured in the same run) against the roofline", "", speedup_markdown(rows)]
    if kv_rows:
        lines += ["", "## KV cache", "", kv_markdown(kv_rows)]
    if result.get("hf_compare"):
        lines += ["", "## HF transformers (apply_nbl) vs llama.cpp", "", hf_markdown(result["hf_compare"])]
    lines += ["", "## Machine", "", "```", json.dumps(result["machine"], indent=2), "```", ""]
    return "\n".join(lines)


def hf_markdown(hf: dict) -> str:
    rows = []
    nan = float("nan")
    for entry in hf["rows"]:
        rows.append([entry["model"], entry["engine"], entry["device"],
                     f"{entry.get('prefill_tps', nan):.1f}", f"{entry.get('prefill_speedup', nan):.3f}",
                     f"{entry.get('decode_tps', nan):.1f}", f"{entry.get('decode_speedup', nan):.3f}"])
    text = markdown_table(["model", "engine", "device", f"prefill t/s ({hf['n_prompt']} tokens)", "vs stock",
                           f"decode t/s ({hf['n_gen']} tokens)", "vs stock"], rows)
    return text + "\n\n" + hf.get("note", "")


# --- the command -------------------------------------------------------------------------------

def measure(models: ModelSet, backends: list[str], args, log) -> tuple[list[dict], list[list[str]]]:
    extra = args.bench_args.split() if args.bench_args else []
    measurements, commands = [], []
    threads = args.threads or os.cpu_count() or 1
    for backend in backends:
        plan = schedule(models.all(), args.depths, args.rounds)
        started = time.monotonic()
        for step, (round_index, depth, candidate) in enumerate(plan, 1):
            t0 = time.monotonic()
            records, command = run_llama_bench(
                candidate.path, n_prompt=args.n_prompt, n_gen=args.n_gen, depth=depth, repetitions=args.repetitions,
                threads=threads, backend=backend, cache_type=args.cache_type, extra=extra)
            if step <= len(models.all()):
                commands.append(command)
            summary = ", ".join(f"{r['test']} {r['avg_ts']:.2f} t/s" for r in records)
            log(f"[{backend} {step}/{len(plan)} round {round_index + 1} depth {depth}] {candidate.label}: {summary} "
                f"({time.monotonic() - t0:.0f} s, {time.monotonic() - started:.0f} s total)")
            for record in records:
                record.update(backend=backend, label=candidate.label, model=str(candidate.path), round=round_index)
                measurements.append(record)
    return measurements, commands


def run(args: argparse.Namespace) -> int:
    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    apply_presets(args)
    if args.threads is not None and args.threads < 1:
        raise NblError("--threads must be at least 1")
    out = Path(args.output_dir)
    backends, devices = resolve_backends(args.backends)
    models = resolve_models(args, log)
    costs = {c.label: c.cost for c in models.all()}
    log(f"benchmarking {models.name} {models.quant} on {', '.join(backends)}: "
        + ", ".join(c.label for c in models.all()) + f"; depths {args.depths}, -p {args.n_prompt} -n {args.n_gen}, "
        f"{args.rounds} rounds x {args.repetitions} repetitions")
    started = time.monotonic()
    measurements, commands = measure(models, backends, args, log)
    rows = speedup_table(measurements, costs, args.cache_type)
    kv_rows = kv_table(measurements, costs, args.cache_type)

    hf = None
    if args.hf_compare:
        from nbl_gguf.measurement import hf_compare

        hf = hf_compare.compare(models, measurements, args, log)

    title = f"NBL vs stock llama.cpp: {models.name} {models.quant}"
    result = {
        "title": title,
        "command": "python -m nbl_gguf bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
        "settings": {k: getattr(args, k) for k in ("n_prompt", "n_gen", "depths", "rounds", "repetitions", "threads",
                                                   "cache_type", "bench_args", "quick")},
        "backends": backends, "devices": devices,
        "build": str(__import__("nbl_gguf.llamacpp.tools", fromlist=["bin_dir"]).bin_dir()),
        "models": [{"label": c.label, "path": str(c.path), "file_type": file_type_name(c.cost.file_type),
                    "bytes": c.path.stat().st_size, "n_layer": c.cost.n_layer,
                    "attention_layers": c.cost.attention_layers,
                    "replaced_layers": [i for i, t in enumerate(c.cost.layer_types) if t != 0],
                    "weight_bytes_per_token": c.cost.weight_bytes_per_token(),
                    "kv_bytes_per_token": c.cost.kv_bytes_per_token(args.cache_type),
                    "block_matmul_params": c.cost.block_matmul_params, "output_params": c.cost.output_params}
                   for c in models.all()],
        "made_by": models.commands,
        "llama_bench_commands": [" ".join(c) for c in commands],
        "speedups": [asdict(r) | {"meets_target": r.meets_target} for r in rows],
        "kv_cache": kv_rows,
        "hf_compare": hf,
        "measurements": measurements,
        "machine": machine_description() | {"llama_bench_cpu": measurements[0]["cpu_info"] if measurements else "",
                                            "llama_bench_gpu": measurements[0]["gpu_info"] if measurements else ""},
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    written = write_outputs(out, result, rows, kv_rows, measurements, not args.no_plot, title)
    print(title)
    print(format_table(rows))
    if kv_rows:
        print()
        print("KV cache bytes/token: " + ", ".join(
            f"{r['model']} {r['bytes_per_token']:,.0f}" + ("" if r["vs_stock"] is None else f" ({r['vs_stock']:.1%})")
            for r in kv_rows if r["depth"] == kv_rows[0]["depth"] and r["backend"] == kv_rows[0]["backend"]))
    if hf:
        print()
        print(hf_markdown(hf))
    print()
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
