"""Where the layer-streamed calibration keeps the windows' hidden states (a GPU, host memory or disk),
from the memory one layer needs and the budget; and the disk its resume state needs at most."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nbl_gguf import models
from nbl_gguf.calibration.hidden import tensor_bytes
from nbl_gguf.calibration.stream import LayerStream
from nbl_gguf.errors import NblError


@dataclass
class HiddenPlan:
    """Where the hidden states live: 'memory' (a device) or files only, from the memory budget."""

    memory: str | None
    reason: str
    fixed: int = 0  # bytes planned for one layer, its statistics, the solve and a batch's activations
    hidden: int = 0  # bytes of the hidden states (this layer's input and output, calibration and held-out)


def taps_bytes(d: int, taps: int) -> int:
    """Memory of one layer's taps statistics (float64 sums over the K d stacked inputs) and their solve
    ((K-1) d square float64 matrices: 6 to 7.4 of them at the peak, measured by
    docs/results/experiments/bench_taps_layer.py at d 1024 and 2048 on a CPU and 4096 on an H200); 0 without taps."""
    if taps < 2:
        return 0
    stacked = taps * d
    return (stacked * stacked + d * stacked) * 8 + 7 * ((taps - 1) * d) ** 2 * 8


def plan_hidden(stream: LayerStream, windows: int, seqlen: int, heldout: int, batch_size: int, targets,
                budget_bytes: int | None, taps: int = 1) -> HiddenPlan:
    """Check that one layer fits and decide where the windows' hidden states go: on the compute
    device when they fit beside one layer (a GPU's free memory; on a CPU, ``budget_bytes``), else in
    host memory within ``budget_bytes``, else on disk."""
    d = stream.hidden_size
    layer = stream.layer_bytes()
    stats = (2 if "block" in targets else 1) * (3 * d * d * 8 + 3 * d * d * 4) + taps_bytes(d, taps)
    solve = 8 * d * d * 8  # eigendecompositions and whitening in float64
    inter = max((getattr(models.text_config(stream.config), "intermediate_size", 4 * d) or 4 * d), d)
    activations = batch_size * seqlen * (6 * d + 3 * inter) * 4
    fixed = layer + stats + solve + activations
    hidden = 2 * tensor_bytes((windows + heldout, seqlen, d), stream.dtype)
    gib = 2**30
    parts = (f"the layer's weights {layer / gib:.2f}, its statistics {stats / gib:.2f}, the solve {solve / gib:.2f}, "
             f"a batch's activations {activations / gib:.2f}")
    if stream.device.startswith("cuda"):
        free = torch.cuda.mem_get_info(torch.device(stream.device))[0]
        if fixed > free:
            raise NblError(f"{stream.device} has {free / gib:.2f} GiB free, and one layer of {stream.name} needs about "
                           f"{fixed / gib:.2f} GiB ({parts}): use --stats-device cpu, a smaller --batch-size, or "
                           f"--device cpu")
        if fixed + hidden <= 0.9 * free:
            return HiddenPlan(stream.device, f"hidden states on {stream.device} ({hidden / gib:.2f} GiB)", fixed, hidden)
        fixed = 0  # the layer is on the GPU: host memory holds only the hidden states
    elif budget_bytes is not None and budget_bytes < fixed:
        raise NblError(f"--memory-budget {budget_bytes / gib:.2f} GiB cannot hold one layer of {stream.name}: it needs "
                       f"about {fixed / gib:.2f} GiB ({parts})")
    if budget_bytes is None or fixed + hidden <= budget_bytes:
        where = "memory" if budget_bytes is not None else "memory (no budget given)"
        return HiddenPlan("cpu", f"hidden states in {where} ({hidden / gib:.2f} GiB)", fixed, hidden)
    return HiddenPlan(None, f"hidden states on disk ({hidden / gib:.2f} GiB over the budget's "
                            f"{(budget_bytes - fixed) / gib:.2f} GiB left after one layer)", fixed, hidden)


def estimated_state_bytes(stream: LayerStream, windows: int, heldout: int, seqlen: int, targets, taps: int = 1) -> int:
    """Disk the state needs at most: two layers' worth of calibration hidden states, every layer's
    held-out input, and every layer's results (maps with and without bias, block maps)."""
    d = stream.hidden_size
    calib = 2 * tensor_bytes((windows, seqlen, d), stream.dtype)
    held = (stream.num_layers + 1) * tensor_bytes((heldout, seqlen, d), stream.dtype)
    per_layer = (2 + (1 if "block" in targets else 0)) * d * d * 4 + 8 * d * 8
    if taps > 1:  # at most the full form: taps d x d weights
        per_layer += taps * d * d * 4
    return calib + held + stream.num_layers * per_layer
