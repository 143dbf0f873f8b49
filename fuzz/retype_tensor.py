"""Write one of fuzz/make_seeds.py's seeds with one tensor stored in another type: how the regression
and upstream files that need a wrongly typed tensor were made (docs/fuzzing.md).

    .venv/bin/python fuzz/retype_tensor.py SEED TENSOR TYPE OUT      e.g. llama-mixed blk.1.attn_nbl.bias Q4_1 x.gguf
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_seeds import SEEDS, seed_tensors, write_seed  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__.strip().splitlines()[3].strip(), file=sys.stderr)
        return 2
    name, tensor, type_name, out = argv
    if name not in SEEDS:
        sys.exit(f"no seed {name}: one of {', '.join(SEEDS)}")
    if tensor not in seed_tensors(SEEDS[name], __import__("numpy").random.default_rng(0)):
        sys.exit(f"seed {name} has no tensor {tensor}")
    write_seed(Path(out), name, SEEDS[name], retype={tensor: type_name})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
