"""The window files of window.md's W = 128 / 2,048 rows, from the committed ranking (no measurement run again),
for the passkey at 16,384 tokens:

    python docs/results/window/qwen2.5-coder-0.5b-sizes/make_files.py Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf
    python -m nbl_gguf eval qwen-windows8-w128-s4.gguf qwen-windows8-w2048-s4.gguf --no-ppl --passkey 16384 \
        --passkey-depths 0.1,0.5,0.9 -t 2 -o docs/results/window/qwen2.5-coder-0.5b-sizes/passkey-16384.json

    python docs/results/window/qwen2.5-coder-0.5b-sizes/make_files.py Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf 4,12
    python -m nbl_gguf eval qwen-windows4-w*-s4.gguf qwen-windows12-w*-s4.gguf --no-ppl --passkey 16384 \
        --passkey-depths 0.1,0.5,0.9 -t 2 -o docs/results/window/qwen2.5-coder-0.5b-sizes/passkey-16384-m4-m12.json

    python docs/results/window/qwen2.5-coder-0.5b-sizes/make_files.py Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf 12 512
    python -m nbl_gguf eval qwen-windows12-w512-s4.gguf --no-ppl --passkey 16384 --passkey-depths 0.1,0.5,0.9 -t 2 \
        -o docs/results/window/qwen2.5-coder-0.5b-sizes/passkey-16384-m12-w512.json

The second argument: the layer counts (m = 8 unless given); the third: the window sizes (128,2048 unless given).
The layers are the first m of choice.json's order, as the "windows m=M W=S" rows of results.json (W = 128, 2,048)
and of ../qwen2.5-coder-0.5b/results.json (W = 512, the ranking's own run) name them."""

import json
import sys
from pathlib import Path

from nbl_gguf.gguf import nbl_format

model = Path(sys.argv[1])
counts = [int(m) for m in sys.argv[2].split(",")] if len(sys.argv) > 2 else [8]
here = Path(__file__).resolve().parent
order = json.loads((here / "choice.json").read_text())["order"]
sizes = [int(w) for w in sys.argv[3].split(",")] if len(sys.argv) > 3 else [128, 2048]
rows = {row["label"]: row for results in (here / "results.json", here.parent / "qwen2.5-coder-0.5b" / "results.json")
        for row in json.loads(results.read_text())["rows"]}
for m in counts:
    layers = sorted(order[:m])
    for size in sizes:
        assert rows[f"windows m={m} W={size} S=4"]["made_by"] == f"layers {layers}", rows[f"windows m={m} W={size} S=4"]
        name = f"qwen-windows{m}-w{size}-s4"
        print(name, layers)
        nbl_format.write_nbl_gguf(model, Path(f"{name}.gguf"), nbl_format.NblLayers(
            types=[nbl_format.ATTENTION] * 24, windows=nbl_format.Windows(tuple(layers), size, 4), method="window"))
