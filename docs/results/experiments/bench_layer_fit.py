"""One layer of the main job's calibration (--taps 4, d 576, 8 windows of 2048 tokens of correlated
activations): the statistics, then the solves (the per-token map with and without bias, the taps map),
before and after the one-engine change of issue 31, on one thread so that the two compare on a shared
machine. Prints seconds; alternate the two trees:

    cd /tmp && PYTHONPATH=<tree at cd43e5f> python <this file>; PYTHONPATH=<tree now> python <this file>
"""
import time

import torch

import nbl_gguf.calibration.statistics as st

torch.set_num_threads(1)
torch.manual_seed(0)
d, k = 576, 4
base = torch.randn(1, 2048 + 3, d)
x = ((base[:, 3:] + 0.8 * base[:, 2:-1] + 0.5 * base[:, 1:-2]) * torch.logspace(-2, 1, d))
y = x @ torch.randn(d, d) / 30 + x.roll(1, 1) @ torch.randn(d, d) / 30
old = not hasattr(st.MomentAccumulator(2, 2), "taps")
from nbl_gguf.calibration import taps as T, solve as S
t0 = time.perf_counter()
if old:
    attn = st.MomentAccumulator(d, d, "cpu", "a", torch.float32); past = T.TapsAccumulator(d, k, "cpu", "t", torch.float32)
    for w in range(8):
        attn.update(x, y); past.update(x, y)
    per_token, stacked = attn.moments(), past.moments()
else:
    acc = st.MomentAccumulator(d, d, "cpu", "a", torch.float32, taps=k)
    for w in range(8):
        acc.update(x, y)
    stacked = acc.moments(); per_token = stacked.leading(1)
t1 = time.perf_counter()
S.fit(per_token, residual=True)
S.fit_without_bias(per_token)
t2 = time.perf_counter()
T.solve(stacked, k, T.DEFAULT_FORM, T.default_rank(d))
t3 = time.perf_counter()
print(f"{'before' if old else 'after '}  statistics {t1 - t0:5.2f} s  per-token solve {t2 - t1:5.2f} s  taps solve {t3 - t2:5.2f} s", flush=True)
