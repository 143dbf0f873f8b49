"""The KV cache figures of `convert` and `inspect` (nbl_gguf.kv_cache) against the caches the patched
libllama allocates for stock and NBL files of sliding-window models (Gemma 2, Gemma 3) and plain ones
(llama, and its stock layout, deci), and against hand arithmetic for Gemma-3-270M."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nbl_gguf.errors import NblError
from nbl_gguf.gguf import nbl_format
from nbl_gguf.kv_cache import Context, KvLayer, KvModel, cache_cells, cache_context, kv_size
from nbl_gguf.llamacpp.cache_types import cache_type_flags, split_cache_type

A, L, D = nbl_format.ATTENTION, nbl_format.LINEAR, nbl_format.DROPPED
MIB = 1024 * 1024


# --- hand arithmetic ---------------------------------------------------------------------------------

def gemma3_270m_metadata(path: Path, arch: str = "gemma3", pattern=None, window: int | None = 512) -> Path:
    """A GGUF with Gemma-3-270M's attention keys and no tensors: 18 layers, 4 heads, 1 KV head of 256
    dims, a 512-token window (None: no sliding_window key), every sixth layer global (llama.cpp's
    default pattern for gemma3)."""
    import gguf

    writer = gguf.GGUFWriter(path, arch=arch)
    if pattern is not None:
        writer.add_sliding_window_pattern(pattern)
    writer.add_context_length(32768)
    writer.add_embedding_length(640)
    writer.add_block_count(18)
    writer.add_head_count(4)
    writer.add_head_count_kv(1)
    writer.add_key_length(256)
    writer.add_value_length(256)
    if window is not None:
        writer.add_sliding_window(window)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Gemma-3-270M: per layer and cell, K and V of 1 head x 256 dims in F16 = 1024 bytes; layers 5, 11, 17
# are global, the 15 others slide over 512 tokens: pad256(min(n_ctx, 512 + n_ubatch 512)) = 1024 cells
CELL = 2 * 256 * 2
M4 = [0, 1, 2, 5]  # three sliding layers and one global one: the m = 4 of issue 22


def test_gemma3_270m_by_hand(tmp_path):
    import gguf

    from nbl_gguf.gguf.metadata import kv_model, kv_sizes

    reader = gguf.GGUFReader(gemma3_270m_metadata(tmp_path / "gemma-3-270m.gguf"))
    model = kv_model(reader)
    assert model.window == 512
    assert [i for i, layer in enumerate(model.layers) if not layer.sliding] == [5, 11, 17]
    types = [L if i in M4 else A for i in range(18)]
    for n_ctx, stock_bytes, nbl_bytes in ((4096, 3 * 4096 * CELL + 15 * 1024 * CELL, 2 * 4096 * CELL + 12 * 1024 * CELL),
                                          (32768, 3 * 32768 * CELL + 15 * 1024 * CELL, 2 * 32768 * CELL + 12 * 1024 * CELL)):
        stock, nbl = kv_sizes(reader, n_ctx, types)
        assert (stock.bytes, nbl.bytes) == (stock_bytes, nbl_bytes)
        assert stock.caches["global"].cells == n_ctx and stock.caches["sliding"].cells == 1024
        assert (nbl.caches["global"].layers, nbl.caches["sliding"].layers) == (2, 12)
        assert nbl.per_layer[5] == 0 and nbl.per_layer[11] == n_ctx * CELL and nbl.per_layer[3] == 1024 * CELL
    # the figures of issue 22: 27 MiB -> 20 MiB at 4096 (-25.9%), 111 MiB -> 76 MiB at 32768 (-31.5%)
    assert [size.bytes / MIB for size in kv_sizes(reader, 4096, types)] == [27.0, 20.0]
    assert [size.bytes / MIB for size in kv_sizes(reader, 32768, types)] == [111.0, 76.0]
    # the flat count it replaces: 18 layers x 4096 cells = 72 MiB
    assert 18 * 4096 * CELL / MIB == 72.0


def test_gemma3_270m_summary_rows(tmp_path):
    import gguf

    from nbl_gguf.commands.convert_summary import Summary
    from nbl_gguf.gguf.metadata import kv_sizes

    reader = gguf.GGUFReader(gemma3_270m_metadata(tmp_path / "gemma-3-270m.gguf"))
    types = [L if i in M4 else A for i in range(18)]
    summary = Summary(model="gemma-3-270m", quant="Q4_K_M", method="attn-nbl", criterion="best", n_layer=18,
                      replaced=M4, scores=None, stock_bytes=2 * MIB, nbl_bytes=MIB, output=Path("x.gguf"),
                      kv={n: kv_sizes(reader, n, types) for n in (4096, 32768)})
    rows = [" ".join(line.split()) for line in summary.table().splitlines()]
    for row in ("KV cache at 4,096 tokens (F16) 27.00 MiB 20.00 MiB -25.9%",
                "global layers: 4,096 cells 12.00 MiB 8.00 MiB -33.3%",
                "sliding-window layers: 1,024 cells 15.00 MiB 12.00 MiB -20.0%",
                "KV cache at 32,768 tokens (F16) 111.00 MiB 76.00 MiB -31.5%",
                "global layers: 32,768 cells 96.00 MiB 64.00 MiB -33.3%",
                "sliding-window layers: 1,024 cells 15.00 MiB 12.00 MiB -20.0%"):
        assert row in rows


def test_which_layers_slide(tmp_path, capsys):
    import gguf

    from nbl_gguf import cli
    from nbl_gguf.gguf.metadata import kv_model

    def global_layers(path):
        return [i for i, layer in enumerate(kv_model(gguf.GGUFReader(path)).layers) if not layer.sliding]

    # sliding_window_pattern overrides llama.cpp's default for the architecture: a period, or one flag per layer
    assert global_layers(gemma3_270m_metadata(tmp_path / "p4.gguf", pattern=4)) == [3, 7, 11, 15]
    flags = [i % 3 != 0 for i in range(18)]
    assert global_layers(gemma3_270m_metadata(tmp_path / "flags.gguf", pattern=flags)) == [0, 3, 6, 9, 12, 15]
    with pytest.raises(NblError, match="sliding_window_pattern has 17 flags for 18 layers"):
        kv_model(gguf.GGUFReader(gemma3_270m_metadata(tmp_path / "short.gguf", pattern=flags[:17])))
    # llama.cpp's gemma2 slides every other layer from 0; qwen2 never slides, whatever the key says
    assert global_layers(gemma3_270m_metadata(tmp_path / "gemma2.gguf", arch="gemma2")) == list(range(1, 18, 2))
    assert global_layers(gemma3_270m_metadata(tmp_path / "qwen2.gguf", arch="qwen2")) == list(range(18))
    # an architecture whose rules these figures do not know says so
    assert cli.main(["inspect", str(gemma3_270m_metadata(tmp_path / "cohere2.gguf", arch="cohere2"))]) == 0
    assert "cohere2: llama.cpp's sliding-window layers of this architecture are not modelled" in capsys.readouterr().out


GEMMA3_270M_CONFIG = {"num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                      "hidden_size": 640}


@pytest.mark.parametrize("arch, model_type, window", [
    ("gemma3", "gemma3_text", 512),
    ("gemma3", "gemma3", 512),
    ("gemma2", "gemma2", 512),
    ("gemma2", "gemma2", None),  # no window given: llama.cpp's and transformers' default, 4096
    ("qwen2", "qwen2", 512),  # a window key llama.cpp ignores: every layer global
])
def test_a_config_and_its_gguf_get_the_same_layout(tmp_path, arch, model_type, window):
    """One architecture table serves a GGUF's metadata and a HF config: the config of a model and
    the GGUF the converter makes of it slide the same layers over the same window."""
    import gguf

    from nbl_gguf.gguf.metadata import kv_model
    from nbl_gguf.kv_cache import model_from_config

    path = gemma3_270m_metadata(tmp_path / f"{arch}.gguf", arch=arch, window=window)
    config = {"model_type": model_type, **GEMMA3_270M_CONFIG, **({} if window is None else {"sliding_window": window})}
    from_gguf = kv_model(gguf.GGUFReader(path))
    assert model_from_config(config) == from_gguf
    assert from_gguf.window == (0 if arch == "qwen2" else window or 4096)


def test_cells_follow_llama_cpp_rules():
    sliding = KvModel(layers=(KvLayer(256, 256, sliding=True), KvLayer(256, 256)), window=512)
    plain = KvModel(layers=(KvLayer(256, 256),))
    assert cache_cells(plain, Context(n_ctx=1000)) == {"global": 1024}  # padded to 256
    assert cache_cells(sliding, Context(n_ctx=100)) == {"global": 256, "sliding": 256}  # never past the context
    assert cache_cells(sliding, Context(n_ctx=4096)) == {"global": 4096, "sliding": 1024}
    assert cache_cells(sliding, Context(n_ctx=4096, swa_full=True)) == {"global": 4096, "sliding": 4096}
    assert cache_cells(sliding, Context(n_ctx=4096, n_batch=256)) == {"global": 4096, "sliding": 768}
    # llama-server's default: 4 sequences in one unified cache keep 4 windows; apart, each its own stream
    assert cache_cells(sliding, Context(n_ctx=8192, n_seq_max=4, kv_unified=True)) == {"global": 8192, "sliding": 2560}
    assert cache_cells(sliding, Context(n_ctx=8192, n_seq_max=4)) == {"global": 2048, "sliding": 1024}
    assert kv_size(sliding, Context(n_ctx=8192, n_seq_max=4)).bytes == 4 * (2048 + 1024) * 2 * 256 * 2
    # q8_0 blocks: 32 values in 34 bytes
    assert kv_size(plain, Context(n_ctx=256, type_k="q8_0")).caches["global"].k_bytes == 256 * 256 // 32 * 34


def test_a_cache_type_names_k_and_v_or_both():
    assert split_cache_type("q8_0") == ("q8_0", "q8_0")
    assert split_cache_type("Q8_0/q4_0") == ("q8_0", "q4_0")
    assert cache_type_flags("f16") == [] and cache_type_flags("f16/f16") == []
    assert cache_type_flags("q8_0/q4_0") == ["-ctk", "q8_0", "-ctv", "q4_0"]
    assert cache_type_flags("q4_0") == ["-ctk", "q4_0", "-ctv", "q4_0"]
    split = kv_size(KvModel(layers=(KvLayer(64, 64),)), cache_context(256, "q8_0/q4_0")).caches["global"]
    assert (split.k_bytes, split.v_bytes) == (256 * 64 // 32 * 34, 256 * 64 // 32 * 18)
    for bad in ("q3", "q8_0/q3", "q8_0/", "q8_0/q4_0/f16"):
        with pytest.raises(NblError, match="unknown KV cache type"):
            split_cache_type(bad)


def test_bad_settings_are_named():
    plain = KvModel(layers=(KvLayer(48, 48),))
    with pytest.raises(NblError, match="unknown KV cache type 'q3'"):
        Context(n_ctx=256, type_k="q3")
    with pytest.raises(NblError, match="n_ctx must be at least 1"):
        Context(n_ctx=0)
    with pytest.raises(NblError, match="multiple of 32 values, this model's are 48"):
        kv_size(plain, Context(n_ctx=256, type_v="q8_0"))
    with pytest.raises(NblError, match="layers \\[3\\] do not exist"):
        plain.without([3])
    with pytest.raises(NblError, match="sliding-window layers need a window"):
        KvModel(layers=(KvLayer(48, 48, sliding=True),))


# --- against libllama --------------------------------------------------------------------------------

N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, N_FF = 64, 2, 2, 256, 128
# per layer and cell, K (and V) of 2 heads x 256 dims in F16 is 1 KiB: 256 cells make 0.25 MiB, which
# llama.cpp's log prints exactly (two decimals), so a layer or 256 cells amiss shows
WINDOW = 128

# name: (architecture, layers, sliding_window key (None: none written), replaced layers and their types)
MODELS = {
    "llama": ("llama", 4, None, {1: L}),
    # gemma3: layers 5 and 11 are global; replaced: one global, one sliding linear, one sliding dropped
    "gemma3": ("gemma3", 12, WINDOW, {0: L, 5: L, 7: D}),
    # gemma2: even layers slide; without the key llama.cpp takes a 4096-token window
    "gemma2": ("gemma2", 8, None, {1: L, 2: L}),
}
# llama-cli's settings at two contexts, then what else moves the cells: --swa-full, llama-server's
# 4 sequences in a unified cache, 2 sequences apart, a batch under the micro-batch, -fa off, K and V of
# different types (-ctk q8_0 -ctv q4_0)
SETTINGS = [dict(n_ctx=4096), dict(n_ctx=1000), dict(n_ctx=8192), dict(n_ctx=4096, swa_full=True),
            dict(n_ctx=4096, n_seq_max=4, kv_unified=True), dict(n_ctx=4096, n_seq_max=2),
            dict(n_ctx=4096, n_batch=256), dict(n_ctx=2048, flash_attn=False),
            dict(n_ctx=4096, kv_type="q8_0/q4_0")]


def write_model(path: Path, arch: str, n_layer: int, window: int | None, seed: int = 0) -> Path:
    """A random F32 GGUF of ``arch`` with heads wider than n_embd / n_head (key_length 256)."""
    import gguf

    from nbl_gguf.fixtures.tiny import add_byte_vocab

    rng = np.random.default_rng(seed)
    n_vocab = 3 + 256
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(8192)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    if window is not None:
        writer.add_sliding_window(window)
    add_byte_vocab(writer, n_vocab)

    def tensor(name, *shape):
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    tensor("token_embd.weight", n_vocab, N_EMBD)
    tensor("output_norm.weight", N_EMBD)
    gemma = arch.startswith("gemma")
    for i in range(n_layer):
        for stem in ["attn_norm", "ffn_norm"] + (["post_attention_norm", "post_ffw_norm"] if gemma else []):
            tensor(f"blk.{i}.{stem}.weight", N_EMBD)
        if arch == "gemma3":
            tensor(f"blk.{i}.attn_q_norm.weight", HEAD_DIM)
            tensor(f"blk.{i}.attn_k_norm.weight", HEAD_DIM)
        tensor(f"blk.{i}.attn_q.weight", N_HEAD * HEAD_DIM, N_EMBD)
        tensor(f"blk.{i}.attn_k.weight", N_HEAD_KV * HEAD_DIM, N_EMBD)
        tensor(f"blk.{i}.attn_v.weight", N_HEAD_KV * HEAD_DIM, N_EMBD)
        tensor(f"blk.{i}.attn_output.weight", N_EMBD, N_HEAD * HEAD_DIM)
        tensor(f"blk.{i}.ffn_gate.weight", N_FF, N_EMBD)
        tensor(f"blk.{i}.ffn_up.weight", N_FF, N_EMBD)
        tensor(f"blk.{i}.ffn_down.weight", N_EMBD, N_FF)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> path: the stock and NBL file of each model, and the llama one's stock layout (deci)."""
    from nbl_gguf.fixtures.tiny import random_linear
    from nbl_gguf.gguf import stock_layout

    root = tmp_path_factory.mktemp("kv")
    out = {}
    for name, (arch, n_layer, window, replaced) in MODELS.items():
        stock = write_model(root / f"{name}.gguf", arch, n_layer, window)
        types = [replaced.get(i, A) for i in range(n_layer)]
        linear = random_linear(N_EMBD, [i for i, t in replaced.items() if t == L])
        out[name] = stock
        out[f"{name}-nbl"] = nbl_format.write_nbl_gguf(stock, root / f"{name}-nbl.gguf",
                                                       nbl_format.NblLayers(types=types, linear=linear))
    # the stock layout takes the map without its bias: it has no slot for one
    linear = {i: (w, np.zeros_like(b)) for i, (w, b) in random_linear(N_EMBD, [1]).items()}
    out["llama-deci"] = stock_layout.write_stock_gguf(out["llama"], root / "llama-deci.gguf",
                                                      nbl_format.NblLayers(types=[A, L, D, A], linear=linear))
    return out


def mib(n_bytes: int) -> str:
    return f"{n_bytes / MIB:.2f}"


@pytest.mark.llama
@pytest.mark.parametrize("name", ["llama", "llama-nbl", "llama-deci", "gemma3", "gemma3-nbl", "gemma2", "gemma2-nbl"])
def test_sizes_are_those_libllama_allocates(files, name):
    import gguf

    from nbl_gguf.gguf.metadata import kv_sizes
    from nbl_gguf.llamacpp import library

    reader = gguf.GGUFReader(files[name])
    for settings in SETTINGS:
        stock, mine = kv_sizes(reader, **settings)
        logged = library.context_kv_caches(files[name], **settings)
        want = [(cache.cells, cache.layers, mib(cache.k_bytes), mib(cache.v_bytes)) for cache in mine.caches.values()]
        got = [(cache.cells, cache.layers, f"{cache.k_mib:.2f}", f"{cache.v_mib:.2f}") for cache in logged]
        assert got == want, (name, settings)
        if name.endswith(("-nbl", "-deci")) and settings.get("flash_attn", True):
            assert mine.bytes < stock.bytes  # the comparison sees the replaced layers


@pytest.mark.llama
def test_the_sizes_tell_the_layers_apart(files):
    """What was compared: the caches differ between the layouts, layers and settings that should differ."""
    import gguf

    from nbl_gguf.gguf.metadata import kv_sizes

    gemma3 = gguf.GGUFReader(files["gemma3-nbl"])
    at_4096 = kv_sizes(gemma3, 4096)[1].caches
    # 1 of 2 global layers replaced, 2 of 10 sliding ones; the window's 128 + 512 cells pad to 768
    assert [(c.cells, c.layers, c.bytes) for c in at_4096.values()] == [(4096, 1, 4096 * 2048), (768, 8, 8 * 768 * 2048)]
    gemma2 = gguf.GGUFReader(files["gemma2"])
    # no window key: llama.cpp's 4096; 4096 + 512 cells at 8192
    assert kv_sizes(gemma2, 8192)[0].caches["sliding"].cells == 4608
    deci = gguf.GGUFReader(files["llama-deci"])
    # -fa off: the replaced layers keep their V rows, padded to the widest
    assert kv_sizes(deci, 2048, flash_attn=False)[1].caches["global"].v_bytes == 4 * 2048 * 1024


@pytest.mark.llama
def test_inspect_shows_each_layers_cache(files, capsys):
    from nbl_gguf import cli
    from nbl_gguf.gguf.inspect import describe
    from nbl_gguf.llamacpp import library

    info = describe(files["gemma3-nbl"], 4096)
    logged = library.context_kv_caches(files["gemma3-nbl"], n_ctx=4096)
    layers = info["layers"]
    # each layer's figure adds up to the cache llama.cpp logs for its kind of layer
    for cache, sliding in zip(logged, (False, True)):
        assert sum(layer["kv_bytes"] for layer in layers if layer["sliding"] == sliding) == (cache.k_mib + cache.v_mib) * MIB
    assert [layer["kv_freed"] for layer in layers if layer["kv_freed"]] == [768 * 2048, 4096 * 2048, 768 * 2048]
    assert [layer["index"] for layer in layers if layer["kv_freed"]] == [0, 5, 7]
    assert cli.main(["inspect", "--ctx-size", "4096", str(files["gemma3-nbl"])]) == 0
    text = capsys.readouterr().out
    # stock: 2 global layers x 4096 cells x 2 KiB + 10 sliding x 768 x 2 KiB = 16 + 15 MiB; NBL: 8 + 12 MiB
    assert "KV cache:      20.00 MiB at 4,096 tokens (--ctx-size) vs stock 31.00 MiB (-35.5%)" in text
    assert "global layers: 1 of 2 cache 4,096 cells: 8.00 MiB (stock 16.00 MiB)" in text
    assert "sliding-window layers (window 128): 8 of 10 cache 768 cells: 12.00 MiB (stock 15.00 MiB)" in text
    rows = [" ".join(line.split()) for line in text.splitlines()]
    assert any(row.startswith("5 linear global freed 8.00 MiB attn_nbl:F32") for row in rows)
    assert any(row.startswith("6 attention sliding 1.50 MiB attn_k:F32") for row in rows)


def test_the_selections_kv_figures_follow_the_micro_batch():
    """calibrate/convert -ub: the selection's KV report of a model with sliding layers of its own (Gemma 3 270M:
    15 of 18 slide over 512 tokens) holds pad256(512 + n_ubatch) cells a sliding layer, 256 values a K and a V
    row; the global layers' cache is the context's, whatever the micro-batch."""
    from nbl_gguf.calibration.report import describe_kv, kv_report

    config = {"model_type": "gemma3_text", **GEMMA3_270M_CONFIG, "sliding_window": 512}
    selection = {"layers": [0, 1]}  # two sliding layers replaced (every sixth layer is global)
    for n_ubatch, cells in ((512, 1024), (128, 768)):
        report = kv_report(config, selection, 8192, n_ubatch=n_ubatch)
        assert report["nbl"]["caches"]["sliding"] == {"cells": cells, "layers": 13, "bytes": 13 * cells * 2 * 256 * 2}
        assert report["nbl"]["caches"]["global"]["cells"] == 8192
        assert (", -ub 128," in describe_kv(report)[0]) == (n_ubatch == 128)
