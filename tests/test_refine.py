"""Refinement (calibration.refine): the maps tuned against the model's output lower the held-out loss of
their LMMSE fit, on a tiny model in both forms; an interrupted run resumes to the same maps; a run that
would not fit memory is refused before anything loads; the artifact keeps the refined maps beside the
LMMSE ones, and a GGUF takes them only for the layers they were refined for."""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

from _calibrate_helpers import run_calibrate, tiny_model, write_checkpoint
from nbl_gguf.calibration import refine as refine_module
from nbl_gguf.calibration.apply import ATTN_LINEAR, ATTN_TAPS, apply_nbl
from nbl_gguf.calibration.refine import RefineSettings, refine_model, refine_streamed
from nbl_gguf.calibration.report import describe_refine
from nbl_gguf.calibration.resume import CalibrationState
from nbl_gguf.calibration.taps import TapsMap
from nbl_gguf.errors import NblError
from nbl_gguf.models import attention_norm, decoder_layers, get_adapter

VOCAB, D, N_LAYER = 97, 32, 4
LAYERS = [1, 2]


def motif_windows(count: int, length: int, generator) -> torch.Tensor:
    """Token windows with structure that takes attention to predict: each window repeats a random motif
    of its own (so the next token is the one a motif length back), with some tokens replaced by noise."""
    motifs = torch.randint(3, VOCAB, (count, 6), generator=generator)
    rows = motifs.repeat(1, -(-length // 6))[:, :length].clone()
    noise = torch.rand(rows.shape, generator=generator) < 0.1
    rows[noise] = torch.randint(3, VOCAB, (int(noise.sum()),), generator=generator)
    return rows


@pytest.fixture(scope="module")
def data():
    generator = torch.Generator().manual_seed(0)
    return motif_windows(16, 32, generator), motif_windows(4, 48, generator)


@pytest.fixture(scope="module")
def model():
    """A tiny model trained to copy the motifs: a teacher whose attention matters."""
    torch.set_num_threads(1)  # the resume test compares bits
    model = tiny_model(layers=N_LAYER, hidden=D, vocab=VOCAB)
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):
        ids = motif_windows(8, 32, generator)
        loss = torch.nn.functional.cross_entropy(model(ids).logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def lmmse_maps(model, pieces) -> dict:
    """{layer: (W, b)}: numpy least squares of each chosen attention's output on its input (after the
    norm), over ``pieces`` (an independent fit, not the calibration engine's)."""
    adapter = get_adapter(model)
    seen = {layer: ([], []) for layer in LAYERS}
    handles = []
    for layer in LAYERS:
        block = decoder_layers(model)[layer]
        handles.append(attention_norm(block, adapter).register_forward_hook(
            lambda _m, _i, out, k=layer: seen[k][0].append(out.detach().reshape(-1, D))))
        handles.append(getattr(block, adapter.attn).register_forward_hook(
            lambda _m, _i, out, k=layer: seen[k][1].append(out[0].detach().reshape(-1, D))))
    with torch.no_grad():
        model(pieces)
    for handle in handles:
        handle.remove()
    maps = {}
    for layer, (xs, ys) in seen.items():
        x, y = torch.cat(xs).double().numpy(), torch.cat(ys).double().numpy()
        coef, *_ = np.linalg.lstsq(np.hstack([x, np.ones((len(x), 1))]), y, rcond=None)
        maps[layer] = (coef[:-1].T.astype(np.float32), coef[-1].astype(np.float32))
    return maps


def taps_maps(linear: dict) -> dict:
    """Past-token maps of 3 tokens that start as the per-token maps (the earlier tokens' map zero)."""
    return {layer: TapsMap(taps=3, weight=w, bias=b, lag=np.zeros((D, 2 * D), np.float32))
            for layer, (w, b) in linear.items()}


def heldout_nll(model, layer_type, maps, heldout) -> np.ndarray:
    """Mean next-token NLL of each window with ``maps`` in place (apply.py's modules, a fresh copy)."""
    replaced = apply_nbl(copy.deepcopy(model), {layer: layer_type for layer in LAYERS}, maps)
    with torch.no_grad():
        logits = replaced(heldout).logits.float()
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), heldout[:, 1:].reshape(-1),
                                            reduction="none")
    return nll.reshape(heldout.shape[0], -1).mean(1).double().numpy()


def run(form, model, layer_type, maps, data, state=None, log=None, training_kinds=None, **options):
    pieces, heldout = data
    settings = RefineSettings(form=form, tokens=24 * 32, seqlen=32, eval_every=4, patience=20, no_progress=True,
                              **{"lr": 3e-2, **options})  # relative to each map tensor's RMS
    if form == "model":
        return refine_model(copy.deepcopy(model), LAYERS, layer_type, maps, pieces, heldout, settings, state,
                            log=log or (lambda text: None), training_kinds=training_kinds)
    from nbl_gguf.calibration.stream import LayerStream

    stream = LayerStream.resident(copy.deepcopy(model))
    return refine_streamed(stream, LAYERS, layer_type, maps, pieces, heldout, settings, state,
                           log=log or (lambda text: None))


def check_report_and_gain(model, layer_type, maps, refined, heldout, share: float):
    """The report's losses are those of the maps it names, recomputed here on the whole model, and the
    refined maps close ``share`` of the gap the starting maps leave; (unmodified, start, refined) NLL."""
    held = refined.report["heldout"]
    start = heldout_nll(model, layer_type, maps, heldout).mean()
    after = heldout_nll(model, layer_type, refined.maps, heldout).mean()
    base = heldout_nll(model, 0, {}, heldout).mean()
    assert held["lmmse_nll"]["all"] == pytest.approx(start, abs=1e-5)
    assert held["refined_nll"]["all"] == pytest.approx(after, abs=1e-5)
    assert held["unmodified_nll"]["all"] == pytest.approx(base, abs=1e-5)
    assert after < start - share * (start - base), (base, start, after)
    return base, start, after


@pytest.mark.parametrize("kind", ["per-token", "taps"])
def test_refined_maps_lower_the_heldout_loss_of_the_lmmse_fit(model, data, kind):
    """The model form on a model whose replaced layers carry its copying: the maps take back part of it."""
    pieces, heldout = data
    linear = lmmse_maps(model, pieces)
    layer_type, maps = (ATTN_LINEAR, linear) if kind == "per-token" else (ATTN_TAPS, taps_maps(linear))
    refined = run("model", model, layer_type, maps, data)
    check_report_and_gain(model, layer_type, maps, refined, heldout, 0.05)
    assert sorted(refined.maps) == LAYERS and refined.report["layers"] == LAYERS
    if kind == "taps":
        assert all(m.taps == 3 and np.abs(m.lag).max() > 0 for m in refined.maps.values())  # the past moved too
        assert refined.taps == 3 and set(refined.tensors()) == {f"taps.{k}.{n}" for k in LAYERS
                                                                for n in ("weight", "bias", "lag")}
    else:
        assert set(refined.tensors()) == {f"attn.{k}.{n}" for k in LAYERS for n in ("weight", "bias")}


@pytest.mark.parametrize("target", ["trajectory", "block"])
def test_the_streamed_form_fits_each_block_and_never_keeps_worse_maps(model, data, target):
    """Each layer's own objective falls; from maps that are off (the fit plus noise) the held-out loss falls
    too; from the LMMSE fit of layers that copy (which no per-layer objective can see: the loss is at the
    output), it never ends worse than its start: the start is kept."""
    pieces, heldout = data
    linear = lmmse_maps(model, pieces)
    generator = np.random.default_rng(0)
    noisy = {k: (w + 0.5 * w.std() * generator.standard_normal(w.shape).astype(np.float32), b)
             for k, (w, b) in linear.items()}
    refined = run("streamed", model, ATTN_LINEAR, noisy, data, target=target)
    assert all(loss["last_epoch"] < loss["first_epoch"] for loss in refined.report["layer_losses"].values())
    assert refined.report["kept"] == "refined"
    assert ("hidden state there" in refined.report["objective"]) == (target == "trajectory")
    assert "memory_budget" not in refined.report["settings"] and refined.report["settings"]["target"] == target
    check_report_and_gain(model, ATTN_LINEAR, noisy, refined, heldout, 0.05)
    from_fit = run("streamed", model, ATTN_LINEAR, linear, data, target=target)
    held = from_fit.report["heldout"]
    assert held["refined_nll"]["all"] <= held["lmmse_nll"]["all"]
    if from_fit.report["kept"] != "refined":
        for layer in LAYERS:
            np.testing.assert_array_equal(from_fit.maps[layer][0], linear[layer][0])


@pytest.mark.parametrize("form", ["model", "streamed"])
def test_maps_that_lower_the_mean_but_raise_one_kind_of_text_are_not_kept(model, data, form, monkeypatch):
    """Held-out windows of two kinds; every evaluation after the start reads the last window (kind "b")
    0.01 nats above its value under the starting maps. Without kinds the mean still falls (the other
    windows' gain is larger) and the refined maps are kept; with them, kind "b" is worse than under the
    starting maps at every evaluation, so those are kept, bit for bit."""
    pieces, heldout = data
    linear = lmmse_maps(model, pieces)
    name = "heldout_nll" if form == "model" else "run_variants_nll"
    original, calls, first = getattr(refine_module, name), [], {}

    def raised(value: np.ndarray) -> np.ndarray:
        value = np.array(value, dtype=np.float64)
        value[-1] = first["b"] + 0.01
        return value

    def model_form(*args, **kwargs):  # the teacher's loss, then the LMMSE maps' (the start), then evaluations
        calls.append(1)
        value = original(*args, **kwargs)
        if len(calls) == 2:
            first["b"] = float(value[-1])
        return raised(value) if len(calls) > 2 else value

    def streamed_form(stream, ids, variants, linear_of):  # (unmodified, LMMSE), then the refined maps
        calls.append(1)
        values = original(stream, ids, variants, linear_of)
        if len(calls) == 1:
            first["b"] = float(values[-1][-1])
        return [raised(values[0])] if len(calls) > 1 else values

    # patience 2: the model form with kinds stops after two evaluations that do not count as better
    settings = RefineSettings(form=form, tokens=24 * 32, seqlen=32, eval_every=4, patience=2, no_progress=True,
                              lr=3e-2)
    if form == "model":
        start = linear
    else:
        from nbl_gguf.calibration.stream import LayerStream

        # from maps that are off, as in the streamed test above, so that the other windows' gain outweighs the 0.01
        generator = np.random.default_rng(0)
        start = {k: (w + 0.5 * w.std() * generator.standard_normal(w.shape).astype(np.float32), b)
                 for k, (w, b) in linear.items()}
    kept = {}
    for kinds in (None, ["a", "a", "a", "b"]):
        calls.clear()
        monkeypatch.setattr(refine_module, name, model_form if form == "model" else streamed_form)
        if form == "model":
            refined = refine_model(copy.deepcopy(model), LAYERS, ATTN_LINEAR, start, pieces, heldout, settings,
                                   kinds=kinds, log=lambda text: None)
        else:
            refined = refine_streamed(LayerStream.resident(copy.deepcopy(model)), LAYERS, ATTN_LINEAR, start,
                                      pieces, heldout, settings, kinds=kinds, log=lambda text: None)
        monkeypatch.setattr(refine_module, name, original)
        held = refined.report["heldout"]
        kept[kinds is None] = refined
        if kinds is None:
            assert held["refined_nll"]["all"] < held["lmmse_nll"]["all"]
        else:
            assert held["refined_nll"] == held["lmmse_nll"]
            assert held["refined_nll"]["b"] == pytest.approx(first["b"])
    with_kinds, without = kept[False], kept[True]
    said = describe_refine(with_kinds.report)
    if form == "model":
        assert without.report["best_step"] > 0 and with_kinds.report["best_step"] == 0
        assert with_kinds.report["steps"] == 8 and "no kind of text worse" in with_kinds.report["stopped"]
        assert "kept the LMMSE maps" in said and "kept step" in describe_refine(without.report)
    else:
        assert without.report["kept"] == "refined" and with_kinds.report["kept"].startswith("lmmse")
        assert "kept lmmse (the refined maps were worse" in said and "kept" not in describe_refine(without.report)
    for layer in LAYERS:
        np.testing.assert_array_equal(with_kinds.maps[layer][0], start[layer][0])
        assert not np.array_equal(without.maps[layer][0], start[layer][0])


def test_no_kind_worse_reads_the_mean_and_each_kind():
    from nbl_gguf.calibration.refine import no_kind_worse

    start = np.array([4.0, 4.0, 3.0, 2.0])
    kinds = ["c4", "c4", "docs", "code"]
    assert no_kind_worse(start, start, kinds)
    assert no_kind_worse(np.array([3.9, 4.0, 3.0, 1.9]), start, kinds)
    assert not no_kind_worse(np.array([4.0, 4.02, 2.5, 1.5]), start, kinds)  # the mean falls, C4 rises
    assert no_kind_worse(np.array([4.0, 4.02, 2.5, 1.5]), start, None)  # one kind: the mean alone
    assert not no_kind_worse(np.array([4.1, 4.0, 3.0, 2.0]), start, None)


class Interrupted(Exception):
    pass


@pytest.mark.parametrize("form,balance", [("model", False), ("model", True), ("streamed", False)])
def test_an_interrupted_refinement_resumes_to_the_same_maps(model, data, form, balance, tmp_path, monkeypatch):
    linear = lmmse_maps(model, data[0])
    # balanced: two kinds of pieces in turn, their running losses part of the state
    options = {"balance": True, "training_kinds": ["a", "b"] * (data[0].shape[0] // 2)} if balance else {}
    whole = run(form, model, ATTN_LINEAR, linear, data, **options)

    def state():
        opened = CalibrationState(tmp_path, "tiny", {"refine": form})
        opened.open()
        return opened

    # stop it part way: the model form after its second checkpoint, the streamed one after its first layer
    name = "distillation_loss" if form == "model" else "read_maps"
    original, calls = getattr(refine_module, name), []

    def interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) == (10 if form == "model" else 2):
            raise Interrupted
        return original(*args, **kwargs)

    monkeypatch.setattr(refine_module, name, interrupt)
    first = state()
    with pytest.raises(Interrupted):
        run(form, model, ATTN_LINEAR, linear, data, state=first, **options)
    first.close(finished=False)
    monkeypatch.setattr(refine_module, name, original)
    said = []
    second = state()
    resumed = run(form, model, ATTN_LINEAR, linear, data, state=second, log=said.append, **options)
    second.close(finished=True)
    assert any(line.startswith("refine: resuming") for line in said)
    for layer in LAYERS:
        for got, expected in zip(resumed.maps[layer], whole.maps[layer]):
            np.testing.assert_array_equal(got, expected)
    for key in ("unmodified_nll", "lmmse_nll", "refined_nll"):
        assert resumed.report["heldout"][key] == whole.report["heldout"][key]


# --- the stage and the artifact, through the calibrate command ------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("refine"), layers=3, texts=80, words=40)


def test_calibrate_refine_keeps_both_maps_and_a_gguf_takes_the_refined_ones_for_their_layers(checkpoint, capsys,
                                                                                              monkeypatch):
    from nbl_gguf.calibration.artifact import load_artifact
    from nbl_gguf.gguf.from_artifact import provenance, taps_maps as file_taps_maps, uses_refined

    monkeypatch.setenv("NBL_GGUF_CACHE", str(checkpoint / "cache"))
    out = checkpoint / "artifact"
    common = ["--model", checkpoint / "model", "--dataset", checkpoint / "data.jsonl", "--no-progress", "--nsamples", 8,
              "--seqlen", 32]
    assert run_calibrate(*common, "--m", 2, "--taps", 2, "-o", out, "--refine", "--refine-tokens", 128,
                         "--refine-seqlen", 16, "--refine-eval-every", 2, "--refine-lr", 0.1) == 0
    printed = capsys.readouterr()
    assert "refined (model form, each kind of text's loss weighed alike) the maps of layers" in printed.out
    assert "windows differ" not in printed.err  # refined on the windows the maps were fitted on
    artifact = load_artifact(out)
    layers = artifact.select()
    refine = artifact.report["refine"]
    assert refine["layers"] == layers and refine["taps"] == 2 and refine["weights"].startswith("refined-")
    assert refine["steps"] >= refine["best_step"] and refine["tokens_read"] == 16 * refine["steps"]
    held = refine["heldout"]
    assert held["refined_nll"]["all"] <= held["lmmse_nll"]["all"]  # the best evaluation is kept, the start among them
    assert artifact.refined_for(layers, 2) and not artifact.refined_for(layers[:1], 2)
    assert not artifact.refined_for(layers, 1)
    refined, lmmse = (file_taps_maps(artifact, layers, 2, flag) for flag in (True, False))
    moved = [np.abs(refined[k].weight - lmmse[k].weight).max() for k in layers]
    assert held["refined_nll"]["all"] == held["lmmse_nll"]["all"] or max(moved) > 0
    # the LMMSE maps are still those of the calibration: the same as a run without --refine
    plain = checkpoint / "plain"
    assert run_calibrate(*common, "--m", 2, "--taps", 2, "-o", plain) == 0
    for layer in layers:
        np.testing.assert_array_equal(lmmse[layer].weight, load_artifact(plain).taps_map(layer).weight)
    # the file takes the refined maps for exactly their layers, in the NBL layout, and says so
    assert uses_refined(artifact, layers, 2, "nbl") and not uses_refined(artifact, layers, 2, "stock")
    assert not uses_refined(artifact, layers[:1], 2, "nbl")
    record = provenance(artifact, out, layers, refined=True)["refine"]
    assert record["layers"] == layers and "seconds" not in record and "weights" not in record
    assert "refine" not in provenance(artifact, out, layers)
    # a second refinement replaces the first one's file
    first_file = refine["weights"]
    assert run_calibrate(*common, "--m", 2, "--taps", 2, "-o", out, "--refine", "--refine-tokens", 64,
                         "--refine-seqlen", 16, "--refine-eval-every", 2, "--refine-lr", 1e-3) == 0
    again = load_artifact(out)
    assert sorted(p.name for p in out.glob("refined-*")) == [again.report["refine"]["weights"]]
    assert again.report["refine"]["settings"]["lr"] == 1e-3 != refine["settings"]["lr"]
    assert first_file.startswith("refined-")


def test_a_refinement_that_would_not_fit_is_refused_before_anything_loads(checkpoint, monkeypatch):
    from nbl_gguf import models
    from nbl_gguf.calibration.settings import Settings
    from nbl_gguf.model_source import resolve_model

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load_model", no_load)
    source = resolve_model(str(checkpoint / "model"))
    settings = RefineSettings(form="model", memory_budget=1e-6, seqlen=4096)
    with pytest.raises(NblError, match=r"--refine \(model\) needs about .* GiB: the model's weights .*, the "
                                       r"activations of a 4096-token window .*; 0.00 GiB are available to it: use a "
                                       r"shorter --refine-seqlen \(or --refine-form streamed"):
        refine_module.refine(source, Settings(model=str(checkpoint / "model")), [1], ATTN_LINEAR, {}, settings)


def test_the_auto_form_is_the_model_form_where_it_fits_else_the_streamed_one(checkpoint):
    from transformers import AutoConfig

    # at 4,096 tokens a window: at short ones this tiny model's held-out hidden states, which the streamed form
    # keeps, outweigh the whole model
    config, dtype, asked = AutoConfig.from_pretrained(str(checkpoint / "model")), torch.float32, RefineSettings(seqlen=4096)
    whole, what = refine_module.model_bytes(config, "model", 4096, dtype)
    one_layer, _ = refine_module.model_bytes(config, "streamed", 4096, dtype)
    assert asked.form == "auto" and one_layer < whole
    said = []
    model_form = refine_module.resolve_form(config, asked, dtype, whole, said.append)
    assert (model_form.form, model_form.balance) == ("model", refine_module.DEFAULT_BALANCE) and not said
    chosen = refine_module.resolve_form(config, asked, dtype, whole - 1, said.append)
    assert chosen.form == "streamed" and chosen.learning_rate == refine_module.DEFAULT_LR["streamed"]
    assert chosen.balance is False  # the streamed form has no loss over kinds to weigh
    assert what.startswith("the model's weights ") and "activations of a 4096-token window" in what
    assert said == [f"refine: the model form needs about {whole / 2**30:.2f} GiB ({what}), {(whole - 1) / 2**30:.2f} "
                    f"GiB are available to it: the streamed form, one layer in memory"]
    refine_module.check_memory(config, chosen, dtype, whole - 1)  # fits
    # a form asked for by name is kept; --refine-balance has the model form only, refused where it does not fit
    assert refine_module.resolve_form(config, RefineSettings(form="model"), dtype, 0).form == "model"
    assert refine_module.resolve_form(config, replace(asked, balance=False), dtype, whole).balance is False
    balanced = refine_module.resolve_form(config, replace(asked, balance=True), dtype, whole - 1)
    assert balanced.form == "model"
    with pytest.raises(NblError, match=r"--refine \(model\) needs about"):
        refine_module.check_memory(config, balanced, dtype, whole - 1)
    with pytest.raises(NblError, match="resolve_form first"):
        RefineSettings().learning_rate


def test_a_refinement_takes_the_streamed_form_when_the_model_form_would_not_fit(checkpoint, monkeypatch):
    from nbl_gguf.calibration.artifact import load_artifact
    from nbl_gguf.calibration.settings import Settings
    from nbl_gguf.model_source import resolve_model
    from transformers import AutoConfig

    monkeypatch.setenv("NBL_GGUF_CACHE", str(checkpoint / "cache"))
    common = dict(model=str(checkpoint / "model"), dataset=str(checkpoint / "data.jsonl"), nsamples=8, seqlen=32)
    out = checkpoint / "auto-streamed"
    assert run_calibrate(*[x for k, v in common.items() for x in (f"--{k}", v)], "--no-progress", "--m", 2,
                         "--taps", 2, "-o", out) == 0
    artifact = load_artifact(out)
    config = AutoConfig.from_pretrained(str(checkpoint / "model"))
    # bf16 weights on a CPU with bf16 matmuls, else float32: a budget between the two forms' needs in either
    # planned for windows of 4,096 tokens (the pieces are the calibration's 32): where the model form outweighs
    # the streamed one's held-out hidden states
    needs = {form: [refine_module.model_bytes(config, form, 4096, dtype)[0] for dtype in (torch.bfloat16, torch.float32)]
             for form in refine_module.FORMS}
    assert max(needs["streamed"]) < min(needs["model"])
    budget = (max(needs["streamed"]) + min(needs["model"])) / 2 / 2**30
    said = []
    refined = refine_module.refine_artifact(artifact, resolve_model(common["model"]), Settings(**common),
                                            artifact.select(), RefineSettings(tokens=64, seqlen=4096, memory_budget=budget,
                                                                              no_progress=True), said.append)
    assert any(line.endswith("the streamed form, one layer in memory") for line in said)
    assert refined.report["refine"]["form"] == "streamed"
    # what the estimate counts for the maps is what the artifact holds (float32), its past-token lags included
    layer_type, maps = refine_module.artifact_maps(artifact, artifact.select())
    held = sum(np.asarray(t, dtype=np.float32).nbytes for m in maps.values() for t in m.tensors().values())
    assert refine_module.map_bytes(config, len(maps), 2) == held > 0
    assert refine_module.map_bytes(config, len(maps)) == sum(np.asarray(artifact.linear(k)[0]).nbytes +
                                                             np.asarray(artifact.linear(k)[1]).nbytes for k in maps)
    streamed = {n: refine_module.model_bytes(config, "streamed", 16, torch.float32, n * held, 64)
                for n in (0, 1)}
    assert streamed[1][0] - streamed[0][0] == refine_module.MAP_COPIES["streamed"] * held
    assert "copies of the maps" in streamed[1][1] and "hidden states" in streamed[1][1]
    assert refined.report["refine"]["settings"]["form"] == "streamed"
    assert refined.report["refine"]["settings"]["balance"] is False


def test_refine_options_are_checked_before_calibrating(checkpoint, capsys):
    common = ["--model", checkpoint / "model", "--dataset", checkpoint / "data.jsonl", "--no-progress", "--nsamples", 8,
              "--seqlen", 32, "-o", checkpoint / "never"]
    with pytest.raises(NblError, match="--refine tunes the maps of attn-nbl layers; --method is attn-drop"):
        run_calibrate(*common, "--refine", "--method", "attn-drop")
    with pytest.raises(NblError, match="--refine-lr must be a positive number, got -1"):
        run_calibrate(*common, "--refine", "--refine-lr", -1)
    with pytest.raises(NblError, match=r"--refine \(model\) needs about .* GiB are available to it"):
        run_calibrate(*common, "--refine", "--refine-form", "model", "--memory-budget", 1e-6)
    # the default form takes the streamed one there and says so; nor does that fit
    with pytest.raises(NblError, match=r"--refine \(streamed\) needs about .* GiB: one layer and the head's weights"):
        run_calibrate(*common, "--refine", "--memory-budget", 1e-6)
    assert "the streamed form, one layer in memory" in capsys.readouterr().err
    assert not (checkpoint / "never").exists()


def test_convert_refuses_a_refinement_that_would_not_fit_before_it_calibrates(tmp_path, monkeypatch, capsys):
    from nbl_gguf.cli import main
    from nbl_gguf.calibration import calibrate as calibrate_module

    from _convert_helpers import save_tiny_llama

    def no_calibration(*args, **kwargs):
        raise AssertionError("the calibration ran")

    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(calibrate_module, "calibrate", no_calibration)
    model = save_tiny_llama(tmp_path / "model")
    assert main(["convert", "--model", str(model), "--m", "2", "--quant", "f32", "--no-eval", "--no-progress", "--refine",
                 "--refine-form", "model", "--memory-budget", "1e-6", "-o", str(tmp_path / "never.gguf")]) != 0
    assert "--refine (model) needs about" in capsys.readouterr().err
    assert not (tmp_path / "never.gguf").exists()


def test_convert_refuses_what_a_refinement_cannot_serve():
    from nbl_gguf.commands import convert

    with pytest.raises(NblError, match="--runtime stock writes bias-free maps, which are not refined"):
        convert.check_refine(convert.options(refine=True, runtime="stock"), "attn-nbl")
    with pytest.raises(NblError, match="--refine with --kv-budget"):
        convert.check_refine(convert.options(refine=True, kv_budget="40MiB"), "attn-nbl")
    with pytest.raises(NblError, match="--refine-form 'whole'"):
        convert.check_refine(convert.options(refine=True, refine_form="whole"), "attn-nbl")
    convert.check_refine(convert.options(refine=True), "attn-nbl")


def test_convert_refine_writes_the_refined_maps_and_says_so(tmp_path, monkeypatch, capsys):
    """convert --refine end to end: it calibrates, refines the chosen layers, and the GGUF's map tensors
    are the refined maps (not the LMMSE ones), its nbl.calibration records the refinement, the summary
    says so."""
    import json

    import gguf

    from nbl_gguf.cli import main
    from nbl_gguf.calibration.artifact import load_artifact
    from nbl_gguf.gguf import nbl_format
    from nbl_gguf.gguf.from_artifact import taps_maps as file_taps_maps

    from _convert_helpers import save_tiny_llama

    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path / "cache"))
    out, kept = tmp_path / "refined.gguf", tmp_path / "calibration"
    model = save_tiny_llama(tmp_path / "model")  # a tokenizer the pinned converter knows
    # held out from the calibration text alone: on this random model every refinement raises one of the three
    # kinds of the mixed windows a little, so the LMMSE maps would be kept (no_kind_worse) and nothing moves
    one_kind = ["--selection-text", "calibration"]
    assert main(["convert", "--model", str(model), "--nsamples", "8", "--seqlen", "64", "--criterion", "cosine", "--dtype", "fp32", "--m", "2",
                 "--taps", "2", "--quant", "f32", "--no-eval", "--no-progress", "--refine", "--refine-tokens", "128",
                 "--refine-seqlen", "16", "--refine-eval-every", "2", "--refine-lr", "0.1", *one_kind,
                 "--save-calibration", str(kept), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    artifact = load_artifact(kept)
    layers = artifact.report["refine"]["layers"]
    assert artifact.refined_for(layers, 2) and "refined" in printed
    reader = gguf.GGUFReader(out)
    assert [i for i, t in enumerate(nbl_format.read_layer_types(reader)) if t != nbl_format.ATTENTION] == layers
    tensors = {t.name: np.asarray(t.data, dtype=np.float64) for t in reader.tensors}
    refined, lmmse = (file_taps_maps(artifact, layers, 2, flag) for flag in (True, False))
    moved = 0.0
    for layer in layers:
        weight = tensors[nbl_format.NBL_WEIGHT.format(layer=layer)].reshape(refined[layer].weight.shape)
        np.testing.assert_allclose(weight, refined[layer].weight, rtol=1e-6, atol=1e-7)
        bias = tensors[nbl_format.NBL_BIAS.format(layer=layer)]
        np.testing.assert_allclose(bias, refined[layer].bias, rtol=1e-6, atol=1e-7)
        for name, pattern in nbl_format.TAPS_TENSORS.items():  # the past-token part, in whichever form it has
            want = getattr(refined[layer], name)
            assert (want is None) == (pattern.format(layer=layer) not in tensors), name
            if want is not None:
                got = tensors[pattern.format(layer=layer)].reshape(want.shape)
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        moved = max(moved, float(np.abs(refined[layer].weight - lmmse[layer].weight).max()))
    assert moved > 1e-4  # the refinement moved the maps: the file could tell them apart
    record = json.loads(str(reader.fields[nbl_format.CALIBRATION_KEY].contents()))
    assert record["refine"]["layers"] == layers
    # per-token layers from the same past-token calibration: the per-token maps are refined (a refinement of
    # the past-token maps would leave the file's maps at LMMSE while the record said refined); without --refine,
    # as convert refines by default
    per_token = tmp_path / "per-token.gguf"
    per_token_options = ["--model", str(model), "--calibration", str(kept), "--criterion", "cosine", "--m", "2",
                         "--taps", "1", "--quant", "f32", "--no-eval", "--no-progress", "--refine-tokens", "128",
                         "--refine-seqlen", "16", "--refine-eval-every", "2", "--refine-lr", "0.1", *one_kind]
    assert main(["convert", *per_token_options, "-o", str(per_token)]) == 0
    artifact = load_artifact(kept)
    layers = artifact.report["refine"]["layers"]
    assert artifact.report["refine"]["taps"] == 1 and artifact.refined_for(layers, 1)
    assert not artifact.refined_for(layers, 2)
    reader = gguf.GGUFReader(per_token)
    assert [i for i, t in enumerate(nbl_format.read_layer_types(reader)) if t != nbl_format.ATTENTION] == layers
    assert set(nbl_format.read_layer_types(reader)) == {nbl_format.ATTENTION, nbl_format.LINEAR}
    tensors = {t.name: np.asarray(t.data, dtype=np.float64) for t in reader.tensors}
    moved = 0.0
    for layer in layers:
        (weight, bias), (lmmse_weight, _) = artifact.linear(layer, refined=True), artifact.linear(layer)
        np.testing.assert_allclose(tensors[nbl_format.NBL_WEIGHT.format(layer=layer)].reshape(weight.shape), weight,
                                   rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(tensors[nbl_format.NBL_BIAS.format(layer=layer)], bias, rtol=1e-6, atol=1e-7)
        moved = max(moved, float(np.abs(weight - lmmse_weight).max()))
    assert moved > 1e-4
    assert json.loads(str(reader.fields[nbl_format.CALIBRATION_KEY].contents()))["refine"]["taps"] == 1
    # --no-refine: the LMMSE maps, though the artifact holds refined ones for these layers
    assert main(["convert", *per_token_options, "--no-refine", "-o", str(tmp_path / "lmmse.gguf")]) == 0
    reader = gguf.GGUFReader(tmp_path / "lmmse.gguf")
    tensors = {t.name: np.asarray(t.data, dtype=np.float64) for t in reader.tensors}
    for layer in layers:
        weight, bias = artifact.linear(layer)
        np.testing.assert_allclose(tensors[nbl_format.NBL_WEIGHT.format(layer=layer)].reshape(weight.shape), weight,
                                   rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(tensors[nbl_format.NBL_BIAS.format(layer=layer)], bias, rtol=1e-6, atol=1e-7)
    assert "refine" not in json.loads(str(reader.fields[nbl_format.CALIBRATION_KEY].contents()))
    # past-token maps of another length than the calibration's: nothing to refine, said by name
    with pytest.raises(NblError, match="--taps 3: the calibration in .* has maps of 2 tokens; calibrate with --taps 3"):
        refine_module.artifact_maps(artifact, layers, 3)


def test_a_default_refinement_that_cannot_run_says_why_and_writes_the_lmmse_maps(tmp_path, monkeypatch, capsys):
    """convert without --refine refines by default; where the refinement cannot run (here: the calibration text
    is too short to hold out the windows its early stopping reads, which a fixed --m with cosine never needs)
    the convert says why and writes the LMMSE maps, where --refine stops with that error and writes nothing."""
    import json

    import gguf

    from nbl_gguf.cli import main
    from nbl_gguf.calibration.artifact import load_artifact
    from nbl_gguf.gguf import nbl_format
    from nbl_gguf.gguf.from_artifact import taps_maps as file_taps_maps

    from _convert_helpers import save_tiny_llama

    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path / "cache"))
    model = save_tiny_llama(tmp_path / "model")
    common = ["--model", str(model), "--nsamples", "8", "--seqlen", "64", "--criterion", "cosine", "--dtype", "fp32",
              "--m", "2", "--taps", "2", "--quant", "f32", "--no-eval", "--no-progress", "--refine-tokens", "128",
              "--refine-seqlen", "16", "--selection-text", "calibration", "--selection-windows", "100000"]
    out, kept = tmp_path / "lmmse.gguf", tmp_path / "calibration"
    assert main(["convert", *common, "--save-calibration", str(kept), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "note: the maps are not refined (" in err and "too few to hold out" in err
    artifact = load_artifact(kept)
    assert "refine" not in artifact.report
    reader = gguf.GGUFReader(out)
    layers = [i for i, t in enumerate(nbl_format.read_layer_types(reader)) if t != nbl_format.ATTENTION]
    assert len(layers) == 2
    tensors = {t.name: np.asarray(t.data, dtype=np.float64) for t in reader.tensors}
    written = file_taps_maps(artifact, layers, 2, False)
    for layer in layers:
        lmmse = written[layer]
        np.testing.assert_allclose(tensors[nbl_format.NBL_WEIGHT.format(layer=layer)].reshape(lmmse.weight.shape),
                                   lmmse.weight, rtol=1e-6, atol=1e-7)
    assert "refine" not in json.loads(str(reader.fields[nbl_format.CALIBRATION_KEY].contents()))
    never = tmp_path / "never.gguf"
    assert main(["convert", *common, "--calibration", str(kept), "--refine", "-o", str(never)]) == 2
    assert "too few to hold out" in capsys.readouterr().err and not never.exists()


def test_refine_text_mix_trains_on_each_kind_alike_and_never_on_the_heldout_windows():
    """--refine-text mix: a third of the pieces from each kind, in turn; the docs' and code's pieces are their
    selection parts' windows after the ones the held-out windows took, token for token."""
    from transformers import AutoTokenizer

    from nbl_gguf import models
    from nbl_gguf.calibration.dataset import bundled_selection_windows, build_windows, kind_texts
    from nbl_gguf.calibration.refine import training_pieces_of

    tokenizer = AutoTokenizer.from_pretrained(models.default_model_dir())
    seqlen, piece = 1024, 256
    calib = torch.arange(6 * seqlen).reshape(6, seqlen)  # stands in for the calibration windows
    composition = {"windows": {"calibration": 2, "prose": 1, "code": 1}}
    alone, kinds = training_pieces_of("calibration", calib, piece)
    assert torch.equal(alone, calib.reshape(-1, piece)) and kinds == {"calibration": 24}

    mixed, kinds = training_pieces_of("mix", calib, piece, tokenizer, composition)
    count = kinds["calibration"]
    assert kinds == {"calibration": count, "prose": count, "code": count} and mixed.shape == (3 * count, piece)
    assert torch.equal(mixed[0::3], calib.reshape(-1, piece)[:count])
    heldout, _ = bundled_selection_windows(tokenizer, {"prose": 1, "code": 1}, seqlen)
    for offset, (kind, held) in enumerate(zip(("prose", "code"), heldout), start=1):
        whole = build_windows(tokenizer, kind_texts(kind, "selection"), 1000, seqlen).input_ids
        assert torch.equal(whole[0], held)  # the held-out window is the part's first
        assert torch.equal(mixed[offset::3], whole[1:].reshape(-1, piece)[:count])
    with pytest.raises(NblError, match="--refine-text 'prose'"):
        RefineSettings(text="prose").check()


@pytest.mark.parametrize("seqlen, held", [(12_000, 1), (30_000, 0)])
def test_refine_text_mix_at_a_seqlen_near_the_bundled_parts_length_trains_on_the_rest_of_their_text(seqlen, held):
    """A calibration --seqlen that leaves no whole window of a bundled part after the held-out ones (12,000: one
    held out of a part of about 18K tokens; 30,000: longer than the part): the mix trains on the part's remaining
    tokens, cut into pieces, rather than stopping after the calibration; too little left is refused by name."""
    from transformers import AutoTokenizer

    from nbl_gguf import models
    from nbl_gguf.calibration.dataset import build_windows, kind_texts
    from nbl_gguf.calibration.refine import training_pieces_of

    tokenizer = AutoTokenizer.from_pretrained(models.default_model_dir())
    piece = 512
    calib = torch.arange(4 * seqlen).reshape(4, seqlen)
    composition = {"windows": {"calibration": 1, "prose": held, "code": held}}
    mixed, kinds = training_pieces_of("mix", calib, piece, tokenizer, composition)
    count = kinds["calibration"]
    assert kinds == {"calibration": count, "prose": count, "code": count} and count > 0
    for offset, kind in enumerate(("prose", "code"), start=1):
        # the part's whole token stream, from an independent cut: windows of one token
        stream = build_windows(tokenizer, kind_texts(kind, "selection"), 1 << 20, 1).input_ids.reshape(-1)
        assert stream.numel() < (held + 1) * seqlen  # no whole window left: the case under test
        rest = stream[held * seqlen:]
        assert torch.equal(mixed[offset::3], rest[:rest.numel() // piece * piece].reshape(-1, piece)[:count])
    with pytest.raises(NblError, match="fewer than one training piece of 512"):
        training_pieces_of("mix", calib, piece, tokenizer, {"windows": {"prose": 1000, "code": 0}})


@pytest.mark.parametrize("family", ["qwen2", "phi3", "smollm3", "gemma2", "gemma3_text", "gemma3"])
def test_the_forward_from_the_first_replaced_layer_gives_the_whole_models_logits(family):
    """The model form runs the layers before the first replaced one once (stream.layer_inputs) and each step
    from there on (stream.starting_at): the logits are the whole forward's, with a map in place after that
    layer too, for families whose forward does more than stack layers (soft-capping, sliding masks, NoPE
    layers, a model nested beside a vision tower)."""
    from transformers import AutoTokenizer

    from _family_helpers import random_family_model
    from nbl_gguf import models
    from nbl_gguf.calibration.stream import layer_inputs, starting_at

    tokenizer = AutoTokenizer.from_pretrained(models.default_model_dir())
    model = random_family_model(family, tokenizer).float()
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(2))
    d = models.text_config(model.config).hidden_size
    rng = np.random.default_rng(0)
    apply_nbl(model, {3: ATTN_LINEAR}, {3: ((0.05 * rng.standard_normal((d, d))).astype(np.float32),
                                           (0.05 * rng.standard_normal(d)).astype(np.float32))})
    inputs = layer_inputs(model, 2, ids)
    assert inputs.shape == (2, 24, d)
    with torch.no_grad():
        whole = model(input_ids=ids, use_cache=False).logits
        for i in range(2):
            with starting_at(model, 2, inputs[i:i + 1]):
                part = model(input_ids=ids[i:i + 1], use_cache=False).logits
            torch.testing.assert_close(part, whole[i:i + 1], rtol=1e-5, atol=1e-5)
    # the layers are the model's own again afterwards
    assert all(type(layer).__name__.endswith("DecoderLayer") for layer in models.decoder_layers(model))


def test_balance_scales_each_kinds_loss_to_the_same_size():
    """--refine-balance: pieces of two kinds whose losses differ tenfold weigh the same once each kind's
    running mean has settled (the resume test above runs it inside a refinement)."""
    from nbl_gguf.calibration.refine import balance_weight

    running = {}
    weighted = {"code": [], "c4": []}
    for step in range(200):
        kind, value = ("code", 1.0) if step % 2 else ("c4", 0.1)
        weighted[kind].append(value * balance_weight(running, kind, value))
    assert running == pytest.approx({"code": 1.0, "c4": 0.1})
    assert weighted["code"][-1] == pytest.approx(weighted["c4"][-1]) == pytest.approx(0.55)
    assert balance_weight({}, "only", 0.3) == pytest.approx(1.0)  # one kind: unscaled
    with pytest.raises(NblError, match="--refine-balance .* --refine-form streamed"):
        RefineSettings(form="streamed", balance=True).check()
