"""Refined maps against their LMMSE fit on the same layers (issue 33): one model, one calibration artifact
(LMMSE maps only), for each m and --taps a `convert` without and with --refine on a fresh copy of it.
One JSON line per (m, taps, type): the layers, the refinement's record (steps, seconds, its held-out
losses), and llama-perplexity of the stock, LMMSE and refined files on all the bundled evaluation text of
each kind, at 512 tokens and at --long-ctx.

    python docs/results/experiments/eval_refine.py --model "$(python -c 'from nbl_gguf import models; print(models.default_model_dir())')" \\
        --calibration out/taps-cal-smollm2 --ms 4,8,12 --taps 1,4 --quants q8_0 --out docs/results/refine-smollm2.jsonl

An HF --model takes --quants (the whole file in that type); a GGUF --model keeps its own types (--quants
default). Extra convert flags (--refine-tokens, --refine-form, ...) go after --.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _conversions

from _conversions import add_evaluation_arguments  # noqa: E402 - after the paths it is found by


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF folder or GGUF file")
    parser.add_argument("--calibration", required=True, help="its calibration artifact (LMMSE maps)")
    parser.add_argument("--ms", default="4,8,12")
    parser.add_argument("--taps", default="1,4")
    parser.add_argument("--quants", default="default", help="convert --quant for each (HF --model), or default")
    parser.add_argument("--criterion", default="cosine")
    add_evaluation_arguments(parser)
    parser.add_argument("--variants", default="lmmse,refined",
                        help="the files made per row: lmmse,refined; refined alone when the LMMSE row is on record "
                             "(the same calibration: its files are the same)")
    parser.add_argument("--out", required=True)
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]

    from nbl_gguf.calibration.artifact import REPORT
    from nbl_gguf.calibration.dataset import KINDS, write_evaluation_text
    from _conversions import convert, fresh_copy, long_perplexities, stock_file, write_row

    def long_ppl(path: Path, texts: dict) -> dict:
        return long_perplexities(path, texts, args.long_ctx, args.long_chunks, args.threads)

    with tempfile.TemporaryDirectory() as tmp, open(args.out, "a", encoding="utf-8") as out:
        tmp = Path(tmp)
        texts = {kind: write_evaluation_text(kind, tmp / f"eval-{kind}.txt") for kind in KINDS}
        for quant in args.quants.split(","):
            common = ["--model", args.model, "--criterion", args.criterion, "--eval-chunks", str(args.eval_chunks),
                      "--no-progress"] + (["--quant", quant] if quant != "default" else []) \
                + (["--threads", str(args.threads)] if args.threads else [])
            # the stock file of this type: no layer replaced
            stock = stock_file(args.model, quant, tmp, args.threads)
            stock_long = long_ppl(stock, texts)
            for m in [int(x) for x in args.ms.split(",")]:
                for taps in [int(x) for x in args.taps.split(",")]:
                    copy = fresh_copy(Path(args.calibration), tmp / f"calibration-{m}-{taps}")
                    row_args = common + ["--calibration", str(copy), "--m", str(m), "--taps", str(taps)]
                    files, summaries, seconds = {}, {}, {}
                    made = {"lmmse": ["--no-refine"], "refined": ["--refine", *extra]}
                    for variant, flags in ((v, made[v]) for v in args.variants.split(",")):
                        files[variant] = tmp / f"{variant}-{m}-{taps}-{quant}.gguf"
                        start = time.perf_counter()
                        summaries[variant] = convert(row_args + flags + ["-o", str(files[variant])])
                        seconds[variant] = round(time.perf_counter() - start, 1)
                    report = json.loads((copy / REPORT).read_text(encoding="utf-8")).get("refine", {})
                    heldout = {}
                    longs = {variant: long_ppl(path, texts) for variant, path in files.items()}
                    for kind in KINDS:
                        first = next(iter(summaries.values())).heldout[kind]
                        heldout[kind] = {"tokens": first["tokens"], "stock": first["stock"],
                                         "long_stock": stock_long[kind]}
                        for variant, summary in summaries.items():
                            heldout[kind][variant] = summary.heldout[kind]["nbl"]
                            heldout[kind][f"long_{variant}"] = longs[variant][kind]
                    row = {"model": Path(args.model).name, "quant": quant, "m": m, "taps": taps,
                           "layers": next(iter(summaries.values())).replaced, "criterion": args.criterion,
                           "long_ctx": args.long_ctx, "heldout": heldout, "convert_seconds": seconds,
                           "extra_flags": extra,
                           "refine": {key: report[key] for key in report if key not in ("history", "weights")}}
                    write_row(out, row, files.values(), copy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
