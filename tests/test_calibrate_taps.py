"""Past-token taps (calibration.taps, apply.TapsAttention): the stacked moments against a brute-force
stack, each form's solve against a known map or the full fit, and the PyTorch layer decoding step
by step with HF's cache against the full recompute and the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nbl_gguf.calibration.apply import ATTN_LINEAR, ATTN_TAPS, apply_nbl
from nbl_gguf.calibration.statistics import MomentAccumulator
from nbl_gguf.calibration.taps import TapsMap, solve, solve_channel, solve_full, solve_lowrank
from nbl_gguf.errors import NblError
from nbl_gguf.fixtures.tiny import TinyLlama
from nbl_gguf.gguf import nbl_format

D, K = 6, 3


def stacked(x: torch.Tensor, taps: int) -> torch.Tensor:
    """[b, s, d] -> [b, s, taps d]: x_t, x_(t-1), ... with zeros before each window (the definition)."""
    parts = [torch.nn.functional.pad(x, (0, 0, j, 0))[:, :x.shape[1]] for j in range(taps)]
    return torch.cat(parts, -1)


def windows(seed=0, batch=5, seq=40, offset=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, D, generator=g, dtype=torch.float64) + offset
    x[:, 1:] += 0.6 * x[:, :-1].clone()  # correlated neighbours, as activations are
    return x, g


def test_streamed_stacked_moments_equal_the_brute_force_stack():
    x, g = windows()
    y = torch.randn(x.shape, generator=g, dtype=torch.float64)
    acc = MomentAccumulator(D, D, taps=K)
    for part in (slice(0, 2), slice(2, 3), slice(3, 5)):  # windows in batches of different sizes
        acc.update(x[part], y[part])
    acc.update(x[0, :2], y[0, :2])  # a window shorter than the taps, given as [seq, d]
    reference = MomentAccumulator(K * D, D)
    reference.update(stacked(x, K), y)
    reference.update(stacked(x[:1, :2], K), y[:1, :2])
    got, want = acc.moments(), reference.moments()
    assert got.n == want.n == 5 * 40 + 2
    for name in ("mean_x", "mean_y", "cxx", "cyx", "cyy"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=1e-11)
    # fewer taps: the leading blocks are what a smaller accumulator gives
    small = MomentAccumulator(D, D, taps=2)
    small.update(x, y)
    small.update(x[0, :2], y[0, :2])
    torch.testing.assert_close(got.leading(2).cxx, small.moments().cxx, rtol=0, atol=1e-11)
    # one tap: every moment of the per-token accumulator, from the same sums (the per-token map's moments)
    single = MomentAccumulator(D, D)
    single.update(x, y)
    single.update(x[0, :2], y[0, :2])
    per_token, lead = single.moments(), got.leading(1)
    assert lead.taps == 1 and got.taps == K and lead.n == per_token.n
    for name in ("mean_x", "mean_y", "cxx", "cyx", "cyy"):
        torch.testing.assert_close(getattr(lead, name), getattr(per_token, name), rtol=0, atol=1e-11)
    with pytest.raises(NblError, match="cannot take 4 taps from moments of 3"):
        got.leading(4)


def test_a_layer_fit_with_taps_gives_the_per_token_map_of_one_without():
    """The taps calibration gathers one set of moments a layer: its per-token map, scores and tensors are
    those of the calibration without taps (float32 products, as the calibrator runs them)."""
    from nbl_gguf.calibration.layer_fit import LayerFit

    x, g = windows(seed=5, batch=4, seq=30)
    y = torch.tanh(x @ torch.randn(D, D, generator=g, dtype=torch.float64)) + 0.1 * x.roll(1, 1)
    fits = {taps: LayerFit(0, D, "cpu", with_block=True, taps=taps) for taps in (1, K)}
    for fit in fits.values():
        for part in (slice(0, 3), slice(3, 4)):
            fit.on_attention(x[part], x[part], y[part])
            fit.on_block(x[part], x[part] + y[part])
    (plain, plain_tensors), (tapped, tapped_tensors) = (fits[1].solve(), fits[K].solve(taps_rank=2))
    assert "taps" not in plain and tapped["taps"]["taps"] == K and tapped["taps"]["rank"] == 2
    assert tapped["taps"]["nmse"] <= tapped["attn"]["nmse"]  # the lags only add inputs
    for target in ("attn", "block"):
        for score, value in plain[target].items():
            assert tapped[target][score] == pytest.approx(value, rel=1e-9, abs=1e-12), (target, score)
    for name, value in plain_tensors.items():
        np.testing.assert_allclose(tapped_tensors[name], value, rtol=1e-6, atol=1e-9, err_msg=name)
    assert sorted(set(tapped_tensors) - set(plain_tensors)) == ["taps.0.bias", "taps.0.lag_down", "taps.0.lag_up",
                                                                 "taps.0.weight"]


def test_accumulator_rejects_a_flat_stream_and_names_non_finite_input():
    acc = MomentAccumulator(D, D, name="layer 4", taps=K)
    with pytest.raises(ValueError, match=r"\[batch, seq, 6\]"):
        acc.update(torch.zeros(2, 3, 4, D), torch.zeros(2, 3, 4, D))
    x = torch.zeros(1, 10, D)
    x[0, 3, 1] = float("nan")
    acc.update(x, torch.zeros(1, 10, D))
    with pytest.raises(NblError, match="non-finite activations .* in layer 4 input"):
        acc.moments()


def fitted(y_of, seed=1):
    x, _ = windows(seed, batch=6, seq=80)
    acc = MomentAccumulator(D, D, taps=K)
    acc.update(x, y_of(x))
    return acc.moments(), x


def test_full_fit_recovers_a_taps_map_and_applies_like_the_definition():
    rng = np.random.default_rng(3)
    w, b = rng.standard_normal((D, K * D)), rng.standard_normal(D)
    m, x = fitted(lambda x: stacked(x, K) @ torch.from_numpy(w).T + torch.from_numpy(b))
    fit = solve_full(m, K)
    assert fit.form == "full" and fit.lag.shape == (D, (K - 1) * D)
    np.testing.assert_allclose(fit.stacked(), w, atol=1e-6)
    np.testing.assert_allclose(fit.bias, b, atol=1e-6)
    assert fit.nmse < 1e-10
    # TapsMap.apply (the file's layout: lags oldest first) reproduces y, also continued from a past
    np.testing.assert_allclose(fit.apply(x[0].numpy()), (stacked(x[:1], K)[0] @ torch.from_numpy(w).T + torch.from_numpy(b)).numpy(), atol=1e-6)
    head, tail = x[0, :7].numpy(), x[0, 7:].numpy()
    np.testing.assert_allclose(np.concatenate([fit.apply(head), fit.apply(tail, past=head[-(K - 1):])]),
                               fit.apply(x[0].numpy()), atol=1e-9)


def test_low_rank_fit_is_exact_at_full_rank_and_optimal_below():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((D, K * D))
    m, _ = fitted(lambda x: stacked(x, K) @ torch.from_numpy(w).T + 0.3 * torch.randn(x.shape, dtype=torch.float64))
    full = solve_full(m, K)
    np.testing.assert_allclose(solve_lowrank(m, K, D).stacked(), full.stacked(), atol=1e-7)
    errors = [solve_lowrank(m, K, r).nmse for r in range(1, D + 1)]
    assert all(a >= b - 1e-12 for a, b in zip(errors, errors[1:]))  # more rank never hurts
    assert errors[-1] == pytest.approx(full.nmse, abs=1e-9)
    two = solve_lowrank(m, K, 2)
    assert two.lag_down.shape == (2, (K - 1) * D) and two.lag_up.shape == (D, 2) and two.params() < full.params()
    # no other rank-2 lag map with its best W_0 does better (random rank-2 maps as the competitors)
    for trial in range(20):
        lag = rng.standard_normal((D, 2)) @ rng.standard_normal((2, (K - 1) * D))
        cza, caa, cya = m.cxx[D:, :D], m.cxx[:D, :D], m.cyx[:, :D]
        w0 = (cya - torch.from_numpy(lag) @ cza) @ torch.linalg.inv(caa)
        other = TapsMap(K, w0.numpy(), np.zeros(D), lag=np.concatenate(
            [lag[:, j * D:(j + 1) * D] for j in reversed(range(K - 1))], 1))
        total = float(torch.trace(m.cyy))
        s = torch.from_numpy(other.stacked())
        mse = total - 2 * float(torch.sum(s * m.cyx)) + float(torch.sum((s @ m.cxx) * s))
        assert mse / total >= two.nmse - 1e-9


def test_channel_fit_recovers_per_channel_taps_and_never_loses_to_the_per_token_map():
    rng = np.random.default_rng(5)
    c = rng.standard_normal((K, D))
    c[0] = 1.0
    w = rng.standard_normal((D, D))

    def target(x):
        z = stacked(x, K)
        u = sum(torch.from_numpy(c[j]) * z[..., j * D:(j + 1) * D] for j in range(K))
        return u @ torch.from_numpy(w).T

    m, x = fitted(target)
    assert solve_channel(m, K).nmse < 0.1 * solve_full(m.leading(1), 1).nmse  # the default stopping rule
    fit = solve_channel(m, K, iterations=2000, tolerance=1e-14)  # run to convergence: the exact map
    assert fit.form == "channel" and fit.conv.shape == (K, D)
    np.testing.assert_allclose(fit.conv, c[::-1], atol=1e-4)
    np.testing.assert_allclose(fit.weight, w, atol=1e-4)
    np.testing.assert_allclose(fit.apply(x[1].numpy()), target(x[1:2])[0].numpy(), atol=1e-3)
    noisy, _ = fitted(lambda x: target(x) + torch.randn(x.shape, dtype=torch.float64), seed=2)
    errors = [solve_channel(noisy, K, iterations=n, tolerance=0).nmse for n in (0, 1, 2, 5, 20)]
    assert errors[0] == pytest.approx(solve_full(noisy.leading(1), 1).nmse, abs=1e-12)  # starts as per-token
    assert all(a >= b - 1e-12 for a, b in zip(errors, errors[1:])) and errors[-1] < errors[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("form", ["full", "lowrank", "channel"])
def test_the_solve_of_moments_on_a_gpu_equals_the_cpu_one(form):
    """The calibrator keeps a layer's statistics on its device; a solve of CUDA moments once failed
    handing its tensors to numpy (found on the H200 by docs/results/experiments/bench_taps_layer.py --device cuda)."""
    x, g = windows(seed=4)
    y = torch.randn(x.shape, generator=g, dtype=torch.float64) + x @ torch.randn(D, D, generator=g, dtype=torch.float64)
    fits = []
    for device in ("cpu", "cuda"):
        acc = MomentAccumulator(D, D, device, taps=K)
        acc.update(x.to(device), y.to(device))
        fits.append(solve(acc.moments(), K, form, 2))
    cpu, gpu = fits

    def maps(fit):  # the low-rank factors only up to the signs of their eigenvectors: their product
        lags = None if fit.lag_down is None else fit.lag_up @ fit.lag_down
        return {"weight": fit.weight, "bias": fit.bias, "lag": fit.lag, "low-rank lag": lags, "conv": fit.conv}

    for (name, a), b in zip(maps(cpu).items(), maps(gpu).values()):
        assert (a is None) == (b is None), name
        if a is not None:
            assert isinstance(b, np.ndarray), name
            np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-9, err_msg=name)
    assert gpu.nmse == pytest.approx(cpu.nmse, rel=1e-6, abs=1e-12)


def test_solve_names_bad_requests():
    m, _ = fitted(lambda x: x)
    with pytest.raises(NblError, match="unknown taps form 'cubic'"):
        solve(m, K, "cubic")
    with pytest.raises(NblError, match="needs a rank"):
        solve(m, K, "lowrank")
    with pytest.raises(NblError, match="rank 7 is outside 1..6"):
        solve(m, K, "lowrank", 7)
    with pytest.raises(NblError, match="do not stack 2 taps"):
        solve(m, 2)
    acc = MomentAccumulator(D, D, taps=K)
    acc.update(torch.randn(1, 10, D), torch.randn(1, 10, D))
    with pytest.raises(NblError, match="only 10 calibration tokens for 18 stacked inputs"):
        solve(acc.moments(), K)


# --- the PyTorch reference layer in a model ----------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return TinyLlama(n_layer=4, n_head=8, n_head_kv=2, seed=1)


@pytest.mark.parametrize("form", ["full", "lowrank", "channel"])
def test_taps_layers_decode_with_the_hf_cache_as_the_full_recompute(tiny, form):
    from transformers import DynamicCache

    types = [nbl_format.TAPS, nbl_format.ATTENTION, nbl_format.LINEAR, nbl_format.TAPS]
    maps = {**tiny.random_taps([0, 3], 4, form), 2: tiny.random_linear([2])[2]}
    tokens = [int(t) for t in np.random.default_rng(0).integers(3, tiny.n_vocab, 20)]
    reference = tiny.forward(tokens, types, maps)
    assert np.abs(reference - tiny.forward(tokens, [0, 0, 1, 0], maps)).max() > 0.1  # the taps layers count
    model = apply_nbl(tiny.hf_model(), {0: ATTN_TAPS, 2: ATTN_LINEAR, 3: ATTN_TAPS}, maps)
    with torch.no_grad():
        whole = model(torch.tensor([tokens])).logits[0].double().numpy()
        cache = DynamicCache()
        rows = [model(torch.tensor([tokens[:7]]), cache=cache, use_cache=True).logits[0]]
        for token in tokens[7:]:  # one token per step: the taps layers read their kept inputs
            rows.append(model(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0])
    stepped = torch.cat(rows).double().numpy()
    assert np.abs(whole - reference).max() < 1e-4
    assert np.abs(stepped - reference).max() < 1e-4
    # generate() (a new cache) gives the reference's greedy continuation
    generated = model.generate(torch.tensor([tokens[:5]]), max_new_tokens=5, do_sample=False, pad_token_id=0)
    greedy = list(tokens[:5])
    for _ in range(5):
        greedy.append(int(np.argmax(tiny.forward(greedy, types, maps)[-1])))
    assert generated[0].tolist() == greedy


def test_a_cropped_cache_is_refused_by_a_taps_layer(tiny):
    from transformers import DynamicCache

    maps = tiny.random_taps([1], 3, "full")
    model = apply_nbl(tiny.hf_model(), {1: ATTN_TAPS}, maps)
    cache = DynamicCache()
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7, 8]]), cache=cache, use_cache=True)
        cache.crop(-2)  # drop the last 2 positions
        with pytest.raises(NblError, match="layer 1: the KV cache holds 2 positions but the taps state 4"):
            model(torch.tensor([[9]]), cache=cache, use_cache=True)


def test_a_linear_layer_0_keeps_the_positions_while_decoding(tiny):
    # transformers 5 reads the sequence length from layer 0's cache: a replaced layer 0 must record it
    from transformers import DynamicCache

    types = [nbl_format.LINEAR, nbl_format.ATTENTION, nbl_format.ATTENTION, nbl_format.ATTENTION]
    maps = tiny.random_linear([0])
    tokens = [int(t) for t in np.random.default_rng(1).integers(3, tiny.n_vocab, 10)]
    model = apply_nbl(tiny.hf_model(), {0: ATTN_LINEAR}, maps)
    cache = DynamicCache()
    with torch.no_grad():
        rows = [model(torch.tensor([tokens[:4]]), cache=cache, use_cache=True).logits[0]]
        for token in tokens[4:]:
            rows.append(model(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0])
    assert np.abs(torch.cat(rows).double().numpy() - tiny.forward(tokens, types, maps)).max() < 1e-4
