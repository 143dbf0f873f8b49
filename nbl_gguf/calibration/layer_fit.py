"""One decoder layer's fit: the statistics the calibration pass gathers of it, and what is solved from
them (the artifact's entry and tensors for the layer).

The attention's moments are gathered once, over the stacked inputs of the layer's taps when it has
past-token maps (statistics.MomentAccumulator with taps): the per-token map is the K = 1 case, read
from the leading block of the same moments, so the costliest d x d products are not taken twice.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from nbl_gguf.calibration import taps as taps_fit
from nbl_gguf.calibration.solve import fit, fit_without_bias
from nbl_gguf.calibration.statistics import CALIBRATION_PARTIAL, CosineAccumulator, MomentAccumulator

SMALL_SOLVE = 1024  # at most this hidden size, a CPU solve runs on one thread (see LayerFit.solve)


class LayerFit:
    """The statistics of layer ``index`` (hidden size ``d``) on ``device``: its attention (input ->
    output, over ``taps`` tokens), its decoder block (input -> output) when ``with_block``, and the
    two 1 - cos redundancy scores. ``on_attention`` and ``on_block`` take capture.py's activations."""

    def __init__(self, index: int, d: int, device, with_block: bool, taps: int = 1, partial=CALIBRATION_PARTIAL):
        self.index, self.d, self.taps = index, d, taps
        self.attn = MomentAccumulator(d, d, device, f"layer {index} attention", partial, taps=taps)
        self.attn_cosine = CosineAccumulator(device)
        self.block = MomentAccumulator(d, d, device, f"layer {index} block", partial) if with_block else None
        # ShortGPT's block influence (1 - cos of the block's input and output) costs one pass over states
        # that are here anyway: kept for every layer, the block ranking of `bench --frontier`'s pruned file
        self.block_cosine = CosineAccumulator(device)

    def on_attention(self, h: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
        self.attn.update(x, y)
        self.attn_cosine.update(h, h + y)  # block input vs. hidden state after the attention residual

    def on_block(self, h: torch.Tensor, out: torch.Tensor) -> None:
        if self.block is not None:
            self.block.update(h, out)
        self.block_cosine.update(h, out)

    def check_finite(self) -> None:
        self.attn.check_finite()

    def solve(self, save_covariances: bool = False, taps_rank: int | None = None) -> tuple[dict, dict]:
        """The layer's artifact record: the entry of its scores ({"index", "attn": {...}, "block": {...},
        "taps": {...}}) and its tensors (maps with and without bias, means, canonical correlations, the
        taps map in calibration.taps.DEFAULT_FORM at rank ``taps_rank`` or its default; covariances on
        request)."""
        index = self.index
        # Multithreaded LAPACK eigh/svd on a small matrix gains little and, on a busy CPU, its spinning
        # threads slowed it 10-200x in our measurements; one thread is fast and predictable there.
        small_cpu = self.attn.device.type == "cpu" and self.d <= SMALL_SOLVE
        threads = torch.get_num_threads()
        if small_cpu:
            torch.set_num_threads(1)
        try:
            stacked = self.attn.moments()
            moments = stacked.leading(1)
            attention = fit(moments, residual=True)
            attention = dataclasses.replace(attention, without_bias=fit_without_bias(moments))
            per_target = [("attn", attention, self.attn_cosine.value(), moments)]
            if self.block is not None:
                block_moments = self.block.moments()
                per_target.append(("block", fit(block_moments, residual=False), self.block_cosine.value(),
                                   block_moments))
        finally:
            torch.set_num_threads(threads)
        entry: dict = {"index": index, "block_cosine": self.block_cosine.value()}
        tensors: dict[str, np.ndarray] = {}
        for target, f, cosine, m in per_target:
            entry[target] = {"cca": f.cca_bound, "nmse": f.nmse, "cosine": cosine, "ridge": f.ridge, "cond": f.cond}
            tensors[f"{target}.{index}.weight"] = f.weight.float().cpu().numpy()
            tensors[f"{target}.{index}.bias"] = f.bias.float().cpu().numpy()
            tensors[f"{target}.{index}.mean_x"] = m.mean_x.cpu().numpy()
            tensors[f"{target}.{index}.mean_y"] = m.mean_y.cpu().numpy()
            tensors[f"{target}.{index}.rho"] = f.rho.cpu().numpy()
            if save_covariances:
                for name in ("cxx", "cyx", "cyy"):
                    tensors[f"{target}.{index}.{name}"] = getattr(m, name).cpu().numpy()
        nobias = attention.without_bias
        entry["attn"]["nmse_nobias"] = nobias.nmse
        entry["attn"]["ridge_nobias"] = nobias.ridge
        tensors[f"attn.{index}.weight_nobias"] = nobias.weight.float().cpu().numpy()
        if self.taps > 1:  # with every thread: its K d systems are large enough to gain from them
            taps_map = taps_fit.solve(stacked, self.taps, taps_fit.DEFAULT_FORM,
                                      taps_rank or taps_fit.default_rank(self.d))
            entry["taps"] = taps_fit.describe(taps_map)
            tensors.update(taps_fit.map_tensors(index, taps_map))
        return entry, tensors
