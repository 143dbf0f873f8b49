"""What a calibration reports beside its maps: the KV cache llama.cpp allocates with the chosen layers
replaced, and the text that `calibrate` and `convert` print of a selection."""

from __future__ import annotations

from nbl_gguf.kv_cache import DEFAULT_UBATCH

KIND_NAMES = {"calibration": "the calibration text", "prose": "Python docs", "code": "Python code"}
DEFAULT_KV_CTX = 4096  # the selection's KV figures for a model whose config names no training context


def kv_report(config, selection: dict, n_ctx: int | None, kv_type: str = "f16",
              n_ubatch: int = DEFAULT_UBATCH) -> dict:
    """The KV cache llama.cpp allocates at ``n_ctx`` (default: the training context) with micro-batches of
    ``n_ubatch`` for the model as it is and with the chosen layers replaced, and for
    each set that `best` compared: a sliding-window layer frees only its window's cells, a global one a cache
    as long as the context."""
    from nbl_gguf.kv_cache import cache_context, kv_size, model_from_config, training_context_from_config

    if n_ctx is None:
        n_ctx = training_context_from_config(config) or DEFAULT_KV_CTX
    model = model_from_config(config)
    context = cache_context(n_ctx, kv_type, n_ubatch=n_ubatch)

    def size(layers) -> dict:
        kv = kv_size(model.without(layers), context)
        return {"bytes": kv.bytes, "caches": {name: {"cells": cache.cells, "layers": cache.layers, "bytes": cache.bytes}
                                              for name, cache in kv.caches.items()}}

    report = {"n_ctx": n_ctx, "type": kv_type, "n_ubatch": n_ubatch, "stock": size([]), "nbl": size(selection["layers"])}
    compared = (selection.get("heldout") or {}).get("compared")
    if compared:
        report["compared"] = {c: size(entry["layers"])["bytes"] for c, entry in compared.items()}
    return report


def _mib(value: int) -> str:
    return f"{value / 2**20:,.2f} MiB"


def _change(before: int, after: int) -> str:
    return f"{(after - before) / before:+.1%}" if before else "+0.0%"


def describe_kv(kv: dict) -> list[str]:
    stock, nbl = kv["stock"], kv["nbl"]
    ubatch = f", -ub {kv['n_ubatch']}" if kv.get("n_ubatch", DEFAULT_UBATCH) != DEFAULT_UBATCH else ""
    lines = [f"  KV cache at {kv['n_ctx']:,} tokens ({kv.get('type', 'f16').upper()}{ubatch}, as llama-cli allocates it): "
             f"{_mib(stock['bytes'])} -> "
             f"{_mib(nbl['bytes'])} ({_change(stock['bytes'], nbl['bytes'])})"]
    if "sliding" in stock["caches"]:
        for name, what in (("global", "global layers"), ("sliding", "sliding-window layers")):
            before, after = stock["caches"][name], nbl["caches"][name]
            lines.append(f"    {what} ({before['cells']:,} cells each): {before['layers']} -> {after['layers']} layers, "
                         f"{_mib(before['bytes'])} -> {_mib(after['bytes'])}")
    return lines


def describe_selection(selection: dict, num_layers: int) -> str:
    """What was chosen and, for auto and greedy, why (the held-out perplexity along the way)."""
    taps = int(selection.get("taps", 1))
    maps = f" with past-token maps of {taps} tokens" if taps > 1 else ""
    lines = [f"{selection['method']}{maps} by {selection['criterion']}: replace layers {selection['layers']} of {num_layers}"]
    heldout = selection.get("heldout")
    if heldout:
        increases = heldout["ppl_increase_pct"]
        if len(increases) == len(heldout["order"]):  # one loss per added layer (walk, greedy)
            steps = ", ".join(f"layer {layer} {inc:+.1f}%" for layer, inc in zip(heldout["order"], increases))
        else:  # the set measured at once (best at a fixed m)
            steps = f"{len(heldout['order'])} layers together {increases[-1]:+.1f}%" if increases else ""
        text = selection.get("heldout_text")
        made_of = ""
        if text:
            made_of = ": " + ", ".join(f"{n} {'window' if n == 1 else 'windows'} of {KIND_NAMES.get(kind, kind)}"
                                       for kind, n in text["windows"].items())
        lines.append(f"  held-out perplexity ({heldout['heldout_tokens']} tokens{made_of}; unmodified "
                     f"{heldout['base_ppl']:.3f}): {steps or 'no layer added'}")
    kv = selection.get("kv_cache")
    sliding = kv is not None and "sliding" in kv["stock"]["caches"]
    if "chosen" in selection:
        def saving(c):  # which layers a set holds matters to the KV cache only where some slide
            if not sliding or c not in kv.get("compared", {}):
                return ""
            return f" (KV {_change(kv['stock']['bytes'], kv['compared'][c])})"

        lines.append("  best on the held-out windows: " + ", ".join(
            f"{c} {len(v['layers'])} layers {v['ppl_increase_pct']:+.1f}%{saving(c)}" for c, v in heldout["compared"].items())
            + f" -> {selection['chosen']}")
    if kv is not None:
        lines += describe_kv(kv)
    if "max_ppl_increase" in selection:
        reason = heldout.get("stopped") or f"all {len(heldout['order'])} candidate layers fit the budget"
        lines.append(f"  --m auto: m = {selection['m']} within +{selection['max_ppl_increase']:g}%: {reason}")
    return "\n".join(lines)


def describe_artifact(artifact) -> str:
    """What a calibration says when it is done: its selection and where the artifact went."""
    report = artifact.report
    refine = f"{describe_refine(report['refine'])}\n" if report.get("refine") else ""
    return (describe_selection(report["selection"], artifact.num_layers) + "\n" + refine
            + f"artifact: {artifact.path}  ({report['data']['tokens']} tokens, timings {report['timings_s']})")


def describe_refine(refine: dict) -> str:
    """The refinement's line: what moved and how far the held-out loss went, per kind of text, as the
    perplexity increase over the unmodified model with the LMMSE maps and with the refined ones."""
    import math

    held = refine["heldout"]
    kinds = [kind for kind in held["unmodified_nll"]]
    parts = []
    for kind in kinds:
        base = held["unmodified_nll"][kind]
        before, after = (100 * (math.exp(held[key][kind] - base) - 1) for key in ("lmmse_nll", "refined_nll"))
        parts.append(f"{kind} {before:+.1f}% -> {after:+.1f}%")
    if "best_step" in refine:
        kept = "the LMMSE maps" if refine["best_step"] == 0 else f"step {refine['best_step']}"
        steps = f"{refine['steps']} steps, kept {kept} ({refine['stopped']})"
    else:
        steps = f"{refine.get('epochs', '?')} epochs a layer" + ("" if refine.get("kept", "refined") == "refined"
                                                                 else f", kept {refine['kept']}")
    settings = refine.get("settings", {})
    weighed = ", each kind of text's loss weighed alike" if settings.get("balance") and settings.get("text") == "mix" else ""
    seconds = f", {refine['seconds']:.0f} s" if "seconds" in refine else ""  # a GGUF's record keeps no time
    return (f"refined ({refine['form']} form{weighed}) the maps of layers {', '.join(map(str, refine['layers']))}: {steps}"
            f"{seconds}; held-out perplexity vs unmodified, LMMSE -> refined: {'; '.join(parts)}")
