"""KL as an actor loss term (use_kl_loss): agg_loss(kl_penalty(log_prob, ref, type), mask, mode) is
differentiable through log_prob, with the analytic per-token derivative and every aggregation weight."""

import pytest
import torch

from hybridflow.algorithms import LOSS_AGG_MODES, agg_loss, kl_penalty

# B = 2, T = 3; row 0 has 3 valid tokens, row 1 has 2 (its last entry is padding)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
REF = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.2, -0.7]], dtype=torch.float64)
DIFF = torch.tensor([[0.3, -0.4, 0.0], [0.7, -0.1, 0.5]], dtype=torch.float64)  # log_prob - ref


def agg_weights(mode):
    """d agg_loss / d loss_mat per token: token-mean 1/N_tok = 1/5; seq-mean-token-sum 1/B = 1/2;
    seq-mean-token-mean 1/(B |y_i|) = 1/6 and 1/4; seq-mean-token-sum-norm 1/(B T) = 1/6."""
    return {
        "token-mean": torch.full((2, 3), 1 / 5),
        "seq-mean-token-sum": torch.full((2, 3), 1 / 2),
        "seq-mean-token-mean": torch.tensor([[1 / 6] * 3, [1 / 4] * 3]),
        "seq-mean-token-sum-norm": torch.full((2, 3), 1 / 6),
    }[mode].double() * MASK.double()


# d kl / d log_prob with d = log_prob - ref:  k1 = d -> 1;  k2 = d^2/2 -> d;  k3 = e^-d + d - 1 -> 1 - e^-d
DERIVATIVES = {
    "kl": lambda d: torch.ones_like(d),
    "mse": lambda d: d,
    "low_var_kl": lambda d: 1 - torch.exp(-d),
}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("kl_type", list(DERIVATIVES))
def test_kl_loss_gradient_is_the_analytic_derivative(mode, kl_type):
    log_prob = (REF + DIFF).requires_grad_()
    loss = agg_loss(kl_penalty(log_prob, REF, kl_type), MASK, mode)
    loss.backward()
    expected = DERIVATIVES[kl_type](DIFF) * agg_weights(mode)
    assert torch.allclose(log_prob.grad, expected, atol=1e-12)
    assert log_prob.grad[1, 2].item() == 0.0  # padding


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_k3_kl_loss_matches_finite_differences(mode):
    log_prob = (REF + DIFF).requires_grad_()
    assert torch.autograd.gradcheck(lambda lp: agg_loss(kl_penalty(lp, REF, "low_var_kl"), MASK, mode), (log_prob,))
    loss = agg_loss(kl_penalty(log_prob, REF, "low_var_kl"), MASK, mode)
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert (grad[MASK != 0][DIFF[MASK != 0] != 0] != 0).all()  # non-zero wherever log_prob != ref


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_k3_gradient_vanishes_where_log_prob_equals_ref(mode):
    # k3 = e^-d + d - 1 = d^2/2 + O(d^3): zero value and zero slope at d = 0 (k1 keeps slope 1 there)
    log_prob = REF.clone().requires_grad_()
    loss = agg_loss(kl_penalty(log_prob, REF, "low_var_kl"), MASK, mode)
    loss.backward()
    assert loss.item() == 0.0
    assert (log_prob.grad == 0).all()
    # to first order the slope is d * weight: at d = 1e-4 it is 1 - e^-d = d - d^2/2 + ... ~ 1e-4
    log_prob = (REF + 1e-4).requires_grad_()
    agg_loss(kl_penalty(log_prob, REF, "low_var_kl"), MASK, mode).backward()
    assert torch.allclose(log_prob.grad, 1e-4 * agg_weights(mode), rtol=1e-4)


def test_k3_clamped_tokens_get_no_gradient_and_padding_garbage_is_ignored():
    # d = -12: k3 = e^12 - 13 > 10 is clamped to 10, so that token's gradient is 0 (documented in kl_penalty)
    ref = torch.tensor([[0.0, 0.0, float("nan")]], dtype=torch.float64)
    log_prob = torch.tensor([[-12.0, 0.5, 3.0]], dtype=torch.float64, requires_grad=True)
    loss = agg_loss(kl_penalty(log_prob, ref, "low_var_kl"), torch.tensor([[1.0, 1.0, 0.0]]), "token-mean")
    loss.backward()
    assert log_prob.grad.tolist()[0] == pytest.approx([0.0, (1 - torch.exp(torch.tensor(-0.5))).item() / 2, 0.0])
