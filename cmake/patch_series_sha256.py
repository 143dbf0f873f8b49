"""sha256 over a patch series: each file's name and bytes, in the order given, each followed by a NUL.

nbl_gguf.gguf.from_artifact.llama_cpp_patches_sha256() computes the same digest for a GGUF's provenance, so
the version a build reports can be matched against a file. CMakeLists.txt runs this at configure time:
    python cmake/patch_series_sha256.py patches/0001-....patch patches/0002-....patch ...
"""

import hashlib
import pathlib
import sys

digest = hashlib.sha256()
for argument in sys.argv[1:]:
    patch = pathlib.Path(argument)
    digest.update(patch.name.encode("utf-8") + b"\0" + patch.read_bytes() + b"\0")
print(digest.hexdigest())
