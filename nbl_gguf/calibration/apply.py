"""PyTorch reference of an NBL model: marked layers replaced in place by their linear maps.

This is the ground truth that the GGUF path is compared against, so it follows the HF modules'
calling conventions exactly and keeps the linear maps in float32 whatever the model dtype.
"""

from __future__ import annotations

import functools
from typing import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from nbl_gguf.errors import NblError
from nbl_gguf.models import decoder_layers, get_adapter

KEEP, ATTN_LINEAR, ATTN_DROP, BLOCK_LINEAR, ATTN_TAPS, ATTN_WINDOW = 0, 1, 2, 3, 4, 5
LAYER_TYPE_NAMES = {KEEP: "keep", ATTN_LINEAR: "attn-nbl", ATTN_DROP: "attn-drop", BLOCK_LINEAR: "block-nbl",
                    ATTN_TAPS: "attn-taps", ATTN_WINDOW: "window"}
METHOD_LAYER_TYPE = {"attn-nbl": ATTN_LINEAR, "attn-drop": ATTN_DROP, "block-nbl": BLOCK_LINEAR}


def _cache(past_key_values, kwargs):
    """The KV cache a replaced module is called with: transformers 5 passes it as `cache`, earlier
    versions as `past_key_values`."""
    return kwargs.get("cache", past_key_values)


def _keep_positions(past_key_values, layer_idx: int, hidden_states: torch.Tensor) -> None:
    """Record this step's length in the KV cache, storing next to nothing.

    HF reads the sequence length from layer 0's cache; appending one-element keys per token keeps
    that count right when layer 0 is replaced (transformers 5 counts an empty cache as length 0, so
    keys without elements would not do).
    """
    if past_key_values is None or layer_idx is None:
        return
    b, s = hidden_states.shape[:2]
    placeholder = hidden_states.new_zeros(b, 1, s, 1)
    past_key_values.update(placeholder, placeholder, layer_idx)


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
        _keep_positions(_cache(past_key_values, kwargs), self.layer_idx, hidden_states)
        return self.affine(hidden_states), None


class ZeroAttention(nn.Module):
    """A dropped attention: the block reduces to h + 0 followed by the MLP."""

    def __init__(self, layer_idx: int | None):
        super().__init__()
        self.layer_idx = layer_idx

    def forward(self, hidden_states, *args, past_key_values=None, **kwargs):
        _keep_positions(_cache(past_key_values, kwargs), self.layer_idx, hidden_states)
        return torch.zeros_like(hidden_states), None


class TapsAttention(nn.Module):
    """Stands in for an attention module with a past-token map (calibration.taps.TapsMap): y_t reads
    x_t and the K-1 inputs before it, zeros before the sequence's start.

    Without a cache (a whole sequence at once) the past starts at zero. With HF's KV cache (generate,
    or a manual decode loop passing past_key_values), the layer keeps the last K-1 inputs of every
    row on the cache object itself, next to the position count it reached, so a cache continued step
    by step gives what the full recompute gives, and a new cache starts from zero. A cache whose length
    no longer matches the kept inputs (cropped, or reordered by beam search) is refused.
    """

    STATE = "_nbl_taps_state"  # attribute of the HF cache object: {layer: (inputs [b, K-1, d], positions)}

    def __init__(self, taps_map, layer_idx: int | None):
        super().__init__()
        d = taps_map.weight.shape[0]
        self.taps, self.layer_idx = int(taps_map.taps), layer_idx

        def buffer(name, array):
            tensor = None if array is None else torch.as_tensor(np.asarray(array), dtype=torch.float32)
            self.register_buffer(name, tensor)

        if taps_map.weight.shape != (d, d) or taps_map.bias.shape != (d,):
            raise NblError(f"layer {layer_idx}: expected a square taps weight and matching bias")
        for name, value in taps_map.tensors().items():
            buffer(name, value)
        for name in ("lag", "lag_down", "lag_up", "conv"):
            if not hasattr(self, name):
                buffer(name, None)

    def _past(self, past_key_values, x: torch.Tensor) -> torch.Tensor:
        b, _, d = x.shape
        zeros = x.new_zeros(b, self.taps - 1, d)
        if past_key_values is None or self.layer_idx is None:
            return zeros
        seen = past_key_values.get_seq_length(self.layer_idx)
        kept = getattr(past_key_values, self.STATE, {}).get(self.layer_idx)
        if seen == 0:
            return zeros
        if kept is None or kept[1] != seen or kept[0].shape[0] != b:
            raise NblError(f"layer {self.layer_idx}: the KV cache holds {seen} positions but the taps state "
                           f"{'none' if kept is None else kept[1]}: a cache cropped or reordered cannot "
                           f"continue a taps layer; recompute from the start")
        return kept[0]

    def forward(self, hidden_states, *args, past_key_values=None, **kwargs):
        past_key_values = _cache(past_key_values, kwargs)
        x = hidden_states.float()
        past = self._past(past_key_values, x)
        _keep_positions(past_key_values, self.layer_idx, hidden_states)
        if past_key_values is not None and self.layer_idx is not None:
            state = past_key_values.__dict__.setdefault(self.STATE, {})
            kept = torch.cat([past, x], 1)[:, x.shape[1]:]
            state[self.layer_idx] = (kept.detach(), past_key_values.get_seq_length(self.layer_idx))
        return self.apply_taps(x, past).to(hidden_states.dtype), None

    def apply_taps(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        """y [b, s, d] from x [b, s, d] and the K-1 inputs before it, past [b, K-1, d] (float32)."""
        b, s, d = x.shape
        k = self.taps
        windows = torch.cat([past, x], 1).unfold(1, k, 1)  # [b, s, d, K], oldest first
        u = (windows * self.conv.T).sum(-1) if self.conv is not None else x
        y = torch.nn.functional.linear(u, self.weight, self.bias)
        if self.lag is not None or self.lag_down is not None:
            lags = windows[..., :k - 1].transpose(-1, -2).reshape(b, s, (k - 1) * d)  # oldest first
            if self.lag is not None:
                y = y + torch.nn.functional.linear(lags, self.lag)
            else:
                y = y + torch.nn.functional.linear(torch.nn.functional.linear(lags, self.lag_down), self.lag_up)
        return y


def window_visible(query: torch.Tensor, key: torch.Tensor, size: int, sinks: int) -> torch.Tensor:
    """[queries, keys] True where a query position sees a key position in a window layer: the last
    ``size`` positions (itself included) and the first ``sinks``, as the patched llama.cpp masks them
    (llama_hparams::is_masked_swa with n_swa_sink)."""
    query, key = query[:, None], key[None, :]
    return (key <= query) & ((query - key < size) | (key < sinks))


# queries per block of windowed_attention: each block reads the sinks, the window before it and itself
WINDOW_BLOCK = 256


def windowed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, size: int, sinks: int,
                       scale: float | None = None, block: int | None = None) -> torch.Tensor:
    """Attention of a whole sequence with no cache before it (query [b, heads, n, d], key and value [b,
    kv heads, n, d], grouped heads repeated) over window_visible's keys only, [b, heads, n, d]. A dense
    mask makes scaled_dot_product_attention score every pair of positions, n^2, most of them masked: by blocks
    of queries it scores n x (sinks + size + block), 5x fewer at 4,096 tokens and a window of 512 (the window
    layers' attention was 73% of the budget's leave-one-out time on Qwen2.5-Coder-0.5B). The same keys are
    visible, so the result is the dense one up to the order of the sums."""
    block = block or WINDOW_BLOCK
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    n = query.shape[2]
    positions = torch.arange(n, device=query.device)
    out = torch.empty_like(query)
    for start in range(0, n, block):
        stop = min(n, start + block)
        first = max(0, start - size + 1)  # the first key any query of the block sees in its window
        head = min(sinks, first)  # the sinks before it
        keys = torch.cat([positions[:head], positions[first:stop]])
        visible = window_visible(positions[start:stop], keys, size, sinks)
        out[:, :, start:stop] = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:stop], torch.cat([key[:, :, :head], key[:, :, first:stop]], dim=2),
            torch.cat([value[:, :, :head], value[:, :, first:stop]], dim=2), attn_mask=visible, scale=scale)
    return out


WINDOW_ATTENTION = "nbl-window"  # transformers' attention function of a window layer (_window_attention_function)


def _window_attention_function(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, nbl_window,
                               **kwargs):
    """transformers' attention interface for a window layer: windowed_attention of ``nbl_window`` = (size, sinks).
    Only WindowAttention's call names it (through the config it gives the module for that call), always with
    the window."""
    out = windowed_attention(query, key, value, nbl_window[0], nbl_window[1], scale=scaling)
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _register_window_attention() -> bool:
    """Whether transformers takes attention functions by name (AttentionInterface: 4.48 and later); registers
    ours once."""
    try:
        from transformers import AttentionInterface
    except ImportError:
        return False
    AttentionInterface.register(WINDOW_ATTENTION, _window_attention_function)
    return True


class WindowAttention(nn.Module):
    """The layer's own attention, over the last ``size`` tokens and the first ``sinks`` only: the
    mask the model passes is narrowed to the window, nothing else changes. Positions are those of the
    sequence: after the cache's length when a KV cache is passed (HF keeps every position). A whole
    sequence with no cache and no mask of its own (no padding) runs windowed_attention instead of a dense
    mask: the module's config is swapped for the call for one that names _window_attention_function."""

    def __init__(self, attention: nn.Module, size: int, sinks: int, layer_idx: int | None):
        super().__init__()
        if size < 1 or sinks < 0:
            raise NblError(f"layer {layer_idx}: a window of {size} tokens with {sinks} sinks")
        self.attention, self.size, self.sinks, self.layer_idx = attention, int(size), int(sinks), layer_idx
        self._blocked = None  # (the module's config, the copy naming WINDOW_ATTENTION)

    def blocked_config(self):
        """A copy of the module's config that names the windowed attention, or None where the model's attention
        is neither sdpa nor eager or transformers takes no attention function by name."""
        config = getattr(self.attention, "config", None)
        if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager") or not _register_window_attention():
            return None
        if self._blocked is None or self._blocked[0] is not config:
            import copy

            blocked = copy.copy(config)
            # not through the setter: it would also set the sub-configs, which the copy shares
            blocked._attn_implementation_internal = WINDOW_ATTENTION
            self._blocked = (config, blocked)
        return self._blocked[1]

    def forward(self, hidden_states, *args, past_key_values=None, **kwargs):
        cache = _cache(past_key_values, kwargs)
        past = 0 if cache is None else int(cache.get_seq_length(self.layer_idx))
        n = hidden_states.shape[1]
        blocked = None
        if past == 0 and kwargs.get("attention_mask") is None and n > self.size + self.sinks + WINDOW_BLOCK:
            blocked = self.blocked_config()
        if blocked is not None:
            config, self.attention.config = self.attention.config, blocked
            try:
                return self.attention(hidden_states, *args, **kwargs, nbl_window=(self.size, self.sinks))
            finally:
                self.attention.config = config
        device = hidden_states.device
        query = torch.arange(past, past + n, device=device)
        visible = window_visible(query, torch.arange(past + n, device=device), self.size, self.sinks)
        mask = kwargs.get("attention_mask")
        if mask is None:
            blocked = torch.finfo(hidden_states.dtype).min
            mask = torch.zeros(visible.shape, dtype=hidden_states.dtype, device=device).masked_fill(~visible, blocked)
            mask = mask[None, None]
        else:
            if mask.shape[-2:] != visible.shape:
                raise NblError(f"layer {self.layer_idx}: an attention mask of {tuple(mask.shape)} for {n} new tokens "
                               f"after {past}: a window layer takes the model's causal mask of every position")
            mask = mask & visible if mask.dtype == torch.bool else \
                mask.masked_fill(~visible, torch.finfo(mask.dtype).min)
        kwargs["attention_mask"] = mask
        if past_key_values is not None:
            kwargs["past_key_values"] = past_key_values
        return self.attention(hidden_states, *args, **kwargs)


class LinearBlock(_Affine):
    """Stands in for a whole decoder layer: h -> W h + b (norms, attention, MLP and residuals)."""

    def __init__(self, weight, bias, layer_idx, tuple_output: bool):
        super().__init__(weight, bias, layer_idx)
        self.tuple_output = tuple_output

    def forward(self, hidden_states, *args, past_key_values=None, **kwargs):
        _keep_positions(_cache(past_key_values, kwargs), self.layer_idx, hidden_states)
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
            raise NblError(f"layer {index}: unknown layer type {kind} "
                           f"(use 0 keep, 1 attn-nbl, 2 attn-drop, 3 block-nbl, 4 attn-taps, 5 window)")
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
    2 attention -> 0, 3 whole decoder layer -> W h + b, 4 attention -> a past-token map.
    linear: {layer: (W, b)} with W [d, d] (y = W x + b), or a CalibrationArtifact (its attention
    maps serve type 1, its block maps type 3); for type 4, {layer: calibration.taps.TapsMap}; for
    type 5 (the layer's attention over a window), {layer: anything with ``size`` and ``sinks``}.
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
        elif kind == ATTN_TAPS:
            taps_map = linear.get(index) if isinstance(linear, Mapping) else None
            if taps_map is None or not hasattr(taps_map, "taps"):
                raise NblError(f"layer {index} is a taps layer but no taps map was given for it")
            setattr(layer, adapter.attn, TapsAttention(taps_map, index).to(device))
        elif kind == ATTN_DROP:
            setattr(layer, adapter.attn, ZeroAttention(index))
        elif kind == ATTN_WINDOW:
            window = linear.get(index) if isinstance(linear, Mapping) else None
            if window is None or not hasattr(window, "size"):
                raise NblError(f"layer {index} is a window layer but no window was given for it")
            setattr(layer, adapter.attn, WindowAttention(getattr(layer, adapter.attn), window.size, window.sinks, index))
        elif kind == BLOCK_LINEAR:
            weight, bias = _lookup(linear, index, "block")
            layers[index] = LinearBlock(weight, bias, index, tuple_output).to(device)
        if kind in (ATTN_LINEAR, ATTN_DROP, ATTN_TAPS) and adapter.attn_out_norm:
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
