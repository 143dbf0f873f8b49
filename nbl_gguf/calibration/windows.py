"""Which attention layers become window layers, by measurement.

A window layer keeps its attention over the last ``size`` tokens and the first ``sinks``
(apply.WindowAttention). What it costs shows only past ``size`` tokens, so the loss is taken on the
second half of long windows of held-out text (as llama-perplexity scores a chunk), and measured
through the stream's variant evaluator: one decoder layer in memory at a time, every candidate's
variant sharing the model's track up to its window layer. Each candidate is measured alone on top of
the layers already replaced (NBL or taps maps); the cheapest are chosen, and the chosen set is then
measured together, since the costs of several windows do not simply add up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from nbl_gguf.calibration.apply import ATTN_WINDOW
from nbl_gguf.errors import NblError

DEFAULT_SIZE = 512
DEFAULT_SINKS = 4  # the first tokens most heads of our models lean on (docs/results/window.md)
DEFAULT_CTX = 4096  # the context the choice is measured at (the model's training context if shorter)


@dataclass(frozen=True)
class Window:
    size: int
    sinks: int

    def __post_init__(self):
        if self.size < 1:
            raise NblError(f"a window of {self.size} tokens: give at least 1")
        if self.sinks < 0:
            raise NblError(f"{self.sinks} attention sinks: give 0 or more")


@dataclass
class WindowChoice:
    layers: tuple[int, ...]
    window: Window
    ctx: int  # tokens per measured window of text
    texts: int  # windows of text measured
    base_loss: float  # nats per scored token, without window layers (with the replaced layers)
    loss: float  # the chosen window layers together
    increases: dict[int, float] = field(default_factory=dict)  # each candidate alone: loss - base_loss

    def report(self) -> dict:
        return {"layers": list(self.layers), "size": self.window.size, "sinks": self.window.sinks, "ctx": self.ctx,
                "texts": self.texts, "base_loss": self.base_loss, "loss": self.loss,
                "increases": {str(k): v for k, v in sorted(self.increases.items())}}


def recall_window(ids: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A window [1, ctx] whose second half repeats its first: tokens drawn from those of ``ids`` (text
    windows [n, ctx]) in a random order. Its second half is predictable only by looking ``ctx / 2`` tokens
    back, which a window layer cannot; on text, the loss barely shows a layer that retrieval needs
    (measured: on SmolLM2 the 4 windows cheapest on text alone already lost a passkey at 4,096 tokens)."""
    ctx = ids.shape[1]
    vocabulary = torch.unique(ids)
    generator = torch.Generator().manual_seed(seed)
    first = vocabulary[torch.randint(len(vocabulary), (ctx - ctx // 2,), generator=generator)]
    return torch.cat([first, first[:ctx // 2]])[None]


def second_half_loss(stream, finals: Sequence[torch.Tensor], ids: torch.Tensor) -> list[float]:
    """Mean next-token NLL over positions ctx/2 .. ctx-2 of windows ``ids`` for each final hidden state."""
    first = ids.shape[1] // 2
    stream.load_head()
    try:
        out = []
        for final in finals:
            values = torch.cat([stream.token_nll(final[i:i + 1], ids[i:i + 1]) for i in range(ids.shape[0])])
            out.append(float(values[:, first:].mean()))
        return out
    finally:
        stream.release_head()


def choose_windows(stream, ids: torch.Tensor, count: int, window: Window, *, replaced: Mapping[int, int] | None = None,
                   maps: Callable | None = None, candidates: Sequence[int] | None = None) -> WindowChoice:
    """The ``count`` layers (of ``candidates``, by default every layer not in ``replaced``) whose window
    costs least on windows ``ids`` [texts, ctx], each measured alone on top of ``replaced`` ({layer:
    apply.py type}, their maps from ``maps(layer, type)``), then together."""
    from nbl_gguf.calibration.variants import run_variants

    replaced = dict(replaced or {})
    pool = sorted(candidates if candidates is not None else
                  (i for i in range(stream.num_layers) if i not in replaced))
    if any(i in replaced for i in pool):
        raise NblError(f"window candidates {sorted(set(pool) & set(replaced))} are replaced layers: a window "
                       f"keeps the attention")
    if not 0 < count <= len(pool):
        raise NblError(f"{count} window layers asked of {len(pool)} attention layers left")
    if ids.shape[1] <= 2 * window.size:
        raise NblError(f"window layers measured on {ids.shape[1]} tokens: a window of {window.size} only shows "
                       f"beyond {window.size} tokens, so measure at least {2 * window.size + 1} (a longer context)")

    def layer_map(layer: int, layer_type: int):
        return window if layer_type == ATTN_WINDOW else maps(layer, layer_type)

    variants = [replaced] + [{**replaced, i: ATTN_WINDOW} for i in pool]
    losses = second_half_loss(stream, run_variants(stream, ids, variants, layer_map), ids)
    base = losses[0]
    increases = dict(zip(pool, (loss - base for loss in losses[1:])))
    chosen = tuple(sorted(sorted(pool, key=lambda i: (increases[i], i))[:count]))
    together = {**replaced, **{i: ATTN_WINDOW for i in chosen}}
    loss = losses[1 + pool.index(chosen[0])] if count == 1 else \
        second_half_loss(stream, run_variants(stream, ids, [together], layer_map), ids)[0]
    return WindowChoice(chosen, window, int(ids.shape[1]), int(ids.shape[0]), base, loss, increases)
