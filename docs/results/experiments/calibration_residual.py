"""What a finished calibrate() leaves resident (refine.md): the resident set before it, after it, after
gc.collect() and after settings.release_freed_memory() (gc and glibc's malloc_trim), and the bytes of the
tensors still alive. Takes calibrate's flags.

    NBL_GGUF_BUILD=build python docs/results/experiments/calibration_residual.py --taps 4 --criterion cosine \\
        --m 12 --targets attn --nsamples 8 --no-progress -o /tmp/probe
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def resident() -> str:
    from nbl_gguf.usage import current_rss_bytes, peak_rss_bytes

    return f"RSS {current_rss_bytes() / 2**30:.2f} GiB (peak {peak_rss_bytes() / 2**30:.2f})"


def live_tensors() -> str:
    import torch

    count, stored = 0, 0
    for thing in gc.get_objects():
        if isinstance(thing, torch.Tensor):
            count, stored = count + 1, stored + thing.untyped_storage().nbytes()
    return f"{count} live tensors, {stored / 2**30:.3f} GiB of storage"


def main(argv=None) -> int:
    from nbl_gguf.calibration.calibrate import calibrate
    from nbl_gguf.calibration.settings import release_freed_memory
    from nbl_gguf.commands import calibrate as command

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    command.add_arguments(parser)
    chosen = command.settings(parser.parse_args(argv))
    print("start", resident(), flush=True)
    started = time.time()
    calibrate(chosen)
    print(f"calibrated in {time.time() - started:.0f} s", flush=True)
    print("after calibrate()", resident(), live_tensors(), flush=True)
    gc.collect()
    print("after gc.collect()", resident(), live_tensors(), flush=True)
    release_freed_memory()
    print("after release_freed_memory()", resident(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
