"""`calibrate`: collect statistics, solve NBL weights for every layer, score, select, save an artifact
(the stage: nbl_gguf.calibration.calibrate)."""

from __future__ import annotations

import argparse

from nbl_gguf.calibration.settings import METHODS, Settings
from nbl_gguf.commands import flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_model(parser, "HF folder, hub id or GGUF file of a supported model (llama, mistral, qwen2/3, phi3, "
                            "gemma2/3, ...; a GGUF is calibrated as transformers dequantizes it) "
                            "(default: embedded SmolLM2-135M-Instruct)")
    flags.add_dataset_arguments(parser)
    parser.add_argument("--nsamples", type=int, default=None,
                        help="number of calibration windows for the fit (default: 256 on CUDA, 32 on a CPU)")
    parser.add_argument("--seqlen", type=int, default=2048,
                        help="tokens per window, capped by the model's context (default: 2048)")
    parser.add_argument("--batch-size", type=int, default=1, help="windows per forward pass (default: 1)")
    flags.add_compute_arguments(parser)
    parser.add_argument("--stats-device", default=None,
                        help="where the float64 statistics live (default: the model device; 'cpu' saves GPU memory)")
    flags.add_threads(parser, "of PyTorch (default: PyTorch's, one per core)")
    flags.add_selection_arguments(parser)
    parser.add_argument("--method", default="attn-nbl", choices=METHODS)
    flags.add_taps_arguments(parser)
    flags.add_output(parser, "artifact directory (default: out/calibration/<model>)", metavar="DIR")
    flags.add_seed(parser)
    parser.add_argument("--targets", default="attn,block",
                        help="what to fit: 'attn,block' (default; block-level NBL is a baseline of the paper) or "
                             "'attn' (about a third faster: the attention is all a GGUF can replace)")
    parser.add_argument("--save-covariances", action="store_true",
                        help="also store float64 covariances (3 d x d per layer and target; large)")
    flags.add_no_progress(parser)
    flags.add_refine_arguments(parser, "off: the artifact keeps the training-free maps, and convert refines the "
                                       "layers it writes")


def settings(args: argparse.Namespace) -> Settings:
    return Settings(**{name: getattr(args, name) for name in Settings.names()})


def run(args: argparse.Namespace) -> int:
    from nbl_gguf.calibration.artifact import load_artifact
    from nbl_gguf.calibration.calibrate import calibrate
    from nbl_gguf.calibration.refine import check_refinable, planned, refine_artifact
    from nbl_gguf.calibration.report import describe_artifact
    from nbl_gguf.model_source import resolve_model

    chosen = settings(args)
    refine = flags.refine_settings(args) if args.refine else None
    if refine is not None:  # before the calibration: a typo, or a form that would not fit, costs nothing
        check_refinable(chosen.method)
        refine = planned(resolve_model(chosen.model), chosen, refine)
    path = calibrate(chosen)
    artifact = load_artifact(path)
    if refine is not None:
        artifact = refine_artifact(artifact, resolve_model(chosen.model), chosen, artifact.select(), refine)
    print(describe_artifact(artifact))
    return 0
