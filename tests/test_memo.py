"""measurement.memo: measurements kept on disk under what they measured, and a budget's measuring run again
after an interruption, which measures only what it had not (tested against an uninterrupted run)."""

from __future__ import annotations

import pytest

from nbl_gguf.kv_cache import KvLayer, KvModel
from nbl_gguf.measurement import kv_budget
from nbl_gguf.measurement.memo import Memo, file_key


def test_a_value_is_kept_under_its_key_and_no_other(tmp_path):
    memo = Memo(tmp_path / "memo")
    key = {"what": "llama-perplexity", "file": "abc", "n_ctx": 4096, "kv_type": "q8_0"}
    assert memo.get(key) is None
    memo.put(key, {"value": 12.5, "s": 3.0})
    assert Memo(tmp_path / "memo").get(dict(key)) == {"value": 12.5, "s": 3.0}
    for field, other in (("file", "abd"), ("n_ctx", 2048), ("kv_type", "f16")):
        assert memo.get(key | {field: other}) is None
    assert not list((tmp_path / "memo").glob("*.part"))  # written by rename
    nothing = Memo(None)
    nothing.put(key, 1)
    assert nothing.get(key) is None and nothing.cached(key, lambda: 2) == (2, False)
    assert memo.cached(key, lambda: pytest.fail("measured again")) == ({"value": 12.5, "s": 3.0}, True)


def test_an_unreadable_entry_is_measured_again(tmp_path):
    memo = Memo(tmp_path)
    key = {"what": "passkey", "file": "abc"}
    memo.put(key, 3)
    entry = next(tmp_path.glob("*.json"))
    entry.write_text('{"key": {"what": "passkey", "file": "ab')  # cut off by a crash mid-write (not by rename)
    assert memo.get(key) is None and memo.cached(key, lambda: 4) == (4, False) and memo.get(key) == 4


def test_a_cache_that_cannot_be_written_costs_the_resume_not_the_run(tmp_path, capsys):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    memo = Memo(blocked / "memo")  # below a file: no folder can be made there
    assert memo.cached({"what": "x"}, lambda: 5) == (5, False)
    assert "a measurement was not kept" in capsys.readouterr().err
    assert memo.cached({"what": "y"}, lambda: 6) == (6, False) and capsys.readouterr().err == ""  # said once


def test_a_files_key_is_its_content(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF" + bytes(100))
    b.write_bytes(b"GGUF" + bytes(100))
    assert file_key(a) == file_key(b)  # the same bytes under another name
    b.write_bytes(b"GGUF" + bytes(99) + b"\x01")
    assert file_key(a) != file_key(b)


def _candidates():
    model = KvModel(layers=tuple(KvLayer(w, w) for w in (256, 64, 256, 64, 128)))
    return kv_budget.candidates(model, 32768, 40 * 10 ** 6, [3, 1, 4, 0], [2, 0, 4, 1, 3], [(512, 4)])


@pytest.mark.parametrize("passkeys", [False, True])
def test_a_budgets_measuring_run_again_after_an_interruption_measures_only_the_rest(tmp_path, monkeypatch, passkeys):
    """Killed after three candidates' perplexities; the run again measures the others only, and chooses what an
    uninterrupted run without the memo chose, from the same numbers."""
    from nbl_gguf.llamacpp import perplexity as llama_perplexity
    from nbl_gguf.measurement import passkey as passkey_module

    found = _candidates()
    assert len(found) >= 5
    texts = {}
    for kind in ("c4", "code"):
        texts[kind] = tmp_path / f"{kind}.txt"
        texts[kind].write_text(f"{kind} text " * 50)
    files = {}
    for i, candidate in enumerate(found):
        files[candidate] = tmp_path / f"c{i}.gguf"
        files[candidate].write_bytes(f"file {i}".encode())
    stock = tmp_path / "stock.gguf"
    stock.write_bytes(b"stock")
    change = {stock.name: 0.0} | {path.name: (7 * i) % 5 + 0.5 * i for i, path in enumerate(files.values())}
    calls, interrupt_at = [], [None]

    def fake_perplexity(path, text, *, cache_type, **_):
        calls.append(("ppl", path.name, text.name, cache_type))
        if len(calls) == interrupt_at[0]:
            raise KeyboardInterrupt
        return llama_perplexity.Perplexity((10.0 if text.name == "c4.txt" else 5.0) * (1 + change[path.name] / 100),
                                           0.1, 1, 4096)

    def fake_passkey(path, lengths, depths, *, kv_type, threads):
        calls.append(("passkey", path.name, kv_type))
        keys = 1 if path.name in ("c0.gguf", "c1.gguf", "c2.gguf") else len(depths)
        return passkey_module.PasskeyResult([passkey_module.Trial(lengths[0], d, 1, 10, "1" if i < keys else "x")
                                             for i, d in enumerate(depths)])

    monkeypatch.setattr(llama_perplexity, "perplexity", fake_perplexity)
    monkeypatch.setattr(passkey_module, "passkey", fake_passkey)
    depths = (0.2, 0.8) if passkeys else ()

    def measure(memo, log=lambda *_: None):
        base, measured, stock_found = kv_budget.measure(stock, files, texts, 4096, 1, 2, log=log, recall_depths=depths,
                                                        memo=memo)
        return base, [(r.candidate, r.perplexity, r.change_pct, r.found) for r in measured], stock_found

    reference = measure(None)
    everything = list(calls)
    calls.clear()
    memo = Memo(tmp_path / "memo")
    # stock's two texts (and its passkey), then three candidates' two texts each: killed in the fourth's second
    interrupt_at[0] = 2 + (1 if passkeys else 0) + 3 * 2 + 2
    with pytest.raises(KeyboardInterrupt):
        measure(memo)
    before = list(calls[:-1])  # the interrupted call kept nothing
    calls.clear()
    interrupt_at[0] = None
    lines = []
    assert measure(memo, log=lines.append) == reference
    ppl_calls = [c for c in calls if c[0] == "ppl"]
    assert sorted(ppl_calls + [c for c in before if c[0] == "ppl"]) == sorted(c for c in everything if c[0] == "ppl")
    assert not set(ppl_calls) & set(before)
    assert [c for c in calls if c[0] == "passkey"] == [c for c in everything if c[0] == "passkey"][1 if passkeys else 0:]
    kept = [line for line in lines if line.endswith("(kept from an earlier run)")]
    labels = [c.label for c in found]
    assert [line.split(": ")[1] for line in kept if "held-out perplexity" in line] == labels[:3]
    assert any(f"3 candidates measured by an earlier run; the {len(found) - 3} candidates'" in line for line in lines)
    # all kept now: nothing runs, and a changed file is measured again
    calls.clear()
    assert measure(memo) == reference and calls == []
    first = next(iter(files.values()))
    first.write_bytes(b"file 0, rewritten")
    measure(memo)
    assert {c[1] for c in calls} == {"c0.gguf"}


def test_an_entry_of_an_earlier_form_is_measured_again(tmp_path, monkeypatch):
    """Entries of the first memo version held a perplexity as a bare number under the same fields; one is not
    taken (it would be misread): measured again."""
    from nbl_gguf.llamacpp import perplexity as llama_perplexity
    from nbl_gguf.measurement.kept_runs import KeptRuns

    model, text = tmp_path / "m.gguf", tmp_path / "t.txt"
    model.write_bytes(b"model")
    text.write_text("text " * 20)
    calls = []
    monkeypatch.setattr(llama_perplexity, "perplexity",
                        lambda path, text, **k: calls.append(k) or llama_perplexity.Perplexity(7.5, 0.2, 2, 512))
    monkeypatch.setattr("nbl_gguf.measurement.kept_runs.llama_build_key", lambda: [["llama-perplexity", 1, 2]])
    runs = KeptRuns(Memo(tmp_path / "memo"), threads=2)
    # the key kv_budget.measure wrote it under then (these fields, no form), with a bare number
    old = {"what": "llama-perplexity", "file": file_key(model), "kv_type": "q8_0", "n_ctx": 512, "threads": 2,
           "build": [["llama-perplexity", 1, 2]], "text": file_key(text), "chunks": 2}
    runs.memo.put(old, {"value": 9.25, "s": 3.0})
    assert not runs.has_perplexity(model, text, 512, 2, "q8_0")
    first = runs.perplexity(model, text, 512, 2, "q8_0")
    assert not first.kept and first.value.ppl == 7.5 and calls == [{"n_ctx": 512, "chunks": 2, "threads": 2,
                                                                    "cache_type": "q8_0"}]
    again = KeptRuns(Memo(tmp_path / "memo"), threads=2).perplexity(model, text, 512, 2, "q8_0")
    assert again.kept and again.value == first.value and len(calls) == 1
    # another thread count, cache type or context is another measurement
    for other in (KeptRuns(Memo(tmp_path / "memo"), threads=1).perplexity(model, text, 512, 2, "q8_0"),
                  runs.perplexity(model, text, 512, 2, "f16"), runs.perplexity(model, text, 1024, 2, "q8_0")):
        assert not other.kept
    assert len(calls) == 4


def test_a_frontier_run_again_measures_only_the_perplexities_and_passkeys_it_had_not(tmp_path, monkeypatch):
    """bench --frontier's measuring killed in its fourth variant's perplexities, then run again: the second run
    measures the rest only, and every speed again (speeds compare within one run); its rows equal those of an
    uninterrupted run without the memo."""
    from nbl_gguf.llamacpp import perplexity as llama_perplexity
    from nbl_gguf.measurement import frontier
    from nbl_gguf.measurement import llama_bench
    from nbl_gguf.measurement import passkey as passkey_module

    variants = []
    for i, (group, kv_type) in enumerate([(frontier.STOCK, "f16"), (frontier.STOCK, "q8_0"), (frontier.KNOB, "f16"),
                                          (frontier.NBL, "f16"), (frontier.NBL, "q4_0")]):
        path = tmp_path / f"v{i if kv_type == 'f16' else i - 1}.gguf"
        path.write_bytes(f"variant {path.name}".encode())
        variants.append(frontier.Variant(f"v{i}", group, path, kv_type))
    texts = {kind: tmp_path / f"{kind}.txt" for kind in ("c4", "code")}
    for kind, path in texts.items():
        path.write_text(f"{kind} " * 40)
    calls, interrupt_at = [], [None]

    def fake_perplexity(path, text, *, n_ctx, chunks, threads, cache_type):
        calls.append(("ppl", path.name, text.name, n_ctx, cache_type))
        if len(calls) == interrupt_at[0]:
            raise KeyboardInterrupt
        return llama_perplexity.Perplexity(len(path.name + text.name + cache_type) + n_ctx / 1000, 0.1, chunks, n_ctx)

    def fake_passkey(path, lengths, depths, *, kv_type, threads):
        calls.append(("passkey", path.name, kv_type))
        return passkey_module.PasskeyResult([passkey_module.Trial(lengths[0], d, 12345, 10, "12345" if i % 2 else "no")
                                             for i, d in enumerate(depths)])

    def fake_bench(path, *, n_prompt, n_gen, depth, cache_type, **_):
        calls.append(("bench", path.name, cache_type, depth))
        return [{"test": "pp", "avg_ts": 100.0, "depth": depth}, {"test": "tg", "avg_ts": 10.0, "depth": depth}], \
            ["llama-bench", "-m", str(path)]

    monkeypatch.setattr(llama_perplexity, "perplexity", fake_perplexity)
    monkeypatch.setattr(passkey_module, "passkey", fake_passkey)
    monkeypatch.setattr(llama_bench, "run_llama_bench", fake_bench)
    monkeypatch.setattr("nbl_gguf.measurement.kept_runs.llama_build_key", lambda: [["llama-perplexity", 1, 2]])
    monkeypatch.setattr(frontier, "kv_bytes", lambda path, kv_type, n_ctx, readers=None: 1000)
    settings = frontier.FrontierSettings(short_ctx=64, long_ctx=256, depths=(0, 128), threads=2, passkey=(200,))

    def measure(memo):
        rows, raw = frontier.measure(variants, texts, settings, lambda *_: None, memo=memo)
        return [(r.label, r.perplexity, r.tokens, r.passkey, r.speed) for r in rows], raw

    reference, raw = measure(None)
    assert raw["kept"] == {"perplexity": [], "passkey": []}
    everything = list(calls)
    calls.clear()
    memo = Memo(tmp_path / "memo")
    interrupt_at[0] = 3 * 4 + 2  # 2 contexts x 2 kinds a variant: killed in the fourth's second
    with pytest.raises(KeyboardInterrupt):
        measure(memo)
    before = calls[:-1]
    calls.clear()
    interrupt_at[0] = None
    rows, raw = measure(memo)
    assert rows == reference
    assert raw["kept"] == {"perplexity": ["v0", "v1", "v2"], "passkey": []}
    assert sorted(c for c in calls if c[0] == "ppl") == sorted(set(c for c in everything if c[0] == "ppl") - set(before))
    assert [c for c in calls if c[0] != "ppl"] == [c for c in everything if c[0] != "ppl"]
    # all kept now: only the speeds are measured; --remeasure (no memo) measures everything
    calls.clear()
    rows, raw = measure(memo)
    assert rows == reference and {c[0] for c in calls} == {"bench"}
    assert raw["kept"] == {"perplexity": [v.label for v in variants], "passkey": [v.label for v in variants]}
    calls.clear()
    assert measure(None)[0] == reference and calls == everything
