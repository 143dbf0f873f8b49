"""The main job that `scripts/setup.sh` runs once everything is set up.

With the converter available: `python -m nbl_gguf convert --m 12 --quant q4_k_m` on the embedded
model, then the patched llama-cli answers a prompt with the result. Until then: a tiny random llama
GGUF with NBL layers, run by the patched llama-cli.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

from nbl_gguf import gguf_nbl, llamacpp
from nbl_gguf.tiny import TinyLlama


def run_cli(model: Path, prompt: str, n_predict: int) -> None:
    command = [str(llamacpp.tool("llama-cli")), "-m", str(model), "-p", prompt, "-n", str(n_predict),
               "--temp", "0", "--single-turn", "--simple-io"]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, stdin=subprocess.DEVNULL)


def main() -> int:
    if importlib.util.find_spec("nbl_gguf.convert") is not None:
        subprocess.run([sys.executable, "-m", "nbl_gguf", "convert", "--m", "12", "--quant", "q4_k_m"], check=True)
        run_cli(Path("model-nbl.gguf"), "The capital of France is", 32)
        return 0
    model = TinyLlama(n_layer=4)
    types = [gguf_nbl.ATTENTION, gguf_nbl.LINEAR, gguf_nbl.DROPPED, gguf_nbl.ATTENTION]
    with tempfile.TemporaryDirectory() as tmp:
        path = model.write_nbl_gguf(Path(tmp) / "tiny-nbl.gguf", types, model.random_linear([1]))
        run_cli(path, "Hello", 16)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
