"""The NBL layer of a GGUF file: per-layer types, the linear tensors, and the rewrite of a stock GGUF.

The format is specified in docs/gguf-format.md; the patched llama.cpp (patches/) reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from nbl_gguf.errors import NblError
from nbl_gguf.gguf_header import read_header
from nbl_gguf.outputs import atomic_write

ATTENTION = 0  # stock self-attention
LINEAR = 1  # attention replaced by y = W x + b of the normed input
DROPPED = 2  # attention removed: the block adds nothing
TAPS = 3  # attention replaced by a linear map of the normed inputs of this and the taps - 1 previous tokens
LAYER_TYPE_NAMES = {ATTENTION: "attention", LINEAR: "linear", DROPPED: "dropped", TAPS: "taps"}

LAYER_TYPES_KEY = "{arch}.nbl.layer_types"
TAPS_KEY = "{arch}.nbl.taps"  # uint32: tokens a taps layer reads (the same for every taps layer)
MAX_TAPS = 64  # LLAMA_NBL_MAX_TAPS of the patched llama.cpp
# window layers: attention over the last W tokens and the first S (the sinks), in upstream's keys where
# they exist; the layer type stays ATTENTION (the layer keeps its attention tensors)
SLIDING_WINDOW_KEY = "{arch}.attention.sliding_window"  # uint32: W, the same for every window layer
SLIDING_WINDOW_PATTERN_KEY = "{arch}.attention.sliding_window_pattern"  # bool[block_count]: the window layers
WINDOW_SINKS_KEY = "{arch}.nbl.window_sinks"  # uint32: S, the first positions every window layer keeps
WINDOW = "window"  # the layer-type name `inspect` and the plan give a window layer
# provenance, for `inspect` and for people; llama.cpp does not read these
METHOD_KEY = "nbl.method"
CRITERION_KEY = "nbl.criterion"
SCORES_KEY = "nbl.scores"
SCORES_CRITERION_KEY = "nbl.scores_criterion"  # the local criterion of nbl.scores (best: the one it chose)
CALIBRATION_KEY = "nbl.calibration"

NBL_WEIGHT = "blk.{layer}.attn_nbl.weight"
NBL_BIAS = "blk.{layer}.attn_nbl.bias"
# the stock tensors that read a layer's attn_norm output, as W does: their importance matrix is W's
IMATRIX_SOURCES = ("blk.{layer}.attn_q.weight", "blk.{layer}.attn_qkv.weight")
# a taps layer's maps of the earlier inputs (calibration.taps.TapsMap: the attribute of the same name)
TAPS_TENSORS = {
    "lag": "blk.{layer}.attn_nbl_lag.weight",  # [d, (K-1) d] on the K-1 earlier inputs, oldest first
    "lag_down": "blk.{layer}.attn_nbl_lag_down.weight",  # [r, (K-1) d]
    "lag_up": "blk.{layer}.attn_nbl_lag_up.weight",  # [d, r]
    "conv": "blk.{layer}.attn_nbl_conv.weight",  # [K, d] per-channel weights, a row per token, oldest first (F32)
}
# the tensors a replaced layer must not carry (weights, optional biases, per-head Q/K norms, and the
# norm on the attention output before the residual add, which the NBL map stands in for)
ATTENTION_TENSOR_STEMS = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "attn_q_norm", "attn_k_norm",
                          "post_attention_norm")
# GGUF architectures whose graph the patched llama.cpp builds with NBL layers (llm_arch_supports_nbl)
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "smollm3")
# those whose graph also builds taps layers (llm_arch_supports_nbl_taps): all of them since patch 0021; an
# architecture that joins the NBL ones without its graph passing the taps state stays out of this list
TAPS_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "smollm3")
# those whose loader reads the window layers of a file and whose graph builds them with the iSWA cache
# (patches 0016, 0018, 0019; gemma2 and gemma3 have sliding windows of their own, which the file's keys
# already set)
WINDOW_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "smollm3")
FLOAT_WEIGHT_TYPES = ("F32", "F16", "BF16")
# W's type when the one it would inherit (its layer's attn_output) cannot hold an n_embd x n_embd
# matrix: q8_0 keeps W within about 0.5% at a quarter of F32's bytes; F16 when even its blocks do not fit
FALLBACK_WEIGHT_TYPES = ("Q8_0", "F16")
# W does a replaced attention's whole work in one matrix, so its rounding costs more than a projection's:
# a 4-bit W (Q4_K, Q4_0, Q4_1, IQ4_*, and less) cost up to 1.4-2.5 points of held-out perplexity
# against Q8_0 at m = 8 on both our models, and 5 bits took most of it back (docs/results/nbl-type.md).
# Below MIN_WEIGHT_BITS per weight, W takes the first of RAISED_WEIGHT_TYPES that holds its rows.
MIN_WEIGHT_BITS = 5.5
RAISED_WEIGHT_TYPES = ("Q5_K", "Q5_0", "F16")


@dataclass(frozen=True)
class Windows:
    """Window layers: each attends to the last ``size`` tokens (itself included) and to the first
    ``sinks`` positions of the sequence, whatever the context."""

    layers: tuple[int, ...]
    size: int
    sinks: int = 0

    def validate(self, types: Sequence[int]) -> None:
        if self.size < 1:
            raise NblError(f"a window of {self.size} tokens: it needs at least 1")
        if self.sinks < 0:
            raise NblError(f"{self.sinks} attention sinks: give 0 or more")
        if not self.layers:
            raise NblError("window layers: none given")
        if len(set(self.layers)) != len(self.layers):
            raise NblError(f"window layers {list(self.layers)} repeat a layer")
        for layer in self.layers:
            if not 0 <= layer < len(types):
                raise NblError(f"window layer {layer} does not exist: the model has {len(types)} layers")
            if types[layer] != ATTENTION:
                raise NblError(f"layer {layer} is a window layer and an NBL {LAYER_TYPE_NAMES.get(types[layer], types[layer])} "
                               f"layer: a window keeps the attention, so it must be an attention layer")

    def pattern(self, n_layer: int) -> list[bool]:
        return [layer in self.layers for layer in range(n_layer)]


@dataclass
class NblLayers:
    """What replaces the attention of each layer: types[i] and, for LINEAR layers, (W [d, d], b [d]);
    for TAPS layers a calibration.taps.TapsMap (or any object with its attributes) in ``taps``."""

    types: Sequence[int]
    linear: Mapping[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    method: str | None = None
    criterion: str | None = None
    scores: Sequence[float] | None = None
    calibration: Mapping | None = None
    scores_criterion: str | None = None  # what ``scores`` score, when not ``criterion`` itself (best, greedy)
    taps: Mapping = field(default_factory=dict)
    windows: Windows | None = None  # attention layers that keep only a window of tokens

    def maps_digest(self) -> str:
        """sha256 of the layer types and every replaced layer's map (its arrays' bytes, shapes and types; a taps map's
        fields in order): what a measurement on top of these replaced layers depends on (measurement.memo)."""
        import hashlib

        digest = hashlib.sha256(json.dumps([int(t) for t in self.types]).encode())

        def add(name: str, value) -> None:
            digest.update(name.encode())
            if value is None or isinstance(value, (int, float, str)):
                digest.update(repr(value).encode())
            else:
                array = np.ascontiguousarray(np.asarray(value))
                digest.update(f"{array.dtype}{array.shape}".encode() + array.tobytes())

        for layer in sorted(self.linear):
            weight, bias = self.linear[layer]
            add(f"linear {layer} weight", weight)
            add(f"linear {layer} bias", bias)
        for layer in sorted(self.taps):
            for name, value in sorted(vars(self.taps[layer]).items()):
                add(f"taps {layer} {name}", value)
        return digest.hexdigest()

    @property
    def n_taps(self) -> int | None:
        """Tokens every taps layer reads, None without taps layers."""
        counts = {int(m.taps) for m in self.taps.values()}
        return counts.pop() if len(counts) == 1 else None

    def validate(self, n_layer: int, n_embd: int) -> None:
        if len(self.types) != n_layer:
            raise NblError(f"{len(self.types)} layer types given for a model of {n_layer} layers")
        for layer, layer_type in enumerate(self.types):
            if layer_type not in LAYER_TYPE_NAMES:
                raise NblError(f"layer {layer}: unknown NBL layer type {layer_type} (0, 1, 2 or 3)")
            if (layer_type == LINEAR) != (layer in self.linear):
                raise NblError(f"layer {layer}: linear weights must be given exactly for type-1 layers")
            if (layer_type == TAPS) != (layer in self.taps):
                raise NblError(f"layer {layer}: taps maps must be given exactly for type-3 layers")
        counts = sorted({int(m.taps) for m in self.taps.values()})
        if len(counts) > 1:
            raise NblError(f"taps layers read {counts} tokens: every taps layer of a file reads the same number")
        for layer, taps_map in sorted(self.taps.items()):
            validate_taps_map(layer, taps_map, n_embd)
        for layer, (weight, bias) in self.linear.items():
            if weight.shape != (n_embd, n_embd) or bias.shape != (n_embd,):
                raise NblError(
                    f"layer {layer}: NBL weight {weight.shape} and bias {bias.shape} do not match n_embd={n_embd}"
                )
            if not (np.isfinite(weight).all() and np.isfinite(bias).all()):
                raise NblError(f"layer {layer}: NBL weight or bias is not finite")
        if self.scores is not None and len(self.scores) != n_layer:
            raise NblError(f"{len(self.scores)} scores given for a model of {n_layer} layers")
        if self.windows is not None:
            self.windows.validate(self.types)


def validate_taps_map(layer: int, taps_map, n_embd: int) -> None:
    """The shapes docs/gguf-format.md gives a taps layer's tensors, each named when it is wrong."""
    k = int(taps_map.taps)
    if not 2 <= k <= MAX_TAPS:
        raise NblError(f"layer {layer}: a taps layer reads 2 to {MAX_TAPS} tokens, not {k}")
    tensors = {name: getattr(taps_map, name, None) for name in ("weight", "bias", *TAPS_TENSORS)}
    present = {name: np.asarray(t) for name, t in tensors.items() if t is not None}
    rank = present["lag_down"].shape[0] if "lag_down" in present and present["lag_down"].ndim == 2 else None
    expected = {"weight": (n_embd, n_embd), "bias": (n_embd,), "lag": (n_embd, (k - 1) * n_embd),
                "lag_down": (rank, (k - 1) * n_embd), "lag_up": (n_embd, rank), "conv": (k, n_embd)}
    for name in ("weight", "bias"):
        if name not in present:
            raise NblError(f"layer {layer}: the taps map has no {name}")
    if not any(name in present for name in TAPS_TENSORS):
        raise NblError(f"layer {layer}: a taps map needs lag, lag_down and lag_up, or conv (else it is a type-1 layer)")
    if "lag" in present and ("lag_down" in present or "lag_up" in present):
        raise NblError(f"layer {layer}: a taps map has a full (lag) or a low-rank (lag_down, lag_up) lag map, not both")
    if ("lag_down" in present) != ("lag_up" in present):
        raise NblError(f"layer {layer}: lag_down and lag_up come together")
    for name, array in present.items():
        if array.shape != expected[name]:
            raise NblError(f"layer {layer}: taps tensor {name} has shape {array.shape}, expected {expected[name]} "
                           f"(n_embd {n_embd}, {k} taps)")
        if not np.isfinite(array).all():
            raise NblError(f"layer {layer}: taps tensor {name} is not finite")


def is_attention_tensor(name: str, layer: int) -> bool:
    return any(name.startswith(f"blk.{layer}.{stem}.") for stem in ATTENTION_TENSOR_STEMS)


def read_layer_types(reader) -> list[int] | None:
    """The layer types of an open GGUF (gguf-py's reader or gguf_header's), or None for a stock file."""
    arch = str(reader.fields["general.architecture"].contents())
    layer_types = reader.fields.get(LAYER_TYPES_KEY.format(arch=arch))
    return None if layer_types is None else [int(v) for v in layer_types.contents()]


@dataclass(frozen=True)
class WeightType:
    """The ggml type of one layer's W, why it is not its attn_output's type when it is not, and the
    importance matrix's column weights it is quantized with, if any."""

    name: str  # gguf.GGMLQuantizationType name: Q4_K, Q8_0, F16, ...
    instead_of: str | None = None
    reason: str | None = None
    importance: np.ndarray | None = field(default=None, compare=False, repr=False)


def weight_type_problem(name: str, n_embd: int) -> str | None:
    """Why type ``name`` cannot store W [n_embd, n_embd], or None when it can."""
    import gguf

    if name in FLOAT_WEIGHT_TYPES:
        return None
    from nbl_gguf.llamacpp import ggml

    if name not in ggml.QUANTIZERS:
        return "ggml has no quantizer for it"
    if name in ggml.NEEDS_IMATRIX:
        return "it needs an importance matrix"
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][0]
    if n_embd % block:
        return f"rows of {n_embd} are not a multiple of its blocks of {block}"
    return None


def first_holding(types: Sequence[str], n_embd: int) -> str:
    """The first of ``types`` that can store an n_embd-wide W (or lag map)."""
    return next(t for t in types if weight_type_problem(t, n_embd) is None)


def bits_per_weight(name: str) -> float:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    return 8 * size / block


def default_weight_type(own: str, n_embd: int) -> WeightType:
    """W's type in a layer whose attn_output is ``own``: that type, raised to MIN_WEIGHT_BITS, or a
    fallback where it cannot hold an n_embd x n_embd matrix; with the reason when it is not ``own``."""
    bits = bits_per_weight(own)
    if bits < MIN_WEIGHT_BITS:
        return WeightType(first_holding(RAISED_WEIGHT_TYPES, n_embd), own, f"has {bits:g} bits per weight, W at least {MIN_WEIGHT_BITS:g}")
    problem = weight_type_problem(own, n_embd)
    if problem is not None:
        return WeightType(first_holding(FALLBACK_WEIGHT_TYPES, n_embd), own, f"cannot hold the {n_embd} x {n_embd} matrix: {problem}")
    return WeightType(own)


def parse_weight_type(text: str, n_embd: int) -> str:
    """``--nbl-type``: a ggml tensor type (any case) that can hold W, else an NblError saying why not."""
    import gguf

    from nbl_gguf.llamacpp import ggml

    name = text.strip().upper()
    usable = [t.lower() for t in ggml.QUANTIZERS if weight_type_problem(t, n_embd) is None]
    if name not in gguf.GGMLQuantizationType.__members__:
        mix = f" ({text} is a llama-quantize file type: a mix of tensor types)" \
            if f"MOSTLY_{name}" in gguf.LlamaFileType.__members__ else ""
        raise NblError(f"--nbl-type {text}: not a ggml tensor type{mix}; for n_embd {n_embd} use one of "
                       f"{', '.join(usable)}")
    problem = weight_type_problem(name, n_embd)
    if problem:
        raise NblError(f"--nbl-type {text} cannot hold the {n_embd} x {n_embd} NBL weight: {problem}; "
                       f"use one of {', '.join(usable)}")
    return name


def weight_types(src, layers: NblLayers, requested: str | None = None,
                 imatrix: str | Path | None = None) -> dict[int, WeightType]:
    """W's type for each linear layer of ``layers`` written into ``src`` (a path, or its open reader or header):
    ``requested`` for all, or by default from the type of that layer's attn_output (default_weight_type).
    With ``imatrix`` (llama-imatrix's GGUF, of the stock model), W is quantized with the column weights of
    its layer's attn_q (IMATRIX_SOURCES)."""
    if imatrix is not None:
        from nbl_gguf.gguf.quantize import imatrix_columns

        return {layer: replace(weight, importance=imatrix_columns(imatrix, [n.format(layer=layer) for n in IMATRIX_SOURCES]))
                for layer, weight in weight_types(src, layers, requested).items()}

    reader = read_header(src) if isinstance(src, (str, Path)) else src
    arch = str(reader.fields["general.architecture"].contents())
    n_embd = int(reader.fields[f"{arch}.embedding_length"].contents())
    mapped = sorted(set(layers.linear) | set(layers.taps))
    if requested is not None:
        name = parse_weight_type(requested, n_embd)
        return {layer: WeightType(name) for layer in mapped}
    attn_output = {layer_of(t.name): t.tensor_type.name for t in reader.tensors if t.name.endswith(".attn_output.weight")}
    return {layer: default_weight_type(attn_output.get(layer, "F32"), n_embd) for layer in mapped}


def write_nbl_gguf(src: str | Path, dst: str | Path, layers: NblLayers,
                   weight_type: str | Mapping[int, WeightType] | None = None) -> Path:
    """Rewrite the GGUF ``src`` (a stock conversion, or any model GGUF, quantized or not) into the NBL
    GGUF ``dst``.

    Every key is kept and every tensor copied as it is (its bytes and type), except the attention
    tensors of replaced layers; the layer-type key, the provenance keys and the NBL tensors are added.
    ``weight_type`` (a ggml type name: "F16", "Q8_0", "Q4_K", ..., or weight_types()' answer) stores W;
    by default each W takes the type of its layer's attn_output (weight_types()). Biases are always F32. The output appears only
    once it is complete.
    """
    import gguf

    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise NblError(f"the NBL GGUF must not overwrite its source {src}")
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    if arch not in SUPPORTED_ARCHITECTURES:
        raise NblError(f"{src} is a '{arch}' model; the patched llama.cpp runs NBL layers for "
                       f"{', '.join(SUPPORTED_ARCHITECTURES)} only")
    if read_layer_types(reader) is not None:
        raise NblError(f"{src} is already an NBL GGUF: start from the stock conversion")
    n_layer = int(reader.fields[f"{arch}.block_count"].contents())
    n_embd = int(reader.fields[f"{arch}.embedding_length"].contents())
    layers.validate(n_layer, n_embd)
    if layers.taps and arch not in TAPS_ARCHITECTURES:
        raise NblError(f"{src} is a '{arch}' model; the patched llama.cpp runs taps layers (type 3) for "
                       f"{', '.join(TAPS_ARCHITECTURES)} only")
    if layers.windows is not None:
        check_windows_allowed(reader, arch, src)
    types = weight_type if isinstance(weight_type, Mapping) else weight_types(reader, layers, weight_type)
    mapped = set(layers.linear) | set(layers.taps)
    if set(types) != mapped:
        raise NblError(f"NBL weight types given for layers {sorted(types)}, linear and taps layers are {sorted(mapped)}")

    tensors: list[tuple[str, np.ndarray, gguf.GGMLQuantizationType]] = []
    emitted: set[int] = set()
    for tensor in reader.tensors:
        layer = layer_of(tensor.name)
        if layer is not None and layers.types[layer] != ATTENTION and is_attention_tensor(tensor.name, layer):
            # the NBL tensors take the place of the first attention tensor, keeping the file's order
            if layer not in emitted and layers.types[layer] in (LINEAR, TAPS):
                weight, bias = layers.linear[layer] if layers.types[layer] == LINEAR else \
                    (layers.taps[layer].weight, layers.taps[layer].bias)
                qtype = gguf.GGMLQuantizationType[types[layer].name]
                tensors.append((NBL_WEIGHT.format(layer=layer), quantize_weight(weight, qtype, types[layer].importance), qtype))
                tensors.append((NBL_BIAS.format(layer=layer), np.asarray(bias, np.float32), gguf.GGMLQuantizationType.F32))
                if layers.types[layer] == TAPS:
                    tensors.extend(taps_tensors(layer, layers.taps[layer], qtype))
            emitted.add(layer)
            continue
        tensors.append((tensor.name, tensor.data, tensor.tensor_type))
    missing = [i for i, t in enumerate(layers.types) if t != ATTENTION and i not in emitted]
    if missing:
        raise NblError(f"{src} has no attention tensors for layers {missing}: is it a {arch} model?")

    with atomic_write(dst) as tmp:
        writer = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
        # a window the source declares for layers it does not mark is replaced by the file's own
        window_keys = {key.format(arch=arch) for key in (SLIDING_WINDOW_KEY, WINDOW_SINKS_KEY)}
        copy_keys(reader, writer, rename=lambda key: None if layers.windows is not None and key in window_keys else key)
        writer.add_key_value(
            LAYER_TYPES_KEY.format(arch=arch), [int(t) for t in layers.types],
            gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32,
        )
        if layers.taps:
            writer.add_uint32(TAPS_KEY.format(arch=arch), layers.n_taps)
        if layers.windows is not None:
            add_windows(writer, arch, layers.windows, n_layer)
        add_provenance(writer, layers)
        write_tensors(writer, tensors, reader.endianess, source=reader)
    return dst


def taps_tensors(layer: int, taps_map, qtype) -> list:
    """A taps layer's lag maps in W's type (a fallback where their rows do not fit its blocks) and its
    per-channel weights in F32 (llama.cpp multiplies the activations by them, ggml_mul takes F32)."""
    import gguf

    out = []
    for name, pattern in TAPS_TENSORS.items():
        array = getattr(taps_map, name, None)
        if array is None:
            continue
        array = np.ascontiguousarray(array, dtype=np.float32)
        if name == "conv":
            out.append((pattern.format(layer=layer), array, gguf.GGMLQuantizationType.F32))
            continue
        own = qtype
        if weight_type_problem(own.name, array.shape[1]) is not None:
            own = gguf.GGMLQuantizationType[first_holding(FALLBACK_WEIGHT_TYPES, array.shape[1])]
        out.append((pattern.format(layer=layer), quantize_weight(array, own), own))
    return out


def check_windows_allowed(reader, arch: str, src) -> None:
    """Window layers need an architecture whose patched graph builds them, and a file without windows
    of its own (its keys would be overwritten)."""
    if arch not in WINDOW_ARCHITECTURES:
        raise NblError(f"{src} is a '{arch}' model; the patched llama.cpp runs window layers for "
                       f"{', '.join(WINDOW_ARCHITECTURES)} only")
    if reader.fields.get(SLIDING_WINDOW_PATTERN_KEY.format(arch=arch)) is not None:
        raise NblError(f"{src} already marks sliding-window layers ({SLIDING_WINDOW_PATTERN_KEY.format(arch=arch)}): "
                       f"start from a file without them")


def add_windows(writer, arch: str, windows: Windows, n_layer: int) -> None:
    import gguf

    writer.add_uint32(SLIDING_WINDOW_KEY.format(arch=arch), int(windows.size))
    writer.add_key_value(SLIDING_WINDOW_PATTERN_KEY.format(arch=arch), windows.pattern(n_layer),
                         gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL)
    writer.add_uint32(WINDOW_SINKS_KEY.format(arch=arch), int(windows.sinks))


def read_windows(reader) -> Windows | None:
    """The window layers of an open GGUF (gguf-py's reader or gguf_header's), as the patched llama.cpp reads
    them (None: none)."""
    arch = str(reader.fields["general.architecture"].contents())
    if arch not in WINDOW_ARCHITECTURES:
        return None
    pattern = reader.fields.get(SLIDING_WINDOW_PATTERN_KEY.format(arch=arch))
    window = reader.fields.get(SLIDING_WINDOW_KEY.format(arch=arch))
    if pattern is None or window is None or not isinstance(pattern.contents(), list):
        return None
    layers = tuple(i for i, flag in enumerate(pattern.contents()) if flag)
    if not layers:
        return None
    sinks = reader.fields.get(WINDOW_SINKS_KEY.format(arch=arch))
    return Windows(layers=layers, size=int(window.contents()), sinks=0 if sinks is None else int(sinks.contents()))


def copy_keys(reader, writer, rename=lambda key: key) -> None:
    """Every key of ``reader`` with its value and type, as ``rename(key)`` (None: left out); not the
    architecture, which the writer was made with, nor the GGUF header's own fields."""
    import gguf

    writer.data_alignment = reader.alignment  # general.alignment, when the source has it, is copied below
    for key_value in reader.fields.values():
        if key_value.name == gguf.Keys.General.ARCHITECTURE or key_value.name.startswith("GGUF."):
            continue
        key = rename(key_value.name)
        if key is None:
            continue
        value_type = key_value.types[0]
        sub_type = key_value.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, key_value.contents(), value_type, sub_type=sub_type)


def add_provenance(writer, layers: NblLayers) -> None:
    """How the layers were chosen and fitted: keys that llama.cpp ignores and `inspect` reads."""
    import gguf

    if layers.method:
        writer.add_string(METHOD_KEY, layers.method)
    if layers.criterion:
        writer.add_string(CRITERION_KEY, layers.criterion)
    if layers.scores is not None:
        writer.add_key_value(SCORES_KEY, [float(v) for v in layers.scores], gguf.GGUFValueType.ARRAY,
                             sub_type=gguf.GGUFValueType.FLOAT32)
        if layers.scores_criterion or layers.criterion:
            writer.add_string(SCORES_CRITERION_KEY, layers.scores_criterion or layers.criterion)
    if layers.calibration is not None:
        writer.add_string(CALIBRATION_KEY, json.dumps(layers.calibration, sort_keys=True))


def write_tensors(writer, tensors: list, endianess, source=None) -> None:
    """The file after its keys: the infos of ``tensors`` [(name, data, ggml type)], then their data; closes
    ``writer``. ``source``: the GGUFReader whose memory map the copied tensors are views of."""
    for name, data, tensor_type in tensors:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data, tensor_endianess=endianess)
        if source is not None:
            drop_pages(source, data)
    writer.close()


def drop_pages(reader, array: np.ndarray) -> None:
    """Let the kernel take back the pages of the source file that copying ``array`` read: a mapped
    page that was touched stays in the process's resident set, so copying a 5 GB model would
    otherwise grow it by 5 GB (the pages stay in the page cache; nothing is read twice)."""
    import mmap

    handle = getattr(reader.data, "_mmap", None)
    base = reader.data.ctypes.data
    start = array.ctypes.data - base if array.size else -1
    if handle is None or not hasattr(handle, "madvise") or not 0 <= start < reader.data.nbytes:
        return
    page = mmap.PAGESIZE
    first = start // page * page
    length = min(start + array.nbytes, reader.data.nbytes) - first
    handle.madvise(mmap.MADV_DONTNEED, first, length)


def quantize_weight(weight: np.ndarray, qtype, importance: np.ndarray | None = None) -> np.ndarray:
    """W as stored: float types by gguf-py, the others by ggml's quantizers (as llama-quantize does,
    with ``importance``'s column weights when given)."""
    import gguf

    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if qtype.name in FLOAT_WEIGHT_TYPES:
        return gguf.quants.quantize(weight, qtype)
    from nbl_gguf.llamacpp import ggml

    return ggml.quantize(weight, int(qtype), qtype.name, importance)


def layer_of(name: str) -> int | None:
    """The block index of a tensor name such as blk.3.attn_q.weight, None for other tensors."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit():
        return int(parts[1])
    return None
