"""Side by side: choose_windows with the retrieval walk on SmolLM2 (6 candidate layers, 4,096 tokens), the dense
mask and full-head probes (before ee71841) against windowed_attention and scored_nll."""
import time, sys, torch
from nbl_gguf import models
from nbl_gguf.calibration import apply, windows as w
from nbl_gguf.calibration.dataset import KINDS, bundled_selection_windows
from nbl_gguf.calibration.stream import LayerStream
from nbl_gguf.model_source import resolve_model
torch.set_num_threads(2)
stream = LayerStream(resolve_model(sys.argv[1]), models.resolve_dtype("auto", "cpu"), "cpu")
ids, _ = bundled_selection_windows(stream.tokenizer, {k: 1 for k in KINDS}, 4096)
window = w.Window(512, 4)
probes = w.retrieval_probes(stream.tokenizer, ids, window)
cands = list(range(0, stream.num_layers, max(1, stream.num_layers // 6)))[:6]
def dense_scored(self, hidden, ids, scored):
    return self.token_nll(hidden, ids)[scored]
fast_nll = LayerStream.scored_nll
results = {}
for label in ("before", "after", "before", "after"):
    apply.WINDOW_BLOCK = 10 ** 9 if label == "before" else 256
    LayerStream.scored_nll = dense_scored if label == "before" else fast_nll
    t = time.perf_counter()
    choice = w.choose_windows(stream, ids, 3, window, candidates=cands, probes=probes)
    dt = time.perf_counter() - t
    results.setdefault(label, []).append(dt)
    print(label, round(dt, 1), "s", choice.layers, round(choice.loss, 5), choice.retrieval.kept,
          [round(x, 4) for x in choice.retrieval.losses], flush=True)
print("speedup (before/after, best of 2):", round(min(results["before"]) / min(results["after"]), 2))
