"""Seed corpus for the loader fuzzer: small valid NBL GGUFs of every architecture the patch series
supports, with all four layer types (attention, linear, dropped, taps: each form of its lag map) and
window layers (with and without sinks, beside taps), weights in F32, F16 and Q8_0.

    python fuzz/make_seeds.py OUT_DIR

Each seed is a real model the patched llama.cpp loads and runs (tests/test_fuzz_regressions.py
checks that): n_embd 32, 2 heads of 16, a 259-token byte vocabulary, 3 or 4 layers, a few tens of KB.
The output is deterministic, so the seeds are regenerated rather than committed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# runs as a script from the repository root or from fuzz/
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nbl_gguf.fixtures.tiny import N_SPECIAL, add_byte_vocab  # noqa: E402
from nbl_gguf.gguf import nbl_format  # noqa: E402

A, L, D, T = nbl_format.ATTENTION, nbl_format.LINEAR, nbl_format.DROPPED, nbl_format.TAPS

N_EMBD, N_HEAD, N_HEAD_KV, N_FF = 32, 2, 1, 16
HEAD_DIM = N_EMBD // N_HEAD
N_VOCAB = N_SPECIAL + 256
TAPS_RANK = 4


@dataclass(frozen=True)
class Arch:
    """What one GGUF architecture's loader wants, as numpy shapes [out, in] (ggml's ne reversed)."""

    name: str
    attention: dict[str, tuple[int, ...]]  # per-layer tensors an NBL layer drops (suffix -> shape)
    ffn: dict[str, tuple[int, ...]]
    tied_output: bool
    keys: dict[str, object] = field(default_factory=dict)  # extra hparams: writer method -> value


QKVO = {
    "attn_q.weight": (N_HEAD * HEAD_DIM, N_EMBD),
    "attn_k.weight": (N_HEAD_KV * HEAD_DIM, N_EMBD),
    "attn_v.weight": (N_HEAD_KV * HEAD_DIM, N_EMBD),
    "attn_output.weight": (N_EMBD, N_HEAD * HEAD_DIM),
}
QK_NORM = {"attn_q_norm.weight": (HEAD_DIM,), "attn_k_norm.weight": (HEAD_DIM,)}
SWIGLU = {"ffn_gate.weight": (N_FF, N_EMBD), "ffn_up.weight": (N_FF, N_EMBD), "ffn_down.weight": (N_EMBD, N_FF)}
GEMMA_FFN = {**SWIGLU, "post_ffw_norm.weight": (N_EMBD,)}

ARCHS = {
    "llama": Arch("llama", QKVO, SWIGLU, tied_output=False, keys={"add_rope_dimension_count": HEAD_DIM}),
    "qwen2": Arch("qwen2", {**QKVO, "attn_q.bias": (N_EMBD,), "attn_k.bias": (HEAD_DIM,), "attn_v.bias": (HEAD_DIM,)},
                  SWIGLU, tied_output=True),
    "qwen3": Arch("qwen3", {**QKVO, **QK_NORM}, SWIGLU, tied_output=False),
    # fused QKV and a gate folded into ffn_up, partial rotary
    "phi3": Arch("phi3", {"attn_qkv.weight": (N_EMBD + 2 * N_HEAD_KV * HEAD_DIM, N_EMBD),
                          "attn_output.weight": (N_EMBD, N_EMBD)},
                 {"ffn_up.weight": (2 * N_FF, N_EMBD), "ffn_down.weight": (N_EMBD, N_FF)}, tied_output=False,
                 keys={"add_rope_dimension_count": HEAD_DIM // 2}),
    # the norm after the attention leaves with it; every other layer slides
    "gemma2": Arch("gemma2", {**QKVO, "post_attention_norm.weight": (N_EMBD,)}, GEMMA_FFN, tied_output=True,
                   keys={"add_sliding_window": 64, "add_attn_logit_softcapping": 50.0,
                         "add_final_logit_softcapping": 30.0}),
    "gemma3": Arch("gemma3", {**QKVO, **QK_NORM, "post_attention_norm.weight": (N_EMBD,)}, GEMMA_FFN,
                   tied_output=True, keys={"add_sliding_window": 64}),
    "smollm3": Arch("smollm3", QKVO, SWIGLU, tied_output=True),
}


@dataclass(frozen=True)
class Seed:
    arch: str
    types: tuple[int, ...] | None  # None: a stock file without the layer-types key
    nbl_type: str = "F16"  # attn_nbl.weight; the other matrices are F16, token_embd and output Q8_0
    arch_keys: bool = True  # False drops Arch.keys (gemma3 without sliding window)
    n_expert: int = 0
    taps: int = 0  # <arch>.nbl.taps for taps layers (T)
    taps_form: str = "full"  # their lag map: full (attn_nbl_lag), lowrank (attn_nbl_lag_down/up), channel (attn_nbl_conv)
    windows: nbl_format.Windows | None = None  # window layers (attention layers over the last tokens and the sinks)


SEEDS = {
    "llama-stock": Seed("llama", None),
    "llama-all-attention": Seed("llama", (A, A, A)),
    "llama-mixed": Seed("llama", (A, L, D)),
    "llama-f32": Seed("llama", (L, A, L), nbl_type="F32"),
    "llama-q8_0": Seed("llama", (A, A, L), nbl_type="Q8_0"),
    "llama-no-attention": Seed("llama", (L, D, L)),
    "llama-moe": Seed("llama", (D, L, A), n_expert=2),
    "llama-taps-full": Seed("llama", (L, T, A), taps=3),
    "llama-taps-lowrank": Seed("llama", (T, A, T), nbl_type="Q8_0", taps=4, taps_form="lowrank"),
    "llama-taps-channel": Seed("llama", (A, T, D), taps=2, taps_form="channel"),
    "llama-windows": Seed("llama", (A, L, A), windows=nbl_format.Windows(layers=(0, 2), size=8, sinks=2)),
    "qwen2-mixed": Seed("qwen2", (A, L, D)),
    "qwen2-windows-taps": Seed("qwen2", (A, T, A), taps=3, windows=nbl_format.Windows(layers=(2,), size=4, sinks=0)),
    "qwen3-mixed": Seed("qwen3", (D, A, L)),
    "qwen3-windows": Seed("qwen3", (A, L, A), windows=nbl_format.Windows(layers=(0, 2), size=8, sinks=2)),
    "qwen3-windows-taps": Seed("qwen3", (T, A, A), taps=2, windows=nbl_format.Windows(layers=(1,), size=4, sinks=2)),
    "phi3-mixed": Seed("phi3", (L, A, D)),
    "phi3-windows": Seed("phi3", (L, A, A), windows=nbl_format.Windows(layers=(1,), size=4, sinks=0)),
    "phi3-taps": Seed("phi3", (A, T, L), taps=3, taps_form="lowrank"),
    "gemma2-mixed": Seed("gemma2", (A, L, D, A)),
    "gemma3-swa": Seed("gemma3", (L, A, D, A)),
    # taps beside gemma's own sliding-window layers (the hybrid iSWA memory)
    "gemma2-taps": Seed("gemma2", (A, T, A, L), taps=4, taps_form="channel"),
    "gemma3-taps": Seed("gemma3", (T, A, D, A), taps=3),
    "gemma3-no-swa": Seed("gemma3", (A, D, L), arch_keys=False),
    "smollm3-mixed": Seed("smollm3", (A, D, L, L)),
    "smollm3-taps": Seed("smollm3", (A, T, A, T), taps=3),
    # layer 3 has no RoPE: a window over positions it does not rotate
    "smollm3-windows": Seed("smollm3", (A, D, A, A), windows=nbl_format.Windows(layers=(0, 3), size=8, sinks=2)),
}


def quantized(array: np.ndarray, type_name: str):
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    data = gguf.quants.quantize(array.astype(np.float32), qtype) if type_name != "F32" else array.astype(np.float32)
    return data, qtype


def seed_tensors(seed: Seed, rng) -> dict[str, tuple[np.ndarray, str]]:
    """name -> (values, type) in file order: globals, then each layer's attention (or NBL) and FFN."""
    arch = ARCHS[seed.arch]
    types = seed.types or (A,) * 3

    def weight(*shape):
        return (rng.standard_normal(shape) * shape[-1] ** -0.5).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    tensors = {"token_embd.weight": (weight(N_VOCAB, N_EMBD), "Q8_0"), "output_norm.weight": (norm(N_EMBD), "F32")}
    if not arch.tied_output:
        tensors["output.weight"] = (weight(N_VOCAB, N_EMBD), "Q8_0")
    for i, layer_type in enumerate(types):
        tensors[f"blk.{i}.attn_norm.weight"] = (norm(N_EMBD), "F32")
        if layer_type == A:
            for suffix, shape in arch.attention.items():
                values = weight(*shape) if len(shape) == 2 else norm(shape[0])
                tensors[f"blk.{i}.{suffix}"] = (values, "F16" if len(shape) == 2 else "F32")
        elif layer_type in (L, T):
            tensors[nbl_format.NBL_WEIGHT.format(layer=i)] = (weight(N_EMBD, N_EMBD), seed.nbl_type)
            tensors[nbl_format.NBL_BIAS.format(layer=i)] = ((0.1 * rng.standard_normal(N_EMBD)).astype(np.float32), "F32")
        if layer_type == T:
            past = (seed.taps - 1) * N_EMBD
            names = nbl_format.TAPS_TENSORS
            if seed.taps_form == "full":
                tensors[names["lag"].format(layer=i)] = (weight(N_EMBD, past), seed.nbl_type)
            elif seed.taps_form == "lowrank":
                tensors[names["lag_down"].format(layer=i)] = (weight(TAPS_RANK, past), seed.nbl_type)
                tensors[names["lag_up"].format(layer=i)] = (weight(N_EMBD, TAPS_RANK), "F16")
            else:
                tensors[names["conv"].format(layer=i)] = ((0.5 * rng.standard_normal((seed.taps, N_EMBD))).astype(np.float32), "F32")
        tensors[f"blk.{i}.ffn_norm.weight"] = (norm(N_EMBD), "F32")
        if seed.n_expert:
            tensors[f"blk.{i}.ffn_gate_inp.weight"] = (weight(seed.n_expert, N_EMBD), "F32")
            for stem, shape in arch.ffn.items():
                tensors[f"blk.{i}.{stem.replace('.weight', '_exps.weight')}"] = (
                    np.stack([weight(*shape) for _ in range(seed.n_expert)]), "F16")
        else:
            for suffix, shape in arch.ffn.items():
                values = weight(*shape) if len(shape) == 2 else norm(shape[0])
                tensors[f"blk.{i}.{suffix}"] = (values, "F16" if len(shape) == 2 else "F32")
    return tensors


def write_seed(path: Path, name: str, seed: Seed, retype: dict[str, str] | None = None) -> Path:
    """retype: tensor name -> type stored instead of the seed's (fuzz/retype_tensor.py)."""
    import gguf

    arch = ARCHS[seed.arch]
    rng = np.random.default_rng(sum(map(ord, name)))
    n_layer = len(seed.types or (A,) * 3)
    writer = gguf.GGUFWriter(path, arch=arch.name)
    # not the architecture's name: llama.cpp's vocab looks up Phi-3's special tokens in a model so named
    writer.add_name("nbl fuzz seed")
    writer.add_context_length(256)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if seed.n_expert:
        writer.add_expert_count(seed.n_expert)
        writer.add_expert_used_count(1)
    for method, value in (arch.keys if seed.arch_keys else {}).items():
        getattr(writer, method)(value)
    add_byte_vocab(writer, N_VOCAB)
    if seed.types is not None:
        writer.add_key_value(nbl_format.LAYER_TYPES_KEY.format(arch=arch.name), list(seed.types),
                             gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
        writer.add_string(nbl_format.METHOD_KEY, "attn-nbl")
    if seed.taps:
        writer.add_uint32(nbl_format.TAPS_KEY.format(arch=arch.name), seed.taps)
    if seed.windows is not None:
        nbl_format.add_windows(writer, arch.name, seed.windows, n_layer)
    for tensor_name, (values, type_name) in seed_tensors(seed, rng).items():
        data, qtype = quantized(values, (retype or {}).get(tensor_name, type_name))
        writer.add_tensor(tensor_name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for name, seed in SEEDS.items():
        path = write_seed(out / f"{name}.gguf", name, seed)
        print(f"{path.name}: {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
