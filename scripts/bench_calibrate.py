#!/usr/bin/env python
"""Benchmark the calibrator against a re-implementation of the reference NBL algorithm.

Both run in one process on the same token windows:
  ours       one forward pass, hooks fold every layer's (X, Y) -- attention AND block -- into
             float64 running sums; per-layer eigh solve + CCA (nbl_gguf.calibration.calibrate)
  reference  one forward pass that materializes X and Y of every attention layer over all tokens
             (the paper's code path), then per layer float64 torch.cov, explicit inverse,
             W = C_YX C_XX^-1, CCA from inverse square roots
Reports tokens/s, wall time and peak memory per phase, and how far the two solutions differ.

  python scripts/bench_calibrate.py --nsamples 8 --seqlen 512            # embedded SmolLM2-135M
  python scripts/bench_calibrate.py --config llama-3.1-8b --nsamples 16  # random weights, needs a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nbl_gguf import models  # noqa: E402
from nbl_gguf.calibration import dataset
from nbl_gguf.calibration.calibrate import collect_statistics  # noqa: E402
from nbl_gguf.calibration.solve import solve_layer  # noqa: E402
from nbl_gguf.calibration.capture import capture_activations  # noqa: E402

# The real Llama-3.1-8B architecture (config.json of meta-llama/Llama-3.1-8B), weights left random.
CONFIGS = {
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                         rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                         bos_token_id=128000, eos_token_id=128001),
}


class PeakMemory:
    """Peak memory above the phase's starting point: CUDA allocator stats, else sampled process RSS."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = self.peak = self._rss()
            self.stop = threading.Event()
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        self.start = time.perf_counter()
        return self

    def _sample(self):
        while not self.stop.wait(0.01):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self.stop.set()
            self.thread.join()
            self.peak = max(self.peak, self._rss())
        self.seconds = time.perf_counter() - self.start
        self.peak_bytes = self.peak - self.base


def reference_capture(model, adapter, input_ids, batch_size, device):
    """Materialize every attention layer's X and Y over all tokens (kept on the CPU, model dtype)."""
    count = len(models.decoder_layers(model))
    xs = [[] for _ in range(count)]
    ys = [[] for _ in range(count)]

    def on_attention(i, h, x, y):
        xs[i].append(x.reshape(-1, x.shape[-1]).cpu())
        ys[i].append(y.reshape(-1, y.shape[-1]).cpu())

    with torch.no_grad(), capture_activations(model, adapter, on_attention, None):
        for start in range(0, input_ids.shape[0], batch_size):
            models.base_model(model)(input_ids=input_ids[start:start + batch_size].to(device), use_cache=False)
    return xs, ys


def reference_solve(xs, ys, device):
    """Per layer: float64 torch.cov, explicit inverse, CCA bound of (X, Y + X), exact NMSE."""
    results = []
    for x_parts, y_parts in zip(xs, ys):
        x = torch.cat(x_parts).to(device, torch.float64)
        y = torch.cat(y_parts).to(device, torch.float64)
        d = x.shape[1]
        cov = torch.cov(torch.cat([x, y], 1).T, correction=0)
        cxx, cyx, cyy = cov[:d, :d], cov[d:, :d], cov[d:, d:]
        w = cyx @ torch.linalg.inv(cxx)
        b = y.mean(0) - w @ x.mean(0)
        nmse = float(torch.trace(cyy - w @ cyx.T) / torch.trace(cyy))
        yp = y + x
        cov_p = torch.cov(torch.cat([x, yp], 1).T, correction=0)

        def inv_sqrt(c):
            vals, vecs = torch.linalg.eigh(c)
            return vecs @ torch.diag(vals.clamp_min(1e-300).rsqrt()) @ vecs.T

        rho = torch.linalg.svdvals(inv_sqrt(cov_p[d:, d:]) @ cov_p[d:, :d] @ inv_sqrt(cxx)).clamp(0, 1)
        results.append((w, b, nmse, float(torch.sum(1 - rho**2))))
        del x, y, yp, cov, cov_p
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model folder/id (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--config", choices=sorted(CONFIGS), default=None, help="random weights with a real config")
    parser.add_argument("--nsamples", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    parser.add_argument("--skip-reference", action="store_true", help="only time ours (reference memory is O(K N d))")
    parser.add_argument("--json", default="out/bench/calibrate-bench.json")
    args = parser.parse_args()

    device = models.resolve_device(args.device)
    dtype = models.resolve_dtype(args.dtype, device)
    t0 = time.perf_counter()
    if args.config:
        from transformers import AutoModelForCausalLM, LlamaConfig

        config = LlamaConfig(**CONFIGS[args.config])
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        name = f"{args.config} (random weights)"
        gen = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, config.vocab_size, (args.nsamples, args.seqlen), generator=gen)
    else:
        loaded = models.load_model(args.model, args.dtype, device)
        model, name = loaded.model, loaded.name
        calib = dataset.load_calibration(loaded.tokenizer, None, args.nsamples, args.seqlen,
                                      max_positions=models.max_context(model.config))
        input_ids = calib.input_ids
    load_s = time.perf_counter() - t0
    adapter = models.get_adapter(model)
    tokens = int(input_ids.numel())
    stats_device = device

    rows = []
    with PeakMemory(device) as fwd:
        attn, block, _, _ = collect_statistics(model, adapter, input_ids, args.batch_size, device, stats_device)
    with PeakMemory(device) as sol:
        records = [solve_layer(i, a, block[i] if block else None, 0.0, 0.0 if block else None) for i, a in enumerate(attn)]
    rows.append(("ours", fwd, sol))

    diff = {}
    if not args.skip_reference:
        with PeakMemory(device) as rfwd:
            xs, ys = reference_capture(model, adapter, input_ids, args.batch_size, device)
        with PeakMemory(device) as rsol:
            ref = reference_solve(xs, ys, stats_device)
        rows.append(("reference", rfwd, rsol))
        del xs, ys
        # Relative to each layer's ||W||: the two solutions differ only by float64 round-off and conditioning.
        diff = {
            "max_rel_weight_diff": max(float((torch.from_numpy(t[f"attn.{i}.weight"]).double() - r[0]).norm() / r[0].norm())
                                       for i, ((_, t), r) in enumerate(zip(records, ref))),
            "max_abs_nmse_diff": max(abs(e["attn"]["nmse"] - r[2]) for (e, _), r in zip(records, ref)),
            "max_rel_cca_diff": max(abs(e["attn"]["cca"] - r[3]) / max(r[3], 1e-12) for (e, _), r in zip(records, ref)),
            "same_cca_ranking": [i for i, _ in sorted(enumerate(records), key=lambda t: t[1][0]["attn"]["cca"])]
            == [i for i, _ in sorted(enumerate(ref), key=lambda t: t[1][3])],
        }

    gib = 1 / 2**30
    print(f"\n{name}: {tokens} tokens ({args.nsamples} x {input_ids.shape[1]}), device {device}, dtype "
          f"{str(dtype).replace('torch.', '')}, {len(attn)} layers, d = {model.config.hidden_size}, load {load_s:.1f} s")
    print(f"{'algorithm':<10} {'forward+stats s':>16} {'tokens/s':>10} {'peak GiB':>9} {'solve s':>9} "
          f"{'peak GiB':>9} {'total s':>9}")
    result_rows = []
    for label, f, s in rows:
        print(f"{label:<10} {f.seconds:>16.2f} {tokens / f.seconds:>10.0f} {f.peak_bytes * gib:>9.2f} "
              f"{s.seconds:>9.2f} {s.peak_bytes * gib:>9.2f} {f.seconds + s.seconds:>9.2f}")
        result_rows.append({"algorithm": label, "forward_stats_s": f.seconds, "tokens_per_s": tokens / f.seconds,
                            "forward_peak_bytes": f.peak_bytes, "solve_s": s.seconds, "solve_peak_bytes": s.peak_bytes})
    if diff:
        print("agreement:", json.dumps(diff))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": name, "tokens": tokens, "nsamples": args.nsamples, "seqlen": int(input_ids.shape[1]),
        "device": device, "dtype": str(dtype), "layers": len(attn), "hidden_size": model.config.hidden_size,
        "load_s": load_s, "rows": result_rows, "agreement": diff, "command": " ".join(sys.argv),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
    }, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
