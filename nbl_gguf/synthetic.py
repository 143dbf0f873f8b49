"""Real-shape llama models with random weights, for speed measurements at scale.

Speed does not depend on weight values, so a model of Llama 3.1 8B's shape made locally times like
the real one. The stock GGUF is written directly with gguf-py (Q8_0 blocks of random int8 with a
fixed scale, or F16), then llama-quantize makes the requested quant; the NBL variant replaces the
attention of the chosen layers by a random W, b (gguf_nbl.write_nbl_gguf) and is quantized the
same way. The tokenizer is the byte-level SPM vocabulary of nbl_gguf.tiny padded to the vocabulary
size: llama-bench feeds random token ids and never tokenizes text.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nbl_gguf.errors import NblError
from nbl_gguf.tiny import add_byte_vocab, add_llama_header, random_linear


@dataclass(frozen=True)
class Shape:
    name: str
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    tied: bool  # output head shares token_embd
    rope_base: float
    n_ctx_train: int

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


SHAPES = {
    s.name: s for s in (
        Shape("llama-3.1-8b", 4096, 32, 32, 8, 14336, 128256, False, 500000.0, 131072),
        Shape("llama-3.2-1b", 2048, 16, 32, 8, 8192, 128256, True, 500000.0, 131072),
        Shape("smollm2-135m", 576, 30, 9, 3, 1536, 49152, True, 100000.0, 8192),
    )
}

Q8_0_BLOCK = 32
Q8_0_BYTES = 34  # f16 scale + 32 int8
UNIFORM_INT8_STD = 73.9  # std of integers uniform on [-128, 127]


def get_shape(name: str) -> Shape:
    if name not in SHAPES:
        raise NblError(f"unknown --shape '{name}' (use one of {', '.join(SHAPES)})")
    return SHAPES[name]


def default_layers(shape: Shape, m: int) -> list[int]:
    """The m layers before the last one: CCA selections favour late layers, and speed does not care."""
    if not 0 < m < shape.n_layer:
        raise NblError(f"--m {m} is out of range for {shape.name} ({shape.n_layer} layers): use 1..{shape.n_layer - 1}")
    return list(range(shape.n_layer - 1 - m, shape.n_layer - 1))


def tensor_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """name -> numpy shape (rows = output features) of a llama model of this shape."""
    d, hd = shape.n_embd, shape.head_dim
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (shape.n_vocab, d), "output_norm.weight": (d,)}
    if not shape.tied:
        out["output.weight"] = (shape.n_vocab, d)
    for i in range(shape.n_layer):
        out[f"blk.{i}.attn_norm.weight"] = (d,)
        out[f"blk.{i}.attn_q.weight"] = (shape.n_head * hd, d)
        out[f"blk.{i}.attn_k.weight"] = (shape.n_head_kv * hd, d)
        out[f"blk.{i}.attn_v.weight"] = (shape.n_head_kv * hd, d)
        out[f"blk.{i}.attn_output.weight"] = (d, shape.n_head * hd)
        out[f"blk.{i}.ffn_norm.weight"] = (d,)
        out[f"blk.{i}.ffn_gate.weight"] = (shape.n_ff, d)
        out[f"blk.{i}.ffn_up.weight"] = (shape.n_ff, d)
        out[f"blk.{i}.ffn_down.weight"] = (d, shape.n_ff)
    return out


def _random_q8_0(rng: np.random.Generator, rows: int, cols: int, std: float) -> np.ndarray:
    """Q8_0 bytes [rows, cols/32*34] of a random matrix with about this standard deviation."""
    blocks = cols // Q8_0_BLOCK
    out = np.empty((rows, blocks, Q8_0_BYTES), dtype=np.uint8)
    out[:, :, :2] = np.frombuffer(np.float16(std / UNIFORM_INT8_STD).tobytes(), dtype=np.uint8)
    out[:, :, 2:] = np.frombuffer(rng.bytes(rows * blocks * Q8_0_BLOCK), dtype=np.uint8).reshape(rows, blocks, Q8_0_BLOCK)
    return out.reshape(rows, blocks * Q8_0_BYTES)


def _random_tensor(rng, name: str, numpy_shape: tuple[int, ...], base: str):
    """(data, GGMLQuantizationType) of one tensor: norms F32 ones, matrices Q8_0 or F16."""
    import gguf

    if len(numpy_shape) == 1:
        return np.ones(numpy_shape, dtype=np.float32), gguf.GGMLQuantizationType.F32
    rows, cols = numpy_shape
    std = 1.0 if name == "token_embd.weight" else cols ** -0.5
    if base == "Q8_0":
        if cols % Q8_0_BLOCK:
            raise NblError(f"{name}: {cols} columns are not a multiple of {Q8_0_BLOCK}")
        return _random_q8_0(rng, rows, cols, std), gguf.GGMLQuantizationType.Q8_0
    data = np.empty(numpy_shape, dtype=np.float16)
    step = max(1, (1 << 24) // cols)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        data[start:stop] = rng.standard_normal((stop - start, cols), dtype=np.float32) * std
    return data, gguf.GGMLQuantizationType.F16


def write_random_gguf(shape: Shape, path: str | os.PathLike, base: str = "Q8_0", seed: int = 0) -> Path:
    """The stock GGUF of ``shape`` with random weights, ``base`` Q8_0 or F16; written tensor by tensor."""
    import gguf

    from nbl_gguf.gguf_nbl import atomic_output

    base = base.upper()
    if base not in ("Q8_0", "F16"):
        raise NblError(f"synthetic base type {base} must be Q8_0 or F16")
    path = Path(path)
    rng = np.random.default_rng(seed)
    shapes = tensor_shapes(shape)
    tmp = atomic_output(path)
    try:
        writer = gguf.GGUFWriter(tmp, arch="llama")
        add_llama_header(
            writer, f"synthetic-{shape.name}", n_ctx_train=shape.n_ctx_train, n_embd=shape.n_embd,
            n_layer=shape.n_layer, n_ff=shape.n_ff, n_head=shape.n_head, n_head_kv=shape.n_head_kv,
            rope_base=shape.rope_base, eps=1e-5, n_vocab=shape.n_vocab,
            file_type=gguf.LlamaFileType.MOSTLY_Q8_0 if base == "Q8_0" else gguf.LlamaFileType.MOSTLY_F16,
        )
        add_byte_vocab(writer, shape.n_vocab)
        # tensor infos need the byte sizes up front; the data is generated again, identically, when written
        for name, numpy_shape in shapes.items():
            if len(numpy_shape) == 1:
                writer.add_tensor_info(name, numpy_shape, np.dtype(np.float32), 4 * numpy_shape[0],
                                       gguf.GGMLQuantizationType.F32)
            elif base == "Q8_0":
                rows, cols = numpy_shape
                byte_shape = (rows, cols // Q8_0_BLOCK * Q8_0_BYTES)
                writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), rows * byte_shape[1],
                                       gguf.GGMLQuantizationType.Q8_0)
            else:
                writer.add_tensor_info(name, numpy_shape, np.dtype(np.float16), 2 * int(np.prod(numpy_shape)),
                                       gguf.GGMLQuantizationType.F16)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, numpy_shape in shapes.items():
            data, _ = _random_tensor(rng, name, numpy_shape, base)
            writer.write_tensor_data(data)
            del data
        writer.close()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def make_pair(shape: Shape, quant: str, ms: list[int], directory: str | os.PathLike, seed: int = 0,
              layers: dict[int, list[int]] | None = None, threads: int | None = None,
              log=print) -> tuple[Path, dict[int, Path]]:
    """Stock and NBL-m GGUFs of ``shape`` in ``quant`` under ``directory`` (made once, then reused).

    ``layers`` maps m to explicit layer indices (default: default_layers). Returns (stock, {m: path}).
    """
    from nbl_gguf import gguf_nbl
    from nbl_gguf.quantize import normalize_quant, quantize

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    floats = {"F16": "F16", "F32": None, "BF16": None}
    if quant.upper() in floats:
        if floats[quant.upper()] is None:
            raise NblError(f"--quant {quant}: synthetic models are written as F16 or quantized from Q8_0")
        qtype, base = "F16", "F16"
    else:
        qtype, base = normalize_quant(quant), "Q8_0"
    tag = f"{shape.name}-seed{seed}"
    stock_final = directory / f"{tag}-stock-{qtype.lower()}.gguf"
    base_path = directory / f"{tag}-stock-{base.lower()}.gguf"
    selections = {m: sorted((layers or {}).get(m) or default_layers(shape, m)) for m in ms}
    nbl_final = {m: directory / f"{tag}-nbl-m{m}-L{'.'.join(map(str, sel))}-{qtype.lower()}.gguf"
                 for m, sel in selections.items()}
    todo = [m for m in ms if not nbl_final[m].is_file()]
    if not stock_final.is_file() or todo:
        if not base_path.is_file():
            log(f"synthetic {shape.name}: writing random {base} weights to {base_path}")
            write_random_gguf(shape, base_path, base=base, seed=seed)
        requant = ["--allow-requantize"] if base == "Q8_0" else []
        for m in todo:
            sel = selections[m]
            types = [gguf_nbl.LINEAR if i in sel else gguf_nbl.ATTENTION for i in range(shape.n_layer)]
            nbl_base = directory / f"{tag}-nbl-m{m}-{base.lower()}.tmp.gguf"
            log(f"synthetic {shape.name}: NBL m={m} (layers {sel}) -> {nbl_final[m]}")
            gguf_nbl.write_nbl_gguf(base_path, nbl_base, gguf_nbl.NblLayers(
                types=types, linear=random_linear(shape.n_embd, sel, seed=seed + 1), method="attn-nbl"), weight_type="F16")
            try:
                if qtype == base:
                    os.replace(nbl_base, nbl_final[m])
                else:
                    quantize(nbl_base, nbl_final[m], qtype, threads=threads, extra_args=requant)
            finally:
                nbl_base.unlink(missing_ok=True)
        if not stock_final.is_file():
            if qtype == base:
                os.replace(base_path, stock_final)
            else:
                log(f"synthetic {shape.name}: llama-quantize {base} -> {qtype}")
                quantize(base_path, stock_final, qtype, threads=threads, extra_args=requant)
        if base_path.is_file() and base_path != stock_final:
            base_path.unlink()
    return stock_final, nbl_final


def hf_config(shape: Shape):
    """A transformers LlamaConfig of this shape (for the HF comparison)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.n_vocab, hidden_size=shape.n_embd, intermediate_size=shape.n_ff,
        num_hidden_layers=shape.n_layer, num_attention_heads=shape.n_head, num_key_value_heads=shape.n_head_kv,
        max_position_embeddings=shape.n_ctx_train, rope_theta=shape.rope_base, rms_norm_eps=1e-5,
        tie_word_embeddings=shape.tied,
    )
