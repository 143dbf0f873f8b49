"""What a calibration is asked for (``Settings``, built by the commands) and every check of it that
needs no model, so that a typo costs nothing: the calibration stage (calibration.calibrate) takes
these settings and parses no arguments."""

from __future__ import annotations

import ctypes
import gc
import os
from dataclasses import dataclass, fields
from pathlib import Path

from nbl_gguf.calibration.artifact import DEFAULT_CRITERION, TARGETS
from nbl_gguf.errors import NblError
from nbl_gguf.kv_cache import DEFAULT_UBATCH

METHODS = ("attn-nbl", "attn-drop", "block-nbl")
DEFAULT_M = 12
# Calibration windows: 256 on a GPU (the paper's 256 x 2048); on a CPU 32 x 2048 = 65k tokens: 4x fewer
# tokens (16k) already gave nearly the same maps and held-out perplexity (docs/results/quality.md,
# "Calibration size"), and it leaves time for the held-out selection within the old main job's budget
DEFAULT_NSAMPLES = {"cuda": 256, "cpu": 32}
DEFAULT_SELECTION_TOKENS = 8192  # held out for best/greedy/auto: 4 windows of 2048 by default
# of the held-out windows: the mix chose the same layers as C4 alone at m = 4 and 8 on both models we have,
# and with --m auto on Qwen kept the budget on docs and code where C4 alone did not (docs/results/selection-text.md)
DEFAULT_SELECTION_TEXT = "mix"
DEFAULT_MAX_PPL_INCREASE = 10.0
DEFAULT_TAPS = 1  # tokens a replaced layer reads: 1 is the per-token NBL map (calibration.taps for more)
MAX_TAPS = 64  # what the patched llama.cpp's taps layers read at most (nbl_format.MAX_TAPS)
DEFAULT_OUTPUT_ROOT = Path("out") / "calibration"


def selection_budget(m, max_ppl_increase) -> tuple[int | None, float | None]:
    """(m or None for auto, budget or None); a budget needs --m auto."""
    if m == "auto":
        return None, DEFAULT_MAX_PPL_INCREASE if max_ppl_increase is None else max_ppl_increase
    if max_ppl_increase is not None:
        raise NblError("--max-ppl-increase goes with --m auto (a fixed --m ignores it)")
    return m, None


def parse_targets(text: str) -> tuple[str, ...]:
    """'attn' or 'attn,block' (the attention statistics are always collected: they choose the layers)."""
    targets = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or "attn" not in targets:
        raise NblError(f"--targets {text!r}: use 'attn' or 'attn,block'")
    return tuple(t for t in TARGETS if t in targets)



def default_m(num_layers: int) -> int:
    return max(0, min(DEFAULT_M, num_layers - 1))


def check_arguments(settings: Settings) -> tuple[tuple[str, ...], int | None, float | None, bool]:
    """(targets, m or None, budget or None, whether the selection needs held-out windows): every check
    that needs no model, so that a typo costs nothing."""
    targets = parse_targets(settings.targets)
    m_fixed, budget = selection_budget(settings.m, settings.max_ppl_increase)
    needs_heldout = settings.m == "auto" or settings.criterion in ("greedy", "best")
    if needs_heldout and settings.method == "block-nbl":
        raise NblError("--m auto and --criterion greedy/best replace attention layers: use --method attn-nbl or "
                       "attn-drop, or a fixed --m with --criterion cosine, nmse or cca")
    if needs_heldout and settings.selection_windows is not None and settings.selection_windows < 1:
        raise NblError(f"--selection-windows must be at least 1, got {settings.selection_windows}")
    from nbl_gguf.calibration.artifact import METHOD_TARGET

    if METHOD_TARGET[settings.method] not in targets:
        raise NblError(f"--method {settings.method} needs the block statistics: use --targets attn,block")
    if settings.memory_budget is not None and settings.memory_budget <= 0:
        raise NblError(f"--memory-budget must be a positive number of GiB, got {settings.memory_budget:g}")
    check_taps(settings.taps, settings.taps_rank, settings.method)
    return targets, m_fixed, budget, needs_heldout


def check_taps(taps: int, taps_rank: int | None, method: str) -> None:
    """--taps K (and --taps-rank): past-token maps of the attention of attn-nbl."""
    if taps < 1:
        raise NblError(f"--taps must be at least 1 (1: today's per-token maps), got {taps}")
    if taps > MAX_TAPS:
        raise NblError(f"--taps {taps}: a taps layer reads at most {MAX_TAPS} tokens")
    if taps_rank is not None and taps_rank < 1:
        raise NblError(f"--taps-rank must be at least 1, got {taps_rank}")
    if taps > 1 and method != "attn-nbl":
        raise NblError(f"--taps {taps} fits past-token maps of the attention: it goes with --method attn-nbl, "
                       f"not {method}")


def release_freed_memory() -> None:
    """Hand the memory that earlier stages freed back to the system before the next stage is sized and
    loaded. glibc keeps freed heap pages resident (after a finished SmolLM2 calibration, 0.96 of its
    1.06 GiB peak with no tensor alive; 0.41 GiB after this): MemAvailable does not count them, and
    a large load that follows, the model form's whole model, does not reuse them."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to hand back this way


def memory_budget_bytes(settings: Settings) -> int:
    """--memory-budget, or half of the memory available now."""
    if settings.memory_budget is not None:
        return int(settings.memory_budget * 2**30)
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        available = 8 * 2**30
    return available // 2


@dataclass
class Settings:
    """What a calibration is asked for: the `calibrate` command's options, under the same names (the
    command's parser gives these defaults; tests/test_command_flags.py holds them equal)."""

    model: str | None = None  # HF folder, hub id or GGUF file (None: the embedded model)
    dataset: str | None = None
    dataset_config: str | None = None
    split: str = "train"
    text_field: str = "text"
    nsamples: int | None = None  # None: DEFAULT_NSAMPLES of the device
    seqlen: int = 2048
    batch_size: int = 1
    dtype: str = "auto"
    device: str = "auto"
    memory_budget: float | None = None  # GiB; None: half the available memory
    whole_model: bool = False  # deprecated: the same engine runs either way (calibrate says so)
    stats_device: str | None = None
    m: int | str | None = None  # a layer count, "auto", or None for default_m
    max_ppl_increase: float | None = None
    criterion: str = DEFAULT_CRITERION
    selection_windows: int | None = None
    candidates: int | None = None
    selection_text: str = DEFAULT_SELECTION_TEXT
    ctx_size: int | None = None  # the context of the KV figures; None: the model's training context
    kv_type: str = "f16"  # the cache type of the KV figures (llama.cpp's -ctk/-ctv)
    ubatch_size: int = DEFAULT_UBATCH  # the micro-batch of the KV figures (llama.cpp's -ub): a sliding-window cache holds one
    method: str = "attn-nbl"
    taps: int = DEFAULT_TAPS
    taps_rank: int | None = None  # None: calibration.taps.default_rank
    output: str | None = None  # the artifact directory; None: DEFAULT_OUTPUT_ROOT / the model's name
    seed: int = 0
    targets: str = "attn,block"
    save_covariances: bool = False
    no_progress: bool = False
    threads: int | None = None  # PyTorch's CPU threads; None: its default

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
