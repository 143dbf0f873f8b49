"""`convert --runtime stock`: the NBL model as llama.cpp's deci architecture, run by the unmodified
libllama (build/stock/libllama.so, built from the pristine tree) in a subprocess.

The reference is the HF model with the same layers replaced in PyTorch (apply_nbl) by the bias-free
maps, an implementation independent of llama.cpp's graph. The tiny models carry attention biases
(o_proj too), so that the attention output has a mean and a map with a bias differs from one without.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from _convert_helpers import calibrate_for_convert, convert_args
from nbl_gguf.errors import NblError
from nbl_gguf.gguf import nbl_format, stock_layout
from nbl_gguf.llamacpp.tools import bin_dir, build_dir, source_dir

pytestmark = [
    pytest.mark.llama,
    pytest.mark.skipif(not (source_dir() / "convert_hf_to_gguf.py").is_file() or not (bin_dir() / "llama-quantize").is_file(),
                       reason="needs the patched llama.cpp build (scripts/build_llama.sh)"),
]

A, L, D = nbl_format.ATTENTION, nbl_format.LINEAR, nbl_format.DROPPED
N_LAYER, HIDDEN, HEADS, KV_HEADS = 4, 64, 4, 2
HEAD_DIM = HIDDEN // HEADS
M = 2
TOLERANCE = 1e-3  # max abs logit difference, f32 weights and KV cache, flash attention off
# llama.cpp's CPU flash-attention kernel rounds Q to F16: on the stock llama file itself its logits
# differ from PyTorch by ~3e-3 (measured); a looser bound for the runs with it on
FLASH_TOLERANCE = 2e-2
KV_CTX = 4096  # cells of the KV measurement: 0.5 MiB of f32 K per attention layer, visible in the log
PROMPT, GENERATED = 40, 8

# model_type: (config class, model class, extra config)
SOURCES = {
    # tied output and Llama 3 rope scaling (the converter writes rope_freqs, which the deci graph applies)
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(tie_word_embeddings=True, attention_bias=True,
                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=64))),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None)),
}


def tiny_source_model(model_type: str, root: Path) -> Path:
    import torch
    import transformers
    from transformers import AutoTokenizer

    from nbl_gguf import models

    config_name, model_name, extra = SOURCES[model_type]
    tokenizer = AutoTokenizer.from_pretrained(models.default_model_dir())
    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=N_LAYER,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256, rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
        **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        # init leaves norms at 1 and biases at 0: perturb both, so that the attention output has a mean
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(0.2 * torch.randn_like(param))
            if name.endswith("o_proj.bias"):
                param.add_(1.0)
    path = root / f"tiny-{model_type}"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)  # SmolLM2's BPE: the converter knows its fingerprint
    return path


@pytest.fixture(scope="module", params=list(SOURCES))
def source(request, tmp_path_factory):
    """A tiny model of the family, one calibration of it, and its stock conversion (f32)."""
    from nbl_gguf.calibration.artifact import load_artifact
    from nbl_gguf.gguf.hf_to_gguf import convert_hf_to_gguf

    root = tmp_path_factory.mktemp(request.param)
    model_dir = tiny_source_model(request.param, root)
    artifact_dir = calibrate_for_convert(root / "calibration", model_dir, convert_args(model=str(model_dir), m=M))
    stock = convert_hf_to_gguf(model_dir, root / "stock-f32.gguf", "f32")
    return request.param, model_dir, artifact_dir, load_artifact(artifact_dir), stock


# --- running a GGUF with a chosen libllama, in a subprocess ----------------------------------------

RUN_GGUF = textwrap.dedent(
    """
    import json, sys
    import llama_cpp
    import numpy as np
    from nbl_gguf.llamacpp import library
    path, tokens, flash, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
    with library.captured_log() as lines:
        llm = llama_cpp.Llama(path, n_ctx=%d, logits_all=True, type_k=llama_cpp.GGML_TYPE_F32,
                              type_v=llama_cpp.GGML_TYPE_F32, flash_attn=flash, verbose=True)
    log = "".join(lines)
    kv = library.kv_caches(log)[0]
    batch = library.logits(llm, tokens)
    # the same tokens one at a time after the first half: each step reads the attention layers' cache
    llm.reset()
    half = len(tokens) // 2
    llm.eval(tokens[:half])
    for token in tokens[half:]:
        llm.eval([token])
    incremental = np.array(llm.scores[: len(tokens)], dtype=np.float64)
    llm.reset()
    completion = llm.create_completion(tokens[:%d], max_tokens=%d, temperature=0.0)
    np.savez(out, batch=batch, incremental=incremental)
    print("RESULT " + json.dumps({"kv": [kv.layers, kv.k_mib, kv.v_mib], "log": log,
                                  "generated": completion["usage"]["completion_tokens"]}))
    """ % (KV_CTX, PROMPT, GENERATED)
)


def stock_library() -> Path:
    library = build_dir() / "stock"
    assert (library / "libllama.so").exists(), "build the stock library: cmake --build build --target llama-stock"
    return library


def run_gguf(path: Path, tokens, tmp_path: Path, library: Path | None, flash: bool = False) -> dict:
    """Logits (batch and token by token), KV cache (layers, K MiB, V MiB), llama.cpp's log and a greedy
    completion of ``path`` run by the libllama in ``library`` (None: the patched one llama-cpp-python is
    bound to)."""
    env = dict(os.environ)
    if library is not None:
        env["LLAMA_CPP_LIB_PATH"] = str(library)
    out = tmp_path / f"run-{'stock' if library else 'patched'}-{int(flash)}.npz"
    completed = subprocess.run([sys.executable, "-c", RUN_GGUF, str(path), json.dumps([int(t) for t in tokens]),
                                "1" if flash else "0", str(out)], capture_output=True, text=True, env=env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(next(line for line in completed.stdout.splitlines() if line.startswith("RESULT "))[7:])
    arrays = np.load(out)
    return {**result, "batch": arrays["batch"], "incremental": arrays["incremental"]}


def reference_logits(model_dir: Path, types, linear, tokens) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    from nbl_gguf.calibration.apply import apply_nbl

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if any(types):
        model = apply_nbl(model, types, linear)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].double().numpy()


def sample_tokens(model_dir: Path, n: int = 48) -> list[int]:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    return [int(t) for t in np.random.default_rng(3).integers(0, vocab, n)]


def bias_free(artifact, layers) -> dict:
    return {i: (artifact.linear_without_bias(i), np.zeros(HIDDEN, np.float32)) for i in layers}


def assert_the_stock_library_runs_q8_0(summary, model_dir: Path, artifact, tmp_path: Path) -> None:
    """The unmodified libllama generates from the converted file, and its logits are PyTorch's with the
    bias-free maps, within what q8_0 weights allow."""
    tokens = sample_tokens(model_dir)
    got = run_gguf(summary.output, tokens, tmp_path, stock_library())
    want = reference_logits(model_dir, [L if i in summary.replaced else A for i in range(N_LAYER)],
                            bias_free(artifact, summary.replaced), tokens)
    assert got["generated"] == GENERATED
    assert np.abs(got["batch"] - want).max() < 0.05 * np.abs(want).max()


# --- the tests -----------------------------------------------------------------------------------

def test_convert_runtime_stock_runs_on_the_unmodified_library(source, tmp_path):
    import gguf

    from nbl_gguf.commands.convert import convert

    name, model_dir, artifact_dir, artifact, _ = source
    output = tmp_path / f"{name}-stock.gguf"
    summary = convert(convert_args(model=str(model_dir), calibration=str(artifact_dir), m=M, quant="f32",
                                   runtime="stock", output=str(output)))
    assert len(summary.replaced) == M and "runs on unmodified llama.cpp builds" in summary.table()
    types = [L if i in summary.replaced else A for i in range(N_LAYER)]

    reader = gguf.GGUFReader(output)
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    assert field("general.architecture") == "deci" and field("nbl.layout") == "deci"
    assert field("nbl.layer_types") == types and field("nbl.method") == "attn-nbl"
    assert field("deci.attention.head_count") == [HEADS] * N_LAYER
    assert field("deci.attention.head_count_kv") == [0 if t else KV_HEADS for t in types]
    assert not [key for key in reader.fields if key.startswith("llama.") or ".nbl." in key]
    names = {t.name for t in reader.tensors}
    for layer in summary.replaced:
        assert {f"blk.{layer}.attn_norm.weight", f"blk.{layer}.attn_output.weight"} <= names
        assert not [n for n in names if n.startswith((f"blk.{layer}.attn_q", f"blk.{layer}.attn_k", f"blk.{layer}.attn_v",
                                                      f"blk.{layer}.attn_output.bias"))]
        stored = next(t for t in reader.tensors if t.name == f"blk.{layer}.attn_output.weight")
        np.testing.assert_array_equal(np.asarray(stored.data), artifact.linear_without_bias(layer))
    if name == "llama":
        assert "rope_freqs.weight" in names and "output.weight" not in names  # Llama 3 rope, tied output

    tokens = sample_tokens(model_dir)
    stock = run_gguf(output, tokens, tmp_path, stock_library())
    want = reference_logits(model_dir, types, bias_free(artifact, summary.replaced), tokens)
    assert np.abs(stock["batch"] - want).max() < TOLERANCE
    assert np.abs(stock["incremental"] - want).max() < TOLERANCE
    assert stock["generated"] == GENERATED
    # the comparison can tell the bias-free maps from the maps with a bias (what the NBL layout runs)
    with_bias = reference_logits(model_dir, types, artifact, tokens)
    assert np.abs(with_bias - want).max() > 20 * TOLERANCE

    # the patched build has no marked layers to treat differently: the same file, the same logits
    patched = run_gguf(output, tokens, tmp_path, None)
    np.testing.assert_array_equal(patched["batch"], stock["batch"])
    assert patched["kv"] == stock["kv"]


def test_mixed_linear_and_dropped_layers(source, tmp_path):
    """A dropped layer 0 (written as a linear layer with a zero map, see stock_layer_kinds), a linear
    layer and a dropped one, through the writer directly."""
    import gguf

    _, model_dir, _, artifact, stock_f32 = source
    types = [D, L, A, D]
    layers = nbl_format.NblLayers(types=types, linear=bias_free(artifact, [1]), method="mixed")
    output = stock_layout.write_stock_gguf(stock_f32, tmp_path / "mixed.gguf", layers)
    reader = gguf.GGUFReader(output)
    assert reader.fields["deci.attention.head_count"].contents() == [HEADS, HEADS, HEADS, 0]
    assert reader.fields["deci.attention.head_count_kv"].contents() == [0, 0, KV_HEADS, 0]
    names = {t.name for t in reader.tensors}
    assert not [n for n in names if n.startswith("blk.3.attn")]  # nothing of the attention-free layer, norm included
    zero = next(t for t in reader.tensors if t.name == "blk.0.attn_output.weight")
    assert not np.asarray(zero.data).any()

    tokens = sample_tokens(model_dir)
    got = run_gguf(output, tokens, tmp_path, stock_library())
    want = reference_logits(model_dir, types, bias_free(artifact, [1]), tokens)
    assert np.abs(got["batch"] - want).max() < TOLERANCE
    assert np.abs(got["incremental"] - want).max() < TOLERANCE
    assert np.abs(reference_logits(model_dir, [A] * N_LAYER, None, tokens) - want).max() > 20 * TOLERANCE


@pytest.mark.parametrize("source", ["llama"], indirect=True)  # once is enough
def test_kv_cache_with_flash_attention_on_and_off(source, tmp_path):
    """K: the attention layers only. V: the attention layers only with flash attention; without it,
    llama.cpp keeps the V cache transposed and pads every layer's to the largest, so the replaced
    layers keep a full V cache."""
    _, model_dir, _, artifact, stock_f32 = source
    replaced = [1, 2]
    types = [L if i in replaced else A for i in range(N_LAYER)]
    output = stock_layout.write_stock_gguf(stock_f32, tmp_path / "stock-layout.gguf", nbl_format.NblLayers(
        types=types, linear=bias_free(artifact, replaced)))
    tokens = sample_tokens(model_dir)
    want = reference_logits(model_dir, types, bias_free(artifact, replaced), tokens)
    layer_mib = KV_CTX * KV_HEADS * HEAD_DIM * 4 / 2**20  # f32 K (or V) of one attention layer

    runs = {}
    for path, label in ((stock_f32, "llama"), (output, "deci")):
        for flash in (False, True):
            run = run_gguf(path, tokens, tmp_path, stock_library(), flash=flash)
            runs[label, flash] = run["kv"]
            if label == "deci":
                assert np.abs(run["batch"] - want).max() < (FLASH_TOLERANCE if flash else TOLERANCE)
                assert ("padding V cache" in run["log"]) != flash
    attention = N_LAYER - len(replaced)
    for flash in (False, True):
        assert runs["llama", flash] == [N_LAYER, pytest.approx(N_LAYER * layer_mib, abs=0.01),
                                        pytest.approx(N_LAYER * layer_mib, abs=0.01)]
    # every layer is in the cache (has_kv), the replaced ones with 0-wide K
    assert runs["deci", True] == [N_LAYER, pytest.approx(attention * layer_mib, abs=0.01),
                                  pytest.approx(attention * layer_mib, abs=0.01)]
    assert runs["deci", False] == [N_LAYER, pytest.approx(attention * layer_mib, abs=0.01),
                                   pytest.approx(N_LAYER * layer_mib, abs=0.01)]


@pytest.mark.parametrize("source", ["llama"], indirect=True)  # once is enough
def test_quantized_source_and_output(source, tmp_path):
    """The writer copies a quantized source's tensors with their type and bytes; convert quantizes
    the deci file, and the stock library runs it."""
    import gguf

    from nbl_gguf.commands.convert import convert
    from nbl_gguf.gguf.quantize import quantize

    _, model_dir, artifact_dir, artifact, stock_f32 = source
    q8 = quantize(stock_f32, tmp_path / "stock-q8_0.gguf", "Q8_0")
    types = [A, L, A, D]
    output = stock_layout.write_stock_gguf(q8, tmp_path / "from-q8.gguf", nbl_format.NblLayers(
        types=types, linear=bias_free(artifact, [1])))
    source_tensors = {t.name: t for t in gguf.GGUFReader(q8).tensors}
    written = {t.name: t for t in gguf.GGUFReader(output).tensors}
    kept = [n for n in written if n != "blk.1.attn_output.weight"]
    assert kept and set(kept) <= set(source_tensors)
    for tensor_name in kept:
        assert written[tensor_name].tensor_type == source_tensors[tensor_name].tensor_type
        assert bytes(written[tensor_name].data) == bytes(source_tensors[tensor_name].data), tensor_name
    assert written["blk.1.attn_output.weight"].tensor_type == gguf.GGMLQuantizationType.F32  # q8_0 W: quantize after

    summary = convert(convert_args(model=str(model_dir), calibration=str(artifact_dir), m=M, quant="q8_0",
                                   runtime="stock", output=str(tmp_path / "q8.gguf")))
    reader = gguf.GGUFReader(summary.output)
    assert reader.fields["general.architecture"].contents() == "deci"
    assert {t.tensor_type.name for t in reader.tensors if t.name.endswith("attn_output.weight")} == {"Q8_0"}
    assert_the_stock_library_runs_q8_0(summary, model_dir, artifact, tmp_path)


@pytest.mark.parametrize("source", ["llama"], indirect=True)  # once is enough
def test_inspect_reports_the_layout(source, tmp_path, capsys):
    from nbl_gguf import cli
    from nbl_gguf.gguf.inspect import describe

    _, model_dir, _, artifact, stock_f32 = source
    types = [A, L, A, D]
    deci = stock_layout.write_stock_gguf(stock_f32, tmp_path / "deci.gguf", nbl_format.NblLayers(
        types=types, linear=bias_free(artifact, [1])))
    nbl = nbl_format.write_nbl_gguf(stock_f32, tmp_path / "nbl.gguf", nbl_format.NblLayers(
        types=types, linear={1: artifact.linear(1)}))
    per_layer = 2 * KV_HEADS * HEAD_DIM * 2  # F16 K and V
    for path, layout, stock_runs, file_kv in (
            (stock_f32, "stock GGUF (no NBL layers)", True, N_LAYER * per_layer),
            (nbl, "NBL (patched llama.cpp)", False, 2 * per_layer),
            (deci, "NBL stock layout (deci)", True, 2 * per_layer)):
        info = describe(path)
        assert (info["layout"], info["stock_llama_cpp_runs_it"]) == (layout, stock_runs)
        kv = info["kv_bytes_per_token"]
        assert (kv["stock"], kv["file"]) == (N_LAYER * per_layer, file_kv)
        # flash attention off: K of the attention layers, V of all of them (measured in the KV test above)
        assert kv.get("file_flash_attention_off") == (2 * per_layer // 2 + N_LAYER * per_layer // 2
                                                      if path == deci else None)
        if path != stock_f32:
            assert [layer["type"] for layer in info["layers"]] == ["attention", "linear", "attention", "dropped"]
    # what inspect says of the NBL layout is what the stock library does with it
    load = "from nbl_gguf.llamacpp import library; library.load_model(__import__('sys').argv[1], n_ctx=64)"
    refused = subprocess.run([sys.executable, "-c", load, str(nbl)], capture_output=True, text=True,
                             env={**os.environ, "LLAMA_CPP_LIB_PATH": str(stock_library())})
    assert refused.returncode != 0 and "tensor 'blk.1.attn_q.weight' not found" in refused.stderr
    assert cli.main(["inspect", str(deci)]) == 0
    out = capsys.readouterr().out
    assert "layout:        NBL stock layout (deci); a stock llama.cpp build runs it: yes" in out
    # at the training context, 256 tokens: 384 of the stock 512 bytes per token
    assert "with -fa off 96.00 KiB (-25.0%): llama.cpp then pads the V cache of the replaced layers" in out


def test_other_architectures_are_refused_by_name(tmp_path, capsys):
    from transformers import MixtralConfig, Qwen2Config

    from nbl_gguf import cli
    from nbl_gguf.fixtures.tiny import TinyLlama

    for config, model_type in ((Qwen2Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=2), "qwen2"),
                               (MixtralConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2), "mixtral")):
        folder = tmp_path / model_type
        config.save_pretrained(folder)
        (folder / "model.safetensors").write_bytes(b"")
        output = tmp_path / f"{model_type}.gguf"
        assert cli.main(["convert", "--runtime", "stock", "--model", str(folder), "-o", str(output)]) != 0
        err = capsys.readouterr().err
        assert f"'{model_type}' cannot be written that way" in err and "use --runtime nbl" in err
        assert not output.exists() and not list(tmp_path.glob(f".{model_type}.gguf*"))

    # the writer itself refuses a non-llama GGUF and an MoE one by name, and writes nothing
    model = TinyLlama(n_layer=2)
    from test_convert_families import _as_architecture

    llama = model.write_gguf(tmp_path / "llama.gguf")
    layers = nbl_format.NblLayers(types=[A, D])
    with pytest.raises(NblError, match=r"is a 'qwen2' model; the stock layout \(llama.cpp's deci graph\) takes llama"):
        stock_layout.write_stock_gguf(_as_architecture(llama, tmp_path / "qwen2.gguf", "qwen2"), tmp_path / "o.gguf", layers)
    import gguf

    moe = model.write_gguf(tmp_path / "moe.gguf", extra_kv={"llama.expert_count": (4, gguf.GGUFValueType.UINT32, None)})
    with pytest.raises(NblError, match=r"mixture-of-experts model \(mixtral\): llama.cpp's deci graph runs no experts"):
        stock_layout.write_stock_gguf(moe, tmp_path / "o.gguf", layers)
    with pytest.raises(NblError, match=r"layer 1: the deci linear attention has no bias"):
        stock_layout.write_stock_gguf(llama, tmp_path / "o.gguf", nbl_format.NblLayers(
            types=[A, L], linear=model.random_linear([1])))
    assert not list(tmp_path.glob("o.gguf*")) and not list(tmp_path.glob(".o.gguf*"))


@pytest.mark.parametrize("source", ["llama"], indirect=True)  # once is enough
def test_gguf_model_in_the_stock_layout(source, tmp_path):
    """convert --model file.gguf --runtime stock: the surgery of a quantized llama GGUF writes deci,
    keeps every other tensor's bytes, stores W0 in the replaced layer's attn_output type, and the
    stock library runs it."""
    import gguf

    from nbl_gguf.commands.convert import convert
    from nbl_gguf.gguf.quantize import quantize
    from test_convert_families import _as_architecture

    _, model_dir, artifact_dir, artifact, stock_f32 = source
    q8 = quantize(stock_f32, tmp_path / "tiny-q8_0.gguf", "Q8_0")
    summary = convert(convert_args(model=str(q8), calibration=str(artifact_dir), m=M, runtime="stock",
                                   output=str(tmp_path / "tiny-stock.gguf")))
    assert "llama.* renamed deci.*" in summary.table()
    reader = gguf.GGUFReader(summary.output)
    assert reader.fields["general.architecture"].contents() == "deci"
    source_tensors = {t.name: t for t in gguf.GGUFReader(q8).tensors}
    written = {t.name: t for t in reader.tensors}
    replaced = {f"blk.{layer}.attn_output.weight" for layer in summary.replaced}
    for name, tensor in written.items():
        if name in replaced:
            layer = int(name.split(".")[1])
            assert tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0
            expected = gguf.quants.quantize(artifact.linear_without_bias(layer), gguf.GGMLQuantizationType.Q8_0)
            assert bytes(tensor.data) == expected.tobytes()
        else:
            assert bytes(tensor.data) == bytes(source_tensors[name].data), name
    assert_the_stock_library_runs_q8_0(summary, model_dir, artifact, tmp_path)

    # a GGUF the deci graph cannot run is refused before any work, and nothing is written
    qwen2 = _as_architecture(q8, tmp_path / "tiny-qwen2.gguf", "qwen2")
    output = tmp_path / "qwen2-stock.gguf"
    with pytest.raises(NblError, match=r"--runtime stock writes llama.cpp's deci architecture, which runs llama GGUFs "
                                       r"only; tiny-qwen2.gguf is a 'qwen2' model: use --runtime nbl"):
        convert(convert_args(model=str(qwen2), calibration=str(artifact_dir), m=M, runtime="stock", output=str(output)))
    assert not output.exists()


def test_both_layouts_keep_a_source_data_alignment(tmp_path):
    """A source written with general.alignment = 64: both writers copy the key, so their tensor data
    must be laid out at that alignment too, or every tensor after the first reads back wrong."""
    import gguf

    from nbl_gguf.fixtures.tiny import TinyLlama

    model = TinyLlama(n_layer=2)
    plain = gguf.GGUFReader(model.write_gguf(tmp_path / "plain.gguf"))
    source = tmp_path / "aligned-64.gguf"
    writer = gguf.GGUFWriter(source, arch="llama")
    nbl_format.copy_keys(plain, writer)
    writer.data_alignment = 64
    writer.add_uint32("general.alignment", 64)
    nbl_format.write_tensors(writer, [(t.name, t.data, t.tensor_type) for t in plain.tensors], plain.endianess)
    reader = gguf.GGUFReader(source)
    assert reader.alignment == 64
    source_bytes = {t.name: bytes(t.data) for t in reader.tensors}
    kept = {name for name in source_bytes if not name.startswith("blk.1.attn")}

    stock = stock_layout.write_stock_gguf(source, tmp_path / "deci.gguf", nbl_format.NblLayers(types=[A, D]))
    nbl = nbl_format.write_nbl_gguf(source, tmp_path / "nbl.gguf", nbl_format.NblLayers(types=[A, D]))
    for path in (stock, nbl):
        written = gguf.GGUFReader(path)
        assert written.alignment == 64
        tensors = {t.name: bytes(t.data) for t in written.tensors}
        assert kept <= set(tensors) <= set(source_bytes), path.name  # the NBL layout keeps blk.1.attn_norm
        assert all(data == source_bytes[name] for name, data in tensors.items()), path.name
