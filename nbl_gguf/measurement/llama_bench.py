"""Running the patched ``llama-bench``: the backends it can use, one call (pp and tg of one model at
one depth) with the KV cache it logged, and the interleaved schedule of calls that ``bench`` makes."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import TypeVar

from nbl_gguf.errors import NblError
from nbl_gguf.llamacpp.cache_types import cache_type_flags

T = TypeVar("T")


# --- backends ----------------------------------------------------------------------------------

def list_devices() -> list[str]:
    """Device names llama-bench sees (e.g. 'CUDA0'); empty for a CPU-only build."""
    from nbl_gguf.llamacpp.tools import tool

    completed = subprocess.run([str(tool("llama-bench")), "--list-devices"], capture_output=True, text=True)
    devices = []
    for line in (completed.stdout + completed.stderr).splitlines():
        match = re.match(r"^\s+([A-Za-z]+\d+):", line)
        if match:
            devices.append(match.group(1))
    return devices


def resolve_backends(spec: str) -> tuple[list[str], list[str]]:
    """(backends to run, devices seen). 'auto' adds cuda when llama-bench lists a CUDA device."""
    devices = list_devices()
    has_cuda = any(d.upper().startswith("CUDA") for d in devices)
    if spec == "auto":
        return (["cpu", "cuda"] if has_cuda else ["cpu"]), devices
    wanted = [s.strip().lower() for s in spec.split(",") if s.strip()]
    for backend in wanted:
        if backend not in ("cpu", "cuda"):
            raise NblError(f"--backends: unknown backend '{backend}' (cpu, cuda)")
        if backend == "cuda" and not has_cuda:
            from nbl_gguf.llamacpp.tools import bin_dir

            raise NblError(f"--backends cuda: llama-bench in {bin_dir()} lists no CUDA device (devices: "
                           f"{', '.join(devices) or 'none'}); build with GGML_CUDA=ON into NBL_GGUF_BUILD=build-cuda "
                           f"and run on a machine with a visible GPU")
    return wanted, devices


def backend_args(backend: str) -> list[str]:
    """CPU: no layers offloaded and no device at all (a CUDA build would otherwise still offload
    large prompt matmuls to the GPU); CUDA: everything offloaded."""
    if backend == "cpu":
        return ["-ngl", "0", "-dev", "none"]
    return ["-ngl", "99"]


# --- llama-bench -------------------------------------------------------------------------------

def parse_bench_json(stdout: str) -> list[dict]:
    """The test records of ``llama-bench -o json`` (one per pp/tg test)."""
    text = stdout.strip()
    start = text.find("[")
    if start < 0:
        raise NblError(f"llama-bench printed no JSON results: {text[-500:]!r}")
    try:
        records = json.loads(text[start:])
    except json.JSONDecodeError as error:
        raise NblError(f"could not parse llama-bench JSON output: {error}") from error
    out = []
    for record in records:
        samples = [float(v) for v in record.get("samples_ts") or [record["avg_ts"]]]
        out.append({
            "test": "pp" if int(record["n_prompt"]) > 0 else "tg",
            "n_prompt": int(record["n_prompt"]), "n_gen": int(record["n_gen"]), "depth": int(record.get("n_depth", 0)),
            "avg_ts": float(record["avg_ts"]), "stddev_ts": float(record.get("stddev_ts", 0.0)),
            "samples_ts": samples, "n_threads": int(record.get("n_threads", 0)),
            "n_gpu_layers": int(record.get("n_gpu_layers", 0)), "backends": record.get("backends", ""),
            "cpu_info": record.get("cpu_info", ""), "gpu_info": record.get("gpu_info", ""),
            "model_size": int(record.get("model_size", 0)), "model_n_params": int(record.get("model_n_params", 0)),
            "model_type": record.get("model_type", ""), "build_commit": record.get("build_commit", ""),
            "type_k": record.get("type_k", ""), "flash_attn": record.get("flash_attn"),
        })
    return out


def parse_kv_log(stderr: str) -> list[dict]:
    """The KV cache of every context llama-bench created (``-v`` log), in test order."""
    from nbl_gguf.llamacpp.library import kv_caches

    return [{"kv_mib": kv.mib, "kv_cells": kv.cells, "kv_layers": kv.layers} for kv in kv_caches(stderr)]


def run_llama_bench(model: Path, *, n_prompt: int, n_gen: int, depth: int, repetitions: int, threads: int,
                    backend: str, cache_type: str = "f16", extra: list[str] = ()) -> tuple[list[dict], list[str]]:
    """One llama-bench call (pp and tg of one model at one depth); records carry the measured KV cache."""
    from nbl_gguf.llamacpp.tools import run_tool

    args = ["-m", str(model), "-p", str(n_prompt), "-n", str(n_gen), "-d", str(depth), "-r", str(repetitions),
            "-t", str(threads), "-o", "json", "-v", *backend_args(backend)]
    args += cache_type_flags(cache_type)
    args += list(extra)
    completed = run_tool("llama-bench", args)
    records = parse_bench_json(completed.stdout)
    kv = parse_kv_log(completed.stderr)
    if len(kv) == len(records):
        for record, info in zip(records, kv):
            record.update(info)
    return records, ["llama-bench", *args]


def schedule(models: list[T], depths: list[int], rounds: int) -> list[tuple[int, int, T]]:
    """(round, depth, model) in run order: every depth of a round runs each model once; the model order
    alternates between rounds (stock first, then NBL first, ...) so that drift hits both alike."""
    order = []
    for round_index in range(rounds):
        ordered = models if round_index % 2 == 0 else list(reversed(models))
        for depth in depths:
            for candidate in ordered:
                order.append((round_index, depth, candidate))
    return order
