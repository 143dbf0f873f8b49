"""`--criterion best` measured again from a calibration artifact at another m or kind of map
(calibration.best_at): the held-out losses against the replaced model's own forward on the same windows,
the choice at each m the least of them (not a prefix of the calibration's choice), recorded and read back,
and refused by name when it cannot be measured."""

import argparse
import copy
import json
import math
import shutil

import pytest
import torch

from _calibrate_helpers import write_checkpoint
from nbl_gguf.calibration import best_at
from nbl_gguf.calibration.apply import ATTN_LINEAR, ATTN_TAPS, apply_nbl
from nbl_gguf.calibration.artifact import CRITERIA, load_artifact
from nbl_gguf.calibration.solve import ranking
from nbl_gguf.calibration.stream import LayerStream
from nbl_gguf.commands import calibrate
from nbl_gguf.errors import NblError
from nbl_gguf.gguf.from_artifact import provenance, recorded_scores
from nbl_gguf.model_source import resolve_model

LAYERS, M = 6, 4


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A tiny 6-layer model's fp32 calibration with 2-token maps and best chosen at m = 4 on 20 held-out
    windows: (checkpoint root, artifact directory)."""
    root = write_checkpoint(tmp_path_factory.mktemp("best-at"), layers=LAYERS, texts=160, words=60)
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    argv = ["--model", root / "model", "--dataset", root / "data.jsonl", "--seqlen", 64, "--targets", "attn",
            "--dtype", "fp32", "--nsamples", 8, "--m", M, "--taps", 2, "--selection-windows", 20, "-o", root / "cal"]
    assert calibrate.run(parser.parse_args([str(a) for a in argv])) == 0
    return root, root / "cal"


def copy_of(artifact_dir, tmp_path):
    shutil.copytree(artifact_dir, tmp_path / "cal")
    return load_artifact(tmp_path / "cal")


def reference_increases(root, artifact, heldout, m: int, taps: int) -> dict:
    """{criterion: perplexity increase %} of each criterion's first m layers replaced by their maps, by the
    whole model's own forward (transformers) over ``heldout``: the independent reference."""
    from transformers import AutoModelForCausalLM

    def loss(model):
        with torch.no_grad():
            logits = model(input_ids=heldout, use_cache=False).logits[:, :-1].float()
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), heldout[:, 1:].reshape(-1)))

    model = AutoModelForCausalLM.from_pretrained(root / "model", torch_dtype=torch.float32).eval()
    base = loss(model)
    increases = {}
    for criterion in CRITERIA:
        layers = ranking(artifact.scores(criterion))[:m]
        replaced = copy.deepcopy(model)
        if taps > 1:
            apply_nbl(replaced, {i: ATTN_TAPS for i in layers}, {i: artifact.taps_map(i) for i in layers})
        else:
            apply_nbl(replaced, {i: ATTN_LINEAR for i in layers}, artifact)
        increases[criterion] = 100 * (math.exp(loss(replaced) - base) - 1)
    return increases


@pytest.mark.parametrize("taps", [2, 1])
def test_best_at_each_m_is_the_criterion_whose_layers_cost_least(calibrated, tmp_path, taps):
    root, directory = calibrated
    artifact = copy_of(directory, tmp_path)
    source = resolve_model(str(root / "model"))
    heldout = best_at.selection_windows(artifact, LayerStream(source, torch.float32, "cpu"))
    assert heldout.shape[0] == artifact.report["data"]["selection_windows"] == 20
    records = best_at.measure(artifact, source, [1, 2, 3, M], "attn-nbl", taps)
    for record in records:
        reference = reference_increases(root, artifact, heldout, record["m"], taps)
        compared = record["heldout"]["compared"]
        for criterion in CRITERIA:
            assert compared[criterion]["layers"] == sorted(ranking(artifact.scores(criterion))[:record["m"]])
            assert compared[criterion]["ppl_increase_pct"] == pytest.approx(reference[criterion], abs=1e-3)
        assert reference[record["chosen"]] == pytest.approx(min(reference.values()), abs=1e-3)
        assert record["layers"] == compared[record["chosen"]]["layers"]
        assert record["heldout"]["heldout_tokens"] == 20 * 63 and record["taps"] == taps
    at_m = next(r for r in records if r["m"] == M)
    if taps == 2:  # the calibration's own maps at its own m: the choice it recorded
        assert at_m["chosen"] == artifact.report["selection"]["chosen"]
        assert at_m["layers"] == artifact.select()


def test_a_smaller_m_is_measured_and_recorded_not_cut_from_the_calibrations_order(calibrated, tmp_path):
    root, directory = calibrated
    artifact = copy_of(directory, tmp_path)
    source = resolve_model(str(root / "model"))
    heldout = best_at.selection_windows(artifact, LayerStream(source, torch.float32, "cpu"))
    # the calibration's m = 4 choice made the costliest criterion's (as if its windows had said so): each
    # smaller m must still get the least costly set at that m, which here is not that order's prefix
    worst = max(CRITERIA, key=lambda c: reference_increases(root, artifact, heldout, M, 2)[c])
    report = json.loads((tmp_path / "cal" / "report.json").read_text())
    order = ranking(artifact.scores(worst))[:M]
    report["selection"].update(chosen=worst, layers=sorted(order))
    report["selection"]["heldout"]["order"] = order
    (tmp_path / "cal" / "report.json").write_text(json.dumps(report))
    artifact = load_artifact(tmp_path / "cal")
    assert artifact.select() == sorted(order) and artifact.nested_order() == order
    with pytest.raises(NblError, match=r"measured at m = 4 for attn-nbl with 2-token maps, not at m = 2 for "
                                       r"attn-nbl with 2-token maps: convert --calibration .* --m 2 measures it"):
        artifact.select(2, "best")
    assert artifact.best_unmeasured(2) and not artifact.best_unmeasured(M) and not artifact.best_unmeasured(0)
    artifact = best_at.measure_and_record(artifact, source, [1, 2, 3], "attn-nbl", 2)
    differs = 0
    for m in (1, 2, 3):
        reference = reference_increases(root, artifact, heldout, m, 2)
        least = min(reference, key=reference.get)
        assert artifact.select(m, "best") == sorted(ranking(artifact.scores(least))[:m]) == \
            artifact.measured_best(m)["layers"]
        differs += reference[least] < reference[worst] - 1e-3
    assert differs  # the prefix of the recorded order would have been worse at some m
    # recorded: read back without measuring; another kind of map is another record
    again = load_artifact(tmp_path / "cal")
    assert not again.best_unmeasured(2) and again.best_unmeasured(2, taps=1)
    assert again.select() == sorted(order)  # the calibration's own choice stays
    assert [e["m"] for e in again.report["selection"]["measured_best"]] == [1, 2, 3]
    again = best_at.measure_and_record(again, source, [2], "attn-nbl", 1)
    assert [(e["m"], e["taps"]) for e in again.report["selection"]["measured_best"]] == [(1, 2), (2, 2), (3, 2), (2, 1)]
    # a file says the measurement that chose its layers for its own maps, and no other's
    for taps in (2, 1):
        record = again.measured_best(2, taps=taps)
        said = provenance(again, root, record["layers"], method="attn-nbl", taps=taps)["selection"]
        assert said["heldout"] == record["heldout"] and said["measured_after_calibration"]
        assert recorded_scores(again, "best", record["layers"], "attn-nbl", taps)[1] == record["chosen"]
    two_token = again.measured_best(2, taps=2)
    per_token = provenance(again, root, two_token["layers"], method="attn-nbl", taps=1).get("selection", {})
    assert per_token.get("heldout") != two_token["heldout"]  # the same layers with other maps were not measured so
    assert provenance(again, root, again.select(), taps=2)["selection"]["heldout"] == \
        again.report["selection"]["heldout"]  # the calibration's own choice, for its maps
    assert "selection" not in provenance(again, root, again.select(), taps=1)
    assert "selection" not in provenance(again, root, again.select(), method="attn-drop", taps=2)


def test_best_at_refuses_windows_it_cannot_cut_again(calibrated, tmp_path):
    root, directory = calibrated
    artifact = copy_of(directory, tmp_path)
    source = resolve_model(str(root / "model"))
    stream = LayerStream(source, torch.float32, "cpu")
    report = json.loads((tmp_path / "cal" / "report.json").read_text())
    with pytest.raises(NblError, match=r"--m 7 is out of range: the model has 6 layers"):
        best_at.measure(artifact, source, [7], "attn-nbl", 2)
    with pytest.raises(NblError, match=r"--taps 3: the calibration in .* has maps of 2 tokens"):
        best_at.measure(artifact, source, [2], "attn-nbl", 3)
    # the calibration text edited since: its fit windows' digest no longer matches
    texts = (root / "data.jsonl").read_text().splitlines()
    edited = tmp_path / "data.jsonl"
    edited.write_text("\n".join([json.dumps({"text": "w1 w2 w3 " * 20})] + texts[1:]) + "\n")
    report["data"]["dataset"] = str(edited)
    (tmp_path / "cal" / "report.json").write_text(json.dumps(report))
    with pytest.raises(NblError, match="reads differently now from when .* was made"):
        best_at.selection_windows(load_artifact(tmp_path / "cal"), stream)
    # the held-out windows' own digest, when it does not match
    report["data"]["dataset"] = str(root / "data.jsonl")
    report["data"]["selection_sha256"] = "0" * 64
    (tmp_path / "cal" / "report.json").write_text(json.dumps(report))
    with pytest.raises(NblError, match="held-out windows cut again differ"):
        best_at.selection_windows(load_artifact(tmp_path / "cal"), stream)
    # a calibration chosen by a local criterion holds no best at any m until it is measured
    report["selection"]["criterion"] = "cosine"
    (tmp_path / "cal" / "report.json").write_text(json.dumps(report))
    with pytest.raises(NblError, match=r"the selection in .* was made by cosine, not by best at m = 4 for attn-nbl "
                                       r"with 2-token maps: convert --calibration .* --m 4 measures it"):
        load_artifact(tmp_path / "cal").select(M, "best")
    # nothing was recorded by the refused measurements
    assert "measured_best" not in load_artifact(tmp_path / "cal").report["selection"]
