"""PyTorch reference of an NBL model: marked layers replaced in place by their linear maps.

This is the ground truth that the GGUF path is compared against, so it follows the HF modules'
calling conventions exactly and keeps the linear maps in float32 whatever the model dtype.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from nbl_gguf.errors import NblError
from nbl_gguf.models import decoder_layers, get_adapter

KEEP, ATTN_LINEAR, ATTN_DROP, BLOCK_LINEAR = 0, 1, 2, 3
LAYER_TYPE_NAMES = {KEEP: "keep", ATTN_LINEAR: "attn-nbl", ATTN_DROP: "attn-drop", BLOCK_LINEAR: "block-nbl"}
METHOD_LAYER_TYPE = {"attn-nbl": ATTN_LINEAR, "attn-drop": ATTN_DROP, "block-nbl": BLOCK_LINEAR}


def _keep_positions(past_key_values, layer_idx: int, hidden_states: torch.Tensor) -> None:
    """Record this step's length in the KV cache without storing anything.

    HF reads the sequence length from layer 0's cache; appending zero-head keys keeps that count
    right when layer 0 is linear, at no memory cost.
    """
    if past_key_values is None or layer_idx is None:
        return
    b, s = hidden_states.shape[:2]
    empty = hidden_states.new_zeros(b, 0, s, 1)
    past_key_values.update(empty, empty, layer_idx)


class _Affine(nn.Module):
    def __init__(self, weight, bias, layer_idx: int | None):
        super().__init__()
        # copies: the maps may come read-only from a memory-mapped file (the artifact, a GGUF)
        weight = torch.tensor(np.asarray(weight), dtype=torch.float32)
        bias = torch.tensor(np.asarray(bias), dtype=torch.float32)
        if weight.ndim != 2 or weight.shape[0] != weight.shape[1] or bias.shape != weight.shape[:1]:
            raise NblError(f"layer {layer_idx}: expected a square weight and matching bias, got "
                           f"{tuple(weight.shape)} and {tuple(bias.shape)}")
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)
        self.layer_idx = layer_idx

    def affine(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.float(), self.weight, self.bias).to(x.dtype)


class LinearAttention(_Affine):
    """Stands in for an attention module: returns (W x + b, None) like HF attention does."""

    def forward(self, hidden_states, *args, past_key_values=None, **kwargs):
        _keep_positions(past_key_values, self.layer_idx, hidden_states)
        return self.affine(hidden_states), None


class ZeroAttention(nn.Module):
    """A dropped attention: the block reduces to h + 0 followed by the MLP."""

    def __init__(self, layer_idx: int | None):
        super().__init__()
        self.layer_idx = layer_idx

    def forward(self, hidden_states, *args, past_key_values=None, **kwargs):
        _keep_positions(past_key_values, self.layer_idx, hidden_states)
        return torch.zeros_like(hidden_states), None


class LinearBlock(_Affine):
    """Stands in for a whole decoder layer: h -> W h + b (norms, attention, MLP and residuals)."""

    def __init__(self, weight, bias, layer_idx, tuple_output: bool):
        super().__init__(weight, bias, layer_idx)
        self.tuple_output = tuple_output

    def forward(self, hidden_states, *args, past_key_values=None, **kwargs):
        _keep_positions(past_key_values, self.layer_idx, hidden_states)
        out = self.affine(hidden_states)
        return (out,) if self.tuple_output else out


def _layer_types(layer_types, count: int) -> dict[int, int]:
    if isinstance(layer_types, Mapping):
        types = {int(k): int(v) for k, v in layer_types.items()}
    else:
        types = {i: int(t) for i, t in enumerate(layer_types)}
        if len(types) != count:
            raise NblError(f"layer_types has {len(types)} entries but the model has {count} layers")
    for index, kind in types.items():
        if not 0 <= index < count:
            raise NblError(f"layer {index} is out of range for a model with {count} layers")
        if kind not in LAYER_TYPE_NAMES:
            raise NblError(f"layer {index}: unknown layer type {kind} (use 0 keep, 1 attn-nbl, 2 attn-drop, 3 block-nbl)")
    return types


def _lookup(linear, index: int, target: str):
    if linear is None:
        raise NblError(f"layer {index} needs linear weights but none were given")
    if hasattr(linear, "linear"):  # a CalibrationArtifact
        return linear.linear(index, target)
    if index not in linear:
        raise NblError(f"no linear weights for layer {index}")
    return linear[index]


def apply_nbl(model, layer_types: Sequence[int] | Mapping[int, int], linear=None):
    """Replace marked layers of `model` in place and return it.

    layer_types: per layer (sequence) or {layer: type}; 0 keep, 1 attention -> W x + b,
    2 attention -> 0, 3 whole decoder layer -> W h + b.
    linear: {layer: (W, b)} with W [d, d] (y = W x + b), or a CalibrationArtifact (its attention
    maps serve type 1, its block maps type 3).
    """
    adapter = get_adapter(model)
    layers = decoder_layers(model)
    tuple_output = int(__import__("transformers").__version__.split(".")[0]) < 5
    for index, kind in sorted(_layer_types(layer_types, len(layers)).items()):
        layer = layers[index]
        device = next(layer.parameters()).device
        if kind == ATTN_LINEAR:
            weight, bias = _lookup(linear, index, "attn")
            setattr(layer, adapter.attn, LinearAttention(weight, bias, index).to(device))
        elif kind == ATTN_DROP:
            setattr(layer, adapter.attn, ZeroAttention(index))
        elif kind == BLOCK_LINEAR:
            weight, bias = _lookup(linear, index, "block")
            layers[index] = LinearBlock(weight, bias, index, tuple_output).to(device)
        if kind in (ATTN_LINEAR, ATTN_DROP) and adapter.attn_out_norm:
            # W x + b already is the block's output after this norm (the fit was taken there)
            setattr(layer, adapter.attn_out_norm, nn.Identity())
    return model


def replace_layer(model, layer: int, layer_type: int, linear):
    """Replace ``layer`` (apply_nbl) and return the function that puts the original modules back."""
    adapter = get_adapter(model)
    layers = decoder_layers(model)
    block = layers[layer]
    saved = {name: getattr(block, name) for name in (adapter.attn, adapter.attn_out_norm) if name}
    apply_nbl(model, {layer: layer_type}, linear)

    def restore():
        layers[layer] = block  # a block-nbl layer replaced the whole decoder layer
        for name, module in saved.items():
            setattr(block, name, module)

    return restore
