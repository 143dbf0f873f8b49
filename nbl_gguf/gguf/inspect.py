"""What a GGUF holds (stock files too): its NBL layer map, provenance, tensors and KV cache cost, as data
(describe) and as the text `inspect` prints (format_text; the command: nbl_gguf.commands.inspect).

Reads the file with gguf-py only (memory-mapped; no torch, no llama.cpp).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

from nbl_gguf.calibration.artifact import CRITERIA
from nbl_gguf.errors import NblError
from nbl_gguf.kv_cache import Context, KvLayer, KvModel, KvSize, kv_size
from nbl_gguf.gguf.nbl_format import (
    ATTENTION,
    CALIBRATION_KEY,
    CRITERION_KEY,
    LAYER_TYPE_NAMES,
    METHOD_KEY,
    SCORES_CRITERION_KEY,
    SCORES_KEY,
    TAPS,
    TAPS_KEY,
    WINDOW,
    layer_of,
    read_layer_types,
    read_windows,
)
from nbl_gguf.gguf.stock_layout import read_stock_layer_types

KV_BYTES = 2  # the KV cache is F16 by default in llama.cpp
DEFAULT_CTX = 4096  # the KV figures' context for a file that names no training context
CONTEXT_SETTINGS = "F16 K and V, one sequence, n_ubatch 512, flash attention not off, no --swa-full"
LAYOUTS = {
    "stock": "stock GGUF (no NBL layers)",
    "nbl": "NBL (patched llama.cpp)",
    "stock-layout": "NBL stock layout (deci)",
}
GGUF_MAGIC = b"GGUF"
# how gguf-py fails when a field or a tensor runs past the end of the file (a cut download or copy)
GGUF_PAST_THE_END = ("exceeds remaining file size", "cannot reshape array of size")


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


# Which layers llama.cpp's loader makes sliding-window ones (src/models/<arch>.cpp): the window it
# assumes without a <arch>.attention.sliding_window key (None: no key, no sliding layers) and the
# pattern p that makes layer i slide when i % p < p - 1, unless <arch>.attention.sliding_window_pattern
# gives another p or one flag per layer
SLIDING_WINDOW_RULES = {"gemma2": (4096, 2), "gemma3": (None, 6)}
# every layer of these attends to the whole context in llama.cpp, whatever sliding_window key the file
# carries (phi3 turns its window off; llama, qwen2 and smollm3 have none in llama.cpp), except the
# window layers that a sliding_window_pattern array marks for the patched llama.cpp (llama, qwen2)
FULL_ATTENTION_ARCHITECTURES = ("llama", "deci", "qwen2", "qwen3", "phi3", "smollm3")


def sliding_layers(reader) -> tuple[int, list[bool]]:
    """(window, whether each layer slides) as llama.cpp reads them from the file."""
    arch = str(_field(reader, "general.architecture"))
    n_layer = int(_field(reader, f"{arch}.block_count"))
    windows = read_windows(reader)
    if windows is not None:
        return windows.size, windows.pattern(n_layer)
    if arch not in SLIDING_WINDOW_RULES:
        return 0, [False] * n_layer
    default_window, pattern = SLIDING_WINDOW_RULES[arch]
    window = _field(reader, f"{arch}.attention.sliding_window", default_window)
    if not window:
        return 0, [False] * n_layer
    flags = _field(reader, f"{arch}.attention.sliding_window_pattern", pattern)
    if isinstance(flags, list):
        if len(flags) != n_layer:
            raise NblError(f"{arch}.attention.sliding_window_pattern has {len(flags)} flags for {n_layer} layers")
        return int(window), [bool(flag) for flag in flags]
    pattern = int(flags)
    return int(window), [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layer)]


def sliding_window_modelled(reader) -> bool:
    """False for an architecture whose sliding-window layers, if it has any, these figures do not know."""
    arch = str(_field(reader, "general.architecture"))
    return (arch in SLIDING_WINDOW_RULES or arch in FULL_ATTENTION_ARCHITECTURES
            or _field(reader, f"{arch}.attention.sliding_window") is None)


def kv_model(reader, layer_types=None) -> KvModel:
    """The KV layout llama.cpp gives the file: per layer its K and V widths, whether it slides, and
    whether it has a cache (not where ``layer_types``, by default the file's own, replaced it)."""
    arch = str(_field(reader, "general.architecture"))
    n_layer = int(_field(reader, f"{arch}.block_count"))
    n_embd = int(_field(reader, f"{arch}.embedding_length"))
    n_head = _per_layer(_field(reader, f"{arch}.attention.head_count"), n_layer)
    n_head_kv = _per_layer(_field(reader, f"{arch}.attention.head_count_kv", _field(reader, f"{arch}.attention.head_count")), n_layer)
    # llama.cpp takes the head size from layer 0's head count unless the file gives it
    head_dim = n_embd // n_head[0] if n_head and n_head[0] else 0
    k_len = int(_field(reader, f"{arch}.attention.key_length", head_dim))
    v_len = int(_field(reader, f"{arch}.attention.value_length", head_dim))
    k_len_swa = int(_field(reader, f"{arch}.attention.key_length_swa", k_len))
    v_len_swa = int(_field(reader, f"{arch}.attention.value_length_swa", v_len))
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
    arch = str(_field(reader, "general.architecture"))
    model = kv_model(reader, layer_types=[ATTENTION] * int(_field(reader, f"{arch}.block_count")))
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


def kv_sizes(reader, n_ctx: int, layer_types=None, **settings) -> tuple[KvSize, KvSize]:
    """(stock, this file) KV cache as llama.cpp allocates it at ``n_ctx`` (llama-cli's settings unless
    ``settings`` name other kv_cache.Context fields); with ``layer_types``, this file as if those layers
    were replaced."""
    stock = stock_kv_model(reader)
    if layer_types is None:
        nbl = kv_model(reader)
    else:
        nbl = stock.without(i for i, t in enumerate(layer_types) if t != ATTENTION)
    context = Context(n_ctx=n_ctx, **settings)
    return kv_size(stock, context), kv_size(nbl, context)


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


def training_context(reader) -> int | None:
    arch = str(_field(reader, "general.architecture"))
    value = _field(reader, f"{arch}.context_length")
    return None if value is None else int(value)


def cache_json(size: KvSize) -> dict:
    return {"bytes": size.bytes, "caches": {name: {"cells": cache.cells, "layers": cache.layers,
                                                   "k_bytes": cache.k_bytes, "v_bytes": cache.v_bytes}
                                            for name, cache in size.caches.items()}}


def describe(path: str | os.PathLike, n_ctx: int | None = None) -> dict:
    """Everything `inspect` prints, as plain data; KV cache sizes at ``n_ctx`` (default: the training context)."""
    import gguf

    path = Path(path)
    reader, arch = open_model_gguf(path)
    n_layer = int(_field(reader, f"{arch}.block_count", 0))
    types = file_layer_types(reader)
    layout_name, stock_runs = layout(reader)
    scores = _field(reader, SCORES_KEY)
    criterion = _field(reader, CRITERION_KEY)
    # files from before nbl.scores_criterion record scores of a local criterion only, under nbl.criterion
    scores_criterion = _field(reader, SCORES_CRITERION_KEY,
                              criterion if scores is not None and criterion in CRITERIA else None)
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
    if n_ctx is None:
        n_ctx = training_context(reader) or DEFAULT_CTX
    size_stock, size_file = kv_sizes(reader, n_ctx)
    sliding = [layer.sliding for layer in kv_model(reader).layers]
    windows = read_windows(reader)
    layers = []
    for layer in range(n_layer):
        layer_type = ATTENTION if types is None else int(types[layer])
        layers.append({
            "index": layer,
            "type": WINDOW if windows is not None and layer in windows.layers
                    else LAYER_TYPE_NAMES.get(layer_type, str(layer_type)),
            "sliding": sliding[layer],
            "score": None if scores is None else float(scores[layer]),
            # what the layer caches at n_ctx, and what its replacement freed
            "kv_bytes": size_file.per_layer[layer],
            "kv_freed": size_stock.per_layer[layer] - size_file.per_layer[layer],
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
        "criterion": criterion,
        "scores_criterion": scores_criterion,
        "calibration": calibration,
        "layers": layers,
        "replaced": {name: sum(1 for e in layers if e["type"] == name) for name in ("linear", "dropped", "taps")},
        "taps": taps_state(reader, types),
        "windows": None if windows is None else {"layers": list(windows.layers), "size": windows.size,
                                                 "sinks": windows.sinks},
        "attention_layers": attention_layers,
        "kv_bytes_per_token": {"stock": kv_stock, "file": kv_file, **(
            {"file_flash_attention_off": stock_layout_kv_without_flash_attention(reader)}
            if read_stock_layer_types(reader) is not None else {})},
        "kv_cache": {
            "n_ctx": n_ctx,
            "training_context": training_context(reader),
            "window": kv_model(reader).window,
            "settings": CONTEXT_SETTINGS,
            "sliding_window_modelled": sliding_window_modelled(reader),
            "stock": cache_json(size_stock),
            "file": cache_json(size_file),
            **({"file_flash_attention_off": kv_sizes(reader, n_ctx, flash_attn=False)[1].bytes}
               if read_stock_layer_types(reader) is not None else {}),
        },
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


def change(before: int, after: int) -> str:
    return f"{(after - before) / before:+.1%}" if before else "+0.0%"


def kv_lines(info: dict) -> list[str]:
    """The KV cache lines of `inspect`: the total at the context, then each cache where there are two."""
    kv = info["kv_cache"]
    stock, file = kv["stock"], kv["file"]
    source = "training context" if kv["n_ctx"] == kv["training_context"] else "--ctx-size"
    out = [f"KV cache:      {human_bytes(file['bytes'])} at {kv['n_ctx']:,} tokens ({source}) vs stock "
           f"{human_bytes(stock['bytes'])} ({change(stock['bytes'], file['bytes'])})"]
    if "sliding" in file["caches"]:
        sinks = f" + {info['windows']['sinks']} sinks" if info.get("windows") else ""
        for name, what in (("global", "global layers"), ("sliding", f"sliding-window layers (window {kv['window']:,}{sinks})")):
            mine, theirs = file["caches"][name], stock["caches"].get(name)
            # the layers of the stock model that a window file made window layers were global ones there
            stock_part = "" if theirs is None else (f" of {theirs['layers']}", f" (stock {human_bytes(theirs['k_bytes'] + theirs['v_bytes'])})")
            of, was = stock_part or ("", "")
            out.append(f"               {what}: {mine['layers']}{of} cache {mine['cells']:,} cells: "
                       f"{human_bytes(mine['k_bytes'] + mine['v_bytes'])}{was}")
    else:
        per_token = info["kv_bytes_per_token"]
        out.append(f"               {per_token['file']:,} bytes per token vs stock {per_token['stock']:,}")
    if "file_flash_attention_off" in kv:
        off = kv["file_flash_attention_off"]
        out.append(f"               with -fa off {human_bytes(off)} ({change(stock['bytes'], off)}): llama.cpp then pads "
                   f"the V cache of the replaced layers")
    if not kv["sliding_window_modelled"]:
        out.append(f"               {info['architecture']}: llama.cpp's sliding-window layers of this architecture are "
                   f"not modelled: every layer counted as caching the whole context")
    out.append(f"               as llama-cli allocates it: {kv['settings']}")
    return out


INDENT = " " * 15  # under the value column of format_text


def scores_line(info: dict) -> str:
    """Which score the layer table shows, or why it shows none."""
    criterion, chosen = info["criterion"], info["scores_criterion"]
    if chosen is not None:
        why = f"the criterion that {criterion} chose" if chosen != criterion else "the criterion that chose the layers"
        return f"{chosen} ({why}); lower: more replaceable"
    if criterion == "greedy":
        return "none per layer: greedy chose the layers by the held-out perplexity of the whole model (selection above)"
    if criterion == "best":
        return "none recorded (the file predates nbl.scores_criterion, which best's scores need)"
    return "none recorded in the file"


def _short(value, digits: int = 12) -> str:
    return str(value)[:digits] if value else "?"


def _increase_steps(heldout: dict) -> str:
    """The held-out perplexity increase as the layers were added (walk, greedy) or of the set at once."""
    order, increases = heldout.get("order") or [], heldout.get("ppl_increase_pct") or []
    if increases and len(increases) == len(order):
        return ", ".join(f"+layer {layer} {inc:+.1f}%" for layer, inc in zip(order, increases))
    if increases:
        return f"{len(order)} layers together {increases[-1]:+.1f}%"
    return "no layer added"


def selection_lines(selection: dict) -> list[str]:
    """How the provenance's measured selection chose the layers: what it compared, on how many tokens."""
    heldout = selection.get("heldout") or {}
    lines = [f"{selection.get('method', '?')} by {selection.get('criterion', '?')}, m = {selection.get('m', '?')}"
             + (f" (--m auto within +{selection['max_ppl_increase']:g}%)" if "max_ppl_increase" in selection else "")
             + f": held-out perplexity on {heldout.get('heldout_tokens', 0):,} tokens"
             + (f" (unmodified {heldout['base_ppl']:.3f})" if "base_ppl" in heldout else "")]
    compared = heldout.get("compared")
    if compared:
        chosen = heldout.get("criterion")
        width = max(len(name) for name in compared)
        for name, entry in compared.items():
            layers = ", ".join(map(str, entry.get("layers", []))) or "none"
            mark = "  <- chosen" if name == chosen else ""
            lines.append(f"  {name:<{width}s}  {entry.get('ppl_increase_pct', float('nan')):+7.1f}%  "
                         f"layers {layers}{mark}")
        if chosen is not None and len(heldout.get("order") or []) == len(heldout.get("ppl_increase_pct") or []):
            lines.append(f"  {chosen} walk: {_increase_steps(heldout)}")
    else:
        lines.append(f"  {_increase_steps(heldout)}")
    if heldout.get("stopped"):
        lines.append(f"  stopped: {heldout['stopped']}")
    return lines


def calibration_lines(calibration) -> list[str]:
    """The calibration record (nbl.calibration) as a short block: model, data, selection, versions."""
    if calibration is None:
        return []
    if not isinstance(calibration, dict):
        text = calibration if isinstance(calibration, str) else json.dumps(calibration, sort_keys=True)
        return [f"calibration:   {text}"]
    rows = []
    model = calibration.get("model")
    if model is not None:
        details = ", ".join(str(calibration[k]) for k in ("model_type", "dtype") if calibration.get(k))
        rows.append(("model", f"{model}" + (f" ({details})" if details else "")))
    source = calibration.get("source_gguf")
    if isinstance(source, dict):
        rows.append(("from", f"{source.get('file', '?')} (sha256 {_short(source.get('sha256'))})"))
    if any(calibration.get(k) is not None for k in ("tokens", "dataset", "nsamples")):
        tokens = calibration.get("tokens")
        windows = (f": {calibration['nsamples']} windows of {calibration['seqlen']}"
                   if calibration.get("nsamples") and calibration.get("seqlen") else "")
        documents = f"{calibration['documents']} documents of " if calibration.get("documents") else ""
        dataset = calibration.get("dataset") or "?"
        config = f" ({calibration['dataset_config']})" if calibration.get("dataset_config") else ""
        split = f", split {calibration['split']}" if calibration.get("split") else ""
        rows.append(("data", (f"{tokens:,} tokens" if isinstance(tokens, int) else "? tokens") + windows
                     + f" from {documents}{dataset}{config}{split}"))
        if calibration.get("text_sha256"):
            rows.append(("", f"text sha256 {_short(calibration['text_sha256'])}"))
    if calibration.get("seed") is not None:
        rows.append(("seed", str(calibration["seed"])))
    selection = calibration.get("selection")
    if isinstance(selection, dict):
        lines = selection_lines(selection)
        rows.append(("selection", lines[0]))
        rows += [("", line) for line in lines[1:]]
    versions = calibration.get("versions")
    if isinstance(versions, dict) and versions:
        shown = {**versions}
        commit, patches = shown.pop("llama.cpp", None), shown.pop("llama.cpp patches", None)
        parts = [f"{name} {shown.pop(name)}" for name in ("nbl_gguf", "gguf", "torch", "transformers") if name in shown]
        if commit or patches:
            parts.insert(1, f"llama.cpp {_short(commit, 7)}" + (f" + patches {_short(patches, 8)}" if patches else ""))
        parts += [f"{name} {value}" for name, value in sorted(shown.items())]
        lines = [parts[0]]
        for part in parts[1:]:  # a few per line
            if len(lines[-1]) + len(part) > 70:
                lines.append(part)
            else:
                lines[-1] += ", " + part
        rows += [("versions" if i == 0 else "", line) for i, line in enumerate(lines)]
    known = {"model", "model_type", "dtype", "source_gguf", "tokens", "dataset", "dataset_config", "split", "nsamples",
             "seqlen", "documents", "text_sha256", "seed", "selection", "versions"}
    rows += [(key, json.dumps(calibration[key], sort_keys=True)) for key in sorted(set(calibration) - known)]
    lines = [("calibration:   " if index == 0 else INDENT) + f"{label:<11s}{value}"
             for index, (label, value) in enumerate(rows)]
    return lines or ["calibration:   {}"]


def format_text(info: dict, with_tensors: bool = False) -> str:
    out = []
    out.append(f"file:          {info['file']}  ({human_bytes(info['file_bytes'])})")
    out.append(f"model:         {info['name'] or '?'}  (architecture {info['architecture']}, file type {info['file_type']}, "
               f"{info['block_count']} layers, n_embd {info['embedding_length']})")
    runs = "yes" if info["stock_llama_cpp_runs_it"] else "no (needs the patched llama.cpp)"
    if info["stock_llama_cpp_runs_it"] and info.get("windows"):
        runs += " (its window layers then attend to every token: the patched llama.cpp bounds their cache)"
    out.append(f"layout:        {info['layout']}; a stock llama.cpp build runs it: {runs}")
    if info["nbl"]:
        rep = info["replaced"]
        kinds = f"{rep['linear']} linear, {rep['dropped']} dropped" + (f", {rep['taps']} taps" if rep["taps"] else "")
        out.append(f"NBL:           {sum(rep.values())} of {info['block_count']} attention layers replaced ({kinds})")
        taps = info["taps"]
        if taps is not None:
            out.append(f"taps:          each taps layer reads {taps['taps']} tokens; state {taps['state_bytes_per_sequence']:,} "
                       f"bytes per sequence (F32: {taps['layers']} layers x {taps['taps'] - 1} x n_embd x 4)")
        windows = info["windows"]
        if windows is not None:
            out.append(f"windows:       {len(windows['layers'])} layers attend to the last {windows['size']:,} tokens and "
                       f"the first {windows['sinks']} (sinks): layers {', '.join(map(str, windows['layers']))}")
        out.append(f"method:        {info['method'] or '?'}    criterion: {info['criterion'] or '?'}")
        out += calibration_lines(info["calibration"])
        out.append(f"scores:        {scores_line(info)}")
    else:
        out.append("NBL:           none (stock GGUF: every layer keeps its attention)")
    out += kv_lines(info)
    out.append("")
    kv = info["kv_cache"]
    kv_header = f"KV at {kv['n_ctx']:,}"
    width = max(len(kv_header), 16)
    slides = any(layer["sliding"] for layer in info["layers"])
    window = "window   " if slides else ""
    with_scores = any(layer["score"] is not None for layer in info["layers"])
    out.append(f"layer  type       {window}" + ("score     " if with_scores else "")
               + f"{kv_header:>{width}s}  attention tensors (other tensors of the layer)")
    for layer in info["layers"]:
        score = ("-" if layer["score"] is None else f"{layer['score']:.4f}").ljust(8) + "  " if with_scores else ""
        attn = [f"{name.removesuffix('.weight')}:{kind}" for name, kind in sorted(layer["tensors"].items(), key=_display_order)
                if _is_attention_part(name)]
        other = sorted({kind for name, kind in layer["tensors"].items() if not _is_attention_part(name)})
        cache = human_bytes(layer["kv_bytes"]) if not layer["kv_freed"] else f"freed {human_bytes(layer['kv_freed'])}"
        attends = ("sliding  " if layer["sliding"] else "global   ") if slides else ""
        out.append(f"{layer['index']:5d}  {layer['type']:<9s}  {attends}{score}{cache:>{width}s}  {' '.join(attn) or '-'}"
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
