"""Held-out perplexity of GGUF files on each bundled kind of text at one long context, as `bench --frontier`
measures its long column (llama-perplexity, the evaluation part of each kind, never calibrated or selected on),
the change against the first file. For files made outside the frontier (docs/results/recall.md):

    python docs/results/experiments/long_ppl.py STOCK.gguf A.gguf B.gguf -c 4096 --chunks 1 -t 2
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from nbl_gguf.calibration.dataset import CHARS_PER_TOKEN_BOUND, KINDS, write_evaluation_text
from nbl_gguf.llamacpp.perplexity import perplexity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("-c", "--ctx-size", type=int, default=4096)
    parser.add_argument("--chunks", type=int, default=1)
    parser.add_argument("-t", "--threads", type=int, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="long-ppl-") as tmp:
        chars = CHARS_PER_TOKEN_BOUND * 2 * args.ctx_size * args.chunks
        texts = {kind: write_evaluation_text(kind, Path(tmp) / f"heldout-{kind}.txt", chars) for kind in KINDS}
        table = {path: {kind: perplexity(path, text, n_ctx=args.ctx_size, chunks=args.chunks,
                                         threads=args.threads).ppl for kind, text in texts.items()}
                 for path in args.files}
    base = table[args.files[0]]
    print(f"| file | {' | '.join(f'{kind} @{args.ctx_size}' for kind in KINDS)} | mean change |\n"
          f"|---|{'---:|' * (len(KINDS) + 1)}")
    for path, row in table.items():
        changes = [100 * (row[kind] / base[kind] - 1) for kind in KINDS]
        cells = [f"{row[kind]:.3f}" + (f" ({change:+.1f}%)" if path != args.files[0] else "")
                 for kind, change in zip(KINDS, changes)]
        mean = "base" if path == args.files[0] else f"{sum(changes) / len(changes):+.1f}%"
        print(f"| {path.name} | {' | '.join(cells)} | {mean} |")


if __name__ == "__main__":
    main()
