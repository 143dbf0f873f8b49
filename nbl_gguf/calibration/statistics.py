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
    """Sums of a stream of (X [n, dx], Y [n, dy]) row pairs, in float64 on `device`."""

    def __init__(self, dx: int, dy: int, device: str | torch.device = "cpu", name: str = "",
                 partial: torch.dtype = torch.float64):
        self.name = name
        self.device = torch.device(device)
        self.partial = partial
        self.n = 0
        f64 = dict(dtype=torch.float64, device=self.device)
        self.shift_x = None
        self.shift_y = None
        self.sum_x = torch.zeros(dx, **f64)
        self.sum_y = torch.zeros(dy, **f64)
        self.sum_xx = torch.zeros(dx, dx, **f64)
        self.sum_yx = torch.zeros(dy, dx, **f64)
        self.sum_yy = torch.zeros(dy, dy, **f64)

    @torch.no_grad()
    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(self.device, self.partial)
        y = y.reshape(-1, y.shape[-1]).to(self.device, self.partial)
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"{self.name}: X has {x.shape[0]} rows but Y has {y.shape[0]}")
        if x.shape[0] == 0:
            return
        if self.shift_x is None:
            # A non-finite first batch would poison the shift; check_finite() reports it later. The
            # shift is kept in the partial dtype, so that it is exactly the value subtracted.
            self.shift_x = torch.nan_to_num(x.double().mean(0)).to(self.partial).double()
            self.shift_y = torch.nan_to_num(y.double().mean(0)).to(self.partial).double()
        x = x - self.shift_x.to(self.partial)
        y = y - self.shift_y.to(self.partial)
        self.n += x.shape[0]
        self.sum_x += x.sum(0, dtype=torch.float64)
        self.sum_y += y.sum(0, dtype=torch.float64)
        if self.partial == torch.float64:
            self.sum_xx.addmm_(x.T, x)
            self.sum_yx.addmm_(y.T, x)
            self.sum_yy.addmm_(y.T, y)
        else:
            self.sum_xx += (x.T @ x).double()
            self.sum_yx += (y.T @ x).double()
            self.sum_yy += (y.T @ y).double()

    def check_finite(self) -> None:
        """A NaN/inf anywhere in X or Y reaches its column sum, so checking the d-vectors suffices."""
        check_finite_sums(self.name, self.sum_x, self.sum_y)

    def moments(self) -> "Moments":
        self.check_finite()
        return moments_from_sums(self.name, self.n, self.sum_x, self.sum_y, self.sum_xx, self.sum_yx, self.sum_yy,
                                 self.shift_x, self.shift_y)


def check_finite_sums(name: str, sum_x: torch.Tensor, sum_y: torch.Tensor) -> None:
    for label, total in (("input", sum_x), ("output", sum_y)):
        if not bool(torch.isfinite(total).all()):
            bad = int((~torch.isfinite(total)).sum())
            raise NblError(f"non-finite activations (NaN/inf) in {name} {label} ({bad} channels); "
                           f"try --dtype fp32 or check the model weights")


def moments_from_sums(name: str, n: int, sum_x, sum_y, sum_xx, sum_yx, sum_yy, shift_x, shift_y) -> "Moments":
    """Means and covariances from sums of shifted rows (x - shift_x, y - shift_y): the shift cancels in
    the covariances and is added back to the means."""
    if n == 0:
        raise NblError(f"{name}: no tokens were accumulated")
    mx, my = sum_x / n, sum_y / n
    # Population (1/n) covariances: the LMMSE solution and every ratio below are scale-free.
    cxx = sum_xx / n - torch.outer(mx, mx)
    cyx = sum_yx / n - torch.outer(my, mx)
    cyy = sum_yy / n - torch.outer(my, my)
    return Moments(n, mx + shift_x, my + shift_y, (cxx + cxx.T) / 2, cyx, (cyy + cyy.T) / 2, name)


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

    def with_residual(self) -> "Moments":
        """Moments of (X, Y + X): the paper scores attention against Y+ = Y + X."""
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
