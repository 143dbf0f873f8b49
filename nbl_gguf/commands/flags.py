"""The flags that several commands take, each defined once so that it is spelled, typed and
defaulted the same everywhere (tests/test_command_flags.py parses every command's parser):

    --model, --seed, --calibration ARTIFACT, -o/--output, --no-progress, -t/--threads N,
    --device, --dtype, and calibrate's groups that `convert` shares (data, compute, selection).

Each command says in its help what a flag covers there; what it means is the same in all of them.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys

from nbl_gguf import models
from nbl_gguf.calibration.artifact import DEFAULT_CRITERION, SELECTIONS
from nbl_gguf.calibration.settings import (DEFAULT_M, DEFAULT_MAX_PPL_INCREASE, DEFAULT_SELECTION_TEXT,
                                            DEFAULT_SELECTION_TOKENS, DEFAULT_TAPS)
from nbl_gguf.errors import NblError

DTYPES = ("auto", "bf16", "fp16", "fp32")


def invocation(command: str, argv: list[str] | None = None) -> str:
    """`python -m nbl_gguf COMMAND ...` as it was run (``argv``: default sys.argv), quoted as a shell reads
    it, so that a results file's command can be pasted again (an empty value such as --nbl-kv-types '' stays
    one word)."""
    argv = sys.argv if argv is None else argv
    words = argv[2:] if argv[1:2] == [command] else argv[1:]
    return shlex.join(["python", "-m", "nbl_gguf", command, *words])


def whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def positive_int(text: str) -> int:
    value = whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_model(parser, help: str) -> None:
    parser.add_argument("--model", default=None, help=help)


def add_seed(parser, what: str = "the calibration") -> None:
    parser.add_argument("--seed", type=int, default=0, metavar="N", help=f"random seed of {what} (default: 0)")


def add_calibration(parser, help: str) -> None:
    parser.add_argument("--calibration", default=None, metavar="ARTIFACT", help=help)


def check_calibration(path) -> None:
    """--calibration, when given, names a directory (what is in it, calibration.artifact.load_artifact checks)."""
    from pathlib import Path

    if path and not Path(path).is_dir():
        raise NblError(f"--calibration {path}: no such artifact directory")


def add_output(parser, help: str, default=None, metavar: str = "PATH") -> None:
    parser.add_argument("-o", "--output", default=default, metavar=metavar, help=help)


def add_no_progress(parser) -> None:
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_threads(parser, what: str) -> None:
    parser.add_argument("-t", "--threads", type=positive_int, default=None, metavar="N",
                        help=f"CPU threads {what}")


def add_device(parser, what: str = "while calibrating") -> None:
    parser.add_argument("--device", default="auto",
                        help=f"where PyTorch runs the model {what}: cuda, cuda:N or cpu (default: cuda if available)")


def add_dtype(parser, what: str = "while calibrating") -> None:
    parser.add_argument("--dtype", default="auto", choices=DTYPES,
                        help=f"compute dtype of the model {what} (default: {models.DTYPE_DEFAULT_HELP})")


def int_list(text: str) -> list[int]:
    """'8,12' (or '8 12' within one argument): non-negative whole numbers."""
    try:
        values = [int(v) for v in re.split(r"[,\s]+", text.strip()) if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got '{text}'")
    return values


class _Flatten(argparse.Action):
    """nargs='+' of int_list: '--m 2 4 8', '--m 2,4,8' and '--m 2,4 8' all give [2, 4, 8]."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [value for part in values for value in part])


def name_list(text: str) -> list[str]:
    """A comma-separated list of names, e.g. lowrank,channel."""
    return [part.strip() for part in text.split(",") if part.strip()]


def add_m_list(parser, help: str, default=None) -> None:
    """--m of the commands that measure several layer counts (bench, eval --sweep)."""
    parser.add_argument("--m", nargs="+", type=int_list, action=_Flatten, default=default, metavar="M", help=help)


def add_taps_list(parser, help: str) -> None:
    """--taps of bench's synthetic models: several counts, one NBL file each."""
    parser.add_argument("--taps", nargs="+", type=int_list, action=_Flatten, default=None, metavar="K", help=help)


# --- calibrate's groups, shared with convert ----------------------------------------------------------

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
    parser.add_argument("--selection-text", type=check_selection_text, default=DEFAULT_SELECTION_TEXT, metavar="TEXT",
                        help="the held-out windows that --m auto and --criterion best/greedy measure: 'mix' (the "
                             "calibration text's windows after the fit windows, and the bundled Python documentation "
                             "and Python code held out for selection, a third of the windows each), 'calibration' "
                             "(the calibration text's only), or KIND:WEIGHT,... of the kinds calibration, prose, code "
                             f"(default: {DEFAULT_SELECTION_TEXT})")
    parser.add_argument("-c", "--ctx-size", type=positive_int, default=None, metavar="N",
                        help="context at which the selection reports the KV cache its layers save, as llama.cpp "
                             "allocates it (default: the model's training context, llama-cli's default)")
    parser.add_argument("--kv-type", type=kv_type, default="f16", metavar="TYPE",
                        help="the KV cache type the file will run with (llama.cpp's -ctk/-ctv): f16 (default, as "
                             "llama.cpp), q8_0, q4_0, or K's/V's as q8_0/q4_0; the KV figures are given at it")
    add_ubatch_size(parser)


def add_ubatch_size(parser) -> None:
    """-ub/--ubatch-size: the micro-batch the KV figures are given at (what a sliding-window layer caches)."""
    from nbl_gguf.kv_cache import DEFAULT_UBATCH

    parser.add_argument("-ub", "--ubatch-size", type=positive_int, default=DEFAULT_UBATCH, metavar="N",
                        help="the micro-batch the file will run with (llama.cpp's -ub): a sliding-window or window "
                             "layer caches its window, its sinks and one micro-batch, so a smaller one shrinks those "
                             "caches and processes prompts more slowly; the KV figures are given at it (default: "
                             f"{DEFAULT_UBATCH}, as llama.cpp)")



def cache_type(flag: str, text: str) -> str:
    """A cache type a command was given (one of llama.cpp's, or K's/V's as q8_0/q4_0), lower-cased; an
    error that names ``flag`` otherwise."""
    from nbl_gguf.llamacpp.cache_types import split_cache_type

    try:
        split_cache_type(text)
    except NblError as error:
        raise NblError(f"{flag}: {error}") from None
    return text.lower()


def kv_type(text: str) -> str:
    """--kv-type: a KV cache type that llama.cpp's CPU and CUDA backends both run with flash attention."""
    from nbl_gguf.measurement.kv_budget import KV_TYPES

    if text.lower() not in KV_TYPES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(KV_TYPES)}, got {text!r}")
    return text.lower()


def taps_count(text: str):
    """convert's --taps: a number of tokens or 'auto'."""
    return text if text == "auto" else positive_int(text)


def add_taps_arguments(parser: argparse.ArgumentParser, auto: bool = False) -> None:
    """--taps and --taps-rank: what replaces a chosen attention (calibrate: a count, 1 by default; convert
    also 'auto', resolved by the file it writes: from_artifact.check_taps)."""
    default = "auto" if auto else DEFAULT_TAPS
    what = ("auto: K = 4 where the file can carry taps layers (--runtime nbl, --method attn-nbl, the "
            "layer-streamed calibration), on a CPU for n_embd up to 2048, and with more fit tokens "
            "than 4 x n_embd, else 1; with --calibration, the artifact's own"
            if auto else f"{DEFAULT_TAPS}")
    parser.add_argument("--taps", type=taps_count if auto else positive_int, default=default, metavar="K",
                        help="tokens each replaced layer reads: 1 is the NBL map of the token's own attention input; "
                             "K > 1 also reads the K - 1 tokens before it (a past-token map: GGUF layer type 3, a "
                             "state of K - 1 inputs per sequence instead of a KV cache; patched llama.cpp only, "
                             f"docs/results/taps.md) (default: {what})")
    parser.add_argument("--taps-rank", type=positive_int, default=None, metavar="R",
                        help="with --taps K > 1: rank of the map of the earlier tokens (default: n_embd / 4)")


def non_negative_int(text: str) -> int:
    value = whole_number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {value}")
    return value


def retrieval_tolerance(text: str) -> float | None:
    """--window-retrieval: nats per answer token, or 'off' (None)."""
    if text == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected nats per answer token (0 or more) or 'off', got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected nats per answer token (0 or more) or 'off', got {text!r}")
    return value


def add_window_arguments(parser: argparse.ArgumentParser) -> None:
    """--windows and its window: attention layers kept over the last tokens and the first few only."""
    from nbl_gguf.calibration.windows import (BUDGET_WINDOW_SIZES, DEFAULT_CTX, DEFAULT_RANKING,
                                              DEFAULT_RETRIEVAL_TOLERANCE, DEFAULT_SINKS, DEFAULT_SIZE, RANKINGS)

    parser.add_argument("--windows", type=non_negative_int, default=0, metavar="N",
                        help="make N of the attention layers that are left window layers: each attends to the last "
                             "--window-size tokens and the first --window-sinks only, so its KV cache stops growing; "
                             "the N whose window costs least, measured at --window-ctx tokens on the selection text, "
                             "among those that keep retrieval (--window-retrieval) (llama, qwen2, qwen3, phi3 and "
                             "smollm3, patched llama.cpp; docs/results/window.md) (default: 0)")
    parser.add_argument("--window-size", type=window_sizes, default=None, metavar="W[,W]",
                        help=f"tokens a window layer attends to, itself included (default: {DEFAULT_SIZE}); with "
                             f"--kv-budget, the sizes it chooses among (default: each of "
                             f"{', '.join(map(str, BUDGET_WINDOW_SIZES))} below half the budget's measuring context)")
    parser.add_argument("--window-sinks", type=non_negative_int, default=DEFAULT_SINKS, metavar="S",
                        help=f"first tokens of the sequence every window layer keeps (attention sinks; default: "
                             f"{DEFAULT_SINKS})")
    parser.add_argument("--window-ctx", type=positive_int, default=None, metavar="N",
                        help=f"tokens per text the window layers are chosen and evaluated at (default: {DEFAULT_CTX}, "
                             f"or the training context if shorter)")
    parser.add_argument("--window-retrieval", type=retrieval_tolerance, default=DEFAULT_RETRIEVAL_TOLERANCE,
                        metavar="NATS",
                        help=f"keep a window layer only while facts hidden far back in the selection text are still "
                             f"answered: their answer's loss may rise by at most NATS per token over the file "
                             f"without window layers ('off': choose by the loss on text alone; default: "
                             f"{DEFAULT_RETRIEVAL_TOLERANCE:g})")
    parser.add_argument("--window-ranking", choices=RANKINGS, default=DEFAULT_RANKING,
                        help=f"the order the candidates are tried in: 'loss', each one's loss on text alone, end to end "
                             f"(about n_layer / 2 passes of the model); 'local', each layer's own output with its window "
                             f"against without, in one pass: faster (a Llama-3.2-1B shape: 54 s against 365 s) but blind to "
                             f"windows that help (Qwen2.5-Coder-0.5B: -0.3%% perplexity at 4,096 tokens against -2.1%%; "
                             f"docs/results/window.md) "
                             f"(default: {DEFAULT_RANKING})")


def window_sizes(text: str) -> list[int]:
    """--window-size: 'W' or 'W,W,...', window sizes of at least one token."""
    sizes = int_list(text)
    if 0 in sizes:
        raise argparse.ArgumentTypeError(f"a window holds at least one token, got '{text}'")
    return sorted(set(sizes))


def given_window_sizes(value) -> list[int] | None:
    """--window-size as given: the parser's list or, from convert.options, an int, as a list; None when not
    given."""
    return None if value is None else [value] if isinstance(value, int) else list(value)


def one_window_size(value) -> int:
    """--window-size for --windows: one size (default calibration.windows.DEFAULT_SIZE); several are for
    --kv-budget to choose among."""
    from nbl_gguf.calibration.windows import DEFAULT_SIZE

    sizes = given_window_sizes(value)
    if sizes is None:
        return DEFAULT_SIZE
    if len(sizes) != 1:
        raise NblError(f"--window-size {','.join(map(str, sizes))}: --windows takes one window size (several are "
                       f"for --kv-budget to choose among)")
    return sizes[0]


def check_selection_text(text: str) -> str:
    """--selection-text, checked when the command line is read (a typo costs no calibration)."""
    from nbl_gguf.calibration.dataset import parse_selection_text

    try:
        parse_selection_text(text)
    except NblError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the calibration text comes from (shared with `convert`)."""
    parser.add_argument("--dataset", default=None,
                        help="local .txt/.json/.jsonl/.parquet file or a `datasets` hub name "
                             "(default: bundled C4 sample, first 256 documents)")
    parser.add_argument("--dataset-config", default=None, help="hub dataset configuration (e.g. 'en' for allenai/c4)")
    parser.add_argument("--split", default="train", help="hub dataset split (default: train)")
    parser.add_argument("--text-field", default="text", help="field/column holding the text (default: text)")


def add_compute_arguments(parser: argparse.ArgumentParser) -> None:
    """Where and how the model runs while calibrating (shared with `convert`)."""
    add_dtype(parser)
    add_device(parser)
    parser.add_argument("--memory-budget", type=float, default=None, metavar="GIB",
                        help="host memory (GiB) the layer-streamed calibration plans for: one layer, its statistics "
                             "and, when they fit, the windows' hidden states (else they go to disk) "
                             "(default: half the available memory)")
    parser.add_argument("--whole-model", action="store_true",
                        help="deprecated, changes nothing: every calibration runs one layer at a time (one engine)")


def group_names(*adders) -> tuple[str, ...]:
    """The option names (argparse dests) that ``adders`` define: what a command passes on to the
    calibration as they are."""
    parser = argparse.ArgumentParser(add_help=False)
    for add in adders:
        add(parser)
    return tuple(action.dest for action in parser._actions)


def explicitly_given(parser: argparse.ArgumentParser, args, title: str | None = None) -> list[str]:
    """The flags (as spelled first) whose value in ``args`` is not their default: of the argument group
    called ``title``, or of the whole parser."""
    actions = parser._actions
    if title is not None:
        actions = next(group._group_actions for group in parser._action_groups if group.title == title)
    return [action.option_strings[0] for action in actions
            if action.option_strings and action.dest != "help"
            and getattr(args, action.dest, action.default) != action.default]


def task_files(args) -> dict[str, tuple[str | None, int | None]]:
    """eval's --hellaswag/--winogrande/--multiple-choice files and their --*-tasks counts, by task name
    (measurement.tasks.check_task_files)."""
    return {"hellaswag": (args.hellaswag, args.hellaswag_tasks), "winogrande": (args.winogrande, args.winogrande_tasks),
            "multiple-choice": (args.multiple_choice, args.multiple_choice_tasks)}


def add_refine_arguments(parser: argparse.ArgumentParser, default: str) -> None:
    """--refine and its settings (calibration.refine.RefineSettings, under the same names after 'refine_');
    ``default``: what the command does without --refine or --no-refine, for the help."""
    from nbl_gguf.calibration import refine

    group = parser.add_argument_group("refinement")
    group.add_argument("--refine", action=argparse.BooleanOptionalAction, default=None,
                       help="after the layers are chosen and fitted, tune their maps against the model's output "
                            "(model: KL of the next-token distributions, the whole model in memory; streamed: each "
                            "block's output, one layer in memory); the LMMSE maps stay in the artifact "
                            f"(docs/results/refine.md) (default: {default})")
    group.add_argument("--refine-form", default=refine.DEFAULT_FORM, choices=refine.FORM_CHOICES,
                       help=f"{refine.AUTO_FORM}: the model form where it fits the memory budget, else the streamed "
                            f"one (default: {refine.DEFAULT_FORM})")
    group.add_argument("--refine-tokens", type=positive_int, default=refine.DEFAULT_TOKENS, metavar="N",
                       help=f"training tokens read (default: {refine.DEFAULT_TOKENS})")
    group.add_argument("--refine-seqlen", type=positive_int, default=refine.DEFAULT_SEQLEN, metavar="N",
                       help=f"tokens per training window, cut from the calibration windows (default: "
                            f"{refine.DEFAULT_SEQLEN})")
    group.add_argument("--refine-lr", type=float, default=None, metavar="LR",
                       help="Adam's step, relative to each map tensor's RMS (default: "
                            + ", ".join(f"{lr:g} for the {form} form" for form, lr in refine.DEFAULT_LR.items()) + ")")
    group.add_argument("--refine-top-k", type=positive_int, default=refine.DEFAULT_TOP_K, metavar="K",
                       help=f"model form: the teacher's most likely tokens kept per position, the rest of its mass "
                            f"as one (default: {refine.DEFAULT_TOP_K})")
    group.add_argument("--refine-eval-every", type=positive_int, default=refine.DEFAULT_EVAL_EVERY, metavar="N",
                       help=f"model form: steps between held-out evaluations and checkpoints (default: "
                            f"{refine.DEFAULT_EVAL_EVERY})")
    group.add_argument("--refine-patience", type=positive_int, default=refine.DEFAULT_PATIENCE, metavar="N",
                       help=f"model form: evaluations without a better held-out loss (on the mean, with no kind of "
                            f"text worse than the LMMSE maps') before stopping (default: "
                            f"{refine.DEFAULT_PATIENCE})")
    group.add_argument("--refine-epochs", type=positive_int, default=refine.DEFAULT_STREAMED_EPOCHS, metavar="N",
                       help=f"streamed form: passes over each layer's tokens (default: "
                            f"{refine.DEFAULT_STREAMED_EPOCHS})")
    group.add_argument("--refine-target", default=refine.DEFAULT_TARGET, choices=refine.TARGETS,
                       help="streamed form: what each replaced block's output is matched to: the unmodified model's "
                            "hidden state there (trajectory), or the unmodified block's output on the same inputs "
                            f"(block) (default: {refine.DEFAULT_TARGET})")
    group.add_argument("--refine-text", default=refine.DEFAULT_TEXT, choices=refine.TEXTS,
                       help="what the maps are trained on: the calibration windows (calibration), or those and the "
                            "bundled Python docs and code held out for selection, a third each, never the held-out "
                            f"windows early stopping reads (mix) (default: {refine.DEFAULT_TEXT})")
    group.add_argument("--refine-balance", action=argparse.BooleanOptionalAction, default=None,
                       help="model form: scale each kind of training text's loss to the same size, so that the kind "
                            "the model already predicts best still steers the maps (docs/results/refine.md) "
                            f"(default: {'on' if refine.DEFAULT_BALANCE else 'off'} with the model form)")


def refine_settings(args):
    """calibration.refine.RefineSettings from the --refine-* flags (and --seed, --memory-budget,
    --no-progress)."""
    from nbl_gguf.calibration.refine import RefineSettings

    return RefineSettings(form=args.refine_form, tokens=args.refine_tokens, seqlen=args.refine_seqlen,
                          lr=args.refine_lr, top_k=args.refine_top_k, eval_every=args.refine_eval_every,
                          patience=args.refine_patience, epochs=args.refine_epochs, target=args.refine_target,
                          text=args.refine_text, balance=args.refine_balance, seed=args.seed,
                          memory_budget=args.memory_budget, no_progress=args.no_progress)
