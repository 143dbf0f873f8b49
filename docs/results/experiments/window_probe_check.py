"""The answer loss (nats per answer token, in PyTorch) of window sets, or of sets of replaced layers, on three
kinds of retrieval prompt: the walk's probes with other keys and depths, the same with a filler of one sentence
repeated, and the passkey prompts of measurement.passkey. For each m: no windows, the walk's first m layers (the
choice's "order"), the first m by cost on text alone.

    python docs/results/experiments/window_probe_check.py --model MODEL.gguf \
        --choice docs/results/window/NAME/choice-retrieval-0.15.json --m 15 > OUT.txt

Or given window sets (W and S from --size/--sinks), the probes at chosen depths, some kinds of prompt only:

    python docs/results/experiments/window_probe_check.py --model MODEL.gguf --sets "19=0-9,12,14,15,17-21,23;..." \
        --depths 0.0,0.25,0.75 --kinds probes,passkey > OUT.txt

Sets of layers replaced by a calibration's maps (as a file of its --taps carries them) instead of windows, the
probes hidden in the held-out evaluation text (docs/results/recall.md):

    python docs/results/experiments/window_probe_check.py --model MODEL --calibration CAL \
        --sets "best=0,19,27,29;checked=0,21,27,29" --part evaluation --texts 2 --seed 7 --depths 0.25,0.75 \
        --ctx 4096 --kinds probes
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))


def parse_layers(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--choice", type=Path, help="a window choice's JSON: compare its walk's and text's first m")
    parser.add_argument("--m", default="15")
    parser.add_argument("--sets", default=None, help="instead of --choice: 'LABEL=LAYERS;...', LAYERS as 0-9,12")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--depths", default="0.25,0.5,0.75", help="the probes' depths in the span beyond the window")
    parser.add_argument("--kinds", default="probes,repeated,passkey",
                        help="which prompts: probes (facts in the texts), repeated (the same facts in one sentence "
                             "repeated), passkey (measurement.passkey's own prompts: the evaluation's)")
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--calibration", default=None,
                        help="with --sets: the sets are replaced layers, with this calibration's maps (not windows)")
    parser.add_argument("--part", choices=("selection", "evaluation"), default="selection",
                        help="the bundled text the probes hide their facts in (default: selection, the walk's)")
    parser.add_argument("--texts", type=int, default=1, help="windows of text per kind")
    parser.add_argument("--seed", type=int, default=1, help="the probes' names and keys")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from nbl_gguf import models
    from nbl_gguf.calibration.apply import ATTN_WINDOW
    from nbl_gguf.calibration.dataset import KINDS, build_windows, kind_texts
    from nbl_gguf.calibration.stream import LayerStream
    from nbl_gguf.calibration.variants import run_variants
    from nbl_gguf.calibration.windows import Window, repeated_filler, retrieval_probes
    from nbl_gguf.measurement import passkey as pk
    from nbl_gguf.model_source import resolve_model

    torch.set_num_threads(args.threads)
    stream = LayerStream(resolve_model(args.model), models.resolve_dtype("auto", "cpu"), "cpu")
    tokenizer = stream.tokenizer
    names, variants = ["no windows"], [{}]
    maps, layer_type = None, ATTN_WINDOW
    if args.calibration:
        from nbl_gguf.calibration.artifact import load_artifact
        from nbl_gguf.calibration.best_at import map_reader

        artifact = load_artifact(args.calibration)
        layer_type, maps = map_reader(artifact, artifact.report["selection"]["method"], artifact.taps)
        names = ["unmodified"]
    if args.sets:
        window = Window(args.size, args.sinks)
        for item in args.sets.split(";"):
            label, _, layers = item.partition("=")
            names.append(label)
            variants.append({i: layer_type for i in parse_layers(layers)})
    else:
        choice = json.loads(args.choice.read_text())
        increases = {int(k): v for k, v in choice["increases"].items()}
        by_text = sorted(increases, key=lambda i: (increases[i], i))
        window = Window(choice["size"], choice["sinks"])
        for m in (int(x) for x in args.m.split(",")):
            names += [f"walk m={m}", f"text m={m}"]
            variants += [{i: ATTN_WINDOW for i in choice["order"][:m]}, {i: ATTN_WINDOW for i in by_text[:m]}]
    depths = tuple(float(x) for x in args.depths.split(","))

    ids = torch.cat([build_windows(tokenizer, kind_texts(kind, args.part), args.texts, args.ctx,
                                   name=f"bundled {kind} text").input_ids for kind in KINDS])
    repeated = repeated_filler(ids)  # one sentence-sized piece of each text, repeated
    kinds = set(args.kinds.split(","))
    sets = {}
    if "probes" in kinds:
        sets["probes, other keys"] = retrieval_probes(tokenizer, ids, window, depths=depths, seed=args.seed)
    if "repeated" in kinds:
        sets["probes, repeated filler"] = retrieval_probes(tokenizer, repeated, window, depths=depths, seed=args.seed)
    for label, probes in sets.items():
        print(f"{label}: distances {list(probes.distances)} (text-major, depths {list(depths)})", flush=True)

    # the passkey prompts, as measurement.passkey builds them (its seed 0 keys), the answer " KEY" scored
    rng = random.Random(0)
    rows, masks = [], []
    for depth in pk.DEPTHS:
        key = rng.randrange(10000, 100000)
        prompt = pk.build_prompt(lambda text: len(tokenizer(text)["input_ids"]), args.ctx, depth, key)
        asked, answered = tokenizer(prompt)["input_ids"], tokenizer(prompt + f" {key}.")["input_ids"][:-1]
        rows.append(answered)
        masks.append(len(answered) - len(asked))
    length = max(map(len, rows))
    passkey_ids = torch.tensor([r + [r[-1]] * (length - len(r)) for r in rows])
    scored = torch.zeros(len(rows), length - 1, dtype=torch.bool)
    for i, (r, n) in enumerate(zip(rows, masks)):
        scored[i, len(r) - 1 - n:len(r) - 1] = True

    prompts = [(k, (p.ids, p.scored)) for k, p in sets.items()]
    if "passkey" in kinds:
        prompts.append(("passkey prompts", (passkey_ids, scored)))
    for label, (batch, mask) in prompts:
        finals = run_variants(stream, batch, variants, lambda k, t: window if t == ATTN_WINDOW else maps(k, t))
        stream.load_head()
        print(f"## {label}")
        for name, final in zip(names, finals):
            nll = torch.cat([stream.token_nll(final[i:i + 1], batch[i:i + 1]) for i in range(batch.shape[0])])
            # per prompt: the mean, and the larger of the first two answer tokens (where a greedy answer turns)
            per = [(round(float(nll[i][mask[i]].mean()), 2), round(float(nll[i][mask[i]][:2].max()), 2))
                   for i in range(batch.shape[0])]
            print(f"{name}: {float(nll[mask].mean()):.3f} per prompt (mean, first two at most) {per}", flush=True)
        stream.release_head()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
