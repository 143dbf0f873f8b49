"""The same model, data and settings give a byte-identical GGUF, from scratch (calibration included),
in two separate processes that differ in everything that must not matter: the folders (of the model,
the data, the output, the working directory), the hash seed (set and dict order) and the PyTorch and
OpenMP thread counts; convert's default refinement of the maps included. And the file says where it came
from: tool versions and the data's hash."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _convert_helpers import save_tiny_llama
from nbl_gguf.gguf import nbl_format
from nbl_gguf.llamacpp.tools import bin_dir, source_dir

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (source_dir() / "convert_hf_to_gguf.py").is_file() or
                       not (bin_dir() / "llama-quantize").is_file(),
                       reason="the patched llama.cpp is not built (scripts/build_llama.sh)"),
]


def calibration_documents() -> list[str]:
    """Eight short real documents (about 1,300 tokens): the calibration reads them in order until it has
    its windows, so the hash it records is the hash of the first ones."""
    from nbl_gguf.calibration.dataset import heldout_texts

    texts = [re.sub(r"\s*\n\s*", " ", text) for text in heldout_texts()]
    return [text[:700].strip() for text in texts if len(text) >= 700][:8]


def convert_in_fresh_process(model: Path, data: Path, output: Path, *, hash_seed: str, threads: str) -> Path:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
               PYTHONHASHSEED=hash_seed, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    output.parent.mkdir(parents=True)
    # the default criterion (best): the held-out selection runs too, on 16 windows (1,024 tokens)
    command = [sys.executable, "-m", "nbl_gguf", "convert", "--model", str(model), "--dataset", str(data),
               "--nsamples", "8", "--seqlen", "64", "--selection-windows", "16", "--device", "cpu", "--m", "2",
               "--quant", "q8_0", "--seed", "5", "--no-eval", "--no-progress", "-o", output.name]
    completed = subprocess.run(command, cwd=output.parent, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr
    assert sorted(p.name for p in output.parent.iterdir()) == [output.name]  # no leftovers
    return output


def test_convert_from_scratch_twice_is_byte_identical_and_records_provenance(tmp_path):
    import gguf
    import torch
    import transformers

    import nbl_gguf

    inputs = tmp_path / "inputs"
    model = save_tiny_llama(inputs / "tiny-llama", n_layer=4, seed=1)
    documents = calibration_documents()
    data = inputs / "calibration.txt"
    data.write_text("\n\n".join(documents) + "\n", encoding="utf-8")

    outputs = []
    for run, hash_seed, threads in (("a", "1", "1"), ("b/deeper", "2", "2")):
        copy = tmp_path / run / "models" / "tiny-llama"
        shutil.copytree(model, copy)
        shutil.copy(data, tmp_path / run / "models" / data.name)
        outputs.append(convert_in_fresh_process(copy, copy.parent / data.name, tmp_path / run / "out" / "tiny-nbl-q8_0.gguf",
                                                hash_seed=hash_seed, threads=threads))
    first, second = (path.read_bytes() for path in outputs)
    assert len(first) == len(second) and first == second

    reader = gguf.GGUFReader(outputs[0])
    assert [i for i, t in enumerate(nbl_format.read_layer_types(reader)) if t] and \
        {t.tensor_type.name for t in reader.tensors if t.name.endswith("attn_nbl.weight")} == {"Q8_0"}
    calibration = json.loads(str(reader.fields[nbl_format.CALIBRATION_KEY].contents()))
    # the maps refined (convert's default), on held-out windows of the file's text, recorded by its name
    assert calibration["refine"]["layers"] == [i for i, t in enumerate(nbl_format.read_layer_types(reader)) if t]
    assert calibration["refine"]["windows"]["heldout"]["calibration_text"] == data.name

    # the data: the sha256 of the documents as calibration consumed them, in order (each one, then a NUL
    # byte); how many it reads depends on how many held-out windows the selection text takes from it
    consumed = calibration["documents"]
    assert 1 <= consumed <= len(documents)
    expected = hashlib.sha256(b"".join(doc.encode("utf-8") + b"\0" for doc in documents[:consumed])).hexdigest()
    assert calibration["text_sha256"] == expected
    assert calibration["seed"] == 5 and calibration["seqlen"] == 64
    assert calibration["dataset"] == data.name  # the file, not where it lay

    # the tools: this package, PyTorch, transformers and gguf-py as installed, and the llama.cpp build
    # as the repository pins it (the commit in CMakeLists.txt, the patch series' bytes)
    versions = calibration["versions"]
    assert versions["nbl_gguf"] == nbl_gguf.__version__
    assert versions["torch"] == torch.__version__ and versions["transformers"] == transformers.__version__
    from importlib import metadata

    assert versions["gguf"] == metadata.version("gguf")
    commit = re.search(r'NBL_LLAMA_COMMIT\s+"([0-9a-f]{40})"', (ROOT / "CMakeLists.txt").read_text()).group(1)
    assert versions["llama.cpp"] == commit
    patches = hashlib.sha256()
    for patch in sorted((ROOT / "patches").glob("*.patch")):
        patches.update(patch.name.encode() + b"\0" + patch.read_bytes() + b"\0")
    assert versions["llama.cpp patches"] == patches.hexdigest()

    # no paths, times or host names: nothing in the record could differ between the two runs
    text = json.dumps(calibration)
    assert str(tmp_path) not in text and "timings" not in text
