"""Can a one-pass local measurement order the window candidates as well as the end-to-end one?

choose_windows orders the candidates by each one's end-to-end loss alone on text (run_variants: every
candidate runs from its own layer to the last, about n_layer / 2 forward passes), then the retrieval walk
tries them in that order, each trial again from its layer to the last. Here, on the unmodified track
(one pass, each layer loaded once), each layer's own output with its window against without:

- text: ||out_window - out_full||^2 / ||out_full - in||^2 over the second half of the selection texts;
- probe: the same over the rows of the retrieval probes that predict the answer (the question's end).

The orders compared: end to end (convert's), local text, and local text with the layers whose probe error
is above the median put last. For each: the walk with the same probes and tolerance (its trials and time),
the chosen set's loss on the second half of the texts together, and the walk's answer loss (``answer_loss``: of
the layers it kept, not of those it refused and the choice filled in). ``local_s`` times both local passes; the
local text order needs only the first.

    python docs/results/experiments/window_order_proxy.py MODEL.gguf [COUNT] > out.json
"""
import json
import math
import sys
import time

import torch

from nbl_gguf import models
from nbl_gguf.calibration import windows as w
from nbl_gguf.calibration.apply import ATTN_WINDOW
from nbl_gguf.calibration.dataset import KINDS, bundled_selection_windows
from nbl_gguf.calibration.stream import LayerStream
from nbl_gguf.calibration.variants import layer_output, run_variants
from nbl_gguf.model_source import resolve_model


def local_errors(stream, ids, rows, layer_map):
    """Per layer: the window's relative error of the layer's contribution on ``rows`` [n, ctx] (bool)."""
    stream.prepare_embedding(ids)
    try:
        hidden = torch.cat([stream.embed(ids[i:i + 1]) for i in range(ids.shape[0])])
    finally:
        stream.release_embedding()
    errors = []
    for k in range(stream.num_layers):
        stream.load_layer(k)
        try:
            full = layer_output(stream, k, hidden)
            windowed = layer_output(stream, k, hidden, ATTN_WINDOW, layer_map)
        finally:
            stream.release_layer(k)
        delta = (windowed - full).float()[rows]
        contribution = (full - hidden).float()[rows]
        errors.append(float(delta.pow(2).sum() / contribution.pow(2).sum()))
        hidden = full
    return errors


def spearman(a, b):
    ra = torch.tensor(a).argsort().argsort().double()
    rb = torch.tensor(b).argsort().argsort().double()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def main():
    torch.set_num_threads(2)
    stream = LayerStream(resolve_model(sys.argv[1]), models.resolve_dtype("auto", "cpu"), "cpu")
    count = int(sys.argv[2]) if len(sys.argv) > 2 else stream.num_layers // 2
    ids, _ = bundled_selection_windows(stream.tokenizer, {k: 1 for k in KINDS}, w.DEFAULT_CTX)
    window = w.Window(w.DEFAULT_SIZE, w.DEFAULT_SINKS)
    probes = w.retrieval_probes(stream.tokenizer, ids, window)
    layer_map = w.window_layer_map(window, None)
    layers = list(range(stream.num_layers))
    out = {"model": sys.argv[1], "count": count, "ctx": int(ids.shape[1])}

    started = time.perf_counter()
    text_rows = torch.zeros(ids.shape, dtype=torch.bool)
    text_rows[:, ids.shape[1] // 2:] = True
    text_error = local_errors(stream, ids, text_rows, layer_map)
    probe_rows = torch.zeros(probes.ids.shape, dtype=torch.bool)
    probe_rows[:, :-1] = probes.scored  # row t predicts token t + 1: the layer's output at row t
    probe_error = local_errors(stream, probes.ids, probe_rows, layer_map)
    out["local_s"] = time.perf_counter() - started
    out["local_text"], out["local_probe"] = text_error, probe_error
    print(f"local: {out['local_s']:.0f} s", file=sys.stderr, flush=True)

    started = time.perf_counter()
    variants = [{}] + [{i: ATTN_WINDOW} for i in layers]
    losses = w.second_half_loss(stream, run_variants(stream, ids, variants, layer_map), ids)
    out["end_to_end_s"] = time.perf_counter() - started
    increases = [loss - losses[0] for loss in losses[1:]]
    out["end_to_end"] = increases
    out["spearman_text"] = spearman(text_error, increases)
    print(f"end to end: {out['end_to_end_s']:.0f} s, spearman {out['spearman_text']:.3f}", file=sys.stderr, flush=True)

    median = sorted(probe_error)[len(probe_error) // 2]
    orders = {
        "end_to_end": sorted(layers, key=lambda i: (increases[i], i)),
        "local_text": sorted(layers, key=lambda i: (text_error[i], i)),
        "local_text_probe_last": sorted(layers, key=lambda i: (probe_error[i] > median, text_error[i], i)),
    }
    out["walks"] = {}
    for name, order in orders.items():
        started = time.perf_counter()
        guard = w.guarded_walk(stream, probes, order, count, {}, layer_map, w.DEFAULT_RETRIEVAL_TOLERANCE)
        walk_s = time.perf_counter() - started
        fill = sorted(guard.refused, key=lambda i: (guard.refused[i], i))[:count - len(guard.kept)]
        chosen = sorted(guard.kept + fill)
        together = w.second_half_loss(stream, run_variants(stream, ids, [{i: ATTN_WINDOW for i in chosen}],
                                                           layer_map), ids)[0]
        out["walks"][name] = {"order": order, "walk_s": walk_s, "trials": len(guard.kept) + len(guard.refused),
                              "kept": guard.kept, "refused": guard.refused, "chosen": chosen,
                              "answer_loss": guard.loss, "base_answer_loss": guard.base_loss,
                              "text_loss": together, "base_text_loss": losses[0],
                              "text_increase_pct": 100 * (math.exp(together - losses[0]) - 1)}
        print(name, json.dumps({k: v for k, v in out["walks"][name].items() if k != "order"}), file=sys.stderr,
              flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
