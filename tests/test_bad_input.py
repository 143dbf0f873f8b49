"""The bad-input matrix: each command (calibrate, convert, inspect, eval, bench), run as a real
subprocess on bad input, exits non-zero with a message that names the problem (the flag, the file,
the tensor, the signal) and leaves nothing behind: no output, no temp file, no work dir.

Every case runs in a folder of its own that holds its inputs; after the run the folder must hold
exactly those, unchanged. Inputs that several cases read (a tiny HF model, a calibration artifact of
it, tiny GGUFs) are made once, elsewhere. A read-only folder is made real for root too (root writes
into a chmod-555 folder): a read-only bind mount in a private mount namespace (`unshare --mount`);
where that is not permitted, /proc stands in for it.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from _convert_helpers import calibrate_for_convert, convert_args, save_tiny_llama
from nbl_gguf.calibration.artifact import REPORT, WEIGHTS
from nbl_gguf.llamacpp.tools import bin_dir, source_dir

ROOT = Path(__file__).resolve().parent.parent
N_LAYER = 4
RUN_TIMEOUT = 180
# the tiny model's convert settings: seconds of calibration, an F32 output (no llama-quantize), no eval
TINY_CONVERT = ("--nsamples", "8", "--seqlen", "64", "--device", "cpu", "--criterion", "cca", "--quant", "f32",
                "--no-eval", "--no-refine")


@dataclass(frozen=True)
class Shared:
    model: Path  # tiny HF llama (4 layers, d=64)
    artifact: Path  # its calibration
    gguf: Path  # a tiny stock GGUF
    nbl: Path  # and an NBL GGUF of the same model
    snapshot: dict  # listing() of the folder that holds them: no case may change them either


@dataclass(frozen=True)
class Interrupt:
    signal: int
    when: str  # text on stderr that says the step to interrupt has begun
    child: bool = False  # wait for a child process too (the converter, a llama.cpp tool)


@dataclass(frozen=True)
class Case:
    argv: tuple[str, ...]  # after `python -m nbl_gguf`; {model} {artifact} {gguf} {nbl} {ro} are filled in
    expect: tuple[str, ...]  # regexes that stderr must match
    prepare: Callable[[Path, Shared], None] | None = None  # writes the case's own inputs into its folder
    needs: tuple[str, ...] = ()  # llama.cpp tools or the converter that the failing check runs
    read_only: bool = False  # {ro} is a read-only folder
    interrupt: Interrupt | None = None


# --- case inputs -------------------------------------------------------------------------------------

def write(name: str, data: bytes | str) -> Callable[[Path, Shared], None]:
    def prepare(folder: Path, shared: Shared) -> None:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
    return prepare


def model_copy(edit: Callable[[Path], None]) -> Callable[[Path, Shared], None]:
    """The tiny model copied to ./model, then damaged by ``edit``."""
    def prepare(folder: Path, shared: Shared) -> None:
        shutil.copytree(shared.model, folder / "model")
        edit(folder / "model")
    return prepare


def truncate(path: Path, fraction: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * fraction)])


def gpt2_folder(folder: Path, shared: Shared) -> None:
    """A HF folder of an architecture nbl-gguf does not handle (the weights are never read)."""
    model = folder / "gpt2"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2, '
                                       '"n_embd": 64, "n_head": 4, "vocab_size": 100}')
    (model / "model.safetensors").write_bytes(b"\0" * 64)


def artifact_copy(edit: Callable[[Path], None]) -> Callable[[Path, Shared], None]:
    """The shared calibration copied to ./artifact, then tampered with by ``edit``."""
    def prepare(folder: Path, shared: Shared) -> None:
        shutil.copytree(shared.artifact, folder / "artifact")
        edit(folder / "artifact")
    return prepare


def edit_tensors(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(artifact: Path) -> None:
        from safetensors.numpy import load_file, save_file

        tensors = load_file(str(artifact / WEIGHTS))
        change(tensors)
        save_file(tensors, str(artifact / WEIGHTS))
    return edit


def cut_gguf(folder: Path, shared: Shared) -> None:
    (folder / "cut.gguf").write_bytes(shared.gguf.read_bytes()[: shared.gguf.stat().st_size * 6 // 10])


def read_only_folder(folder: Path, shared: Shared) -> None:
    (folder / "ro").mkdir()


def _pop(name):
    return lambda tensors: tensors.pop(name)


def _shorten(name):
    return lambda tensors: tensors.__setitem__(name, tensors[name][:-1].copy())


def _nan(name):
    def change(tensors):
        tensors[name] = tensors[name].copy()
        tensors[name][0, 0] = np.nan
    return change


# convert on the tampered artifact asks for all 4 layers' maps
ARTIFACT_CONVERT = ("convert", "--model", "{model}", "--calibration", "artifact", "--m", "4", *TINY_CONVERT,
                    "--no-progress", "-o", "out.gguf")

CASES = {
    # unknown commands, flags and values
    "unknown-command": Case(("frobnicate",), (r"invalid choice: 'frobnicate'",)),
    "convert-unknown-flag": Case(("convert", "--model", "{model}", "--frobnicate", "-o", "out.gguf"),
                                 (r"unrecognized arguments: --frobnicate",)),
    "convert-unknown-quant": Case(("convert", "--model", "{model}", "--quant", "q9_z", "-o", "out.gguf"),
                                  (r"unknown quantization type 'q9_z'",), needs=("llama-quantize",)),
    "calibrate-m-not-a-number": Case(("calibrate", "--m", "lots"),
                                     (r"argument --m: expected a number of layers or 'auto', got 'lots'",)),
    "calibrate-unknown-selection-text": Case(("calibrate", "--selection-text", "wiki:1"),
                                             (r"argument --selection-text: --selection-text 'wiki:1': use mix, "
                                              r"calibration or KIND:WEIGHT",)),
    "convert-ctx-size-zero": Case(("convert", "--ctx-size", "0", "-o", "out.gguf"),
                                  (r"argument -c/--ctx-size: must be at least 1, got 0",)),
    "calibrate-unknown-criterion": Case(("calibrate", "--criterion", "vibes"),
                                        (r"argument --criterion: invalid choice: 'vibes'",)),
    "bench-bad-depths": Case(("bench", "--shape", "llama-3.2-1b", "--depths", "0,x"),
                             (r"argument -d/--depths: expected comma-separated integers, got '0,x'",)),
    # options that mean nothing for a GGUF --model, given explicitly
    "convert-gguf-intermediate": Case(("convert", "--model", "{gguf}", "--intermediate", "f32", "-o", "out.gguf"),
                                      (r"--intermediate f32 means nothing for a GGUF --model",)),
    "bench-gguf-quant": Case(("bench", "--model", "{gguf}", "--quant", "q4_k_m"),
                             (r"--quant q4_k_m means nothing for a GGUF --model: the stock side is tiny\.gguf",)),
    # m out of range
    "convert-m-too-large": Case(("convert", "--model", "{model}", "--m", "9", *TINY_CONVERT, "-o", "out.gguf"),
                                (r"--m 9 is out of range: tiny-llama has 4 layers",)),
    # window layers: checked before any calibration
    "convert-windows-stock-runtime": Case(("convert", "--model", "{model}", "--windows", "2", "--runtime", "stock",
                                           *TINY_CONVERT, "-o", "out.gguf"),
                                          (r"--windows and --runtime stock: window layers need the patched llama\.cpp",)),
    "convert-windows-too-many": Case(("convert", "--model", "{model}", "--windows", "5", *TINY_CONVERT, "-o", "out.gguf"),
                                     (r"--windows 5: tiny-llama has 4 layers",)),
    "convert-window-ctx-too-short": Case(("convert", "--model", "{model}", "--windows", "1", "--window-ctx", "1024",
                                          *TINY_CONVERT, "-o", "out.gguf"),
                                         (r"--window-size 512 at --window-ctx 1024: .* \(1025 or more\)",)),
    "convert-window-sinks-negative": Case(("convert", "--windows", "1", "--window-sinks", "-1", "-o", "out.gguf"),
                                          (r"--window-sinks: .*expected 0 or more, got -1",)),
    "convert-window-retrieval-word": Case(("convert", "--windows", "1", "--window-retrieval", "strict", "-o", "out.gguf"),
                                          (r"--window-retrieval: expected nats per answer token \(0 or more\) or 'off', "
                                           r"got 'strict'",)),
    "calibrate-m-negative": Case(("calibrate", "--model", "{model}", "--m", "-1", "--device", "cpu", "-o", "cal"),
                                 (r"--m -1 is out of range: the model has 4 layers",)),
    # empty and non-text datasets
    "calibrate-empty-dataset": Case(("calibrate", "--model", "{model}", "--dataset", "empty.txt", "--device", "cpu",
                                     "--criterion", "cca", "-o", "cal"),
                                    (r"empty\.txt contains no text",), prepare=write("empty.txt", "\n\n  \n")),
    "calibrate-binary-dataset": Case(("calibrate", "--model", "{model}", "--dataset", "photo.txt", "--device", "cpu",
                                      "--criterion", "cca", "-o", "cal"),
                                     (r"photo\.txt is not UTF-8 text",),
                                     prepare=write("photo.txt", b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR\xff\xfe" * 8)),
    "convert-dataset-without-text": Case(("convert", "--model", "{model}", "--dataset", "rows.jsonl", *TINY_CONVERT,
                                          "-o", "out.gguf"),
                                         (r"rows\.jsonl:1: expected strings or objects with a 'text' string",),
                                         prepare=write("rows.jsonl", '{"text": 5}\n{"text": 6}\n')),
    # missing, corrupt and unsupported model folders
    "convert-missing-model": Case(("convert", "--model", "./nowhere", *TINY_CONVERT, "-o", "out.gguf"),
                                  (r"--model \./nowhere: no such folder",)),
    "calibrate-missing-model": Case(("calibrate", "--model", "./nowhere", "-o", "cal"),
                                    (r"--model \./nowhere: no such folder",)),
    "convert-corrupt-config": Case(("convert", "--model", "model", *TINY_CONVERT, "-o", "out.gguf"),
                                   (r"model/config\.json is not valid JSON",),
                                   prepare=model_copy(lambda m: (m / "config.json").write_text('{"model_type": "lla'))),
    "convert-truncated-weights": Case(("convert", "--model", "model", *TINY_CONVERT, "-o", "out.gguf"),
                                      (r"model/model\.safetensors: tensor \S+ runs past the end of the file \(truncated\?\)",),
                                      prepare=model_copy(lambda m: truncate(m / "model.safetensors"))),
    "convert-weights-not-safetensors": Case(("convert", "--model", "model", *TINY_CONVERT, "-o", "out.gguf"),
                                            (r"model/model\.safetensors is not a safetensors file",),
                                            prepare=model_copy(lambda m: (m / "model.safetensors").write_bytes(
                                                (12).to_bytes(8, "little") + b"<html>oops</"))),
    "calibrate-unsupported-architecture": Case(("calibrate", "--model", "gpt2", "--device", "cpu", "-o", "cal"),
                                               (r"unsupported architecture 'gpt2' \(GPT2LMHeadModel\)",),
                                               prepare=gpt2_folder),
    "convert-unsupported-architecture": Case(("convert", "--model", "gpt2", *TINY_CONVERT, "-o", "out.gguf"),
                                             (r"unsupported architecture 'gpt2' \(GPT2LMHeadModel\)",),
                                             prepare=gpt2_folder),
    # tampered calibration artifacts
    "convert-artifact-missing-tensor": Case(ARTIFACT_CONVERT, (r"has no tensor attn\.2\.weight",),
                                            prepare=artifact_copy(edit_tensors(_pop("attn.2.weight")))),
    "convert-artifact-wrong-shape": Case(ARTIFACT_CONVERT,
                                         (r"tensor attn\.1\.bias has shape \[63\], expected \[64\]",),
                                         prepare=artifact_copy(edit_tensors(_shorten("attn.1.bias")))),
    "convert-artifact-nan": Case(ARTIFACT_CONVERT, (r"tensor attn\.3\.weight is not finite",),
                                 prepare=artifact_copy(edit_tensors(_nan("attn.3.weight")))),
    "convert-artifact-cut-report": Case(ARTIFACT_CONVERT, (r"artifact/report\.json is not valid JSON",),
                                        prepare=artifact_copy(lambda a: truncate(a / REPORT))),
    # truncated GGUFs
    "inspect-truncated-gguf": Case(("inspect", "cut.gguf"), (r"cut\.gguf is truncated",), prepare=cut_gguf),
    "eval-truncated-gguf": Case(("eval", "{nbl}", "cut.gguf", "--chunks", "1"), (r"cut\.gguf is truncated",),
                                prepare=cut_gguf),
    "bench-truncated-gguf": Case(("bench", "--baseline", "cut.gguf", "--nbl", "{nbl}", "--no-plot"),
                                 (r"cut\.gguf is truncated",), prepare=cut_gguf, needs=("llama-bench",)),
    # outputs in missing or read-only folders
    "convert-output-missing-folder": Case(("convert", "--model", "{model}", *TINY_CONVERT, "-o", "nowhere/out.gguf"),
                                          (r"-o nowhere/out\.gguf: the folder nowhere does not exist",)),
    "convert-output-read-only": Case(("convert", "--model", "{model}", *TINY_CONVERT, "-o", "{ro}/out.gguf"),
                                     (r"-o \S*out\.gguf: cannot write in",), prepare=read_only_folder, read_only=True),
    "calibrate-output-read-only": Case(("calibrate", "--model", "{model}", "--device", "cpu", "-o", "{ro}/cal"),
                                       (r"-o \S*cal: cannot write in",), prepare=read_only_folder, read_only=True),
    "eval-output-missing-folder": Case(("eval", "{nbl}", "-o", "nowhere/eval.json"),
                                       (r"-o nowhere/eval\.json: the folder nowhere does not exist",)),
    "bench-output-read-only": Case(("bench", "--baseline", "{gguf}", "--nbl", "{nbl}", "-o", "{ro}/results"),
                                   (r"-o \S*results: cannot write in",), prepare=read_only_folder, read_only=True,
                                   needs=("llama-bench",)),
    # interrupted runs: Ctrl-C while calibrating, `kill` while the llama.cpp converter runs
    "convert-sigint-while-calibrating": Case(
        ("convert", "--model", "{model}", *TINY_CONVERT, "-o", "out.gguf"), (r"interrupted by SIGINT",),
        interrupt=Interrupt(signal.SIGINT, "compute on the CPU"), needs=("converter",)),
    "convert-sigterm-while-converting": Case(
        ("convert", "--model", "{model}", "--calibration", "{artifact}", "--m", "2", *TINY_CONVERT, "-o", "out.gguf"),
        (r"interrupted by SIGTERM",), interrupt=Interrupt(signal.SIGTERM, "stock conversion", child=True),
        needs=("converter",)),
}


# --- running a case ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Shared:
    from nbl_gguf.fixtures.tiny import TinyLlama

    base = tmp_path_factory.mktemp("shared")
    model = save_tiny_llama(base / "tiny-llama", N_LAYER)
    artifact = calibrate_for_convert(base / "artifact", model, convert_args(model=str(model), m=2))
    tiny = TinyLlama(n_layer=2)
    gguf_path = tiny.write_gguf(base / "tiny.gguf")
    nbl = tiny.write_nbl_gguf(base / "tiny-nbl.gguf", [0, 1], tiny.random_linear([1]))
    return Shared(model, artifact, gguf_path, nbl, listing(base))


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["HF_HUB_OFFLINE"] = "1"  # a model or dataset name that is not a local path fails at once
    return env


def listing(folder: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``folder`` (hidden ones too) with its size and modification time."""
    return {str(p.relative_to(folder)): (p.stat().st_size if p.is_file() else -1, p.stat().st_mtime_ns)
            for p in folder.rglob("*")}


@functools.lru_cache(maxsize=None)
def read_only_mounts() -> bool:
    """Whether this process may make a read-only bind mount in a private mount namespace."""
    with tempfile.TemporaryDirectory() as folder:
        probe = subprocess.run(["unshare", "--mount", "sh", "-c", _RO_MOUNT + 'touch "$0/x" 2>/dev/null; test $? = 1',
                                folder], capture_output=True)
        return probe.returncode == 0 and not os.listdir(folder)


_RO_MOUNT = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && '


def command_for(case: Case, folder: Path, shared: Shared) -> list[str]:
    ro = "ro"
    prefix: list[str] = []
    if case.read_only:
        if os.geteuid() != 0:
            (folder / "ro").chmod(0o555)
        elif shutil.which("unshare") and read_only_mounts():
            prefix = ["unshare", "--mount", "sh", "-c", _RO_MOUNT + 'exec "$@"', str(folder / "ro")]
        else:
            ro = "/proc"  # exists, is a folder, and takes no new files, even from root
    values = {"model": shared.model, "artifact": shared.artifact, "gguf": shared.gguf, "nbl": shared.nbl, "ro": ro}
    return [*prefix, sys.executable, "-m", "nbl_gguf", *(arg.format(**values) for arg in case.argv)]


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def run_interrupted(command: list[str], folder: Path, interrupt: Interrupt) -> tuple[int, str]:
    """Start ``command``, wait for ``interrupt.when`` on its stderr (and a child process), send the signal."""
    # SIGINT as a terminal's Ctrl-C finds it: a child of a background job (`cmd &`, some CI runners)
    # inherits SIGINT ignored, and Python then never turns it into KeyboardInterrupt
    process = subprocess.Popen(command, cwd=folder, env=environment(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: process.stderr.read1(4096), b"")))
    reader.start()
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        while interrupt.when.encode() not in b"".join(chunks) or (interrupt.child and not children(process.pid)):
            assert process.poll() is None, "finished before it could be interrupted:\n" + b"".join(chunks).decode()
            assert time.monotonic() < deadline, "never reached the step to interrupt"
            time.sleep(0.02)
        kids = children(process.pid)
        process.send_signal(interrupt.signal)
        code = process.wait(timeout=RUN_TIMEOUT)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        reader.join()
    # the child tool went with it (subprocess.run kills it while the interrupt unwinds)
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{kid}").exists() for kid in kids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [kid for kid in kids if Path(f"/proc/{kid}").exists()], "a child process outlived the interrupt"
    return code, b"".join(chunks).decode("utf-8", "replace")


def missing_prerequisites(case: Case) -> list[str]:
    missing = [tool for tool in case.needs if tool != "converter" and not (bin_dir() / tool).is_file()]
    if "converter" in case.needs and not (source_dir() / "convert_hf_to_gguf.py").is_file():
        missing.append("the llama.cpp converter")
    return missing


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name, shared, tmp_path):
    case = CASES[name]
    missing = missing_prerequisites(case)
    if missing:
        pytest.skip(f"not built: {', '.join(missing)} (scripts/build_llama.sh)")
    folder = tmp_path / "case"
    folder.mkdir()
    if case.prepare:
        case.prepare(folder, shared)
    before = listing(folder)
    command = command_for(case, folder, shared)
    try:
        if case.interrupt:
            code, stderr = run_interrupted(command, folder, case.interrupt)
            # it dies by the signal (a shell shows 128 + N), every time: CPython alone would do so only
            # sometimes after a caught KeyboardInterrupt, and exit 130 the other times
            assert code == -case.interrupt.signal, \
                f"exit status {code}, not killed by {case.interrupt.signal.name}; its stderr:\n{stderr}"
            assert "Traceback" not in stderr, stderr
        else:
            completed = subprocess.run(command, cwd=folder, env=environment(), capture_output=True, text=True,
                                       errors="replace", timeout=RUN_TIMEOUT)
            code, stderr = completed.returncode, completed.stderr
            assert code != 0, completed.stdout
            assert "Traceback" not in stderr, stderr
    finally:
        if case.read_only and (folder / "ro").exists():
            (folder / "ro").chmod(0o755)
    for pattern in case.expect:
        assert re.search(pattern, stderr), f"{pattern!r} not in:\n{stderr}"
    assert listing(folder) == before, f"left behind: {sorted(set(listing(folder)) - set(before))}"
    assert listing(shared.artifact.parent) == shared.snapshot


def test_matrix_covers_every_command_and_kind():
    commands = {case.argv[0] for case in CASES.values()}
    assert {"calibrate", "convert", "inspect", "eval", "bench"} <= commands
    assert len(CASES) >= 20
    assert {case.interrupt.signal for case in CASES.values() if case.interrupt} == {signal.SIGINT, signal.SIGTERM}
