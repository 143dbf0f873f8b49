"""The GGUFs that `bench` and `bench --frontier` make from a --model and keep under the work dir: NBL files
by `convert` (one calibration reused across m, and by the frontier across kinds of map), and where they live."""

from __future__ import annotations

from pathlib import Path

from nbl_gguf.errors import NblError
from nbl_gguf.measurement.bench import Candidate


def work_dir(args) -> Path:
    if args.work_dir:
        return Path(args.work_dir)
    from nbl_gguf.models import cache_dir

    return cache_dir() / "bench"


def nbl_by_convert(args, model: str, directory: Path, suffix: str, extra: dict, log) -> tuple[list, list[str]]:
    """(an NBL-m Candidate per --m, the convert commands): convert.convert of ``model`` per m into ``directory``
    (kept and reused), with the convert options ``extra`` ({name: value}), the first making the one
    calibration that the others reuse."""
    from nbl_gguf.commands import convert, flags

    flags.check_calibration(args.calibration)
    calibration = Path(args.calibration) if args.calibration else directory / "calibration"
    tag = "" if not args.calibration else f"-cal{abs(_stable_hash(str(calibration.resolve()))) % 100000:05d}"
    paths = {m: directory / f"nbl-m{m}{tag}{suffix}.gguf" for m in args.m}
    commands = {}
    # the largest m first: its convert makes the calibration, on whose held-out windows each smaller m's best
    # (the default criterion) is then measured for that m (calibration.best_at)
    for m in sorted(set(args.m), reverse=True):
        values = dict(model=model, m=m, **extra, output=str(paths[m]), seed=args.seed, no_progress=args.no_progress,
                      threads=args.threads)
        if calibration.is_dir():
            values["calibration"] = str(calibration)
        else:
            values.update(save_calibration=str(calibration), device=args.device, dtype=args.dtype)
            if args.calib_nsamples:
                values["nsamples"] = args.calib_nsamples
            if args.calib_seqlen:
                values["seqlen"] = args.calib_seqlen
        options = convert.options(**values)
        commands[m] = convert.command_line(options)
        if not paths[m].is_file():
            log(f"{Path(model).name}: {commands[m]}")
            summary = convert.convert(options)
            log(summary.table())
    return [Candidate(f"nbl-m{m}", paths[m]) for m in args.m], list(commands.values())


def _stable_hash(text: str) -> int:
    import zlib

    return zlib.crc32(text.encode("utf-8"))


def resolve_model_dir(model: str | None) -> Path:
    """A local HF folder for ``model``: the embedded default, a folder, or a hub snapshot (for the
    commands that take no GGUF file)."""
    from nbl_gguf.model_source import is_gguf_file, resolve_model

    if is_gguf_file(model):
        raise NblError(f"--model {model} is a file: this command takes a HF model folder or a hub id "
                       f"(calibrate, convert and eval --sweep take GGUF files)")
    return resolve_model(model).hf_folder()


def stock_ladder(model_dir: Path, quants: list[str], directory: Path, threads, log) -> dict[str, Path]:
    """{type: the stock file of a HF folder at that type}: one F32 conversion, quantized to each type."""
    from nbl_gguf.gguf.hf_to_gguf import convert_hf_to_gguf
    from nbl_gguf.gguf.quantize import FLOAT_TYPES, quantize

    paths = {q: directory / f"stock-{q.lower()}.gguf" for q in quants}
    missing = [q for q, p in paths.items() if not p.is_file()]
    if missing:
        intermediate = directory / ".stock-f32.gguf"
        log(f"{model_dir.name}: stock conversion, then llama-quantize {', '.join(missing)}")
        try:
            convert_hf_to_gguf(model_dir, intermediate, "f32")
            for q in missing:
                if q in FLOAT_TYPES:
                    convert_hf_to_gguf(model_dir, paths[q], q.lower())
                else:
                    quantize(intermediate, paths[q], q, threads=threads)
        finally:
            intermediate.unlink(missing_ok=True)
    return paths
