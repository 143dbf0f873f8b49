"""Streaming float64 statistics: batch-invariance, precision at scale, non-finite input."""

import numpy as np
import pytest
import torch

from nbl_gguf.errors import NblError
from nbl_gguf.calibration.statistics import CosineAccumulator, MomentAccumulator


def test_streamed_batches_equal_one_shot():
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((1000, 12)) + 5)
    y = torch.from_numpy(rng.standard_normal((1000, 12)) @ rng.standard_normal((12, 12)))
    one = MomentAccumulator(12, 12)
    one.update(x, y)
    streamed = MomentAccumulator(12, 12)
    for chunk in (slice(0, 7), slice(7, 300), slice(300, 301), slice(301, 1000)):
        streamed.update(x[chunk], y[chunk])
    a, b = one.moments(), streamed.moments()
    assert a.n == b.n == 1000
    for name in ("mean_x", "mean_y", "cxx", "cyx", "cyy"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-12, atol=1e-12)
    # And both equal numpy's two-pass covariance.
    reference = np.cov(np.hstack([x.numpy(), y.numpy()]).T, bias=True)
    np.testing.assert_allclose(b.cyx.numpy(), reference[12:, :12], atol=1e-10)


def test_float64_accumulation_is_accurate_at_a_million_tokens_with_large_offset():
    rng = np.random.default_rng(1)
    n, d, batch = 1_000_000, 4, 50_000
    offset = 1e4
    mix = rng.standard_normal((d, d))
    x32 = (rng.standard_normal((n, d)) @ mix + offset).astype(np.float32)  # activations arrive as float32
    y32 = (x32 - offset) @ rng.standard_normal((d, d)).astype(np.float32) + np.float32(offset / 2)
    acc = MomentAccumulator(d, d)
    for start in range(0, n, batch):
        acc.update(torch.from_numpy(x32[start:start + batch]), torch.from_numpy(y32[start:start + batch]))
    m = acc.moments()
    # Two-pass reference in float64 (centre first, then multiply): no cancellation.
    x, y = x32.astype(np.float64), y32.astype(np.float64)
    xc, yc = x - x.mean(0), y - y.mean(0)
    ref_xx, ref_yx = xc.T @ xc / n, yc.T @ xc / n
    np.testing.assert_allclose(m.cxx.numpy(), ref_xx, rtol=0, atol=1e-9 * np.abs(ref_xx).max())
    np.testing.assert_allclose(m.cyx.numpy(), ref_yx, rtol=0, atol=1e-9 * np.abs(ref_yx).max())
    np.testing.assert_allclose(m.mean_x.numpy(), x.mean(0), rtol=1e-13)
    # The naive float32 one-pass formula fails on the same data: that is what float64 + shift buys.
    s = torch.from_numpy(x32)
    naive = (s.T @ s) / n - torch.outer(s.mean(0), s.mean(0))
    assert np.abs(naive.numpy() - ref_xx).max() > 1e-2 * np.abs(ref_xx).max()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_activations_name_the_layer(bad):
    acc = MomentAccumulator(4, 4, name="layer 7 attention")
    x = torch.randn(10, 4)
    y = torch.randn(10, 4)
    y[3, 2] = bad
    acc.update(x, y)
    with pytest.raises(NblError, match=r"non-finite activations \(NaN/inf\) in layer 7 attention output"):
        acc.check_finite()
    with pytest.raises(NblError, match="layer 7 attention"):
        acc.moments()


def test_cosine_accumulator_is_mean_of_one_minus_cosine():
    a = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
    b = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])
    acc = CosineAccumulator()
    acc.update(a[:2], b[:2])
    acc.update(a[2:], b[2:])
    assert acc.value() == pytest.approx((0 + 1 + 2) / 3)
