"""Refinement: the replaced layers' maps tuned against the model's output, starting from their LMMSE fit.

Every map is fitted to its own layer's attention output; what users see is the loss at the model's
output, after every later layer has reacted to every replaced one. Refinement moves the maps only
(W, b and the taps tensors of the chosen layers; the rest of the model frozen), in one of two forms:

    model      KL(unmodified model || NBL model) of the next-token distributions on the calibration
               windows, the whole model in memory: the teacher's top-k log-probabilities computed once
               (the rest of its mass kept as one outcome), Adam on the maps, early stopping on the
               selection's held-out windows (the maps of the best evaluation that leaves no kind of
               text worse than the LMMSE maps are kept: no_kind_worse).
    streamed   one decoder layer in memory, as the calibration: each replaced layer's map tuned so that
               its decoder block's output (after the MLP), on the inputs that the already-refined earlier
               layers produce, matches the unmodified model's hidden state there (or the unmodified
               block's output on those inputs: RefineSettings.target), then the next.

Both are deterministic for a seed and resumable (the state folder of calibration.resume). What was
refined and how far the held-out loss moved is recorded in the artifact (``save_refined``), whose
LMMSE maps stay as they are: a refinement holds for its set of layers only.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from nbl_gguf import models
from nbl_gguf.errors import NblError

FORMS = ("model", "streamed")
# "auto": the model form where it fits the memory budget, else the streamed form (one layer in memory). Where
# both fit, the model form: on SmolLM2 m = 12 taps it took C4 to +26.4% against the streamed form's +33.3%;
# on Qwen2.5-Coder-0.5B m = 8 taps the two were alike (docs/results/refine.md)
AUTO_FORM = "auto"
FORM_CHOICES = (AUTO_FORM,) + FORMS
DEFAULT_FORM = AUTO_FORM
# an eighth of the CPU calibration's tokens (32 x 2048), read DEFAULT_SEQLEN at a time: on SmolLM2 and Qwen 0.5B
# every kind of text gained, in under half the calibration's time; 32768 gained more in 1-3x it
# (docs/results/refine.md, "At 8,192 tokens")
DEFAULT_TOKENS = 8192
DEFAULT_SEQLEN = 512
# Adam's step, relative to each map tensor's RMS (an absolute step moves the maps of a model whose maps are
# small, as Qwen2.5's are 30x SmolLM2's, by far more: docs/results/refine.md); the streamed form's
# per-layer loss takes a larger one
DEFAULT_LR = {"model": 2e-3, "streamed": 5e-3}
DEFAULT_TOP_K = 32
DEFAULT_EVAL_EVERY = 8  # steps between held-out evaluations (and checkpoints)
DEFAULT_PATIENCE = 2  # evaluations without a better held-out loss before stopping
DEFAULT_STREAMED_EPOCHS = 3  # passes of the streamed form over each layer's tokens
# SmolLM2 m = 12 taps, 16384 tokens, 3 epochs: the trajectory closed 7% of the held-out gap, the block's own
# output 1% (docs/results/refine.md)
TARGETS = ("trajectory", "block")
DEFAULT_TARGET = "trajectory"
# the text the maps are trained on: the calibration windows alone, or those and the bundled Python docs and code
# held out for selection (beyond the held-out windows themselves), a third each (training_pieces_of). The mix by
# default: SmolLM2 m = 12 taps, code +104% -> +45% at 32,768 tokens (C4 +23.4% -> +26.4%), and at 65,536 tokens on
# two kinds neither trained nor selected on (Vim's manual, licence texts) +52% / +55% -> +39% / +40%
# (docs/results/refine.md)
TEXTS = ("calibration", "mix")
DEFAULT_TEXT = "mix"
# --refine-balance: on wherever the model form runs (the streamed form trains each layer on its own, with no
# loss to weigh). Qwen2.5-Coder-0.5B m = 8 taps: unbalanced, C4 ends worse than the LMMSE maps (+0.5% on 16,384
# unseen tokens at 4,096, +2.3% on the evaluation text) while docs and code gain; balanced, C4 gains too (-0.4%
# there, -1.4 points at 512) for 0.9-2.4 points of docs and code; SmolLM2 m = 12: C4 and docs 0.1-0.5 points
# better, code 3 worse (docs/results/refine.md). Every kind at least as good as the LMMSE maps is issue 33's bar.
DEFAULT_BALANCE = True
# what the state key and the report record of the settings: not where progress goes or how much memory was allowed
UNRECORDED = ("no_progress", "memory_budget")


@dataclass(frozen=True)
class RefineSettings:
    """What a refinement is asked for: calibrate's and convert's --refine-* options."""

    form: str = DEFAULT_FORM
    tokens: int = DEFAULT_TOKENS  # training tokens read (steps x seqlen)
    seqlen: int = DEFAULT_SEQLEN
    lr: float | None = None  # relative to each tensor's RMS; None: DEFAULT_LR of the form
    top_k: int = DEFAULT_TOP_K
    eval_every: int = DEFAULT_EVAL_EVERY
    patience: int = DEFAULT_PATIENCE
    epochs: int = DEFAULT_STREAMED_EPOCHS
    # streamed form: the unmodified model's own hidden state after the block ("trajectory", so that a layer
    # also corrects what the earlier replaced ones changed), or the unmodified block's output on the same
    # inputs ("block")
    target: str = DEFAULT_TARGET
    text: str = DEFAULT_TEXT
    # each kind of training text's loss scaled by the mean over kinds of their running losses over its own, so
    # that a kind whose KL is small (Qwen2.5's C4 beside its code) steers the maps as much as the others
    # None: DEFAULT_BALANCE where the model form runs (resolve_form); off where read unresolved
    balance: bool | None = None
    seed: int = 0
    memory_budget: float | None = None  # GiB; None: half the memory available (settings.memory_budget_bytes)
    no_progress: bool = False

    def check(self) -> None:
        if self.form not in FORM_CHOICES:
            raise NblError(f"--refine-form {self.form!r}: use {', '.join(FORM_CHOICES[:-1])} or {FORM_CHOICES[-1]}")
        for name, value, least in (("--refine-tokens", self.tokens, 1), ("--refine-seqlen", self.seqlen, 2),
                                   ("--refine-top-k", self.top_k, 1), ("--refine-eval-every", self.eval_every, 1),
                                   ("--refine-patience", self.patience, 1), ("--refine-epochs", self.epochs, 1)):
            if value < least:
                raise NblError(f"{name} must be at least {least}, got {value}")
        if self.lr is not None and (not self.lr > 0 or not math.isfinite(self.lr)):
            raise NblError(f"--refine-lr must be a positive number, got {self.lr}")
        if self.target not in TARGETS:
            raise NblError(f"--refine-target {self.target!r}: use {' or '.join(TARGETS)}")
        if self.text not in TEXTS:
            raise NblError(f"--refine-text {self.text!r}: use {' or '.join(TEXTS)}")
        if self.balance and self.form == "streamed":
            raise NblError(f"--refine-balance weighs the kinds of text in the model form's loss; --refine-form "
                           f"{self.form} trains each layer on its own and has no such loss: use --refine-form model "
                           f"or leave --refine-balance out")

    @property
    def learning_rate(self) -> float:
        if self.form not in FORMS:
            raise NblError(f"--refine-form {self.form}: the learning rate is the chosen form's (resolve_form first)")
        return DEFAULT_LR[self.form] if self.lr is None else self.lr

    def recorded(self) -> dict:
        """The settings that shape the maps (the resume state's key, the artifact's and the GGUF's record)."""
        return {key: value for key, value in asdict(self).items() if key not in UNRECORDED}


@dataclass
class Refined:
    """The refined maps of ``layers`` ({layer: (W, b)} for per-token maps, {layer: TapsMap} for taps)
    and the report the artifact keeps."""

    layers: list[int]
    taps: int
    maps: dict
    report: dict = field(default_factory=dict)

    def tensors(self) -> dict[str, np.ndarray]:
        """The maps under the artifact's names (artifact.save_refined)."""
        from nbl_gguf.calibration.taps import map_tensors

        tensors = {}
        for layer, value in self.maps.items():
            if self.taps > 1:
                tensors.update(map_tensors(layer, value))
            else:
                tensors[f"attn.{layer}.weight"], tensors[f"attn.{layer}.bias"] = value
        return tensors


# --- the maps as parameters ---------------------------------------------------------------------------

def map_modules(model, layers: list[int]) -> dict[int, nn.Module]:
    """The stand-in attention modules (apply.py) of the replaced ``layers``."""
    adapter = models.get_adapter(model)
    decoder = models.decoder_layers(model)
    return {layer: getattr(decoder[layer], adapter.attn) for layer in layers}


def _rms(tensor: torch.Tensor) -> float:
    return float(tensor.detach().float().pow(2).mean().sqrt())


def make_trainable(modules: dict[int, nn.Module], lr: float) -> tuple[list[nn.Parameter], torch.optim.Adam]:
    """The maps' tensors (buffers of apply.py's modules) as float32 parameters, in a fixed order, and Adam
    over them with each tensor's step ``lr`` times its starting RMS (a tensor that starts at zero takes its
    module's weight's): Adam's early steps move every entry by about the step, so an absolute one would
    move small maps more than large ones. Every other parameter of the model is frozen by the caller."""
    params, groups = [], []
    for layer in sorted(modules):
        module = modules[layer]
        weight = getattr(module, "weight", None)
        fallback = _rms(weight) if weight is not None else 1.0
        for name in sorted(module._buffers):
            tensor = module._buffers[name]
            if tensor is None:
                continue
            del module._buffers[name]
            parameter = nn.Parameter(tensor.detach().clone().float())
            module.register_parameter(name, parameter)
            params.append(parameter)
            groups.append({"params": [parameter], "lr": lr * (_rms(parameter) or fallback)})
    return params, torch.optim.Adam(groups)


def read_maps(modules: dict[int, nn.Module], taps: int) -> dict:
    """The modules' maps in the artifact's form: (W, b) float32, or a TapsMap."""
    from nbl_gguf.calibration.taps import TENSOR_NAMES, TapsMap

    maps = {}
    for layer, module in sorted(modules.items()):
        tensors = {name: getattr(module, name).detach().cpu().numpy().astype(np.float32).copy()
                   for name in ("weight", "bias", *TENSOR_NAMES) if getattr(module, name, None) is not None}
        if taps > 1:
            maps[layer] = TapsMap(taps=taps, **tensors)
        else:
            maps[layer] = (tensors["weight"], tensors["bias"])
    return maps


def _parameter_state(params: list[nn.Parameter]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def _load_parameters(params: list[nn.Parameter], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)


# --- what fits in memory ------------------------------------------------------------------------------

# the maps a form holds: the model form its modules', Adam's two moments, the best evaluation's copy and the
# LMMSE fit; the streamed form the LMMSE fit and the refined maps (one layer's training state is small beside them)
MAP_COPIES = {"model": 5, "streamed": 2}


def map_bytes(config, count: int, taps: int = 1, rank: int | None = None) -> int:
    """Bytes of ``count`` layers' maps in float32: W [d, d] and b, and with ``taps`` > 1 a past-token map's
    lags of ``rank`` (default: calibration.taps.default_rank)."""
    from nbl_gguf.calibration.taps import default_rank

    d = int(models.text_config(config).hidden_size)
    per_layer = d * d + d
    if taps > 1:
        r = rank or default_rank(d)  # at most d (taps.solve_lowrank)
        per_layer += r * (taps - 1) * d + d * r
    return count * per_layer * 4


def model_bytes(config, form: str, seqlen: int, dtype, maps: int = 0, tokens: int = 0) -> tuple[int, str]:
    """(peak bytes, what they are) of a refinement: the model's weights (all, or one layer's and the head's
    for the streamed form), the activations autograd keeps for one window of ``seqlen`` tokens, the copies
    of the maps (``maps``: the LMMSE maps' bytes, map_bytes) that the form holds, and for the streamed form
    the hidden states of ``tokens`` training tokens (two tracks) and of the held-out windows (three)."""
    from nbl_gguf.calibration.settings import DEFAULT_SELECTION_TOKENS
    from nbl_gguf.calibration.stream import LOSS_POSITIONS

    text = models.text_config(config)
    d, n_layer = int(text.hidden_size), int(text.num_hidden_layers)
    ffn = int(getattr(text, "intermediate_size", 4 * d))
    vocab = int(text.vocab_size)
    width = torch.finfo(dtype).bits // 8
    per_layer_weights = (4 * d * d + 3 * d * ffn) * width
    # autograd keeps, per token and layer, about a dozen d-wide tensors and four ffn-wide ones (norms,
    # projections, SiLU and its product), in float32 where our maps run
    per_token_layer = (12 * d + 4 * ffn) * 4
    if form == "model":
        weights = n_layer * per_layer_weights + vocab * d * width
        activations = seqlen * (n_layer * per_token_layer + 3 * vocab * 4)  # logits, log-softmax, their grad
        tracks = 0
    else:
        # two layers (one leaving, one coming), and the head (or the embedding) with the logits of a
        # held-out window's LOSS_POSITIONS rows in the model's type and in float32 for the loss
        weights = 2 * per_layer_weights + vocab * d * width + LOSS_POSITIONS * vocab * (width + 8)
        activations = seqlen * per_token_layer * 2
        tracks = (2 * tokens + 3 * DEFAULT_SELECTION_TOKENS) * d * width
    held = MAP_COPIES[form] * maps
    what = (f"{'the model' if form == 'model' else 'one layer and the head'}'s weights {weights / 2**30:.2f} GiB, "
            f"the activations of a {seqlen}-token window {activations / 2**30:.2f} GiB"
            + (f", the hidden states {tracks / 2**30:.2f} GiB" if tracks else "")
            + (f", {MAP_COPIES[form]} copies of the maps {held / 2**30:.2f} GiB" if maps else ""))
    return weights + activations + tracks + held, what


def resolve_form(config, settings: RefineSettings, dtype, available: int, log=None, maps: int = 0) -> RefineSettings:
    """``settings`` with --refine-form auto made a form: the model form where it fits ``available`` bytes (and
    always with --refine-balance asked for, which only it has), else the streamed form, said in ``log``; and
    --refine-balance left unsaid made the form's default."""
    form = settings.form
    if form == AUTO_FORM:
        needed, what = model_bytes(config, "model", settings.seqlen, dtype, maps)
        form = "model" if settings.balance or needed <= available else "streamed"
        if form == "streamed" and log:
            log(f"refine: the model form needs about {needed / 2**30:.2f} GiB ({what}), {available / 2**30:.2f} GiB "
                f"are available to it: the streamed form, one layer in memory")
    balance = (DEFAULT_BALANCE and form == "model") if settings.balance is None else settings.balance
    return replace(settings, form=form, balance=balance)


def check_memory(config, settings: RefineSettings, dtype, available: int, maps: int = 0) -> None:
    """Refuse a refinement that would not fit, before anything is loaded (``maps``: model_bytes')."""
    needed, what = model_bytes(config, settings.form, settings.seqlen, dtype, maps, settings.tokens)
    if needed > available:
        other = " (or --refine-form streamed, one layer in memory)" if settings.form == "model" else \
            ", fewer --refine-tokens or a smaller --m"
        raise NblError(f"--refine ({settings.form}) needs about {needed / 2**30:.2f} GiB: {what}; "
                       f"{available / 2**30:.2f} GiB are available to it: use a shorter --refine-seqlen{other}")


# --- the data -----------------------------------------------------------------------------------------

def training_pieces(ids: torch.Tensor, seqlen: int) -> torch.Tensor:
    """The calibration windows [n, L] cut into pieces of ``seqlen`` tokens [m, seqlen] (a piece is a
    window's beginning or continues it: each starts its own context, as a calibration window does)."""
    n, length = ids.shape
    seqlen = min(seqlen, length)
    per = length // seqlen
    return ids[:, :per * seqlen].reshape(n * per, seqlen)


def training_pieces_of(text: str, calib: torch.Tensor, seqlen: int, tokenizer=None,
                       composition: dict | None = None) -> tuple[torch.Tensor, dict]:
    """(the training pieces [m, seqlen], {kind: pieces}) of RefineSettings.text: ``calib``'s windows alone
    ("calibration"), or as many pieces of each of them and of the bundled Python docs' and code's selection
    parts as the smallest gives ("mix"), those parts read after the windows that the held-out ``composition``
    (dataset.load_windows') took from them, so that early stopping stays on text the maps never trained on."""
    from nbl_gguf.calibration.dataset import CALIBRATION_KIND, MIX_KINDS, bundled_windows_after

    own = training_pieces(calib, seqlen)
    if text == "calibration":
        return own, {CALIBRATION_KIND: int(own.shape[0])}
    held = (composition or {}).get("windows", {})
    parts = {CALIBRATION_KIND: own}
    for kind in MIX_KINDS[1:]:
        parts[kind] = training_pieces(
            bundled_windows_after(tokenizer, kind, held.get(kind, 0), calib.shape[1], own.shape[1]), own.shape[1])
    count = min(int(part.shape[0]) for part in parts.values())
    # interleaved (calibration, docs, code, calibration, ...): each kind's share is the same in any prefix
    mixed = torch.stack([part[:count] for part in parts.values()], dim=1).reshape(-1, own.shape[1])
    return mixed, {kind: count for kind in parts}


def piece_kinds(counts: dict[str, int]) -> list[str]:
    """The kind of each of training_pieces_of's pieces, from its {kind: pieces}: the kinds in turn."""
    kinds = list(counts)
    return [kinds[i % len(kinds)] for i in range(sum(counts.values()))]


def step_order(count: int, steps: int, seed: int) -> list[int]:
    """Which piece each step reads: a fresh permutation of the pieces each epoch, from the seed alone (so
    a resumed run reads what an uninterrupted one would)."""
    order = []
    epoch = 0
    while len(order) < steps:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order += torch.randperm(count, generator=generator).tolist()
        epoch += 1
    return order[:steps]


# --- the model form -------------------------------------------------------------------------------------

def _logits(model, ids: torch.Tensor, start=None) -> torch.Tensor:
    """The logits of windows ``ids``; ``start``: (first layer, its input for these windows): the model's
    forward from that layer on (stream.starting_at), the same logits where nothing before it changed."""
    if start is None:
        return model(input_ids=ids, use_cache=False).logits.float()
    from nbl_gguf.calibration.stream import starting_at

    with starting_at(model, *start):
        return model(input_ids=ids, use_cache=False).logits.float()


class _Prefix:
    """The input of the first replaced layer, computed once for every window the refinement reads: the
    unmodified layers before it are then not run again at each step and evaluation (the same logits as the
    whole forward's). Qwen2.5-Coder-0.5B's m = 8 starts at layer 11 of 24, yet the refinement took 299 s
    against 304 s: its steps are mostly the 152K-token head and loss (docs/results/refine.md)."""

    def __init__(self, model, first: int, windows: torch.Tensor):
        from nbl_gguf.calibration.stream import layer_inputs

        self.first = first
        self.inputs = layer_inputs(model, first, windows) if first > 0 else None

    def start(self, i: int):
        return None if self.inputs is None else (self.first, self.inputs[i:i + 1])


def teacher_top_k(model, pieces: torch.Tensor, k: int, progress) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities [m, seqlen, k] float32, their token ids [m, seqlen, k] int64) of the unmodified
    model's k most likely next tokens at every position of every piece."""
    values, indices = [], []
    with torch.no_grad():
        for i in range(pieces.shape[0]):
            logp = torch.log_softmax(_logits(model, pieces[i:i + 1]), -1)
            top = logp.topk(k, dim=-1)
            values.append(top.values[0])
            indices.append(top.indices[0])
            progress.update()
    return torch.stack(values), torch.stack(indices)


def balance_weight(running: dict[str, float], kind: str, value: float) -> float:
    """RefineSettings.balance: the factor of a ``kind`` piece's training loss ``value``, the mean over kinds of
    their running mean losses (``running``, updated here) over its own. Unscaled, each kind steers the maps in
    proportion to its KL: on Qwen2.5-Coder, code's is the largest and C4's the smallest, and the maps trained on
    a third of each drifted away from C4 while code and docs improved (docs/results/refine.md)."""
    running[kind] = value if kind not in running else 0.9 * running[kind] + 0.1 * value
    return float(np.mean(list(running.values()))) / max(running[kind], 1e-12)


def distillation_loss(student_logits: torch.Tensor, top_logp: torch.Tensor, top_ids: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per position, mean: the teacher's top-k outcomes and one more, "any other
    token", which holds the rest of each side's mass (so the student is not rewarded for moving mass
    off the teacher's top-k)."""
    logp = torch.log_softmax(student_logits, -1)
    student_top = logp.gather(-1, top_ids)
    # log of the student's mass outside the teacher's top-k: logsumexp over the other tokens
    masked = logp.scatter(-1, top_ids, float("-inf"))
    student_rest = torch.logsumexp(masked, -1)
    teacher_p = top_logp.exp()
    teacher_rest_p = (1 - teacher_p.sum(-1)).clamp_min(1e-12)
    kl_top = (teacher_p * (top_logp - student_top)).sum(-1)
    kl_rest = teacher_rest_p * (teacher_rest_p.log() - student_rest)
    return (kl_top + kl_rest).mean()


def heldout_nll(model, heldout: torch.Tensor, progress=None, prefix: _Prefix | None = None) -> np.ndarray:
    """Mean next-token NLL of each held-out window [windows] (float64); ``prefix``: the windows' input of
    the first replaced layer."""
    values = []
    with torch.no_grad():
        for i in range(heldout.shape[0]):
            logits = _logits(model, heldout[i:i + 1], prefix.start(i) if prefix is not None else None)
            nll = torch.nn.functional.cross_entropy(logits[0, :-1], heldout[i, 1:], reduction="mean")
            values.append(float(nll))
            if progress is not None:
                progress.update()
    return np.array(values, dtype=np.float64)


def _kinds_report(nll: np.ndarray, kinds: list[str] | None) -> dict:
    """{kind: mean NLL} of the held-out windows, and 'all'."""
    report = {"all": float(nll.mean())}
    if kinds:
        for kind in dict.fromkeys(kinds):
            report[kind] = float(np.mean([v for v, k in zip(nll, kinds) if k == kind]))
    return report


def no_kind_worse(nll: np.ndarray, lmmse: np.ndarray, kinds: list[str] | None) -> bool:
    """Whether held-out NLLs ``nll`` are no higher than the LMMSE maps' ``lmmse`` on the mean and on each
    kind of text. A lower mean alone traded one kind for the others: on Qwen2.5-Coder-0.5B m = 4 taps the kept
    evaluation had C4 higher and docs and code lower, and C4 ended worse than the LMMSE maps on unseen text
    too (docs/results/refine.md); issue 33's bar is no kind worse."""
    now, start = _kinds_report(nll, kinds), _kinds_report(lmmse, kinds)
    return all(now[kind] <= start[kind] for kind in start)


def _evaluation(step: int, nll: np.ndarray, train_kl: float | None, kinds: list[str] | None) -> dict:
    """One entry of the report's history: the held-out NLL after ``step`` steps, by kind where there are
    several (a kind can get worse while the mean falls: docs/results/refine.md), and the mean training KL
    since the last evaluation."""
    entry = {"step": step, "heldout_nll": float(nll.mean()), "train_kl": train_kl}
    by_kind = _kinds_report(nll, kinds)
    if len(by_kind) > 2:
        entry["heldout_nll_by_kind"] = {kind: value for kind, value in by_kind.items() if kind != "all"}
    return entry


class _Checkpoints:
    """The refinement's resume files in a resume.CalibrationState folder (None: no resume)."""

    def __init__(self, state):
        self.state = state

    def load(self, name: str):
        if self.state is None or not self.state.path(name).is_file():
            return None
        return torch.load(self.state.path(name), weights_only=False)

    def save(self, name: str, value) -> None:
        if self.state is not None:
            # straight to the file: through a buffer, an 8B model's checkpoint was in memory twice more
            self.state.write_file(name, lambda handle: torch.save(value, handle))


def refine_model(model, layers: list[int], layer_type: int, maps: dict, pieces: torch.Tensor, heldout: torch.Tensor,
                 settings: RefineSettings, state=None, kinds: list[str] | None = None, log=None,
                 training_kinds: list[str] | None = None) -> Refined:
    """The model form. ``model``: the unmodified model, in memory (its replaced layers are swapped in
    here: apply.apply_nbl of ``layers`` as ``layer_type`` with ``maps``, the LMMSE fit); ``pieces``:
    training token windows [m, seqlen]; ``heldout``: the early-stopping windows [w, L], of the text
    ``kinds`` (one name a window, for the report); ``state``: a resume.CalibrationState to checkpoint
    into (None: no resume); ``training_kinds``: the kind of each piece (piece_kinds; for
    RefineSettings.balance). Returns the maps of the best held-out evaluation."""
    from tqdm import tqdm

    from nbl_gguf.calibration.apply import ATTN_TAPS, apply_nbl

    log = log or (lambda text: print(text, file=sys.stderr))
    started = time.perf_counter()
    files = _Checkpoints(state)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    steps = max(1, settings.tokens // pieces.shape[1])
    order = step_order(pieces.shape[0], steps, settings.seed)
    needed = sorted(set(order))
    position = {piece: i for i, piece in enumerate(needed)}

    teacher = files.load("teacher.pt")
    if teacher is None:
        with tqdm(total=len(needed) + heldout.shape[0], desc="refine: teacher", unit="window",
                  disable=settings.no_progress, file=sys.stderr) as bar:
            top_logp, top_ids = teacher_top_k(model, pieces[needed], settings.top_k, bar)
            base = heldout_nll(model, heldout, bar)
        teacher = {"top_logp": top_logp.to(torch.float16), "top_ids": top_ids.to(torch.int32), "base": base}
        files.save("teacher.pt", teacher)
    top_logp, top_ids, base = teacher["top_logp"].float(), teacher["top_ids"].long(), teacher["base"]
    first = min(layers)
    piece_prefix, heldout_prefix = _Prefix(model, first, pieces[needed]), _Prefix(model, first, heldout)

    apply_nbl(model, {layer: layer_type for layer in layers}, maps)
    modules = map_modules(model, layers)
    params, optimizer = make_trainable(modules, settings.learning_rate)
    # cosine decay to a tenth over the planned steps: the late steps settle instead of wandering
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: 0.1 + 0.45 * (1 + math.cos(math.pi * min(i, steps) / steps)))
    saved = files.load("refine.pt")
    if saved is not None:
        _load_parameters(params, saved["params"])
        optimizer.load_state_dict(saved["optimizer"])
        schedule.load_state_dict(saved["schedule"])
        step, best, history, waited = saved["step"], saved["best"], saved["history"], saved["waited"]
        start_nll, running = saved["start_nll"], saved["running"]
        log(f"refine: resuming after step {step} (state {state.folder})")
    else:
        start_nll = heldout_nll(model, heldout, prefix=heldout_prefix)
        step, waited = 0, 0
        best = {"step": 0, "nll": start_nll, "params": _parameter_state(params)}
        history = [_evaluation(0, start_nll, None, kinds)]
        running = {}  # kind: running mean of its training loss (settings.balance)
    bar = tqdm(total=steps, initial=step, desc="refine", unit="step", disable=settings.no_progress, file=sys.stderr)
    window_loss = []
    while step < steps and waited < settings.patience:  # a resumed run that had stopped stays stopped
        piece = order[step]
        logits = _logits(model, pieces[piece:piece + 1], piece_prefix.start(position[piece]))[0]
        loss = distillation_loss(logits, top_logp[position[piece]], top_ids[position[piece]])
        weight = balance_weight(running, training_kinds[piece], float(loss.detach())) \
            if settings.balance and training_kinds else 1.0
        optimizer.zero_grad(set_to_none=True)
        (loss * weight).backward()
        optimizer.step()
        schedule.step()
        window_loss.append(float(loss.detach()))
        step += 1
        bar.update()
        if step % settings.eval_every and step < steps:
            continue
        nll = heldout_nll(model, heldout, prefix=heldout_prefix)
        history.append(_evaluation(step, nll, float(np.mean(window_loss)), kinds))
        window_loss = []
        bar.set_postfix_str(f"held-out NLL {start_nll.mean():.4f} -> {nll.mean():.4f}")
        if nll.mean() < best["nll"].mean() and no_kind_worse(nll, start_nll, kinds):
            best, waited = {"step": step, "nll": nll, "params": _parameter_state(params)}, 0
        else:
            waited += 1
        files.save("refine.pt", {"params": _parameter_state(params), "optimizer": optimizer.state_dict(),
                                 "schedule": schedule.state_dict(), "step": step,
                                 "best": best, "history": history, "waited": waited,
                                 "start_nll": start_nll, "running": running})
    bar.close()
    stopped = (f"no better held-out loss with no kind of text worse in {settings.patience} evaluations"
               if waited >= settings.patience else "token budget")
    _load_parameters(params, best["params"])
    taps = int(maps[layers[0]].taps) if layer_type == ATTN_TAPS else 1
    report = {
        "form": "model", "layers": sorted(layers), "taps": taps,
        "objective": f"KL(unmodified || NBL) of the next-token distribution, the teacher's top {settings.top_k} "
                     f"tokens and the rest of its mass",
        "steps": step, "best_step": best["step"], "tokens_read": step * pieces.shape[1], "stopped": stopped,
        "heldout": {"windows": int(heldout.shape[0]), "tokens": int(heldout.numel()),
                    "unmodified_nll": _kinds_report(base, kinds),
                    "lmmse_nll": _kinds_report(start_nll, kinds),
                    "refined_nll": _kinds_report(best["nll"], kinds)},
        "history": history,
        "settings": settings.recorded(), "seconds": round(time.perf_counter() - started, 1),
    }
    return Refined(sorted(layers), taps, read_maps(modules, taps), report)


# --- the streamed form ------------------------------------------------------------------------------------

def refine_streamed(stream, layers: list[int], layer_type: int, maps: dict, pieces: torch.Tensor,
                    heldout: torch.Tensor, settings: RefineSettings, state=None, kinds: list[str] | None = None,
                    log=None) -> Refined:
    """The streamed form on ``stream`` (a calibration.stream.LayerStream, one layer in memory): layer by
    layer, the hidden states of the refined model so far; at a replaced layer, its map trained so that
    the block's output matches the unmodified block's on those same inputs (relative mean squared
    error, ``settings.epochs`` passes over the pieces, Adam), before the next layer is read."""
    from tqdm import tqdm

    from nbl_gguf.calibration.apply import ATTN_TAPS, replace_layer

    log = log or (lambda text: print(text, file=sys.stderr))
    started = time.perf_counter()
    files = _Checkpoints(state)
    count = max(1, min(pieces.shape[0], settings.tokens // pieces.shape[1]))
    chosen = pieces[sorted(step_order(pieces.shape[0], count, settings.seed))]
    taps = int(maps[layers[0]].taps) if layer_type == ATTN_TAPS else 1
    saved = files.load("streamed.pt")
    if saved is not None:
        first, hidden, teacher = saved["next_layer"], saved["hidden"], saved["teacher"]
        refined_maps = {k: files.load(_streamed_map(k)) for k in layers if k < first}
        losses = saved["losses"]
        log(f"refine: resuming at layer {first} (state {state.folder})")
    else:
        hidden = stream.embed_all(chosen)
        first, refined_maps, losses = 0, {}, {}
        teacher = hidden.clone() if settings.target == "trajectory" else None

    def run_all(k: int, states=None) -> torch.Tensor:
        states = hidden if states is None else states
        return torch.cat([stream.run_layer(k, states[i:i + 1]) for i in range(states.shape[0])])

    last = max(layers)
    bar = tqdm(total=last + 1, initial=first, desc="refine (streamed)", unit="layer", disable=settings.no_progress,
               file=sys.stderr)
    for k in range(first, last + 1):
        stream.load_layer(k)
        try:
            if teacher is not None:
                teacher = run_all(k, teacher)
            if k in layers:
                target = teacher if teacher is not None else run_all(k)
                restore = replace_layer(stream.model, k, layer_type, {k: maps[k]})
                try:
                    module = map_modules(stream.model, [k])
                    _, optimizer = make_trainable(module, settings.learning_rate)
                    scale = target.float().pow(2).mean()
                    history = []
                    for epoch in range(settings.epochs):
                        for i in step_order(hidden.shape[0], hidden.shape[0], settings.seed + 7919 * (epoch + 1) + k):
                            out = stream.run_layer(k, hidden[i:i + 1], grad=True)
                            loss = (out.float() - target[i:i + 1].float()).pow(2).mean() / scale
                            optimizer.zero_grad(set_to_none=True)
                            loss.backward()
                            optimizer.step()
                            history.append(float(loss.detach()))
                    refined_maps.update(read_maps(module, taps))
                    # each map saved once, in its own file: the whole set at every layer was gigabytes at 8B
                    files.save(_streamed_map(k), refined_maps[k])
                    losses[k] = {"first_epoch": float(np.mean(history[:hidden.shape[0]])),
                                 "last_epoch": float(np.mean(history[-hidden.shape[0]:]))}
                    hidden = run_all(k)
                finally:
                    restore()
            else:
                hidden = run_all(k)
        finally:
            stream.release_layer(k)
        files.save("streamed.pt", {"next_layer": k + 1, "hidden": hidden, "losses": losses, "teacher": teacher})
        bar.update()
    bar.close()
    # the held-out loss of the unmodified model, of the LMMSE maps and of the refined ones
    variant = {layer: layer_type for layer in layers}
    unmodified, lmmse = run_variants_nll(stream, heldout, [{}, variant], lambda k, _type: maps[k])
    (refined,) = run_variants_nll(stream, heldout, [variant], lambda k, _type: refined_maps[k])
    kept = "refined"
    if not no_kind_worse(refined, lmmse, kinds):
        # no early stopping inside the layer loop: a refinement that ends worse on the held-out windows, on the
        # mean or on one kind of text, is not kept
        kept, refined_maps, refined = "lmmse (the refined maps were worse on the held-out windows)", dict(maps), lmmse
    report = {
        "form": "streamed", "layers": sorted(layers), "taps": taps,
        "objective": "each replaced block's output (after the MLP) against "
                     + ("the unmodified model's hidden state there" if settings.target == "trajectory" else
                        "the unmodified block's on the same inputs") + ", relative mean squared error, layer by layer",
        "epochs": settings.epochs, "tokens_read": int(chosen.numel()) * settings.epochs,
        "heldout": {"windows": int(heldout.shape[0]), "tokens": int(heldout.numel()),
                    "unmodified_nll": _kinds_report(unmodified, kinds),
                    "lmmse_nll": _kinds_report(lmmse, kinds),
                    "refined_nll": _kinds_report(refined, kinds)},
        "kept": kept, "layer_losses": {str(k): v for k, v in sorted(losses.items())},
        "settings": settings.recorded(), "seconds": round(time.perf_counter() - started, 1),
    }
    return Refined(sorted(layers), taps, refined_maps, report)


def _streamed_map(layer: int) -> str:
    """The streamed form's resume file of ``layer``'s refined map."""
    return f"streamed-map-{layer}.pt"


def run_variants_nll(stream, ids: torch.Tensor, variants: list[dict[int, int]], linear) -> list[np.ndarray]:
    """The mean next-token NLL of each window [windows] (float64) of each variant of the model
    (variants.run_variants: {layer: layer type}, ``linear(k, type)`` the map)."""
    from nbl_gguf.calibration.variants import run_variants

    outputs = run_variants(stream, ids, variants, linear)
    stream.load_head()
    try:
        return [stream.token_nll(out, ids).mean(1).numpy() for out in outputs]
    finally:
        stream.release_head()


# --- the stage ------------------------------------------------------------------------------------------

def heldout_kinds(composition: dict | None, count: int) -> list[str] | None:
    """The kind of each held-out window, in load_windows' order (the calibration text's, then each
    bundled kind's)."""
    if not composition:
        return None
    kinds = [kind for kind, n in composition["windows"].items() for _ in range(n)]
    return kinds if len(kinds) == count else None


def planned(source, calibration, settings: RefineSettings, log=None) -> RefineSettings:
    """``settings`` checked, their form chosen for the model ``source`` and the memory that ``calibration``
    (calibration.settings.Settings) allows, and refused when that form would not fit: nothing is loaded, so the
    commands ask before they calibrate."""
    from transformers import AutoConfig

    dtype = models.resolve_dtype(calibration.dtype, models.resolve_device(calibration.device))
    return fitted(AutoConfig.from_pretrained(str(source.hf_folder())), dtype, calibration, settings, log)


def fitted(config, dtype, calibration, settings: RefineSettings, log=None, maps: int | None = None) -> RefineSettings:
    """planned(), for a model whose config and dtype are known; ``maps``: the bytes of the maps to refine (None:
    map_bytes of as many layers as ``calibration`` may replace, --m auto all but one)."""
    from nbl_gguf.calibration.settings import default_m, memory_budget_bytes

    log = log or (lambda text: print(text, file=sys.stderr))
    settings.check()
    available = memory_budget_bytes(calibration) if settings.memory_budget is None \
        else int(settings.memory_budget * 2**30)
    if maps is None:
        n_layer = int(models.text_config(config).num_hidden_layers)
        m = calibration.m
        count = n_layer - 1 if m == "auto" else default_m(n_layer) if m is None else int(m)
        maps = map_bytes(config, count, calibration.taps, calibration.taps_rank)
    settings = resolve_form(config, settings, dtype, available, log, maps)
    check_memory(config, settings, dtype, available, maps)
    return settings


def refine(source, calibration, layers: list[int], layer_type: int, maps: dict, settings: RefineSettings,
           artifact_data: dict | None = None, log=None) -> Refined:
    """Refine the maps of ``layers`` (their LMMSE fit ``maps``, of apply.py's ``layer_type``) of the model
    ``source`` (a model_source.ModelSource) on the windows that ``calibration`` (calibration.settings.Settings)
    names; ``artifact_data``: the artifact's record of its windows, to say when they differ."""
    from nbl_gguf.calibration import dataset
    from nbl_gguf.calibration.resume import CalibrationState, digest, model_identity, tokens_digest
    from nbl_gguf.calibration.settings import DEFAULT_NSAMPLES, release_freed_memory
    from transformers import AutoConfig

    log = log or (lambda text: print(text, file=sys.stderr))
    if not layers:
        raise NblError("--refine: no layer is replaced, so there is no map to refine")
    device = models.resolve_device(calibration.device)
    dtype = models.resolve_dtype(calibration.dtype, device)
    config = AutoConfig.from_pretrained(str(source.hf_folder()))
    release_freed_memory()  # what the calibration before it freed: counted as available, not kept beside the model
    settings = fitted(config, dtype, calibration, settings, log, sum(4 * a.size for a in _map_arrays(maps)))
    if calibration.threads is not None:
        torch.set_num_threads(calibration.threads)
    torch.manual_seed(settings.seed)
    if settings.form == "model":
        loaded = models.load_model(str(source.hf_folder()), dtype=calibration.dtype, device=device, name=source.name)
        shape = SimpleNamespace(tokenizer=loaded.tokenizer, config=loaded.model.config,  # what load_windows reads
                                hidden_size=int(models.text_config(config).hidden_size))
    else:
        from nbl_gguf.calibration.stream import LayerStream

        shape = LayerStream(source, dtype, device)
    nsamples = calibration.nsamples or DEFAULT_NSAMPLES["cuda" if device.startswith("cuda") else "cpu"]
    # fitting=False: the maps are fitted already, so the windows need not outnumber the map's inputs
    calib, heldout, composition = dataset.load_windows(calibration, shape, True, nsamples, fitting=False)
    if artifact_data and artifact_data.get("windows_sha256") not in (None, tokens_digest(calib.input_ids)):
        log("refine: note: the calibration windows differ from those the artifact was fitted on "
            "(another --dataset, --nsamples or --seqlen): the maps are refined on these")
    pieces, counts = training_pieces_of(settings.text, calib.input_ids, settings.seqlen, shape.tokenizer,
                                        composition)
    # "kept": the rule that picks the maps kept; a state saved under the earlier rule (the lowest mean alone) is
    # not resumed under this one
    inputs = {"refine": settings.recorded(), "kept": "no_kind_worse",
              "layers": sorted(layers), "layer_type": layer_type, "dtype": str(dtype), "device": device.split(":")[0],
              "tokens": tokens_digest(pieces, heldout),
              "maps": digest({str(k): _map_digest(v) for k, v in sorted(maps.items())})}
    state = CalibrationState.for_model(model_identity(source), inputs, log=log)
    state.open()
    finished = False
    try:
        run = refine_model if settings.form == "model" else refine_streamed
        refined = run(loaded.model if settings.form == "model" else shape, sorted(layers), layer_type, maps, pieces,
                      heldout, settings, state, heldout_kinds(composition, heldout.shape[0]), log,
                      **({"training_kinds": piece_kinds(counts)} if settings.form == "model" else {}))
        finished = True
    finally:
        state.close(finished=finished)
    refined.report.update(dtype=str(dtype).replace("torch.", ""), device=device,
                          windows={"training": f"{pieces.shape[0]} pieces of {pieces.shape[1]} tokens from "
                                               f"{calib.nsamples} calibration windows of {calib.seqlen}"
                                               + ("" if settings.text == "calibration" else
                                                  f" and the bundled Python docs and code held out for selection "
                                                  f"({', '.join(f'{k}: {n}' for k, n in counts.items())})"),
                                   "heldout": composition})
    return refined


def _map_arrays(maps: dict):
    """The arrays of maps {layer: (W, b) or TapsMap}."""
    for value in maps.values():
        yield from value.tensors().values() if hasattr(value, "tensors") else value


def _map_digest(value) -> str:
    import hashlib

    h = hashlib.sha256()
    for array in _map_arrays({0: value}):
        h.update(np.ascontiguousarray(array, dtype=np.float32).tobytes())
    return h.hexdigest()


def check_refinable(method: str, what: str = "--method") -> None:
    if method != "attn-nbl":
        raise NblError(f"--refine tunes the maps of attn-nbl layers; {what} is {method}, which has none")


def artifact_maps(artifact, layers: list[int], taps: int | None = None) -> tuple[int, dict]:
    """(apply.py's layer type, {layer: LMMSE map}) of ``layers`` in a calibration artifact, of the kind the
    file will carry: past-token maps of ``taps`` tokens, or per-token attention maps with ``taps`` 1 (None:
    the artifact's own kind). A past-token calibration holds both kinds; attn-drop and block-nbl have no map
    to refine."""
    from nbl_gguf.calibration.apply import ATTN_LINEAR, ATTN_TAPS

    check_refinable(artifact.report["selection"]["method"], f"the calibration in {artifact.path}")
    taps = artifact.taps if taps is None else int(taps)
    if taps > 1:
        artifact.require_taps(taps)
        return ATTN_TAPS, {layer: artifact.taps_map(layer) for layer in layers}
    return ATTN_LINEAR, {layer: artifact.linear(layer, "attn") for layer in layers}


def refine_artifact(artifact, source, calibration, layers: list[int], settings: RefineSettings, log=None,
                    taps: int | None = None):
    """Refine the maps of ``layers`` of ``artifact`` (a loaded CalibrationArtifact) and add them to it; the
    artifact, reloaded. ``taps``: the kind of map the file carries (artifact_maps)."""
    from nbl_gguf.calibration.artifact import load_artifact, save_refined

    layer_type, maps = artifact_maps(artifact, layers, taps)
    refined = refine(source, calibration, layers, layer_type, maps, settings, artifact.report.get("data"), log)
    save_refined(artifact, refined.report, refined.tensors())
    return load_artifact(artifact.path)
