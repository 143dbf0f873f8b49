"""Speed-up statistics of llama-bench measurements: mean and spread per cell, per-round ratios, the
measured speed-up against the roofline prediction, and the measured KV cache against the GGUF's."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from nbl_gguf.errors import NblError
from nbl_gguf.measurement.roofline import ModelCost, predicted_speedup


TARGET_EFFICIENCY = 0.9


@dataclass
class Cell:
    backend: str
    label: str
    test: str
    n_tokens: int
    depth: int
    mean_ts: float
    std_ts: float
    samples: list[float]


def aggregate(measurements: list[dict]) -> dict[tuple, Cell]:
    """(backend, label, test, depth) -> mean and spread over every sample of every round."""
    groups: dict[tuple, list[dict]] = {}
    for record in measurements:
        key = (record["backend"], record["label"], record["test"], record["depth"])
        groups.setdefault(key, []).append(record)
    cells = {}
    for key, records in groups.items():
        samples = [s for r in records for s in r["samples_ts"]]
        n_tokens = records[0]["n_prompt"] if key[2] == "pp" else records[0]["n_gen"]
        cells[key] = Cell(*key[:3], n_tokens, key[3], statistics.fmean(samples),
                          statistics.stdev(samples) if len(samples) > 1 else 0.0, samples)
    return cells


def round_ratios(measurements: list[dict], backend: str, label: str, test: str, depth: int) -> list[float]:
    """Per-round speed-ups (NBL mean / stock mean of the same round): the spread of the ratio."""
    by_round: dict[int, dict[str, list[float]]] = {}
    for record in measurements:
        if (record["backend"], record["test"], record["depth"]) == (backend, test, depth) and \
                record["label"] in ("stock", label):
            by_round.setdefault(record["round"], {}).setdefault(record["label"], []).extend(record["samples_ts"])
    return [statistics.fmean(r[label]) / statistics.fmean(r["stock"])
            for _, r in sorted(by_round.items()) if "stock" in r and label in r]


@dataclass
class Speedup:
    backend: str
    model: str
    test: str
    n_tokens: int
    depth: int
    stock_ts: float
    nbl_ts: float
    measured: float
    predicted: float
    efficiency: float  # measured / predicted
    ratio_min: float
    ratio_max: float

    @property
    def meets_target(self) -> bool:
        return self.efficiency >= TARGET_EFFICIENCY


def speedup_table(measurements: list[dict], costs: dict[str, ModelCost], cache_type: str = "f16") -> list[Speedup]:
    """Every (backend, NBL model, test, depth) cell: measured ratio of mean t/s, roofline, and their ratio."""
    cells = aggregate(measurements)
    order = {label: index for index, label in enumerate(costs)}
    rows = []
    for (backend, label, test, depth), cell in sorted(
            cells.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], len(order)), kv[0][1], kv[0][2] != "pp", kv[0][3])):
        if label == "stock":
            continue
        stock = cells.get((backend, "stock", test, depth))
        if stock is None:
            raise NblError(f"no stock measurement for {backend} {test} at depth {depth}")
        measured = cell.mean_ts / stock.mean_ts
        predicted = predicted_speedup(costs["stock"], costs[label], test, depth, cell.n_tokens, cache_type)
        per_round = round_ratios(measurements, backend, label, test, depth) or [measured]
        rows.append(Speedup(backend, label, test, cell.n_tokens, depth, stock.mean_ts, cell.mean_ts, measured,
                            predicted, measured / predicted, min(per_round), max(per_round)))
    return rows


def _buffer_bytes(cost: ModelCost, cells: int, cache_type: str) -> float:
    """The K/V buffers llama.cpp allocates for a context of ``cells``: every attention layer's cells, except
    that a file with window layers has a second, window-sized cache for them (kv_cache's rule)."""
    if not cost.window_cells:
        return cost.kv_bytes_per_token(cache_type) * cells
    from nbl_gguf.gguf.metadata import kv_sizes, open_gguf

    _, size = kv_sizes(open_gguf(cost.path), cells, kv_type=cache_type)
    return size.bytes


def kv_table(measurements: list[dict], costs: dict[str, ModelCost], cache_type: str = "f16") -> list[dict]:
    """Measured KV cache (llama.cpp's log) per model and depth against the GGUF's bytes/token."""
    rows = {}
    for record in measurements:
        if "kv_mib" not in record or record["test"] != "tg":
            continue
        key = (record["backend"], record["label"], record["depth"])
        cost = costs[record["label"]]
        per_token = cost.kv_bytes_per_token(cache_type)
        rows[key] = {
            "backend": record["backend"], "model": record["label"], "depth": record["depth"],
            "cells": record["kv_cells"], "kv_layers": record["kv_layers"], "measured_mib": record["kv_mib"],
            "predicted_mib": _buffer_bytes(cost, record["kv_cells"], cache_type) / 2**20,
            "bytes_per_token": per_token,
            # what the tokens at this depth hold: a window layer's cells stop at its window and sinks
            "at_depth_mib": (cost.tg_bytes(record["depth"], cache_type) - cost.weight_bytes_per_token()) / 2**20,
        }
    out = list(rows.values())
    stock = {(r["backend"], r["depth"]): r for r in out if r["model"] == "stock"}
    for row in out:
        base = stock.get((row["backend"], row["depth"]))
        row["vs_stock"] = row["bytes_per_token"] / base["bytes_per_token"] if base and base["bytes_per_token"] else None
    order = {label: index for index, label in enumerate(costs)}
    return sorted(out, key=lambda r: (r["backend"], order.get(r["model"], len(order)), r["model"], r["depth"]))
