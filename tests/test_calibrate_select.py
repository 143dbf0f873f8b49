"""Layer selection on tiny models (CPU, seconds): the streamed evaluator over a model in memory against
the plain forward, greedy joint selection against exhaustive search on a model whose best layers are
known by construction, and --m auto against its budget."""

import argparse
import copy
import itertools
import json
import math

import pytest
import torch
import transformers

from _calibrate_helpers import tiny_model, write_checkpoint
from nbl_gguf.commands import calibrate
from nbl_gguf.calibration import select as selection
from nbl_gguf.calibration.apply import ATTN_DROP, ATTN_LINEAR, apply_nbl
from nbl_gguf.calibration.artifact import load_artifact
from nbl_gguf.calibration.capture import capture_activations
from nbl_gguf.calibration.layer_fit import LayerFit
from nbl_gguf.calibration.solve import ranking
from nbl_gguf.calibration.stream import LayerStream
from nbl_gguf.calibration.variants import StreamedEvaluator
from nbl_gguf.errors import NblError
from nbl_gguf.models import decoder_layers, get_adapter

VOCAB = 97


def reference_loss(model, ids) -> float:
    """Mean next-token NLL over all positions by the model's own forward (the independent reference)."""
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)))


def family_model(family: str, layers: int = 4, seed: int = 0):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    if family == "llama":
        return tiny_model(layers=layers, vocab=VOCAB, seed=seed)
    torch.manual_seed(seed)
    if family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:  # gemma2: scaled embeddings, a norm after the attention, sliding windows, logit soft-capping
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**common, head_dim=8, sliding_window=8))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    model.config.use_cache = False
    return model.eval()


def windows(count=3, length=24, seed=1):
    return torch.randint(3, VOCAB, (count, length), generator=torch.Generator().manual_seed(seed))


def random_maps(model, seed=0):
    d = model.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    return {i: (0.1 * torch.randn(d, d, generator=g).numpy(), 0.1 * torch.randn(d, generator=g).numpy())
            for i in range(len(decoder_layers(model)))}


def evaluator(model, heldout, maps, **kwargs):
    """The calibration's evaluator, streaming the layers of ``model`` as it is in memory."""
    return StreamedEvaluator(LayerStream.resident(model), heldout, ATTN_LINEAR, lambda layer, _type: maps[layer],
                             **{"min_tokens": 0, **kwargs})


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_losses_equal_the_replaced_model_and_leave_the_model_as_it_was(family):
    model, ids = family_model(family), windows()
    maps = random_maps(model)
    before = {name: module for name, module in model.named_modules()}
    trials = evaluator(model, ids, maps, batch_size=2)
    assert trials.base_loss == pytest.approx(reference_loss(model, ids), rel=1e-5)
    one, both, none = trials.losses([[2], [3, 1], []])
    assert one == pytest.approx(reference_loss(apply_nbl(copy.deepcopy(model), {2: 1}, maps), ids), rel=1e-5)
    assert both == pytest.approx(reference_loss(apply_nbl(copy.deepcopy(model), {1: 1, 3: 1}, maps), ids), rel=1e-5)
    assert none == trials.base_loss
    assert {name: module for name, module in model.named_modules()} == before
    # the stream's own module tree is restored after each trial: the same set measures the same again
    assert trials.losses([[2]]) == [one]


# --- a model whose best layers are known by construction ----------------------------------------------

def constructed_qwen2(layers=5, linear=(1, 3), seed=0):
    """Qwen2 where the attention of ``linear`` layers is exactly linear in its input and large, and the
    other layers' attention is small but mixes tokens; the head is sharpened so that every change of
    the last hidden state shows in the loss.

    With W_q = W_k = 0 and equal large q/k biases, q_t . k_s = |b|^2 sum_i cos((t - s) theta_i) peaks
    sharply at s = t: every head attends to its own token only, so the attention output is
    W_o (W_v x + b_v), which the NBL map reproduces exactly. Scaling W_o up makes these layers turn
    the residual stream most, so the cosine criterion ranks them last.
    """
    model = family_model("qwen2", layers=layers, seed=seed)
    with torch.no_grad():
        for index, layer in enumerate(decoder_layers(model)):
            attn = layer.self_attn
            if index in linear:
                attn.q_proj.weight.zero_()
                attn.k_proj.weight.zero_()
                attn.q_proj.bias.fill_(30.0)
                attn.k_proj.bias.fill_(30.0)
                attn.o_proj.weight.mul_(6.0)
            else:
                attn.q_proj.weight.mul_(2.0)
                attn.k_proj.weight.mul_(2.0)
        model.lm_head.weight.mul_(10.0)
    return model


def continuations(model, count, length, seed):
    """The model's own greedy continuations of random 4-token prompts: text it predicts confidently."""
    ids = torch.randint(3, VOCAB, (count, 4), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        while ids.shape[1] < length:
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


def fitted_maps(model, ids):
    """(maps, cosine scores, nmse scores) of every layer, from one forward of the whole model with each
    layer's LayerFit hooked (float64 products)."""
    fits = [LayerFit(i, model.config.hidden_size, "cpu", with_block=False, partial=torch.float64)
            for i in range(len(decoder_layers(model)))]
    with torch.no_grad(), capture_activations(model, get_adapter(model), lambda i, h, x, y: fits[i].on_attention(h, x, y),
                                              lambda i, h, out: fits[i].on_block(h, out)):
        model(input_ids=ids, use_cache=False)
    records = [fit.solve() for fit in fits]
    maps = {i: (tensors[f"attn.{i}.weight"], tensors[f"attn.{i}.bias"]) for i, (_, tensors) in enumerate(records)}
    return maps, [entry["attn"]["cosine"] for entry, _ in records], [entry["attn"]["nmse"] for entry, _ in records]


@pytest.fixture(scope="module")
def constructed():
    model = constructed_qwen2()
    maps, cosine, nmse = fitted_maps(model, continuations(model, 24, 32, seed=1))
    heldout = continuations(model, 16, 32, seed=2)
    base = reference_loss(model, heldout)

    def loss_of(layers):
        return reference_loss(apply_nbl(copy.deepcopy(model), {i: ATTN_LINEAR for i in layers}, maps), heldout)

    return model, maps, cosine, nmse, heldout, base, loss_of


def evaluator_for(constructed):
    model, maps, _, _, heldout, _, _ = constructed
    return evaluator(model, heldout, maps)


def test_greedy_finds_the_set_that_exhaustive_search_finds_and_local_criteria_miss(constructed):
    model, maps, cosine, nmse, heldout, base, loss_of = constructed
    assert max(nmse[1], nmse[3]) < 1e-6  # the construction: those two attentions are exactly linear
    assert loss_of((1, 3)) == pytest.approx(base, abs=1e-5)
    # the reference: every pair of layers, each model evaluated by its own forward
    losses = {pair: loss_of(pair) for pair in itertools.combinations(range(5), 2)}
    best = min(losses.values())
    trace = selection.greedy(evaluator_for(constructed), [ranking(cosine), ranking(nmse)], m=2, candidates=5)
    assert losses[tuple(sorted(trace.order))] == pytest.approx(best, abs=1e-6)
    assert trace.losses[-1] == pytest.approx(best, rel=1e-5)
    assert trace.increases[-1] == pytest.approx(100 * (math.exp(best - base) - 1), abs=1e-4)
    for local in (cosine, nmse):
        assert losses[tuple(sorted(ranking(local)[:2]))] > best + 1e-3


def test_greedy_step_one_is_the_best_single_layer(constructed):
    model, maps, cosine, nmse, heldout, base, loss_of = constructed
    singles = {layer: loss_of((layer,)) for layer in range(5)}
    trace = selection.greedy(evaluator_for(constructed), [ranking(cosine), ranking(nmse)], m=1, candidates=5)
    assert trace.order == [min(singles, key=singles.get)]
    # with fewer candidates, only the first of the two rankings in turn are tried
    pool = selection.interleave([ranking(cosine), ranking(nmse)])[:2]
    trace = selection.greedy(evaluator_for(constructed), [ranking(cosine), ranking(nmse)], m=1, candidates=2)
    assert trace.order == [min(pool, key=singles.get)]


# --- layers that are harmless alone and harmful together ---------------------------------------------

TEXT_START = 0  # the first token of every text; the copy heads read nothing of it


def looking_back(offset, head_dim=8, base=10000.0, size=30.0):
    """(q bias, k bias) of a head without q/k weights that attends ``offset`` tokens back: under RoPE,
    q_t . k_s = sum_i |b_i|^2 cos((s - t + offset) theta_i) when k is q rotated by offset * theta_i."""
    q = torch.full((head_dim,), size)
    k = q.clone()
    half = head_dim // 2
    for i in range(half):
        angle = offset * base ** (-2 * i / head_dim)
        k[i] = q[i] * math.cos(angle) - q[i + half] * math.sin(angle)
        k[i + half] = q[i + half] * math.cos(angle) + q[i] * math.sin(angle)
    return q, k


def redundant_copies_qwen2(vocab=17, seed=0):
    """Qwen2 of 4 layers (d 48, 6 heads of 8) over texts in which token t+1 = perm[token t-1].

    Coordinates: E (0-11) the embeddings, L (12-17) the linear part of every attention (a head that
    attends to its own token), S (18-25) the previous token, which the LM head alone reads, J (26-47) junk
    that nothing reads. Layers 1 and 3 are copies: one head of each writes the previous token into S, the
    same way. Either copy is enough (the logits' margin is large), so each alone is harmless to replace,
    and both together lose the previous token and with it every prediction. Their outputs are small and
    mostly linear, so cosine and nmse rank them first. Layers 0 and 2 write large, nonlinear junk (the
    token 2 and 4 back) into J: local criteria rank them last, and replacing them costs nothing.
    """
    E, L, S, J = slice(0, 12), slice(12, 18), slice(18, 26), slice(26, 48)
    copies, junk_back = (1, 3), {0: 2, 2: 4}
    g = torch.Generator().manual_seed(seed)
    config = transformers.Qwen2Config(vocab_size=vocab, hidden_size=48, intermediate_size=8, num_hidden_layers=4,
                                      num_attention_heads=6, num_key_value_heads=6, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(config).eval()
    v_copy, o_copy = torch.randn(8, 12, generator=g), torch.randn(8, 8, generator=g)
    # embeddings that the copy heads turn into the +-axes of S (then the head tells tokens apart widely)
    copy_map = o_copy @ v_copy
    axes = torch.cat([torch.eye(8), -torch.eye(8)])[: vocab - 1]
    embeddings = torch.randn(vocab, 12, generator=g)
    embeddings -= embeddings @ (torch.linalg.pinv(copy_map) @ copy_map).T
    embeddings[1:] += 4 * axes @ torch.linalg.pinv(copy_map).T
    embeddings[TEXT_START] *= 3
    perm = torch.cat([torch.tensor([TEXT_START]), 1 + torch.randperm(vocab - 1, generator=g)])
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0) if "norm" in name else param.zero_()
        model.model.embed_tokens.weight[:, E] = 3 * embeddings
        for index, layer in enumerate(decoder_layers(model)):
            heads = [(0, 0, L, torch.randn(8, 12, generator=g), 0.1 * torch.randn(6, 8, generator=g))]
            if index in copies:
                heads.append((1, 1, S, v_copy, 0.1 * o_copy))
            else:
                heads += [(h, junk_back[index], J, torch.randn(8, 12, generator=g), 0.08 * torch.randn(22, 8, generator=g))
                          for h in range(1, 6)]
            attn = layer.self_attn
            for head, back, rows, v, o in heads:
                cols = slice(8 * head, 8 * head + 8)
                attn.q_proj.bias[cols], attn.k_proj.bias[cols] = looking_back(back)
                attn.v_proj.weight[cols, E] = v
                attn.o_proj.weight[rows, cols] = o
        model.lm_head.weight[perm[1:], S] = 100 * axes
    model.config.use_cache = False
    return model, perm


def permutation_texts(perm, count, length, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.full((count, 1), TEXT_START), torch.randint(1, len(perm), (count, 2), generator=g)], 1)
    while ids.shape[1] < length:
        ids = torch.cat([ids, perm[ids[:, -2]][:, None]], 1)
    return ids


def test_greedy_avoids_layers_that_are_harmless_alone_and_harmful_together():
    model, perm = redundant_copies_qwen2()
    maps, cosine, nmse = fitted_maps(model, permutation_texts(perm, 128, 32, seed=1))
    heldout = permutation_texts(perm, 16, 32, seed=2)
    base = reference_loss(model, heldout)
    losses = {pair: reference_loss(apply_nbl(copy.deepcopy(model), {i: ATTN_LINEAR for i in pair}, maps), heldout)
              - base for pair in itertools.combinations(range(4), 2)}
    singles = {layer: reference_loss(apply_nbl(copy.deepcopy(model), {layer: ATTN_LINEAR}, maps), heldout) - base
               for layer in range(4)}
    # the construction: each copy alone costs little, both together lose every prediction
    assert max(singles[1], singles[3]) < 0.05 and losses[(1, 3)] > 2.0
    best = min(losses.values())
    for local in (cosine, nmse):
        assert sorted(ranking(local)[:2]) == [1, 3]  # each copy looks harmless alone
    trace = selection.greedy(evaluator(model, heldout, maps), [ranking(cosine), ranking(nmse)], m=2, candidates=4)
    assert losses[tuple(sorted(trace.order))] == pytest.approx(best, abs=1e-3)
    assert losses[(1, 3)] > best + 2.0


# --- --m auto ------------------------------------------------------------------------------------------

def prefix_increases(constructed, order):
    """The reference: each prefix of ``order`` replaced, its increase by the model's own forward."""
    _, _, _, _, _, base, loss_of = constructed
    return [0.0] + [100 * (math.exp(loss_of(order[:m]) - base) - 1) for m in range(1, len(order))]


@pytest.mark.parametrize("budget", [0.0, 0.5, 2.0, 5.0, 20.0, 1e6])
def test_auto_m_keeps_the_longest_prefix_within_the_budget(constructed, budget):
    order = ranking(constructed[2])
    increases = prefix_increases(constructed, order)
    trace = selection.walk(evaluator_for(constructed), order, "cosine", budget=budget)
    m = len(trace.order)
    assert m == next((k - 1 for k in range(1, len(increases)) if increases[k] > budget), len(increases) - 1)
    assert trace.order == order[:m]
    for got, want in zip(trace.increases, increases[1:]):
        assert got == pytest.approx(want, abs=1e-4)
    if m < len(increases) - 1:
        assert f"adding layer {order[m]} would raise" in trace.stopped


def test_auto_m_is_monotone_in_the_budget_and_answers_0_when_nothing_fits(constructed):
    # most harmful first, so that the first step already costs something
    singles = {layer: constructed[6]((layer,)) for layer in range(5)}
    order = sorted(singles, key=singles.get, reverse=True)
    first = prefix_increases(constructed, order)[1]
    assert first > 1.0
    chosen = [len(selection.walk(evaluator_for(constructed), order, "cosine", budget=b).order)
              for b in (0.0, first / 2, first * 1.001, 10 * first, 1e6)]
    assert chosen == sorted(chosen) and chosen[0] == chosen[1] == 0 and chosen[2] >= 1
    trials = evaluator_for(constructed)
    trace = selection.walk(trials, order, "cosine", budget=first / 2)
    assert trace.order == [] and f"adding layer {order[0]} would raise the held-out perplexity by +{first:.1f}%" in trace.stopped
    # the step over the budget was undone: the unmodified model measures as before
    assert trials.losses([[order[1]]])[0] == pytest.approx(constructed[6]((order[1],)), rel=1e-5)


def test_best_of_picks_the_criterion_whose_set_costs_least(constructed):
    model, maps, cosine, nmse, heldout, base, loss_of = constructed
    cca = list(reversed(ranking(cosine)))  # a third ranking: cosine's worst first
    rankings = {"cca": cca, "nmse": ranking(nmse), "cosine": ranking(cosine)}
    trials = evaluator_for(constructed)
    chosen, trace, compared = selection.best_of(trials, rankings, m=2)
    reference = {c: loss_of(tuple(sorted(order[:2]))) for c, order in rankings.items()}
    assert chosen == min(reference, key=reference.get)
    assert trace.order == rankings[chosen][:2]
    for c, (layers, inc) in compared.items():
        assert layers == sorted(rankings[c][:2])
        assert inc == pytest.approx(100 * (math.exp(reference[c] - base) - 1), abs=1e-4)
    # left as it was: a set measures as the reference after the trials
    assert trials.losses([[0]])[0] == pytest.approx(loss_of((0,)), rel=1e-5)
    # with --m auto: the criterion that fits the most layers in the budget, then the least loss; whichever
    # is walked first, the criteria that cannot fit as many are settled by one trial, not walked
    budget = 1.0
    increases = {c: prefix_increases(constructed, order) for c, order in rankings.items()}
    fits = {c: next((k - 1 for k, inc in enumerate(increases[c]) if inc > budget), 4) for c in rankings}
    expected = min(rankings, key=lambda c: (-fits[c], increases[c][fits[c]], list(rankings).index(c)))
    for first in rankings:
        chosen, trace, compared = selection.best_of(evaluator_for(constructed), rankings, budget=budget, walk_first=first)
        assert chosen == expected and len(trace.order) == fits[chosen] == max(fits.values())
        assert list(compared) == list(rankings)
        for c, (layers, inc) in compared.items():
            if len(layers) == fits[c]:  # walked
                assert inc == pytest.approx(increases[c][fits[c]], abs=1e-4)
            else:  # its first k layers, k fitted by a criterion walked before it, are over the budget
                assert fits[c] < len(layers) <= fits[expected] and inc > budget and layers == sorted(rankings[c][:len(layers)])


def test_selection_bad_input(constructed):
    model, maps, cosine, _, heldout, _, _ = constructed
    with pytest.raises(NblError, match="--max-ppl-increase must be zero or positive, got -1"):
        selection.walk(evaluator_for(constructed), ranking(cosine), "cosine", budget=-1.0)
    with pytest.raises(NblError, match="--max-ppl-increase must be zero or positive, got -1"):
        selection.best_of(evaluator_for(constructed), {"cosine": ranking(cosine)}, budget=-1.0, walk_first="cosine")
    with pytest.raises(NblError, match="--candidates must be at least 1"):
        selection.greedy(evaluator_for(constructed), [ranking(cosine)], m=1, candidates=0)
    with pytest.raises(NblError, match="held-out slice for layer selection has 64 tokens; it needs at least 1024"):
        evaluator(model, heldout[:2], maps, min_tokens=selection.MIN_HELDOUT_TOKENS)


# --- the calibrate command ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("select"), layers=4, texts=120, words=60)


def run_calibrate(checkpoint, *argv):
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    args = ["--model", checkpoint / "model", "--dataset", checkpoint / "data.jsonl", "--seqlen", 64,
            "--targets", "attn", *argv]
    return calibrate.run(parser.parse_args([str(a) for a in args]))


def test_calibrate_defaults_to_best_and_records_auto_and_greedy(checkpoint, capsys):
    out = checkpoint / "auto"
    assert run_calibrate(checkpoint, "--nsamples", 8, "--m", "auto", "--max-ppl-increase", 3,
                         "--selection-windows", 20, "-o", out) == 0
    art = load_artifact(out)
    chosen = art.report["selection"]
    assert chosen["criterion"] == "best" and chosen["max_ppl_increase"] == 3
    assert art.report["data"]["nsamples"] == 8 and art.report["data"]["selection_windows"] == 20
    heldout = chosen["heldout"]
    compared = heldout["compared"]
    assert set(compared) == {"cca", "nmse", "cosine"} and chosen["chosen"] in compared
    # best = the criterion that fits the most layers in the budget, then the least loss
    most = max(len(v["layers"]) for v in compared.values())
    assert len(compared[chosen["chosen"]]["layers"]) == most == chosen["m"]
    assert heldout["heldout_tokens"] == 20 * 63 and chosen["m"] == len(heldout["order"]) == len(chosen["layers"])
    assert all(inc <= 3 for inc in heldout["ppl_increase_pct"])
    assert heldout["order"] == ranking(art.scores(chosen["chosen"]))[:chosen["m"]]
    assert art.select() == sorted(heldout["order"])
    printed = capsys.readouterr().out
    assert f"--m auto: m = {chosen['m']} within +3%" in printed and f"-> {chosen['chosen']}" in printed

    out = checkpoint / "greedy"
    assert run_calibrate(checkpoint, "--nsamples", 8, "--m", 2, "--criterion", "greedy", "--method", "attn-drop",
                         "--selection-windows", 20, "--candidates", 4, "-o", out) == 0
    art = load_artifact(out)
    order = art.report["selection"]["heldout"]["order"]
    assert len(order) == 2 and art.select() == sorted(order) and art.select(1) == order[:1]
    assert art.layer_types().count(ATTN_DROP) == 2
    with pytest.raises(NblError, match="goes to m = 2, not 3: calibrate again with --criterion greedy --m 3"):
        art.select(3)
    with pytest.raises(NblError, match="was made for attn-drop, not attn-nbl"):
        art.select(2, "greedy", "attn-nbl")
    with pytest.raises(NblError, match="made no greedy selection"):
        load_artifact(checkpoint / "auto").select(2, "greedy")


def test_calibrate_selection_errors(checkpoint):
    with pytest.raises(NblError, match="--max-ppl-increase goes with --m auto"):
        run_calibrate(checkpoint, "--m", 2, "--max-ppl-increase", 5)
    with pytest.raises(NblError, match="--max-ppl-increase must be zero or positive, got -2"):
        run_calibrate(checkpoint, "--nsamples", 8, "--m", "auto", "--max-ppl-increase", -2, "--selection-windows", 20,
                      "-o", checkpoint / "x")
    with pytest.raises(NblError, match="too few to hold out --selection-windows 500"):
        run_calibrate(checkpoint, "--m", "auto", "--selection-windows", 500, "--selection-text", "calibration",
                      "-o", checkpoint / "x")
    with pytest.raises(NblError, match=r"too few to hold out 167 of --selection-windows 500 \(its share in "
                                       r"--selection-text mix\)"):
        run_calibrate(checkpoint, "--m", "auto", "--selection-windows", 500, "--selection-text", "mix", "-o", checkpoint / "x")
    with pytest.raises(NblError, match="held-out slice for layer selection has 128 tokens"):
        run_calibrate(checkpoint, "--nsamples", 8, "--m", "auto", "--selection-windows", 2, "-o", checkpoint / "x")
    assert not (checkpoint / "x").exists()


def test_sweep_best_rows_repeat_the_choice_of_calibrate(checkpoint, tmp_path):
    from nbl_gguf.measurement import sweep
    from nbl_gguf.model_source import resolve_model

    out = checkpoint / "best-m2"
    assert run_calibrate(checkpoint, "--nsamples", 8, "--m", 2, "--selection-windows", 20, "-o", out) == 0
    art = load_artifact(out)
    recorded = art.report["selection"]
    choices = sweep.best_choices(art, resolve_model(str(checkpoint / "model")), ["attn-nbl", "attn-drop", "block-nbl"], [2],
                                 sweep.Cache(tmp_path / "results.json", fresh=True), "tag")
    assert choices == {("attn-nbl", 2): recorded["chosen"]}  # measured for Attn NBL only
    cached = json.loads((tmp_path / "results.json").read_text())["best|tag|attn-nbl|m2"]["compared"]
    for criterion, entry in recorded["heldout"]["compared"].items():
        assert cached[criterion][0] == entry["layers"]
        assert cached[criterion][1] == pytest.approx(entry["ppl_increase_pct"], abs=1e-6)
    main, _ = sweep.build_configs(art, [2], ["attn-nbl"], "best", best=choices)
    labels = [config.label for config in main]
    chosen = recorded["chosen"]
    assert labels[1] == f"Attn NBL-2 (best: {chosen} layers)" and main[1].layers == recorded["layers"]
    assert sorted(labels[2:]) == sorted(f"Attn NBL-2 ({c} layers)" for c in ("cca", "nmse", "cosine") if c != chosen)
