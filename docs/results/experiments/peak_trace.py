"""Run `python -m nbl_gguf ARGS` with a thread that samples VmRSS every 20 ms and, at each new high of
+64 MiB, prints the main thread's innermost frames: where the resident set grows (Linux: /proc/self/status).

    .venv/bin/python docs/results/experiments/peak_trace.py calibrate --model DIR --m 4 --refine ... 2> trace.log
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

STEP = 64 << 20  # bytes above the last high before the next is printed
PERIOD = 0.02  # seconds between samples


def resident_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def watch(main_id: int, highs: list[int]) -> None:
    started = time.time()
    while True:
        rss = resident_bytes()
        if rss > (highs[-1] if highs else 0) + STEP:
            highs.append(rss)
            frames = traceback.extract_stack(sys._current_frames().get(main_id))[-5:]
            where = " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))
            print(f"PEAK {time.time() - started:8.1f}s {rss / 2**30:6.2f} GiB  {where}", file=sys.stderr, flush=True)
        time.sleep(PERIOD)


def main() -> int:
    from nbl_gguf.cli import main as nbl_main

    highs: list[int] = []
    threading.Thread(target=watch, args=(threading.main_thread().ident, highs), daemon=True).start()
    try:
        return nbl_main(sys.argv[1:])
    finally:
        print(f"FINAL PEAK {max(highs, default=0) / 2**30:.2f} GiB", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
