"""Measurements kept on disk under what they measured, so that a long command run again after an interruption (SIGINT,
SIGTERM, a killed process) takes what it had measured instead of measuring it again.

`convert --kv-budget/--total-budget` measures each candidate file for minutes (Qwen2.5-Coder-0.5B on 2 cores: 3.5
min a candidate, 22 candidates, and a 50-min window stage before them), and an interruption used to lose all of it;
so did `bench --frontier` (30 variants, 30-90 min on 2 cores). measurement.kept_runs puts llama-perplexity and the
passkey test through it for both. A measurement here is a pure function of its key: the measured file's content
(sha256), the text's, the tool's settings and the llama.cpp build that ran it (its binaries' sizes and modification
times: a rebuild is another build); the window stage's key is the calibration-resume kind (the model's identity,
the settings, this package's version). A key that differs in anything is another entry, so a result is never taken
for another file, text or build. One JSON file an entry under ``NBL_GGUF_CACHE/measurements``, written by rename:
an interrupted write leaves no entry.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Callable

from nbl_gguf.calibration.resume import digest

MEMO_FORMAT = 1
_FILE_DIGESTS: dict[tuple, str] = {}  # (path, size, mtime_ns) -> sha256 of the content, for this process


def memo_root() -> Path:
    from nbl_gguf.models import cache_dir

    return cache_dir() / "measurements"


def file_key(path) -> str:
    """The sha256 of a file's content (hashed once per process while its size and modification time hold)."""
    from nbl_gguf.model_source import file_sha256

    path = Path(path).resolve()
    stat = path.stat()
    known = (str(path), stat.st_size, stat.st_mtime_ns)
    if known not in _FILE_DIGESTS:
        _FILE_DIGESTS[known] = file_sha256(path)
    return _FILE_DIGESTS[known]


def llama_build_key() -> list:
    """The llama.cpp build the tools run from: each library and tool binary's name, size and modification time."""
    from nbl_gguf.llamacpp.tools import bin_dir

    folder = bin_dir()
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(folder.iterdir())
            if p.is_file() and (p.name.startswith("llama-") or ".so" in p.name or p.suffix in (".dll", ".dylib"))]


class Memo:
    """get/put of JSON values by key (a JSON-able dict); ``folder`` None: nothing is kept."""

    def __init__(self, folder: Path | None):
        self.folder = None if folder is None else Path(folder)

    def _path(self, key: dict) -> Path:
        return self.folder / f"{digest({'format': MEMO_FORMAT, 'key': key})}.json"

    def get(self, key: dict):
        if self.folder is None:
            return None
        try:
            entry = json.loads(self._path(key).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None  # none, or unreadable: measured again
        if entry.get("key") != json.loads(json.dumps(key)):
            return None  # a digest collision, or an entry edited by hand
        return entry["value"]

    def put(self, key: dict, value) -> None:
        if self.folder is None:
            return
        path = self._path(key)
        part = path.with_name(f"{path.name}.{os.getpid()}.part")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            part.write_text(json.dumps({"key": key, "value": value}, sort_keys=True), encoding="utf-8")
            os.replace(part, path)
        except OSError as error:  # a cache that cannot be written costs the resume, not the run
            with contextlib.suppress(OSError):
                part.unlink(missing_ok=True)
            print(f"warning: a measurement was not kept for a run again ({error}); set NBL_GGUF_CACHE to a "
                  f"writable folder", file=sys.stderr)
            self.folder = None  # said once: nothing more is kept

    def cached(self, key: dict, compute: Callable[[], object]) -> tuple[object, bool]:
        """(the value, whether it was kept from before): ``compute()`` where none was, then kept."""
        value = self.get(key)
        if value is not None:
            return value, True
        value = compute()
        self.put(key, value)
        return value, False
