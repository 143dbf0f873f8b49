"""How llama.cpp attends in each GGUF architecture that nbl-gguf knows: the one table that the KV
figures read, from a GGUF's metadata (gguf.metadata) as from a Hugging Face config (kv_cache, through
the GGUF architecture that models.ADAPTERS converts the config's model_type to)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    """Which layers llama.cpp's loader makes sliding-window ones (src/models/<arch>.cpp)."""

    # p: layer i slides when i % p < p - 1, unless <arch>.attention.sliding_window_pattern gives
    # another p or one flag per layer; None: every layer attends to the whole context, whatever
    # sliding_window key the file carries, except the window layers that a sliding_window_pattern
    # array marks for the patched llama.cpp (gguf.nbl_format.WINDOW_ARCHITECTURES)
    sliding_pattern: int | None = None
    # the window llama.cpp assumes without a <arch>.attention.sliding_window key (0: no key, no
    # sliding layers); a HF config without sliding_window gets it too
    default_window: int = 0


# Keyed by GGUF architecture. Gemma 2's 4096 is both llama.cpp's default n_swa and transformers'
# Gemma2Config default. phi3 turns its own window off in llama.cpp (not the window layers of a pattern
# array); llama, qwen2, qwen3 and smollm3 have none there.
ARCHITECTURES = {
    "gemma2": Architecture(sliding_pattern=2, default_window=4096),
    "gemma3": Architecture(sliding_pattern=6),
    "llama": Architecture(),
    "deci": Architecture(),
    "qwen2": Architecture(),
    "qwen3": Architecture(),
    "phi3": Architecture(),
    "smollm3": Architecture(),
}
