"""The server soak (`python -m nbl_gguf soak`, nbl_gguf/measurement/soak.py) for 30 s, on a tiny NBL GGUF: 8 concurrent greedy clients,
0 failed requests, every response equal to the single-client reference, prompts served from the
cache, and the server's memory flat after the warm-up. (The committed 5-minute run on the embedded
SmolLM2 is in docs/results/soak.md; converting that model would take minutes here.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nbl_gguf.fixtures.tiny import TinyLlama
from nbl_gguf.gguf import nbl_format
from nbl_gguf.llamacpp.tools import bin_dir

A, L, D = nbl_format.ATTENTION, nbl_format.LINEAR, nbl_format.DROPPED


@pytest.mark.slow
@pytest.mark.skipif(not (bin_dir() / "llama-server").is_file(), reason="llama-server not built (scripts/build_llama.sh)")
def test_soak_30_seconds(tmp_path):
    model = TinyLlama(n_layer=4, n_head=8, n_head_kv=2, seed=11)
    # every kind of layer: linear, attention, dropped
    path = model.write_nbl_gguf(tmp_path / "tiny-nbl.gguf", [L, A, D, A], model.random_linear([0], seed=4))
    out = tmp_path / "soak.json"
    # a byte-level vocabulary makes a prompt as many tokens as bytes: a quarter of the default lengths.
    # An F32 KV cache: llama.cpp's CPU kernels differ with the batch's shape (docs/results/soak.md), and
    # with an F16 cache the flash-attention paths round differently enough to flip this random model's
    # near-ties; in F32 what is left is summation order. One thread: on a busy 2-core machine a second
    # one mostly waits at barriers.
    command = [sys.executable, "-m", "nbl_gguf", "soak", "--model", str(path), "--duration", "30",
               "--warmup", "10", "--clients", "8", "--max-requests", "5000", "--prompt-scale", "0.25",
               "--ctx-per-slot", "1024", "--threads", "1", "--server-arg=-ctk", "--server-arg=f32",
               "--server-arg=-ctv", "--server-arg=f32", "-o", str(out)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert out.is_file(), completed.stdout + completed.stderr
    result = json.loads(out.read_text())
    soak = result["soak"]
    summary = completed.stdout
    assert soak["failed"] == 0, soak["failures"]
    assert soak["different"] == 0, soak["differences"]
    assert soak["max_in_flight"] == 8  # the 8 clients really were concurrent
    assert 0 < soak["requests"] <= 5000 and soak["requests"] == sum(k["requests"] for k in soak["by_kind"].values())
    assert {"short", "medium", "long", "shared-prefix-0"} <= set(soak["by_kind"])
    assert soak["prompt_tokens_from_cache"] > 0  # slots reused cached prompts
    memory = soak["memory"]
    assert memory["growth_after_warmup_mib"] <= result["settings"]["rss_tolerance_mib"], memory
    assert memory["samples"] >= 30
    assert soak["passed"] and completed.returncode == 0, summary + completed.stderr
