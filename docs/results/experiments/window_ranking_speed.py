"""The window candidates' ranking alone, at a real model's shape: choose_windows' ``local`` ranking (one pass,
each layer with and without its window) or its ``loss`` ranking (every candidate run alone to the output), on
random weights of ``--shape`` (the order means nothing there; the time and memory are the model's). One ranking
per process, so that /usr/bin/time -v gives each one's peak RSS:

    /usr/bin/time -v python docs/results/experiments/window_ranking_speed.py --shape llama-3.2-1b --ranking local
    /usr/bin/time -v python docs/results/experiments/window_ranking_speed.py --shape llama-3.2-1b --ranking loss

Three texts of --ctx tokens, as convert's choice (one per bundled kind), W = 512, S = 4, bf16 on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def main() -> int:
    import torch

    from nbl_gguf import models
    from nbl_gguf.calibration import windows as w
    from nbl_gguf.calibration.apply import ATTN_WINDOW
    from nbl_gguf.calibration.dataset import KINDS, bundled_selection_windows
    from nbl_gguf.calibration.stream import LayerStream
    from nbl_gguf.calibration.variants import run_variants
    from nbl_gguf.fixtures.synthetic import get_shape, write_random_hf_folder
    from nbl_gguf.model_source import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.2-1b")
    parser.add_argument("--ranking", choices=w.RANKINGS, required=True)
    parser.add_argument("--ctx", type=int, default=w.DEFAULT_CTX)
    parser.add_argument("--out", default="bench-results/scale")
    args = parser.parse_args()
    torch.set_num_threads(2)
    shape = get_shape(args.shape)
    folder = write_random_hf_folder(shape, Path(args.out) / f"{shape.name}-random-f16", models.default_model_dir())
    stream = LayerStream(resolve_model(str(folder)), models.resolve_dtype("auto", "cpu"), "cpu")
    ids, _ = bundled_selection_windows(stream.tokenizer, {k: 1 for k in KINDS}, args.ctx)
    layer_map = w.window_layer_map(w.Window(w.DEFAULT_SIZE, w.DEFAULT_SINKS), None)
    pool = list(range(stream.num_layers))
    started = time.perf_counter()
    if args.ranking == "local":
        costs = w.local_window_errors(stream, ids, pool, {}, layer_map)
    else:  # what choose_windows runs for it
        variants = [{}] + [{i: ATTN_WINDOW} for i in pool]
        losses = w.second_half_loss(stream, run_variants(stream, ids, variants, layer_map), ids)
        costs = {i: loss - losses[0] for i, loss in zip(pool, losses[1:])}
    seconds = time.perf_counter() - started
    print(json.dumps({"shape": shape.name, "ranking": args.ranking, "ctx": args.ctx, "texts": int(ids.shape[0]),
                      "dtype": str(stream.dtype), "seconds": seconds, "costs": costs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
