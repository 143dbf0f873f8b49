"""Window layers in PyTorch and their measured choice: apply.WindowAttention against the float64
reference forward of the tiny model with the same masks (whole sequence and a KV cache continued token
by token), and calibration.windows.choose_windows (layer-streamed) against the whole model run once per
candidate, with and without NBL layers replaced before it, by each of its rankings."""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
import torch

from _calibrate_helpers import sample_texts, tiny_model, word_tokenizer
from nbl_gguf.calibration.apply import ATTN_LINEAR, ATTN_WINDOW, apply_nbl
from nbl_gguf.calibration.windows import Window, choose_windows
from nbl_gguf.errors import NblError
from nbl_gguf.fixtures.tiny import TinyLlama
from nbl_gguf.gguf import nbl_format


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_window_attention_matches_the_reference_masks(implementation):
    tiny = TinyLlama(n_layer=4, n_head=8, n_head_kv=2, n_ctx_train=1024, seed=3)
    windows = nbl_format.Windows(layers=(0, 2), size=6, sinks=2)
    tokens = [int(t) for t in np.random.default_rng(0).integers(3, tiny.n_vocab, 60)]
    want = tiny.forward(tokens, windows=windows)
    assert np.abs(tiny.forward(tokens) - want).max() > 0.1  # the windows change the logits
    model = tiny.hf_model()
    model.config._attn_implementation = implementation
    apply_nbl(model, {0: ATTN_WINDOW, 2: ATTN_WINDOW}, {0: windows, 2: windows})
    with torch.no_grad():
        whole = model(torch.tensor([tokens])).logits[0].double().numpy()
        out = model(torch.tensor([tokens[:40]]), use_cache=True)
        # transformers 5 renamed past_key_values to cache (5.24 warns at the old name, 5.40 drops it)
        renamed = "cache" in inspect.signature(model.forward).parameters
        steps = []
        for i in range(40, 60):
            past = {"cache": out.cache} if renamed else {"past_key_values": out.past_key_values}
            out = model(torch.tensor([[tokens[i]]]), **past, use_cache=True)
            steps.append(out.logits[0, -1].double().numpy())
    assert np.abs(whole - want).max() < 1e-4
    assert np.abs(np.stack(steps) - want[40:]).max() < 1e-4


@pytest.mark.parametrize("size, sinks, block", [(37, 3, 1), (37, 3, 7), (37, 40, 16), (5, 0, 64), (300, 4, 32),
                                                 (37, 3, 1000)])
def test_windowed_attention_equals_the_dense_mask(size, sinks, block):
    """Blocks of queries over the sinks and the window before them: the keys window_visible shows, no other
    (sinks past the window's start, no sinks, a window longer than the sequence, one block for all)."""
    from nbl_gguf.calibration.apply import window_visible, windowed_attention

    generator = torch.Generator().manual_seed(size + sinks + block)
    query = torch.randn(2, 8, 300, 16, generator=generator, dtype=torch.float64)
    key, value = (torch.randn(2, 2, 300, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    positions = torch.arange(300)
    visible = window_visible(positions, positions, size, sinks)
    scores = (query @ key.repeat_interleave(4, 1).transpose(-1, -2) / 4).masked_fill(~visible, float("-inf"))
    want = scores.softmax(-1) @ value.repeat_interleave(4, 1)
    got = windowed_attention(query, key, value, size, sinks, scale=0.25, block=block)
    assert (got - want).abs().max() < 1e-12


def test_a_long_window_layer_runs_by_blocks_and_matches_the_reference(monkeypatch):
    """Past WINDOW_BLOCK tokens with no cache before them, a window layer of an sdpa model runs windowed_attention
    (counted) and gives the reference's logits; eager, or a mask of the model's own, keeps the dense mask."""
    from nbl_gguf.calibration import apply

    tiny = TinyLlama(n_layer=4, n_head=8, n_head_kv=2, n_ctx_train=1024, seed=3)
    windows = nbl_format.Windows(layers=(0, 2), size=6, sinks=2)
    tokens = [int(t) for t in np.random.default_rng(1).integers(3, tiny.n_vocab, 70)]
    want = tiny.forward(tokens, windows=windows)
    monkeypatch.setattr(apply, "WINDOW_BLOCK", 8)
    calls = []
    blocked = apply.windowed_attention
    monkeypatch.setattr(apply, "windowed_attention", lambda *a, **k: calls.append(a[3:5]) or blocked(*a, **k))
    for implementation, runs in (("sdpa", [(6, 2), (6, 2)]), ("eager", [])):
        model = tiny.hf_model()
        model.config._attn_implementation = implementation
        apply_nbl(model, {0: ATTN_WINDOW, 2: ATTN_WINDOW}, {0: windows, 2: windows})
        calls.clear()
        with torch.no_grad():
            whole = model(torch.tensor([tokens])).logits[0].double().numpy()
        assert calls == runs
        assert np.abs(whole - want).max() < 1e-4
        assert model.config._attn_implementation == implementation  # the model's config is left as it was


@pytest.fixture(scope="module")
def stream_and_model(tmp_path_factory):
    from nbl_gguf.calibration.stream import LayerStream
    from nbl_gguf.model_source import resolve_model

    folder = tmp_path_factory.mktemp("window-select") / "model"
    tokenizer = word_tokenizer(sample_texts(50, 20, seed=2))
    model = tiny_model(layers=6, hidden=32, vocab=len(tokenizer), seed=4, max_position_embeddings=256)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    ids = torch.randint(4, len(tokenizer), (2, 96), generator=torch.Generator().manual_seed(5))
    return LayerStream(resolve_model(str(folder)), torch.float32, "cpu"), model, ids


def whole_model_loss(model, ids, kinds, maps) -> float:
    import copy

    variant = apply_nbl(copy.deepcopy(model), kinds, maps)
    with torch.no_grad():
        logits = variant(ids).logits.double()
    first = ids.shape[1] // 2
    nll = torch.nn.functional.cross_entropy(logits[:, first:-1].reshape(-1, logits.shape[-1]),
                                            ids[:, first + 1:].reshape(-1), reduction="none")
    return float(nll.mean())


def random_maps(replaced) -> dict:
    """Random (W, b) maps of the tiny model's width for the layers of ``replaced``."""
    rng = np.random.default_rng(1)
    return {i: ((0.1 * rng.standard_normal((32, 32))).astype(np.float32), (0.1 * rng.standard_normal(32)).astype(np.float32))
            for i in replaced}


@pytest.mark.parametrize("replaced", [{}, {1: ATTN_LINEAR, 4: ATTN_LINEAR}])
def test_choice_equals_the_whole_model_measured_per_candidate(stream_and_model, replaced):
    stream, model, ids = stream_and_model
    window, linear = Window(size=4, sinks=1), random_maps(replaced)
    choice = choose_windows(stream, ids, 2, window, replaced=replaced, maps=lambda layer, _type: linear[layer])
    assert choice.ranking == "loss" and not choice.local_errors

    base = whole_model_loss(model, ids, replaced, linear)
    pool = [i for i in range(6) if i not in replaced]
    want = {i: whole_model_loss(model, ids, {**replaced, i: ATTN_WINDOW}, {**linear, i: window}) - base for i in pool}
    assert choice.base_loss == pytest.approx(base, abs=1e-5)
    assert sorted(choice.increases) == pool
    for layer in pool:
        assert choice.increases[layer] == pytest.approx(want[layer], abs=1e-5)
    assert max(abs(v) for v in want.values()) > 1e-3  # a window costs something here: the ranking means something
    assert choice.layers == tuple(sorted(sorted(pool, key=lambda i: want[i])[:2]))
    together = whole_model_loss(model, ids, {**replaced, **{i: ATTN_WINDOW for i in choice.layers}},
                                {**linear, **{i: window for i in choice.layers}})
    assert choice.loss == pytest.approx(together, abs=1e-5)


def layer_io(model, ids, kinds, maps) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each decoder layer's (input, output) hidden states of the whole model with ``kinds`` replaced."""
    import copy

    variant = apply_nbl(copy.deepcopy(model), kinds, maps)
    seen, hooks = {}, []
    for k, layer in enumerate(variant.model.layers):
        def hook(_module, args, kwargs, out, k=k):
            hidden = args[0] if args else kwargs["hidden_states"]
            seen[k] = (hidden.detach().double(), (out[0] if isinstance(out, tuple) else out).detach().double())
        hooks.append(layer.register_forward_hook(hook, with_kwargs=True))
    with torch.no_grad():
        variant(ids)
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize("replaced", [{}, {1: ATTN_LINEAR, 4: ATTN_LINEAR}])
def test_the_local_ranking_equals_each_layer_windowed_in_the_whole_model(stream_and_model, replaced):
    stream, model, ids = stream_and_model
    window, linear = Window(size=4, sinks=1), random_maps(replaced)
    choice = choose_windows(stream, ids, 2, window, replaced=replaced, maps=lambda layer, _type: linear[layer],
                            ranking="local")
    assert choice.ranking == "local" and not choice.increases

    full = layer_io(model, ids, replaced, linear)
    half = ids.shape[1] // 2
    pool = [i for i in range(6) if i not in replaced]
    want = {}
    for layer in pool:
        windowed = layer_io(model, ids, {**replaced, layer: ATTN_WINDOW}, {**linear, layer: window})
        assert torch.allclose(windowed[layer][0], full[layer][0], atol=1e-5)  # the same track up to the layer
        hidden, out = full[layer]
        want[layer] = float((windowed[layer][1] - out)[:, half:].pow(2).sum() / (out - hidden)[:, half:].pow(2).sum())
    assert sorted(choice.local_errors) == pool
    for layer in pool:
        assert choice.local_errors[layer] == pytest.approx(want[layer], rel=1e-3, abs=1e-7)
    assert max(want.values()) > 3 * min(want.values())  # the layers differ: the order means something
    assert choice.layers == tuple(sorted(sorted(pool, key=lambda i: want[i])[:2]))
    assert choice.order == sorted(pool, key=lambda i: (want[i], i))
    base = whole_model_loss(model, ids, replaced, linear)
    together = whole_model_loss(model, ids, {**replaced, **{i: ATTN_WINDOW for i in choice.layers}},
                                {**linear, **{i: window for i in choice.layers}})
    assert choice.base_loss == pytest.approx(base, abs=1e-5)
    assert choice.loss == pytest.approx(together, abs=1e-5)
    assert choice.report()["ranking"] == "local" and "increases" not in choice.report()
    from pathlib import Path

    from nbl_gguf.commands.convert_summary import Summary

    line = Summary(model="tiny", quant="F32", method="attn-nbl", criterion="best", n_layer=6, replaced=sorted(replaced),
                   scores=None, stock_bytes=1, nbl_bytes=1, kv={}, output=Path("tiny.gguf"),
                   windows=choice.report()).window_lines()[0]
    errors = ", ".join(f"{layer}: {choice.local_errors[layer]:.1%}" for layer in choice.layers)  # the figures: above
    assert f"chosen by each one's error on its own layer's output ({errors}) and together " \
           f"{np.expm1(choice.loss - choice.base_loss):+.1%}" in line


def test_bad_choices_are_refused_by_name(stream_and_model):
    stream, _, ids = stream_and_model
    with pytest.raises(NblError, match="7 window layers asked of 6"):
        choose_windows(stream, ids, 7, Window(8, 2))
    with pytest.raises(NblError, match="measure at least 97"):
        choose_windows(stream, ids, 1, Window(48, 2))
    with pytest.raises(NblError, match="are replaced layers"):
        choose_windows(stream, ids, 1, Window(8, 2), replaced={1: ATTN_LINEAR}, candidates=[1, 2])
    with pytest.raises(NblError, match="window ranking 'cosine': one of local, loss"):
        choose_windows(stream, ids, 1, Window(8, 2), ranking="cosine")
    with pytest.raises(NblError, match="a window of 0 tokens"):
        Window(0, 2)


def char_tokenizer(texts):
    """A character-level fast tokenizer (every digit its own token, as in our models' tokenizers)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted({c for t in texts for c in t})
    vocab = {"[PAD]": 0, "[BOS]": 1, "[UNK]": 2} | {c: i + 3 for i, c in enumerate(chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="[BOS]", unk_token="[UNK]", pad_token="[PAD]")


def test_retrieval_probes_hide_the_fact_beyond_the_window_and_score_its_answer():
    from nbl_gguf.calibration import windows as w

    text = "the quick brown fox jumps over the lazy dog; " * 40
    tokenizer = char_tokenizer([text, w.PROBE_NEEDLE, w.PROBE_QUESTION, "0123456789", *w.PROBE_NAMES])
    ctx, window = 900, Window(size=200, sinks=3)
    ids = torch.tensor([[1] + tokenizer(text, add_special_tokens=False)["input_ids"][:ctx - 1]] * 2)
    probes = w.retrieval_probes(tokenizer, ids, window, depths=(0.0, 1.0), seed=7)
    assert probes.ids.shape == (4, ctx) and probes.scored.shape == (4, ctx - 1)
    for row, scored, distance in zip(probes.ids, probes.scored, probes.distances):
        decoded = tokenizer.decode(row[1:]).replace(" ", "")
        answer = tokenizer.decode(row[1:][scored]).replace(" ", "")  # row t of token_nll predicts token t + 1
        assert len(answer) == 5 and answer.isdigit() and scored.sum() == 6  # the key, after its space
        name = next(n for n in w.PROBE_NAMES if w.PROBE_QUESTION.format(name=n).replace(" ", "") in decoded)
        needle = w.PROBE_NEEDLE.format(name=name, key=answer).replace(" ", "")
        assert decoded.count(needle) == 1 and decoded.endswith(answer + ".")
        assert int(row[0]) == 1 and distance > window.size
        question = tokenizer(w.PROBE_QUESTION.format(name=name) + f" {answer}.", add_special_tokens=False)["input_ids"]
        needle_ids = tokenizer(w.PROBE_NEEDLE.format(name=name, key=answer), add_special_tokens=False)["input_ids"]
        at = next(i for i in range(ctx) if row[i:i + len(needle_ids)].tolist() == needle_ids)
        assert ctx - len(question) - at - len(needle_ids) == distance
        assert at > window.sinks  # not a fact the sinks keep
        assert row[1:at].tolist() == ids[0, 1:at].tolist()  # the text itself around the fact
    assert probes.distances[0] > probes.distances[1]  # depth 0: the fact farthest back
    with pytest.raises(NblError, match="needs more than 900 tokens at a window of 800"):
        w.retrieval_probes(tokenizer, ids, Window(size=800, sinks=3))


def whole_model_answer_loss(model, probes, kinds, maps) -> float:
    import copy

    variant = apply_nbl(copy.deepcopy(model), kinds, maps)
    with torch.no_grad():
        logits = variant(probes.ids).logits.double()
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), probes.ids[:, 1:].reshape(-1),
                                            reduction="none").reshape(probes.scored.shape)
    return float(nll[probes.scored].mean())


def test_the_retrieval_walk_equals_the_whole_model_measured_per_step(stream_and_model):
    from nbl_gguf.calibration.windows import RetrievalProbes

    stream, model, ids = stream_and_model
    window = Window(size=4, sinks=1)
    probe_ids = torch.randint(4, 40, (2, 96), generator=torch.Generator().manual_seed(9))
    probe_ids[:, 85:91] = probe_ids[:, 10:16]  # a span repeated from far back: what only a full layer can see
    scored = torch.zeros(2, 95, dtype=torch.bool)
    scored[:, 85:90] = True
    probes = RetrievalProbes(probe_ids, scored, (69, 69))
    free = choose_windows(stream, ids, 1, window)
    by_text = sorted(free.increases, key=lambda i: (free.increases[i], i))

    # the walk done here on the whole model, at a tolerance that keeps some layers and refuses others
    base = whole_model_answer_loss(model, probes, {}, {})
    alone = sorted(whole_model_answer_loss(model, probes, {i: ATTN_WINDOW}, {i: window}) - base for i in by_text)
    tolerance = (alone[2] + alone[3]) / 2
    kept, refused = [], {}
    for layer in by_text:
        if len(kept) == 3:
            break
        layers = kept + [layer]
        loss = whole_model_answer_loss(model, probes, {i: ATTN_WINDOW for i in layers}, {i: window for i in layers})
        if loss <= base + tolerance:
            kept.append(layer)
        else:
            refused[layer] = loss
    assert kept and refused  # the tolerance divides: the test can tell a walk from a ranking

    choice = choose_windows(stream, ids, 3, window, probes=probes, tolerance=tolerance)
    guard = choice.retrieval
    assert guard.base_loss == pytest.approx(base, abs=1e-5)
    assert guard.kept == kept and sorted(guard.refused) == sorted(refused)
    for layer, loss in refused.items():
        assert guard.refused[layer] == pytest.approx(loss, abs=1e-5)
    fill = sorted(refused, key=lambda i: refused[i])[:3 - len(kept)]
    assert choice.layers == tuple(sorted(kept + fill))
    assert choice.order[:len(kept)] == kept and sorted(choice.order) == sorted(by_text)
    assert choice.report()["retrieval"]["kept"] == kept
    # holding fewer layers' inputs (the walk restarting from an earlier one) changes nothing
    from nbl_gguf.calibration.windows import guarded_walk

    sparse = guarded_walk(stream, probes, by_text, 3, {}, lambda layer, _type: window, tolerance, hold_bytes=1)
    assert (sparse.kept, sparse.losses, sparse.refused) == (guard.kept, guard.losses, guard.refused)


def test_the_retrieval_walk_of_replaced_layers_equals_the_whole_model_measured_per_step(stream_and_model):
    """calibration.recall's walk: guarded_walk with linear maps in place of windows, against the whole model
    with each step's set replaced."""
    from nbl_gguf.calibration.recall import walk_order
    from nbl_gguf.calibration.windows import RetrievalProbes, guarded_walk

    stream, model, _ = stream_and_model
    probe_ids = torch.randint(4, 40, (2, 96), generator=torch.Generator().manual_seed(13))
    probe_ids[:, 84:92] = probe_ids[:, 20:28]
    scored = torch.zeros(2, 95, dtype=torch.bool)
    scored[:, 84:91] = True
    probes = RetrievalProbes(probe_ids, scored, (64, 64))
    linear = random_maps(range(6))
    order = walk_order([3, 1], [5, 3, 0, 1, 4, 2])
    assert order == [3, 1, 5, 0, 4, 2]

    base = whole_model_answer_loss(model, probes, {}, {})
    alone = sorted(whole_model_answer_loss(model, probes, {i: ATTN_LINEAR}, {i: linear[i]}) - base for i in order)
    tolerance = (alone[1] + alone[2]) / 2
    kept, refused = [], {}
    for layer in order:
        if len(kept) == 2:
            break
        layers = kept + [layer]
        loss = whole_model_answer_loss(model, probes, {i: ATTN_LINEAR for i in layers}, {i: linear[i] for i in layers})
        if loss <= base + tolerance:
            kept.append(layer)
        else:
            refused[layer] = loss
    assert kept and refused  # the tolerance keeps some and refuses some: the walk goes past the selection

    guard = guarded_walk(stream, probes, order, 2, {}, lambda layer, _type: linear[layer], tolerance,
                         layer_type=ATTN_LINEAR)
    assert guard.base_loss == pytest.approx(base, abs=1e-5)
    assert guard.kept == kept and sorted(guard.refused) == sorted(refused)
    for layer, loss in refused.items():
        assert guard.refused[layer] == pytest.approx(loss, abs=1e-5)
    fill = sorted(refused, key=lambda i: refused[i])[:2 - len(kept)]
    assert guard.chosen(2) == tuple(sorted(kept + fill))
    with pytest.raises(NblError, match=r"layers \[7\] of the selection are not in the ranking"):
        walk_order([7], [0, 1])


def test_global_recall_equals_the_whole_model_with_each_layer_global_in_turn(stream_and_model):
    from nbl_gguf.calibration.windows import RetrievalProbes, global_recall

    stream, model, _ = stream_and_model
    window = Window(size=4, sinks=1)
    probe_ids = torch.randint(4, 40, (2, 96), generator=torch.Generator().manual_seed(11))
    probe_ids[:, 80:88] = probe_ids[:, 12:20]
    scored = torch.zeros(2, 95, dtype=torch.bool)
    scored[:, 80:87] = True
    probes = RetrievalProbes(probe_ids, scored, (60, 60))
    replaced = {1: ATTN_LINEAR}
    rng = np.random.default_rng(3)
    linear = {1: ((0.1 * rng.standard_normal((32, 32))).astype(np.float32), (0.1 * rng.standard_normal(32)).astype(np.float32))}
    windows = (4, 0, 3)

    recall = global_recall(stream, probes, windows, window, replaced=replaced, maps=lambda k, _type: linear[k])
    every = {**replaced, **{i: ATTN_WINDOW for i in windows}}
    maps = {**linear, **{i: window for i in windows}}
    assert recall.base_loss == pytest.approx(whole_model_answer_loss(model, probes, every, maps), abs=1e-5)
    want = {layer: whole_model_answer_loss(model, probes, {k: t for k, t in every.items() if k != layer}, maps)
            for layer in windows}
    assert sorted(recall.losses) == sorted(windows)
    for layer in windows:
        assert recall.losses[layer] == pytest.approx(want[layer], abs=1e-5)
    assert len({round(v, 4) for v in want.values()}) == 3  # the layers differ: the ranking means something
    assert recall.ranking == sorted(windows, key=lambda i: want[i])
    assert recall.report()["ranking"] == recall.ranking


def test_repeated_filler_keeps_the_first_token_and_repeats_a_piece_of_each_text():
    from nbl_gguf.calibration.windows import repeated_filler

    ids = torch.arange(2 * 50).reshape(2, 50)
    out = repeated_filler(ids, piece=7)
    assert out.shape == ids.shape and out[:, 0].tolist() == ids[:, 0].tolist()
    for row in range(2):
        unit = ids[row, 1:8].tolist()
        assert out[row, 1:].tolist() == (unit * 8)[:49]
    with pytest.raises(NblError, match="more than 8 tokens"):
        repeated_filler(ids[:, :8], piece=7)


def test_scored_nll_is_token_nll_at_the_scored_positions(stream_and_model):
    """The head on the scored rows alone: the same values as the whole window's token_nll there, in row-major
    order (windows.scored_loss's probes score a few answer tokens each)."""
    stream, _, ids = stream_and_model
    stream.prepare_embedding(ids)
    try:
        hidden = stream.embed(ids)
    finally:
        stream.release_embedding()
    scored = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)
    scored[0, [3, 50, 94]] = True
    scored[1, 10:14] = True
    stream.load_head()
    try:
        whole = stream.token_nll(hidden, ids)
        got = stream.scored_nll(hidden, ids, scored)
    finally:
        stream.release_head()
    assert got.shape == (7,)
    assert torch.allclose(got, whole[scored], atol=1e-6)
    assert whole[scored].std() > 1e-3  # distinct values: the order is checked too


def test_a_choice_read_back_from_its_report_is_the_same_choice():
    """convert keeps --windows' choice as its report (measurement.memo); read back it is the choice, field by field,
    with a retrieval walk and a recall ranking, and with the local ranking."""
    from nbl_gguf.calibration.windows import GlobalRecall, RetrievalGuard, WindowChoice

    walk = RetrievalGuard(6, (3000, 2000), 0.15, 0.41, kept=[5, 2, 7], losses=[0.45, 0.5, 0.52],
                          refused={9: 0.9, 1: 0.7})
    recall = GlobalRecall((2, 5, 7), 0.52, {2: 0.3, 5: 0.1, 7: 0.5})
    by_loss = WindowChoice((1, 2, 5, 7), Window(512, 4), 4096, 3, 2.25, 2.31, {1: 0.5, 2: 0.01, 5: -0.02, 7: 0.03, 9: 0.2},
                           walk, recall)
    local = WindowChoice((0, 3), Window(128, 0), 1024, 2, 1.5, 1.6, local_errors={0: 0.25, 3: 0.125, 4: 2.0})
    for choice in (by_loss, local):
        again = WindowChoice.from_report(json.loads(json.dumps(choice.report())))
        assert again == choice and again.report() == choice.report() and again.order == choice.order
