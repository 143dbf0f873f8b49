"""Soak test: llama-server with an NBL GGUF on loopback, many concurrent greedy clients for minutes.

    python -m nbl_gguf soak                # the embedded SmolLM2, --m 4, q4_k_m, 5 minutes (the command: commands/soak.py)
    python -m nbl_gguf soak --model F.gguf --duration 30 -o out/soak.json

The patched build/bin/llama-server serves the GGUF on 127.0.0.1 with one slot per client
(--parallel), prompt caching (requests with cache_prompt) and KV-shifting cache reuse (--cache-reuse).
First one client sends every prompt once (the reference); then --clients threads send prompts in
their own shuffled orders for --duration seconds or --max-requests requests, whichever comes first.
Every request is greedy (temperature 0, top_k 1, a fixed seed, n_predict bounded), so every response
must equal the reference exactly: the text and the token ids. Where one differs, the summary gives
the reference's lead (top-1 minus top-2 log-probability) at the first differing token, against its
leads over all tokens: a numerically different evaluation flips near-ties only. The prompts mix
lengths (short, medium, long) and share prefixes (one document, several questions), so that slots
reuse cached prompts. The server's resident memory (VmRSS) is sampled every second: after the
warm-up it must stay flat. Extra llama-server options go through --server-arg (e.g. -ub 1).

The command writes the result as JSON (-o) and prints a summary; exits 1 when a request failed, a response
differed from the reference or the memory grew by more than --rss-tolerance-mib after the warm-up.
Results and what they mean: docs/results/soak.md.
"""

from __future__ import annotations

import json
import platform
import random
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nbl_gguf.calibration.dataset import heldout_texts
from nbl_gguf.errors import NblError
from nbl_gguf.llamacpp.tools import tool

DEFAULT_MODEL = Path("out") / "soak" / "SmolLM2-135M-Instruct-nbl-m4-q4_k_m.gguf"  # under the working folder
# a short calibration: which 4 layers, and how well fitted, matters to quality, not to a soak
CONVERT_DEFAULT = ["--m", "4", "--quant", "q4_k_m", "--nsamples", "8", "--seqlen", "512", "--criterion", "cosine",
                   "--no-eval", "--no-progress"]


@dataclass(frozen=True)
class SoakSettings:
    """The soak's load and the server's options (`python -m nbl_gguf soak`'s flags under the same names)."""

    duration: float = 300.0  # seconds of concurrent load
    clients: int = 8  # concurrent clients and server slots
    max_requests: int = 20000
    n_predict: int = 24  # tokens generated per request
    prompt_scale: float = 1.0  # prompt lengths relative to the default set
    ctx_per_slot: int = 2048
    cache_reuse: int = 64  # llama-server --cache-reuse
    no_cache_prompt: bool = False
    threads: int | None = None  # llama-server -t (None: its own)
    seed: int = 0
    warmup: float | None = None  # seconds before memory must be flat (None: 20% of duration)
    rss_tolerance_mib: float = 8.0
    request_timeout: float = 300.0
    port: int = 0  # 0: a free port
    server_arg: tuple[str, ...] = field(default_factory=tuple)  # extra llama-server arguments
    server_log: str | None = None

    def __post_init__(self):
        if self.warmup is None:
            object.__setattr__(self, "warmup", round(0.2 * self.duration, 1))
        if self.clients < 1 or self.max_requests < 1 or self.duration <= 0 or not 0 <= self.warmup < self.duration:
            raise NblError("need --clients >= 1, --max-requests >= 1, --duration > 0 and 0 <= --warmup < --duration")


QUESTIONS = ("\n\nQuestion: What is the text above about?\nAnswer:",
             "\n\nQuestion: Who is the text above written for?\nAnswer:",
             "\n\nSummarize the text above in one sentence:",
             "\n\nThe main point of the text above is")


# --- prompts -----------------------------------------------------------------------------------------

def prompt_set(scale: float = 1.0) -> list[dict]:
    """Held-out C4 documents (never calibrated on) cut to three lengths (about 15, 85 and 330 tokens
    of SmolLM2 at ``scale`` 1), plus two documents with four questions each (shared prefixes, so that a
    slot reuses a cached prompt)."""
    docs = [re.sub(r"\s+", " ", text).strip() for text in heldout_texts()]
    docs = [doc for doc in docs if len(doc) >= 1600]
    prompts = []

    def cut(doc: str, chars: int) -> str:
        return doc[:max(8, int(chars * scale))].rsplit(" ", 1)[0]

    for i, doc in enumerate(docs[:8]):
        prompts.append({"kind": "short", "prompt": cut(doc, 60)})
        prompts.append({"kind": "medium", "prompt": cut(docs[-1 - i], 400)})
    for doc in docs[8:12]:
        prompts.append({"kind": "long", "prompt": cut(doc, 1500)})
    for family, doc in enumerate(docs[12:14]):
        prefix = cut(doc, 1000)
        for question in QUESTIONS:
            prompts.append({"kind": f"shared-prefix-{family}", "prompt": prefix + question})
    for index, prompt in enumerate(prompts):
        prompt["id"] = index
    return prompts


# --- the server --------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, settings: SoakSettings) -> tuple[subprocess.Popen, int, list[str]]:
    port = settings.port or free_port()
    command = [str(tool("llama-server")), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
               "--parallel", str(settings.clients), "-c", str(settings.clients * settings.ctx_per_slot),
               "--cache-reuse", str(settings.cache_reuse), "--seed", str(settings.seed), "--no-webui",
               *(["-t", str(settings.threads)] if settings.threads else []), *settings.server_arg]
    log = open(settings.server_log, "w") if settings.server_log else subprocess.DEVNULL
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return process, port, command
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise NblError(f"llama-server did not start (exit {process.poll()}); see --server-log")
        time.sleep(0.2)


def complete(port: int, prompt: str, settings: SoakSettings) -> dict:
    body = {"prompt": prompt, "n_predict": settings.n_predict, "temperature": 0.0, "top_k": 1, "seed": settings.seed,
            "cache_prompt": not settings.no_cache_prompt, "return_tokens": True, "n_probs": 2}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=settings.request_timeout) as response:
        return json.loads(response.read())


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class RssSampler(threading.Thread):
    """VmRSS of the server every ``interval`` seconds, as (seconds since start, KiB)."""

    def __init__(self, pid: int, interval: float = 1.0):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()
        self.start_time = time.monotonic()

    def run(self):
        while not self.stop.is_set():
            value = rss_kib(self.pid)
            if value is not None:
                self.samples.append((round(time.monotonic() - self.start_time, 2), value))
            self.stop.wait(self.interval)


# --- the two passes ----------------------------------------------------------------------------------

def margins(result: dict) -> list[float | None]:
    """Per generated token, how far greedy's choice led the runner-up (nats): where it is small, a
    numerically different but equally valid evaluation may choose the other token."""
    out = []
    for entry in result.get("completion_probabilities", []):
        top = entry.get("top_logprobs", [])
        out.append(round(top[0]["logprob"] - top[1]["logprob"], 5) if len(top) >= 2 else None)
    return out


def reference_pass(port: int, prompts: list[dict], settings: SoakSettings) -> dict[int, dict]:
    reference = {}
    for prompt in prompts:
        result = complete(port, prompt["prompt"], settings)
        if result["truncated"]:
            raise NblError(f"prompt {prompt['id']} ({prompt['kind']}) does not fit --ctx-per-slot {settings.ctx_per_slot}")
        reference[prompt["id"]] = {"content": result["content"], "tokens": result["tokens"],
                                   "prompt_tokens": result["tokens_evaluated"], "margins": margins(result)}
    return reference


class Soak:
    def __init__(self, port: int, prompts: list[dict], reference: dict[int, dict], settings: SoakSettings):
        self.port, self.prompts, self.reference, self.settings = port, prompts, reference, settings
        self.lock = threading.Lock()
        self.sent = 0
        self.records: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0

    def take_ticket(self) -> bool:
        with self.lock:
            if self.sent >= self.settings.max_requests:
                return False
            self.sent += 1
            return True

    def client(self, index: int, deadline: float) -> None:
        order = list(range(len(self.prompts)))
        rng = random.Random(self.settings.seed * 1000 + index)
        position = len(order)
        while time.monotonic() < deadline and self.take_ticket():
            if position == len(order):
                rng.shuffle(order)
                position = 0
            prompt = self.prompts[order[position]]
            position += 1
            record = {"client": index, "prompt": prompt["id"], "kind": prompt["kind"]}
            with self.lock:
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            started = time.monotonic()
            try:
                result = complete(self.port, prompt["prompt"], self.settings)
                expected = self.reference[prompt["id"]]
                record.update(ok=True, same=result["content"] == expected["content"]
                              and result["tokens"] == expected["tokens"],
                              prompt_n=result["timings"]["prompt_n"], cache_n=result["timings"]["cache_n"],
                              predicted_n=result["timings"]["predicted_n"])
                if not record["same"]:
                    first = next((i for i, (a, b) in enumerate(zip(result["tokens"], expected["tokens"])) if a != b),
                                 min(len(result["tokens"]), len(expected["tokens"])))
                    ref_margins, own_margins = expected["margins"], margins(result)
                    record.update(first_different_token=first, content=result["content"], tokens=result["tokens"],
                                  reference_margin=ref_margins[first] if first < len(ref_margins) else None,
                                  margin=own_margins[first] if first < len(own_margins) else None)
            except (OSError, ValueError, KeyError) as error:  # HTTP errors and refused connections are OSErrors
                record.update(ok=False, error=f"{type(error).__name__}: {error}")
            finally:
                with self.lock:
                    self.in_flight -= 1
            record["seconds"] = round(time.monotonic() - started, 3)
            with self.lock:
                self.records.append(record)

    def run(self) -> float:
        started = time.monotonic()
        deadline = started + self.settings.duration
        threads = [threading.Thread(target=self.client, args=(i, deadline)) for i in range(self.settings.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return time.monotonic() - started


# --- the verdict -------------------------------------------------------------------------------------

def memory_report(samples: list[tuple[float, int]], soak_start: float, soak_end: float, warmup: float) -> dict:
    """RSS at the end of the warm-up (median of its last 5 s) against the end of the run (median of the
    last 5 s), the peak after the warm-up, and the least-squares slope after the warm-up."""
    def median_between(lo, hi):
        values = [kib for t, kib in samples if lo <= t <= hi]
        return statistics.median(values) if values else None

    warm_end = soak_start + warmup
    after = [(t, kib) for t, kib in samples if warm_end <= t <= soak_end]
    at_warm = median_between(warm_end - 5, warm_end)
    at_end = median_between(soak_end - 5, soak_end)
    slope = None
    if len(after) >= 3:
        mean_t = statistics.fmean(t for t, _ in after)
        mean_v = statistics.fmean(v for _, v in after)
        var = sum((t - mean_t) ** 2 for t, _ in after)
        slope = sum((t - mean_t) * (v - mean_v) for t, v in after) / var * 60 / 1024 if var else 0.0
    mib = lambda kib: None if kib is None else round(kib / 1024, 2)  # noqa: E731
    return {
        "at_start_mib": mib(median_between(0, 2)), "before_soak_mib": mib(median_between(soak_start - 5, soak_start)),
        "warmup_s": warmup, "at_warmup_end_mib": mib(at_warm), "at_end_mib": mib(at_end),
        "peak_after_warmup_mib": mib(max((v for _, v in after), default=None)),
        "growth_after_warmup_mib": None if at_warm is None or at_end is None else mib(at_end - at_warm),
        "slope_after_warmup_mib_per_min": None if slope is None else round(slope, 3),
        "samples": len(samples),
    }


def summarize(records: list[dict], reference: dict, max_in_flight: int, seconds: float, memory: dict, settings: SoakSettings) -> dict:
    failed = [r for r in records if not r["ok"]]
    done = [r for r in records if r["ok"]]
    different = [r for r in done if not r["same"]]
    by_kind = {}
    for r in records:
        entry = by_kind.setdefault(r["kind"], {"requests": 0, "different": 0, "failed": 0})
        entry["requests"] += 1
        entry["failed"] += not r["ok"]
        entry["different"] += r["ok"] and not r["same"]
    latencies = sorted(r["seconds"] for r in done)
    prompt_tokens = sum(reference[r["prompt"]]["prompt_tokens"] for r in done)
    evaluated = sum(r["prompt_n"] for r in done)
    growth = memory["growth_after_warmup_mib"]
    # where the differences begin: the reference's lead of its token there, against all its leads
    at_divergence = [r["reference_margin"] for r in different if r.get("reference_margin") is not None]
    all_margins = sorted(m for entry in reference.values() for m in entry["margins"] if m is not None)
    checks = {
        "no failed requests": not failed,
        "every response equals the single-client reference": not different,
        f"memory flat after the warm-up (growth <= {settings.rss_tolerance_mib} MiB)":
            growth is not None and growth <= settings.rss_tolerance_mib,
    }
    return {
        "requests": len(records), "failed": len(failed), "different": len(different),
        "clients": settings.clients, "max_in_flight": max_in_flight, "seconds": round(seconds, 1),
        "requests_per_s": round(len(records) / seconds, 2) if seconds else None,
        "generated_tokens": sum(r["predicted_n"] for r in done),
        "prompt_tokens": prompt_tokens, "prompt_tokens_evaluated": evaluated,
        "prompt_tokens_from_cache": prompt_tokens - evaluated,
        "latency_s": {"median": latencies[len(latencies) // 2], "p95": latencies[int(len(latencies) * 0.95)],
                      "max": latencies[-1]} if latencies else None,
        "by_kind": by_kind, "memory": memory,
        "divergence": {
            "differing_responses": len(different),
            "reference_margin_at_first_difference_nats": {
                "max": max(at_divergence), "median": statistics.median(at_divergence)} if at_divergence else None,
            "reference_margins_nats": {"tokens": len(all_margins), "median": statistics.median(all_margins),
                                       "below_0.1": sum(m < 0.1 for m in all_margins),
                                       "below_0.5": sum(m < 0.5 for m in all_margins)} if all_margins else None,
        },
        "failures": failed[:20], "differences": different[:20],
        "checks": checks, "passed": all(checks.values()),
    }


def print_summary(result: dict) -> None:
    s = result["soak"]
    m = s["memory"]
    print(f"soak: {s['requests']} requests from {s['clients']} clients in {s['seconds']} s "
          f"({s['requests_per_s']} req/s, at most {s['max_in_flight']} in flight), "
          f"{s['generated_tokens']} tokens generated")
    print(f"  failed: {s['failed']}   different from the single-client reference: {s['different']}")
    print(f"  prompt tokens: {s['prompt_tokens']}, {s['prompt_tokens_from_cache']} of them from the cache "
          f"({s['prompt_tokens_evaluated']} evaluated)")
    if s["latency_s"]:
        print(f"  latency: median {s['latency_s']['median']} s, p95 {s['latency_s']['p95']} s, "
              f"max {s['latency_s']['max']} s")
    print(f"  server RSS: {m['at_start_mib']} MiB after loading, {m['before_soak_mib']} MiB after the reference "
          f"pass, {m['at_warmup_end_mib']} MiB after the {m['warmup_s']:g} s warm-up, {m['at_end_mib']} MiB at the end "
          f"(growth {m['growth_after_warmup_mib']} MiB, slope {m['slope_after_warmup_mib_per_min']} MiB/min, "
          f"peak {m['peak_after_warmup_mib']} MiB)")
    divergence = s["divergence"]
    if divergence["reference_margin_at_first_difference_nats"]:
        at, every = divergence["reference_margin_at_first_difference_nats"], divergence["reference_margins_nats"]
        print(f"  differences begin where the reference's token led by at most {at['max']} nats (median {at['median']}); "
              f"over all {every['tokens']} reference tokens the median lead is {every['median']} nats")
    for kind, entry in s["by_kind"].items():
        print(f"  {kind:<16s} {entry['requests']:6d} requests  {entry['different']} different  {entry['failed']} failed")
    for name, ok in s["checks"].items():
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}")


# --- main --------------------------------------------------------------------------------------------

def default_model() -> Path:
    """The embedded SmolLM2-135M-Instruct converted with --m 4 --quant q4_k_m, made once."""
    if not DEFAULT_MODEL.is_file():
        DEFAULT_MODEL.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "nbl_gguf", "convert", *CONVERT_DEFAULT, "-o", str(DEFAULT_MODEL)]
        print("making the default model: " + " ".join(command[1:]), file=sys.stderr, flush=True)
        subprocess.run(command, check=True)
    return DEFAULT_MODEL


def soak(model: Path | None, settings: SoakSettings, command: str) -> dict:
    """Serve ``model`` (None: default_model()) and load it as ``settings`` say; the result (``command``:
    how it was asked for), whose ["soak"]["passed"] says whether every check held."""
    model = model or default_model()
    prompts = prompt_set(settings.prompt_scale)
    process, port, server_command = start_server(model, settings)
    sampler = RssSampler(process.pid)
    sampler.start()
    try:
        reference = reference_pass(port, prompts, settings)
        load = Soak(port, prompts, reference, settings)
        soak_start = time.monotonic() - sampler.start_time
        seconds = load.run()
        soak_end = soak_start + seconds
        time.sleep(1.5)  # one more sample after the last request
    finally:
        sampler.stop.set()
        sampler.join()
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
    memory = memory_report(sampler.samples, soak_start, soak_end, settings.warmup)
    summary = summarize(load.records, reference, load.max_in_flight, seconds, memory, settings)
    result = {
        "command": command,
        "server_command": [Path(server_command[0]).name, *server_command[1:]],
        "model": str(model), "model_bytes": model.stat().st_size,
        "settings": {k: v for k, v in asdict(settings).items() if k not in ("request_timeout", "port", "server_log")},
        "prompts": [{"id": p["id"], "kind": p["kind"], "chars": len(p["prompt"]),
                     "tokens": reference[p["id"]]["prompt_tokens"], "reference": reference[p["id"]]["content"]}
                    for p in prompts],
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "soak": summary,
        "rss_samples_kib": sampler.samples,
    }
    return result
