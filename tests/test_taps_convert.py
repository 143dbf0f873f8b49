"""`calibrate --taps K` / `convert --taps K`: past-token maps fitted by the layer-streamed calibrator,
chosen with them on the held-out windows, and written as GGUF taps layers (type 3).

References: the stacked least-squares fit by numpy over the activations of the whole HF model; the
held-out perplexity of the HF model with the chosen layers replaced by apply_nbl's TapsAttention; the
patched llama.cpp's logits on the converted file against that PyTorch model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from _calibrate_helpers import tiny_model
from _convert_helpers import convert_args, save_tiny_llama
from nbl_gguf.calibration.artifact import load_artifact
from nbl_gguf.commands import calibrate
from nbl_gguf.errors import NblError
from nbl_gguf.gguf.from_artifact import DEFAULT_TAPS

TAPS = 3
NSAMPLES, SEQLEN = 8, 64


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def calibration_text(tmp_path_factory):
    from nbl_gguf.calibration.dataset import heldout_texts

    path = tmp_path_factory.mktemp("text") / "text.json"
    path.write_text(json.dumps(heldout_texts()), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from transformers import AutoTokenizer

    from nbl_gguf import models

    tokenizer = AutoTokenizer.from_pretrained(models.default_model_dir())
    folder = tmp_path_factory.mktemp("tiny") / "llama"
    tiny_model(layers=4, hidden=32, vocab=len(tokenizer), seed=5).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_calibrate(*argv):
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    return calibrate.run(parser.parse_args([str(a) for a in argv] + ["--no-progress"]))


def windows(folder: Path, text: Path, count: int) -> torch.Tensor:
    """The calibration windows calibrate cuts from ``text`` (the first ``count``)."""
    from transformers import AutoTokenizer

    from nbl_gguf.calibration.dataset import load_calibration

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return load_calibration(tokenizer, str(text), count, SEQLEN).input_ids[:count]


def stacked_reference(model, ids: torch.Tensor, layer: int, taps: int):
    """(Z [n, taps d] with zeros before each window's start, lag-major; Y [n, d]) of ``layer``, from hooks
    on the whole model, float64."""
    from nbl_gguf.calibration.capture import capture_activations
    from nbl_gguf.models import get_adapter

    xs, ys = [], []

    def keep(i, h, x, y):
        if i == layer:
            xs.append(x.double())
            ys.append(y.double())

    with torch.no_grad(), capture_activations(model, get_adapter(model), keep):
        model(input_ids=ids, use_cache=False)
    x, y = torch.cat(xs), torch.cat(ys)
    lags = [torch.nn.functional.pad(x, (0, 0, j, 0))[:, :x.shape[1]] for j in range(taps)]
    d = x.shape[-1]
    return torch.cat(lags, -1).reshape(-1, taps * d).numpy(), y.reshape(-1, d).numpy()


def test_streamed_taps_maps_equal_numpy_least_squares(tmp_path, tiny_folder, calibration_text):
    """At full rank the low-rank form is the stacked LMMSE: its predictions equal numpy's least squares
    with an intercept over the whole model's activations; the default rank (n_embd / 4) costs error."""
    from transformers import AutoModelForCausalLM

    common = ["--model", tiny_folder, "--dataset", calibration_text, "--nsamples", NSAMPLES, "--seqlen", SEQLEN,
              "--dtype", "fp32", "--device", "cpu", "--targets", "attn", "--criterion", "cosine", "--m", 1,
              "--taps", TAPS]
    run_calibrate(*common, "--taps-rank", 32, "-o", tmp_path / "full")
    run_calibrate(*common, "-o", tmp_path / "default")
    full, default = load_artifact(tmp_path / "full"), load_artifact(tmp_path / "default")
    model = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()
    ids = windows(tiny_folder, calibration_text, NSAMPLES)
    for layer in range(4):
        z, y = stacked_reference(model, ids, layer, TAPS)
        design = np.concatenate([z, np.ones((len(z), 1))], 1)
        solution = np.linalg.lstsq(design, y, rcond=None)[0]
        expected = design @ solution
        got_map = full.taps_map(layer)
        got = z @ got_map.stacked().T.astype(np.float64) + got_map.bias
        scale = np.linalg.norm(y - y.mean(0))
        assert np.linalg.norm(got - expected) / scale < 1e-4, layer
        nmse = np.sum((y - expected) ** 2) / np.sum((y - y.mean(0)) ** 2)
        entry = full.report["layers"][layer]["taps"]
        assert entry["nmse"] == pytest.approx(nmse, rel=1e-3, abs=1e-6)
        assert entry["form"] == "lowrank" and entry["rank"] == 32 and entry["taps"] == TAPS
        low = default.report["layers"][layer]["taps"]
        assert low["rank"] == 32 // 4 and low["params"] < entry["params"]
        assert low["nmse"] >= entry["nmse"] - 1e-9
        # the per-token map of the same calibration is the K = 1 case: never better than the taps map
        assert full.report["layers"][layer]["attn"]["nmse"] >= entry["nmse"] - 1e-9
    assert full.report["selection"]["taps"] == TAPS


def test_selection_measures_the_taps_maps(tmp_path, tiny_folder, calibration_text):
    """`best` with --taps: the held-out perplexity it records for its choice is that of the HF model with
    those layers replaced by their taps maps (TapsAttention), not by the per-token maps."""
    from transformers import AutoModelForCausalLM

    from nbl_gguf.calibration.apply import ATTN_LINEAR, ATTN_TAPS, apply_nbl

    held = 16  # 1,024 tokens: what the selection needs at least
    run_calibrate("--model", tiny_folder, "--dataset", calibration_text, "--nsamples", NSAMPLES, "--seqlen", SEQLEN,
                  "--dtype", "fp32", "--device", "cpu", "--targets", "attn", "--criterion", "best", "--m", 2,
                  "--selection-text", "calibration", "--selection-windows", held, "--taps", TAPS, "-o", tmp_path / "a")
    artifact = load_artifact(tmp_path / "a")
    selection = artifact.report["selection"]
    chosen = selection["layers"]
    assert len(chosen) == 2 and selection["taps"] == TAPS
    from nbl_gguf.calibration.report import describe_selection

    assert describe_selection(selection, 4).startswith(f"attn-nbl with past-token maps of {TAPS} tokens by best: ")
    ids = windows(tiny_folder, calibration_text, NSAMPLES + held)[NSAMPLES:]

    def ppl(kind):
        model = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()
        maps = {i: artifact.taps_map(i) if kind == ATTN_TAPS else artifact.linear(i) for i in chosen}
        apply_nbl(model, {i: kind for i in chosen}, maps)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, :-1].double()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        return float(torch.exp(nll))

    recorded = selection["heldout"]["ppl"][-1]
    taps_ppl, linear_ppl = ppl(ATTN_TAPS), ppl(ATTN_LINEAR)
    print(f"recorded {recorded:.6f}, taps {taps_ppl:.6f}, per-token {linear_ppl:.6f}")
    assert abs(recorded - taps_ppl) < 0.1 * abs(recorded - linear_ppl)  # the two maps are told apart
    assert recorded == pytest.approx(taps_ppl, rel=1e-5)


def test_taps_arguments_are_checked_before_calibrating(tmp_path, tiny_folder, calibration_text):
    from nbl_gguf.commands.convert import convert

    out = tmp_path / "x.gguf"
    with pytest.raises(NblError, match="--runtime nbl"):
        convert(convert_args(model=str(tiny_folder), taps=4, runtime="stock", output=str(out)))
    with pytest.raises(NblError, match="--method attn-nbl"):
        convert(convert_args(model=str(tiny_folder), taps=4, method="attn-drop", output=str(out)))
    with pytest.raises(NblError, match="at most 64"):
        convert(convert_args(model=str(tiny_folder), taps=65, output=str(out)))
    for argv, message in ((["--taps", 0], "at least 1"), (["--taps", 3, "--method", "attn-drop"], "--method attn-nbl")):
        with pytest.raises((NblError, SystemExit)):
            run_calibrate("--model", tiny_folder, "--dataset", calibration_text, *argv, "-o", tmp_path / "c")
    # too few fit tokens for the stacked inputs: refused once the windows are cut, before layer 0 runs
    with pytest.raises(NblError, match=r"only 64 calibration tokens for --taps 4, which stacks 4 x 32 = 128 inputs a "
                                       r"layer; need more than 128"):
        run_calibrate("--model", tiny_folder, "--dataset", calibration_text, "--taps", 4, "--nsamples", 2,
                      "--seqlen", 32, "--m", 1, "--criterion", "cosine", "-o", tmp_path / "c")
    assert not out.exists() and not (tmp_path / "c").exists()


# --- convert end to end: the GGUF's taps layers in llama.cpp ------------------------------------------

def family_folder(tmp_path: Path, family: str) -> Path:
    """A tiny HF folder: the llama of the convert tests, or a random model of another family with the
    small SentencePiece vocabulary the pinned converter takes for it (test_convert_families)."""
    if family == "llama":
        return save_tiny_llama(tmp_path / "hf", n_layer=4, seed=2)
    from _family_helpers import sentencepiece_model, tiny_family_model
    from nbl_gguf.calibration.dataset import heldout_texts

    return tiny_family_model(family, tmp_path, sentencepiece_model(heldout_texts()))


@pytest.mark.llama
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "phi3", "smollm3", "gemma2", "gemma3_text"])
def test_convert_taps_runs_in_llama_cpp_as_in_pytorch(family, tmp_path, calibration_text):
    """convert --taps writes type-3 layers with the artifact's maps; llama.cpp's logits on the F32 file
    equal PyTorch's with the same layers replaced (TapsAttention), for every graph that builds taps
    layers (llama; qwen2, patch 0014; qwen3, phi3, smollm3, gemma2 and gemma3 beside their own sliding
    layers, patch 0021); a per-token artifact is refused for --taps, and a taps artifact still serves
    --taps 1 (its per-token maps)."""
    pytest.importorskip("llama_cpp")
    import gguf

    from nbl_gguf.calibration.apply import ATTN_TAPS, apply_nbl
    from nbl_gguf.commands.convert import convert
    from nbl_gguf.gguf import nbl_format
    from nbl_gguf.llamacpp import library
    from nbl_gguf.llamacpp.tools import bin_dir, source_dir

    if not (bin_dir() / "libllama.so").is_file() or not (source_dir() / "convert_hf_to_gguf.py").is_file():
        pytest.skip("needs the patched llama.cpp build (scripts/build_llama.sh)")
    folder = family_folder(tmp_path, family)
    args = dict(model=str(folder), dataset=str(calibration_text), nsamples=NSAMPLES, seqlen=SEQLEN, m=2,
                criterion="cosine", dtype="fp32")
    out = tmp_path / "taps.gguf"
    summary = convert(convert_args(**args, taps=TAPS, quant="f32", output=str(out),
                                   save_calibration=str(tmp_path / "cal")))
    artifact = load_artifact(tmp_path / "cal")
    reader = gguf.GGUFReader(out)
    from _family_helpers import FAMILIES

    arch = "llama" if family == "llama" else FAMILIES[family][2]
    assert str(reader.fields["general.architecture"].contents()) == arch
    types = nbl_format.read_layer_types(reader)
    assert [i for i, t in enumerate(types) if t == nbl_format.TAPS] == summary.replaced
    assert int(reader.fields[f"{arch}.nbl.taps"].contents()) == TAPS
    assert summary.method == "attn-taps"
    from nbl_gguf.gguf.inspect import describe, human_bytes

    state = describe(out)["taps"]["state_bytes_per_sequence"]
    assert state == len(summary.replaced) * (TAPS - 1) * reader.fields[f"{arch}.embedding_length"].contents() * 4
    assert summary.taps_state_bytes == state and human_bytes(state) in summary.table()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    apply_nbl(model, {i: ATTN_TAPS for i in summary.replaced}, {i: artifact.taps_map(i) for i in summary.replaced})
    # ids within every family's GGUF vocabulary (the SentencePiece one has 400)
    tokens = [int(t) for t in np.random.default_rng(0).integers(3, 400, SEQLEN)]
    with torch.no_grad():
        expected = model(torch.tensor([tokens])).logits[0].double().numpy()
    llm, _ = library.load_model(out, n_ctx=SEQLEN, logits_all=True, f32_kv=True)
    got = library.logits(llm, tokens)
    assert np.abs(got - expected).max() < 1e-3

    # a per-token artifact cannot give taps layers; the taps artifact still gives per-token ones
    with pytest.raises(NblError, match="calibrate with --taps 3"):
        plain = tmp_path / "plain"
        from _convert_helpers import calibrate_for_convert

        calibrate_for_convert(plain, folder, convert_args(**args))
        convert(convert_args(**args, calibration=str(plain), taps=TAPS, quant="f32", output=str(tmp_path / "p.gguf")))
    assert not (tmp_path / "p.gguf").exists()
    linear = convert(convert_args(**args, calibration=str(tmp_path / "cal"), quant="f32",
                                  output=str(tmp_path / "linear.gguf")))
    types = nbl_format.read_layer_types(gguf.GGUFReader(tmp_path / "linear.gguf"))
    assert [i for i, t in enumerate(types) if t == nbl_format.LINEAR] == linear.replaced == summary.replaced
    # --taps auto (the default) with a --calibration: the artifact's own maps
    auto = convert(convert_args(**args, calibration=str(tmp_path / "cal"), quant="f32", taps="auto",
                                output=str(tmp_path / "auto.gguf")))
    types = nbl_format.read_layer_types(gguf.GGUFReader(tmp_path / "auto.gguf"))
    assert [i for i, t in enumerate(types) if t == nbl_format.TAPS] == auto.replaced == summary.replaced


def test_taps_are_refused_for_a_graph_without_them(tmp_path, monkeypatch):
    """Every NBL architecture builds taps layers today (patch 0021); one that joins without them is left out
    of TAPS_ARCHITECTURES, and --taps K for its model is refused before any work, nothing written."""
    from nbl_gguf.commands.convert import convert
    from nbl_gguf.gguf import nbl_format

    monkeypatch.setattr(nbl_format, "TAPS_ARCHITECTURES", ("llama", "qwen2"))
    folder = family_folder(tmp_path, "phi3")
    with pytest.raises(NblError, match="'phi3' model; use --taps 1"):
        convert(convert_args(model=str(folder), taps=4, output=str(tmp_path / "x.gguf")))
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("family, runtime, method, hidden, device, expected", [
    ("llama", "nbl", "attn-nbl", 576, "cpu", DEFAULT_TAPS), ("qwen2", "nbl", "attn-nbl", 896, "cpu", DEFAULT_TAPS),
    ("llama", "stock", "attn-nbl", 576, "cpu", 1), ("llama", "nbl", "attn-drop", 576, "cpu", 1),
    ("phi3", "nbl", "attn-nbl", 576, "cpu", DEFAULT_TAPS), ("gemma3_text", "nbl", "attn-nbl", 640, "cpu", DEFAULT_TAPS),
    # an 8B width: its taps fit is too dear for a CPU (minutes and ~10 GB a layer), not for a GPU
    ("llama", "nbl", "attn-nbl", 4096, "cpu", 1), ("llama", "nbl", "attn-nbl", 4096, "cuda", DEFAULT_TAPS)])
def test_taps_auto_is_the_default_where_the_file_can_carry_taps_layers(family, runtime, method, hidden, device, expected,
                                                                      tmp_path):
    from nbl_gguf.gguf.from_artifact import TapsRequest, check_taps

    folder = tmp_path / family
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": family}), encoding="utf-8")

    class Source:
        gguf, name = None, family

        def hf_folder(self):
            return folder

    assert check_taps(TapsRequest("auto", runtime=runtime), Source(), method, hidden, device) == expected


def test_taps_need_more_fit_tokens_than_stacked_inputs(tmp_path):
    """K taps of width d stack K x d inputs: auto keeps per-token maps below that many fit tokens, and
    an explicit --taps K is refused before any work (not at layer 0 of the calibration)."""
    from nbl_gguf.commands.convert import convert
    from nbl_gguf.gguf.from_artifact import TapsRequest, check_taps

    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}), encoding="utf-8")

    class Source:
        gguf, name = None, "llama"

        def hf_folder(self):
            return folder

    def resolved(taps, nsamples, seqlen=256):
        return check_taps(TapsRequest(taps, nsamples=nsamples, seqlen=seqlen), Source(), "attn-nbl", 576, "cpu")

    assert resolved("auto", 8) == 1  # 2048 tokens for 4 x 576 = 2304 inputs
    assert resolved("auto", 10) == DEFAULT_TAPS  # 2560
    assert resolved("auto", None, 64) == 1  # the CPU's default 32 windows of 64: 2048
    assert resolved(2, 8) == 2
    with pytest.raises(NblError, match=r"--taps 4 stacks 4 x 576 = 2304 inputs a layer, and --nsamples 8 x --seqlen "
                                       r"256 is 2048 tokens: fit on more than 2304 tokens, or use --taps 1"):
        resolved(4, 8)
    model = family_folder(tmp_path, "llama")
    with pytest.raises(NblError, match=r"--taps 4 stacks 4 x \d+ = \d+ inputs a layer"):
        convert(convert_args(model=str(model), taps=4, nsamples=2, seqlen=16, output=str(tmp_path / "x.gguf")))
    assert not (tmp_path / "x.gguf").exists()
