"""`bench`: roofline numbers, llama-bench parsing on a real run, the speed-up table, bad input."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from nbl_gguf.commands import bench
from nbl_gguf.measurement import bench_report, llama_bench, roofline, speedup
from nbl_gguf.measurement.bench import Candidate
from nbl_gguf.cli import main
from nbl_gguf.errors import NblError
from nbl_gguf.gguf.nbl_format import ATTENTION as A, DROPPED as D, LINEAR as L
from nbl_gguf.fixtures.tiny import TinyLlama

# TinyLlama defaults: 3 layers, n_embd 64, 4 heads of 16, 2 KV heads, n_ff 96, vocab 3 + 256, F32, untied
D_MODEL, HD, N_HEAD, N_KV, N_FF, VOCAB = 64, 16, 4, 2, 96, 259
ATTN_PARAMS = 64 * 64 + 32 * 64 + 32 * 64 + 64 * 64  # q, k, v, o
FFN_PARAMS = 3 * 96 * 64
NORMS = 2 * 64  # attn_norm + ffn_norm of one layer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Stock and NBL (layer 1 linear) GGUFs of one tiny model, plus a dropped-layer variant."""
    root = tmp_path_factory.mktemp("bench")
    model = TinyLlama()
    stock = model.write_gguf(root / "stock.gguf")
    nbl = model.write_nbl_gguf(root / "nbl.gguf", [A, L, A], model.random_linear([1]))
    dropped = model.write_nbl_gguf(root / "dropped.gguf", [A, D, D], {})
    return {"model": model, "stock": stock, "nbl": nbl, "dropped": dropped, "root": root}


# --- roofline ----------------------------------------------------------------------------------

def test_roofline_costs_match_hand_computation(tiny):
    stock = roofline.model_cost(tiny["stock"])
    nbl = roofline.model_cost(tiny["nbl"])
    embd = VOCAB * D_MODEL * 4
    stock_total = 4 * (2 * VOCAB * D_MODEL + 3 * (ATTN_PARAMS + FFN_PARAMS + NORMS) + D_MODEL)
    assert stock.total_bytes == stock_total
    assert stock.n_vocab == VOCAB and not stock.tied_output
    assert stock.token_embd_bytes == embd
    assert stock.block_matmul_params == 3 * (ATTN_PARAMS + FFN_PARAMS)
    assert stock.output_params == VOCAB * D_MODEL
    assert stock.weight_bytes_per_token() == stock_total - embd + D_MODEL * 4
    # K and V: 2 KV heads x (16 + 16) per attention layer, F16
    assert stock.kv_bytes_per_token() == 3 * N_KV * 2 * HD * 2
    assert stock.kv_bytes_per_token("f32") == 3 * N_KV * 2 * HD * 4
    assert stock.attn_width == 3 * N_HEAD * 2 * HD

    # layer 1: q/k/v/o (+ nothing else) -> W 64x64 (F32, the file's type) + bias 64
    nbl_total = stock_total - 4 * ATTN_PARAMS + 4 * (D_MODEL * D_MODEL + D_MODEL)
    assert nbl.total_bytes == nbl_total
    assert nbl.block_matmul_params == 2 * ATTN_PARAMS + 3 * FFN_PARAMS + D_MODEL * D_MODEL
    assert nbl.kv_bytes_per_token() == 2 * N_KV * 2 * HD * 2
    assert nbl.attention_layers == 2 and nbl.is_nbl

    depth, n = 100, 8
    ctx = depth + n / 2
    tg_stock = stock_total - embd + 4 * D_MODEL + 3 * 128 * ctx
    tg_nbl = nbl_total - embd + 4 * D_MODEL + 2 * 128 * ctx
    assert stock.tg_bytes(ctx) == pytest.approx(tg_stock)
    assert roofline.predicted_speedup(stock, nbl, "tg", depth, n) == pytest.approx(tg_stock / tg_nbl)

    n_prompt = 16
    ctx = depth + n_prompt / 2
    pp_stock = 2 * 3 * (ATTN_PARAMS + FFN_PARAMS) + 2 * VOCAB * D_MODEL / n_prompt + 4 * 3 * N_HEAD * HD * ctx
    pp_nbl = (2 * (2 * ATTN_PARAMS + 3 * FFN_PARAMS + D_MODEL**2) + 2 * VOCAB * D_MODEL / n_prompt
              + 4 * 2 * N_HEAD * HD * ctx)
    assert stock.pp_flops(ctx, n_prompt) == pytest.approx(pp_stock)
    assert roofline.predicted_speedup(stock, nbl, "pp", depth, n_prompt) == pytest.approx(pp_stock / pp_nbl)


def test_roofline_dropped_layers_and_tied_output(tiny, tmp_path):
    stock = roofline.model_cost(tiny["stock"])
    dropped = roofline.model_cost(tiny["dropped"])
    assert dropped.attention_layers == 1
    assert dropped.block_matmul_params == ATTN_PARAMS + 3 * FFN_PARAMS
    assert dropped.kv_bytes_per_token() == stock.kv_bytes_per_token() / 3
    # a tied model (no output.weight) reads all of token_embd per generated token
    model = TinyLlama()
    tied = roofline.model_cost(model.write_gguf(tmp_path / "tied.gguf", skip_tensors={"output.weight"}))
    assert tied.tied_output and tied.output_params == VOCAB * D_MODEL
    assert tied.weight_bytes_per_token() == tied.total_bytes + D_MODEL * 4
    # the speed-up grows with the context as the KV share grows
    ratios = [roofline.predicted_speedup(stock, dropped, "tg", d, 1) for d in (0, 1000, 100000)]
    assert ratios == sorted(ratios) and ratios[0] > 1


def test_roofline_window_layers_read_their_window_and_sinks_only(tiny, tmp_path):
    """Window layers 0 and 2 (W = 24, S = 4): their K/V term stops at 28 cells, layer 1's grows with the
    context; the weights are the stock file's."""
    from nbl_gguf.gguf import nbl_format

    path = tmp_path / "windows.gguf"
    nbl_format.write_nbl_gguf(tiny["stock"], path, nbl_format.NblLayers(
        types=[A, A, A], windows=nbl_format.Windows((0, 2), 24, 4), method="window"))
    stock, windowed = roofline.model_cost(tiny["stock"]), roofline.model_cost(path)
    assert windowed.is_nbl and windowed.window_cells == 28 and windowed.attention_layers == 3
    assert windowed.weight_bytes_per_token() == pytest.approx(stock.weight_bytes_per_token(), rel=1e-3)
    per_layer_kv, per_layer_attn = N_KV * 2 * HD, N_HEAD * 2 * HD
    weights = windowed.weight_bytes_per_token()
    for ctx in (10, 28, 1000):
        cells = ctx + 2 * min(ctx, 28)  # layer 1 reads the context, layers 0 and 2 their 28 cells at most
        assert windowed.tg_bytes(ctx) == pytest.approx(weights + per_layer_kv * cells * 2)
        assert windowed.tg_bytes(ctx, "q8_0") == pytest.approx(weights + per_layer_kv * cells * 34 / 32)
        assert windowed.pp_flops(ctx, 16) == pytest.approx(
            2 * windowed.block_matmul_params + 2 * windowed.output_params / 16 + 2 * per_layer_attn * cells)
    # at a short context a window changes nothing; at depth it saves two layers' K/V reads of three
    assert roofline.predicted_speedup(stock, windowed, "tg", 0, 1) == pytest.approx(1.0, rel=1e-3)
    deep = roofline.predicted_speedup(stock, windowed, "tg", 10 ** 6, 1)
    assert deep == pytest.approx(stock.tg_bytes(10 ** 6) / (weights + per_layer_kv * 2 * (10 ** 6 + 56)))
    roofline.check_pair(stock, windowed)  # a window file is a candidate against its stock file

    # bench's KV table: llama.cpp's buffers at 1,024 cells are the global layer's 1,024 and the window
    # layers' pad256(W + S + n_ubatch 512) = 768 each; at depth 1,000 the window layers hold 28 tokens
    records = [{"test": "tg", "backend": "cpu", "label": label, "depth": 1000, "kv_cells": 1024, "kv_layers": 3,
                "kv_mib": 1.0} for label in ("stock", "windows")]
    rows = {r["model"]: r for r in speedup.kv_table(records, {"stock": stock, "windows": windowed})}
    assert rows["stock"]["predicted_mib"] * 2 ** 20 == pytest.approx(per_layer_kv * 2 * 3 * 1024)
    assert rows["windows"]["predicted_mib"] * 2 ** 20 == pytest.approx(per_layer_kv * 2 * (1024 + 2 * 768))
    assert rows["windows"]["at_depth_mib"] * 2 ** 20 == pytest.approx(per_layer_kv * 2 * (1000 + 2 * 28))


# --- llama-bench -------------------------------------------------------------------------------

@pytest.mark.llama
def test_llama_bench_short_run_is_parsed(tiny):
    records, command = llama_bench.run_llama_bench(tiny["nbl"], n_prompt=16, n_gen=4, depth=8, repetitions=1, threads=1,
                                             backend="cpu")
    assert command[0] == "llama-bench" and "-dev" in command
    assert [r["test"] for r in records] == ["pp", "tg"]
    pp, tg = records
    assert (pp["n_prompt"], pp["n_gen"], tg["n_prompt"], tg["n_gen"]) == (16, 0, 0, 4)
    assert pp["depth"] == tg["depth"] == 8
    for record in records:
        assert record["avg_ts"] > 0 and len(record["samples_ts"]) == 1
        assert record["n_gpu_layers"] == 0 and "CPU" in record["backends"]
        # the measured KV cache: two attention layers of 2 x 2 heads x 16 F16 per cell
        assert record["kv_layers"] == 2
        assert record["kv_mib"] * 2**20 / record["kv_cells"] == pytest.approx(2 * 2 * 2 * 16 * 2, rel=0.05)


def test_parse_bench_json_rejects_garbage():
    with pytest.raises(NblError, match="no JSON"):
        llama_bench.parse_bench_json("error: something")
    with pytest.raises(NblError, match="parse"):
        llama_bench.parse_bench_json("[{")


# --- the ratio table ---------------------------------------------------------------------------

def _record(label, test, depth, round_index, samples, backend="cpu"):
    return {"backend": backend, "label": label, "test": test, "depth": depth, "round": round_index,
            "n_prompt": 16 if test == "pp" else 0, "n_gen": 4 if test == "tg" else 0, "samples_ts": samples}


def test_speedup_table_ratios_and_efficiency(tiny):
    costs = {"stock": roofline.model_cost(tiny["stock"]), "nbl": roofline.model_cost(tiny["nbl"])}
    measurements = [
        _record("stock", "pp", 0, 0, [100.0, 100.0]), _record("nbl", "pp", 0, 0, [120.0, 120.0]),
        _record("nbl", "pp", 0, 1, [150.0, 150.0]), _record("stock", "pp", 0, 1, [100.0, 100.0]),
        _record("stock", "tg", 64, 0, [10.0]), _record("nbl", "tg", 64, 0, [11.0]),
    ]
    rows = speedup.speedup_table(measurements, costs)
    assert [(r.test, r.depth) for r in rows] == [("pp", 0), ("tg", 64)]
    pp, tg = rows
    assert pp.measured == pytest.approx(135.0 / 100.0)
    assert (pp.ratio_min, pp.ratio_max) == pytest.approx((1.2, 1.5))
    assert pp.predicted == pytest.approx(roofline.predicted_speedup(costs["stock"], costs["nbl"], "pp", 0, 16))
    assert pp.efficiency == pytest.approx(pp.measured / pp.predicted)
    assert tg.measured == pytest.approx(1.1) and tg.n_tokens == 4
    assert tg.meets_target == (tg.efficiency >= 0.9)
    text = bench_report.format_table(rows)
    assert "pp16" in text and "tg4" in text and f"{pp.measured:.3f}" in text
    with pytest.raises(NblError, match="no stock measurement"):
        speedup.speedup_table([_record("nbl", "pp", 0, 0, [1.0])], costs)


def test_schedule_interleaves_and_alternates():
    models = [Candidate("stock", None), Candidate("a", None), Candidate("b", None)]
    plan = [(r, d, c.label) for r, d, c in llama_bench.schedule(models, [0, 512], rounds=2)]
    assert plan[:3] == [(0, 0, "stock"), (0, 0, "a"), (0, 0, "b")]
    assert plan[6:9] == [(1, 0, "b"), (1, 0, "a"), (1, 0, "stock")]
    assert len(plan) == 12


# --- bad input ---------------------------------------------------------------------------------

def _args(**overrides):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_bad_inputs_are_clear_errors(tiny, tmp_path):
    with pytest.raises(NblError, match="does not exist"):
        bench.resolve_models(_args(baseline=str(tmp_path / "missing.gguf"), nbl=[str(tiny["nbl"])]))
    not_gguf = tmp_path / "junk.gguf"
    not_gguf.write_bytes(b"not a gguf at all")
    with pytest.raises(NblError, match="not a GGUF"):
        bench.resolve_models(_args(baseline=str(tiny["stock"]), nbl=[str(not_gguf)]))
    other = TinyLlama(n_layer=4)
    other_nbl = other.write_nbl_gguf(tmp_path / "other.gguf", [A, L, A, A], other.random_linear([1]))
    with pytest.raises(NblError, match="not the same model.*block count"):
        bench.resolve_models(_args(baseline=str(tiny["stock"]), nbl=[str(other_nbl)]))
    wide = TinyLlama(n_embd=128)
    wide_nbl = wide.write_nbl_gguf(tmp_path / "wide.gguf", [A, L, A], wide.random_linear([1]))
    with pytest.raises(NblError, match="embedding length"):
        bench.resolve_models(_args(baseline=str(tiny["stock"]), nbl=[str(wide_nbl)]))
    with pytest.raises(NblError, match="baseline must be the stock"):
        bench.resolve_models(_args(baseline=str(tiny["nbl"]), nbl=[str(tiny["nbl"])]))
    with pytest.raises(NblError, match="is a stock GGUF"):
        bench.resolve_models(_args(baseline=str(tiny["stock"]), nbl=[str(tiny["stock"])]))
    # same model, another quantization
    import gguf

    f16 = tmp_path / "f16-nbl.gguf"
    from nbl_gguf.gguf import nbl_format

    model = tiny["model"]
    stock16 = tmp_path / "stock16.gguf"
    model.write_gguf(stock16, extra_kv={"general.file_type": (int(gguf.LlamaFileType.MOSTLY_F16),
                                                              gguf.GGUFValueType.UINT32, None)})
    nbl_format.write_nbl_gguf(stock16, f16, nbl_format.NblLayers([A, L, A], model.random_linear([1])))
    with pytest.raises(NblError, match="quantized differently"):
        bench.resolve_models(_args(baseline=str(tiny["stock"]), nbl=[str(f16)]))


def test_argument_errors():
    with pytest.raises(NblError, match="nothing to measure"):
        bench.apply_presets(_args())
    with pytest.raises(NblError, match="only one of"):
        bench.apply_presets(_args(shape="llama-3.2-1b", model="embedded"))
    with pytest.raises(NblError, match="both --baseline"):
        bench.apply_presets(_args(baseline="x.gguf"))
    with pytest.raises(NblError, match="--cache-type q3: unknown KV cache type 'q3'"):
        bench.apply_presets(_args(shape="llama-3.2-1b", cache_type="q3"))
    with pytest.raises(NblError, match="--cache-type q8_0/q3: unknown KV cache type"):
        bench.apply_presets(_args(shape="llama-3.2-1b", cache_type="q8_0/q3"))
    quick = _args(quick=True)
    bench.apply_presets(quick)
    assert quick.model == "embedded" and quick.depths == [0, 512] and quick.m == [8, 12]
    from nbl_gguf.fixtures import synthetic

    with pytest.raises(NblError, match="unknown --shape"):
        synthetic.get_shape("llama-99b")
    with pytest.raises(NblError, match="out of range"):
        synthetic.default_layers(synthetic.get_shape("llama-3.2-1b"), 16)
    assert synthetic.default_layers(synthetic.get_shape("llama-3.2-1b"), 6) == [9, 10, 11, 12, 13, 14]


def test_cli_reports_missing_file(tmp_path, capsys):
    assert main(["bench", "--baseline", str(tmp_path / "none.gguf"), "--nbl", str(tmp_path / "n.gguf"),
                 "--backends", "cpu"]) == 2
    assert "does not exist" in capsys.readouterr().err


# --- end to end --------------------------------------------------------------------------------

@pytest.mark.llama
def test_bench_end_to_end_on_tiny_models(tiny, tmp_path, capsys):
    out = tmp_path / "results"
    code = main(["bench", "--baseline", str(tiny["stock"]), "--nbl", str(tiny["nbl"]), str(tiny["dropped"]),
                 "-p", "16", "-n", "4", "-d", "0,16", "-r", "1", "--rounds", "2", "-t", "1", "-o", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "roofline" in printed and "dropped" in printed
    result = json.loads((out / "results.json").read_text())
    assert {(r["model"], r["test"], r["depth"]) for r in result["speedups"]} == {
        (m, t, d) for m in ("nbl", "dropped") for t in ("pp", "tg") for d in (0, 16)}
    assert len(result["measurements"]) == 3 * 2 * 2 * 2  # models x depths x rounds x (pp, tg)
    for name in ("measurements.csv", "speedups.csv", "kv_cache.csv", "speedup-cpu.png", "report.md"):
        assert (out / name).is_file(), name
    kv = {(r["model"], r["depth"]): r for r in result["kv_cache"]}
    assert kv[("dropped", 0)]["vs_stock"] == pytest.approx(1 / 3)
    assert kv[("nbl", 16)]["kv_layers"] == 2


def test_nbl_layers_read_back_for_hf(tiny):
    pytest.importorskip("torch")
    from nbl_gguf.measurement.hf_compare import nbl_layers_from_gguf

    types, linear = nbl_layers_from_gguf(tiny["nbl"])
    want = tiny["model"].random_linear([1])
    assert types == [A, L, A] and set(linear) == {1}
    np.testing.assert_allclose(linear[1][0], want[1][0])
    np.testing.assert_allclose(linear[1][1], want[1][1])


def test_kv_log_of_plain_and_sliding_window_contexts():
    from nbl_gguf.llamacpp.library import kv_caches

    line = ("llama_kv_cache: size = {mib:7.2f} MiB ({cells:6d} cells, {layers:3d} layers,  1/1 seqs), "
            "K (f16): {half:7.2f} MiB, V (f16): {half:7.2f} MiB")
    log = "\n".join([
        line.format(mib=4.0, cells=4096, layers=4, half=2.0),                    # a plain context
        "llama_kv_cache_iswa: creating non-SWA KV cache, size = 4096 cells",      # an iSWA context ...
        line.format(mib=1.0, cells=4096, layers=1, half=0.5),
        "llama_kv_cache_iswa: creating     SWA KV cache, size = 768 cells",
        line.format(mib=0.5, cells=768, layers=3, half=0.25),                     # ... is one cache
        line.format(mib=2.0, cells=2048, layers=4, half=1.0),
    ])
    caches = kv_caches(log)
    assert [(c.cells, c.layers, c.mib) for c in caches] == [(4096, 4, 4.0), (4096, 4, 1.5), (2048, 4, 2.0)]
    assert [row["kv_layers"] for row in llama_bench.parse_kv_log(log)] == [4, 4, 4]


# --- a GGUF --model: the file itself against convert's surgery on it ----------------------------

def test_bench_makes_the_largest_m_first_then_reuses_its_calibration(tmp_path, monkeypatch):
    """The first convert (which calibrates) takes the largest m, the others reuse its calibration (and
    measure best at their own m on its held-out windows); files already made are not made again."""
    from types import SimpleNamespace

    from nbl_gguf.commands import convert

    calls = []

    def fake_convert(args):
        calls.append((args.m, args.calibration, args.save_calibration, args.quant))
        Path(args.save_calibration or args.calibration).mkdir(exist_ok=True)
        Path(args.output).write_bytes(b"GGUF")
        return SimpleNamespace(table=lambda: "")

    monkeypatch.setattr(convert, "convert", fake_convert)
    args = _args(m=[4, 12, 8])
    nbl, commands = bench.nbl_by_convert(args, "model.gguf", tmp_path, "", {}, log=lambda _: None)
    calibration = str(tmp_path / "calibration")
    assert calls == [(12, None, calibration, None), (8, calibration, None, None), (4, calibration, None, None)]
    assert [(c.label, c.path.name) for c in nbl] == [("nbl-m4", "nbl-m4.gguf"), ("nbl-m12", "nbl-m12.gguf"),
                                                     ("nbl-m8", "nbl-m8.gguf")]
    assert [" --m 12 " in commands[0], " --m 8 " in commands[1], " --m 4 " in commands[2]] == [True] * 3
    calls.clear()
    bench.nbl_by_convert(args, "model.gguf", tmp_path, "", {}, log=lambda _: None)
    assert calls == []


@pytest.mark.parametrize("flag, shown", [([], True), (["--no-progress"], False)])
def test_no_progress_reaches_the_conversions_bench_makes(tmp_path, monkeypatch, flag, shown):
    """The progress bars bench drives are those of the convert runs that make its NBL files (calibration
    layers, convert steps): bench --no-progress turns them off, and without it they show."""
    from types import SimpleNamespace

    from nbl_gguf.commands import convert

    bars = []

    def fake_convert(args):
        bars.append(not args.no_progress)
        Path(args.save_calibration or args.calibration).mkdir(exist_ok=True)
        Path(args.output).write_bytes(b"GGUF")
        return SimpleNamespace(table=lambda: "")

    monkeypatch.setattr(convert, "convert", fake_convert)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--m", "4,8", *flag])
    _, commands = bench.nbl_by_convert(args, "model.gguf", tmp_path, "", {}, log=lambda _: None)
    assert bars == [shown, shown]
    assert all(("--no-progress" in command) != shown for command in commands)


def test_gguf_model_takes_no_quant(tiny):
    with pytest.raises(NblError, match="--quant q8_0 means nothing for a GGUF --model: the stock side is stock.gguf"):
        bench.apply_presets(_args(model=str(tiny["stock"]), quant="q8_0"))
    args = _args(model=str(tiny["stock"]), m=[1])
    bench.apply_presets(args)  # the default quant is no error
    with pytest.raises(NblError, match="--m 3 is out of range: stock.gguf has 3 layers"):
        bench.resolve_models(_args(model=str(tiny["stock"]), m=[3], calibration=str(tiny["root"])))
    with pytest.raises(NblError, match="already an NBL GGUF"):
        bench.resolve_models(_args(model=str(tiny["nbl"]), m=[1], calibration=str(tiny["root"])))


@pytest.mark.llama
def test_bench_on_a_gguf_model_measures_the_file_and_its_surgery(tmp_path, monkeypatch, capsys):
    """bench --model FILE.gguf: the file as given against `convert --model FILE.gguf` per m (one
    calibration on the model transformers dequantizes from it, made at the largest m)."""
    pytest.importorskip("torch")
    import gguf

    from nbl_gguf.calibration.artifact import load_artifact
    from nbl_gguf.gguf.nbl_format import is_attention_tensor
    from nbl_gguf.model_source import file_sha256

    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path / "cache"))  # the dequantized checkpoint
    source = TinyLlama(n_layer=4, n_ctx_train=512).write_gguf(tmp_path / "tiny.gguf")
    out, work = tmp_path / "results", tmp_path / "work"
    assert main(["bench", "--model", str(source), "--m", "1,2", "--calib-nsamples", "8", "--calib-seqlen", "64",
                 "-p", "16", "-n", "4", "-d", "0", "-r", "1", "--rounds", "1", "-t", "1", "--no-plot",
                 "--work-dir", str(work), "-o", str(out)]) == 0
    assert "NBL vs stock llama.cpp: tiny F32" in capsys.readouterr().out
    result = json.loads((out / "results.json").read_text())
    models = {m["label"]: m for m in result["models"]}
    assert list(models) == ["stock", "nbl-m1", "nbl-m2"]
    # the stock side is the user's file as given
    assert models["stock"]["path"] == str(source) and models["stock"]["bytes"] == source.stat().st_size
    assert {m["file_type"] for m in models.values()} == {"F32"}
    artifact = load_artifact(work / "models" / "gguf" / file_sha256(source)[:16] / "tiny" / "calibration")
    assert artifact.report["selection"]["m"] == 2 and artifact.report["selection"]["criterion"] == "best"
    # convert's default --taps (auto) gives a llama file past-token maps: the low-rank lag map's tensors too
    from nbl_gguf.gguf.from_artifact import DEFAULT_TAPS

    assert artifact.taps == DEFAULT_TAPS
    nbl_tensors = ("attn_nbl.weight", "attn_nbl.bias", "attn_nbl_lag_down.weight", "attn_nbl_lag_up.weight")
    stock = {t.name: t for t in gguf.GGUFReader(source).tensors}
    for m in (1, 2):
        replaced = artifact.select(m, "best", "attn-nbl")
        assert models[f"nbl-m{m}"]["replaced_layers"] == sorted(replaced)
        # convert's surgery: every tensor but the replaced attention keeps the input's bytes and type
        nbl = {t.name: t for t in gguf.GGUFReader(models[f"nbl-m{m}"]["path"]).tensors}
        dropped = {name for name in stock if any(is_attention_tensor(name, layer) for layer in replaced)}
        assert set(nbl) - set(stock) == {f"blk.{i}.{name}" for i in replaced for name in nbl_tensors}
        assert dropped and set(stock) - set(nbl) == dropped
        for name in set(stock) - dropped:
            assert nbl[name].tensor_type == stock[name].tensor_type
            assert nbl[name].data.tobytes() == stock[name].data.tobytes(), name
    assert {(r["model"], r["test"], r["depth"]) for r in result["speedups"]} == {
        (f"nbl-m{m}", t, 0) for m in (1, 2) for t in ("pp", "tg")}
    # llama.cpp's own KV cache: 3 and 2 of the 4 attention layers left
    kv = {r["model"]: r for r in result["kv_cache"]}
    assert kv["nbl-m1"]["vs_stock"] == pytest.approx(3 / 4) and kv["nbl-m2"]["vs_stock"] == pytest.approx(2 / 4)
    assert result["made_by"][0].startswith(str(source))


@pytest.mark.llama
def test_synthetic_models_carry_taps_layers_of_the_calibrators_default_form(tmp_path, monkeypatch):
    """`bench --shape --taps 1,4`: one NBL file per count on the same layers, the taps file's replaced
    layers of type 3 with the low-rank lags a calibrated file has (rank n_embd / 4 over 3 earlier
    inputs), quantized by llama-quantize like the others; counts out of range are refused."""
    import gguf

    from nbl_gguf.fixtures import synthetic
    from nbl_gguf.gguf import nbl_format

    shape = synthetic.Shape("tiny-taps", 256, 4, 4, 2, 512, 300, False, 10000.0, 4096)
    stock, nbl = synthetic.make_pair(shape, "q4_k_m", [2], tmp_path, taps=[1, 4], log=lambda *a: None)
    assert sorted(nbl) == [(2, ""), (2, "taps4")]
    layers = synthetic.default_layers(shape, 2)
    for (m, label), path in nbl.items():
        k = 4 if label else 1
        reader = gguf.GGUFReader(path)
        kind = nbl_format.TAPS if k > 1 else nbl_format.LINEAR
        assert nbl_format.read_layer_types(reader) == [kind if i in layers else nbl_format.ATTENTION for i in range(4)]
        tensors = {t.name: t for t in reader.tensors}
        for layer in layers:
            lags = {name: tensors.get(pattern.format(layer=layer)) for name, pattern in nbl_format.TAPS_TENSORS.items()}
            if k == 1:
                assert not any(lags.values())
                continue
            assert lags["lag"] is None and lags["conv"] is None
            assert [int(n) for n in lags["lag_down"].shape] == [3 * 256, 64]  # gguf order: columns first
            assert [int(n) for n in lags["lag_up"].shape] == [64, 256]
            assert lags["lag_down"].tensor_type != gguf.GGMLQuantizationType.F16  # quantized with the rest
    assert nbl_format.read_layer_types(gguf.GGUFReader(stock)) is None

    args = argparse.Namespace(shape="tiny-taps", layers=None, quant="q4_k_m", m=[2], seed=0, threads=None, taps=[1, 4],
                              taps_forms=None, work_dir=str(tmp_path / "work"))
    monkeypatch.setitem(synthetic.SHAPES, "tiny-taps", shape)
    models = bench.shape_models(args, log=lambda *a: None)
    assert [c.label for c in models.nbl] == ["nbl-m2", "nbl-m2-taps4"]
    with pytest.raises(NblError, match="each count is 1"):
        synthetic.make_pair(shape, "q4_k_m", [2], tmp_path, taps=[0], log=lambda *a: None)
    with pytest.raises(NblError, match="--taps 1,4 means nothing without --shape"):
        bench.apply_presets(_args(baseline="a.gguf", nbl=["b.gguf"], taps=[1, 4]))


def test_synthetic_taps_files_of_each_asked_form_carry_that_forms_tensors(tmp_path):
    """`bench --shape --taps 1,4 --taps-forms lowrank:32,channel,full`: one taps file per form on the
    same layers, each with its form's lag tensors at their sizes; a bad form or rank is refused by name."""
    import gguf

    from nbl_gguf.fixtures import synthetic
    from nbl_gguf.gguf import nbl_format

    shape = synthetic.Shape("tiny-forms", 256, 4, 4, 2, 512, 300, False, 10000.0, 4096)
    _, nbl = synthetic.make_pair(shape, "q8_0", [1], tmp_path, taps=[1, 4], taps_forms=["lowrank:32", "channel", "full"],
                                 log=lambda *a: None)
    assert sorted(label for _, label in nbl) == ["", "taps4-channel", "taps4-full", "taps4-lowrank32"]
    layer = synthetic.default_layers(shape, 1)[0]
    want = {"taps4-lowrank32": {"lag_down": [3 * 256, 32], "lag_up": [32, 256]},
            "taps4-channel": {"conv": [256, 4]},
            "taps4-full": {"lag": [3 * 256, 256]}}
    for label, shapes in want.items():
        tensors = {t.name: t for t in gguf.GGUFReader(nbl[1, label]).tensors}
        lags = {name: tensors.get(pattern.format(layer=layer)) for name, pattern in nbl_format.TAPS_TENSORS.items()}
        present = {name: [int(n) for n in t.shape] for name, t in lags.items() if t is not None and name in
                   ("lag", "lag_down", "lag_up", "conv")}
        assert present == shapes, label
    for bad, message in [("lowrank:0", "rank is a whole number"), ("channel:8", "only the lowrank form"),
                         ("conv", "unknown form 'conv'")]:
        with pytest.raises(NblError, match=message):
            synthetic.make_pair(shape, "q8_0", [1], tmp_path, taps=[4], taps_forms=[bad], log=lambda *a: None)
    with pytest.raises(NblError, match="--taps-forms channel means nothing"):
        bench.apply_presets(_args(shape="llama-3.2-1b", m=[6], taps=[1], taps_forms=["channel"]))
