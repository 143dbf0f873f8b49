"""Perplexity text and perplexity in PyTorch with llama-perplexity's chunking: the held-out text,
what llama-perplexity tokenizes for ``-f``, llama.cpp's tokens of it, and the chunked NLL of a model."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Sequence

from nbl_gguf.errors import NblError
from nbl_gguf.llamacpp.perplexity import Perplexity
from nbl_gguf.measurement.tasks import _read_prompt


# --- text ----------------------------------------------------------------------------------------

def prompt_text(path: str | os.PathLike) -> str:
    """What llama-perplexity tokenizes for ``-f path`` (one trailing newline removed)."""
    return _read_prompt(Path(path))


# --- PyTorch perplexity with llama-perplexity's chunking -------------------------------------------

def perplexity_chunks(tokens: Sequence[int], n_ctx: int, chunks: int | None = None,
                      bos: int | None = None) -> list[list[int]]:
    """perplexity.cpp's chunks: chunk i is tokens[i n_ctx, (i+1) n_ctx) with its first token replaced by
    BOS when ``bos`` is given; positions n_ctx/2 .. n_ctx-2 of each predict the next token."""
    if n_ctx < 4:
        raise NblError(f"--ctx-size {n_ctx} is too small")
    if len(tokens) < 2 * n_ctx:
        raise NblError(f"the text tokenizes to {len(tokens)} tokens; perplexity with --ctx-size {n_ctx} "
                       f"needs at least {2 * n_ctx}")
    n_chunk = len(tokens) // n_ctx
    if chunks is not None and chunks >= 0:
        n_chunk = min(chunks, n_chunk)
    out = []
    for i in range(n_chunk):
        chunk = list(tokens[i * n_ctx:(i + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


def perplexity_of(values, n_chunk: int, n_ctx: int) -> Perplexity:
    """llama-perplexity's estimate and its standard error from the scored positions' NLLs."""
    import numpy as np

    values = np.asarray(values, dtype=np.float64).reshape(-1)
    mean = float(values.mean())
    var = float((values * values).mean()) - mean * mean
    ppl = math.exp(mean)
    return Perplexity(ppl, ppl * math.sqrt(max(var, 0.0) / (len(values) - 1)), n_chunk, n_ctx)


def chunked_nll(logprob_fn, tokens: Sequence[int], n_ctx: int, *, chunks: int | None = None,
                bos: int | None = None) -> Perplexity:
    """perplexity.cpp's perplexity() (chunks: perplexity_chunks).

    logprob_fn(chunk) -> log-probabilities [n_ctx, n_vocab] (any array type with numpy conversion).
    """
    import numpy as np

    first = n_ctx // 2
    windows = perplexity_chunks(tokens, n_ctx, chunks, bos)
    values = []
    for i, chunk in enumerate(windows):
        logprobs = np.asarray(logprob_fn(chunk), dtype=np.float64)
        targets = np.asarray(tokens[i * n_ctx + first + 1:(i + 1) * n_ctx])
        values.append(-logprobs[np.arange(first, n_ctx - 1), targets])
    return perplexity_of(np.concatenate(values), len(windows), n_ctx)


def streamed_perplexities(source, variants: dict[str, dict[int, int]], linear, tokens: Sequence[int], n_ctx: int, *,
                          chunks: int | None = None, bos: int | None = None, dtype="fp32", device: str = "cpu",
                          batch_size: int = 1) -> dict[str, Perplexity]:
    """torch_perplexity of several variants of a model ({name: {layer: apply.py layer type}}; {} is the
    model itself) at once, one decoder layer in memory at a time (calibration.stream): each layer is read
    once for all variants. ``linear(k)`` gives (W, b) of layer k; ``source`` is a model_source.ModelSource."""
    import torch

    from nbl_gguf import models
    from nbl_gguf.calibration.stream import LayerStream
    from nbl_gguf.calibration.variants import run_variants

    stream = LayerStream(source, models.resolve_dtype(dtype, device), device)
    windows = torch.tensor(perplexity_chunks(tokens, n_ctx, chunks, bos), dtype=torch.long)
    first = n_ctx // 2
    finals = run_variants(stream, windows, list(variants.values()), linear, batch_size)
    stream.load_head()
    try:
        results = {}
        for name, final in zip(variants, finals):
            # token_nll[:, p] scores the token at p + 1; the window's tokens after its first are the text's
            values = torch.cat([stream.token_nll(final[start:start + batch_size], windows[start:start + batch_size])
                                for start in range(0, len(windows), batch_size)])
            results[name] = perplexity_of(values[:, first:n_ctx - 1].numpy(), len(windows), n_ctx)
        return results
    finally:
        stream.release_head()


def llama_tokens(gguf_path, text: str) -> tuple[list[int], int | None]:
    """llama.cpp's tokenization of ``text`` by the GGUF's vocab, as llama-perplexity does it
    (common_tokenize with add_special), and the BOS id if the vocab adds one (else None)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf_path), vocab_only=True, verbose=False)
    try:
        with_special = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
        plain = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        bos = llm.token_bos() if len(with_special) > len(plain) else None
        return list(with_special), bos
    finally:
        llm.close()


def torch_perplexity(model, tokens: Sequence[int], n_ctx: int, *, chunks: int | None = None,
                     bos: int | None = None, progress: bool = False) -> Perplexity:
    import torch

    device = next(model.parameters()).device
    n_total = len(tokens) // n_ctx if chunks is None or chunks < 0 else min(chunks, len(tokens) // n_ctx)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n_total, desc="pytorch perplexity", unit="chunk", leave=False, file=sys.stderr)

    def logprobs(chunk):
        with torch.no_grad():
            ids = torch.tensor([chunk], dtype=torch.long, device=device)
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
        if bar is not None:
            bar.update()
        return torch.log_softmax(logits, dim=-1).double().cpu().numpy()

    try:
        return chunked_nll(logprobs, tokens, n_ctx, chunks=chunks, bos=bos)
    finally:
        if bar is not None:
            bar.close()
