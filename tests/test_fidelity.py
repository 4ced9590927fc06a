"""The gradient-fidelity instrument: ZO estimates against autograd on a tiny model."""

from __future__ import annotations

import statistics

import torch

from adazeta.tools.fidelity import (autograd_gradient, cosine, directional_derivatives, estimate_cosine,
                                   estimate_vector, expected_cosine, projected_gradients, zo_fidelity)
from adazeta.scoring import Scorer
from test_zo_health import tiny_batch, with_adapters


def test_zo_estimates_align_with_autograd_as_the_theory_says_and_leave_the_weights_alone():
    loaded, model = with_adapters("tt", "reference")
    batch = tiny_batch(loaded)
    params = [p for p in model.parameters() if p.requires_grad]
    dim = sum(p.numel() for p in params)
    before = [p.detach().clone() for p in params]
    scorer = Scorer.of(model, loaded.tokenizer)
    loss = lambda: scorer.loss(batch)  # noqa: E731
    grad = autograd_gradient(params, loss)
    rows = zo_fidelity(params, loss, grad, [1, 4, 64], seeds=[0, 1, 2, 3], eps=1e-3, lr=1e-2)
    assert len(rows) == 12
    for p, b in zip(params, before):
        torch.testing.assert_close(p, b, atol=1e-5, rtol=0)  # +eps, -2 eps, +eps and -lr, +lr: rounding only
    by_q = {q: [r for r in rows if r.queries == q] for q in (1, 4, 64)}
    # central differences at eps 1e-3 recover the directional derivative z . g closely
    assert max(r.fd_error for r in rows) < 0.05
    cos = {q: statistics.mean(r.cosine for r in by_q[q]) for q in by_q}
    assert cos[64] > cos[4] > cos[1] > 0
    assert 0.5 * expected_cosine(64, dim) < cos[64] < 2 * expected_cosine(64, dim)
    # the first-order prediction lr * g . g_hat tracks the measured decrease for a small step
    for r in by_q[64]:
        assert abs(r.loss_decrease - r.predicted_decrease) < 0.5 * abs(r.predicted_decrease) + 1e-4
        assert r.decrease_per_forward == r.loss_decrease / 128


def test_expected_cosine_grows_with_queries_and_shrinks_with_dimension():
    assert expected_cosine(64, 10**3) > expected_cosine(1, 10**3) > expected_cosine(1, 10**8)
    assert abs(expected_cosine(1, 179_100) - 1 / 423.2) < 1e-4


def test_exact_directional_derivatives_are_what_central_differences_measure_on_a_quadratic():
    torch.manual_seed(0)
    w = [torch.randn(40, 3), torch.randn(7)]
    a = [torch.randn(40, 3), torch.randn(7)]
    loss = lambda: sum(((x * y).sum() ** 2 for x, y in zip(w, a)), torch.tensor(0.0))  # noqa: E731
    for p in w:
        p.requires_grad_(True)
    grad = autograd_gradient(w, loss)
    with torch.no_grad():
        measured = projected_gradients(w, loss, 3, 8, 1e-2)  # central differences are exact on a quadratic
    exact = directional_derivatives(w, 3, 8, grad)
    assert all(abs(m - e) < 1e-3 * (1 + abs(e)) for m, e in zip(measured, exact))
    # the estimate from exact derivatives is the one the measured derivatives approach, direction by direction
    assert cosine(estimate_vector(w, measured, 3), estimate_vector(w, exact, 3)) > 0.9999
    assert estimate_cosine(w, exact, 3, grad) == cosine(estimate_vector(w, exact, 3), grad)
    flipped = [-exact[0], *exact[1:]]  # one direction's sign wrong: a measurably worse estimate
    assert cosine(estimate_vector(w, flipped, 3), estimate_vector(w, exact, 3)) < 0.95
