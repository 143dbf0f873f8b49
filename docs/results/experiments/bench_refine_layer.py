"""The streamed refinement's cost at a real shape (issue 33): one decoder layer of --shape with random bf16
weights, its attention replaced by a past-token map (the default low-rank form, random), timed as
calibration.refine.refine_streamed runs it on --seqlen-token pieces: the layer's forward without
autograd (each kept layer's pass, the teacher's trajectory, the target), and a training step (the
forward with autograd, backward to the map, Adam). Prints one JSON line with the times, the peak RSS
and the whole streamed refinement of --m layers extrapolated from them.

    python docs/results/experiments/bench_refine_layer.py --shape llama-3.1-8b --m 12 --tokens 32768
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--m", type=int, default=12)
    parser.add_argument("--taps", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=32768, help="--refine-tokens")
    parser.add_argument("--epochs", type=int, default=3, help="--refine-epochs")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from nbl_gguf.calibration.apply import ATTN_TAPS, replace_layer
    from nbl_gguf.calibration.refine import make_trainable, map_modules
    from nbl_gguf.calibration.stream import LayerStream
    from nbl_gguf.calibration.taps import TapsMap, default_rank
    from nbl_gguf.fixtures.synthetic import get_shape

    shape = get_shape(args.shape)
    d = shape.n_embd
    config = LlamaConfig(hidden_size=d, intermediate_size=shape.n_ff, num_hidden_layers=1,
                         num_attention_heads=shape.n_head, num_key_value_heads=shape.n_head_kv, vocab_size=256,
                         max_position_embeddings=shape.n_ctx_train, rope_theta=shape.rope_base)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    stream = LayerStream.resident(model)
    stream.load_layer(0)
    hidden = torch.randn(1, args.seqlen, d, dtype=torch.bfloat16)
    rank = default_rank(d)
    generator = np.random.default_rng(0)
    taps_map = TapsMap(taps=args.taps, weight=(generator.standard_normal((d, d)) / d ** 0.5).astype(np.float32),
                       bias=np.zeros(d, np.float32),
                       lag_down=(generator.standard_normal((rank, (args.taps - 1) * d)) / d).astype(np.float32),
                       lag_up=(generator.standard_normal((d, rank)) / rank ** 0.5).astype(np.float32))

    def timed(function) -> float:
        function()  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            function()
            times.append(time.perf_counter() - start)
        return min(times)

    forward_s = timed(lambda: stream.run_layer(0, hidden))
    replace_layer(stream.model, 0, ATTN_TAPS, {0: taps_map})
    _, optimizer = make_trainable(map_modules(stream.model, [0]), 2e-3)
    target = stream.run_layer(0, hidden)

    def step():
        out = stream.run_layer(0, hidden, grad=True)
        loss = (out.float() - target.float()).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    step_s = timed(step)
    replaced_forward_s = timed(lambda: stream.run_layer(0, hidden))
    pieces = args.tokens // args.seqlen
    # per replaced layer: the teacher's pass and the epochs of training steps, then the pass that makes the
    # next layer's input; per kept layer (up to the last replaced one): the teacher's pass and the model's
    kept = shape.n_layer - args.m
    total = args.m * pieces * (forward_s + args.epochs * step_s + replaced_forward_s) + kept * pieces * 2 * forward_s
    row = {"shape": shape.name, "d": d, "seqlen": args.seqlen, "taps": args.taps, "rank": rank,
           "threads": torch.get_num_threads(), "layer_forward_s": round(forward_s, 3),
           "train_step_s": round(step_s, 3), "replaced_forward_s": round(replaced_forward_s, 3),
           "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
           "m": args.m, "tokens": args.tokens, "epochs": args.epochs,
           "streamed_refine_estimate_s": round(total), "note": "kept layers counted up to the model's last layer "
                                                                "(an upper bound: the loop stops at the last replaced)"}
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
