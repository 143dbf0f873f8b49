"""The loader fuzzer's corpus replayed through the regular build (no sanitizers): every seed (a small
valid NBL GGUF of each architecture, fuzz/make_seeds.py) loads and decodes, and every file in
fuzz/regressions/ loads or fails with the error that fuzz/regressions/expected.json names. Nothing
may die of a signal. The files are loaded as the harness loads them (fuzz/replay.py, in a subprocess
bound to this build's libllama); docs/fuzzing.md tells how they were found.

fuzz/upstream/ keeps one file per crash the fuzzer found outside the patch: each must end the same
way with the stock library (unpatched src/) as with the patched one, the abort that
fuzz/upstream/expected.json names included, which is what makes it upstream's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nbl_gguf.gguf import nbl_format
from nbl_gguf.llamacpp import tools as llamacpp

FUZZ = Path(__file__).resolve().parent.parent / "fuzz"
REGRESSIONS = FUZZ / "regressions"
UPSTREAM = FUZZ / "upstream"

pytestmark = [
    pytest.mark.llama,
    pytest.mark.skipif(not (llamacpp.bin_dir() / "libllama.so").is_file(),
                       reason="needs the patched llama.cpp build (scripts/build_llama.sh)"),
]


def run_replay(paths: list[Path], lib_dir: Path) -> subprocess.CompletedProcess:
    # an abort prints ggml's message, not a gdb backtrace
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(lib_dir), GGML_NO_BACKTRACE="1")
    return subprocess.run([sys.executable, str(FUZZ / "replay.py"), *map(str, paths)],
                          capture_output=True, text=True, errors="replace", env=env, timeout=600)


def replay(paths: list[Path]) -> dict[str, dict]:
    """fuzz/replay.py's result for each file; fails naming the file a crashed process was loading."""
    completed = run_replay(paths, llamacpp.bin_dir())
    records = [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]
    started = [r["file"] for r in records if r.get("begin")]
    assert completed.returncode == 0, (
        f"replay exited with {completed.returncode} while loading {started[-1] if started else None}:\n"
        + completed.stderr[-4000:])
    results = {r["file"]: r for r in records if not r.get("begin")}
    assert list(results) == [str(p) for p in paths]
    return results


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> list[Path]:
    out = tmp_path_factory.mktemp("seeds")
    subprocess.run([sys.executable, str(FUZZ / "make_seeds.py"), str(out)], check=True, capture_output=True)
    return sorted(out.glob("*.gguf"))


def test_seeds_cover_every_architecture_and_layer_type(seeds):
    import gguf

    architectures, types, windowed, with_taps = set(), set(), set(), set()
    for path in seeds:
        reader = gguf.GGUFReader(path)
        arch = str(reader.fields["general.architecture"].contents())
        architectures.add(arch)
        layer_types = nbl_format.read_layer_types(reader) or []
        types.update(layer_types)
        if nbl_format.read_windows(reader) is not None:
            windowed.add(arch)
        if nbl_format.TAPS in layer_types:
            with_taps.add(arch)
    assert architectures == set(nbl_format.SUPPORTED_ARCHITECTURES)
    assert types == set(nbl_format.LAYER_TYPE_NAMES)
    assert windowed == set(nbl_format.WINDOW_ARCHITECTURES)
    assert with_taps == set(nbl_format.TAPS_ARCHITECTURES)  # taps layers load and decode in each of them
    assert max(path.stat().st_size for path in seeds) < 64 * 1024


def test_every_seed_loads_and_decodes(seeds):
    results = replay(seeds)
    for path in seeds:
        result = results[str(path)]
        assert result["loaded"] and result["context"] and result["decode"] == 0, result


def test_regression_files_load_or_fail_with_their_error():
    expected = json.loads((REGRESSIONS / "expected.json").read_text())
    files = sorted(REGRESSIONS.glob("*.gguf"))
    assert sorted(expected) == [path.name for path in files], "every regression file has an expected outcome"
    results = replay(files)
    for path in files:
        result, error = results[str(path)], expected[path.name]
        if error is None:
            assert result["loaded"] and result["context"] and result["decode"] == 0, result
        else:
            assert not result["loaded"] and error in (result["error"] or ""), result


def test_upstream_crashes_are_the_stock_librarys():
    expected = json.loads((UPSTREAM / "expected.json").read_text())
    files = sorted(UPSTREAM.glob("*.gguf"))
    assert sorted(expected) == [path.name for path in files], "every upstream file has an expected outcome"
    stock = llamacpp.build_dir() / "stock"
    assert (stock / "libllama.so").exists(), "build the stock library: cmake --build build --target llama-stock"
    for path in files:
        abort = expected[path.name]
        for lib_dir in (llamacpp.bin_dir(), stock):
            completed = run_replay([path], lib_dir)
            where = f"{path.name} with {lib_dir}"
            if abort is None:  # undefined behaviour only the sanitizers see: loads or fails cleanly
                assert completed.returncode == 0, f"{where}: exit {completed.returncode}\n{completed.stderr[-2000:]}"
            else:
                assert completed.returncode == -signal.SIGABRT and abort in completed.stderr, (
                    f"{where}: exit {completed.returncode}, expected the upstream abort '{abort}' "
                    f"(fixed upstream? then move the file to fuzz/regressions/)\n{completed.stderr[-2000:]}")
