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
        return type("P", (), {"ppl": (10.0 if text.name == "c4.txt" else 5.0) * (1 + change[path.name] / 100)})()

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
