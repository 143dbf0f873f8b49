"""One layer's solve at a real width (layer_fit.LayerFit.solve: maps with and without bias, CCA scores), with
the ridge decided by a shifted Cholesky (the default above solve.EIGENVALUES_UP_TO) and by eigvalsh,
side by side in one run on the same moments; prints both times and how far the results differ.
Random activations with a spread spectrum (condition number about 1e6) stand in for a layer's. The 8B
shape (d = 4096):

    PYTHONPATH=. .venv/bin/python docs/results/experiments/bench_solve_layer.py
"""
import argparse
import time

import numpy as np
import torch

from nbl_gguf.calibration import solve
from nbl_gguf.calibration.layer_fit import LayerFit

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--d", type=int, default=4096)
p.add_argument("--tokens", type=int, default=8192)
p.add_argument("--repeats", type=int, default=2)
args = p.parse_args()
d = args.d
torch.manual_seed(0)
basis = torch.linalg.qr(torch.randn(d, d)).Q
scale = torch.logspace(-2, 1, d)
mix = torch.randn(d, d) / d**0.5
layer = LayerFit(0, d, "cpu", with_block=False)
for start in range(0, args.tokens, 2048):
    x = (torch.randn(2048, d) * scale) @ basis
    layer.attn.update(x[None], (x @ mix + 0.1 * torch.randn(2048, d))[None])

results = {}
for repeat in range(args.repeats):
    for name, limit in (("eigvalsh", 10**9), ("shifted Cholesky", solve.EIGENVALUES_UP_TO)):
        solve.EIGENVALUES_UP_TO = limit
        start = time.perf_counter()
        entry, tensors = layer.solve()
        print(f"{name}: {time.perf_counter() - start:.1f} s (cond {entry['attn']['cond']:.4g}, "
              f"ridge {entry['attn']['ridge']:g})", flush=True)
        results[name] = entry, tensors
(exact, exact_tensors), (fast, fast_tensors) = results["eigvalsh"], results["shifted Cholesky"]
worst = max(float(np.abs(fast_tensors[k] - exact_tensors[k]).max() / max(np.abs(exact_tensors[k]).max(), 1e-30))
            for k in exact_tensors)
print(f"largest difference of a tensor, relative to its largest entry: {worst:.1e}; cca {fast['attn']['cca']:.6g} "
      f"vs {exact['attn']['cca']:.6g}; nmse {fast['attn']['nmse']:.6g} vs {exact['attn']['nmse']:.6g}")
