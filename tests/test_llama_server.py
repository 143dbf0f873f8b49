"""llama-server on an NBL GGUF: parallel slots and prompt-cache reuse give the greedy continuation
that the numpy reference computes."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from _build_info import expected_build_info
from _llama_server import post, running_llama_server

from nbl_gguf.gguf import nbl_format
from nbl_gguf.fixtures.tiny import TinyLlama

A, L, D = nbl_format.ATTENTION, nbl_format.LINEAR, nbl_format.DROPPED
N_PREDICT = 6


def greedy(model: TinyLlama, prompt, types, linear, n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        logits = model.forward(tokens, types, linear)[-1]
        logits[:3] = -np.inf  # the special tokens are kept out, as in the requests below
        tokens.append(int(np.argmax(logits)))
    return tokens[len(prompt):]


@pytest.fixture()
def server(tmp_path):
    model = TinyLlama(n_layer=4, n_head=8, n_head_kv=2, seed=11)
    # one attention layer, after per-token layers only: its K/V depend on the token and its position
    # alone, so even a cache reused by shifting (approximate with two attention layers) is exact
    types = [L, A, D, L]
    linear = model.random_linear([0, 3], seed=4)
    path = model.write_nbl_gguf(tmp_path / "nbl.gguf", types, linear)
    with running_llama_server(path, tmp_path / "server.log", "-np", "2", "-c", "512", "-ctk", "f32", "-ctv", "f32",
                              "-t", "2", "--cache-reuse", "4") as port:
        yield port, model, types, linear


def complete(port: int, prompt: list[int]) -> dict:
    return post(port, "/completion", {
        "prompt": prompt, "n_predict": N_PREDICT, "temperature": 0.0, "top_k": 1, "cache_prompt": True,
        "return_tokens": True, "logit_bias": [[0, False], [1, False], [2, False]],
    })


def test_parallel_slots_and_cache_reuse(server):
    port, model, types, linear = server
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(3, model.n_vocab, size=n)] for n in (20, 27)]

    with ThreadPoolExecutor(max_workers=2) as pool:  # both slots decode at once
        results = list(pool.map(lambda p: complete(port, p), prompts))
    for prompt, result in zip(prompts, results):
        assert result["tokens"] == greedy(model, prompt, types, linear, N_PREDICT)

    # the same prompt again: its KV comes from the slot's cache and only the rest is evaluated
    again = complete(port, prompts[0])
    assert again["tokens"] == results[0]["tokens"]
    assert again["timings"]["prompt_n"] < len(prompts[0])

    # a prompt with a chunk cut out of its middle: cache reuse shifts the kept KV into place
    shifted = prompts[0][:6] + prompts[0][12:]
    result = complete(port, shifted)
    assert result["timings"]["prompt_n"] < len(shifted)
    assert result["tokens"] == greedy(model, shifted, types, linear, N_PREDICT)

    # the server says which llama.cpp and patch series it runs
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/props", timeout=10) as response:
        assert json.loads(response.read())["build_info"] == expected_build_info()
