"""`convert` on each supported HF family (tiny random models with the SmolLM2 tokenizer): the patched
llama.cpp running the F32 NBL GGUF must give the logits of the HF model with the same layers replaced
in PyTorch (apply_nbl), which is an implementation independent of llama.cpp's graph.

Families other than llama exercise what is specific to them: Qwen2's Q/K/V biases and tied output,
Qwen3's per-head Q/K norms (tensors that must leave the file with the attention), Mistral's conversion
to the llama architecture, Mixtral's experts behind an NBL attention, Phi-3's fused QKV projection and
partial rotary embedding, SmolLM3's layers without RoPE, Gemma 2/3's norm after the attention (part of
the replaced block: Y is taken after it, and it leaves the file with the attention), their
sliding-window caches and Gemma 2's attention logit soft-capping.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from _convert_helpers import calibrate_for_convert, convert_args, rewritten_gguf
from _family_helpers import FAMILIES, N_LAYER, sentencepiece_model, tiny_family_model
from nbl_gguf.gguf import nbl_format
from nbl_gguf.errors import NblError
from nbl_gguf.llamacpp.tools import bin_dir, source_dir

pytestmark = [
    pytest.mark.llama,
    pytest.mark.skipif(not (source_dir() / "convert_hf_to_gguf.py").is_file() or not (bin_dir() / "llama-quantize").is_file(),
                       reason="needs the patched llama.cpp build (scripts/build_llama.sh)"),
]

M = 2
TOLERANCE = 2e-3  # relative to the largest reference logit


@pytest.fixture(scope="module")
def spm():
    from nbl_gguf.calibration.dataset import heldout_texts

    return sentencepiece_model(heldout_texts())


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, spm, tmp_path_factory):
    """A tiny model of the family and one calibration of it (shared by both methods)."""
    from nbl_gguf.calibration.artifact import load_artifact

    root = tmp_path_factory.mktemp(request.param)
    model_dir = tiny_family_model(request.param, root, spm)
    artifact_dir = calibrate_for_convert(root / "calibration", model_dir, convert_args(model=str(model_dir), m=M))
    return request.param, model_dir, artifact_dir, load_artifact(artifact_dir)


@pytest.mark.parametrize("method", ["attn-nbl", "attn-drop"])
def test_nbl_gguf_logits_match_pytorch(family, method, tmp_path):
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    from nbl_gguf import models
    from nbl_gguf.llamacpp import library
    from nbl_gguf.calibration.apply import apply_nbl
    from nbl_gguf.commands.convert import convert

    name, model_dir, artifact_dir, artifact = family
    output = tmp_path / f"{name}-{method}.gguf"
    summary = convert(convert_args(model=str(model_dir), calibration=str(artifact_dir), m=M, method=method,
                                   quant="f32", output=str(output)))
    assert len(summary.replaced) == M

    reader = gguf.GGUFReader(output)
    assert str(reader.fields["general.architecture"].contents()) == FAMILIES[name][2]
    layer_type = nbl_format.LINEAR if method == "attn-nbl" else nbl_format.DROPPED
    assert nbl_format.read_layer_types(reader) == [layer_type if i in summary.replaced else nbl_format.ATTENTION
                                                 for i in range(N_LAYER)]
    # a replaced layer keeps its norm and MLP and carries nothing of its attention
    for layer in summary.replaced:
        names = {t.name for t in reader.tensors if nbl_format.layer_of(t.name) == layer}
        assert f"blk.{layer}.attn_norm.weight" in names
        assert names & {f"blk.{layer}.ffn_down.weight", f"blk.{layer}.ffn_down_exps.weight"}
        assert not [n for n in names if nbl_format.is_attention_tensor(n, layer)]
        assert (f"blk.{layer}.attn_nbl.weight" in names) == (method == "attn-nbl")
    kept = [i for i in range(N_LAYER) if i not in summary.replaced]
    if name in ("qwen3", "gemma3_text", "gemma3"):
        assert {f"blk.{i}.attn_q_norm.weight" for i in kept} <= {t.name for t in reader.tensors}
    if name in ("gemma2", "gemma3_text", "gemma3"):
        assert {f"blk.{i}.post_attention_norm.weight" for i in kept} <= {t.name for t in reader.tensors}

    types = artifact.layer_types(M, "cca", method)
    assert [i for i, t in enumerate(types) if t] == summary.replaced
    # the KV cache the calibration reported from the HF config is what llama.cpp reads from the file
    from nbl_gguf.gguf.metadata import kv_sizes, stock_kv_model
    from nbl_gguf.kv_cache import model_from_config

    assert model_from_config(json.loads((model_dir / "config.json").read_text(encoding="utf-8"))) == stock_kv_model(reader)
    reported = artifact.report["selection"]["kv_cache"]
    stock_kv, nbl_kv = kv_sizes(reader, reported["n_ctx"])
    assert (reported["stock"]["bytes"], reported["nbl"]["bytes"]) == (stock_kv.bytes, nbl_kv.bytes)
    reference = apply_nbl(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), types, artifact)
    stock = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = models.text_config(stock.config).vocab_size
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, vocab - 1, 48)]  # the last id: gemma3's image token

    llm, kv = library.load_model(output, n_ctx=64, logits_all=True, f32_kv=True)
    got = library.logits(llm, tokens)
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0].double().numpy()
        want_stock = stock(torch.tensor([tokens])).logits[0].double().numpy()
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= TOLERANCE * scale
    # the comparison can tell the NBL model from the stock one
    assert np.abs(want_stock - want).max() > 20 * TOLERANCE * scale
    assert kv is not None and kv.layers == N_LAYER - M


def test_convert_rejects_an_architecture_llama_cpp_cannot_run(tmp_path, capsys):
    from transformers import GPT2Config

    from nbl_gguf import cli

    folder = tmp_path / "gpt2"
    GPT2Config(n_layer=2, n_embd=32, n_head=2).save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"")
    output = tmp_path / "out.gguf"
    assert cli.main(["convert", "--model", str(folder), "-o", str(output)]) != 0
    err = capsys.readouterr().err
    assert "unsupported architecture 'gpt2'" in err and "qwen3" in err
    assert not output.exists()


def _as_architecture(src: Path, dst: Path, arch: str) -> Path:
    """``src`` with every '<old arch>.' key renamed to '<arch>.', as if another converter had made it."""
    return rewritten_gguf(src, dst, arch=arch)


def test_unsupported_architectures_are_named_by_writer_and_loader(tmp_path):
    from nbl_gguf.llamacpp import library
    from nbl_gguf.fixtures.tiny import TinyLlama

    model = TinyLlama(n_layer=3)
    types = [nbl_format.ATTENTION, nbl_format.LINEAR, nbl_format.ATTENTION]
    nbl = model.write_nbl_gguf(tmp_path / "llama-nbl.gguf", types, model.random_linear([1]))
    stock = model.write_gguf(tmp_path / "llama.gguf")

    with pytest.raises(NblError, match=r"is a 'granite' model; the patched llama.cpp runs NBL layers for llama, qwen2, qwen3"):
        nbl_format.write_nbl_gguf(_as_architecture(stock, tmp_path / "granite.gguf", "granite"), tmp_path / "out.gguf",
                                nbl_format.NblLayers(types=types, linear=model.random_linear([1])))
    assert not (tmp_path / "out.gguf").exists()

    # a file from elsewhere that marks layers of an architecture without NBL support: refused by name,
    # before llama.cpp looks for the attention tensors the file does not carry
    with pytest.raises(NblError, match=r"granite.nbl.layer_types: NBL layers are not supported for architecture 'granite'"):
        library.load_model(_as_architecture(nbl, tmp_path / "granite-nbl.gguf", "granite"), n_ctx=64)


def test_python_and_llama_cpp_agree_on_the_supported_architectures():
    import re

    from nbl_gguf.models import ADAPTERS

    source = (source_dir() / "src" / "llama-arch.cpp").read_text(encoding="utf-8")
    body = re.search(r"bool llm_arch_supports_nbl\(const llm_arch & arch\) \{(.*?)\n\}", source, re.S).group(1)
    names = re.search(r"LLM_ARCH_NAMES = \{(.*?)\n\};", source, re.S).group(1)
    arch_names = dict(re.findall(r"\{\s*(LLM_ARCH_\w+),\s*\"([\w-]+)\"\s*\}", names))
    in_cpp = {arch_names[case] for case in re.findall(r"case (LLM_ARCH_\w+):", body)}
    assert in_cpp == set(nbl_format.SUPPORTED_ARCHITECTURES)
    assert {adapter.gguf_arch for adapter in ADAPTERS.values()} == in_cpp


# a family of each architecture that builds window layers (mistral's is llama; qwen3, phi3 and smollm3 since
# patch 0019), qwen2 also without replaced layers
WINDOW_CASES = [("mistral", M), ("qwen2", M), ("qwen2", 0), ("qwen3", M), ("phi3", M), ("smollm3", M)]


def test_window_cases_cover_every_window_architecture():
    assert {FAMILIES[family][2] for family, _ in WINDOW_CASES} == set(nbl_format.WINDOW_ARCHITECTURES)


@pytest.mark.parametrize("family, m", WINDOW_CASES, indirect=["family"])
def test_window_layers_logits_match_pytorch(family, m, tmp_path):
    """convert --windows on top of the replaced layers: the chosen window layers are attention layers
    in the file, and llama.cpp's iSWA graph (cache bounded to the window: swa_full off) gives the logits
    of the HF model with those layers' masks narrowed (apply.WindowAttention)."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    from nbl_gguf.calibration.apply import ATTN_WINDOW, apply_nbl
    from nbl_gguf.commands.convert import convert
    from nbl_gguf.llamacpp import library

    name, model_dir, artifact_dir, artifact = family
    output = tmp_path / f"{name}-windows.gguf"
    summary = convert(convert_args(model=str(model_dir), calibration=str(artifact_dir), m=m, quant="f32",
                                   windows=2, window_size=8, window_sinks=2, window_ctx=128, output=str(output)))
    windows = nbl_format.read_windows(gguf.GGUFReader(output))
    assert windows.size == 8 and windows.sinks == 2 and len(windows.layers) == 2
    assert not set(windows.layers) & set(summary.replaced)
    assert summary.windows["layers"] == list(windows.layers)
    walk = summary.windows["retrieval"]  # the retrieval probes' walk (--window-retrieval's default)
    assert set(walk["kept"]) <= set(windows.layers) and len(walk["kept"]) + len(walk["refused"]) >= 2
    assert "retrieval: 6 facts hidden" in summary.table()
    assert summary.windows["ranking"] == "loss" and "chosen by the perplexity each costs alone" in summary.table()

    types = artifact.layer_types(m, "cca", "attn-nbl") if m else [0] * N_LAYER
    assert len(summary.replaced) == m
    reference = apply_nbl(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), types, artifact)
    full = apply_nbl(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), types, artifact)
    apply_nbl(reference, {i: ATTN_WINDOW for i in windows.layers}, {i: windows for i in windows.layers})
    tokens = [int(t) for t in np.random.default_rng(4).integers(0, 1000, 48)]
    llm, _ = library.load_model(output, n_ctx=64, logits_all=True, f32_kv=True, swa_full=False)
    got = library.logits(llm, tokens)
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0].double().numpy()
        want_full = full(torch.tensor([tokens])).logits[0].double().numpy()
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= TOLERANCE * scale
    assert np.abs(want_full - want).max() > 20 * TOLERANCE * scale  # the windows show in the logits


@pytest.mark.parametrize("family", ["qwen2"], indirect=True)
def test_window_layers_alone_run_no_calibration(family, tmp_path, monkeypatch):
    """convert --m 0 --windows N fits no map, so it calibrates nothing: the file is the one the same convert
    makes when handed a calibration (the same window layers, every tensor and the layer types to the byte),
    and it records the model and the tools it was made with, not a calibration's data."""
    import gguf

    from nbl_gguf.calibration import calibrate as calibrate_module
    from nbl_gguf.commands.convert import convert

    name, model_dir, artifact_dir, _ = family
    options = dict(model=str(model_dir), m=0, quant="f32", windows=2, window_size=8, window_sinks=2, window_ctx=128)
    # each its own cache: the window choice is kept there, and the second must measure its own
    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path / "cache-given"))
    given = convert(convert_args(**options, calibration=str(artifact_dir), output=str(tmp_path / "given.gguf")))

    def no_calibration(*_args, **_kwargs):
        raise AssertionError("a window-only convert calibrated")

    monkeypatch.setattr(calibrate_module, "calibrate", no_calibration)
    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path / "cache-alone"))
    alone = convert(convert_args(**options, output=str(tmp_path / "alone.gguf")))
    assert not any(stage.startswith("calibrate") or stage == "load calibration" for stage in alone.resources)
    assert alone.windows["layers"] == given.windows["layers"] and len(alone.windows["layers"]) == 2
    assert alone.replaced == given.replaced == []

    readers = {path: gguf.GGUFReader(tmp_path / path) for path in ("alone.gguf", "given.gguf")}
    tensors = {path: {t.name: bytes(t.data.tobytes()) for t in reader.tensors} for path, reader in readers.items()}
    assert tensors["alone.gguf"] == tensors["given.gguf"]
    for reader in readers.values():
        assert nbl_format.read_layer_types(reader) == [nbl_format.ATTENTION] * N_LAYER
    assert nbl_format.read_windows(readers["alone.gguf"]) == nbl_format.read_windows(readers["given.gguf"])
    record = json.loads(str(readers["alone.gguf"].fields[nbl_format.CALIBRATION_KEY].contents()))
    assert record["model"] == model_dir.name and record["versions"]["nbl_gguf"]
    assert not {"dataset", "nsamples", "tokens", "selection"} & set(record)
    from nbl_gguf.gguf.inspect import describe, format_text

    text = format_text(describe(tmp_path / "alone.gguf"))
    assert f"0 of {N_LAYER} attention layers replaced" in text and "windows:       2 layers" in text
    assert f"calibration:   model      {model_dir.name}\n" in text
    assert "scores:" not in text and "method:" not in text  # no map: nothing was scored or chosen by a method

    # the same convert again (another output, as after an interruption): the choice is the one kept, not measured
    from nbl_gguf.calibration import windows as windows_module

    def not_measured(*_args, **_kwargs):
        raise AssertionError("the window choice was measured again")

    monkeypatch.setattr(windows_module, "choose_windows", not_measured)
    again = convert(convert_args(**options, output=str(tmp_path / "again.gguf")))
    assert again.windows == alone.windows and again.replaced == []
    reader = gguf.GGUFReader(tmp_path / "again.gguf")
    assert {t.name: bytes(t.data.tobytes()) for t in reader.tensors} == tensors["alone.gguf"]
    assert nbl_format.read_windows(reader) == nbl_format.read_windows(readers["alone.gguf"])
    # on top of replaced layers the choice is another one: measured
    with pytest.raises(AssertionError, match="the window choice was measured again"):
        convert(convert_args(**(options | {"m": 1}), calibration=str(artifact_dir), output=str(tmp_path / "m1.gguf")))


@pytest.mark.parametrize("family", ["qwen2"], indirect=True)
@pytest.mark.parametrize("extra, message", [
    ({}, "--m 0 replaces no layer: give --windows N"),
    ({"windows": 2, "refine": True}, "--refine tunes the maps of the replaced layers, and --m 0 replaces none"),
    ({"windows": 2, "save_calibration": "cal"}, "--m 0 with window layers alone runs no calibration"),
])
def test_m_0_without_a_layer_to_change_is_refused(family, extra, message, tmp_path):
    from nbl_gguf.commands.convert import convert

    _, model_dir, _, _ = family
    output = tmp_path / "out.gguf"
    if "save_calibration" in extra:
        extra = extra | {"save_calibration": str(tmp_path / extra["save_calibration"])}
    with pytest.raises(NblError, match=message):
        convert(convert_args(model=str(model_dir), m=0, quant="f32", window_size=8, window_ctx=128, output=str(output),
                             **extra))
    assert not output.exists() and list(tmp_path.iterdir()) == []
