"""Where commands write, checked before any work: a typo or a read-only folder in -o must fail in a
second, not after a calibration. The writes themselves stay atomic (temp name, then rename: ``atomic_write``)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from nbl_gguf.errors import NblError


def _check_writable(folder: Path, flag: str, path: Path) -> None:
    # os.access says yes to root on a chmod-555 folder and cannot see every refusal (read-only
    # mounts, ACLs, quotas); an anonymous temp file is the real test and leaves no name behind
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise NblError(f"{flag} {path}: cannot write in {folder} ({error.strerror or error})") from None


def check_output_file(path: str | os.PathLike, flag: str = "-o") -> Path:
    """A file output: its folder must exist (it is not created: a missing folder is more often a typo
    than a wish) and be writable, and the path must not be a folder."""
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        raise NblError(f"{flag} {path} is a directory")
    if not folder.exists():
        raise NblError(f"{flag} {path}: the folder {folder} does not exist")
    if not folder.is_dir():
        raise NblError(f"{flag} {path}: {folder} is not a folder")
    _check_writable(folder, flag, path)
    return path


def check_output_dir(path: str | os.PathLike, flag: str = "-o", *, renamed_into_place: bool = False) -> Path:
    """A folder output (an artifact, a results folder), created with its parents when written: an
    existing ``path`` must be a folder, and the nearest existing folder on the way must be writable
    (``renamed_into_place``: the folder is built beside ``path`` and renamed, so its parent is written)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NblError(f"{flag} {path} exists and is not a folder")
    ancestor = path.parent if renamed_into_place else path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise NblError(f"{flag} {path}: {ancestor} is not a folder")
    _check_writable(ancestor, flag, path)
    return path


@contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path next to ``path`` to write (or have a tool write) the whole file to; when the block
    ends without an error it is renamed to ``path``, with the permissions a new file gets (0666 & ~umask,
    not the temp file's 0600: a model made here is read by other users' llama.cpp), and otherwise removed,
    so that ``path`` never holds half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _umask() -> int:
    # reading the umask means setting it: set it back at once
    umask = os.umask(0)
    os.umask(umask)
    return umask
