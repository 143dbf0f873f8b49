"""NBL taps layers (type 3) in the patched llama.cpp against the PyTorch reference (the tiny model as a
transformers Llama with calibration.apply's TapsAttention): a prompt then token-by-token decoding, two
sequences interleaved in one batch, a sequence state saved and loaded, seq_cp / seq_keep, and the
removal of a suffix, which the state cannot roll back: it is refused, and re-evaluating gives the
same logits. Malformed taps files fail to load with a message naming the layer or tensor."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from _llama_context import Context
from _llama_server import running_llama_server

from nbl_gguf.calibration.apply import ATTN_LINEAR, ATTN_TAPS, apply_nbl
from nbl_gguf.errors import NblError
from nbl_gguf.fixtures.tiny import TinyLlama
from nbl_gguf.gguf import nbl_format
from nbl_gguf.llamacpp import library
from nbl_gguf.llamacpp import tools as llamacpp

pytestmark = [
    pytest.mark.llama,
    pytest.mark.skipif(not (llamacpp.bin_dir() / "libllama.so").is_file(),
                       reason="needs the patched llama.cpp build (scripts/build_llama.sh)"),
]

A, L, D, T = nbl_format.ATTENTION, nbl_format.LINEAR, nbl_format.DROPPED, nbl_format.TAPS
TOLERANCE = 1e-3
TYPES = [T, A, L, T]  # a taps layer first (its inputs are the embeddings) and one after attention
TAPS = 4
FORMS = ["full", "lowrank", "channel"]


class Reference:
    """The PyTorch reference of one tiny NBL model with taps layers (float32 transformers Llama)."""

    def __init__(self, form: str, seed: int = 11):
        self.tiny = TinyLlama(n_layer=4, n_head=8, n_head_kv=2, seed=seed)
        self.maps = {**self.tiny.random_taps([0, 3], TAPS, form), 2: self.tiny.random_linear([2])[2]}
        kinds = {0: ATTN_TAPS, 2: ATTN_LINEAR, 3: ATTN_TAPS}
        self.model = apply_nbl(self.tiny.hf_model(), kinds, self.maps)

    def logits(self, tokens) -> np.ndarray:
        with torch.no_grad():
            return self.model(torch.tensor([list(tokens)])).logits[0].double().numpy()

    def write(self, path):
        return self.tiny.write_nbl_gguf(path, TYPES, self.maps)

    def tokens(self, n: int, seed: int) -> list[int]:
        return [int(t) for t in np.random.default_rng(seed).integers(3, self.tiny.n_vocab, n)]


def close(got, want) -> float:
    return float(np.abs(got - want).max())


@pytest.fixture(scope="module", params=FORMS)
def taps_model(request, tmp_path_factory):
    reference = Reference(request.param)
    path = reference.write(tmp_path_factory.mktemp(request.param) / "taps.gguf")
    return reference, path


def test_prompt_then_token_by_token_decoding_match_pytorch(taps_model):
    reference, path = taps_model
    tokens = reference.tokens(20, seed=1)
    want = reference.logits(tokens)
    # the comparison can tell a taps layer from a per-token one: drop the lags and it fails
    per_token = reference.tiny.forward(tokens, [L, A, L, L], {**reference.maps, 0: (reference.maps[0].weight,
                                       reference.maps[0].bias), 3: (reference.maps[3].weight, reference.maps[3].bias)})
    assert close(per_token, want) > 100 * TOLERANCE
    context = Context(path, n_seq_max=1)
    try:
        got = np.concatenate([context.run(tokens[:12]), context.step(tokens[12:], start=12)])
        assert close(got, want) < TOLERANCE
        # a prompt split over several ubatches of 5 tokens carries the state across them
        context.seq_rm(0, -1, -1)
    finally:
        context.close()
    small = Context(path, n_seq_max=1, n_ubatch=5)
    try:
        assert close(small.run(tokens), want) < TOLERANCE
    finally:
        small.close()


def test_two_sequences_interleaved_in_one_batch(taps_model):
    reference, path = taps_model
    a, b = reference.tokens(13, seed=2), reference.tokens(9, seed=3)
    context = Context(path)
    try:
        # the prompts' tokens alternate in one batch (a's last 4 alone at the end)
        items = []
        for i in range(max(len(a), len(b)) - 4):
            items += [(a[i], i, 0)] if i < len(a) - 4 else []
            items += [(b[i], i, 1)] if i < len(b) - 2 else []
        got = context.decode(items)
        rows_a = [k for k, (_, _, s) in enumerate(items) if s == 0]
        rows_b = [k for k, (_, _, s) in enumerate(items) if s == 1]
        n_a, n_b = len(rows_a), len(rows_b)
        assert close(got[rows_a], reference.logits(a[:n_a])) < TOLERANCE
        assert close(got[rows_b], reference.logits(b[:n_b])) < TOLERANCE
        # then both continue one token each per batch
        for step in range(2):
            got = context.decode([(a[n_a + step], n_a + step, 0), (b[n_b + step], n_b + step, 1)])
            assert close(got[0], reference.logits(a[:n_a + step + 1])[-1]) < TOLERANCE
            assert close(got[1], reference.logits(b[:n_b + step + 1])[-1]) < TOLERANCE
    finally:
        context.close()


def test_sequence_state_save_and_load(taps_model):
    reference, path = taps_model
    prompt, other = reference.tokens(10, seed=4), reference.tokens(6, seed=5)
    context = Context(path)
    try:
        context.run(prompt)
        saved = context.save_seq(0)
        context.run(other, start=len(prompt))  # moves the state on
        context.seq_rm(0, -1, -1)
        context.load_seq(saved, 0)
        assert context.pos_max(0) == len(prompt) - 1
        got = context.run([7], start=len(prompt))
        assert close(got[0], reference.logits(prompt + [7])[-1]) < TOLERANCE
        # into another sequence of a fresh context (a prompt cache restored elsewhere)
        fresh = Context(path)
        try:
            fresh.load_seq(saved, 1)
            got = fresh.step([9, 12], seq=1, start=len(prompt))
            assert close(got, reference.logits(prompt + [9, 12])[-2:]) < TOLERANCE
        finally:
            fresh.close()
    finally:
        context.close()


def test_seq_rm_of_a_suffix_is_refused_and_reevaluation_gives_the_same_logits(taps_model):
    reference, path = taps_model
    prompt = reference.tokens(12, seed=6)
    context = Context(path)
    try:
        context.run(prompt)
        # the kept inputs are those of the last tokens: dropping positions 8.. cannot be undone
        assert not context.seq_rm(0, 8, -1)
        assert context.pos_max(0) == len(prompt) - 1  # nothing was removed
        got = context.run([5], start=len(prompt))
        assert close(got[0], reference.logits(prompt + [5])[-1]) < TOLERANCE
        # what a caller does then: drop the sequence and evaluate the kept prefix again
        assert context.seq_rm(0, -1, -1)
        again = context.run(prompt[:8] + [21, 22])
        assert close(again, reference.logits(prompt[:8] + [21, 22])) < TOLERANCE
    finally:
        context.close()
    # the refusal comes from the taps state: the same model without taps layers rolls back
    linear = {i: (m.weight, m.bias) if hasattr(m, "taps") else m for i, m in reference.maps.items()}
    plain = reference.tiny.write_nbl_gguf(path.with_name("plain.gguf"), [L, A, L, L], linear)
    context = Context(plain)
    try:
        context.run(prompt)
        assert context.seq_rm(0, 8, -1) and context.pos_max(0) == 7
    finally:
        context.close()


def test_seq_cp_and_seq_keep(taps_model):
    reference, path = taps_model
    prompt = reference.tokens(9, seed=7)
    context = Context(path)
    try:
        context.run(prompt)
        context.lib.llama_memory_seq_cp(context.memory, 0, 1, -1, -1)
        n = len(prompt)
        got = context.decode([(30, n, 0), (40, n, 1)])  # the two copies go different ways
        assert close(got[0], reference.logits(prompt + [30])[-1]) < TOLERANCE
        assert close(got[1], reference.logits(prompt + [40])[-1]) < TOLERANCE
        context.lib.llama_memory_seq_keep(context.memory, 1)
        assert context.pos_max(0) == -1 and context.pos_max(1) == n
        got = context.run([41], seq=1, start=n + 1)
        assert close(got[0], reference.logits(prompt + [40, 41])[-1]) < TOLERANCE
    finally:
        context.close()


def test_taps_layers_keep_no_kv_cache(tmp_path):
    reference = Reference("full")
    path = reference.write(tmp_path / "taps.gguf")
    _, kv = library.load_model(path, n_ctx=4096, f32_kv=True)
    assert kv.layers == TYPES.count(A)
    layer_mib = 2 * 4096 * reference.tiny.n_head_kv * reference.tiny.head_dim * 4 / 2**20
    assert kv.mib == pytest.approx(TYPES.count(A) * layer_mib, abs=0.011)


@pytest.mark.parametrize("form", FORMS)
def test_quantized_taps_file_runs(tmp_path, form):
    # rows of 256 let every quantized type apply; the lag maps are quantized like W, the per-channel
    # taps stay F32 (patch 0013), the low-rank up map's rows of r = 32 fit Q8_0 blocks
    model = TinyLlama(n_layer=3, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, seed=5)
    types = [A, T, D]
    maps = model.random_taps([1], TAPS, form, rank=32)
    f32 = model.write_nbl_gguf(tmp_path / "f32.gguf", types, maps)
    out = tmp_path / "q8_0.gguf"
    llamacpp.run_tool("llama-quantize", [f32, out, "q8_0"])
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    kinds = {name: t.tensor_type.name for name, t in tensors.items() if name.startswith("blk.1.attn_nbl")}
    expected = {"full": {"attn_nbl_lag.weight": "Q8_0"},
                "lowrank": {"attn_nbl_lag_down.weight": "Q8_0", "attn_nbl_lag_up.weight": "Q8_0"},
                "channel": {"attn_nbl_conv.weight": "F32"}}[form]
    assert kinds == {"blk.1.attn_nbl.weight": "Q8_0", "blk.1.attn_nbl.bias": "F32",
                     **{f"blk.1.{k}": v for k, v in expected.items()}}
    # reference: the numpy pass over the file's own weights, dequantized by gguf-py
    deq = {name: gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])
           for name, t in tensors.items()}
    for name in model.weights:
        if name in deq:
            model.weights[name] = deq[name].astype(np.float32)
    quantized_map = maps[1]
    for key, pattern in {"weight": nbl_format.NBL_WEIGHT, "bias": nbl_format.NBL_BIAS, **nbl_format.TAPS_TENSORS}.items():
        if pattern.format(layer=1) in deq:
            setattr(quantized_map, key, deq[pattern.format(layer=1)])
    tokens = [int(t) for t in np.random.default_rng(3).integers(3, model.n_vocab, 12)]
    context = Context(out, n_seq_max=1)
    try:
        got = np.concatenate([context.run(tokens[:6]), context.step(tokens[6:], start=6)])
    finally:
        context.close()
    want = model.forward(tokens, types, {1: quantized_map})
    # llama.cpp also quantizes the activations for the dot products: the error stays a small part of
    # what the taps layer adds
    assert close(got, want) < 0.1 * close(got, model.forward(tokens, [A, D, D]))


# --- malformed taps files: each fails to load with a message naming what is wrong ---------------

KEY, TAPS_KEY = "llama.nbl.layer_types", "llama.nbl.taps"
I32 = (gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
U32 = (gguf.GGUFValueType.UINT32, None)


def attention_of(layer):
    return {f"blk.{layer}.{stem}.weight" for stem in ("attn_q", "attn_k", "attn_v", "attn_output")}


def taps_tensors(model, layer, k=3, **shapes):
    """A type-3 layer's tensors (full form), any of them replaced or dropped (None) through ``shapes``."""
    d = model.n_embd
    names = {"weight": f"blk.{layer}.attn_nbl.weight", "bias": f"blk.{layer}.attn_nbl.bias",
             **{key: pattern.format(layer=layer) for key, pattern in nbl_format.TAPS_TENSORS.items()}}
    default = {"weight": (d, d), "bias": (d,), "lag": (d, (k - 1) * d)}
    out = {}
    for key, shape in {**default, **shapes}.items():
        if shape is None:
            continue
        dtype = np.float16 if key == "conv16" else np.float32
        out[names[key.removesuffix("16")]] = np.zeros(shape, dtype=dtype)
    return out


def malformed_cases(model):
    d = model.n_embd
    types, skip = [A, T, A], attention_of(1)
    taps3 = {KEY: (types, *I32), TAPS_KEY: (3, *U32)}
    return {
        "no-taps-key": (dict(extra_kv={KEY: (types, *I32)}, skip_tensors=skip, extra_tensors=taps_tensors(model, 1)),
                        r"llama.nbl.layer_types has NBL taps layers \(type 3\) but llama.nbl.taps is missing"),
        "taps-key-without-taps-layers": (dict(extra_kv={KEY: ([A, L, A], *I32), TAPS_KEY: (3, *U32)}, skip_tensors=skip,
                                              extra_tensors=taps_tensors(model, 1, lag=None)),
                                         r"llama.nbl.taps is set but no layer has NBL type 3"),
        "one-tap": (dict(extra_kv={KEY: (types, *I32), TAPS_KEY: (1, *U32)}, skip_tensors=skip,
                         extra_tensors=taps_tensors(model, 1)), r"llama.nbl.taps is 1, expected 2 to 64"),
        "no-lag-tensors": (dict(extra_kv=taps3, skip_tensors=skip, extra_tensors=taps_tensors(model, 1, lag=None)),
                           r"layer 1 has NBL type 3 \(taps\) but none of 'blk.1.attn_nbl_lag.weight'"),
        "misshaped-lag": (dict(extra_kv=taps3, skip_tensors=skip, extra_tensors=taps_tensors(model, 1, lag=(d, d))),
                          r"tensor 'blk.1.attn_nbl_lag.weight' has wrong shape"),
        "half-a-low-rank-map": (dict(extra_kv=taps3, skip_tensors=skip,
                                     extra_tensors=taps_tensors(model, 1, lag=None, lag_down=(4, 2 * d))),
                                r"layer 1 has NBL type 3 \(taps\) but tensor 'blk.1.attn_nbl_lag_up.weight' is missing"),
        "misshaped-lag-up": (dict(extra_kv=taps3, skip_tensors=skip,
                                  extra_tensors=taps_tensors(model, 1, lag=None, lag_down=(4, 2 * d), lag_up=(d, 5))),
                             r"tensor 'blk.1.attn_nbl_lag_up.weight' has wrong shape"),
        "full-and-low-rank": (dict(extra_kv=taps3, skip_tensors=skip,
                                   extra_tensors=taps_tensors(model, 1, lag_down=(4, 2 * d), lag_up=(d, 4))),
                              r"layer 1 carries 'blk.1.attn_nbl_lag.weight' and a low-rank lag map"),
        "misshaped-conv": (dict(extra_kv=taps3, skip_tensors=skip, extra_tensors=taps_tensors(model, 1, conv=(2, d))),
                           r"tensor 'blk.1.attn_nbl_conv.weight' has wrong shape"),
        "f16-conv": (dict(extra_kv=taps3, skip_tensors=skip, extra_tensors=taps_tensors(model, 1, conv16=(3, d))),
                     r"tensor 'blk.1.attn_nbl_conv.weight' has type f16, expected f32"),
        "taps-tensor-on-a-linear-layer": (dict(extra_kv={KEY: ([A, L, A], *I32)}, skip_tensors=skip,
                                               extra_tensors=taps_tensors(model, 1)),
                                          r"layer 1 has NBL type 1 \(linear\) but carries taps tensor "
                                          r"'blk.1.attn_nbl_lag.weight', expected type 3"),
        "taps-without-weight": (dict(extra_kv=taps3, skip_tensors=skip, extra_tensors=taps_tensors(model, 1, weight=None)),
                                r"layer 1 has NBL type 3 \(taps\) but tensor 'blk.1.attn_nbl.weight' is missing"),
    }


@pytest.mark.parametrize("case", list(malformed_cases(TinyLlama(n_layer=3))))
def test_malformed_taps_files_give_a_clear_error(tmp_path, case):
    model = TinyLlama(n_layer=3)
    kwargs, message = malformed_cases(model)[case]
    path = model.write_gguf(tmp_path / f"{case}.gguf", **kwargs)
    with pytest.raises(NblError, match=message):
        library.load_model(path, n_ctx=64)


def load_make_seeds():
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "make_seeds", Path(__file__).resolve().parent.parent / "fuzz" / "make_seeds.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_seeds", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def arch_switch_cases(function: str) -> set[str]:
    """The architectures a `bool <function>(const llm_arch & arch)` switch of the patched llama-arch.cpp returns
    true for, as GGUF names (LLM_ARCH_GEMMA3 -> gemma3)."""
    import re

    text = (llamacpp.source_dir() / "src" / "llama-arch.cpp").read_text(encoding="utf-8")
    body = re.search(rf"bool {function}\(const llm_arch & arch\) \{{(.*?)\n\}}", text, re.S)
    assert body, function
    return {name.lower() for name in re.findall(r"case LLM_ARCH_(\w+):", body.group(1))}


@pytest.mark.skipif(not (llamacpp.source_dir() / "src" / "llama-arch.cpp").is_file(),
                    reason="needs the patched llama.cpp tree (scripts/build_llama.sh)")
def test_the_taps_architectures_are_those_the_patched_loader_admits():
    """nbl_format's lists mirror llm_arch_supports_nbl() and llm_arch_supports_nbl_taps(): the writer refuses
    a taps layer exactly where the loader would (every NBL architecture since patch 0021)."""
    assert arch_switch_cases("llm_arch_supports_nbl") == set(nbl_format.SUPPORTED_ARCHITECTURES)
    assert arch_switch_cases("llm_arch_supports_nbl_taps") == set(nbl_format.TAPS_ARCHITECTURES)


def test_taps_where_the_graph_cannot_build_them_are_refused_by_name(tmp_path, monkeypatch):
    """An architecture that joins the NBL ones without its graph passing the taps state is left out of
    TAPS_ARCHITECTURES, as of llm_arch_supports_nbl_taps(): the writer refuses a taps layer for it by name,
    leaving nothing behind. (The loader's own refusal has no architecture left to be seen with.)"""
    seeds = load_make_seeds()
    stock = seeds.write_seed(tmp_path / "qwen3.gguf", "qwen3", seeds.Seed("qwen3", None))
    taps = TinyLlama(n_layer=3, n_embd=seeds.N_EMBD).random_taps([1], 3)
    with monkeypatch.context() as patched:
        patched.setattr(nbl_format, "TAPS_ARCHITECTURES", ("llama", "qwen2"))
        with pytest.raises(NblError, match="'qwen3' model; the patched llama.cpp runs taps layers .* for llama, qwen2 only"):
            nbl_format.write_nbl_gguf(stock, tmp_path / "out.gguf", nbl_format.NblLayers(types=[A, T, A], taps=taps))
    assert not list(tmp_path.glob("out.gguf*")) and not list(tmp_path.glob(".out.gguf*"))


# --- llama-server: parallel slots, the prompt cache, and prompts that share only a prefix ----------
# (no --cache-reuse: reusing a cached chunk by shifting it is as approximate for the taps state as for
# K/V, which were computed with the dropped tokens in context, so it has no exact reference here)


@pytest.fixture()
def taps_server(tmp_path):
    model = TinyLlama(n_layer=4, n_head=8, n_head_kv=2, seed=11)
    maps = {**model.random_taps([0, 3], TAPS, "full"), 2: model.random_linear([2])[2]}
    path = model.write_nbl_gguf(tmp_path / "taps.gguf", TYPES, maps)
    with running_llama_server(path, tmp_path / "server.log", "-np", "2", "-c", "512", "-ctk", "f32", "-ctv", "f32",
                              "-t", "2") as port:
        yield port, model, maps


def test_server_parallel_slots_and_prompt_cache_with_taps_layers(taps_server):
    from concurrent.futures import ThreadPoolExecutor

    from test_llama_server import N_PREDICT, complete, greedy

    port, model, maps = taps_server
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(3, model.n_vocab, size=n)] for n in (20, 27)]

    def want(prompt):
        return greedy(model, prompt, TYPES, maps, N_PREDICT)

    with ThreadPoolExecutor(max_workers=2) as pool:  # both slots decode at once
        results = list(pool.map(lambda p: complete(port, p), prompts))
    for prompt, result in zip(prompts, results):
        assert result["tokens"] == want(prompt)

    # the same prompt again: the server cannot drop the last token from the taps state, so it restores
    # a context checkpoint (the partial sequence state: the taps inputs and the KV of that prefix) and
    # evaluates the rest
    again = complete(port, prompts[0])
    assert again["tokens"] == results[0]["tokens"]
    assert again["timings"]["prompt_n"] < len(prompts[0])
    # a prompt sharing only a prefix with the cached one: the taps state cannot drop the cached suffix,
    # so the server restores a checkpoint or re-evaluates instead of continuing from a stale state
    branch = prompts[0][:14] + [int(t) for t in rng.integers(3, model.n_vocab, size=5)]
    assert complete(port, branch)["tokens"] == want(branch)
    # and the other slot still continues its own prompt
    longer = prompts[1] + [int(t) for t in rng.integers(3, model.n_vocab, size=3)]
    assert complete(port, longer)["tokens"] == want(longer)
