#!/usr/bin/env python3
"""Regenerate the bundled Python documentation and code texts (nbl_gguf/data/python-docs.json,
python-code.json, PSF-LICENSE.txt) from Debian bookworm's packages: the command line of
nbl_gguf.calibration.bundled_text.build, which says how (and nbl_gguf/data/README.md, which sha256s)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nbl_gguf.calibration.bundled_text import DATA, VERSION, build


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--doc-deb", type=Path, help=f"python3.11-doc_{VERSION}_all.deb")
    parser.add_argument("--stdlib-deb", type=Path, help=f"libpython3.11-stdlib_{VERSION}_amd64.deb")
    parser.add_argument("--doc-chars", type=int, default=4000, help="most characters kept of one page or module")
    parser.add_argument("--budget", type=int, default=130_000, help="characters of each kind, both parts together")
    parser.add_argument("-o", "--output", type=Path, default=DATA)
    args = parser.parse_args(argv)
    build(args.output, args.doc_deb, args.stdlib_deb, args.doc_chars, args.budget)
    return 0


if __name__ == "__main__":
    sys.exit(main())
