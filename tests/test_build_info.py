"""The build says what it is: the pinned llama.cpp commit and the patch series, in `--version`, the
llama-cli banner, and llama_version() of the patched and the stock libllama (llama-server's
build_info: tests/test_llama_server.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from _build_info import expected_build_info, expected_commit, pinned, series
from nbl_gguf.fixtures.tiny import TinyLlama
from nbl_gguf.gguf.from_artifact import llama_cpp_patches_sha256
from nbl_gguf.llamacpp import tools as llamacpp


def test_version_names_the_commit_and_the_patch_series():
    commit, number = pinned()
    count, sha256 = series()
    # the digest a GGUF's provenance records for the patches
    assert llama_cpp_patches_sha256() == sha256
    completed = subprocess.run([str(llamacpp.tool("llama-cli")), "--version"], capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr
    output = completed.stdout + completed.stderr
    assert f"(build {number}, commit {expected_commit()})" in output, output
    # llama_version(): upstream's version with the same facts as semver build metadata
    assert re.search(rf"version: \d+\.\d+\.\d+\S*\+{commit[:9]}\.nbl\.{count}\.{sha256[:12]} ", output), output


def test_the_llama_cli_banner_names_the_build(tmp_path):
    path = TinyLlama(n_layer=1).write_gguf(tmp_path / "tiny.gguf")
    completed = subprocess.run(
        [str(llamacpp.tool("llama-cli")), "-m", str(path), "-p", "hi", "-n", "1", "--single-turn", "-t", "2"],
        capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL, timeout=60,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert re.search(rf"^build\s*: {re.escape(expected_build_info())}$", completed.stdout + completed.stderr, re.M)


def library_version(lib_dir: Path) -> str:
    script = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); lib.llama_version.restype = ctypes.c_char_p; "
              "print(lib.llama_version().decode())")
    completed = subprocess.run([sys.executable, "-c", script, str(lib_dir / "libllama.so")],
                               capture_output=True, text=True, check=True, timeout=60)
    return completed.stdout.strip()


def test_patched_and_stock_libraries_report_what_they_were_built_from():
    commit, _ = pinned()
    count, sha256 = series()
    stock = llamacpp.build_dir() / "stock"
    assert (stock / "libllama.so").exists(), "build the stock library: cmake --build build --target llama-stock"
    patched_version = library_version(llamacpp.bin_dir())
    stock_version = library_version(stock)
    assert patched_version.endswith(f"+{commit[:9]}.nbl.{count}.{sha256[:12]}"), patched_version
    assert stock_version.endswith(f"+{commit[:9]}"), stock_version
    # the same upstream version before the '+'
    assert patched_version.split("+")[0] == stock_version.split("+")[0]
