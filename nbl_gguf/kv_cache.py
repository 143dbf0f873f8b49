"""The KV cache llama.cpp allocates for a model at a given context, layer by layer, as the pinned
llama.cpp sizes it (src/llama-context.cpp, llama-kv-cache.cpp, llama-kv-cache-iswa.cpp).

A model whose layers all attend to every token gets one cache of ``n_ctx`` cells (the context
rounded up to 256). A model with sliding-window layers (Gemma 2 and 3) gets two: the global layers
cache every token of the context, the sliding ones only enough cells for the window plus one
micro-batch, ``pad256(min(n_ctx, n_swa * sequences + n_ubatch))``, so at long contexts nearly all of
the cache belongs to the global layers. Window layers that nbl-gguf chose (patches 0015-0018) are
sliding ones with attention sinks: their cache holds the sinks too, ``(n_swa + sinks) * sequences``. A layer whose attention NBL replaced owns no cache at all
(patch 0004). Each cell of a layer holds its K and V rows: ``n_head_kv * head_dim`` values each, in
the cache type (F16 by default).

Pure arithmetic on a description of the layers, so that it serves a GGUF's metadata (gguf.metadata)
as well as a Hugging Face config.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

from nbl_gguf.architectures import ARCHITECTURES
from nbl_gguf.errors import NblError
from nbl_gguf.llamacpp.cache_types import CACHE_TYPES, split_cache_type
from nbl_gguf.models import ADAPTERS

CELL_PADDING = 256  # llama.cpp pads the context, and the sliding-window cache, to a multiple of 256
# llama.cpp's micro-batch (-ub): a sliding-window cache holds one beside the window, so the tokens of a micro-batch
# find every cell they attend to; a smaller one shrinks that cache and slows prompts (docs/convert.md)
DEFAULT_UBATCH = 512
GLOBAL, SLIDING = "global", "sliding"


def cache_context(n_ctx: int, kv_type: str, **settings) -> "Context":
    """The Context of llama-cli's settings (or ``settings``) with the cache type ``kv_type``."""
    k, v = split_cache_type(kv_type)
    return Context(n_ctx=n_ctx, type_k=k, type_v=v, **settings)


@dataclass(frozen=True)
class KvLayer:
    """What one layer puts in the cache per token."""

    k_width: int  # K values per token: n_head_kv * key head size
    v_width: int  # V values per token: n_head_kv * value head size
    sliding: bool = False  # attends to the last ``window`` tokens only
    cached: bool = True  # False where NBL replaced the attention: the layer owns no cache


@dataclass(frozen=True)
class KvModel:
    layers: tuple[KvLayer, ...]
    window: int = 0  # n_swa, the sliding window in tokens; 0 when no layer slides
    sinks: int = 0  # the first positions of a sequence that sliding layers keep too (nbl.window_sinks)

    def __post_init__(self):
        if any(layer.sliding for layer in self.layers) and self.window <= 0:
            raise NblError(f"sliding-window layers need a window of at least one token, got {self.window}")

    @property
    def has_sliding(self) -> bool:
        return any(layer.sliding for layer in self.layers)

    def without(self, replaced: Iterable[int]) -> KvModel:
        """The same model with the attention of ``replaced`` layers gone (their cache with it)."""
        replaced = set(replaced)
        if replaced - set(range(len(self.layers))):
            raise NblError(f"layers {sorted(replaced - set(range(len(self.layers))))} do not exist: "
                           f"the model has {len(self.layers)}")
        return replace(self, layers=tuple(replace(layer, cached=False) if i in replaced else layer
                                          for i, layer in enumerate(self.layers)))


@dataclass(frozen=True)
class Context:
    """The context settings that size the cache. The defaults are llama-cli's and llama-server's with
    one sequence; the C API's (and llama-cpp-python's) differ in swa_full, which they turn on."""

    n_ctx: int
    n_batch: int = 2048
    n_ubatch: int = DEFAULT_UBATCH
    n_seq_max: int = 1
    kv_unified: bool = False
    swa_full: bool = False  # --swa-full: sliding-window layers cache the whole context too
    flash_attn: bool = True  # off, llama.cpp stores V transposed and pads every layer's V to the widest
    type_k: str = "f16"
    type_v: str = "f16"

    def __post_init__(self):
        for name in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max"):
            if getattr(self, name) < 1:
                raise NblError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("type_k", "type_v"):
            if getattr(self, name) not in CACHE_TYPES:
                raise NblError(f"unknown KV cache type '{getattr(self, name)}' (use one of {', '.join(CACHE_TYPES)})")


@dataclass(frozen=True)
class CacheSize:
    """One of llama.cpp's caches, as it logs it: ``llama_kv_cache: size = ... (N cells, L layers, ...)``."""

    cells: int
    layers: int
    k_bytes: int
    v_bytes: int

    @property
    def bytes(self) -> int:
        return self.k_bytes + self.v_bytes


@dataclass(frozen=True)
class KvSize:
    per_layer: tuple[int, ...]  # K + V bytes of each layer (0 where the layer owns no cache)
    caches: dict[str, CacheSize]  # GLOBAL, and SLIDING for a model with sliding-window layers

    @property
    def bytes(self) -> int:
        return sum(cache.bytes for cache in self.caches.values())


def _pad(n: int) -> int:
    return -(-n // CELL_PADDING) * CELL_PADDING


def _row_bytes(type_name: str, width: int) -> int:
    block, block_bytes = CACHE_TYPES[type_name]
    if width % block:
        raise NblError(f"a KV cache of type {type_name} needs rows of a multiple of {block} values, "
                       f"this model's are {width}")
    return width // block * block_bytes


def cache_cells(model: KvModel, context: Context) -> dict[str, int]:
    """Cells of each cache per sequence stream: the global one and, with sliding layers, theirs."""
    n_ctx = _pad(context.n_ctx)
    # each sequence gets its own stream of cells unless the cache is unified
    cells = n_ctx if context.kv_unified else _pad(n_ctx // context.n_seq_max)
    out = {GLOBAL: cells}
    if model.has_sliding:
        # llama.cpp bounds the micro-batch by the batch and the batch by the context it was asked for
        n_ubatch = min(context.n_ubatch, context.n_batch, context.n_ctx)
        windows = context.n_seq_max if context.kv_unified else 1
        out[SLIDING] = cells if context.swa_full else _pad(min(cells, (model.window + model.sinks) * windows + n_ubatch))
    return out


def kv_size(model: KvModel, context: Context) -> KvSize:
    """The bytes llama.cpp allocates for the KV cache of ``model`` at ``context``, per layer and per cache."""
    cells = cache_cells(model, context)
    streams = 1 if context.kv_unified else context.n_seq_max
    # V stored transposed (-fa off) pads every layer's V row to the widest, replaced layers' included
    v_max = max((layer.v_width for layer in model.layers), default=0)
    per_layer = []
    totals = {name: [0, 0, 0] for name in cells}  # layers, K bytes, V bytes
    for layer in model.layers:
        if not layer.cached:
            per_layer.append(0)
            continue
        name = SLIDING if layer.sliding else GLOBAL
        rows = cells[name] * streams
        k_bytes = rows * _row_bytes(context.type_k, layer.k_width)
        v_bytes = rows * _row_bytes(context.type_v, layer.v_width if context.flash_attn else v_max)
        per_layer.append(k_bytes + v_bytes)
        for index, value in enumerate((1, k_bytes, v_bytes)):
            totals[name][index] += value
    caches = {name: CacheSize(cells[name], layers, k_bytes, v_bytes)
              for name, (layers, k_bytes, v_bytes) in totals.items()}
    return KvSize(per_layer=tuple(per_layer), caches=caches)


# --- from a Hugging Face config -----------------------------------------------------------------------

def _as_dict(config) -> dict:
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return config


def _text_part(config: dict) -> dict:
    text = config.get("text_config")
    return _as_dict(text) if text else config


def model_from_config(config) -> KvModel:
    """The KV layout llama.cpp gives the model of a HF ``config`` (config.json as a dict, or a
    transformers config) once converted: per layer its K and V widths and whether it slides."""
    config = _as_dict(config)
    text = _text_part(config)
    model_type = text.get("model_type") or config.get("model_type")
    try:
        n_layer = int(text["num_hidden_layers"])
        n_head = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
    except (KeyError, TypeError, ValueError) as error:
        raise NblError(f"the model's config has no usable {error.args[0] if error.args else 'attention shape'}") from None
    n_head_kv = int(text.get("num_key_value_heads") or n_head)
    head_dim = int(text.get("head_dim") or hidden // n_head)
    # Which layers slide in the GGUF that the pinned converter writes for the config, as llama.cpp
    # then reads it: the config's window (or the architecture's default) and the architecture's pattern,
    # since the converter writes no pattern key (gemma3's 6 holds whatever the config's layer_types
    # say); none with a config pattern of 1. A family whose architecture has no pattern attends to the
    # whole context in llama.cpp (a Mistral or Qwen2 sliding_window included).
    adapter = ADAPTERS.get(model_type)
    architecture = ARCHITECTURES.get(adapter.gguf_arch) if adapter is not None else None
    window, pattern = 0, architecture.sliding_pattern if architecture is not None else None
    if pattern is not None and text.get("sliding_window_pattern") != 1:
        window = int(text.get("sliding_window") or architecture.default_window)
    sliding = [bool(window) and i % pattern < pattern - 1 for i in range(n_layer)] if pattern else [False] * n_layer
    width = n_head_kv * head_dim
    return KvModel(layers=tuple(KvLayer(width, width, sliding=flag) for flag in sliding), window=window)


def training_context_from_config(config) -> int | None:
    """The context llama.cpp takes by default (-c 0): the model's max_position_embeddings."""
    value = _text_part(_as_dict(config)).get("max_position_embeddings")
    return int(value) if value else None
