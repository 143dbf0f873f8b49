"""Wall time, peak resident memory and peak GPU memory of each stage of a command.

The process's own high-water mark (VmHWM) is never reset: resetting it (/proc/self/clear_refs) also
resets what the kernel reports for the process when it exits, so `/usr/bin/time -v`, a parent's
ru_maxrss or a job scheduler would see only the peak since the last reset (measured: a 2.1 GB peak
before a reset read as 0.3 GB). A stage that raises the process's high-water mark gets that mark,
exact; a stage that does not gets the largest resident set sampled while it ran (every
SAMPLE_INTERVAL_S, and at its start and end), marked as sampled. The llama.cpp tools a stage runs are
separate processes that map their model files: their peaks are reported apart
(llamacpp.tools.run_measured records each tool's own, read while it runs).
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from nbl_gguf.llamacpp.tools import CHILD_PEAKS, high_water_mark  # CHILD_PEAKS: the tools' peaks, as each exits

STATM = Path("/proc/self/statm")
SAMPLE_INTERVAL_S = 0.02
# the stages running now; the sampler raises each one's sampled peak
_ACTIVE: list[dict] = []
_LOCK = threading.Lock()
_SAMPLER: dict = {}


def peak_rss_bytes() -> int:
    """The process's peak resident set since it started."""
    mark = high_water_mark()
    if mark is not None:
        return mark
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def current_rss_bytes() -> int:
    try:
        return int(STATM.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _sample_forever(stop: threading.Event) -> None:
    while not stop.wait(SAMPLE_INTERVAL_S):
        rss = current_rss_bytes()
        with _LOCK:
            for frame in _ACTIVE:
                frame["sampled"] = max(frame["sampled"], rss)


def _open(frame: dict) -> None:
    with _LOCK:
        _ACTIVE.append(frame)
        if not _SAMPLER:
            stop = threading.Event()
            thread = threading.Thread(target=_sample_forever, args=(stop,), name="rss-sampler", daemon=True)
            _SAMPLER.update(stop=stop, thread=thread)
            thread.start()


def _close(frame: dict) -> None:
    with _LOCK:
        del _ACTIVE[next(i for i, f in enumerate(_ACTIVE) if f is frame)]  # by identity: frames can be equal
        sampler = dict(_SAMPLER) if not _ACTIVE else None
        if sampler:
            _SAMPLER.clear()
    if sampler:
        sampler["stop"].set()
        sampler["thread"].join()


def _cuda():
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda
    return None


class StageMeter:
    """Records {stage: {wall_s, peak_rss_bytes[, peak_rss_sampled][, peak_gpu_bytes][, tools]}} for the
    stages run under it."""

    def __init__(self):
        self.stages: dict[str, dict] = {}

    @contextmanager
    def __call__(self, name: str):
        mark_before = peak_rss_bytes()
        cuda = _cuda()
        if cuda is not None:
            cuda.reset_peak_memory_stats()  # the allocator's own counter: resetting it hides nothing from the kernel
        children = len(CHILD_PEAKS)
        start = time.perf_counter()
        frame = {"sampled": current_rss_bytes()}
        _open(frame)
        try:
            yield
        finally:
            _close(frame)
            mark_after = peak_rss_bytes()
            record = {"wall_s": round(time.perf_counter() - start, 3)}
            if mark_after > mark_before:
                record["peak_rss_bytes"] = mark_after  # this stage set the process's peak: exact
            else:
                record["peak_rss_bytes"] = max(frame["sampled"], current_rss_bytes())
                record["peak_rss_sampled"] = True
            with _LOCK:  # the stages around this one ran through it: its peak is theirs too
                for outer in _ACTIVE:
                    outer["sampled"] = max(outer["sampled"], record["peak_rss_bytes"])
            cuda = _cuda()
            if cuda is not None:
                record["peak_gpu_bytes"] = int(cuda.max_memory_allocated())
            tools = CHILD_PEAKS[children:]
            if tools:
                record["tools_peak_rss_bytes"] = {tool: peak for tool, peak in tools}
            self.stages[name] = record

    @property
    def timings(self) -> dict[str, float]:
        return {name: record["wall_s"] for name, record in self.stages.items()}

    def merge(self, stages: dict[str, dict], prefix: str = "") -> None:
        for name, record in stages.items():
            self.stages[prefix + name] = record
