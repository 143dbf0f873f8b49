"""Which replaced layers keep retrieval: a selection of NBL layers walked with retrieval probes.

A replaced layer mixes no tokens at all, and a few layers carry most of a model's recall of a fact stated far
back. The held-out perplexity that the selection chooses by barely sees it: on SmolLM2-135M (Q5_K_M), best's
m = 4 (nmse's layers 0, 19, 27, 29 with past-token maps, +11.8% perplexity at 4,096 tokens) found 0/5 passkeys at
4,096 tokens where the stock file finds 5/5, with per-token maps on those layers 0/5 too, and cosine's layers 6,
25, 26, 28 5/5 (docs/results/frontier.md). The window walk's retrieval probes (windows.retrieval_probes: a code
word and its number stated once in the selection text, asked for at the end) see part of it at 1,024 tokens:
answer loss 0.103 nats per token unmodified, 0.340 with nmse's four layers, 0.303 with layer 19 alone, 0.109 with
cosine's four. The walk keeps recall of facts in held-out text, not the passkey, which SmolLM2's layer 0 carries
and these probes barely see (docs/results/recall.md): hence off by default.

So the walk of windows.guarded_walk, with replaced layers: the selection's layers in its criterion's order, then
that criterion's next ones, each kept only while the probes' answer loss of the set so far with it stays within a
tolerance of the unmodified model's. If fewer than the selection's count pass, the rest are those it refused, the
least harmful first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from nbl_gguf.calibration.windows import RetrievalGuard, Window, guarded_walk, retrieval_probes
from nbl_gguf.errors import NblError

DEFAULT_CTX = 1024  # tokens per probe (the training context if shorter): a replaced layer loses any distance


@dataclass
class RecallChoice:
    layers: tuple[int, ...]  # the layers to replace
    selected: tuple[int, ...]  # the selection's own, before the walk
    ctx: int
    guard: RetrievalGuard

    @property
    def changed(self) -> bool:
        return self.layers != self.selected

    def report(self) -> dict:
        return {"layers": list(self.layers), "selected": list(self.selected), "ctx": self.ctx,
                "retrieval": self.guard.report()}


def walk_order(selected: Sequence[int], ranking: Sequence[int]) -> list[int]:
    """The order the walk tries the layers in: ``selected`` in the order of ``ranking``, then the rest of it."""
    chosen = set(selected)
    if not chosen <= set(ranking):
        raise NblError(f"layers {sorted(chosen - set(ranking))} of the selection are not in the ranking")
    return [i for i in ranking if i in chosen] + [i for i in ranking if i not in chosen]


def keep_recall(stream, ids: torch.Tensor, selected: Sequence[int], ranking: Sequence[int], layer_type: int,
                maps: Callable, tolerance: float) -> RecallChoice:
    """As many layers as ``selected``, walked in walk_order(selected, ranking) on retrieval probes in windows of
    text ``ids`` [n, ctx], each made ``layer_type`` with its map from ``maps(layer, type)`` (variants.run_variants'
    ``linear``): the module's docstring."""
    ctx = int(ids.shape[1])
    try:
        probes = retrieval_probes(stream.tokenizer, ids, Window(ctx // 4, 0))
    except NblError:
        raise NblError(f"a retrieval probe does not fit in {ctx} tokens: the model's context is too short to check "
                       f"recall (--nbl-retrieval off)") from None
    count = len(selected)
    guard = guarded_walk(stream, probes, walk_order(selected, ranking), count, {}, maps, tolerance,
                         layer_type=layer_type)
    return RecallChoice(guard.chosen(count), tuple(sorted(selected)), ctx, guard)


def describe(choice: RecallChoice) -> str:
    """One line for the summary: what the walk kept, refused, and the answer loss it ended at."""
    guard = choice.guard
    refused = ", ".join(f"{i} ({loss:.3f})" for i, loss in guard.refused.items()) or "none"
    head = (f"retrieval check: the selection's layers {', '.join(map(str, choice.selected))} -> "
            f"{', '.join(map(str, choice.layers))}" if choice.changed else
            f"retrieval check: the selection's layers {', '.join(map(str, choice.selected))} kept")
    return (f"{head}; probes' answer loss {guard.base_loss:.3f} nats/token unmodified, {guard.loss:.3f} with the "
            f"layers kept (tolerance {guard.tolerance:g}); refused: {refused} ({len(guard.distances)} probes at "
            f"{choice.ctx} tokens)")
