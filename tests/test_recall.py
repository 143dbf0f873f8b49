"""convert --nbl-retrieval (calibration.recall): the selection walked on retrieval probes, on a tiny random HF
Llama, against the whole model in PyTorch with each set replaced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _convert_helpers import calibrate_for_convert, convert_args, save_tiny_llama
from nbl_gguf import cli
from nbl_gguf.errors import NblError
from nbl_gguf.gguf import nbl_format
from nbl_gguf.llamacpp.tools import source_dir

needs_converter = pytest.mark.skipif(not (source_dir() / "convert_hf_to_gguf.py").is_file(),
                                     reason="pinned llama.cpp source not unpacked (scripts/build_llama.sh)")
N_LAYER = 6
CTX = 256  # the tiny model's training context: the probes' length (recall.DEFAULT_CTX is longer)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_tiny_llama(tmp_path_factory.mktemp("recall") / "tiny-llama", N_LAYER, seed=3)
    artifact = calibrate_for_convert(folder.parent / "artifact", folder, convert_args(model=str(folder), m=2))
    return folder, artifact


def whole_model_answer_loss(folder: Path, artifact, layers) -> float:
    """The probes' answer loss that recall.keep_recall measures, of the HF model with ``layers`` replaced by the
    artifact's per-token maps, in one forward of the whole model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nbl_gguf.calibration.apply import ATTN_LINEAR, apply_nbl
    from nbl_gguf.calibration.dataset import KINDS, bundled_selection_windows
    from nbl_gguf.calibration.windows import Window, retrieval_probes

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids, _ = bundled_selection_windows(tokenizer, {kind: 1 for kind in KINDS}, CTX)
    probes = retrieval_probes(tokenizer, ids, Window(CTX // 4, 0))
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    apply_nbl(model, {i: ATTN_LINEAR for i in layers}, {i: artifact.linear(i, "attn") for i in layers})
    with torch.no_grad():
        logits = model(probes.ids).logits.double()
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), probes.ids[:, 1:].reshape(-1),
                                            reduction="none").reshape(probes.scored.shape)
    return float(nll[probes.scored].mean())


def convert_with(folder, artifact, out: Path, tolerance: str) -> dict:
    import gguf

    code = cli.main(["convert", "--model", str(folder), "--calibration", str(artifact), "--m", "2", "--criterion",
                     "nmse", "--quant", "f16", "--dtype", "fp32", "--nbl-retrieval", tolerance, "--no-progress",
                     "--no-eval", "-o", str(out)])
    assert code == 0
    reader = gguf.GGUFReader(out)
    recall = json.loads(bytes(reader.fields[nbl_format.CALIBRATION_KEY].parts[-1]).decode())["recall"]
    replaced = [i for i, t in enumerate(nbl_format.read_layer_types(reader)) if t != nbl_format.ATTENTION]
    assert replaced == recall["layers"]  # the file replaces what the walk chose
    return recall


@needs_converter
def test_convert_walks_the_selection_on_retrieval_probes(tiny, tmp_path, capsys):
    from nbl_gguf.calibration.artifact import load_artifact
    from nbl_gguf.calibration.solve import ranking

    folder, path = tiny
    artifact = load_artifact(path)
    selected = artifact.select(2, "nmse", "attn-nbl")
    order = ranking(artifact.scores("nmse", "attn"))
    in_order = [i for i in order if i in selected]

    # a tolerance nothing exceeds: the selection as it is, its answer losses measured along the walk
    free = convert_with(folder, path, tmp_path / "free.gguf", "1e9")
    guard = free["retrieval"]
    assert free["layers"] == free["selected"] == sorted(selected) and free["ctx"] == CTX
    assert guard["kept"] == in_order and guard["refused"] == {}
    assert guard["base_loss"] == pytest.approx(whole_model_answer_loss(folder, artifact, []), abs=1e-4)
    for step, loss in enumerate(guard["losses"]):
        assert loss == pytest.approx(whole_model_answer_loss(folder, artifact, in_order[:step + 1]), abs=1e-4)
    assert "retrieval check: the selection's layers" in capsys.readouterr().out

    # a tolerance the selection's first layer exceeds: it is refused, and the walk goes on down nmse's ranking
    first = guard["losses"][0] - guard["base_loss"]
    assert first > 0, "the tiny model's first nmse layer should cost its probes something"
    checked = convert_with(folder, path, tmp_path / "checked.gguf", repr(first / 2))
    guard = checked["retrieval"]
    assert str(in_order[0]) in guard["refused"] and checked["layers"] != sorted(selected)
    walked = [i for i in order if i in guard["kept"] or str(i) in guard["refused"]]
    assert walked == order[:len(walked)] and guard["kept"] == [i for i in walked if str(i) not in guard["refused"]]
    for step, layer in enumerate(guard["kept"]):
        loss = whole_model_answer_loss(folder, artifact, guard["kept"][:step + 1])
        assert guard["losses"][step] == pytest.approx(loss, abs=1e-4) and loss <= guard["base_loss"] + first / 2
    assert "->" in capsys.readouterr().out
    # inspect shows what the check did
    assert cli.main(["inspect", str(tmp_path / "checked.gguf")]) == 0
    shown = capsys.readouterr().out
    assert (f"recall     layers {', '.join(map(str, checked['layers']))} from the selection's "
            f"{', '.join(map(str, sorted(selected)))}; refused "
            f"{', '.join(f'{k} ({v:.3f})' for k, v in guard['refused'].items())}" in shown)
    assert f"probes' answer loss {guard['base_loss']:.3f} -> {guard['loss']:.3f} nats/token" in shown


def test_the_check_is_refused_with_a_kv_budget(tmp_path):
    from nbl_gguf.commands import convert

    with pytest.raises(NblError, match="--nbl-retrieval with --kv-budget"):
        convert.convert(convert_args(kv_budget="1MiB", ctx_size=256, nbl_retrieval=0.1, output=str(tmp_path / "x.gguf")))
    assert list(tmp_path.iterdir()) == []
