"""Shared by the convert tests."""

from __future__ import annotations

import argparse


def convert_args(**overrides) -> argparse.Namespace:
    """`convert`'s defaults as its parser gives them, no progress bars, and a tiny CPU calibration
    (8 windows of 64 tokens) unless overridden."""
    from nbl_gguf.gguf import convert

    parser = argparse.ArgumentParser()
    convert.add_arguments(parser)
    args = parser.parse_args([])
    args.no_progress = True
    args.nsamples, args.seqlen, args.device = 8, 64, "cpu"
    for key, value in overrides.items():
        setattr(args, key, value)
    return args
