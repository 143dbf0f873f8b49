"""Shared by the convert tests."""

from __future__ import annotations

import argparse


def convert_args(**overrides) -> argparse.Namespace:
    """`convert`'s defaults as its parser gives them, no progress bars, a tiny CPU calibration (8 windows
    of 64 tokens), the cca selection (the tests compare against artifact.layer_types(m, "cca")) and no
    held-out perplexity unless overridden."""
    from nbl_gguf.gguf import convert

    parser = argparse.ArgumentParser()
    convert.add_arguments(parser)
    args = parser.parse_args([])
    args.no_progress = True
    args.nsamples, args.seqlen, args.device = 8, 64, "cpu"
    args.criterion, args.no_eval = "cca", True
    for key, value in overrides.items():
        setattr(args, key, value)
    return args
