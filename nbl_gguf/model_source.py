"""What ``--model`` names: the embedded default, a HF folder, a hub id, or a GGUF file.

calibrate, convert and eval --sweep resolve it here, once. A GGUF file is judged by its header before
any heavy work: an architecture that the caller cannot run, or that transformers' GGUF loader cannot
read, is refused by name. Calibration runs on the model transformers dequantizes from the file (a
plain safetensors folder, made once and cached under the file's content hash); `convert` writes its
NBL file by surgery on the GGUF itself (nbl_gguf.gguf.nbl_format), so both are kept here.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Collection

from nbl_gguf import models
from nbl_gguf.errors import NblError
from nbl_gguf.gguf_header import NotGguf, read_header
from nbl_gguf.gguf_rope import rope_scaling

# nbl_format.LAYER_TYPES_KEY without its "{arch}" (that module is further down the pipeline)
NBL_LAYER_TYPES_SUFFIX = ".nbl.layer_types"
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


@dataclass(frozen=True)
class GgufFile:
    """A model GGUF given as --model: what its header says, and its content hash."""

    path: Path
    architecture: str
    n_layer: int
    n_embd: int
    file_type: str  # llama.cpp's name of general.file_type: Q4_K_M, Q4_1, F16, ...
    sha256: str

    def provenance(self) -> dict:
        return {"file": self.path.name, "sha256": self.sha256}


@dataclass
class ModelSource:
    name: str
    folder: Path | None = None  # the HF folder; for a GGUF, None until hf_folder() dequantizes it
    gguf: GgufFile | None = None

    def hf_folder(self) -> Path:
        """The HF checkpoint that calibration loads (a GGUF's is dequantized on first use)."""
        if self.folder is None:
            self.folder = models.checkpoint_from_gguf(self.gguf.path, dequantized_dir(self.gguf))
        return self.folder


def dequantized_dir(gguf: GgufFile) -> Path:
    """Keyed by content, named after the file (reports name a model by its folder)."""
    return models.cache_dir() / "models" / "gguf" / gguf.sha256[:16] / gguf.path.stem


def is_gguf_file(model: str | None) -> bool:
    """Whether --model names a file: the only files it takes are GGUFs (read_gguf says if it is not one)."""
    return model is not None and Path(model).expanduser().is_file()


def resolve_model(model: str | None, *, runnable: Collection[str] | None = None,
                  calibrating: bool = True) -> ModelSource:
    """The source ``model`` names. For a GGUF: ``runnable`` are the architectures the caller can
    write NBL files of (None: no such check), ``calibrating`` adds the check that transformers can
    read it. Nothing heavy happens for a GGUF until ``hf_folder()``."""
    if model in (None, "", "default", "embedded"):
        return ModelSource(models.EMBEDDED_NAME, models.default_model_dir())
    path = Path(model).expanduser()
    if path.is_dir():
        return ModelSource(path.resolve().name, path)
    if path.exists():
        return ModelSource(path.stem, gguf=read_gguf(path, runnable=runnable, calibrating=calibrating))
    if model.startswith((".", "/", "~")) or model.count("/") > 1 or model.lower().endswith(".gguf"):
        raise NblError(f"--model {model}: no such folder or file")
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(model, allow_patterns=HUB_PATTERNS))
    except Exception as error:  # noqa: BLE001 - offline, unknown repo, gated: all the same to the user
        raise NblError(f"--model {model}: not a local folder or file, and the hub download failed "
                       f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})") from error
    return ModelSource(model.rstrip("/").split("/")[-1], folder)


def read_gguf(path: Path, *, runnable: Collection[str] | None = None, calibrating: bool = True,
              flag: str = "--model") -> GgufFile:
    """The header of the model GGUF at ``path``, checked; a clear NblError (naming ``flag``) for anything else."""
    try:
        reader = read_header(path)  # a tensor that runs past the end of the file fails here too
    except NotGguf as error:
        raise NblError(f"{flag} {path} is a file but not a GGUF (it does not start with 'GGUF'): "
                       f"pass a HF model folder, a hub id or a .gguf file") from error
    except ValueError as error:
        raise NblError(f"{flag} {path} is not a readable GGUF (truncated or damaged?): "
                       f"{type(error).__name__}: {error}") from error
    field = reader.fields.get("general.architecture")
    if field is None:
        raise NblError(f"{flag} {path} has no general.architecture: not a model GGUF")
    arch = str(field.contents())
    if any(name.endswith(NBL_LAYER_TYPES_SUFFIX) for name in reader.fields):
        raise NblError(f"{flag} {path} is already an NBL GGUF: start from the model's own GGUF")
    if runnable is not None and arch not in runnable:
        raise NblError(f"{flag} {path} is a '{arch}' model; the patched llama.cpp runs NBL layers for "
                       f"{', '.join(runnable)} only")
    if calibrating:
        readable = transformers_gguf_architectures()
        if arch not in readable:
            raise NblError(f"{flag} {path} is a '{arch}' model, which transformers' GGUF loader cannot read "
                           f"(it reads {', '.join(sorted(readable))}), so it cannot be calibrated from the file: "
                           f"pass its HF checkpoint instead, or a calibration made from it (--calibration)")
        try:  # a rope scaling that transformers cannot be told would calibrate another model
            rope_scaling(reader)
        except NblError as error:
            raise NblError(f"{flag} {path}: {error}") from error
    try:
        n_layer = int(reader.fields[f"{arch}.block_count"].contents())
        n_embd = int(reader.fields[f"{arch}.embedding_length"].contents())
    except KeyError as error:
        raise NblError(f"{flag} {path} has no {error.args[0]}") from error
    return GgufFile(path, arch, n_layer, n_embd, _file_type(reader), file_sha256(path))


def _file_type(reader) -> str:
    import gguf

    field = reader.fields.get("general.file_type")
    if field is None:
        return "GGUF"
    try:
        return gguf.LlamaFileType(int(field.contents())).name.replace("MOSTLY_", "").replace("ALL_", "")
    except ValueError:
        return str(field.contents())


def transformers_gguf_architectures() -> set[str]:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return set(GGUF_SUPPORTED_ARCHITECTURES)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
