"""`eval`: perplexity and multiple-choice accuracy of GGUFs through the patched ``llama-perplexity``.

    python -m nbl_gguf eval A.gguf B.gguf [--text FILE] [--hellaswag F] [--winogrande F] [--multiple-choice F]
    python -m nbl_gguf eval --sweep --m 2 4 8 12 --quant q8_0 q4_k_m --out docs/results

The first form evaluates the given GGUFs; the sweep builds baseline / Attn NBL-m / Attn DROP-m GGUFs
from one calibration artifact, evaluates them, evaluates the same configurations (and Block NBL-m)
in PyTorch float32 with llama-perplexity's chunking, benchmarks speed with llama-bench, and writes
a markdown table, a CSV and a plot (nbl_gguf/sweep.py).

File formats are llama-perplexity's own (tools/perplexity/perplexity.cpp):

* perplexity: plain text; split into ``n_ctx`` token chunks (BOS first when the vocab adds one),
  the second half of each chunk is scored (tokens ``n_ctx/2 + 1 .. n_ctx - 1``).
* ``--hellaswag``: 6 lines per task: context, gold ending index (0-3), 4 endings. The score of an
  ending is the mean log-probability of its tokens after the common prefix of the 4 sequences
  ``context + " " + ending``; the highest wins (acc_norm). Reported with a 95% Wilson interval.
* ``--winogrande``: CSV rows ``index,sentence with _,choice1,choice2,answer(1|2)``; the sentence with
  each choice in place of ``_`` is scored on the tokens after the choice (all but the last).
  Reported with a standard error.
* ``--multiple-choice``: binary (see :func:`write_multiple_choice`); ``question + " " + answer``
  scored like HellaSwag; reported with a standard error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import struct
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from nbl_gguf.errors import NblError

DEFAULT_CTX = 512
TASKS = ("hellaswag", "winogrande", "multiple-choice")


# --- results -------------------------------------------------------------------------------------

@dataclass
class Perplexity:
    ppl: float
    error: float  # llama-perplexity's "+/-": ppl * standard error of the mean token NLL
    chunks: int
    n_ctx: int

    @property
    def tokens(self) -> int:
        """Scored tokens: n_ctx - n_ctx/2 - 1 per chunk."""
        return self.chunks * (self.n_ctx - self.n_ctx // 2 - 1)


@dataclass
class Accuracy:
    task: str  # hellaswag | winogrande | multiple-choice
    accuracy: float  # percent
    tasks: int
    stderr: float | None = None  # percent, as printed (winogrande, multiple-choice)
    ci95: tuple[float, float] | None = None  # percent, Wilson interval as printed (hellaswag)
    per_task: list = field(default_factory=list, repr=False)

    @property
    def interval(self) -> tuple[float, float]:
        """95% interval in percent: the printed Wilson interval, else accuracy +/- 1.96 stderr."""
        if self.ci95 is not None:
            return self.ci95
        half = 1.96 * (self.stderr or 0.0) if self.stderr == self.stderr else 0.0  # nan for one task
        return max(0.0, self.accuracy - half), min(100.0, self.accuracy + half)

    def format(self) -> str:
        if self.ci95 is not None:
            return f"{self.accuracy:.2f} [{self.ci95[0]:.2f}, {self.ci95[1]:.2f}]"
        return f"{self.accuracy:.2f} ± {self.stderr:.2f}" if self.stderr is not None else f"{self.accuracy:.2f}"


# --- parsing llama-perplexity's output ----------------------------------------------------------

_FLOAT = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|-?inf)"
_PPL_FINAL = re.compile(r"Final estimate: PPL = " + _FLOAT + r" \+/- " + _FLOAT)
_PPL_SETUP = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)")
# --ppl-output-type 1: "%8d  %.4lf  %4lf  %4lf" = position, running PPL, mean NLL, its standard error
_PPL_CHUNK = re.compile(r"^\s*(\d+)\s+" + _FLOAT + r"\s+" + _FLOAT + r"\s+" + _FLOAT + r"\s*$", re.M)
_HS_LINE = re.compile(r"^(\d+)\t" + _FLOAT + r"%\t\[" + _FLOAT + r"%, " + _FLOAT + r"%\]\s*$", re.M)
_HS_COUNT = re.compile(r"hellaswag_score : selecting (\d+)")
_WG_LINE = re.compile(r"^(\d+)\t" + _FLOAT + r"\t\s*" + _FLOAT + r"\s+" + _FLOAT + r"\s+([12])\s+([12])\s*$", re.M)
_WG_FINAL = re.compile(r"Final Winogrande score\((\d+) tasks\): " + _FLOAT + r" \+/- " + _FLOAT)
_WG_COUNT = re.compile(r"winogrande_score : (?:loaded|selecting) (\d+)")
_MC_LINE = re.compile(r"^(\d+)\t" + _FLOAT + r"\s*$", re.M)
_MC_FINAL = re.compile(r"Final result: " + _FLOAT + r" \+/- " + _FLOAT)
_MC_COUNT = re.compile(r"calculating TruthfulQA score over (\d+) tasks")
# LOG_ERR lines, with or without the "M.s.ms.us E " prefix
_ERROR_LINE = re.compile(r"^(?:[\d.]+ )?E (.+)$", re.M)


class IncompleteOutput(NblError):
    """llama-perplexity ended without printing all of its results."""


def tool_errors(output: str) -> list[str]:
    return [m.group(1).strip() for m in _ERROR_LINE.finditer(output)]


def parse_perplexity(output: str) -> Perplexity:
    setup = _PPL_SETUP.search(output)
    if setup is None:
        errors = tool_errors(output)
        raise NblError("llama-perplexity computed no perplexity" + (": " + " | ".join(errors) if errors else ""))
    chunks, n_ctx = int(setup.group(1)), int(setup.group(2))
    final = _PPL_FINAL.search(output)
    if final:
        return Perplexity(float(final.group(1)), float(final.group(2)), chunks, n_ctx)
    # the running line after the last chunk carries the same numbers (with --ppl-output-type 1)
    lines = _PPL_CHUNK.findall(output)
    if len(lines) >= chunks:
        _, ppl, _, stderr = lines[chunks - 1]
        return Perplexity(float(ppl), float(ppl) * float(stderr), chunks, n_ctx)
    raise IncompleteOutput(f"llama-perplexity stopped after {len(lines)} of {chunks} chunks without a final estimate")


def _wilson(correct: int, n: int) -> tuple[float, float]:
    """perplexity.cpp's Wilson score interval (z = 1.95996398454), in percent."""
    za = 1.95996398454
    freq = correct / n
    z = za * za / n
    cnf = z * math.sqrt(n * (4.0 * freq * (1 - freq) + z)) / (za + za)
    return 100 * (freq + z * 0.5 - cnf) / (1.0 + z), 100 * (freq + z * 0.5 + cnf) / (1.0 + z)


def _stderr(p: float, n: int) -> float:
    """perplexity.cpp's sqrt(p (1 - p) / (n - 1)), in percent (nan for a single task)."""
    return 100 * math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else float("nan")


def parse_hellaswag(output: str) -> Accuracy:
    lines = _HS_LINE.findall(output)
    count = _HS_COUNT.search(output)
    expected = int(count.group(1)) if count else None
    errors = tool_errors(output)
    if errors and (not lines or expected is None or len(lines) != expected):
        raise NblError("llama-perplexity --hellaswag failed: " + " | ".join(errors))
    if not lines:
        if errors:
            raise NblError("llama-perplexity --hellaswag failed: " + " | ".join(errors))
        raise IncompleteOutput("llama-perplexity --hellaswag printed no task results")
    n, acc, lo, hi = lines[-1]
    if expected is not None and int(n) != expected:
        raise IncompleteOutput(f"llama-perplexity --hellaswag stopped after {n} of {expected} tasks")
    per_task = [float(a) for _, a, _, _ in lines]
    return Accuracy("hellaswag", float(acc), int(n), ci95=(float(lo), float(hi)), per_task=per_task)


def parse_winogrande(output: str) -> Accuracy:
    lines = _WG_LINE.findall(output)
    count = _WG_COUNT.findall(output)
    expected = int(count[-1]) if count else None
    errors = [e for e in tool_errors(output) if "load_winogrande_from_csv" not in e]  # skipped rows
    if errors and (not lines or expected is None or len(lines) != expected):
        raise NblError("llama-perplexity --winogrande failed: " + " | ".join(errors))
    if not lines:
        errors = tool_errors(output)
        if errors:
            raise NblError("llama-perplexity --winogrande failed: " + " | ".join(errors))
        raise IncompleteOutput("llama-perplexity --winogrande printed no task results")
    if expected is not None and len(lines) != expected:
        raise IncompleteOutput(f"llama-perplexity --winogrande stopped after {len(lines)} of {expected} tasks")
    per_task = [(float(s1), float(s2), int(r), int(a)) for _, _, s1, s2, r, a in lines]
    n = len(per_task)
    correct = sum(r == a for _, _, r, a in per_task)
    final = _WG_FINAL.search(output)
    if final:  # printed only for 100 tasks or more
        return Accuracy("winogrande", float(final.group(2)), int(final.group(1)), stderr=float(final.group(3)),
                        per_task=per_task)
    return Accuracy("winogrande", 100.0 * correct / n, n, stderr=_stderr(correct / n, n), per_task=per_task)


def parse_multiple_choice(output: str) -> Accuracy:
    lines = _MC_LINE.findall(output)
    count = _MC_COUNT.search(output)
    if count is None:
        errors = tool_errors(output)
        raise NblError("llama-perplexity --multiple-choice failed: "
                       + (" | ".join(errors) if errors else "it scored no tasks"))
    expected = int(count.group(1))
    # the header "task\tacc_norm" is not matched; task lines are "n\tpercent"
    lines = [(int(n), float(a)) for n, a in lines]
    errors = tool_errors(output)
    if len(lines) != expected and errors:
        raise NblError("llama-perplexity --multiple-choice failed: " + " | ".join(errors))
    if len(lines) != expected:
        raise IncompleteOutput(f"llama-perplexity --multiple-choice stopped after {len(lines)} of {expected} tasks")
    n, acc = lines[-1]
    correct = round(acc * n / 100)
    per_task = [a for _, a in lines]
    final = _MC_FINAL.search(output)
    if final:
        return Accuracy("multiple-choice", float(final.group(1)), n, stderr=float(final.group(2)), per_task=per_task)
    return Accuracy("multiple-choice", 100.0 * correct / n, n, stderr=_stderr(correct / n, n), per_task=per_task)


# --- input files ---------------------------------------------------------------------------------

def _read_prompt(path: Path, binary: bool = False):
    """The file as llama.cpp's ``-f`` reads it: whole, with one trailing newline removed."""
    if not path.exists():
        raise NblError(f"{path} does not exist")
    if path.is_dir():
        raise NblError(f"{path} is a directory, not a task file")
    data = path.read_bytes()
    if data.endswith(b"\n"):
        data = data[:-1]
    if binary:
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise NblError(f"{path} is not UTF-8 text ({error})") from error


def check_text(path: Path, n_ctx: int) -> None:
    text = _read_prompt(path)
    if not text.strip():
        raise NblError(f"{path} is empty: perplexity needs text")


def check_hellaswag(path: Path) -> int:
    """Number of tasks; NblError for a file llama-perplexity would reject or misread."""
    lines = _read_prompt(path).split("\n")
    if lines == [""]:
        raise NblError(f"{path} is empty: a HellaSwag file has 6 lines per task")
    if len(lines) % 6:
        raise NblError(f"{path}: {len(lines)} lines, not a multiple of 6 (HellaSwag: context, gold index, "
                       f"4 endings per task)")
    for task in range(len(lines) // 6):
        label = lines[6 * task + 1].strip()
        if not label.isdigit() or not 0 <= int(label) <= 3:
            raise NblError(f"{path}:{6 * task + 2}: task {task + 1}: the gold ending index must be 0-3, got {label!r}")
    return len(lines) // 6


def winogrande_rows(text: str) -> tuple[list[dict], list[str]]:
    """perplexity.cpp's CSV reader (rows it skips come back as messages); the last line is read only
    when followed by a newline, as in llama.cpp, which stops at end of file."""
    rows, skipped = [], []
    lines = text.split("\n")
    complete = lines[:-1]  # getline() hitting EOF ends the loop before the last, unterminated line
    for number, line in enumerate(complete, 1):
        commas, quote = [], False
        for i, ch in enumerate(line):
            if not quote:
                if ch == ",":
                    commas.append(i)
                    if len(commas) == 4:
                        break
                elif ch == '"':
                    quote = True
            elif ch == '"':
                quote = False
        if len(commas) != 4:
            skipped.append(f"line {number}: fewer than 4 commas")
            continue
        c0, c1, c2, c3 = commas
        sentence = line[c0 + 2:c1 - 1] if line[c0 + 1:c0 + 2] == '"' else line[c0 + 1:c1]
        answer = line[c3 + 1:].strip()
        if "_" not in sentence:
            skipped.append(f"line {number}: no _ in the sentence")
            continue
        match = re.match(r"[+-]?\d+", answer)
        if not match or int(match.group()) not in (1, 2):
            skipped.append(f"line {number}: answer {answer!r} is not 1 or 2")
            continue
        where = sentence.index("_")
        rows.append({"first": sentence[:where], "second": sentence[where + 1:],
                     "choices": (line[c1 + 1:c2], line[c2 + 1:c3]), "answer": int(match.group())})
    return rows, skipped


def prepare_winogrande(path: Path, directory: Path) -> tuple[Path, int, list[str]]:
    """A copy of the CSV that llama-perplexity reads to the last row (it drops an unterminated or
    newline-terminated last line: ``-f`` strips one newline and the reader stops at EOF)."""
    text = _read_prompt(path)
    if not text.strip():
        raise NblError(f"{path} is empty: a Winogrande CSV has rows index,sentence,choice1,choice2,answer")
    text = text.rstrip("\n") + "\n"
    rows, skipped = winogrande_rows(text)
    if not rows:
        raise NblError(f"{path}: no valid Winogrande rows (index,sentence with _,choice1,choice2,answer 1|2); "
                       + "; ".join(skipped[:3]))
    copy = directory / "winogrande.csv"
    copy.write_bytes(text.encode("utf-8") + b"\n")  # -f strips one newline; the other ends the last row
    return copy, len(rows), skipped


# binary multiple-choice format (perplexity.cpp multiple_choice_score):
#   uint32 n_task; uint32 offset[n_task] (byte offset of each task from the start of the file);
#   per task: string question; mc1 = answers; mc2 = answers (not scored)
#   answers: uint32 n (<= 100); n strings; int32 labels[n] (1 = correct)
#   string: uint32 length; bytes (UTF-8)

def _string(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<I", len(data)) + data


def serialize_multiple_choice(tasks: Sequence[dict]) -> bytes:
    """tasks: {"question", "answers", "labels"[, "mc2_answers", "mc2_labels"]} -> the binary file."""
    if not tasks:
        raise NblError("no multiple-choice tasks to write")
    blobs = []
    for number, task in enumerate(tasks, 1):
        answers, labels = list(task["answers"]), [int(x) for x in task["labels"]]
        mc2_answers, mc2_labels = list(task.get("mc2_answers", [])), [int(x) for x in task.get("mc2_labels", [])]
        if len(answers) != len(labels) or len(mc2_answers) != len(mc2_labels):
            raise NblError(f"task {number}: answers and labels differ in number")
        if len(answers) > 100 or len(mc2_answers) > 100:
            raise NblError(f"task {number}: more than 100 answers")
        blob = _string(task["question"])
        for group, group_labels in ((answers, labels), (mc2_answers, mc2_labels)):
            blob += struct.pack("<I", len(group)) + b"".join(_string(a) for a in group)
            blob += struct.pack(f"<{len(group_labels)}i", *group_labels)
        blobs.append(blob)
    offset = 4 + 4 * len(blobs)
    positions = []
    for blob in blobs:
        positions.append(offset)
        offset += len(blob)
    return struct.pack(f"<I{len(blobs)}I", len(blobs), *positions) + b"".join(blobs)


def write_multiple_choice(path: str | os.PathLike, tasks: Sequence[dict]) -> Path:
    path = Path(path)
    path.write_bytes(serialize_multiple_choice(tasks))
    return path


def read_multiple_choice(data: bytes, where: str = "multiple-choice file") -> list[dict]:
    """Parse the binary format as perplexity.cpp does (after ``-f`` removed a trailing newline byte)."""
    def fail(message):
        raise NblError(f"{where}: {message} (not llama-perplexity's binary multiple-choice format)")

    def u32(offset):
        if offset + 4 > len(data):
            fail(f"truncated at byte {offset}")
        return struct.unpack_from("<I", data, offset)[0], offset + 4

    def string(offset):
        size, offset = u32(offset)
        if offset + size > len(data):
            fail(f"a string of {size} bytes at byte {offset} runs past the end")
        try:
            return data[offset:offset + size].decode("utf-8"), offset + size
        except UnicodeDecodeError:
            fail(f"the string at byte {offset} is not UTF-8")

    def answers(offset):
        n, offset = u32(offset)
        if n > 100:
            fail(f"{n} answers at byte {offset - 4} (at most 100)")
        texts = []
        for _ in range(n):
            text, offset = string(offset)
            texts.append(text)
        if offset + 4 * n > len(data):
            fail(f"labels truncated at byte {offset}")
        labels = list(struct.unpack_from(f"<{n}i", data, offset))
        return texts, labels, offset + 4 * n

    n_task, offset = u32(0)
    if n_task == 0:
        fail("no tasks")
    if 4 + 4 * n_task > len(data):
        fail(f"{n_task} task offsets do not fit in {len(data)} bytes")
    tasks = []
    offset = 4 + 4 * n_task
    for number in range(n_task):
        question, offset = string(offset)
        mc1, labels, offset = answers(offset)
        mc2, labels2, offset = answers(offset)
        if not question or not mc1 or any(not a for a in mc1):
            fail(f"task {number + 1} has an empty question or answer")
        tasks.append({"question": question, "answers": mc1, "labels": labels,
                      "mc2_answers": mc2, "mc2_labels": labels2})
    return tasks


def check_multiple_choice(path: Path) -> tuple[int, int]:
    """(tasks, the largest number of answers of a task)."""
    tasks = read_multiple_choice(_read_prompt(path, binary=True), str(path))
    return len(tasks), max(len(t["answers"]) for t in tasks)


# --- running llama-perplexity ---------------------------------------------------------------------

def run_perplexity_tool(model: str | os.PathLike, args: Sequence[str], parse, *, threads: int | None = None, cwd=None):
    """Run llama-perplexity on ``model`` and parse its output (IncompleteOutput if results are missing)."""
    from nbl_gguf.llamacpp.tools import tool

    binary = tool("llama-perplexity")
    model = Path(model)
    if not model.is_file():
        raise NblError(f"{model} does not exist")
    command = [str(binary), "-m", str(model), *map(str, args)]
    if threads:
        command += ["-t", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=cwd, errors="replace")
    output = done.stdout + "\n" + done.stderr
    if done.returncode != 0:
        errors = tool_errors(output) or output.strip().splitlines()[-5:]
        raise NblError(f"llama-perplexity failed on {model.name} (exit {done.returncode}): " + " | ".join(errors))
    try:
        return parse(output)
    except IncompleteOutput as error:
        raise IncompleteOutput(f"{error} ({model.name})") from None


def perplexity(model, text_file, *, n_ctx: int = DEFAULT_CTX, chunks: int | None = None, batch: int | None = None,
               threads: int | None = None) -> Perplexity:
    args = ["-f", str(text_file), "-c", str(n_ctx), "--ppl-output-type", "1"]
    if chunks:
        args += ["--chunks", str(chunks)]
    if batch:
        args += ["-b", str(batch)]
    return run_perplexity_tool(model, args, parse_perplexity, threads=threads)


def hellaswag(model, path, *, n_ctx: int = DEFAULT_CTX, tasks: int | None = None, threads=None) -> Accuracy:
    path = Path(path)
    available = check_hellaswag(path)
    args = ["-f", str(path), "--hellaswag", "-c", str(n_ctx), "--hellaswag-tasks", str(tasks or available)]
    return run_perplexity_tool(model, args, parse_hellaswag, threads=threads)


def winogrande(model, path, *, n_ctx: int = DEFAULT_CTX, tasks: int | None = None, threads=None) -> Accuracy:
    with tempfile.TemporaryDirectory(prefix="nbl-eval-") as tmp:
        copy, _, _ = prepare_winogrande(Path(path), Path(tmp))
        args = ["-f", str(copy), "--winogrande", "-c", str(n_ctx)]
        if tasks:
            args += ["--winogrande-tasks", str(tasks)]
        return run_perplexity_tool(model, args, parse_winogrande, threads=threads)


def multiple_choice(model, path, *, n_ctx: int = DEFAULT_CTX, tasks: int | None = None, threads=None) -> Accuracy:
    path = Path(path)
    _, answers = check_multiple_choice(path)
    # each answer is a sequence of its own: a task with more than 4 answers needs more parallel sequences
    args = ["-f", str(path), "--multiple-choice", "-c", str(n_ctx), "-np", str(max(4, answers))]
    if tasks:
        args += ["--multiple-choice-tasks", str(tasks)]
    return run_perplexity_tool(model, args, parse_multiple_choice, threads=threads)


TASK_RUNNERS = {"hellaswag": hellaswag, "winogrande": winogrande, "multiple-choice": multiple_choice}


# --- text ----------------------------------------------------------------------------------------

def heldout_text() -> str:
    """The held-out documents of the bundled C4 sample, blank-line separated (the default text)."""
    from nbl_gguf.calibration.dataset import heldout_texts

    return "\n\n".join(text.strip() for text in heldout_texts() if text.strip()) + "\n"


def write_heldout_text(path: str | os.PathLike) -> Path:
    path = Path(path)
    path.write_text(heldout_text(), encoding="utf-8")
    return path


def prompt_text(path: str | os.PathLike) -> str:
    """What llama-perplexity tokenizes for ``-f path`` (one trailing newline removed)."""
    return _read_prompt(Path(path))


# --- PyTorch perplexity with llama-perplexity's chunking -------------------------------------------

def chunked_nll(logprob_fn, tokens: Sequence[int], n_ctx: int, *, chunks: int | None = None,
                bos: int | None = None) -> Perplexity:
    """perplexity.cpp's perplexity(): chunk i is tokens[i n_ctx, (i+1) n_ctx) with its first token
    replaced by BOS when ``bos`` is given; positions first = n_ctx/2 .. n_ctx-2 predict the next token.

    logprob_fn(chunk) -> log-probabilities [n_ctx, n_vocab] (any array type with numpy conversion).
    """
    import numpy as np

    if n_ctx < 4:
        raise NblError(f"--ctx-size {n_ctx} is too small")
    if len(tokens) < 2 * n_ctx:
        raise NblError(f"the text tokenizes to {len(tokens)} tokens; perplexity with --ctx-size {n_ctx} "
                       f"needs at least {2 * n_ctx}")
    n_chunk = len(tokens) // n_ctx
    if chunks is not None and chunks >= 0:
        n_chunk = min(chunks, n_chunk)
    first = n_ctx // 2
    nll = nll2 = 0.0
    count = 0
    for i in range(n_chunk):
        chunk = list(tokens[i * n_ctx:(i + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        logprobs = np.asarray(logprob_fn(chunk), dtype=np.float64)
        targets = np.asarray(tokens[i * n_ctx + first + 1:(i + 1) * n_ctx])
        values = -logprobs[np.arange(first, n_ctx - 1), targets]
        nll += float(values.sum())
        nll2 += float((values * values).sum())
        count += len(values)
    mean = nll / count
    var = nll2 / count - mean * mean
    ppl = math.exp(mean)
    return Perplexity(ppl, ppl * math.sqrt(max(var, 0.0) / (count - 1)), n_chunk, n_ctx)


def llama_tokens(gguf_path, text: str) -> tuple[list[int], int | None]:
    """llama.cpp's tokenization of ``text`` by the GGUF's vocab, as llama-perplexity does it
    (common_tokenize with add_special), and the BOS id if the vocab adds one (else None)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf_path), vocab_only=True, verbose=False)
    try:
        with_special = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
        plain = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        bos = llm.token_bos() if len(with_special) > len(plain) else None
        return list(with_special), bos
    finally:
        llm.close()


def torch_perplexity(model, tokens: Sequence[int], n_ctx: int, *, chunks: int | None = None,
                     bos: int | None = None, progress: bool = False) -> Perplexity:
    import torch

    device = next(model.parameters()).device
    n_total = len(tokens) // n_ctx if chunks is None or chunks < 0 else min(chunks, len(tokens) // n_ctx)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n_total, desc="pytorch perplexity", unit="chunk", leave=False, file=sys.stderr)

    def logprobs(chunk):
        with torch.no_grad():
            ids = torch.tensor([chunk], dtype=torch.long, device=device)
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
        if bar is not None:
            bar.update()
        return torch.log_softmax(logits, dim=-1).double().cpu().numpy()

    try:
        return chunked_nll(logprobs, tokens, n_ctx, chunks=chunks, bos=bos)
    finally:
        if bar is not None:
            bar.close()


# --- command line ----------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("models", nargs="*", metavar="GGUF", help="GGUF files to evaluate (not with --sweep)")
    parser.add_argument("--text", default=None,
                        help="perplexity text file (default: the held-out part of the bundled C4 sample)")
    parser.add_argument("--no-ppl", action="store_true", help="skip perplexity")
    parser.add_argument("-c", "--ctx-size", type=int, default=DEFAULT_CTX,
                        help=f"llama-perplexity context: perplexity chunk size, and the context that "
                             f"multiple-choice tasks are packed into (default: {DEFAULT_CTX})")
    parser.add_argument("--chunks", type=int, default=None, help="perplexity chunks (default: all the text)")
    parser.add_argument("-b", "--batch-size", type=int, default=None, help="llama-perplexity batch size")
    parser.add_argument("-t", "--threads", type=int, default=None,
                        help="llama.cpp threads (and PyTorch threads in the sweep; default: the tools' own)")
    parser.add_argument("--hellaswag", default=None, metavar="FILE", help="HellaSwag file (llama.cpp text format)")
    parser.add_argument("--hellaswag-tasks", type=int, default=None, help="HellaSwag tasks (default: all)")
    parser.add_argument("--winogrande", default=None, metavar="FILE", help="Winogrande CSV (llama.cpp format)")
    parser.add_argument("--winogrande-tasks", type=int, default=None, help="Winogrande tasks (default: all)")
    parser.add_argument("--multiple-choice", default=None, metavar="FILE",
                        help="binary multiple-choice file (llama.cpp format: ARC, MMLU, TruthfulQA, ...)")
    parser.add_argument("--multiple-choice-tasks", type=int, default=None, help="tasks (default: all)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    sweep = parser.add_argument_group("sweep (--sweep)")
    sweep.add_argument("--sweep", action="store_true",
                       help="baseline, Attn NBL-m, Attn DROP-m (GGUF and PyTorch) and Block NBL-m (PyTorch) for each m")
    sweep.add_argument("--model", default=None, help="HF model (default: embedded SmolLM2-135M-Instruct)")
    sweep.add_argument("--calibration", default=None, metavar="ARTIFACT",
                       help="calibration artifact to use (default: calibrate once into the work dir)")
    sweep.add_argument("--nsamples", type=int, default=32, help="calibration windows when calibrating (default: 32)")
    sweep.add_argument("--seqlen", type=int, default=512, help="calibration window length (default: 512)")
    sweep.add_argument("--m", type=int, nargs="+", default=[2, 4, 8, 12], help="layers replaced (default: 2 4 8 12)")
    sweep.add_argument("--quant", nargs="+", default=["q8_0", "q4_k_m"], help="GGUF types (default: q8_0 q4_k_m)")
    sweep.add_argument("--methods", nargs="+", default=["attn-nbl", "attn-drop", "block-nbl"],
                       choices=["attn-nbl", "attn-drop", "block-nbl"], help="methods (default: all three)")
    sweep.add_argument("--criterion", default="cca", choices=["cca", "nmse", "cosine"],
                       help="layer selection of the main sweep (default: cca)")
    sweep.add_argument("--extra-criteria", nargs="*", default=["cosine"], choices=["cca", "nmse", "cosine"],
                       help="also run Attn NBL-m and Attn DROP-m with these criteria's layers (the published "
                            "attention-drop baseline selects by cosine; default: cosine; give none for no extra rows)")
    sweep.add_argument("--criteria-m", type=int, default=8,
                       help="compare the cca, nmse and cosine selections at this m (Attn NBL and Attn DROP, "
                            "first --quant; 0 = skip; default: 8)")
    sweep.add_argument("--no-pytorch", action="store_true", help="skip the PyTorch float32 evaluations")
    sweep.add_argument("--no-bench", action="store_true", help="skip the llama-bench speed measurement")
    sweep.add_argument("--bench-args", default="-p 128 -n 32 -r 2",
                       help="llama-bench arguments for the speed-up (default: '-p 128 -n 32 -r 2')")
    sweep.add_argument("--work", default="out/eval", help="GGUFs, calibration and cached results (default: out/eval)")
    sweep.add_argument("--out", default=None, help="where quality.md, quality.csv and quality.png go "
                                                   "(default: the work dir)")
    sweep.add_argument("--fresh", action="store_true", help="ignore cached results in the work dir")


def _task_files(args) -> dict[str, tuple[Path, int | None]]:
    files = {}
    for task, attr in (("hellaswag", "hellaswag"), ("winogrande", "winogrande"), ("multiple-choice", "multiple_choice")):
        value = getattr(args, attr)
        if value:
            path = Path(value)
            # fail on a bad file before any model runs
            if task == "hellaswag":
                check_hellaswag(path)
            elif task == "winogrande":
                with tempfile.TemporaryDirectory() as tmp:
                    prepare_winogrande(path, Path(tmp))
            else:
                check_multiple_choice(path)
            files[task] = (path, getattr(args, attr + "_tasks"))
    return files


def evaluate(model, *, text_file=None, n_ctx=DEFAULT_CTX, chunks=None, batch=None, threads=None,
             task_files: dict | None = None) -> dict:
    """Perplexity (if ``text_file``) and each task's accuracy of one GGUF, as plain data."""
    result: dict = {"model": str(model)}
    if text_file is not None:
        result["perplexity"] = asdict(perplexity(model, text_file, n_ctx=n_ctx, chunks=chunks, batch=batch,
                                                 threads=threads))
        result["perplexity"]["tokens"] = Perplexity(**result["perplexity"]).tokens
    for task, (path, tasks) in (task_files or {}).items():
        acc = TASK_RUNNERS[task](model, path, n_ctx=n_ctx, tasks=tasks, threads=threads)
        result[task] = {"accuracy": acc.accuracy, "tasks": acc.tasks, "stderr": acc.stderr,
                        "ci95": list(acc.interval), "printed_ci": acc.ci95 is not None}
    return result


def format_results(results: list[dict]) -> str:
    tasks = [t for t in TASKS if any(t in r for r in results)]
    header = ["model"] + (["PPL"] if any("perplexity" in r for r in results) else []) + tasks
    rows = []
    for r in results:
        row = [Path(r["model"]).name]
        if "PPL" in header:
            p = r.get("perplexity")
            row.append(f"{p['ppl']:.4f} ± {p['error']:.4f}" if p else "")
        for task in tasks:
            a = r.get(task)
            if not a:
                row.append("")
            elif a["printed_ci"]:
                row.append(f"{a['accuracy']:.2f} [{a['ci95'][0]:.2f}, {a['ci95'][1]:.2f}] (n={a['tasks']})")
            else:
                row.append(f"{a['accuracy']:.2f} ± {a['stderr']:.2f} (n={a['tasks']})")
        rows.append(row)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.ctx_size < 8:
        raise NblError(f"--ctx-size {args.ctx_size} is too small")
    if args.sweep:
        if args.models:
            raise NblError("--sweep builds its own GGUFs: pass no GGUF files with it")
        from nbl_gguf.measurement import sweep

        return sweep.run_sweep(args)
    if not args.models:
        raise NblError("no GGUF files given (or use --sweep)")
    for model in args.models:
        if not Path(model).is_file():
            raise NblError(f"{model} does not exist")
    task_files = _task_files(args)
    if args.no_ppl and not task_files:
        raise NblError("nothing to evaluate: --no-ppl and no task file")
    results = []
    with tempfile.TemporaryDirectory(prefix="nbl-eval-") as tmp:
        text_file = None
        if not args.no_ppl:
            if args.text:
                text_file = Path(args.text)
                check_text(text_file, args.ctx_size)
            else:
                text_file = write_heldout_text(Path(tmp) / "heldout.txt")
        for model in args.models:
            print(f"evaluating {model} ...", file=sys.stderr)
            results.append(evaluate(model, text_file=text_file, n_ctx=args.ctx_size, chunks=args.chunks,
                                    batch=args.batch_size, threads=args.threads, task_files=task_files))
    if text_file is not None and results:
        p = results[0]["perplexity"]
        print(f"perplexity: {p['chunks']} chunks of {p['n_ctx']} tokens, {p['tokens']} scored tokens "
              f"({'held-out C4' if not args.text else args.text})")
    print(format_results(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0
