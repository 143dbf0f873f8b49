"""Atomic writes (outputs.atomic_write): the finished file has the permissions a new file gets, a failed write
leaves neither half a file nor its temporary, and the files llama.cpp's tools write through it (llama-quantize)
are no exception."""

from __future__ import annotations

import os
import stat

import pytest

from nbl_gguf.errors import NblError
from nbl_gguf.llamacpp.tools import bin_dir
from nbl_gguf.outputs import atomic_write


@pytest.fixture
def umask_027():
    previous = os.umask(0o027)
    yield 0o640
    os.umask(previous)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_finished_file_gets_the_umask_s_permissions_not_the_temp_file_s(tmp_path, umask_027):
    target = tmp_path / "deeper" / "model.gguf"
    with atomic_write(target) as tmp:
        assert tmp.parent == target.parent and not target.exists()
        assert mode(tmp) == 0o600  # mkstemp's: nobody reads it before it is whole
        tmp.write_bytes(b"GGUF")
    assert target.read_bytes() == b"GGUF"
    assert mode(target) == umask_027
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.gguf"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "model.gguf"
    target.write_bytes(b"old")
    with pytest.raises(NblError, match="the writer failed"):
        with atomic_write(target) as tmp:
            tmp.write_bytes(b"half")
            raise NblError("the writer failed")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


@pytest.mark.skipif(not (bin_dir() / "llama-quantize").is_file(),
                    reason="patched llama-quantize not built (scripts/build_llama.sh)")
def test_llama_quantize_s_output_is_readable_as_a_new_file_is(tmp_path, umask_027):
    from nbl_gguf.fixtures import synthetic
    from nbl_gguf.gguf.quantize import prune_blocks, quantize

    shape = synthetic.Shape("tiny-outputs", 256, 4, 4, 2, 512, 300, False, 10000.0, 4096)
    source = synthetic.write_random_gguf(shape, tmp_path / "source-f16.gguf", base="F16")
    assert mode(source) == umask_027
    # before atomic_write set them, llama-quantize's outputs kept the temporary's 0600 (the frontier's Q3_K_M,
    # Q5_K_M and pruned files)
    assert mode(quantize(source, tmp_path / "q4_k_m.gguf", "q4_k_m")) == umask_027
    assert mode(prune_blocks(source, tmp_path / "pruned.gguf", [1])) == umask_027
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pruned.gguf", "q4_k_m.gguf", "source-f16.gguf"]
