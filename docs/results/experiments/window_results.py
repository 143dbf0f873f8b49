"""Window layers measured on one model (docs/results/window.md): which layers, at what cost, against the
stock file and the NBL files of the same m.

    python docs/results/experiments/window_results.py --model STOCK.gguf -o docs/results/window/NAME \
        [--m 4,8,12,half] [--sizes 512] [--extra-sizes 128,2048] [--sinks 4] [--compare LABEL=GGUF ...]

1. The ranking: calibration.windows.choose_windows on the selection text of each bundled kind at 4,096
   tokens (the training context if shorter), W = --select-size, every layer measured alone.
2. The files: the stock file with the top m layers made window layers (nbl_format.Windows), for each
   m and --sizes; the --extra-sizes and a window without sinks at the largest m.
3. Measured as `bench --frontier` measures (measurement.frontier): llama-perplexity per kind at 512 and
   4,096 tokens on the evaluation texts, KV as llama.cpp allocates it at --kv-ctx, llama-bench for the
   --bench labels at --depths; passkey retrieval (measurement.passkey) for the --passkey labels.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from nbl_gguf.calibration.dataset import CHARS_PER_TOKEN_BOUND, KINDS, bundled_selection_windows, write_evaluation_text  # noqa: E402
from nbl_gguf.calibration.windows import Window, choose_windows, recall_window, retrieval_probes  # noqa: E402
from nbl_gguf.gguf import nbl_format  # noqa: E402
from nbl_gguf.measurement import frontier  # noqa: E402


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def ranking(model: Path, out: Path, size: int, sinks: int, ctx: int, threads: int | None, recall: bool = False,
            tolerance: float | None = None, count: int = 1) -> dict:
    cached = out / ("choice-recall.json" if recall else
                    f"choice-retrieval-{tolerance:g}.json" if tolerance is not None else "choice.json")
    if cached.is_file():
        return json.loads(cached.read_text())
    import torch

    from nbl_gguf import models
    from nbl_gguf.calibration.stream import LayerStream
    from nbl_gguf.model_source import resolve_model

    if threads:
        torch.set_num_threads(threads)
    started = time.monotonic()
    stream = LayerStream(resolve_model(str(model)), models.resolve_dtype("auto", "cpu"), "cpu")
    ids, _ = bundled_selection_windows(stream.tokenizer, {kind: 1 for kind in KINDS}, ctx)
    if recall:  # tried for passkey retrieval: no clear gain (docs/results/window.md)
        ids = torch.cat([ids, recall_window(ids)])
    probes = None if tolerance is None else retrieval_probes(stream.tokenizer, ids, Window(size, sinks))
    choice = choose_windows(stream, ids, count if probes is not None else 1, Window(size, sinks), probes=probes,
                            **({} if tolerance is None else {"tolerance": tolerance}))
    report = choice.report() | {"seconds": time.monotonic() - started, "order": choice.order}
    cached.write_text(json.dumps(report, indent=1))
    log(f"ranking at W={size}, S={sinks}, {ctx} tokens: {report['order']} ({report['seconds']:.0f} s)")
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path, help="the stock GGUF")
    parser.add_argument("-o", "--output", required=True, type=Path)
    parser.add_argument("--m", default="4,8,12,half")
    parser.add_argument("--sizes", default="512")
    parser.add_argument("--extra-sizes", default="128,2048", help="at the largest m only")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--select-size", type=int, default=512)
    parser.add_argument("--select-ctx", type=int, default=4096)
    parser.add_argument("--recall", action="store_true",
                        help="rank with a fourth window whose second half repeats its first (calibration.windows.recall_window)")
    parser.add_argument("--retrieval-tolerance", type=float, default=None,
                        help="rank with retrieval probes (calibration.windows.guarded_walk) at this tolerance, "
                             "walking to the largest --m")
    parser.add_argument("--skip-sinkless", action="store_true", help="no file without sinks at the largest m")
    parser.add_argument("--compare", nargs="*", default=[], help="LABEL=GGUF files measured beside (NBL files)")
    parser.add_argument("--bench", default="stock", help="labels llama-bench measures (comma-separated; 'all')")
    parser.add_argument("--depths", default="0,4096,16384")
    parser.add_argument("--passkey", default="", help="labels passkey retrieval measures ('all')")
    parser.add_argument("--passkey-ctx", default="4096")
    parser.add_argument("--passkey-depths", default="0.1,0.5,0.9")
    parser.add_argument("--kv-ctx", default="8192,32768")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--render", action="store_true", help="only write results.md again from results.json")
    args = parser.parse_args()
    if args.render:
        (args.output / "results.md").write_text(render(json.loads((args.output / "results.json").read_text())))
        return 0

    import gguf

    out = args.output
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    reader = gguf.GGUFReader(args.model)
    arch = str(reader.fields["general.architecture"].contents())
    n_layer = int(reader.fields[f"{arch}.block_count"].contents())
    trained = int(reader.fields[f"{arch}.context_length"].contents())
    ctx = min(args.select_ctx, trained)
    ms = [n_layer // 2 if m == "half" else int(m) for m in args.m.split(",")]
    rank = ranking(args.model, out, args.select_size, args.sinks, ctx, args.threads, args.recall,
                   args.retrieval_tolerance, max(ms))
    order = rank["order"]

    plans = [(m, int(w), args.sinks) for w in args.sizes.split(",") for m in ms]
    plans += [(max(ms), int(w), args.sinks) for w in args.extra_sizes.split(",") if w]
    if not args.skip_sinkless:
        plans.append((max(ms), args.select_size, 0))
    variants = [frontier.Variant("stock", frontier.STOCK, args.model, made_by="the input file")]
    for m, size, sinks in plans:
        layers = tuple(sorted(order[:m]))
        path = work / f"window-m{m}-w{size}-s{sinks}.gguf"
        if not path.is_file():
            nbl_format.write_nbl_gguf(args.model, path, nbl_format.NblLayers(
                types=[nbl_format.ATTENTION] * n_layer, windows=nbl_format.Windows(layers, size, sinks),
                method="window"))
        variants.append(frontier.Variant(f"windows m={m} W={size} S={sinks}", frontier.NBL, path,
                                         made_by=f"layers {list(layers)}"))
    for item in args.compare:
        label, _, path = item.rpartition("=")  # a label may hold "=", a path does not
        variants.append(frontier.Variant(label, frontier.NBL, Path(path), made_by="--compare"))

    depths = tuple(int(d) for d in args.depths.split(","))
    settings = frontier.FrontierSettings(long_ctx=ctx, kv_ctx=int(args.kv_ctx.split(",")[0]), depths=depths,
                                         n_gen=64, repetitions=1, threads=args.threads)
    chosen = [v for v in variants if args.bench == "all" or v.label in args.bench.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        tokens = max(2 * settings.short_ctx * settings.short_chunks, 2 * settings.long_ctx * settings.long_chunks)
        texts = {kind: write_evaluation_text(kind, Path(tmp) / f"heldout-{kind}.txt", CHARS_PER_TOKEN_BOUND * tokens)
                 for kind in KINDS}
        perplexities = frontier.measure_perplexity(variants, texts, settings, log)
    records, commands = frontier.measure_speed(chosen, settings, log) if chosen else ([], [])
    speeds = frontier.mean_speeds(records)

    from nbl_gguf.measurement.passkey import passkey

    keyed = [v for v in variants if args.passkey == "all" or v.label in args.passkey.split(",")]
    passkeys = {}
    for variant in keyed:
        began = time.monotonic()
        result = passkey(variant.path, tuple(int(n) for n in args.passkey_ctx.split(",")),
                         tuple(float(d) for d in args.passkey_depths.split(",")), threads=args.threads)
        passkeys[variant.label] = result.report()
        log(f"[passkey] {variant.label}: {passkeys[variant.label]['accuracy']} ({time.monotonic() - began:.0f} s)")

    rows = []
    for variant in variants:
        measured = perplexities[variant.label]
        rows.append({"label": variant.label, "made_by": variant.made_by, "file_bytes": variant.path.stat().st_size,
                     "kv_bytes": {n: frontier.kv_bytes(variant.path, "f16", int(n)) for n in args.kv_ctx.split(",")},
                     "perplexity": {ctx_: {k: p.ppl for k, p in kinds.items()} for ctx_, kinds in measured.items()},
                     "speed": speeds.get(variant.label, {}), "passkey": passkeys.get(variant.label)})
    raw = {"model": str(args.model), "n_layer": n_layer, "ranking": rank,
           "settings": {"short": [settings.short_ctx, settings.short_chunks], "long": [settings.long_ctx, settings.long_chunks],
                        "depths": depths, "llama_bench": commands},
           "rows": rows, "llama_bench": records, "elapsed_s": time.monotonic() - started}
    (out / "results.json").write_text(json.dumps(raw, indent=1))
    table = render(json.loads((out / "results.json").read_text()))  # its keys as the file has them
    (out / "results.md").write_text(table)
    print(table)
    return 0


def render(raw: dict) -> str:
    """The table: perplexity change per kind at both contexts, KV, passkey and speed against stock."""
    rows = raw["rows"]
    stock = rows[0]
    short, long_ = (str(raw["settings"]["short"][0]), str(raw["settings"]["long"][0]))
    kv_ctx = list(stock["kv_bytes"])
    depths = raw["settings"]["depths"]
    head = (["file"] + [f"{kind} @{short}" for kind in KINDS] + [f"{kind} @{long_}" for kind in KINDS]
            + [f"KV @{int(n) // 1024}K" for n in kv_ctx] + ["passkey"] + [f"decode d{d}" for d in depths])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["label"]]
        for ctx in (short, long_):
            for kind in KINDS:
                value, base = row["perplexity"][ctx][kind], stock["perplexity"][ctx][kind]
                cells.append(f"{value:.3f}" if row is stock else f"{100 * (value / base - 1):+.1f}%")
        cells += [f"{row['kv_bytes'][n] / 2**20:.0f} MiB" for n in kv_ctx]
        cells.append(", ".join(f"{v:.0%}" for v in row["passkey"]["accuracy"].values()) if row["passkey"] else "")
        for depth in depths:
            key = f"cpu tg d{depth}"
            if key in row["speed"]:
                value = row["speed"][key]
                cells.append(f"{value:.1f} t/s" if row is stock else f"{value / stock['speed'][key]:.2f}x")
            else:
                cells.append("")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
