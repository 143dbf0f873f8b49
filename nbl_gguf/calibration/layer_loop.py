"""The calibration pass: every layer fitted in turn, one layer's weights in memory (calibration.stream),
its statistics and solve in calibration.layer_fit, its results and the hidden states in the resume
state (calibration.resume)."""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from nbl_gguf.calibration.capture import capture_activations
from nbl_gguf.calibration.hidden import HiddenStates
from nbl_gguf.calibration.memory_plan import HiddenPlan
from nbl_gguf.calibration.stream import LayerStream, batches


@dataclass
class StreamTimes:
    """Seconds spent in each part of the layer loop, summed over layers, and each layer's total."""

    parts: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    per_layer: list[float] = field(default_factory=list)

    @contextmanager
    def part(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.parts[name] += time.perf_counter() - start

    def as_report(self) -> dict:
        return {"parts_s": {k: round(v, 3) for k, v in self.parts.items()},
                "per_layer_s": [round(v, 3) for v in self.per_layer]}


def calibrate_layers(stream: LayerStream, calib_ids: torch.Tensor, heldout_ids: torch.Tensor | None, state,
                     *, batch_size: int, targets, stats_device: str, save_covariances: bool, plan: HiddenPlan,
                     progress: bool = True, times: StreamTimes | None = None, taps: int = 1,
                     taps_rank: int | None = None) -> list[dict]:
    """Fit every layer, streaming; returns the per-layer entries (their tensors are in ``state``).

    ``state`` (calibration.resume.CalibrationState, opened) holds the finished layers and the hidden
    states; a state with layers done continues after them. ``taps`` > 1 also fits each layer's
    past-token map (calibration.layer_fit: from the same moments as its per-token map)."""
    from tqdm import tqdm

    from nbl_gguf.calibration.layer_fit import LayerFit

    times = times or StreamTimes()
    count, seqlen = calib_ids.shape
    held = 0 if heldout_ids is None else heldout_ids.shape[0]
    d = stream.hidden_size
    shape = (count, seqlen, d)
    num_layers = stream.num_layers
    done = state.layers_done

    def calib_store(layer: int, existing: bool) -> HiddenStates:
        return HiddenStates(shape, stream.dtype, plan.memory, state.path(f"calib-{layer}.bin"), existing)

    def held_store(layer: int, existing: bool) -> HiddenStates | None:
        if not held:
            return None
        return HiddenStates((held, seqlen, d), stream.dtype, None, state.path(f"heldout-{layer}.bin"), existing)

    if done < num_layers:
        with times.part("embedding"):
            if done == 0:
                stream.prepare_embedding(calib_ids, heldout_ids)
                current, current_held = calib_store(0, False), held_store(0, False)
                for start, stop in batches(count, batch_size):
                    current.write(start, stream.embed(calib_ids[start:stop]))
                for start, stop in batches(held, batch_size):
                    current_held.write(start, stream.embed(heldout_ids[start:stop]))
                stream.release_embedding()
                current.flush()
                if current_held is not None:
                    current_held.flush()
            else:
                current, current_held = calib_store(done, True), held_store(done, True)

    with_block = "block" in targets
    entries = [state.layer_entry(i) for i in range(done)]
    bar = tqdm(total=num_layers, initial=done, desc="calibration layers", unit="layer", disable=not progress,
               file=sys.stderr)
    for k in range(done, num_layers):
        layer_start = time.perf_counter()
        with times.part("load_weights"):
            stream.load_layer(k)
        layer_fit = LayerFit(k, d, stats_device, with_block, taps)

        def on_attention(i, h, x, y):
            with times.part("statistics"):
                layer_fit.on_attention(h, x, y)

        def on_block(i, h, out):
            with times.part("statistics"):
                layer_fit.on_block(h, out)

        following = calib_store(k + 1, False) if k + 1 < num_layers else None
        following_held = held_store(k + 1, False)
        with times.part("forward"), capture_activations(stream.model, stream.adapter, on_attention,
                                                        on_block, only=[k]):
            for start, stop in batches(count, batch_size):
                out = stream.run_layer(k, current.read(start, stop))
                if following is not None:
                    following.write(start, out)
                layer_fit.check_finite()
        with times.part("heldout"):
            for start, stop in batches(held, batch_size):
                following_held.write(start, stream.run_layer(k, current_held.read(start, stop)))
        with times.part("solve"):
            entry, tensors = layer_fit.solve(save_covariances, taps_rank)
        layer_fit = None  # its sums (K d x K d with taps: 2 GiB at d 4096) are not kept into the next layer
        with times.part("save"):
            state.save_layer(k, entry, tensors)
            for store in (following, following_held):
                if store is not None:
                    store.flush()
            state.finish_layer(k)
        stream.release_layer(k)
        if current.path is not None:
            current.path.unlink(missing_ok=True)
        current, current_held = following, following_held
        entries.append(entry)
        times.per_layer.append(time.perf_counter() - layer_start)
        bar.update()
    bar.close()
    return entries
