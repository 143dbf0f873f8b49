"""The outputs of ``bench``: the console table, markdown tables, speed-up plots, report.md, the CSV
and JSON files (write_outputs) and the description of the machine."""

from __future__ import annotations

import csv
import json
import os
import platform
import shutil
import subprocess
from dataclasses import asdict
from pathlib import Path

from nbl_gguf.measurement.speedup import TARGET_EFFICIENCY, Speedup


def format_table(rows: list[Speedup]) -> str:
    header = ["backend", "model", "test", "depth", "stock t/s", "NBL t/s", "speed-up", "(rounds)", "roofline",
              "meas/roof"]
    lines = [header]
    for r in rows:
        spread = f"{r.ratio_min:.3f}-{r.ratio_max:.3f}" if r.ratio_max > r.ratio_min else ""
        lines.append([r.backend, r.model, f"{r.test}{r.n_tokens}", str(r.depth), f"{r.stock_ts:.2f}",
                      f"{r.nbl_ts:.2f}", f"{r.measured:.3f}", spread, f"{r.predicted:.3f}",
                      f"{r.efficiency:.1%}" + ("" if r.meets_target else " *")])
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    text = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    if any(not r.meets_target for r in rows):
        text.append(f"* below {TARGET_EFFICIENCY:.0%} of the roofline prediction")
    return "\n".join(text)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(out)


def speedup_markdown(rows: list[Speedup]) -> str:
    return markdown_table(
        ["backend", "model", "test", "depth", "stock t/s", "NBL t/s", "speed-up (round min-max)", "roofline",
         "measured / roofline"],
        [[r.backend, r.model, f"{r.test}{r.n_tokens}", str(r.depth), f"{r.stock_ts:.2f}", f"{r.nbl_ts:.2f}",
          f"**{r.measured:.3f}** ({r.ratio_min:.3f}-{r.ratio_max:.3f})", f"{r.predicted:.3f}",
          f"{r.efficiency:.1%}" + ("" if r.meets_target else " ⚠")] for r in rows])


def kv_markdown(rows: list[dict]) -> str:
    from nbl_gguf.gguf.inspect import human_bytes

    return markdown_table(
        ["backend", "model", "depth", "KV bytes/token", "vs stock", "KV at depth", "llama.cpp KV buffer (cells)",
         "predicted buffer"],
        [[r["backend"], r["model"], str(r["depth"]), f"{r['bytes_per_token']:,.0f}",
          "" if r["vs_stock"] is None else f"{r['vs_stock']:.3f}", human_bytes(r["at_depth_mib"] * 2**20),
          f"{r['measured_mib']:.2f} MiB ({r['cells']})", f"{r['predicted_mib']:.2f} MiB"] for r in rows])


def plot_speedups(rows: list[Speedup], path_stem: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for backend in sorted({r.backend for r in rows}):
        mine = [r for r in rows if r.backend == backend]
        depths = sorted({r.depth for r in mine})
        x = {d: i for i, d in enumerate(depths)}
        tests = [t for t in ("pp", "tg") if any(r.test == t for r in mine)]
        fig, axes = plt.subplots(1, len(tests), figsize=(5.2 * len(tests), 4), squeeze=False)
        for ax, test in zip(axes[0], tests):
            for index, model in enumerate(sorted({r.model for r in mine})):
                cells = sorted((r for r in mine if r.model == model and r.test == test), key=lambda r: r.depth)
                color = f"C{index}"
                xs = [x[r.depth] for r in cells]
                ax.errorbar(xs, [r.measured for r in cells],
                            yerr=[[r.measured - r.ratio_min for r in cells], [r.ratio_max - r.measured for r in cells]],
                            fmt="o-", color=color, capsize=3, label=f"{model} measured")
                ax.plot(xs, [r.predicted for r in cells], "--", color=color, alpha=0.7, label=f"{model} roofline")
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xticks(range(len(depths)), [str(d) for d in depths])
            ax.set_xlabel("context depth (tokens)")
            n = next(r.n_tokens for r in mine if r.test == test)
            ax.set_ylabel(f"speed-up vs stock ({'prompt processing' if test == 'pp' else 'token generation'})")
            ax.set_title(f"{test}{n}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"{title} — {backend.upper()}", fontsize=10)
        fig.tight_layout()
        path = path_stem.parent / f"{path_stem.name}-{backend}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def machine_description() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count()}
    if shutil.which("lscpu"):
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        keep = ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "L2 cache",
                "L3 cache", "Hypervisor vendor")
        info["lscpu"] = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())
                         if k.strip() in keep}
        flags = next((line for line in text.splitlines() if line.startswith("Flags")), "")
        info["simd"] = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")
                        if f" {f}" in flags]
    try:
        with open("/proc/meminfo", encoding="utf-8") as handle:
            info["mem_total"] = handle.readline().split(":", 1)[1].strip()
    except OSError:
        pass
    if shutil.which("nvidia-smi"):
        completed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        info["gpus"] = completed.stdout.strip().splitlines() if completed.returncode == 0 else []
    return info


def write_outputs(out: Path, result: dict, rows: list[Speedup], kv_rows: list[dict], measurements: list[dict],
                  plot: bool, title: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    written.append(out / "results.json")
    with open(out / "measurements.csv", "w", newline="", encoding="utf-8") as handle:
        fields = ["backend", "model", "label", "round", "test", "n_prompt", "n_gen", "depth", "avg_ts", "stddev_ts",
                  "samples_ts", "kv_mib", "kv_cells", "n_threads", "n_gpu_layers", "backends"]
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for record in measurements:
            writer.writerow({**record, "samples_ts": " ".join(f"{s:.3f}" for s in record["samples_ts"])})
    written.append(out / "measurements.csv")
    with open(out / "speedups.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(asdict(rows[0]).keys()) if rows else ["backend"])
        writer.writeheader()
        for row in rows:
            writer.writerow(asdict(row))
    written.append(out / "speedups.csv")
    if kv_rows:
        with open(out / "kv_cache.csv", "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(kv_rows[0].keys()))
            writer.writeheader()
            writer.writerows(kv_rows)
        written.append(out / "kv_cache.csv")
    if plot and rows:
        written += plot_speedups(rows, out / "speedup", title)
    (out / "report.md").write_text(report_markdown(result, rows, kv_rows), encoding="utf-8")
    written.append(out / "report.md")
    return written


def report_markdown(result: dict, rows: list[Speedup], kv_rows: list[dict]) -> str:
    lines = [f"# {result['title']}", "", f"Command: `{result['command']}`", ""]
    lines.append("Models:")
    for model in result["models"]:
        lines.append(f"- {model['label']}: `{model['path']}` ({model['file_type']}, {model['bytes'] / 2**20:.1f} MiB, "
                     f"{model['attention_layers']}/{model['n_layer']} attention layers)")
    lines += ["", "## Speed-up, NBL vs stock (measured in the same run) against the roofline", "", speedup_markdown(rows)]
    if kv_rows:
        lines += ["", "## KV cache", "", kv_markdown(kv_rows)]
    if result.get("hf_compare"):
        lines += ["", "## HF transformers (apply_nbl) vs llama.cpp", "", hf_markdown(result["hf_compare"])]
    lines += ["", "## Machine", "", "```", json.dumps(result["machine"], indent=2), "```", ""]
    return "\n".join(lines)


def hf_markdown(hf: dict) -> str:
    rows = []
    nan = float("nan")
    for entry in hf["rows"]:
        rows.append([entry["model"], entry["engine"], entry["device"],
                     f"{entry.get('prefill_tps', nan):.1f}", f"{entry.get('prefill_speedup', nan):.3f}",
                     f"{entry.get('decode_tps', nan):.1f}", f"{entry.get('decode_speedup', nan):.3f}"])
    text = markdown_table(["model", "engine", "device", f"prefill t/s ({hf['n_prompt']} tokens)", "vs stock",
                           f"decode t/s ({hf['n_gen']} tokens)", "vs stock"], rows)
    return text + "\n\n" + hf.get("note", "")


def format_summary(title: str, rows, kv_rows: list[dict], hf: dict | None, written) -> str:
    """What `bench` prints: the speed-up table, KV bytes per token, the HF comparison, the files written."""
    lines = [title, format_table(rows)]
    if kv_rows:
        lines += ["", "KV cache bytes/token: " + ", ".join(
            f"{r['model']} {r['bytes_per_token']:,.0f}" + ("" if r["vs_stock"] is None else f" ({r['vs_stock']:.1%})")
            for r in kv_rows if r["depth"] == kv_rows[0]["depth"] and r["backend"] == kv_rows[0]["backend"])]
    if hf:
        lines += ["", hf_markdown(hf)]
    lines += ["", "wrote " + ", ".join(str(p) for p in written)]
    return "\n".join(lines)
