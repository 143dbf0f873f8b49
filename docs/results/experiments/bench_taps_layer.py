"""One layer's taps fit at a real width, on random activations: the statistics of --windows x --seqlen
tokens (float32 partial sums, as the calibrator) and the default low-rank solve; time and, under
/usr/bin/time -v, peak RSS. The 8B shape (d = 4096, 16 x 2048 tokens):

    PYTHONPATH=. /usr/bin/time -v .venv/bin/python docs/results/experiments/bench_taps_layer.py
    PYTHONPATH=. python3 docs/results/experiments/bench_taps_layer.py --device cuda      # and peak GPU memory
"""
import argparse
import time

import torch

from nbl_gguf.calibration.statistics import CALIBRATION_PARTIAL, MomentAccumulator
from nbl_gguf.calibration.taps import default_rank, solve

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--d", type=int, default=4096)
p.add_argument("--taps", type=int, default=4)
p.add_argument("--windows", type=int, default=16)
p.add_argument("--seqlen", type=int, default=2048)
p.add_argument("--device", default="cpu", help="where the statistics and the solve run, as the calibrator's layer")
args = p.parse_args()
d, K, windows, seq = args.d, args.taps, args.windows, args.seqlen
torch.manual_seed(0)
device = torch.device(args.device)
cuda = device.type == "cuda"


def now() -> float:
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter()


acc = MomentAccumulator(d, d, device, f"d = {d} layer", CALIBRATION_PARTIAL, taps=K)
mix = torch.randn(d, d, device=device) / d**0.5
t = now()
for w in range(windows):
    x = torch.randn(1, seq, d, dtype=torch.bfloat16, device=device)
    y = (x.float() @ mix).to(torch.bfloat16)
    acc.update(x, y)
stats = now() - t
t = now()
m = acc.moments()
del acc
fit = solve(m, K, "lowrank", default_rank(d))
solve_s = now() - t
peak = f"; peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB" if cuda else ""
print(f"statistics {stats:.1f} s for {windows}x{seq} tokens; solve {solve_s:.1f} s; "
      f"nmse {fit.nmse:.3f}; rank {fit.rank}{peak}")
