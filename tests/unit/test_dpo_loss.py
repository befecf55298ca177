"""DPO's pair losses (rlcu.train.dpo_loss) against the formulas written out here, their
gradients against autograd of those formulas, and the per-token gradient against
differentiating the packed sequence sums."""

import math

import pytest
import torch

from rlcu.train.dpo_loss import PAIR_STATS, pair_loss, pair_stats, seq_sums, token_grads
from rlcu.train.pair_batch import greedy_batches, pack_pairs, pair_len


def _sig(x):
    return 1 / (1 + math.exp(-x))


def _inputs(P=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    pi = -20 * torch.rand(4, P, generator=g, dtype=torch.float64)  # pi_c, pi_r, ref_c, ref_r
    n = torch.randint(1, 9, (2, P), generator=g).double()
    return (*pi, *n)


@pytest.mark.parametrize("loss_type,eps", [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0)])
def test_pair_loss_against_the_formula_and_autograd(loss_type, eps):
    beta = 0.3
    pi_c, pi_r, ref_c, ref_r, n_c, n_r = _inputs()
    loss, dc, dr = pair_loss(pi_c, pi_r, ref_c, ref_r, n_c, n_r, loss_type=loss_type, beta=beta, label_smoothing=eps)
    for k in range(pi_c.numel()):  # one pair at a time, in plain floats
        hc, hr = float(pi_c[k] - ref_c[k]), float(pi_r[k] - ref_r[k])
        if loss_type == "sigmoid":
            z = beta * (hc - hr)
            want = -(1 - eps) * math.log(_sig(z)) - eps * math.log(_sig(-z))
        else:
            want = (hc / float(n_c[k]) - hr / float(n_r[k]) - 1 / (2 * beta)) ** 2
        assert float(loss[k]) == pytest.approx(want, rel=1e-12)
    a, b = pi_c.clone().requires_grad_(), pi_r.clone().requires_grad_()
    if loss_type == "sigmoid":
        z = beta * ((a - ref_c) - (b - ref_r))
        ref_loss = -(1 - eps) * torch.log(torch.sigmoid(z)) - eps * torch.log(torch.sigmoid(-z))
    else:
        ref_loss = ((a - ref_c) / n_c - (b - ref_r) / n_r - 1 / (2 * beta)) ** 2
    ref_loss.sum().backward()
    torch.testing.assert_close(dc, a.grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(dr, b.grad, rtol=1e-12, atol=1e-14)


def test_large_margins_stay_finite_and_stats_are_trls():
    pi_c = torch.tensor([0.0, -1e4, -3.0])
    pi_r = torch.tensor([-1e4, 0.0, -3.0])
    zero = torch.zeros(3)
    loss, dc, dr = pair_loss(pi_c, pi_r, zero, zero, zero + 1, zero + 1, beta=1.0)
    assert torch.isfinite(loss).all() and torch.isfinite(dc).all()
    assert float(loss[0]) == 0.0 and float(loss[1]) == pytest.approx(1e4)
    s = dict(zip(PAIR_STATS, pair_stats(loss, pi_c, pi_r, zero, zero, 0.5).tolist()))
    assert s["rewards/chosen"] == pytest.approx(0.5 * (-1e4 - 3)) and s["rewards/accuracies"] == 1.0  # ties: not >
    assert s["rewards/margins"] == pytest.approx(s["rewards/chosen"] - s["rewards/rejected"])
    assert s["logps/rejected"] == pytest.approx(-1e4 - 3)
    with pytest.raises(ValueError, match="loss_type must be one of sigmoid, ipo"):
        pair_loss(pi_c, pi_r, zero, zero, zero, zero, loss_type="hinge")


def test_packed_pairs_sums_and_token_gradients():
    """Two pairs packed as [c0, r0, c1, r1]: the prompt and each sequence's first token masked
    out, the sums per sequence, and dlp = d(sum_s dseq_s * sum_i m_i lp_i)/dlp by autograd."""
    pairs = [([5, 6, 7], [1, 2], [3]), ([], [4, 4, 4], [9, 8])]
    b = pack_pairs(pairs, [0, 1], "cpu")
    assert b.tokens.tolist() == [5, 6, 7, 1, 2, 5, 6, 7, 3, 4, 4, 4, 9, 8]
    assert b.cu.tolist() == [0, 5, 9, 12, 14] and b.cu.dtype == torch.int32
    assert b.mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 1, 0, 1, 1, 0, 1]
    assert b.n_completion.tolist() == [[2, 1], [3, 2]]  # as TRL counts them (all completion tokens)
    assert [pair_len(p) for p in pairs] == [9, 5]
    assert greedy_batches([9, 5, 4, 20], [0, 1, 2, 3], 10) == [[0], [1, 2], [3]]
    lp = -torch.rand(b.num_tokens, dtype=torch.float64)
    s = seq_sums(lp, b.mask, b.seq, 4)
    assert s.tolist() == pytest.approx([float(lp[3] + lp[4]), float(lp[8]), float(lp[10] + lp[11]), float(lp[13])])
    dseq = torch.tensor([0.5, -2.0, 3.0, 0.25], dtype=torch.float64)
    x = lp.clone().requires_grad_()
    (seq_sums(x, b.mask, b.seq, 4) * dseq).sum().backward()
    torch.testing.assert_close(token_grads(dseq, b.mask, b.seq), x.grad.float())
