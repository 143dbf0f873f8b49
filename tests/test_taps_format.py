"""Taps layers (type 3) in the GGUF: what the writer stores (key, tensors, layout, types), what it
refuses by name, the stock layout's refusal, and what `inspect` shows (no llama.cpp needed)."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from nbl_gguf import cli
from nbl_gguf.errors import NblError
from nbl_gguf.fixtures.tiny import TinyLlama
from nbl_gguf.gguf import nbl_format, stock_layout

A, L, D, T = nbl_format.ATTENTION, nbl_format.LINEAR, nbl_format.DROPPED, nbl_format.TAPS


@pytest.fixture()
def stock(tmp_path):
    model = TinyLlama(n_layer=4, seed=2)
    return model, model.write_gguf(tmp_path / "stock.gguf")


def tensors_of(path):
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def test_writer_stores_each_form_in_the_documented_layout(tmp_path, stock):
    model, src = stock
    d = model.n_embd
    maps = {**model.random_taps([0], 3, "full"), **model.random_taps([2], 3, "lowrank", rank=8, seed=4),
            **model.random_taps([3], 3, "channel", seed=5)}
    types = [T, A, T, T]
    out = nbl_format.write_nbl_gguf(src, tmp_path / "taps.gguf",
                                    nbl_format.NblLayers(types=types, taps=maps), weight_type="F32")
    reader = gguf.GGUFReader(out)
    assert reader.fields["llama.nbl.taps"].contents() == 3
    assert nbl_format.read_layer_types(reader) == types
    tensors = tensors_of(out)
    # GGUF shapes are ne0 first: the lag maps take (K-1) d inputs
    assert list(tensors["blk.0.attn_nbl_lag.weight"].shape) == [2 * d, d]
    assert list(tensors["blk.2.attn_nbl_lag_down.weight"].shape) == [2 * d, 8]
    assert list(tensors["blk.2.attn_nbl_lag_up.weight"].shape) == [8, d]
    assert list(tensors["blk.3.attn_nbl_conv.weight"].shape) == [d, 3]
    assert not any(name.startswith(("blk.0.attn_q", "blk.2.attn_k", "blk.3.attn_output")) for name in tensors)
    # the values, read back in numpy order, are the map's
    np.testing.assert_array_equal(tensors["blk.0.attn_nbl_lag.weight"].data, maps[0].lag)
    np.testing.assert_array_equal(tensors["blk.3.attn_nbl_conv.weight"].data, maps[3].conv)
    # quantized W: the lag maps follow it, the low-rank up map (rows of 8) falls back, conv stays F32
    q = nbl_format.write_nbl_gguf(src, tmp_path / "q.gguf", nbl_format.NblLayers(types=types, taps=maps),
                                  weight_type="Q8_0")
    kinds = {name: t.tensor_type.name for name, t in tensors_of(q).items() if "attn_nbl" in name}
    assert kinds["blk.0.attn_nbl_lag.weight"] == kinds["blk.2.attn_nbl_lag_down.weight"] == "Q8_0"
    assert kinds["blk.2.attn_nbl_lag_up.weight"] == "F16" and kinds["blk.3.attn_nbl_conv.weight"] == "F32"
    assert kinds["blk.3.attn_nbl.bias"] == "F32"


def bad(model, **changes):
    taps_map = model.random_taps([1], 3, "full")[1]
    for key, value in changes.items():
        setattr(taps_map, key, value)
    return taps_map


@pytest.mark.parametrize("case, message", [
    ("lag-shape", r"layer 1: taps tensor lag has shape \(64, 64\), expected \(64, 128\)"),
    ("both", r"layer 1: a taps map has a full \(lag\) or a low-rank \(lag_down, lag_up\) lag map, not both"),
    ("none", r"layer 1: a taps map needs lag, lag_down and lag_up, or conv"),
    ("half", r"layer 1: lag_down and lag_up come together"),
    ("nan", r"layer 1: taps tensor lag is not finite"),
    ("one-tap", r"layer 1: a taps layer reads 2 to 64 tokens, not 1"),
])
def test_writer_refuses_a_malformed_map_by_name(tmp_path, stock, case, message):
    model, src = stock
    d = model.n_embd
    lag = np.zeros((d, 2 * d), np.float32)
    lag[3, 4] = np.nan
    taps_map = {
        "lag-shape": lambda: bad(model, lag=np.zeros((d, d), np.float32)),
        "both": lambda: bad(model, lag_down=np.zeros((4, 2 * d), np.float32), lag_up=np.zeros((d, 4), np.float32)),
        "none": lambda: bad(model, lag=None),
        "half": lambda: bad(model, lag=None, lag_down=np.zeros((4, 2 * d), np.float32)),
        "nan": lambda: bad(model, lag=lag),
        "one-tap": lambda: bad(model, taps=1),
    }[case]()
    out = tmp_path / "out.gguf"
    with pytest.raises(NblError, match=message):
        nbl_format.write_nbl_gguf(src, out, nbl_format.NblLayers(types=[A, T, A, A], taps={1: taps_map}))
    assert list(tmp_path.glob("*out.gguf*")) == []


def test_writer_refuses_mixed_taps_counts_and_maps_on_the_wrong_layers(tmp_path, stock):
    model, src = stock
    maps = {**model.random_taps([1], 3), **model.random_taps([2], 4)}
    with pytest.raises(NblError, match=r"taps layers read \[3, 4\] tokens"):
        nbl_format.write_nbl_gguf(src, tmp_path / "o.gguf", nbl_format.NblLayers(types=[A, T, T, A], taps=maps))
    with pytest.raises(NblError, match="layer 2: taps maps must be given exactly for type-3 layers"):
        nbl_format.write_nbl_gguf(src, tmp_path / "o.gguf", nbl_format.NblLayers(types=[A, T, L, A], taps=maps,
                                                                                 linear=model.random_linear([2])))


def test_stock_layout_refuses_taps_layers(tmp_path, stock):
    model, src = stock
    layers = nbl_format.NblLayers(types=[A, T, A, A], taps=model.random_taps([1], 3))
    with pytest.raises(NblError, match=r"layers \[1\] are taps layers.*deci graph \(--runtime stock\) keeps no such "
                                       r"state: use --runtime nbl"):
        stock_layout.write_stock_gguf(src, tmp_path / "deci.gguf", layers)
    assert not (tmp_path / "deci.gguf").exists()


def test_inspect_shows_taps_layers_and_their_state(tmp_path, stock, capsys):
    model, src = stock
    out = nbl_format.write_nbl_gguf(src, tmp_path / "taps.gguf", nbl_format.NblLayers(
        types=[T, L, D, T], taps=model.random_taps([0, 3], 4), linear=model.random_linear([1])))
    assert cli.main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "4 of 4 attention layers replaced (1 linear, 1 dropped, 2 taps)" in text
    # 2 layers x 3 earlier inputs x 64 floats x 4 bytes
    assert "taps:          each taps layer reads 4 tokens; state 1,536 bytes per sequence" in text
    assert "    0  taps" in text and "attn_nbl_lag:F32" in text
    assert cli.main(["inspect", "--json", str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["replaced"] == {"linear": 1, "dropped": 1, "taps": 2}
    assert info["taps"] == {"taps": 4, "layers": 2, "state_bytes_per_sequence": 2 * 3 * model.n_embd * 4}
    assert info["kv_bytes_per_token"]["file"] == 0
    assert info["stock_llama_cpp_runs_it"] is False
