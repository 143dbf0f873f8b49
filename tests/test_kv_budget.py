"""`convert --kv-budget`: sizes parsed, each cache type's fewest layers against a brute-force search, a
budget nothing meets refused by name before any work, and a real conversion of a tiny GGUF whose chosen
file and cache type fit the budget as llama.cpp allocates it."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from nbl_gguf.cli import main
from nbl_gguf.errors import NblError
from nbl_gguf.kv_cache import KvLayer, KvModel
from nbl_gguf.llamacpp.cache_types import cache_type_flags
from nbl_gguf.llamacpp.tools import source_dir
from nbl_gguf.measurement import kv_budget


@pytest.mark.parametrize("text, expected", [("640MiB", 640 << 20), ("0.5G", 512 << 20), ("2 GB", 2 << 30),
                                            ("1048576", 1 << 20), ("12k", 12 << 10), ("1.5 gib", 3 << 29)])
def test_sizes(text, expected):
    assert kv_budget.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "-1M", "0", "12 apples", "1.5 PB"])
def test_bad_sizes_are_named(text):
    with pytest.raises(NblError, match="--kv-budget .*expected a size"):
        kv_budget.parse_size(text)


def _model():
    # uneven layers: two wide, two narrow, one sliding (its cache is the window's, not the context's)
    layers = (KvLayer(256, 256), KvLayer(64, 64), KvLayer(256, 256, sliding=True), KvLayer(64, 64), KvLayer(128, 128))
    return KvModel(layers=layers, window=256)


def test_most_layers_needed_is_what_any_order_needs_at_most():
    """Brute force over every order of the layers: per cache type, the most layers an order needs before
    its prefix fits (an order that never fits within 4 layers: none); the calibration must go as far as
    the largest of those that are finite, so that every type that surely fits has its candidate."""
    model, n_ctx = _model(), 8192
    for budget in (10 ** 5, 10 ** 6, 3 * 10 ** 6, 10 ** 7, 10 ** 8):
        worst = {}
        for kv_type in kv_budget.KV_TYPES:
            needs = []
            for order in itertools.permutations(range(5)):
                fit = [m for m in range(5) if kv_budget.kv_bytes(model, n_ctx, kv_type, order[:m]) <= budget]
                needs.append(fit[0] if fit else None)
            if None not in needs:
                worst[kv_type] = max(needs)
        expected = max(worst.values()) if worst else None
        assert kv_budget.most_layers_needed(model, n_ctx, budget, max_m=4) == expected, budget


def test_candidates_are_the_shortest_fitting_prefix_of_each_type():
    model, n_ctx, order = _model(), 8192, [3, 1, 4, 0]
    budget = 3 * 10 ** 6
    found = kv_budget.candidates(model, n_ctx, budget, order)
    for candidate in found:
        assert candidate.kv_bytes <= budget
        assert candidate.layers == tuple(sorted(order[:candidate.m]))
        if candidate.m:  # one layer fewer does not fit
            assert kv_budget.kv_bytes(model, n_ctx, candidate.kv_type, order[:candidate.m - 1]) > budget
    assert [c.kv_type for c in found] == [t for t in kv_budget.KV_TYPES
                                          if kv_budget.kv_bytes(model, n_ctx, t, order) <= budget]


def test_window_candidates_are_the_shortest_fitting_prefix_of_their_order():
    # a model without sliding layers of its own (a file carries one window)
    model = KvModel(layers=tuple(KvLayer(w, w) for w in (256, 64, 256, 64, 128)))
    n_ctx, order, window_order = 32768, [3, 1, 4, 0], [2, 0, 4, 1, 3]
    budget = 40 * 10 ** 6
    found = kv_budget.candidates(model, n_ctx, budget, order, window_order, [(512, 4)])
    windowed = [c for c in found if c.windows]
    assert windowed, "some type fits with window layers at this budget"
    for candidate in windowed:
        k = len(candidate.windows)
        assert candidate.windows == tuple(sorted(window_order[:k])) and candidate.layers == ()
        assert candidate.kv_bytes <= budget < kv_budget.kv_bytes(model, n_ctx, candidate.kv_type,
                                                                 windows=window_order[:k - 1], window=(512, 4))
        # a window layer holds pad256(W + S + n_ubatch) cells, the others the whole context (kv_cache's own rule)
        per_cell = {i: kv_budget.kv_bytes(model, 256, candidate.kv_type, [j for j in range(5) if j != i]) / 256
                    for i in range(5)}
        assert candidate.kv_bytes == sum(per_cell[i] * (1280 if i in candidate.windows else n_ctx) for i in range(5))
        assert "window layers (W = 512)" in candidate.label


# window layers each count needs at 10% of Qwen2.5-0.5B's F16 cache at 32,768 tokens, per micro-batch (-ub)
# and (cache type, W); None: no candidate, a larger window needs as few
BUDGET_COUNTS = {
    512: {("f16", 512): 23, ("f16", 128): None, ("q8_0", 512): 21, ("q8_0", 128): 20,
          ("q8_0/q4_0", 512): 19, ("q8_0/q4_0", 128): None},
    # a window layer's cache holds one micro-batch beside its window: at 128, pad256(516 + 128) = 768 cells at
    # W = 512 (1,280 at -ub 512), so q8_0 keeps one more global layer at W = 512, F16 one more at W = 128
    128: {("f16", 512): 23, ("f16", 128): 22, ("q8_0", 512): 20, ("q8_0", 128): None,
          ("q8_0/q4_0", 512): 19, ("q8_0/q4_0", 128): None},
}


@pytest.mark.parametrize("n_ubatch", sorted(BUDGET_COUNTS))
def test_a_smaller_window_is_a_candidate_where_it_needs_fewer_window_layers(n_ubatch):
    """Qwen2.5-0.5B's cache (24 layers, 2 KV heads of 64) at 32,768 tokens and 10% of its F16 bytes: with
    q8_0, W = 512 needs 21 window layers and W = 128 20, one more global layer; with F16 both need 23, and
    the smaller window (same count, less attended) is no candidate. Against the cache written out by hand:
    a global layer holds the context, a window layer pad256(W + sinks + n_ubatch) cells, 2 x 128 values a
    cell."""
    model = KvModel(layers=tuple(KvLayer(128, 128) for _ in range(24)))
    n_ctx, budget, window_order = 32768, int(38.4 * 2 ** 20), list(range(24))
    cell_bytes = {"f16": 2 * 128 * 2, "q8_0": 2 * 128 // 32 * 34, "q8_0/q4_0": 128 // 32 * (34 + 18),
                  "q4_0": 2 * 128 // 32 * 18}

    def by_hand(kv_type, k, size):
        cells = -(-(size + 4 + n_ubatch) // 256) * 256
        return ((24 - k) * n_ctx + k * cells) * cell_bytes[kv_type]

    found = kv_budget.candidates(model, n_ctx, budget, [], window_order, [(128, 4), (512, 4)], n_ubatch=n_ubatch)
    expected = []
    for kv_type in kv_budget.KV_TYPES:
        fewest = 25
        for size in (512, 128):
            k = next(k for k in range(1, 25) if by_hand(kv_type, k, size) <= budget)
            if k < fewest:
                expected.append((kv_type, size, k, by_hand(kv_type, k, size)))
                fewest = k
    assert [(c.kv_type, c.window[0], len(c.windows), c.kv_bytes) for c in found if c.windows] == expected
    counts = {(kv_type, size): k for kv_type, size, k, _ in expected}
    for key, count in BUDGET_COUNTS[n_ubatch].items():
        assert counts.get(key) == count, key
    assert any("window layers (W = 128)" in c.label for c in found)
    assert all(kv_budget.kv_bytes(model, n_ctx, c.kv_type, windows=c.windows, window=c.window,
                                  n_ubatch=n_ubatch) == c.kv_bytes for c in found if c.windows)


def test_the_budgets_window_sizes_show_at_its_context():
    """--kv-budget tries each default window size below half its measuring context, or those given;
    a given size that cannot show there is refused by name, and --windows takes one size."""
    import argparse

    from nbl_gguf.commands import flags
    from nbl_gguf.commands.convert import budget_window_sizes
    from nbl_gguf.errors import NblError

    source = type("Source", (), {"gguf": type("G", (), {"architecture": "qwen2"})()})()
    args = argparse.Namespace(runtime="nbl", window_size=None)
    assert budget_window_sizes(args, source, 4096) == (128, 512)
    assert budget_window_sizes(args, source, 8192) == (128, 512, 2048)
    assert budget_window_sizes(argparse.Namespace(runtime="stock", window_size=None), source, 8192) == ()
    assert budget_window_sizes(argparse.Namespace(runtime="nbl", window_size=[512, 64]), source, 4096) == (64, 512)
    with pytest.raises(NblError, match=r"--window-size 2048 with --kv-budget: .* 4,096 tokens"):
        budget_window_sizes(argparse.Namespace(runtime="nbl", window_size=[2048], kv_budget="45MiB", total_budget=None),
                            source, 4096)
    assert flags.one_window_size(None) == 512 and flags.one_window_size([64]) == 64
    with pytest.raises(NblError, match="--window-size 128,512: --windows takes one window size"):
        flags.one_window_size([128, 512])


def test_candidates_holding_refused_window_layers_rank_last(monkeypatch):
    """Where the retrieval walk kept only the first ``window_kept`` (here 1) of the window order, a candidate with more
    window layers holds refused ones (named in its label) and ranks after every candidate that holds none,
    even with a lower perplexity: perplexity cannot see recall beyond the window."""
    from nbl_gguf.llamacpp import perplexity as llama_perplexity

    model = KvModel(layers=tuple(KvLayer(w, w) for w in (256, 64, 256, 64, 128)))
    n_ctx, order, window_order = 32768, [3, 1, 4, 0], [2, 0, 4, 1, 3]
    budget = 40 * 10 ** 6
    found = kv_budget.candidates(model, n_ctx, budget, order, window_order, [(512, 4)], window_kept=1)
    windowed = [c for c in found if c.windows]
    assert any(len(c.windows) > 1 for c in windowed) and any(len(c.windows) == 1 for c in windowed)
    for candidate in windowed:
        assert candidate.refused == tuple(sorted(window_order[1:len(candidate.windows)]))
        assert ("refused by the retrieval walk" in candidate.label) == bool(candidate.refused)
    assert all(not c.refused for c in kv_budget.candidates(model, n_ctx, budget, order, window_order, [(512, 4)]))

    # perplexity: the fewer layers touched the better, except the refused candidates, which measure best
    def fake(path, text, **_):
        candidate = files_by_path[path]
        return type("P", (), {"ppl": 10.0 + (0 if candidate is None else (-5 if candidate.refused else
                                                                          len(candidate.layers + candidate.windows)))})()

    monkeypatch.setattr(llama_perplexity, "perplexity", fake)
    files_by_path = {"stock": None} | {f"c{i}": c for i, c in enumerate(found)}
    files = {c: f"c{i}" for i, c in enumerate(found)}
    _, measured, stock_found = kv_budget.measure("stock", files, {"c4": "t"}, 4096, 1, 1, log=lambda *_: None)
    assert stock_found is None and all(r.found is None for r in measured)
    ranks = [bool(r.candidate.refused) for r in measured]
    assert ranks == sorted(ranks) and ranks[-1] and not ranks[0]
    kept = [r.change_pct for r in measured if not r.candidate.refused]
    assert kept == sorted(kept)


@pytest.mark.parametrize("refused_best", [True, False])
def test_candidates_holding_refused_window_layers_are_not_measured_where_one_holds_none(monkeypatch, refused_best):
    """They rank after every candidate that holds none whatever they measure, so measuring only the others
    chooses the same candidate, in the same order, with fewer perplexities; where all hold some, all are
    measured."""
    from nbl_gguf.llamacpp import perplexity as llama_perplexity

    model = KvModel(layers=tuple(KvLayer(w, w) for w in (256, 64, 256, 64, 128)))
    found = kv_budget.candidates(model, 32768, 40 * 10 ** 6, [3, 1, 4, 0], [2, 0, 4, 1, 3], [(512, 4)],
                                 window_kept=1)
    files = {c: f"c{i}" for i, c in enumerate(found)}
    by_path = {"stock": None} | {path: c for c, path in files.items()}
    runs = []

    def fake(path, text, **_):
        runs.append(path)
        candidate = by_path[path]
        touched = 0 if candidate is None else len(candidate.layers + candidate.windows)
        return type("P", (), {"ppl": 10.0 + (-5 if candidate is not None and candidate.refused and refused_best
                                             else touched)})()

    monkeypatch.setattr(llama_perplexity, "perplexity", fake)
    _, everything, _ = kv_budget.measure("stock", files, {"c4": "t"}, 4096, 1, 1, log=lambda *_: None)
    runs.clear()
    logged = []
    kept, outranked = kv_budget.without_outranked(files, log=logged.append)
    assert outranked == [c for c in found if c.refused] and outranked and len(kept) < len(files)
    assert all(candidate.label in line and "not measured" in line for candidate, line in zip(outranked, logged))
    _, measured, _ = kv_budget.measure("stock", kept, {"c4": "t"}, 4096, 1, 1, log=lambda *_: None)
    assert sorted(runs) == sorted(["stock"] + list(kept.values()))
    assert [r.candidate for r in measured] == [r.candidate for r in everything if not r.candidate.refused]
    # every candidate holding refused layers: nothing to rank them after, so all are measured
    only_refused = {c: path for c, path in files.items() if c.refused}
    assert kv_budget.without_outranked(only_refused, log=logged.append) == (only_refused, [])


def test_the_summary_names_the_candidates_left_unmeasured(tmp_path):
    from nbl_gguf.commands.convert_summary import Summary

    row = {"label": "2 window layers (W = 512), KV q8_0", "kv_type": "q8_0", "m": 0, "layers": [], "windows": [1, 2],
           "refused_windows": [], "kv_bytes": 2 ** 20, "passkey_found": None, "perplexity": {}, "change_pct": 1.3}
    budget = {"bytes": 2 ** 21, "n_ctx": 32768, "eval_ctx": 4096, "chunks": 1, "stock_ppl": {}, "candidates": [row]}
    summary = Summary(model="m", quant="Q4_K_M", method="attn-nbl", criterion="best", n_layer=4, replaced=[],
                      scores=None, stock_bytes=1, nbl_bytes=1, kv={}, output=tmp_path / "o.gguf", budget=budget)
    assert not any("not measured" in line for line in summary.budget_lines())
    budget["unmeasured"] = [{"label": "3 window layers (W = 512), KV f16 (refused by the retrieval walk: 4)"},
                            {"label": "4 window layers (W = 128), KV f16 (refused by the retrieval walk: 4, 1)"}]
    line = next(line for line in summary.budget_lines() if "not measured" in line)
    assert line.endswith("3 window layers (W = 512), KV f16 (refused by the retrieval walk: 4); "
                         "4 window layers (W = 128), KV f16 (refused by the retrieval walk: 4, 1)")


def test_candidates_that_find_fewer_passkeys_than_stock_rank_after_those_that_find_as_many(monkeypatch):
    """With recall depths, stock and each candidate take the passkey test with their own cache type; the
    best-measuring candidate loses keys, so the next one by perplexity that keeps them all is chosen."""
    from nbl_gguf.llamacpp import perplexity as llama_perplexity
    from nbl_gguf.measurement import passkey as passkey_module

    model = KvModel(layers=tuple(KvLayer(w, w) for w in (256, 64, 256, 64, 128)))
    found = kv_budget.candidates(model, 32768, 40 * 10 ** 6, [3, 1, 4, 0], [2, 0, 4, 1, 3], [(512, 4)])
    assert len(found) >= 3
    paths = {c: f"c{i}" for i, c in enumerate(found)}
    change = {"stock": 0.0} | {path: 1.0 + i for i, path in enumerate(paths.values())}  # c0 best, then c1, ...
    asked = []

    def fake_perplexity(path, text, **_):
        return type("P", (), {"ppl": 10.0 * (1 + change[path] / 100)})()

    def fake_passkey(path, lengths, depths, *, kv_type, threads):
        asked.append((path, kv_type, lengths))
        keys = 1 if path == "c0" else len(depths)  # the best by perplexity loses recall
        return passkey_module.PasskeyResult([passkey_module.Trial(lengths[0], d, 1, 10, "1" if i < keys else "x")
                                             for i, d in enumerate(depths)])

    monkeypatch.setattr(llama_perplexity, "perplexity", fake_perplexity)
    monkeypatch.setattr(passkey_module, "passkey", fake_passkey)
    _, measured, stock_found = kv_budget.measure("stock", paths, {"c4": "t"}, 4096, 1, 1, log=lambda *_: None,
                                                 recall_depths=(0.2, 0.5, 0.8))
    assert stock_found == 3
    prompt = (passkey_module.longest_prompt(4096),)  # the prompt and its answer within the measured context
    # in the order of perplexity until one finds as many keys as stock: c0 loses some, c1 wins, the rest untested
    assert asked == [("stock", "f16", prompt)] + [(paths[c], c.kv_type, prompt) for c in found[:2]]
    assert [paths[r.candidate] for r in measured] == [f"c{i}" for i in range(1, len(found))] + ["c0"]
    assert measured[-1].found == 1 and measured[-1].loses_recall(stock_found)
    assert measured[0].found == 3 and all(r.found is None for r in measured[1:-1])


def test_when_every_candidate_loses_recall_the_one_that_finds_most_keys_wins(monkeypatch):
    """Qwen at 10% of its cache at 32K: the best by perplexity found 1 key in 5, a slightly worse one 4."""
    from nbl_gguf.llamacpp import perplexity as llama_perplexity
    from nbl_gguf.measurement import passkey as passkey_module

    model = KvModel(layers=tuple(KvLayer(w, w) for w in (256, 64, 256, 64, 128)))
    found = kv_budget.candidates(model, 32768, 40 * 10 ** 6, [3, 1, 4, 0], [2, 0, 4, 1, 3], [(512, 4)])
    paths = {c: f"c{i}" for i, c in enumerate(found)}
    change = {"stock": 0.0} | {path: 1.0 + i for i, path in enumerate(paths.values())}
    keys = {"stock": 5} | {path: (1 if path == "c0" else 4 if path == "c2" else 2) for path in paths.values()}
    monkeypatch.setattr(llama_perplexity, "perplexity",
                        lambda path, text, **_: type("P", (), {"ppl": 10.0 * (1 + change[path] / 100)})())
    monkeypatch.setattr(passkey_module, "passkey", lambda path, lengths, depths, **_: passkey_module.PasskeyResult(
        [passkey_module.Trial(lengths[0], d, 1, 10, "1" if i < keys[path] else "x") for i, d in enumerate(depths)]))
    _, measured, stock_found = kv_budget.measure("stock", paths, {"c4": "t"}, 4096, 1, 1, log=lambda *_: None,
                                                 recall_depths=(0.1, 0.3, 0.5, 0.7, 0.9))
    assert stock_found == 5 and all(r.loses_recall(stock_found) for r in measured)
    assert paths[measured[0].candidate] == "c2" and measured[0].found == 4
    rest = [paths[r.candidate] for r in measured[1:]]
    assert rest[-1] == "c0" and rest[:-1] == sorted(rest[:-1], key=lambda p: int(p[1:]))


def test_the_window_walk_goes_as_far_as_the_budget_needs():
    """kv_budget.windows_needed: for layers with alike caches, the most window layers any cache type's
    candidate takes (the retrieval walk stops there, not at every layer)."""
    model = KvModel(layers=tuple(KvLayer(64, 64) for _ in range(6)))
    n_ctx, window = 32768, (512, 4)
    for budget in (10 * 2 ** 20, 30 * 2 ** 20, 60 * 2 ** 20):
        found = kv_budget.candidates(model, n_ctx, budget, [], list(range(6)), [window])
        most = max((len(c.windows) for c in found if c.windows), default=1)
        assert kv_budget.windows_needed(model, n_ctx, budget, window) == most
    # a budget no count of window layers meets: walk them all
    assert kv_budget.windows_needed(model, n_ctx, 1, window) == 6


def test_an_unreachable_budget_names_the_smallest_reachable():
    model = _model()
    smallest = kv_budget.smallest_reachable(model, 8192, 4)
    # the smallest is the q4_0 cache of the one layer left when the 4 largest caches are gone
    assert smallest == min(kv_budget.kv_bytes(model, 8192, "q4_0", [i for i in range(5) if i != keep])
                           for keep in range(5))
    with pytest.raises(NblError, match=f"cannot be met: the smallest KV cache reachable is {smallest / 2 ** 20:,.2f} MiB"):
        kv_budget.check_reachable(model, 8192, smallest - 1, 4)
    assert kv_budget.check_reachable(model, 8192, smallest, 4) == 4


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from nbl_gguf.fixtures.tiny import TinyLlama

    # 4 layers with a K and a V row of 32 values: 128 KiB of F16 cache a layer at 1,024 tokens
    return TinyLlama(n_layer=4, n_head=2, n_head_kv=1, n_ctx_train=1024).write_gguf(
        tmp_path_factory.mktemp("budget") / "tiny.gguf")


def test_bad_budgets_are_refused_before_any_work(tiny_gguf, tmp_path, capsys):
    out = tmp_path / "out.gguf"
    cases = [(["--kv-budget", "10KiB"], "cannot be met: the smallest KV cache reachable is 0.04 MiB"),
             (["--kv-budget", "100MiB"], "is met by the stock model as it is"),
             (["--kv-budget", "150KiB", "--m", "2"], "the budget chooses m"),
             (["--kv-budget", "150KiB", "--kv-type", "q8_0"], "the budget chooses the KV type"),
             (["--kv-budget", "lots"], "expected a size"),
             (["--kv-budget-passkey", "off"], "--kv-budget-passkey means nothing without --kv-budget"),
             (["--kv-budget", "150KiB", "--window-size", "64,4096"],
              "--window-size 4096 with --kv-budget: the candidates are measured at"),
             (["--windows", "2", "--window-size", "8,16"], "--window-size 8,16: --windows takes one window size")]
    for extra, message in cases:
        assert main(["convert", "--model", str(tiny_gguf), *extra, "-o", str(out)]) == 2
        assert message in capsys.readouterr().err
        assert not out.exists()


@pytest.mark.llama
def test_convert_meets_the_budget_as_llama_cpp_allocates_it(tiny_gguf, tmp_path, monkeypatch, capsys):
    import gguf

    from nbl_gguf.gguf.metadata import file_layer_types
    from nbl_gguf.measurement.llama_bench import run_llama_bench

    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out.gguf"
    # F16 needs 3 layers replaced (128 KiB), q8_0 2 (136 KiB), q8_0 K with q4_0 V 2 (104 KiB), q4_0 none (144 KiB)
    budget = 150 << 10
    # no passkey test: a random model finds no key (and its byte tokens run past the answer's length)
    assert main(["convert", "--model", str(tiny_gguf), "--kv-budget", "150KiB", "--kv-budget-passkey", "off",
                 "--nsamples", "8", "--seqlen", "64", "--no-progress", "--threads", "1", "--eval-chunks", "1", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "KV budget 150.00 KiB at 1,024 tokens" in printed
    lines = [line for line in printed.splitlines() if line.startswith("    NBL m = ") or line.startswith("    stock, KV")]
    labels = {line.split("  KV ")[0].strip() for line in lines}
    assert labels == {"NBL m = 3, KV f16", "NBL m = 2, KV q8_0", "NBL m = 2, KV q8_0/q4_0", "stock, KV q4_0"}
    chosen = next(line for line in lines if line.endswith("<- chosen"))
    m, kv_type = int(chosen.split("m = ")[1].split(",")[0]) if "NBL" in chosen else 0, chosen.split("KV ")[1].split()[0]
    types = file_layer_types(gguf.GGUFReader(out)) or [0] * 4
    assert sum(t != 0 for t in types) == m
    if m == 0:
        assert out.read_bytes() == tiny_gguf.read_bytes()
    else:
        assert " ".join(cache_type_flags(kv_type)) in printed
    # what llama.cpp allocates for the output at 1,024 tokens with the chosen cache type
    records, _ = run_llama_bench(out, n_prompt=16, n_gen=8, depth=1000, repetitions=1, threads=1, backend="cpu",
                                 cache_type=kv_type)
    assert records[0]["kv_cells"] == 1024
    assert records[0]["kv_mib"] * 2 ** 20 <= budget + 0.01 * 2 ** 20


def test_window_candidates_are_measured_with_their_windows(tiny_gguf, tmp_path, monkeypatch, capsys):
    """With a window that shows at the budget's context, each KV type also gets window-layer candidates;
    each is measured as its own file (a window candidate replaces no layer, and was once taken for the
    stock file: its F16 change then read +0.00%)."""
    import gguf

    from nbl_gguf.gguf import nbl_format

    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out.gguf"
    assert main(["convert", "--model", str(tiny_gguf), "--kv-budget", "1.2MiB", "--kv-budget-passkey", "off",
                 "--ctx-size", "4096", "--window-size", "64",
                 "--window-sinks", "2", "--nsamples", "8", "--seqlen", "64", "--no-progress", "--threads", "1",
                 "--eval-chunks", "1", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    windowed = [line for line in printed.splitlines() if " window layers (W = 64), KV " in line and "MiB" in line]
    assert any("KV f16" in line for line in windowed), printed
    for line in windowed:
        assert not line.split("MiB")[1].strip().startswith("+0.00%"), line
    chosen = next(line for line in printed.splitlines() if line.endswith("<- chosen"))
    windows = nbl_format.read_windows(gguf.GGUFReader(out))
    assert (windows is not None) == ("window layers" in chosen)


def test_a_budget_run_again_takes_its_window_order_and_measurements_from_the_first(tiny_gguf, tmp_path, monkeypatch,
                                                                                  capsys):
    """The same convert twice (as after an interruption): the second runs no window stage and no perplexity, and
    writes the same file; another window size is another window order, measured."""
    from nbl_gguf.llamacpp import perplexity as llama_perplexity

    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path / "cache"))
    command = ["convert", "--model", str(tiny_gguf), "--kv-budget", "1.2MiB", "--kv-budget-passkey", "off",
               "--ctx-size", "4096", "--window-size", "64", "--window-sinks", "2", "--nsamples", "8", "--seqlen", "64",
               "--no-progress", "--threads", "1", "--eval-chunks", "1", "--no-eval"]
    assert main(command + ["-o", str(tmp_path / "first.gguf")]) == 0
    first = capsys.readouterr().out
    order = next(line for line in first.splitlines() if line.startswith("kv budget: window order"))
    assert not order.endswith("(kept from an earlier run)")
    measured = [line for line in first.splitlines() if line.startswith("kv budget: ") and "held-out perplexity" in line]
    assert measured and not any("earlier run" in line for line in measured)

    real, runs = llama_perplexity.perplexity, []
    monkeypatch.setattr(llama_perplexity, "perplexity", lambda *a, **k: runs.append(a) or real(*a, **k))
    assert main(command + ["-o", str(tmp_path / "second.gguf")]) == 0
    second = capsys.readouterr().out
    assert order.split(" (")[0] + " (kept from an earlier run)" in second.splitlines()
    again = [line for line in second.splitlines() if line.startswith("kv budget: ") and "held-out perplexity" in line]
    assert again == [line + " (kept from an earlier run)" for line in measured] and runs == []
    assert (tmp_path / "second.gguf").read_bytes() == (tmp_path / "first.gguf").read_bytes()

    assert main(command[:command.index("64")] + ["96"] + command[command.index("64") + 1:]
                + ["-o", str(tmp_path / "third.gguf")]) == 0
    third = capsys.readouterr().out
    assert not next(line for line in third.splitlines() if line.startswith("kv budget: window order")).endswith(
        "(kept from an earlier run)")


@pytest.mark.llama
def test_a_smaller_micro_batch_fits_window_layers_where_llama_cpps_default_does_not(tiny_gguf, tmp_path, monkeypatch,
                                                                                    capsys):
    """-ub 64: a window layer (W = 64, 2 sinks) caches pad256(66 + 64) = 256 cells instead of the 768 of -ub 512,
    32 KiB in F16 instead of 96, so 4 F16 window layers fit 0.3 MiB at 4,096 tokens (at -ub 512 they take
    384 KiB, and no F16 candidate fits: 3 replaced layers leave 512 KiB). The chosen file, loaded by llama.cpp
    with that micro-batch and its cache type, fits the budget; the summary gives -ub with the run flags."""
    from nbl_gguf.llamacpp import library

    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path / "cache"))
    out, budget = tmp_path / "out.gguf", int(0.3 * 2 ** 20)
    tiny = KvModel(layers=tuple(KvLayer(32, 32) for _ in range(4)))
    assert kv_budget.kv_bytes(tiny, 4096, "f16", windows=range(4), window=(64, 2)) > budget  # -ub 512
    assert main(["convert", "--model", str(tiny_gguf), "--kv-budget", "0.3MiB", "--kv-budget-passkey", "off",
                 "--ctx-size", "4096", "--window-size", "64", "--window-sinks", "2", "-ub", "64", "--nsamples", "8",
                 "--seqlen", "64", "--no-progress", "--threads", "1", "--eval-chunks", "1", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "KV budget 307.20 KiB at 4,096 tokens with -ub 64" in printed
    assert any(line.startswith("    4 window layers (W = 64), KV f16 ") for line in printed.splitlines()), printed
    chosen = next(line for line in printed.splitlines() if line.endswith("<- chosen"))
    kv_type = chosen.split("KV ")[1].split()[0].rstrip(",")
    assert "-ub 64 (llama-cpp-python: " in printed and "n_ubatch = 64)" in printed
    caches = library.context_kv_caches(out, n_ctx=4096, n_ubatch=64, kv_type=kv_type)
    assert sum(c.mib for c in caches) * 2 ** 20 <= budget + 0.01 * 2 ** 20
    # the F16 window file at llama.cpp's default micro-batch would not fit
    if "window layers (W = 64), KV f16" in chosen:
        assert sum(c.mib for c in library.context_kv_caches(out, n_ctx=4096, kv_type=kv_type)) * 2 ** 20 > budget


def test_window_candidates_kept_global_for_recall_are_measured_as_their_own_files(tiny_gguf, tmp_path, monkeypatch,
                                                                                 capsys):
    """A budget where F16 needs three window layers and q8_0 one: the leave-one-out runs on the walk's kept layers
    (at most three), and q8_0's one-window candidate comes with one whose window is another layer, measured
    as a file of its own (a different perplexity), the ranking named in the summary."""
    import re

    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out.gguf"
    assert main(["convert", "--model", str(tiny_gguf), "--kv-budget", "0.9MiB", "--kv-budget-passkey", "off",
                 "--ctx-size", "4096", "--window-size", "64", "--window-sinks", "2", "--nsamples", "8", "--seqlen", "64",
                 "--no-progress", "--threads", "1", "--eval-chunks", "1", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    measured = dict(re.findall(r"^kv budget: (1 window layers \(W = 64\), KV q8_0.*?): [0-9.]+ [KM]iB, held-out "
                               r"perplexity at \d+ ([-+][0-9.]+)%$", printed, re.M))
    assert len(measured) == 2, printed
    swapped = next(label for label in measured if "global for recall" in label)
    assert measured[swapped] != measured["1 window layers (W = 64), KV q8_0"]
    ranking = re.search(r"recall each window layer gives back made global alone .* with all (\d+)\): (\d+) ", printed)
    assert ranking and 2 <= int(ranking.group(1)) <= 3
    # the ranking's first layer is the swapped-in global; the layer the order kept global is windowed instead
    assert re.search(rf"{ranking.group(2)} global for recall \(windowed: \d+\)", swapped)


def test_the_summary_gives_kv_and_run_flags_at_the_kv_type(tmp_path):
    """convert --kv-type q8_0: the KV rows in that type's bytes (34 bytes a block of 32 values, against 64 in
    F16) and the flags to run the file with."""
    from nbl_gguf.commands.convert_summary import Summary
    from nbl_gguf.kv_cache import Context, kv_size

    model = KvModel(layers=tuple(KvLayer(64, 64) for _ in range(4)))
    context = Context(n_ctx=4096, type_k="q8_0", type_v="q8_0")
    stock, nbl = kv_size(model, context), kv_size(model.without([1]), context)
    assert stock.bytes == 4 * 4096 * 2 * (64 // 32 * 34)
    summary = Summary(model="m", quant="Q4_K_M", method="attn-nbl", criterion="best", n_layer=4, replaced=[1],
                      scores=None, stock_bytes=1, nbl_bytes=1, kv={4096: (stock, nbl)}, output=tmp_path / "o.gguf",
                      kv_type="q8_0")
    table = summary.table()
    assert "KV cache at 4,096 tokens (Q8_0)" in table
    assert f"run with: llama-cli -m {tmp_path / 'o.gguf'} -ctk q8_0 -ctv q8_0" in table
    assert "run with" not in Summary(**{**summary.__dict__, "kv_type": "f16"}).table()
    split = Summary(**{**summary.__dict__, "kv_type": "q8_0/q4_0"}).table()
    assert "-ctk q8_0 -ctv q4_0 (llama-cpp-python: type_k = GGML_TYPE_Q8_0, type_v = GGML_TYPE_Q4_0)" in split


def test_the_summary_gives_kv_and_run_flags_at_the_micro_batch(tmp_path):
    """convert -ub 128: a window file's sliding cache at pad256(W + S + 128) cells, said in the KV rows, and -ub
    with the run flags (with the cache type's, where there is one); none at llama.cpp's own 512."""
    from nbl_gguf.commands.convert_summary import Summary
    from nbl_gguf.kv_cache import Context, kv_size

    stock = KvModel(layers=tuple(KvLayer(64, 64) for _ in range(4)))
    windowed = kv_budget.windowed(stock, [0, 2], (512, 4))
    sizes = {n_ubatch: (kv_size(stock, Context(n_ctx=4096, n_ubatch=n_ubatch)),
                        kv_size(windowed, Context(n_ctx=4096, n_ubatch=n_ubatch))) for n_ubatch in (128, 512)}
    assert sizes[128][1].caches["sliding"].cells == 768 and sizes[512][1].caches["sliding"].cells == 1280
    summary = Summary(model="m", quant="Q4_K_M", method="attn-nbl", criterion="best", n_layer=4, replaced=[],
                      scores=None, stock_bytes=1, nbl_bytes=1, kv={4096: sizes[128]}, output=tmp_path / "o.gguf",
                      n_ubatch=128)
    table = summary.table()
    assert "KV cache at 4,096 tokens (F16, -ub 128)" in table and "sliding-window layers: 768 cells" in table
    assert f"run with: llama-cli -m {tmp_path / 'o.gguf'} -ub 128 (llama-cpp-python: n_ubatch = 128)" in table
    quantized = Summary(**{**summary.__dict__, "kv_type": "q8_0"}).table()
    assert ("-ctk q8_0 -ctv q8_0 -ub 128 (llama-cpp-python: type_k = GGML_TYPE_Q8_0, type_v = GGML_TYPE_Q8_0, "
            "n_ubatch = 128)") in quantized
    default = Summary(**{**summary.__dict__, "kv": {4096: sizes[512]}, "n_ubatch": 512}).table()
    assert "run with" not in default and "-ub" not in default and "sliding-window layers: 1,280 cells" in default


def test_the_summary_gives_each_candidates_passkeys_and_warns_when_the_chosen_one_lost_some(tmp_path):
    from nbl_gguf.commands.convert_summary import Summary

    def candidate(label, change, found):
        return {"label": label, "kv_type": "q8_0", "m": 0, "layers": [], "windows": [1, 2], "refused_windows": [],
                "kv_bytes": 2 ** 20, "passkey_found": found, "perplexity": {}, "change_pct": change}

    budget = {"bytes": 2 ** 21, "n_ctx": 32768, "eval_ctx": 4096, "chunks": 1, "stock_ppl": {},
              "passkey_depths": [0.1, 0.5, 0.9], "stock_passkey_found": 3,
              "candidates": [candidate("2 window layers (W = 512), KV q8_0", 1.3, 1),
                             candidate("NBL m = 2, KV q4_0", 200.0, 0)]}
    summary = Summary(model="m", quant="Q4_K_M", method="attn-nbl", criterion="best", n_layer=4, replaced=[],
                      scores=None, stock_bytes=1, nbl_bytes=1, kv={}, output=tmp_path / "o.gguf", budget=budget)
    lines = summary.budget_lines()
    assert lines[1].endswith("+1.30%  passkey 1/3  <- chosen") and lines[2].endswith("passkey 0/3")
    assert any("stock (F16) found 3/3" in line for line in lines)
    assert any(line.startswith("  warning: no candidate within the budget found as many passkeys as stock (1/3 "
                               "against 3/3)") for line in lines)
    budget["candidates"][0]["passkey_found"] = 3
    assert not any("warning" in line for line in summary.budget_lines())


def test_window_candidates_come_with_layers_kept_global_for_recall():
    """swap_globals: the recall ranking's first layers global in place of the window order's, and each of its
    first RECALL_SWAPS that the order windows swapped alone for the order's global that gives back the least;
    each such candidate fits the budget like the one it comes from, and none comes from a candidate that holds
    a refused layer or windows the whole ranked set."""
    model = KvModel(layers=tuple(KvLayer(128, 128) for _ in range(8)))
    n_ctx, window = 32768, (512, 4)
    window_order = [5, 2, 7, 0, 3, 1, 6, 4]
    ranking = [7, 5, 3, 0, 1, 2]  # the first six of the order, the most recall first
    four = kv_budget.kv_bytes(model, n_ctx, "f16", windows=window_order[:4], window=window)
    found = kv_budget.candidates(model, n_ctx, four, [], window_order, [window], window_kept=6, recall_ranking=ranking)
    f16 = [c for c in found if c.kv_type == "f16"]
    text = next(c for c in f16 if not c.recall_globals)
    assert text.windows == (0, 2, 5, 7)  # the order's first four: globals 3 and 1 of the ranked set
    swaps = {c.windows: (c.recall_globals, c.recall_windowed) for c in f16 if c.recall_globals}
    assert kv_budget.RECALL_SWAPS == 2
    assert swaps == {(0, 1, 2, 3): ((5, 7), (1, 3)),  # the ranking's two first global instead of 3 and 1
                     (0, 1, 2, 5): ((7,), (1,)),  # 7 for 1 (1 gives back less than 3)
                     (0, 1, 2, 7): ((5,), (1,))}
    for c in found:
        assert c.kv_bytes <= four
        assert kv_budget.kv_bytes(model, n_ctx, c.kv_type, windows=c.windows, window=window) == c.kv_bytes
    swapped = next(c for c in f16 if c.recall_globals == (7,))
    assert swapped.label.endswith("KV f16, 7 global for recall (windowed: 1)")
    # the whole ranked set windowed, or a candidate holding a refused layer: nothing to swap
    assert kv_budget.swap_globals(replace(text, windows=tuple(sorted(ranking))), ranking) == []
    assert kv_budget.swap_globals(replace(text, refused=(2,)), ranking) == []
    # a ranking whose first layers are the order's globals: nothing to swap; one of them first: one swap
    assert kv_budget.swap_globals(text, [3, 1, 7, 5, 0, 2]) == []
    half = kv_budget.swap_globals(text, [3, 7, 1, 5, 0, 2])
    assert [(c.recall_globals, c.recall_windowed, c.windows) for c in half] == [((7,), (1,), (0, 1, 2, 5))]


def test_a_swap_that_no_longer_fits_is_left_out():
    """Layers with unequal caches: keeping a larger one global for a smaller can overrun the budget."""
    model = KvModel(layers=(KvLayer(128, 128), KvLayer(512, 512), KvLayer(128, 128), KvLayer(128, 128)))
    n_ctx, window = 32768, (512, 4)
    window_order = [1, 0, 2, 3]
    budget = kv_budget.kv_bytes(model, n_ctx, "f16", windows=[1, 0], window=window)
    found = kv_budget.candidates(model, n_ctx, budget, [], window_order, [window], window_kept=3,
                                 recall_ranking=[1, 2, 0])
    f16 = [c for c in found if c.kv_type == "f16"]
    assert [c.windows for c in f16] == [(0, 1)]  # 1 global for 2 would need more room
    every = kv_budget.swap_globals(f16[0], [1, 2, 0])
    assert [c.windows for c in every] == [(0, 2)]
    assert kv_budget.kv_bytes(model, n_ctx, "f16", windows=(0, 2), window=window) > budget


def test_the_log_estimates_the_candidates_time_from_the_stock_files_own(monkeypatch):
    """After the stock file is measured, the log says how long the candidates will take at its pace: each
    candidate's perplexity as long as stock's, each passkey test as long as stock's."""
    from nbl_gguf.llamacpp import perplexity as llama_perplexity
    from nbl_gguf.measurement import passkey as passkey_module

    now = [0.0]
    model = KvModel(layers=tuple(KvLayer(w, w) for w in (256, 64, 256, 64, 128)))
    found = kv_budget.candidates(model, 32768, 40 * 10 ** 6, [3, 1, 4, 0], [2, 0, 4, 1, 3], [(512, 4)])
    paths = {c: f"c{i}" for i, c in enumerate(found)}

    def fake_perplexity(path, text, **_):
        now[0] += 400.0 if path == "stock" else 1.0  # stock: 400 s a text, two texts
        return type("P", (), {"ppl": 10.0})()

    def fake_passkey(path, lengths, depths, **_):
        now[0] += 1200.0 if path == "stock" else 1.0
        return passkey_module.PasskeyResult([passkey_module.Trial(lengths[0], d, 1, 10, "1") for d in depths])

    monkeypatch.setattr(llama_perplexity, "perplexity", fake_perplexity)
    monkeypatch.setattr(passkey_module, "passkey", fake_passkey)
    lines = []
    kv_budget.measure("stock", paths, {"c4": "t", "code": "u"}, 4096, 1, 1, log=lines.append,
                      recall_depths=(0.5,), clock=lambda: now[0])
    estimate = [line for line in lines if "will take" in line]
    hours = len(found) * 800 / 3600
    assert estimate == [f"kv budget: stock measured in 800 s (perplexity) and 1,200 s (passkey); the {len(found)} "
                        f"candidates' perplexities will take about {hours:.1f} h, and each passkey test about 20 min "
                        f"(at least one)"], lines
    assert len(found) * 800 >= 5400  # the hours branch, as an 8B model's would be

    lines.clear()  # no passkey test: no passkey estimate
    assert 90 <= len(found) * 400 < 5400  # the minutes branch
    kv_budget.measure("stock", paths, {"c4": "t"}, 4096, 1, 1, log=lines.append, clock=lambda: now[0])
    assert [line for line in lines if "will take" in line] == [
        f"kv budget: stock measured in 400 s (perplexity); the {len(found)} candidates' perplexities will take "
        f"about {len(found) * 400 / 60:.0f} min"]


# --- --total-budget: the weights, llama.cpp's buffers and the KV cache together -------------------------------

def _weights(path) -> int:
    from nbl_gguf.gguf.metadata import open_gguf, weight_bytes

    return weight_bytes(open_gguf(path))


def _held(path, n_ctx: int):
    """What the convert sets aside for the stock file at ``n_ctx``: its weights and llama.cpp's buffers."""
    from nbl_gguf.commands.convert import stock_held

    return stock_held(path, n_ctx, 512)


def _allocated_buffers(path, n_ctx: int, n_ubatch: int = 512, kv_type: str = "f16") -> float:
    """MiB of compute and output buffers that llama-completion allocates for a context of these settings, the layers
    on the CPU as library.context_buffers puts them, as its log says (a real context, in another process: the
    reference for that projection). Its log is complete since patch 0022: unflushed at exit, a short run beside a busy
    process lost the lines after the model's loading (3 runs of 40), this assertion's earlier failures."""
    import re

    from nbl_gguf.llamacpp.tools import run_tool

    done = run_tool("llama-completion", ["-m", path, "-c", n_ctx, "-ub", n_ubatch, "-n", 1, "-p", "hi", "-no-cnv",
                                         "-t", 1, "-ngl", 0, "-v", "--fit", "off", *cache_type_flags(kv_type)])
    sizes = re.findall(r"(?:compute|output) buffer size =\s*([\d.]+) MiB", done.stdout + done.stderr)
    assert len(sizes) >= 2, sizes  # one context (--fit off): its output buffer, its compute buffer on each backend
    return sum(map(float, sizes))


@pytest.mark.llama
def test_context_buffers_are_what_a_context_allocates(tiny_gguf):
    """library.context_buffers projects without allocating (llama.cpp's no_alloc); a context that llama-completion
    creates for real takes the same, to the 0.01 MiB it logs, and the projection is a bound. The compute buffer
    grows with the micro-batch (the logits of each of its tokens)."""
    from nbl_gguf.llamacpp.library import context_buffers

    seen = {}
    for n_ubatch, kv_type in [(512, "f16"), (64, "f16"), (64, "q8_0")]:
        projected = context_buffers(tiny_gguf, n_ctx=1024, n_ubatch=n_ubatch, kv_type=kv_type).bytes / 2 ** 20
        allocated = _allocated_buffers(tiny_gguf, 1024, n_ubatch, kv_type)
        assert allocated <= projected <= allocated + 0.011, (n_ubatch, kv_type)
        seen[n_ubatch] = allocated
    assert seen[512] > 4 * seen[64]


def test_weight_bytes_are_what_the_tensors_take_in_the_file(tiny_gguf):
    """metadata.weight_bytes against gguf-py's own reader: each tensor's data, the metadata apart."""
    import gguf

    reader = gguf.GGUFReader(tiny_gguf)
    assert _weights(tiny_gguf) == sum(int(tensor.n_bytes) for tensor in reader.tensors)
    assert _weights(tiny_gguf) < tiny_gguf.stat().st_size


@pytest.mark.llama
def test_bad_total_budgets_are_refused_before_any_work(tiny_gguf, tmp_path, capsys):
    out, held = tmp_path / "out.gguf", _held(tiny_gguf, 1024)
    assert held.weights == _weights(tiny_gguf) and held.buffers > 0
    fits_kv = f"{held.bytes + (150 << 10)}"  # bytes: the weights, the buffers and 150 KiB of cache
    cases = [(["--total-budget", fits_kv, "--kv-budget", "150KiB"], "give one (the total holds the weights"),
             (["--total-budget", f"{held.bytes + (10 << 10)}"],
              f"cannot be met: the weights take {held.weights / 2 ** 20:,.2f} MiB, llama.cpp's compute and output "
              f"buffers {held.buffers / 2 ** 20:,.2f} MiB at -ub 512, and the smallest KV cache reachable is "
              f"0.04 MiB (a q4_0 cache with 3 of 4 layers replaced); raise the budget, lower --ctx-size or "
              f"--ubatch-size"),
             (["--total-budget", "100MiB"], f"is met by the stock model as it is with its weights "
                                           f"({held.weights / 2 ** 20:,.2f} MiB) and llama.cpp's buffers "
                                           f"({held.buffers / 2 ** 20:,.2f} MiB)"),
             (["--total-budget", fits_kv, "--m", "2"], "--m 2 and --total-budget: the budget chooses m"),
             (["--total-budget", fits_kv, "--windows", "2"], "--windows and --total-budget"),
             (["--total-budget", "lots"], "--total-budget 'lots': expected a size")]
    for extra, message in cases:
        assert main(["convert", "--model", str(tiny_gguf), *extra, "-o", str(out)]) == 2
        assert message in capsys.readouterr().err
        assert not out.exists()


def test_a_hf_model_with_an_imatrix_is_refused_before_any_work(tmp_path, capsys):
    from _convert_helpers import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "tiny-llama")
    out = tmp_path / "out.gguf"
    assert main(["convert", "--model", str(folder), "--total-budget", "5MiB", "--imatrix", "-o", str(out)]) == 2
    assert "--total-budget and --imatrix" in capsys.readouterr().err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["tiny-llama"]


def test_candidates_whose_own_weights_do_not_fit_the_total_are_left_out():
    model = _model()
    found = kv_budget.candidates(model, 8192, 7 << 20, [0, 2, 4, 1, 3])
    assert len(found) >= 2
    heavy, light = found[0], found[1]
    weights = {heavy: 10 << 20, light: 1 << 20} | {c: 1 << 20 for c in found[2:]}
    total = max(c.kv_bytes for c in found) + (2 << 20)
    logged = []
    files = {c: f"{i}.gguf" for i, c in enumerate(found)}
    kept = kv_budget.within_total(files, weights, total, log=logged.append)
    assert heavy not in kept and set(kept) == set(found[1:])
    assert kept[light] == "1.gguf"
    assert len(logged) == 1 and logged[0].startswith(f"kv budget: {heavy.label}: left out, its weights 10.00 MiB")
    # the context's buffers count too: the light one's fit on its weights and cache alone, not with 1 MiB more
    slack = total - weights[light] - light.kv_bytes
    buffers = {c: 0 for c in found} | {light: slack + 1}
    logged.clear()
    kept = kv_budget.within_total(files, weights, total, log=logged.append, buffers=buffers)
    assert light not in kept and heavy not in kept and set(kept) == set(found[2:])
    assert f"kv budget: {light.label}: left out, its weights 1.00 MiB, compute and output buffers " in logged[1]
    assert kv_budget.within_total(files, weights, total, log=logged.append, buffers={light: slack}).keys() == kept.keys() | {light}


@pytest.mark.llama
def test_convert_meets_a_total_budget_as_llama_cpp_loads_and_allocates_it(tiny_gguf, tmp_path, monkeypatch, capsys):
    """The weights, llama.cpp's buffers and 150 KiB of KV cache: the KV share is what --kv-budget 150KiB meets (the
    test above), and each candidate's own weights and buffers count. The chosen file's weights and cache, as
    llama-bench reports them (model_size; the KV cache llama.cpp allocates with the chosen type), and the buffers
    that llama-completion allocates with its cache type, fit the total."""
    from nbl_gguf.gguf.inspect import human_bytes
    from nbl_gguf.measurement.llama_bench import run_llama_bench

    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path / "cache"))
    out, held = tmp_path / "out.gguf", _held(tiny_gguf, 1024)
    total = held.bytes + (150 << 10)
    assert main(["convert", "--model", str(tiny_gguf), "--total-budget", str(total), "--kv-budget-passkey", "off",
                 "--nsamples", "8", "--seqlen", "64", "--no-progress", "--threads", "1", "--eval-chunks", "1",
                 "-o", str(out)]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert (f"total budget: in the stock file the weights take {held.weights / 2 ** 20:,.2f} MiB, llama.cpp's compute "
            f"and output buffers {held.buffers / 2 ** 20:,.2f} MiB at -ub 512, leaving 0.15 MiB for the KV cache at "
            f"1,024 tokens") in captured.err
    assert (f"Total budget {human_bytes(total)} (weights, buffers and KV cache; the stock file's weights "
            f"{human_bytes(held.weights)} and llama.cpp's compute and output buffers {human_bytes(held.buffers)} "
            f"leave 150.00 KiB for the KV cache) at 1,024 tokens") in printed
    lines = [line for line in printed.splitlines() if line.startswith(("    NBL m = ", "    stock, KV", "    stock Q"))]
    left_out = [line for line in printed.splitlines() if ": left out, its weights " in line]
    labels = {line.split("  KV ")[0].strip() for line in lines} | {line.split(": ")[1] for line in left_out}
    # the candidates of --kv-budget 150KiB, less those logged as too heavy, and llama.cpp's weight-type knob: the F32
    # stock file in Q8_0 leaves room for a whole F16 cache
    assert labels == {"NBL m = 3, KV f16", "NBL m = 2, KV q8_0", "NBL m = 2, KV q8_0/q4_0", "stock, KV q4_0",
                      "stock Q8_0, KV f16"}
    for line in lines:  # "weights X  buffers B  total Y" with Y = X + B + KV, within the total
        shown = line.split("  total ")[1].split("iB")[0] + "iB"
        assert kv_budget.parse_size(shown.replace(" ", "")) <= total + 0.01 * 2 ** 10
    chosen = next(line for line in lines if line.endswith("<- chosen"))
    kv_type = chosen.split("KV ")[1].split()[0].rstrip(",")
    records, _ = run_llama_bench(out, n_prompt=16, n_gen=8, depth=1000, repetitions=1, threads=1, backend="cpu",
                                 cache_type=kv_type)
    assert records[0]["kv_cells"] == 1024
    buffers = _allocated_buffers(out, 1024, kv_type=kv_type)
    assert records[0]["model_size"] + (records[0]["kv_mib"] + buffers) * 2 ** 20 <= total + 0.01 * 2 ** 20
    assert records[0]["model_size"] == _weights(out)
    if chosen.startswith("    stock Q8_0"):  # the knob won: the output is the stock model in Q8_0
        assert "no layer replaced: the stock model at Q8_0 with a f16 KV cache" in printed
        assert records[0]["model_size"] < _weights(tiny_gguf) / 3


@pytest.mark.skipif(not (source_dir() / "convert_hf_to_gguf.py").is_file(),
                    reason="pinned llama.cpp source not unpacked (scripts/build_llama.sh)")
def test_a_hf_models_total_budget_takes_the_weights_of_its_stock_file(tmp_path, monkeypatch, capsys):
    """A HF model: the stock file is made first, and the budget's KV share is the total less that file's weights and
    llama.cpp's buffers, here made apart by the pinned converter and llama-quantize (the same tensors whatever the
    intermediate type). 100 KiB of cache at 256 tokens: the stock model needs 256 KiB in F16, 136 KiB in q8_0, 72 KiB
    in q4_0."""
    from _convert_helpers import save_tiny_llama
    from nbl_gguf.gguf.hf_to_gguf import convert_hf_to_gguf
    from nbl_gguf.gguf.inspect import human_bytes
    from nbl_gguf.gguf.quantize import quantize
    from nbl_gguf.measurement.llama_bench import run_llama_bench

    folder = save_tiny_llama(tmp_path / "tiny-llama", n_head=2)  # its tokenizer from the usual cache
    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path / "cache"))
    apart = tmp_path / "apart"
    apart.mkdir()
    held = _held(quantize(convert_hf_to_gguf(folder, apart / "f32.gguf", "f32"), apart / "q8_0.gguf", "q8_0"), 256)
    work = tmp_path / "work"
    work.mkdir()
    out, total = work / "out.gguf", held.bytes + (100 << 10)
    # a total the weights leave too little of: refused by name once they are known, nothing left behind
    assert main(["convert", "--model", str(folder), "--quant", "q8_0", "--total-budget", str(held.bytes + (10 << 10)),
                 "-o", str(out)]) == 2
    assert (f"cannot be met: the weights take {held.weights / 2 ** 20:,.2f} MiB, llama.cpp's compute and output "
            f"buffers {held.buffers / 2 ** 20:,.2f} MiB" in capsys.readouterr().err)
    assert list(work.iterdir()) == []
    assert main(["convert", "--model", str(folder), "--quant", "q8_0", "--total-budget", str(total),
                 "--kv-budget-passkey", "off", "--nsamples", "8", "--seqlen", "64", "--no-progress", "--threads", "1",
                 "--eval-chunks", "1", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (f"the stock file's weights {human_bytes(held.weights)} and llama.cpp's compute and output buffers "
            f"{human_bytes(held.buffers)} leave 100.00 KiB for the KV cache) at 256 tokens" in printed), printed
    stages = [line.split()[0] for line in printed.split("time and memory")[1].splitlines()[1:]]
    assert stages[:3] == ["stock", "quantize", "calibrate"]  # "stock conversion", "quantize stock", then the rest
    assert [p.name for p in work.iterdir()] == ["out.gguf"]  # the stock file's folder is gone
    chosen = next(line for line in printed.splitlines() if line.endswith("<- chosen"))
    kv_type = chosen.split("KV ")[1].split()[0].rstrip(",")
    records, _ = run_llama_bench(out, n_prompt=16, n_gen=8, depth=200, repetitions=1, threads=1, backend="cpu",
                                 cache_type=kv_type)
    assert records[0]["kv_cells"] == 256
    buffers = _allocated_buffers(out, 256, kv_type=kv_type)
    assert records[0]["model_size"] + (records[0]["kv_mib"] + buffers) * 2 ** 20 <= total + 0.01 * 2 ** 20


def test_the_weight_type_down_takes_the_largest_cache_its_lighter_weights_leave_room_for():
    """kv_budget.weight_down: llama.cpp's weight-type knob within a total budget, against the cache sizes by hand."""
    model = _model()
    sizes = {kv_type: kv_budget.kv_bytes(model, 8192, kv_type) for kv_type in kv_budget.KV_TYPES}
    buffers = {kv_type: 1 << 20 for kv_type in kv_budget.KV_TYPES}
    weights = 5 << 20
    # room for a q8_0 cache and not an F16 one: q8_0, the largest that fits
    total = weights + (1 << 20) + sizes["q8_0"]
    found = kv_budget.weight_down(model, 8192, total, "Q3_K_M", weights, buffers)
    assert (found.kv_type, found.kv_bytes, found.weight_type, found.is_stock) == ("q8_0", sizes["q8_0"], "Q3_K_M", True)
    assert found.label == "stock Q3_K_M, KV q8_0"
    # a larger buffer with that cache type tips it to the next one down
    tipped = kv_budget.weight_down(model, 8192, total, "Q3_K_M", weights, buffers | {"q8_0": (1 << 20) + 1})
    assert tipped.kv_type == "q8_0/q4_0"
    # the stock file at its own type fits with a q8_0 cache already: the lighter weights buy nothing
    assert kv_budget.weight_down(model, 8192, total, "Q3_K_M", weights, buffers, stock_types=["q8_0"]) is None
    # nothing fits
    assert kv_budget.weight_down(model, 8192, weights + (1 << 20) + sizes["q4_0"] - 1, "Q3_K_M", weights,
                                 buffers) is None


@pytest.mark.skipif(not (source_dir() / "convert_hf_to_gguf.py").is_file(),
                    reason="pinned llama.cpp source not unpacked (scripts/build_llama.sh)")
def test_a_hf_models_weight_type_down_is_quantized_from_its_float_file(tmp_path):
    """convert.make_stock(also=...): the budget's weight-type knob of a HF model is quantized from the same float
    file as the stock file, as a user makes it with llama.cpp, not requantized from the stock file: its tensors
    are those of llama-quantize on the float file made apart, and differ from a requantization's."""
    import argparse
    import contextlib

    import gguf

    from _convert_helpers import save_tiny_llama
    from nbl_gguf.commands.convert import make_stock
    from nbl_gguf.gguf.hf_to_gguf import convert_hf_to_gguf, default_intermediate
    from nbl_gguf.gguf.quantize import quantize
    from nbl_gguf.model_source import resolve_model

    folder = save_tiny_llama(tmp_path / "tiny-llama", n_head=2)
    work, apart = tmp_path / "work", tmp_path / "apart"
    work.mkdir()
    apart.mkdir()
    args = argparse.Namespace(intermediate=None, imatrix=False, threads=1)
    stock, imatrix = make_stock(args, resolve_model(str(folder)), "q8_0", None, work,
                                lambda name: contextlib.nullcontext(), also="q4_0")
    assert imatrix is None and sorted(p.name for p in work.iterdir()) == ["stock-q4_0.gguf", "stock-q8_0.gguf"]
    floats = convert_hf_to_gguf(folder, apart / "float.gguf", default_intermediate(folder))
    from_float = quantize(floats, apart / "q4_0.gguf", "q4_0")
    requantized = quantize(stock, apart / "requantized.gguf", "q4_0", extra_args=["--allow-requantize"])

    def tensors(path):
        return {t.name: bytes(t.data.tobytes()) for t in gguf.GGUFReader(path).tensors}

    made = tensors(work / "stock-q4_0.gguf")
    assert made == tensors(from_float)
    assert made != tensors(requantized)
