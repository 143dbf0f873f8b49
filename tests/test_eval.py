"""eval: llama-perplexity's perplexity, HellaSwag, Winogrande and binary multiple-choice paths on a tiny
random GGUF, checked against an independent numpy computation (TinyLlama.forward) of the same rules
as tools/perplexity/perplexity.cpp defines them; the output parsers; bad input."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
import pytest

from nbl_gguf import cli
from nbl_gguf.gguf import nbl_format
from nbl_gguf.llamacpp import perplexity as runtime_ppl
from nbl_gguf.measurement import perplexity as llama_ppl
from nbl_gguf.measurement import tasks as task_formats
from nbl_gguf.measurement import torch_ppl
from nbl_gguf.errors import NblError
from nbl_gguf.llamacpp.tools import bin_dir
from nbl_gguf.fixtures.tiny import TinyLlama

needs_perplexity = pytest.mark.skipif(not (bin_dir() / "llama-perplexity").is_file(),
                                      reason="patched llama-perplexity not built (scripts/build_llama.sh)")

BOS = 1
THREADS = 1  # the tiny model gains nothing from more; on a busy CPU one thread is much faster
SPACE = "\u2581"


def tokenize(text: str) -> list[int]:
    """The tiny vocab is <unk> <s> </s> + 256 byte tokens: llama.cpp's SPM tokenizer prefixes a space,
    turns spaces into U+2581 and falls back to bytes (token 3 + byte); BOS first."""
    return [BOS] + [3 + b for b in (SPACE + text.replace(" ", SPACE)).encode("utf-8")]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module")
def tiny():
    return TinyLlama(n_layer=3, n_embd=64, n_head=4, n_head_kv=2, n_ff=96, seed=3)


@pytest.fixture(scope="module")
def tiny_gguf(tiny, tmp_path_factory) -> Path:
    return tiny.write_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


class Reference:
    """numpy log-probabilities of the tiny model, cached per token sequence."""

    def __init__(self, model: TinyLlama, types=None, linear=None):
        self.model, self.types, self.linear = model, types, linear
        self.cache = {}

    def logprobs(self, tokens) -> np.ndarray:
        key = tuple(tokens)
        if key not in self.cache:
            self.cache[key] = log_softmax(self.model.forward(list(tokens), self.types, self.linear))
        return self.cache[key]

    def ending_scores(self, sequences) -> list[float]:
        """HellaSwag / multiple-choice: mean log-prob of each sequence's tokens after the common prefix
        (the first from the prefix's last position)."""
        prefix = 0
        while all(len(s) > prefix for s in sequences) and len({s[prefix] for s in sequences}) == 1:
            prefix += 1
        scores = []
        for seq in sequences:
            lp = self.logprobs(seq)
            values = [lp[j, seq[j + 1]] for j in range(prefix - 1, len(seq) - 1)]
            scores.append(float(np.mean(values)))
        return scores

    def winogrande_scores(self, row) -> tuple[float, float]:
        """perplexity.cpp's winogrande_score, including its choice of the first logits (FIXME there)."""
        seqs = [tokenize(row["first"] + c + row["second"]) for c in row["choices"]]
        prefix = 0
        while prefix < min(map(len, seqs)) and seqs[0][prefix] == seqs[1][prefix]:
            prefix += 1
        skip_choice = len(seqs[0]) - prefix > 3 and len(seqs[1]) - prefix > 3
        scores = []
        for s, seq in enumerate(seqs):
            n_base = len(tokenize(row["first"] + row["choices"][s])) if skip_choice else prefix
            last = 1 if len(seq) - n_base > 1 else 0
            values = []
            for j in range(n_base - 1, len(seq) - 1 - last):
                lp = self.logprobs(seq)[j]
                if s == 1 and j < prefix:  # the batch position the tool reads: the end of the first sequence
                    lp = self.logprobs(seqs[0])[len(seqs[0]) - 1]
                values.append(lp[seq[j + 1]])
            scores.append(float(np.sum(values) / (len(seq) - n_base - last)))
        return scores[0], scores[1]

    def perplexity(self, tokens, n_ctx: int) -> tuple[float, float, int]:
        first = n_ctx // 2
        nll = []
        for i in range(len(tokens) // n_ctx):
            chunk = list(tokens[i * n_ctx:(i + 1) * n_ctx])
            chunk[0] = BOS
            lp = self.logprobs(chunk)
            nll += [-lp[j, tokens[i * n_ctx + j + 1]] for j in range(first, n_ctx - 1)]
        nll = np.array(nll)
        ppl = math.exp(nll.mean())
        return ppl, ppl * math.sqrt(nll.var() / (len(nll) - 1)), len(nll)


WORDS = ("the cat dog sat ran on a mat hill red blue big small quickly slowly and then because it was "
         "warm cold there home away").split()


def sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


# --- tokenizer sanity --------------------------------------------------------------------------

@needs_perplexity
def test_test_tokenizer_matches_llama_cpp(tiny_gguf):
    tokens, bos = torch_ppl.llama_tokens(tiny_gguf, "the cat sat, on a mat")
    assert tokens == tokenize("the cat sat, on a mat") and bos == BOS


# --- perplexity --------------------------------------------------------------------------------

@needs_perplexity
@pytest.mark.parametrize("nbl", [False, True], ids=["stock", "nbl"])
def test_perplexity_matches_numpy_chunking(tiny, tmp_path, nbl):
    rng = np.random.default_rng(0)
    text = sentence(rng, 120)
    path = tmp_path / "text.txt"
    path.write_text(text + "\n")  # llama.cpp's -f drops this newline
    types, linear = None, None
    gguf = tmp_path / "m.gguf"
    if nbl:
        types = [nbl_format.LINEAR, nbl_format.ATTENTION, nbl_format.DROPPED]
        linear = tiny.random_linear([0])
        tiny.write_nbl_gguf(gguf, types, linear)
    else:
        tiny.write_gguf(gguf)
    n_ctx = 64
    result = runtime_ppl.perplexity(gguf, path, n_ctx=n_ctx, threads=THREADS)
    tokens = tokenize(text)
    ref = Reference(tiny, types, linear)
    ppl, err, count = ref.perplexity(tokens, n_ctx)
    assert result.chunks == len(tokens) // n_ctx and result.n_ctx == n_ctx and result.tokens == count
    assert result.ppl == pytest.approx(ppl, rel=2e-4)
    assert result.error == pytest.approx(err, rel=2e-3)
    # eval's own chunking (used for PyTorch) gives the same numbers from the same log-probs
    mine = torch_ppl.chunked_nll(ref.logprobs, tokens, n_ctx, bos=BOS)
    assert mine.ppl == pytest.approx(ppl, rel=1e-12) and mine.error == pytest.approx(err, rel=1e-9)
    assert mine.tokens == count


@needs_perplexity
def test_perplexity_text_too_short(tiny_gguf, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("the cat sat")
    with pytest.raises(NblError, match="need at least 128 tokens"):
        runtime_ppl.perplexity(tiny_gguf, path, n_ctx=64)


# --- HellaSwag --------------------------------------------------------------------------------

@needs_perplexity
def test_hellaswag_matches_numpy(tiny, tiny_gguf, tmp_path):
    rng = np.random.default_rng(1)
    ref = Reference(tiny)
    lines, expected, margins = [], 0, []
    for task in range(10):
        context = sentence(rng, 6)
        endings = [sentence(rng, int(rng.integers(2, 5))) for _ in range(4)]
        scores = ref.ending_scores([tokenize(context + " " + e) for e in endings])
        best = int(np.argmax(scores))
        margins.append(sorted(scores)[-1] - sorted(scores)[-2])
        gold = best if task % 3 else (best + 1) % 4  # every task's decision matters
        expected += gold == best
        lines += [context, str(gold), *endings]
    assert min(margins) > 1e-4  # the float32 tool and float64 numpy cannot disagree on these
    path = tmp_path / "hellaswag.txt"
    path.write_text("\n".join(lines) + "\n")
    acc = llama_ppl.hellaswag(tiny_gguf, path, n_ctx=128, threads=THREADS)
    assert acc.tasks == 10
    assert acc.accuracy == pytest.approx(100 * expected / 10)
    assert acc.ci95 == pytest.approx(llama_ppl._wilson(expected, 10), abs=1e-3)


# --- Winogrande -------------------------------------------------------------------------------

@needs_perplexity
def test_winogrande_matches_numpy(tiny, tiny_gguf, tmp_path):
    rng = np.random.default_rng(2)
    ref = Reference(tiny)
    rows, lines = [], []
    for index in range(8):
        first, second = sentence(rng, 4) + " ", " " + sentence(rng, int(rng.integers(1, 6)))
        choices = (rng.choice(WORDS), rng.choice(WORDS[::-1]))
        if index == 5:  # a short tail: the tool scores from the common prefix instead of after the choice
            second = "."
        row = {"first": first, "second": second, "choices": choices, "answer": int(rng.integers(1, 3))}
        rows.append(row)
        quoted = f'"{first}_{second}"' if index % 2 else f"{first}_{second}"
        lines.append(f"{index},{quoted},{choices[0]},{choices[1]},{row['answer']}")
    path = tmp_path / "winogrande.csv"
    path.write_text("\n".join(lines) + "\n")
    acc = llama_ppl.winogrande(tiny_gguf, path, n_ctx=128, threads=THREADS)
    assert acc.tasks == 8  # the last row is scored too (eval feeds llama-perplexity a terminated copy)
    correct = 0
    for row, (s1, s2, result, answer) in zip(rows, acc.per_task):
        r1, r2 = ref.winogrande_scores(row)
        assert (s1, s2) == pytest.approx((r1, r2), abs=2e-4)
        assert result == (1 if r1 > r2 else 2) and answer == row["answer"]
        correct += result == answer
    assert acc.accuracy == pytest.approx(100 * correct / 8)
    assert acc.stderr == pytest.approx(llama_ppl._stderr(correct / 8, 8))


def test_winogrande_reader_matches_perplexity_cpp():
    text = ('0,"Sarah, not Maria, said _ won.",Sarah,Maria,2\n'
            "1,no blank here,a,b,1\n"
            "2,The _ sat.,cat,dog,3\n"
            "3,too,few,commas\n"
            "4,The _ ran.,cat,dog,1\n"
            "5,unterminated _ last line,a,b,1")
    rows, skipped = task_formats.winogrande_rows(text)
    assert [(r["first"], r["second"], r["choices"], r["answer"]) for r in rows] == [
        ("Sarah, not Maria, said ", " won.", ("Sarah", "Maria"), 2), ("The ", " ran.", ("cat", "dog"), 1)]
    assert len(skipped) == 3  # no _, answer 3, too few commas; the unterminated last line is not read


# --- binary multiple choice --------------------------------------------------------------------

def test_multiple_choice_serializer_round_trip_and_layout():
    tasks = [{"question": "Q one?", "answers": ["yes", "no"], "labels": [1, 0]},
             {"question": "Q twö", "answers": ["a", "b", "c"], "labels": [0, 0, 1],
              "mc2_answers": ["a"], "mc2_labels": [1]}]
    data = task_formats.serialize_multiple_choice(tasks)
    n_task, p0, p1 = struct.unpack_from("<3I", data)
    assert n_task == 2 and p0 == 12
    assert struct.unpack_from("<I", data, p0)[0] == len(b"Q one?") and data[p0 + 4:p0 + 10] == b"Q one?"
    assert struct.unpack_from("<I", data, p1)[0] == len("Q twö".encode())
    back = task_formats.read_multiple_choice(data)
    assert back[0]["answers"] == ["yes", "no"] and back[0]["labels"] == [1, 0] and back[0]["mc2_answers"] == []
    assert back[1]["question"] == "Q twö" and back[1]["mc2_labels"] == [1]


@needs_perplexity
def test_multiple_choice_matches_numpy(tiny, tiny_gguf, tmp_path):
    rng = np.random.default_rng(3)
    ref = Reference(tiny)
    tasks, running, correct, margins = [], [], 0, []
    for index in range(9):
        question = sentence(rng, 5) + "?"
        answers = [sentence(rng, int(rng.integers(1, 4))) for _ in range(int(rng.integers(2, 6)))]
        scores = ref.ending_scores([tokenize(question + " " + a) for a in answers])
        best = int(np.argmax(scores))
        margins.append(sorted(scores)[-1] - sorted(scores)[-2])
        gold = best if index % 2 else (best + 1) % len(answers)
        labels = [int(i == gold) for i in range(len(answers))]
        tasks.append({"question": question, "answers": answers, "labels": labels})
        correct += gold == best
        running.append(100 * correct / (index + 1))
    assert min(margins) > 1e-4
    path = task_formats.write_multiple_choice(tmp_path / "mc.bin", tasks)
    acc = llama_ppl.multiple_choice(tiny_gguf, path, n_ctx=128, threads=THREADS)
    assert acc.tasks == 9
    assert acc.per_task == pytest.approx(running, abs=1e-6)  # task by task, in file order
    assert acc.accuracy == pytest.approx(100 * correct / 9, abs=1e-3)
    assert acc.stderr == pytest.approx(llama_ppl._stderr(correct / 9, 9), abs=1e-3)


# --- parsers on canned output --------------------------------------------------------------------

PPL_OUTPUT = """0.01.675.631 I perplexity: calculating perplexity over 3 chunks, n_ctx=128, batch_size=128, n_seq=1
0.95 minutes
       0  420.9165  6.042435  0.126143
     128  403.0389  5.999033  0.080245
     256  444.3008  6.096502  0.067298

0.24.912.063 I Final estimate: PPL = 444.3008 +/- 29.90065
"""


def test_parse_perplexity():
    result = runtime_ppl.parse_perplexity(PPL_OUTPUT)
    assert (result.ppl, result.error, result.chunks, result.n_ctx, result.tokens) == (444.3008, 29.90065, 3, 128, 189)
    # the final line lost: the running line of the last chunk has the same numbers
    lost = runtime_ppl.parse_perplexity(PPL_OUTPUT.split("\n\n")[0])
    assert lost.ppl == 444.3008 and lost.error == pytest.approx(444.3008 * 0.067298)
    with pytest.raises(llama_ppl.IncompleteOutput):
        runtime_ppl.parse_perplexity(PPL_OUTPUT.split("     256")[0])
    with pytest.raises(NblError, match="you need at least 1024 tokens"):
        runtime_ppl.parse_perplexity("0.01.6 E perplexity: you need at least 1024 tokens to evaluate perplexity with a "
                            "context of 512\n")


def test_parse_hellaswag():
    out = ("hellaswag_score : selecting 3 randomized tasks.\n\ntask\tacc_norm\t95% confidence interval\n"
           "1\t100.00000000%\t[20.6549%, 100.0000%]\n2\t50.00000000%\t[9.4531%, 90.5469%]\n"
           "3\t66.66666667%\t[20.7660%, 93.8508%]\n\n")
    acc = llama_ppl.parse_hellaswag(out)
    assert (acc.accuracy, acc.tasks, acc.ci95) == (66.66666667, 3, (20.7660, 93.8508))
    assert acc.ci95 == pytest.approx(llama_ppl._wilson(2, 3), abs=1e-4)
    with pytest.raises(llama_ppl.IncompleteOutput, match="2 of 3"):
        llama_ppl.parse_hellaswag(out.split("3\t66")[0])
    with pytest.raises(NblError, match="multiple of 6"):
        llama_ppl.parse_hellaswag("0.00.1 E hellaswag_score : number of lines in prompt not a multiple of 6.\n")


def test_parse_winogrande():
    lines = "".join(f"{i + 1}\t{100.0 * (i // 2 + 1) / (i + 1):.4f}\t  -5.855519   -5.815276  {1 + i % 2}  2\n"
                    for i in range(4))
    acc = llama_ppl.parse_winogrande("winogrande_score : loaded 4 tasks from prompt.\n" + lines)
    assert acc.tasks == 4 and acc.accuracy == 50.0 and acc.stderr == pytest.approx(llama_ppl._stderr(0.5, 4))
    assert acc.per_task[1] == (-5.855519, -5.815276, 2, 2)
    final = llama_ppl.parse_winogrande("winogrande_score : loaded 4 tasks\n" + lines +
                                "\nFinal Winogrande score(4 tasks): 50.0000 +/- 28.8675\n")
    assert (final.accuracy, final.stderr) == (50.0, 28.8675)
    with pytest.raises(llama_ppl.IncompleteOutput):
        llama_ppl.parse_winogrande("winogrande_score : loaded 5 tasks from prompt.\n" + lines)


def test_parse_multiple_choice():
    out = ("multiple_choice_score : calculating TruthfulQA score over 2 tasks.\n\ntask\tacc_norm\n"
           "1\t100.00000000\n2\t50.00000000\n\nFinal result: 50.0000 +/- 50.0000\nRandom chance: 40.0 +/- 1\n")
    acc = llama_ppl.parse_multiple_choice(out)
    assert (acc.accuracy, acc.stderr, acc.tasks, acc.per_task) == (50.0, 50.0, 2, [100.0, 50.0])
    assert llama_ppl.parse_multiple_choice(out.split("\n\nFinal")[0]).stderr == pytest.approx(50.0)
    with pytest.raises(NblError, match="failed to read task 2"):
        llama_ppl.parse_multiple_choice("E multiple_choice_score: failed to read task 2 of 3\n")


# --- bad input -------------------------------------------------------------------------------------

def test_bad_task_files(tmp_path):
    with pytest.raises(NblError, match="does not exist"):
        task_formats.check_hellaswag(tmp_path / "missing.txt")
    bad = tmp_path / "hs.txt"
    bad.write_text("ctx\n1\na\nb\nc\n")
    with pytest.raises(NblError, match="not a multiple of 6"):
        task_formats.check_hellaswag(bad)
    bad.write_text("ctx\nfour\na\nb\nc\nd\n")
    with pytest.raises(NblError, match="gold ending index"):
        task_formats.check_hellaswag(bad)
    wino = tmp_path / "w.csv"
    wino.write_text("index,sentence,option1,option2,answer\n1,no blank,a,b,1\n")
    with pytest.raises(NblError, match="no valid Winogrande rows"):
        task_formats.prepare_winogrande(wino, tmp_path)
    mc = tmp_path / "mc.bin"
    mc.write_bytes(task_formats.serialize_multiple_choice(
        [{"question": "q", "answers": ["a", "b"], "labels": [1, 0]}])[:-6])
    with pytest.raises(NblError, match="truncated|runs past"):
        task_formats.check_multiple_choice(mc)
    mc.write_text("this is not a binary task file at all\n")
    with pytest.raises(NblError, match="multiple-choice format"):
        task_formats.check_multiple_choice(mc)
    with pytest.raises(NblError, match="empty question"):
        task_formats.read_multiple_choice(
            task_formats.serialize_multiple_choice([{"question": "", "answers": ["a"], "labels": [1]}]))


@needs_perplexity
def test_cli_errors(tiny_gguf, tmp_path, capsys):
    def fails(*argv) -> str:
        assert cli.main(["eval", *argv]) == 2
        return capsys.readouterr().err

    assert "missing.gguf does not exist" in fails(str(tmp_path / "missing.gguf"))
    assert "no GGUF files given" in fails()
    bad = tmp_path / "hs.txt"
    bad.write_text("only\nfive\nlines\nin\nhere\n")
    assert "not a multiple of 6" in fails(str(tiny_gguf), "--hellaswag", str(bad))
    assert "does not exist" in fails(str(tiny_gguf), "--winogrande", str(tmp_path / "nope.csv"))
    assert "pass no GGUF files" in fails(str(tiny_gguf), "--sweep")
    assert "--cache-type q3_k: unknown KV cache type" in fails(str(tiny_gguf), "--cache-type", "q3_k")
    assert "--passkey-depths means nothing without --passkey" in fails(str(tiny_gguf), "--passkey-depths", "0.5")
    assert "1.5 is outside 0 (start) to 1 (end)" in fails(str(tiny_gguf), "--passkey", "512", "--passkey-depths", "0.5,1.5")
    assert "--passkey 32: a prompt of 32 tokens leaves no room" in fails(str(tiny_gguf), "--passkey", "32")
    # llama.cpp caps a sequence at the training context (4,096 here): the answer must fit beside the prompt
    assert "tiny.gguf is trained to 4,096, which must hold the prompt and its answer (ask for at most 4,072)" in \
        fails(str(tiny_gguf), "--passkey", "1024,4096")
    assert "--cache-type and --passkey measure the GGUF files given" in fails("--sweep", "--passkey", "512")


@needs_perplexity
def test_cli_table_and_json(tiny_gguf, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(sentence(np.random.default_rng(5), 60))
    mc = task_formats.write_multiple_choice(tmp_path / "mc.bin", [{"question": "the cat", "answers": ["sat", "ran"],
                                                          "labels": [1, 0]}])
    out = tmp_path / "r.json"
    assert cli.main(["eval", str(tiny_gguf), "--text", str(text), "-c", "64", "--multiple-choice", str(mc),
                     "-o", str(out), "-t", str(THREADS)]) == 0
    printed = capsys.readouterr().out
    assert "| tiny.gguf |" in printed and "scored tokens" in printed
    import json

    result = json.loads(out.read_text())[0]
    assert result["perplexity"]["n_ctx"] == 64 and result["multiple-choice"]["tasks"] == 1


# --- sweep report (synthetic numbers: the sweep itself needs minutes of conversions) -----------------

def test_sweep_report_files(tmp_path):
    from nbl_gguf.measurement import sweep, sweep_report

    main = [sweep.Config("baseline", 0, "cca")]
    for m, layers in ((1, [2]), (2, [1, 2])):
        main += [sweep.Config("attn-nbl", m, "cca", layers), sweep.Config("attn-drop", m, "cca", layers),
                 sweep.Config("block-nbl", m, "cca", layers[::-1][:m])]
    main.append(sweep.Config("attn-drop", 2, "cosine", [0, 3], variant="cosine layers"))
    criteria = [sweep.Config(method, 2, c, layers) for method in ("attn-nbl", "attn-drop") for c, layers in
                (("cca", [1, 2]), ("nmse", [0, 2]), ("cosine", [0, 1]))]
    quants = ["Q8_0", "Q4_K_M"]
    results, torch_results = {}, {}
    for i, config in enumerate(main + criteria):
        ppl = 10.0 * (1 + 0.1 * config.m * (3 if config.method == "attn-drop" else 1)) + i * 0.01
        torch_results[config.key] = {"ppl": ppl, "error": 0.1, "chunks": 2, "n_ctx": 64, "tokens": 62}
        for quant in ["F32"] + quants:
            results[(config.key, quant)] = {
                "perplexity": {"ppl": ppl * (1.01 if quant == "Q4_K_M" else 1.0), "error": 0.1, "chunks": 2,
                               "n_ctx": 64, "tokens": 62},
                "winogrande": {"accuracy": 60.0 - config.m, "tasks": 10, "stderr": 5.0, "ci95": [50.2, 69.8],
                               "printed_ci": False},
                "bench": {"pp": [100.0 * (1 + 0.1 * config.m), 5.0], "tg": [20.0 * (1 + 0.05 * config.m), 1.0]},
            }

    def kv(config):
        return 4 * 128, 128 * (4 - len(config.layers))

    task_files = {"winogrande": (tmp_path / "w.csv", None)}
    rows = sweep_report.collect_rows(main, criteria, quants, results, torch_results, kv, task_files)
    drop2 = next(r for r in rows if r["config"] == "Attn DROP-2" and r["quant"] == "q8_0")
    assert drop2["kv_saving"] == 0.5 and drop2["speedup_tg"] == pytest.approx(1.1)
    assert not any(r["method"] == "block-nbl" and r["backend"] == "llama.cpp" for r in rows)
    setup = {"command": "python -m nbl_gguf eval --sweep", "model": "tiny", "n_layer": 4,
             "artifact": {"data": {"nsamples": 8, "seqlen": 64, "tokens": 512, "dataset": "x"}},
             "text": "held-out", "ctx": 64, "chunks": 2, "tokens": 62, "criterion": "cca",
             "bench_args": "-p 8", "machine": "test", "elapsed_min": 0.1,
             "eval_min": 1.0, "torch_min": 2.0}
    md = tmp_path / "quality.md"
    md.write_text(f"old\n{sweep_report.NOTES_BEGIN}\nkeep me\n{sweep_report.NOTES_END}\n")
    sweep_report.write_markdown(md, rows, setup, main, criteria, quants, task_files)
    sweep_report.write_csv(tmp_path / "quality.csv", rows)
    sweep_report.plot(tmp_path / "quality.png", rows, quants, task_files, setup)
    text = md.read_text()
    assert "| Attn DROP-2 | 1 2 | 50.0% |" in text and "n/a (PyTorch only)" in text and "keep me" in text
    assert "| nmse | 0 2 |" in text and "python -m nbl_gguf eval --sweep" in text
    assert "| Attn DROP-2 (cosine layers) | 0 3 | 50.0% |" in text
    import csv

    with open(tmp_path / "quality.csv") as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == len(rows) and {"ppl", "speedup_tg", "winogrande_acc"} <= set(table[0])
    assert (tmp_path / "quality.png").stat().st_size > 10_000
