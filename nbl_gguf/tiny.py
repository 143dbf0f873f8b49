"""Tiny llama-architecture models with random weights, written as GGUF with gguf-py, and an
independent numpy forward pass of the same weights (llama.cpp's conventions: ggml tensor layout,
RoPE on adjacent pairs, RMSNorm, SwiGLU, GQA)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nbl_gguf import gguf_nbl

N_SPECIAL = 3  # <unk>, <s>, </s>, then one token per byte


def add_llama_header(writer, name: str, *, n_ctx_train: int, n_embd: int, n_layer: int, n_ff: int, n_head: int,
                     n_head_kv: int, rope_base: float, eps: float, n_vocab: int, file_type) -> None:
    """The llama hyper-parameters of a GGUF written from numpy (here and in nbl_gguf.synthetic)."""
    writer.add_name(name)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(eps)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(file_type)


def add_byte_vocab(writer, n_vocab: int) -> None:
    """A byte-level SPM vocabulary (any text tokenizes), padded with unused tokens to ``n_vocab``."""
    import gguf

    if n_vocab < N_SPECIAL + 256:
        raise ValueError(f"a vocabulary of {n_vocab} is smaller than the {N_SPECIAL + 256} byte tokens")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    token_types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    token_types += [gguf.TokenType.BYTE] * 256
    tokens += [f"<unused{i}>" for i in range(n_vocab - len(tokens))]
    token_types += [gguf.TokenType.UNUSED] * (n_vocab - len(token_types))
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * n_vocab)
    writer.add_token_types(token_types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)


def random_linear(n_embd: int, layers, seed: int = 1) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Random NBL weights for ``layers``, of the size an attention block contributes."""
    rng = np.random.default_rng(seed)
    return {
        i: (
            (rng.standard_normal((n_embd, n_embd)) * 0.5 * n_embd**-0.5).astype(np.float32),
            (rng.standard_normal(n_embd) * 0.1).astype(np.float32),
        )
        for i in layers
    }


@dataclass
class TinyLlama:
    n_layer: int = 3
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 96
    n_ctx_train: int = 4096
    rope_base: float = 10000.0
    eps: float = 1e-5
    seed: int = 0
    weights: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_vocab(self) -> int:
        return N_SPECIAL + 256

    def __post_init__(self):
        rng = np.random.default_rng(self.seed)

        def randn(*shape, scale):
            return (rng.standard_normal(shape) * scale).astype(np.float32)

        d, hd = self.n_embd, self.head_dim
        w = self.weights
        w["token_embd.weight"] = randn(self.n_vocab, d, scale=1.0)
        w["output_norm.weight"] = (1.0 + randn(d, scale=0.1)).astype(np.float32)
        w["output.weight"] = randn(self.n_vocab, d, scale=d**-0.5)
        for i in range(self.n_layer):
            w[f"blk.{i}.attn_norm.weight"] = (1.0 + randn(d, scale=0.1)).astype(np.float32)
            w[f"blk.{i}.attn_q.weight"] = randn(self.n_head * hd, d, scale=d**-0.5)
            w[f"blk.{i}.attn_k.weight"] = randn(self.n_head_kv * hd, d, scale=d**-0.5)
            w[f"blk.{i}.attn_v.weight"] = randn(self.n_head_kv * hd, d, scale=d**-0.5)
            w[f"blk.{i}.attn_output.weight"] = randn(d, self.n_head * hd, scale=d**-0.5)
            w[f"blk.{i}.ffn_norm.weight"] = (1.0 + randn(d, scale=0.1)).astype(np.float32)
            w[f"blk.{i}.ffn_gate.weight"] = randn(self.n_ff, d, scale=d**-0.5)
            w[f"blk.{i}.ffn_up.weight"] = randn(self.n_ff, d, scale=d**-0.5)
            w[f"blk.{i}.ffn_down.weight"] = randn(d, self.n_ff, scale=self.n_ff**-0.5)

    def random_linear(self, layers, seed: int = 1) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        return random_linear(self.n_embd, layers, seed)

    # --- GGUF -------------------------------------------------------------------------------
    def write_gguf(self, path: Path, skip_tensors=frozenset(), extra_kv=None, extra_tensors=None) -> Path:
        """The stock GGUF of this model; tests leave tensors out or add keys and tensors to break it.

        ``extra_kv`` maps a key to (value, GGUFValueType, sub_type or None).
        """
        import gguf

        writer = gguf.GGUFWriter(path, arch="llama")
        add_llama_header(
            writer, "tiny-llama", n_ctx_train=self.n_ctx_train, n_embd=self.n_embd, n_layer=self.n_layer,
            n_ff=self.n_ff, n_head=self.n_head, n_head_kv=self.n_head_kv, rope_base=self.rope_base, eps=self.eps,
            n_vocab=self.n_vocab, file_type=gguf.LlamaFileType.ALL_F32,
        )
        add_byte_vocab(writer, self.n_vocab)
        for key, (value, value_type, sub_type) in (extra_kv or {}).items():
            writer.add_key_value(key, value, value_type, sub_type=sub_type)

        for name, tensor in {**self.weights, **(extra_tensors or {})}.items():
            if name not in skip_tensors:
                writer.add_tensor(name, tensor)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    def write_nbl_gguf(self, path: Path, types, linear) -> Path:
        stock = path.with_suffix(".stock.gguf")
        self.write_gguf(stock)
        gguf_nbl.write_nbl_gguf(stock, path, gguf_nbl.NblLayers(types=types, linear=linear))
        stock.unlink()
        return path

    # --- reference forward pass -------------------------------------------------------------
    def forward(self, tokens, types=None, linear=None) -> np.ndarray:
        """Logits [n_tokens, n_vocab] in float64 for a causal pass over ``tokens``."""
        types = types or [gguf_nbl.ATTENTION] * self.n_layer
        linear = linear or {}
        w = {k: v.astype(np.float64) for k, v in self.weights.items()}
        h = w["token_embd.weight"][np.asarray(tokens)]
        positions = np.arange(len(tokens))
        for i in range(self.n_layer):
            x = self._rms_norm(h, w[f"blk.{i}.attn_norm.weight"])
            if types[i] == gguf_nbl.ATTENTION:
                h = h + self._attention(x, w, i, positions)
            elif types[i] == gguf_nbl.LINEAR:
                weight, bias = linear[i]
                h = h + x @ weight.astype(np.float64).T + bias.astype(np.float64)
            x = self._rms_norm(h, w[f"blk.{i}.ffn_norm.weight"])
            gate = x @ w[f"blk.{i}.ffn_gate.weight"].T
            up = x @ w[f"blk.{i}.ffn_up.weight"].T
            h = h + (gate / (1.0 + np.exp(-gate)) * up) @ w[f"blk.{i}.ffn_down.weight"].T
        return self._rms_norm(h, w["output_norm.weight"]) @ w["output.weight"].T

    def _rms_norm(self, x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * weight

    def _rope(self, x, positions):
        # llama.cpp's "normal" RoPE rotates adjacent pairs (x[2j], x[2j+1]) by pos * base^(-2j/hd)
        hd = x.shape[-1]
        theta = positions[:, None] * self.rope_base ** (-np.arange(0, hd, 2) / hd)
        cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    def _attention(self, x, w, i, positions):
        n, hd = x.shape[0], self.head_dim
        q = (x @ w[f"blk.{i}.attn_q.weight"].T).reshape(n, self.n_head, hd)
        k = (x @ w[f"blk.{i}.attn_k.weight"].T).reshape(n, self.n_head_kv, hd)
        v = (x @ w[f"blk.{i}.attn_v.weight"].T).reshape(n, self.n_head_kv, hd)
        q, k = self._rope(q, positions), self._rope(k, positions)
        group = self.n_head // self.n_head_kv
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        scores = np.where(np.tril(np.ones((n, n), dtype=bool))[None], scores, -np.inf)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        out = np.einsum("hqk,khd->qhd", probs, v).reshape(n, self.n_head * hd)
        return out @ w[f"blk.{i}.attn_output.weight"].T
