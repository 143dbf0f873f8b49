"""What the build should report about itself, read from CMakeLists.txt and hashed from patches/ here,
independently of the build (tests/test_build_info.py, tests/test_llama_server.py)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pinned() -> tuple[str, int]:
    """The pinned llama.cpp commit and upstream's build number of it."""
    text = (ROOT / "CMakeLists.txt").read_text()
    commit = re.search(r'set\(NBL_LLAMA_COMMIT\s+"([0-9a-f]{40})"\)', text).group(1)
    number = int(re.search(r"set\(NBL_LLAMA_BUILD_NUMBER\s+(\d+)\)", text).group(1))
    return commit, number


def series() -> tuple[int, str]:
    """The number of patches and the sha256 over each one's name and bytes, in order."""
    patches = sorted((ROOT / "patches").glob("*.patch"))
    digest = hashlib.sha256()
    for patch in patches:
        digest.update(patch.name.encode() + b"\0" + patch.read_bytes() + b"\0")
    return len(patches), digest.hexdigest()


def expected_commit() -> str:
    """The commit the patched tools report: <commit>+nbl.<patches>.<series sha256>, shortened."""
    commit, _ = pinned()
    count, sha256 = series()
    return f"{commit[:9]}+nbl.{count}.{sha256[:12]}"


def expected_build_info() -> str:
    """llama_build_info(): the llama-cli banner's build line, llama-server's build_info."""
    return f"b{pinned()[1]}-{expected_commit()}"
