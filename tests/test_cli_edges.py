"""The command line where its output goes away early: `nbl_gguf inspect FILE | head` ends quietly, with
SIGPIPE's status (128 + 13) and no traceback, as other command-line tools do. The commands run as a
user's shell runs them: stdout to a pipe is block-buffered (this environment's PYTHONUNBUFFERED dropped)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

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
