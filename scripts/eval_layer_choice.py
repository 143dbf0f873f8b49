"""Why does the CCA selection lose to the cosine selection on SmolLM2-135M? (docs/results/quality.md)

For every layer, on calibration windows, with the artifact's attention maps:
  nmse_y      E|Y - Yhat|^2 / E|Y - E Y|^2     (the fit's NMSE, what `nmse` scores, out of the fit's frame)
  drop_y      E|Y|^2        / E|Y - E Y|^2     (the same for Y -> 0, Attn DROP)
  nbl_resid   E|Y - Yhat|^2 / E|h + Y|^2       (NBL's error relative to the residual stream it is added to)
  drop_resid  E|Y|^2        / E|h + Y|^2       (DROP's)
then PyTorch perplexity (llama-perplexity chunking) of Attn NBL-m for selections by cca, cosine and
nbl_resid, and of Attn DROP-m by drop_resid.

    python scripts/eval_layer_choice.py --calibration out/eval/calibration-32x512 --m 8 --chunks 8
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import numpy as np
import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", required=True)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--windows", type=int, default=4, help="calibration windows for the per-layer statistics")
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--ctx-size", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--gguf", default=None, help="a GGUF of the model, for llama.cpp's tokens of the text")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from nbl_gguf import models
    from nbl_gguf.calibration import dataset
    from nbl_gguf.measurement import torch_ppl
    from nbl_gguf.calibration.apply import apply_nbl
    from nbl_gguf.calibration.artifact import load_artifact
    from nbl_gguf.calibration.capture import capture_activations
    from nbl_gguf.calibration.solve import select_layers

    artifact = load_artifact(args.calibration)
    loaded = models.load_model(artifact.report["model"]["path"], "fp32", "cpu")
    model, n = loaded.model, artifact.num_layers
    calib = dataset.load_calibration(loaded.tokenizer, None, args.windows, args.seqlen)
    sums = {k: np.zeros(n) for k in ("err", "y2", "yc", "resid")}
    maps = [tuple(torch.as_tensor(a, dtype=torch.float32) for a in artifact.linear(i, "attn")) for i in range(n)]
    ys = [[] for _ in range(n)]

    def on_attention(i, h, x, y):
        w, b = maps[i]
        x, y, h = x.float().reshape(-1, x.shape[-1]), y.float().reshape(-1, y.shape[-1]), h.float().reshape(-1, h.shape[-1])
        err = y - (x @ w.T + b)
        sums["err"][i] += float((err ** 2).sum())
        sums["y2"][i] += float((y ** 2).sum())
        sums["resid"][i] += float(((h + y) ** 2).sum())
        ys[i].append(y.sum(0).double())
        sums["yc"][i] += float((y.double() ** 2).sum())

    tokens_seen = 0
    with torch.no_grad(), capture_activations(model, loaded.adapter, on_attention, None):
        for window in calib.input_ids:
            models.base_model(model)(input_ids=window[None], use_cache=False)
            tokens_seen += window.numel()
    mean_sq = np.array([float((torch.stack(v).sum(0) / tokens_seen).pow(2).sum()) for v in ys])
    centered = sums["yc"] - tokens_seen * mean_sq
    table = {
        "nmse_y": sums["err"] / centered,
        "drop_y": sums["y2"] / centered,
        "nbl_resid": sums["err"] / sums["resid"],
        "drop_resid": sums["y2"] / sums["resid"],
        "cca": artifact.scores("cca", "attn"),
        "cosine": artifact.scores("cosine", "attn"),
    }
    print("layer " + " ".join(f"{k:>11}" for k in table))
    for i in range(n):
        print(f"{i:5d} " + " ".join(f"{table[k][i]:11.4g}" for k in table))

    selections = {
        "nbl/cca": ("attn-nbl", select_layers(table["cca"], args.m)),
        "nbl/cosine": ("attn-nbl", select_layers(table["cosine"], args.m)),
        "nbl/nbl_resid": ("attn-nbl", select_layers(table["nbl_resid"], args.m)),
        "drop/drop_resid": ("attn-drop", select_layers(table["drop_resid"], args.m)),
    }
    text = dataset.heldout_text().removesuffix("\n")
    if args.gguf:
        tokens, bos = torch_ppl.llama_tokens(args.gguf, text)
    else:
        tokens, bos = loaded.tokenizer(text)["input_ids"], None
    results = {}
    for name, (method, layers) in selections.items():
        from nbl_gguf.calibration.apply import METHOD_LAYER_TYPE

        types = [METHOD_LAYER_TYPE[method] if i in layers else 0 for i in range(n)]
        candidate = apply_nbl(copy.deepcopy(model), types, artifact)
        ppl = torch_ppl.torch_perplexity(candidate, tokens, args.ctx_size, chunks=args.chunks, bos=bos)
        results[name] = {"layers": layers, "ppl": ppl.ppl, "error": ppl.error, "tokens": ppl.tokens}
        print(f"{name:16s} layers {layers}: PPL {ppl.ppl:.3f} ± {ppl.error:.3f} ({ppl.tokens} tokens)", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"per_layer": {k: list(map(float, v)) for k, v in table.items()}, "selections": results},
                      handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
