"""ggml's own quantizers, through ctypes on the build's libggml-base: the code llama-quantize runs.

gguf-py quantizes to a handful of types; ``ggml_quantize_chunk`` covers them all (k-quants, i-quants),
so an NBL weight joins a quantized GGUF in the type of its neighbours, quantized as llama-quantize
would (with an importance matrix's column weights when given). Types are ggml's enum values (gguf.GGMLQuantizationType).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from nbl_gguf.errors import NblError
from nbl_gguf.llamacpp.tools import bin_dir

LIBRARY_NAMES = ("libggml-base.so", "libggml-base.dylib")

# The types ggml_quantize_chunk has a quantizer for (the switch in ggml.c); any other type is an
# assert that aborts the whole process, so nothing else may reach it.
QUANTIZERS = ("F32", "F16", "BF16", "Q1_0", "Q2_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "NVFP4",
              "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "TQ1_0", "TQ2_0", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ3_S",
              "IQ2_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS")
# The types llama-quantize refuses to write without an importance matrix (tensor_requires_imatrix in
# llama-quant.cpp; a superset of ggml_quantize_requires_imatrix, whose types abort without one).
NEEDS_IMATRIX = ("IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_M", "IQ1_S")


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    for name in LIBRARY_NAMES:
        path = bin_dir() / name
        if path.is_file():
            break
    else:
        raise NblError(f"{LIBRARY_NAMES[0]} not found in {bin_dir()}: build the patched llama.cpp first "
                       f"(bash scripts/build_llama.sh)")
    lib = ctypes.CDLL(str(path))
    lib.ggml_blck_size.argtypes = [ctypes.c_int]
    lib.ggml_blck_size.restype = ctypes.c_int64
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    return lib


def block_size(type_id: int) -> int:
    return int(library().ggml_blck_size(int(type_id)))


def row_size(type_id: int, n_per_row: int) -> int:
    return int(library().ggml_row_size(int(type_id), int(n_per_row)))


def quantize(matrix: np.ndarray, type_id: int, type_name: str, importance: np.ndarray | None = None) -> np.ndarray:
    """The rows of ``matrix`` [rows, n_per_row] in ggml type ``type_id``: uint8 [rows, row bytes], the
    bytes a GGUF stores. ``type_name`` (gguf-py's name of the type) guards the call. ``importance``:
    one weight per column (an importance matrix's mean squared activation), as llama-quantize passes."""
    if type_name not in QUANTIZERS:
        raise NblError(f"ggml has no quantizer for {type_name}")
    if type_name in NEEDS_IMATRIX or library().ggml_quantize_requires_imatrix(int(type_id)):
        raise NblError(f"{type_name} needs an importance matrix")
    src = np.ascontiguousarray(matrix, dtype=np.float32)
    if src.ndim != 2:
        raise NblError(f"expected a matrix, got shape {src.shape}")
    rows, n_per_row = src.shape
    if n_per_row % block_size(type_id):
        raise NblError(f"rows of {n_per_row} are not a multiple of {type_name}'s blocks of {block_size(type_id)}")
    weights = None
    if importance is not None:
        weights = np.ascontiguousarray(importance, dtype=np.float32)
        if weights.shape != (n_per_row,):
            raise NblError(f"importance of shape {weights.shape} for rows of {n_per_row}")
    dst = np.empty((rows, row_size(type_id, n_per_row)), dtype=np.uint8)
    written = library().ggml_quantize_chunk(int(type_id), src.ctypes.data, dst.ctypes.data, 0, rows, n_per_row,
                                            None if weights is None else weights.ctypes.data)
    if written != dst.nbytes:
        raise NblError(f"ggml_quantize_chunk wrote {written} bytes for {type_name}, expected {dst.nbytes}")
    return dst


class _TypeTraits(ctypes.Structure):
    # struct ggml_type_traits (ggml.h of the pinned commit)
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


@functools.lru_cache(maxsize=None)
def _to_float(type_id: int):
    lib = library()
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    traits = lib.ggml_get_type_traits(int(type_id)).contents
    return _TO_FLOAT(traits.to_float) if traits.to_float else None


def dequantize(raw: np.ndarray, type_id: int, n_per_row: int) -> np.ndarray:
    """float32 [rows, n_per_row] of the rows ``raw`` (uint8 [rows, row bytes], as a GGUF stores them),
    by ggml's own to_float: the values llama.cpp computes with, and many times faster than numpy."""
    convert = _to_float(type_id)
    if convert is None:
        raise NblError(f"ggml has no dequantizer for type {type_id}")
    src = np.ascontiguousarray(raw)
    rows = src.shape[0]
    if src.nbytes != rows * row_size(type_id, n_per_row):
        raise NblError(f"{src.nbytes} bytes are not {rows} rows of {n_per_row} values of type {type_id}")
    dst = np.empty((rows, n_per_row), dtype=np.float32)
    convert(src.ctypes.data, dst.ctypes.data, rows * n_per_row)
    return dst
