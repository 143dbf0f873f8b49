"""Tiny random Llama models and tokenizers for the calibrator tests (CPU, seconds)."""

from __future__ import annotations

import torch


def tiny_config(layers: int = 3, hidden: int = 32, vocab: int = 97, **overrides):
    from transformers import LlamaConfig

    options = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    options.update(overrides)
    return LlamaConfig(**options)


def tiny_model(layers: int = 3, hidden: int = 32, seed: int = 0, **overrides):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(layers, hidden, **overrides)).eval()
    # Random init leaves norms at 1 and small weights; perturb so layers differ from each other.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    model.config.use_cache = False
    return model


def word_tokenizer(texts):
    """A whitespace word-level fast tokenizer with an EOS token, built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for t in texts for w in t.split()})
    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, "[UNK]": 3}
    vocab.update({w: i + 4 for i, w in enumerate(words)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="[EOS]", bos_token="[BOS]",
                                   unk_token="[UNK]", pad_token="[PAD]")


def sample_texts(count: int = 40, words: int = 30, seed: int = 0):
    import random

    rng = random.Random(seed)
    lexicon = [f"w{i}" for i in range(60)]
    return [" ".join(rng.choice(lexicon) for _ in range(words)) for _ in range(count)]


def write_checkpoint(root, layers: int, texts: int, words: int):
    """``root``/model (a tiny model and the word tokenizer of its text, saved as HF does) and
    ``root``/data.jsonl (``texts`` documents of ``words`` words): what the calibrate command reads."""
    import json

    documents = sample_texts(texts, words)
    tokenizer = word_tokenizer(documents)
    tiny_model(layers=layers, vocab=len(tokenizer)).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in documents))
    return root


def run_calibrate(*argv):
    """The calibrate command with layers chosen by cosine (the default, best, measures the model on held-out
    windows: tests/test_calibrate_select.py) on fp32 activations, which the maps are checked against."""
    import argparse

    from nbl_gguf.commands import calibrate

    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    return calibrate.run(parser.parse_args(["--criterion", "cosine", "--dtype", "fp32"] + [str(a) for a in argv]))
