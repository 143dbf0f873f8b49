"""Wall time, peak resident memory and peak GPU memory of each stage of a command.

The peak resident set of a stage is the process's own high-water mark (VmHWM), reset at the start of
the stage through /proc/self/clear_refs (Linux; elsewhere the process's peak so far). The llama.cpp
tools a stage runs are separate processes that map their model files: their peaks are reported
apart (llamacpp.tools.run_measured records each tool's, from the kernel's accounting when it exits).
"""

from __future__ import annotations

import resource
import sys
import time
from contextlib import contextmanager
from pathlib import Path

CLEAR_REFS = Path("/proc/self/clear_refs")
STATUS = Path("/proc/self/status")
from nbl_gguf.llamacpp.tools import CHILD_PEAKS  # the tools' peaks, recorded as each one exits
# the stages running now, outermost first: a nested stage resets the high-water mark, so it hands its
# peak to the stages around it
_ACTIVE: list[dict] = []


def _reset_peak() -> bool:
    try:
        CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """The process's peak resident set since the last reset (or since it started)."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def current_rss_bytes() -> int:
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cuda():
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda
    return None


class StageMeter:
    """Records {stage: {wall_s, peak_rss_bytes[, peak_gpu_bytes][, tools]}} for the stages run under it."""

    def __init__(self):
        self.stages: dict[str, dict] = {}

    @contextmanager
    def __call__(self, name: str):
        before = peak_rss_bytes()  # the stages around this one keep the peak that the reset forgets
        for outer in _ACTIVE:
            outer["peak"] = max(outer["peak"], before)
        reset = _reset_peak()
        cuda = _cuda()
        if cuda is not None:
            cuda.reset_peak_memory_stats()
        children = len(CHILD_PEAKS)
        start = time.perf_counter()
        frame = {"peak": 0}
        _ACTIVE.append(frame)
        try:
            yield
        finally:
            del _ACTIVE[next(i for i, f in enumerate(_ACTIVE) if f is frame)]
            peak = max(peak_rss_bytes(), frame["peak"])
            for outer in _ACTIVE:
                outer["peak"] = max(outer["peak"], peak)
            record = {"wall_s": round(time.perf_counter() - start, 3), "peak_rss_bytes": peak}
            if not reset:
                record["peak_rss_is_process_peak"] = True
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
