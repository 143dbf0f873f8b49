"""Regenerate the bundled held-out texts of two more kinds than C4: English technical prose (the Python
documentation) and source code (Python standard library modules), from Debian bookworm's packages.

    apt-get download python3.11-doc=3.11.2-6+deb12u9 libpython3.11-stdlib=3.11.2-6+deb12u9
    .venv/bin/python scripts/make_heldout_texts.py --doc-deb python3.11-doc_3.11.2-6+deb12u9_all.deb \\
        --stdlib-deb libpython3.11-stdlib_3.11.2-6+deb12u9_amd64.deb

Without --doc-deb/--stdlib-deb it runs that `apt-get download` into a temporary folder. It reads the
.deb files with the standard library only (ar archive, data.tar.xz), and writes
nbl_gguf/data/python-docs.json, python-code.json and PSF-LICENSE.txt (the license of both). The same
packages give the same bytes; the sha256 of the packages and of the outputs are in nbl_gguf/data/README.md.

Each output is a JSON list of {"text", "source", "part"} documents: one page of the documentation, or
one module, cut at a paragraph (prose) or top-level statement (code) boundary to at most --doc-chars
characters. Documents alternate between the parts: the 1st, 3rd, ... are "selection" (the held-out
windows that layer selection may measure), the 2nd, 4th, ... "evaluation" (the summary's held-out
perplexity), so the two never share a document.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import re
import subprocess
import sys
import tarfile
import tempfile
from html.parser import HTMLParser
from pathlib import Path

VERSION = "3.11.2-6+deb12u9"
PACKAGES = {"doc": f"python3.11-doc={VERSION}", "stdlib": f"libpython3.11-stdlib={VERSION}"}
DATA = Path(__file__).resolve().parent.parent / "data"  # nbl_gguf/data
DOC_ROOT = "usr/share/doc/python3.11/html/"
STDLIB_ROOT = "usr/lib/python3.11/"
# prose: the tutorial, the HOWTOs and the FAQ (running text; the library reference is mostly API entries)
DOC_SECTIONS = ("tutorial/", "howto/", "faq/")
# code: the modules of the package, without tests, demos and generated or joke files
CODE_SKIP = re.compile(r"(^|/)(test|tests|idlelib|lib2to3|turtledemo|__phello__|pydoc_data)/|"
                       r"(^|/)(_sysconfigdata.*|this|antigravity|__hello__)\.py$")
BLOCK_TAGS = {"p", "pre", "div", "section", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd", "tr",
              "table", "ul", "ol", "dl", "blockquote", "br", "figure", "caption"}
SKIP_TAGS = {"script", "style", "nav"}  # nav: a page's own table of contents


def deb_members(deb: Path) -> dict[str, bytes]:
    """{path: bytes} of the regular files in a .deb's data archive (ar, then data.tar.xz)."""
    blob = deb.read_bytes()
    if not blob.startswith(b"!<arch>\n"):
        raise SystemExit(f"{deb} is not a .deb (no ar header)")
    offset, data = 8, None
    while offset < len(blob):
        header = blob[offset:offset + 60]
        name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58].decode())
        body = blob[offset + 60:offset + 60 + size]
        if name.startswith("data.tar"):
            data = body
        offset += 60 + size + (size % 2)
    if data is None or not name:
        raise SystemExit(f"{deb} has no data.tar member")
    raw = lzma.decompress(data) if data[:6] == b"\xfd7zXZ\x00" else data
    files = {}
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        for member in tar:
            if member.isfile():
                files[member.name.removeprefix("./")] = tar.extractfile(member).read()
    return files


class BodyText(HTMLParser):
    """The text of a Sphinx page's main body: paragraphs separated by blank lines, code blocks verbatim,
    permalink marks and scripts left out."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.depth = 0  # div nesting inside the body (0: outside it)
        self.skip, self.skip_tag = 0, ""  # depth in the element left out, and its tag
        self.pre = 0
        self.blocks: list[str] = []
        self.current: list[str] = []
        self.item = False  # a list item began: its first block gets the bullet

    def _flush(self):
        text = "".join(self.current)
        text = text.strip("\n") if self.pre else re.sub(r"\s+", " ", text).strip()
        if text:
            self.blocks.append(("- " if self.item else "") + text)
            self.item = False
        self.current = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if not self.depth:
            if tag == "div" and attrs.get("role") == "main":
                self.depth = 1
            return
        if tag == "div":
            self.depth += 1
        if self.skip:  # inside a left-out element: only its own nesting counts
            self.skip += tag == self.skip_tag
            return
        if tag in SKIP_TAGS or (tag == "a" and "headerlink" in (attrs.get("class") or "")):
            self.skip, self.skip_tag = 1, tag
        elif tag in BLOCK_TAGS:
            self._flush()
            if tag == "pre":
                self.pre += 1
            elif tag == "li":
                self.item = True

    def handle_endtag(self, tag):
        if not self.depth:
            return
        if self.skip:
            self.skip -= tag == self.skip_tag
        elif tag in BLOCK_TAGS:
            self._flush()
            if tag == "pre":
                self.pre = max(0, self.pre - 1)
        if tag == "div":
            self.depth -= 1

    def handle_data(self, data):
        if self.depth and not self.skip:
            self.current.append(data)

    def text(self) -> str:
        self._flush()
        return "\n\n".join(self.blocks)


def cut(text: str, limit: int, boundary: re.Pattern) -> str:
    """``text`` cut to at most ``limit`` characters at the last ``boundary`` before it."""
    if len(text) <= limit:
        return text.strip()
    stops = [m.start() for m in boundary.finditer(text, 0, limit + 1) if m.start() > 0]
    return text[:stops[-1] if stops else limit].strip()


def prose_documents(files: dict[str, bytes], limit: int) -> list[dict]:
    pages = sorted(p for p in files if p.startswith(DOC_ROOT) and p.endswith(".html")
                   and p[len(DOC_ROOT):].startswith(DOC_SECTIONS) and not p.endswith("/index.html"))
    documents = []
    for page in pages:
        parser = BodyText()
        parser.feed(files[page].decode("utf-8"))
        text = cut(parser.text(), limit, re.compile(r"\n\n"))
        if text:
            documents.append({"text": text, "source": page[len(DOC_ROOT):]})
    return documents


def code_documents(files: dict[str, bytes], limit: int) -> list[dict]:
    modules = sorted(p for p in files if p.startswith(STDLIB_ROOT) and p.endswith(".py")
                     and not CODE_SKIP.search(p[len(STDLIB_ROOT):]))
    documents = []
    for module in modules:
        source = files[module].decode("utf-8")
        # from the first top-level def or class: code rather than the module docstring and imports
        start = re.search(r"^(def|class|async def) ", source, re.M)
        if start is None:
            continue
        text = cut(source[start.start():], limit, re.compile(r"\n(?=\S)"))
        if len(text) >= limit // 4:  # a module with little code says little
            documents.append({"text": text, "source": module[len(STDLIB_ROOT):]})
    return documents


def alternate(documents: list[dict], budget: int) -> list[dict]:
    """Documents spread evenly over the whole list until ``budget`` characters, parts alternating."""
    total = sum(len(d["text"]) for d in documents)
    step = max(1.0, total / budget)
    chosen, position = [], 0.0
    while int(position) < len(documents) and sum(len(d["text"]) for d in chosen) < budget:
        chosen.append(documents[int(position)])
        position += step
    return [{**d, "part": "selection" if i % 2 == 0 else "evaluation"} for i, d in enumerate(chosen)]


def download(folder: Path) -> dict[str, Path]:
    subprocess.run(["apt-get", "download", *PACKAGES.values()], cwd=folder, check=True)
    found = {kind: next(folder.glob(spec.split("=")[0] + "_*.deb")) for kind, spec in PACKAGES.items()}
    return found


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build(output: Path = DATA, doc_deb: Path | None = None, stdlib_deb: Path | None = None, doc_chars: int = 4000,
          budget: int = 130_000) -> None:
    """Write python-docs.json, python-code.json and PSF-LICENSE.txt into ``output`` from the two Debian
    packages (downloaded with apt-get where not both given): at most ``doc_chars`` characters of one page
    or module, ``budget`` characters of each kind (both parts together)."""
    with tempfile.TemporaryDirectory() as tmp:
        debs = {"doc": doc_deb, "stdlib": stdlib_deb}
        if not all(debs.values()):
            debs = download(Path(tmp))
        for kind, deb in debs.items():
            print(f"{deb.name}: sha256 {sha256(deb.read_bytes())}", file=sys.stderr)
        docs, stdlib = deb_members(debs["doc"]), deb_members(debs["stdlib"])
    outputs = {
        "python-docs.json": alternate(prose_documents(docs, doc_chars), budget),
        "python-code.json": alternate(code_documents(stdlib, doc_chars), budget),
    }
    for name, documents in outputs.items():
        blob = (json.dumps(documents, ensure_ascii=False, indent=0) + "\n").encode("utf-8")
        (output / name).write_bytes(blob)
        parts = {part: sum(len(d["text"]) for d in documents if d["part"] == part) for part in ("selection", "evaluation")}
        print(f"{name}: {len(documents)} documents, {parts['selection']:,} + {parts['evaluation']:,} characters, "
              f"{len(blob):,} bytes, sha256 {sha256(blob)}", file=sys.stderr)
    license_text = stdlib[STDLIB_ROOT + "LICENSE.txt"]
    (output / "PSF-LICENSE.txt").write_bytes(license_text)
    print(f"PSF-LICENSE.txt: {len(license_text):,} bytes, sha256 {sha256(license_text)}", file=sys.stderr)
