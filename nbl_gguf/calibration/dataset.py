"""Calibration text: where it comes from, and how it becomes fixed-length token windows.

Documents are tokenized one at a time and consumed only until enough tokens are gathered, so a
hub dataset as large as C4 is streamed rather than downloaded whole.

Held-out text comes in three bundled kinds (nbl_gguf/data/README.md): C4 web text, English technical
prose (the Python documentation) and source code (Python standard library modules). Each has a part
that layer selection may measure and a part for the summary's perplexity, which never share a
document: a model that holds up on web text can fall apart on code, and one kind alone hides it.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

from nbl_gguf.errors import NblError

if TYPE_CHECKING:
    from nbl_gguf.calibration.settings import Settings

BUNDLED_NAME = "c4-sample.json"
CALIBRATION_DOCS = 256  # the rest of the bundled sample is held out for perplexity
DEFAULT_DATASET = f"bundled:{BUNDLED_NAME}[:{CALIBRATION_DOCS}]"
FILE_SUFFIXES = (".txt", ".json", ".jsonl", ".parquet")  # local files; any other name is a hub dataset


def _bundled_texts() -> list[str]:
    with resources.files("nbl_gguf").joinpath("data", BUNDLED_NAME).open(encoding="utf-8") as handle:
        return _texts_from_json(json.load(handle), BUNDLED_NAME, "text")


def heldout_texts() -> list[str]:
    """The bundled documents never used for calibration (the perplexity slice)."""
    return _bundled_texts()[CALIBRATION_DOCS:]


def heldout_text() -> str:
    """The held-out documents, blank-line separated: the default text of perplexity measurements."""
    return "\n\n".join(text.strip() for text in heldout_texts() if text.strip()) + "\n"


def write_heldout_text(path) -> Path:
    path = Path(path)
    path.write_text(heldout_text(), encoding="utf-8")
    return path


# --- held-out text of several kinds ------------------------------------------------------------------

@dataclass(frozen=True)
class TextKind:
    name: str
    label: str  # what the summary calls it
    file: str  # in nbl_gguf/data


KINDS = {
    "c4": TextKind("c4", "C4 web text", BUNDLED_NAME),
    "prose": TextKind("prose", "Python docs", "python-docs.json"),
    "code": TextKind("code", "Python code", "python-code.json"),
}
EVALUATION, SELECTION = "evaluation", "selection"
# --selection-text: the held-out windows of layer selection. "calibration": the windows after the fit
# windows in the calibration text (C4 by default); "mix": those and the selection parts of the other
# bundled kinds, in these proportions of the windows (or KIND:WEIGHT,... to choose)
CALIBRATION_KIND = "calibration"
MIX_KINDS = (CALIBRATION_KIND, "prose", "code")
SELECTION_TEXTS = {"calibration": {CALIBRATION_KIND: 1}, "mix": {kind: 1 for kind in MIX_KINDS}}


def _bundled_documents(kind: str) -> list[dict]:
    if kind not in KINDS:
        raise NblError(f"unknown kind of text '{kind}' (use {', '.join(KINDS)})")
    with resources.files("nbl_gguf").joinpath("data", KINDS[kind].file).open(encoding="utf-8") as handle:
        return json.load(handle)


def kind_texts(kind: str, part: str) -> list[str]:
    """The documents of one bundled kind in one part: ``selection`` (C4: the calibration slice, whose
    windows after the fit windows layer selection measures) or ``evaluation`` (never calibrated or
    selected on)."""
    if part not in (SELECTION, EVALUATION):
        raise NblError(f"unknown part '{part}' (use {SELECTION} or {EVALUATION})")
    if kind == "c4":
        texts = _bundled_texts()
        return texts[:CALIBRATION_DOCS] if part == SELECTION else texts[CALIBRATION_DOCS:]
    return [doc["text"] for doc in _bundled_documents(kind) if doc["part"] == part]


# more characters than any tokenizer's mean token takes on our text: a text cut at N x this holds N tokens
CHARS_PER_TOKEN_BOUND = 12


def _joined(texts: list[str], max_chars: int | None) -> str:
    """Documents blank-line separated, whole documents only, up to the first that reaches ``max_chars``
    (llama-perplexity tokenizes the whole file before it takes its first chunks)."""
    kept, total = [], 0
    for text in (t.strip() for t in texts):
        if not text:
            continue
        kept.append(text)
        total += len(text) + 2
        if max_chars is not None and total >= max_chars:
            break
    return "\n\n".join(kept) + "\n"


def evaluation_text(kind: str, max_chars: int | None = None) -> str:
    """A kind's evaluation part, blank-line separated: the text of the summary's perplexity."""
    return _joined(kind_texts(kind, EVALUATION), max_chars)


def write_evaluation_text(kind: str, path, max_chars: int | None = None) -> Path:
    path = Path(path)
    path.write_text(evaluation_text(kind, max_chars), encoding="utf-8")
    return path


def write_selection_text(kind: str, path, max_chars: int | None = None) -> Path:
    """A kind's selection part, blank-line separated, for choices measured through llama.cpp (convert
    --kv-budget). C4's documents come last first: the calibration fit consumes its slice from the start,
    so a long-context chunk of the tail is text the maps were not fitted on."""
    texts = kind_texts(kind, SELECTION)
    if kind == "c4":
        texts = texts[::-1]
    path = Path(path)
    path.write_text(_joined(texts, max_chars), encoding="utf-8")
    return path


def parse_selection_text(text: str) -> dict[str, float]:
    """--selection-text: 'mix', 'calibration' or KIND:WEIGHT,... (kinds: calibration, prose, code)."""
    if text in SELECTION_TEXTS:
        return dict(SELECTION_TEXTS[text])
    weights = {}
    for item in text.split(","):
        kind, _, weight = item.strip().partition(":")
        try:
            value = float(weight) if weight else 1.0
        except ValueError:
            value = -1.0
        if kind not in MIX_KINDS or kind in weights or not value >= 0:
            raise NblError(f"--selection-text {text!r}: use mix, calibration or KIND:WEIGHT,... with kinds "
                           f"{', '.join(MIX_KINDS)} each at most once and weights of zero or more")
        weights[kind] = value
    if not sum(weights.values()) > 0:
        raise NblError(f"--selection-text {text!r}: the weights add up to nothing")
    return {kind: weights[kind] for kind in MIX_KINDS if kind in weights}  # the windows' order: calibration, prose, code


def mix_windows(weights: dict[str, float], total: int) -> dict[str, int]:
    """``total`` windows shared among the kinds in proportion to ``weights``: each kind its whole share,
    the rest one each to the largest remainders (ties to the earlier kind in ``weights``)."""
    scale = sum(weights.values())
    shares = {kind: total * weight / scale for kind, weight in weights.items()}
    counts = {kind: int(share) for kind, share in shares.items()}
    order = sorted(weights, key=lambda kind: -(shares[kind] - counts[kind]))  # stable: ties keep their order
    for kind in order[:total - sum(counts.values())]:
        counts[kind] += 1
    return counts


def bundled_selection_windows(tokenizer, counts: dict[str, int], seqlen: int):
    """(token windows [sum of counts, seqlen], {kind: {windows, documents, sha256}}) of the selection
    parts of bundled kinds, each kind's windows cut from its own documents, in the order of ``counts``."""
    import torch

    parts, report = [], {}
    for kind, count in counts.items():
        if not count:
            continue
        data = build_windows(tokenizer, kind_texts(kind, SELECTION), count, seqlen, name=f"bundled {kind} text")
        if data.nsamples < count:
            raise NblError(f"the bundled {KINDS[kind].label} held out for layer selection gives {data.nsamples} "
                           f"windows of {seqlen} tokens, fewer than the {count} that --selection-text asks of it "
                           f"(use fewer --selection-windows, a shorter --seqlen or another --selection-text)")
        parts.append(data.input_ids)
        report[kind] = {"windows": count, "documents": data.documents, "sha256": data.sha256}
    ids = torch.cat(parts) if parts else torch.empty(0, seqlen, dtype=torch.long)
    return ids, report


def bundled_windows_after(tokenizer, kind: str, skip: int, seqlen: int, piece: int):
    """The windows [n, seqlen] of a bundled kind's selection part after its first ``skip`` (those that
    bundled_selection_windows gives the held-out windows): as many as the rest of its text holds. Where no
    whole window is left (a --seqlen near the part's length or beyond it: Qwen2.5's 32K context, a part of
    about 16K tokens), the rest as one window of as many whole ``piece``s (the training pieces' length) as it
    holds, so that a long --seqlen still trains on each kind."""
    import torch

    label = f"bundled {kind} text"
    stream, _, _ = _token_stream(tokenizer, kind_texts(kind, SELECTION), 1 << 62, label)  # every document
    rest = stream[skip * seqlen:]
    whole = len(rest) // seqlen
    if whole:
        return torch.tensor(rest[:whole * seqlen], dtype=torch.long).view(whole, seqlen)
    usable = len(rest) // piece * piece
    if not usable:
        raise NblError(f"the bundled {KINDS[kind].label} held out for selection has {len(rest)} tokens after the "
                       f"{skip} held-out windows of {seqlen} tokens, fewer than one training piece of {piece}: "
                       f"none is left to train on (a shorter --refine-seqlen, or --refine-text calibration)")
    return torch.tensor(rest[:usable], dtype=torch.long).view(1, usable)


def _as_text(item, where: str, field: str) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and isinstance(item.get(field), str):
        return item[field]
    raise NblError(f"{where}: expected strings or objects with a '{field}' string, got {type(item).__name__}")


def _texts_from_json(data, where: str, field: str) -> list[str]:
    if isinstance(data, dict) and isinstance(data.get(field), list):
        data = data[field]
    if not isinstance(data, list):
        raise NblError(f"{where}: expected a JSON list of strings or of {{\"{field}\": ...}} objects")
    return [_as_text(item, where, field) for item in data]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise NblError(f"{path} is not UTF-8 text (byte {error.start}: {error.reason})") from None


def _file_texts(path: Path, field: str) -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix == ".txt":
        # Blank lines separate documents; a file without any is one document.
        text = _read_text(path)
        yield from (doc.strip() for doc in text.split("\n\n") if doc.strip())
    elif suffix == ".json":
        try:
            data = json.loads(_read_text(path))
        except json.JSONDecodeError as error:
            raise NblError(f"{path}: not valid JSON ({error})") from error
        yield from _texts_from_json(data, str(path), field)
    elif suffix == ".jsonl":
        number = 0
        with path.open(encoding="utf-8") as handle:  # streamed: only the documents needed are read
            try:
                for number, line in enumerate(handle, 1):
                    if line.strip():
                        try:
                            yield _as_text(json.loads(line), f"{path}:{number}", field)
                        except json.JSONDecodeError as error:
                            raise NblError(f"{path}:{number}: not valid JSON ({error})") from error
            except UnicodeDecodeError as error:
                raise NblError(f"{path} is not UTF-8 text (after line {number}: {error.reason})") from None
    elif suffix == ".parquet":
        import pyarrow
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except pyarrow.ArrowException as error:
            raise NblError(f"{path}: not a readable Parquet file ({error})") from error
        if field not in table.column_names:
            raise NblError(f"{path}: no '{field}' column (columns: {', '.join(table.column_names)})")
        yield from (text for text in table.column(field).to_pylist() if isinstance(text, str))
    else:
        raise NblError(f"{path}: unsupported file type '{suffix}' (use .txt, .json, .jsonl or .parquet)")


def _hub_texts(name: str, config: str | None, split: str, field: str) -> Iterator[str]:
    import datasets

    try:
        dataset = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as error:  # datasets raises many unrelated types for "not found / offline"
        raise NblError(f"cannot load dataset '{name}' from the hub: {error}") from error
    for row in dataset:
        yield _as_text(row, name, field)


def iter_texts(dataset: str | None = None, *, config: str | None = None, split: str = "train",
               field: str = "text") -> Iterator[str]:
    """Documents of a local file, a `datasets` hub name, or (None) the bundled calibration slice."""
    if dataset in (None, "", DEFAULT_DATASET):
        return iter(_bundled_texts()[:CALIBRATION_DOCS])
    path = Path(dataset)
    if path.exists():
        if path.is_dir():
            raise NblError(f"{dataset} is a directory; pass a .txt, .json, .jsonl or .parquet file")
        return _file_texts(path, field)
    if path.suffix.lower() in FILE_SUFFIXES:
        raise NblError(f"dataset file {dataset} does not exist")
    return _hub_texts(dataset, config, split, field)


@dataclass
class CalibrationData:
    input_ids: object  # torch.LongTensor [nsamples, seqlen]
    requested_samples: int
    seqlen: int
    documents: int
    sha256: str  # of the consumed documents, so a report pins its exact text

    @property
    def nsamples(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def tokens(self) -> int:
        return self.nsamples * self.seqlen

    def split_last(self, count: int):
        """(these data without their last ``count`` windows, those windows): a held-out slice of the same text."""
        import dataclasses

        return dataclasses.replace(self, input_ids=self.input_ids[:-count]), self.input_ids[-count:]


def effective_seqlen(seqlen: int, max_positions: int | None) -> int:
    if seqlen < 1:
        raise NblError(f"--seqlen must be positive, got {seqlen}")
    return min(seqlen, max_positions) if max_positions else seqlen


def _token_stream(tokenizer, texts: Iterable[str], needed: int, name: str) -> tuple[list[int], int, str]:
    """(the documents' tokens joined with EOS between them, how many documents, their sha256), read until
    ``needed`` tokens or the texts' end."""
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    digest = hashlib.sha256()
    documents = 0
    for text in texts:
        if not text:
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            continue
        digest.update(text.encode("utf-8") + b"\0")
        if stream and eos is not None:
            stream.append(eos)
        stream.extend(ids)
        documents += 1
        if len(stream) >= needed:
            break
    if documents == 0:
        raise NblError(f"{name} contains no text")
    return stream, documents, digest.hexdigest()


def build_windows(tokenizer, texts: Iterable[str], nsamples: int, seqlen: int, *, name: str = "dataset") -> CalibrationData:
    """Join documents (EOS between them) and cut the stream into up to `nsamples` windows.

    A source with fewer tokens yields fewer windows (the caller reports it); one with less than a
    single window is an error.
    """
    import torch

    if nsamples < 1:
        raise NblError(f"--nsamples must be positive, got {nsamples}")
    stream, documents, digest = _token_stream(tokenizer, texts, nsamples * seqlen, name)
    windows = min(nsamples, len(stream) // seqlen)
    if windows == 0:
        raise NblError(f"{name} has only {len(stream)} tokens, fewer than one window of --seqlen {seqlen}; "
                       f"pass a smaller --seqlen or more text")
    ids = torch.tensor(stream[: windows * seqlen], dtype=torch.long).view(windows, seqlen)
    return CalibrationData(ids, nsamples, seqlen, documents, digest)


def load_calibration(tokenizer, dataset: str | None, nsamples: int, seqlen: int, *, config: str | None = None,
                     split: str = "train", field: str = "text", max_positions: int | None = None) -> CalibrationData:
    seqlen = effective_seqlen(seqlen, max_positions)
    name = dataset or DEFAULT_DATASET
    return build_windows(tokenizer, iter_texts(dataset, config=config, split=split, field=field), nsamples, seqlen,
                         name=name)


def check_fit_tokens(calib, hidden_size: int, taps: int) -> None:
    """The windows ``calib`` hold more tokens than a map fitted on them has inputs (else its covariance is singular)."""
    if calib.tokens <= hidden_size:
        raise NblError(f"only {calib.tokens} calibration tokens for hidden size {hidden_size}; need more than "
                       f"{hidden_size} (raise --nsamples/--seqlen or use more text)")
    stacked = taps * hidden_size  # a taps map's inputs: the token's and its taps - 1 predecessors'
    if taps > 1 and calib.tokens <= stacked:
        raise NblError(f"only {calib.tokens} calibration tokens for --taps {taps}, which stacks {taps} x "
                       f"{hidden_size} = {stacked} inputs a layer; need more than {stacked} (raise "
                       f"--nsamples/--seqlen, or use --taps 1)")


def load_windows(settings: Settings, stream, needs_heldout: bool, nsamples: int, fitting: bool = True):
    """(calibration windows, held-out windows or None, what the held-out windows are made of or None)
    for calibration.settings.Settings ``settings``, cut with the tokenizer of ``stream`` (a LayerStream).
    The held-out windows follow --selection-text: the calibration text's windows after the fit
    windows, then those of each bundled kind's selection part. ``fitting``: the windows will fit maps, so
    there must be more tokens than a map has inputs."""
    import torch

    from nbl_gguf import models
    from nbl_gguf.calibration.settings import DEFAULT_SELECTION_TOKENS

    counts = {}
    if needs_heldout:
        seqlen = effective_seqlen(settings.seqlen, models.max_context(stream.config))
        total = settings.selection_windows or -(-DEFAULT_SELECTION_TOKENS // seqlen)
        counts = mix_windows(parse_selection_text(settings.selection_text), total)
    held = counts.get(CALIBRATION_KIND, 0)
    calib = load_calibration(stream.tokenizer, settings.dataset, nsamples + held, settings.seqlen,
                                     config=settings.dataset_config, split=settings.split, field=settings.text_field,
                                     max_positions=models.max_context(stream.config))
    parts = []
    if held:
        if calib.nsamples <= held:
            asked = (f"--selection-windows {held}" if held == sum(counts.values()) else
                     f"{held} of --selection-windows {sum(counts.values())} (its share in --selection-text "
                     f"{settings.selection_text})")
            raise NblError(f"{settings.dataset or DEFAULT_DATASET} gives {calib.nsamples} windows of {calib.seqlen} "
                           f"tokens: too few to hold out {asked} for layer selection and still fit (use more text, a "
                           f"shorter --seqlen or fewer --selection-windows; or a fixed --m with --criterion cosine, "
                           f"which needs none)")
        calib, own = calib.split_last(held)
        parts.append(own)
    if calib.nsamples < nsamples:
        print(f"note: {settings.dataset or DEFAULT_DATASET} gives {calib.nsamples} windows of {calib.seqlen} tokens "
              f"for the fit, fewer than the {nsamples} requested; calibrating on {calib.tokens} tokens", file=sys.stderr)
    if fitting:
        check_fit_tokens(calib, stream.hidden_size, settings.taps)
    if not counts:
        return calib, None, None
    bundled, kinds = bundled_selection_windows(
        stream.tokenizer, {kind: n for kind, n in counts.items() if kind != CALIBRATION_KIND}, calib.seqlen)
    if bundled.shape[0]:
        parts.append(bundled)
    composition = {"selection_text": settings.selection_text,
                   "windows": {kind: n for kind, n in counts.items() if n},
                   "calibration_text": settings.dataset or DEFAULT_DATASET, "bundled": kinds}
    return calib, torch.cat(parts), composition
