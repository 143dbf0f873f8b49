"""Passkey retrieval (measurement.passkey) of window files made from a stock GGUF and a ranking that
window_results.py wrote (its choice*.json "order", or with --by-text the order of each layer's cost on text alone): the first m
layers made window layers.

    python docs/results/experiments/window_passkey.py --model STOCK.gguf --choice docs/results/window/NAME/choice.json \
        --m 12 [--size 512] [--sinks 4] [--ctx 4096,16384] [--depths 0.1,0.3,0.5,0.7,0.9] -o OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from nbl_gguf.gguf import nbl_format  # noqa: E402
from nbl_gguf.measurement.passkey import passkey  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path, help="the stock GGUF")
    parser.add_argument("--choice", required=True, type=Path, help="a choice*.json of window_results.py")
    parser.add_argument("--by-text", action="store_true",
                        help="the order of the layers' cost on text alone (the choice's increases), not its walk")
    parser.add_argument("--m", default="12", help="window layers (comma-separated)")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--ctx", default="4096")
    parser.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("-o", "--output", required=True, type=Path)
    args = parser.parse_args()

    import gguf

    reader = gguf.GGUFReader(args.model)
    arch = str(reader.fields["general.architecture"].contents())
    n_layer = int(reader.fields[f"{arch}.block_count"].contents())
    choice = json.loads(args.choice.read_text())
    costs = {int(k): v for k, v in (choice.get("increases") or choice["local_errors"]).items()}
    order = sorted(costs, key=lambda i: (costs[i], i)) if args.by_text else choice["order"]
    name = f"{args.choice.name}{', by text' if args.by_text else ''}"
    lengths = tuple(int(n) for n in args.ctx.split(","))
    depths = tuple(float(d) for d in args.depths.split(","))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for m in (int(x) for x in args.m.split(",")):
            layers = tuple(sorted(order[:m]))
            path = Path(tmp) / f"window-m{m}.gguf"
            nbl_format.write_nbl_gguf(args.model, path, nbl_format.NblLayers(
                types=[nbl_format.ATTENTION] * n_layer, windows=nbl_format.Windows(layers, args.size, args.sinks),
                method="window"))
            began = time.monotonic()
            report = passkey(path, lengths, depths, threads=args.threads).report()
            results[f"windows m={m} W={args.size} S={args.sinks} ({name})"] = \
                report | {"layers": list(layers), "seconds": time.monotonic() - began}
            print(f"m={m}: {report['accuracy']}", file=sys.stderr, flush=True)
    args.output.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
