"""The main job that `scripts/setup.sh` runs once everything is set up: what a user types.

    python -m nbl_gguf convert --m 12 --quant q4_k_m      (embedded model, bundled data, offline)
    build/bin/llama-cli -m model-nbl.gguf -p ...          (the patched llama.cpp answers a prompt)
"""

from __future__ import annotations

import subprocess
import sys

from nbl_gguf.llamacpp import tools as llamacpp

OUTPUT = "model-nbl.gguf"
PROMPT = "What is the capital of France?"


def main() -> int:
    subprocess.run([sys.executable, "-m", "nbl_gguf", "convert", "--m", "12", "--quant", "q4_k_m", "-o", OUTPUT],
                   check=True)
    command = [str(llamacpp.tool("llama-cli")), "-m", OUTPUT, "-p", PROMPT, "-n", "48", "--temp", "0",
               "--single-turn", "--simple-io"]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, stdin=subprocess.DEVNULL)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
