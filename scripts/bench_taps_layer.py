"""One layer's taps fit at a real width, on random activations: the statistics of --windows x --seqlen
tokens (float32 partial sums, as the calibrator) and the default low-rank solve; time and, under
/usr/bin/time -v, peak RSS. The 8B shape (d = 4096, 16 x 2048 tokens):

    PYTHONPATH=. /usr/bin/time -v .venv/bin/python scripts/bench_taps_layer.py
"""
import argparse
import time

import torch

from nbl_gguf.calibration.statistics import CALIBRATION_PARTIAL
from nbl_gguf.calibration.taps import TapsAccumulator, default_rank, solve

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--d", type=int, default=4096)
p.add_argument("--taps", type=int, default=4)
p.add_argument("--windows", type=int, default=16)
p.add_argument("--seqlen", type=int, default=2048)
args = p.parse_args()
d, K, windows, seq = args.d, args.taps, args.windows, args.seqlen
torch.manual_seed(0)
acc = TapsAccumulator(d, K, "cpu", f"d = {d} layer", CALIBRATION_PARTIAL)
mix = torch.randn(d, d) / d**0.5
t = time.perf_counter()
for w in range(windows):
    x = torch.randn(1, seq, d, dtype=torch.bfloat16)
    y = (x.float() @ mix).to(torch.bfloat16)
    acc.update(x, y)
stats = time.perf_counter() - t
t = time.perf_counter()
m = acc.moments()
del acc
fit = solve(m, K, "lowrank", default_rank(d))
print(f"statistics {stats:.1f} s for {windows}x{seq} tokens; solve {time.perf_counter() - t:.1f} s; "
      f"nmse {fit.nmse:.3f}; rank {fit.rank}")
