"""The independent reference of the calibration engine: the whole HF model run at once over the same
windows, every layer's activations kept, and each layer's fit and scores computed in float64 numpy
(least squares, canonical correlations); the held-out losses of the chosen sets measured by the
whole model with those layers replaced (apply.apply_nbl)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch


def layer_activations(model, ids: torch.Tensor) -> list[dict]:
    """Per layer {"h", "x", "y", "out"} [tokens, d] float64: block input, attention input and output,
    block output, from one forward of the whole model."""
    from nbl_gguf.calibration.capture import capture_activations
    from nbl_gguf.models import decoder_layers, get_adapter

    kept = [{"h": [], "x": [], "y": [], "out": []} for _ in decoder_layers(model)]

    def on_attention(i, h, x, y):
        kept[i]["x"].append(x.double().reshape(-1, x.shape[-1]))
        kept[i]["y"].append(y.double().reshape(-1, y.shape[-1]))

    def on_block(i, h, out):
        kept[i]["h"].append(h.double().reshape(-1, h.shape[-1]))
        kept[i]["out"].append(out.double().reshape(-1, out.shape[-1]))

    with torch.no_grad(), capture_activations(model, get_adapter(model), on_attention, on_block):
        model(input_ids=ids, use_cache=False)
    return [{name: torch.cat(parts).numpy() for name, parts in layer.items()} for layer in kept]


def least_squares(x: np.ndarray, y: np.ndarray, intercept: bool = True) -> tuple[np.ndarray, np.ndarray, float]:
    """(W, b, nmse) of y ~ W x + b (b = 0 without intercept); nmse against y's variance."""
    design = np.concatenate([x, np.ones((len(x), 1))], 1) if intercept else x
    solution = np.linalg.lstsq(design, y, rcond=None)[0]
    weight = solution[:x.shape[1]].T
    bias = solution[x.shape[1]] if intercept else np.zeros(y.shape[1])
    residual = y - x @ weight.T - bias
    return weight, bias, float(np.sum(residual**2) / np.sum((y - y.mean(0)) ** 2))


def cca_bound(x: np.ndarray, y: np.ndarray) -> float:
    """sum(1 - rho^2) over the canonical correlations of x and y (orthonormal bases of both, centered)."""
    qx = np.linalg.qr(x - x.mean(0))[0]
    qy = np.linalg.qr(y - y.mean(0))[0]
    rho = np.clip(np.linalg.svd(qx.T @ qy, compute_uv=False), 0, 1)
    return float(np.sum(1 - rho[:min(x.shape[1], y.shape[1])] ** 2))


def ill_conditioned(c: np.ndarray, rcond: float = 1e-10) -> bool:
    """Whether the smallest eigenvalue of the symmetric ``c`` is below ``rcond`` times its largest (where
    the engine's solve adds a ridge)."""
    spectrum = np.linalg.eigvalsh(c)
    return bool(spectrum[0] < rcond * spectrum[-1])


def one_minus_cos(a: np.ndarray, b: np.ndarray) -> float:
    cos = np.sum(a * b, 1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
    return float(np.mean(1 - cos))


def assert_fits_match(artifact, activations: list[dict], tolerance: float) -> None:
    """Every layer's maps (attention with and without bias, block where fitted) and scores against numpy;
    maps compared by their predictions, relative to the spread of what they predict."""
    for layer, acts in enumerate(activations):
        entry = artifact.report["layers"][layer]
        x, y, h, out = acts["x"], acts["y"], acts["h"], acts["out"]
        targets = {"attn": (x, y)}
        if "block" in artifact.targets:
            targets["block"] = (h, out)
        for target, (inputs, outputs) in targets.items():
            weight, bias, nmse = least_squares(inputs, outputs)
            got_w = artifact.tensors[f"{target}.{layer}.weight"].astype(np.float64)
            got_b = artifact.tensors[f"{target}.{layer}.bias"].astype(np.float64)
            spread = np.linalg.norm(outputs - outputs.mean(0))
            difference = np.linalg.norm(inputs @ (got_w - weight).T + (got_b - bias)) / spread
            assert difference < tolerance, (layer, target, difference)
            assert entry[target]["nmse"] == pytest.approx(nmse, rel=100 * tolerance, abs=tolerance), (layer, target)
        assert entry["attn"]["cosine"] == pytest.approx(one_minus_cos(h, h + y), rel=tolerance, abs=1e-9), layer
        assert entry["block_cosine"] == pytest.approx(one_minus_cos(h, out), rel=tolerance, abs=1e-9), layer
        # where C_XX is singular to 1e-10 (a constant channel: SmolLM2's layer 0) the engine adds a ridge
        # (solve.spd_factor), and the canonical correlations of a rank-deficient X have no one right value
        singular = ill_conditioned(np.cov(x.T))
        assert (entry["attn"]["ridge"] > 0) == singular, layer
        if not singular:
            assert entry["attn"]["cca"] == pytest.approx(cca_bound(x, y + x), rel=100 * tolerance, abs=tolerance), layer
        # the map without bias solves E[X X^T], whose ridge the engine decides the same way
        singular = ill_conditioned(x.T @ x / len(x))
        assert (entry["attn"]["ridge_nobias"] > 0) == singular, layer
        if not singular:
            weight, _, _ = least_squares(x, y, intercept=False)
            got = artifact.tensors[f"attn.{layer}.weight_nobias"].astype(np.float64)
            assert np.linalg.norm(x @ (got - weight).T) / np.linalg.norm(y - y.mean(0)) < tolerance, layer


def mean_nll(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].double()
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)))


def replaced_nll(model, artifact, layers, layer_type: int, ids: torch.Tensor) -> float:
    from nbl_gguf.calibration.apply import apply_nbl

    if not layers:
        return mean_nll(model, ids)
    return mean_nll(apply_nbl(copy.deepcopy(model), {i: layer_type for i in layers}, artifact), ids)


def assert_selection_matches(artifact, model, heldout: torch.Tensor, layer_type: int, rel: float = 1e-5) -> None:
    """The held-out perplexities the selection recorded (each prefix of its order, and each set `best`
    compared) are those of the whole model with those layers replaced."""
    heldout_report = artifact.report["selection"]["heldout"]
    base = mean_nll(model, heldout)
    assert heldout_report["base_ppl"] == pytest.approx(math.exp(base), rel=rel)
    order, ppl = heldout_report["order"], heldout_report["ppl"]
    # a walk records every prefix; best at a fixed m the set at once (its last entry)
    prefixes = range(1, len(order) + 1) if len(ppl) == len(order) else [len(order)] * bool(ppl)
    for recorded, m in zip(ppl if len(ppl) == len(order) else ppl[-1:], prefixes):
        assert recorded == pytest.approx(math.exp(replaced_nll(model, artifact, order[:m], layer_type, heldout)),
                                         rel=rel), order[:m]
    for criterion, compared in heldout_report.get("compared", {}).items():
        want = 100 * (math.exp(replaced_nll(model, artifact, compared["layers"], layer_type, heldout) - base) - 1)
        assert compared["ppl_increase_pct"] == pytest.approx(want, rel=100 * rel, abs=1e-3), criterion
