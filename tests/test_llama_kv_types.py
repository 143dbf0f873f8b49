"""llama.cpp's quantized KV cache (-ctk/-ctv q8_0, q4_0, and K in q8_0 with V in q4_0) with NBL and taps layers: the logits of each file
with a quantized cache against the same file with an F16 cache move no more than the stock file's do (its
own KV-quantization error), a prompt then token-by-token decoding, so that `convert --kv-type` and the
frontier's KV rows run what they promise. The F16-cache logits themselves are held to PyTorch by
test_llama_nbl and test_llama_taps."""

from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest
from _llama_context import Context

from nbl_gguf.fixtures.tiny import TinyLlama
from nbl_gguf.gguf import nbl_format
from nbl_gguf.llamacpp import tools as llamacpp

pytestmark = [
    pytest.mark.llama,
    pytest.mark.skipif(not (llamacpp.bin_dir() / "libllama.so").is_file(),
                       reason="needs the patched llama.cpp build (scripts/build_llama.sh)"),
]

A, L, T = nbl_format.ATTENTION, nbl_format.LINEAR, nbl_format.TAPS
# head size 32: a quantized cache row holds whole blocks of 32 values
TINY = dict(n_layer=4, n_embd=128, n_head=4, n_head_kv=2, seed=5)
FILES = {"stock": [A, A, A, A], "nbl": [A, L, A, L], "taps": [T, A, L, T]}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-types")
    tiny = TinyLlama(**TINY)
    linear, taps = tiny.random_linear([1, 2, 3]), tiny.random_taps([0, 3], 4, "lowrank")
    paths = {"stock": tiny.write_gguf(root / "stock.gguf"),
             "nbl": tiny.write_nbl_gguf(root / "nbl.gguf", FILES["nbl"], {1: linear[1], 3: linear[3]}),
             "taps": tiny.write_nbl_gguf(root / "taps.gguf", FILES["taps"], {0: taps[0], 2: linear[2], 3: taps[3]})}
    tokens = [int(t) for t in np.random.default_rng(3).integers(3, tiny.n_vocab, 48)]
    return paths, tokens


def logits(path, tokens, kv_type: str) -> np.ndarray:
    context = Context(path, n_seq_max=1, kv_type=kv_type)
    try:
        return np.concatenate([context.run(tokens[:32]), context.step(tokens[32:], start=32)])
    finally:
        context.close()


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0", "q8_0/q4_0"])
def test_quantized_kv_moves_nbl_and_taps_logits_no_more_than_stock(files, kv_type):
    paths, tokens = files
    error = {}
    for name, path in paths.items():
        reference = logits(path, tokens, "f16")
        got = logits(path, tokens, kv_type)
        assert np.isfinite(got).all(), name
        error[name] = float(np.abs(got - reference).max())
    # the cache type took effect (a file with attention layers sees its quantization) ...
    assert all(value > 0 for value in error.values()), error
    # ... and the NBL and taps layers add nothing to it: within the stock file's own KV-quantization error
    for name in ("nbl", "taps"):
        assert error[name] <= 2 * error["stock"], (name, error)


def test_prompt_batches_read_a_quantized_cache_as_decoding_does():
    """ggml's CPU flash attention takes its tiled path for a batch of 64 queries or more; patch 0020 lets
    quantized caches take it (2.6-4.7x faster 4,096-token perplexities on a 2-core CPU) and rounds Q as the
    per-row path does. Per K/V pair, the tiled result against the CPU backend's reference (the per-row path):
    not identical (else the tiled path was not taken), equal to float rounding (tests/native/flash_attn_paths.cpp)."""
    program = llamacpp.bin_dir() / "nbl-flash-attn-paths"
    assert program.is_file(), "build it: cmake --build build --target nbl-flash-attn-paths (scripts/test.sh does)"
    lines = subprocess.run([program], capture_output=True, text=True, check=True).stdout.splitlines()
    nmse = {line.split()[0]: float(line.split()[2]) for line in lines}
    assert set(nmse) >= {"q8_0/q8_0", "q8_0/q4_0", "q4_0/q4_0", "q4_1/q5_1", "iq4_nl/iq4_nl"}, lines
    for pair in ("q8_0/q8_0", "q8_0/q4_0", "q4_0/q4_0", "iq4_nl/iq4_nl"):
        assert 0 < nmse[pair] < 1e-10, (pair, lines)
    # K types whose dot products take Q in Q8_1: the tiled path rounds Q as Q8_0 does (the same scale and
    # rounding, its scale stored apart), within float rounding of the per-row result
    assert 0 < nmse["q4_1/q5_1"] < 1e-6, lines


def test_ggml_operator_test_passes_flash_attention_of_quantized_caches():
    """ggml's own operator test (test-backend-ops) on the CPU backend against its reference path, for flash
    attention with q8_0 and q4_0 caches, the cases of 64 queries and more among them (the tiled path)."""
    program = llamacpp.bin_dir() / "test-backend-ops"
    assert program.is_file(), "build it: cmake --build build --target nbl-test-backend-ops (scripts/test.sh does)"
    result = subprocess.run([program, "test", "-b", "CPU", "-o", "FLASH_ATTN_EXT", "-p", "type_K=q[48]_0"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    passed = re.findall(r"FLASH_ATTN_EXT\(([^)]*)\): \S*OK", result.stdout)
    tiled = [case for case in passed if int(re.search(r"\bnb=(\d+)", case).group(1)) >= 64]
    assert any("type_K=q8_0" in case for case in tiled) and any("type_K=q4_0" in case for case in tiled), \
        result.stdout[-2000:]
