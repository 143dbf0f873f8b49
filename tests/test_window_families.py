"""Window layers (attention over the last W tokens and the first S, the sinks) in the families other than
llama that the patched llama.cpp builds them for (patches 0018, 0019: qwen2, qwen3, phi3, smollm3):
each tiny random HF model of the family, converted by the pinned converter and given window layers beside
an NBL layer, against the HF model itself in float64 with the same layers replaced and the same masks
(apply.WindowAttention), an implementation independent of llama.cpp's graph and cache. The prompt is
longer than the sliding-window cache, so its cells are overwritten and the sinks must stay; then token
by token decoding, two sequences of as many tokens in one batch, and the cache llama.cpp allocates against
kv_cache's figures. test_llama_window does the same for llama against fixtures.tiny's numpy reference."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
from _family_helpers import FAMILIES, HIDDEN, N_LAYER, sentencepiece_model, tiny_family_model
from _llama_context import Context

from nbl_gguf import kv_cache
from nbl_gguf.architectures import ARCHITECTURES
from nbl_gguf.fixtures.tiny import random_linear, random_taps
from nbl_gguf.gguf import metadata
from nbl_gguf.gguf import nbl_format
from nbl_gguf.llamacpp import library
from nbl_gguf.llamacpp.tools import bin_dir, source_dir

pytestmark = [
    pytest.mark.llama,
    pytest.mark.skipif(not (source_dir() / "convert_hf_to_gguf.py").is_file() or not (bin_dir() / "libllama.so").is_file(),
                       reason="needs the patched llama.cpp build (scripts/build_llama.sh)"),
]

A, L, T = nbl_format.ATTENTION, nbl_format.LINEAR, nbl_format.TAPS
# the HF families converted to a window architecture other than llama (whose graph test_llama_window checks)
WINDOW_FAMILIES = sorted(family for family, (_, _, arch, _) in FAMILIES.items()
                         if arch in nbl_format.WINDOW_ARCHITECTURES and arch != "llama")
TYPES = [A, L, A, A]  # layer 1 an NBL map: it owns no cache in either of the iSWA caches
SIZE, SINKS = 6, 2
WINDOWS = nbl_format.Windows(layers=(0, 3), size=SIZE, sinks=SINKS)  # layer 3 is SmolLM3's layer without RoPE
# the sliding-window cache of one sequence holds pad256(W + S + n_ubatch) = 256 cells: a prompt of 300
# tokens, fed in ubatches of 8, overwrites the oldest window cells and must keep the sinks
N_CTX, N_UBATCH, N_PROMPT = 1024, 8, 300
TOLERANCE = 1e-3  # relative to the largest reference logit
# Phi-3-mini's own window, which llama.cpp turns off, as its converter writes it: the file's W replaces it
PHI3_OWN_WINDOW = 2047


def test_window_families_cover_every_architecture_without_windows_of_its_own():
    """Every supported architecture either has sliding layers of its own (gemma2/3) or builds window layers,
    and the graph of each window architecture takes the iSWA input (a file with window layers whose graph
    does not aborts at its first decode: 'Use llama_kv_cache_iswa for SWA')."""
    for arch in nbl_format.SUPPORTED_ARCHITECTURES:
        assert (arch in nbl_format.WINDOW_ARCHITECTURES) != (ARCHITECTURES[arch].sliding_pattern is not None), arch
    for arch in nbl_format.WINDOW_ARCHITECTURES:
        graph = (source_dir() / "src" / "models" / f"{arch}.cpp").read_text(encoding="utf-8")
        assert re.search(r"build_attn_inp_kv_iswa\(\)|build_inp_mem_hybrid_iswa\(\)", graph), arch
    assert {FAMILIES[family][2] for family in WINDOW_FAMILIES} == set(nbl_format.WINDOW_ARCHITECTURES) - {"llama"}


@pytest.fixture(scope="module")
def spm():
    from nbl_gguf.calibration.dataset import heldout_texts

    return sentencepiece_model(heldout_texts())


class Reference:
    """The family's HF model in float64, layer 1 replaced by the NBL (or taps) map, some layers given windows."""

    def __init__(self, model_dir, maps, types=TYPES):
        self.model_dir, self.maps, self.types, self.models = model_dir, maps, types, {}

    def _model(self, windows):
        import torch
        from transformers import AutoModelForCausalLM

        from nbl_gguf.calibration.apply import ATTN_LINEAR, ATTN_TAPS, ATTN_WINDOW, apply_nbl

        key = None if windows is None else (windows.layers, windows.size, windows.sinks)
        if key not in self.models:
            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float64).eval()
            types = {i: {L: ATTN_LINEAR, T: ATTN_TAPS}[t] for i, t in enumerate(self.types) if t in (L, T)}
            maps = dict(self.maps)
            if windows is not None:
                types.update({i: ATTN_WINDOW for i in windows.layers})
                maps.update({i: windows for i in windows.layers})
            self.models[key] = apply_nbl(model, types, maps)
        return self.models[key]

    def logits(self, tokens, windows=WINDOWS) -> np.ndarray:
        import torch

        with torch.no_grad():
            return self._model(windows)(torch.tensor([tokens])).logits[0].numpy()


@pytest.fixture(scope="module", params=WINDOW_FAMILIES)
def family_window_model(request, spm, tmp_path_factory):
    """(family, HF reference, stock GGUF, the NBL GGUF with window layers)."""
    family = request.param
    maps = random_linear(HIDDEN, [i for i, t in enumerate(TYPES) if t == L], seed=5)
    model_dir, stock, path = family_files(family, spm, tmp_path_factory.mktemp(family),
                                          nbl_format.NblLayers(types=TYPES, linear=maps, windows=WINDOWS))
    return family, Reference(model_dir, maps), stock, path


def family_files(family, spm, root, layers: nbl_format.NblLayers):
    """(the family's tiny HF folder, its stock GGUF, the NBL GGUF of ``layers``)."""
    from nbl_gguf.gguf.hf_to_gguf import convert_hf_to_gguf

    # a training context that holds the prompt; Phi-3 with its own window, as Phi-3-mini's config has it
    overrides = {"max_position_embeddings": N_CTX}
    if family == "phi3":
        overrides.update(original_max_position_embeddings=N_CTX, sliding_window=PHI3_OWN_WINDOW)
    model_dir = tiny_family_model(family, root, spm, **overrides)
    stock = convert_hf_to_gguf(model_dir, root / "stock.gguf", "f32")
    return model_dir, stock, nbl_format.write_nbl_gguf(stock, root / "window.gguf", layers)


def tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 1000, n)]


def error(got, want) -> float:
    """The largest difference, relative to the largest reference logit."""
    return float(np.abs(got - want).max() / np.abs(want).max())


def context(path, **kwargs) -> Context:
    return Context(path, n_ctx=N_CTX, n_ubatch=N_UBATCH, **{"n_seq_max": 1, **kwargs})


def test_the_file_marks_the_window_layers(family_window_model):
    family, _, stock, path = family_window_model
    reader = gguf.GGUFReader(path)
    assert str(reader.fields["general.architecture"].contents()) == FAMILIES[family][2]
    assert nbl_format.read_windows(reader) == WINDOWS
    assert nbl_format.read_layer_types(reader) == TYPES
    if family == "phi3":  # the converter's own window key is replaced by W, not duplicated
        arch = FAMILIES[family][2]
        key = nbl_format.SLIDING_WINDOW_KEY.format(arch=arch)
        assert gguf.GGUFReader(stock).fields[key].contents() == PHI3_OWN_WINDOW
        assert reader.fields[key].contents() == SIZE


def test_long_prompt_then_decoding_match_the_reference(family_window_model):
    _, reference, _, path = family_window_model
    ids = tokens(N_PROMPT + 4, seed=1)
    want = reference.logits(ids)
    # the comparison sees the window and the sinks: full attention, or a window without sinks, fails it
    assert error(reference.logits(ids, windows=None), want) > 20 * TOLERANCE
    no_sinks = nbl_format.Windows(layers=WINDOWS.layers, size=SIZE, sinks=0)
    assert error(reference.logits(ids, windows=no_sinks), want) > 20 * TOLERANCE
    ctx = context(path)
    try:
        got = np.concatenate([ctx.run(ids[:N_PROMPT]), ctx.step(ids[N_PROMPT:], start=N_PROMPT)])
        assert got.shape == want.shape
        assert error(got, want) < TOLERANCE
        # the window's cells were overwritten: the cache reports where its window begins
        assert ctx.pos_max(0) == N_PROMPT + 3
        assert SINKS < ctx.pos_min(0) <= N_PROMPT + 4 - SIZE
    finally:
        ctx.close()


def test_two_sequences_in_one_batch(family_window_model):
    _, reference, _, path = family_window_model
    a, b = tokens(290, seed=2), tokens(270, seed=3)  # each overwrites its own stream's window cells
    ctx = context(path, n_seq_max=2)
    try:
        got_a, got_b = ctx.interleaved(a, b)
        assert error(got_a, reference.logits(a)) < TOLERANCE
        assert error(got_b, reference.logits(b)) < TOLERANCE
    finally:
        ctx.close()


@pytest.mark.parametrize("family", WINDOW_FAMILIES)
def test_a_taps_layer_beside_window_layers_matches_the_reference(family, spm, tmp_path):
    """Patch 0021: the taps layer's state in the hybrid iSWA memory beside the two caches of the window and the
    global layers (patch 0017), carried from ubatch to ubatch of the long prompt and then token by token."""
    types = [A, T, A, A]
    maps = random_taps(HIDDEN, [1], 3, seed=6)
    model_dir, _, path = family_files(family, spm, tmp_path, nbl_format.NblLayers(types=types, taps=maps,
                                                                                 windows=WINDOWS))
    reference = Reference(model_dir, maps, types)
    ids = tokens(N_PROMPT + 4, seed=9)
    want = reference.logits(ids)
    # the taps layer's lags show: the same layer as a per-token map (its current-token part) differs
    per_token = Reference(model_dir, {1: (maps[1].weight, maps[1].bias)}, [A, L, A, A])
    assert error(per_token.logits(ids), want) > 20 * TOLERANCE
    ctx = context(path)
    try:
        got = np.concatenate([ctx.run(ids[:N_PROMPT]), ctx.step(ids[N_PROMPT:], start=N_PROMPT)])
        assert error(got, want) < TOLERANCE
    finally:
        ctx.close()


def test_swa_full_gives_the_same_logits(family_window_model):
    _, reference, _, path = family_window_model
    ids = tokens(N_PROMPT, seed=8)
    ctx = context(path, swa_full=True)
    try:
        assert error(ctx.run(ids), reference.logits(ids)) < TOLERANCE
    finally:
        ctx.close()


def test_window_cache_is_the_window_the_sinks_and_a_ubatch(family_window_model):
    family, _, stock, path = family_window_model
    n_ctx, n_ubatch = 2048, 512
    _, caches = library.load_model_caches(path, n_ctx=n_ctx, n_ubatch=n_ubatch, swa_full=False, f32_kv=True)
    sizes = kv_cache.kv_size(metadata.kv_model(gguf.GGUFReader(path)),
                             kv_cache.Context(n_ctx=n_ctx, n_ubatch=n_ubatch, type_k="f32", type_v="f32"))
    n_window = len(WINDOWS.layers)
    n_global = sum(1 for t in TYPES if t == A) - n_window
    assert [(c.cells, c.layers) for c in caches] == [(n_ctx, n_global), (768, n_window)]  # pad256(6 + 2 + 512)
    assert [(c.cells, c.layers) for c in sizes.caches.values()] == [(n_ctx, n_global), (768, n_window)]
    assert sum(c.mib for c in caches) == pytest.approx(sizes.bytes / 2**20, abs=0.011)
    # the stock file: one cache of every layer (Phi-3's own window stays off)
    _, caches = library.load_model_caches(stock, n_ctx=n_ctx, n_ubatch=n_ubatch, swa_full=False, f32_kv=True)
    assert [(c.cells, c.layers) for c in caches] == [(n_ctx, N_LAYER)]


@pytest.mark.parametrize("family_window_model", ["phi3"], indirect=True)
def test_phi3_warns_that_its_own_window_is_off_but_not_for_window_layers(family_window_model):
    import llama_cpp

    _, _, stock, path = family_window_model

    def load_log(file) -> str:
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        with library.captured_log() as lines:
            model = llama_cpp.llama_model_load_from_file(str(file).encode(), params)
        assert model, file
        llama_cpp.llama_model_free(model)
        return "".join(lines)

    warning = "Phi SWA is currently disabled"
    assert warning in load_log(stock)
    log = load_log(path)
    assert warning not in log
    assert re.search(rf"n_swa\s+= {SIZE}\n", log) and re.search(rf"n_swa_sink\s+= {SINKS}\n", log)
