"""Passkey retrieval: a five-digit number hidden at some depth of filler text, asked for at the end
(Mohtashami and Jaggi's test). A window layer, or a replaced one, that loses what lies far back shows
here when a perplexity averaged over every token barely moves.

The model runs in-process through llama-cpp-python with llama-cli's settings that matter for the
cache: one sequence, ``swa_full`` off (llama-cpp-python's default is on, which would keep the whole
context in the window layers and hide what they lose), and the KV cache type asked for.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from nbl_gguf.errors import NblError

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about it.\n\n")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
ANSWER_TOKENS = 8
HEADROOM = ANSWER_TOKENS + 16  # cells beyond the prompt: the answer, and a margin


@dataclass(frozen=True)
class Trial:
    n_ctx: int
    depth: float
    key: int
    prompt_tokens: int
    answer: str

    @property
    def found(self) -> bool:
        return re.search(rf"(?<!\d){self.key}(?!\d)", self.answer) is not None


@dataclass
class PasskeyResult:
    trials: list[Trial] = field(default_factory=list)

    def found(self, n_ctx: int | None = None) -> list[bool]:
        """Whether each trial (at prompt length ``n_ctx``, or any) found its key, in trial order."""
        return [t.found for t in self.trials if n_ctx is None or t.n_ctx == n_ctx]

    def accuracy(self, n_ctx: int | None = None) -> float:
        found = self.found(n_ctx)
        return sum(found) / len(found) if found else float("nan")

    def report(self) -> dict:
        lengths = sorted({t.n_ctx for t in self.trials})
        return {"accuracy": {str(n): self.accuracy(n) for n in lengths},
                "trials": [{"n_ctx": t.n_ctx, "depth": t.depth, "key": t.key, "prompt_tokens": t.prompt_tokens,
                            "answer": t.answer, "found": t.found} for t in self.trials]}


def found_of_asked(found) -> str:
    """'3/5': the keys found of those asked, as the tables show them."""
    return f"{sum(found)}/{len(found)}"


def build_prompt(count_tokens, n_tokens: int, depth: float, key: int) -> str:
    """Filler around the needle at ``depth`` (0: start, 1: end) so that the prompt takes about
    ``n_tokens`` tokens by ``count_tokens`` (and never more)."""
    if not 0.0 <= depth <= 1.0:
        raise NblError(f"passkey depth {depth}: give 0 to 1")
    needle = NEEDLE.format(key=key)
    fixed = count_tokens(INTRO + needle + QUESTION)
    per_filler = count_tokens(FILLER * 20) / 20
    repeats = int((n_tokens - fixed) / per_filler)
    if repeats < 2:
        raise NblError(f"a passkey prompt of {n_tokens} tokens leaves no room for filler")
    while repeats > 1:
        before = int(round(repeats * depth))
        prompt = INTRO + FILLER * before + needle + FILLER * (repeats - before) + QUESTION
        if count_tokens(prompt) <= n_tokens:
            return prompt
        repeats -= 1
    raise NblError(f"a passkey prompt of {n_tokens} tokens leaves no room for filler")


def longest_prompt(n_ctx: int) -> int:
    """The longest passkey prompt whose answer still fits a context of ``n_ctx`` cells."""
    return n_ctx - HEADROOM


def check_lengths(model, lengths) -> None:
    """llama.cpp caps a sequence at the training context: a prompt and its answer beyond it find no cell."""
    from nbl_gguf.gguf.metadata import open_gguf, training_context

    trained = training_context(open_gguf(model))
    if trained and max(lengths) + HEADROOM > trained:
        raise NblError(f"passkey prompts of {max(lengths):,} tokens: {Path(model).name} is trained to {trained:,}, "
                       f"which must hold the prompt and its answer (ask for at most {longest_prompt(trained):,})")


def token_counter(llm):
    """Tokens of a text by ``llm``'s tokenizer, BOS included: what build_prompt fills a length with."""
    return lambda text: len(llm.tokenize(text.encode("utf-8"), add_bos=True))


def check_prompts(model, lengths) -> None:
    """check_lengths, and a prompt of each length holds the needle and some filler by the model's own tokenizer
    (its vocabulary alone loaded, in a second): a length that cannot is refused before minutes of measuring."""
    from nbl_gguf.llamacpp import library

    check_lengths(model, lengths)
    llm, _ = library.load_model(model, vocab_only=True)
    try:
        for n_ctx in lengths:
            build_prompt(token_counter(llm), n_ctx, 0.5, 10000)
    finally:
        llm.close()


def passkey(model: str | Path, lengths=(4096,), depths=DEPTHS, *, seed: int = 0, kv_type: str = "f16",
            threads: int | None = None, n_gpu_layers: int | None = None) -> PasskeyResult:
    """Greedy answers of the GGUF ``model`` to one prompt per (length, depth), each with its own key."""
    from nbl_gguf.llamacpp import library

    check_lengths(model, lengths)
    rng = random.Random(seed)
    type_k, type_v = library.ggml_cache_types(kv_type)
    llm, _ = library.load_model(model, n_ctx=max(lengths) + HEADROOM, n_gpu_layers=n_gpu_layers,
                                swa_full=False, type_k=type_k, type_v=type_v, flash_attn=True, n_batch=512,
                                n_threads=threads, n_threads_batch=threads)
    try:
        count = token_counter(llm)
        result = PasskeyResult()
        for n_ctx in lengths:
            for depth in depths:
                key = rng.randrange(10000, 100000)
                prompt = build_prompt(count, n_ctx, depth, key)
                result.trials.append(Trial(n_ctx, depth, key, count(prompt), greedy_answer(llm, prompt)))
        return result
    finally:
        llm.close()


def greedy_answer(llm, prompt: str) -> str:
    """Greedy decoding after ``prompt`` up to ANSWER_TOKENS tokens or an end-of-generation token, as text.
    Counted in tokens: a completion counted in characters (llama-cpp-python's create_completion) holds back
    tokens that end inside a UTF-8 character, and a model that emits such bytes without end fills the context
    and fails."""
    import llama_cpp

    llm.reset()
    tokens = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
    answer = []
    for token in llm.generate(tokens, top_k=1, temp=0.0):
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, token):
            break
        answer.append(token)
        if len(answer) == ANSWER_TOKENS:
            break
    return llm.detokenize(answer, prev_tokens=tokens).decode("utf-8", errors="replace")
