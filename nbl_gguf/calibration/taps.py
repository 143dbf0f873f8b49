"""Past-token taps (issue 19): the NBL map of a layer that also reads the previous tokens' inputs.

    y_t = W_0 x_t + W_1 x_(t-1) + ... + W_(K-1) x_(t-K+1) + b

x is the layer's attention input (norm(h)), y its attention output; K is the number of taps. Before a
sequence starts there is nothing: positions before the start read as zeros, in the fit (before each
calibration window) as at run time (llama.cpp's state of a new sequence is zero). So the first K-1
tokens of a sequence are predicted from fewer inputs; the fit sees them as ordinary rows (K-1 of each
window's tokens), which the bias and W_0 carry like the others.

Streaming fit: `statistics.MomentAccumulator(d, d, taps=K)` gathers the float64 moments of the
stacked input z_t = [x_t; x_(t-1); ...; x_(t-K+1)] (lag-major, lag 0 first) over windows [batch, seq,
d] (token order matters), and `solve(moments, taps, form, rank)` gives the map in one of the forms
below, as a `TapsMap` holding the tensors a GGUF stores. Every solve takes solve.spd_factor's ridge.

Forms (bytes per layer: `TapsMap.params()`):
  full      the stacked LMMSE, K d x d matrices (W_0 and one lag map [d, (K-1) d]);
  lowrank   W_0 full, the lags through rank r: y = W_0 x_t + U (V z_lags) + b, the closed-form
            reduced-rank regression of the part of y that x_t does not explain on the part of the
            lags that x_t does not explain (exact optimum for the rank);
  channel   per-channel lag weights followed by one shared map: y = W (sum_j c_j * x_(t-j)) + b,
            c_0 = 1; alternating least squares from the moments (each step exact, so the error
            never rises), d x d + (K-1) d weights.

Tensor layout (the GGUF's, docs/gguf-format.md): lag inputs are ordered oldest first,
z_lags = [x_(t-K+1); ...; x_(t-1)], which is how llama.cpp lays out the state and the window of
each token; the per-channel weights `conv` are [K, d], one row per token, oldest first, conv[-1] = c_0 = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nbl_gguf.calibration.solve import nmse, solve_right, spd_factor
from nbl_gguf.calibration.statistics import Moments
from nbl_gguf.errors import NblError

FORMS = ("full", "lowrank", "channel")
# what calibrate --taps fits (docs/results/taps.md): the low-rank form kept nearly all of the full map's
# gain at about half its bytes; its rank scales with the width (128 was measured at d = 576)
DEFAULT_FORM = "lowrank"
RANK_FRACTION = 4  # default rank: n_embd / RANK_FRACTION
# a map's tensors, by their GGUF suffix and their name in the calibration state and artifact (taps.<layer>.<name>)
TENSOR_NAMES = ("weight", "bias", "lag", "lag_down", "lag_up", "conv")
CHANNEL_ITERATIONS = 50
CHANNEL_TOLERANCE = 1e-5  # relative drop of the error below which the alternation stops


@dataclass
class TapsMap:
    """One layer's map, as the GGUF stores it (float64 numpy; see the module doc for the layout).

    y_t = weight @ u_t + bias (+ lag @ z_lags | + lag_up @ (lag_down @ z_lags)), where u_t = x_t, or
    sum_j conv[K-1-j] * x_(t-j) when conv is given, and z_lags = [x_(t-K+1); ...; x_(t-1)].
    """

    taps: int
    weight: np.ndarray  # [d, d]
    bias: np.ndarray  # [d]
    lag: np.ndarray | None = None  # [d, (K-1) d]
    lag_down: np.ndarray | None = None  # [r, (K-1) d]
    lag_up: np.ndarray | None = None  # [d, r]
    conv: np.ndarray | None = None  # [K, d], oldest first; conv[-1] = 1
    nmse: float = float("nan")  # exact E||y - yhat||^2 / Tr(C_yy) on the calibration moments

    @property
    def form(self) -> str:
        if self.conv is not None:
            return "channel"
        return "lowrank" if self.lag_down is not None else "full"

    @property
    def rank(self) -> int | None:
        return None if self.lag_down is None else int(self.lag_down.shape[0])

    def tensors(self) -> dict[str, np.ndarray]:
        """The non-empty tensors by their GGUF suffix (TENSOR_NAMES)."""
        return {name: getattr(self, name) for name in TENSOR_NAMES if getattr(self, name) is not None}

    def params(self) -> int:
        """Weights of the layer (the bias included): its bytes at a given type."""
        return int(sum(t.size for t in self.tensors().values()))

    def stacked(self) -> np.ndarray:
        """The equivalent stacked map [d, K d] on z_t = [x_t; x_(t-1); ...] (lag-major)."""
        d, k = self.weight.shape[0], self.taps
        blocks = [None] * k
        if self.conv is not None:
            for j in range(k):
                blocks[j] = self.weight * self.conv[k - 1 - j][None, :]
        else:
            blocks[0] = self.weight.copy()
            lag = self.lag if self.lag is not None else (self.lag_up @ self.lag_down if self.lag_down is not None else None)
            for j in range(1, k):
                blocks[j] = np.zeros((d, d)) if lag is None else lag[:, (k - 1 - j) * d:(k - j) * d]
        return np.concatenate(blocks, 1)

    def apply(self, x: np.ndarray, past: np.ndarray | None = None) -> np.ndarray:
        """y [T, d] for the inputs x [T, d] of one sequence after the K-1 inputs ``past`` (zeros: its start)."""
        d, k = self.weight.shape[0], self.taps
        past = np.zeros((k - 1, d)) if past is None else past
        xs = np.concatenate([past, x], 0)
        windows = np.stack([xs[t:t + k] for t in range(len(x))])  # [T, K, d], oldest first
        return windows.reshape(len(x), -1) @ self.stacked_oldest_first().T + self.bias

    def stacked_oldest_first(self) -> np.ndarray:
        d, k = self.weight.shape[0], self.taps
        lagged = self.stacked()
        return np.concatenate([lagged[:, j * d:(j + 1) * d] for j in reversed(range(k))], 1)


def _right_solve(b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """b c^-1 for a symmetric positive semi-definite c (solve.spd_factor's ridge)."""
    return solve_right(b, spd_factor((c + c.T) / 2, exact=False)[0])


def _spd_solve(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a^-1 b for a symmetric positive semi-definite a and a vector b."""
    return torch.cholesky_solve(b[:, None], spd_factor((a + a.T) / 2, exact=False)[0])[:, 0]


def _check(m: Moments, taps: int) -> int:
    d = m.cyx.shape[0]
    if m.cxx.shape[0] != taps * d:
        raise NblError(f"{m.name}: moments of {m.cxx.shape[0]} inputs do not stack {taps} taps of {d}")
    if m.n <= m.cxx.shape[0]:
        raise NblError(f"{m.name}: only {m.n} calibration tokens for {m.cxx.shape[0]} stacked inputs; "
                       f"use at least {m.cxx.shape[0] + 1} tokens")
    return d


def _oldest_first(lag_major: torch.Tensor, d: int) -> torch.Tensor:
    """Columns of lags 1..K-1 (lag-major) reordered oldest first, the file's order."""
    k1 = lag_major.shape[1] // d
    return torch.cat([lag_major[:, j * d:(j + 1) * d] for j in reversed(range(k1))], 1)


def _finish(m: Moments, taps: int, stacked: torch.Tensor, **tensors) -> TapsMap:
    bias = m.mean_y - stacked @ m.mean_x
    arrays = {name: None if t is None else t.cpu().numpy() for name, t in tensors.items()}
    return TapsMap(taps=taps, bias=bias.cpu().numpy(), nmse=nmse(m, stacked), **arrays)


def solve_full(m: Moments, taps: int) -> TapsMap:
    """The stacked LMMSE: [W_0, ..., W_(K-1)] = C_yz C_zz^-1."""
    d = _check(m, taps)
    stacked = _right_solve(m.cyx, m.cxx)
    lag = _oldest_first(stacked[:, d:], d) if taps > 1 else None
    return _finish(m, taps, stacked, weight=stacked[:, :d], lag=lag)


def solve_lowrank(m: Moments, taps: int, rank: int) -> TapsMap:
    """W_0 full and the lag map of rank ``rank``: the exact minimum of the error for that rank.

    With a = x_t and z the lags, y's error for a given lag map L is smallest at W_0 = (C_ya - L C_za)
    C_aa^-1, which leaves the regression of y_r = y - E[y|a] on z_r = z - E[z|a]: the best L of rank r
    is P_r L_ols, L_ols = C_(y_r z_r) C_(z_r z_r)^-1 and P_r the projection on the top r eigenvectors of
    L_ols C_(z_r z_r) L_ols^T (reduced-rank regression with identity weight).
    """
    d = _check(m, taps)
    if taps < 2:
        raise NblError("a low-rank lag map needs at least 2 taps")
    if not 1 <= rank <= d:
        raise NblError(f"rank {rank} is outside 1..{d}")
    caa, cza, czz = m.cxx[:d, :d], m.cxx[d:, :d], m.cxx[d:, d:]
    cya, cyz = m.cyx[:, :d], m.cyx[:, d:]
    za_aa = _right_solve(cza, caa)  # C_za C_aa^-1
    czz_r = czz - za_aa @ cza.T
    cyz_r = cyz - _right_solve(cya, caa) @ cza.T
    l_ols = _right_solve(cyz_r, czz_r)
    explained = l_ols @ cyz_r.T
    _, vectors = torch.linalg.eigh((explained + explained.T) / 2)
    up = vectors[:, -rank:].flip(1)  # [d, r], orthonormal, the strongest direction first
    down = up.T @ l_ols  # [r, (K-1) d]
    lag = up @ down
    weight = _right_solve(cya - lag @ cza, caa)
    stacked = torch.cat([weight, lag], 1)
    return _finish(m, taps, stacked, weight=weight, lag_down=_oldest_first(down, d), lag_up=up)


def solve_channel(m: Moments, taps: int, iterations: int = CHANNEL_ITERATIONS,
                  tolerance: float = CHANNEL_TOLERANCE) -> TapsMap:
    """y = W (sum_j c_j * x_(t-j)) + b with c_0 = 1, by alternating exact least-squares steps.

    For fixed c the input u = sum_j c_j * x_(t-j) is linear in z, and W is its LMMSE. For fixed W the
    error is quadratic in c_1..c_(K-1): its normal equations have the blocks (W^T W) * C_(ij)
    (elementwise) and right-hand sides diag(W^T C_(y j) - W^T W C_(0 j)), all from the moments.
    Starting from c = 0 (the per-token map), every step lowers the error.
    """
    d = _check(m, taps)
    k = taps
    czz = m.cxx.reshape(k, d, k, d)
    cyz = m.cyx.reshape(d, k, d)
    c = torch.zeros(k, d, dtype=torch.float64)
    c[0] = 1.0

    def shared_map(c):
        cuu = torch.einsum("id,idje,je->de", c, czz, c)
        weight = _right_solve(torch.einsum("yje,je->ye", cyz, c), cuu)
        return weight, torch.cat([weight * c[j][None, :] for j in range(k)], 1)

    weight, stacked = shared_map(c)
    error = nmse(m, stacked)
    for _ in range(iterations if k > 1 else 0):
        gram = weight.T @ weight
        hessian = torch.cat([torch.cat([gram * czz[i, :, j, :] for j in range(1, k)], 1) for i in range(1, k)], 0)
        rhs = torch.cat([torch.einsum("yk,yk->k", weight, cyz[:, j, :])
                         - torch.einsum("kl,lk->k", gram, czz[0, :, j, :]) for j in range(1, k)])
        c[1:] = _spd_solve(hessian, rhs).reshape(k - 1, d)
        weight, stacked = shared_map(c)
        previous, error = error, nmse(m, stacked)
        if previous - error <= tolerance * max(previous, 1e-300):
            break
    conv = c.flip(0).contiguous()  # [K, d], oldest first
    return _finish(m, taps, stacked, weight=weight, conv=conv)


def solve(m: Moments, taps: int, form: str = "full", rank: int | None = None) -> TapsMap:
    if form == "full":
        return solve_full(m, taps)
    if form == "lowrank":
        if rank is None:
            raise NblError("the lowrank form needs a rank")
        return solve_lowrank(m, taps, rank)
    if form == "channel":
        return solve_channel(m, taps)
    raise NblError(f"unknown taps form '{form}' (use one of {', '.join(FORMS)})")


def default_rank(d: int) -> int:
    return max(1, d // RANK_FRACTION)


# --- in the calibration state and the artifact: one layer's map as tensors "taps.<layer>.<name>" ---------

def map_tensors(layer: int, taps_map: TapsMap) -> dict[str, np.ndarray]:
    return {f"taps.{layer}.{name}": np.asarray(array, dtype=np.float32) for name, array in taps_map.tensors().items()}


def map_from_tensors(get, layer: int, taps: int, names) -> TapsMap:
    """The TapsMap of ``layer`` from ``get(name)`` (the artifact's or the state's reader), for the
    optional tensors among ``names`` present; the weight and the bias are always read, so a missing
    one is ``get``'s error."""
    present = {name: get(f"taps.{layer}.{name}") for name in TENSOR_NAMES
               if name in ("weight", "bias") or f"taps.{layer}.{name}" in names}
    return TapsMap(taps=taps, **present)


def describe(taps_map: TapsMap) -> dict:
    """What the artifact's layer entry records of a fitted taps map."""
    return {"taps": taps_map.taps, "form": taps_map.form, "rank": taps_map.rank, "nmse": float(taps_map.nmse),
            "params": taps_map.params()}
