"""The patch series against the pinned llama.cpp: it applies in order, and a patch that does not
apply stops the build with its name."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from nbl_gguf.llamacpp import tools as llamacpp

ROOT = Path(__file__).resolve().parent.parent
PATCHES = sorted((ROOT / "patches").glob("*.patch"))
SCRIPT = ROOT / "cmake" / "apply_patches.cmake"


# the parts of llama.cpp the series may touch: libllama, the tools and the CPU backend's kernels
PATCHED_DIRS = ("src", "tools", "ggml/src/ggml-cpu")


def pristine_tree(tmp_path: Path) -> Path:
    stock = llamacpp.build_dir() / "llama.cpp-stock-src"
    tree = tmp_path / "llama.cpp"
    for name in PATCHED_DIRS:
        assert (stock / name).is_dir(), f"the build keeps the pristine llama.cpp {name}/ in {stock}"
        shutil.copytree(stock / name, tree / name)
    return tree


def apply(tree: Path, patch_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["cmake", f"-DSOURCE_DIR={tree}", f"-DPATCH_DIR={patch_dir}", "-P", str(SCRIPT)],
        capture_output=True, text=True,
    )


def test_series_touches_only_its_dirs_and_applies_to_the_pinned_tree(tmp_path):
    assert [p.name[:4] for p in PATCHES] == [f"{i:04d}" for i in range(1, len(PATCHES) + 1)]
    for patch in PATCHES:
        touched = [line.split()[2].removeprefix("a/") for line in patch.read_text().splitlines()
                   if line.startswith("diff --git")]
        assert touched and all(path.startswith(tuple(d + "/" for d in PATCHED_DIRS)) for path in touched), patch.name

    tree = pristine_tree(tmp_path)
    result = apply(tree, ROOT / "patches")
    assert result.returncode == 0, result.stderr
    # the result is the tree the build compiled
    files = [path.relative_to(tree) for name in PATCHED_DIRS for path in (tree / name).rglob("*") if path.is_file()]
    assert len(files) > 100
    patched = llamacpp.source_dir()
    assert [f for f in files if (tree / f).read_bytes() != (patched / f).read_bytes()] == []


def test_a_patch_that_does_not_apply_stops_with_its_name(tmp_path):
    broken_dir = tmp_path / "patches"
    broken_dir.mkdir()
    for patch in PATCHES:
        shutil.copy(patch, broken_dir / patch.name)
    # upstream moved on: a context line of the graph patch no longer matches
    graph_patch = next(broken_dir.glob("0003-*.patch"))
    text = graph_patch.read_text()
    assert " llm_graph_qkv llm_graph_context::build_qkv(" in text
    graph_patch.write_text(text.replace(" llm_graph_qkv llm_graph_context::build_qkv(", " llm_graph_qkv llm_graph_context::build_qkv_v2(", 1))

    result = apply(pristine_tree(tmp_path), broken_dir)
    assert result.returncode != 0
    assert "patch does not apply" in result.stderr and graph_patch.name in result.stderr
    # the patches before it were applied, the ones after it were not tried
    output = result.stdout + result.stderr
    assert "applied" in output and "0002-" in output and "0004-" not in output


def test_a_wrong_download_stops_the_configure_step(tmp_path):
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    (downloads / "llama_cpp_python-0.3.36.tar.gz").write_bytes(b"not the pinned sdist")
    result = subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(tmp_path / "build"), f"-DNBL_DOWNLOAD_DIR={downloads}"],
        capture_output=True, text=True,
    )
    assert result.returncode != 0
    assert "checksum mismatch" in result.stderr
    assert not (tmp_path / "build" / "llama.cpp-src").exists()


def test_a_build_folder_with_the_patched_tree_configures_without_the_sdist(tmp_path):
    """A machine without network (the GPU machine) is given the build folder's patched tree and its
    stamp: the configure step must neither download nor read the sdist then."""
    build = llamacpp.build_dir()
    given = tmp_path / "build"
    given.mkdir()
    for name in ("llama.cpp-src", "llama.cpp-stock-src"):
        (given / name).symlink_to(build / name, target_is_directory=True)
    shutil.copy(build / "llama.cpp-src.stamp", given / "llama.cpp-src.stamp")
    empty = tmp_path / "no-downloads"
    empty.mkdir()
    result = subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(given), f"-DNBL_DOWNLOAD_DIR={empty}", "-DGGML_CUDA=OFF"],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "downloading" not in result.stdout and "extracting" not in result.stdout
    assert not list(empty.iterdir())
    assert (given / "CMakeCache.txt").exists()
