"""Which layers to replace: local criteria, greedy joint selection, and `--m auto`.

Local criteria rank the layers by a score of each one alone, from the one pass over the original
model that also fits the maps: ``cosine`` (1 - cos between the residual stream before and after the
attention: the attention-drop criterion), ``nmse`` (the fit's normalized error) and ``cca`` (the
NBL paper's CCA bound). Measured on held-out text, cosine chooses best (docs/results/quality.md), so
it is the default; cca stays selectable as the paper's.

``greedy`` chooses by what the layers do together: it adds one layer at a time, the one whose
replacement by its map gives the whole model the lowest loss on held-out calibration windows. The
candidates of a step are the first layers not yet chosen of the cosine and the nmse rankings taken in
turn: cosine finds layers whose attention does little, nmse those whose attention is close to linear
however much it does. An evaluator answers ``losses(sets)`` (variants.StreamedEvaluator: each trial
runs only the layers from its first replaced one on, over the kept inputs of that layer); the
selections ask for every set they need at once, so that it reads each layer once per call.

``--m auto`` walks a nested order (a local ranking, or greedy's picks) and keeps the longest prefix
whose held-out perplexity increase over the unmodified model stays within the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nbl_gguf.errors import NblError

DEFAULT_CANDIDATES = 5
MIN_HELDOUT_TOKENS = 1024  # below this, differences between candidates are mostly noise


def ppl_increase(loss: float, base_loss: float) -> float:
    """Perplexity increase in percent of a mean NLL over the base model's."""
    return 100.0 * (math.exp(loss - base_loss) - 1.0)


@dataclass
class SelectionTrace:
    """Layers in the order they were added, with the held-out loss after each addition."""

    criterion: str
    base_loss: float
    tokens: int
    order: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    stopped: str = ""

    @property
    def increases(self) -> list[float]:
        return [ppl_increase(loss, self.base_loss) for loss in self.losses]

    def as_report(self) -> dict:
        return {"criterion": self.criterion, "heldout_tokens": self.tokens, "base_ppl": math.exp(self.base_loss),
                "order": list(self.order), "ppl": [math.exp(x) for x in self.losses],
                "ppl_increase_pct": self.increases, "stopped": self.stopped}


def _check_budget(m: int | None, budget: float | None, num_layers: int) -> int:
    """The most layers to add: m, or (auto) all but one."""
    if budget is not None and budget < 0:
        raise NblError(f"--max-ppl-increase must be zero or positive, got {budget}")
    if m is None:
        if budget is None:
            raise NblError("give --m, or --m auto with --max-ppl-increase")
        return num_layers - 1
    if not 0 <= m <= num_layers:
        raise NblError(f"--m {m} is out of range: the model has {num_layers} layers")
    return m


WALK_CHUNK = 4  # prefixes measured per call while walking with a budget (at most this many past the stop)


def walk(evaluator, ranking: list[int], criterion: str, m: int | None = None,
         budget: float | None = None, chunk: int = WALK_CHUNK) -> SelectionTrace:
    """Add layers in ``ranking`` order: m of them, or (m None) while the increase stays within ``budget``.
    The prefixes are measured ``chunk`` at a time (all m at once for a fixed m)."""
    limit = _check_budget(m, budget, len(ranking))
    order = list(ranking[:limit])
    trace = SelectionTrace(criterion, evaluator.base_loss, evaluator.tokens)
    step = max(1, len(order) if m is not None else chunk)
    for start in range(0, len(order), step):
        prefixes = [order[:stop] for stop in range(start + 1, min(len(order), start + step) + 1)]
        for prefix, loss in zip(prefixes, evaluator.losses(prefixes)):
            increase = ppl_increase(loss, evaluator.base_loss)
            if m is None and increase > budget:
                trace.stopped = (f"adding layer {prefix[-1]} would raise the held-out perplexity by "
                                 f"{increase:+.1f}%, over the budget of {budget:g}%")
                return trace
            trace.losses.append(loss)
            trace.order.append(prefix[-1])
    return trace


def best_of(evaluator, rankings: dict[str, list[int]], m: int | None = None,
            budget: float | None = None, walk_first: str | None = None) -> tuple[str, SelectionTrace, dict]:
    """The local criterion whose choice is best on the held-out windows: at a fixed m the one whose m
    layers cost least, with --m auto the one that fits the most layers in the budget (then the least
    loss; ties go to the earlier criterion in ``rankings``). Returns (criterion, its trace,
    {criterion: (layers, ppl increase %)} for every one).

    With --m auto, ``walk_first`` is walked first; a later criterion whose first k layers (k: the
    number the first one fitted) already exceed the budget cannot fit k, so one trial settles it
    instead of a walk (its entry then holds those k layers and their increase). This keeps auto with
    best near the cost of one walk when the first criterion wins, and gives the same choice as walking
    them all."""
    compared, traces = {}, {}
    names = sorted(rankings, key=lambda c: c != walk_first)
    if m is not None:
        for criterion in names:
            _check_budget(m, None, len(rankings[criterion]))
        losses = evaluator.losses([rankings[c][:m] for c in names]) if m else [evaluator.base_loss] * len(names)
        for criterion, loss in zip(names, losses):
            trace = SelectionTrace(criterion, evaluator.base_loss, evaluator.tokens, order=list(rankings[criterion][:m]))
            trace.losses = [loss] if m else []
            traces[criterion] = trace
    else:
        traces[names[0]] = walk(evaluator, rankings[names[0]], names[0], None, budget)
        fitted = len(traces[names[0]].order)
        rest = names[1:]
        trials = evaluator.losses([rankings[c][:fitted] for c in rest]) if fitted else [None] * len(rest)
        for criterion, loss in zip(rest, trials):
            increase = None if loss is None else ppl_increase(loss, evaluator.base_loss)
            if increase is not None and increase > budget:
                trace = SelectionTrace(criterion, evaluator.base_loss, evaluator.tokens)
                trace.stopped = (f"its first {fitted} layers raise the held-out perplexity by {increase:+.1f}%, "
                                 f"over the budget of {budget:g}%: not walked")
                traces[criterion] = trace
                compared[criterion] = (sorted(rankings[criterion][:fitted]), increase)
            else:
                traces[criterion] = walk(evaluator, rankings[criterion], criterion, None, budget)
    for criterion, trace in traces.items():
        if criterion not in compared:
            loss = trace.losses[-1] if trace.losses else evaluator.base_loss
            compared[criterion] = (sorted(trace.order), ppl_increase(loss, evaluator.base_loss))
    compared = {c: compared[c] for c in rankings}
    # a criterion settled by one trial has no layers and some other has more: it cannot be chosen
    chosen = min(traces, key=lambda c: (-len(traces[c].order), compared[c][1], list(rankings).index(c)))
    return chosen, traces[chosen], compared


def interleave(rankings: list[list[int]]) -> list[int]:
    """The rankings' layers taken in turn (first of each, then second of each, ...), each layer once."""
    merged: list[int] = []
    for tier in zip(*rankings):
        merged.extend(layer for layer in tier if layer not in merged)
    return merged


def greedy(evaluator, rankings: list[list[int]], m: int | None = None, budget: float | None = None,
           candidates: int = DEFAULT_CANDIDATES) -> SelectionTrace:
    """Greedy joint selection: each step adds the candidate (the first ``candidates`` layers not yet
    chosen of the ``rankings`` taken in turn) whose replacement gives the lowest held-out loss."""
    if candidates < 1:
        raise NblError(f"--candidates must be at least 1, got {candidates}")
    order = interleave(rankings)
    limit = _check_budget(m, budget, len(order))
    trace = SelectionTrace("greedy", evaluator.base_loss, evaluator.tokens)
    while len(trace.order) < limit:
        pool = [layer for layer in order if layer not in trace.order][:candidates]
        losses = dict(zip(pool, evaluator.losses([trace.order + [layer] for layer in pool])))
        best = min(pool, key=lambda layer: (losses[layer], layer))
        if m is None and ppl_increase(losses[best], evaluator.base_loss) > budget:
            trace.stopped = (f"the best next layer, {best}, would raise the held-out perplexity by "
                             f"{ppl_increase(losses[best], evaluator.base_loss):+.1f}%, over the budget of {budget:g}%")
            break
        trace.order.append(best)
        trace.losses.append(losses[best])
    return trace
