"""Thin command-line front end: each sub-command is a module of nbl_gguf.commands.

A module registered here exposes ``add_arguments(parser)`` and ``run(args) -> int``. Modules are
imported only when their command runs, so ``inspect`` does not pay for importing torch.
"""

from __future__ import annotations

import _thread
import argparse
import importlib
import os
import signal
import sys
import threading

from nbl_gguf.errors import NblError

COMMANDS = {
    "calibrate": ("nbl_gguf.commands.calibrate", "collect statistics, solve NBL weights, score and select layers"),
    "convert": ("nbl_gguf.commands.convert", "HF model or GGUF -> NBL GGUF (calibrate, convert, rewrite, quantize)"),
    "inspect": ("nbl_gguf.commands.inspect", "show the NBL layer map, scores and tensors of a GGUF"),
    "bench": ("nbl_gguf.commands.bench", "speed and memory of NBL GGUFs against stock with llama-bench"),
    "eval": ("nbl_gguf.commands.eval", "perplexity and multiple-choice accuracy with llama-perplexity"),
    "soak": ("nbl_gguf.commands.soak", "llama-server with an NBL GGUF under concurrent clients: same answers, flat memory"),
}


def main(argv: list[str] | None = None) -> int:
    """Run one command in this process and return its exit code (128 + N after signal N)."""
    return _run(argv)[0]


def program() -> None:
    """The `nbl-gguf` / `python -m nbl_gguf` entry point: exits with the command's code, and an
    interrupted run dies by its signal, as an uncaught Ctrl-C ends any Python program. A shell then
    reports 128 + N and a calling script or make stops too. CPython itself ends that way, at random,
    after a KeyboardInterrupt that was caught (when it was first raised inside C-evaluated code), so
    taking this path every time keeps the exit status the same from one run to the next."""
    code, interrupt = _run(None)
    if interrupt is None:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(interrupt, signal.SIG_DFL)
    os.kill(os.getpid(), interrupt)
    sys.exit(code)  # reached only where the signal is blocked: the status a shell would have shown


def _run(argv: list[str] | None) -> tuple[int, signal.Signals | None]:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="nbl_gguf", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return (0 if argv else 2), None
    name = argv[0]
    if name not in COMMANDS:
        parser.parse_args(argv)  # prints the usage error and exits
    module_name, help_text = COMMANDS[name]
    stop = _Interrupts()
    try:
        with stop:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as error:
                if error.name == module_name:
                    print(f"nbl_gguf: the '{name}' command is not available in this build", file=sys.stderr)
                    return 2, None
                raise
            command_parser = argparse.ArgumentParser(prog=f"nbl_gguf {name}", description=help_text)
            module.add_arguments(command_parser)
            args = command_parser.parse_args(argv[1:])
            code = int(module.run(args) or 0)
            # a block-buffered stdout (a pipe) writes the command's last lines here, where a reader that
            # went away is caught below, not in the interpreter's final flush ("Exception ignored", status 120)
            sys.stdout.flush()
            return code, None
    except NblError as error:
        print(f"nbl_gguf {name}: error: {error}", file=sys.stderr)
        return 2, None
    except BrokenPipeError:
        # the reader went away (`inspect FILE | head`): stop quietly, as a command-line tool that SIGPIPE
        # ends would; stdout goes to devnull so that the interpreter's last flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE, None
    except KeyboardInterrupt:
        # every write is atomic and every temp file is removed while the interrupt unwinds: say so
        # in one line instead of a traceback through whatever was running
        print(f"nbl_gguf {name}: interrupted by {stop.signal_name}; no partial output was left", file=sys.stderr)
        return 128 + stop.signal_number, signal.Signals(stop.signal_number)


class _Interrupts:
    """SIGTERM (a plain ``kill``, a job scheduler, a container stop) unwinds like Ctrl-C, so that the
    same cleanup runs: temp dirs removed, child tools killed by subprocess.run.

    An interrupt that lands while a finalizer runs (a ``__del__``, a weakref callback: the import
    system and regex run such code all the time) is raised there, and CPython only prints it and goes
    on ("Exception ignored in"); the run would then finish as if nothing had happened. The
    unraisable hook sends the signal again, so that it is raised in the code the finalizer
    interrupted (without it, 2 of 60 converts sent SIGINT during their imports ran to the end; with
    it, 0 of 80; tests/test_cli_edges.py puts the signal in a finalizer every time)."""

    def __init__(self):
        self.signal_number = signal.SIGINT

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signal_number).name

    def _raise(self, signum, frame):
        self.signal_number = signum
        raise KeyboardInterrupt

    def _unraisable(self, unraisable):
        try:
            if not isinstance(unraisable.exc_value, KeyboardInterrupt):
                self._previous_hook(unraisable)
                return
        except KeyboardInterrupt:
            pass  # the signal came while the hook printed: CPython would swallow it here too
        # from another thread, a moment later: the handler runs in the next code the main thread runs, not
        # in this hook, where CPython would print it again, and not (most likely) in the same finalizer; if
        # it lands in a finalizer again, this hook sends it again. On a loaded machine the timer can fire before
        # start() returns here (start waits for the thread): then it is raised in this hook, where CPython drops
        # it ("Exception ignored in sys.unraisablehook", the run went on: 1 test run in 3 under load), so send
        # it again
        while True:
            try:
                timer = threading.Timer(0.01, _thread.interrupt_main, (self.signal_number,))
                timer.daemon = True
                timer.start()
                return
            except KeyboardInterrupt:
                continue

    def __enter__(self):
        # signal handlers belong to the main thread (cli.main called from a worker thread keeps the default)
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._raise)
            self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            sys.unraisablehook = self._previous_hook
        return False
