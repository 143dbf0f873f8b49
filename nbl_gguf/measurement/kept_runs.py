"""llama-perplexity and the passkey test, kept in a measurement.memo.Memo under what they measured, so that a long
command run again after an interruption takes them instead of measuring them again.

Both are pure functions of their key: the file's content, the text's (perplexity) or the prompts' settings and the
source that writes them (passkey), the context, the cache type, the threads and the llama.cpp build. Speeds are not
kept: they are measured side by side in one run, and a number from another run (another load on the machine) would
not compare. Used by `convert --kv-budget/--total-budget` (measurement.kv_budget) and `bench --frontier`
(measurement.frontier).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from nbl_gguf.measurement.memo import Memo, file_key, llama_build_key


@dataclass
class Run:
    value: object  # llamacpp.perplexity.Perplexity or measurement.passkey.PasskeyResult
    seconds: float  # what the measurement took when it was made
    kept: bool  # taken from an earlier run


class KeptRuns:
    """Perplexities and passkey tests through ``memo`` (None, or a Memo of no folder: each is measured every time).
    ``clock``: seconds, for the time a measurement took."""

    def __init__(self, memo: Memo | None = None, threads: int | None = None, clock: Callable[[], float] = time.monotonic):
        self.memo = memo or Memo(None)
        self.threads = threads
        self.clock = clock
        self._build = None

    @property
    def keeps(self) -> bool:
        return self.memo.folder is not None

    def _key(self, what: str, path, kv_type: str, **settings) -> dict | None:
        if not self.keeps:
            return None
        if self._build is None:
            self._build = llama_build_key()
        return {"what": what, "file": file_key(path), "kv_type": kv_type, "threads": self.threads,
                "build": self._build} | settings

    def _perplexity_key(self, path, text, n_ctx: int, chunks: int | None, kv_type: str) -> dict | None:
        # "form": the first memo version kept a bare number under the same fields; its entries are not this form
        return self._key("llama-perplexity", path, kv_type, n_ctx=n_ctx, chunks=chunks,
                         text=file_key(text) if self.keeps else None, form="Perplexity fields")

    def _passkey_key(self, path, lengths, depths, kv_type: str) -> dict | None:
        from nbl_gguf.measurement import passkey as passkey_module

        # the prompts are this package's (passkey.py: filler, wording, keys by a fixed seed): its source is in the key
        return self._key("passkey", path, kv_type, lengths=list(lengths), depths=list(depths),
                         prompts=file_key(passkey_module.__file__) if self.keeps else None)

    def _run(self, key: dict | None, compute: Callable[[], object], encode, decode) -> Run:
        def measured() -> tuple[object, float]:
            started = self.clock()
            value = compute()
            return value, self.clock() - started

        if key is None:
            return Run(*measured(), False)

        def entry() -> dict:
            value, seconds = measured()
            return {"value": encode(value), "s": seconds}

        kept, was_kept = self.memo.cached(key, entry)
        return Run(decode(kept["value"]), float(kept["s"]), was_kept)

    def perplexity(self, path: Path, text: Path, n_ctx: int, chunks: int | None, kv_type: str = "f16") -> Run:
        """llamacpp.perplexity.perplexity of ``path`` on ``text`` with that cache type."""
        from nbl_gguf.llamacpp import perplexity as llama_perplexity

        return self._run(self._perplexity_key(path, text, n_ctx, chunks, kv_type),
                         lambda: llama_perplexity.perplexity(path, text, n_ctx=n_ctx, chunks=chunks,
                                                             threads=self.threads, cache_type=kv_type),
                         asdict, _perplexity_of)

    def has_perplexity(self, path: Path, text: Path, n_ctx: int, chunks: int | None, kv_type: str = "f16") -> bool:
        """Whether an earlier run kept that perplexity (a run of perplexity() would take it)."""
        key = self._perplexity_key(path, text, n_ctx, chunks, kv_type)
        return key is not None and self.memo.get(key) is not None

    def passkey(self, path: Path, lengths, depths, kv_type: str = "f16") -> Run:
        """measurement.passkey.passkey of ``path`` at those prompt lengths and depths with that cache type."""
        from nbl_gguf.measurement import passkey as passkey_module

        def decode(value) -> passkey_module.PasskeyResult:
            return passkey_module.PasskeyResult([passkey_module.Trial(**trial) for trial in value])

        return self._run(self._passkey_key(path, lengths, depths, kv_type),
                         lambda: passkey_module.passkey(path, tuple(lengths), tuple(depths), kv_type=kv_type,
                                                        threads=self.threads),
                         lambda result: [asdict(trial) for trial in result.trials], decode)


def _perplexity_of(value: dict):
    from nbl_gguf.llamacpp.perplexity import Perplexity

    return Perplexity(**value)
