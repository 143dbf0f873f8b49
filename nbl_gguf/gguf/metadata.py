"""A GGUF's metadata as llama.cpp reads it (stock files too): opening the file, its fields, its NBL
layer types, and the KV cache its layers get. The library that `inspect` renders (gguf.inspect) and
that convert, eval, bench and the measurements read; per-architecture facts: nbl_gguf.architectures.

Reads the header alone (nbl_gguf.gguf_header; gguf-py's reader where tensor data is wanted): no torch, no llama.cpp.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from nbl_gguf.architectures import ARCHITECTURES
from nbl_gguf.errors import NblError
from nbl_gguf.gguf_header import GgufHeader, HeaderTruncated, NotGguf, read_header
from nbl_gguf.kv_cache import KvLayer, KvModel, KvSize, cache_context, kv_size
from nbl_gguf.gguf.nbl_format import (
    ATTENTION,
    SLIDING_WINDOW_KEY,
    SLIDING_WINDOW_PATTERN_KEY,
    TAPS,
    TAPS_KEY,
    read_layer_types,
    read_windows,
)
from nbl_gguf.gguf.stock_layout import read_stock_layer_types

KV_BYTES = 2  # the KV cache is F16 by default in llama.cpp


def open_gguf(path: str | os.PathLike) -> GgufHeader:
    """The metadata keys and tensor entries of ``path``, what every function of this module reads
    (nbl_gguf.gguf_header: gguf-py's reader would build an object per token); a missing, foreign, truncated
    or damaged file is an NblError that says which."""
    path = Path(path)
    if not path.exists():
        raise NblError(f"{path} does not exist")
    if not path.is_file():
        raise NblError(f"{path} is not a file")
    try:
        return read_header(path)
    except NotGguf as error:
        raise NblError(f"{path} is not a GGUF file (it does not start with the GGUF magic)") from error
    except HeaderTruncated as error:
        raise NblError(f"{path} is truncated (or its header is damaged): the file ends before the data its header "
                       f"declares ({path.stat().st_size:,} bytes; {error})") from error
    except ValueError as error:
        raise NblError(f"{path} is not a readable GGUF file: {error}") from error


def open_model_gguf(path: str | os.PathLike):
    """(reader, architecture) of a model GGUF; a GGUF without an architecture is a clear error."""
    reader = open_gguf(path)
    if "general.architecture" not in reader.fields:
        raise NblError(f"{path} has no general.architecture: not a model GGUF")
    return reader, architecture_name(reader)


def read_field(reader, key, default=None):
    """The value of the metadata key ``key`` (a list for an array), or ``default`` where the file has none."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def per_layer(value, n_layer: int) -> list[int]:
    """A per-layer key's value for each layer: GGUF stores one number where every layer has the same."""
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)] * n_layer


def architecture_name(reader) -> str:
    """general.architecture: the prefix of the file's model keys."""
    return str(read_field(reader, "general.architecture"))


def file_type_name(file_type) -> str | None:
    """llama.cpp's name of a general.file_type (Q4_0, F16, ...): None for none, the value itself where
    gguf-py knows no such type."""
    import gguf

    if file_type is None:
        return None
    try:
        return gguf.LlamaFileType(int(file_type)).name.replace("MOSTLY_", "").replace("ALL_", "")
    except (TypeError, ValueError):
        return str(file_type)


def head_counts(reader, arch: str, n_layer: int) -> tuple[list[int], list[int]]:
    """(query heads, KV heads) of each layer; without head_count_kv, as many KV heads as query heads."""
    n_head = per_layer(read_field(reader, f"{arch}.attention.head_count"), n_layer)
    n_head_kv = read_field(reader, f"{arch}.attention.head_count_kv")
    return n_head, n_head if n_head_kv is None else per_layer(n_head_kv, n_layer)


def sliding_layers(reader) -> tuple[int, list[bool]]:
    """(window, whether each layer slides) as llama.cpp reads them from the file."""
    arch = architecture_name(reader)
    n_layer = int(read_field(reader, f"{arch}.block_count"))
    windows = read_windows(reader)
    if windows is not None:
        return windows.size, windows.pattern(n_layer)
    architecture = ARCHITECTURES.get(arch)
    if architecture is None or architecture.sliding_pattern is None:
        return 0, [False] * n_layer
    window = read_field(reader, SLIDING_WINDOW_KEY.format(arch=arch), architecture.default_window)
    if not window:
        return 0, [False] * n_layer
    pattern_key = SLIDING_WINDOW_PATTERN_KEY.format(arch=arch)
    flags = read_field(reader, pattern_key, architecture.sliding_pattern)
    if isinstance(flags, list):
        if len(flags) != n_layer:
            raise NblError(f"{pattern_key} has {len(flags)} flags for {n_layer} layers")
        return int(window), [bool(flag) for flag in flags]
    pattern = int(flags)
    return int(window), [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layer)]


def sliding_window_modelled(reader) -> bool:
    """False for an architecture whose sliding-window layers, if it has any, these figures do not know."""
    arch = architecture_name(reader)
    return arch in ARCHITECTURES or read_field(reader, SLIDING_WINDOW_KEY.format(arch=arch)) is None


def kv_model(reader, layer_types=None) -> KvModel:
    """The KV layout llama.cpp gives the file: per layer its K and V widths, whether it slides, and
    whether it has a cache (not where ``layer_types``, by default the file's own, replaced it)."""
    arch = architecture_name(reader)
    n_layer = int(read_field(reader, f"{arch}.block_count"))
    n_embd = int(read_field(reader, f"{arch}.embedding_length"))
    n_head, n_head_kv = head_counts(reader, arch, n_layer)
    # llama.cpp takes the head size from layer 0's head count unless the file gives it
    head_dim = n_embd // n_head[0] if n_head and n_head[0] else 0
    k_len = int(read_field(reader, f"{arch}.attention.key_length", head_dim))
    v_len = int(read_field(reader, f"{arch}.attention.value_length", head_dim))
    k_len_swa = int(read_field(reader, f"{arch}.attention.key_length_swa", k_len))
    v_len_swa = int(read_field(reader, f"{arch}.attention.value_length_swa", v_len))
    window, sliding = sliding_layers(reader)
    types = layer_types if layer_types is not None else read_layer_types(reader)
    layers = []
    for layer in range(n_layer):
        k, v = (k_len_swa, v_len_swa) if sliding[layer] else (k_len, v_len)
        # the NBL layout's replaced layers own no cache (patch 0004); the stock layout's are deci layers
        # with head_count_kv = 0, which keep an entry of zero width
        cached = types is None or types[layer] == ATTENTION
        layers.append(KvLayer(k_width=n_head_kv[layer] * k, v_width=n_head_kv[layer] * v,
                              sliding=sliding[layer], cached=cached))
    windows = read_windows(reader)
    return KvModel(layers=tuple(layers), window=window, sinks=windows.sinks if windows is not None else 0)


def stock_kv_model(reader) -> KvModel:
    """The KV layout of the model before any layer was replaced."""
    arch = architecture_name(reader)
    model = kv_model(reader, layer_types=[ATTENTION] * int(read_field(reader, f"{arch}.block_count")))
    if read_windows(reader) is not None:
        # the window layers were full attention layers before
        model = KvModel(layers=tuple(replace(layer, sliding=False) for layer in model.layers))
    if read_stock_layer_types(reader) is None:
        return model
    # the stock layout keeps no heads for replaced layers; llama-family models have the same heads in
    # every layer, so each layer of the unreplaced model costs what an attention layer costs
    widest = max(model.layers, key=lambda layer: layer.k_width + layer.v_width)
    return KvModel(layers=tuple(widest for _ in model.layers), window=model.window)


def stock_layout_kv_without_flash_attention(reader) -> int:
    """KV bytes per token of a stock-layout file when flash attention is off: llama.cpp keeps every
    deci layer in the cache and, with V stored transposed, pads each layer's V to the widest, so the
    replaced layers lose only their K (docs/gguf-format.md, "Stock layout")."""
    layers = kv_model(reader).layers
    v_max = max((layer.v_width for layer in layers), default=0)
    return sum((layer.k_width + v_max) * KV_BYTES for layer in layers)


def kv_bytes_per_token(reader, layer_types=None) -> tuple[int, int]:
    """(stock, this file) KV bytes per cell, summed over the layers that cache (F16): the cost of one more
    token of context in a model without sliding-window layers. Sizes at a context: kv_sizes()."""
    stock = stock_kv_model(reader)
    types = layer_types if layer_types is not None else file_layer_types(reader)
    nbl = stock if types is None else stock.without(i for i, t in enumerate(types) if t != ATTENTION)

    def per_cell(model):
        return sum((layer.k_width + layer.v_width) * KV_BYTES for layer in model.layers if layer.cached)

    return per_cell(stock), per_cell(nbl)


def kv_sizes(reader, n_ctx: int, layer_types=None, kv_type: str = "f16", **settings) -> tuple[KvSize, KvSize]:
    """(stock, this file) KV cache as llama.cpp allocates it at ``n_ctx`` with the cache type ``kv_type``
    ('q8_0/q4_0': K's and V's) (llama-cli's settings unless ``settings`` name other kv_cache.Context
    fields); with ``layer_types``, this file as if those layers were replaced."""
    stock = stock_kv_model(reader)
    if layer_types is None:
        nbl = kv_model(reader)
    else:
        nbl = stock.without(i for i, t in enumerate(layer_types) if t != ATTENTION)
    context = cache_context(n_ctx, kv_type, **settings)
    return kv_size(stock, context), kv_size(nbl, context)


def file_layer_types(reader) -> list[int] | None:
    """The NBL layer types of either layout, or None for a stock GGUF."""
    types = read_layer_types(reader)
    return types if types is not None else read_stock_layer_types(reader)


def taps_state(reader, types) -> dict | None:
    """Tokens a taps layer reads and the F32 state llama.cpp keeps for them per sequence (the inputs of
    the last taps - 1 tokens of every taps layer), or None without taps layers."""
    arch = architecture_name(reader)
    n_taps = read_field(reader, TAPS_KEY.format(arch=arch))
    layers = sum(1 for t in types or [] if t == TAPS)
    if n_taps is None or not layers:
        return None
    n_embd = int(read_field(reader, f"{arch}.embedding_length"))
    return {"taps": int(n_taps), "layers": layers,
            "state_bytes_per_sequence": layers * (int(n_taps) - 1) * n_embd * 4}


def training_context(reader) -> int | None:
    """The context the model was trained at (what llama.cpp takes for -c 0), or None where the file names none."""
    arch = architecture_name(reader)
    value = read_field(reader, f"{arch}.context_length")
    return None if value is None else int(value)


def weight_bytes(reader) -> int:
    """The bytes of the file's tensors: what llama.cpp loads as the model's weights (llama-bench's model_size),
    the metadata and the vocabulary apart."""
    return sum(tensor.n_bytes for tensor in reader.tensors)
