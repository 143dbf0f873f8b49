"""The commands' flags: one spelling for each shared flag, the same type and default wherever it
appears, taken by every command that does what it controls; an option spelled alike in two commands
reads alike (or is listed below with the reason it cannot); a flag that means nothing for the input
at hand is refused by name. Every command's parser is built as the CLI builds it."""

from __future__ import annotations

import argparse
import importlib
from collections import defaultdict

import pytest

from nbl_gguf import cli
from nbl_gguf.errors import NblError

# flag -> (the commands that must take it, what must be equal wherever it appears)
SHARED = {
    "--no-progress": ({"calibrate", "convert", "eval", "bench"},  # they show progress bars (eval: the sweep's
                      # calibration; bench: the converts that make its NBL files)
                      dict(option_strings=("--no-progress",), action="_StoreTrueAction", default=False)),
    "--threads": ({"calibrate", "convert", "eval", "bench"},  # PyTorch and/or llama.cpp CPU work
                  dict(option_strings=("-t", "--threads"), type="positive_int", default=None, metavar="N", nargs=None)),
    "--device": ({"calibrate", "convert", "eval", "bench"},  # PyTorch runs a model (calibration, --hf-compare)
                 dict(option_strings=("--device",), type=None, default="auto", choices=None, nargs=None)),
    "--dtype": ({"calibrate", "convert", "eval", "bench"},
                dict(option_strings=("--dtype",), default="auto", choices=("auto", "bf16", "fp16", "fp32"))),
    "--output": ({"calibrate", "convert", "eval", "bench"},  # inspect prints only
                 dict(option_strings=("-o", "--output"), action="_StoreAction", type=None, nargs=None)),
    "--seed": ({"calibrate", "convert", "bench"},
               dict(option_strings=("--seed",), type="int", default=0, metavar="N")),
    "--model": ({"calibrate", "convert", "eval", "bench"}, dict(option_strings=("--model",), default=None, nargs=None)),
    "--calibration": ({"convert", "eval", "bench"},
                      dict(option_strings=("--calibration",), default=None, metavar="ARTIFACT")),
}
# options spelled alike in several commands that read differently there, and why
DIFFERENT = {
    "--m": "calibrate and convert make one file: one count or 'auto'; bench and eval --sweep measure several counts",
    "--quant": "convert and bench make one type; eval --sweep measures several",
    "--criterion": "eval --sweep re-ranks one artifact per m and has no greedy (calibrate makes that walk)",
    "--method": "convert takes any word to explain why block-nbl cannot be a GGUF; calibrate lists its choices",
    "--batch-size": "calibration windows per forward pass (calibrate, convert); eval's -b is llama-perplexity's",
    "--taps": "convert also takes 'auto' (decided by the file it writes: runtime, method, architecture); calibrate "
              "writes no GGUF and takes a count",
}


def parsers() -> dict[str, argparse.ArgumentParser]:
    built = {}
    for name, (module, help_text) in cli.COMMANDS.items():
        parser = argparse.ArgumentParser(prog=f"nbl_gguf {name}", description=help_text)
        importlib.import_module(module).add_arguments(parser)
        built[name] = parser
    return built


def visible(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS and a.dest != "help"]


def reading(action: argparse.Action) -> dict:
    """How an option is read, by name (defaults, metavars and help may differ between commands)."""
    return dict(option_strings=tuple(action.option_strings), dest=action.dest, action=type(action).__name__,
                type=getattr(action.type, "__name__", action.type), nargs=action.nargs,
                choices=tuple(action.choices) if action.choices is not None else None)


def find(parser: argparse.ArgumentParser, flag: str) -> argparse.Action | None:
    return next((a for a in visible(parser) if flag in a.option_strings), None)


@pytest.mark.parametrize("flag", list(SHARED))
def test_a_shared_flag_is_one_flag_everywhere(flag):
    takers, wanted = SHARED[flag]
    found = {}
    for name, parser in parsers().items():
        action = find(parser, flag)
        if action is not None:
            attributes = {**reading(action), "default": action.default, "metavar": action.metavar}
            found[name] = {key: attributes[key] for key in wanted}
    assert takers <= set(found), f"{flag} missing in {sorted(takers - set(found))}"
    assert found == {name: wanted for name in found}


def test_an_option_spelled_alike_reads_alike():
    by_spelling = defaultdict(dict)
    for name, parser in parsers().items():
        for action in visible(parser):
            for spelling in action.option_strings:
                by_spelling[spelling][name] = reading(action)
    differing = {spelling for spelling, readings in by_spelling.items()
                 if len({tuple(r.items()) for r in readings.values()}) > 1}
    assert differing == set(DIFFERENT)


def test_old_spellings_are_hidden_aliases_of_the_new():
    """bench --hf-device/--hf-dtype/--output-dir and eval --out still read (the commands recorded in
    docs/results use them) but are not shown, store into the new flag, and no command shows them."""
    built = parsers()
    shown = {s for parser in built.values() for action in visible(parser) for s in action.option_strings}
    hidden = {}
    for name, parser in built.items():
        dests = {action.dest for action in visible(parser)}
        for action in parser._actions:
            if action.option_strings and action.help == argparse.SUPPRESS:
                hidden[action.option_strings[0]] = name
                assert action.dest in dests or action.dest == "out_alias", action.option_strings
                assert not set(action.option_strings) & shown, action.option_strings
    assert hidden == {"--hf-device": "bench", "--hf-dtype": "bench", "--output-dir": "bench", "--out": "eval"}
    args = built["bench"].parse_args(["--hf-device", "cpu", "--hf-dtype", "fp32", "--output-dir", "r"])
    assert (args.device, args.dtype, args.output) == ("cpu", "fp32", "r")
    assert built["bench"].parse_args([]).output == "bench-results"


def test_calibrate_flags_are_the_calibration_settings():
    """Every calibrate option is a field of calibration.settings.Settings with the parser's default, so
    that `calibrate` and `convert` hand the stage the same thing; convert passes on only such fields."""
    from dataclasses import asdict

    from nbl_gguf.calibration.settings import Settings
    from nbl_gguf.commands import calibrate, convert

    from nbl_gguf.calibration.refine import RefineSettings
    from nbl_gguf.commands import flags

    parser = parsers()["calibrate"]
    refine = set(flags.group_names(lambda parser: flags.add_refine_arguments(parser, "off")))
    assert {a.dest for a in parser._actions if a.dest != "help"} - refine == set(Settings.names())
    assert asdict(calibrate.settings(parser.parse_args([]))) == asdict(Settings())
    # the refinement's flags are RefineSettings' fields after 'refine_' (and --seed, --memory-budget, --no-progress)
    shared = {"seed", "memory_budget", "no_progress"}
    assert {name.removeprefix("refine_") for name in refine - {"refine"}} | shared == set(asdict(RefineSettings()))
    for command in ("calibrate", "convert"):
        assert flags.refine_settings(parsers()[command].parse_args([])) == RefineSettings()
        assert flags.refine_settings(parsers()[command].parse_args(["--refine-lr", "0.5", "--seed", "3"])) == \
            RefineSettings(lr=0.5, seed=3)
    assert set(convert.CALIBRATION_FLAGS) <= set(Settings.names())
    args = parsers()["convert"].parse_args(["--threads", "3", "--dtype", "fp32", "--criterion", "cca", "--nsamples", "5"])
    settings = convert.calibration_settings(args, "out-dir", "model-dir", taps=4)
    assert (settings.threads, settings.dtype, settings.criterion, settings.nsamples, settings.seqlen) == (3, "fp32", "cca",
                                                                                                          5, 2048)
    assert (settings.targets, settings.output, settings.model, settings.taps) == ("attn", "out-dir", "model-dir", 4)


@pytest.mark.parametrize("command", ["bench", "eval"])
def test_lists_of_m_take_commas_and_spaces(command):
    parser = parsers()[command]
    assert parser.parse_args(["--m", "2,4", "8"]).m == [2, 4, 8]
    assert parser.parse_args(["--m", "12"]).m == [12]


@pytest.mark.parametrize("command", ["calibrate", "convert", "bench", "eval"])
def test_threads_must_be_positive(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parsers()[command].parse_args(["-t", "0"])
    assert exit_info.value.code == 2
    assert "argument -t/--threads: must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["calibrate", "convert", "inspect"])
def test_the_micro_batch_is_llama_cpps_flag_and_must_be_positive(command, capsys):
    positional = ["x.gguf"] if command == "inspect" else []
    assert parsers()[command].parse_args(positional).ubatch_size == 512  # llama.cpp's own default
    assert parsers()[command].parse_args([*positional, "-ub", "128"]).ubatch_size == 128
    assert parsers()[command].parse_args([*positional, "--ubatch-size", "64"]).ubatch_size == 64
    with pytest.raises(SystemExit) as exit_info:
        parsers()[command].parse_args([*positional, "-ub", "0"])
    assert exit_info.value.code == 2
    assert "argument -ub/--ubatch-size: must be at least 1, got 0" in capsys.readouterr().err


# --- flags that mean nothing for the input at hand ----------------------------------------------

MEANINGLESS = {
    "eval-sweep-flag-without-sweep": (["eval", "a.gguf", "--model", "m", "--m", "2"],
                                      "--model, --m mean nothing without --sweep"),
    "eval-device-without-sweep": (["eval", "a.gguf", "--device", "cpu"], "--device means nothing without --sweep"),
    "eval-out-without-sweep": (["eval", "a.gguf", "--out", "results"], "--out results is the sweep's report folder"),
    "bench-layers-without-shape": (["bench", "--baseline", "s.gguf", "--nbl", "n.gguf", "--layers", "1:3"],
                                   "--layers 1:3 means nothing without --shape"),
    "bench-hf-model-without-compare": (["bench", "--baseline", "s.gguf", "--nbl", "n.gguf", "--hf-model", "hf"],
                                       "--hf-model hf means nothing without --hf-compare"),
    "bench-calibration-without-model": (["bench", "--shape", "llama-3.2-1b", "--calibration", "cal"],
                                        "--calibration cal means nothing without --model"),
    "bench-calib-nsamples-with-files": (["bench", "--baseline", "s.gguf", "--nbl", "n.gguf", "--calib-nsamples", "8"],
                                        "--calib-nsamples 8 means nothing without a calibration to make"),
    "bench-device-with-files": (["bench", "--baseline", "s.gguf", "--nbl", "n.gguf", "--device", "cpu"],
                                "--device cpu means nothing here: nothing runs in PyTorch"),
    "bench-dtype-with-calibration": (["bench", "--model", "embedded", "--calibration", "cal", "--dtype", "fp32"],
                                     "--dtype fp32 means nothing here"),
    "inspect-tensors-with-json": (["inspect", "x.gguf", "--json", "--tensors"],
                                  "--tensors means nothing with --json"),
}


@pytest.mark.parametrize("case", list(MEANINGLESS))
def test_a_flag_that_means_nothing_is_refused(case, capsys, tmp_path, monkeypatch):
    """Refused before any file is read or anything runs (the files named here do not exist)."""
    monkeypatch.chdir(tmp_path)
    argv, message = MEANINGLESS[case]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_save_calibration_means_nothing_with_a_calibration(tmp_path):
    from _convert_helpers import convert_args
    from nbl_gguf.commands.convert import convert

    with pytest.raises(NblError, match="--save-calibration keeps the calibration that this run makes; with "
                                       "--calibration cal it makes none"):
        convert(convert_args(calibration="cal", save_calibration=str(tmp_path / "keep"),
                             output=str(tmp_path / "out.gguf")))
    assert list(tmp_path.iterdir()) == []


def test_convert_options_and_their_command_line_agree():
    """bench and the frontier call convert.convert with convert.options(...) and record
    convert.command_line(...) as how the file was made: that line, parsed by convert's own parser, gives
    the same options; a name convert does not take is refused."""
    import shlex

    from nbl_gguf.commands import convert

    given = dict(model="dir with space", m=8, quant="q4_k_m", taps=4, no_eval=True, output="out/nbl.gguf", seed=3,
                 threads=2, nsamples=16, save_calibration="cal", windows=2, window_size=[128, 512])
    parser = argparse.ArgumentParser()
    convert.add_arguments(parser)
    # the --flag / --no-flag options both ways (their default: None, which the command resolves)
    for switches in (dict(refine=False, refine_balance=True), dict(refine=True, refine_balance=False)):
        options = convert.options(**given, **switches)
        assert {name: getattr(options, name) for name in given | switches} == given | switches
        words = shlex.split(convert.command_line(options))
        assert words[:4] == ["python", "-m", "nbl_gguf", "convert"]
        assert ("--refine" in words, "--no-refine" in words) == (switches["refine"], not switches["refine"])
        assert vars(parser.parse_args(words[4:])) == vars(options)
    assert vars(convert.options()) == vars(parser.parse_args([]))
    with pytest.raises(TypeError, match="no option bogus"):
        convert.options(bogus=1)


@pytest.mark.parametrize("argv", [
    ["nbl_gguf", "bench", "--frontier", "--m", "4", "--nbl-kv-types", "", "--prune-blocks", "0", "-o", "out dir"],
    ["nbl_gguf", "--frontier", "--kv-types", "q8_0,q8_0/q4_0", "--work-dir", "/tmp/it's here"],
])
def test_a_recorded_command_runs_again_as_it_ran(argv):
    # results files record the command; a shell reading it back must give bench the same options (an empty
    # --nbl-kv-types joined with spaces alone became `--nbl-kv-types --prune-blocks`, which bench refuses)
    import shlex

    from nbl_gguf.commands import flags

    words = shlex.split(flags.invocation("bench", argv))
    assert words[:4] == ["python", "-m", "nbl_gguf", "bench"]
    bench = parsers()["bench"]
    assert bench.parse_args(words[4:]) == bench.parse_args(argv[2:] if argv[1] == "bench" else argv[1:])
