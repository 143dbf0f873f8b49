"""Stock HF -> GGUF conversion by the pinned llama.cpp converter.

The converter (``convert_hf_to_gguf.py`` with its ``conversion`` package and ``gguf-py``) owns
the tokenizer and metadata handling; this module only runs it as a subprocess with the current
Python, checks its result and turns failures into an :class:`NblError`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

from nbl_gguf.errors import NblError
from nbl_gguf.llamacpp.tools import run_measured, source_dir

OUTTYPES = ("f32", "f16", "bf16")
# the stock conversion's type by default: the checkpoint's own float type when every weight has it (a
# 16-bit model converts losslessly at half the bytes of f32: 16 GB instead of 32 for an 8B model, twice over)
INTERMEDIATE_OF = {"F16": "f16", "BF16": "bf16"}


def converter_script() -> Path:
    script = source_dir() / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise NblError(f"the llama.cpp converter {script} is missing: run scripts/build_llama.sh first "
                       f"(it unpacks the pinned, patched llama.cpp source)")
    return script


def check_hf_folder(model_dir: str | os.PathLike) -> Path:
    """A local folder that looks like a HF checkpoint (config.json and weights), else NblError."""
    path = Path(model_dir)
    if not path.exists():
        raise NblError(f"model folder {path} does not exist")
    if not path.is_dir():
        raise NblError(f"{path} is not a directory: pass a HF model folder (config.json, *.safetensors, tokenizer)")
    if not (path / "config.json").is_file():
        raise NblError(f"{path} is not a HF model folder: it has no config.json")
    weights = [p for p in path.iterdir() if p.suffix in (".safetensors", ".bin") or p.name.endswith(".index.json")]
    if not weights:
        raise NblError(f"{path} is not a HF model folder: it has no *.safetensors or pytorch_model*.bin weights")
    return path


def convert_hf_to_gguf(model_dir: str | os.PathLike, outfile: str | os.PathLike, outtype: str = "f32",
                       *, quiet: bool = True, timeout: float | None = None) -> Path:
    """Run the pinned converter on ``model_dir``; returns ``outfile`` once it is a complete GGUF.

    The converter writes to a temp name next to ``outfile`` that is renamed at the end, so a
    failure leaves nothing behind.
    """
    outtype = outtype.lower()
    if outtype not in OUTTYPES:
        raise NblError(f"--outtype {outtype!r}: the stock conversion writes one of {', '.join(OUTTYPES)}")
    model_dir = check_hf_folder(model_dir)
    script = converter_script()
    outfile = Path(outfile)
    outfile.parent.mkdir(parents=True, exist_ok=True)
    tmp = outfile.with_name(f".{outfile.name}.converting.gguf")
    # absolute paths: the converter runs in its own directory
    command = [sys.executable, str(script), str(model_dir.resolve()), "--outtype", outtype, "--outfile", str(tmp.resolve())]
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)  # always the pinned tree's gguf-py
    env.setdefault("PYTHONIOENCODING", "utf-8")
    try:
        completed = run_measured(command, "convert_hf_to_gguf.py", env=env, cwd=str(script.parent), timeout=timeout)
        if completed.returncode != 0 or not tmp.is_file():
            raise NblError(f"the llama.cpp converter failed on {model_dir} (exit {completed.returncode}):\n"
                           + _tail(completed.stdout + completed.stderr))
        _check_gguf(tmp, model_dir)
        os.replace(tmp, outfile)
    except subprocess.TimeoutExpired as error:
        raise NblError(f"the llama.cpp converter timed out after {timeout} s on {model_dir}") from error
    finally:
        tmp.unlink(missing_ok=True)
    if not quiet:
        print(completed.stderr, file=sys.stderr)
    return outfile


def _check_gguf(path: Path, model_dir: Path) -> None:
    from nbl_gguf.gguf_header import read_header

    try:
        reader = read_header(path)  # a tensor past the end of the file fails here too
    except ValueError as error:
        raise NblError(f"the converter's output for {model_dir} is not a readable GGUF: {error}") from error
    if "general.architecture" not in reader.fields or not reader.tensors:
        raise NblError(f"the converter's output for {model_dir} has no architecture or no tensors")


def _tail(text: str, lines: int = 20) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def model_shape(model_dir: Path) -> tuple[int, int]:
    """(layers, hidden size) from config.json, after checking that the architecture is one we can
    calibrate and llama.cpp can run with NBL layers, so bad inputs fail before any heavy work."""
    from nbl_gguf.models import get_adapter

    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise NblError(f"{model_dir} is not a HF model folder: it has no config.json")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise NblError(f"{config_path} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise NblError(f"{config_path} is not a JSON object")
    get_adapter(config)
    config = config.get("text_config", config)
    try:
        return int(config["num_hidden_layers"]), int(config["hidden_size"])
    except KeyError as error:
        raise NblError(f"{config_path} has no {error.args[0]}") from error


def default_intermediate(model_dir: Path) -> str:
    """f16 or bf16 when every float tensor of the checkpoint is stored so, else f32."""
    from nbl_gguf.calibration.weights import safetensors_dtypes

    stored = {dtype for dtype in safetensors_dtypes(model_dir) if dtype.startswith(("F", "BF"))}
    return INTERMEDIATE_OF.get(stored.pop(), "f32") if len(stored) == 1 else "f32"


OUTTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
QUANTIZED_BITS_BOUND = 8.5


def conversion_bytes(model_dir: Path, outtype: str) -> int:
    """Bytes of the model's tensors in ``outtype`` (f32, f16 or bf16), from the safetensors headers: the
    size of one intermediate GGUF, less its metadata and the 1-D tensors the converter keeps F32."""
    from nbl_gguf.calibration.weights import safetensors_headers

    per_element = OUTTYPE_BYTES[outtype]
    total = 0
    for header in safetensors_headers(model_dir):
        for name, info in header.items():
            if name != "__metadata__":
                total += math.prod(info["shape"]) * per_element
    return total


def check_conversion_space(model_dir: Path, outtype: str, folder: Path, quantized: bool = True) -> int:
    """The stock conversion (in ``outtype``) is on disk beside its quantized copy until that is made, and
    the NBL file beside the stock file after it; for a float output both are ``outtype`` files. Refuse
    before the calibration when ``folder``'s disk cannot hold them, rather than let llama-quantize fail
    on a full disk an hour in. Returns the bytes needed."""
    conversion = conversion_bytes(model_dir, outtype)
    # a quantized file is at most q8_0's 8.5 bits per weight (the largest llama-quantize type short of f16)
    second = int(conversion_bytes(model_dir, "f32") * QUANTIZED_BITS_BOUND / 32) if quantized else conversion
    needed = conversion + second
    free = shutil.disk_usage(folder).free
    if needed > free:
        what = f"the stock file in {outtype} and its quantized copy" if quantized else f"the stock and NBL files in {outtype}"
        raise NblError(f"converting {model_dir.name} needs at least {needed / 2**30:.1f} GiB free in {folder} for "
                       f"{what}; {free / 2**30:.1f} GiB are free (free some space, or write -o to a larger disk)")
    return needed
