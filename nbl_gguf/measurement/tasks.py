"""The task files of llama-perplexity: reading, checking and writing them as the tool reads them.

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

import os
import re
import struct
import tempfile
from pathlib import Path
from typing import Sequence

from nbl_gguf.errors import NblError


TASKS = ("hellaswag", "winogrande", "multiple-choice")


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


TASKS = ("hellaswag", "winogrande", "multiple-choice")


def check_task_files(requested: dict[str, tuple[str | None, int | None]]) -> dict[str, tuple[Path, int | None]]:
    """{task: (its file, how many of its tasks)} for the tasks of TASKS given a file in ``requested``
    ({task: (file or None, count or None)}), each file checked before any model runs."""
    unknown = set(requested) - set(TASKS)
    if unknown:
        raise ValueError(f"unknown tasks {sorted(unknown)}: the tasks are {', '.join(TASKS)}")
    files = {}
    for task in TASKS:
        value, count = requested.get(task, (None, None))
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
            files[task] = (path, count)
    return files
