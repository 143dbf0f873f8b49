"""The patched llama.cpp on tiny random llama GGUFs, against an independent numpy forward pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest

from nbl_gguf.gguf import nbl_format
from nbl_gguf.llamacpp import tools as llamacpp
from nbl_gguf.llamacpp import library
from nbl_gguf.errors import NblError
from nbl_gguf.fixtures.tiny import TinyLlama

A, L, D = nbl_format.ATTENTION, nbl_format.LINEAR, nbl_format.DROPPED
TOLERANCE = 1e-3

# (model shape, layer types): no NBL layer, one, and all but one
CASES = {
    "stock": (dict(n_layer=3), [A, A, A]),
    "one-linear": (dict(n_layer=3), [A, L, A]),
    "one-dropped": (dict(n_layer=2, n_head=4, n_head_kv=1), [D, A]),
    "all-but-one": (dict(n_layer=4, n_head=8, n_head_kv=2), [L, D, A, L]),
}


def tokens_for(model: TinyLlama, n: int, seed: int = 7) -> list[int]:
    return list(np.random.default_rng(seed).integers(3, model.n_vocab, size=n))


def make_gguf(tmp_path, shape, types, seed=0):
    model = TinyLlama(seed=seed, **shape)
    linear = model.random_linear([i for i, t in enumerate(types) if t == L])
    path = tmp_path / "model.gguf"
    if all(t == A for t in types):
        model.write_gguf(path)
    else:
        model.write_nbl_gguf(path, types, linear)
    return model, linear, path


@pytest.mark.parametrize("case", CASES)
def test_logits_match_numpy_reference(tmp_path, case):
    shape, types = CASES[case]
    model, linear, path = make_gguf(tmp_path, shape, types)
    tokens = tokens_for(model, 24)
    llm, _ = library.load_model(path, n_ctx=64, logits_all=True, f32_kv=True)
    got = library.logits(llm, tokens)
    want = model.forward(tokens, types, linear)
    assert np.abs(got - want).max() < TOLERANCE
    if case != "stock":
        # the comparison can tell an NBL layer from the attention it replaced
        assert np.abs(model.forward(tokens) - want).max() > 100 * TOLERANCE


@pytest.mark.parametrize("case", ["one-linear", "all-but-one"])
def test_token_by_token_decoding_matches_reference(tmp_path, case):
    shape, types = CASES[case]
    model, linear, path = make_gguf(tmp_path, shape, types)
    tokens = tokens_for(model, 12)
    llm, _ = library.load_model(path, n_ctx=64, logits_all=True, f32_kv=True)
    llm.reset()
    for token in tokens:  # one token per batch: every step reads the KV cache
        llm.eval([token])
    got = np.array(llm.scores[: len(tokens)], dtype=np.float64)
    assert np.abs(got - model.forward(tokens, types, linear)).max() < TOLERANCE


@pytest.mark.parametrize("case", CASES)
def test_kv_cache_shrinks_by_the_marked_fraction(tmp_path, case):
    shape, types = CASES[case]
    model, _, path = make_gguf(tmp_path, shape, types)
    stock_path = model.write_gguf(tmp_path / "stock.gguf")
    # 4096 cells of f32 K and V make each layer's share a whole number of MiB, so the log is exact
    _, kv = library.load_model(path, n_ctx=4096, f32_kv=True)
    _, kv_stock = library.load_model(stock_path, n_ctx=4096, f32_kv=True)
    n_attention = types.count(A)
    assert kv_stock.layers == model.n_layer
    assert kv.layers == n_attention
    layer_mib = 2 * 4096 * model.n_head_kv * model.head_dim * 4 / 2**20
    assert kv_stock.mib == pytest.approx(model.n_layer * layer_mib, abs=0.011)
    assert kv.mib == pytest.approx(kv_stock.mib * n_attention / model.n_layer, abs=0.011)


def test_a_model_without_attention_runs(tmp_path):
    # every layer linear or dropped: nothing reads the positions or the KV cache (patch 0007; the
    # loader fuzzer found the first decode aborting)
    types = [L, D, L]
    model, linear, path = make_gguf(tmp_path, dict(n_layer=3), types)
    tokens = tokens_for(model, 12)
    llm, _ = library.load_model(path, n_ctx=64, logits_all=True, f32_kv=True)
    got = library.logits(llm, tokens)
    assert np.abs(got - model.forward(tokens, types, linear)).max() < TOLERANCE


def test_context_shift_and_state_reuse(tmp_path):
    shape, types = CASES["all-but-one"]
    model, linear, path = make_gguf(tmp_path, shape, types)
    tokens = tokens_for(model, 20)
    llm, _ = library.load_model(path, n_ctx=64, logits_all=True, f32_kv=True)
    import llama_cpp

    llm.reset()
    llm.eval(tokens)
    state = llm.save_state()

    # context shift as llama-server does it: drop positions 4..7, move the rest down by 4
    memory = llama_cpp.llama_get_memory(llm.ctx)
    assert llama_cpp.llama_memory_can_shift(memory)
    assert llama_cpp.llama_memory_seq_rm(memory, 0, 4, 8)
    llama_cpp.llama_memory_seq_add(memory, 0, 8, -1, -4)
    llm.n_tokens = 16
    llm.input_ids[:16] = tokens[:4] + tokens[8:]
    llm.eval([5])
    shifted = np.array(llm.scores[16], dtype=np.float64)
    want = model.forward(tokens[:4] + tokens[8:] + [5], types, linear)[-1]
    assert np.abs(shifted - want).max() < TOLERANCE

    # prompt-cache reuse: restore the saved state and continue from it
    llm.load_state(state)
    llm.eval([9])
    resumed = np.array(llm.scores[20], dtype=np.float64)
    assert np.abs(resumed - model.forward(tokens + [9], types, linear)[-1]).max() < TOLERANCE


STOCK_LOGITS = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from nbl_gguf.llamacpp import library
    path, tokens, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    llm, _ = library.load_model(path, n_ctx=64, logits_all=True, f32_kv=True)
    np.save(out, library.logits(llm, tokens))
    """
)


def logits_with_library(lib_dir, path, tokens, out):
    env = dict(os.environ)
    if lib_dir is not None:
        env["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    subprocess.run(
        [sys.executable, "-c", STOCK_LOGITS, str(path), json.dumps([int(t) for t in tokens]), str(out)],
        check=True, env=env,
    )
    return np.load(out)


def test_stock_gguf_is_unchanged_by_the_patch(tmp_path):
    stock_lib = llamacpp.build_dir() / "stock"
    assert (stock_lib / "libllama.so").exists(), "build the stock library: cmake --build build --target llama-stock"
    model = TinyLlama(n_layer=3, seed=3)
    path = model.write_gguf(tmp_path / "stock.gguf")
    tokens = tokens_for(model, 16)
    patched = logits_with_library(None, path, tokens, tmp_path / "patched.npy")
    stock = logits_with_library(stock_lib, path, tokens, tmp_path / "stock.npy")
    np.testing.assert_array_equal(patched, stock)
    assert np.abs(patched - model.forward(tokens)).max() < TOLERANCE


# --- malformed NBL metadata: each case fails to load with a message naming the layer -------------

KEY = "llama.nbl.layer_types"
I32 = (gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)


def attention_of(layer):
    return {f"blk.{layer}.{stem}.weight" for stem in ("attn_q", "attn_k", "attn_v", "attn_output")}


def nbl_tensors(model, layer, weight_shape=None):
    d = model.n_embd
    return {
        f"blk.{layer}.attn_nbl.weight": np.zeros(weight_shape or (d, d), dtype=np.float32),
        f"blk.{layer}.attn_nbl.bias": np.zeros(d, dtype=np.float32),
    }


def malformed_cases(model):
    types = [A, L, A]
    return {
        "wrong-length": (dict(extra_kv={KEY: ([A, L], *I32)}, skip_tensors=attention_of(1), extra_tensors=nbl_tensors(model, 1)),
                         r"llama.nbl.layer_types has 2 entries, expected one per layer \(3\)"),
        # a single value, not one per layer: rejected by name rather than loaded as if no layer were marked
        "scalar-layer-types": (dict(extra_kv={KEY: (L, gguf.GGUFValueType.INT32, None)}, skip_tensors=attention_of(1),
                                    extra_tensors=nbl_tensors(model, 1)),
                               r"llama.nbl.layer_types must be an int32 array with one entry per layer, not a single i32"),
        "unknown-type": (dict(extra_kv={KEY: ([A, 7, A], *I32)}, skip_tensors=attention_of(1), extra_tensors=nbl_tensors(model, 1)),
                         r"layer 1 has unknown type 7"),
        "missing-weight": (dict(extra_kv={KEY: (types, *I32)}, skip_tensors=attention_of(1)),
                           r"layer 1 has NBL type 1 \(linear\) but tensor 'blk.1.attn_nbl.weight' is missing"),
        "misshaped-weight": (dict(extra_kv={KEY: (types, *I32)}, skip_tensors=attention_of(1),
                                  extra_tensors=nbl_tensors(model, 1, weight_shape=(model.n_embd // 2, model.n_embd))),
                             r"tensor 'blk.1.attn_nbl.weight' has wrong shape"),
        # the graph adds the bias to F32 activations; another type loaded and aborted the first decode (patch 0009)
        "f16-bias": (dict(extra_kv={KEY: (types, *I32)}, skip_tensors=attention_of(1),
                          extra_tensors={**nbl_tensors(model, 1), "blk.1.attn_nbl.bias": np.zeros(model.n_embd, np.float16)}),
                     r"tensor 'blk.1.attn_nbl.bias' has type f16, expected f32"),
        "leftover-attention": (dict(extra_kv={KEY: (types, *I32)}, extra_tensors=nbl_tensors(model, 1)),
                               r"layer 1 has NBL type 1 but carries attention tensor 'blk.1.attn_q.weight'"),
        "nbl-on-attention-layer": (dict(extra_kv={KEY: ([A, A, A], *I32)}, extra_tensors=nbl_tensors(model, 2)),
                                   r"layer 2 has NBL type 0 \(attention\) but carries NBL tensors"),
        "nbl-on-dropped-layer": (dict(extra_kv={KEY: ([A, A, D], *I32)}, skip_tensors=attention_of(2), extra_tensors=nbl_tensors(model, 2)),
                                 r"layer 2 has NBL type 2 \(dropped\) but carries NBL tensors"),
    }


@pytest.mark.parametrize("case", list(malformed_cases(TinyLlama(n_layer=3))))
def test_malformed_metadata_gives_a_clear_error(tmp_path, case):
    model = TinyLlama(n_layer=3)
    kwargs, message = malformed_cases(model)[case]
    path = model.write_gguf(tmp_path / f"{case}.gguf", **kwargs)
    with pytest.raises(NblError, match=message):
        library.load_model(path, n_ctx=64)


# --- llama-quantize -------------------------------------------------------------------------------


@pytest.mark.parametrize("quant, weight_type", [("q8_0", "Q8_0"), ("q4_k_m", None)])
def test_quantized_nbl_gguf_loads_and_generates(tmp_path, quant, weight_type):
    # rows of 256 let the k-quants apply to every matrix
    model = TinyLlama(n_layer=3, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, seed=5)
    types = [A, L, D]
    linear = model.random_linear([1])
    f32 = model.write_nbl_gguf(tmp_path / "f32.gguf", types, linear)
    out = tmp_path / f"{quant}.gguf"
    llamacpp.run_tool("llama-quantize", [f32, out, quant])

    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    weight = tensors["blk.1.attn_nbl.weight"].tensor_type.name
    assert weight == (weight_type or tensors["blk.0.attn_output.weight"].tensor_type.name)
    assert weight not in ("F32", "F16")
    assert tensors["blk.1.attn_nbl.bias"].tensor_type.name == "F32"
    assert not any(name.startswith(("blk.1.attn_q", "blk.2.attn_q", "blk.2.attn_nbl")) for name in tensors)

    llm, kv = library.load_model(out, n_ctx=128, logits_all=True)
    assert kv.layers == 1
    tokens = tokens_for(model, 8)
    # reference: the numpy pass over the file's own weights, dequantized by gguf-py
    dequantized = {
        t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])
        for t in gguf.GGUFReader(out).tensors
    }
    for name in model.weights:
        if name in dequantized:
            model.weights[name] = dequantized[name].astype(np.float32)
    linear_q = {1: (dequantized["blk.1.attn_nbl.weight"], dequantized["blk.1.attn_nbl.bias"])}
    got = library.logits(llm, tokens)
    error = np.abs(got - model.forward(tokens, types, linear_q)).max()
    # llama.cpp also quantizes activations for the dot products: the error stays a small fraction of
    # what the NBL layer contributes
    assert error < 0.1 * np.abs(got - model.forward(tokens, [A, D, D])).max()
    completion = llm.create_completion("Hello", max_tokens=6, temperature=0.0, logit_bias={2: -100.0})
    assert completion["usage"]["completion_tokens"] == 6
