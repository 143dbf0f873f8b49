"""Shared by the convert tests."""

from __future__ import annotations

import argparse
from pathlib import Path


def convert_args(**overrides) -> argparse.Namespace:
    """`convert`'s defaults as its parser gives them, no progress bars, a tiny CPU calibration (8 windows
    of 64 tokens), the cca selection (the tests compare against artifact.layer_types(m, "cca")), per-token
    maps (--taps 1: the layer type these tests check; tests/test_taps_convert.py has the taps layers and
    the default), the LMMSE maps (--no-refine: the maps these tests compare with the artifact's;
    tests/test_refine.py has the refined ones and convert's default) and no held-out perplexity unless
    overridden."""
    from nbl_gguf.commands import convert

    return convert.options(**(dict(no_progress=True, nsamples=8, seqlen=64, device="cpu", criterion="cca",
                                   no_eval=True, taps=1, refine=False) | overrides))


def calibrate_for_convert(directory: Path, model, args: argparse.Namespace) -> Path:
    """The calibration that `convert` with ``args`` runs, into ``directory``; returns it."""
    from nbl_gguf.calibration.calibrate import calibrate
    from nbl_gguf.commands.convert import calibration_settings

    return calibrate(calibration_settings(args, directory, model, args.taps))


def save_tiny_llama(path: Path, n_layer: int = 4, seed: int = 0, n_head: int = 4) -> Path:
    """A tiny random LlamaForCausalLM (d=64, 2 KV heads) with the embedded SmolLM2 tokenizer (which the pinned
    converter recognizes), saved as a HF folder at ``path``. ``n_head=2`` gives heads of 32 values, which
    llama.cpp's quantized KV caches need (a block of 32 a row)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from nbl_gguf import models

    tokenizer = AutoTokenizer.from_pretrained(models.default_model_dir())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=n_layer,
                         num_attention_heads=n_head, num_key_value_heads=2, max_position_embeddings=256,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def rewritten_gguf(src: Path, dst: Path, *, arch: str | None = None, keys: dict | None = None,
                   extra_tensor: str | None = None) -> Path:
    """``src`` copied to ``dst`` as another converter might have written it: with every '<old arch>.' key renamed
    to '<arch>.', the ``keys`` ({name: (value, gguf value type)}) added, and a tensor ``extra_tensor`` of 8 floats."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    old = str(reader.fields["general.architecture"].contents())
    arch = arch or old
    writer = gguf.GGUFWriter(dst, arch=arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        key = arch + field.name[len(old):] if field.name.startswith(old + ".") else field.name
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for name, (value, value_type) in (keys or {}).items():
        writer.add_key_value(name, value, value_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    if extra_tensor:
        writer.add_tensor(extra_tensor, np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
