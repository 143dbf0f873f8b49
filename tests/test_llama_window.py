"""Window layers (attention over the last W tokens and the first S, the sinks) in the patched llama.cpp
against the float64 reference of the tiny model (fixtures.tiny.TinyLlama.forward with the same masks):
prompts long enough that the sliding-window cache evicts cells, token-by-token decoding, two sequences
in one batch, a sequence state saved and loaded, a suffix removed, beside NBL and taps layers; the
cache llama.cpp allocates against kv_cache's figures; malformed files refused by name."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from _llama_context import Context

from nbl_gguf import kv_cache
from nbl_gguf.errors import NblError
from nbl_gguf.fixtures.tiny import TinyLlama
from nbl_gguf.gguf import metadata
from nbl_gguf.gguf import nbl_format
from nbl_gguf.llamacpp import library
from nbl_gguf.llamacpp import tools as llamacpp

pytestmark = [
    pytest.mark.llama,
    pytest.mark.skipif(not (llamacpp.bin_dir() / "libllama.so").is_file(),
                       reason="needs the patched llama.cpp build (scripts/build_llama.sh)"),
]

A, L, T = nbl_format.ATTENTION, nbl_format.LINEAR, nbl_format.TAPS
TOLERANCE = 1e-3
SIZE, SINKS = 6, 2
# the sliding-window cache holds pad256(W + S + n_ubatch) = 256 cells: a prompt of 300 tokens, fed in
# ubatches of 8, overwrites the oldest window cells and must keep the sinks
N_CTX, N_UBATCH, N_PROMPT = 1024, 8, 300


class Reference:
    def __init__(self, types, windows, seed: int = 21):
        self.tiny = TinyLlama(n_layer=len(types), n_head=8, n_head_kv=2, n_ctx_train=1024, seed=seed)
        self.types, self.windows = list(types), windows
        maps = {**self.tiny.random_linear([i for i, t in enumerate(types) if t == L])}
        maps.update(self.tiny.random_taps([i for i, t in enumerate(types) if t == T], 4, "full"))
        self.maps = maps

    def logits(self, tokens, windows="own") -> np.ndarray:
        return self.tiny.forward(tokens, self.types, self.maps, self.windows if windows == "own" else windows)

    def write(self, path):
        return self.tiny.write_nbl_gguf(path, self.types, self.maps, windows=self.windows)

    def tokens(self, n: int, seed: int) -> list[int]:
        return [int(t) for t in np.random.default_rng(seed).integers(3, self.tiny.n_vocab, n)]


def close(got, want) -> float:
    return float(np.abs(got - want).max())


MODELS = {
    "windows": ([A, A, A, A], (0, 2)),
    "windows-nbl-taps": ([T, A, L, A], (1, 3)),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def window_model(request, tmp_path_factory):
    types, layers = MODELS[request.param]
    reference = Reference(types, nbl_format.Windows(layers=layers, size=SIZE, sinks=SINKS))
    return reference, reference.write(tmp_path_factory.mktemp(request.param) / "window.gguf")


def context(path, **kwargs) -> Context:
    return Context(path, n_ctx=N_CTX, n_ubatch=N_UBATCH, **{"n_seq_max": 1, **kwargs})


def test_long_prompt_then_decoding_match_the_reference(window_model):
    reference, path = window_model
    tokens = reference.tokens(N_PROMPT + 4, seed=1)
    want = reference.logits(tokens)
    # the comparison sees the window and the sinks: full attention, or a window without sinks, fails it
    assert close(reference.logits(tokens, windows=None), want) > 100 * TOLERANCE
    no_sinks = nbl_format.Windows(layers=reference.windows.layers, size=SIZE, sinks=0)
    assert close(reference.logits(tokens, windows=no_sinks), want) > 100 * TOLERANCE
    ctx = context(path)
    try:
        got = np.concatenate([ctx.run(tokens[:N_PROMPT]), ctx.step(tokens[N_PROMPT:], start=N_PROMPT)])
        assert close(got, want) < TOLERANCE
        # the window's cells were overwritten: the cache now reports where its window begins (a
        # server then knows it cannot reuse a prefix that ends before it); a taps state, its last token
        assert ctx.pos_max(0) == N_PROMPT + 3
        if T in reference.types:
            assert ctx.pos_min(0) == N_PROMPT + 3
        else:
            assert SINKS < ctx.pos_min(0) <= N_PROMPT + 4 - SIZE
    finally:
        ctx.close()


def test_two_sequences_in_one_batch(window_model):
    reference, path = window_model
    a, b = reference.tokens(40, seed=2), reference.tokens(33, seed=3)
    ctx = context(path, n_seq_max=2)
    try:
        got_a, got_b = ctx.interleaved(a, b)
        assert close(got_a, reference.logits(a)) < TOLERANCE
        assert close(got_b, reference.logits(b)) < TOLERANCE
    finally:
        ctx.close()


def test_sequence_state_save_and_load(window_model):
    reference, path = window_model
    prompt = reference.tokens(N_PROMPT, seed=4)
    ctx = context(path, n_seq_max=2)  # a state loads into a context of as many streams
    try:
        ctx.run(prompt)
        saved = ctx.save_seq(0)
    finally:
        ctx.close()
    # into another sequence of a fresh context: the sinks and the window come back
    fresh = context(path, n_seq_max=2)
    try:
        fresh.load_seq(saved, 1)
        assert fresh.pos_max(1) == N_PROMPT - 1
        got = fresh.step([9, 12], seq=1, start=N_PROMPT)
        assert close(got, reference.logits(prompt + [9, 12])[-2:]) < TOLERANCE
    finally:
        fresh.close()


def test_removing_a_suffix_within_the_window(window_model):
    reference, path = window_model
    if T in reference.types:
        pytest.skip("a taps layer's state cannot roll back a suffix (test_llama_taps)")
    prompt = reference.tokens(N_PROMPT, seed=6)
    ctx = context(path)
    try:
        ctx.run(prompt)
        keep = N_PROMPT - 3  # the last window still holds positions keep - SIZE .. keep - 1
        assert ctx.seq_rm(0, keep, -1) and ctx.pos_max(0) == keep - 1
        got = ctx.run([5, 6], start=keep)
        assert close(got, reference.logits(prompt[:keep] + [5, 6])[-2:]) < TOLERANCE
    finally:
        ctx.close()


def test_swa_full_gives_the_same_logits(window_model):
    reference, path = window_model
    tokens = reference.tokens(N_PROMPT, seed=8)
    ctx = context(path, swa_full=True)
    try:
        assert close(ctx.run(tokens), reference.logits(tokens)) < TOLERANCE
    finally:
        ctx.close()


# pad256(700 + 4 + n_ubatch): llama-cli's micro-batch, and a smaller one (-ub 128) that shrinks the window cache
@pytest.mark.parametrize("n_ubatch, window_cells", [(512, 1280), (128, 1024)])
def test_window_cache_is_the_window_the_sinks_and_a_ubatch(tmp_path, n_ubatch, window_cells):
    reference = Reference([A, A, L, A], nbl_format.Windows(layers=(0, 3), size=700, sinks=4))
    path = reference.write(tmp_path / "window.gguf")
    n_ctx = 4096
    _, caches = library.load_model_caches(path, n_ctx=n_ctx, n_ubatch=n_ubatch, swa_full=False, f32_kv=True)
    reader = gguf.GGUFReader(path)
    sizes = kv_cache.kv_size(metadata.kv_model(reader),
                             kv_cache.Context(n_ctx=n_ctx, n_ubatch=n_ubatch, type_k="f32", type_v="f32"))
    assert [(c.cells, c.layers) for c in caches] == [(4096, 1), (window_cells, 2)]
    assert [(c.cells, c.layers) for c in sizes.caches.values()] == [(4096, 1), (window_cells, 2)]
    assert sum(c.mib for c in caches) == pytest.approx(sizes.bytes / 2**20, abs=0.011)
    # what convert's summary and inspect report at that micro-batch (-ub)
    assert metadata.kv_sizes(reader, n_ctx, kv_type="f32", n_ubatch=n_ubatch)[1] == sizes


def bad_file(tmp_path, types, extra_kv, name="bad.gguf"):
    tiny = TinyLlama(n_layer=len(types), seed=3)
    maps = tiny.random_linear([i for i, t in enumerate(types) if t == L])
    stock = tiny.write_gguf(tmp_path / "stock.gguf", extra_kv=extra_kv)
    nbl_format.write_nbl_gguf(stock, tmp_path / name, nbl_format.NblLayers(types=types, linear=maps))
    return tmp_path / name


ARRAY, BOOL, U32 = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL, gguf.GGUFValueType.UINT32


@pytest.mark.parametrize("types, extra, message", [
    ([A, A, A], {"llama.attention.sliding_window": (8, U32, None),
                 "llama.attention.sliding_window_pattern": ([True, False], ARRAY, BOOL)},
     "has 2 entries, expected one per layer"),
    ([A, A, A], {"llama.attention.sliding_window_pattern": ([True, False, False], ARRAY, BOOL)},
     "llama.attention.sliding_window is missing or 0"),
    ([A, L, A], {"llama.attention.sliding_window": (8, U32, None),
                 "llama.attention.sliding_window_pattern": ([False, True, False], ARRAY, BOOL)},
     "layer 1 is a sliding-window layer"),
    ([A, A, A], {"llama.nbl.window_sinks": (4, U32, None)}, "has no sliding-window layers"),
])
def test_malformed_window_files_are_refused_by_name(tmp_path, types, extra, message):
    path = bad_file(tmp_path, types, extra)
    with pytest.raises(NblError, match=message):
        library.load_model(path, n_ctx=64)


def test_a_lone_sliding_window_key_keeps_every_layer_global(tmp_path):
    # as a stock converter may write for a Mistral: no pattern array, no window layers
    path = bad_file(tmp_path, [A, A, A], {"llama.attention.sliding_window": (8, U32, None)})
    _, caches = library.load_model_caches(path, n_ctx=512, swa_full=False)
    assert len(caches) == 1 and caches[0].cells == 512
