"""Layer selection's measurements: the held-out loss of variants of the model (sets of replaced layers),
each layer read once per call however many variants share it (run_variants, StreamedEvaluator)."""

from __future__ import annotations

import torch

from nbl_gguf.calibration.hidden import HiddenStates
from nbl_gguf.calibration.select import MIN_HELDOUT_TOKENS
from nbl_gguf.calibration.stream import LayerStream, batches
from nbl_gguf.errors import NblError


def run_variants(stream: LayerStream, ids: torch.Tensor, variants: list[dict[int, int]], linear, batch_size: int = 1,
                 base_input=None) -> list[torch.Tensor]:
    """The last layer's output for windows ``ids`` of each variant of the model ({layer: layer type}
    of its replaced layers; apply.py's codes), reading each layer once.

    A variant's hidden states are the unmodified model's until its first replaced layer; variants that
    agree up to a layer share one track up to it. ``base_input(k)``: the unmodified model's input of
    layer k, kept from the calibration (then no layer before the first replacement is run); None: the
    unmodified track is computed here from the embedding. ``linear(k, layer_type)``: (W, b) of layer k's
    map of that type (attention or whole block), or its calibration.taps.TapsMap (ATTN_TAPS)."""
    keys = [frozenset(variant.items()) for variant in variants]
    empty = frozenset()
    tracks: dict[frozenset, torch.Tensor] = {}
    if base_input is None:
        tracks[empty] = stream.embed_all(ids, batch_size)
        first = 0
    else:
        first = min((layer for key in keys for layer, _ in key), default=stream.num_layers)
    for k in range(first, stream.num_layers):
        outputs = {frozenset(item for item in key if item[0] <= k) for key in keys}
        if base_input is not None:
            outputs.discard(empty)
        if not outputs:
            continue
        stream.load_layer(k)
        try:
            new_tracks = {}
            for key in sorted(outputs, key=lambda key: sorted(key)):
                source = frozenset(item for item in key if item[0] != k)
                hidden = tracks[source] if source in tracks else base_input(k)
                new_tracks[key] = layer_output(stream, k, hidden, dict(key).get(k), linear, batch_size)
            tracks = new_tracks
        finally:
            stream.release_layer(k)
    return [tracks[key] if key in tracks else base_input(stream.num_layers) for key in keys]


def layer_output(stream: LayerStream, k: int, hidden: torch.Tensor, layer_type: int | None = None, linear=None,
                 batch_size: int = 1) -> torch.Tensor:
    """Loaded layer ``k``'s output for ``hidden`` [windows, seqlen, d], ``batch_size`` windows at a time; with
    ``layer_type``, the layer replaced by that type for the call (its map from ``linear(k, layer_type)``)."""
    from nbl_gguf.calibration.apply import ATTN_DROP, replace_layer

    restore = None
    if layer_type is not None:
        restore = replace_layer(stream.model, k, layer_type,
                                None if layer_type == ATTN_DROP else {k: linear(k, layer_type)})
    try:
        out = torch.empty(hidden.shape[:2] + (stream.hidden_size,), dtype=stream.dtype, device=stream.device)
        for start, stop in batches(hidden.shape[0], batch_size):
            out[start:stop] = stream.run_layer(k, hidden[start:stop])
        return out
    finally:
        if restore is not None:
            restore()


class StreamedEvaluator:
    """Held-out loss of variants of the model (sets of replaced layers), each layer streamed once per
    call (run_variants). ``base_input(k)``: the unmodified model's input of layer k on these windows,
    kept by the calibration (None: computed from the embedding in every call). ``linear(k, type)``: the
    map of layer k."""

    def __init__(self, stream: LayerStream, heldout_ids: torch.Tensor, layer_type: int, linear, batch_size: int = 1,
                 base_input=None, min_tokens: int = MIN_HELDOUT_TOKENS):
        if heldout_ids.numel() < min_tokens:
            raise NblError(f"the held-out slice for layer selection has {heldout_ids.numel()} tokens; "
                           f"it needs at least {min_tokens} (more --selection-windows or a longer --seqlen)")
        self.stream, self.ids, self.linear, self.base_input = stream, heldout_ids, linear, base_input
        self.layer_type, self.batch_size = layer_type, max(1, batch_size)
        self.tokens = int(heldout_ids.shape[0] * (heldout_ids.shape[1] - 1))
        self.passes = 0
        stream.load_head()
        if base_input is not None:
            self.base_loss = self._loss(base_input(stream.num_layers))
        else:
            self.base_loss = self._loss(run_variants(stream, heldout_ids, [{}], linear, self.batch_size)[0])

    @classmethod
    def from_state(cls, stream: LayerStream, state, heldout_ids: torch.Tensor, layer_type: int, batch_size: int = 1,
                   taps: int = 1):
        """On the held-out windows whose every layer's input the calibration kept in ``state``; with
        ``taps`` > 1 the layers are replaced by their taps maps (layer_type ATTN_TAPS)."""
        from safetensors import safe_open

        shape = (heldout_ids.shape[0], heldout_ids.shape[1], stream.hidden_size)

        def base_input(layer: int) -> torch.Tensor:
            return HiddenStates(shape, stream.dtype, None, state.path(f"heldout-{layer}.bin"), existing=True).all()

        def linear(layer: int, _type: int):
            with safe_open(str(state.layer_tensors(layer)), framework="numpy") as handle:
                return handle.get_tensor(f"attn.{layer}.weight"), handle.get_tensor(f"attn.{layer}.bias")

        def taps_map(layer: int, _type: int):
            from nbl_gguf.calibration.taps import map_from_tensors

            with safe_open(str(state.layer_tensors(layer)), framework="numpy") as handle:
                return map_from_tensors(handle.get_tensor, layer, taps, set(handle.keys()))

        return cls(stream, heldout_ids, layer_type, linear if taps < 2 else taps_map, batch_size, base_input)

    def close(self) -> None:
        self.stream.release_head()

    def _loss(self, hidden: torch.Tensor) -> float:
        total = sum(float(self.stream.token_nll(hidden[start:stop], self.ids[start:stop]).sum())
                    for start, stop in batches(self.ids.shape[0], self.batch_size))
        return total / self.tokens

    def losses(self, sets) -> list[float]:
        sets = [sorted(int(i) for i in s) for s in sets]
        replaced = [s for s in sets if s]
        if not replaced:
            return [self.base_loss] * len(sets)
        self.passes += 1
        finals = iter(run_variants(self.stream, self.ids, [{layer: self.layer_type for layer in s} for s in replaced],
                                   self.linear, self.batch_size, self.base_input))
        return [self._loss(next(finals)) if s else self.base_loss for s in sets]
