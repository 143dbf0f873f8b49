"""What `convert` prints when it is done: the stock and NBL files side by side (Summary.table) and the
time and memory of each stage (resources_table)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from nbl_gguf.calibration.dataset import KINDS
from nbl_gguf.gguf.from_artifact import RUNTIMES
from nbl_gguf.kv_cache import DEFAULT_UBATCH
from nbl_gguf.llamacpp.cache_types import cache_type_flags, split_cache_type


@dataclass
class Summary:
    model: str
    quant: str
    method: str
    criterion: str
    n_layer: int
    replaced: list[int]
    scores: list[float] | None
    stock_bytes: int
    nbl_bytes: int
    kv: dict  # context -> (stock, NBL) kv_cache.KvSize, as llama-cli allocates the cache
    output: Path
    heldout: dict | None = None  # {kind: heldout_perplexities()'s figures}, or None with --no-eval
    runtime: str = "nbl"
    extra: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # printed under the table
    resources: dict = field(default_factory=dict)  # usage.StageMeter.stages of the run
    taps_state_bytes: int = 0  # what llama.cpp keeps per sequence for the taps layers (F32), 0 without
    kv_type: str = "f16"  # the cache type of the KV rows, and of the flags to run the file with
    n_ubatch: int = DEFAULT_UBATCH  # the micro-batch of the KV rows (llama.cpp's -ub), and of those flags
    budget: dict | None = None  # convert --kv-budget's candidates, as measured (choose_for_budget's report)
    windows: dict | None = None  # convert --windows' choice (calibration.windows.WindowChoice.report())
    output_type: str | None = None  # the output's weight type where it is not the stock file's (a total budget's
    # choice of llama.cpp's weight type one step down)

    def table(self) -> str:
        from nbl_gguf.gguf.inspect import human_bytes

        def change(before, after):
            return f"{(after - before) / before:+.1%}" if before else ""

        rows = [
            ("", f"stock {self.quant}", f"output {self.output_type}" if self.output_type else f"NBL {self.quant}",
             "change"),
            ("attention layers", str(self.n_layer), str(self.n_layer - len(self.replaced)), f"-{len(self.replaced)}"),
            ("file size", human_bytes(self.stock_bytes), human_bytes(self.nbl_bytes),
             change(self.stock_bytes, self.nbl_bytes)),
        ]
        for n_ctx, (stock, nbl) in self.kv.items():
            ubatch = f", -ub {self.n_ubatch}" if self.n_ubatch != DEFAULT_UBATCH else ""
            rows.append((f"KV cache at {n_ctx:,} tokens ({self.kv_type.upper()}{ubatch})", human_bytes(stock.bytes),
                         human_bytes(nbl.bytes),
                         change(stock.bytes, nbl.bytes)))
            if "sliding" in nbl.caches:
                # llama.cpp keeps two caches: the window's cells for the sliding layers, every token for the others
                # (a stock model without sliding layers has the global one only)
                for name, what in (("global", "global layers"), ("sliding", "sliding-window layers")):
                    before, after = stock.caches.get(name), nbl.caches[name]
                    rows.append((f"  {what}: {after.cells:,} cells", human_bytes(before.bytes if before else 0),
                                 human_bytes(after.bytes), change(before.bytes, after.bytes) if before else ""))
        if self.taps_state_bytes:
            rows.append(("taps state per sequence (F32)", human_bytes(0), human_bytes(self.taps_state_bytes), ""))
        for kind, measured in (self.heldout or {}).items():
            rows.append((f"held-out perplexity, {KINDS[kind].label} ({measured['tokens']:,} tokens)",
                         f"{measured['stock']:.3f}", f"{measured['nbl']:.3f}", change(measured["stock"], measured["nbl"])))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        windowed = f"; {len(self.windows['layers'])} window layers" if self.windows else ""
        lines = [f"{self.model}: {self.method} by {self.criterion}, {len(self.replaced)} of {self.n_layer} layers "
                 f"replaced: {', '.join(map(str, self.replaced)) or 'none'}{windowed}"]
        if self.scores is not None:
            lines.append("  layer scores (" + self.criterion + "): "
                         + ", ".join(f"{i}={self.scores[i]:.4f}" for i in self.replaced))
        for index, row in enumerate(rows):
            lines.append("  " + "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                                          for i, (cell, w) in enumerate(zip(row, widths))))
            if index == 0:
                lines.append("  " + "  ".join("-" * w for w in widths))
        if self.heldout:
            first = next(iter(self.heldout.values()))
            cache = f", both files with a {self.kv_type} KV cache" if self.kv_type != "f16" else ""
            lines.append(f"  held-out perplexity: llama-perplexity, up to {first['chunks']} chunks of {first['ctx']} "
                         f"tokens of each kind's bundled documents never used for calibration or layer selection{cache}")
            worst = max(self.heldout, key=lambda kind: self.heldout[kind]["nbl"] / self.heldout[kind]["stock"])
            lines.append(f"  worst kind of text: {KINDS[worst].label}, "
                         f"{change(self.heldout[worst]['stock'], self.heldout[worst]['nbl'])}")
        lines += self.budget_lines()
        lines += self.window_lines()
        lines += [f"  {note}" for note in self.notes]
        lines.append(f"  layout: {RUNTIMES[self.runtime]}" if self.replaced or self.windows else
                     "  layout: the stock file itself, no layer replaced: any llama.cpp runs it")
        lines.append(f"  output: {self.output}")
        lines += self.run_lines()
        return "\n".join(lines)

    def run_lines(self) -> list[str]:
        """The flags the KV rows hold for: llama.cpp cannot read a cache type or a micro-batch from the file, so
        the user passes them each run (none for llama.cpp's defaults)."""
        ubatch = self.n_ubatch != DEFAULT_UBATCH
        if self.kv_type == "f16" and not ubatch:
            return []
        type_k, type_v = split_cache_type(self.kv_type)
        flags = cache_type_flags(self.kv_type) + (["-ub", str(self.n_ubatch)] if ubatch else [])
        python = ([f"type_k = GGML_TYPE_{type_k.upper()}", f"type_v = GGML_TYPE_{type_v.upper()}"]
                  if self.kv_type != "f16" else []) + ([f"n_ubatch = {self.n_ubatch}"] if ubatch else [])
        return [f"  run with: llama-cli -m {self.output} {' '.join(flags)} (llama-cpp-python: {', '.join(python)})"]


    def window_lines(self) -> list[str]:
        """What --windows chose and measured (loss on the second half of each selection text)."""
        if not self.windows:
            return []
        import math

        w = self.windows
        line = (f"  window layers: {len(w['layers'])} ({', '.join(map(str, w['layers']))}) attend to the last "
                f"{w['size']:,} tokens and the first {w['sinks']}")
        if "loss" in w:  # --windows: the measured choice
            if "increases" in w:
                alone = ", ".join(f"{layer}: {math.expm1(w['increases'][str(layer)]):+.1%}" for layer in w["layers"])
                how = f"the perplexity each costs alone ({alone})"
            else:
                alone = ", ".join(f"{layer}: {w['local_errors'][str(layer)]:.1%}" for layer in w["layers"])
                how = f"each one's error on its own layer's output ({alone})"
            line += (f"; chosen by {how} and together {math.expm1(w['loss'] - w['base_loss']):+.1%}, on the second "
                     f"half of {w['texts']} selection texts of {w['ctx']:,} tokens")
        lines = [line]
        if "retrieval" in w:
            r = w["retrieval"]
            refused = ", ".join(f"{layer} ({loss - r['base_loss']:+.2f})" for layer, loss in r["refused"].items())
            lines.append(f"  retrieval: {r['probes']} facts hidden {min(r['distances']):,}-{max(r['distances']):,} tokens "
                         f"back, answer loss {r['base_loss']:.2f} -> {r['loss']:.2f} nats per token (tolerance "
                         f"+{r['tolerance']:g}); refused as window layers: {refused or 'none'}")
            if len(r["kept"]) < len(w["layers"]):
                lines.append(f"  warning: only {len(r['kept'])} window layers kept the answers within the tolerance; "
                             f"{len(w['layers']) - len(r['kept'])} more were taken among the refused (long-range "
                             f"retrieval may suffer: ask for fewer --windows)")
        cache = f" --cache-type {self.kv_type}" if self.kv_type != "f16" else ""
        return lines + ["  llama-cpp-python: load it with swa_full=False, or the window layers cache the whole context "
                        "(llama-cli and llama-server: as long as --swa-full is not given)",
                        f"  check recall at the lengths you will run: python -m nbl_gguf eval {self.output}{cache} "
                        f"--no-ppl --passkey 4096,16384"]

    def budget_lines(self) -> list[str]:
        """What --kv-budget measured: each cache type's fewest layers within the budget, best first."""
        if not self.budget:
            return []
        from nbl_gguf.gguf.inspect import human_bytes

        b = self.budget
        ubatch = f" with -ub {b['n_ubatch']}" if b.get("n_ubatch", DEFAULT_UBATCH) != DEFAULT_UBATCH else ""
        total = b.get("total_bytes")
        if total is None:
            budget = f"KV budget {human_bytes(b['bytes'])}"
        else:
            budget = (f"Total budget {human_bytes(total)} (weights, buffers and KV cache; the stock file's weights "
                      f"{human_bytes(b['weight_bytes'])} and llama.cpp's compute and output buffers "
                      f"{human_bytes(b['buffer_bytes'])} leave {human_bytes(b['bytes'])} for the KV cache)")
        lines = [f"  {budget} at {b['n_ctx']:,} tokens{ubatch}: each KV type with the fewest layers "
                 f"that fit, by held-out perplexity at {b['eval_ctx']:,} tokens ({b['chunks']} chunk of each kind's "
                 f"selection text) against stock with an F16 cache:"]
        width = max(len(c["label"]) for c in b["candidates"])
        asked, stock_found = len(b.get("passkey_depths") or ()), b.get("stock_passkey_found")
        for index, c in enumerate(b["candidates"]):
            keys = f"  passkey {c['passkey_found']}/{asked}" if c.get("passkey_found") is not None else ""
            weights = (f"  weights {human_bytes(c['weight_bytes']):>11}  buffers {human_bytes(c['buffer_bytes']):>11}  "
                       f"total {human_bytes(c['weight_bytes'] + c['buffer_bytes'] + c['kv_bytes']):>11}"
                       if total is not None else "")
            lines.append(f"    {c['label']:<{width}}  KV {human_bytes(c['kv_bytes']):>11}{weights}  {c['change_pct']:+7.2f}%"
                         + keys + ("  <- chosen" if index == 0 else ""))
        if any(c.get("refused_windows") for c in b["candidates"]):
            lines.append("    (a candidate with window layers the retrieval walk refused ranks after those without: "
                         "perplexity cannot see recall beyond the window)")
        unmeasured = b.get("unmeasured") or []
        if unmeasured:
            lines.append("    not measured, since they rank after every candidate above (they hold window layers "
                         "the retrieval walk refused: perplexity cannot see recall beyond the window): "
                         + "; ".join(c["label"] for c in unmeasured))
        recall = b.get("window_recall")
        if recall:
            best = ", ".join(f"{layer} ({recall['losses'][str(layer)]:.3f})" for layer in recall["ranking"][:4])
            lines.append(f"    recall each window layer gives back made global alone (answer loss on facts in repeated "
                         f"filler, {recall['base_loss']:.3f} with all {len(recall['windows'])}): {best}, ...; the "
                         f"candidates 'global for recall' keep such layers global in place of the window order's")
        if stock_found is not None:
            lines.append(f"    passkey: a number hidden in filler text at {asked} depths of a {b['eval_ctx']:,}-token "
                         f"prompt, each file with its cache type; stock (F16) found {stock_found}/{asked}, and a "
                         f"candidate that finds fewer ranks after those that find as many (taken in the order of "
                         f"perplexity until one does: the rest untested)")
            chosen = b["candidates"][0]
            if chosen.get("passkey_found") is not None and chosen["passkey_found"] < stock_found:
                lines.append(f"  warning: no candidate within the budget found as many passkeys as stock "
                             f"({chosen['passkey_found']}/{asked} against {stock_found}/{asked}): recall of what lies "
                             f"far back is weaker; a larger budget keeps more layers global")
        return lines


def resources_table(stages: dict, process_peak: int | None = None) -> str:
    """Wall time and peak memory of each stage (the calibration's own stages indented under it), and the
    process's own peak so far where given: work between the stages (the summary reads both files) counts
    there, as it does for /usr/bin/time."""
    from nbl_gguf.gguf.inspect import human_bytes

    lines = ["  time and memory (peak resident set of this process, ~ where sampled; the llama.cpp tools apart):"]
    for name, record in stages.items():
        tools = record.get("tools_peak_rss_bytes") or {}
        extra = "".join(f", {tool} {human_bytes(peak)}" for tool, peak in tools.items())
        gpu = f", GPU {human_bytes(record['peak_gpu_bytes'])}" if "peak_gpu_bytes" in record else ""
        peak = ("~" if record.get("peak_rss_sampled") else "") + human_bytes(record["peak_rss_bytes"])
        lines.append(f"    {name:<32} {record['wall_s']:>9.1f} s  {peak:>11}{gpu}{extra}")
    if process_peak is not None:
        lines.append(f"    {'the whole run':<32} {'':>11}  {human_bytes(process_peak):>11}")
    return "\n".join(lines)
