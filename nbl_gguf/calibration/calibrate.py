"""`calibrate`: run the model once over calibration text, fit every layer, score, select, save.

One forward pass feeds all layers' statistics at once (hooks fold each batch into float64 sums),
then each layer is solved independently. The artifact holds the maps for every layer, so the
selection (m, criterion, method) can be changed later without running the model again.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np

from nbl_gguf.calibration.artifact import TARGETS
from nbl_gguf.errors import NblError

METHODS = ("attn-nbl", "attn-drop", "block-nbl")
CRITERIA = ("cca", "nmse", "cosine")
DEFAULT_M = 12


def parse_targets(text: str) -> tuple[str, ...]:
    """'attn' or 'attn,block' (the attention statistics are always collected: they choose the layers)."""
    targets = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or "attn" not in targets:
        raise NblError(f"--targets {text!r}: use 'attn' or 'attn,block'")
    return tuple(t for t in TARGETS if t in targets)


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the calibration text comes from (shared with `convert`)."""
    parser.add_argument("--dataset", default=None,
                        help="local .txt/.json/.jsonl/.parquet file or a `datasets` hub name "
                             "(default: bundled C4 sample, first 256 documents)")
    parser.add_argument("--dataset-config", default=None, help="hub dataset configuration (e.g. 'en' for allenai/c4)")
    parser.add_argument("--split", default="train", help="hub dataset split (default: train)")
    parser.add_argument("--text-field", default="text", help="field/column holding the text (default: text)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF folder or hub id of a supported model (llama, mistral, qwen2/3, phi3, gemma2/3, ...) "
                             "(default: embedded SmolLM2-135M-Instruct)")
    add_dataset_arguments(parser)
    parser.add_argument("--nsamples", type=int, default=256,
                        help="number of calibration windows (default: 256; CPU users may want fewer)")
    parser.add_argument("--seqlen", type=int, default=2048,
                        help="tokens per window, capped by the model's context (default: 2048)")
    parser.add_argument("--batch-size", type=int, default=1, help="windows per forward pass (default: 1)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                        help="model dtype (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default: cuda if available)")
    parser.add_argument("--stats-device", default=None,
                        help="where the float64 statistics live (default: the model device; 'cpu' saves GPU memory)")
    parser.add_argument("--m", type=int, default=None,
                        help=f"number of layers to replace (default: min({DEFAULT_M}, layers - 1))")
    parser.add_argument("--method", default="attn-nbl", choices=METHODS)
    parser.add_argument("--criterion", default="cca", choices=CRITERIA)
    parser.add_argument("-o", "--output", default=None, help="artifact directory (default: out/calibration/<model>)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--targets", default="attn,block",
                        help="what to fit: 'attn,block' (default; block-level NBL is a baseline of the paper) or "
                             "'attn' (about a third faster: the attention is all a GGUF can replace)")
    parser.add_argument("--save-covariances", action="store_true",
                        help="also store float64 covariances (3 d x d per layer and target; large)")


class _Timer:
    def __init__(self):
        self.phases: dict[str, float] = {}

    def __call__(self, name: str):
        timer = self

        class _Phase:
            def __enter__(self):
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                timer.phases[name] = round(time.perf_counter() - self.start, 3)

        return _Phase()


def _versions() -> dict:
    import torch
    import transformers

    from nbl_gguf import __version__

    return {"nbl_gguf": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "numpy": np.__version__, "python": platform.python_version()}


def collect_statistics(model, adapter, input_ids, batch_size: int, device: str, stats_device: str,
                       progress: bool = True, targets=TARGETS):
    """One pass over the windows; returns per-layer (attn, block) MomentAccumulators and cosine means
    (the block lists are empty when ``targets`` leaves the block out)."""
    import torch
    from tqdm import tqdm

    from nbl_gguf.calibration.capture import capture_activations
    from nbl_gguf.models import base_model, decoder_layers, text_config
    from nbl_gguf.calibration.statistics import CosineAccumulator, MomentAccumulator

    d = text_config(model.config).hidden_size
    count = len(decoder_layers(model))
    attn = [MomentAccumulator(d, d, stats_device, f"layer {i} attention") for i in range(count)]
    with_block = "block" in targets
    block_count = count if with_block else 0
    block = [MomentAccumulator(d, d, stats_device, f"layer {i} block") for i in range(block_count)]
    attn_cos = [CosineAccumulator(stats_device) for _ in range(count)]
    block_cos = [CosineAccumulator(stats_device) for _ in range(block_count)]

    def on_attention(i, h, x, y):
        attn[i].update(x, y)
        attn_cos[i].update(h, h + y)  # block input vs. hidden state after the attention residual

    def on_block(i, h, out):
        block[i].update(h, out)
        block_cos[i].update(h, out)

    batch_size = max(1, batch_size)
    body = base_model(model)
    with torch.no_grad(), capture_activations(model, adapter, on_attention, on_block if with_block else None):
        batches = range(0, input_ids.shape[0], batch_size)
        for start in tqdm(batches, desc="calibration forward", unit="batch", disable=not progress):
            body(input_ids=input_ids[start:start + batch_size].to(device), use_cache=False)
            for acc in attn + block:
                acc.check_finite()
    return attn, block, [c.value() for c in attn_cos], [c.value() for c in block_cos]


def solve_all(attn, block, progress: bool = True):
    """[(attention fit, block fit or None)] per layer; ``block`` may be empty."""
    import torch
    from tqdm import tqdm

    from nbl_gguf.calibration.solve import fit

    # Multithreaded LAPACK eigh/svd on a small matrix gains little and, on a busy CPU, its spinning
    # threads slowed it 10-200x in our measurements; one thread is fast and predictable there.
    small_cpu = attn and attn[0].device.type == "cpu" and attn[0].sum_xx.shape[0] <= 1024
    threads = torch.get_num_threads()
    if small_cpu:
        torch.set_num_threads(1)
    try:
        fits = []
        for i in tqdm(range(len(attn)), desc="solve", unit="layer", disable=not progress):
            fits.append((fit(attn[i].moments(), residual=True),
                         fit(block[i].moments(), residual=False) if block else None))
    finally:
        torch.set_num_threads(threads)
    return fits


def default_m(num_layers: int) -> int:
    return max(0, min(DEFAULT_M, num_layers - 1))


def run(args: argparse.Namespace) -> int:
    import torch

    from nbl_gguf import models
    from nbl_gguf.calibration import dataset
    from nbl_gguf.calibration.artifact import METHOD_TARGET, plot_scores, write_artifact
    from nbl_gguf.calibration.solve import ranking, select_layers

    targets = parse_targets(args.targets)
    if METHOD_TARGET[args.method] not in targets:
        raise NblError(f"--method {args.method} needs the block statistics: use --targets attn,block")
    torch.manual_seed(args.seed)
    timer = _Timer()
    with timer("load_model"):
        loaded = models.load_model(args.model, args.dtype, args.device)
    model, config = loaded.model, loaded.config
    num_layers = len(models.decoder_layers(model))
    d = models.text_config(config).hidden_size
    m = default_m(num_layers) if args.m is None else args.m
    if m > num_layers or m < 0:
        raise NblError(f"--m {m} is out of range: the model has {num_layers} layers")

    with timer("load_data"):
        calib = dataset.load_calibration(loaded.tokenizer, args.dataset, args.nsamples, args.seqlen,
                                      config=args.dataset_config, split=args.split, field=args.text_field,
                                      max_positions=models.max_context(config))
    if calib.nsamples < args.nsamples:
        print(f"note: {args.dataset or dataset.DEFAULT_DATASET} gives {calib.nsamples} windows of {calib.seqlen} tokens, "
              f"fewer than the {args.nsamples} requested; calibrating on {calib.tokens} tokens", file=sys.stderr)
    if calib.tokens <= d:
        raise NblError(f"only {calib.tokens} calibration tokens for hidden size {d}; need more than {d} "
                       f"(raise --nsamples/--seqlen or use more text)")

    stats_device = args.stats_device or loaded.device
    with timer("forward_and_statistics"):
        attn, block, attn_cos, block_cos = collect_statistics(model, loaded.adapter, calib.input_ids,
                                                              args.batch_size, loaded.device, stats_device,
                                                              targets=targets)
    with timer("solve"):
        fits = solve_all(attn, block)

    layers = []
    tensors: dict[str, np.ndarray] = {}
    for i, (fa, fb) in enumerate(fits):
        entry = {"index": i}
        per_target = [("attn", fa, attn_cos[i], attn[i])]
        if fb is not None:
            per_target.append(("block", fb, block_cos[i], block[i]))
        for target, f, cos, acc in per_target:
            entry[target] = {"cca": f.cca_bound, "nmse": f.nmse, "cosine": cos, "ridge": f.ridge, "cond": f.cond}
            tensors[f"{target}.{i}.weight"] = f.weight.float().cpu().numpy()
            tensors[f"{target}.{i}.bias"] = f.bias.float().cpu().numpy()
            moments = acc.moments()
            tensors[f"{target}.{i}.mean_x"] = moments.mean_x.cpu().numpy()
            tensors[f"{target}.{i}.mean_y"] = moments.mean_y.cpu().numpy()
            tensors[f"{target}.{i}.rho"] = f.rho.cpu().numpy()
            if args.save_covariances:
                for name in ("cxx", "cyx", "cyy"):
                    tensors[f"{target}.{i}.{name}"] = getattr(moments, name).cpu().numpy()
        layers.append(entry)

    target = METHOD_TARGET[args.method]
    scores = [entry[target][args.criterion] for entry in layers]
    selected = select_layers(scores, m)
    report = {
        "format_version": 1,
        "model": {"name": loaded.name, "path": loaded.path, "architecture": (config.architectures or ["?"])[0],
                  "model_type": config.model_type, "hidden_size": d, "num_layers": num_layers,
                  "dtype": str(loaded.dtype).replace("torch.", ""), "device": loaded.device},
        "data": {"dataset": args.dataset or dataset.DEFAULT_DATASET, "dataset_config": args.dataset_config,
                 "split": args.split, "nsamples": calib.nsamples, "nsamples_requested": calib.requested_samples,
                 "seqlen": calib.seqlen, "tokens": calib.tokens, "documents": calib.documents,
                 "sha256": calib.sha256, "seed": args.seed},
        "statistics": {"device": str(stats_device), "tokens_per_layer": attn[0].n, "covariances_saved": args.save_covariances},
        "layers": layers,
        "targets": list(targets),
        "ranking": {t: {c: ranking([e[t][c] for e in layers]) for c in CRITERIA} for t in targets},
        "selection": {"method": args.method, "criterion": args.criterion, "m": m, "layers": selected},
        "timings_s": timer.phases,
        "versions": _versions(),
    }
    output = Path(args.output or Path("out") / "calibration" / loaded.name)
    write_artifact(output, report, tensors, plot=lambda path: plot_scores(path, report))
    print(f"{args.method} by {args.criterion}: replace layers {selected} of {num_layers}")
    print(f"artifact: {output}  ({calib.tokens} tokens, timings {report['timings_s']})")
    return 0
