"""Which criterion `--criterion best` picks at each m when its held-out windows are made of other text
(--selection-text variants), on the maps of one calibration artifact (the fit does not depend on the
held-out windows, so one calibration serves every variant), and what each criterion's layers then cost
on each kind's evaluation part (text never calibrated or selected on; PyTorch, the artifact's maps
unquantized). One JSON line per (variant, m): the windows of each kind, every criterion's layers and
selection-window increase, the choice; then one line per m with every criterion's layers' increase on
each kind's evaluation windows.

    python docs/results/experiments/eval_selection_text.py --calibration ART --ms 4,8 \\
        --variants "calibration;mix;mix" --windows 4,4,6 --out selection-text.jsonl

With --max-ppl-increase P, each variant also runs --m auto (best, cosine walked first) and the layers
it kept are scored on each kind's evaluation part (--ms "" for those rows alone).

--variants and --windows pair up (one window count per variant). The rankings do not depend on the
variant, so every variant chooses among the same candidate sets, and the evaluation rows score them all.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time


def emit(out, row: dict) -> None:
    """One JSON line to the results file (flushed: a long run keeps what it measured) and to stderr."""
    out.write(json.dumps(row) + "\n")
    out.flush()
    print(json.dumps(row), file=sys.stderr)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", required=True, help="artifact directory (calibrate -o / --save-calibration)")
    parser.add_argument("--model", default=None, help="the artifact's model (default: the embedded SmolLM2)")
    parser.add_argument("--ms", default="4,8")
    parser.add_argument("--variants", default="calibration;mix", help="--selection-text values, separated by ';'")
    parser.add_argument("--windows", default="4,4", help="held-out windows of each variant")
    parser.add_argument("--max-ppl-increase", type=float, default=None, metavar="P",
                        help="also --m auto with this budget: each variant's choice, then its layers on each kind")
    parser.add_argument("--eval-windows", type=int, default=2,
                        help="windows (of the artifact's seqlen) of each kind's evaluation part (default: 2)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import torch

    from nbl_gguf.calibration import dataset
    from nbl_gguf.calibration.artifact import LOCAL_DEFAULT
    from nbl_gguf.calibration.apply import METHOD_LAYER_TYPE
    from nbl_gguf.calibration.artifact import CRITERIA, load_artifact
    from nbl_gguf.calibration.dataset import EVALUATION, KINDS, build_windows, kind_texts
    from nbl_gguf.calibration.select import best_of, ppl_increase
    from nbl_gguf.calibration.solve import ranking
    from nbl_gguf.calibration.stream import LayerStream
    from nbl_gguf.calibration.variants import StreamedEvaluator
    from nbl_gguf.model_source import resolve_model

    artifact = load_artifact(args.calibration)
    data = artifact.report["data"]
    variants = args.variants.split(";")
    windows = [int(w) for w in args.windows.split(",")]
    if len(windows) != len(variants):
        raise SystemExit("--windows needs one count per variant")
    ms = [int(m) for m in args.ms.split(",") if m]
    auto_sets = {}  # variant -> the layers --m auto kept
    torch.manual_seed(0)
    # the calibration's own compute type, as sweep's best uses it
    dtype = getattr(torch, artifact.report["model"].get("dtype") or "float32")
    stream = LayerStream(resolve_model(args.model), dtype, "cpu")
    rankings = {c: ranking(artifact.scores(c, "attn")) for c in CRITERIA}
    with open(args.out, "a", encoding="utf-8") as out:
        for variant, count in zip(variants, windows):
            cargs = argparse.Namespace(seqlen=int(data["seqlen"]), selection_windows=count, selection_text=variant,
                                       dataset=None if data["dataset"].startswith("bundled:") else data["dataset"],
                                       dataset_config=data.get("dataset_config"), split=data.get("split") or "train",
                                       text_field="text")
            calib, heldout, made_of = dataset.load_windows(cargs, stream, True, int(data["nsamples"]))
            if calib.nsamples != int(data["nsamples"]):
                raise SystemExit(f"{calib.nsamples} fit windows, the artifact has {data['nsamples']}")
            start = time.time()
            evaluator = StreamedEvaluator(stream, heldout, METHOD_LAYER_TYPE["attn-nbl"],
                                          lambda k, _type: artifact.linear(k, "attn"))
            for m in ms:
                chosen, _, compared = best_of(evaluator, rankings, m)
                row = {"variant": variant, "windows": made_of["windows"], "m": m, "chosen": chosen,
                       "tokens": evaluator.tokens,
                       "compared": {c: {"layers": layers, "ppl_increase_pct": inc} for c, (layers, inc) in compared.items()},
                       "seconds": round(time.time() - start, 1)}
                emit(out, row)
            if args.max_ppl_increase is not None:
                chosen, trace, compared = best_of(evaluator, rankings, None, args.max_ppl_increase, walk_first=LOCAL_DEFAULT)
                auto_sets[variant] = list(trace.order)
                row = {"variant": variant, "windows": made_of["windows"], "auto": args.max_ppl_increase,
                       "chosen": chosen, "layers": auto_sets[variant], "tokens": evaluator.tokens,
                       "compared": {c: {"layers": layers, "ppl_increase_pct": inc} for c, (layers, inc) in compared.items()},
                       "seconds": round(time.time() - start, 1)}
                emit(out, row)
            evaluator.close()
        # every criterion's m layers on each kind's evaluation part
        seqlen = int(data["seqlen"])
        for kind in KINDS:
            windows = build_windows(stream.tokenizer, kind_texts(kind, EVALUATION), args.eval_windows, seqlen,
                                    name=f"{kind} evaluation text")
            start = time.time()
            evaluator = StreamedEvaluator(stream, windows.input_ids, METHOD_LAYER_TYPE["attn-nbl"],
                                          lambda k, _type: artifact.linear(k, "attn"))
            for m in ms:
                sets = {c: rankings[c][:m] for c in rankings}
                losses = evaluator.losses(list(sets.values()))
                row = {"evaluation": kind, "m": m, "tokens": evaluator.tokens,
                       "base_ppl": round(math.exp(evaluator.base_loss), 4),
                       "compared": {c: {"layers": sets[c], "ppl_increase_pct": round(ppl_increase(loss, evaluator.base_loss), 3)}
                                    for c, loss in zip(sets, losses)},
                       "seconds": round(time.time() - start, 1)}
                emit(out, row)
            if auto_sets:
                losses = evaluator.losses(list(auto_sets.values()))
                row = {"evaluation": kind, "auto": args.max_ppl_increase, "tokens": evaluator.tokens,
                       "base_ppl": round(math.exp(evaluator.base_loss), 4),
                       "variants": {v: {"layers": auto_sets[v], "ppl_increase_pct": round(ppl_increase(loss, evaluator.base_loss), 3)}
                                    for v, loss in zip(auto_sets, losses)},
                       "seconds": round(time.time() - start, 1)}
                emit(out, row)
            evaluator.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
