"""Held-out perplexity against the NBL weights' ggml type (issue 19, point 0): one GGUF --model, one
calibration artifact, the same layers for every type, `convert --nbl-type T` for each type and m.
One JSON line per (m, type): the file's bytes, the stock and NBL perplexity on each kind of bundled
held-out text (llama-perplexity; rows written before issue 22 hold C4's alone, at the top level), and
which layers.

    python docs/results/experiments/eval_nbl_type.py --model Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf \\
        --calibration bench-results/dtypes-qwen/calibration-bf16 --ms 4,8 --types default,q4_k,q5_k,q6_k,q8_0,f16 \\
        --out docs/results/nbl-type-qwen.jsonl

"default" is convert's own choice (the type of each layer's attn_output). The layers come from one
local criterion (--criterion, default cosine), so every type is measured on the same layers.

The same for past-token maps (issue 19, point 4): --taps 1,4 converts each row with each --taps (the
artifact calibrated with --taps 4 holds both maps), and an HF --model takes --quants instead of
--types (the whole file in that type, as `convert --quant`); a taps row also records the state bytes:

    python docs/results/experiments/eval_nbl_type.py --model "$(python -c 'from nbl_gguf import models; print(models.default_model_dir())')" \
        --calibration CAL --ms 4,8,12 --quants q8_0,q4_k_m --taps 1,4 --out docs/results/taps-quality-smollm2.jsonl
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="GGUF file (or HF folder: then --quant's types)")
    parser.add_argument("--calibration", required=True, help="its calibration artifact")
    parser.add_argument("--ms", default="4,8")
    parser.add_argument("--types", default="default,q4_k,q5_k,q6_k,q8_0,f16")
    parser.add_argument("--quants", default=None, help="HF --model: convert --quant for each (instead of --types)")
    parser.add_argument("--emulate", default="", help="types measured by quantizing W and back, stored F32")
    parser.add_argument("--taps", default="1", help="convert --taps for each (comma-separated)")
    parser.add_argument("--criterion", default="cosine")
    parser.add_argument("--eval-chunks", type=int, default=16)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    from nbl_gguf.commands import convert as convert_command
    from nbl_gguf.gguf.inspect import describe

    variants = [("quant", q) for q in args.quants.split(",")] if args.quants else \
        [("nbl_type", t) for t in args.types.split(",") if t]
    variants += [("emulated_type", t) for t in args.emulate.split(",") if t]
    rows = [(m, variant, taps) for m in [int(x) for x in args.ms.split(",")] for variant in variants
            for taps in [int(x) for x in args.taps.split(",")]]
    with tempfile.TemporaryDirectory() as tmp, open(args.out, "a", encoding="utf-8") as out:
        for m, (option, nbl_type), taps in rows:
            output = Path(tmp) / f"nbl-{m}-{nbl_type}-{taps}.gguf"
            calibration = args.calibration
            if option == "emulated_type":
                calibration = Path(tmp) / f"calibration-{nbl_type}"
                if not calibration.exists():
                    emulated_artifact(Path(args.calibration), nbl_type, calibration)
            argv = ["--model", args.model, "--calibration", str(calibration), "--m", str(m), "--criterion",
                    args.criterion, "--eval-chunks", str(args.eval_chunks), "--no-progress", "-o", str(output),
                    "--taps", str(taps), "--no-refine"]  # the LMMSE maps, whatever convert's default
            if option == "emulated_type":
                argv += ["--nbl-type", "f32"]
            elif nbl_type != "default":
                argv += [f"--{option.replace('_', '-')}", nbl_type]
            command = argparse.ArgumentParser()
            convert_command.add_arguments(command)
            start = time.perf_counter()
            summary = convert_command.convert(command.parse_args(argv))
            # one entry per kind of held-out text (C4 web text, Python docs, Python code)
            heldout = {kind: {"tokens": h["tokens"], "stock_ppl": h["stock"], "nbl_ppl": h["nbl"],
                              "increase_pct": 100 * (h["nbl"] / h["stock"] - 1)} for kind, h in summary.heldout.items()}
            state = describe(output)["taps"]
            row = {"model": Path(args.model).name, "m": m, option: nbl_type, "taps": taps, "layers": summary.replaced,
                   "state_bytes_per_sequence": state["state_bytes_per_sequence"] if state else 0,
                   "criterion": args.criterion, "nbl_bytes": summary.nbl_bytes, "stock_bytes": summary.stock_bytes,
                   "heldout": heldout, "seconds": round(time.perf_counter() - start, 1)}
            if option == "emulated_type":
                row["w_bytes_per_layer_in_type"] = weight_bytes(nbl_type, load_width(calibration))
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
            out.flush()
            output.unlink(missing_ok=True)
    return 0


def load_width(calibration: Path) -> int:
    from nbl_gguf.calibration.artifact import load_artifact

    return int(load_artifact(calibration).linear(0)[0].shape[1])


def weight_bytes(type_name: str, width: int) -> int:
    """Bytes of a width x width W in ``type_name`` if its blocks fit (bits per weight x weights)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name.upper()]]
    return width * width * size // block


def emulate(matrix, type_name: str):
    """``matrix`` [rows, n] through ggml's quantizer for ``type_name`` and gguf-py's dequantizer, each row
    padded with zeros to the type's block (a zero block costs nothing in a K-quant's scales)."""
    import gguf
    import numpy as np

    from nbl_gguf.llamacpp import ggml

    qtype = gguf.GGMLQuantizationType[type_name.upper()]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    rows, n = matrix.shape
    padded = np.zeros((rows, -(-n // block) * block), dtype=np.float32)
    padded[:, :n] = matrix
    values = gguf.quants.dequantize(ggml.quantize(padded, int(qtype), qtype.name), qtype)
    return np.ascontiguousarray(values.reshape(rows, -1)[:, :n], dtype=np.float32)


def emulated_artifact(source: Path, type_name: str, folder: Path) -> None:
    """A copy of the artifact ``source`` whose per-token maps hold what ``type_name`` would store."""
    from safetensors import safe_open

    from nbl_gguf.calibration.artifact import WEIGHTS, LazyTensors, save_safetensors

    tensors = LazyTensors([source / WEIGHTS])
    with safe_open(str(source / WEIGHTS), framework="numpy") as handle:
        metadata = handle.metadata() or {}
    maps = {name: emulate(tensors[name], type_name) for name in tensors
            if name.startswith("attn.") and name.endswith(".weight")}
    folder.mkdir()
    for path in source.iterdir():
        if path.name != WEIGHTS:
            shutil.copy2(path, folder / path.name)
    save_safetensors(folder / WEIGHTS, {name: maps.get(name, tensors[name]) for name in tensors}, metadata)


if __name__ == "__main__":
    sys.exit(main())
