"""Running GGUFs in-process through llama-cpp-python, which setup binds to the patched libllama.

llama.cpp reports load errors and the KV cache size only in its log, so the helpers here capture
that log while a model and its context are created.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from nbl_gguf.errors import NblError
from nbl_gguf.llamacpp.cache_types import split_cache_type

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


def kv_cache_lines(log: str) -> list[KvCacheInfo]:
    """Every ``llama_kv_cache: size = ...`` line of a llama.cpp log, in order, one per cache: an iSWA
    context logs its full-attention cache, then its sliding-window one."""
    return [KvCacheInfo(cells=int(m.group(2)), layers=int(m.group(3)), k_mib=float(m.group(5)), v_mib=float(m.group(7)))
            for m in map(_KV_LINE.search, log.splitlines()) if m]


def ggml_cache_types(kv_type: str) -> tuple[int, int]:
    """llama-cpp-python's (type_k, type_v) of a cache type as nbl-gguf names it ('q8_0', 'q8_0/q4_0')."""
    import llama_cpp

    k, v = split_cache_type(kv_type)
    return getattr(llama_cpp, f"GGML_TYPE_{k.upper()}"), getattr(llama_cpp, f"GGML_TYPE_{v.upper()}")


def context_kv_caches(path: str | Path, *, n_ctx: int, n_batch: int = 2048, n_ubatch: int = 512, n_seq_max: int = 1,
                      kv_unified: bool = False, swa_full: bool = False, flash_attn: bool = True,
                      kv_type: str = "f16") -> list[KvCacheInfo]:
    """The caches libllama allocates for ``path`` with these context settings (the C API's own
    defaults but for swa_full, which is llama-cli's here): a model and a context are created and freed."""
    log = _context_log(path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_seq_max,
                       kv_unified=kv_unified, swa_full=swa_full, flash_attn=flash_attn, kv_type=kv_type)
    return kv_cache_lines(log)


# sched_reserve:        CPU compute buffer size =    98.25 MiB   /   llama_context:        CPU  output buffer size =     0.19 MiB
_BUFFER_LINE = re.compile(r"^(?:sched_reserve|llama_context):\s+(\S+)\s+(compute|output) buffer size =\s*([\d.]+) MiB")


@dataclass
class ContextBuffers:
    """What a context takes beside its model and its KV cache, as llama.cpp reserves it: the compute buffers
    (the largest graph's intermediates: at a 512-token micro-batch mostly the logits, n_vocab x n_ubatch floats)
    and the output buffer, in bytes over every backend."""
    compute: int
    output: int

    @property
    def bytes(self) -> int:
        return self.compute + self.output


def context_buffers(path: str | Path, *, n_ctx: int, n_batch: int = 2048, n_ubatch: int = 512,
                    flash_attn: bool = True, kv_type: str = "f16") -> ContextBuffers:
    """llama.cpp's own projection of a context's compute and output buffers for ``path`` (llama-cli's settings
    otherwise, the layers on the CPU): the model is loaded without its weights and nothing is allocated
    (no_alloc, as llama.cpp's --fit measures), so it takes a second at any model size. llama.cpp logs each
    buffer rounded to 0.01 MiB; half of that is added to each, so that the sizes are bounds."""
    log = _context_log(path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, flash_attn=flash_attn,
                       kv_type=kv_type, no_alloc=True)
    sizes = {"compute": 0, "output": 0}
    found = False
    for line in log.splitlines():
        match = _BUFFER_LINE.match(line.strip())
        if match:
            found = found or match.group(2) == "compute"
            sizes[match.group(2)] += math.ceil((float(match.group(3)) + 0.005) * 2 ** 20)
    if not found:
        raise NblError(f"llama.cpp reported no compute buffer for {path} (its log changed?)")
    return ContextBuffers(**sizes)


def _context_log(path, *, n_ctx: int, n_batch: int = 2048, n_ubatch: int = 512, n_seq_max: int = 1,
                 kv_unified: bool = False, swa_full: bool = False, flash_attn: bool = True, kv_type: str = "f16",
                 no_alloc: bool = False) -> str:
    """llama.cpp's log of creating a model and a context of these settings for ``path``, both freed after.
    ``no_alloc``: the model's metadata only and no buffer allocated (the sizes are logged as planned)."""
    import llama_cpp

    model_params = llama_cpp.llama_model_default_params()
    model_params.n_gpu_layers = 0
    if no_alloc:
        model_params.no_alloc = True
        model_params.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE  # a mapping is an allocation: llama.cpp asserts
    with captured_log() as lines:
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
        if not model:
            raise NblError(f"llama.cpp could not load {path}: " + " | ".join(
                line.strip() for line in lines if "error" in line.lower() or "failed" in line.lower()))
        try:
            params = llama_cpp.llama_context_default_params()
            params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx, n_batch, n_ubatch, n_seq_max
            params.kv_unified, params.swa_full = kv_unified, swa_full
            # auto, llama-cli's default, creates the cache as flash attention does: V not transposed
            params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO if flash_attn
                                      else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
            params.type_k, params.type_v = ggml_cache_types(kv_type)
            context = llama_cpp.llama_init_from_model(model, params)
            if not context:
                raise NblError(f"llama.cpp could not create a context of {n_ctx} for {path}")
            llama_cpp.llama_free(context)
        finally:
            llama_cpp.llama_model_free(model)
    return "".join(lines)


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


def default_gpu_layers() -> int:
    """``NBL_GGUF_N_GPU_LAYERS`` or 0: in a CUDA build the in-process tests run on the GPU only when asked
    (llama.cpp's own default offloads every layer)."""
    return int(os.environ.get("NBL_GGUF_N_GPU_LAYERS", "0"))


def load_model(path: str | Path, *, n_ctx: int = 512, n_gpu_layers: int | None = None, f32_kv: bool = False,
               **kwargs):
    """A ``llama_cpp.Llama`` for ``path`` and its KV cache info; load errors carry llama.cpp's message.

    ``n_gpu_layers`` None: default_gpu_layers() (docs/building.md)."""
    llm, log = _load_logged(path, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, f32_kv=f32_kv, **kwargs)
    caches = kv_caches(log)
    return llm, caches[0] if caches else None


def load_model_caches(path: str | Path, *, n_ctx: int = 512, n_gpu_layers: int | None = None, f32_kv: bool = False,
                      **kwargs):
    """load_model(), with each of the context's caches apart (kv_cache_lines): an iSWA context's
    full-attention cache, then its sliding-window one."""
    llm, log = _load_logged(path, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, f32_kv=f32_kv, **kwargs)
    return llm, kv_cache_lines(log)


def _load_logged(path, *, n_ctx: int, n_gpu_layers: int | None, f32_kv: bool, **kwargs):
    import llama_cpp

    if n_gpu_layers is None:
        n_gpu_layers = default_gpu_layers()
    if f32_kv:
        kwargs.update(type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    import llama_cpp._logger as default_logger

    # verbose so that llama.cpp logs the load (its KV cache lines) into `lines`; the Python side's own prints
    # of it (the model's metadata, its chat template) are dropped, and the model runs quietly afterwards:
    # a convert that took the passkey test printed some 80 lines of them per file
    with captured_log() as lines, contextlib.redirect_stderr(io.StringIO()):
        try:
            llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, verbose=True, **kwargs)
        except ValueError as error:
            reasons = [line.strip() for line in lines if "error" in line.lower() or "failed" in line.lower()]
            raise NblError(f"llama.cpp could not load {path}: " + " | ".join(reasons or [str(error)])) from error
        finally:
            default_logger.set_verbose(False)
    llm.verbose = False
    return llm, "".join(lines)


def logits(llm, tokens: Sequence[int]) -> np.ndarray:
    """Logits [n_tokens, n_vocab] of one causal pass over ``tokens`` (``llm`` made with logits_all)."""
    llm.reset()
    llm.eval(list(tokens))
    return np.array(llm.scores[: len(tokens)], dtype=np.float64)
