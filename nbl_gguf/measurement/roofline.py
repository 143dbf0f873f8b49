"""What the GGUF files alone predict about NBL speed: a roofline of one generated / one prompt token.

Token generation (batch 1) is memory-bound: every weight is read once per token, and the K/V of
every earlier token in every attention layer::

    bytes/token = all tensor bytes - token_embd + one token_embd row (a lookup)
                  (+ all of token_embd again when the output head is tied to it)
                  + kv_bytes_per_token * context,
    kv_bytes_per_token = sum over attention layers of n_head_kv * (k_len + v_len) * kv_type_bytes.

A window layer (nbl.window_sinks with the sliding-window pattern) reads at most W + S cells, its window and
its sinks, whatever the context: its share of the KV term is ``min(context, W + S)`` cells, not ``context``.

Prompt processing is compute-bound: per prompt token::

    FLOPs/token = 2 * (matmul weight parameters of the blocks)
                  + 2 * (output head parameters) / n_prompt   (llama.cpp computes logits of the last token only)
                  + sum over attention layers of 2 * n_head * (k_len + v_len) * context   (QK^T and PV)
                  (a window layer's context again capped at W + S).

An NBL layer drops its Q/K/V/O projections and its K/V cache and adds one d x d matmul, so the
predicted speed-up of a cell is ``cost(stock) / cost(NBL)``. Non-matmul work (norms, RoPE, softmax,
activations) and kernel efficiency are outside the model: they are what a measured/predicted ratio
below 1 is made of.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from nbl_gguf.errors import NblError
from nbl_gguf.llamacpp.cache_types import CACHE_TYPES, split_cache_type


def kv_type_bytes(kv_type: str) -> float:
    """Bytes per cached element; for K's and V's types ('q8_0/q4_0') their mean (K and V rows alike wide)."""
    k, v = split_cache_type(kv_type)
    return sum(CACHE_TYPES[name][1] / CACHE_TYPES[name][0] for name in (k, v)) / 2


@dataclass(frozen=True)
class ModelCost:
    """The numbers of one GGUF that the roofline needs (see the module docstring)."""

    path: str
    architecture: str
    n_layer: int
    n_embd: int
    n_vocab: int
    n_ff: int | None
    file_type: int | None
    layer_types: tuple[int, ...]  # 0 attention, 1 linear, 2 dropped (all 0 for a stock file)
    total_bytes: int  # every tensor
    token_embd_bytes: int
    tied_output: bool  # no output.weight: the output head reads token_embd
    output_params: int
    block_matmul_params: int  # 2-D weights inside the blocks (attn_*, ffn_*, attn_nbl)
    kv_elements_per_token: int  # sum over attention layers of n_head_kv * (k_len + v_len)
    attn_width: int  # sum over attention layers of n_head * (k_len + v_len)
    window_cells: int = 0  # W + S of the window layers (0: none)
    window_kv_elements_per_token: int = 0  # the window layers' share of kv_elements_per_token
    window_attn_width: int = 0  # the window layers' share of attn_width
    shape_key: tuple = field(default=(), compare=False)  # what must match between stock and NBL

    @property
    def attention_layers(self) -> int:
        return sum(1 for t in self.layer_types if t == 0)

    @property
    def token_embd_row_bytes(self) -> float:
        return self.token_embd_bytes / self.n_vocab if self.n_vocab else 0.0

    @property
    def is_nbl(self) -> bool:
        """Changed by nbl-gguf: layers replaced or made window layers."""
        return any(t != 0 for t in self.layer_types) or self.window_cells > 0

    def kv_bytes_per_token(self, kv_type: str = "f16") -> float:
        return self.kv_elements_per_token * kv_type_bytes(kv_type)

    def _attended(self, per_cell: int, window_per_cell: int, context: float) -> float:
        """Cells read at ``context`` weighted per layer: a window layer's capped at W + S."""
        return (per_cell - window_per_cell) * context + window_per_cell * min(context, self.window_cells)

    def weight_bytes_per_token(self) -> float:
        """Weight bytes read to generate one token."""
        embd = self.token_embd_row_bytes + (self.token_embd_bytes if self.tied_output else 0)
        return self.total_bytes - self.token_embd_bytes + embd

    def tg_bytes(self, context: float, kv_type: str = "f16") -> float:
        """Bytes read per generated token with ``context`` tokens in the KV cache."""
        kv = self._attended(self.kv_elements_per_token, self.window_kv_elements_per_token, context)
        return self.weight_bytes_per_token() + kv * kv_type_bytes(kv_type)

    def pp_flops(self, context: float, n_prompt: int | None = None) -> float:
        """FLOPs per prompt token whose attention spans ``context`` tokens; the output head is
        spread over ``n_prompt`` tokens (None: counted in full, as for one generated token)."""
        head = 2 * self.output_params / (n_prompt if n_prompt else 1)
        return 2 * self.block_matmul_params + head + 2 * self._attended(self.attn_width, self.window_attn_width, context)


def model_cost(path: str | os.PathLike) -> ModelCost:
    """Read the roofline numbers of a GGUF (stock or NBL) with gguf-py."""
    from nbl_gguf.gguf.nbl_format import read_layer_types, read_windows
    from nbl_gguf.gguf.metadata import head_counts, open_model_gguf, read_field

    path = Path(path)
    reader, arch = open_model_gguf(path)
    if read_field(reader, f"{arch}.block_count") is None or read_field(reader, f"{arch}.embedding_length") is None:
        raise NblError(f"{path}: no {arch}.block_count / embedding_length: not a decoder model GGUF")
    n_layer = int(read_field(reader, f"{arch}.block_count"))
    n_embd = int(read_field(reader, f"{arch}.embedding_length"))
    n_head, n_head_kv = head_counts(reader, arch, n_layer)
    n_ff = read_field(reader, f"{arch}.feed_forward_length")
    n_ff = None if n_ff is None else (n_ff if isinstance(n_ff, int) else tuple(n_ff) if isinstance(n_ff, list) else int(n_ff))
    types = read_layer_types(reader) or [0] * n_layer

    total = embd_bytes = output_params = block_params = 0
    n_vocab = 0
    embd_params = 0
    has_output = False
    for tensor in reader.tensors:
        nbytes, nelem = int(tensor.n_bytes), int(tensor.n_elements)
        total += nbytes
        dims = [int(n) for n in tensor.shape]
        if tensor.name == "token_embd.weight":
            embd_bytes, embd_params = nbytes, nelem
            n_vocab = nelem // dims[0] if dims and dims[0] else 0
        elif tensor.name == "output.weight":
            has_output = True
            output_params = nelem
        elif tensor.name.startswith("blk.") and tensor.name.endswith(".weight") and len([d for d in dims if d > 1]) >= 2:
            block_params += nelem
    if not has_output:
        output_params = embd_params

    windows = read_windows(reader)
    window_layers = set(windows.layers) if windows is not None else set()
    kv_elements = attn_width = window_kv = window_width = 0
    for layer in range(n_layer):
        if types[layer] != 0:
            continue
        head_dim = n_embd // n_head[layer] if n_head[layer] else 0
        k_len = int(read_field(reader, f"{arch}.attention.key_length", head_dim))
        v_len = int(read_field(reader, f"{arch}.attention.value_length", head_dim))
        kv_elements += n_head_kv[layer] * (k_len + v_len)
        attn_width += n_head[layer] * (k_len + v_len)
        if layer in window_layers:
            window_kv += n_head_kv[layer] * (k_len + v_len)
            window_width += n_head[layer] * (k_len + v_len)

    file_type = read_field(reader, "general.file_type")
    shape_key = (arch, n_layer, n_embd, n_vocab, n_ff, tuple(n_head), tuple(n_head_kv), not has_output)
    return ModelCost(
        path=str(path), architecture=arch, n_layer=n_layer, n_embd=n_embd, n_vocab=n_vocab, n_ff=n_ff,
        file_type=None if file_type is None else int(file_type), layer_types=tuple(int(t) for t in types),
        total_bytes=total, token_embd_bytes=embd_bytes, tied_output=not has_output, output_params=output_params,
        block_matmul_params=block_params, kv_elements_per_token=kv_elements, attn_width=attn_width,
        window_cells=(windows.size + windows.sinks) if windows is not None else 0,
        window_kv_elements_per_token=window_kv, window_attn_width=window_width, shape_key=shape_key,
    )


def cell_context(test: str, depth: int, n_tokens: int) -> float:
    """The mean context a test's tokens attend to: the depth plus half the tokens of the test."""
    if test not in ("pp", "tg"):
        raise ValueError(f"test must be pp or tg, not {test!r}")
    return depth + n_tokens / 2


def predicted_speedup(stock: ModelCost, nbl: ModelCost, test: str, depth: int, n_tokens: int,
                      kv_type: str = "f16") -> float:
    """Roofline speed-up of ``nbl`` over ``stock`` for a llama-bench cell (pp or tg of n_tokens at depth)."""
    context = cell_context(test, depth, n_tokens)
    if test == "tg":
        return stock.tg_bytes(context, kv_type) / nbl.tg_bytes(context, kv_type)
    return stock.pp_flops(context, n_tokens) / nbl.pp_flops(context, n_tokens)


def check_pair(stock: ModelCost, nbl: ModelCost) -> None:
    """Stock and NBL must be the same model and quantization, the NBL one with layers replaced."""
    if stock.is_nbl:
        raise NblError(f"--baseline {stock.path} is an NBL GGUF ({stock.n_layer - stock.attention_layers} layers "
                       f"replaced): the baseline must be the stock model")
    if not nbl.is_nbl:
        raise NblError(f"--nbl {nbl.path} is a stock GGUF (no {nbl.architecture}.nbl.layer_types nor window "
                       f"layers): pass an NBL GGUF of the same model")
    names = ("architecture", "block count", "embedding length", "vocabulary", "feed-forward length",
             "head counts", "KV head counts", "tied output")
    for name, a, b in zip(names, stock.shape_key, nbl.shape_key):
        if a != b:
            raise NblError(f"{nbl.path} is not the same model as the baseline {stock.path}: {name} {b} vs {a}")
    if stock.file_type != nbl.file_type:
        raise NblError(f"{nbl.path} ({file_type_name(nbl.file_type)}) and the baseline {stock.path} "
                       f"({file_type_name(stock.file_type)}) are quantized differently: compare the same quant")


def file_type_name(file_type: int | None) -> str:
    """The quantization of a ModelCost for messages and reports: "?" where the file names none."""
    from nbl_gguf.gguf import metadata

    return metadata.file_type_name(file_type) or "?"
