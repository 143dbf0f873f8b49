"""A model's weights read one tensor at a time, and its module tree with no weights in it.

The layer-streamed calibrator (calibration.stream) holds one decoder layer in memory at a time, so
it cannot let transformers load the model. Instead the model is built on the meta device (buffers
such as rotary frequencies are real: they are computed, not loaded), and each parameter is read
from the source when its layer is needed:

- a HF folder: the safetensors files' headers are parsed once; a tensor is read with plain file
  reads (not a memory map, whose touched pages would stay in the process's resident set), renamed
  and converted as transformers' own loader would (its checkpoint conversion mapping);
- a GGUF file: gguf-py reads the header; a tensor's bytes are read, dequantized by ggml's own
  to_float (gguf-py's numpy code when the library is not built), and reshaped and processed by
  transformers' GGUF tensor processors (llama's Q/K un-permutation, Gemma's norm offset), exactly
  what ``from_pretrained(gguf_file=...)`` does to the whole file.

The token embedding is read by rows: only the rows of the tokens in the calibration text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from nbl_gguf.errors import NblError

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}
ROWS_PER_READ = 8192  # embedding / head rows per read: bounded memory whatever the vocabulary


def read_exactly(handle, offset: int, out: np.ndarray) -> None:
    """Fill ``out`` (contiguous) with the file's bytes at ``offset``."""
    view = memoryview(out).cast("B")
    handle.seek(offset)
    done = 0
    while done < len(view):
        count = handle.readinto(view[done:])
        if not count:
            raise NblError(f"{handle.name}: the file ends before byte {offset + len(view)} (truncated?)")
        done += count


# --- the module tree ----------------------------------------------------------------------------

def skeleton(config, dtype):
    """The CausalLM of ``config`` with every parameter on the meta device and real buffers."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    model.config.use_cache = False
    return model


def set_parameter(model, name: str, tensor: torch.Tensor) -> None:
    """Put ``tensor`` in place of parameter ``name`` (a dotted path)."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    module._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)


def release_parameters(model, prefix: str) -> None:
    """Turn the parameters under ``prefix`` back into meta tensors (their memory is freed)."""
    module = model.get_submodule(prefix)
    for name, param in list(module.named_parameters(recurse=True)):
        set_parameter(module, name, torch.empty(param.shape, dtype=param.dtype, device="meta"))


def parameter_names(model, prefix: str) -> list[str]:
    return [f"{prefix}.{name}" for name, _ in model.get_submodule(prefix).named_parameters()]


# --- sources ------------------------------------------------------------------------------------

@dataclass
class _SafetensorsEntry:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class WeightSource:
    """Parameters of a HF model by name (the names of ``model.state_dict()``), read on demand."""

    def __init__(self, model):
        self.model = model
        self.aliases = _tied_aliases(model)  # taken now: replacing a parameter later unties the two

    def parameter(self, name: str, dtype) -> torch.Tensor:
        raise NotImplementedError

    def embedding_rows(self, name: str, rows: torch.Tensor, dtype) -> torch.Tensor:
        """Rows ``rows`` (sorted unique ids) of the embedding matrix ``name``, as [len(rows), d]."""
        raise NotImplementedError

    def matrix(self, name: str, dtype) -> torch.Tensor:
        """A large 2-D parameter (the LM head), read in row blocks into one tensor of ``dtype``."""
        return self.parameter(name, dtype)

    def load(self, prefix: str, dtype, device) -> None:
        """Materialize every parameter under ``prefix`` (a module path of the model)."""
        for name in parameter_names(self.model, prefix):
            self.load_parameter(name, dtype, device)

    def load_parameter(self, name: str, dtype, device) -> None:
        expected = self.model.get_parameter(name).shape
        tensor = self.parameter(name, dtype)
        if tuple(tensor.shape) != tuple(expected):
            raise NblError(f"{self.describe()}: {name} has shape {list(tensor.shape)}, the model expects "
                           f"{list(expected)}")
        set_parameter(self.model, name, tensor.to(device))

    def describe(self) -> str:
        raise NotImplementedError


def safetensors_headers(folder: Path) -> list[dict]:
    """The JSON header of each of a folder's *.safetensors files (tensor name -> dtype, shape, offsets)."""
    headers = []
    for path in sorted(Path(folder).glob("*.safetensors")):
        with open(path, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            if not 2 <= size <= 100 << 20:
                raise NblError(f"{path} is not a safetensors file (header size {size})")
            try:
                headers.append(json.loads(handle.read(size)))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise NblError(f"{path} is not a safetensors file (its header is not JSON: {error})") from None
    return headers


def safetensors_dtypes(folder: Path) -> set[str]:
    """The dtypes (safetensors names: F32, F16, BF16, ...) of every tensor of a folder's *.safetensors."""
    return {info["dtype"] for header in safetensors_headers(folder)
            for name, info in header.items() if name != "__metadata__"}


class SafetensorsSource(WeightSource):
    """A HF folder's *.safetensors files (one, or shards)."""

    def __init__(self, model, folder: Path):
        super().__init__(model)
        self.folder = Path(folder)
        self.entries: dict[str, _SafetensorsEntry] = {}
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise NblError(f"{self.folder} has no *.safetensors files (nor a PyTorch *.bin checkpoint)")
        for path in files:
            self._read_header(path)
        self.targets = self._map_names()

    def describe(self) -> str:
        return str(self.folder)

    def _read_header(self, path: Path) -> None:
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise NblError(f"{path} is not a safetensors file (shorter than its header)")
            size = int.from_bytes(head, "little")
            if size > 100 << 20 or size > path.stat().st_size:
                raise NblError(f"{path} is not a safetensors file (header size {size})")
            try:
                header = json.loads(handle.read(size))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise NblError(f"{path}: unreadable safetensors header ({error})") from None
        base = 8 + size
        file_size = path.stat().st_size
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            if info["dtype"] not in SAFETENSORS_DTYPES:
                raise NblError(f"{path}: tensor {name} has dtype {info['dtype']}, which is not read here")
            if base + end > file_size:
                raise NblError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
            self.entries[name] = _SafetensorsEntry(path, SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]),
                                                   base + start, end - start)

    def _map_names(self) -> dict[str, tuple]:
        """Model parameter name -> ("tensor", checkpoint name) or ("converter", transform, [(pattern, name)]):
        the checkpoint's names renamed (and grouped for converters) as transformers' loader does."""
        state = {name: None for name, _ in self.model.named_parameters()}
        renamings, converters = _conversions(self.model)
        targets: dict[str, tuple] = {}
        grouped: dict[str, tuple] = {}
        prefix = getattr(self.model, "base_model_prefix", None)
        for key in sorted(self.entries, key=_natural_key):
            target, pattern = _rename(key, renamings, converters, prefix, state)
            if pattern is None:
                targets[target] = ("tensor", key)
            else:
                converter = next(c for c in converters if pattern in c.source_patterns)
                grouped.setdefault(target, ("converter", converter, []))[2].append((pattern, key))
        for target, group in grouped.items():
            targets.setdefault(target, group)
        return targets

    def _source(self, name: str):
        found = self.targets.get(name)
        if found is None:
            found = self.targets.get(self.aliases.get(name, ""))
        if found is None:
            raise NblError(f"{self.folder}: no tensor for the model's parameter {name}")
        return found

    def _read(self, key: str) -> torch.Tensor:
        entry = self.entries[key]
        raw = np.empty(entry.nbytes, dtype=np.uint8)
        with open(entry.path, "rb") as handle:
            read_exactly(handle, entry.offset, raw)
        return torch.frombuffer(raw, dtype=entry.dtype).reshape(entry.shape) if entry.nbytes else \
            torch.empty(entry.shape, dtype=entry.dtype)

    def parameter(self, name: str, dtype) -> torch.Tensor:
        found = self._source(name)
        if found[0] == "tensor":
            return self._read(found[1]).to(dtype)
        _, converter, sources = found
        return _convert(converter, name, sources, self._read).to(dtype)

    def embedding_rows(self, name: str, rows: torch.Tensor, dtype) -> torch.Tensor:
        found = self._source(name)
        if found[0] != "tensor":
            return self.parameter(name, dtype)[rows]
        entry = self.entries[found[1]]
        width = int(np.prod(entry.shape[1:]))
        row_bytes = width * torch.finfo(entry.dtype).bits // 8 if entry.dtype.is_floating_point else None
        if row_bytes is None:
            raise NblError(f"{self.folder}: embedding {name} is not a float tensor")
        out = torch.empty((len(rows), width), dtype=dtype)
        with open(entry.path, "rb") as handle:
            for start in range(0, entry.shape[0], ROWS_PER_READ):
                stop = min(entry.shape[0], start + ROWS_PER_READ)
                wanted = (rows >= start) & (rows < stop)
                if not wanted.any():
                    continue
                raw = np.empty((stop - start) * row_bytes, dtype=np.uint8)
                read_exactly(handle, entry.offset + start * row_bytes, raw)
                block = torch.frombuffer(raw, dtype=entry.dtype).reshape(stop - start, width)
                out[wanted] = block[rows[wanted] - start].to(dtype)
        return out


class ResidentSource(WeightSource):
    """The parameters of a model already in memory (a loaded HF model): the layer stream over them is
    the whole-model calibration, with nothing read from disk."""

    def __init__(self, model, loaded):
        super().__init__(model)
        self.loaded = loaded
        self.state = dict(loaded.named_parameters(remove_duplicate=False))

    def describe(self) -> str:
        return f"the loaded {type(self.loaded).__name__}"

    def parameter(self, name: str, dtype) -> torch.Tensor:
        found = self.state.get(name)
        if found is None:
            found = self.state.get(self.aliases.get(name, ""))
        if found is None:
            raise NblError(f"{self.describe()} has no parameter {name}")
        return found.detach().to(dtype)

    def embedding_rows(self, name: str, rows: torch.Tensor, dtype) -> torch.Tensor:
        table = self.parameter(name, dtype)
        return table[rows.to(table.device)].cpu()


# (architecture, {name: tensor}) of each GGUF already opened in this process, by path, size and modification
# time: gguf-py parses every metadata field to reach the tensors, the vocabulary's strings one by one (15 s for
# Qwen2.5's 150K), and one convert opens the model up to four times
_GGUF_INDEX: dict[tuple, tuple] = {}


def _gguf_index(path: Path) -> tuple[str, dict]:
    import gguf

    status = path.stat()
    key = (str(path.resolve()), status.st_size, status.st_mtime_ns)
    if key not in _GGUF_INDEX:
        reader = gguf.GGUFReader(path)
        # tensors are read with plain reads (GgufSource._rows): only their names, shapes, types and offsets
        tensors = {t.name: SimpleNamespace(name=t.name, shape=t.shape.copy(), tensor_type=t.tensor_type,
                                           data_offset=int(t.data_offset)) for t in reader.tensors}
        _GGUF_INDEX[key] = (str(reader.fields["general.architecture"].contents()), tensors)
        del reader
    return _GGUF_INDEX[key]


class GgufSource(WeightSource):
    """A model GGUF's tensors, dequantized and processed as transformers' GGUF loader does."""

    def __init__(self, model, path: Path):
        super().__init__(model)
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, \
            get_gguf_hf_weights_map

        self.path = Path(path)
        arch, self.tensors = _gguf_index(self.path)
        self.processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
        to_hf = get_gguf_hf_weights_map(model, self.processor)
        self.names = {hf: name for name, hf in to_hf.items() if name in self.tensors}

    def describe(self) -> str:
        return str(self.path)

    def _gguf_name(self, name: str) -> str:
        found = self.names.get(name) or self.names.get(self.aliases.get(name, ""))
        if found is None:
            raise NblError(f"{self.path}: no tensor for the model's parameter {name}")
        return found

    def _rows(self, tensor, start: int, stop: int) -> np.ndarray:
        """float32 [stop - start, ne0] of rows of a GGUF tensor, as stored (before processing)."""
        import gguf

        width = int(tensor.shape[0])  # ne[0]: values per row
        qtype = tensor.tensor_type
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        row_bytes = width // block * type_size
        raw = np.empty((stop - start, row_bytes), dtype=np.uint8)
        with open(self.path, "rb") as handle:
            read_exactly(handle, int(tensor.data_offset) + start * row_bytes, raw)
        return _dequantize(raw, qtype, width)

    def parameter(self, name: str, dtype) -> torch.Tensor:
        gguf_name = self._gguf_name(name)
        tensor = self.tensors[gguf_name]
        rows = int(np.prod(tensor.shape[1:])) if len(tensor.shape) > 1 else 1
        values = self._rows(tensor, 0, rows).reshape(tuple(int(n) for n in reversed(tensor.shape)))
        values = self.processor.process(weights=values, name=gguf_name).weights
        return torch.from_numpy(np.ascontiguousarray(values)).to(dtype)

    def _row_blocks(self, name: str):
        gguf_name = self._gguf_name(name)
        tensor = self.tensors[gguf_name]
        if len(tensor.shape) != 2:
            raise NblError(f"{self.path}: {gguf_name} is not a matrix")
        count = int(tensor.shape[1])
        for start in range(0, count, ROWS_PER_READ):
            stop = min(count, start + ROWS_PER_READ)
            # row-wise processors only (embedding and head): none reorders rows across blocks
            block = self.processor.process(weights=self._rows(tensor, start, stop), name=gguf_name).weights
            yield start, stop, torch.from_numpy(np.ascontiguousarray(block))

    def embedding_rows(self, name: str, rows: torch.Tensor, dtype) -> torch.Tensor:
        out = None
        for start, stop, block in self._row_blocks(name):
            if out is None:
                out = torch.empty((len(rows), block.shape[1]), dtype=dtype)
            wanted = (rows >= start) & (rows < stop)
            if wanted.any():
                out[wanted] = block[rows[wanted] - start].to(dtype)
        return out

    def matrix(self, name: str, dtype) -> torch.Tensor:
        out = None
        for start, stop, block in self._row_blocks(name):
            if out is None:
                out = torch.empty((int(self.tensors[self._gguf_name(name)].shape[1]), block.shape[1]), dtype=dtype)
            out[start:stop] = block.to(dtype)
        return out


def _dequantize(raw: np.ndarray, qtype, width: int) -> np.ndarray:
    import gguf

    if qtype == gguf.GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(raw.shape[0], width)
    try:
        from nbl_gguf.llamacpp import ggml

        return ggml.dequantize(raw, int(qtype), width)
    except NblError:  # no ggml library built: gguf-py's numpy dequantizers give the same values
        return gguf.quants.dequantize(raw, qtype).reshape(raw.shape[0], width)


# --- transformers' checkpoint conversions -------------------------------------------------------

def _natural_key(name: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _conversions(model):
    """(renamings, converters) that transformers applies to this model's checkpoint keys (none before 5.x)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return [], []
    transforms = get_model_conversion_mapping(model)
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])


def _rename(key, renamings, converters, prefix, state):
    try:
        from transformers.core_model_loading import rename_source_key
    except ImportError:
        return key, None
    return rename_source_key(key, renamings, converters, prefix, state)


def _convert(converter, name: str, sources, read) -> torch.Tensor:
    """Run a transformers WeightConverter (e.g. Mixtral's per-expert matrices into one) on its sources."""
    work = converter.copy(converter._original_source_patterns, converter._original_target_patterns,
                          operations=converter.operations)
    for pattern, key in sources:
        work.add_tensor(name, key, pattern, lambda key=key: read(key))
    converted = work.convert(name)
    if name not in converted:
        raise NblError(f"transformers' conversion of {[k for _, k in sources]} gave {sorted(converted)}, not {name}")
    return converted[name]


def _tied_aliases(model) -> dict[str, str]:
    """{output head's weight: input embedding's weight} when the two are tied (the checkpoint then
    stores the matrix once, under the embedding's name)."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    tied = head is not None and embedding is not None and (
        head.weight is embedding.weight or getattr(config, "tie_word_embeddings", False))
    if not tied:
        return {}
    return {f"{module_name(model, head)}.weight": f"{module_name(model, embedding)}.weight"}


def module_name(model, module) -> str:
    for name, candidate in model.named_modules():
        if candidate is module:
            return name
    raise NblError(f"module {type(module).__name__} is not part of the model")


def open_source(model, source) -> WeightSource:
    """The WeightSource of a model_source.ModelSource: its GGUF file, else its HF folder's safetensors,
    else its PyTorch *.bin checkpoint, which cannot be read a tensor at a time: transformers loads it
    whole (memory for the whole model, in the checkpoint's dtype) and the layers are served from it."""
    if source.gguf is not None:
        return GgufSource(model, source.gguf.path)
    folder = Path(source.hf_folder())
    if not any(folder.glob("*.safetensors")) and any(folder.glob("*.bin")):
        from transformers import AutoModelForCausalLM

        try:
            loaded = AutoModelForCausalLM.from_pretrained(folder, dtype="auto", use_safetensors=False)
        except Exception as error:  # noqa: BLE001 - a truncated or foreign pickle: each loader its own type
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise NblError(f"cannot load the PyTorch checkpoint in {folder} ({type(error).__name__}: {first})") \
                from error
        return ResidentSource(model, loaded.eval())
    return SafetensorsSource(model, folder)


def file_identity(path: Path) -> dict:
    """What identifies a weight file cheaply: name, size and modification time (the resume key)."""
    stat = Path(path).stat()
    return {"name": Path(path).name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def folder_identity(folder: Path) -> list[dict]:
    names = sorted(p for p in Path(folder).iterdir() if p.suffix in (".safetensors", ".bin", ".json") and p.is_file())
    return [file_identity(p) for p in names]

