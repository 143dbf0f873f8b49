"""The two window files of report.md, from the committed choices (no walk run again):

    python docs/results/window/qwen2.5-coder-0.5b-prompt-bench/make_files.py Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf

qwen-windows12-w512-s4.gguf: the retrieval walk's 12 layers (qwen2.5-coder-0.5b-retrieval); qwen-windows20-w512-s4.gguf:
the text ranking's first 20 (qwen2.5-coder-0.5b/choice.json), all but 4, as in window.md's +5% row."""

import json
import sys
from pathlib import Path

from nbl_gguf.gguf import nbl_format

model = Path(sys.argv[1])
results = Path("docs/results/window")
walk = json.loads((results / "qwen2.5-coder-0.5b-retrieval/choice-retrieval-0.15.json").read_text())["layers"]
order = json.loads((results / "qwen2.5-coder-0.5b/choice.json").read_text())["order"]
for name, layers in (("qwen-windows12-w512-s4", sorted(walk)), ("qwen-windows20-w512-s4", sorted(order[:20]))):
    print(name, layers)
    nbl_format.write_nbl_gguf(model, Path(f"{name}.gguf"), nbl_format.NblLayers(
        types=[nbl_format.ATTENTION] * 24, windows=nbl_format.Windows(tuple(layers), 512, 4), method="window"))
