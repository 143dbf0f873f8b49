"""Streaming sufficient statistics of paired activations (X, Y), one accumulator per layer.

Only sums are kept (n, sum x, sum y, sum xx^T, sum yx^T, sum yy^T), so memory is O(d^2) per
layer whatever the token count. Sums are float64 and taken around a fixed shift (the first
batch's mean): hidden states carry large per-channel offsets, and E[xx^T] - E[x]E[x]^T would
otherwise cancel away most significant digits. Each batch's products can be formed in float32
(``partial=torch.float32``) and then added to the float64 sums: on a CPU the d x d products are most
of the statistics' cost, and float32 matmuls run several times faster than float64 ones; the
centered values of one batch (a few thousand rows) lose nothing that matters in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nbl_gguf.errors import NblError

# the calibrator's per-batch products (both paths): float32 partial sums added to float64 totals
CALIBRATION_PARTIAL = torch.float32


class MomentAccumulator:
    """Sums of a stream of (X, Y) row pairs, in float64 on `device`.

    With ``taps`` K > 1 the input of a row is the stacked z_t = [x_t; x_(t-1); ...; x_(t-K+1)]
    (lag-major: lag 0, the token itself, first; calibration.taps fits maps on it), made from the
    token order of windows [batch, seq, dx]; each window starts a sequence, so its lags before the
    start are zeros. The K dx x K dx input sums cost K matrix products per batch, not K^2: the
    blocks E[x_(t-i) x_(t-j)^T] along a diagonal differ only by the terms at the windows' two ends.
    The leading dx block of these moments is what K = 1 gives (``Moments.leading``): one
    accumulator serves both the per-token map and the taps map of a layer.
    """

    def __init__(self, dx: int, dy: int, device: str | torch.device = "cpu", name: str = "",
                 partial: torch.dtype = torch.float64, taps: int = 1):
        if taps < 1:
            raise NblError(f"{name or 'taps'}: the number of taps must be at least 1, got {taps}")
        self.name = name
        self.dx, self.taps = dx, taps
        self.device = torch.device(device)
        self.partial = partial
        self.n = 0
        f64 = dict(dtype=torch.float64, device=self.device)
        self.shift_x = None
        self.shift_y = None
        self.sum_x = torch.zeros(taps * dx, **f64)
        self.sum_y = torch.zeros(dy, **f64)
        self.sum_xx = torch.zeros(taps * dx, taps * dx, **f64)
        self.sum_yx = torch.zeros(dy, taps * dx, **f64)
        self.sum_yy = torch.zeros(dy, dy, **f64)

    def _windows(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y as windows [batch, seq, d] in the partial dtype: rows in any shape for K = 1 (their
        order does not matter there), [batch, seq, d] or one window [seq, d] for K > 1."""
        if self.taps == 1:
            x, y = x.reshape(1, -1, x.shape[-1]), y.reshape(1, -1, y.shape[-1])
            if x.shape[1] != y.shape[1]:
                raise ValueError(f"{self.name}: X has {x.shape[1]} rows but Y has {y.shape[1]}")
        else:
            if x.ndim == 2:
                x, y = x[None], y[None]
            if x.ndim != 3 or x.shape[:2] != y.shape[:2] or x.shape[-1] != self.dx:
                raise ValueError(f"{self.name}: expected X and Y of shape [batch, seq, {self.dx}], "
                                 f"got {tuple(x.shape)} and {tuple(y.shape)}")
        return x.to(self.device, self.partial), y.to(self.device, self.partial)

    @torch.no_grad()
    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = self._windows(x, y)
        batch, seq, d = x.shape
        if batch * seq == 0:
            return
        if self.shift_x is None:
            # A non-finite first batch would poison the shift; check_finite() reports it later. The
            # shift is kept in the partial dtype, so that it is exactly the value subtracted.
            self.shift_x = torch.nan_to_num(x.reshape(-1, d).double().mean(0)).to(self.partial).double()
            self.shift_y = torch.nan_to_num(y.reshape(-1, y.shape[-1]).double().mean(0)).to(self.partial).double()
        k = self.taps
        shift_x = self.shift_x.to(self.partial)
        # p[:, u + k - 1] = x_u - shift for u >= 0 and 0 - shift before the window's start, so
        # that z_j(t) - shift = p[:, t - j + k - 1] for every lag j
        p = x - shift_x if k == 1 else torch.cat([(-shift_x).expand(batch, k - 1, d), x - shift_x], 1)
        yc = (y - self.shift_y.to(self.partial)).reshape(-1, y.shape[-1])

        def lag(j: int) -> torch.Tensor:
            return p[:, k - 1 - j: k - 1 - j + seq].reshape(-1, d)

        self.n += batch * seq
        self.sum_y += yc.sum(0, dtype=torch.float64)
        self.sum_yy += (yc.T @ yc).double()
        current = lag(0)
        first_row = []
        for j in range(k):
            lagged = current if j == 0 else lag(j)
            self.sum_x[j * d:(j + 1) * d] += lagged.sum(0, dtype=torch.float64)
            self.sum_yx[:, j * d:(j + 1) * d] += (yc.T @ lagged).double()
            first_row.append((current.T @ lagged).double())
        # block(i, i + s) = block(i - 1, i - 1 + s) + p_(-i) p_(-i-s)^T - p_(seq-i) p_(seq-i-s)^T
        # (sum over t of p_(t-i) p_(t-i-s)^T, shifted by one position)
        for s in range(k):
            block = first_row[s]
            for i in range(k - s):
                if i > 0:
                    head = p[:, k - 1 - i], p[:, k - 1 - i - s]
                    tail = p[:, k - 1 + seq - i], p[:, k - 1 + seq - i - s]
                    block = block + (head[0].T @ head[1] - tail[0].T @ tail[1]).double()
                j = i + s
                self.sum_xx[i * d:(i + 1) * d, j * d:(j + 1) * d] += block
                if s:
                    self.sum_xx[j * d:(j + 1) * d, i * d:(i + 1) * d] += block.T

    def check_finite(self) -> None:
        """A NaN/inf anywhere in X or Y reaches its column sum, so checking the d-vectors suffices."""
        check_finite_sums(self.name, self.sum_x, self.sum_y)

    def moments(self) -> "Moments":
        """Means and covariances of (X, Y); with taps, of the stacked input (lag-major)."""
        self.check_finite()
        shift_x = None if self.shift_x is None else self.shift_x.repeat(self.taps)
        return moments_from_sums(self.name, self.n, self.sum_x, self.sum_y, self.sum_xx, self.sum_yx, self.sum_yy,
                                 shift_x, self.shift_y, self.taps)


def check_finite_sums(name: str, sum_x: torch.Tensor, sum_y: torch.Tensor) -> None:
    for label, total in (("input", sum_x), ("output", sum_y)):
        if not bool(torch.isfinite(total).all()):
            bad = int((~torch.isfinite(total)).sum())
            raise NblError(f"non-finite activations (NaN/inf) in {name} {label} ({bad} channels); "
                           f"try --dtype fp32 or check the model weights")


def moments_from_sums(name: str, n: int, sum_x, sum_y, sum_xx, sum_yx, sum_yy, shift_x, shift_y,
                      taps: int = 1) -> "Moments":
    """Means and covariances from sums of shifted rows (x - shift_x, y - shift_y): the shift cancels in
    the covariances and is added back to the means."""
    if n == 0:
        raise NblError(f"{name}: no tokens were accumulated")
    mx, my = sum_x / n, sum_y / n
    # Population (1/n) covariances: the LMMSE solution and every ratio below are scale-free.
    cxx = sum_xx / n - torch.outer(mx, mx)
    cyx = sum_yx / n - torch.outer(my, mx)
    cyy = sum_yy / n - torch.outer(my, my)
    return Moments(n, mx + shift_x, my + shift_y, (cxx + cxx.T) / 2, cyx, (cyy + cyy.T) / 2, name, taps)


@dataclass
class Moments:
    """Means and population covariances of one (X, Y) pair, float64."""

    n: int
    mean_x: torch.Tensor
    mean_y: torch.Tensor
    cxx: torch.Tensor
    cyx: torch.Tensor
    cyy: torch.Tensor
    name: str = ""
    taps: int = 1  # the input stacks this many lags of x (MomentAccumulator's taps)

    def leading(self, taps: int) -> "Moments":
        """The moments of the first ``taps`` lags of moments accumulated with more (taps = 1: the
        per-token input): their leading blocks, which the same zero-padded windows would have given."""
        d = self.cxx.shape[0] // self.taps
        if not 1 <= taps <= self.taps:
            raise NblError(f"{self.name}: cannot take {taps} taps from moments of {self.taps}")
        k = taps * d
        return Moments(self.n, self.mean_x[:k], self.mean_y, self.cxx[:k, :k], self.cyx[:, :k], self.cyy, self.name,
                       taps)

    def with_residual(self) -> "Moments":
        """Moments of (X, Y + X): the paper scores attention against Y+ = Y + X."""
        if self.taps != 1:
            raise NblError(f"{self.name}: the residual target needs per-token moments (take .leading(1))")
        cyx = self.cyx + self.cxx
        cyy = self.cyy + self.cyx + self.cyx.T + self.cxx
        return Moments(self.n, self.mean_x, self.mean_y + self.mean_x, self.cxx, cyx, (cyy + cyy.T) / 2,
                       self.name + " (Y+X)")


class CosineAccumulator:
    """Running mean over tokens of 1 - cos(a, b) (the attention/block-drop redundancy criterion)."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.total = torch.zeros((), dtype=torch.float64, device=device)
        self.n = 0

    @torch.no_grad()
    def update(self, a: torch.Tensor, b: torch.Tensor) -> None:
        a = a.reshape(-1, a.shape[-1]).to(self.total.device, torch.float64)
        b = b.reshape(-1, b.shape[-1]).to(self.total.device, torch.float64)
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-12)
        self.total += (1 - cos).sum()
        self.n += a.shape[0]

    def value(self) -> float:
        return float(self.total) / self.n if self.n else float("nan")
