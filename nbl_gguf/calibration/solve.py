"""From moments to a linear replacement and redundancy scores, and from scores to a selection.

Theorem used by the CCA score (NBL paper, Algorithm 2): let rho_i be the canonical correlations
of X and Z. The LMMSE fit of Z from X has error covariance
    E = C_ZZ - C_ZX C_XX^-1 C_XZ = C_ZZ^1/2 (I - K K^T) C_ZZ^1/2,  K = C_ZZ^-1/2 C_ZX C_XX^-1/2,
and the singular values of K are the rho_i, so
    NMSE_Z = Tr(E) / Tr(C_ZZ) <= lambda_max(C_ZZ)/Tr(C_ZZ) * sum(1 - rho_i^2) <= sum(1 - rho_i^2).
For attention, Z = Y+ = Y + X. The residual of Y+ equals the residual of Y (X is predicted
exactly), so the bound covers MSE(Y) / Tr(C_Y+Y+) -- *not* MSE(Y) / Tr(C_YY), which can exceed
it when the attention output is small next to X (see tests/test_calibrate_solve.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from nbl_gguf.errors import NblError
from nbl_gguf.calibration.statistics import Moments

RCOND = 1e-10  # eigenvalues of C_XX below RCOND * max get a ridge; float64 solves are safe above it


@dataclass
class LinearFit:
    weight: torch.Tensor  # [dy, dx] float64, y ~ weight @ x + bias
    bias: torch.Tensor  # [dy] float64
    ridge: float  # 0.0 unless C_XX was ill-conditioned
    cond: float  # condition number of C_XX (estimated above EIGENVALUES_UP_TO)
    nmse: float  # exact E||Y - W X - b||^2 / Tr(C_YY) (solve.nmse)
    cca_bound: float  # sum(1 - rho^2) between X and Y (+ X for attention)
    rho: torch.Tensor = field(repr=False)  # canonical correlations, descending
    without_bias: "BiasFreeFit | None" = None  # the map for a slot without bias (solve_all adds it for attention)


@dataclass
class BiasFreeFit:
    """y ~ weight @ x with no bias: what stock llama.cpp's deci "linear attention" layer computes."""

    weight: torch.Tensor  # [dy, dx] float64
    ridge: float
    cond: float  # condition number of E[X X^T]
    nmse: float  # exact E||Y - W X||^2 / Tr(C_YY): the same denominator as LinearFit.nmse, so the two compare


def _check_tokens(m: Moments) -> None:
    d = m.cxx.shape[0]
    if m.n <= d:
        raise NblError(f"{m.name}: only {m.n} calibration tokens for hidden size {d}; the covariance is singular. "
                       f"Use at least {d + 1} tokens (more --nsamples or a longer --seqlen)")


def _eigvals(c: torch.Tensor) -> torch.Tensor:
    """Eigenvalues of a symmetric PSD matrix, ascending, clipped at 0 (eigenvalues only: several times
    cheaper than a full eigendecomposition at d = 4096)."""
    return torch.linalg.eigvalsh(c).clamp_min(0)


def _floor(values: torch.Tensor, rcond: float) -> float:
    """Ridge needed so that the smallest eigenvalue is at least rcond * the largest."""
    top = float(values[-1])
    if top <= 0:
        return 1.0  # all-zero input: any ridge gives W = 0, the only sensible answer
    low = float(values[0])
    return 0.0 if low >= rcond * top else rcond * top - low


def _cond(values: torch.Tensor) -> float:
    return float(values[-1] / values[0]) if values[0] > 0 else float("inf")


def _cholesky(c: torch.Tensor, ridge: float) -> torch.Tensor:
    """Lower Cholesky factor of C + ridge I. The ridge keeps the smallest eigenvalue at RCOND x the
    largest, a condition number float64 factors reliably; a factorization that still fails gets a
    larger ridge rather than an error (it only happens on data that is singular to rounding)."""
    eye = torch.eye(c.shape[0], dtype=c.dtype, device=c.device)
    extra = 0.0
    for _ in range(8):
        factor, info = torch.linalg.cholesky_ex(c + (ridge + extra) * eye)
        if int(info) == 0:
            return factor
        extra = max(extra * 100, float(c.diagonal().abs().max()) * 1e-12, 1e-300)
    raise NblError("the calibration covariance is not positive definite even with a ridge (NaN in the statistics?)")


# Above this size a layer's ridge test and condition number skip eigvalsh (see spd_factor)
EIGENVALUES_UP_TO = 1024
COND_BLOCK, COND_ITERATIONS = 8, 12


def spd_factor(c: torch.Tensor, rcond: float = RCOND, exact: bool = True) -> tuple[torch.Tensor, float, float]:
    """(L, ridge, cond): the lower Cholesky factor of C + ridge I, the ridge that keeps C's smallest
    eigenvalue at ``rcond`` times its largest (0 for a well-conditioned C: _floor), and C's condition
    number. The one policy of every solve of the calibration (per-token, block and taps maps).

    At d = 4096, eigvalsh takes 3.5 s on 2 cores and a layer's solve calls it three times for this
    alone (docs/results/scale-cpu.md), to decide a ridge that activations rarely need. Above
    EIGENVALUES_UP_TO, a Cholesky of C - rcond Tr(C) I decides it instead: it succeeds only when the
    smallest eigenvalue is above rcond Tr(C) >= rcond max, where _floor's ridge is 0; cond is then
    estimated by subspace iteration at both ends (from below: 2-5% low on dense spectra). Where it
    fails, the eigenvalues decide, as for any smaller C.

    ``exact=False`` (the taps systems, which only need solving: nothing reports their ridge or cond)
    always adds the ridge rcond Tr(C), at most n times the exact one and as negligible, and factors
    once; cond is nan. Their K d systems are often ill-conditioned (the lags are correlated), where
    the exact rule's eigenvalues cost more than the rest of a layer's solve, and a test factorization
    besides the real one cost a quarter more (measured on the main job's layers, one thread)."""
    if not exact:
        ridge = rcond * max(float(torch.trace(c)), 0.0)
        return _cholesky(c, ridge), ridge, float("nan")
    if c.shape[0] > EIGENVALUES_UP_TO:
        scale = float(torch.trace(c))
        if scale > 0:
            eye = torch.eye(c.shape[0], dtype=c.dtype, device=c.device)
            if int(torch.linalg.cholesky_ex(c - rcond * scale * eye)[1]) == 0:
                factor = _cholesky(c, 0.0)
                return factor, 0.0, _estimated_cond(c, factor)
    values = _eigvals(c)
    ridge = _floor(values, rcond)
    return _cholesky(c, ridge), ridge, _cond(values)


def _estimated_cond(c: torch.Tensor, factor: torch.Tensor) -> float:
    """lambda_max(C) / lambda_min(C) from block subspace iteration on C and on C^-1 (through its Cholesky
    factor), each ending in the largest Ritz value; a fixed start, so that the result repeats."""
    generator = torch.Generator(device=c.device).manual_seed(0)
    start = torch.randn(c.shape[0], COND_BLOCK, generator=generator, dtype=c.dtype, device=c.device)

    def largest(apply) -> float:
        basis = start
        for _ in range(COND_ITERATIONS):
            basis = torch.linalg.qr(apply(basis)).Q
        return float(torch.linalg.eigvalsh(basis.T @ apply(basis))[-1])

    return largest(lambda v: c @ v) * largest(lambda v: torch.cholesky_solve(v, factor))


def solve_right(b: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """B (L L^T)^-1 for the Cholesky factor L (spd_factor's)."""
    return torch.cholesky_solve(b.T, factor).T


def nmse(m: Moments, weight: torch.Tensor) -> float:
    """E||y - (W x + b)||^2 / Tr(C_YY) with the best bias b, exact from the moments for any map W
    (a ridge, a low rank or a constrained form moves W off the LMMSE optimum)."""
    total = float(torch.trace(m.cyy))
    mse = total - 2 * float(torch.sum(weight * m.cyx)) + float(torch.sum((weight @ m.cxx) * weight))
    return max(mse, 0.0) / total if total > 0 else 0.0


def canonical_correlations(cxx: torch.Tensor, cyx: torch.Tensor, cyy: torch.Tensor, rcond: float = RCOND,
                           factor_x=None) -> torch.Tensor:
    """Singular values of C_YY^-1/2 C_YX C_XX^-1/2 (both sides whitened, each with its ridge), clipped to
    [0, 1], descending. Any whitening gives the same singular values, so the Cholesky factors serve:
    rho^2 are the eigenvalues of K K^T with K = L_Y^-1 C_YX L_X^-T. ``factor_x``: L_X, when known."""
    if factor_x is None:
        factor_x = spd_factor(cxx, rcond)[0]
    factor_y = spd_factor(cyy, rcond)[0]
    k = torch.linalg.solve_triangular(factor_y, cyx, upper=False)
    k = torch.linalg.solve_triangular(factor_x, k.T, upper=False).T
    squared = torch.linalg.eigvalsh(k @ k.T).flip(0)
    return squared[:min(cxx.shape[0], cyy.shape[0])].clamp(0, 1).sqrt()


def fit(m: Moments, residual: bool = False, rcond: float = RCOND) -> LinearFit:
    """LMMSE map W = C_YX C_XX^-1, b = E[Y] - W E[X], with its exact NMSE and CCA bound.

    residual=True scores against Y + X (the attention case); W and b always predict Y itself.
    """
    _check_tokens(m)
    factor, ridge, cond = spd_factor(m.cxx, rcond)
    weight = solve_right(m.cyx, factor)  # C_YX (C_XX + ridge I)^-1
    bias = m.mean_y - weight @ m.mean_x
    target = m.with_residual() if residual else m
    rho = canonical_correlations(target.cxx, target.cyx, target.cyy, rcond, factor_x=factor)
    return LinearFit(weight, bias, ridge, cond, nmse(m, weight), float(torch.sum(1 - rho**2)), rho)


def fit_without_bias(m: Moments, rcond: float = RCOND) -> BiasFreeFit:
    """LMMSE map without intercept, W0 = E[Y X^T] E[X X^T]^-1, from the uncentered second moments
    E[X X^T] = C_XX + mu_x mu_x^T and E[Y X^T] = C_YX + mu_y mu_x^T (same solve and ridge rule as
    `fit`). Its NMSE is never below `fit`'s: the difference is what the missing bias costs."""
    _check_tokens(m)
    sxx = m.cxx + torch.outer(m.mean_x, m.mean_x)
    sxx = (sxx + sxx.T) / 2
    syx = m.cyx + torch.outer(m.mean_y, m.mean_x)
    factor, ridge, cond = spd_factor(sxx, rcond)
    weight = solve_right(syx, factor)
    # E||Y - W X||^2 = Tr(S_YY) - 2 Tr(W S_XY) + Tr(W S_XX W^T), exact with or without a ridge
    syy_trace = float(torch.trace(m.cyy) + m.mean_y @ m.mean_y)
    mse = syy_trace - 2 * float(torch.sum(weight * syx)) + float(torch.sum((weight @ sxx) * weight))
    total = float(torch.trace(m.cyy))
    if total > 0:
        error = max(mse, 0.0) / total
    else:  # a constant Y: only its mean is left to predict, which a map without bias may miss
        error = 0.0 if mse <= 1e-12 * max(syy_trace, 1e-300) else float("inf")
    return BiasFreeFit(weight, ridge, cond, error)


def select_layers(scores, m: int) -> list[int]:
    """Indices of the m lowest scores (most redundant first in ties: lower index wins), sorted."""
    scores = np.asarray(scores, dtype=np.float64)
    if m < 0:
        raise NblError(f"--m must be non-negative, got {m}")
    if m > len(scores):
        raise NblError(f"--m {m} is larger than the model's {len(scores)} layers")
    if np.isnan(scores).any():
        raise NblError("cannot rank layers: some scores are NaN")
    order = np.argsort(scores, kind="stable")
    return sorted(int(i) for i in order[:m])


def ranking(scores) -> list[int]:
    """All layer indices, most redundant (lowest score) first."""
    return [int(i) for i in np.argsort(np.asarray(scores, dtype=np.float64), kind="stable")]
