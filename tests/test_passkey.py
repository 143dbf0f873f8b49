"""Passkey retrieval (measurement.passkey): the prompt's length and the needle's depth, and the test on
the embedded model: it finds the key, and a file whose every layer attends to a narrow window without
sinks does not (so the test can see retrieval killed)."""

from __future__ import annotations

import pytest

from nbl_gguf.errors import NblError
from nbl_gguf.measurement import passkey as pk


def words(text: str) -> int:
    return len(text.split())


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_prompt_fills_the_length_with_the_needle_at_its_depth(depth):
    prompt = pk.build_prompt(words, 2000, depth, 12345)
    assert 2000 - 2 * words(pk.FILLER) < words(prompt) <= 2000
    assert prompt.endswith(pk.QUESTION) and prompt.count("12345") == 2
    body = prompt[len(pk.INTRO):-len(pk.QUESTION)]
    position = body.index(pk.NEEDLE.format(key=12345)) / (len(body) - len(pk.NEEDLE.format(key=12345)))
    assert position == pytest.approx(depth, abs=0.02)


def test_answers_are_scored_on_the_whole_number():
    assert pk.Trial(1024, 0.5, 60494, 1000, " 60494. The").found
    assert not pk.Trial(1024, 0.5, 60494, 1000, " 604941").found
    assert not pk.Trial(1024, 0.5, 60494, 1000, " the pass key").found
    with pytest.raises(NblError, match="no room for filler"):
        pk.build_prompt(words, 30, 0.5, 12345)
    with pytest.raises(NblError, match="depth 1.5"):
        pk.build_prompt(words, 2000, 1.5, 12345)


@pytest.mark.llama
def test_the_embedded_model_finds_the_key_and_a_narrow_window_loses_it(tmp_path, capfd):
    from nbl_gguf.gguf import nbl_format
    from nbl_gguf.llamacpp import tools as llamacpp
    from nbl_gguf.models import embedded_gguf_path

    if not (llamacpp.bin_dir() / "libllama.so").is_file():
        pytest.skip("needs the patched llama.cpp build (scripts/build_llama.sh)")
    stock = embedded_gguf_path()
    capfd.readouterr()
    result = pk.passkey(stock, lengths=(1024,), depths=(0.2, 0.6), threads=2)
    assert result.accuracy(1024) == 1.0, result.report()
    # quietly: no model metadata, chat template or timings from llama.cpp (a convert's --kv-budget runs this)
    assert capfd.readouterr() == ("", "")
    narrow = nbl_format.write_nbl_gguf(stock, tmp_path / "narrow.gguf", nbl_format.NblLayers(
        types=[nbl_format.ATTENTION] * 30, windows=nbl_format.Windows(tuple(range(30)), size=32, sinks=0)))
    lost = pk.passkey(narrow, lengths=(1024,), depths=(0.2, 0.6), threads=2)
    assert lost.accuracy(1024) == 0.0, lost.report()
    assert [t.prompt_tokens for t in lost.trials] == [t.prompt_tokens for t in result.trials]


@pytest.mark.llama
def test_eval_passkey_reports_each_file_with_its_cache_type(tmp_path, capsys, monkeypatch):
    """`eval --passkey --cache-type`: the same trials as the library call (same keys, same answers) for the
    stock file and for a narrow-window one, the cache type passed to both, and the table's found / asked."""
    import json

    from nbl_gguf.cli import main
    from nbl_gguf.gguf import nbl_format
    from nbl_gguf.llamacpp import tools as llamacpp
    from nbl_gguf.models import embedded_gguf_path

    if not (llamacpp.bin_dir() / "libllama.so").is_file():
        pytest.skip("needs the patched llama.cpp build (scripts/build_llama.sh)")
    stock = embedded_gguf_path()
    narrow = nbl_format.write_nbl_gguf(stock, tmp_path / "narrow.gguf", nbl_format.NblLayers(
        types=[nbl_format.ATTENTION] * 30, windows=nbl_format.Windows(tuple(range(30)), size=32, sinks=0)))
    kv_types = []
    library_call = pk.passkey

    def spy(*args, **kwargs):
        kv_types.append(kwargs.get("kv_type"))
        return library_call(*args, **kwargs)

    monkeypatch.setattr(pk, "passkey", spy)
    out = tmp_path / "eval.json"
    assert main(["eval", str(stock), str(narrow), "--no-ppl", "--passkey", "1024", "--passkey-depths", "0.2,0.6",
                 "--cache-type", "q8_0", "-t", "2", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert kv_types == ["q8_0", "q8_0"]
    results = json.loads(out.read_text())
    for result, model in zip(results, (stock, narrow)):
        expected = library_call(model, lengths=(1024,), depths=(0.2, 0.6), kv_type="q8_0", threads=2).report()
        assert result["passkey"] == expected
    assert results[0]["passkey"]["accuracy"] == {"1024": 1.0} and results[1]["passkey"]["accuracy"] == {"1024": 0.0}
    assert "| passkey @1024 |" in printed and "| 2/2 |" in printed and "| 0/2 |" in printed
    assert "KV cache: q8_0" in printed


@pytest.mark.llama
def test_an_answer_of_bytes_that_never_complete_a_character_ends_after_its_tokens(tmp_path):
    """A random tiny model answers with byte tokens that never end a UTF-8 character: the answer is still
    ANSWER_TOKENS tokens (llama-cpp-python's create_completion, counting characters, kept generating until the
    context was full: 'llama_decode returned 1')."""
    from nbl_gguf.fixtures.tiny import TinyLlama
    from nbl_gguf.llamacpp import tools as llamacpp

    if not (llamacpp.bin_dir() / "libllama.so").is_file():
        pytest.skip("needs the patched llama.cpp build (scripts/build_llama.sh)")
    model = TinyLlama(n_layer=2, n_head=2, n_head_kv=1, n_ctx_train=2048).write_gguf(tmp_path / "tiny.gguf")
    result = pk.passkey(model, lengths=(768,), depths=(0.5,), threads=1)
    (trial,) = result.trials
    assert trial.prompt_tokens <= 768 and not trial.found
    assert "\ufffd" in trial.answer and len(trial.answer.encode("utf-8")) <= 3 * pk.ANSWER_TOKENS
