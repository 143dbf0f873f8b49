"""`bench --frontier`: the Pareto marks against a sort-and-sweep reference, the weight-type ladder, the
table's changes against hand arithmetic, argument errors, and a real run on a tiny GGUF whose KV bytes
are held to what llama.cpp logs it allocated and whose pruned file has the calibration's least
influential block removed."""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import numpy as np
import pytest

from nbl_gguf.cli import main
from nbl_gguf.commands import bench
from nbl_gguf.errors import NblError
from nbl_gguf.measurement import frontier
from nbl_gguf.measurement.frontier import FrontierSettings, Row, Variant


def sweep_front(points):
    """Reference skyline: sort by the first coordinate (then the second), keep a point when its second
    coordinate is below every one seen before it; exact duplicates share their fate."""
    order = sorted(range(len(points)), key=lambda i: points[i])
    keep, best, previous = set(), float("inf"), None
    for i in order:
        if previous is not None and points[i] == points[previous] and previous in keep:
            keep.add(i)
        elif points[i][1] < best:
            keep.add(i)
        best = min(best, points[i][1])
        previous = i
    return [i in keep for i in range(len(points))]


def test_pareto_marks_equal_a_sort_and_sweep_skyline():
    rng = np.random.default_rng(0)
    for trial in range(200):
        n = int(rng.integers(1, 12))
        # few distinct values: ties on one axis and exact duplicates happen often
        points = [(float(rng.integers(0, 5)), float(rng.integers(0, 5))) for _ in range(n)]
        assert frontier.pareto(points) == sweep_front(points), points


def test_weight_type_ladder():
    assert frontier.neighbour_types("Q4_K_M") == ("Q3_K_M", "Q5_K_M")
    assert frontier.neighbour_types("q4_1") == ("Q4_K_M", "Q5_K_M")  # the embedded SmolLM2's type
    assert frontier.neighbour_types("Q8_0") == ("Q6_K", None)
    assert frontier.neighbour_types("Q2_K") == (None, "Q3_K_M")
    assert frontier.neighbour_types("F32") == ("Q8_0", None)
    with pytest.raises(NblError, match="no place for weight type IQ1_S"):
        frontier.neighbour_types("IQ1_S")


def _row(label, group, ppl_short, ppl_long, kv, tg, kv_type="f16"):
    variant = Variant(label, group, Path(f"/x/{label}.gguf"), kv_type=kv_type)
    return Row(variant, 1000, kv, perplexity={512: {"c4": ppl_short[0], "code": ppl_short[1]},
                                              4096: {"c4": ppl_long[0], "code": ppl_long[1]}},
               speed={"cpu tg d0": tg, "cpu tg d4096": tg / 2})


def test_table_changes_and_fronts_by_hand(tmp_path):
    settings = FrontierSettings(depths=(0, 4096), kv_ctx=8192, passkey=(4096,))
    rows = [_row("stock", frontier.STOCK, (10, 4), (8, 2), 100, 50),
            _row("stock kv q8_0", frontier.STOCK, (10.1, 4), (8.08, 2.02), 53, 48, "q8_0"),
            _row("nbl-m4", frontier.NBL, (11, 5), (9, 3), 80, 60),
            _row("worse", frontier.KNOB, (20, 8), (16, 4), 100, 40)]
    for row, found in zip(rows, ([True] * 5, [True] * 5, [True, False, True, False, False], [False] * 5)):
        row.passkey = {4096: found}
    # mean change at 4096: stock 0; q8_0 (1% + 1%) / 2 = 1%; nbl (12.5% + 50%) / 2 = 31.25%; worse 100%
    assert frontier.mean_change(rows[1], rows[0], 4096) == pytest.approx(1.0)
    assert frontier.mean_change(rows[2], rows[0], 4096) == pytest.approx(31.25)
    on = frontier.frontiers(rows, settings)
    assert on["kv"] == [True, True, False, False]  # nbl: more loss and more KV than q8_0
    assert on["decode"] == [True, False, True, False]  # nbl decodes fastest; q8_0 slower and worse than stock
    header, cells = frontier.table(rows, settings)
    assert cells[2][header.index("PPL code @4096")] == "3.000 (+50.0%)"
    assert cells[2][header.index("mean change @4096")] == "+31.2%"
    assert cells[1][header.index("run with")] == "-ctk q8_0 -ctv q8_0"
    assert cells[2][header.index("cpu tg d4096")] == "30.0 (1.20x)"
    assert cells[3][header.index("frontier")] == ""
    assert [line[header.index("passkey @4096")] for line in cells] == ["5/5", "5/5", "2/5", "0/5"]
    # within +10%: ours has nothing (nbl-m4 is +31%); llama.cpp's fastest is stock (50 against q8_0's 48)
    race = frontier.decode_within(rows, settings)
    assert race[0] == ("decode at depth 0 (cpu), within +10% of stock's perplexity at 4,096: fastest of ours none; "
                       "of llama.cpp's own stock, 50.0 t/s (+0.0%)")
    wider = frontier.decode_within(rows, settings, bar=40.0)  # nbl-m4 inside: 60 against 50 t/s
    assert wider[1].endswith("fastest of ours nbl-m4, 30.0 t/s (+31.2%); of llama.cpp's own stock, 25.0 t/s (+0.0%): "
                             "ours 1.20x theirs")
    written = frontier.write_outputs(tmp_path, "t", rows, settings, {}, ["note"], plot_it=True)
    assert "## Decode within +10%" in (tmp_path / "frontier.md").read_text()
    # the report written again from results.json alone is the same report
    first = {name: (tmp_path / name).read_text() for name in ("frontier.md", "frontier.csv", "results.json")}
    for name in ("frontier.md", "frontier.csv"):
        (tmp_path / name).unlink()
    assert main(["bench", "--frontier-report", str(tmp_path), "--no-plot"]) == 0
    assert {name: (tmp_path / name).read_text() for name in first} == first
    assert [p.name for p in written] == ["frontier.md", "frontier.csv", "results.json", "frontier.png"]
    with open(tmp_path / "frontier.csv", encoding="utf-8") as handle:
        table = list(csv.DictReader(handle))
    assert [r["label"] for r in table] == ["stock", "stock kv q8_0", "nbl-m4", "worse"]
    assert [(r["passkey_found_4096"], r["passkey_asked_4096"]) for r in table] == [("5", "5"), ("5", "5"), ("2", "5"), ("0", "5")]
    assert [r["kv_frontier"] for r in table] == ["1", "1", "0", "0"]
    assert float(table[3]["mean_change_pct_4096"]) == pytest.approx(100.0)


def _args(*argv):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv, message", [
    (["--frontier"], "--frontier measures one model: give --model"),
    (["--frontier", "--shape", "llama-3.2-1b"], "--shape means nothing with --frontier"),
    (["--frontier", "--model", "m.gguf", "--calibration", "x"], "--calibration means nothing with --frontier"),
    (["--prune-blocks", "2", "--quick"], "--prune-blocks means nothing without --frontier"),
    (["--ppl-chunks", "2,1", "--quick"], "--ppl-chunks means nothing without --frontier"),
    (["--frontier-passkey", "4096", "--quick"], "--frontier-passkey means nothing without --frontier"),
    (["--remeasure", "--quick"], "--remeasure means nothing without --frontier"),
])
def test_frontier_argument_errors(argv, message):
    with pytest.raises(NblError, match=message):
        from nbl_gguf.commands import frontier as command

        command.check_arguments(_args(*argv))


def test_a_report_without_results_is_named(tmp_path, capsys):
    assert main(["bench", "--frontier-report", str(tmp_path)]) != 0
    assert "results.json: not a frontier's results.json ([Errno 2]" in capsys.readouterr().err
    (tmp_path / "results.json").write_text('{"title": "t"}')
    assert main(["bench", "--frontier-report", str(tmp_path)]) != 0
    assert "not a frontier's results.json ('settings')" in capsys.readouterr().err
    assert not (tmp_path / "frontier.md").exists()


def test_unknown_kv_type_is_named():
    from nbl_gguf.commands import frontier as command

    with pytest.raises(NblError, match="unknown KV cache type 'q3_0'"):
        command.kv_types("q8_0,q3_0")
    assert command.kv_types("f16,q8_0,q8_0") == ["q8_0"]
    assert command.kv_types("q8_0/q4_0, q4_0") == ["q8_0/q4_0", "q4_0"]
    with pytest.raises(NblError, match="--nbl-kv-types: unknown KV cache type 'q8_0/q3'"):
        command.kv_types("q8_0/q3", "--nbl-kv-types")


@pytest.mark.llama
def test_frontier_on_a_tiny_gguf(tmp_path, monkeypatch, capsys):
    """Every variant measured; the KV bytes of each row are what llama.cpp's allocator logs for the same
    context; the pruned file lacks the block of least influence that the calibration recorded."""
    pytest.importorskip("torch")
    import gguf

    from nbl_gguf.calibration.artifact import load_artifact
    from nbl_gguf.fixtures.tiny import TinyLlama
    from nbl_gguf.gguf import nbl_format
    from nbl_gguf.measurement.llama_bench import run_llama_bench

    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path / "cache"))
    source = TinyLlama(n_layer=4, n_head=2, n_head_kv=1, n_ctx_train=2048).write_gguf(tmp_path / "tiny.gguf")
    out, work = tmp_path / "results", tmp_path / "work"
    command = ["bench", "--frontier", "--model", str(source), "--m", "1,2", "--calib-nsamples", "8",
               "--calib-seqlen", "64", "--ppl-chunks", "1,1", "-p", "16", "-n", "4", "-d", "0,64", "-r", "1", "-t", "1",
               "--kv-types", "q8_0/q4_0", "--nbl-kv-types", "q8_0", "--frontier-windows", "1", "--frontier-passkey", "768",
               "--work-dir", str(work)]
    assert main(command + ["-o", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "results.json").read_text())
    assert result["kept"] == {"perplexity": [], "passkey": []} and "Kept from an earlier run" not in printed
    labels = [r["label"] for r in result["rows"]]
    assert labels == ["stock", "stock kv q8_0/q4_0", "stock Q8_0", "stock prune 1 blocks",
                      "nbl-m1 taps4", "nbl-m1 taps4 kv q8_0", "nbl-m2 taps4", "nbl-m2 taps4 kv q8_0",
                      "nbl-m1 per-token", "nbl-m1 per-token kv q8_0", "nbl-m2 per-token", "nbl-m2 per-token kv q8_0",
                      "windows 1", "windows 1 kv q8_0", "windows 1 Q8_0"]
    assert "| nbl-m2 taps4 kv q8_0 |" in printed and (out / "frontier.png").is_file()
    assert "| passkey @768 |" in printed
    assert result["settings"]["long_ctx"] == 2048 and result["settings"]["kv_ctx"] == 2048
    rows = {r["label"]: r for r in result["rows"]}
    for row in result["rows"]:
        assert set(row["perplexity"]) == {"512", "2048"} and all(v > 1 for v in row["perplexity"]["2048"].values())
        assert {"cpu pp d0", "cpu tg d0", "cpu pp d64", "cpu tg d64"} <= set(row["speed"])
        # the KV bytes at a context llama-bench allocates (16 + 4 + 2000 tokens, 2048 cells) against its log,
        # which prints K and V to 0.01 MiB each, of each cache (a window file has two: global and sliding)
        records, _ = run_llama_bench(Path(row["path"]), n_prompt=16, n_gen=4, depth=2000, repetitions=1, threads=1,
                                     backend="cpu", cache_type=row["kv_type"])
        expected = frontier.kv_bytes(Path(row["path"]), row["kv_type"], 2020) / 2 ** 20
        caches = 2 if row["label"].startswith("windows") else 1
        assert records[0]["kv_mib"] == pytest.approx(expected, abs=0.011 * caches), row["label"]
    # K in q8_0 and V in q4_0: (34 + 18) / 2 bytes a block of 32 values against 64 in F16; the file without
    # attention in 2 layers, half the stock's
    assert rows["stock kv q8_0/q4_0"]["kv_bytes"] < 0.41 * rows["stock"]["kv_bytes"]
    assert rows["nbl-m2 taps4 kv q8_0"]["kv_bytes"] < 0.54 * rows["nbl-m2 taps4"]["kv_bytes"]
    assert rows["nbl-m2 taps4"]["kv_bytes"] == rows["stock"]["kv_bytes"] // 2
    # one of 4 layers keeps 512 + 4 sinks (+ a ubatch) cells of the 2048: less than stock, more than 3 layers' worth
    assert 3 * rows["stock"]["kv_bytes"] // 4 < rows["windows 1"]["kv_bytes"] < rows["stock"]["kv_bytes"]
    assert gguf.GGUFReader(rows["windows 1"]["path"]).get_field("llama.attention.sliding_window") is not None
    # the window layers on the weight type down: the window file's layers, the Q8_0 stock file's tensors
    from nbl_gguf.gguf.nbl_format import read_windows

    window_file, composed, knob = (gguf.GGUFReader(rows[label]["path"]) for label in
                                   ("windows 1", "windows 1 Q8_0", "stock Q8_0"))
    assert read_windows(composed) == read_windows(window_file) and read_windows(knob) is None
    assert {t.name: (t.tensor_type, t.data.tobytes()) for t in composed.tensors} == \
        {t.name: (t.tensor_type, t.data.tobytes()) for t in knob.tensors}
    assert rows["windows 1 Q8_0"]["kv_bytes"] == rows["windows 1"]["kv_bytes"]
    # the passkey column: each variant's answers with its own cache type, as eval --passkey gives them
    from nbl_gguf.measurement.passkey import DEPTHS, passkey

    for label in ("stock", "stock kv q8_0/q4_0", "nbl-m2 taps4 kv q8_0", "windows 1"):
        alone = passkey(rows[label]["path"], (768,), kv_type=rows[label]["kv_type"], threads=1)
        assert rows[label]["passkey"] == {"768": [t.found for t in alone.trials]}, label
        assert result["passkey"][label]["trials"] == alone.report()["trials"], label
    assert all(len(row["passkey"]["768"]) == len(DEPTHS) for row in result["rows"])
    table = list(csv.DictReader(open(out / "frontier.csv", encoding="utf-8")))
    assert [int(r["passkey_asked_768"]) for r in table] == [len(DEPTHS)] * len(table)
    assert [int(r["passkey_found_768"]) for r in table] == [sum(r["passkey"]["768"]) for r in result["rows"]]
    # one calibration: the past-token one holds the per-token maps and scores too (tests/test_calibrate_taps.py), so
    # the per-token files are cut from it, with best measured for per-token maps at each m and recorded there
    calibration = next(Path(work).rglob("taps4/calibration"))
    assert [p.name for p in Path(work).rglob("calibration") if p.is_dir()] == ["calibration"]
    artifact = load_artifact(calibration)
    for m in (1, 2):
        assert f"--calibration {calibration}" in rows[f"nbl-m{m} per-token"]["made_by"]
        measured = artifact.measured_best(m, "attn-nbl", 1)
        assert measured is not None and measured["taps"] == 1
        assert nbl_format.read_layer_types(gguf.GGUFReader(rows[f"nbl-m{m} per-token"]["path"])) == \
            [nbl_format.LINEAR if i in measured["layers"] else nbl_format.ATTENTION for i in range(4)]
    # the pruned file: llama-quantize --prune-layers of the lowest block influence
    weakest = int(np.argmin(artifact.block_influence()))
    pruned = gguf.GGUFReader(rows["stock prune 1 blocks"]["path"])
    assert int(pruned.fields["llama.block_count"].parts[-1][0]) == 3
    assert f"--prune-layers {weakest} " in rows["stock prune 1 blocks"]["made_by"]

    # run again (as after an interruption): the files from the work dir, the perplexities and passkeys from the
    # first run, the speeds measured again; the report says what it took
    from nbl_gguf.llamacpp import perplexity as llama_perplexity

    real, runs = llama_perplexity.perplexity, []
    monkeypatch.setattr(llama_perplexity, "perplexity", lambda *a, **k: runs.append(a) or real(*a, **k))
    assert main(command + ["-o", str(tmp_path / "again")]) == 0
    printed = capsys.readouterr().out
    again = json.loads((tmp_path / "again" / "results.json").read_text())
    assert runs == [] and again["kept"] == {"perplexity": labels, "passkey": labels}
    assert [(r["perplexity"], r["passkey"]) for r in again["rows"]] == \
        [(r["perplexity"], r["passkey"]) for r in result["rows"]]
    assert len(again["llama_bench"]) == len(result["llama_bench"])
    assert f"the perplexities of {len(labels)} of the {len(labels)} variants and the passkeys of {len(labels)}" in printed
    assert main(command + ["--remeasure", "-o", str(tmp_path / "remeasured")]) == 0
    assert len(runs) == 2 * 3 * len(labels) and "Kept from an earlier run" not in capsys.readouterr().out


@pytest.mark.llama
def test_a_passkey_longer_than_the_training_context_is_refused_before_the_nbl_files(tmp_path, monkeypatch, capsys):
    from nbl_gguf.fixtures.tiny import TinyLlama

    monkeypatch.setenv("NBL_GGUF_CACHE", str(tmp_path / "cache"))
    source = TinyLlama(n_layer=4, n_head=2, n_head_kv=1, n_ctx_train=2048).write_gguf(tmp_path / "tiny.gguf")
    assert main(["bench", "--frontier", "--model", str(source), "--m", "1,2", "--frontier-passkey", "1024,2048",
                 "--work-dir", str(tmp_path / "work"), "-o", str(tmp_path / "results")]) != 0
    assert "passkey prompts of 2,048 tokens: tiny.gguf is trained to 2,048, which must hold the prompt and its " \
           "answer (ask for at most 2,024)" in capsys.readouterr().err
    # and one too short for the needle and filler by the model's tokenizer
    assert main(["bench", "--frontier", "--model", str(source), "--m", "1,2", "--frontier-passkey", "256",
                 "--work-dir", str(tmp_path / "work"), "-o", str(tmp_path / "results")]) != 0
    assert "a passkey prompt of 256 tokens leaves no room for filler" in capsys.readouterr().err
    assert not list((tmp_path / "work").rglob("calibration")) and not (tmp_path / "results").exists()


@pytest.mark.parametrize("long_worst, scale", [((8.5, 2.1), "linear"), ((16, 4), "symlog")])
def test_plot_axis_reads_as_plain_percent(long_worst, scale):
    # a narrow range of losses (here at most +6.2%) drew symlog's own labels at its limits ("8.36438 x 10^0");
    # a wide one (+100%) stays symlog, linear to 10%; the labels are plain numbers either way
    import matplotlib.pyplot as plt

    settings = FrontierSettings(depths=(0, 4096), kv_ctx=8192)
    rows = [_row("stock", frontier.STOCK, (10, 4), (8, 2), 100, 50),
            _row("stock kv q8_0", frontier.STOCK, (10.1, 4), (8.08, 2.02), 53, 48, "q8_0"),
            _row("ours", frontier.NBL, (11, 5), long_worst, 80, 60)]
    figure = frontier.draw("t", rows, settings)
    try:
        figure.canvas.draw()
        for ax in figure.axes:
            assert ax.get_yscale() == scale
            labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
            assert labels
            [float(text.replace("\u2212", "-")) for text in labels]  # a number each (mathtext is not)
    finally:
        plt.close(figure)
