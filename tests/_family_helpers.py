"""Tiny random models of each supported family (tests of the converter and of the calibrator)."""

from __future__ import annotations

import json
from pathlib import Path

N_LAYER, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 4, 64, 4, 2, 16

# family: (config class, model class, GGUF architecture, extra config)
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "qwen3", dict(tie_word_embeddings=False, head_dim=HEAD_DIM)),
    "mistral": ("MistralConfig", "MistralForCausalLM", "llama", dict(tie_word_embeddings=False, sliding_window=None)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "llama", dict(tie_word_embeddings=False, sliding_window=None,
                                                                    num_local_experts=4, num_experts_per_tok=2)),
    # partial rotary as in Phi-4-mini; the converter wants original_max_position_embeddings
    "phi3": ("Phi3Config", "Phi3ForCausalLM", "phi3", dict(tie_word_embeddings=False, partial_rotary_factor=0.5,
                                                          original_max_position_embeddings=256)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", "smollm3", dict(tie_word_embeddings=True)),  # NoPE every 4th layer
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "gemma2", dict(tie_word_embeddings=True, head_dim=HEAD_DIM,
                                                                 query_pre_attn_scalar=HEAD_DIM, sliding_window=512)),
    # sliding-window layers (iSWA cache) with a window longer than the test; llama.cpp scales Q by 1/sqrt(head_dim)
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", "gemma3", dict(tie_word_embeddings=True, head_dim=HEAD_DIM,
                                                                           query_pre_attn_scalar=HEAD_DIM,
                                                                           sliding_window=512)),
    # image-text Gemma 3 (4B and up): the same decoder, nested beside a vision tower (see family_config)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForConditionalGeneration", "gemma3", dict(head_dim=HEAD_DIM,
                                                                                    query_pre_attn_scalar=HEAD_DIM,
                                                                                    sliding_window=512)),
}


def family_config(family: str, tokenizer, **overrides):
    """The tiny config of the family; ``overrides`` replace its settings (e.g. a longer context)."""
    import transformers

    config_name, _, _, extra = FAMILIES[family]
    settings = dict(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=N_LAYER,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256, rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id, **extra)
    config = getattr(transformers, config_name)(**{**settings, **overrides})
    if family == "gemma3":
        vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=32, patch_size=8)
        config = transformers.Gemma3Config(text_config=config.to_dict(), vision_config=vision.to_dict(),
                                           mm_tokens_per_image=4, image_token_index=len(tokenizer) - 1,
                                           bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                           pad_token_id=tokenizer.eos_token_id)
    return config


def random_family_model(family: str, tokenizer, seed: int = 0, **overrides):
    """A random model of the family, norms and biases perturbed (init leaves norms at 1 and biases at
    0, so that a dropped Q/K norm or bias would not show)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family][1])(family_config(family, tokenizer, **overrides)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(0.2 * torch.randn_like(param))
    return model


def sentencepiece_model(texts) -> bytes:
    """A small byte-fallback SentencePiece model. transformers 5 picks the tokenizer class from the
    model type (Qwen2Tokenizer for qwen2/qwen3), which re-tokenizes SmolLM2's vocabulary in a way the
    pinned converter's BPE fingerprint table does not know; with a tokenizer.model present, the
    converter takes the vocabulary from it instead, as for a SentencePiece model, without that check."""
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=model, vocab_size=400,
                                             model_type="bpe", byte_fallback=True, minloglevel=2,
                                             # llama.cpp looks this token up in a model named phi3
                                             user_defined_symbols=["<|endoftext|>"])
    return model.getvalue()


def tiny_family_model(family: str, root: Path, spm: bytes, **overrides) -> Path:
    from transformers import AutoTokenizer

    from nbl_gguf import models

    tokenizer = AutoTokenizer.from_pretrained(models.default_model_dir())
    model = random_family_model(family, tokenizer, **overrides)
    path = root / f"tiny-{family}"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)  # the calibrator's tokenizer; llama.cpp is fed token ids here
    (path / "tokenizer.model").write_bytes(spm)
    # the Phi-3 converter lays the HF added tokens over the SentencePiece ids, which would clobber
    # the byte tokens of this small vocabulary (real Phi-3 checkpoints add theirs after it)
    for name, key, empty in (("tokenizer.json", "added_tokens", []), ("tokenizer_config.json", "added_tokens_decoder", {})):
        content = json.loads((path / name).read_text(encoding="utf-8"))
        content[key] = empty
        (path / name).write_text(json.dumps(content), encoding="utf-8")
    return path
