"""LMMSE solve, CCA bound and selection against independent numpy references."""

import numpy as np
import pytest
import torch

from nbl_gguf.errors import NblError
from nbl_gguf.calibration.solve import canonical_correlations, fit, fit_without_bias, ranking, select_layers
from nbl_gguf.calibration.statistics import MomentAccumulator


def moments_of(x, y):
    acc = MomentAccumulator(x.shape[1], y.shape[1], name="layer 0 attention")
    acc.update(torch.from_numpy(x), torch.from_numpy(y))
    return acc.moments()


def random_pair(rng, n, d, noise):
    x = rng.standard_normal((n, d)) @ rng.standard_normal((d, d)) + rng.standard_normal(d) * 3
    w = rng.standard_normal((d, d)) / np.sqrt(d)
    b = rng.standard_normal(d)
    y = x @ w.T + b + noise * rng.standard_normal((n, d)) * rng.uniform(0.1, 2, d)
    return x, y


def test_weight_and_bias_equal_least_squares_with_intercept():
    rng = np.random.default_rng(0)
    for d, noise in ((8, 0.0), (16, 0.3), (24, 1.0)):
        x, y = random_pair(rng, 2000, d, noise)
        f = fit(moments_of(x, y))
        design = np.hstack([x, np.ones((len(x), 1))])
        coef, *_ = np.linalg.lstsq(design, y, rcond=None)
        np.testing.assert_allclose(f.weight.numpy(), coef[:-1].T, atol=1e-8, rtol=0)
        np.testing.assert_allclose(f.bias.numpy(), coef[-1], atol=1e-8, rtol=0)
        assert f.ridge == 0.0
        # Exact NMSE equals the residual energy of the least-squares fit.
        residual = y - design @ coef
        expected = np.sum((residual - residual.mean(0)) ** 2) / np.sum((y - y.mean(0)) ** 2)
        assert f.nmse == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_bias_free_weight_equals_least_squares_without_intercept():
    rng = np.random.default_rng(6)
    for d, noise in ((8, 0.0), (16, 0.3), (24, 1.0)):
        x, y = random_pair(rng, 2000, d, noise)
        m = moments_of(x, y)
        f0 = fit_without_bias(m)
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        np.testing.assert_allclose(f0.weight.numpy(), coef.T, atol=1e-8, rtol=0)
        assert f0.ridge == 0.0
        # exact NMSE: the residual energy of that fit over the variance of Y (fit's denominator)
        residual = y - x @ coef
        expected = np.sum(residual**2) / np.sum((y - y.mean(0)) ** 2)
        assert f0.nmse == pytest.approx(expected, rel=1e-9, abs=1e-12)
        # random_pair has a bias and inputs with a mean: dropping the intercept costs something
        assert f0.nmse > fit(m).nmse


def test_bias_free_fit_costs_nothing_when_the_data_need_no_bias():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3000, 6)) + rng.standard_normal(6)  # inputs with a mean
    w = rng.standard_normal((5, 6))
    y = x @ w.T + 0.2 * rng.standard_normal((3000, 5))  # no intercept
    m = moments_of(x, y)
    with_bias, without = fit(m), fit_without_bias(m)
    assert without.nmse >= with_bias.nmse - 1e-12
    assert without.nmse == pytest.approx(with_bias.nmse, rel=2e-3)
    np.testing.assert_allclose(without.weight.numpy(), w, atol=0.02)


def test_bias_free_fit_of_singular_inputs_gets_a_ridge_and_an_exact_nmse():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((400, 5)) + 1.0
    x = np.hstack([x, x[:, :1]])  # duplicated column: E[XX^T] singular
    y = x[:, :3] @ rng.standard_normal((3, 4)) + 0.5 + 0.1 * rng.standard_normal((400, 4))
    f0 = fit_without_bias(moments_of(x, y))
    assert f0.ridge > 0 and np.isfinite(f0.weight.numpy()).all()
    residual = y - x @ f0.weight.numpy().T  # the ridged weight's own error, not the unridged optimum's
    assert f0.nmse == pytest.approx(np.sum(residual**2) / np.sum((y - y.mean(0)) ** 2), rel=1e-6)


def test_canonical_correlations_match_qr_reference():
    # Reference: CCA via orthonormal bases of the centred data (Bjorck-Golub), no covariances involved.
    rng = np.random.default_rng(1)
    x, y = random_pair(rng, 500, 6, 0.7)
    qx, _ = np.linalg.qr(x - x.mean(0))
    qy, _ = np.linalg.qr(y - y.mean(0))
    expected = np.linalg.svd(qx.T @ qy, compute_uv=False)
    m = moments_of(x, y)
    np.testing.assert_allclose(canonical_correlations(m.cxx, m.cyx, m.cyy).numpy(), expected, atol=1e-10)


def test_nmse_of_y_plus_never_exceeds_cca_bound():
    """The theorem: MSE / Tr(C_Y+Y+) <= sum(1 - rho_i(X, Y+)^2), with Y+ = Y + X."""
    rng = np.random.default_rng(2)
    for case in range(200):
        d = int(rng.integers(2, 12))
        n = int(rng.integers(d + 5, 400))
        x, y = random_pair(rng, n, d, float(rng.choice([0.0, 0.01, 0.3, 3.0, 30.0])))
        if case % 3 == 0:
            y = y * 1e-3  # attention output small next to its input, as in real layers
        f = fit(moments_of(x, y), residual=True)
        yp = y + x
        mse = np.sum((y - (x @ f.weight.numpy().T + f.bias.numpy())) ** 2) / n  # residual of Y == of Y+
        nmse_plus = mse / np.sum(np.var(yp, axis=0))
        assert nmse_plus <= f.cca_bound + 1e-9, (case, nmse_plus, f.cca_bound)
        # Without the residual, the same theorem bounds the NMSE of Y itself.
        g = fit(moments_of(x, y), residual=False)
        assert g.nmse <= g.cca_bound + 1e-9


def test_bound_does_not_cover_nmse_of_y_normalized_by_y():
    # Documented limit: Y independent of X and tiny -> Y+ ~ X, rho ~ 1, bound ~ 0, yet NMSE(Y) ~ 1.
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5000, 4))
    y = 1e-3 * rng.standard_normal((5000, 4))
    f = fit(moments_of(x, y), residual=True)
    assert f.nmse > 0.99
    assert f.cca_bound < 1e-3


def test_ill_conditioned_input_gets_a_reported_ridge():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((300, 5))
    x = np.hstack([x, x[:, :1]])  # duplicated column: C_XX singular
    y = x[:, :3] @ rng.standard_normal((3, 6)) + 0.1 * rng.standard_normal((300, 6))
    f = fit(moments_of(x, y))
    assert f.ridge > 0
    assert np.isfinite(f.weight.numpy()).all()
    assert f.nmse < 0.05


def test_large_covariances_skip_eigenvalues_with_the_same_fit(monkeypatch):
    """Above EIGENVALUES_UP_TO the ridge is decided by a shifted Cholesky and cond estimated: the maps,
    ridges and scores equal the eigenvalue path's, and cond is within 10% of the exact one (from below)."""
    from nbl_gguf.calibration import solve

    rng = np.random.default_rng(6)
    d = 48
    basis = np.linalg.qr(rng.standard_normal((d, d)))[0]
    x = rng.standard_normal((4000, d)) * np.logspace(-2, 1, d) @ basis  # cond ~1e6, no ridge needed
    singular = np.hstack([x[:, :-1], x[:, :1]])  # duplicated column: a ridge needed
    for inputs, eigenvalue_calls in ((x, 0), (singular, 2)):
        y = inputs @ rng.standard_normal((d, d)) * 0.1 + 0.05 * rng.standard_normal((4000, d))
        moments = moments_of(inputs, y)
        exact = fit(moments, residual=True), fit_without_bias(moments)
        calls = []
        monkeypatch.setattr(solve, "EIGENVALUES_UP_TO", 8)
        monkeypatch.setattr(solve, "_eigvals", lambda c, real=solve._eigvals: calls.append(c) or real(c))
        fast = fit(moments, residual=True), fit_without_bias(moments)
        monkeypatch.undo()
        # C_XX and E[X X^T] when singular; never C_Y+Y+ (Y+ = Y + X has noise in every direction)
        assert len(calls) == eigenvalue_calls
        for e, f in zip(exact, fast):
            assert f.ridge == e.ridge
            np.testing.assert_allclose(f.weight.numpy(), e.weight.numpy(), rtol=0, atol=1e-9 * np.abs(e.weight.numpy()).max())
            assert f.nmse == pytest.approx(e.nmse, rel=1e-9, abs=1e-12)
            assert 0.9 * e.cond <= f.cond <= e.cond * (1 + 1e-9), (f.cond, e.cond)
        assert fast[0].cca_bound == pytest.approx(exact[0].cca_bound, rel=1e-9)
        np.testing.assert_allclose(fast[0].rho.numpy(), exact[0].rho.numpy(), atol=1e-9)
    assert exact[0].ridge > 0


def test_fewer_tokens_than_hidden_size_is_an_error():
    rng = np.random.default_rng(5)
    x, y = random_pair(rng, 16, 16, 0.1)
    with pytest.raises(NblError, match=r"only 16 calibration tokens for hidden size 16.*at least 17"):
        fit(moments_of(x, y))


def test_select_lowest_scores():
    scores = [0.5, 0.1, 0.9, 0.1, 0.3]
    assert select_layers(scores, 2) == [1, 3]
    assert select_layers(scores, 3) == [1, 3, 4]
    assert select_layers(scores, 0) == []
    assert ranking(scores) == [1, 3, 4, 0, 2]
    with pytest.raises(NblError, match="--m 6 is larger than the model's 5 layers"):
        select_layers(scores, 6)
