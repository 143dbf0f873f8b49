"""`bench --hf-compare`: the HF transformers model with the same NBL layers (apply_nbl) against llama.cpp.

Prefill = one forward pass over n_prompt random tokens from an empty cache (logits of the last token
only, as llama.cpp computes them); decode = n_gen single-token steps from an empty cache with a
DynamicCache (llama-bench's tg at depth 0). The NBL weights are read back from each NBL GGUF
(dequantized), so both engines run exactly the same layer map.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from nbl_gguf.errors import NblError
from nbl_gguf.measurement.bench import BenchSettings


def nbl_layers_from_gguf(path) -> tuple[list[int], dict[int, tuple[np.ndarray, np.ndarray]]]:
    """(layer types, {layer: (W [d, d] float32, b [d])}) of an NBL GGUF, dequantized with gguf-py."""
    import gguf

    from nbl_gguf.gguf.nbl_format import LINEAR, NBL_BIAS, NBL_WEIGHT, read_layer_types

    reader = gguf.GGUFReader(path)
    types = read_layer_types(reader)
    if types is None:
        raise NblError(f"{path} is not an NBL GGUF")
    tensors = {t.name: t for t in reader.tensors}
    linear = {}
    for layer, kind in enumerate(types):
        if kind != LINEAR:
            continue
        weight = tensors[NBL_WEIGHT.format(layer=layer)]
        bias = tensors[NBL_BIAS.format(layer=layer)]
        w = gguf.quants.dequantize(weight.data, weight.tensor_type).astype(np.float32)
        b = gguf.quants.dequantize(bias.data, bias.tensor_type).astype(np.float32).reshape(-1)
        linear[layer] = (w.reshape(b.shape[0], -1), b)
    return types, linear


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_model(model, n_vocab: int, n_prompt: int, n_gen: int, reps: int, device: str, seed: int = 0) -> dict:
    """Median prefill and decode tokens/s of a HF causal LM."""
    import torch
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, n_vocab, (1, max(1, n_prompt)), generator=generator).to(device)
    first = prompt[:, :1]

    def prefill():
        _sync(device)
        t0 = time.perf_counter()
        model(input_ids=prompt, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
        _sync(device)
        return time.perf_counter() - t0

    def decode(steps):
        cache = DynamicCache()
        token = first
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            logits = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            token = logits[:, -1:].argmax(-1)
        _sync(device)
        return time.perf_counter() - t0

    with torch.inference_mode():
        result = {}
        if n_prompt > 0:
            prefill()  # warm-up
            result["prefill_tps"] = n_prompt / statistics.median(prefill() for _ in range(reps))
        if n_gen > 0:
            decode(min(4, n_gen))  # warm-up
            result["decode_tps"] = n_gen / statistics.median(decode(n_gen) for _ in range(reps))
    return result


@dataclass(frozen=True)
class HfSettings:
    """The transformers side of --hf-compare: --device, --dtype ('auto': the device's) and --seed."""

    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0


def load_hf(models, settings: HfSettings, log):
    """The HF model for ``models`` (a folder, or a random model of a synthetic shape), its device and dtype."""
    import torch

    from nbl_gguf.models import load_model, resolve_device, resolve_dtype

    spec = models.hf
    if not spec:
        raise NblError("--hf-compare with explicit GGUFs needs --hf-model (the HF folder they were converted from)")
    device = resolve_device(settings.device)
    if spec["kind"] == "folder":
        loaded = load_model(spec["path"], dtype=settings.dtype, device=device)
        return loaded.model, device, loaded.dtype
    from transformers import AutoModelForCausalLM

    from nbl_gguf.fixtures.synthetic import get_shape, hf_config

    dtype = resolve_dtype(settings.dtype, device)
    torch.manual_seed(spec.get("seed", 0))
    log(f"hf-compare: random {spec['shape']} in {dtype} on {device}")
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(get_shape(spec["shape"])), dtype=dtype)
    return model.eval(), device, dtype


def compare(models, measurements, bench: BenchSettings, hf: HfSettings, log) -> dict:
    import torch

    from nbl_gguf.calibration import apply
    from nbl_gguf.measurement.llama_bench import run_llama_bench
    from nbl_gguf.measurement.speedup import aggregate
    from nbl_gguf.models import decoder_layers, get_adapter

    threads = bench.thread_count
    torch.set_num_threads(threads)
    model, device, dtype = load_hf(models, hf, log)
    backend = "cuda" if device.startswith("cuda") else "cpu"
    n_vocab = model.config.vocab_size
    reps = max(2, bench.rounds * bench.repetitions)

    # llama.cpp at depth 0 on the matching backend: from the main run, or measured here
    cells = aggregate([r for r in measurements if r["backend"] == backend and r["depth"] == 0])
    if not cells:
        extra = []
        for candidate in models.all():
            records, _ = run_llama_bench(candidate.path, n_prompt=bench.n_prompt, n_gen=bench.n_gen, depth=0,
                                         repetitions=reps, threads=threads, backend=backend,
                                         cache_type=bench.cache_type)
            for record in records:
                record.update(backend=backend, label=candidate.label, round=0)
            extra += records
        cells = aggregate(extra)

    adapter = get_adapter(model)
    layers = decoder_layers(model)
    originals = {i: getattr(layer, adapter.attn) for i, layer in enumerate(layers)}
    rows = []
    for candidate in models.all():
        if candidate.label == "stock":
            types, linear = [0] * len(layers), {}
        else:
            types, linear = nbl_layers_from_gguf(candidate.path)
            if len(types) != len(layers):
                raise NblError(f"{candidate.path} has {len(types)} layers, the HF model {len(layers)}")
        for i, layer in enumerate(layers):  # back to stock before applying this candidate's layers
            setattr(layer, adapter.attn, originals[i])
        apply.apply_nbl(model, types, linear)
        log(f"hf-compare: transformers {candidate.label} on {device} ({dtype})")
        timing = time_model(model, n_vocab, bench.n_prompt, bench.n_gen, reps, device, seed=hf.seed)
        rows.append({"model": candidate.label, "engine": f"transformers {str(dtype).replace('torch.', '')}",
                     "device": device, **timing})
        pp, tg = cells.get((backend, candidate.label, "pp", 0)), cells.get((backend, candidate.label, "tg", 0))
        rows.append({"model": candidate.label, "engine": f"llama.cpp {models.quant}", "device": backend,
                     "prefill_tps": pp.mean_ts if pp else float("nan"), "decode_tps": tg.mean_ts if tg else float("nan")})
    for i, layer in enumerate(layers):
        setattr(layer, adapter.attn, originals[i])

    # NBL speed-up within each engine
    for row in rows:
        base = next(r for r in rows if r["model"] == "stock" and r["engine"] == row["engine"])
        row["prefill_speedup"] = row.get("prefill_tps", float("nan")) / base.get("prefill_tps", float("nan"))
        row["decode_speedup"] = row.get("decode_tps", float("nan")) / base.get("decode_tps", float("nan"))
    note = (f"transformers {__import__('transformers').__version__}, torch {torch.__version__}, {threads} threads; "
            f"median of {reps} runs after a warm-up. llama.cpp: the same run's pp{bench.n_prompt} / tg{bench.n_gen} "
            f"at depth 0 on {backend}.")
    return {"n_prompt": bench.n_prompt, "n_gen": bench.n_gen, "device": device, "rows": rows, "note": note}
