"""`bench --frontier`: one model's stock file, llama.cpp's own knobs and our NBL files, measured side by
side in one run, and the two frontiers they draw: quality against KV bytes, and quality against decode
speed (the files and how they are made: nbl_gguf.commands.bench).

A variant is a GGUF and the KV cache type it runs with (``-ctk/-ctv``). Each one gets:
- llama-perplexity on each bundled kind of held-out text (C4 web text, Python docs, Python code), at a
  short context (512) and at a long one (4096, or the training context if smaller), where a KV or a
  window saving can show;
- the KV cache llama.cpp allocates for it at ``kv_ctx`` (nbl_gguf.kv_cache, which is tested against the
  allocator's log) and its file size;
- llama-bench prompt and decode at each depth, every variant once per round in alternating order, so
  that a noisy machine slows all alike (measurement.llama_bench);
- optionally (``passkey``), the passkey test at those prompt lengths with the variant's cache type
  (measurement.passkey): retrieval, which perplexity does not show and a weight type can lose as well as a
  window layer.
The quality of a variant is its mean change in long-context perplexity over the kinds of text, against
the stock file with an F16 cache; a point is on a frontier when no other variant is at least as good
on both axes and better on one.
"""

from __future__ import annotations

import csv
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nbl_gguf.errors import NblError

# llama-quantize types by bits per weight (llama.cpp's own table), for the weight-type knob one step down
# and one up; the legacy types are placed by their bits so that a Q4_1 source finds its neighbours too
TYPE_BITS = {"Q2_K": 2.63, "Q3_K_M": 3.91, "Q4_0": 4.5, "Q4_K_M": 4.85, "Q4_1": 5.0, "Q5_0": 5.5,
             "Q5_K_M": 5.69, "Q5_1": 6.0, "Q6_K": 6.56, "Q8_0": 8.5, "F16": 16.0, "BF16": 16.0, "F32": 32.0}
LADDER = ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")  # the steps a knob moves along
FLOAT_TYPES = ("F32", "F16", "BF16")
STOCK, KNOB, NBL = "stock", "llama.cpp knob", "nbl"


def neighbour_types(file_type: str) -> tuple[str | None, str | None]:
    """(one step down, one step up) the ladder from ``file_type``, None past its ends."""
    bits = TYPE_BITS.get(file_type.upper())
    if bits is None:
        raise NblError(f"the frontier has no place for weight type {file_type} among {', '.join(TYPE_BITS)}")
    down = [t for t in LADDER if TYPE_BITS[t] < bits]
    up = [t for t in LADDER if TYPE_BITS[t] > bits]
    return (down[-1] if down else None), (up[0] if up else None)


@dataclass(frozen=True)
class Variant:
    label: str
    group: str  # STOCK, KNOB or NBL
    path: Path
    kv_type: str = "f16"
    made_by: str = ""  # how the file was made

    @property
    def runtime(self) -> str:
        """How to run it: the llama.cpp flags beyond -m."""
        from nbl_gguf.llamacpp.cache_types import cache_type_flags

        return " ".join(cache_type_flags(self.kv_type))


@dataclass(frozen=True)
class FrontierSettings:
    short_ctx: int = 512
    short_chunks: int = 4
    long_ctx: int = 4096
    long_chunks: int = 1
    kv_ctx: int = 4096  # the context the KV bytes are given at
    depths: tuple[int, ...] = (0, 4096)
    n_prompt: int = 512
    n_gen: int = 128
    repetitions: int = 2
    rounds: int = 1
    threads: int | None = None
    backends: tuple[str, ...] = ("cpu",)
    bench_args: tuple[str, ...] = ()
    passkey: tuple[int, ...] = ()  # passkey prompt lengths in tokens; none: no passkey test

    def __post_init__(self):
        for name in ("short_ctx", "short_chunks", "long_ctx", "long_chunks", "kv_ctx", "repetitions", "rounds"):
            if getattr(self, name) < 1:
                raise NblError(f"the frontier's {name.replace('_', ' ')} must be at least 1, got {getattr(self, name)}")
        if any(n < 1 for n in self.passkey):
            raise NblError(f"the frontier's passkey lengths must be at least 1 token, got {list(self.passkey)}")
        if self.long_ctx < self.short_ctx:
            raise NblError(f"the long context ({self.long_ctx}) is shorter than the short one ({self.short_ctx})")


@dataclass
class Row:
    """One variant's measurements (perplexity per context and kind; speed per backend, test and depth)."""

    variant: Variant
    file_bytes: int
    kv_bytes: int
    perplexity: dict[int, dict[str, float]] = field(default_factory=dict)
    tokens: dict[int, dict[str, int]] = field(default_factory=dict)
    speed: dict[str, float] = field(default_factory=dict)  # "cpu tg d4096" -> tokens/s (mean of the calls)
    passkey: dict[int, list[bool]] = field(default_factory=dict)  # prompt length -> found, at each depth

    def passkey_cell(self, n_ctx: int) -> str:
        from nbl_gguf.measurement.passkey import found_of_asked

        found = self.passkey.get(n_ctx)
        return "" if found is None else found_of_asked(found)

    @property
    def label(self) -> str:
        return self.variant.label


# --- measuring -------------------------------------------------------------------------------------

def measure_perplexity(variants: list[Variant], texts: dict[str, Path], settings: FrontierSettings, log,
                       runs) -> tuple[dict, list[str]]:
    """({label: {ctx: {kind: Perplexity}}} by llama-perplexity with each variant's cache type, the labels of those
    whose perplexities were all kept from an earlier run). ``runs``: a measurement.kept_runs.KeptRuns."""
    out, kept = {}, []
    for index, variant in enumerate(variants, 1):
        started = time.monotonic()
        done = {ctx: {kind: runs.perplexity(variant.path, text, ctx, chunks, variant.kv_type)
                      for kind, text in texts.items()}
                for ctx, chunks in ((settings.short_ctx, settings.short_chunks), (settings.long_ctx, settings.long_chunks))}
        out[variant.label] = {ctx: {kind: r.value for kind, r in kinds.items()} for ctx, kinds in done.items()}
        was_kept = all(r.kept for kinds in done.values() for r in kinds.values())
        if was_kept:
            kept.append(variant.label)
        shown = ", ".join(f"{kind} {out[variant.label][settings.long_ctx][kind].ppl:.3f}" for kind in texts)
        log(f"[perplexity {index}/{len(variants)}] {variant.label}: at {settings.long_ctx} {shown} "
            + ("(kept from an earlier run)" if was_kept else f"({time.monotonic() - started:.0f} s)"))
    return out, kept


def measure_passkey(variants: list[Variant], settings: FrontierSettings, log, runs) -> tuple[dict, list[str]]:
    """({label: PasskeyResult}: each variant's greedy answers to the passkey prompts, with its cache type; the
    labels of those kept from an earlier run). ``runs``: a measurement.kept_runs.KeptRuns."""
    from nbl_gguf.measurement.passkey import DEPTHS, found_of_asked

    out, kept = {}, []
    for index, variant in enumerate(variants, 1):
        run = runs.passkey(variant.path, settings.passkey, DEPTHS, variant.kv_type)
        out[variant.label] = result = run.value
        if run.kept:
            kept.append(variant.label)
        shown = ", ".join(f"{found_of_asked(result.found(n))} at {n}" for n in settings.passkey)
        log(f"[passkey {index}/{len(variants)}] {variant.label}: {shown} "
            + ("(kept from an earlier run)" if run.kept else f"({run.seconds:.0f} s)"))
    return out, kept


def measure_speed(variants: list[Variant], settings: FrontierSettings, log) -> tuple[list[dict], list[str]]:
    """llama-bench records of every variant at every depth on every backend, interleaved; the commands run."""
    import os

    from nbl_gguf.measurement.llama_bench import run_llama_bench, schedule

    threads = settings.threads or os.cpu_count() or 1
    records, commands = [], []
    for backend in settings.backends:
        plan = schedule(variants, list(settings.depths), settings.rounds)
        started = time.monotonic()
        for step, (round_index, depth, variant) in enumerate(plan, 1):
            result, command = run_llama_bench(
                variant.path, n_prompt=settings.n_prompt, n_gen=settings.n_gen, depth=depth,
                repetitions=settings.repetitions, threads=threads, backend=backend, cache_type=variant.kv_type,
                extra=list(settings.bench_args))
            if round_index == 0 and depth == settings.depths[0]:
                commands.append(" ".join(command))
            log(f"[{backend} {step}/{len(plan)} depth {depth}] {variant.label}: "
                + ", ".join(f"{r['test']} {r['avg_ts']:.1f} t/s" for r in result)
                + f" ({time.monotonic() - started:.0f} s total)")
            for record in result:
                record.update(backend=backend, label=variant.label, round=round_index)
                records.append(record)
    return records, commands


def speed_key(backend: str, test: str, depth: int) -> str:
    return f"{backend} {test} d{depth}"


def mean_speeds(records: list[dict]) -> dict[str, dict[str, float]]:
    """{label: {speed_key: mean tokens/s over the calls}}."""
    sums: dict[str, dict[str, list[float]]] = {}
    for record in records:
        key = speed_key(record["backend"], record["test"], record["depth"])
        sums.setdefault(record["label"], {}).setdefault(key, []).append(record["avg_ts"])
    return {label: {key: sum(v) / len(v) for key, v in keys.items()} for label, keys in sums.items()}


def kv_bytes(path: Path, kv_type: str, n_ctx: int, readers: dict | None = None) -> int:
    """The KV cache llama.cpp allocates for the file at ``n_ctx`` with that cache type (llama-cli's settings).
    ``readers``: the headers read so far, by path (the variants of one file share it)."""
    from nbl_gguf.gguf.metadata import kv_sizes, open_gguf

    readers = {} if readers is None else readers
    if path not in readers:
        readers[path] = open_gguf(path)
    _, size = kv_sizes(readers[path], n_ctx, kv_type=kv_type)
    return size.bytes


def measure(variants: list[Variant], texts: dict[str, Path], settings: FrontierSettings, log,
            memo=None) -> tuple[list[Row], dict]:
    """Every variant's row, and the raw llama-bench records and commands. ``memo`` (measurement.memo.Memo): the
    perplexities and passkeys kept there by an earlier run are taken (measurement.kept_runs), the speeds are
    measured again, side by side; raw["kept"] names the variants whose perplexities and passkeys were taken."""
    from nbl_gguf.measurement.kept_runs import KeptRuns

    labels = [v.label for v in variants]
    if len(set(labels)) != len(labels):
        raise NblError(f"two frontier variants share a label: {labels}")
    if not variants or variants[0].group != STOCK or variants[0].kv_type != "f16":
        raise NblError("the frontier's first variant must be the stock file with an F16 cache (the reference)")
    runs = KeptRuns(memo, settings.threads)
    perplexities, kept = measure_perplexity(variants, texts, settings, log, runs)
    passkeys, kept_passkeys = measure_passkey(variants, settings, log, runs) if settings.passkey else ({}, [])
    records, commands = measure_speed(variants, settings, log)
    speeds = mean_speeds(records)
    rows, readers = [], {}
    for variant in variants:
        measured = perplexities[variant.label]
        rows.append(Row(variant, variant.path.stat().st_size,
                        kv_bytes(variant.path, variant.kv_type, settings.kv_ctx, readers),
                        perplexity={ctx: {k: p.ppl for k, p in kinds.items()} for ctx, kinds in measured.items()},
                        tokens={ctx: {k: p.tokens for k, p in kinds.items()} for ctx, kinds in measured.items()},
                        speed=speeds.get(variant.label, {}),
                        passkey={n: passkeys[variant.label].found(n) for n in settings.passkey}))
    raw = {"llama_bench": records, "llama_bench_commands": commands,
           "kept": {"perplexity": kept, "passkey": kept_passkeys}}
    if passkeys:  # the answers, to read what a variant said instead of the key
        raw["passkey"] = {label: result.report() for label, result in passkeys.items()}
    return rows, raw


# --- the frontier ------------------------------------------------------------------------------------

def change(row: Row, reference: Row, ctx: int, kind: str) -> float:
    """Perplexity change of ``row`` against ``reference`` on one kind at one context, in percent."""
    return 100.0 * (row.perplexity[ctx][kind] / reference.perplexity[ctx][kind] - 1.0)


def mean_change(row: Row, reference: Row, ctx: int) -> float:
    kinds = list(reference.perplexity[ctx])
    return sum(change(row, reference, ctx, kind) for kind in kinds) / len(kinds)


def pareto(points: list[tuple[float, float]]) -> list[bool]:
    """For each (a, b) point, to be made small on both: whether no other point is at least as small on
    both and smaller on one."""
    front = []
    for i, (a, b) in enumerate(points):
        dominated = any(a2 <= a and b2 <= b and (a2 < a or b2 < b) for j, (a2, b2) in enumerate(points) if j != i)
        front.append(not dominated)
    return front


def decode_key(settings: FrontierSettings) -> str:
    """The speed the decode frontier is drawn on: tg at the deepest depth on the first backend."""
    return speed_key(settings.backends[0], "tg", max(settings.depths))


def frontiers(rows: list[Row], settings: FrontierSettings) -> dict[str, list[bool]]:
    """Which rows are on each frontier: 'kv' (quality, KV bytes) and 'decode' (quality, decode speed)."""
    reference = rows[0]
    loss = [mean_change(r, reference, settings.long_ctx) for r in rows]
    key = decode_key(settings)
    return {"kv": pareto([(l, r.kv_bytes) for l, r in zip(loss, rows)]),
            "decode": pareto([(l, -r.speed.get(key, 0.0)) for l, r in zip(loss, rows)])}


QUALITY_BAR = 10.0  # issue 30's decode race: the fastest point within +10% of stock's long-context perplexity


def decode_within(rows: list[Row], settings: FrontierSettings, bar: float = QUALITY_BAR) -> list[str]:
    """Per backend and decode depth, the fastest of ours and of llama.cpp's own (the stock file and its knobs)
    among the points within ``bar`` percent of the stock file's long-context perplexity, and which is faster."""
    reference = rows[0]
    lines = []
    for backend in settings.backends:
        for depth in settings.depths:
            key = speed_key(backend, "tg", depth)
            fastest = {}
            for side, groups in (("ours", (NBL,)), ("llama.cpp's", (STOCK, KNOB))):
                inside = [r for r in rows if r.variant.group in groups and key in r.speed
                          and mean_change(r, reference, settings.long_ctx) <= bar]
                fastest[side] = max(inside, key=lambda r: r.speed[key], default=None)

            def name(row: Row | None) -> str:
                if row is None:
                    return "none"
                return (f"{row.label}, {row.speed[key]:.1f} t/s "
                        f"({mean_change(row, reference, settings.long_ctx):+.1f}%)")

            ours, theirs = fastest["ours"], fastest["llama.cpp's"]
            verdict = ("" if ours is None or theirs is None
                       else f": ours {ours.speed[key] / theirs.speed[key]:.2f}x theirs")
            lines.append(f"decode at depth {depth:,} ({backend}), within +{bar:g}% of stock's perplexity at "
                         f"{settings.long_ctx:,}: fastest of ours {name(ours)}; of llama.cpp's own {name(theirs)}"
                         f"{verdict}")
    return lines


def table(rows: list[Row], settings: FrontierSettings) -> tuple[list[str], list[list[str]]]:
    """The frontier as (header, rows of cells): every number, changes against the stock F16 row."""
    reference = rows[0]
    kinds = list(reference.perplexity[settings.short_ctx])
    keys = [speed_key(b, t, d) for b in settings.backends for t in ("pp", "tg") for d in settings.depths]
    on = frontiers(rows, settings)
    header = (["variant", "kind", "run with", "file", f"KV at {settings.kv_ctx:,}"]
              + [f"PPL {kind} @{ctx}" for ctx in (settings.short_ctx, settings.long_ctx) for kind in kinds]
              + [f"mean change @{settings.long_ctx}"] + keys + [f"passkey @{n}" for n in settings.passkey]
              + ["frontier"])
    cells = []
    for index, row in enumerate(rows):
        line = [row.label, row.variant.group, row.variant.runtime or "-", _mib(row.file_bytes), _mib(row.kv_bytes)]
        for ctx in (settings.short_ctx, settings.long_ctx):
            for kind in kinds:
                value = row.perplexity[ctx][kind]
                line.append(f"{value:.3f}" if index == 0 else f"{value:.3f} ({change(row, reference, ctx, kind):+.1f}%)")
        line.append("base" if index == 0 else f"{mean_change(row, reference, settings.long_ctx):+.1f}%")
        for key in keys:
            value = row.speed.get(key)
            base = reference.speed.get(key)
            line.append("" if value is None else f"{value:.1f}" + ("" if index == 0 or not base else f" ({value / base:.2f}x)"))
        line += [row.passkey_cell(n) for n in settings.passkey]
        line.append(", ".join(name for name, marks in (("KV", on["kv"]), ("decode", on["decode"])) if marks[index]))
        cells.append(line)
    return header, cells


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.2f} MiB"


def markdown(title: str, rows: list[Row], settings: FrontierSettings, notes: list[str]) -> str:
    header, cells = table(rows, settings)
    lines = [f"# {title}", ""] + [f"- {note}" for note in notes] + ["", "| " + " | ".join(header) + " |",
                                                                    "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in line) + " |" for line in cells]
    lines += ["", f"## Decode within +{QUALITY_BAR:g}%", ""] + [f"- {line}" for line in decode_within(rows, settings)]
    return "\n".join(lines) + "\n"


def write_csv(path: Path, rows: list[Row], settings: FrontierSettings) -> Path:
    reference = rows[0]
    kinds = list(reference.perplexity[settings.short_ctx])
    keys = sorted({key for row in rows for key in row.speed})
    on = frontiers(rows, settings)
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["label", "group", "kv_type", "file_bytes", "kv_bytes", "kv_ctx"]
                        + [f"ppl_{kind}_{ctx}" for ctx in (settings.short_ctx, settings.long_ctx) for kind in kinds]
                        + [f"mean_change_pct_{settings.long_ctx}"] + [k.replace(" ", "_") + "_ts" for k in keys]
                        + [f"passkey_{what}_{n}" for n in settings.passkey for what in ("found", "asked")]
                        + ["kv_frontier", "decode_frontier"])
        for index, row in enumerate(rows):
            writer.writerow([row.label, row.variant.group, row.variant.kv_type, row.file_bytes, row.kv_bytes,
                             settings.kv_ctx]
                            + [f"{row.perplexity[ctx][kind]:.4f}" for ctx in (settings.short_ctx, settings.long_ctx)
                               for kind in kinds]
                            + [f"{mean_change(row, reference, settings.long_ctx):.3f}"]
                            + [f"{row.speed[k]:.3f}" if k in row.speed else "" for k in keys]
                            + [value for n in settings.passkey
                               for value in ((sum(row.passkey[n]), len(row.passkey[n])) if n in row.passkey else ("", ""))]
                            + [int(on["kv"][index]), int(on["decode"][index])])
    return path


SYMLOG_LINEAR = 10  # percent of perplexity change: the plot's linear range


def plot(path: Path, title: str, rows: list[Row], settings: FrontierSettings) -> Path:
    """draw's figure, saved at ``path``."""
    import matplotlib.pyplot as plt

    figure = draw(title, rows, settings)
    figure.savefig(path, dpi=130)
    plt.close(figure)
    return path


def draw(title: str, rows: list[Row], settings: FrontierSettings):
    """Two panels: quality against KV bytes, quality against decode speed; the Pareto points ringed and
    joined, every point named (a matplotlib Figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    reference = rows[0]
    loss = [mean_change(r, reference, settings.long_ctx) for r in rows]
    # losses spanning +0.1% to +500% read on symlog (linear near zero, logarithmic beyond); a narrow range linear
    wide = max(abs(y) for y in loss) > SYMLOG_LINEAR
    key = decode_key(settings)
    on = frontiers(rows, settings)
    colors = {STOCK: "black", KNOB: "tab:orange", NBL: "tab:blue"}
    figure, axes = plt.subplots(1, 2, figsize=(15, 6.5))
    for ax, name, xs, xlabel in (
            (axes[0], "kv", [r.kv_bytes / 2 ** 20 for r in rows], f"KV cache at {settings.kv_ctx:,} tokens (MiB)"),
            (axes[1], "decode", [r.speed.get(key, 0.0) for r in rows], f"decode ({key}), tokens/s")):
        for x, y, row in zip(xs, loss, rows):
            ax.scatter(x, y, color=colors[row.variant.group], s=25, zorder=3)
            ax.annotate(row.label, (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
        front = sorted((x, y) for x, y, mark in zip(xs, loss, on[name]) if mark)
        ax.plot([x for x, _ in front], [y for _, y in front], color="tab:green", lw=1, zorder=2)
        ax.scatter([x for x, _ in front], [y for _, y in front], facecolors="none", edgecolors="tab:green", s=110,
                   zorder=4, label="Pareto points")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"mean perplexity change at {settings.long_ctx} tokens (%)")
        if wide:
            ax.set_yscale("symlog", linthresh=SYMLOG_LINEAR)
        # plain numbers: symlog's own labels of a narrow range read "8.36438 x 10^0"
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.grid(alpha=0.3)
    for group, color in colors.items():
        axes[0].scatter([], [], color=color, label=group)
    axes[0].legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def write_outputs(out: Path, title: str, rows: list[Row], settings: FrontierSettings, raw: dict, notes: list[str],
                  plot_it: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "frontier.md", write_csv(out / "frontier.csv", rows, settings)]
    written[0].write_text(markdown(title, rows, settings, notes), encoding="utf-8")
    record = {"title": title, "settings": asdict(settings), "notes": notes,
              "rows": [{"label": r.label, "group": r.variant.group, "kv_type": r.variant.kv_type,
                        "path": str(r.variant.path), "made_by": r.variant.made_by, "file_bytes": r.file_bytes,
                        "kv_bytes": r.kv_bytes, "perplexity": r.perplexity, "tokens": r.tokens, "speed": r.speed,
                        "passkey": r.passkey}
                       for r in rows]} | raw
    (out / "results.json").write_text(json.dumps(record, indent=1, default=str), encoding="utf-8")
    written.append(out / "results.json")
    if plot_it:
        written.append(plot(out / "frontier.png", title, rows, settings))
    return written


def read_results(path: Path) -> tuple[str, list[Row], FrontierSettings, list[str], dict]:
    """A finished frontier's results.json as write_outputs wrote it: (title, rows, settings, notes, the raw
    rest), for its report to be written again (after a change to the report, with nothing measured)."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
        settings = FrontierSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in record["settings"].items()})
        rows = [Row(Variant(r["label"], r["group"], Path(r["path"]), r["kv_type"], r.get("made_by", "")),
                    r["file_bytes"], r["kv_bytes"],
                    perplexity={int(ctx): kinds for ctx, kinds in r["perplexity"].items()},
                    tokens={int(ctx): kinds for ctx, kinds in r.get("tokens", {}).items()}, speed=r["speed"],
                    passkey={int(n): found for n, found in r.get("passkey", {}).items()})
                for r in record["rows"]]
        title, notes = record["title"], record["notes"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise NblError(f"{path}: not a frontier's results.json ({error})") from None
    known = {"title", "settings", "notes", "rows"}
    return title, rows, settings, notes, {k: v for k, v in record.items() if k not in known}

