"""Refinement's Adam step, per tensor or per input channel, side by side on one calibration artifact.

    python docs/results/experiments/refine_step_check.py --model MODEL --calibration DIR \
        --variants tensor:2e-3,column:2e-3 --out rows.jsonl -- --nsamples 16

Each variant refines the artifact's selected maps (the model form, the artifact left unchanged) and prints
the held-out NLL report. "tensor": the step relative to each map tensor's RMS (refine.make_trainable);
"balanced": the same with RefineSettings.balance (each kind of text's loss scaled to the mean's size);
"whole": the same as "tensor" with every step run through the whole model instead of from the first
replaced layer on (refine._Prefix), to time the two side by side;
"column": each entry's step relative to its input channel's RMS in the starting map instead (the columns of
the weight, the lag weights and the lag projection down), the tensor's mean kept: a diagonal preconditioner
for inputs whose channels differ in scale by orders of magnitude (Qwen2.5's)."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def column_scaled(make_trainable):
    """make_trainable whose Adam steps of 2-D input-channel tensors are scaled per column."""
    def wrapped(modules, lr):
        params, optimizer = make_trainable(modules, lr)
        scales = {}
        for module in modules.values():
            for name in ("weight", "lag", "lag_down"):
                p = getattr(module, name, None)
                if isinstance(p, torch.nn.Parameter) and p.dim() == 2:
                    col = p.detach().pow(2).mean(0).sqrt()
                    scales[p] = (col / col.pow(2).mean().sqrt().clamp_min(1e-30)).unsqueeze(0)
        before = {}

        def snapshot(optimizer, args, kwargs):
            before.update({p: p.detach().clone() for p in scales})

        def scale(optimizer, args, kwargs):
            with torch.no_grad():
                for p, s in scales.items():
                    p.copy_(before[p] + (p - before[p]) * s)
        # hooks, not a replaced step(): the learning-rate schedule wraps optimizer.step itself
        optimizer.register_step_pre_hook(snapshot)
        optimizer.register_step_post_hook(scale)
        return params, optimizer
    return wrapped


def whole_model(prefix_init):
    """refine._Prefix's __init__ as if the first replaced layer were layer 0: every step runs the whole model."""
    def wrapped(self, model, first, windows):
        prefix_init(self, model, 0, windows)
    return wrapped


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--calibration", required=True)
    parser.add_argument("--variants", default="tensor:2e-3,column:2e-3")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--text", default="mix")
    parser.add_argument("--out", required=True)
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]

    from nbl_gguf.calibration import refine as refine_module
    from nbl_gguf.calibration.artifact import load_artifact
    from nbl_gguf.commands import calibrate as calibrate_command
    from nbl_gguf.model_source import resolve_model

    command = argparse.ArgumentParser()
    calibrate_command.add_arguments(command)
    settings = calibrate_command.settings(command.parse_args(["--model", args.model, "--no-progress", *extra]))
    artifact = load_artifact(args.calibration)
    layers = artifact.select()
    layer_type, maps = refine_module.artifact_maps(artifact, layers)
    source = resolve_model(args.model)
    plain, prefix = refine_module.make_trainable, refine_module._Prefix.__init__
    with open(args.out, "a", encoding="utf-8") as out:
        try:
            for variant in args.variants.split(","):
                kind, _, lr = variant.partition(":")
                refine_module.make_trainable = column_scaled(plain) if kind == "column" else plain
                refine_module._Prefix.__init__ = whole_model(prefix) if kind == "whole" else prefix
                chosen = refine_module.RefineSettings(form="model", lr=float(lr), tokens=args.tokens, text=args.text,
                                                      balance=kind == "balanced", no_progress=True)
                started = time.perf_counter()
                refined = refine_module.refine(source, settings, layers, layer_type, maps, chosen,
                                               artifact.report.get("data"))
                row = {"model": args.model, "variant": variant, "layers": layers,
                       "seconds": round(time.perf_counter() - started), "extra": extra} \
                    | {k: refined.report[k] for k in ("steps", "best_step", "stopped", "heldout", "history")} \
                    | {"refine_seconds": refined.report["seconds"]}
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")
                out.flush()
        finally:
            refine_module.make_trainable = plain  # the module's own again, also when a variant fails
            refine_module._Prefix.__init__ = prefix
    return 0


if __name__ == "__main__":
    sys.exit(main())
