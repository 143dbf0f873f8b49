"""The stage meter against the kernel's own accounting of the process (what /usr/bin/time -v reads)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20

# a stage that peaks at 400 MiB and frees it, then one that holds 60 MiB, the second nested in an outer
# stage; the process prints its stages and exits
CHILD = """
import json, time
from nbl_gguf.usage import StageMeter, current_rss_bytes
baseline = current_rss_bytes()
meter = StageMeter()
def touch(n):
    block = bytearray(n)
    block[::4096] = b"x" * len(block[::4096])
    return block
with meter("big"):
    block = touch(400 << 20)
    del block
with meter("outer"):
    with meter("small"):
        block = touch(60 << 20)
        time.sleep(0.1)
        del block
print(json.dumps({"baseline": baseline, "stages": meter.stages}))
"""


# the kernel's peak of a child counts the parent's resident set at the fork (until the exec), so the
# child is started by a small interpreter rather than by this test process, which may hold a model
WAIT = """
import json, os, subprocess, sys
process = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
stdout = process.stdout.read()
_, status, usage = os.wait4(process.pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
print(json.dumps(dict(json.loads(stdout), kernel_peak=usage.ru_maxrss * 1024)))
"""


def run_child():
    """The child's stages, its resident set before them, and its peak as the kernel reports it at exit."""
    result = json.loads(subprocess.run([sys.executable, "-c", WAIT, CHILD], cwd=ROOT, capture_output=True,
                                       text=True, check=True).stdout)
    return result["stages"], result["baseline"], result["kernel_peak"]


def test_the_kernel_still_sees_the_peak_of_an_earlier_stage():
    stages, baseline, kernel_peak = run_child()
    # what /usr/bin/time -v reports: a meter that reset the high-water mark would leave the peak of the
    # last stage here (about 60 MiB above the interpreter)
    assert kernel_peak >= baseline + 390 * MiB
    assert "peak_rss_sampled" not in stages["big"]  # it set the process's peak: read exactly
    assert stages["big"]["peak_rss_bytes"] == kernel_peak


def test_a_stage_below_the_process_peak_gets_its_sampled_peak():
    stages, baseline, kernel_peak = run_child()
    small = stages["small"]
    assert small["peak_rss_sampled"] is True
    assert baseline + 55 * MiB <= small["peak_rss_bytes"] < baseline + 200 * MiB
    # the stage around it ran through it
    assert stages["outer"]["peak_rss_bytes"] >= small["peak_rss_bytes"]


def test_a_tool_s_peak_is_its_own_not_the_parent_s():
    from nbl_gguf.llamacpp.tools import CHILD_PEAKS, run_measured
    from nbl_gguf.usage import peak_rss_bytes

    held = bytearray(300 * MiB)  # this process's peak is at least 300 MiB when the tool starts
    held[::4096] = b"x" * len(held[::4096])
    assert peak_rss_bytes() >= 300 * MiB
    tool = "import time; block = bytearray(50 << 20); block[::4096] = b'y' * len(block[::4096]); time.sleep(0.3)"
    done = run_measured([sys.executable, "-c", tool], "allocator")
    assert done.returncode == 0
    label, peak = CHILD_PEAKS[-1]
    # the kernel's ru_maxrss of the child would read this process's 300 MiB and more
    assert label == "allocator" and 50 * MiB <= peak < 200 * MiB
    del held


def test_the_table_ends_with_the_whole_run_s_peak():
    from nbl_gguf.commands.convert_summary import resources_table
    from nbl_gguf.gguf.inspect import human_bytes
    from nbl_gguf.usage import StageMeter, peak_rss_bytes

    meter = StageMeter()
    with meter("stage"):
        pass
    block = bytearray(80 * MiB)  # between the stages: only the whole run sees it
    block[::4096] = b"z" * len(block[::4096])
    peak = peak_rss_bytes()
    del block
    last = resources_table(meter.stages, process_peak=peak).splitlines()[-1].split()
    assert last[:3] == ["the", "whole", "run"] and " ".join(last[3:]) == human_bytes(peak)
    assert peak >= 80 * MiB and peak >= meter.stages["stage"]["peak_rss_bytes"]
