"""The RoPE scaling that a GGUF asks of llama.cpp, told to transformers.

transformers' GGUF loader reads a model's rope base and dimensions, not its scaling. A Llama 3.1 or 3.2 GGUF
carries its scaling as the tensor rope_freqs.weight: one factor per rotary frequency, which convert_hf_to_gguf
computes from the checkpoint's llama3 rope_scaling and llama.cpp divides each frequency by. The loader skips
that tensor, so the model it builds rotates by the unscaled frequencies: another model than the one llama.cpp
runs (a tiny Llama-3-style model: its logits 2.7e-3 off llama.cpp's, relative to the largest, against 4e-7 for
the model of its own config; tests/test_gguf_rope.py). Calibrating, selecting layers or windows, or refining on
it would measure that other model, most of all at long range.

rope_scaling() gives the transformers rope_scaling that reproduces a GGUF's factors (llama3's four numbers,
recomputed as convert_hf_to_gguf computes them and checked against the file's), or the linear or YaRN scaling
its keys name; it refuses, by name, a scaling that transformers would not reproduce from the file (YaRN with
settings of its own, LongRoPE's factor tensors), rather than calibrate a different model. with_rope_scaling()
puts it into a config.
"""

from __future__ import annotations

import math

import numpy as np

from nbl_gguf.errors import NblError

ROPE_FREQS = "rope_freqs.weight"
# LongRoPE's two factor sets (Phi-3 128K and the like): transformers' GGUF loader reads neither
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# YaRN's settings a file may carry (rope.scaling.yarn_*): llama.cpp's defaults for them are transformers' too
YARN_SETTINGS = ("ext_factor", "attn_factor", "beta_fast", "beta_slow", "log_multiplier")
# the factors a file carries against those recomputed from the recovered numbers (float32 in both)
FACTOR_RTOL = 1e-5


def llama3_factors(base: float, n_dims: int, factor: float, low_freq_factor: float, high_freq_factor: float,
                   original_context: float) -> np.ndarray:
    """The per-frequency factors of a llama3 rope scaling, as convert_hf_to_gguf writes rope_freqs.weight."""
    freqs = 1.0 / (base ** (np.arange(0, n_dims, 2, dtype=np.float32) / n_dims))
    low_wavelen, high_wavelen = original_context / low_freq_factor, original_context / high_freq_factor
    out = []
    for freq in freqs.astype(np.float64):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def llama3_from_factors(factors: np.ndarray, base: float, n_dims: int) -> dict | None:
    """The llama3 rope_scaling whose factors are ``factors`` (rope_freqs.weight), None if every one is 1.

    The factors fix the scaling factor (the largest), and in the band between the two wavelengths they name
    the ramp s = (L / wavelength - low) / (high - low); L, low and high are fixed by it only up to a common
    scale, which the choice low = 1 (Llama 3's own) settles. Checked by recomputing the factors."""
    factors = np.asarray(factors, dtype=np.float64)
    if factors.shape != (n_dims // 2,):
        raise NblError(f"its {ROPE_FREQS} holds {factors.size} factors; the rotary dimensions ({n_dims}) need "
                       f"{n_dims // 2}")
    if np.all(factors == 1):
        return None
    factor = float(factors.max())
    if not np.all(np.isfinite(factors)) or factors.min() < 1 or factor <= 1:
        raise NblError(f"its {ROPE_FREQS} holds factors from {factors.min():g} to {factor:g}: not a llama3 rope scaling")
    wavelen = 2 * math.pi * base ** (np.arange(0, n_dims, 2, dtype=np.float64) / n_dims)
    ramp = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    smooth = (1 / factors[ramp] - 1 / factor) / (1 - 1 / factor)  # the ramp's s at those wavelengths
    candidates = []
    # Llama 3's own low = 1, high = 4: L from the ramp, or between the last factor of 1 and the first of the scaling
    if ramp.any():
        candidates.append((1.0, 4.0, float(np.median(wavelen[ramp] * (3 * smooth + 1)))))
    else:  # no frequency on the ramp: any L and high with last_one < L / high and L < first_full give these
        last_one = float(wavelen[factors == 1].max(initial=0.0))
        first_full = float(wavelen[factors == factor].min())
        ratio = min(4.0, math.sqrt(first_full / last_one)) if last_one > 0 else 4.0
        candidates.append((1.0, ratio, math.sqrt(ratio * last_one * first_full) if last_one > 0 else first_full / 2))
    if ramp.sum() >= 2:  # other numbers: s = a / wavelength - b, and low = 1 gives L = a / b, high = 1 + 1 / b
        a, b = np.polyfit(1 / wavelen[ramp], smooth, 1) * np.array([1, -1])
        if b > 0:
            candidates.append((1.0, float(1 + 1 / b), float(a / b)))
    for low_factor, high_factor, context in candidates:
        for length in dict.fromkeys((round(context), float(context))):  # an integer context where it fits
            recomputed = llama3_factors(base, n_dims, factor, low_factor, high_factor, length)
            if np.allclose(recomputed, factors, rtol=FACTOR_RTOL, atol=0):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low_factor,
                        "high_freq_factor": high_factor, "original_max_position_embeddings": length}
    raise NblError(f"its {ROPE_FREQS} (factors {factors.min():g} to {factor:g}) matches no llama3 rope scaling: "
                   f"transformers could not rotate as llama.cpp does with it")


def rope_scaling(header) -> dict | None:
    """transformers' rope_scaling for the GGUF whose header (gguf_header.read_header) is ``header``: None where
    llama.cpp scales nothing; an NblError for a scaling transformers would not reproduce from the file."""
    fields = header.fields
    arch = str(fields["general.architecture"].contents())

    def field(key, default=None):
        value = fields.get(f"{arch}.{key}")
        return default if value is None else value.contents()

    tensors = {t.name: t for t in header.tensors}
    longrope = [name for name in LONGROPE_TENSORS if name in tensors]
    if longrope:
        raise NblError(f"it carries LongRoPE factors ({', '.join(longrope)}), which transformers' GGUF "
                       f"loader does not read: the model it builds would rotate unlike llama.cpp's. Calibrate from the "
                       f"model's HF checkpoint instead")
    kind = str(field("rope.scaling.type", "none")).lower()
    factor = float(field("rope.scaling.factor", 1.0))
    if kind == "linear":
        return None if factor == 1 else {"rope_type": "linear", "factor": factor}
    # YaRN with llama.cpp's defaults for the rest (as Qwen2.5 asks for beyond 32K): transformers' own yarn rotation
    # then gives llama.cpp's logits (tests/test_gguf_rope.py); a file that sets the others is refused below
    if kind == "yarn":
        own = [f"{arch}.rope.scaling.yarn_{key}" for key in YARN_SETTINGS
               if field(f"rope.scaling.yarn_{key}") is not None]
        original = field("rope.scaling.original_context_length")
        if own or original is None:
            raise NblError("it asks llama.cpp for yarn rope scaling "
                           + (f"with settings of its own ({', '.join(own)}), which transformers' GGUF loader does "
                              f"not read" if own else f"without {arch}.rope.scaling.original_context_length")
                           + ": the model transformers builds would rotate unlike llama.cpp's. Calibrate from the "
                             "model's HF checkpoint instead")
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": int(original)}
    if kind not in ("none", ""):
        raise NblError(f"it asks llama.cpp for {kind} rope scaling ({arch}.rope.scaling.type), which "
                       f"transformers' GGUF loader does not read: the model it builds would rotate unlike llama.cpp's. "
                       f"Calibrate from the model's HF checkpoint instead")
    if ROPE_FREQS not in tensors:
        return None
    entry = tensors[ROPE_FREQS]
    if entry.tensor_type.name != "F32":
        raise NblError(f"its {ROPE_FREQS} is {entry.tensor_type.name}, not F32")
    with open(header.path, "rb") as handle:
        handle.seek(entry.data_offset)
        factors = np.frombuffer(handle.read(entry.n_bytes), dtype=header.endianess + "f4")
    n_dims = field("rope.dimension_count")
    if n_dims is None:
        n_dims = int(field("embedding_length")) // int(field("attention.head_count"))
    return llama3_from_factors(factors, float(field("rope.freq_base", 10000.0)), int(n_dims))


def with_rope_scaling(config, scaling: dict | None):
    """``config`` (a transformers config read from a GGUF) with ``scaling`` in it, where transformers reads it:
    rope_parameters (transformers 5, beside rope_theta) or rope_scaling (4.x). Unchanged for None."""
    if scaling is None:
        return config
    if hasattr(config, "rope_parameters"):
        theta = (config.rope_parameters or {}).get("rope_theta", getattr(config, "rope_theta", None))
        config.rope_parameters = {**scaling, **({"rope_theta": theta} if theta is not None else {})}
    else:
        config.rope_scaling = dict(scaling)
    return config


def holds_scaling(config, scaling: dict | None) -> bool:
    """Whether a transformers config rotates with ``scaling`` (None: the default rotation); keys that
    transformers adds with their defaults are not compared."""
    held = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if held.get("rope_type", held.get("type", "default")) == "default":
        return scaling is None
    return scaling is not None and all(held.get(key) == value for key, value in scaling.items())
