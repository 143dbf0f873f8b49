"""The resume state of a layer-streamed calibration: every finished layer's results, and the hidden
states the next layer starts from.

One state folder per model and key (under the cache: ``NBL_GGUF_CACHE/calibration-state``), the key
being everything the per-layer results depend on (the model's identity, the calibration tokens, the
settings, this package's version). Running the same command again after an interruption (SIGINT,
SIGTERM, a killed process) continues after the last finished layer; a run whose key differs starts
afresh, says what changed, and never mixes in a layer of the old run, whose interrupted state it
removes (unless that run is still going: calibrations of one model with other settings can run side
by side). A layer counts as finished
only once its results and the next layer's input are on disk and ``state.json`` says so (written
by rename), so a state is consistent at every instant. The folder is removed when the calibration
completes.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from nbl_gguf.calibration.hidden import disk_error
from nbl_gguf.errors import NblError

STATE_FORMAT = 1
STATE_FILE = "state.json"


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def tokens_digest(*arrays) -> str:
    h = hashlib.sha256()
    for array in arrays:
        if array is not None:
            data = np.ascontiguousarray(array.cpu().numpy() if hasattr(array, "cpu") else array, dtype=np.int64)
            h.update(str(data.shape).encode() + data.tobytes())
    return h.hexdigest()


def state_root() -> Path:
    from nbl_gguf.models import cache_dir

    return cache_dir() / "calibration-state"


class CalibrationState:
    """A state folder, locked while a calibration uses it."""

    def __init__(self, root: Path, model_key: str, inputs: dict, log=None):
        self.inputs = inputs
        self.key = digest({"format": STATE_FORMAT, **inputs})
        self.root, self.model_key = Path(root), model_key
        self.folder = self.root / f"{model_key}-{self.key[:16]}"
        self.log = log or (lambda text: print(text, file=sys.stderr))
        self._lock = None
        self.layers_done = 0

    @classmethod
    def for_model(cls, model_identity: dict, inputs: dict, log=None) -> "CalibrationState":
        return cls(state_root(), digest(model_identity)[:16], {"model": model_identity, **inputs}, log)

    # --- lifetime ---------------------------------------------------------------------------------

    def open(self) -> int:
        """Lock the folder and return the number of finished layers (0: starting afresh)."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._lock = open(self.folder / ".lock", "w")
        except OSError as error:
            raise disk_error(self.folder / ".lock", error) from error
        if not _try_lock(self._lock):
            self._lock.close()
            self._lock = None
            raise NblError(f"the same calibration is running already (its state is {self.folder}); wait for it to "
                           f"finish, or give this one another NBL_GGUF_CACHE") from None
        saved = self._read_state()
        if saved is not None and saved.get("key") == self.key:
            self.layers_done = int(saved.get("layers_done", 0))
            if self.layers_done:
                self.log(f"calibration: resuming after layer {self.layers_done - 1} (state {self.folder})")
            return self.layers_done
        self._clear()
        self._remove_stale_states()
        self._write_state(0)
        return 0

    def _remove_stale_states(self) -> None:
        """Interrupted calibrations of this model with other inputs: say what changed and remove them
        (their layers can never be used by this run); those still running are left alone."""
        for other in sorted(self.root.glob(f"{self.model_key}-*")):
            if other == self.folder or not other.is_dir():
                continue
            try:
                lock = open(other / ".lock", "a")
            except OSError:
                continue
            try:
                if not _try_lock(lock):
                    continue
                try:
                    saved = json.loads((other / STATE_FILE).read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    saved = {}
                old = saved.get("inputs", {})
                changed = sorted(k for k in set(old) | set(self.inputs) if old.get(k) != self.inputs.get(k))
                self.log(f"calibration: the saved state in {other} was made with other inputs "
                         f"({', '.join(changed) or 'format'} changed): starting afresh")
                shutil.rmtree(other, ignore_errors=True)
            finally:
                lock.close()

    def close(self, finished: bool) -> None:
        """Release the lock; a finished calibration's state is deleted (its artifact holds the results)."""
        if finished:
            shutil.rmtree(self.folder, ignore_errors=True)
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _clear(self) -> None:
        for path in self.folder.iterdir():
            if path.name != ".lock":
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)

    def _read_state(self) -> dict | None:
        try:
            return json.loads((self.folder / STATE_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def _write_state(self, layers_done: int) -> None:
        self._atomic_write(STATE_FILE, json.dumps({"key": self.key, "inputs": self.inputs,
                                                   "layers_done": layers_done}, indent=1, default=str).encode())
        self.layers_done = layers_done

    def _atomic_write(self, name: str, data: bytes) -> None:
        self.write_file(name, lambda handle: handle.write(data))

    def write_file(self, name: str, write) -> None:
        """``name`` in the state folder, written by ``write(handle)`` (a binary file) and replaced whole: a
        reader sees the old or the new file, and nothing of it is held in memory here."""
        path = self.folder / name
        tmp = path.with_name(f".{name}.tmp")
        try:
            with open(tmp, "wb") as handle:
                write(handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except OSError as error:
            tmp.unlink(missing_ok=True)
            raise disk_error(path, error) from error

    # --- contents ---------------------------------------------------------------------------------

    def path(self, name: str) -> Path:
        return self.folder / name

    def save_layer(self, layer: int, entry: dict, tensors: dict[str, np.ndarray]) -> None:
        """A finished layer's results; the layer counts as done only after finish_layer()."""
        from safetensors.numpy import save_file

        tmp = self.folder / f".layer-{layer}.safetensors.tmp"
        try:
            save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp))
            os.replace(tmp, self.layer_tensors(layer))
        except OSError as error:
            tmp.unlink(missing_ok=True)
            raise disk_error(self.layer_tensors(layer), error) from error
        self._atomic_write(f"layer-{layer}.json", json.dumps(entry).encode())

    def finish_layer(self, layer: int) -> None:
        self._write_state(layer + 1)

    def layer_tensors(self, layer: int) -> Path:
        return self.folder / f"layer-{layer}.safetensors"

    def layer_entry(self, layer: int) -> dict:
        return json.loads((self.folder / f"layer-{layer}.json").read_text(encoding="utf-8"))

    def save_json(self, name: str, value) -> None:
        self._atomic_write(name, json.dumps(value).encode())

    def load_json(self, name: str):
        try:
            return json.loads((self.folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def check_space(self, needed: int) -> None:
        free = shutil.disk_usage(self.folder).free
        if needed > free:
            raise NblError(f"the layer-streamed calibration needs about {needed / 2**30:.1f} GiB in {self.folder} for "
                           f"its hidden states and per-layer results; {free / 2**30:.1f} GiB are free (set NBL_GGUF_CACHE "
                           f"to a folder on a larger disk)")


def _try_lock(handle) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def model_identity(source) -> dict:
    """What names the model's weights for the resume state (content hash of a GGUF; names, sizes and
    modification times of a folder's files)."""
    from nbl_gguf.calibration.weights import folder_identity

    if source.gguf is not None:
        return {"gguf_sha256": source.gguf.sha256}
    folder = source.hf_folder()
    return {"folder": str(Path(folder).resolve()), "files": folder_identity(folder)}
