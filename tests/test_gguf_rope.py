"""A GGUF's rope scaling told to transformers (nbl_gguf.gguf_rope): the llama3 numbers recovered from the
factors against transformers' own llama3 rotation, and tiny Llamas with a llama3, a linear or a YaRN scaling converted
by the pinned convert_hf_to_gguf.py (rope_freqs.weight, or the scaling keys) against llama.cpp's logits, where
transformers' own GGUF loader rotates differently."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from nbl_gguf.errors import NblError
from nbl_gguf.gguf_rope import llama3_factors, llama3_from_factors, rope_scaling
from nbl_gguf.llamacpp.tools import bin_dir, source_dir

# Llama 3.1 8B's and Llama 3.2 1B's rotary settings, and a tiny model's whose ramp holds one frequency
LLAMA3 = {
    "3.1-8b": dict(base=500000.0, n_dims=128, factor=8.0, original=8192),
    "3.2-1b": dict(base=500000.0, n_dims=64, factor=32.0, original=8192),
    "tiny": dict(base=500000.0, n_dims=16, factor=32.0, original=256),
}


def transformers_inv_freq(base: float, n_dims: int, scaling: dict | None) -> np.ndarray:
    """transformers' own inverse frequencies for a Llama config with this rotation (the reference)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=n_dims * 4, num_attention_heads=4, rope_theta=base,
                         max_position_embeddings=131072, rope_scaling=dict(scaling) if scaling else None)
    return LlamaRotaryEmbedding(config=config).inv_freq.double().numpy()


@pytest.mark.parametrize("name", list(LLAMA3))
def test_llama3_numbers_are_recovered_from_the_factors_transformers_rotates_by(name):
    s = LLAMA3[name]
    scaling = {"rope_type": "llama3", "factor": s["factor"], "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": s["original"]}
    # the file's factors: the frequencies llama.cpp divides, as transformers' llama3 rotation has them
    factors = (transformers_inv_freq(s["base"], s["n_dims"], None)
               / transformers_inv_freq(s["base"], s["n_dims"], scaling)).astype(np.float32)
    assert factors.max() == pytest.approx(s["factor"]) and factors.min() == pytest.approx(1.0)
    np.testing.assert_allclose(llama3_factors(s["base"], s["n_dims"], s["factor"], 1.0, 4.0, s["original"]), factors,
                               rtol=1e-6)
    recovered = llama3_from_factors(factors, s["base"], s["n_dims"])
    assert recovered == scaling
    np.testing.assert_allclose(transformers_inv_freq(s["base"], s["n_dims"], recovered),
                               transformers_inv_freq(s["base"], s["n_dims"], scaling), rtol=1e-12)


def test_other_llama3_numbers_and_a_ramp_of_no_frequency():
    # low and high other than Llama 3's: recovered up to the common scale, the same rotation
    factors = llama3_factors(10000.0, 64, 4.0, 2.0, 8.0, 4096)
    recovered = llama3_from_factors(factors, 10000.0, 64)
    np.testing.assert_allclose(transformers_inv_freq(10000.0, 64, recovered),
                               transformers_inv_freq(10000.0, 64, {"rope_type": "llama3", "factor": 4.0,
                                                                   "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                                                                   "original_max_position_embeddings": 4096}),
                               rtol=1e-6)
    # every factor 1 or the full factor: any context between the two bands gives it
    wavelen = 2 * np.pi * 10000.0 ** (np.arange(0, 16, 2) / 16)
    factors = np.where(wavelen > 40, 8.0, 1.0).astype(np.float32)
    assert not ((factors > 1) & (factors < 8)).any()
    recovered = llama3_from_factors(factors, 10000.0, 16)
    np.testing.assert_array_equal(llama3_factors(10000.0, 16, 8.0, recovered["low_freq_factor"],
                                                 recovered["high_freq_factor"],
                                                 recovered["original_max_position_embeddings"]), factors)
    assert llama3_from_factors(np.ones(8, dtype=np.float32), 10000.0, 16) is None


@pytest.mark.parametrize("factors, message", [
    (np.ones(7), "holds 7 factors; the rotary dimensions \\(16\\) need 8"),
    (np.array([1, 1, 0.5, 2, 2, 2, 2, 2]), "factors from 0.5 to 2: not a llama3 rope scaling"),
    (np.array([1, 3, 1, 3, 1, 3, 1, 3]), "matches no llama3 rope scaling"),
])
def test_factors_of_no_llama3_scaling_are_refused(factors, message):
    with pytest.raises(NblError, match=message):
        llama3_from_factors(np.asarray(factors, dtype=np.float32), 10000.0, 16)


# --- a Llama-3-style GGUF through the pinned converter and llama.cpp ---------------------------------------

needs_build = pytest.mark.skipif(not (source_dir() / "convert_hf_to_gguf.py").is_file()
                                 or not (bin_dir() / "llama-perplexity").is_file(),
                                 reason="needs the patched llama.cpp build (scripts/build_llama.sh)")
TINY = LLAMA3["tiny"]


LLAMA3_SCALING = {"rope_type": "llama3", "factor": TINY["factor"], "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": TINY["original"]}


def scaled_llama_gguf(root: Path, scaling: dict) -> Path:
    """The F32 GGUF, by the pinned convert_hf_to_gguf.py, of a tiny random Llama whose config has ``scaling``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from nbl_gguf import models

    tokenizer = AutoTokenizer.from_pretrained(models.default_model_dir())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, rope_theta=TINY["base"], rope_scaling=dict(scaling))
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "hf")
    tokenizer.save_pretrained(root / "hf")
    path = root / "scaled.gguf"
    subprocess.run([sys.executable, str(source_dir() / "convert_hf_to_gguf.py"), str(root / "hf"), "--outtype", "f32",
                    "--outfile", str(path)], check=True, capture_output=True)
    return path


@pytest.fixture(scope="module")
def llama3_gguf(tmp_path_factory):
    return scaled_llama_gguf(tmp_path_factory.mktemp("llama3"), LLAMA3_SCALING)


def llama_cpp_logits(path: Path, tokens: list[int]) -> np.ndarray:
    from nbl_gguf.llamacpp import library

    llm, _ = library.load_model(path, n_ctx=1024, logits_all=True, f32_kv=True)
    return library.logits(llm, tokens)


def hf_logits(model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].double().numpy()


@needs_build
@pytest.mark.parametrize("scaling", [LLAMA3_SCALING, {"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}],
                         ids=["llama3", "linear", "yarn"])
def test_a_scaled_gguf_is_calibrated_on_the_model_llama_cpp_runs(scaling, tmp_path, monkeypatch):
    """The dequantized checkpoint, and the layer stream's rotation, of a GGUF with a rope scaling (llama3's
    rope_freqs.weight, or linear's or YaRN's keys): llama.cpp's logits 600 tokens in, where transformers' own GGUF load
    (no scaling) is far off them."""
    from transformers import AutoModelForCausalLM

    from nbl_gguf import models
    from nbl_gguf.calibration.stream import LayerStream
    from nbl_gguf.gguf_header import read_header
    from nbl_gguf.model_source import resolve_model

    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path / "cache"))
    gguf_path = scaled_llama_gguf(tmp_path, scaling)
    assert rope_scaling(read_header(gguf_path)) == scaling
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, 1000, 600)]
    want = llama_cpp_logits(gguf_path, tokens)
    scale = np.abs(want).max()

    unscaled = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                    dtype=torch.float32).eval()
    assert np.abs(hf_logits(unscaled, tokens) - want).max() > 1e-4 * scale  # what the scaling is worth here

    source = resolve_model(str(gguf_path))
    model = models.load_model(str(source.hf_folder()), dtype="float32", device="cpu").model.eval()
    assert np.abs(hf_logits(model, tokens) - want).max() < 1e-5 * scale

    # the layer stream (calibration, best, windows) rotates by llama.cpp's frequencies: base^(-2i/d) / factor_i
    stream = LayerStream(source, torch.float32, "cpu")
    if scaling["rope_type"] == "yarn":  # its ramp of frequencies is transformers' own (the logits checked above)
        assert stream.base.rotary_emb.rope_type == "yarn"
        np.testing.assert_allclose(stream.base.rotary_emb.inv_freq.double().numpy(),
                                   transformers_inv_freq(TINY["base"], TINY["n_dims"], scaling), rtol=1e-6)
        return
    factors = llama3_factors(TINY["base"], TINY["n_dims"], TINY["factor"], 1.0, 4.0, TINY["original"]) \
        if scaling["rope_type"] == "llama3" else np.full(TINY["n_dims"] // 2, scaling["factor"])
    expected = 1.0 / (TINY["base"] ** (np.arange(0, TINY["n_dims"], 2) / TINY["n_dims"])) / factors
    np.testing.assert_allclose(stream.base.rotary_emb.inv_freq.double().numpy(), expected, rtol=1e-6)


@needs_build
def test_a_checkpoint_dequantized_without_the_scaling_is_made_again(llama3_gguf, tmp_path, monkeypatch):
    """A folder cached before the scaling was read (its config without it) is not trusted: made again."""
    import json

    from transformers import AutoConfig

    from nbl_gguf.gguf_header import read_header
    from nbl_gguf.gguf_rope import holds_scaling
    from nbl_gguf.model_source import resolve_model

    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path / "cache"))
    gguf_path = llama3_gguf
    folder = resolve_model(str(gguf_path)).hf_folder()
    config = json.loads((folder / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling"):
        config.pop(key, None)
    config["rope_theta"] = TINY["base"]
    (folder / "config.json").write_text(json.dumps(config))
    assert holds_scaling(AutoConfig.from_pretrained(str(folder)), None)
    again = resolve_model(str(gguf_path)).hf_folder()
    assert again == folder
    assert holds_scaling(AutoConfig.from_pretrained(str(again)), rope_scaling(read_header(gguf_path)))


@needs_build
@pytest.mark.parametrize("keys, tensor, message", [
    ({"llama.rope.scaling.type": ("yarn", 8)}, None,
     "asks llama.cpp for yarn rope scaling without llama.rope.scaling.original_context_length"),
    ({"llama.rope.scaling.type": ("yarn", 8), "llama.rope.scaling.original_context_length": (1024, 4),
      "llama.rope.scaling.yarn_beta_fast": (16.0, 6)}, None,
     "asks llama.cpp for yarn rope scaling with settings of its own \\(llama.rope.scaling.yarn_beta_fast\\)"),
    ({"llama.rope.scaling.type": ("su", 8)}, None, "asks llama.cpp for su rope scaling"),
    ({}, "rope_factors_long.weight", "carries LongRoPE factors \\(rope_factors_long.weight\\)"),
])
def test_a_rope_scaling_transformers_cannot_be_told_is_refused_by_name(llama3_gguf, tmp_path, keys, tensor, message):
    import gguf
    from _convert_helpers import rewritten_gguf

    from nbl_gguf.model_source import read_gguf

    gguf_path = llama3_gguf
    keys = {name: (value, gguf.GGUFValueType(value_type)) for name, (value, value_type) in keys.items()}
    path = rewritten_gguf(gguf_path, tmp_path / "other.gguf", keys=keys, extra_tensor=tensor)
    with pytest.raises(NblError, match=f"--model {path}: it {message}.*Calibrate from the model's HF checkpoint"):
        read_gguf(path)
    read_gguf(path, calibrating=False)  # a file only measured or rewritten is not refused
