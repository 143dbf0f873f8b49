"""Layer selection and fitting variants of issue 10, measured in PyTorch float32 on held-out text.

Every variant replaces attention layers of the embedded SmolLM2-135M (or --model) by LMMSE maps fitted
on --nfit calibration windows and reports the perplexity increase on --held chunks of 512 tokens of the
bundled held-out C4 documents (second half of each chunk scored, as llama-perplexity), one JSON line
per (variant, m) in --out. Experiments (--exp, comma-separated):

  refit   cosine layers, each map refit in depth order on the inputs of the partially linearized model
          (GPTQ-style), target its own attention on those inputs (local) or the original Y (orig)
  iter    iterative re-scoring of cosine on the partially linearized model (LLM-Drop's iterative
          variant), maps one-shot or refit when picked
  greedy  greedy joint selection by the NLL of all positions of --nval held-out calibration windows,
          candidates the --pool lowest-cosine layers (the product's --criterion greedy also offers
          the lowest-nmse layers)
  nblcos  one-pass per-token criteria that know the map: 1 - cos(h + y, h + yhat), |y - yhat|^2/|h + y|^2
  wfit    weighted LMMSE: tokens weighted by 1/|h + y|^2 (rel), 1/|h|^2 (relx), or position 0 left out (nopos1)
  shrink  cosine layers, W shrunk towards 0: C_YX (C_XX + lam tr(C_XX)/d I)^-1, lam 0.01 and 0.1
  rawx    the reference code's X: the raw residual h (the layer's norm removed), y = W h + b
  conv    past-token inputs: the map also reads the previous --taps - 1 tokens' attention inputs (a short
          causal convolution; needs a decode state in llama.cpp, so it is measured here, not built)

The one-shot cca / nmse / cosine rows come from the sweep (eval --sweep) and from --exp oneshot in the
first harness version (same numbers: the maps and selections are the calibrate command's).
Results of the runs in docs/results/quality.md: docs/results/selection-variants-smollm2.jsonl.

    python scripts/eval_selection_variants.py --exp refit,iter --out variants.jsonl
    python scripts/eval_selection_variants.py --exp greedy --nval 16 --pool 5 --out variants.jsonl

This layer-by-layer runner truncates the layer list and feeds inputs_embeds, which is right for
llama-like models (no embedding scale in the model's forward); the product's runner
(nbl_gguf.calibration.layerwise) works for every supported family.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import time

import numpy as np
import torch
from torch import nn

from nbl_gguf import models
from nbl_gguf.calibration import dataset as data
from nbl_gguf.calibration.apply import apply_nbl
from nbl_gguf.calibration.capture import capture_activations
from nbl_gguf.calibration.solve import fit
from nbl_gguf.calibration.statistics import CosineAccumulator, MomentAccumulator

p = argparse.ArgumentParser()
p.add_argument("--model", default=None)
p.add_argument("--nfit", type=int, default=32)
p.add_argument("--nval", type=int, default=8)
p.add_argument("--seqlen", type=int, default=512)
p.add_argument("--held", type=int, default=24)
p.add_argument("--ms", default="4,8,12")
p.add_argument("--exp", default="refit,iter")
p.add_argument("--out", default="selection-variants.jsonl")
p.add_argument("--pool", type=int, default=6)
p.add_argument("--score-from", type=int, default=0)
p.add_argument("--nblcos-on", default="val")
p.add_argument("--schemes", default="rel,nopos1")
p.add_argument("--taps", type=int, default=4, help="conv: current token and taps - 1 previous ones")
p.add_argument("--layers", default=None, help="fixed layer order for refit (default: one-shot cosine)")
args = p.parse_args()
MS = [int(x) for x in args.ms.split(",")]
MMAX = max(MS)
torch.set_num_threads(2)

loaded = models.load_model(args.model, "fp32", "cpu")
model, tok, adapter = loaded.model, loaded.tokenizer, loaded.adapter
L = len(models.decoder_layers(model))
d = model.config.hidden_size
windows = data.load_calibration(tok, None, args.nfit + args.nval, args.seqlen).input_ids
fit_ids, val_ids = windows[:args.nfit], windows[args.nfit:]
held = tok(data.heldout_text())["input_ids"]
held_ids = torch.tensor(held[:args.held * 512]).view(args.held, 512)
out = open(args.out, "a")
BS = 4


class Runner:
    """Runs one decoder layer at a time over cached hidden states of all windows."""

    def __init__(self, mdl):
        self.mdl = mdl
        self.base = models.base_model(mdl)
        self.layers = models.decoder_layers(mdl)

    @torch.no_grad()
    def embed(self, ids):
        return self.base.embed_tokens(ids)

    @torch.no_grad()
    def run_layer(self, k, H, on_attention=None):
        """H_{k+1} from H_k through layer k; on_attention(h, x, y) sees each batch."""
        full = self.base.layers
        self.base.layers = nn.ModuleList([self.layers[k]])
        outs = []

        def hook(module, a, kw, output):
            outs.append((output[0] if isinstance(output, tuple) else output).clone())

        handle = self.layers[k].register_forward_hook(hook, with_kwargs=True)
        cb = (lambda i, h, x, y: on_attention(h, x, y)) if on_attention else None
        try:
            with capture_activations(self.mdl, adapter, cb, None) if cb else _null():
                for i in range(0, len(H), BS):
                    self.base(inputs_embeds=H[i:i + BS], use_cache=False)
        finally:
            handle.remove()
            self.base.layers = full
        return torch.cat(outs)

    @torch.no_grad()
    def head_nll(self, H, ids, half=None):
        half = ids.shape[1] // 2 if half is None else half
        tot, n = 0.0, 0
        for i in range(0, len(H), BS):
            h = self.base.norm(H[i:i + BS])
            logits = self.mdl.lm_head(h[:, half:-1]).float()
            tgt = ids[i:i + BS, half + 1:]
            tot += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="sum"))
            n += tgt.numel()
        return tot / n


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def np_map(f):
    return f.weight.float().numpy(), f.bias.float().numpy()


@torch.no_grad()
def nll(m, ids):
    r = Runner(m)
    H = r.embed(ids)
    for k in range(L):
        H = r.run_layer(k, H)
    return r.head_nll(H, ids)


base_nll = nll(model, held_ids)
print(f"base held-out ppl {math.exp(base_nll):.3f}", flush=True)


def record(name, m, layers, maps, extra=None):
    mdl = apply_nbl(copy.deepcopy(model), {i: 1 for i in maps}, maps)
    h = nll(mdl, held_ids)
    rec = {"model": loaded.name, "variant": name, "m": m, "layers": sorted(layers), "ppl": math.exp(h),
           "base_ppl": math.exp(base_nll), "increase_pct": 100 * (math.exp(h - base_nll) - 1), **(extra or {})}
    print(json.dumps(rec), flush=True)
    out.write(json.dumps(rec) + "\n")
    out.flush()


@torch.no_grad()
def layer_pass(r, k, H, target_ys=None):
    """Moments of layer k on H (Y = its attention on these inputs, or the given original Ys), cosine."""
    acc = MomentAccumulator(d, d, "cpu", f"layer {k}")
    cos = CosineAccumulator()
    state = {"b": 0}

    def on_att(h, x, y):
        if target_ys is not None:
            y = target_ys[state["b"]]
            state["b"] += 1
        acc.update(x, y)
        cos.update(h, h + y)

    Hn = r.run_layer(k, H, on_att)
    return acc, cos.value(), Hn


def one_fit(acc):
    torch.set_num_threads(1)
    try:
        return fit(acc.moments(), residual=True)
    finally:
        torch.set_num_threads(2)


t = time.time()
orig = Runner(model)
Hs_fit = [orig.embed(fit_ids)]
orig_y = []
fits0, cos0 = [], []
for k in range(L):
    ys = []
    acc, c, Hn = layer_pass(orig, k, Hs_fit[-1])
    fits0.append(one_fit(acc))
    cos0.append(c)
    Hs_fit.append(Hn)
print(f"one-shot layerwise stats {time.time() - t:.1f}s", flush=True)
maps0 = {i: np_map(f) for i, f in enumerate(fits0)}
cos_order = [int(i) for i in np.argsort(cos0, kind="stable")]
exps = args.exp.split(",")


def sequential_refit(layers, target):
    """Depth order; each selected layer refit on the inputs of the model with the earlier ones replaced."""
    mdl = copy.deepcopy(model)
    r = Runner(mdl)
    H = Hs_fit[0]
    maps = {}
    first = min(layers)
    H = Hs_fit[first]
    for k in range(first, L):
        if k in layers:
            ys = None
            if target == "orig":
                # the original model's attention output at this layer, batch by batch
                ys = []
                orig.run_layer(k, Hs_fit[k], lambda h, x, y: ys.append(y.clone()))
            acc, _, _ = layer_pass(r, k, H, ys)
            maps[k] = np_map(one_fit(acc))
            apply_nbl(mdl, {k: 1}, {k: maps[k]})
        H = r.run_layer(k, H)
    return maps


if "refit" in exps:
    order = [int(x) for x in args.layers.split(",")] if args.layers else cos_order
    for target in ("local", "orig"):
        for m in MS:
            t = time.time()
            maps = sequential_refit(set(order[:m]), target)
            record(f"refit-{target}", m, order[:m], maps, {"seconds": round(time.time() - t, 1)})

if "iter" in exps:
    # iterative cosine re-scoring on the partially linearized model (maps: one-shot or refit at pick time)
    for refit in (False, True):
        mdl = copy.deepcopy(model)
        r = Runner(mdl)
        Hs = list(Hs_fit)
        chosen, maps = [], {}
        t = time.time()
        cos = list(cos0)
        fits = list(fits0)
        for step in range(MMAX):
            best = min((i for i in range(L) if i not in chosen), key=lambda i: cos[i])
            chosen.append(best)
            maps[best] = np_map(fits[best]) if refit else maps0[best]
            apply_nbl(mdl, {best: 1}, {best: maps[best]})
            if step + 1 in MS:
                record(f"iter-cosine{'+refit' if refit else ''}", step + 1, chosen, dict(maps),
                       {"order": list(chosen), "seconds": round(time.time() - t, 1)})
            if step + 1 == MMAX:
                break
            # re-score the layers after the one just replaced
            for k in range(best, L):
                acc, c, Hn = layer_pass(r, k, Hs[k])
                if k not in chosen:
                    cos[k] = c
                    fits[k] = one_fit(acc) if refit else fits[k]
                Hs[k + 1] = Hn

if "greedy" in exps:
    Hv0 = [orig.embed(val_ids)]
    for k in range(L):
        Hv0.append(orig.run_layer(k, Hv0[-1]))
    mdl = copy.deepcopy(model)
    r = Runner(mdl)
    Hv = list(Hv0)
    chosen = []
    t = time.time()
    for step in range(MMAX):
        pool = [i for i in cos_order if i not in chosen][:args.pool]
        best, best_nll = None, None
        for c in pool:
            cand = apply_nbl(copy.deepcopy(mdl), {c: 1}, {c: maps0[c]})
            rc = Runner(cand)
            H = Hv[c]
            for k in range(c, L):
                H = rc.run_layer(k, H)
            v = rc.head_nll(H, val_ids, args.score_from)
            if best_nll is None or v < best_nll:
                best, best_nll = c, v
        chosen.append(best)
        apply_nbl(mdl, {best: 1}, {best: maps0[best]})
        for k in range(best, L):
            Hv[k + 1] = r.run_layer(k, Hv[k])
        print(f"greedy step {step + 1}: {best} val ppl {math.exp(best_nll):.3f} pool {pool}", flush=True)
        if step + 1 in MS:
            record(f"greedy-val{args.nval}-from{args.score_from}-pool{args.pool}", step + 1, chosen, {i: maps0[i] for i in chosen},
                   {"order": list(chosen), "seconds": round(time.time() - t, 1)})

if "nblcos" in exps:
    # per-token criteria that know the map: 1 - cos(h + y, h + yhat), |e|^2/|h+y|^2 per token; one pass
    src = {"fit": Hs_fit, "val": None}
    ids_for = val_ids if args.nblcos_on == "val" else fit_ids
    r = Runner(model)
    H = r.embed(ids_for)
    crit = {"nblcos": np.zeros(L), "tokrel": np.zeros(L), "cos": np.zeros(L)}
    for k in range(L):
        w, b = (torch.as_tensor(a) for a in maps0[k])
        sums = {"nblcos": 0.0, "tokrel": 0.0, "cos": 0.0, "n": 0}

        def on_att(h, x, y, w=w, b=b, sums=sums):
            h, x, y = (t.reshape(-1, t.shape[-1]).double() for t in (h, x, y))
            yh = x @ w.double().T + b.double()
            a, c = h + y, h + yh
            sums["nblcos"] += float((1 - torch.nn.functional.cosine_similarity(a, c, dim=-1)).sum())
            sums["tokrel"] += float((((y - yh) ** 2).sum(-1) / (a ** 2).sum(-1)).sum())
            sums["cos"] += float((1 - torch.nn.functional.cosine_similarity(h, a, dim=-1)).sum())
            sums["n"] += h.shape[0]

        H = r.run_layer(k, H, on_att)
        for key in crit:
            crit[key][k] = sums[key] / sums["n"]
    print(json.dumps({k: list(map(float, v)) for k, v in crit.items()}), flush=True)
    for key in ("nblcos", "tokrel"):
        order = [int(i) for i in np.argsort(crit[key], kind="stable")]
        for m in MS:
            record(f"oneshot/{key}-{args.nblcos_on}", m, order[:m], {i: maps0[i] for i in order[:m]}, {"order": order[:MMAX]})

if "wfit" in exps:
    from nbl_gguf.calibration.statistics import Moments

    class WAcc:
        def __init__(self):
            f = dict(dtype=torch.float64)
            self.n = 0; self.sw = 0.0
            self.sx = torch.zeros(d, **f); self.sy = torch.zeros(d, **f)
            self.sxx = torch.zeros(d, d, **f); self.syx = torch.zeros(d, d, **f); self.syy = torch.zeros(d, d, **f)
            self.shift = None

        def update(self, x, y, w):
            x, y, w = x.double(), y.double(), w.double()
            if self.shift is None:
                self.shift = (x.mean(0), y.mean(0))
            x, y = x - self.shift[0], y - self.shift[1]
            self.n += x.shape[0]; self.sw += float(w.sum())
            self.sx += (w[:, None] * x).sum(0); self.sy += (w[:, None] * y).sum(0)
            self.sxx += (x * w[:, None]).T @ x; self.syx += (y * w[:, None]).T @ x; self.syy += (y * w[:, None]).T @ y

        def moments(self):
            n = self.sw
            mx, my = self.sx / n, self.sy / n
            cxx = self.sxx / n - torch.outer(mx, mx); cyx = self.syx / n - torch.outer(my, mx); cyy = self.syy / n - torch.outer(my, my)
            return Moments(self.n, mx + self.shift[0], my + self.shift[1], (cxx + cxx.T) / 2, cyx, (cyy + cyy.T) / 2)

    schemes = args.schemes.split(",")
    accs = {s: [WAcc() for _ in range(L)] for s in schemes}
    r = Runner(model)
    H = Hs_fit[0]
    for k in range(L):
        def on_att(h, x, y, k=k):
            S_ = h.shape[1]
            h, x, y = (t.reshape(-1, t.shape[-1]) for t in (h, x, y))
            pos = torch.arange(S_).repeat(h.shape[0] // S_)
            for s in schemes:
                if s == "rel":
                    w = 1.0 / ((h + y).double() ** 2).sum(-1)
                elif s == "relx":
                    w = 1.0 / (h.double() ** 2).sum(-1)
                elif s.startswith("nopos"):
                    w = (pos >= int(s[5:])).double()
                elif s == "relnopos1":
                    w = (pos >= 1).double() / ((h + y).double() ** 2).sum(-1)
                accs[s][k].update(x, y, w)
        H = Hs_fit[k + 1]
        r.run_layer(k, Hs_fit[k], on_att)
    order = [int(x) for x in args.layers.split(",")] if args.layers else cos_order
    for s in schemes:
        maps = {}
        for k in range(L):
            maps[k] = np_map(one_fit(accs[s][k]))
        for m in MS:
            record(f"wfit-{s}/{'given' if args.layers else 'cosine'}", m, order[:m], {i: maps[i] for i in order[:m]})
        # the scheme's own cosine-style NBL ranking is not needed: selection stays cosine

if "conv" in exps:
    # past-token inputs: y_t = sum_j W_j x_{t-j} + b, j < args.taps (a short causal convolution of the
    # attention input), LMMSE-fitted on the original model's activations; cosine layers
    taps = args.taps

    def shifted(x):
        """[b, s, d] -> [b, s, taps * d]: x_t, x_{t-1}, ... (zeros before the window)."""
        parts = [x] + [torch.nn.functional.pad(x, (0, 0, j, 0))[:, :x.shape[1]] for j in range(1, taps)]
        return torch.cat(parts, -1)

    class ConvAttention(nn.Module):
        def __init__(self, w, b):
            super().__init__()
            self.w, self.b = torch.as_tensor(w).float(), torch.as_tensor(b).float()

        def forward(self, hidden_states, *a, **kw):
            return torch.nn.functional.linear(shifted(hidden_states.float()), self.w, self.b), None

    accs = [MomentAccumulator(taps * d, d, "cpu", f"conv {k}") for k in range(L)]
    r = Runner(model)
    for k in range(L):
        r.run_layer(k, Hs_fit[k], lambda h, x, y, k=k: accs[k].update(shifted(x), y))
    torch.set_num_threads(1)
    conv_maps = {k: fit(accs[k].moments()) for k in range(L)}
    torch.set_num_threads(2)
    for m in MS:
        mdl = copy.deepcopy(model)
        for k in cos_order[:m]:
            setattr(models.decoder_layers(mdl)[k], adapter.attn, ConvAttention(conv_maps[k].weight, conv_maps[k].bias))
        h = nll(mdl, held_ids)
        rec = {"model": loaded.name, "variant": f"conv{taps}/cosine", "m": m, "layers": sorted(cos_order[:m]),
               "ppl": math.exp(h), "base_ppl": math.exp(base_nll), "increase_pct": 100 * (math.exp(h - base_nll) - 1)}
        print(json.dumps(rec), flush=True)
        out.write(json.dumps(rec) + "\n")
        out.flush()

if "shrink" in exps or "rawx" in exps:
    # moments of the cosine layers: (norm(h), y) and (h, y)
    chosen = cos_order[:MMAX]
    acc_n = {k: MomentAccumulator(d, d, "cpu", f"n {k}") for k in chosen}
    acc_h = {k: MomentAccumulator(d, d, "cpu", f"h {k}") for k in chosen}
    r = Runner(model)
    for k in chosen:
        def both(h, x, y, k=k):
            acc_n[k].update(x, y)
            acc_h[k].update(h, y)
        r.run_layer(k, Hs_fit[k], both)

    def ridge_map(mom, lam):
        """W = C_YX (C_XX + lam tr(C_XX)/d I)^-1 (shrinkage towards 0), b = E[Y] - W E[X]."""
        cxx = mom.cxx + lam * torch.trace(mom.cxx) / mom.cxx.shape[0] * torch.eye(mom.cxx.shape[0], dtype=mom.cxx.dtype)
        w = torch.linalg.solve(cxx, mom.cyx.T).T
        return w.float().numpy(), (mom.mean_y - w @ mom.mean_x).float().numpy()

    if "shrink" in exps:
        moms = {k: acc_n[k].moments() for k in chosen}
        for lam in (0.01, 0.1):
            for m in MS:
                record(f"shrink{lam}/cosine", m, cos_order[:m], {k: ridge_map(moms[k], lam) for k in cos_order[:m]})

    if "rawx" in exps:
        # the reference code's X: the raw residual h (the layer's norm removed), y = W h + b
        class RawResidualMap(nn.Module):
            def __init__(self, w, b):
                super().__init__()
                self.w, self.b, self.h = torch.as_tensor(w), torch.as_tensor(b), None

            def forward(self, hidden_states, *a, **kw):
                return torch.nn.functional.linear(self.h.float(), self.w, self.b).to(hidden_states.dtype), None

        raw = {k: ridge_map(acc_h[k].moments(), 0.0) for k in chosen}
        for m in MS:
            mdl = copy.deepcopy(model)
            for k in cos_order[:m]:
                layer = models.decoder_layers(mdl)[k]
                module = RawResidualMap(*raw[k])
                setattr(layer, adapter.attn, module)
                layer.register_forward_pre_hook(
                    lambda mod, args, kwargs, module=module: setattr(module, "h", args[0] if args else kwargs["hidden_states"]),
                    with_kwargs=True)
            h = nll(mdl, held_ids)
            rec = {"model": loaded.name, "variant": "rawx/cosine", "m": m, "layers": sorted(cos_order[:m]),
                   "ppl": math.exp(h), "base_ppl": math.exp(base_nll), "increase_pct": 100 * (math.exp(h - base_nll) - 1)}
            print(json.dumps(rec), flush=True)
            out.write(json.dumps(rec) + "\n")
            out.flush()
