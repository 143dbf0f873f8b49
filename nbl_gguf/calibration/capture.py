"""Forward hooks that hand every layer's attention and block activations to callbacks, in one pass.

Callbacks consume the activations immediately (the calibrator folds them into running sums),
so nothing is kept across layers or batches.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch

from nbl_gguf.models import ModelAdapter, attention_norm, attention_output, decoder_layers

# on_attention(layer, h, x, y): h = block input, x = attention input (norm(h)), y = attention output
# (after the adapter's attn_out_norm, if any: what the block adds to the residual stream)
AttentionCallback = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]
# on_block(layer, h, out): decoder layer input and output hidden states
BlockCallback = Callable[[int, torch.Tensor, torch.Tensor], None]


def _first(output):
    # transformers 5 returns a tensor from decoder layers and (out, weights) from attention; 4.x tuples.
    return output[0] if isinstance(output, (tuple, list)) else output


@contextmanager
def capture_activations(model, adapter: ModelAdapter, on_attention: AttentionCallback | None = None,
                        on_block: BlockCallback | None = None, only=None):
    """Hooks on every decoder layer, or on the layers ``only`` (the layer-streamed calibrator's one)."""
    handles = []
    for index, layer in enumerate(decoder_layers(model)):
        if only is not None and index not in only:
            continue
        slot: dict[str, torch.Tensor] = {}

        def layer_pre(module, inputs, kwargs, slot=slot):
            slot["h"] = inputs[0] if inputs else kwargs["hidden_states"]

        def norm_hook(module, inputs, output, slot=slot):
            slot["x"] = _first(output)

        def attn_hook(module, inputs, output, index=index, slot=slot):
            if on_attention is not None:
                on_attention(index, slot["h"], slot["x"], _first(output))

        def layer_hook(module, inputs, kwargs, output, index=index, slot=slot):
            if on_block is not None:
                on_block(index, slot["h"], _first(output))
            slot.clear()  # let the batch's activations be freed

        handles.append(layer.register_forward_pre_hook(layer_pre, with_kwargs=True))
        # A layer already replaced by a linear block (apply_nbl) has no attention to observe.
        if hasattr(layer, adapter.attn) and hasattr(layer, adapter.attn_norm):
            handles.append(attention_norm(layer, adapter).register_forward_hook(norm_hook))
            handles.append(attention_output(layer, adapter).register_forward_hook(attn_hook))
        handles.append(layer.register_forward_hook(layer_hook, with_kwargs=True))
    try:
        yield handles
    finally:
        for handle in handles:
            handle.remove()
