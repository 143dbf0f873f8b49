"""GGUF in: `convert --model some.gguf` calibrates on the model transformers dequantizes from the file and
writes the NBL file by surgery on the file itself.

Checked against independent references: the input's own bytes (every untouched tensor, every key),
gguf-py's quantizers (the NBL weight's bytes), and PyTorch on the dequantized model with the same layers
replaced (apply_nbl), within the distance that the unmodified file already has from that model in
llama.cpp: the CPU backend rounds a matmul's input to its weight's partner type on the fly (8 bits per
32 values for q4_1/q5_0/q8_0, f16 for f16), so the reference rounds the NBL map's input the same way;
the rest of the difference is what every stock layer has too. The calibration is small but not tiny
(8 x 256 tokens): a map fitted on barely more tokens than d is ill-conditioned and amplifies that
rounding by itself (measured: 1024 tokens, cca layers: 0.17-0.30 relative RMS against the stock's 0.05).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from _convert_helpers import convert_args
from nbl_gguf.errors import NblError
from nbl_gguf.gguf import nbl_format
from nbl_gguf.llamacpp.tools import bin_dir

needs_build = pytest.mark.skipif(not (bin_dir() / "llama-perplexity").is_file(),
                                 reason="needs the patched llama.cpp build (scripts/build_llama.sh)")
pytestmark = [pytest.mark.llama, needs_build]

M = 4
CRITERION = "cosine"
WINDOW = 256
WINDOWS = 4
NBL_KEYS = {nbl_format.METHOD_KEY, nbl_format.CRITERION_KEY, nbl_format.SCORES_KEY, nbl_format.SCORES_CRITERION_KEY,
            nbl_format.CALIBRATION_KEY}


# --- helpers -------------------------------------------------------------------------------------

def listing(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()} if directory.exists() else set()


def tensors_of(reader) -> dict:
    return {t.name: t for t in reader.tensors}


def assert_surgery(src: Path, dst: Path, types: list[int]) -> dict[int, str]:
    """``dst`` is ``src`` with the attention of the replaced layers swapped for NBL tensors: every other
    tensor has the input's bytes, type and shape, in the input's order, and every key is kept. Returns
    each linear layer's W type."""
    import gguf

    before, after = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    arch = str(before.fields["general.architecture"].contents())
    assert nbl_format.read_layer_types(after) == types

    dropped = [t.name for t in before.tensors
               if (layer := nbl_format.layer_of(t.name)) is not None and types[layer] != nbl_format.ATTENTION
               and nbl_format.is_attention_tensor(t.name, layer)]
    assert dropped, "the replaced layers had attention tensors"
    kept = [t for t in before.tensors if t.name not in set(dropped)]
    out = tensors_of(after)
    for tensor in kept:
        twin = out[tensor.name]
        assert twin.tensor_type == tensor.tensor_type, tensor.name
        assert list(twin.shape) == list(tensor.shape), tensor.name
        assert bytes(twin.data) == bytes(tensor.data), tensor.name
    nbl_names = {name for name in out if ".attn_nbl." in name}
    linear = [i for i, t in enumerate(types) if t == nbl_format.LINEAR]
    assert nbl_names == {n for i in linear for n in (nbl_format.NBL_WEIGHT.format(layer=i),
                                                    nbl_format.NBL_BIAS.format(layer=i))}
    assert [t.name for t in after.tensors if t.name not in nbl_names] == [t.name for t in kept]

    keys_before = {k for k in before.fields if not k.startswith("GGUF.")}
    keys_after = {k for k in after.fields if not k.startswith("GGUF.")}
    assert keys_after - keys_before <= NBL_KEYS | {nbl_format.LAYER_TYPES_KEY.format(arch=arch)}
    assert keys_before <= keys_after
    for key in keys_before:
        assert after.fields[key].contents() == before.fields[key].contents(), key
        assert after.fields[key].types == before.fields[key].types, key

    for i in linear:
        assert out[nbl_format.NBL_BIAS.format(layer=i)].tensor_type.name == "F32"
    return {i: out[nbl_format.NBL_WEIGHT.format(layer=i)].tensor_type.name for i in linear}


def file_linear(path: Path) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """The (W, b) that the NBL file holds, dequantized by gguf-py (not by ggml, which wrote them)."""
    import gguf

    tensors = tensors_of(gguf.GGUFReader(path))
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(".attn_nbl.weight"):
            layer = nbl_format.layer_of(name)
            n_in, n_out = (int(v) for v in tensor.shape)
            weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(n_out, n_in)
            bias = tensors[nbl_format.NBL_BIAS.format(layer=layer)].data
            out[layer] = (np.asarray(weight, dtype=np.float32), np.asarray(bias, dtype=np.float32))
    return out


# a position counts for top-1 agreement when PyTorch's top token leads the runner-up by this many nats:
# near-ties flip under any rounding (llama.cpp quantizes activations for its dot products), and a
# model with replaced layers has more of them; the RMS term below bounds the error everywhere
DECIDED = 1.0


@dataclass
class Deviation:
    """How far llama.cpp's logits of a file are from PyTorch's on the same windows."""

    top1: float  # share of the decided positions (see DECIDED) with the same argmax
    rel_rms: float  # RMS of the logit difference over the RMS of PyTorch's centred logits
    ppl_rel: float  # relative perplexity difference

    def within(self, stock: "Deviation") -> bool:
        """At most as far as the unmodified file is, with a margin for the few replaced layers."""
        return (self.top1 >= stock.top1 - 0.02 and self.rel_rms <= 1.5 * stock.rel_rms + 0.005
                and self.ppl_rel <= 2 * stock.ppl_rel + 0.005)


def heldout_windows(tokenizer, window: int = WINDOW, count: int = WINDOWS) -> list[list[int]]:
    from nbl_gguf.calibration.dataset import heldout_texts

    stream: list[int] = []
    for text in reversed(heldout_texts()):  # the last documents of the bundled sample: never calibrated on
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(stream) >= window * count:
            break
    return [stream[i * window:(i + 1) * window] for i in range(count)]


def deviation(model, path: Path, windows: list[list[int]]) -> Deviation:
    import torch

    from nbl_gguf.llamacpp import library

    llm, _ = library.load_model(path, n_ctx=len(windows[0]), logits_all=True, f32_kv=True)
    agree = total = 0
    squares = references = 0.0
    nll_torch, nll_gguf = [], []
    for tokens in windows:
        with torch.no_grad():
            ref = model(torch.tensor([tokens])).logits[0].double().numpy()
        got = library.logits(llm, tokens)
        top_two = np.sort(ref, axis=-1)[:, -2:]
        decided = top_two[:, 1] - top_two[:, 0] > DECIDED
        agree += int((ref.argmax(-1) == got.argmax(-1))[decided].sum())
        total += int(decided.sum())
        squares += float(((ref - got) ** 2).sum())
        references += float(((ref - ref.mean(-1, keepdims=True)) ** 2).sum())
        nll_torch.append(_nll(ref, tokens))
        nll_gguf.append(_nll(got, tokens))
    ppl_torch = float(np.exp(np.concatenate(nll_torch).mean()))
    ppl_gguf = float(np.exp(np.concatenate(nll_gguf).mean()))
    assert total >= 0.25 * sum(map(len, windows)), f"only {total} decided positions"
    return Deviation(agree / total, (squares / references) ** 0.5, abs(ppl_gguf - ppl_torch) / ppl_torch)


def _nll(logits: np.ndarray, tokens: list[int]) -> np.ndarray:
    logits = logits[:-1]
    top = logits.max(axis=-1, keepdims=True)
    logz = top[:, 0] + np.log(np.exp(logits - top).sum(axis=-1))
    return logz - logits[np.arange(len(tokens) - 1), tokens[1:]]


# what ggml's CPU matmul turns its input into for a weight of this type (vec_dot_type in ggml-cpu.c;
# q8_1 holds the values of q8_0)
INPUT_ROUNDING = {"Q4_0": "Q8_0", "Q4_1": "Q8_0", "Q5_0": "Q8_0", "Q5_1": "Q8_0", "Q8_0": "Q8_0", "F16": "F16"}


def nbl_model(loaded, types: list[int], linear, weight_type: str):
    """PyTorch NBL: the model with ``types`` replaced by ``linear``, each map's input rounded as
    llama.cpp's CPU backend rounds it for a W of ``weight_type``."""
    import copy

    import gguf
    import torch

    from nbl_gguf.calibration.apply import LinearAttention, apply_nbl

    def round_like_ggml(x):
        flat = np.ascontiguousarray(x.detach().float().reshape(-1, x.shape[-1]).numpy())
        if INPUT_ROUNDING[weight_type] == "F16":
            flat = flat.astype(np.float16).astype(np.float32)
        else:
            qtype = gguf.GGMLQuantizationType[INPUT_ROUNDING[weight_type]]
            flat = gguf.quants.dequantize(gguf.quants.quantize(flat, qtype), qtype)
        return torch.from_numpy(np.ascontiguousarray(flat)).reshape(x.shape).to(x.dtype)

    def rounded(module, args, kwargs):  # HF passes hidden_states by keyword
        if args:
            return (round_like_ggml(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": round_like_ggml(kwargs["hidden_states"])}

    model = apply_nbl(copy.deepcopy(loaded.model), types, linear)
    for module in model.modules():
        if isinstance(module, LinearAttention):
            module.register_forward_pre_hook(rounded, with_kwargs=True)
    return model


def tiny_gguf(path: Path, arch: str, n_embd: int = 64, n_layer: int = 2, tensors=()) -> Path:
    """A small valid GGUF of architecture ``arch``: its shape keys and the given (name, array, type) tensors."""
    import gguf

    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_block_count(n_layer)
    writer.add_embedding_length(n_embd)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for name, array, raw_dtype in tensors or [("token_embd.weight", np.zeros((8, n_embd), np.float32), None)]:
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- ggml's quantizers and the choice of W's type (no model) ------------------------------------

def test_ggml_quantizers_match_gguf_py():
    import gguf

    from nbl_gguf.llamacpp import ggml

    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((16, 512)).astype(np.float32)
    for name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16"):  # gguf-py ports ggml's reference code
        qtype = gguf.GGMLQuantizationType[name]
        assert ggml.quantize(matrix, int(qtype), name).tobytes() == gguf.quants.quantize(matrix, qtype).tobytes(), name
    # k- and i-quants: gguf-py dequantizes what ggml wrote, within each type's rounding
    for name, bound in (("Q4_K", 0.10), ("Q5_K", 0.05), ("Q6_K", 0.025), ("IQ4_NL", 0.10), ("IQ4_XS", 0.10)):
        qtype = gguf.GGMLQuantizationType[name]
        data = ggml.quantize(matrix, int(qtype), name)
        assert data.shape == (16, ggml.row_size(int(qtype), 512))
        back = gguf.quants.dequantize(data, qtype).reshape(matrix.shape)
        error = np.sqrt(((back - matrix) ** 2).mean() / (matrix ** 2).mean())
        assert 0 < error < bound, (name, error)
    with pytest.raises(NblError, match="IQ2_XS needs an importance matrix"):
        ggml.quantize(matrix, int(gguf.GGMLQuantizationType.IQ2_XS), "IQ2_XS")
    with pytest.raises(NblError, match="ggml has no quantizer for Q8_1"):
        ggml.quantize(matrix, int(gguf.GGMLQuantizationType.Q8_1), "Q8_1")
    with pytest.raises(NblError, match="rows of 96 are not a multiple of Q4_K's blocks of 256"):
        ggml.quantize(matrix[:, :96], int(gguf.GGMLQuantizationType.Q4_K), "Q4_K")


def test_weight_type_follows_attn_output_raised_to_5_bits_or_falls_back(tmp_path):
    """Gemma 3 1B's shape: n_embd 1152 is no multiple of 256, its attn_output rows (4 x 256) are."""
    import gguf

    def attn_output(layer, name):
        qtype = gguf.GGMLQuantizationType[name]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        return f"blk.{layer}.attn_output.weight", np.zeros((1152, 1024 // block * size), np.uint8), qtype

    path = tiny_gguf(tmp_path / "gemma3.gguf", "gemma3", n_embd=1152, n_layer=4,
                     tensors=[attn_output(0, "Q4_K"), attn_output(1, "IQ3_XXS"), attn_output(2, "Q5_0"),
                              attn_output(3, "Q6_K")])
    layers = nbl_format.NblLayers(types=[1] * 4, linear={i: (None, None) for i in range(4)})
    chosen = nbl_format.weight_types(path, layers)
    assert chosen[0] == nbl_format.WeightType("Q5_0", "Q4_K", "has 4.5 bits per weight, W at least 5.5")
    assert chosen[1] == nbl_format.WeightType("Q5_0", "IQ3_XXS", "has 3.0625 bits per weight, W at least 5.5")
    assert chosen[2] == nbl_format.WeightType("Q5_0")
    assert chosen[3] == nbl_format.WeightType("Q8_0", "Q6_K", "cannot hold the 1152 x 1152 matrix: rows of 1152 "
                                                              "are not a multiple of its blocks of 256")
    assert {w.name for w in nbl_format.weight_types(path, layers, "iq4_nl").values()} == {"IQ4_NL"}
    with pytest.raises(NblError, match=r"--nbl-type q6_k cannot hold the 1152 x 1152 NBL weight: rows of 1152 are "
                                       r"not a multiple of its blocks of 256; use one of f32, f16, bf16, .*q8_0"):
        nbl_format.weight_types(path, layers, "q6_k")
    # where K-quant rows fit, a 4-bit W becomes a 5-bit K-quant; 5.5 bits and more are kept
    assert nbl_format.default_weight_type("Q4_K", 4096).name == "Q5_K"
    assert nbl_format.default_weight_type("Q4_1", 576) == nbl_format.WeightType(
        "Q5_0", "Q4_1", "has 5 bits per weight, W at least 5.5")
    for kept in ("Q5_K", "Q6_K", "Q8_0", "F16", "BF16", "F32"):
        assert nbl_format.default_weight_type(kept, 4096) == nbl_format.WeightType(kept)


def test_w_takes_the_importance_matrix_as_llama_quantize_reads_it(tmp_path):
    """With --imatrix, W is quantized with the column weights of its layer's attn_q (the same input).
    Reference: llama-quantize itself, given the same imatrix file, quantizing attn_q to Q5_K: our
    imatrix_columns + ggml quantizer must give its bytes, and differ from the unweighted quantization."""
    import gguf

    from nbl_gguf.fixtures.tiny import TinyLlama
    from nbl_gguf.gguf.quantize import imatrix_columns, quantize
    from nbl_gguf.llamacpp import ggml

    tiny = TinyLlama(n_layer=2, n_embd=256, n_ff=512)
    stock = tiny.write_gguf(tmp_path / "stock-f32.gguf")
    rng = np.random.default_rng(5)
    imatrix = tmp_path / "imatrix.gguf"
    writer = gguf.GGUFWriter(imatrix, arch="imatrix")
    writer.add_array("imatrix.datasets", ["test"])
    writer.add_uint32("imatrix.chunk_count", 3)
    writer.add_uint32("imatrix.chunk_size", 512)
    for layer in range(2):
        for stem in ("attn_q", "attn_k", "attn_v"):
            # squared activations summed over 37 tokens: a wide spread, so the weighting shows
            sums = (rng.standard_normal(256) * np.exp(rng.uniform(-3, 3, 256))) ** 2 * 37
            writer.add_tensor(f"blk.{layer}.{stem}.weight.in_sum2", sums.astype(np.float32).reshape(1, 256))
            writer.add_tensor(f"blk.{layer}.{stem}.weight.counts", np.array([[37.0]], np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    quantized = quantize(stock, tmp_path / "stock-q5_k.gguf", "q8_0", imatrix=imatrix,
                         extra_args=["--tensor-type", "attn_q=q5_k"])
    reference = {t.name: t for t in gguf.GGUFReader(quantized).tensors}["blk.1.attn_q.weight"]
    assert reference.tensor_type.name == "Q5_K"
    weight = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(stock).tensors}["blk.1.attn_q.weight"]
    columns = imatrix_columns(imatrix, ["blk.1.attn_q.weight"])
    q5_k = int(gguf.GGMLQuantizationType.Q5_K)
    ours = ggml.quantize(weight, q5_k, "Q5_K", columns)
    assert ours.tobytes() == np.asarray(reference.data).tobytes()
    assert ggml.quantize(weight, q5_k, "Q5_K").tobytes() != ours.tobytes()
    # the NBL weight of layer 1 takes attn_q's columns; a fused attn_qkv or no entry at all is looked up too
    layers = nbl_format.NblLayers(types=[0, 1], linear=tiny.random_linear([1]), method="attn-nbl")
    typed = nbl_format.weight_types(quantized, layers, "q5_k", imatrix=imatrix)
    np.testing.assert_array_equal(typed[1].importance, columns)
    assert imatrix_columns(imatrix, ["blk.1.attn_qkv.weight"]) is None


# --- the embedded SmolLM2 Q4_1 GGUF through convert ---------------------------------------------

@pytest.fixture(scope="module")
def embedded_gguf() -> Path:
    from nbl_gguf.models import embedded_gguf_path

    return embedded_gguf_path()


@pytest.fixture(scope="module")
def smol(embedded_gguf, embedded_calibration, tmp_path_factory):
    """`convert --model SmolLM2-135M-Instruct.Q4_1.gguf --m 4` with the calibration that convert makes of
    that file, small (8 x 256 tokens): the session's (tests/conftest.py); and its artifact."""
    pytest.importorskip("llama_cpp")
    from nbl_gguf.commands.convert import convert

    assert embedded_calibration.report["model"]["gguf"]["file"] == embedded_gguf.name
    assert embedded_calibration.report["data"]["tokens"] == 8 * 256
    output = tmp_path_factory.mktemp("gguf-in") / "out" / "smol-nbl.gguf"
    output.parent.mkdir()
    summary = convert(convert_args(model=str(embedded_gguf), calibration=str(embedded_calibration.path), m=M,
                                   criterion=CRITERION, output=str(output)))
    types = embedded_calibration.layer_types(M, CRITERION, "attn-nbl")
    return summary, output, embedded_calibration, types


@pytest.fixture(scope="module")
def dequantized(embedded_gguf):
    """The model transformers dequantizes from the GGUF, its held-out windows, and how far the
    unmodified file is from it in llama.cpp."""
    from nbl_gguf import models
    from nbl_gguf.model_source import resolve_model

    loaded = models.load_model(str(resolve_model(str(embedded_gguf)).hf_folder()), "fp32", "cpu")
    windows = heldout_windows(loaded.tokenizer)
    stock = deviation(loaded.model, embedded_gguf, windows)
    print(f"stock Q4_1 file vs the dequantized model in PyTorch: {stock}")
    assert stock.top1 > 0.9 and stock.rel_rms < 0.1  # the file and its dequantized model are one model
    return loaded, windows, stock


def test_untouched_tensors_keep_their_bytes(smol, embedded_gguf):
    import gguf

    summary, output, artifact, types = smol
    assert [i for i, t in enumerate(types) if t] == summary.replaced and len(summary.replaced) == M
    w_types = assert_surgery(embedded_gguf, output, types)
    assert set(w_types.values()) == {"Q5_0"}  # every layer's attn_output is Q4_1, raised to 5.5 bits

    # W's bytes are gguf-py's Q5_0 of the calibrated map; b is the map's bias exactly
    out = tensors_of(gguf.GGUFReader(output))
    for layer in summary.replaced:
        weight, bias = artifact.linear(layer, "attn")
        expected = gguf.quants.quantize(np.ascontiguousarray(weight, np.float32), gguf.GGMLQuantizationType.Q5_0)
        assert bytes(out[nbl_format.NBL_WEIGHT.format(layer=layer)].data) == expected.tobytes()
        np.testing.assert_array_equal(out[nbl_format.NBL_BIAS.format(layer=layer)].data, bias.astype(np.float32))

    provenance = json.loads(str(gguf.GGUFReader(output).fields[nbl_format.CALIBRATION_KEY].contents()))
    assert provenance["source_gguf"] == {"file": embedded_gguf.name,
                                         "sha256": hashlib.sha256(embedded_gguf.read_bytes()).hexdigest()}
    assert summary.quant == "Q4_1" and summary.stock_bytes == embedded_gguf.stat().st_size
    # SmolLM2-135M: 30 layers of 3 KV heads x 64 dims, every one caching the whole context (8192 to train)
    assert list(summary.kv) == [4096, 8192]
    for n_ctx, (stock, nbl) in summary.kv.items():
        assert stock.bytes == 30 * n_ctx * 3 * 64 * 2 * 2 and nbl.bytes == stock.bytes * (30 - M) // 30
    table = summary.table()
    assert "stock Q4_1" in table and f"{embedded_gguf.name} itself" in table
    assert (f"NBL weights: Q5_0 in layers {', '.join(map(str, summary.replaced))} (their attn_output's Q4_1 has 5 "
            f"bits per weight, W at least 5.5)") in table
    assert listing(output.parent) == {output.name}  # no temp files left next to it


def test_nbl_file_logits_match_pytorch(smol, dequantized):
    """llama.cpp on the NBL file against PyTorch with the W the file holds (Q5_0, as gguf-py reads it)."""
    summary, output, artifact, types = smol
    loaded, windows, stock = dequantized
    got = deviation(nbl_model(loaded, types, file_linear(output), "Q5_0"), output, windows)
    print(f"NBL Q5_0-map file vs PyTorch NBL: {got}")
    assert got.within(stock), (got, stock)


def test_nbl_type_f16_matches_the_calibrated_maps(smol, dequantized, embedded_gguf, tmp_path):
    """--nbl-type f16 keeps W to f16 rounding: the file then matches PyTorch with the calibration's
    own float32 maps as closely as the unmodified file matches its model."""
    import gguf

    from nbl_gguf.commands.convert import convert

    summary, _, artifact, types = smol
    loaded, windows, stock = dequantized
    output = tmp_path / "nbl-f16.gguf"
    convert(convert_args(model=str(embedded_gguf), calibration=str(artifact.path), m=M, criterion=CRITERION,
                         nbl_type="f16", output=str(output)))
    assert set(assert_surgery(embedded_gguf, output, types).values()) == {"F16"}
    out = tensors_of(gguf.GGUFReader(output))
    for layer in summary.replaced:
        weight = artifact.linear(layer, "attn")[0]
        np.testing.assert_array_equal(out[nbl_format.NBL_WEIGHT.format(layer=layer)].data, weight.astype(np.float16))
    got = deviation(nbl_model(loaded, types, artifact, "F16"), output, windows)
    print(f"NBL F16 file vs PyTorch NBL (calibrated float32 maps): {got}")
    assert got.within(stock), (got, stock)


def test_nbl_type_q8_0_and_refusals(smol, embedded_gguf, tmp_path):
    import gguf

    from nbl_gguf.commands.convert import convert

    summary, _, artifact, types = smol
    output = tmp_path / "out" / "nbl-q8_0.gguf"
    output.parent.mkdir()
    (tmp_path / "refused").mkdir()
    convert(convert_args(model=str(embedded_gguf), calibration=str(artifact.path), m=M, criterion=CRITERION,
                         nbl_type="Q8_0", output=str(output)))
    out = tensors_of(gguf.GGUFReader(output))
    for layer in summary.replaced:
        weight = np.ascontiguousarray(artifact.linear(layer, "attn")[0], np.float32)
        expected = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
        assert bytes(out[nbl_format.NBL_WEIGHT.format(layer=layer)].data) == expected.tobytes()

    refused = {
        "q9_z": r"--nbl-type q9_z: not a ggml tensor type; for n_embd 576 use one of f32, f16, bf16, .*q8_0",
        "q4_k_m": r"q4_k_m is a llama-quantize file type: a mix of tensor types",
        "q4_k": r"--nbl-type q4_k cannot hold the 576 x 576 NBL weight: rows of 576 are not a multiple of its blocks "
                r"of 256",
        "iq2_xxs": r"--nbl-type iq2_xxs cannot hold the 576 x 576 NBL weight: it needs an importance matrix",
    }
    for nbl_type, message in refused.items():
        target = tmp_path / "refused" / f"{nbl_type}.gguf"
        with pytest.raises(NblError, match=message):
            convert(convert_args(model=str(embedded_gguf), calibration=str(artifact.path), m=M, nbl_type=nbl_type,
                                 output=str(target)))
        assert listing(target.parent) == set()
    assert listing(output.parent) == {output.name}


def test_options_that_mean_nothing_for_a_gguf(embedded_gguf, tmp_path, capsys):
    from nbl_gguf import cli
    from nbl_gguf.commands.convert import convert

    output = tmp_path / "out" / "x.gguf"
    output.parent.mkdir()
    with pytest.raises(NblError, match=r"--quant q8_0 means nothing for a GGUF --model: the NBL file keeps every "
                                       r"tensor of SmolLM2-135M-Instruct.Q4_1.gguf as it is"):
        convert(convert_args(model=str(embedded_gguf), quant="q8_0", output=str(output)))
    with pytest.raises(NblError, match="--imatrix means nothing for a GGUF --model"):
        convert(convert_args(model=str(embedded_gguf), imatrix=True, output=str(output)))
    with pytest.raises(NblError, match="--intermediate f16 means nothing for a GGUF --model: no stock conversion"):
        convert(convert_args(model=str(embedded_gguf), intermediate="f16", output=str(output)))
    with pytest.raises(NblError, match="-o .* is the --model file itself"):
        convert(convert_args(model=str(embedded_gguf), output=str(embedded_gguf)))
    assert cli.main(["convert", "--model", str(embedded_gguf), "--quant", "q4_k_m", "-o", str(output)]) == 2
    assert "means nothing for a GGUF --model" in capsys.readouterr().err
    # asked for explicitly, even as the HF default: refused; left out (every other GGUF conversion here): no error
    assert cli.main(["convert", "--model", str(embedded_gguf), "--intermediate", "f32", "-o", str(output)]) == 2
    assert "--intermediate f32 means nothing for a GGUF --model" in capsys.readouterr().err
    assert listing(output.parent) == set()


def test_bad_gguf_inputs_are_refused_by_name(embedded_gguf, smol, tmp_path):
    from nbl_gguf.commands.convert import convert

    bad = tmp_path / "bad"
    bad.mkdir()
    inputs = {
        tiny_gguf(bad / "gpt2.gguf", "gpt2"):
            r"is a 'gpt2' model; the patched llama.cpp runs NBL layers for llama, qwen2, .* only",
        tiny_gguf(bad / "smollm3.gguf", "smollm3"):
            r"is a 'smollm3' model, which transformers' GGUF loader cannot read \(it reads .*llama.*\)",
        smol[1]: "is already an NBL GGUF",
    }
    truncated = bad / "truncated.gguf"
    truncated.write_bytes(embedded_gguf.read_bytes()[: embedded_gguf.stat().st_size // 2])
    inputs[truncated] = r"is not a readable GGUF \(truncated or damaged\?\)"
    header_only = bad / "header.gguf"
    header_only.write_bytes(embedded_gguf.read_bytes()[:4096])
    inputs[header_only] = r"is not a readable GGUF \(truncated or damaged\?\)"
    not_gguf = bad / "model.gguf"
    not_gguf.write_text("<html>404 Not Found</html>")
    inputs[not_gguf] = r"is a file but not a GGUF \(it does not start with 'GGUF'\)"
    inputs[bad / "missing.gguf"] = "no such folder or file"
    (tmp_path / "out").mkdir()

    for path, message in inputs.items():
        output = tmp_path / "out" / f"{path.stem}-nbl.gguf"
        with pytest.raises(NblError, match=message):
            convert(convert_args(model=str(path), m=2, output=str(output)))
        assert listing(tmp_path / "out") == set(), path
    # the architecture that transformers cannot read is fine with a calibration made elsewhere: the
    # check is the calibration's, and the next complaint is about the artifact
    with pytest.raises(NblError, match="no such artifact directory"):
        convert(convert_args(model=str(bad / "smollm3.gguf"), calibration=str(bad / "none"), m=1,
                             output=str(tmp_path / "out" / "x.gguf")))


# --- calibrate and eval --sweep take a GGUF too ---------------------------------------------------

def test_calibrate_on_a_gguf_is_calibrating_its_dequantized_model(embedded_gguf, tmp_path):
    """calibrate --model file.gguf gives the maps of calibrating the folder transformers makes of it,
    and records the file."""
    import argparse

    from nbl_gguf.commands import calibrate
    from nbl_gguf.calibration.artifact import load_artifact
    from nbl_gguf.model_source import resolve_model

    def run(model, output):
        parser = argparse.ArgumentParser()
        calibrate.add_arguments(parser)
        args = parser.parse_args(["--model", model, "--nsamples", "8", "--seqlen", "128", "--device", "cpu",
                                  "--m", "2", "--criterion", "cosine", "--targets", "attn", "-o", str(output)])
        assert calibrate.run(args) == 0
        return load_artifact(output)

    from_file = run(str(embedded_gguf), tmp_path / "from-gguf")
    from_folder = run(str(resolve_model(str(embedded_gguf)).hf_folder()), tmp_path / "from-folder")
    model = from_file.report["model"]
    assert model["name"] == embedded_gguf.stem
    assert model["gguf"] == {"file": embedded_gguf.name, "sha256": hashlib.sha256(embedded_gguf.read_bytes()).hexdigest()}
    assert "gguf" not in from_folder.report["model"]
    for layer in range(from_file.num_layers):
        for a, b in zip(from_file.linear(layer, "attn"), from_folder.linear(layer, "attn")):
            np.testing.assert_array_equal(a, b)


def test_sweep_on_a_gguf_measures_the_file_and_its_surgery(embedded_gguf, smol, tmp_path):
    import argparse
    import csv

    from nbl_gguf.commands import eval as eval_command

    _, _, artifact, _ = smol
    parser = argparse.ArgumentParser()
    eval_command.add_arguments(parser)
    common = ["--sweep", "--model", str(embedded_gguf), "--calibration", str(artifact.path), "--m", "2",
              "--methods", "attn-nbl", "--criterion", "cca", "--extra-criteria", "--criteria-m", "0",
              "--no-pytorch", "--no-bench", "--chunks", "1", "-c", "128", "--work", str(tmp_path / "work")]
    with pytest.raises(NblError, match="--quant means nothing for a GGUF --model"):
        eval_command.run(parser.parse_args(common + ["--quant", "q8_0"]))
    assert eval_command.run(parser.parse_args(common)) == 0

    rows = list(csv.DictReader(open(tmp_path / "work" / "quality.csv", encoding="utf-8")))
    assert {(r["method"], r["m"], r["backend"], r["quant"]) for r in rows} == {
        ("baseline", "0", "llama.cpp", "q4_1"), ("attn-nbl", "2", "llama.cpp", "q4_1")}
    # the baseline is the input file itself; the NBL configuration is the surgery on it
    assert [int(r["file_bytes"]) for r in rows if r["method"] == "baseline"] == [embedded_gguf.stat().st_size]
    [nbl] = list((tmp_path / "work").glob("gguf-*/attn-nbl-cca-m2-q4_1.gguf"))
    assert_surgery(embedded_gguf, nbl, artifact.layer_types(2, "cca", "attn-nbl"))
    assert not list((tmp_path / "work").glob("gguf-*/baseline*"))


# --- a second real model: Qwen2.5-Coder-0.5B-Instruct Q4_K_M --------------------------------------

@pytest.fixture(scope="module")
def qwen_gguf() -> Path:
    from nbl_gguf.fixtures import packaged

    try:
        return packaged.assemble(packaged.QWEN_CODER_05B)
    except NblError as error:
        pytest.skip(f"Qwen2.5-Coder-0.5B-Instruct Q4_K_M not available: {error}")


@pytest.mark.slow
def test_qwen_coder_q4_k_m_end_to_end(qwen_gguf, tmp_path):
    """The issue's case: `convert --model ...Q4_K_M.gguf --m 4` writes a file whose untouched tensors are
    the input's own bytes, that the patched llama-cli runs, and whose logits match PyTorch."""
    pytest.importorskip("llama_cpp")
    from nbl_gguf import models
    from nbl_gguf.calibration.artifact import load_artifact
    from nbl_gguf.commands.convert import convert
    from nbl_gguf.model_source import resolve_model

    output = tmp_path / "qwen-nbl4.gguf"
    summary = convert(convert_args(model=str(qwen_gguf), m=M, nsamples=8, seqlen=256, criterion=CRITERION,
                                   output=str(output), save_calibration=str(tmp_path / "calibration"),
                                   no_eval=False, eval_chunks=1))
    artifact = load_artifact(tmp_path / "calibration")
    types = artifact.layer_types(M, CRITERION, "attn-nbl")
    assert [i for i, t in enumerate(types) if t] == summary.replaced
    assert set(assert_surgery(qwen_gguf, output, types).values()) == {"Q5_0"}  # this file's attn_output type
    assert summary.quant == "Q4_K_M" and summary.n_layer == 24
    assert set(summary.heldout) == {"c4", "prose", "code"}
    assert all(measured["stock"] > 1 and measured["nbl"] > 1 for measured in summary.heldout.values())
    print(summary.table())

    cli = subprocess.run(
        [str(bin_dir() / "llama-cli"), "-m", str(output), "-p", "Write a Python function that adds two numbers.",
         "-n", "16", "--temp", "0", "--single-turn", "--simple-io", "--no-warmup", "-c", "256"],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert cli.returncode == 0, cli.stderr[-2000:]
    answer = cli.stdout.split("adds two numbers.", 1)[-1]
    assert answer.strip(), cli.stdout[-2000:]
    print(f"llama-cli: {answer.strip()!r}")

    loaded = models.load_model(str(resolve_model(str(qwen_gguf)).hf_folder()), "fp32", "cpu")
    windows = heldout_windows(loaded.tokenizer, window=128, count=2)
    stock = deviation(loaded.model, qwen_gguf, windows)
    got = deviation(nbl_model(loaded, types, file_linear(output), "Q5_0"), output, windows)
    print(f"stock Q4_K_M vs PyTorch: {stock}\nNBL file vs PyTorch NBL: {got}")
    assert stock.top1 > 0.9
    assert got.within(stock), (got, stock)
