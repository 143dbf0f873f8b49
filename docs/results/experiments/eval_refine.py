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
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF folder or GGUF file")
    parser.add_argument("--calibration", required=True, help="its calibration artifact (LMMSE maps)")
    parser.add_argument("--ms", default="4,8,12")
    parser.add_argument("--taps", default="1,4")
    parser.add_argument("--quants", default="default", help="convert --quant for each (HF --model), or default")
    parser.add_argument("--criterion", default="cosine")
    parser.add_argument("--eval-chunks", type=int, default=64, help="chunks of 512 (64: all of each kind's text)")
    parser.add_argument("--long-ctx", type=int, default=4096)
    parser.add_argument("--long-chunks", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--variants", default="lmmse,refined",
                        help="the files made per row: lmmse,refined; refined alone when the LMMSE row is on record "
                             "(the same calibration: its files are the same)")
    parser.add_argument("--out", required=True)
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]

    from nbl_gguf.calibration.artifact import REPORT, WEIGHTS
    from nbl_gguf.calibration.dataset import KINDS, write_evaluation_text
    from nbl_gguf.commands import convert as convert_command
    from nbl_gguf.llamacpp.perplexity import perplexity

    def convert(argv):
        command = argparse.ArgumentParser()
        convert_command.add_arguments(command)
        return convert_command.convert(command.parse_args(argv))

    def long_ppl(path: Path, texts: dict) -> dict:
        return {kind: perplexity(path, text, n_ctx=args.long_ctx, chunks=args.long_chunks, threads=args.threads).ppl
                for kind, text in texts.items()}

    with tempfile.TemporaryDirectory() as tmp, open(args.out, "a", encoding="utf-8") as out:
        tmp = Path(tmp)
        texts = {kind: write_evaluation_text(kind, tmp / f"eval-{kind}.txt") for kind in KINDS}
        for quant in args.quants.split(","):
            common = ["--model", args.model, "--criterion", args.criterion, "--eval-chunks", str(args.eval_chunks),
                      "--no-progress"] + (["--quant", quant] if quant != "default" else []) \
                + (["--threads", str(args.threads)] if args.threads else [])
            # the stock file of this type: no layer replaced
            stock = tmp / f"stock-{quant}.gguf"
            convert(common + ["--calibration", args.calibration, "--m", "0", "--no-eval", "-o", str(stock)])
            stock_long = long_ppl(stock, texts)
            for m in [int(x) for x in args.ms.split(",")]:
                for taps in [int(x) for x in args.taps.split(",")]:
                    copy = tmp / f"calibration-{m}-{taps}"
                    copy.mkdir()
                    for name in (WEIGHTS, REPORT):
                        shutil.copy2(Path(args.calibration) / name, copy / name)
                    row_args = common + ["--calibration", str(copy), "--m", str(m), "--taps", str(taps)]
                    files, summaries, seconds = {}, {}, {}
                    made = {"lmmse": [], "refined": ["--refine", *extra]}
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
                    print(json.dumps(row), flush=True)
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    for path in files.values():
                        path.unlink(missing_ok=True)
                    shutil.rmtree(copy, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
