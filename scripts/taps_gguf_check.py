"""Taps maps fitted by scripts/eval_taps.py (--save-maps) written into SmolLM2-135M-Instruct GGUFs and run
by the patched llama.cpp: llama-perplexity of the F32 and q8_0 files on the held-out text, next to the
PyTorch float32 perplexity of the same model (calibration.apply's TapsAttention) on llama.cpp's tokens
and chunks, and the unmodified model's. One JSON line per (m, file) in --out.

    python scripts/taps_gguf_check.py --maps out/taps-maps/full-2.npz --ms 4,8,12 --out docs/results/taps-gguf.jsonl

The llama-perplexity chunks are sequences of one batch each (-b = --ctx-size times the parallel chunks),
so the taps state runs through llama.cpp's hybrid memory with several sequences per batch.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from nbl_gguf import models
from nbl_gguf.calibration.apply import ATTN_TAPS, apply_nbl
from nbl_gguf.calibration.dataset import write_heldout_text
from nbl_gguf.calibration.taps import TapsMap
from nbl_gguf.gguf import nbl_format
from nbl_gguf.gguf.hf_to_gguf import convert_hf_to_gguf
from nbl_gguf.gguf.quantize import quantize
from nbl_gguf.llamacpp.perplexity import perplexity
from nbl_gguf.measurement.torch_ppl import llama_tokens, prompt_text, torch_perplexity

QUALITY_MD_COSINE = "6,7,25,26,5,9,28,29,12,14,17,22"

p = argparse.ArgumentParser()
p.add_argument("--maps", required=True, help="a FORM.npz of scripts/eval_taps.py --save-maps")
p.add_argument("--ms", default="4,8,12")
p.add_argument("--layers", default=QUALITY_MD_COSINE)
p.add_argument("--chunks", type=int, default=24)
p.add_argument("--ctx-size", type=int, default=512)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--work", default=None, help="folder for the GGUFs (default: a temporary one)")
p.add_argument("--out", default="taps-gguf.jsonl")
args = p.parse_args()

import torch  # noqa: E402

torch.set_num_threads(args.threads)
saved = np.load(args.maps)
taps = int(saved["taps"])
maps: dict[int, TapsMap] = {}
for key in saved.files:
    if key.startswith("blk."):
        _, layer, name = key.split(".", 2)
        maps.setdefault(int(layer), TapsMap(taps, None, None))
        setattr(maps[int(layer)], name, saved[key])
order = [int(v) for v in args.layers.split(",")]
work = Path(args.work or tempfile.mkdtemp(prefix="taps-gguf-"))
work.mkdir(parents=True, exist_ok=True)
text = write_heldout_text(work / "heldout.txt")
model_dir = models.default_model_dir()
stock = work / "stock-f32.gguf"
if not stock.exists():
    convert_hf_to_gguf(model_dir, stock, "f32")
tokens, bos = llama_tokens(stock, prompt_text(text))
loaded = models.load_model(str(model_dir), "fp32", "cpu", name=models.EMBEDDED_NAME)
n_layer = len(models.decoder_layers(loaded.model))
out = open(args.out, "a")


def record(**fields):
    print(json.dumps(fields), flush=True)
    out.write(json.dumps(fields) + "\n")
    out.flush()


def gguf_ppl(path):
    t = time.time()
    result = perplexity(path, text, n_ctx=args.ctx_size, chunks=args.chunks, batch=4 * args.ctx_size,
                        threads=args.threads)
    return result, time.time() - t


base = torch_perplexity(loaded.model, tokens, args.ctx_size, chunks=args.chunks, bos=bos)
stock_q8 = quantize(stock, work / "stock-q8_0.gguf", "q8_0")
stock_ppl = {}
for name, path in (("f32", stock), ("q8_0", stock_q8)):
    result, seconds = gguf_ppl(path)
    stock_ppl[name] = result.ppl
    name = f"stock {name}"
    record(file=name, m=0, ppl=result.ppl, error=result.error, torch_ppl=base.ppl, base_torch_ppl=base.ppl,
           chunks=result.chunks, bytes=path.stat().st_size, seconds=round(seconds, 1))
for m in [int(v) for v in args.ms.split(",")]:
    chosen = sorted(order[:m])
    types = [nbl_format.TAPS if i in chosen else nbl_format.ATTENTION for i in range(n_layer)]
    f32 = nbl_format.write_nbl_gguf(stock, work / f"taps-m{m}-f32.gguf", nbl_format.NblLayers(
        types=types, taps={i: maps[i] for i in chosen}, method="attn-taps"), weight_type="F32")
    q8 = quantize(f32, work / f"taps-m{m}-q8_0.gguf", "q8_0")
    reference = apply_nbl(models.load_model(str(model_dir), "fp32", "cpu").model, {i: ATTN_TAPS for i in chosen},
                          {i: maps[i] for i in chosen})
    torch_result = torch_perplexity(reference, tokens, args.ctx_size, chunks=args.chunks, bos=bos)
    del reference
    for kind, path in (("f32", f32), ("q8_0", q8)):
        result, seconds = gguf_ppl(path)
        record(file=f"taps {kind}", maps=Path(args.maps).name, taps=taps, m=m, layers=chosen, ppl=result.ppl, error=result.error,
               torch_ppl=torch_result.ppl, base_torch_ppl=base.ppl, chunks=result.chunks,
               increase_pct=100 * (result.ppl / stock_ppl[kind] - 1), bytes=path.stat().st_size, seconds=round(seconds, 1))
