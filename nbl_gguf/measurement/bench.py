"""`bench`'s measurement: speed and KV cache of NBL GGUFs against the stock GGUF of the same model and quant
(the command, its model sets and its report: nbl_gguf.commands.bench).

The patched ``llama-bench`` (the same binary runs stock GGUFs unchanged) measures prompt processing
(pp) and token generation (tg) at several context depths, on every backend built and visible: the
CPU, and CUDA when the build has it and a GPU shows up. Stock and NBL runs are interleaved (one
llama-bench call per model and depth, in alternating order per round), so that a noisy machine
slows both alike, and each speed-up is the ratio of the two means measured in the same run. Beside
it stands the speed-up that the roofline model (nbl_gguf.measurement.roofline) predicts from the GGUF files,
and measured / predicted.

Running llama-bench is in llama_bench, the statistics in speedup, the tables, plots and report in bench_report.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from nbl_gguf.measurement.llama_bench import run_llama_bench, schedule
from nbl_gguf.measurement.roofline import ModelCost, check_pair, file_type_name, model_cost


@dataclass
class Candidate:
    label: str
    path: Path
    cost: ModelCost | None = None


@dataclass
class ModelSet:
    name: str
    quant: str
    stock: Candidate
    nbl: list[Candidate]
    hf: dict = field(default_factory=dict)  # how to build the HF model for --hf-compare
    commands: list[str] = field(default_factory=list)  # how the GGUFs were made

    def all(self) -> list[Candidate]:
        return [self.stock, *self.nbl]


def check_models(models: ModelSet) -> ModelSet:
    """Each file's cost (a missing file or not a GGUF: NblError), each NBL file checked against the stock
    one (same model and quant), and the set's quant named from the stock file where it was not given."""
    for candidate in models.all():
        candidate.cost = model_cost(candidate.path)
    for candidate in models.nbl:
        check_pair(models.stock.cost, candidate.cost)
    if not models.quant:
        models.quant = file_type_name(models.stock.cost.file_type).lower()
    return models


@dataclass(frozen=True)
class BenchSettings:
    """How llama-bench runs each model: -p/-n tokens at each depth, calls per round (-r), interleaved
    rounds, threads (None: every core), the KV cache type (-ctk/-ctv; None: f16) and extra llama-bench
    arguments (one string, split on spaces)."""

    n_prompt: int
    n_gen: int
    depths: tuple[int, ...]
    repetitions: int
    rounds: int
    threads: int | None = None
    cache_type: str | None = None
    bench_args: str | None = None

    @property
    def thread_count(self) -> int:
        return self.threads or os.cpu_count() or 1


def measure(models: ModelSet, backends: list[str], settings: BenchSettings, log) -> tuple[list[dict], list[list[str]]]:
    extra = settings.bench_args.split() if settings.bench_args else []
    measurements, commands = [], []
    threads = settings.thread_count
    for backend in backends:
        plan = schedule(models.all(), list(settings.depths), settings.rounds)
        started = time.monotonic()
        for step, (round_index, depth, candidate) in enumerate(plan, 1):
            t0 = time.monotonic()
            records, command = run_llama_bench(
                candidate.path, n_prompt=settings.n_prompt, n_gen=settings.n_gen, depth=depth,
                repetitions=settings.repetitions, threads=threads, backend=backend, cache_type=settings.cache_type,
                extra=extra)
            if step <= len(models.all()):
                commands.append(command)
            summary = ", ".join(f"{r['test']} {r['avg_ts']:.2f} t/s" for r in records)
            log(f"[{backend} {step}/{len(plan)} round {round_index + 1} depth {depth}] {candidate.label}: {summary} "
                f"({time.monotonic() - t0:.0f} s, {time.monotonic() - started:.0f} s total)")
            for record in records:
                record.update(backend=backend, label=candidate.label, model=str(candidate.path), round=round_index)
                measurements.append(record)
    return measurements, commands
