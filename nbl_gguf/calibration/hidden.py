"""Hidden states of the calibration windows between one decoder layer and the next.

The layer-streamed calibrator keeps, for every window, the residual stream at the current layer:
[windows, seqlen, d] in the model's dtype (16 x 2048 windows of an 8B model: 268 MB in bf16). A store
holds them on the compute device or in RAM when they fit the memory budget, else in a file that is
read and written one batch of windows at a time with plain file I/O (a memory map would count every
page it touched in the resident set). A file-backed copy is also what a resumed run starts from.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import torch

from nbl_gguf.errors import NblError


def tensor_bytes(shape, dtype) -> int:
    return int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()


def disk_error(path: Path, error: OSError) -> NblError:
    if error.errno == errno.ENOSPC:
        return NblError(f"the disk of {path.parent} is full: the layer-streamed calibration keeps its hidden states "
                        f"and resume state there (set NBL_GGUF_CACHE to a folder on a larger disk, or raise "
                        f"--memory-budget to keep the hidden states in RAM)")
    return NblError(f"cannot write {path}: {error.strerror or error}")


class HiddenStates:
    """[windows, seqlen, d] tensors of ``dtype``, read and written by window ranges.

    ``memory``: a device to keep them on (None: only in the file). ``path``: a file that mirrors them
    (write-through, for resuming) or, without ``memory``, holds them. At least one of the two is given.
    """

    def __init__(self, shape: tuple[int, int, int], dtype, memory: str | torch.device | None = None,
                 path: Path | None = None, existing: bool = False):
        if memory is None and path is None:
            raise ValueError("a HiddenStates needs memory or a file")
        self.shape = tuple(int(n) for n in shape)
        self.dtype = dtype
        self.path = Path(path) if path is not None else None
        self.window_bytes = tensor_bytes(self.shape[1:], dtype)
        self.tensor = None
        if existing:
            if self.path is None or not self.path.is_file() or self.path.stat().st_size != self.shape[0] * self.window_bytes:
                raise NblError(f"{self.path}: saved hidden states missing or of the wrong size")
            if memory is not None:
                self.tensor = self._read_file(0, self.shape[0]).to(memory)
        elif memory is not None:
            self.tensor = torch.empty(self.shape, dtype=dtype, device=memory)
        if self.path is not None and not existing:
            try:
                with open(self.path, "wb") as handle:
                    handle.truncate(self.shape[0] * self.window_bytes)
            except OSError as error:
                raise disk_error(self.path, error) from error

    def __len__(self) -> int:
        return self.shape[0]

    def read(self, start: int, stop: int) -> torch.Tensor:
        if self.tensor is not None:
            return self.tensor[start:stop]
        return self._read_file(start, stop)

    def _read_file(self, start: int, stop: int) -> torch.Tensor:
        from nbl_gguf.calibration.weights import read_exactly

        raw = np.empty((stop - start) * self.window_bytes, dtype=np.uint8)
        with open(self.path, "rb") as handle:
            read_exactly(handle, start * self.window_bytes, raw)
        return torch.frombuffer(raw, dtype=self.dtype).reshape(stop - start, *self.shape[1:])

    def write(self, start: int, values: torch.Tensor) -> None:
        values = values.detach()
        if tuple(values.shape[1:]) != self.shape[1:] or values.dtype != self.dtype:
            raise ValueError(f"hidden states {tuple(values.shape)} {values.dtype} do not fit {self.shape} {self.dtype}")
        if self.tensor is not None:
            self.tensor[start:start + values.shape[0]] = values.to(self.tensor.device)
        if self.path is not None:
            raw = values.to("cpu").contiguous().view(torch.uint8).numpy()
            try:
                with open(self.path, "r+b") as handle:
                    handle.seek(start * self.window_bytes)
                    handle.write(memoryview(raw).cast("B"))
            except OSError as error:
                raise disk_error(self.path, error) from error

    def flush(self) -> None:
        """Make the file's content durable before the state says the layer is done."""
        if self.path is not None:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def all(self) -> torch.Tensor:
        return self.read(0, self.shape[0])
