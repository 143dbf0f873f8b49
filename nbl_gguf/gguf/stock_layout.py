"""The stock-runtime layout: an NBL model written as llama.cpp's `deci` architecture (Nemotron-NAS),
whose graph every unmodified llama.cpp build (ollama, LM Studio, llama-cpp-python wheels) runs.

The deci graph already has the two layer kinds NBL needs, chosen per layer by the head counts:

    head_count > 0, head_count_kv > 0   attention, exactly as the llama graph computes it
    head_count > 0, head_count_kv = 0   "linear attention": h + attn_output @ attn_norm(h)   (no bias)
    head_count = 0                      attention-free: h (no attn_norm, no attention tensors)

so a llama GGUF becomes a deci GGUF by renaming its `llama.*` keys, writing per-layer head counts and
swapping the attention tensors of the replaced layers. The linear slot has no bias: it takes the
map fitted without one (calibration `attn.{i}.weight_nobias`). The format is in docs/gguf-format.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from nbl_gguf.errors import NblError
from nbl_gguf.gguf.nbl_format import (
    ATTENTION,
    DROPPED,
    LINEAR,
    TAPS,
    NblLayers,
    WeightType,
    add_provenance,
    copy_keys,
    is_attention_tensor,
    layer_of,
    quantize_weight,
    write_tensors,
)
from nbl_gguf.outputs import atomic_write

STOCK_ARCH = "deci"
# GGUF architectures whose layer the deci graph computes unchanged (RMSNorm, rotary attention with
# optional Llama 3 rope_freqs, SiLU-gated MLP, tied or separate output); mistral converts to llama
SOURCE_ARCHITECTURES = ("llama",)
# HF model types that convert to such a file (checked before calibrating)
SOURCE_MODEL_TYPES = ("llama", "mistral")

# written by nbl-gguf, read by `inspect`, ignored by llama.cpp; not '<arch>.nbl.layer_types', which
# the patched loader would take as marked layers that the deci graph cannot build
LAYOUT_KEY = "nbl.layout"
LAYOUT = "deci"
LAYER_TYPES_KEY = "nbl.layer_types"

# the per-layer keys the deci loader reads as arrays; they say what each layer is
HEAD_COUNT = "attention.head_count"
HEAD_COUNT_KV = "attention.head_count_kv"
FEED_FORWARD_LENGTH = "feed_forward_length"
PER_LAYER_KEYS = (HEAD_COUNT, HEAD_COUNT_KV, FEED_FORWARD_LENGTH)
# tensors a replaced layer keeps: a linear one its attn_norm (the map reads its output); a dropped
# one nothing, since the deci loader creates no attn_norm for an attention-free layer
KEPT_ATTENTION_NORM = {LINEAR: True, DROPPED: False}
FLOAT_TYPES = ("F32", "F16", "BF16")


def check_source_model_type(model_type: str | None) -> None:
    """Refuse, before any work, a HF model whose GGUF the deci graph cannot run."""
    if model_type not in SOURCE_MODEL_TYPES:
        why = {"mixtral": "the deci graph runs no mixture-of-experts FFN"}.get(model_type, "its layers are not llama layers")
        raise NblError(f"--runtime stock writes llama.cpp's deci architecture, which runs llama-family models "
                       f"({', '.join(SOURCE_MODEL_TYPES)}) only; '{model_type}' cannot be written that way ({why}): "
                       f"use --runtime nbl (the patched llama.cpp)")


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _per_layer(value, n_layer: int, key: str) -> list[int]:
    values = [int(v) for v in value] if isinstance(value, list) else [int(value)] * n_layer
    if len(values) != n_layer:
        raise NblError(f"{key} has {len(values)} entries for {n_layer} layers")
    return values


def check_source(reader, src) -> str:
    """The source's architecture, after refusing what the deci graph would compute differently."""
    arch = str(_field(reader, "general.architecture"))
    if arch == STOCK_ARCH and _field(reader, LAYOUT_KEY) is not None:
        raise NblError(f"{src} is already an NBL file in the stock layout: start from the stock conversion")
    if arch not in SOURCE_ARCHITECTURES:
        raise NblError(f"{src} is a '{arch}' model; the stock layout (llama.cpp's deci graph) takes "
                       f"{', '.join(SOURCE_ARCHITECTURES)} GGUFs only (llama, mistral): use the NBL layout "
                       f"(--runtime nbl, patched llama.cpp)")
    if _field(reader, f"{arch}.nbl.layer_types") is not None:
        raise NblError(f"{src} is already an NBL GGUF: start from the stock conversion")
    if int(_field(reader, f"{arch}.expert_count", 0) or 0) > 0:
        raise NblError(f"{src} is a mixture-of-experts model (mixtral): llama.cpp's deci graph runs no experts, "
                       f"so it has no stock layout; use --runtime nbl (patched llama.cpp)")
    scales = [t.name for t in reader.tensors if t.name.endswith(".scale")]
    if scales:
        raise NblError(f"{src} carries per-tensor scales ({scales[0]}, ...) that llama.cpp's deci graph does not "
                       f"apply: convert the model from its unscaled weights")
    return arch


def _weight_qtype(reader, weight_type: str | None):
    """W0's type: ``weight_type``, else that of the file's attn_output tensors when it is a float type, else F32."""
    import gguf

    if weight_type is None:
        types = [t.tensor_type.name for t in reader.tensors if t.name.endswith(".attn_output.weight")]
        weight_type = types[0] if types and types[0] in FLOAT_TYPES else "F32"
    if weight_type.upper() not in FLOAT_TYPES:
        raise NblError(f"weight type {weight_type!r} is not one of {', '.join(FLOAT_TYPES)}: quantize afterwards")
    return gguf.GGMLQuantizationType[weight_type.upper()]


def stock_layer_kinds(types) -> list[int]:
    """How each layer is written. A dropped layer 0 is written as a linear layer whose map is zero
    (the same function, h + 0): llama.cpp takes the head size from layer 0's head count, and a
    head count of 0 there would leave the attention layers with none."""
    return [LINEAR if layer == 0 and kind == DROPPED else kind for layer, kind in enumerate(types)]


def write_stock_gguf(src: str | os.PathLike, dst: str | os.PathLike, layers: NblLayers,
                     weight_type: str | Mapping[int, WeightType] | None = None) -> Path:
    """Rewrite the llama GGUF ``src`` (float or quantized) into a deci GGUF ``dst`` with ``layers``
    replaced: linear layers get attn_output = W (their bias must be zero: the slot has none),
    dropped layers lose their attention and its norm. Every other tensor is copied with its type and
    bytes; the output appears only once it is complete. ``weight_type``: a float type for every W, or
    per layer (nbl_format.weight_types(), e.g. Q4_K for a Q4_K_M source: the surgery of a GGUF --model)."""
    import gguf

    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise NblError(f"the stock-layout GGUF must not overwrite its source {src}")
    reader = gguf.GGUFReader(src)
    arch = check_source(reader, src)
    n_layer = int(_field(reader, f"{arch}.block_count"))
    n_embd = int(_field(reader, f"{arch}.embedding_length"))
    layers.validate(n_layer, n_embd)
    taps = [layer for layer, kind in enumerate(layers.types) if kind == TAPS]
    if taps:
        raise NblError(f"layers {taps} are taps layers, which read earlier tokens' inputs from a state kept per "
                       f"sequence; llama.cpp's deci graph (--runtime stock) keeps no such state: use --runtime nbl")
    for layer, (_, bias) in layers.linear.items():
        if np.any(bias != 0):
            raise NblError(f"layer {layer}: the deci linear attention has no bias, but a nonzero one was given: "
                           f"pass the bias-free map (artifact.linear_without_bias)")
    kinds = stock_layer_kinds(layers.types)
    weights = {layer: layers.linear[layer][0] if layer in layers.linear else np.zeros((n_embd, n_embd), np.float32)
               for layer, kind in enumerate(kinds) if kind == LINEAR}
    if isinstance(weight_type, Mapping):
        # a dropped layer 0 written as a zero map (not in the mapping) is stored exactly, in F32
        qtypes = {layer: gguf.GGMLQuantizationType[weight_type[layer].name] if layer in weight_type
                  else gguf.GGMLQuantizationType.F32 for layer in weights}
        importance = {layer: weight_type[layer].importance for layer in weights if layer in weight_type}
    else:
        qtypes = dict.fromkeys(weights, _weight_qtype(reader, weight_type))
        importance = {}

    n_head = _per_layer(_field(reader, f"{arch}.{HEAD_COUNT}"), n_layer, HEAD_COUNT)
    n_head_kv = _per_layer(_field(reader, f"{arch}.{HEAD_COUNT_KV}", n_head), n_layer, HEAD_COUNT_KV)
    n_ff = _per_layer(_field(reader, f"{arch}.{FEED_FORWARD_LENGTH}"), n_layer, FEED_FORWARD_LENGTH)
    per_layer = {
        HEAD_COUNT: [0 if kind == DROPPED else n for n, kind in zip(n_head, kinds)],
        HEAD_COUNT_KV: [n if kind == ATTENTION else 0 for n, kind in zip(n_head_kv, kinds)],
        FEED_FORWARD_LENGTH: n_ff,
    }

    tensors = []
    emitted: set[int] = set()
    for tensor in reader.tensors:
        layer = layer_of(tensor.name)
        kind = ATTENTION if layer is None else kinds[layer]
        if kind != ATTENTION and (is_attention_tensor(tensor.name, layer)
                                  or (tensor.name.startswith(f"blk.{layer}.attn_norm.") and not KEPT_ATTENTION_NORM[kind])):
            # W takes the place of the first attention tensor, keeping the file's order
            if kind == LINEAR and layer not in emitted:
                data = quantize_weight(weights[layer], qtypes[layer], importance.get(layer))
                tensors.append((f"blk.{layer}.attn_output.weight", data, qtypes[layer]))
            emitted.add(layer)
            continue
        tensors.append((tensor.name, tensor.data, tensor.tensor_type))
    missing = [i for i, kind in enumerate(kinds) if kind != ATTENTION and i not in emitted]
    if missing:
        raise NblError(f"{src} has no attention tensors for layers {missing}: is it a {arch} model?")

    with atomic_write(dst) as tmp:
        writer = gguf.GGUFWriter(tmp, arch=STOCK_ARCH, endianess=reader.endianess)
        def deci_key(key: str) -> str | None:
            if not key.startswith(f"{arch}."):
                return key
            suffix = key[len(arch) + 1:]
            return None if suffix in PER_LAYER_KEYS else f"{STOCK_ARCH}.{suffix}"  # per-layer keys follow

        copy_keys(reader, writer, deci_key)
        for suffix, values in per_layer.items():
            writer.add_key_value(f"{STOCK_ARCH}.{suffix}", values, gguf.GGUFValueType.ARRAY,
                                 sub_type=gguf.GGUFValueType.INT32)
        writer.add_string(LAYOUT_KEY, LAYOUT)
        writer.add_key_value(LAYER_TYPES_KEY, [int(t) for t in layers.types], gguf.GGUFValueType.ARRAY,
                             sub_type=gguf.GGUFValueType.INT32)
        add_provenance(writer, layers)
        write_tensors(writer, tensors, reader.endianess, source=reader)
    return dst


def read_stock_layer_types(reader) -> list[int] | None:
    """The NBL layer types of a stock-layout file (its nbl.layer_types), or None for any other file."""
    if str(_field(reader, "general.architecture")) != STOCK_ARCH or _field(reader, LAYOUT_KEY) is None:
        return None
    values = _field(reader, LAYER_TYPES_KEY)
    return None if values is None else [int(v) for v in values]
