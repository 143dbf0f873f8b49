#!/usr/bin/env python
"""The scale benchmark's models: a real-shape llama with random weights as an F16 safetensors folder and
as a Q4_K_M GGUF made from it by the pinned llama.cpp (convert_hf_to_gguf.py to F16, then llama-quantize).

  python scripts/make_scale_models.py --shape llama-3.1-8b --out bench-results/scale

Prints the two paths; files that exist are reused. The tokenizer is the embedded SmolLM2's (random
weights make any text equally meaningless; its ids fit the larger vocabulary).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nbl_gguf import models  # noqa: E402
from nbl_gguf.fixtures.synthetic import get_shape, write_random_hf_folder  # noqa: E402
from nbl_gguf.gguf.hf_to_gguf import convert_hf_to_gguf  # noqa: E402
from nbl_gguf.gguf.quantize import quantize  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--out", default="bench-results/scale")
    parser.add_argument("--quant", default="q4_k_m")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="folder with the tokenizer files (default: the embedded SmolLM2's; a machine without "
                             "the embedded model, such as a GPU machine, is given them)")
    args = parser.parse_args()
    shape = get_shape(args.shape)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = out / f"{shape.name}-random-f16"
    gguf = out / f"{shape.name}-random-{args.quant.lower()}.gguf"
    t0 = time.time()
    write_random_hf_folder(shape, folder, args.tokenizer or models.default_model_dir(), seed=args.seed)
    print(f"{folder} ({time.time() - t0:.0f} s)", flush=True)
    if not gguf.is_file():
        t0 = time.time()
        f16 = out / f"{shape.name}-random-f16.gguf"
        convert_hf_to_gguf(folder, f16, "f16")
        quantize(f16, gguf, args.quant)
        f16.unlink()
        print(f"{gguf} ({time.time() - t0:.0f} s)", flush=True)
    print(gguf)
    return 0


if __name__ == "__main__":
    sys.exit(main())
