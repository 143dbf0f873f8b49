"""The embedded SmolLM2-135M-Instruct becomes a plain HF checkpoint that reloads and predicts."""

import json

import pytest
import torch


@pytest.mark.slow
def test_default_model_dir_is_a_plain_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path))
    from nbl_gguf.models import default_model_dir, load_model

    path = default_model_dir()
    assert path == tmp_path / "models" / "SmolLM2-135M-Instruct"
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    assert not [p for p in tmp_path.joinpath("models").iterdir() if p.name.startswith(".")]  # no temp left
    assert default_model_dir() == path  # second call reuses the cache

    loaded = load_model(str(path), "fp32", "cpu")
    assert loaded.config.model_type == "llama" and loaded.config.num_hidden_layers == 30
    ids = loaded.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = loaded.model(ids).logits
    assert torch.isfinite(logits).all()
    assert loaded.tokenizer.decode(logits[0, -1].argmax()).strip() == "Paris"
    # Low perplexity on ordinary text shows the dequantized weights are sane.
    text = loaded.tokenizer("The quick brown fox jumps over the lazy dog. " * 4, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = loaded.model(text, labels=text).loss
    assert float(loss) < 3.0
