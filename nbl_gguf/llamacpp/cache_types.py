"""The KV cache types llama.cpp takes (-ctk/-ctv) and how nbl-gguf names a pair of them."""

from __future__ import annotations

from nbl_gguf.errors import NblError

# the cache types llama.cpp accepts (-ctk/-ctv): values per block and bytes per block
CACHE_TYPES = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2),
    "q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "iq4_nl": (32, 18),
}


def split_cache_type(kv_type: str) -> tuple[str, str]:
    """A KV cache type as nbl-gguf names it -> (K's, V's), llama.cpp's -ctk and -ctv: 'q8_0' is both,
    'q8_0/q4_0' K in q8_0 and V in q4_0 (K carries the outliers that a 4-bit type breaks on some models,
    V rarely does: measured in docs/results/frontier.md)."""
    names = str(kv_type).lower().split("/")
    if len(names) > 2 or any(name not in CACHE_TYPES for name in names):
        raise NblError(f"unknown KV cache type '{kv_type}' (use one of {', '.join(CACHE_TYPES)}, "
                       f"or K's/V's such as q8_0/q4_0)")
    return names[0], names[-1]


def cache_type_flags(kv_type: str) -> list[str]:
    """llama.cpp's flags for the cache type (none for its default, F16)."""
    k, v = split_cache_type(kv_type)
    return [] if (k, v) == ("f16", "f16") else ["-ctk", k, "-ctv", v]
