"""One window file made from a stock GGUF with the window layers given, measured as a --kv-budget candidate
is and as its summary measures the output: llama-perplexity at a long context on each kind's evaluation text
(and the stock file beside it, both with the cache type given), and the passkey test at the lengths given.

    python docs/results/experiments/window_file_check.py --model STOCK.gguf --windows 0,1,2 --size 128 \
        --kv-type q8_0 [--ctx 4096] [--passkey 4096,16384] -o OUT.json
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

from nbl_gguf.calibration.dataset import KINDS, write_evaluation_text  # noqa: E402
from nbl_gguf.gguf import nbl_format  # noqa: E402
from nbl_gguf.llamacpp.perplexity import perplexity  # noqa: E402
from nbl_gguf.measurement.passkey import DEPTHS, passkey  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path, help="the stock GGUF")
    parser.add_argument("--windows", required=True, help="the window layers (comma-separated)")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--kv-type", default="f16")
    parser.add_argument("--ctx", type=int, default=4096, help="the perplexity context (one chunk per kind)")
    parser.add_argument("--passkey", default="4096,16384", help="passkey prompt lengths ('' for none)")
    parser.add_argument("--no-stock", action="store_true", help="skip the stock file's perplexity")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("-o", "--output", required=True, type=Path)
    args = parser.parse_args()

    import gguf

    reader = gguf.GGUFReader(args.model)
    arch = str(reader.fields["general.architecture"].contents())
    n_layer = int(reader.fields[f"{arch}.block_count"].contents())
    windows = tuple(sorted(int(x) for x in args.windows.split(",")))
    out = {"model": args.model.name, "windows": list(windows), "size": args.size, "sinks": args.sinks,
           "kv_type": args.kv_type, "ctx": args.ctx}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "windows.gguf"
        nbl_format.write_nbl_gguf(args.model, path, nbl_format.NblLayers(
            types=[nbl_format.ATTENTION] * n_layer, windows=nbl_format.Windows(windows, args.size, args.sinks),
            method="window"))
        texts = {kind: write_evaluation_text(kind, Path(tmp) / f"{kind}.txt", 8 * 2 * args.ctx) for kind in KINDS}
        for name, model in ((("stock", args.model),) if not args.no_stock else ()) + (("windows", path),):
            began = time.monotonic()
            out[f"{name}_ppl"] = {kind: perplexity(model, text, n_ctx=args.ctx, chunks=1, threads=args.threads,
                                                   cache_type=args.kv_type).ppl for kind, text in texts.items()}
            print(name, out[f"{name}_ppl"], f"({time.monotonic() - began:.0f} s)", flush=True)
        if "stock_ppl" in out:
            out["change_pct"] = {kind: 100 * (out["windows_ppl"][kind] / out["stock_ppl"][kind] - 1) for kind in texts}
            print("change %", {k: round(v, 2) for k, v in out["change_pct"].items()}, flush=True)
        lengths = tuple(int(n) for n in args.passkey.split(",") if n)
        if lengths:
            began = time.monotonic()
            out["passkey"] = passkey(path, lengths, DEPTHS, kv_type=args.kv_type, threads=args.threads).report()
            print("passkey", json.dumps(out["passkey"])[:400], f"({time.monotonic() - began:.0f} s)", flush=True)
    args.output.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
