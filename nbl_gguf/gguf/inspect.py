"""What a GGUF holds (stock files too): its NBL layer map, provenance, tensors and KV cache cost, as data
(describe) and as the text `inspect` prints (format_text; the command: nbl_gguf.commands.inspect). The
reading itself, fields and KV layout: gguf.metadata.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

from nbl_gguf.calibration.artifact import CRITERIA
from nbl_gguf.kv_cache import DEFAULT_UBATCH, KvSize
from nbl_gguf.gguf.metadata import (
    file_layer_types,
    file_type_name,
    kv_bytes_per_token,
    kv_model,
    kv_sizes,
    open_model_gguf,
    read_field,
    sliding_window_modelled,
    stock_layout_kv_without_flash_attention,
    taps_state,
    training_context,
)
from nbl_gguf.gguf.nbl_format import (
    ATTENTION,
    CALIBRATION_KEY,
    CRITERION_KEY,
    LAYER_TYPE_NAMES,
    METHOD_KEY,
    SCORES_CRITERION_KEY,
    SCORES_KEY,
    WINDOW,
    layer_of,
    read_layer_types,
    read_windows,
)
from nbl_gguf.gguf.stock_layout import read_stock_layer_types

DEFAULT_CTX = 4096  # the KV figures' context for a file that names no training context
def context_settings(n_ubatch: int = DEFAULT_UBATCH) -> str:
    return f"F16 K and V, one sequence, n_ubatch {n_ubatch}, flash attention not off, no --swa-full"
LAYOUTS = {
    "stock": "stock GGUF (no NBL layers)",
    "nbl": "NBL (patched llama.cpp)",
    "stock-layout": "NBL stock layout (deci)",
}


def layout(reader) -> tuple[str, bool]:
    """(the file's layout, whether an unmodified llama.cpp build runs it)."""
    if read_stock_layer_types(reader) is not None:
        return LAYOUTS["stock-layout"], True
    types = read_layer_types(reader)
    if types is not None:
        # a stock build ignores the key and then misses the attention tensors of the replaced layers
        return LAYOUTS["nbl"], all(t == ATTENTION for t in types)
    return LAYOUTS["stock"], True


def cache_json(size: KvSize) -> dict:
    return {"bytes": size.bytes, "caches": {name: {"cells": cache.cells, "layers": cache.layers,
                                                   "k_bytes": cache.k_bytes, "v_bytes": cache.v_bytes}
                                            for name, cache in size.caches.items()}}


def describe(path: str | os.PathLike, n_ctx: int | None = None, n_ubatch: int = DEFAULT_UBATCH) -> dict:
    """Everything `inspect` prints, as plain data; KV cache sizes at ``n_ctx`` (default: the training context)
    with micro-batches of ``n_ubatch`` (what a sliding-window layer caches beside its window)."""
    path = Path(path)
    reader, arch = open_model_gguf(path)
    n_layer = int(read_field(reader, f"{arch}.block_count", 0))
    types = file_layer_types(reader)
    layout_name, stock_runs = layout(reader)
    scores = read_field(reader, SCORES_KEY)
    criterion = read_field(reader, CRITERION_KEY)
    # files from before nbl.scores_criterion record scores of a local criterion only, under nbl.criterion
    scores_criterion = read_field(reader, SCORES_CRITERION_KEY,
                                  criterion if scores is not None and criterion in CRITERIA else None)
    calibration = read_field(reader, CALIBRATION_KEY)
    if calibration is not None:
        try:
            calibration = json.loads(calibration)
        except json.JSONDecodeError:
            pass

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
    size_stock, size_file = kv_sizes(reader, n_ctx, n_ubatch=n_ubatch)
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
        "name": read_field(reader, "general.name"),
        "file_type": file_type_name(read_field(reader, "general.file_type")),
        "nbl": types is not None,
        "layout": layout_name,
        "stock_llama_cpp_runs_it": stock_runs,
        "block_count": n_layer,
        "embedding_length": read_field(reader, f"{arch}.embedding_length"),
        "method": read_field(reader, METHOD_KEY),
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
            "settings": context_settings(n_ubatch),
            "sliding_window_modelled": sliding_window_modelled(reader),
            "stock": cache_json(size_stock),
            "file": cache_json(size_file),
            **({"file_flash_attention_off": kv_sizes(reader, n_ctx, flash_attn=False, n_ubatch=n_ubatch)[1].bytes}
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
             + (" (measured at this m from the calibration)" if selection.get("measured_after_calibration") else "")
             + f": held-out perplexity on {heldout.get('heldout_tokens', 0):,} tokens"
             + (f" (unmodified {heldout['base_ppl']:.3f})" if "base_ppl" in heldout else "")]
    compared = heldout.get("compared")
    if compared:
        chosen = heldout.get("criterion")
        width = max(len(name) for name in compared)
        for name, entry in compared.items():
            layers = _layers(entry.get("layers"))
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
    recall = calibration.get("recall")
    if isinstance(recall, dict) and isinstance(recall.get("retrieval"), dict):
        guard = recall["retrieval"]
        refused = ", ".join(f"{k} ({v:.3f})" for k, v in guard.get("refused", {}).items()) or "none"
        rows.append(("recall", f"layers {_layers(recall.get('layers'))} from the selection's "
                               f"{_layers(recall.get('selected'))}; refused {refused}"))
        rows.append(("", f"probes' answer loss {guard.get('base_loss', float('nan')):.3f} -> "
                         f"{guard.get('loss', float('nan')):.3f} nats/token (tolerance {guard.get('tolerance')}, "
                         f"{guard.get('probes')} probes of {recall.get('ctx')} tokens)"))
    refine = calibration.get("refine")
    described = {"refine"} if isinstance(refine, dict) and isinstance(refine.get("heldout"), dict) else set()
    if described:
        import textwrap

        from nbl_gguf.calibration.report import describe_refine

        lines = textwrap.wrap(describe_refine(refine), 90)
        rows += [("refine" if i == 0 else "", line) for i, line in enumerate(lines)]
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
             "seqlen", "documents", "text_sha256", "seed", "selection", "versions", "recall"} | described
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
        if sum(rep.values()):  # window layers alone: no map, so no method or scores to name
            out.append(f"method:        {info['method'] or '?'}    criterion: {info['criterion'] or '?'}")
        out += calibration_lines(info["calibration"])
        if sum(rep.values()):
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


def _layers(layers) -> str:
    return ", ".join(map(str, layers or [])) or "none"
