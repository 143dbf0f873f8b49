"""Best measured at each m against the prefix of the calibration's choice (issue 30's frontier, and convert
--calibration DIR --m N): one model, one calibration made by best at the largest --ms; for each smaller m
the file convert now makes (best measured at that m on the calibration's held-out windows, calibration.best_at)
and the one it made before (the first m layers of the criterion the calibration chose, that is the prefix of
its order). One JSON line per m: both sets of layers, the measured comparison and its seconds, and
llama-perplexity of stock and both files on all the bundled evaluation text of each kind, at 512 tokens and
at --long-ctx.

    python docs/results/experiments/eval_best_per_m.py --model embedded --quant q4_k_m --taps 4 --ms 4,8,12 \\
        --calibration out/best-cal-smollm2 --threads 2 --out docs/results/best-per-m-smollm2.jsonl

The calibration is made (convert --m <largest> --save-calibration, with the convert flags after --) when
--calibration does not exist; a GGUF --model keeps its own types (no --quant).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _conversions

from _conversions import add_evaluation_arguments  # noqa: E402 - after the paths it is found by


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF folder, 'embedded' or a GGUF file")
    parser.add_argument("--quant", default=None, help="convert --quant (HF --model)")
    parser.add_argument("--taps", type=int, default=4)
    parser.add_argument("--ms", default="4,8,12")
    parser.add_argument("--calibration", required=True, help="the calibration artifact (made at the largest m if absent)")
    add_evaluation_arguments(parser)
    parser.add_argument("--out", required=True)
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]  # convert flags for the calibration (--nsamples, --seqlen, ...)

    from nbl_gguf.calibration.artifact import load_artifact
    from nbl_gguf.calibration.dataset import KINDS, write_evaluation_text
    from _conversions import convert, fresh_copy, long_perplexities, stock_file, write_row

    def long_ppl(path: Path, texts: dict) -> dict:
        return long_perplexities(path, texts, args.long_ctx, args.long_chunks, args.threads)

    ms = sorted(int(x) for x in args.ms.split(","))
    # the LMMSE maps, whatever convert's default for --refine
    common = ["--model", args.model, "--taps", str(args.taps), "--eval-chunks", str(args.eval_chunks), "--no-progress",
              "--no-refine"] \
        + (["--quant", args.quant] if args.quant else []) + (["--threads", str(args.threads)] if args.threads else [])
    with tempfile.TemporaryDirectory() as tmp, open(args.out, "a", encoding="utf-8") as out:
        tmp = Path(tmp)
        calibration = Path(args.calibration)
        if not calibration.is_dir():
            start = time.perf_counter()
            convert(common + extra + ["--m", str(ms[-1]), "--save-calibration", str(calibration), "--no-eval",
                              "-o", str(tmp / "calibrating.gguf")])
            print(f"calibration: {time.perf_counter() - start:.0f} s", file=sys.stderr)
        artifact = load_artifact(calibration)
        selection = artifact.report["selection"]
        if selection.get("criterion") != "best":
            raise SystemExit(f"{calibration}: calibrated by {selection.get('criterion')}, not best")
        texts = {kind: write_evaluation_text(kind, tmp / f"eval-{kind}.txt") for kind in KINDS}
        stock = stock_file(args.model, args.quant or "default", tmp, args.threads)
        stock_long = long_ppl(stock, texts)
        for m in ms:
            copy = fresh_copy(calibration, tmp / f"calibration-{m}")  # no best measured at this m yet
            row_args = common + ["--calibration", str(copy), "--m", str(m)]
            files, summaries, seconds = {}, {}, {}
            # measured: best at m; prefix: the first m of the criterion the calibration chose (its order's prefix)
            for variant, criterion in (("measured", "best"), ("prefix", selection["chosen"])):
                if variant == "prefix" and m == selection["m"]:  # the calibration's own choice: the same file
                    files[variant], summaries[variant], seconds[variant] = files["measured"], summaries["measured"], 0
                    continue
                files[variant] = tmp / f"{variant}-{m}.gguf"
                start = time.perf_counter()
                summaries[variant] = convert(row_args + ["--criterion", criterion, "-o", str(files[variant])])
                seconds[variant] = round(time.perf_counter() - start, 1)
            measured = load_artifact(copy).measured_best(m, taps=args.taps)
            assert summaries["prefix"].replaced == sorted(selection["heldout"]["order"][:m]) or m > len(
                selection["heldout"]["order"])
            same = summaries["measured"].replaced == summaries["prefix"].replaced
            longs = {"measured": long_ppl(files["measured"], texts)}
            longs["prefix"] = longs["measured"] if same else long_ppl(files["prefix"], texts)
            heldout = {}
            for kind in KINDS:
                first = summaries["measured"].heldout[kind]
                heldout[kind] = {"tokens": first["tokens"], "stock": first["stock"], "long_stock": stock_long[kind]}
                for variant, summary in summaries.items():
                    heldout[kind][variant] = summary.heldout[kind]["nbl"]
                    heldout[kind][f"long_{variant}"] = longs[variant][kind]
            row = {"model": Path(args.model).name, "quant": args.quant, "taps": args.taps, "m": m,
                   "calibration_m": selection["m"], "calibration_chosen": selection["chosen"],
                   "measured_layers": summaries["measured"].replaced, "prefix_layers": summaries["prefix"].replaced,
                   "measured": None if measured is None else {
                       "chosen": measured["chosen"], "seconds": round(measured["seconds"], 1),
                       "compared": measured["heldout"]["compared"], "heldout_tokens": measured["heldout"]["heldout_tokens"]},
                   "long_ctx": args.long_ctx, "heldout": heldout, "convert_seconds": seconds}
            write_row(out, row, set(files.values()), copy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
