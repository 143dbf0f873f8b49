"""Window layers in the GGUF (docs/gguf-format.md, "Window layers"): what the writer puts in the file
and reads back, what it refuses, and the KV figures inspect gives for them against llama.cpp's rule."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from nbl_gguf import kv_cache
from nbl_gguf.errors import NblError
from nbl_gguf.fixtures.tiny import TinyLlama
from nbl_gguf.gguf import inspect as gguf_inspect
from nbl_gguf.gguf import metadata
from nbl_gguf.gguf import nbl_format

A, L = nbl_format.ATTENTION, nbl_format.LINEAR


def write(tmp_path, types, windows, source_kv=None):
    tiny = TinyLlama(n_layer=len(types), seed=4)
    stock = tiny.write_gguf(tmp_path / "stock.gguf", extra_kv=source_kv)
    layers = nbl_format.NblLayers(types=types, linear=tiny.random_linear([i for i, t in enumerate(types) if t == L]),
                                  windows=windows)
    return nbl_format.write_nbl_gguf(stock, tmp_path / "window.gguf", layers)


def test_upstream_keys_and_the_sinks_are_written_and_read_back(tmp_path):
    windows = nbl_format.Windows(layers=(0, 3), size=512, sinks=4)
    # a stock converter's own sliding_window key is replaced, not duplicated
    path = write(tmp_path, [A, L, A, A], windows,
                 source_kv={"llama.attention.sliding_window": (4096, gguf.GGUFValueType.UINT32, None)})
    reader = gguf.GGUFReader(path)
    assert reader.fields["llama.attention.sliding_window"].contents() == 512
    assert reader.fields["llama.attention.sliding_window_pattern"].contents() == [True, False, False, True]
    assert reader.fields["llama.attention.sliding_window_pattern"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL]
    assert reader.fields["llama.nbl.window_sinks"].contents() == 4
    assert nbl_format.read_windows(reader) == windows
    info = gguf_inspect.describe(path, n_ctx=4096)
    assert [layer["type"] for layer in info["layers"]] == ["window", "linear", "attention", "window"]
    assert info["windows"] == {"layers": [0, 3], "size": 512, "sinks": 4}
    text = gguf_inspect.format_text(info)
    assert "2 layers attend to the last 512 tokens and the first 4 (sinks)" in text


def test_inspect_gives_the_window_cache_at_the_micro_batch_asked_for(tmp_path, capsys):
    from nbl_gguf import cli

    path = write(tmp_path, [A, L, A, A], nbl_format.Windows(layers=(0, 3), size=512, sinks=4))
    for n_ubatch, cells in ((None, 1280), (128, 768)):  # pad256(512 + 4 + n_ubatch), llama.cpp's 512 by default
        assert cli.main(["inspect", "-c", "4096", str(path), *(["-ub", str(n_ubatch)] if n_ubatch else [])]) == 0
        text = capsys.readouterr().out
        assert f"sliding-window layers (window 512 + 4 sinks): 2 cache {cells:,} cells" in text, text
        assert f"n_ubatch {n_ubatch or 512}," in text


@pytest.mark.parametrize("types, windows, message", [
    ([A, L, A], nbl_format.Windows(layers=(1,), size=8), "layer 1 is a window layer and an NBL linear layer"),
    ([A, A, A], nbl_format.Windows(layers=(3,), size=8), "window layer 3 does not exist"),
    ([A, A, A], nbl_format.Windows(layers=(0,), size=0), "a window of 0 tokens"),
    ([A, A, A], nbl_format.Windows(layers=(0,), size=8, sinks=-1), "-1 attention sinks"),
    ([A, A, A], nbl_format.Windows(layers=(), size=8), "none given"),
    ([A, A, A], nbl_format.Windows(layers=(1, 1), size=8), "repeat a layer"),
])
def test_bad_windows_are_refused_and_nothing_is_written(tmp_path, types, windows, message):
    with pytest.raises(NblError, match=message):
        write(tmp_path, types, windows)
    assert not (tmp_path / "window.gguf").exists()


def test_a_file_with_sliding_layers_of_its_own_is_refused(tmp_path):
    pattern = {"llama.attention.sliding_window_pattern": ([True, False], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL)}
    with pytest.raises(NblError, match="already marks sliding-window layers"):
        write(tmp_path, [A, A], nbl_format.Windows(layers=(0,), size=8), source_kv=pattern)


@pytest.mark.parametrize("n_ctx, n_seq, unified, want", [
    (32768, 1, False, 1280),   # pad256(512 + 4 + 512)
    (1024, 1, False, 1024),    # never more than the context
    (32768, 4, True, 2816),    # pad256((512 + 4) * 4 + 512 = 2576): a unified cache holds a window per sequence
    (32768, 4, False, 1280),   # a stream per sequence, each with one window
])
def test_window_cache_cells_follow_llama_cpps_rule_with_the_sinks(n_ctx, n_seq, unified, want):
    model = kv_cache.KvModel(layers=(kv_cache.KvLayer(64, 64), kv_cache.KvLayer(64, 64, sliding=True)), window=512, sinks=4)
    cells = kv_cache.cache_cells(model, kv_cache.Context(n_ctx=n_ctx, n_seq_max=n_seq, kv_unified=unified))
    assert cells[kv_cache.SLIDING] == want


def test_inspect_counts_the_stock_model_with_every_layer_global(tmp_path):
    path = write(tmp_path, [A, A, A, A], nbl_format.Windows(layers=(1, 2), size=100, sinks=4))
    size_stock, size_file = metadata.kv_sizes(gguf.GGUFReader(path), 32768)
    assert list(size_stock.caches) == [kv_cache.GLOBAL] and size_stock.caches[kv_cache.GLOBAL].layers == 4
    assert size_file.caches[kv_cache.SLIDING].cells == 768 and size_file.caches[kv_cache.SLIDING].layers == 2
    assert size_file.bytes == pytest.approx(size_stock.bytes * (2 * 32768 + 2 * 768) / (4 * 32768))


def test_an_architecture_with_sliding_layers_of_its_own_is_refused(tmp_path):
    """gemma2 and gemma3 slide by llama.cpp's own rule for them; every other architecture takes window layers."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("make_seeds", Path(__file__).resolve().parent.parent / "fuzz" / "make_seeds.py")
    seeds = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_seeds", seeds)  # its dataclasses look their module up there
    spec.loader.exec_module(seeds)
    stock = seeds.write_seed(tmp_path / "gemma2.gguf", "gemma2", seeds.Seed("gemma2", None))
    layers = nbl_format.NblLayers(types=[A, A, A], windows=nbl_format.Windows(layers=(1,), size=8))
    with pytest.raises(NblError, match="'gemma2' model; the patched llama.cpp runs window layers for "
                                       "llama, qwen2, qwen3, phi3, smollm3 only"):
        nbl_format.write_nbl_gguf(stock, tmp_path / "out.gguf", layers)
    assert not list(tmp_path.glob("*out.gguf*"))


def test_the_maps_digest_changes_with_any_map_and_type_only():
    """NblLayers.maps_digest keys a window choice made on top of replaced layers (convert --windows, kept on disk):
    the same maps give the same digest; a changed value, type or taps field another."""
    from nbl_gguf.calibration.taps import TapsMap

    tiny = TinyLlama(n_layer=4, seed=4)

    def layers(**change):
        linear = tiny.random_linear([1])
        taps = {2: TapsMap(4, np.eye(tiny.n_embd), np.zeros(tiny.n_embd), lag=np.ones((tiny.n_embd, 3 * tiny.n_embd)))}
        types = [A, L, nbl_format.TAPS, A]
        if "weight" in change:
            linear[1][0][0, 0] += change["weight"]
        if "taps" in change:
            taps[2].lag[1, 2] = change["taps"]
        if "types" in change:
            types = change["types"]
        return nbl_format.NblLayers(types=types, linear=linear, taps=taps, windows=change.get("windows"))

    base = layers().maps_digest()
    assert layers().maps_digest() == base
    assert layers(windows=nbl_format.Windows(layers=(0,), size=8, sinks=2)).maps_digest() == base  # not a map
    others = [layers(weight=1e-6), layers(taps=0.5), layers(types=[L, L, nbl_format.TAPS, A])]
    assert len({base, *(other.maps_digest() for other in others)}) == 4
    assert nbl_format.NblLayers(types=[A] * 4).maps_digest() != nbl_format.NblLayers(types=[A] * 5).maps_digest()
