"""What reading a GGUF's metadata costs: gguf-py's GGUFReader against nbl_gguf.gguf_header.read_header, each
in a fresh process (its resident set before and at its high-water mark, and the wall time), on the files
given; and whether the two read the same keys and tensor entries.

    .venv/bin/python docs/results/experiments/header_reader_cost.py FILE.gguf [FILE.gguf ...]

Result: docs/results/rss-accounting.md (section 3).
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import json, sys, time
def vm(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
which, path = sys.argv[1], sys.argv[2]
import gguf, numpy
from nbl_gguf.gguf_header import read_header
before, start = vm("VmRSS:"), time.perf_counter()
if which == "gguf-py":
    reader = gguf.GGUFReader(path)
    keys, tensors = len(reader.fields), len(reader.tensors)
else:
    header = read_header(path)
    keys, tensors = len(header.fields), len(header.tensors)
seconds = time.perf_counter() - start
print(json.dumps({"reader": which, "seconds": round(seconds, 3), "keys": keys, "tensors": tensors,
                  "rss_before": before, "peak": vm("VmHWM:"), "held": vm("VmRSS:")}))
"""

SAME = r"""
import sys, gguf
from nbl_gguf.gguf_header import read_header
path = sys.argv[1]
ours, theirs = read_header(path), gguf.GGUFReader(path)
same = list(ours.fields) == list(theirs.fields) and all(
    ours.fields[k].contents() == f.contents() for k, f in theirs.fields.items()) and [
    (t.name, t.data_offset, t.n_bytes) for t in ours.tensors] == [
    (t.name, int(t.data_offset), int(t.n_bytes)) for t in theirs.tensors]
print("same" if same else "DIFFERENT")
"""


def main(paths: list[str]) -> None:
    mib = 1 << 20
    print("| file | reader | keys | tensors | seconds | peak over the start (MiB) |")
    print("|---|---|---:|---:|---:|---:|")
    for path in paths:
        for which in ("gguf-py", "gguf_header"):
            out = subprocess.run([sys.executable, "-c", CHILD, which, path], check=True, capture_output=True,
                                 text=True).stdout
            row = json.loads(out)
            print(f"| {path.rsplit('/', 1)[-1]} | {which} | {row['keys']} | {row['tensors']} | {row['seconds']} | "
                  f"{(row['peak'] - row['rss_before']) / mib:.0f} |")
        same = subprocess.run([sys.executable, "-c", SAME, path], check=True, capture_output=True, text=True)
        print(f"<!-- {path}: {same.stdout.strip()} -->")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
