"""The LM-head pass of layer selection (stream.LayerStream.token_nll) against the strided head input it
replaced, side by side on one window of a model (docs/results/scale-cpu.md, "Selection").

    python docs/results/experiments/bench_selection_head.py bench-results/scale/llama-3.1-8b-random-q4_k_m.gguf

Before the fix, the head read each slice of 256 positions as a [1, 256, d] view that kept the window's
batch stride; torch's bf16 CPU matmul then left its fast path. Prints both times and the largest
difference between the two NLLs (0: the same numbers, only faster).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="GGUF file or HF folder")
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from nbl_gguf.calibration.stream import LOSS_POSITIONS, LayerStream
    from nbl_gguf.model_source import resolve_model

    stream = LayerStream(resolve_model(args.model), torch.bfloat16, "cpu")
    stream.load_head()
    head = stream.model.get_output_embeddings()
    torch.manual_seed(0)
    hidden = torch.randn(1, args.seqlen, stream.hidden_size, dtype=torch.bfloat16)
    ids = torch.randint(0, head.weight.shape[0], (1, args.seqlen))
    for _ in range(args.repeats):
        start = time.perf_counter()
        now = stream.token_nll(hidden, ids)[0]
        fixed = time.perf_counter() - start
        with torch.no_grad():
            normed = stream._forward_base(torch.zeros_like(hidden), inject=hidden)[2].last_hidden_state
            start = time.perf_counter()
            old = torch.cat([F.cross_entropy(head(normed[:, a:min(a + LOSS_POSITIONS, args.seqlen - 1)]).float()[0],
                                             ids[0, a + 1:min(a + LOSS_POSITIONS, args.seqlen - 1) + 1], reduction="none")
                             for a in range(0, args.seqlen - 1, LOSS_POSITIONS)])
            strided = time.perf_counter() - start
        print(f"one window of {args.seqlen}: token_nll {fixed:.1f} s, the strided head input {strided:.1f} s "
              f"({strided / fixed:.1f}x); max |NLL difference| {float((old.double() - now).abs().max()):.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
