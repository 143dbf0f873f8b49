#!/usr/bin/env python
"""What bf16 compute does to a calibration on the CPU, against fp32: the same `convert` run twice
(--dtype fp32, then bf16, each under /usr/bin/time -v), then the two calibrations' maps compared
(relative Frobenius norm of W per layer), their chosen layers, the held-out perplexity of the two NBL
files (llama-perplexity, convert's summary) and the calibration's time.

  python docs/results/experiments/compare_dtypes.py --out bench-results/dtypes-smollm2 -- --m 12 --quant q8_0
  python docs/results/experiments/compare_dtypes.py --out bench-results/dtypes-qwen -- --model Qwen.gguf --m 8

Arguments after -- go to `convert` as they are. Writes OUT/summary.json and prints a markdown row.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from nbl_gguf.calibration.artifact import load_artifact  # noqa: E402


def run_convert(out: Path, dtype: str, extra: list[str]) -> dict:
    calibration = out / f"calibration-{dtype}"
    command = ["/usr/bin/time", "-v", sys.executable, "-m", "nbl_gguf", "convert", "--no-refine", *extra, "--dtype", dtype,
               "--save-calibration", str(calibration), "--no-progress", "-o", str(out / f"nbl-{dtype}.gguf")]
    print("$ " + " ".join(command[2:]), flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    (out / f"convert-{dtype}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"convert --dtype {dtype} failed:\n{done.stderr[-3000:]}")
    heldout = re.search(r"held-out perplexity \(([\d,]+) tokens\)\s+([\d.]+)\s+([\d.]+)\s+([+-][\d.]+%)", done.stdout)
    wall = re.search(r"Elapsed \(wall clock\) time.*: (\S+)", done.stderr)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    report = json.loads((calibration / "report.json").read_text())
    return {"dtype": dtype, "stock_ppl": float(heldout.group(2)), "nbl_ppl": float(heldout.group(3)),
            "increase": heldout.group(4), "wall": wall.group(1), "max_rss_gib": int(rss.group(1)) / 2**20,
            "calibration_s": report["timings_s"], "layers": report["selection"]["layers"],
            "chosen": report["selection"].get("chosen")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("convert_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    extra = [a for a in args.convert_args if a != "--"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {dtype: run_convert(out, dtype, extra) for dtype in ("fp32", "bf16")}
    fp32, bf16 = (load_artifact(out / f"calibration-{d}") for d in ("fp32", "bf16"))
    rel = []
    for layer in range(fp32.num_layers):
        w32, _ = fp32.linear(layer)
        w16, _ = bf16.linear(layer)
        rel.append(float(np.linalg.norm(w16 - w32) / np.linalg.norm(w32)))
    summary = {"convert_args": extra, "runs": runs, "map_rel_frobenius": {"median": float(np.median(rel)),
                                                                         "max": float(np.max(rel)), "per_layer": rel}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    same = runs["fp32"]["layers"] == runs["bf16"]["layers"]
    print(f"| {' '.join(extra)} | {runs['fp32']['nbl_ppl']:.3f} ({runs['fp32']['increase']}) | "
          f"{runs['bf16']['nbl_ppl']:.3f} ({runs['bf16']['increase']}) | {'same' if same else 'differ'} | "
          f"{100 * np.median(rel):.2f}% / {100 * np.max(rel):.2f}% | {runs['fp32']['wall']} / {runs['bf16']['wall']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
