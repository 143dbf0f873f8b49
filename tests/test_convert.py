"""convert / inspect / hf_to_gguf / quantize on a tiny random HF Llama (CPU, tens of seconds).

The tiny model carries the embedded SmolLM2 tokenizer, which the pinned converter recognizes.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from _convert_helpers import calibrate_for_convert, convert_args, save_tiny_llama
from nbl_gguf import cli
from nbl_gguf.gguf import nbl_format
from nbl_gguf.errors import NblError
from nbl_gguf.llamacpp.tools import bin_dir, source_dir

needs_converter = pytest.mark.skipif(not (source_dir() / "convert_hf_to_gguf.py").is_file(),
                                     reason="pinned llama.cpp source not unpacked (scripts/build_llama.sh)")
needs_quantize = pytest.mark.skipif(not (bin_dir() / "llama-quantize").is_file(),
                                    reason="patched llama-quantize not built (scripts/build_llama.sh)")

N_LAYER = 4


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    """A tiny random LlamaForCausalLM (4 layers, d=64) with the SmolLM2 tokenizer, saved as a HF folder."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-hf") / "tiny-llama", N_LAYER)


@pytest.fixture(scope="module")
def tiny_artifact(tiny_hf, tmp_path_factory) -> Path:

    out = tmp_path_factory.mktemp("calib") / "artifact"
    return calibrate_for_convert(out, tiny_hf, convert_args(model=str(tiny_hf), m=2))


def listing(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


# --- hf_to_gguf ----------------------------------------------------------------------------------

@needs_converter
def test_stock_conversion_by_pinned_converter(tiny_hf, tmp_path, monkeypatch):
    import os

    import gguf

    from nbl_gguf.gguf.hf_to_gguf import convert_hf_to_gguf

    # relative paths work although the converter runs in its own directory
    monkeypatch.chdir(tmp_path)
    out = convert_hf_to_gguf(os.path.relpath(tiny_hf, tmp_path), "stock.gguf", "f16")
    assert out == Path("stock.gguf") and out.is_file()
    reader = gguf.GGUFReader(out)
    assert str(reader.fields["general.architecture"].contents()) == "llama"
    assert int(reader.fields["llama.block_count"].contents()) == N_LAYER
    assert str(reader.fields["tokenizer.ggml.pre"].contents()) == "smollm"  # the converter's tokenizer handling
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == "F16" and types["blk.0.attn_norm.weight"] == "F32"
    assert nbl_format.read_layer_types(reader) is None
    assert listing(tmp_path) == {"stock.gguf"}


def test_hf_to_gguf_rejects_non_model_folders(tmp_path):
    from nbl_gguf.gguf.hf_to_gguf import convert_hf_to_gguf

    with pytest.raises(NblError, match="does not exist"):
        convert_hf_to_gguf(tmp_path / "missing", tmp_path / "x.gguf")
    with pytest.raises(NblError, match="no config.json"):
        convert_hf_to_gguf(tmp_path, tmp_path / "x.gguf")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(NblError, match="no \\*.safetensors"):
        convert_hf_to_gguf(tmp_path, tmp_path / "x.gguf")
    with pytest.raises(NblError, match="outtype"):
        convert_hf_to_gguf(tmp_path, tmp_path / "x.gguf", "q4_k_m")


@needs_converter
def test_hf_to_gguf_converter_failure_is_a_clear_error(tmp_path):
    from nbl_gguf.gguf.hf_to_gguf import convert_hf_to_gguf

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"]}))
    (tmp_path / "model.safetensors").write_bytes(b"not really")
    with pytest.raises(NblError, match="converter failed"):
        convert_hf_to_gguf(tmp_path, tmp_path / "out" / "x.gguf")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# --- quantize ------------------------------------------------------------------------------------

@needs_quantize
def test_quant_types_from_llama_quantize():
    from nbl_gguf.gguf.quantize import normalize_quant, quant_types

    types = quant_types()
    assert {"Q4_K_M", "Q5_K_M", "Q8_0", "F16", "IQ4_XS"} <= set(types)
    assert normalize_quant("q4_k_m") == "Q4_K_M"
    with pytest.raises(NblError, match="unknown quantization type 'q9_z'.*q4_k_m"):
        normalize_quant("q9_z")


@needs_quantize
def test_quantize_nbl_gguf(tmp_path):
    import gguf

    from nbl_gguf.gguf.quantize import quantize
    from nbl_gguf.fixtures.tiny import TinyLlama

    # rows of 256 so that k-quants apply to every matrix
    model = TinyLlama(n_layer=3, n_embd=256, n_head=4, n_head_kv=2, n_ff=512)
    src = model.write_nbl_gguf(tmp_path / "nbl-f32.gguf", [0, 1, 2], model.random_linear([1]))
    out = quantize(src, tmp_path / "nbl-q8.gguf", "q8_0")
    reader = gguf.GGUFReader(out)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.1.attn_nbl.weight"] == "Q8_0"
    assert types["blk.1.attn_nbl.bias"] == "F32"
    assert nbl_format.read_layer_types(reader) == [0, 1, 2]
    assert listing(tmp_path) == {"nbl-f32.gguf", "nbl-q8.gguf"}


# --- convert -------------------------------------------------------------------------------------

@needs_quantize
@needs_converter
@pytest.mark.slow
def test_convert_end_to_end_is_deterministic(tiny_hf, tmp_path):
    """Calibrate + convert + rewrite + imatrix + q4_k_m, twice: byte-identical, no leftovers."""
    import gguf

    from nbl_gguf.commands.convert import convert

    outputs = []
    for run in ("a", "b"):
        out_dir = tmp_path / run
        out_dir.mkdir()
        summary = convert(convert_args(model=str(tiny_hf), m=2, quant="Q4_K_M", imatrix=True, imatrix_chunks=2,
                                       seed=3, output=str(out_dir / "tiny-nbl.gguf")))
        assert listing(out_dir) == {"tiny-nbl.gguf"}  # no temp dir, no partial files
        outputs.append(out_dir / "tiny-nbl.gguf")
    assert outputs[0].read_bytes() == outputs[1].read_bytes()

    assert summary.n_layer == N_LAYER and len(summary.replaced) == 2
    # at 4096 (the summary's context; the tiny model's training context is shorter): every layer caches
    # 4096 cells of 2 KV heads x 16 dims, K and V, F16
    stock, nbl = summary.kv[4096]
    assert list(summary.kv) == [4096]
    assert nbl.bytes * 2 == stock.bytes == N_LAYER * 4096 * 2 * 2 * 16 * 2
    assert summary.stock_bytes > summary.nbl_bytes > 0
    table = summary.table()
    assert "KV cache at 4,096 tokens (F16) 2.00 MiB 1.00 MiB -50.0%" in [" ".join(row.split()) for row in table.splitlines()]

    # every stage's time and peak memory, the calibration's own stages in it, the tools' peaks apart
    from nbl_gguf.commands.convert_summary import resources_table

    stages = summary.resources
    assert list(stages)[:2] == ["calibrate", "calibrate: load_model"] and "calibrate: layers" in stages
    assert {"stock conversion", "imatrix", "quantize stock", "NBL surgery"} <= set(stages)
    assert all(r["wall_s"] >= 0 and r["peak_rss_bytes"] > 50 << 20 for r in stages.values())
    assert stages["calibrate: layers"]["wall_s"] > 0 and stages["quantize stock"]["wall_s"] > 0
    assert stages["calibrate"]["peak_rss_bytes"] >= stages["calibrate: layers"]["peak_rss_bytes"]
    assert stages["calibrate"]["wall_s"] >= stages["calibrate: layers"]["wall_s"]
    assert set(stages["quantize stock"]["tools_peak_rss_bytes"]) == {"llama-quantize"}
    assert set(stages["stock conversion"]["tools_peak_rss_bytes"]) == {"convert_hf_to_gguf.py"}
    assert stages["imatrix"]["tools_peak_rss_bytes"]["llama-imatrix"] > 1 << 20
    rendered = resources_table(stages)
    assert all(name in rendered for name in stages)

    reader = gguf.GGUFReader(outputs[0])
    types = nbl_format.read_layer_types(reader)
    assert [i for i, t in enumerate(types) if t == nbl_format.LINEAR] == summary.replaced
    assert str(reader.fields[nbl_format.METHOD_KEY].contents()) == "attn-nbl"
    calibration = json.loads(str(reader.fields[nbl_format.CALIBRATION_KEY].contents()))
    assert calibration["seed"] == 3 and calibration["nsamples"] == 8 and calibration["seqlen"] == 64
    assert int(reader.fields["general.file_type"].contents()) == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    assert "quantize.imatrix.file" in reader.fields
    names = {t.name for t in reader.tensors}
    for layer in summary.replaced:
        assert f"blk.{layer}.attn_nbl.weight" in names and f"blk.{layer}.attn_q.weight" not in names
    # W as the stock file's attn_output: q4_k_m's Q4_K cannot hold rows of 64, llama-quantize's Q5_0 can
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    kept = next(i for i in range(N_LAYER) if i not in summary.replaced)
    assert types[f"blk.{kept}.attn_output.weight"] == "Q5_0"
    assert {types[f"blk.{layer}.attn_nbl.weight"] for layer in summary.replaced} == {"Q5_0"}
    assert f"NBL weights: Q5_0 in layers {', '.join(map(str, summary.replaced))} (their attn_output's type)" in table


@needs_converter
def test_convert_reuses_calibration_attn_drop_f16(tiny_hf, tiny_artifact, tmp_path, capsys):
    import gguf

    from nbl_gguf.calibration.artifact import load_artifact

    out = tmp_path / "drop.gguf"
    code = cli.main(["convert", "--model", str(tiny_hf), "--calibration", str(tiny_artifact), "--m", "1",
                     "--method", "attn-drop", "--criterion", "nmse", "--quant", "f16", "--no-progress", "--no-eval",
                     "-o", str(out)])
    assert code == 0
    stdout = capsys.readouterr().out
    assert "attn-drop by nmse, 1 of 4 layers replaced" in stdout
    artifact = load_artifact(tiny_artifact)
    dropped = artifact.select(1, "nmse", "attn-drop")
    reader = gguf.GGUFReader(out)
    assert nbl_format.read_layer_types(reader) == [2 if i in dropped else 0 for i in range(N_LAYER)]
    assert not any(t.name.startswith(f"blk.{dropped[0]}.attn_") and "norm" not in t.name for t in reader.tensors)
    scores = list(reader.fields[nbl_format.SCORES_KEY].contents())
    np.testing.assert_allclose(scores, artifact.scores("nmse"), rtol=1e-6)
    assert {t.tensor_type.name for t in reader.tensors if t.name.endswith("attn_q.weight")} == {"F16"}
    assert listing(tmp_path) == {"drop.gguf"}

    # inspect shows the same map
    assert cli.main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "1 of 4 attention layers replaced (0 linear, 1 dropped)" in text
    assert "method:        attn-drop    criterion: nmse" in text
    assert f"{dropped[0]:5d}  dropped" in text
    # the tiny model's training context, 256 tokens: 256 cells of 2 KV heads x 16 dims, K and V, F16, per layer
    assert "KV cache:      96.00 KiB at 256 tokens (training context) vs stock 128.00 KiB (-25.0%)" in text
    assert "384 bytes per token vs stock 512" in text
    # the dropped layer's row: its score, then the 256 cells x 128 bytes its cache would hold
    assert re.search(rf"^ +{dropped[0]}  dropped +[\d.]+ +freed 32\.00 KiB  -", text, re.M)
    assert cli.main(["inspect", "--json", str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["replaced"] == {"linear": 0, "dropped": 1, "taps": 0}
    assert info["layers"][dropped[0]]["type"] == "dropped" and info["calibration"]["nsamples"] == 8
    assert info["kv_bytes_per_token"] == {"stock": 512, "file": 384}


@needs_converter
def test_convert_records_the_default_criterion_and_the_auto_choice(tiny_hf, tmp_path, capsys):
    """With no --criterion the layers are those of the local criterion that costs least on the held-out
    windows, and the GGUF says so (nbl.criterion best, the comparison in the provenance); with --m auto
    the provenance carries the held-out losses that chose m."""
    import gguf

    from nbl_gguf.calibration.artifact import DEFAULT_CRITERION, load_artifact

    common = ["--model", str(tiny_hf), "--nsamples", "8", "--seqlen", "64", "--device", "cpu", "--quant", "f16",
              "--no-progress", "--no-eval"]
    out = tmp_path / "default.gguf"
    assert cli.main(["convert", *common, "--m", "1", "--save-calibration", str(tmp_path / "cal"), "-o", str(out)]) == 0
    reader = gguf.GGUFReader(out)
    assert DEFAULT_CRITERION == "best" and reader.fields[nbl_format.CRITERION_KEY].contents() == "best"
    artifact = load_artifact(tmp_path / "cal")
    best = artifact.report["selection"]["chosen"]
    assert [i for i, t in enumerate(nbl_format.read_layer_types(reader)) if t] == [int(np.argmin(artifact.scores(best)))]
    provenance = json.loads(reader.fields[nbl_format.CALIBRATION_KEY].contents())
    assert provenance["selection"]["heldout"]["compared"][best]["layers"] == artifact.select()
    # the scores recorded are those of the criterion best chose, and the file says which
    assert reader.fields[nbl_format.SCORES_CRITERION_KEY].contents() == best
    np.testing.assert_allclose(list(reader.fields[nbl_format.SCORES_KEY].contents()), artifact.scores(best), rtol=1e-6)
    capsys.readouterr()
    assert cli.main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"scores:        {best} (the criterion that best chose)" in text
    for layer, score in enumerate(artifact.scores(best)):
        # the default --taps (auto) gives a llama model taps layers
        assert f"\n{layer:5d}  {'taps' if layer in artifact.select() else 'attention':<9s}  {score:<8.4f}  " in text
    heldout = artifact.report["selection"]["heldout"]
    for criterion, compared in heldout["compared"].items():
        layers = ", ".join(map(str, compared["layers"]))
        assert f"{criterion:<6s}  {compared['ppl_increase_pct']:+7.1f}%  layers {layers}" in text
    assert f"layers {', '.join(map(str, artifact.select()))}  <- chosen" in text
    assert f"held-out perplexity on {heldout['heldout_tokens']:,} tokens (unmodified {heldout['base_ppl']:.3f})" in text
    versions = provenance["versions"]
    assert f"torch {versions['torch']}" in text and f"llama.cpp {versions['llama.cpp'][:7]} + patches" in text
    assert f"{provenance['tokens']:,} tokens: 8 windows of 64 from {provenance['documents']} documents" in text
    # convert refines by default: the file's record says what moved, as the calibration's summary does
    from nbl_gguf.calibration.report import describe_refine

    assert provenance["refine"]["layers"] == artifact.select()
    assert "refine     " + describe_refine(provenance["refine"])[:60] in text
    assert "{" not in text  # no raw JSON left
    # --json: the whole record, the calibration key as the file holds it
    assert cli.main(["inspect", "--json", str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["calibration"] == provenance and info["scores_criterion"] == best
    assert [layer["score"] for layer in info["layers"]] == pytest.approx(list(artifact.scores(best)), rel=1e-6)
    assert [t["name"] for t in info["tensors"]] == [t.name for t in reader.tensors]

    # another m from that calibration: best measured at that m on its held-out windows (not a prefix of its m = 1
    # choice), recorded in the artifact, said in the file, and read back by a second conversion
    out = tmp_path / "m2.gguf"
    assert cli.main(["convert", *common, "--m", "2", "--calibration", str(tmp_path / "cal"), "-o", str(out)]) == 0
    assert "best: attn-nbl m = 2 with 4-token maps" in capsys.readouterr().err
    measured = load_artifact(tmp_path / "cal").measured_best(2)
    compared = measured["heldout"]["compared"]
    assert measured["chosen"] == min(compared, key=lambda c: (compared[c]["ppl_increase_pct"], list(compared).index(c)))
    reader = gguf.GGUFReader(out)
    assert [i for i, t in enumerate(nbl_format.read_layer_types(reader)) if t] == measured["layers"]
    provenance = json.loads(reader.fields[nbl_format.CALIBRATION_KEY].contents())
    assert provenance["selection"]["measured_after_calibration"] and provenance["selection"]["m"] == 2
    assert provenance["selection"]["heldout"] == measured["heldout"]
    assert reader.fields[nbl_format.SCORES_CRITERION_KEY].contents() == measured["chosen"]
    assert cli.main(["inspect", str(out)]) == 0
    assert "attn-nbl by best, m = 2 (measured at this m from the calibration)" in capsys.readouterr().out
    assert cli.main(["convert", *common, "--m", "2", "--calibration", str(tmp_path / "cal"), "-o",
                     str(tmp_path / "m2-again.gguf")]) == 0
    assert "best: attn-nbl" not in capsys.readouterr().err
    assert (tmp_path / "m2-again.gguf").read_bytes() == out.read_bytes()

    out = tmp_path / "auto.gguf"
    assert cli.main(["convert", *common, "--m", "auto", "--max-ppl-increase", "1e9", "--selection-windows", "20",
                     "--save-calibration", str(tmp_path / "auto-cal"), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    provenance = json.loads(gguf.GGUFReader(out).fields[nbl_format.CALIBRATION_KEY].contents())
    chosen = load_artifact(tmp_path / "auto-cal").report["selection"]
    assert provenance["selection"]["max_ppl_increase"] == 1e9 and provenance["selection"]["heldout"] == chosen["heldout"]
    assert chosen["m"] == N_LAYER - 1 and f"attn-taps by best, {N_LAYER - 1} of {N_LAYER} layers replaced" in printed
    # reusing that artifact with --m auto takes its choice; an artifact made for a fixed m is refused
    assert cli.main(["convert", *common, "--m", "auto", "--calibration", str(tmp_path / "auto-cal"),
                     "-o", str(tmp_path / "again.gguf")]) == 0
    assert cli.main(["convert", *common, "--m", "auto", "--calibration", str(tmp_path / "cal"),
                     "-o", str(tmp_path / "refused.gguf")]) == 2
    assert "--m auto is decided while calibrating" in capsys.readouterr().err
    assert not (tmp_path / "refused.gguf").exists()


@needs_converter
def test_convert_failure_leaves_nothing(tiny_hf, tiny_artifact, tmp_path, monkeypatch):
    """A failure (here: an interrupt while the NBL tensors are written) leaves no GGUF and no temp files."""
    import gguf

    from nbl_gguf.commands.convert import convert

    calls = {"n": 0}
    original = gguf.GGUFWriter.write_tensor_data

    def interrupted(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", interrupted)
    out = tmp_path / "out" / "model.gguf"
    (tmp_path / "out").mkdir()
    with pytest.raises(KeyboardInterrupt):
        convert(convert_args(model=str(tiny_hf), calibration=str(tiny_artifact), m=2, quant="f32", output=str(out)))
    assert calls["n"] == 5
    assert listing(tmp_path / "out") == set()


@needs_quantize
@needs_converter
def test_convert_quantize_failure_leaves_nothing(tiny_hf, tiny_artifact, tmp_path, monkeypatch):
    from nbl_gguf.gguf import quantize as quantize_module
    from nbl_gguf.commands.convert import convert

    real = quantize_module.run_tool
    calls = []

    def failing(name, args, **kwargs):
        calls.append(name)
        if name == "llama-quantize":  # the stock file's quantization, half-written
            Path(args[-2]).write_bytes(b"partial")
            raise NblError("llama-quantize failed (exit 1): simulated")
        return real(name, args, **kwargs)

    monkeypatch.setattr(quantize_module, "run_tool", failing)
    out = tmp_path / "model.gguf"
    with pytest.raises(NblError, match="simulated"):
        convert(convert_args(model=str(tiny_hf), calibration=str(tiny_artifact), m=2, quant="q8_0", output=str(out)))
    assert calls == ["llama-quantize"] and listing(tmp_path) == set()


def test_convert_bad_inputs(tiny_hf, tmp_path, capsys):
    def fails(*argv) -> str:
        assert cli.main(["convert", "--no-progress", "-o", str(tmp_path / "x.gguf"), *argv]) == 2
        return capsys.readouterr().err

    assert "block-level NBL is evaluated in PyTorch only" in fails("--model", str(tiny_hf), "--method", "block-nbl")
    assert "unknown --method 'attn-foo'" in fails("--model", str(tiny_hf), "--method", "attn-foo")
    if (bin_dir() / "llama-quantize").is_file():
        assert "unknown quantization type 'q4_k_z'" in fails("--model", str(tiny_hf), "--quant", "q4_k_z")
    assert "--m 9 is out of range: tiny-llama has 4 layers" in fails("--model", str(tiny_hf), "--m", "9", "--quant", "f16")
    assert "no such folder" in fails("--model", str(tmp_path / "nowhere"), "--quant", "f16")
    assert "no config.json" in fails("--model", str(tmp_path), "--quant", "f16")
    assert "no such artifact" in fails("--model", str(tiny_hf), "--calibration", str(tmp_path / "none"), "--quant", "f16")
    assert "must end in .gguf" in fails("--model", str(tiny_hf), "--quant", "f16", "-o", str(tmp_path / "x.bin"))
    assert not (tmp_path / "x.gguf").exists()


@needs_converter
def test_convert_rejects_calibration_of_another_model(tiny_hf, tiny_artifact, tmp_path):
    from nbl_gguf.commands.convert import convert

    other = tmp_path / "other"
    shutil.copytree(tiny_hf, other)
    config = json.loads((other / "config.json").read_text())
    config["num_hidden_layers"] = N_LAYER + 1
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(NblError, match="calibration has 4 layers"):
        convert(convert_args(model=str(other), calibration=str(tiny_artifact), m=1, quant="f16",
                             output=str(tmp_path / "x.gguf")))
    assert not (tmp_path / "x.gguf").exists()


# --- inspect -------------------------------------------------------------------------------------

def test_recorded_scores_follow_the_selection(tiny_artifact):
    from nbl_gguf.calibration.artifact import load_artifact
    from nbl_gguf.gguf.from_artifact import recorded_scores

    artifact = load_artifact(tiny_artifact)
    for criterion in ("cca", "nmse", "cosine"):
        scores, under = recorded_scores(artifact, criterion)
        assert under == criterion and scores == pytest.approx(list(artifact.scores(criterion)))
    assert recorded_scores(artifact, "greedy") == (None, None)  # no per-layer score
    artifact.report["selection"]["chosen"] = "nmse"  # what a best calibration records
    assert recorded_scores(artifact, "best") == (pytest.approx(list(artifact.scores("nmse"))), "nmse")


def test_inspect_stock_and_nbl_tiny_gguf(tmp_path, capsys):
    from nbl_gguf.gguf.inspect import describe
    from nbl_gguf.fixtures.tiny import TinyLlama

    model = TinyLlama(n_layer=3, n_embd=64, n_head=4, n_head_kv=2)
    stock = model.write_gguf(tmp_path / "stock.gguf")
    info = describe(stock)
    assert not info["nbl"] and info["attention_layers"] == 3
    kv = 3 * 2 * 2 * 16 * 2
    assert info["kv_bytes_per_token"] == {"stock": kv, "file": kv}
    assert cli.main(["inspect", str(stock)]) == 0
    text = capsys.readouterr().out
    assert "stock GGUF: every layer keeps its attention" in text
    assert "attn_k:F32 attn_output:F32 attn_q:F32 attn_v:F32" in text

    nbl = tmp_path / "nbl.gguf"
    nbl_format.write_nbl_gguf(stock, nbl, nbl_format.NblLayers(
        types=[1, 0, 2], linear=model.random_linear([0]), method="attn-nbl", criterion="cca",
        scores=[0.1, 0.5, 0.2], calibration={"model": "tiny", "seed": 7}))
    info = describe(nbl)
    assert [layer["type"] for layer in info["layers"]] == ["linear", "attention", "dropped"]
    assert info["layers"][0]["tensors"]["attn_nbl.weight"] == "F32"
    assert "attn_q.weight" not in info["layers"][0]["tensors"]
    assert info["kv_bytes_per_token"] == {"stock": kv, "file": kv // 3}
    assert info["calibration"] == {"model": "tiny", "seed": 7}
    assert cli.main(["inspect", "--tensors", str(nbl)]) == 0
    text = capsys.readouterr().out
    assert "2 of 3 attention layers replaced (1 linear, 1 dropped)" in text
    rows = [" ".join(line.split()) for line in text.splitlines()]
    # each layer's cache at the training context, 4096: 4096 cells x 2 KV heads x 16 dims x K, V x F16
    assert "0 linear 0.1000 freed 512.00 KiB attn_nbl:F32 attn_nbl.bias:F32 (+5 F32)" in rows
    assert "1 attention 0.5000 512.00 KiB attn_k:F32 attn_output:F32 attn_q:F32 attn_v:F32 (+5 F32)" in rows
    assert "2 dropped 0.2000 freed 512.00 KiB - (+5 F32)" in rows
    assert "calibration:   model      tiny\n" in text and "               seed       7\n" in text
    assert "scores:        cca (the criterion that chose the layers)" in text and "blk.0.attn_nbl.weight" in text
    assert cli.main(["inspect", str(stock)]) == 0
    assert "score" not in capsys.readouterr().out  # a stock file has no score column

    # greedy records no per-layer score, and says so instead of an empty column
    greedy = tmp_path / "greedy.gguf"
    nbl_format.write_nbl_gguf(stock, greedy, nbl_format.NblLayers(
        types=[1, 0, 0], linear=model.random_linear([0]), method="attn-nbl", criterion="greedy",
        calibration={"selection": {"method": "attn-nbl", "criterion": "greedy", "m": 1, "heldout": {
            "heldout_tokens": 4096, "base_ppl": 12.5, "order": [0], "ppl_increase_pct": [3.5], "stopped": ""}}}))
    assert cli.main(["inspect", str(greedy)]) == 0
    text = capsys.readouterr().out
    assert "scores:        none per layer: greedy chose the layers by the held-out perplexity" in text
    assert "attn-nbl by greedy, m = 1: held-out perplexity on 4,096 tokens (unmodified 12.500)" in text
    assert "+layer 0 +3.5%" in text
    assert "0 linear freed 512.00 KiB attn_nbl:F32 attn_nbl.bias:F32 (+5 F32)" in [" ".join(line.split())
                                                                                for line in text.splitlines()]


def test_inspect_errors(tmp_path, capsys):
    assert cli.main(["inspect", str(tmp_path / "missing.gguf")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "text.gguf").write_text("hello, not a gguf")
    assert cli.main(["inspect", str(tmp_path / "text.gguf")]) == 2
    assert "is not a GGUF file" in capsys.readouterr().err
    (tmp_path / "cut.gguf").write_bytes(b"GGUF\x03\x00\x00\x00\x05")
    assert cli.main(["inspect", str(tmp_path / "cut.gguf")]) == 2
    error = capsys.readouterr().err
    assert "cut.gguf is truncated" in error and "at byte 8" in error  # the tensor count is cut


def test_inspect_does_not_import_torch(tmp_path):
    import subprocess
    import sys

    from nbl_gguf.fixtures.tiny import TinyLlama

    path = TinyLlama(n_layer=2).write_gguf(tmp_path / "stock.gguf")
    code = ("import sys; from nbl_gguf import cli; cli.main(['inspect', sys.argv[1]]); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    root = Path(__file__).resolve().parent.parent
    completed = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=root)
    assert completed.returncode == 0, completed.stderr


def test_the_stock_conversion_keeps_a_16_bit_checkpoint_in_16_bits(tmp_path):
    """--intermediate defaults to the checkpoint's own float type (lossless, half the bytes of f32)."""
    import torch

    from _calibrate_helpers import tiny_model
    from nbl_gguf.gguf.hf_to_gguf import default_intermediate

    model = tiny_model(layers=1)
    for dtype, expected in ((torch.float16, "f16"), (torch.bfloat16, "bf16"), (torch.float32, "f32")):
        model.to(dtype).save_pretrained(tmp_path / expected)
        assert default_intermediate(tmp_path / expected) == expected
    mixed = tmp_path / "mixed"  # one tensor in another type: f32 loses nothing of either
    model.to(torch.float16).save_pretrained(mixed)
    from safetensors.torch import save_file

    save_file({"extra": torch.zeros(2, dtype=torch.float32)}, str(mixed / "extra.safetensors"))
    assert default_intermediate(mixed) == "f32"


def test_convert_refuses_a_disk_too_small_for_the_intermediate_files(tiny_hf, tmp_path, monkeypatch):
    """The stock conversion (here f32, the checkpoint's type) and its quantized copy (at most 8.5 bits a
    weight), or for a float output the stock and NBL files, must fit side by side in -o's folder: less
    free space is an error before the calibration, naming what is needed and where."""
    import collections

    from safetensors import safe_open

    from nbl_gguf.commands.convert import convert
    from nbl_gguf.gguf import hf_to_gguf

    elements = 0
    for path in tiny_hf.glob("*.safetensors"):
        with safe_open(str(path), framework="numpy") as handle:
            elements += sum(handle.get_tensor(name).size for name in handle.keys())
    needed = 4 * elements + int(elements * 8.5 / 8)
    assert hf_to_gguf.check_conversion_space(tiny_hf, "f32", tmp_path) == needed
    assert hf_to_gguf.check_conversion_space(tiny_hf, "bf16", tmp_path) == 2 * elements + int(elements * 8.5 / 8)
    assert hf_to_gguf.check_conversion_space(tiny_hf, "f16", tmp_path, quantized=False) == 2 * 2 * elements

    usage = collections.namedtuple("usage", "total used free")
    free = {"bytes": needed - 1}
    monkeypatch.setattr(hf_to_gguf.shutil, "disk_usage", lambda folder: usage(10 * needed, 0, free["bytes"]))
    out = tmp_path / "out" / "model.gguf"
    (tmp_path / "out").mkdir()
    with pytest.raises(NblError, match=rf"converting {tiny_hf.name} needs at least \d+\.\d GiB free in "
                                       rf"{re.escape(str(out.parent))} for the stock file in f32 and its quantized copy"):
        convert(convert_args(model=str(tiny_hf), m=2, quant="q8_0", output=str(out)))
    assert listing(tmp_path / "out") == set()
    free["bytes"] = needed
    assert hf_to_gguf.check_conversion_space(tiny_hf, "f32", out.parent) == needed


@needs_converter
@needs_quantize
def test_convert_cuts_the_nbl_file_from_a_given_stock_file(tiny_hf, tiny_artifact, tmp_path, capsys):
    """--stock-gguf: the NBL file from the stock file given equals the one from convert's own conversion,
    with no conversion made; a file of another type or shape, or beside an option that would make it
    another way, is refused by name."""
    from nbl_gguf.commands.convert import convert
    from nbl_gguf.commands.model_files import stock_ladder

    ladder = stock_ladder(tiny_hf, ["Q4_K_M", "Q8_0"], tmp_path, None, lambda text: None)
    common = dict(model=str(tiny_hf), calibration=str(tiny_artifact), m=2, quant="Q4_K_M")
    own = convert(convert_args(**common, output=str(tmp_path / "own.gguf")))
    given = convert(convert_args(**common, stock_gguf=str(ladder["Q4_K_M"]), output=str(tmp_path / "given.gguf")))
    assert (tmp_path / "own.gguf").read_bytes() == (tmp_path / "given.gguf").read_bytes()
    assert "stock conversion" in own.resources and not {"stock conversion", "quantize stock"} & set(given.resources)
    assert ladder["Q4_K_M"].is_file()  # the given file is not consumed

    def fails(*argv) -> str:
        assert cli.main(["convert", "--no-progress", "--no-eval", "--model", str(tiny_hf), "--calibration",
                         str(tiny_artifact), "--m", "2", "-o", str(tmp_path / "x.gguf"), *argv]) == 2
        return capsys.readouterr().err

    assert f"--stock-gguf {ladder['Q8_0']} is not tiny-llama at Q4_K_M: type Q8_0 (the model's: Q4_K_M)" in \
        fails("--quant", "q4_k_m", "--stock-gguf", str(ladder["Q8_0"]))
    assert "--stock-gguf and --imatrix" in fails("--stock-gguf", str(ladder["Q4_K_M"]), "--imatrix")
    assert "no such file" in fails("--stock-gguf", str(tmp_path / "none.gguf"))
    (tmp_path / "text.gguf").write_text("not a model")
    assert f"--stock-gguf {tmp_path / 'text.gguf'} is a file but not a GGUF" in fails("--stock-gguf",
                                                                                     str(tmp_path / "text.gguf"))
    assert not (tmp_path / "x.gguf").exists()
