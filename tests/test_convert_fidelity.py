"""Fidelity of the NBL GGUF on the embedded SmolLM2-135M-Instruct: the patched llama.cpp running the
F32 NBL GGUF against the HF model with the same layers replaced in PyTorch (apply_nbl), on held-out
C4 text (and the summary's perplexity on each bundled kind of text); then the q4_k_m NBL GGUF generating through llama-completion, llama-cli and llama_cpp.Llama.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from _convert_helpers import convert_args
from nbl_gguf.gguf import nbl_format
from nbl_gguf.llamacpp.tools import bin_dir, source_dir

pytestmark = [
    pytest.mark.llama,
    pytest.mark.slow,
    pytest.mark.skipif(not (bin_dir() / "llama-quantize").is_file() or not (source_dir() / "convert_hf_to_gguf.py").is_file(),
                       reason="needs the patched llama.cpp build (scripts/build_llama.sh)"),
]

M = 8
WINDOW = 256
WINDOWS = 4
PROMPT = "The capital of France is"
EVAL_CHUNKS = 2


@pytest.fixture(scope="module")
def embedded(embedded_calibration, tmp_path_factory):
    """The session's calibration of the embedded model (tests/conftest.py; fidelity needs the same W on
    both sides, not a good W), the F32 NBL GGUF of the embedded model's folder and its q4_k_m quantization."""
    pytest.importorskip("llama_cpp")
    from nbl_gguf.commands.convert import convert
    from nbl_gguf.gguf.quantize import quantize

    root = tmp_path_factory.mktemp("fidelity")
    f32 = root / "nbl-f32.gguf"
    summary = convert(convert_args(calibration=str(embedded_calibration.path), m=M, quant="f32", output=str(f32),
                                   no_eval=False, eval_chunks=EVAL_CHUNKS))
    q4 = quantize(f32, root / "nbl-q4_k_m.gguf", "q4_k_m")
    return embedded_calibration, summary, f32, q4


def _heldout_windows(tokenizer) -> list[list[int]]:
    from nbl_gguf.calibration.dataset import heldout_texts

    stream: list[int] = []
    for text in reversed(heldout_texts()):  # the last documents of the bundled sample
        if stream:
            stream.append(tokenizer.eos_token_id)
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(stream) >= WINDOW * WINDOWS:
            break
    assert len(stream) >= WINDOW * WINDOWS
    return [stream[i * WINDOW:(i + 1) * WINDOW] for i in range(WINDOWS)]


def _nll(logits: np.ndarray, tokens: list[int]) -> np.ndarray:
    logits = logits[:-1].astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    logz = top[:, 0] + np.log(np.exp(logits - top).sum(axis=-1))
    return logz - logits[np.arange(len(tokens) - 1), tokens[1:]]


def test_f32_nbl_gguf_matches_pytorch_nbl(embedded):
    import torch

    from nbl_gguf import models
    from nbl_gguf.llamacpp import library
    from nbl_gguf.calibration.apply import apply_nbl

    artifact, summary, f32, _ = embedded
    types = artifact.layer_types(M, "cca", "attn-nbl")
    assert [i for i, t in enumerate(types) if t] == summary.replaced and len(summary.replaced) == M

    loaded = models.load_model(None, "fp32", "cpu")
    model = apply_nbl(loaded.model, types, artifact)
    windows = _heldout_windows(loaded.tokenizer)

    llm, kv = library.load_model(f32, n_ctx=WINDOW, logits_all=True, f32_kv=True)
    assert kv is None or kv.layers == summary.n_layer - M
    agree = total = 0
    nll_hf, nll_gguf = [], []
    for tokens in windows:
        with torch.no_grad():
            ref = model(torch.tensor([tokens])).logits[0].double().numpy()
        got = library.logits(llm, tokens)
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        total += len(tokens)
        nll_hf.append(_nll(ref, tokens))
        nll_gguf.append(_nll(got, tokens))
    ppl_hf = float(np.exp(np.concatenate(nll_hf).mean()))
    ppl_gguf = float(np.exp(np.concatenate(nll_gguf).mean()))
    print(f"top-1 agreement {agree / total:.4f} over {total} tokens; perplexity HF {ppl_hf:.4f} GGUF {ppl_gguf:.4f}")
    assert agree / total >= 0.99
    assert abs(ppl_gguf - ppl_hf) / ppl_hf <= 0.005


@pytest.mark.parametrize("kind", ["c4", "prose", "code"])
def test_summary_heldout_perplexity_matches_pytorch(embedded, kind):
    """convert's held-out perplexity of the stock and NBL files (llama-perplexity) on each kind of text
    against PyTorch on the same chunks of the same tokens (the F32 files reproduce their models, so the
    two must agree); the text is the kind's evaluation documents as the bundled file holds them."""
    import json
    from importlib import resources

    from nbl_gguf import models
    from nbl_gguf.calibration.apply import apply_nbl
    from nbl_gguf.calibration.dataset import KINDS
    from nbl_gguf.commands.convert import EVAL_CTX
    from nbl_gguf.measurement.torch_ppl import llama_tokens, torch_perplexity

    artifact, summary, f32, _ = embedded
    heldout = summary.heldout[kind]
    assert heldout["chunks"] == EVAL_CHUNKS and heldout["ctx"] == EVAL_CTX
    documents = json.loads(resources.files("nbl_gguf").joinpath("data", KINDS[kind].file).read_text(encoding="utf-8"))
    if kind == "c4":
        texts = [d["text"] for d in documents[256:]]  # the documents after the calibration slice
    else:
        texts = [d["text"] for d in documents if d["part"] == "evaluation"]
    tokens, bos = llama_tokens(f32, "\n\n".join(t.strip() for t in texts if t.strip()))
    loaded = models.load_model(None, "fp32", "cpu")
    stock = torch_perplexity(loaded.model, tokens, EVAL_CTX, chunks=EVAL_CHUNKS, bos=bos)
    nbl = torch_perplexity(apply_nbl(loaded.model, artifact.layer_types(M, "cca", "attn-nbl"), artifact), tokens,
                           EVAL_CTX, chunks=EVAL_CHUNKS, bos=bos)
    assert heldout["tokens"] == stock.tokens
    assert heldout["stock"] == pytest.approx(stock.ppl, rel=2e-3)
    assert heldout["nbl"] == pytest.approx(nbl.ppl, rel=2e-3)
    assert heldout["nbl"] > heldout["stock"]
    table = summary.table()
    assert f"held-out perplexity, {KINDS[kind].label} ({stock.tokens:,} tokens)" in table
    worst = max(summary.heldout, key=lambda k: summary.heldout[k]["nbl"] / summary.heldout[k]["stock"])
    assert f"worst kind of text: {KINDS[worst].label}, " in table


def test_q4_k_m_nbl_gguf_generates(embedded):
    import gguf

    from nbl_gguf.llamacpp import library

    _, summary, _, q4 = embedded
    reader = gguf.GGUFReader(q4)
    assert [i for i, t in enumerate(nbl_format.read_layer_types(reader)) if t == nbl_format.LINEAR] == summary.replaced

    completion = subprocess.run(
        [str(bin_dir() / "llama-completion"), "-m", str(q4), "-p", PROMPT, "-n", "8", "--temp", "0", "--seed", "0",
         "-no-cnv", "--no-warmup", "-c", "256", "--no-display-prompt"],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert completion.returncode == 0, completion.stderr[-2000:]
    assert completion.stdout.strip(), completion.stderr[-2000:]

    cli = subprocess.run(
        [str(bin_dir() / "llama-cli"), "-m", str(q4), "-p", "What is the capital of France?", "-n", "8", "--temp", "0",
         "--single-turn", "--simple-io", "--no-warmup", "-c", "256"],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert cli.returncode == 0, cli.stderr[-2000:]
    answer = cli.stdout.split("What is the capital of France?", 1)[-1]
    assert answer.strip(), cli.stdout[-2000:]

    llm, _ = library.load_model(q4, n_ctx=256)
    out = llm.create_completion(PROMPT, max_tokens=8, temperature=0.0)
    text = out["choices"][0]["text"]
    assert text.strip() and out["usage"]["completion_tokens"] > 0
    print(f"llama-completion: {completion.stdout.strip()!r}\nllama-cli: {answer.strip()!r}\nllama_cpp: {text!r}")
