"""Running GGUFs in-process through llama-cpp-python, which setup binds to the patched libllama.

llama.cpp reports load errors and the KV cache size only in its log, so the helpers here capture
that log while a model and its context are created.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from nbl_gguf.errors import NblError

# llama_kv_cache: size =    4.00 MiB (  4096 cells,   4 layers,  1/1 seqs), K (f32):    2.00 MiB, V (f32):    2.00 MiB
_KV_LINE = re.compile(
    r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers.*?K \((\w+)\):\s*([\d.]+) MiB, V \((\w+)\):\s*([\d.]+) MiB"
)


# a sliding-window model (iSWA) logs two caches per context: this line comes before the second one
_SWA_HALF = "creating     SWA KV cache"


@dataclass
class KvCacheInfo:
    cells: int  # the largest of the context's caches
    layers: int
    k_mib: float
    v_mib: float

    @property
    def mib(self) -> float:
        return self.k_mib + self.v_mib


def kv_caches(log: str) -> list[KvCacheInfo]:
    """The KV cache of every context created in a llama.cpp log, in order; the full-attention and
    sliding-window caches of an iSWA context are added up into one."""
    caches: list[KvCacheInfo] = []
    swa_half = False
    for line in log.splitlines():
        if _SWA_HALF in line:
            swa_half = True
            continue
        match = _KV_LINE.search(line)
        if not match:
            continue
        cache = KvCacheInfo(cells=int(match.group(2)), layers=int(match.group(3)),
                            k_mib=float(match.group(5)), v_mib=float(match.group(7)))
        if swa_half and caches:
            first = caches.pop()
            cache = KvCacheInfo(max(first.cells, cache.cells), first.layers + cache.layers,
                                first.k_mib + cache.k_mib, first.v_mib + cache.v_mib)
        caches.append(cache)
        swa_half = False
    return caches


@contextlib.contextmanager
def captured_log() -> Iterator[list[str]]:
    """Collect llama.cpp's log lines (all levels) while the block runs."""
    import llama_cpp
    import llama_cpp._logger as default_logger

    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def collect(level, text, user_data):
        lines.append(text.decode("utf-8", errors="replace"))

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        llama_cpp.llama_log_set(default_logger.llama_log_callback, ctypes.c_void_p(0))


def load_model(path: str | Path, *, n_ctx: int = 512, n_gpu_layers: int = 0, f32_kv: bool = False, **kwargs):
    """A ``llama_cpp.Llama`` for ``path`` and its KV cache info; load errors carry llama.cpp's message."""
    import llama_cpp

    if f32_kv:
        kwargs.update(type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    with captured_log() as lines:
        try:
            llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, verbose=True, **kwargs)
        except ValueError as error:
            reasons = [line.strip() for line in lines if "error" in line.lower() or "failed" in line.lower()]
            raise NblError(f"llama.cpp could not load {path}: " + " | ".join(reasons or [str(error)])) from error
    caches = kv_caches("".join(lines))
    return llm, caches[0] if caches else None


def logits(llm, tokens: Sequence[int]) -> np.ndarray:
    """Logits [n_tokens, n_vocab] of one causal pass over ``tokens`` (``llm`` made with logits_all)."""
    llm.reset()
    llm.eval(list(tokens))
    return np.array(llm.scores[: len(tokens)], dtype=np.float64)
