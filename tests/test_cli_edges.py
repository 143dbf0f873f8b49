"""The command line at its edges. Where its output goes away early: `nbl_gguf inspect FILE | head` ends
quietly, with SIGPIPE's status (128 + 13) and no traceback, as other command-line tools do. The commands
run as a user's shell runs them: stdout to a pipe is block-buffered (this environment's PYTHONUNBUFFERED
dropped). Where a signal lands inside a finalizer: the run still stops."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from nbl_gguf.fixtures.tiny import TinyLlama

SIGPIPE_STATUS = 128 + 13


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    # 16 layers: inspect --json prints about 30 KB, more than a 4 KiB pipe and Python's 8 KiB buffer
    # hold; inspect about 2 KB, which the buffer holds
    return TinyLlama(n_layer=16).write_gguf(tmp_path_factory.mktemp("cli") / "tiny.gguf")


def inspect_into(write_end: int, *argv) -> subprocess.Popen:
    env = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    return subprocess.Popen([sys.executable, "-m", "nbl_gguf", "inspect", *map(str, argv)], stdout=write_end,
                            stderr=subprocess.PIPE, text=True, env=env)


def test_a_reader_that_stops_after_one_line_ends_the_command_quietly(tiny_gguf):
    """`| head -1`: the command is still writing when the reader goes away."""
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)  # the smallest pipe: the output cannot fit in it
    command = inspect_into(write_end, "--json", tiny_gguf)
    os.close(write_end)
    with os.fdopen(read_end) as reader:
        first_line = reader.readline()
    _, stderr = command.communicate(timeout=120)
    assert first_line == "{\n"
    assert stderr == ""  # no traceback, no "Exception ignored"
    assert command.returncode == SIGPIPE_STATUS


def test_a_reader_gone_before_the_last_flush_ends_the_command_quietly(tiny_gguf):
    """The reader closes before the command writes: all that the command printed is still in Python's
    buffer when it returns, and the write that fails is the flush after it."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    command = inspect_into(write_end, tiny_gguf)
    os.close(write_end)
    _, stderr = command.communicate(timeout=120)
    assert stderr == ""
    assert command.returncode == SIGPIPE_STATUS


# a command whose run() drops an object whose finalizer gets the signal: CPython prints an exception raised
# in a finalizer and goes on, as it did with a Ctrl-C during convert's imports (2 runs of 60 finished)
FINALIZER_COMMAND = textwrap.dedent("""
    import signal, sys, time, types
    from nbl_gguf import cli

    class Finalized:
        def __del__(self):
            signal.raise_signal(signal.{name})
            for _ in range(100):  # the handler runs here, inside the finalizer
                pass

    def run(args):
        Finalized()
        for _ in range(500):  # 5 s of work after it
            time.sleep(0.01)
        print("ran to the end", flush=True)
        return 0

    sys.modules["finalizer_command"] = types.SimpleNamespace(add_arguments=lambda parser: None, run=run)
    cli.COMMANDS["finalizer"] = ("finalizer_command", "drops an object whose finalizer gets the signal")
    sys.argv = ["nbl_gguf", "finalizer"]
    cli.program()
""")


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_signal_that_lands_in_a_finalizer_still_stops_the_run(name):
    number = getattr(signal, name)
    completed = subprocess.run([sys.executable, "-c", FINALIZER_COMMAND.format(name=name)], capture_output=True,
                               text=True, timeout=120, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert completed.returncode == -number, completed.stdout + completed.stderr
    assert "ran to the end" not in completed.stdout
    assert f"nbl_gguf finalizer: interrupted by {name}" in completed.stderr
    assert "Exception ignored" not in completed.stderr and "Traceback" not in completed.stderr, completed.stderr
