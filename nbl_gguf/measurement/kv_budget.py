"""`convert --kv-budget SIZE`: the KV cache type and the number of replaced layers that fit a KV budget at
a context (``--ctx-size``) with the least measured loss.

For each KV cache type llama.cpp runs (f16, q8_0, q8_0 K with q4_0 V, q4_0) the fewest layers of the calibration's own order
that bring the cache, as llama.cpp allocates it, within the budget make one candidate; m = 0 is the stock
file with that cache type, llama.cpp's own answer to the same budget. Each candidate file is measured by
llama-perplexity with its cache type at a long context on held-out text of the three kinds that the
summary's evaluation never sees (the selection parts), and the lowest mean change against the stock
file with an F16 cache wins: a quantized cache and replaced layers are traded by what they cost, not by
a rule.

Where the file can carry window layers (llama, qwen2, qwen3, phi3, smollm3), each cache type also gets,
for each window size W of a small set, the fewest window layers of their measured order
(calibration.windows) that fit: a window layer keeps its attention over the last W tokens and the first
few, and its cache stops at the window (so it saves less than a replaced layer at short contexts, nearly
as much at long ones). A smaller W frees room for more global layers (those that retrieve from far back)
at the same budget, and costs the window layers their mixing beyond W: measured, not ruled. Where the window order came from the retrieval walk
(``--window-retrieval``), a candidate that needs more window layers than the walk kept holds layers it
refused: perplexity cannot see what they cost (recall of a fact beyond the window), so such a candidate
ranks after every one that holds none, whatever its perplexity (so, where one holds none, it is not measured:
without_outranked). With ``recall_depths``, each candidate
and the stock file also take the passkey test (measurement.passkey) at the measurement's context through
llama.cpp with the candidate's own cache type, which the walk (PyTorch, no quantized cache) cannot see; a
candidate that finds fewer keys than stock ranks after those that find as many, and among those that find
fewer, one that finds more ranks first.

Which layers a window candidate keeps global is a trade the window order alone gets wrong: its probes are
facts in running text, which barely tell window sets apart, while a passkey is a number in filler. So each
window candidate also comes with layers kept global by the recall they give back (swap_globals: a
leave-one-out on probes in repeated filler), measured like the others.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, replace
from typing import Sequence

from nbl_gguf.errors import NblError
from nbl_gguf.kv_cache import DEFAULT_UBATCH, KvModel, cache_context, kv_size

# largest first; K in q8_0 with V in q4_0 holds where a q4_0 K breaks a model (Qwen2.5: +515% perplexity)
KV_TYPES = ("f16", "q8_0", "q8_0/q4_0", "q4_0")
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b?)\s*$", re.I)


def parse_size(text: str, flag: str = "--kv-budget") -> int:
    """'640MiB', '0.5G', '2 GB', '1048576' -> bytes (K, M, G, T are powers of 1024, as llama.cpp prints them)."""
    match = _SIZE.match(str(text))
    if not match or float(match.group(1)) <= 0:
        raise NblError(f"{flag} {text!r}: expected a size such as 640MiB, 0.5GiB or 600000000 (bytes)")
    power = " kmgt".index(match.group(2).lower() or " ")
    return int(float(match.group(1)) * 1024 ** power)


@dataclass(frozen=True)
class Candidate:
    kv_type: str
    layers: tuple[int, ...]  # the replaced layers, a prefix of the calibration's order
    kv_bytes: int
    windows: tuple[int, ...] = ()  # window layers, a prefix of their measured order
    window: tuple[int, int] | None = None  # (W, sinks) of the window layers
    refused: tuple[int, ...] = ()  # window layers the retrieval walk refused (they lose recall beyond W)
    recall_globals: tuple[int, ...] = ()  # layers kept global for recall in place of the window order's (swap_globals)
    recall_windowed: tuple[int, ...] = ()  # the layers the window order kept global, windowed for them
    weight_type: str | None = None  # the stock file requantized to this type (--total-budget); None: its own type

    @property
    def m(self) -> int:
        return len(self.layers)

    @property
    def is_stock(self) -> bool:
        """No layer replaced nor windowed: the stock file itself, with this cache type."""
        return not self.layers and not self.windows

    @property
    def label(self) -> str:
        if self.windows:
            what = f"{len(self.windows)} window layers (W = {self.window[0]})"
        else:
            what = ("stock" + (f" {self.weight_type}" if self.weight_type else "")) if self.is_stock \
                else f"NBL m = {self.m}"
        refused = f" (refused by the retrieval walk: {', '.join(map(str, self.refused))})" if self.refused else ""
        swapped = (f", {', '.join(map(str, self.recall_globals))} global for recall (windowed: "
                   f"{', '.join(map(str, self.recall_windowed))})") if self.recall_globals else ""
        return f"{what}, KV {self.kv_type}{swapped}{refused}"


def kv_bytes(model: KvModel, n_ctx: int, kv_type: str, replaced=(), windows=(), window=None,
             n_ubatch: int = DEFAULT_UBATCH) -> int:
    """The cache at ``n_ctx`` with the ``replaced`` layers gone and the ``windows`` layers kept over a
    window of ``window`` = (W, sinks) tokens, run in micro-batches of ``n_ubatch`` (what a window layer's cache
    holds beside its window)."""
    return kv_size(windowed(model.without(replaced), windows, window),
                   cache_context(n_ctx, kv_type, n_ubatch=n_ubatch)).bytes


def windowed(model: KvModel, windows, window) -> KvModel:
    """``model`` with the ``windows`` layers made window layers of ``window`` = (W, sinks) (a model that
    has sliding layers of its own keeps its window: the file's keys hold one)."""
    windows = set(windows)
    if not windows:
        return model
    if model.has_sliding:
        raise NblError("window layers in a model with sliding-window layers of its own")
    size, sinks = window
    return KvModel(layers=tuple(replace(layer, sliding=True) if i in windows else layer
                                for i, layer in enumerate(model.layers)), window=size, sinks=sinks)


def most_layers_needed(model: KvModel, n_ctx: int, budget: int, max_m: int, n_ubatch: int = DEFAULT_UBATCH) -> int | None:
    """The most layers any order could need to meet ``budget`` with the largest cache type that can meet it
    at all (the layers with the smallest caches replaced first: no order needs more), or None when
    even the smallest cache type with ``max_m`` layers replaced misses it. Sizes the calibration before
    its order is known."""
    for kv_type in KV_TYPES:
        per_layer = kv_size(model, cache_context(n_ctx, kv_type, n_ubatch=n_ubatch)).per_layer
        smallest_first = sorted(range(len(per_layer)), key=lambda i: per_layer[i])
        for m in range(max_m + 1):
            if kv_bytes(model, n_ctx, kv_type, smallest_first[:m], n_ubatch=n_ubatch) <= budget:
                return m
    return None


def smallest_reachable(model: KvModel, n_ctx: int, max_m: int, n_ubatch: int = DEFAULT_UBATCH) -> int:
    """The smallest cache any choice can reach: the smallest type with the ``max_m`` largest caches gone."""
    kv_type = KV_TYPES[-1]
    per_layer = kv_size(model, cache_context(n_ctx, kv_type, n_ubatch=n_ubatch)).per_layer
    largest_first = sorted(range(len(per_layer)), key=lambda i: -per_layer[i])
    return kv_bytes(model, n_ctx, kv_type, largest_first[:max_m], n_ubatch=n_ubatch)


@dataclass(frozen=True)
class Held:
    """What a total budget (--total-budget) holds beside the KV cache: the weights as llama.cpp loads them and
    the context's compute and output buffers as llama.cpp reserves them (library.context_buffers), which grow
    with the micro-batch: at -ub 512 mostly the logits, n_vocab x 512 floats (98 MiB for SmolLM2, more than its
    weights)."""
    weights: int
    buffers: int
    n_ubatch: int = DEFAULT_UBATCH

    @property
    def bytes(self) -> int:
        return self.weights + self.buffers

    def describe(self) -> str:
        return (f"the weights take {format_mib(self.weights)}, llama.cpp's compute and output buffers "
                f"{format_mib(self.buffers)} at -ub {self.n_ubatch},")


def check_reachable(model: KvModel, n_ctx: int, budget: int, max_m: int, n_ubatch: int = DEFAULT_UBATCH,
                    given: str | None = None, held: Held | None = None) -> int:
    """The layers the calibration must go to: most_layers_needed, or ``max_m`` where only some orders fit
    (which ones the calibration decides); an NblError naming the smallest cache that can be reached when
    no order does. ``given``: the option as the user gave it, when ``budget`` is what is left of it after
    ``held`` (--total-budget)."""
    smallest = smallest_reachable(model, n_ctx, max_m, n_ubatch)
    if budget < smallest:
        remedy = "raise the budget, lower --ctx-size or --ubatch-size" if held else "raise the budget or lower --ctx-size"
        raise NblError(f"{given or '--kv-budget ' + format_mib(budget)} at {n_ctx:,} tokens cannot be met: "
                       f"{held.describe() + ' and ' if held else ''}the "
                       f"smallest KV cache reachable is {format_mib(smallest)} (a {KV_TYPES[-1]} cache with {max_m} of {len(model.layers)} layers "
                       f"replaced); {remedy}")
    needed = most_layers_needed(model, n_ctx, budget, max_m, n_ubatch)
    return max_m if needed is None else needed


def candidates(model: KvModel, n_ctx: int, budget: int, order: list[int], window_order: list[int] | None = None,
               windows_at: Sequence[tuple[int, int]] = (), window_kept: int | None = None,
               recall_ranking: Sequence[int] = (), n_ubatch: int = DEFAULT_UBATCH) -> list[Candidate]:
    """Per cache type, the shortest prefix of ``order`` whose cache fits the budget (none where no prefix does);
    with ``window_order``, also, for each window ``windows_at`` = [(W, sinks), ...], the shortest prefix of it
    made window layers of that window that fits (from one window layer: no window layer is the stock
    candidate already), and its swap_globals with ``recall_ranking``. A smaller window is a candidate only
    where it needs fewer window layers than every larger one of that cache type: with as many, the larger
    window attends to more at the same count. ``window_kept``: how many of ``window_order`` the retrieval walk
    kept (the rest it refused), None where there was no walk. ``n_ubatch``: the micro-batch the file will run with
    (a window layer's cache holds one beside its window)."""
    out = []
    for kv_type in KV_TYPES:
        for m in range(len(order) + 1):
            size = kv_bytes(model, n_ctx, kv_type, order[:m], n_ubatch=n_ubatch)
            if size <= budget:
                out.append(Candidate(kv_type, tuple(sorted(order[:m])), size))
                break
        if not window_order or kv_bytes(model, n_ctx, kv_type, n_ubatch=n_ubatch) <= budget:
            continue
        fewest = len(window_order) + 1  # window layers the larger windows of this type needed
        for window in sorted(windows_at, reverse=True):
            for k in range(1, fewest):
                size = kv_bytes(model, n_ctx, kv_type, windows=window_order[:k], window=window, n_ubatch=n_ubatch)
                if size <= budget:
                    refused = () if window_kept is None else tuple(sorted(window_order[window_kept:k]))
                    found = Candidate(kv_type, (), size, tuple(sorted(window_order[:k])), window, refused)
                    out.append(found)
                    out += [swap for swap in swap_globals(found, recall_ranking)
                            if kv_bytes(model, n_ctx, kv_type, windows=swap.windows, window=window,
                                        n_ubatch=n_ubatch) <= budget]
                    fewest = k
                    break
    return out


# how many of the layers that give back the most recall each get a candidate of their own (swap_globals); the one
# that met Qwen2.5-Coder-0.5B's 10% target kept the second (docs/results/frontier.md)
RECALL_SWAPS = 2


def swap_globals(candidate: Candidate, recall_ranking: Sequence[int]) -> list[Candidate]:
    """The candidate's window layers with other layers kept global for recall: ``recall_ranking`` orders a set
    of the window order's first layers by the recall (answer loss on probes in repeated filler) each gives back
    made global alone (calibration.windows.global_recall), the most first. The window order keeps global the
    set's last layers; the walk's probes (facts in running text) barely see what a layer does for a number in
    filler, so where the ranking disagrees, candidates that follow it: the ranking's first layers global
    instead of the window order's (as many as it keeps global), and, for each of the ranking's first
    RECALL_SWAPS that the order windows, that layer global for the one of the order's globals that gives back
    the least (one swap: a layer that windowing helps on text can be the one recall needs most, and which is
    worth more is measured). None where the candidate windows every layer of the set or holds a refused one."""
    ranked = list(recall_ranking)
    windows = set(candidate.windows)
    kept_global = [i for i in ranked if i not in windows]
    if not kept_global or candidate.refused:
        return []
    # (made global, windowed for them): the ranking's globals for the order's, then the single swaps
    first = set(ranked[:len(kept_global)])
    least = kept_global[-1]  # of the order's globals in the set, the one that gives back the least
    swaps = [(first - set(kept_global), set(kept_global) - first)]
    swaps += [({layer}, {least}) for layer in ranked[:RECALL_SWAPS] if layer in windows]
    out = []
    for made_global, windowed in swaps:
        layers = tuple(sorted(windows - made_global | windowed))
        if not made_global or any(c.windows == layers for c in out):
            continue  # the order keeps them global already, or a swap already made
        out.append(replace(candidate, windows=layers, recall_globals=tuple(sorted(made_global)),
                           recall_windowed=tuple(sorted(windowed))))
    return out


def windows_needed(model: KvModel, n_ctx: int, budget: int, window: tuple[int, int],
                   n_ubatch: int = DEFAULT_UBATCH) -> int:
    """How many window layers the cache types that need them take to fit, at most (layers in file order:
    the count, not which, is what the budget asks where the layers' caches are alike); every layer where
    none fits."""
    n_layer = len(model.layers)
    needed = 1
    for kv_type in KV_TYPES:
        if kv_bytes(model, n_ctx, kv_type, n_ubatch=n_ubatch) <= budget:
            continue
        fits = next((k for k in range(1, n_layer + 1)
                     if kv_bytes(model, n_ctx, kv_type, windows=list(range(k)), window=window,
                                 n_ubatch=n_ubatch) <= budget), n_layer)
        needed = max(needed, fits)
    return needed


def format_mib(n: int) -> str:
    return f"{n / 2 ** 20:,.2f} MiB"


def within_total(files: dict[Candidate, object], weights: dict[Candidate, int], total: int, log=print,
                 buffers: dict[Candidate, int] | None = None) -> dict:
    """The ``files`` whose own weights (``weights``: bytes), KV cache and context buffers (``buffers``: llama.cpp's
    compute and output buffers with the candidate's cache type, library.context_buffers) fit ``total`` bytes
    (--total-budget): each candidate was chosen for the KV cache that the stock file's weights and buffers leave,
    and a file of replaced layers carries maps instead of their attention, which can weigh more (past-token maps
    at a low rank, or a wide model with few KV heads). The rest are logged and left out."""
    buffers = buffers or {}
    kept = {}
    for candidate, path in files.items():
        held = buffers.get(candidate, 0)
        if weights[candidate] + candidate.kv_bytes + held > total:
            extra = f", compute and output buffers {format_mib(held)}" if held else ""
            log(f"kv budget: {candidate.label}: left out, its weights {format_mib(weights[candidate])}{extra} and KV "
                f"cache {format_mib(candidate.kv_bytes)} exceed the total budget of {format_mib(total)}")
        else:
            kept[candidate] = path
    return kept


def without_outranked(files: dict[Candidate, object], log=print) -> tuple[dict, list[Candidate]]:
    """(the ``files`` worth measuring, those left unmeasured). A candidate holding window layers the retrieval walk
    refused ranks after every candidate that holds none, whatever either measures (measure's order), so where any
    holds none those that do cannot be chosen: measuring them (a few minutes each at 0.5B on 2 cores) would change
    nothing but the summary's table. They are logged and left out; where every candidate holds some, all stay."""
    if all(candidate.refused for candidate in files):
        return files, []
    outranked = [candidate for candidate in files if candidate.refused]
    for candidate in outranked:
        log(f"kv budget: {candidate.label}: not measured: it ranks after every candidate without refused window "
            f"layers")
    return {c: path for c, path in files.items() if not c.refused}, outranked


def weight_down(model: KvModel, n_ctx: int, total: int, weight_type: str, weights: int, buffers: dict[str, int],
                stock_types: Sequence[str] = (), n_ubatch: int = DEFAULT_UBATCH) -> Candidate | None:
    """llama.cpp's other knob within a total budget: the stock model at a lighter ``weight_type`` (``weights``: its
    tensors' bytes; ``buffers``: its context's buffers per cache type), with the largest cache type whose whole
    cache fits what they leave. None where none fits, or where the stock file at its own weight type fits with
    that cache type already (``stock_types``: the cache types it has candidates with), which the lighter
    weights can only lose to."""
    for kv_type in KV_TYPES:
        size = kv_bytes(model, n_ctx, kv_type, n_ubatch=n_ubatch)
        if weights + buffers[kv_type] + size <= total:
            return None if kv_type in stock_types else Candidate(kv_type, (), size, weight_type=weight_type)
    return None


def estimate_line(candidates: int, perplexity_s: float, passkey_s: float | None, kept: int = 0) -> str:
    """What the rest of the measuring will take, from the stock file's own times: each candidate's perplexity
    about as long as stock's (a quantized cache or window layers run about as fast, or faster, at these
    contexts: docs/results/frontier.md), and each passkey test as long as stock's (at least one is taken).
    ``kept``: the candidates whose perplexities an earlier run measured (measurement.memo), not counted."""
    line = (f"kv budget: stock measured in {perplexity_s:,.0f} s (perplexity)"
            + (f" and {passkey_s:,.0f} s (passkey)" if passkey_s is not None else "")
            + (f"; {kept} candidates measured by an earlier run" if kept else ""))
    if candidates:
        line += f"; the {candidates} candidates' perplexities will take about {_duration(candidates * perplexity_s)}"
    if passkey_s is not None:
        line += f"{', and' if candidates else ';'} each passkey test about {_duration(passkey_s)} (at least one)"
    return line


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.0f} min" if seconds >= 90 \
        else f"{seconds:.0f} s"


@dataclass
class Measured:
    candidate: Candidate
    perplexity: dict[str, float]  # kind -> llama-perplexity at the long context
    change_pct: float  # mean over the kinds, against the stock file with an F16 cache
    found: int | None = None  # passkeys found at the context (None: not tested)

    def loses_recall(self, stock_found: int | None) -> bool:
        return self.found is not None and stock_found is not None and self.found < stock_found


def measure(stock_path, files: dict[Candidate, object], texts: dict, n_ctx: int, chunks: int, threads, log=print,
            recall_depths: tuple[float, ...] = (), clock=time.monotonic, memo=None):
    """(the stock F16 perplexities, a Measured per candidate best first, the passkeys stock found (None without
    ``recall_depths``)). Best first: those that hold no window layer the retrieval walk refused, then those that
    find as many passkeys as stock, each group by perplexity (those that find fewer: by the keys they find
    first). The passkey test (a few minutes a file at long
    contexts) is taken in that order until a candidate finds as many keys as stock; the rest keep found None.
    The stock file's own times (``clock``: seconds) give the log an estimate of the
    rest: at 8B on a 2-core CPU the candidates take hours (docs/scale.md), which a user should know early.
    ``memo`` (measurement.memo.Memo): each file's perplexities and passkeys kept under the file's and texts'
    content, so that a run again after an interruption measures only what it had not."""
    from nbl_gguf.measurement.kept_runs import KeptRuns
    from nbl_gguf.measurement.passkey import longest_prompt

    runs = KeptRuns(memo, threads, clock)

    def run(path, kv_type) -> tuple[dict[str, float], float, bool]:
        """(perplexity per kind, the seconds they took when measured, whether all were kept from before)"""
        done = {kind: runs.perplexity(path, text, n_ctx, chunks, kv_type) for kind, text in texts.items()}
        return ({kind: r.value.ppl for kind, r in done.items()}, sum(r.seconds for r in done.values()),
                all(r.kept for r in done.values()))

    def recall(path, kv_type) -> tuple[int | None, float, bool]:
        if not recall_depths:
            return None, 0.0, False
        # the prompt and its answer within the context (the training context where that is the measurement's)
        r = runs.passkey(path, (longest_prompt(n_ctx),), recall_depths, kv_type)
        return sum(trial.found for trial in r.value.trials), r.seconds, r.kept

    def kept_all(path, kv_type) -> bool:
        return all(runs.has_perplexity(path, text, n_ctx, chunks, kv_type) for text in texts.values())

    def before(was: bool) -> str:
        return " (kept from an earlier run)" if was else ""

    base, perplexity_s, _ = run(stock_path, "f16")
    stock_found, passkey_s, was = recall(stock_path, "f16")
    if stock_found is not None:
        log(f"kv budget: stock, KV f16: passkey at {n_ctx} found {stock_found}/{len(recall_depths)}{before(was)}")
    left = [c for c, path in files.items() if not kept_all(path, c.kv_type)]
    log(estimate_line(len(left), perplexity_s, passkey_s if stock_found is not None else None,
                      kept=len(files) - len(left)))
    measured = []
    for candidate, path in files.items():
        ppl, _, was = run(path, candidate.kv_type)
        change = sum(100 * (ppl[k] / base[k] - 1) for k in base) / len(base)
        log(f"kv budget: {candidate.label}: {format_mib(candidate.kv_bytes)}, held-out perplexity at {n_ctx} "
            f"{change:+.2f}%{before(was)}")
        measured.append(Measured(candidate, ppl, change))
    measured.sort(key=lambda r: (bool(r.candidate.refused), r.change_pct, r.candidate.kv_bytes))
    if stock_found is not None:
        # in that order until one finds as many keys as stock: it wins, so those after it need no test
        for r in measured:
            r.found, _, was = recall(files[r.candidate], r.candidate.kv_type)
            log(f"kv budget: {r.candidate.label}: passkey at {n_ctx} found {r.found}/{len(recall_depths)}{before(was)}")
            if not r.loses_recall(stock_found):
                break
    # those that lose recall by the keys they still find (when none keeps them all, the file that nearly
    # does beats a lower perplexity that misses most), then by perplexity
    measured.sort(key=lambda r: (bool(r.candidate.refused), r.loses_recall(stock_found),
                                 -r.found if r.loses_recall(stock_found) else 0, r.change_pct, r.candidate.kv_bytes))
    return base, measured, stock_found
