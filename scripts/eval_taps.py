"""Past-token taps (issue 19): every form of the taps map fitted on the same layers, held-out
perplexity in PyTorch float32, against the bytes each form costs per layer.

One forward pass of the unmodified model over --nfit calibration windows of --seqlen tokens feeds a
calibration.statistics.MomentAccumulator with taps (--max-taps; fewer taps are its leading blocks) for each layer
of --layers (a ranking: the first m are replaced at each m of --ms; default the cosine layers that
docs/results/quality.md replaces at m = 4, 8, 12) and the cosine criterion of every layer (printed,
to check that ranking on these windows). Each form of --forms (form:taps[:rank]) is solved per layer
and the model with the first m layers replaced by calibration.apply's TapsAttention is measured on
--held chunks of 512 held-out tokens (second half of each chunk scored, as llama-perplexity and
scripts/eval_selection_variants.py), one JSON line per (form, m) in --out. Also recorded: the
perplexity of the first 4 predictions of every chunk (positions whose lags reach before the start).

    nice -n 10 python scripts/eval_taps.py --out docs/results/taps-smollm2.jsonl
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from nbl_gguf import models
from nbl_gguf.calibration import dataset as data
from nbl_gguf.calibration.apply import ATTN_TAPS, apply_nbl
from nbl_gguf.calibration.capture import capture_activations
from nbl_gguf.calibration.statistics import CosineAccumulator
from nbl_gguf.calibration.statistics import MomentAccumulator
from nbl_gguf.calibration.taps import solve

QUALITY_MD_COSINE = "6,7,25,26,5,9,28,29,12,14,17,22"
FIRST = 4

p = argparse.ArgumentParser()
p.add_argument("--model", default=None)
p.add_argument("--nfit", type=int, default=16)
p.add_argument("--seqlen", type=int, default=2048)
p.add_argument("--held", type=int, default=24)
p.add_argument("--ms", default="4,8,12")
p.add_argument("--layers", default=QUALITY_MD_COSINE)
p.add_argument("--max-taps", type=int, default=4)
p.add_argument("--forms", default="full:1,full:2,full:4,lowrank:4:32,lowrank:4:128,channel:2,channel:4")
p.add_argument("--batch", type=int, default=2)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--out", default="taps.jsonl")
p.add_argument("--save-maps", default=None, help="a folder: each form's fitted maps are saved there "
                                                 "(FORM.npz: blk.N.<tensor> arrays, as TapsMap.tensors(), and taps)")
p.add_argument("--save-only", default="", help="forms (as --forms) whose maps are only fitted and saved (--save-maps)")
p.add_argument("--moments", default=None, help="a .pt file: the accumulated moments are loaded from it when it "
                                               "exists (same model, windows, layers, taps), else saved to it")
args = p.parse_args()
torch.set_num_threads(args.threads)
MS = [int(v) for v in args.ms.split(",")]
ORDER = [int(v) for v in args.layers.split(",")]
FITTED = ORDER[:max(MS)]

loaded = models.load_model(args.model, "fp32", "cpu")
model, tok, adapter = loaded.model, loaded.tokenizer, loaded.adapter
layers = models.decoder_layers(model)
n_layer, d = len(layers), model.config.hidden_size
attention = getattr(layers[0], adapter.attn)
ATTENTION_PARAMS = sum(p.numel() for p in attention.parameters())
windows = data.load_calibration(tok, None, args.nfit, args.seqlen).input_ids
held = tok(data.heldout_text())["input_ids"]
held_ids = torch.tensor(held[:args.held * 512]).view(args.held, 512)

t0 = time.time()
key = dict(model=loaded.name, nfit=args.nfit, seqlen=args.seqlen, layers=FITTED, taps=args.max_taps)
if args.moments and Path(args.moments).exists():
    saved = torch.load(args.moments, weights_only=False)
    if saved["key"] != key:
        raise SystemExit(f"{args.moments} holds moments of {saved['key']}, not {key}")
    moments, cos = saved["moments"], saved["cosine"]
else:
    accs = {k: MomentAccumulator(d, d, "cpu", f"layer {k}", taps=args.max_taps) for k in FITTED}
    cosine = [CosineAccumulator() for _ in range(n_layer)]

    def on_attention(k, h, x, y):
        cosine[k].update(h, h + y)
        if k in accs:
            accs[k].update(x, y)

    with torch.no_grad(), capture_activations(model, adapter, on_attention):
        base = models.base_model(model)
        for i in range(0, len(windows), args.batch):
            base(input_ids=windows[i:i + args.batch], use_cache=False)
    moments = {k: acc.moments() for k, acc in accs.items()}
    cos = [c.value() for c in cosine]
    if args.moments:
        torch.save({"key": key, "moments": moments, "cosine": cos}, args.moments)
stats_seconds = time.time() - t0
ranking = [int(i) for i in np.argsort(cos, kind="stable")]
print(f"statistics of {windows.numel()} tokens, {len(FITTED)} layers: {stats_seconds:.0f} s; "
      f"cosine ranking on these windows: {ranking[:max(MS)]}", flush=True)


@torch.no_grad()
def nll(mdl):
    """Mean NLL of the second half of each held-out chunk, and of the first FIRST predictions."""
    tot, n, first, n_first = 0.0, 0, 0.0, 0
    half = held_ids.shape[1] // 2
    for i in range(0, len(held_ids), 4):
        ids = held_ids[i:i + 4]
        logits = mdl(input_ids=ids, use_cache=False).logits.float()
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                               reduction="none").view(ids.shape[0], -1)
        tot += float(ce[:, half:].sum())
        n += ce[:, half:].numel()
        first += float(ce[:, :FIRST].sum())
        n_first += ce[:, :FIRST].numel()
    return tot / n, first / n_first


base_nll, base_first = nll(model)
print(f"unmodified: held-out ppl {math.exp(base_nll):.3f}", flush=True)
out = open(args.out, "a")
for spec in [f for f in args.save_only.split(",") if f] + args.forms.split(","):
    parts = spec.split(":")
    form, taps = parts[0], int(parts[1])
    rank = int(parts[2]) if len(parts) > 2 else None
    t = time.time()
    maps = {k: solve(moments[k].leading(taps), taps, form, rank) for k in FITTED}
    solve_seconds = time.time() - t
    if args.save_maps:
        Path(args.save_maps).mkdir(parents=True, exist_ok=True)
        np.savez(Path(args.save_maps) / f"{spec.replace(':', '-')}.npz", taps=taps,
                 **{f"blk.{k}.{name}": array for k, m in maps.items() for name, array in m.tensors().items()})
    if spec in args.save_only.split(","):
        continue
    for m in MS:
        chosen = ORDER[:m]
        mdl = apply_nbl(copy.deepcopy(model), {k: ATTN_TAPS for k in chosen}, {k: maps[k] for k in chosen})
        h, first = nll(mdl)
        del mdl
        rec = {
            "model": loaded.name, "variant": f"taps/{form}", "form": form, "taps": taps, "rank": rank, "m": m,
            "layers": sorted(chosen), "ppl": math.exp(h), "base_ppl": math.exp(base_nll),
            "increase_pct": 100 * (math.exp(h - base_nll) - 1),
            "first_ppl": math.exp(first), "base_first_ppl": math.exp(base_first),
            "params_per_layer": maps[chosen[0]].params(), "attention_params_per_layer": ATTENTION_PARAMS,
            "nmse_mean": float(np.mean([maps[k].nmse for k in chosen])),
            "fit": f"{args.nfit}x{args.seqlen}", "held_chunks": args.held, "solve_seconds": round(solve_seconds, 1),
        }
        print(json.dumps(rec), flush=True)
        out.write(json.dumps(rec) + "\n")
        out.flush()
