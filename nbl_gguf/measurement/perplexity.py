"""HellaSwag, Winogrande and multiple-choice accuracy of one GGUF through the patched ``llama-perplexity``
(perplexity itself: nbl_gguf.llamacpp.perplexity); evaluate gives all of them as plain data,
format_results the table `eval` prints."""

from __future__ import annotations

import math
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nbl_gguf.errors import NblError
# the perplexity runner lives with the llama.cpp runtime (convert measures its files with it too)
from nbl_gguf.llamacpp.perplexity import (DEFAULT_CTX, FLOAT as _FLOAT, IncompleteOutput, Perplexity, perplexity,
                                          run_perplexity_tool, tool_errors)
from nbl_gguf.measurement.tasks import TASKS, check_hellaswag, check_multiple_choice, prepare_winogrande


# --- results -------------------------------------------------------------------------------------

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

_HS_LINE = re.compile(r"^(\d+)\t" + _FLOAT + r"%\t\[" + _FLOAT + r"%, " + _FLOAT + r"%\]\s*$", re.M)
_HS_COUNT = re.compile(r"hellaswag_score : selecting (\d+)")
_WG_LINE = re.compile(r"^(\d+)\t" + _FLOAT + r"\t\s*" + _FLOAT + r"\s+" + _FLOAT + r"\s+([12])\s+([12])\s*$", re.M)
_WG_FINAL = re.compile(r"Final Winogrande score\((\d+) tasks\): " + _FLOAT + r" \+/- " + _FLOAT)
_WG_COUNT = re.compile(r"winogrande_score : (?:loaded|selecting) (\d+)")
_MC_LINE = re.compile(r"^(\d+)\t" + _FLOAT + r"\s*$", re.M)
_MC_FINAL = re.compile(r"Final result: " + _FLOAT + r" \+/- " + _FLOAT)
_MC_COUNT = re.compile(r"calculating TruthfulQA score over (\d+) tasks")


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


# --- running llama-perplexity ---------------------------------------------------------------------

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


def evaluate(model, *, text_file=None, n_ctx=DEFAULT_CTX, chunks=None, batch=None, threads=None,
             task_files: dict | None = None, cache_type: str = "f16") -> dict:
    """Perplexity (if ``text_file``, with a ``cache_type`` KV cache) and each task's accuracy of one GGUF, as
    plain data."""
    result: dict = {"model": str(model)}
    if text_file is not None:
        result["perplexity"] = asdict(perplexity(model, text_file, n_ctx=n_ctx, chunks=chunks, batch=batch,
                                                 threads=threads, cache_type=cache_type))
        result["perplexity"]["tokens"] = Perplexity(**result["perplexity"]).tokens
    for task, (path, tasks) in (task_files or {}).items():
        acc = TASK_RUNNERS[task](model, path, n_ctx=n_ctx, tasks=tasks, threads=threads)
        result[task] = {"accuracy": acc.accuracy, "tasks": acc.tasks, "stderr": acc.stderr,
                        "ci95": list(acc.interval), "printed_ci": acc.ci95 is not None}
    return result


def format_results(results: list[dict]) -> str:
    """evaluate()'s results of several GGUFs as a markdown table."""
    from nbl_gguf.measurement.passkey import found_of_asked

    tasks = [t for t in TASKS if any(t in r for r in results)]
    lengths = sorted({int(n) for r in results for n in (r.get("passkey") or {}).get("accuracy", {})})
    header = ["model"] + (["PPL"] if any("perplexity" in r for r in results) else []) + tasks
    header += [f"passkey @{n}" for n in lengths]
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
        for n in lengths:
            trials = [t for t in (r.get("passkey") or {}).get("trials", []) if t["n_ctx"] == n]
            row.append(found_of_asked([t["found"] for t in trials]) if trials else "")
        rows.append(row)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
