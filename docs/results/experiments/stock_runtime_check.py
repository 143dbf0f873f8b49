"""Run GGUFs with an unmodified libllama: its KV cache with flash attention off and on, and a greedy
answer to a chat prompt (docs/results/stock-runtime.md).

llama-cpp-python loads the library named by LLAMA_CPP_LIB_PATH, so the stock one is chosen with it:

    LLAMA_CPP_LIB_PATH=build/stock .venv/bin/python docs/results/experiments/stock_runtime_check.py stock.gguf nbl-stock-layout.gguf
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

PROMPT = "What is the capital of France?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--ctx", type=int, default=4096, help="KV cache cells (default: 4096)")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()

    import llama_cpp

    from nbl_gguf.llamacpp import library

    print(f"libllama: {llama_cpp.llama_cpp._lib._name}  (LLAMA_CPP_LIB_PATH={os.environ.get('LLAMA_CPP_LIB_PATH')})")
    print(f"{'file':<44s} {'flash attn':>10s} {'layers':>6s} {'K MiB':>8s} {'V MiB':>8s} {'K+V MiB':>8s}  V padded")
    answers = {}
    for path in args.files:
        for flash in (False, True):
            with library.captured_log() as lines:
                llm = llama_cpp.Llama(path, n_ctx=args.ctx, flash_attn=flash, verbose=True)
            log = "".join(lines)
            kv = library.kv_caches(log)[0]
            padded = "padding V cache" in log
            print(f"{Path(path).name:<44s} {'on' if flash else 'off':>10s} {kv.layers:6d} {kv.k_mib:8.2f} "
                  f"{kv.v_mib:8.2f} {kv.mib:8.2f}  {'yes' if padded else 'no'}")
            if flash:
                reply = llm.create_chat_completion([{"role": "user", "content": PROMPT}],
                                                   max_tokens=args.max_tokens, temperature=0.0)
                answers[path] = reply["choices"][0]["message"]["content"]
            del llm
    for path, answer in answers.items():
        print(f"\n{Path(path).name}: {PROMPT!r} -> {answer!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
