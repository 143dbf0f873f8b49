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

def chunked_nll(logprob_fn, tokens: Sequence[int], n_ctx: int, *, chunks: int | None = None,
                bos: int | None = None) -> Perplexity:
    """perplexity.cpp's perplexity(): chunk i is tokens[i n_ctx, (i+1) n_ctx) with its first token
    replaced by BOS when ``bos`` is given; positions first = n_ctx/2 .. n_ctx-2 predict the next token.

    logprob_fn(chunk) -> log-probabilities [n_ctx, n_vocab] (any array type with numpy conversion).
    """
    import numpy as np

    if n_ctx < 4:
        raise NblError(f"--ctx-size {n_ctx} is too small")
    if len(tokens) < 2 * n_ctx:
        raise NblError(f"the text tokenizes to {len(tokens)} tokens; perplexity with --ctx-size {n_ctx} "
                       f"needs at least {2 * n_ctx}")
    n_chunk = len(tokens) // n_ctx
    if chunks is not None and chunks >= 0:
        n_chunk = min(chunks, n_chunk)
    first = n_ctx // 2
    nll = nll2 = 0.0
    count = 0
    for i in range(n_chunk):
        chunk = list(tokens[i * n_ctx:(i + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        logprobs = np.asarray(logprob_fn(chunk), dtype=np.float64)
        targets = np.asarray(tokens[i * n_ctx + first + 1:(i + 1) * n_ctx])
        values = -logprobs[np.arange(first, n_ctx - 1), targets]
        nll += float(values.sum())
        nll2 += float((values * values).sum())
        count += len(values)
    mean = nll / count
    var = nll2 / count - mean * mean
    ppl = math.exp(mean)
    return Perplexity(ppl, ppl * math.sqrt(max(var, 0.0) / (count - 1)), n_chunk, n_ctx)


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
