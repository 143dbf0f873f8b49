"""Which attention layers become window layers, by measurement.

A window layer keeps its attention over the last ``size`` tokens and the first ``sinks``
(apply.WindowAttention). What it costs shows only past ``size`` tokens, so the loss is taken on the
second half of long windows of held-out text (as llama-perplexity scores a chunk), and measured
through the stream's variant evaluator: one decoder layer in memory at a time. The candidates are ranked
on top of the layers already replaced (NBL or taps maps) by one of two measurements (RANKINGS):

- ``loss`` (the default): each candidate's loss on text alone, end to end (every candidate runs from its
  layer to the last, about n_layer / 2 passes);
- ``local``: one pass, each layer's own output with its window against without, on the model's track
  (local_window_errors): the ranking several times faster (a Llama-3.2-1B shape: 54 s against 365 s, peak
  RSS 1.6 against 5.1 GB), but blind to a window that helps. On SmolLM2 the walk chose a set of the same
  loss on text by either; on Qwen2.5-Coder-0.5B, whose two layers that gain most from a window (-1.7% and
  -0.8% perplexity alone) change their own output most, the local set cost 1.8 points more (-0.3% against
  -2.1%; docs/results/window.md).

The cheapest are chosen, and the chosen set is then measured together, since the costs of several
windows do not simply add up.

The loss on text barely sees retrieval (a fact far back asked for at the end): on SmolLM2, 15 window
layers chosen by it cost +1.5% at 4,096 tokens and lost a passkey that the stock file finds. With
retrieval probes (retrieval_probes), the layers are taken in the order of their cost on text, each kept
only if the probes' answer loss of the set so far with it stays within a tolerance of the loss without
window layers: a set measured, since no one layer alone loses the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from nbl_gguf.calibration.apply import ATTN_WINDOW
from nbl_gguf.errors import NblError

DEFAULT_SIZE = 512
# the window sizes --kv-budget chooses among (those that show at its measuring context)
BUDGET_WINDOW_SIZES = (128, 512, 2048)
DEFAULT_SINKS = 4  # the first tokens most heads of our models lean on (docs/results/window.md)
DEFAULT_CTX = 4096  # the context the choice is measured at (the model's training context if shorter)
# nats per answer token over the loss without window layers (SmolLM2: 0.41 without; the 8 layers cheapest on text
# 0.70, which kept a passkey; 15 layers 0.86, which lost it: docs/results/window.md)
DEFAULT_RETRIEVAL_TOLERANCE = 0.15
RANKINGS = ("local", "loss")  # how the candidates are ordered (the module's docstring)
DEFAULT_RANKING = "loss"


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
    increases: dict[int, float] = field(default_factory=dict)  # ranking "loss": each candidate alone, loss - base_loss
    retrieval: RetrievalGuard | None = None  # the probes' walk, when the choice had probes
    global_recall: GlobalRecall | None = None  # what each of a set of them gives back made global, when asked
    local_errors: dict[int, float] = field(default_factory=dict)  # ranking "local": local_window_errors

    @property
    def ranking(self) -> str:
        return "local" if self.local_errors else "loss"

    @property
    def order(self) -> list[int]:
        """The candidates in the order they are best made window layers: with probes, those the walk kept,
        then those it refused, then those it did not reach (each group by the ranking's cost)."""
        costs = self.local_errors or self.increases
        by_text = sorted(costs, key=lambda i: (costs[i], i))
        if self.retrieval is None:
            return by_text
        kept, refused = self.retrieval.kept, list(self.retrieval.refused)
        return kept + refused + [i for i in by_text if i not in kept and i not in refused]

    def report(self) -> dict:
        return {"layers": list(self.layers), "size": self.window.size, "sinks": self.window.sinks, "ctx": self.ctx,
                "texts": self.texts, "base_loss": self.base_loss, "loss": self.loss, "ranking": self.ranking} | \
            ({"increases": {str(k): v for k, v in sorted(self.increases.items())}} if self.increases else {}) | \
            ({"local_errors": {str(k): v for k, v in sorted(self.local_errors.items())}} if self.local_errors else {}) | \
            ({"retrieval": self.retrieval.report()} if self.retrieval is not None else {}) | \
            ({"global_recall": self.global_recall.report()} if self.global_recall is not None else {})

    @classmethod
    def from_report(cls, report: dict) -> WindowChoice:
        """The WindowChoice that gave ``report`` (a choice kept on disk: measurement.memo)."""
        def by_layer(values: dict) -> dict[int, float]:
            return {int(k): v for k, v in values.items()}

        return cls(tuple(report["layers"]), Window(report["size"], report["sinks"]), report["ctx"], report["texts"],
                   report["base_loss"], report["loss"], by_layer(report.get("increases", {})),
                   RetrievalGuard.from_report(report["retrieval"]) if "retrieval" in report else None,
                   GlobalRecall.from_report(report.get("global_recall")),
                   by_layer(report.get("local_errors", {})))


@dataclass
class RetrievalGuard:
    probes: int
    distances: tuple[int, ...]
    tolerance: float
    base_loss: float  # nats per answer token with the walk's ``replaced`` layers alone (none of its own)
    kept: list[int] = field(default_factory=list)  # in the order the walk took them
    losses: list[float] = field(default_factory=list)  # the set's answer loss as each was kept
    refused: dict[int, float] = field(default_factory=dict)  # the set's answer loss with it

    @property
    def loss(self) -> float:
        return self.losses[-1] if self.losses else self.base_loss

    def chosen(self, count: int) -> tuple[int, ...]:
        """``count`` layers: those kept, then (if fewer passed) those refused, the least harmful first."""
        fill = sorted(self.refused, key=lambda i: (self.refused[i], i))[:count - len(self.kept)]
        return tuple(sorted(self.kept + fill))

    def report(self) -> dict:
        return {"probes": self.probes, "distances": list(self.distances), "tolerance": self.tolerance,
                "base_loss": self.base_loss, "loss": self.loss, "kept": self.kept, "losses": self.losses,
                "refused": {str(k): v for k, v in self.refused.items()}}

    @classmethod
    def from_report(cls, report: dict) -> RetrievalGuard:
        return cls(report["probes"], tuple(report["distances"]), report["tolerance"], report["base_loss"],
                   list(report["kept"]), list(report["losses"]), {int(k): v for k, v in report["refused"].items()})


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


# A fact stated once in ordinary text and asked for at the end: its answer is predictable only from far back,
# which a window layer cannot see. Not measurement.passkey's wording or filler (that is the evaluation).
PROBE_NEEDLE = "\nNote for later: the code word {name} stands for the number {key}.\n"
PROBE_QUESTION = "\nQuestion: which number does the code word {name} stand for? Answer: the number"
PROBE_NAMES = ("amber", "falcon", "juniper", "quartz", "harbor", "violet", "meadow", "cobalt", "orchid", "lantern",
               "saffron", "glacier")


@dataclass(frozen=True)
class RetrievalProbes:
    """Windows of text [n, ctx] each hiding a fact far back and asking for it at its end; ``scored`` [n,
    ctx - 1]: the positions of stream.token_nll's rows that predict the answer's tokens."""
    ids: torch.Tensor
    scored: torch.Tensor
    distances: tuple[int, ...]  # tokens from each fact to its question


def retrieval_probes(tokenizer, ids: torch.Tensor, window: Window, depths: Sequence[float] = (0.25, 0.75),
                     seed: int = 0) -> RetrievalProbes:
    """One probe per (text window of ``ids`` [n, ctx], depth): the window's own text with a fact (a code word
    and a five-digit number) inserted at ``depth`` of the span that lies beyond ``window`` from the question,
    and the question with its answer at the end (the text cut to keep ``ctx`` tokens)."""
    import random

    rng = random.Random(seed)
    ctx = ids.shape[1]

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    rows, masks, distances = [], [], []
    for text in ids:
        for depth in depths:
            name, key = rng.choice(PROBE_NAMES), rng.randrange(10000, 100000)
            needle = encode(PROBE_NEEDLE.format(name=name, key=key))
            question = encode(PROBE_QUESTION.format(name=name))
            tail = encode(PROBE_QUESTION.format(name=name) + f" {key}.")
            answer = len(tail) - len(question) - 1  # the key's tokens (the full stop not scored)
            first = window.sinks + 8  # past the sinks: a fact the sinks keep would not test the layer
            last = ctx - len(tail) - len(needle) - window.size - 8  # beyond the window from the question
            if answer < 1 or last <= first:
                raise NblError(f"a retrieval probe needs more than {ctx} tokens at a window of {window.size} (a longer "
                               f"--window-ctx, or --window-retrieval off)")
            at = first + int(round(depth * (last - first)))
            filler = text[1:ctx - len(tail) - len(needle)].tolist()  # text[0] stays first (a BOS, if any)
            row = [int(text[0])] + filler[:at - 1] + needle + filler[at - 1:] + tail
            mask = torch.zeros(ctx - 1, dtype=torch.bool)
            mask[ctx - 2 - answer:ctx - 2] = True  # rows predicting tokens ctx-1-answer .. ctx-2
            rows.append(torch.tensor(row[:ctx]))
            masks.append(mask)
            distances.append(ctx - len(tail) - at - len(needle))
    return RetrievalProbes(torch.stack(rows), torch.stack(masks), tuple(distances))


def repeated_filler(ids: torch.Tensor, piece: int = 24) -> torch.Tensor:
    """Windows ``ids`` [n, ctx] with each one's text after its first token replaced by a sentence-sized
    ``piece`` of it repeated. A fact hidden in such filler is what a passkey test asks for; in running text a
    fact stands out and is easy to find again, so probes there barely tell window sets apart (Qwen2.5-Coder-0.5B:
    three sets that find 5/5, 4/5 and 3/5 passkeys: answer loss 0.068, 0.086 and 0.099; docs/results/frontier.md)."""
    if ids.shape[1] <= piece + 1:
        raise NblError(f"repeated filler of {piece}-token pieces needs windows of more than {piece + 1} tokens")
    out = ids.clone()
    for row in range(ids.shape[0]):
        unit = ids[row, 1:1 + piece]
        out[row, 1:] = unit.repeat(ids.shape[1] // piece + 1)[:ids.shape[1] - 1]
    return out


@dataclass
class GlobalRecall:
    """What each window layer of a set gives back made global alone (a leave-one-out on retrieval probes):
    the probes' answer loss with the whole set, and with each of its layers global instead."""
    windows: tuple[int, ...]
    base_loss: float  # nats per answer token, the whole set windowed
    losses: dict[int, float]  # layer -> the answer loss with that layer global, the rest windowed

    @property
    def ranking(self) -> list[int]:
        """The set's layers, the one that gives back the most recall first."""
        return sorted(self.losses, key=lambda i: (self.losses[i], i))

    def report(self) -> dict:
        return {"windows": list(self.windows), "base_loss": self.base_loss,
                "losses": {str(k): v for k, v in sorted(self.losses.items())}, "ranking": self.ranking}

    @classmethod
    def from_report(cls, report: dict | None) -> GlobalRecall | None:
        """The GlobalRecall that gave ``report`` (None for None)."""
        if report is None:
            return None
        return cls(tuple(report["windows"]), report["base_loss"], {int(k): v for k, v in report["losses"].items()})


def window_layer_map(window: Window, maps: Callable | None) -> Callable:
    """The variant evaluator's ``linear(layer, type)``: ``window`` for a window layer, else ``maps(layer, type)``
    (the replaced layers' maps)."""
    return lambda layer, layer_type: window if layer_type == ATTN_WINDOW else maps(layer, layer_type)


def global_recall(stream, probes: RetrievalProbes, windows: Sequence[int], window: Window, *,
                  replaced: Mapping[int, int] | None = None, maps: Callable | None = None) -> GlobalRecall:
    """GlobalRecall of the window layers ``windows`` (of ``window``) on ``probes``, on top of ``replaced``
    (their maps from ``maps(layer, type)``, as choose_windows) (one pass of the stream: the variants share
    their track up to the first layer where they differ)."""
    from nbl_gguf.calibration.variants import run_variants

    replaced = dict(replaced or {})
    windows = tuple(windows)
    whole = {**replaced, **{i: ATTN_WINDOW for i in windows}}
    variants = [whole] + [{k: t for k, t in whole.items() if k != layer} for layer in windows]
    losses = answer_loss(stream, run_variants(stream, probes.ids, variants, window_layer_map(window, maps)), probes)
    return GlobalRecall(windows, losses[0], dict(zip(windows, losses[1:])))


def scored_loss(stream, finals: Sequence[torch.Tensor], ids: torch.Tensor, scored: torch.Tensor) -> list[float]:
    """Mean next-token NLL over the positions ``scored`` [n, ctx - 1] (bool: row t predicts token t + 1) of
    windows ``ids`` [n, ctx], for each final hidden state."""
    stream.load_head()
    try:
        out = []
        for final in finals:
            values = torch.cat([stream.scored_nll(final[i:i + 1], ids[i:i + 1], scored[i:i + 1])
                                for i in range(ids.shape[0])])
            out.append(float(values.mean()))
        return out
    finally:
        stream.release_head()


def answer_loss(stream, finals: Sequence[torch.Tensor], probes: RetrievalProbes) -> list[float]:
    """The probes' answer tokens' mean NLL for each final hidden state (nats per token)."""
    return scored_loss(stream, finals, probes.ids, probes.scored)


def second_half_loss(stream, finals: Sequence[torch.Tensor], ids: torch.Tensor) -> list[float]:
    """Mean next-token NLL over positions ctx/2 .. ctx-2 of windows ``ids`` for each final hidden state."""
    scored = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)
    scored[:, ids.shape[1] // 2:] = True
    return scored_loss(stream, finals, ids, scored)


def local_window_errors(stream, ids: torch.Tensor, pool: Sequence[int], replaced: Mapping[int, int],
                        layer_map: Callable) -> dict[int, float]:
    """Each layer of ``pool``: its output's error with a window (``layer_map(k, ATTN_WINDOW)``) against without,
    relative to what the layer adds, ||out_window - out||^2 / ||out - in||^2 over the second half of windows
    ``ids`` [n, ctx] (where a window shows), on the track of the model with ``replaced``: one pass of the
    stream. It does not see what the error does to the layers after, nor which way: a window that lowers
    the loss scores as a cost (the ``loss`` ranking sees both; the module's docstring)."""
    from nbl_gguf.calibration.variants import layer_output

    hidden = stream.embed_all(ids)
    half = ids.shape[1] // 2
    errors = {}
    for k in range(stream.num_layers):
        stream.load_layer(k)
        try:
            out = layer_output(stream, k, hidden, replaced.get(k), layer_map)
            if k in pool:
                windowed = layer_output(stream, k, hidden, ATTN_WINDOW, layer_map)
                error = (windowed[:, half:] - out[:, half:]).double().pow(2).sum()
                added = (out[:, half:] - hidden[:, half:]).double().pow(2).sum()
                errors[k] = float(error / added) if added > 0 else float("inf") if error > 0 else 0.0
        finally:
            stream.release_layer(k)
        hidden = out
    return errors


HOLD_BYTES = 2 << 30  # the walk's held hidden states, at most (an 8B model's 33 layer inputs would be 6.6 GB)


def guarded_walk(stream, probes: RetrievalProbes, order: Sequence[int], count: int, replaced: Mapping[int, int],
                 layer_map: Callable, tolerance: float,
                 hold_bytes: int = HOLD_BYTES, layer_type: int = ATTN_WINDOW) -> RetrievalGuard:
    """Take the layers of ``order`` one by one until ``count`` are kept, each kept if the probes' answer loss
    with it made ``layer_type`` (a window layer, or a replaced one: calibration.recall) and those kept before
    stays within ``tolerance`` of the loss of ``replaced`` alone.

    The kept set's hidden states are held at every ``stride``-th layer's input (as many as ``hold_bytes``
    allows), so a candidate runs from the held input at or before its own layer on: the layers before
    it see the set unchanged."""
    from nbl_gguf.calibration.variants import layer_output

    n_layer = stream.num_layers
    per_layer = probes.ids.numel() * stream.hidden_size * torch.finfo(stream.dtype).bits // 8
    stride = max(1, -(-per_layer * (n_layer + 1) // max(1, hold_bytes)))

    def run(track: dict[int, torch.Tensor], first: int, variant: Mapping[int, int]) -> dict[int, torch.Tensor]:
        start = max(k for k in track if k <= first)
        held = {k: v for k, v in track.items() if k <= start}
        hidden = track[start]
        for k in range(start, n_layer):
            stream.load_layer(k)
            try:
                hidden = layer_output(stream, k, hidden, variant.get(k), layer_map)
            finally:
                stream.release_layer(k)
            if (k + 1) % stride == 0 or k + 1 == n_layer:
                held[k + 1] = hidden
        return held

    start = {0: stream.embed_all(probes.ids)}
    variant = dict(replaced)
    track = run(start, 0, variant)
    guard = RetrievalGuard(int(probes.ids.shape[0]), probes.distances, tolerance,
                           answer_loss(stream, [track[n_layer]], probes)[0])
    for layer in order:
        if len(guard.kept) == count:
            break
        trial = run(track, layer, {**variant, layer: layer_type})
        loss = answer_loss(stream, [trial[n_layer]], probes)[0]
        if loss <= guard.base_loss + tolerance:
            variant[layer] = layer_type
            track = trial
            guard.kept.append(layer)
            guard.losses.append(loss)
        else:
            guard.refused[layer] = loss
    return guard


def choose_windows(stream, ids: torch.Tensor, count: int, window: Window, *, replaced: Mapping[int, int] | None = None,
                   maps: Callable | None = None, candidates: Sequence[int] | None = None,
                   probes: RetrievalProbes | None = None, tolerance: float = DEFAULT_RETRIEVAL_TOLERANCE,
                   ranking: str = DEFAULT_RANKING) -> WindowChoice:
    """The ``count`` layers (of ``candidates``, by default every layer not in ``replaced``) whose window
    costs least on windows ``ids`` [texts, ctx] by ``ranking`` (RANKINGS), each measured alone on top of
    ``replaced`` ({layer: apply.py type}, their maps from ``maps(layer, type)``), then together. With
    ``probes``, taken in that order only while the probes' answer loss stays within ``tolerance``
    (guarded_walk); if fewer than ``count`` pass, the rest are those it refused, the least harmful first."""
    from nbl_gguf.calibration.variants import run_variants

    replaced = dict(replaced or {})
    pool = sorted(candidates if candidates is not None else
                  (i for i in range(stream.num_layers) if i not in replaced))
    if any(i in replaced for i in pool):
        raise NblError(f"window candidates {sorted(set(pool) & set(replaced))} are replaced layers: a window "
                       f"keeps the attention")
    if not 0 < count <= len(pool):
        raise NblError(f"{count} window layers asked of {len(pool)} attention layers left")
    if ranking not in RANKINGS:
        raise NblError(f"window ranking {ranking!r}: one of {', '.join(RANKINGS)}")
    if ids.shape[1] <= 2 * window.size:
        raise NblError(f"window layers measured on {ids.shape[1]} tokens: a window of {window.size} only shows "
                       f"beyond {window.size} tokens, so measure at least {2 * window.size + 1} (a longer context)")

    layer_map = window_layer_map(window, maps)
    increases, errors, base = {}, {}, None
    if ranking == "loss":
        variants = [replaced] + [{**replaced, i: ATTN_WINDOW} for i in pool]
        losses = second_half_loss(stream, run_variants(stream, ids, variants, layer_map), ids)
        base = losses[0]
        increases = dict(zip(pool, (loss - base for loss in losses[1:])))
    else:
        errors = local_window_errors(stream, ids, pool, replaced, layer_map)
    costs = increases or errors
    by_text = sorted(pool, key=lambda i: (costs[i], i))
    guard = None
    if probes is not None:
        guard = guarded_walk(stream, probes, by_text, count, replaced, layer_map, tolerance)
        chosen = guard.chosen(count)
    else:
        chosen = tuple(sorted(by_text[:count]))
    together = {**replaced, **{i: ATTN_WINDOW for i in chosen}}
    if base is None:
        base, loss = second_half_loss(stream, run_variants(stream, ids, [replaced, together], layer_map), ids)
    else:
        loss = base + increases[chosen[0]] if count == 1 else \
            second_half_loss(stream, run_variants(stream, ids, [together], layer_map), ids)[0]
    return WindowChoice(chosen, window, int(ids.shape[1]), int(ids.shape[0]), base, loss, increases, guard,
                        local_errors=errors)
