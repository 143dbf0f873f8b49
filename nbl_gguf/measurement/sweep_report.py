"""The outputs of ``eval --sweep``: the rows of every configuration (collect_rows), quality.csv,
quality.md (its hand-written notes kept between the NOTES markers) and quality.png."""

from __future__ import annotations

import csv
from pathlib import Path


METHOD_LABELS = {"baseline": "Baseline", "attn-nbl": "Attn NBL", "attn-drop": "Attn DROP", "block-nbl": "Block NBL"}
NOTES_BEGIN, NOTES_END = "<!-- notes -->", "<!-- /notes -->"


def collect_rows(main, criteria, quants, results, torch_results, kv, task_files) -> list[dict]:
    rows = []
    base_bench = {q: results.get(("baseline", q), {}).get("bench") for q in quants}
    seen = set()
    for group, configs in (("sweep", main), ("criteria", criteria)):
        for config in configs:
            stock_kv, kv_now = kv(config)
            common = {"group": group, "config": config.label, "method": config.method, "series": config.series,
                      "criterion": config.criterion,
                      "m": config.m, "layers": " ".join(map(str, config.layers)), "kv_bytes_per_token": kv_now,
                      "kv_saving": 1 - kv_now / stock_kv if stock_kv else 0.0}
            torch_result = torch_results.get(config.key)
            if torch_result and (group, config.key, "pytorch") not in seen:
                seen.add((group, config.key, "pytorch"))
                rows.append({**common, "backend": "pytorch", "quant": "f32", "ppl": torch_result["ppl"],
                             "ppl_err": torch_result["error"], "tokens": torch_result["tokens"]})
            for quant in (["F32"] if config.method == "baseline" else []) + (quants if config.gguf else []):
                result = results.get((config.key, quant))
                if result is None or (group, config.key, quant) in seen:
                    continue
                seen.add((group, config.key, quant))
                row = {**common, "backend": "llama.cpp", "quant": quant.lower()}
                if "perplexity" in result:
                    row.update(ppl=result["perplexity"]["ppl"], ppl_err=result["perplexity"]["error"],
                               tokens=result["perplexity"]["tokens"])
                row["file_bytes"] = result.get("file_bytes")
                for task in task_files:
                    if task in result:
                        row[f"{task}_acc"] = result[task]["accuracy"]
                        row[f"{task}_lo"], row[f"{task}_hi"] = result[task]["ci95"]
                        row[f"{task}_n"] = result[task]["tasks"]
                speed = result.get("bench")
                base = result.get("bench_baseline") or base_bench.get(quant)
                for kind in ("pp", "tg"):
                    if speed and kind in speed:
                        avg, std = speed[kind]
                        row[f"{kind}_ts"], row[f"{kind}_ts_std"] = avg, std
                        if base and kind in base:
                            b_avg, b_std = base[kind]
                            ratio = avg / b_avg
                            row[f"speedup_{kind}"] = ratio
                            row[f"speedup_{kind}_err"] = ratio * ((std / avg) ** 2 + (b_std / b_avg) ** 2) ** 0.5
                rows.append(row)
    return rows


CSV_FIELDS = ["group", "config", "method", "series", "criterion", "m", "layers", "backend", "quant", "kv_bytes_per_token",
              "kv_saving", "ppl", "ppl_err", "tokens", "file_bytes", "pp_ts", "pp_ts_std", "tg_ts", "tg_ts_std",
              "speedup_pp", "speedup_pp_err", "speedup_tg", "speedup_tg_err"]


def write_csv(path: Path, rows: list[dict]) -> None:
    fields = CSV_FIELDS + sorted({k for r in rows for k in r} - set(CSV_FIELDS))
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})


def _find(rows, group, config, backend, quant):
    for row in rows:
        if row["group"] == group and row["config"] == config and row["backend"] == backend and row["quant"] == quant:
            return row
    return None


def _ppl(row) -> str:
    return f"{row['ppl']:.3f} ± {row['ppl_err']:.3f}" if row and row.get("ppl") is not None else "—"


def _speed(row, kind="tg") -> str:
    if not row or row.get(f"speedup_{kind}") is None:
        return "—"
    return f"{row[f'speedup_{kind}']:.2f} ± {row[f'speedup_{kind}_err']:.2f}"


def write_markdown(path: Path, rows, setup, main, criteria, quants, task_files) -> None:
    notes = ""
    if path.is_file():
        old = path.read_text(encoding="utf-8")
        if NOTES_BEGIN in old and NOTES_END in old:
            notes = old[old.index(NOTES_BEGIN):old.index(NOTES_END) + len(NOTES_END)]
    report = setup["artifact"]
    data = report.get("data", {})
    q = [x.lower() for x in quants]
    lines = [f"# Quality: NBL vs attention drop vs baseline ({setup['model']})", ""]
    if setup.get("command"):
        lines += ["Produced by", "", "```", setup["command"], "```", ""]
    lines += [
        f"* model: {setup['model']} ({setup['n_layer']} layers); calibration: {data.get('nsamples')} x "
        f"{data.get('seqlen')} = {data.get('tokens')} tokens of {data.get('dataset')}, one artifact for every row",
        f"* layer selection: `{setup['criterion']}` (attention scores for Attn NBL / DROP, block scores for Block NBL)",
    ]
    if setup["criterion"] == "best":
        lines.append("* `best` (the default of calibrate and convert): for Attn NBL at each m, the layers of the local "
                     "criterion (cca, nmse, cosine) whose set costs least on held-out calibration windows (the 8,192 "
                     "tokens after the fit windows, never the evaluation text); each main row names its pick, the "
                     "other criteria's layers follow it")
    if setup.get("tokens"):
        lines.append(f"* perplexity: {setup['text']}, `--ctx-size {setup['ctx']}`, {setup['chunks']} chunks, "
                     f"{setup['tokens']} scored tokens (second half of each chunk, as llama-perplexity); "
                     f"± is llama-perplexity's standard error (PPL x s.e. of the mean token NLL); PyTorch float32 "
                     f"uses llama.cpp's tokens and the same chunking")
    lines.append("* KV cache saving: share of KV bytes per token removed (layers without attention keep no K/V)")
    if setup.get("bench_args"):
        lines.append(f"* speed-up: llama-bench `{setup['bench_args']}` tokens/s of the GGUF over the baseline of the "
                     f"same type, measured back to back in one llama-bench process (tg = generation, pp = prompt); "
                     f"± from llama-bench's standard deviations; baseline row: mean over its runs; "
                     f"{setup['machine']} shared with other jobs, so timings are noisy")
    lines.append(f"* time: {setup['eval_min']} min of llama-perplexity and {setup['torch_min']} min of PyTorch "
                 f"evaluation (as recorded when computed), plus conversions, quantization and llama-bench; "
                 f"{setup['machine']}")
    lines += ["", "## Perplexity", ""]
    header = ["config", "layers replaced", "KV saving", "PyTorch f32"] + [f"GGUF {x}" for x in q]
    if setup.get("bench_args"):
        header += [f"tg speed-up {x}" for x in q]
    lines += ["| " + " | ".join(header) + " |", "|---|---|---:|---:|" + "---:|" * (len(header) - 4)]
    for config in main:
        torch_row = _find(rows, "sweep", config.label, "pytorch", "f32")
        any_row = next((r for r in rows if r["group"] == "sweep" and r["config"] == config.label), None)
        if any_row is None:
            continue
        cells = [config.label, any_row["layers"] or "—", f"{100 * any_row['kv_saving']:.1f}%", _ppl(torch_row)]
        cells += [_ppl(_find(rows, "sweep", config.label, "llama.cpp", x)) if config.gguf else "n/a (PyTorch only)"
                  for x in q]
        if setup.get("bench_args"):
            cells += [_speed(_find(rows, "sweep", config.label, "llama.cpp", x)) if config.gguf else "—" for x in q]
        lines.append("| " + " | ".join(cells) + " |")
    f32 = _find(rows, "sweep", "Baseline", "llama.cpp", "f32")
    if f32 and f32.get("ppl") is not None:
        lines += ["", f"Baseline as an F32 GGUF through llama.cpp: {_ppl(f32)} (against PyTorch float32: the two "
                      f"paths agree when quantization is off)."]
    if criteria:
        m = criteria[0].m
        lines += ["", f"## Layer-selection criteria (m = {m}, GGUF {q[0]})", "",
                  f"| criterion | layers replaced | Attn NBL-{m} PyTorch f32 | Attn NBL-{m} GGUF {q[0]} "
                  f"| Attn DROP-{m} PyTorch f32 | Attn DROP-{m} GGUF {q[0]} |", "|---|---|---:|---:|---:|---:|"]

        def pick(method, criterion, backend):
            return next((r for r in rows if r["group"] == "criteria" and r["method"] == method
                         and r["criterion"] == criterion and r["backend"] == backend
                         and r["quant"] == ("f32" if backend == "pytorch" else q[0])), None)

        for criterion in dict.fromkeys(c.criterion for c in criteria):
            layers = next(c.layers for c in criteria if c.criterion == criterion)
            cells = [criterion, " ".join(map(str, layers))]
            cells += [_ppl(pick(method, criterion, backend)) for method in ("attn-nbl", "attn-drop")
                      for backend in ("pytorch", "llama.cpp")]
            lines.append("| " + " | ".join(cells) + " |")
    if task_files:
        lines += ["", "## Multiple choice", ""]
        header = ["config", "quant"] + [f"{t} (n={n or 'all'})" for t, (_, n) in task_files.items()]
        lines += ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * len(task_files)]
        for row in rows:
            if row["group"] != "sweep" or row["backend"] != "llama.cpp":
                continue
            cells = [row["config"], row["quant"]]
            for task in task_files:
                if row.get(f"{task}_acc") is None:
                    cells.append("—")
                else:
                    cells.append(f"{row[f'{task}_acc']:.2f} [{row[f'{task}_lo']:.2f}, {row[f'{task}_hi']:.2f}]")
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "Accuracy in %, 95% interval: HellaSwag's Wilson interval as printed; Winogrande and "
                      "multiple-choice ±1.96 x the printed standard error."]
    lines += ["", "Files: quality.csv (every number above, tokens/s included), quality.png "
                  "(perplexity against KV-cache saving and measured speed-up).", ""]
    if notes:
        lines += [notes, ""]
    path.write_text("\n".join(lines), encoding="utf-8")


def plot(path: Path, rows, quants, task_files, setup) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("ppl", "perplexity (held-out C4)")] if any(r.get("ppl") is not None for r in rows) else []
    metrics += [(f"{t}_acc", f"{t} accuracy (%)") for t in task_files]
    if not metrics:
        return
    has_speed = any(r.get("speedup_tg") is not None for r in rows)
    ncols = 2 if has_speed else 1
    fig, axes = plt.subplots(len(metrics), ncols, figsize=(6.5 * ncols, 4.2 * len(metrics)), squeeze=False)
    palette = {"attn-nbl": "tab:blue", "attn-drop": "tab:red", "block-nbl": "tab:green"}
    extra = iter(["tab:orange", "tab:purple", "tab:brown", "tab:gray"])
    colors = {}
    for r in rows:
        series_name = r.get("series", r["method"])
        if r["method"] != "baseline" and series_name not in colors:
            colors[series_name] = palette[r["method"]] if series_name == r["method"] else next(extra, "black")
    styles = {q.lower(): s for q, s in zip(quants, ["-", "--", ":", "-."])}
    sweep_rows = [r for r in rows if r["group"] == "sweep"]

    def series(name, backend, quant):
        base = [r for r in sweep_rows if r["method"] == "baseline" and r["backend"] == backend and r["quant"] == quant]
        own = sorted((r for r in sweep_rows if r.get("series", r["method"]) == name and r["backend"] == backend
                      and r["quant"] == quant), key=lambda r: r["m"])
        return base + own

    for row_index, (metric, label) in enumerate(metrics):
        for col, (xkey, xlabel) in enumerate([("kv_saving", "KV-cache saving (%)"),
                                              ("speedup_tg", "measured generation speed-up (llama-bench tg)")][:ncols]):
            ax = axes[row_index][col]
            curves = []
            for name in colors:
                method = name.split(" ")[0]
                pretty = METHOD_LABELS[method] + name[len(method):]
                for quant in [q.lower() for q in quants]:
                    if method != "block-nbl":
                        curves.append((name, "llama.cpp", quant, f"{pretty} GGUF {quant}", styles[quant], "o"))
                if metric == "ppl" and xkey == "kv_saving":
                    curves.append((name, "pytorch", "f32", f"{pretty} PyTorch f32", ":", "x"))
            for method, backend, quant, name, style, marker in curves:
                points = [r for r in series(method, backend, quant) if r.get(metric) is not None
                          and r.get(xkey) is not None]
                if len(points) < 2:
                    continue
                xs = [100 * r[xkey] if xkey == "kv_saving" else r[xkey] for r in points]
                ys = [r[metric] for r in points]
                if metric == "ppl":
                    err = [r.get("ppl_err") or 0 for r in points]
                    yerr = [err, err]
                else:
                    task = metric[:-4]
                    yerr = [[r[metric] - r[f"{task}_lo"] for r in points], [r[f"{task}_hi"] - r[metric] for r in points]]
                xerr = None
                if xkey == "speedup_tg":
                    xerr = [r.get("speedup_tg_err") or 0 for r in points]
                # speed-ups are not ordered by m: points there, lines only along the KV-cache saving axis
                ax.errorbar(xs, ys, yerr=yerr, xerr=xerr, fmt=marker, color=colors[method],
                            linestyle=style if xkey == "kv_saving" else "none",
                            label=name, ms=4, capsize=2, lw=1.2)
                if backend != "pytorch":
                    for x, y, r in zip(xs, ys, points):
                        if r["m"]:
                            ax.annotate(str(r["m"]), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6)
            if metric == "ppl":
                from matplotlib.ticker import FormatStrFormatter

                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
                low, high = ax.get_ylim()
                if high / low < 20:  # label the minor ticks only where there are few of them
                    ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
                    ax.tick_params(axis="y", which="minor", labelsize=6)
                else:
                    from matplotlib.ticker import NullFormatter

                    ax.yaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel(xlabel)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=6.5)
    fig.suptitle(f"{setup['model']}: NBL vs attention drop (labels: m layers replaced; error bars: perplexity "
                 f"±1 s.e., accuracy 95% interval, speed-up ±1 s.d.)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
