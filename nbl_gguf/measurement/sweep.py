"""`eval --sweep`: baseline vs Attn NBL-m vs Attn DROP-m (GGUF, through llama.cpp, and PyTorch float32)
vs Block NBL-m (PyTorch only: the GGUF format has no block-level type), for a list of m.

One calibration artifact serves every configuration. The stock model is converted to an F32 GGUF
once; each configuration is the NBL rewrite of it (nbl_format.write_nbl_gguf, as `convert` does),
quantized with llama-quantize. Results are cached in the work dir under a key of everything that
determines them, so an interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import copy
import csv
import hashlib
import json
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nbl_gguf.errors import NblError

METHOD_LABELS = {"baseline": "Baseline", "attn-nbl": "Attn NBL", "attn-drop": "Attn DROP", "block-nbl": "Block NBL"}
NOTES_BEGIN, NOTES_END = "<!-- notes -->", "<!-- /notes -->"


@dataclass
class Config:
    method: str  # baseline | attn-nbl | attn-drop | block-nbl
    m: int
    criterion: str
    layers: list[int] = field(default_factory=list)
    variant: str = ""  # set when the selection differs from the sweep's main criterion

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
        return f"{METHOD_LABELS[self.method]}-{self.m}" + (f" ({self.variant})" if self.variant else "")

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

def get_calibration(args, model_dir: Path, work: Path):
    from nbl_gguf.calibration.artifact import load_artifact
    from nbl_gguf.gguf.convert import calibrate_into

    if args.calibration:
        if not Path(args.calibration).is_dir():
            raise NblError(f"--calibration {args.calibration}: no such artifact directory")
        return load_artifact(args.calibration)
    target = work / f"calibration-{args.nsamples}x{args.seqlen}"
    if target.is_dir():
        artifact = load_artifact(target)
        data = artifact.report.get("data", {})
        if (data.get("nsamples_requested") == args.nsamples and data.get("seqlen") == args.seqlen
                and Path(artifact.report["model"].get("path", "")).resolve() == model_dir.resolve()):
            _log(f"reusing calibration {target}")
            return artifact
    _log(f"calibrating {model_dir.name}: {args.nsamples} x {args.seqlen} tokens -> {target}")
    ns = argparse_namespace(dataset=None, dataset_config=None, split="train", text_field="text",
                            nsamples=args.nsamples, seqlen=args.seqlen, batch_size=1, device="auto", m=None,
                            method="attn-nbl", criterion="cca", seed=0)
    return load_artifact(calibrate_into(target, model_dir, ns))


def argparse_namespace(**kwargs):
    import argparse

    return argparse.Namespace(**kwargs)


def build_configs(artifact, args, n_layer: int) -> tuple[list[Config], list[Config]]:
    """(main sweep, criteria comparison) configurations with their selected layers."""
    main = [Config("baseline", 0, args.criterion)]
    extra = [c for c in args.extra_criteria if c != args.criterion]
    for m in args.m:
        for method in args.methods:
            main.append(Config(method, m, args.criterion, artifact.select(m, args.criterion, method)))
            if method in ("attn-nbl", "attn-drop"):
                for criterion in extra:
                    main.append(Config(method, m, criterion, artifact.select(m, criterion, method),
                                       variant=f"{criterion} layers"))
    criteria = []
    if args.criteria_m:
        for method in ("attn-nbl", "attn-drop"):
            for criterion in ("cca", "nmse", "cosine"):
                criteria.append(Config(method, args.criteria_m, criterion,
                                       artifact.select(args.criteria_m, criterion, method)))
    return main, criteria


# --- GGUFs ----------------------------------------------------------------------------------------

class GgufFactory:
    """Stock F32 conversion once; per configuration the NBL rewrite and llama-quantize."""

    def __init__(self, model_dir: Path, artifact, directory: Path, threads: int | None):
        self.model_dir = model_dir
        self.artifact = artifact
        self.directory = directory
        self.threads = threads
        directory.mkdir(parents=True, exist_ok=True)
        self._stock = None

    @property
    def stock(self) -> Path:
        from nbl_gguf.gguf.hf_to_gguf import convert_hf_to_gguf

        if self._stock is None:
            path = self.directory / "stock-f32.gguf"
            if not path.is_file():
                _log("stock F32 conversion")
                convert_hf_to_gguf(self.model_dir, path, "f32")
            self._stock = path
        return self._stock

    def path(self, config: Config, quant: str) -> Path:
        from nbl_gguf.gguf import nbl_format
        from nbl_gguf.gguf.convert import provenance
        from nbl_gguf.gguf.quantize import quantize

        target = self.directory / f"{config.key}-{quant.lower()}.gguf"
        if target.is_file():
            return target
        if config.method == "baseline":
            source = self.stock
        else:
            source = self.directory / f"{config.key}-f32.gguf"
            if not source.is_file():
                _log(f"NBL rewrite {config.key}")
                n_layer = self.artifact.num_layers
                code = nbl_format.LINEAR if config.method == "attn-nbl" else nbl_format.DROPPED
                types = [code if i in config.layers else nbl_format.ATTENTION for i in range(n_layer)]
                linear = {i: self.artifact.linear(i, "attn") for i in config.layers if code == nbl_format.LINEAR}
                layers = nbl_format.NblLayers(types=types, linear=linear, method=config.method,
                                            criterion=config.criterion,
                                            scores=[float(s) for s in self.artifact.scores(config.criterion, "attn")],
                                            calibration=provenance(self.artifact, self.model_dir))
                nbl_format.write_nbl_gguf(self.stock, source, layers, weight_type="F32")
        if quant.upper() == "F32":
            return source
        _log(f"llama-quantize {config.key} -> {quant}")
        return quantize(source, target, quant, threads=self.threads)

    def drop_intermediates(self, config: Config) -> None:
        if config.method != "baseline":
            (self.directory / f"{config.key}-f32.gguf").unlink(missing_ok=True)


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


# --- the sweep -----------------------------------------------------------------------------------

def run_sweep(args) -> int:
    import gguf as gguf_py

    from nbl_gguf.measurement import eval as ev
    from nbl_gguf.gguf.convert import check_quant, model_shape, resolve_model_dir
    from nbl_gguf.gguf.hf_to_gguf import check_hf_folder
    from nbl_gguf.gguf.inspect import kv_bytes_per_token

    started = time.time()
    quants = [check_quant(q) for q in args.quant]
    if not quants:
        raise NblError("--quant: give at least one type")
    model_dir = resolve_model_dir(args.model)
    check_hf_folder(model_dir)
    n_layer, _ = model_shape(model_dir)
    for m in list(args.m) + ([args.criteria_m] if args.criteria_m else []):
        if not 0 < m <= n_layer:
            raise NblError(f"--m {m} is out of range: {model_dir.name} has {n_layer} layers")
    task_files = ev._task_files(args)
    # absolute: the pinned converter runs in its own directory (hf_to_gguf passes paths through)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out).resolve() if args.out else work
    out.mkdir(parents=True, exist_ok=True)

    if args.no_ppl:
        text_file = None
    elif args.text:
        text_file = Path(args.text)
        ev.check_text(text_file, args.ctx_size)
    else:
        text_file = ev.write_heldout_text(work / "heldout.txt")

    artifact = get_calibration(args, model_dir, work)
    if artifact.num_layers != n_layer:
        raise NblError(f"the calibration has {artifact.num_layers} layers but {model_dir.name} has {n_layer}")
    calib_tag = _file_sha(artifact.path / "report.json")
    factory = GgufFactory(model_dir, artifact, work / f"gguf-{calib_tag}", args.threads)
    cache = Cache(work / "results.json", args.fresh)
    main, criteria = build_configs(artifact, args, n_layer)
    text_tag = _file_sha(text_file) if text_file else "none"
    task_tag = _sha(json.dumps({t: [_file_sha(p), n] for t, (p, n) in task_files.items()}).encode())
    eval_tag = f"{text_tag}-c{args.ctx_size}-k{args.chunks}-{task_tag}"

    stock_reader = gguf_py.GGUFReader(factory.stock)

    def kv(config: Config) -> tuple[int, int]:
        return kv_bytes_per_token(stock_reader, [0 if i not in config.layers else 1 for i in range(n_layer)])

    # 1. GGUF evaluations through llama-perplexity (and llama-bench), one configuration at a time so
    #    that its F32 intermediate can go once all its types are quantized
    jobs: dict[str, tuple[Config, list[str]]] = {}
    for config in main:
        if config.gguf:
            jobs[config.key] = (config, (["F32"] if config.method == "baseline" else []) + quants)
    for config in criteria:
        jobs.setdefault(config.key, (config, [quants[0]]))
    results: dict[tuple[str, str], dict] = {}
    total = sum(len(qs) for _, qs in jobs.values())
    done = 0
    for config, config_quants in jobs.values():
        for quant in config_quants:
            done += 1
            key = f"gguf|{calib_tag}|{config.key}|{quant}|{eval_tag}"
            cached = cache.get(key)
            if cached is None:
                path = factory.path(config, quant)
                _log(f"[{done}/{total}] llama-perplexity {config.label} ({config.criterion}) {quant}")
                t0 = time.time()
                cached = ev.evaluate(path, text_file=text_file, n_ctx=args.ctx_size, chunks=args.chunks,
                                     batch=args.batch_size, threads=args.threads, task_files=task_files)
                cached["seconds"] = round(time.time() - t0, 1)
                cached["file_bytes"] = path.stat().st_size
                cache.put(key, cached)
            results[(config.key, quant)] = dict(cached)
        factory.drop_intermediates(config)

    # speed: each GGUF in one llama-bench process with its baseline, back to back, so that the ratio
    # sees the same machine load (timings on a shared CPU drift by tens of percent over minutes)
    if not args.no_bench:
        baseline = main[0]
        pairs = [(c, q) for c, qs in jobs.values() if c.method != "baseline" for q in qs]
        base_runs: dict[str, list] = {}
        for index, (config, quant) in enumerate(pairs, 1):
            key = f"bench-pair|{calib_tag}|{config.key}|{quant}|{args.bench_args}|{args.threads}"
            pair = cache.get(key)
            if pair is None:
                _log(f"[{index}/{len(pairs)}] llama-bench {config.label} ({config.criterion}) {quant} with its baseline")
                pair = cache.put(key, bench_pair(factory.path(baseline, quant), factory.path(config, quant),
                                                 args.bench_args, args.threads))
            results[(config.key, quant)]["bench"] = pair["model"]
            results[(config.key, quant)]["bench_baseline"] = pair["baseline"]
            base_runs.setdefault(quant, []).append(pair["baseline"])
        for quant, runs in base_runs.items():
            results[(baseline.key, quant)]["bench"] = {
                kind: (sum(r[kind][0] for r in runs) / len(runs), sum(r[kind][1] for r in runs) / len(runs))
                for kind in ("pp", "tg") if all(kind in r for r in runs)}

    # 2. the same configurations in PyTorch float32
    torch_results: dict[str, dict] = {}
    if not args.no_pytorch and text_file is not None:
        loaded = None
        tokens = bos = None
        configs = main + [c for c in criteria if c.key not in {x.key for x in main}]
        for index, config in enumerate(configs, 1):
            key = f"torch|{calib_tag}|{config.key}|{eval_tag}"
            cached = cache.get(key)
            if cached is None:
                if loaded is None:
                    import torch

                    from nbl_gguf.models import load_model

                    torch.manual_seed(0)
                    if args.threads:
                        torch.set_num_threads(args.threads)
                    loaded = load_model(str(model_dir), "fp32", "cpu")
                    tokens, bos = ev.llama_tokens(factory.stock, ev.prompt_text(text_file))
                from nbl_gguf.calibration.apply import apply_nbl

                _log(f"[{index}/{len(configs)}] pytorch perplexity {config.label}")
                t0 = time.time()
                model = loaded.model if config.method == "baseline" else copy.deepcopy(loaded.model)
                if config.method != "baseline":
                    apply_nbl(model, config.apply_types(n_layer), artifact)
                ppl = ev.torch_perplexity(model, tokens, args.ctx_size, chunks=args.chunks, bos=bos, progress=True)
                cached = cache.put(key, {**asdict(ppl), "tokens": ppl.tokens, "seconds": round(time.time() - t0, 1)})
                del model
            torch_results[config.key] = cached

    # 3. report
    rows = collect_rows(main, criteria, quants, results, torch_results, kv, task_files)
    setup = {
        "command": "python -m nbl_gguf eval " + " ".join(shlex.quote(a) for a in sys.argv[2:])
        if len(sys.argv) > 1 and sys.argv[1] == "eval" else None,
        "model": model_dir.name, "n_layer": n_layer, "artifact": artifact.report,
        "text": str(args.text) if args.text else "held-out C4 (bundled sample, last 44 documents)",
        "ctx": args.ctx_size, "quants": quants, "criteria_m": args.criteria_m, "criterion": args.criterion,
        "bench_args": None if args.no_bench else args.bench_args, "threads": args.threads,
        "machine": f"{platform.machine()}, {_cpu_count()} CPU threads",
        "elapsed_min": round((time.time() - started) / 60, 1),
        "eval_min": round(sum(r.get("seconds", 0) for r in results.values()) / 60, 1),
        "torch_min": round(sum(r.get("seconds", 0) for r in torch_results.values()) / 60, 1),
        "tasks": {t: (str(p), n) for t, (p, n) in task_files.items()},
    }
    ppl_any = next((r for r in results.values() if "perplexity" in r), None)
    if ppl_any:
        setup["chunks"] = ppl_any["perplexity"]["chunks"]
        setup["tokens"] = ppl_any["perplexity"]["tokens"]
    write_csv(out / "quality.csv", rows)
    write_markdown(out / "quality.md", rows, setup, main, criteria, quants, task_files)
    plot(out / "quality.png", rows, quants, task_files, setup)
    print((out / "quality.md").read_text(encoding="utf-8"))
    _log(f"wrote {out / 'quality.md'}, quality.csv, quality.png in {setup['elapsed_min']} min")
    return 0


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# --- tables and plot ----------------------------------------------------------------------------------

def collect_rows(main, criteria, quants, results, torch_results, kv, task_files) -> list[dict]:
    rows = []
    base_bench = {q: results.get(("baseline", q), {}).get("bench") for q in quants}
    seen = set()
    for group, configs in (("sweep", main), ("criteria", criteria)):
        for config in configs:
            stock_kv, kv_now = kv(config)
            common = {"group": group, "config": config.label, "method": config.method, "series": config.series,
                      "criterion": config.criterion,
                      "m": config.m, "layers": " ".join(map(str, config.layers)), "kv_bytes_per_token": kv_now,
                      "kv_saving": 1 - kv_now / stock_kv if stock_kv else 0.0}
            torch_result = torch_results.get(config.key)
            if torch_result and (group, config.key, "pytorch") not in seen:
                seen.add((group, config.key, "pytorch"))
                rows.append({**common, "backend": "pytorch", "quant": "f32", "ppl": torch_result["ppl"],
                             "ppl_err": torch_result["error"], "tokens": torch_result["tokens"]})
            for quant in (["F32"] if config.method == "baseline" else []) + (quants if config.gguf else []):
                result = results.get((config.key, quant))
                if result is None or (group, config.key, quant) in seen:
                    continue
                seen.add((group, config.key, quant))
                row = {**common, "backend": "llama.cpp", "quant": quant.lower()}
                if "perplexity" in result:
                    row.update(ppl=result["perplexity"]["ppl"], ppl_err=result["perplexity"]["error"],
                               tokens=result["perplexity"]["tokens"])
                row["file_bytes"] = result.get("file_bytes")
                for task in task_files:
                    if task in result:
                        row[f"{task}_acc"] = result[task]["accuracy"]
                        row[f"{task}_lo"], row[f"{task}_hi"] = result[task]["ci95"]
                        row[f"{task}_n"] = result[task]["tasks"]
                speed = result.get("bench")
                base = result.get("bench_baseline") or base_bench.get(quant)
                for kind in ("pp", "tg"):
                    if speed and kind in speed:
                        avg, std = speed[kind]
                        row[f"{kind}_ts"], row[f"{kind}_ts_std"] = avg, std
                        if base and kind in base:
                            b_avg, b_std = base[kind]
                            ratio = avg / b_avg
                            row[f"speedup_{kind}"] = ratio
                            row[f"speedup_{kind}_err"] = ratio * ((std / avg) ** 2 + (b_std / b_avg) ** 2) ** 0.5
                rows.append(row)
    return rows


CSV_FIELDS = ["group", "config", "method", "series", "criterion", "m", "layers", "backend", "quant", "kv_bytes_per_token",
              "kv_saving", "ppl", "ppl_err", "tokens", "file_bytes", "pp_ts", "pp_ts_std", "tg_ts", "tg_ts_std",
              "speedup_pp", "speedup_pp_err", "speedup_tg", "speedup_tg_err"]


def write_csv(path: Path, rows: list[dict]) -> None:
    fields = CSV_FIELDS + sorted({k for r in rows for k in r} - set(CSV_FIELDS))
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})


def _find(rows, group, config, backend, quant):
    for row in rows:
        if row["group"] == group and row["config"] == config and row["backend"] == backend and row["quant"] == quant:
            return row
    return None


def _ppl(row) -> str:
    return f"{row['ppl']:.3f} ± {row['ppl_err']:.3f}" if row and row.get("ppl") is not None else "—"


def _speed(row, kind="tg") -> str:
    if not row or row.get(f"speedup_{kind}") is None:
        return "—"
    return f"{row[f'speedup_{kind}']:.2f} ± {row[f'speedup_{kind}_err']:.2f}"


def write_markdown(path: Path, rows, setup, main, criteria, quants, task_files) -> None:
    notes = ""
    if path.is_file():
        old = path.read_text(encoding="utf-8")
        if NOTES_BEGIN in old and NOTES_END in old:
            notes = old[old.index(NOTES_BEGIN):old.index(NOTES_END) + len(NOTES_END)]
    report = setup["artifact"]
    data = report.get("data", {})
    q = [x.lower() for x in quants]
    lines = [f"# Quality: NBL vs attention drop vs baseline ({setup['model']})", ""]
    if setup.get("command"):
        lines += ["Produced by", "", "```", setup["command"], "```", ""]
    lines += [
        f"* model: {setup['model']} ({setup['n_layer']} layers); calibration: {data.get('nsamples')} x "
        f"{data.get('seqlen')} = {data.get('tokens')} tokens of {data.get('dataset')}, one artifact for every row",
        f"* layer selection: `{setup['criterion']}` (attention scores for Attn NBL / DROP, block scores for Block NBL)",
    ]
    if setup.get("tokens"):
        lines.append(f"* perplexity: {setup['text']}, `--ctx-size {setup['ctx']}`, {setup['chunks']} chunks, "
                     f"{setup['tokens']} scored tokens (second half of each chunk, as llama-perplexity); "
                     f"± is llama-perplexity's standard error (PPL x s.e. of the mean token NLL); PyTorch float32 "
                     f"uses llama.cpp's tokens and the same chunking")
    lines.append("* KV cache saving: share of KV bytes per token removed (layers without attention keep no K/V)")
    if setup.get("bench_args"):
        lines.append(f"* speed-up: llama-bench `{setup['bench_args']}` tokens/s of the GGUF over the baseline of the "
                     f"same type, measured back to back in one llama-bench process (tg = generation, pp = prompt); "
                     f"± from llama-bench's standard deviations; baseline row: mean over its runs; "
                     f"{setup['machine']} shared with other jobs, so timings are noisy")
    lines.append(f"* time: {setup['eval_min']} min of llama-perplexity and {setup['torch_min']} min of PyTorch "
                 f"evaluation (as recorded when computed), plus conversions, quantization and llama-bench; "
                 f"{setup['machine']}")
    lines += ["", "## Perplexity", ""]
    header = ["config", "layers replaced", "KV saving", "PyTorch f32"] + [f"GGUF {x}" for x in q]
    if setup.get("bench_args"):
        header += [f"tg speed-up {x}" for x in q]
    lines += ["| " + " | ".join(header) + " |", "|---|---|---:|---:|" + "---:|" * (len(header) - 4)]
    for config in main:
        torch_row = _find(rows, "sweep", config.label, "pytorch", "f32")
        any_row = next((r for r in rows if r["group"] == "sweep" and r["config"] == config.label), None)
        if any_row is None:
            continue
        cells = [config.label, any_row["layers"] or "—", f"{100 * any_row['kv_saving']:.1f}%", _ppl(torch_row)]
        cells += [_ppl(_find(rows, "sweep", config.label, "llama.cpp", x)) if config.gguf else "n/a (PyTorch only)"
                  for x in q]
        if setup.get("bench_args"):
            cells += [_speed(_find(rows, "sweep", config.label, "llama.cpp", x)) if config.gguf else "—" for x in q]
        lines.append("| " + " | ".join(cells) + " |")
    f32 = _find(rows, "sweep", "Baseline", "llama.cpp", "f32")
    if f32 and f32.get("ppl") is not None:
        lines += ["", f"Baseline as an F32 GGUF through llama.cpp: {_ppl(f32)} (against PyTorch float32: the two "
                      f"paths agree when quantization is off)."]
    if criteria:
        m = criteria[0].m
        lines += ["", f"## Layer-selection criteria (m = {m}, GGUF {q[0]})", "",
                  f"| criterion | layers replaced | Attn NBL-{m} PyTorch f32 | Attn NBL-{m} GGUF {q[0]} "
                  f"| Attn DROP-{m} PyTorch f32 | Attn DROP-{m} GGUF {q[0]} |", "|---|---|---:|---:|---:|---:|"]

        def pick(method, criterion, backend):
            return next((r for r in rows if r["group"] == "criteria" and r["method"] == method
                         and r["criterion"] == criterion and r["backend"] == backend
                         and r["quant"] == ("f32" if backend == "pytorch" else q[0])), None)

        for criterion in dict.fromkeys(c.criterion for c in criteria):
            layers = next(c.layers for c in criteria if c.criterion == criterion)
            cells = [criterion, " ".join(map(str, layers))]
            cells += [_ppl(pick(method, criterion, backend)) for method in ("attn-nbl", "attn-drop")
                      for backend in ("pytorch", "llama.cpp")]
            lines.append("| " + " | ".join(cells) + " |")
    if task_files:
        lines += ["", "## Multiple choice", ""]
        header = ["config", "quant"] + [f"{t} (n={n or 'all'})" for t, (_, n) in task_files.items()]
        lines += ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * len(task_files)]
        for row in rows:
            if row["group"] != "sweep" or row["backend"] != "llama.cpp":
                continue
            cells = [row["config"], row["quant"]]
            for task in task_files:
                if row.get(f"{task}_acc") is None:
                    cells.append("—")
                else:
                    cells.append(f"{row[f'{task}_acc']:.2f} [{row[f'{task}_lo']:.2f}, {row[f'{task}_hi']:.2f}]")
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "Accuracy in %, 95% interval: HellaSwag's Wilson interval as printed; Winogrande and "
                      "multiple-choice ±1.96 x the printed standard error."]
    lines += ["", "Files: quality.csv (every number above, tokens/s included), quality.png "
                  "(perplexity against KV-cache saving and measured speed-up).", ""]
    if notes:
        lines += [notes, ""]
    path.write_text("\n".join(lines), encoding="utf-8")


def plot(path: Path, rows, quants, task_files, setup) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("ppl", "perplexity (held-out C4)")] if any(r.get("ppl") is not None for r in rows) else []
    metrics += [(f"{t}_acc", f"{t} accuracy (%)") for t in task_files]
    if not metrics:
        return
    has_speed = any(r.get("speedup_tg") is not None for r in rows)
    ncols = 2 if has_speed else 1
    fig, axes = plt.subplots(len(metrics), ncols, figsize=(6.5 * ncols, 4.2 * len(metrics)), squeeze=False)
    palette = {"attn-nbl": "tab:blue", "attn-drop": "tab:red", "block-nbl": "tab:green"}
    extra = iter(["tab:orange", "tab:purple", "tab:brown", "tab:gray"])
    colors = {}
    for r in rows:
        series_name = r.get("series", r["method"])
        if r["method"] != "baseline" and series_name not in colors:
            colors[series_name] = palette[r["method"]] if series_name == r["method"] else next(extra, "black")
    styles = {q.lower(): s for q, s in zip(quants, ["-", "--", ":", "-."])}
    sweep_rows = [r for r in rows if r["group"] == "sweep"]

    def series(name, backend, quant):
        base = [r for r in sweep_rows if r["method"] == "baseline" and r["backend"] == backend and r["quant"] == quant]
        own = sorted((r for r in sweep_rows if r.get("series", r["method"]) == name and r["backend"] == backend
                      and r["quant"] == quant), key=lambda r: r["m"])
        return base + own

    for row_index, (metric, label) in enumerate(metrics):
        for col, (xkey, xlabel) in enumerate([("kv_saving", "KV-cache saving (%)"),
                                              ("speedup_tg", "measured generation speed-up (llama-bench tg)")][:ncols]):
            ax = axes[row_index][col]
            curves = []
            for name in colors:
                method = name.split(" ")[0]
                pretty = METHOD_LABELS[method] + name[len(method):]
                for quant in [q.lower() for q in quants]:
                    if method != "block-nbl":
                        curves.append((name, "llama.cpp", quant, f"{pretty} GGUF {quant}", styles[quant], "o"))
                if metric == "ppl" and xkey == "kv_saving":
                    curves.append((name, "pytorch", "f32", f"{pretty} PyTorch f32", ":", "x"))
            for method, backend, quant, name, style, marker in curves:
                points = [r for r in series(method, backend, quant) if r.get(metric) is not None
                          and r.get(xkey) is not None]
                if len(points) < 2:
                    continue
                xs = [100 * r[xkey] if xkey == "kv_saving" else r[xkey] for r in points]
                ys = [r[metric] for r in points]
                if metric == "ppl":
                    err = [r.get("ppl_err") or 0 for r in points]
                    yerr = [err, err]
                else:
                    task = metric[:-4]
                    yerr = [[r[metric] - r[f"{task}_lo"] for r in points], [r[f"{task}_hi"] - r[metric] for r in points]]
                xerr = None
                if xkey == "speedup_tg":
                    xerr = [r.get("speedup_tg_err") or 0 for r in points]
                # speed-ups are not ordered by m: points there, lines only along the KV-cache saving axis
                ax.errorbar(xs, ys, yerr=yerr, xerr=xerr, fmt=marker, color=colors[method],
                            linestyle=style if xkey == "kv_saving" else "none",
                            label=name, ms=4, capsize=2, lw=1.2)
                if backend != "pytorch":
                    for x, y, r in zip(xs, ys, points):
                        if r["m"]:
                            ax.annotate(str(r["m"]), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6)
            if metric == "ppl":
                from matplotlib.ticker import FormatStrFormatter

                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
                low, high = ax.get_ylim()
                if high / low < 20:  # label the minor ticks only where there are few of them
                    ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
                    ax.tick_params(axis="y", which="minor", labelsize=6)
                else:
                    from matplotlib.ticker import NullFormatter

                    ax.yaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel(xlabel)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=6.5)
    fig.suptitle(f"{setup['model']}: NBL vs attention drop (labels: m layers replaced; error bars: perplexity "
                 f"±1 s.e., accuracy 95% interval, speed-up ±1 s.d.)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
