"""`eval --sweep`: baseline vs Attn NBL-m vs Attn DROP-m (GGUF, through llama.cpp, and PyTorch float32)
vs Block NBL-m (PyTorch only), for a list of m, from one calibration artifact (the pieces, and how
the GGUFs are made and cached: nbl_gguf.measurement.sweep; the report: sweep_report)."""

from __future__ import annotations

import json
import platform
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

from nbl_gguf.commands import flags
from nbl_gguf.errors import NblError
from nbl_gguf.measurement.sweep import (DEFAULT_QUANTS, Cache, Config, GgufFactory, _file_sha, _log, _sha, bench_pair,
                                        best_choices, build_configs)
from nbl_gguf.measurement.sweep_report import collect_rows, plot, write_csv, write_markdown


def run_sweep(args) -> int:
    from nbl_gguf.gguf import nbl_format
    from nbl_gguf.gguf.hf_to_gguf import check_hf_folder, model_shape
    from nbl_gguf.gguf.quantize import check_quant
    from nbl_gguf.gguf.metadata import kv_bytes_per_token, open_gguf
    from nbl_gguf.model_source import is_gguf_file, resolve_model
    from nbl_gguf.measurement.perplexity import evaluate
    from nbl_gguf.measurement.tasks import check_task_files, check_text
    from nbl_gguf.calibration.dataset import write_heldout_text
    from nbl_gguf.measurement.torch_ppl import llama_tokens, prompt_text

    started = time.time()
    gguf_input = is_gguf_file(args.model)
    if gguf_input and args.quant is not None:
        raise NblError(f"--quant means nothing for a GGUF --model: every configuration keeps the types of "
                       f"{Path(args.model).name} (the NBL weights take their layer's attn_output type)")
    if not gguf_input:
        quants = [check_quant(q) for q in (DEFAULT_QUANTS if args.quant is None else args.quant)]
        if not quants:
            raise NblError("--quant: give at least one type")
    source = resolve_model(args.model, runnable=nbl_format.SUPPORTED_ARCHITECTURES if gguf_input else None,
                           calibrating=not args.calibration or not args.no_pytorch)
    if source.gguf is not None:
        quants = [source.gguf.file_type]
        n_layer = source.gguf.n_layer
    else:
        check_hf_folder(source.hf_folder())
        n_layer, _ = model_shape(source.hf_folder())
    for m in list(args.m) + ([args.criteria_m] if args.criteria_m else []):
        if not 0 < m <= n_layer:
            raise NblError(f"--m {m} is out of range: {source.name} has {n_layer} layers")
    task_files = check_task_files(flags.task_files(args))
    # absolute: the pinned converter runs in its own directory (hf_to_gguf passes paths through)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.output).resolve() if args.output else work
    out.mkdir(parents=True, exist_ok=True)

    if args.no_ppl:
        text_file = None
    elif args.text:
        text_file = Path(args.text)
        check_text(text_file, args.ctx_size)
    else:
        text_file = write_heldout_text(work / "heldout.txt")

    artifact = get_calibration(args, source, work)
    if artifact.num_layers != n_layer:
        raise NblError(f"the calibration has {artifact.num_layers} layers but {source.name} has {n_layer}")
    calib_tag = _file_sha(artifact.path / "report.json")
    factory = GgufFactory(source, artifact, work / f"gguf-{calib_tag}", args.threads)
    cache = Cache(work / "results.json", args.fresh)
    best = None
    if args.criterion == "best":
        best = best_choices(artifact, source, args.methods, sorted(set(args.m)), cache, calib_tag)
    main, criteria = build_configs(artifact, args.m, args.methods, args.criterion, args.extra_criteria,
                                   args.criteria_m, best)
    text_tag = _file_sha(text_file) if text_file else "none"
    task_tag = _sha(json.dumps({t: [_file_sha(p), n] for t, (p, n) in task_files.items()}).encode())
    eval_tag = f"{text_tag}-c{args.ctx_size}-k{args.chunks}-{task_tag}"

    stock_reader = open_gguf(factory.stock)

    def kv(config: Config) -> tuple[int, int]:
        return kv_bytes_per_token(stock_reader, [0 if i not in config.layers else 1 for i in range(n_layer)])

    # 1. GGUF evaluations through llama-perplexity (and llama-bench)
    jobs: dict[str, tuple[Config, list[str]]] = {}
    for config in main:
        if config.gguf:
            stock_f32 = config.method == "baseline" and source.gguf is None
            types = quants[:1] if config.variant and getattr(args, "criteria_first_quant", False) else quants
            jobs[config.key] = (config, (["F32"] if stock_f32 else []) + types)
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
                cached = evaluate(path, text_file=text_file, n_ctx=args.ctx_size, chunks=args.chunks,
                                  batch=args.batch_size, threads=args.threads, task_files=task_files)
                cached["seconds"] = round(time.time() - t0, 1)
                cached["file_bytes"] = path.stat().st_size
                cache.put(key, cached)
            results[(config.key, quant)] = dict(cached)

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
        configs = main + [c for c in criteria if c.key not in {x.key for x in main}]
        keys = {config.key: f"torch|{calib_tag}|{config.key}|{eval_tag}" for config in configs}
        missing = [config for config in configs if cache.get(keys[config.key]) is None]
        if missing:
            import torch

            from nbl_gguf.calibration.apply import BLOCK_LINEAR
            from nbl_gguf.measurement.torch_ppl import streamed_perplexities

            torch.manual_seed(0)
            if args.threads:
                torch.set_num_threads(args.threads)
            tokens, bos = llama_tokens(factory.stock, prompt_text(text_file))
            variants = {config.key: {i: t for i, t in enumerate(config.apply_types(n_layer)) if t} for config in missing}
            _log(f"pytorch perplexity of {len(missing)} configurations, the model streamed one layer at a time")
            t0 = time.time()
            results = streamed_perplexities(
                source, variants, lambda k, kind: artifact.linear(k, "block" if kind == BLOCK_LINEAR else "attn"),
                tokens, args.ctx_size, chunks=args.chunks, bos=bos, dtype="fp32", device="cpu")
            seconds = round(time.time() - t0, 1)
            for config in missing:
                ppl = results[config.key]
                cache.put(keys[config.key], {**asdict(ppl), "tokens": ppl.tokens, "seconds": seconds})
        torch_results = {config.key: cache.get(keys[config.key]) for config in configs}

    # 3. report
    rows = collect_rows(main, criteria, quants, results, torch_results, kv, task_files)
    setup = {
        "command": "python -m nbl_gguf eval " + " ".join(shlex.quote(a) for a in sys.argv[2:])
        if len(sys.argv) > 1 and sys.argv[1] == "eval" else None,
        "model": source.name, "n_layer": n_layer, "artifact": artifact.report,
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


def get_calibration(args, source, work: Path):
    """--calibration, or the calibration this sweep made before in ``work`` with the same settings, or a new one."""
    from nbl_gguf.calibration.artifact import load_artifact
    from nbl_gguf.calibration.calibrate import calibrate
    from nbl_gguf.calibration.report import describe_artifact
    from nbl_gguf.calibration.settings import Settings

    if args.calibration:
        flags.check_calibration(args.calibration)
        return load_artifact(args.calibration)
    model_dir = source.hf_folder()
    target = work / f"calibration-{args.nsamples}x{args.seqlen}"
    # Block NBL rows need the block maps too
    targets = ("attn", "block") if "block-nbl" in args.methods else ("attn",)
    if target.is_dir():
        artifact = load_artifact(target)
        data = artifact.report.get("data", {})
        if (data.get("nsamples_requested") == args.nsamples and data.get("seqlen") == args.seqlen
                and Path(artifact.report["model"].get("path", "")).resolve() == model_dir.resolve()
                and set(targets) <= set(artifact.targets)):
            _log(f"reusing calibration {target}")
            return artifact
    _log(f"calibrating {model_dir.name}: {args.nsamples} x {args.seqlen} tokens -> {target}")
    settings = Settings(model=str(model_dir), nsamples=args.nsamples, seqlen=args.seqlen, criterion="cosine",
                        targets=",".join(targets), output=str(target), device=args.device, dtype=args.dtype,
                        threads=args.threads, no_progress=args.no_progress)
    artifact = load_artifact(calibrate(settings))
    print(describe_artifact(artifact))
    return artifact
