"""`inspect`: the NBL layer map of a GGUF (stock files too), its provenance, tensors and KV cache cost.

Reads the file with gguf-py only (memory-mapped; no torch, no llama.cpp).
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from pathlib import Path

from nbl_gguf.errors import NblError
from nbl_gguf.gguf.nbl_format import (
    ATTENTION,
    CALIBRATION_KEY,
    CRITERION_KEY,
    LAYER_TYPE_NAMES,
    METHOD_KEY,
    SCORES_KEY,
    TAPS,
    TAPS_KEY,
    layer_of,
    read_layer_types,
)
from nbl_gguf.gguf.stock_layout import read_stock_layer_types

KV_BYTES = 2  # the KV cache is F16 by default in llama.cpp
LAYOUTS = {
    "stock": "stock GGUF (no NBL layers)",
    "nbl": "NBL (patched llama.cpp)",
    "stock-layout": "NBL stock layout (deci)",
}
GGUF_MAGIC = b"GGUF"
# how gguf-py fails when a field or a tensor runs past the end of the file (a cut download or copy)
GGUF_PAST_THE_END = ("exceeds remaining file size", "cannot reshape array of size")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="a GGUF file (NBL or stock)")
    parser.add_argument("--json", action="store_true", help="print the description as JSON")
    parser.add_argument("--tensors", action="store_true", help="also list every tensor")


def open_gguf(path: str | os.PathLike):
    import gguf

    path = Path(path)
    if not path.exists():
        raise NblError(f"{path} does not exist")
    if not path.is_file():
        raise NblError(f"{path} is not a file")
    with path.open("rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise NblError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
    try:
        return gguf.GGUFReader(path)
    except Exception as error:  # noqa: BLE001 - gguf-py raises assorted types for damaged files
        if any(sign in str(error) for sign in GGUF_PAST_THE_END):
            raise NblError(f"{path} is truncated (or its header is damaged): the file ends before the data its "
                           f"header declares ({path.stat().st_size:,} bytes; gguf-py: {error})") from error
        raise NblError(f"{path} is not a readable GGUF file: {error}") from error


def open_model_gguf(path: str | os.PathLike):
    """(reader, architecture) of a model GGUF; a GGUF without an architecture is a clear error."""
    reader = open_gguf(path)
    if "general.architecture" not in reader.fields:
        raise NblError(f"{path} has no general.architecture: not a model GGUF")
    return reader, str(_field(reader, "general.architecture"))


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _per_layer(value, n_layer: int) -> list[int]:
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)] * n_layer


def kv_bytes_per_layer(reader) -> list[int]:
    """Bytes per token of each layer's K and V cache (F16) if the layer keeps its attention."""
    return [k + v for k, v in zip(*kv_widths(reader))]


def kv_widths(reader) -> tuple[list[int], list[int]]:
    """Bytes per token of each layer's K cache and of its V cache (F16), from the file's head counts."""
    arch = str(_field(reader, "general.architecture"))
    n_layer = int(_field(reader, f"{arch}.block_count"))
    n_embd = int(_field(reader, f"{arch}.embedding_length"))
    n_head = _per_layer(_field(reader, f"{arch}.attention.head_count"), n_layer)
    n_head_kv = _per_layer(_field(reader, f"{arch}.attention.head_count_kv", _field(reader, f"{arch}.attention.head_count")), n_layer)
    k_bytes, v_bytes = [], []
    for layer in range(n_layer):
        head_dim = n_embd // n_head[layer] if n_head[layer] else 0
        k_len = int(_field(reader, f"{arch}.attention.key_length", head_dim))
        v_len = int(_field(reader, f"{arch}.attention.value_length", head_dim))
        k_bytes.append(n_head_kv[layer] * k_len * KV_BYTES)
        v_bytes.append(n_head_kv[layer] * v_len * KV_BYTES)
    return k_bytes, v_bytes


def stock_layout_kv_without_flash_attention(reader) -> int:
    """KV bytes per token of a stock-layout file when flash attention is off: llama.cpp keeps every
    deci layer in the cache and, with V stored transposed, pads each layer's V to the widest, so the
    replaced layers lose only their K (docs/gguf-format.md, "Stock layout")."""
    k_bytes, v_bytes = kv_widths(reader)
    return sum(k_bytes) + len(v_bytes) * max(v_bytes, default=0)


def kv_bytes_per_token(reader, layer_types=None) -> tuple[int, int]:
    """(stock, this file) KV cache bytes per token: 2 * n_head_kv * head_dim * 2 bytes per attention layer."""
    per_layer = kv_bytes_per_layer(reader)
    types = layer_types if layer_types is not None else file_layer_types(reader)
    if types is None:
        return sum(per_layer), sum(per_layer)
    attention = [b for b, t in zip(per_layer, types) if t == ATTENTION]
    if read_stock_layer_types(reader) is not None:
        # the stock layout keeps no heads for replaced layers; llama-family models have the same heads
        # in every layer, so the unreplaced model's layers each cost what an attention layer costs
        per_layer = [max(attention, default=0)] * len(per_layer)
    return sum(per_layer), sum(attention)


def file_layer_types(reader) -> list[int] | None:
    """The NBL layer types of either layout, or None for a stock GGUF."""
    types = read_layer_types(reader)
    return types if types is not None else read_stock_layer_types(reader)


def layout(reader) -> tuple[str, bool]:
    """(the file's layout, whether an unmodified llama.cpp build runs it)."""
    if read_stock_layer_types(reader) is not None:
        return LAYOUTS["stock-layout"], True
    types = read_layer_types(reader)
    if types is not None:
        # a stock build ignores the key and then misses the attention tensors of the replaced layers
        return LAYOUTS["nbl"], all(t == ATTENTION for t in types)
    return LAYOUTS["stock"], True


def taps_state(reader, types) -> dict | None:
    """Tokens a taps layer reads and the F32 state llama.cpp keeps for them per sequence (the inputs of
    the last taps - 1 tokens of every taps layer), or None without taps layers."""
    arch = str(_field(reader, "general.architecture"))
    n_taps = _field(reader, TAPS_KEY.format(arch=arch))
    layers = sum(1 for t in types or [] if t == TAPS)
    if n_taps is None or not layers:
        return None
    n_embd = int(_field(reader, f"{arch}.embedding_length"))
    return {"taps": int(n_taps), "layers": layers,
            "state_bytes_per_sequence": layers * (int(n_taps) - 1) * n_embd * 4}


def describe(path: str | os.PathLike) -> dict:
    """Everything `inspect` prints, as plain data."""
    import gguf

    path = Path(path)
    reader, arch = open_model_gguf(path)
    n_layer = int(_field(reader, f"{arch}.block_count", 0))
    types = file_layer_types(reader)
    layout_name, stock_runs = layout(reader)
    scores = _field(reader, SCORES_KEY)
    calibration = _field(reader, CALIBRATION_KEY)
    if calibration is not None:
        try:
            calibration = json.loads(calibration)
        except json.JSONDecodeError:
            pass
    file_type = _field(reader, "general.file_type")
    try:
        file_type_name = gguf.LlamaFileType(int(file_type)).name.replace("MOSTLY_", "").replace("ALL_", "")
    except (TypeError, ValueError):
        file_type_name = None if file_type is None else str(file_type)

    layer_tensors: dict[int, list[dict]] = defaultdict(list)
    tensors = []
    by_type: dict[str, dict] = {}
    for tensor in reader.tensors:
        entry = {"name": tensor.name, "type": tensor.tensor_type.name,
                 "shape": [int(n) for n in tensor.shape], "bytes": int(tensor.n_bytes)}
        tensors.append(entry)
        summary = by_type.setdefault(entry["type"], {"count": 0, "bytes": 0, "params": 0})
        summary["count"] += 1
        summary["bytes"] += entry["bytes"]
        summary["params"] += int(tensor.n_elements)
        layer = layer_of(tensor.name)
        if layer is not None:
            layer_tensors[layer].append(entry)

    kv_stock, kv_file = kv_bytes_per_token(reader, types)
    layers = []
    for layer in range(n_layer):
        layer_type = ATTENTION if types is None else int(types[layer])
        layers.append({
            "index": layer,
            "type": LAYER_TYPE_NAMES.get(layer_type, str(layer_type)),
            "score": None if scores is None else float(scores[layer]),
            "tensors": {t["name"].split(".", 2)[2]: t["type"] for t in layer_tensors.get(layer, [])},
        })
    attention_layers = sum(1 for entry in layers if entry["type"] == "attention")
    return {
        "file": str(path),
        "file_bytes": path.stat().st_size,
        "architecture": arch,
        "name": _field(reader, "general.name"),
        "file_type": file_type_name,
        "nbl": types is not None,
        "layout": layout_name,
        "stock_llama_cpp_runs_it": stock_runs,
        "block_count": n_layer,
        "embedding_length": _field(reader, f"{arch}.embedding_length"),
        "method": _field(reader, METHOD_KEY),
        "criterion": _field(reader, CRITERION_KEY),
        "calibration": calibration,
        "layers": layers,
        "replaced": {name: sum(1 for e in layers if e["type"] == name) for name in ("linear", "dropped", "taps")},
        "taps": taps_state(reader, types),
        "attention_layers": attention_layers,
        "kv_bytes_per_token": {"stock": kv_stock, "file": kv_file, **(
            {"file_flash_attention_off": stock_layout_kv_without_flash_attention(reader)}
            if read_stock_layer_types(reader) is not None else {})},
        "tensor_types": dict(sorted(by_type.items())),
        "tensor_count": len(tensors),
        "tensors": tensors,
    }


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _display_order(item) -> tuple[str, bool]:
    stem, _, suffix = item[0].rpartition(".")
    return stem, suffix != "weight"


def _is_attention_part(name: str) -> bool:
    return name.startswith("attn_") and not name.startswith("attn_norm")


def format_text(info: dict, with_tensors: bool = False) -> str:
    out = []
    out.append(f"file:          {info['file']}  ({human_bytes(info['file_bytes'])})")
    out.append(f"model:         {info['name'] or '?'}  (architecture {info['architecture']}, file type {info['file_type']}, "
               f"{info['block_count']} layers, n_embd {info['embedding_length']})")
    runs = "yes" if info["stock_llama_cpp_runs_it"] else "no (needs the patched llama.cpp)"
    out.append(f"layout:        {info['layout']}; a stock llama.cpp build runs it: {runs}")
    if info["nbl"]:
        rep = info["replaced"]
        kinds = f"{rep['linear']} linear, {rep['dropped']} dropped" + (f", {rep['taps']} taps" if rep["taps"] else "")
        out.append(f"NBL:           {sum(rep.values())} of {info['block_count']} attention layers replaced ({kinds})")
        taps = info["taps"]
        if taps is not None:
            out.append(f"taps:          each taps layer reads {taps['taps']} tokens; state {taps['state_bytes_per_sequence']:,} "
                       f"bytes per sequence (F32: {taps['layers']} layers x {taps['taps'] - 1} x n_embd x 4)")
        out.append(f"method:        {info['method'] or '?'}    criterion: {info['criterion'] or '?'}")
        calibration = info["calibration"]
        if calibration is not None:
            text = json.dumps(calibration, sort_keys=True) if not isinstance(calibration, str) else calibration
            out.append(f"calibration:   {text}")
    else:
        out.append("NBL:           none (stock GGUF: every layer keeps its attention)")
    kv = info["kv_bytes_per_token"]
    ratio = kv["file"] / kv["stock"] if kv["stock"] else 1.0
    out.append(f"KV cache:      {kv['file']:,} bytes/token (F16)  vs stock {kv['stock']:,}  ({ratio:.1%})")
    if "file_flash_attention_off" in kv:
        off = kv["file_flash_attention_off"]
        out.append(f"               with flash attention; without it {off:,} ({off / kv['stock']:.1%}): "
                   f"llama.cpp pads the V cache of the replaced layers")
    out.append("")
    out.append("layer  type       score     attention tensors (other tensors of the layer)")
    for layer in info["layers"]:
        score = "" if layer["score"] is None else f"{layer['score']:.4f}"
        attn = [f"{name.removesuffix('.weight')}:{kind}" for name, kind in sorted(layer["tensors"].items(), key=_display_order)
                if _is_attention_part(name)]
        other = sorted({kind for name, kind in layer["tensors"].items() if not _is_attention_part(name)})
        out.append(f"{layer['index']:5d}  {layer['type']:<9s}  {score:<8s}  {' '.join(attn) or '-'}"
                   f"  (+{len(layer['tensors']) - len(attn)} {'/'.join(other)})")
    out.append("")
    out.append(f"tensor types ({info['tensor_count']} tensors):")
    out.append("  type      count      params        bytes")
    for name, summary in info["tensor_types"].items():
        out.append(f"  {name:<8s} {summary['count']:6d} {summary['params']:12,d} {human_bytes(summary['bytes']):>12s}")
    if with_tensors:
        out.append("")
        out.append("tensors:")
        for tensor in info["tensors"]:
            shape = "x".join(str(n) for n in tensor["shape"])
            out.append(f"  {tensor['name']:<32s} {tensor['type']:<7s} {shape:<14s} {human_bytes(tensor['bytes'])}")
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    info = describe(args.file)
    if args.json:
        if not args.tensors:
            info = {k: v for k, v in info.items() if k != "tensors"}
        print(json.dumps(info, indent=2))
    else:
        print(format_text(info, with_tensors=args.tensors))
    return 0
