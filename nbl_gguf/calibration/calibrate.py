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

from nbl_gguf.calibration.artifact import CRITERIA, DEFAULT_CRITERION, LOCAL_DEFAULT, SELECTIONS, TARGETS
from nbl_gguf.errors import NblError
from nbl_gguf.outputs import check_output_dir

METHODS = ("attn-nbl", "attn-drop", "block-nbl")
DEFAULT_M = 12
# Calibration windows: 256 on a GPU (the paper's 256 x 2048); on a CPU 32 x 2048 = 65k tokens: 4x fewer
# tokens (16k) already gave nearly the same maps and held-out perplexity (docs/results/quality.md,
# "Calibration size"), and it leaves time for the held-out selection within the old main job's budget
DEFAULT_NSAMPLES = {"cuda": 256, "cpu": 32}
DEFAULT_SELECTION_TOKENS = 8192  # held out for best/greedy/auto: 4 windows of 2048 by default
DEFAULT_MAX_PPL_INCREASE = 10.0
DEFAULT_OUTPUT_ROOT = Path("out") / "calibration"


def parse_m(text: str):
    """--m: a layer count or 'auto' (the largest m within --max-ppl-increase)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of layers or 'auto', got {text!r}") from None


def add_selection_arguments(parser: argparse.ArgumentParser) -> None:
    """How many layers and which (shared with `convert`)."""
    parser.add_argument("--m", type=parse_m, default=None,
                        help=f"number of layers to replace, or 'auto': the largest m whose perplexity increase on "
                             f"held-out calibration windows stays within --max-ppl-increase "
                             f"(default: min({DEFAULT_M}, layers - 1))")
    parser.add_argument("--max-ppl-increase", type=float, default=None, metavar="P",
                        help=f"with --m auto: the budget, in percent of the unmodified model's held-out perplexity "
                             f"(default: {DEFAULT_MAX_PPL_INCREASE:g})")
    parser.add_argument("--criterion", default=DEFAULT_CRITERION, choices=SELECTIONS,
                        help="how layers are chosen: best (default: the set of cosine, nmse or cca that costs least on "
                             "held-out calibration windows), cosine, nmse, cca (the NBL paper's CCA bound), or greedy "
                             "(joint: adds the layer that costs the whole model least on those windows)")
    parser.add_argument("--selection-windows", type=int, default=None,
                        help="calibration windows held out from the fit to measure the model for --m auto and "
                             f"--criterion best/greedy (default: {DEFAULT_SELECTION_TOKENS} tokens' worth)")
    parser.add_argument("--candidates", type=int, default=None,
                        help="greedy: layers tried at each step, the first not yet chosen of the cosine and nmse rankings "
                             "in turn (default: 5)")


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
                        help="HF folder, hub id or GGUF file of a supported model (llama, mistral, qwen2/3, phi3, "
                             "gemma2/3, ...; a GGUF is calibrated as transformers dequantizes it) "
                             "(default: embedded SmolLM2-135M-Instruct)")
    add_dataset_arguments(parser)
    parser.add_argument("--nsamples", type=int, default=None,
                        help="number of calibration windows for the fit (default: 256 on CUDA, 32 on a CPU)")
    parser.add_argument("--seqlen", type=int, default=2048,
                        help="tokens per window, capped by the model's context (default: 2048)")
    parser.add_argument("--batch-size", type=int, default=1, help="windows per forward pass (default: 1)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                        help="model dtype (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default: cuda if available)")
    parser.add_argument("--stats-device", default=None,
                        help="where the float64 statistics live (default: the model device; 'cpu' saves GPU memory)")
    add_selection_arguments(parser)
    parser.add_argument("--method", default="attn-nbl", choices=METHODS)
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
    """[(attention fit, block fit or None)] per layer; ``block`` may be empty. Each attention fit
    carries its bias-free map too (``without_bias``), for runtimes whose slot has no bias."""
    import dataclasses

    import torch
    from tqdm import tqdm

    from nbl_gguf.calibration.solve import fit, fit_without_bias

    # Multithreaded LAPACK eigh/svd on a small matrix gains little and, on a busy CPU, its spinning
    # threads slowed it 10-200x in our measurements; one thread is fast and predictable there.
    small_cpu = attn and attn[0].device.type == "cpu" and attn[0].sum_xx.shape[0] <= 1024
    threads = torch.get_num_threads()
    if small_cpu:
        torch.set_num_threads(1)
    try:
        fits = []
        for i in tqdm(range(len(attn)), desc="solve", unit="layer", disable=not progress):
            moments = attn[i].moments()
            attention = fit(moments, residual=True)
            attention = dataclasses.replace(attention, without_bias=fit_without_bias(moments))
            fits.append((attention, fit(block[i].moments(), residual=False) if block else None))
    finally:
        torch.set_num_threads(threads)
    return fits


def default_m(num_layers: int) -> int:
    return max(0, min(DEFAULT_M, num_layers - 1))


def select(model, layers: list[dict], tensors: dict, args, m: int | None, budget: float | None, heldout_ids) -> dict:
    """The artifact's selection: a local ranking cut at m, or (auto / greedy) a walk measured on the
    held-out windows. Greedy and auto replace layers of ``model`` in place (it is not needed after)."""
    from nbl_gguf.calibration.apply import METHOD_LAYER_TYPE
    from nbl_gguf.calibration.artifact import METHOD_TARGET
    from nbl_gguf.calibration.select import DEFAULT_CANDIDATES, NestedEvaluator, best_of, greedy, walk
    from nbl_gguf.calibration.solve import ranking, select_layers

    target = METHOD_TARGET[args.method]
    local = args.criterion if args.criterion in CRITERIA else LOCAL_DEFAULT
    scores = [entry[target][local] for entry in layers]
    selection = {"method": args.method, "criterion": args.criterion}
    if heldout_ids is None:
        return {**selection, "m": m, "layers": select_layers(scores, m)}
    linear = {i: (tensors[f"attn.{i}.weight"], tensors[f"attn.{i}.bias"]) for i in range(len(layers))}
    evaluator = NestedEvaluator(model, heldout_ids, METHOD_LAYER_TYPE[args.method], linear, args.batch_size)
    rankings = {c: ranking([entry[target][c] for entry in layers]) for c in CRITERIA}
    compared = None
    if args.criterion == "greedy":
        trace = greedy(evaluator, [rankings["cosine"], rankings["nmse"]], m, budget, args.candidates or DEFAULT_CANDIDATES)
    elif args.criterion == "best":
        chosen, trace, compared = best_of(evaluator, rankings, m, budget, walk_first=LOCAL_DEFAULT)
        selection["chosen"] = chosen
    else:
        trace = walk(evaluator, ranking(scores), args.criterion, m, budget)
    selection.update(m=len(trace.order), layers=sorted(trace.order), heldout=trace.as_report())
    if compared is not None:
        selection["heldout"]["compared"] = {c: {"layers": layers_c, "ppl_increase_pct": inc}
                                            for c, (layers_c, inc) in compared.items()}
    if budget is not None:
        selection["max_ppl_increase"] = budget
    return selection


def describe_selection(selection: dict, num_layers: int) -> str:
    """What was chosen and, for auto and greedy, why (the held-out perplexity along the way)."""
    lines = [f"{selection['method']} by {selection['criterion']}: replace layers {selection['layers']} of {num_layers}"]
    heldout = selection.get("heldout")
    if heldout:
        increases = heldout["ppl_increase_pct"]
        if len(increases) == len(heldout["order"]):  # one loss per added layer (walk, greedy)
            steps = ", ".join(f"layer {layer} {inc:+.1f}%" for layer, inc in zip(heldout["order"], increases))
        else:  # the set measured at once (best at a fixed m)
            steps = f"{len(heldout['order'])} layers together {increases[-1]:+.1f}%" if increases else ""
        lines.append(f"  held-out perplexity ({heldout['heldout_tokens']} tokens, unmodified {heldout['base_ppl']:.3f}): "
                     f"{steps or 'no layer added'}")
    if "chosen" in selection:
        lines.append("  best on the held-out windows: " + ", ".join(
            f"{c} {len(v['layers'])} layers {v['ppl_increase_pct']:+.1f}%" for c, v in heldout["compared"].items())
            + f" -> {selection['chosen']}")
    if "max_ppl_increase" in selection:
        reason = heldout.get("stopped") or f"all {len(heldout['order'])} candidate layers fit the budget"
        lines.append(f"  --m auto: m = {selection['m']} within +{selection['max_ppl_increase']:g}%: {reason}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    from nbl_gguf import models
    from nbl_gguf.calibration import dataset
    from nbl_gguf.model_source import resolve_model
    from nbl_gguf.calibration.artifact import METHOD_TARGET, plot_scores, write_artifact
    from nbl_gguf.calibration.solve import ranking

    targets = parse_targets(args.targets)
    m_fixed, budget = selection_budget(args.m, args.max_ppl_increase)
    needs_heldout = args.m == "auto" or args.criterion in ("greedy", "best")
    if needs_heldout and args.method == "block-nbl":
        raise NblError("--m auto and --criterion greedy/best replace attention layers: use --method attn-nbl or "
                       "attn-drop, or a fixed --m with --criterion cosine, nmse or cca")
    if needs_heldout and args.selection_windows is not None and args.selection_windows < 1:
        raise NblError(f"--selection-windows must be at least 1, got {args.selection_windows}")
    if METHOD_TARGET[args.method] not in targets:
        raise NblError(f"--method {args.method} needs the block statistics: use --targets attn,block")
    # the artifact is written last: a folder it cannot be written in must not cost a calibration first
    if args.output:
        check_output_dir(args.output, "-o", renamed_into_place=True)
    else:
        check_output_dir(DEFAULT_OUTPUT_ROOT, "the default -o")
    torch.manual_seed(args.seed)
    timer = _Timer()
    with timer("load_model"):
        source = resolve_model(args.model)
        loaded = models.load_model(str(source.hf_folder()), args.dtype, args.device, name=source.name)
    model, config = loaded.model, loaded.config
    num_layers = len(models.decoder_layers(model))
    d = models.text_config(config).hidden_size
    if m_fixed is None and args.m != "auto":
        m_fixed = default_m(num_layers)
    if m_fixed is not None and not 0 <= m_fixed <= num_layers:
        raise NblError(f"--m {m_fixed} is out of range: the model has {num_layers} layers")
    nsamples = args.nsamples
    if nsamples is None:
        nsamples = DEFAULT_NSAMPLES["cuda" if loaded.device.startswith("cuda") else "cpu"]
    held = 0
    if needs_heldout:
        seqlen = dataset.effective_seqlen(args.seqlen, models.max_context(config))
        held = args.selection_windows or -(-DEFAULT_SELECTION_TOKENS // seqlen)

    with timer("load_data"):
        calib = dataset.load_calibration(loaded.tokenizer, args.dataset, nsamples + held, args.seqlen,
                                         config=args.dataset_config, split=args.split, field=args.text_field,
                                         max_positions=models.max_context(config))
    heldout_ids = None
    if held:
        if calib.nsamples <= held:
            raise NblError(f"{args.dataset or dataset.DEFAULT_DATASET} gives {calib.nsamples} windows of {calib.seqlen} "
                           f"tokens: too few to hold out --selection-windows {held} for layer selection and still fit "
                           f"(use more text, a shorter --seqlen or fewer --selection-windows; or a fixed --m with "
                           f"--criterion cosine, which needs none)")
        calib, heldout_ids = calib.split_last(held)
    if calib.nsamples < nsamples:
        print(f"note: {args.dataset or dataset.DEFAULT_DATASET} gives {calib.nsamples} windows of {calib.seqlen} tokens "
              f"for the fit, fewer than the {nsamples} requested; calibrating on {calib.tokens} tokens", file=sys.stderr)
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
        nobias = fa.without_bias
        entry["attn"]["nmse_nobias"] = nobias.nmse
        entry["attn"]["ridge_nobias"] = nobias.ridge
        tensors[f"attn.{i}.weight_nobias"] = nobias.weight.float().cpu().numpy()
        layers.append(entry)

    with timer("selection"):
        selection = select(model, layers, tensors, args, m_fixed, budget, heldout_ids)
    report = {
        "format_version": 1,
        "model": {"name": loaded.name, "path": loaded.path, "architecture": (config.architectures or ["?"])[0],
                  "model_type": config.model_type, "hidden_size": d, "num_layers": num_layers,
                  "dtype": str(loaded.dtype).replace("torch.", ""), "device": loaded.device,
                  **({"gguf": source.gguf.provenance()} if source.gguf is not None else {})},
        "data": {"dataset": args.dataset or dataset.DEFAULT_DATASET, "dataset_config": args.dataset_config,
                 "split": args.split, "nsamples": calib.nsamples, "nsamples_requested": nsamples,
                 "selection_windows": 0 if heldout_ids is None else int(heldout_ids.shape[0]),
                 "seqlen": calib.seqlen, "tokens": calib.tokens, "documents": calib.documents,
                 "sha256": calib.sha256, "seed": args.seed},
        "statistics": {"device": str(stats_device), "tokens_per_layer": attn[0].n, "covariances_saved": args.save_covariances},
        "layers": layers,
        "targets": list(targets),
        "ranking": {t: {c: ranking([e[t][c] for e in layers]) for c in CRITERIA} for t in targets},
        "selection": selection,
        "timings_s": timer.phases,
        "versions": _versions(),
    }
    output = Path(args.output or DEFAULT_OUTPUT_ROOT / loaded.name)
    write_artifact(output, report, tensors, plot=lambda path: plot_scores(path, report))
    print(describe_selection(selection, num_layers))
    print(f"artifact: {output}  ({calib.tokens} tokens, timings {report['timings_s']})")
    return 0
