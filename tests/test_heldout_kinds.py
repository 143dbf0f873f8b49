"""Held-out text of three kinds (issue 22): the bundled Python documentation and Python code beside
C4, their parts, the script that makes them, the held-out windows of layer selection drawn from a mix
of the kinds, and the KV cache saving the selection reports, against independent references (the
bundled files read directly, token windows cut by hand, KV bytes by hand)."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import re
import tarfile
from importlib import resources
from pathlib import Path

import pytest

from nbl_gguf.calibration import dataset
from nbl_gguf.errors import NblError

ROOT = Path(__file__).resolve().parent.parent
FILES = {"prose": "python-docs.json", "code": "python-code.json"}


def raw_documents(kind: str) -> list[dict]:
    return json.loads(resources.files("nbl_gguf").joinpath("data", FILES[kind]).read_text(encoding="utf-8"))


# --- the bundled texts -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["prose", "code"])
def test_each_kind_has_a_selection_and_an_evaluation_part_that_never_overlap(kind):
    documents = raw_documents(kind)
    parts = {part: [d for d in documents if d["part"] == part] for part in ("selection", "evaluation")}
    assert len(parts["selection"]) + len(parts["evaluation"]) == len(documents)
    # alternating documents: the parts come from the same pages or modules' spread, never the same one
    assert [d["part"] for d in documents] == ["selection", "evaluation"] * (len(documents) // 2) + \
        ["selection"] * (len(documents) % 2)
    assert not {d["source"] for d in parts["selection"]} & {d["source"] for d in parts["evaluation"]}
    for part, docs in parts.items():
        assert dataset.kind_texts(kind, part) == [d["text"] for d in docs]
        # enough for the summary (8 chunks of 512) and for 4 selection windows of 2048 of one kind
        assert sum(len(d["text"]) for d in docs) > 50_000
    evaluation = dataset.evaluation_text(kind)
    assert all(d["text"] in evaluation for d in parts["evaluation"])
    assert not any(d["text"][:200] in evaluation for d in parts["selection"])


def test_c4_parts_are_the_calibration_slice_and_the_rest():
    texts = [d["text"] for d in json.loads(resources.files("nbl_gguf").joinpath("data", "c4-sample.json")
                                          .read_text(encoding="utf-8"))]
    assert dataset.kind_texts("c4", "selection") == texts[:256] == list(dataset.iter_texts(None))
    assert dataset.kind_texts("c4", "evaluation") == texts[256:] == dataset.heldout_texts()
    assert dataset.evaluation_text("c4") == dataset.heldout_text()
    with pytest.raises(NblError, match="unknown kind of text 'wiki'"):
        dataset.kind_texts("wiki", "evaluation")


def test_the_readme_names_the_files_as_they_are_and_the_license_is_shipped():
    readme = (ROOT / "nbl_gguf" / "data" / "README.md").read_text(encoding="utf-8")
    for name in FILES.values():
        digest = hashlib.sha256((ROOT / "nbl_gguf" / "data" / name).read_bytes()).hexdigest()
        assert re.search(rf"`{re.escape(name)}`\s+`{digest}`", readme), f"README's sha256 of {name} is stale"
    license_text = (ROOT / "nbl_gguf" / "data" / "PSF-LICENSE.txt").read_text(encoding="utf-8")
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in license_text
    assert "Python Software Foundation;\nAll Rights Reserved" in license_text


def load_script():
    from nbl_gguf.calibration import bundled_text

    return bundled_text


def fake_deb(path: Path, files: dict[str, bytes]) -> Path:
    """A .deb as dpkg-deb builds one: an ar archive of debian-binary, control.tar.xz and data.tar.xz."""
    def tar_xz(members):
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for name, data in members.items():
                info = tarfile.TarInfo("./" + name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return lzma.compress(buffer.getvalue())

    blob = b"!<arch>\n"
    for name, data in (("debian-binary", b"2.0\n"), ("control.tar.xz", tar_xz({"control": b"Package: x\n"})),
                       ("data.tar.xz", tar_xz(files))):
        blob += f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n".encode() + data
        blob += b"\n" if len(data) % 2 else b""
    path.write_bytes(blob)
    return path


def test_the_script_strips_the_markup_and_cuts_at_boundaries(tmp_path):
    script = load_script()
    page = ("<html><body><nav><p>site menu</p></nav><div class='body' role='main'><section>"
            "<h1>Sorting HOW TO<a class='headerlink' href='#s'>¶</a></h1>"
            "<nav class='contents'><ul><li><p><a href='#a'>Basics</a></p></li></ul></nav>"
            "<p>Python lists have a   built-in <code>list.sort()</code>\nmethod.</p>"
            "<ul><li><p>one</p></li><li>two</li></ul>"
            "<div class='highlight'><pre>&gt;&gt;&gt; sorted([5, 2])\n[2, 5]\n</pre></div>"
            "<script>var x;</script></section></div><div class='footer'>Copyright</div></body></html>")
    parser = script.BodyText()
    parser.feed(page)
    assert parser.text() == ("Sorting HOW TO\n\nPython lists have a built-in list.sort() method.\n\n- one\n\n- two"
                             "\n\n>>> sorted([5, 2])\n[2, 5]")
    assert script.cut("aa\n\nbb\n\ncc", 7, re.compile(r"\n\n")) == "aa\n\nbb"
    assert script.cut("def f():\n    return 1\ndef g():\n    pass\n", 30, re.compile(r"\n(?=\S)")) == \
        "def f():\n    return 1"
    deb = fake_deb(tmp_path / "x.deb", {"usr/lib/python3.11/m.py": b"import os\n\ndef f():\n    return 1\n"})
    files = script.deb_members(deb)
    assert files == {"usr/lib/python3.11/m.py": b"import os\n\ndef f():\n    return 1\n"}
    # a module is taken from its first top-level def or class; too little code leaves it out
    assert script.code_documents(files, 40) == [{"text": "def f():\n    return 1", "source": "m.py"}]
    assert script.code_documents(files, 1000) == []


# --- the mix ---------------------------------------------------------------------------------------------

def test_windows_are_shared_in_the_stated_proportions():
    equal = dataset.parse_selection_text("mix")
    assert equal == {"calibration": 1, "prose": 1, "code": 1}
    assert dataset.mix_windows(equal, 4) == {"calibration": 2, "prose": 1, "code": 1}
    assert dataset.mix_windows(equal, 6) == {"calibration": 2, "prose": 2, "code": 2}
    assert dataset.mix_windows(equal, 16) == {"calibration": 6, "prose": 5, "code": 5}
    assert dataset.mix_windows(equal, 1) == {"calibration": 1, "prose": 0, "code": 0}
    assert dataset.mix_windows(dataset.parse_selection_text("calibration"), 4) == {"calibration": 4}
    weighted = dataset.parse_selection_text("calibration:2,prose:1,code:1")
    assert dataset.mix_windows(weighted, 8) == {"calibration": 4, "prose": 2, "code": 2}
    assert dataset.mix_windows(dataset.parse_selection_text("code:3,prose"), 4) == {"code": 3, "prose": 1}
    for bad in ("wiki:1", "prose:x", "prose:-1", "prose:1,prose:2", "prose:0,code:0", ""):
        with pytest.raises(NblError, match="--selection-text"):
            dataset.parse_selection_text(bad)


def windows_by_hand(tokenizer, texts, first: int, count: int, seqlen: int) -> list[list[int]]:
    """Windows ``first`` .. ``first + count - 1`` of the documents joined with EOS, cut by hand."""
    stream: list[int] = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if stream:
            stream.append(tokenizer.eos_token_id)
        stream.extend(ids)
        if len(stream) >= (first + count) * seqlen:
            break
    return [stream[i * seqlen:(i + 1) * seqlen] for i in range(first, first + count)]


@pytest.fixture(scope="module")
def embedded_prepared():
    from transformers import AutoConfig, AutoTokenizer

    from types import SimpleNamespace

    from nbl_gguf import models

    folder = models.default_model_dir()
    config = AutoConfig.from_pretrained(folder)
    # what load_windows reads of the layer stream (calibration.stream.LayerStream), without its weights
    return SimpleNamespace(config=config, tokenizer=AutoTokenizer.from_pretrained(folder), device="cpu",
                           hidden_size=config.hidden_size)


def window_args(**overrides) -> argparse.Namespace:
    from nbl_gguf.commands import calibrate

    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_the_mixed_held_out_windows_come_from_each_kind(embedded_prepared):
    from nbl_gguf.calibration.dataset import load_windows

    tokenizer, seqlen, fit = embedded_prepared.tokenizer, 256, 3
    calib, heldout, made_of = load_windows(window_args(seqlen=seqlen, selection_windows=6, selection_text="mix"),
                                           embedded_prepared, True, fit)
    assert calib.nsamples == fit and heldout.shape == (6, seqlen)
    assert made_of["windows"] == {"calibration": 2, "prose": 2, "code": 2}
    c4 = dataset.kind_texts("c4", "selection")
    assert calib.input_ids.tolist() == windows_by_hand(tokenizer, c4, 0, fit, seqlen)
    # the calibration text's windows right after the fit windows, then each kind's first windows
    assert heldout[:2].tolist() == windows_by_hand(tokenizer, c4, fit, 2, seqlen)
    for rows, kind in ((slice(2, 4), "prose"), (slice(4, 6), "code")):
        selection = [d["text"] for d in raw_documents(kind) if d["part"] == "selection"]
        assert heldout[rows].tolist() == windows_by_hand(tokenizer, selection, 0, 2, seqlen)
        assert made_of["bundled"][kind]["windows"] == 2
    # nothing of a kind's evaluation part is measured: no window's text is in it
    for kind in ("prose", "code"):
        evaluation = dataset.evaluation_text(kind)
        for row in heldout[2:].tolist():
            assert tokenizer.decode(row[40:80]) not in evaluation

    _, only_c4, made_of = load_windows(window_args(seqlen=seqlen, selection_windows=6, selection_text="calibration"),
                                       embedded_prepared, True, fit)
    assert only_c4.tolist() == windows_by_hand(tokenizer, c4, fit, 6, seqlen) and made_of["windows"] == {"calibration": 6}
    _, weighted, made_of = load_windows(window_args(seqlen=seqlen, selection_windows=4, selection_text="code:3,prose:1"),
                                        embedded_prepared, True, fit)
    code = [d["text"] for d in raw_documents("code") if d["part"] == "selection"]
    assert made_of["windows"] == {"code": 3, "prose": 1} and weighted[1:].tolist() == windows_by_hand(tokenizer, code, 0, 3, seqlen)
    with pytest.raises(NblError, match=r"the bundled Python docs held out for layer selection gives \d+ windows of 2048 "
                                       r"tokens, fewer than the 30"):
        load_windows(window_args(seqlen=2048, selection_windows=90, selection_text="mix"), embedded_prepared, True, fit)
    assert load_windows(window_args(seqlen=seqlen), embedded_prepared, False, fit)[1:] == (None, None)
    # the default (docs/results/selection-text.md): the mix
    _, default, made_of = load_windows(window_args(seqlen=seqlen, selection_windows=6), embedded_prepared, True, fit)
    assert made_of["windows"] == {"calibration": 2, "prose": 2, "code": 2} and default.tolist() == heldout.tolist()


# --- the KV cache saving of the selection --------------------------------------------------------------------

GEMMA_LAYERS, WINDOW = 7, 512  # gemma3: layer 5 global (llama.cpp's pattern 6), the others slide over 512 tokens


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    from transformers import AutoTokenizer

    from nbl_gguf import models

    from _family_helpers import family_config

    tokenizer = AutoTokenizer.from_pretrained(models.default_model_dir())
    config = family_config("gemma3_text", tokenizer)
    config.num_hidden_layers = GEMMA_LAYERS
    config.layer_types = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(GEMMA_LAYERS)]
    import torch
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("gemma3") / "tiny-gemma3"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_best_reports_the_kv_saving_of_its_layers_as_llama_cpp_allocates_it(tiny_gemma3, capsys):
    from nbl_gguf.commands import calibrate
    from nbl_gguf.calibration.artifact import load_artifact

    from _family_helpers import HEAD_DIM, KV_HEADS

    out = tiny_gemma3.parent / "calibration"
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_gemma3), "--nsamples", "8", "--seqlen", "64", "--targets", "attn",
                              "--m", "2", "--selection-windows", "18", "--selection-text", "mix", "--ctx-size", "8192", "--device", "cpu",
                              "--no-progress", "-o", str(out)])
    assert calibrate.run(args) == 0
    selection = load_artifact(out).report["selection"]
    assert selection["heldout_text"]["windows"] == {"calibration": 6, "prose": 6, "code": 6}
    assert selection["heldout"]["heldout_tokens"] == 18 * 63

    # by hand: a cell of a layer holds K and V of 2 heads x 16 dims in F16; the global layer caches
    # all 8,192 tokens, a sliding one pad256(min(8192, window 512 + micro-batch 512)) = 1,024 cells
    cell = 2 * KV_HEADS * HEAD_DIM * 2

    def cells(layer):
        return 8192 if layer == 5 else 1024

    stock = sum(cells(layer) for layer in range(GEMMA_LAYERS)) * cell
    kv = selection["kv_cache"]
    assert kv["n_ctx"] == 8192 and kv["stock"]["bytes"] == stock == (8192 + 6 * 1024) * cell
    assert kv["nbl"]["bytes"] == stock - sum(cells(layer) for layer in selection["layers"]) * cell
    assert kv["nbl"]["caches"]["global"]["layers"] == 1 - (5 in selection["layers"])
    for criterion, entry in selection["heldout"]["compared"].items():
        assert kv["compared"][criterion] == stock - sum(cells(layer) for layer in entry["layers"]) * cell
    printed = capsys.readouterr().out
    mib = 2 ** 20
    assert (f"KV cache at 8,192 tokens (F16, as llama-cli allocates it): {stock / mib:,.2f} MiB -> "
            f"{kv['nbl']['bytes'] / mib:,.2f} MiB") in printed
    assert "sliding-window layers (1,024 cells each): 6 -> " in printed
    assert "6 windows of the calibration text, 6 windows of Python docs, 6 windows of Python code" in printed


def test_the_kv_model_of_a_config_follows_llama_cpp():
    """Sliding layers as llama.cpp makes them from what the pinned converter writes (the GGUF side is
    tested against libllama in test_kv_cache, and against each converted family in test_convert_families)."""
    from nbl_gguf.kv_cache import model_from_config, training_context_from_config

    base = dict(num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=1, hidden_size=640, head_dim=256,
                sliding_window=512, max_position_embeddings=32768)
    gemma3 = model_from_config({"model_type": "gemma3_text", **base})
    assert [i for i, layer in enumerate(gemma3.layers) if not layer.sliding] == [5, 11] and gemma3.window == 512
    assert gemma3.layers[0].k_width == gemma3.layers[0].v_width == 256
    # image-text Gemma 3: the decoder's config is nested; llama.cpp ignores the config's own layer_types
    nested = model_from_config({"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", **base, "layer_types": ["full_attention"] * 12}})
    assert nested == gemma3 and training_context_from_config({"text_config": base}) == 32768
    assert not model_from_config({"model_type": "gemma3_text", **base, "sliding_window_pattern": 1}).has_sliding
    gemma2 = model_from_config({"model_type": "gemma2", **{**base, "sliding_window": None}})
    assert gemma2.window == 4096 and [layer.sliding for layer in gemma2.layers[:4]] == [True, False, True, False]
    # Mistral and Qwen2 configs name a window that llama.cpp does not apply
    for model_type in ("mistral", "qwen2"):
        assert not model_from_config({"model_type": model_type, **base}).has_sliding
    llama = model_from_config({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 9,
                               "num_key_value_heads": 3, "hidden_size": 576})
    assert llama.layers[0].k_width == 3 * 64
    with pytest.raises(NblError, match="hidden_size"):
        model_from_config({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 9})
