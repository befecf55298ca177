"""DPO's pair losses and their gradients by hand, and the per-token gradient the model's
backward starts from.

A pair's policy logprob pi_c (chosen) or pi_r (rejected) is the sum of its completion tokens'
logprobs (the prompt's masked out); ref_c, ref_r are the reference's, taken once before
training (rlcu.train.dpo_ref). With the log-ratios h_c = pi_c - ref_c, h_r = pi_r - ref_r:

    sigmoid (DPO; cDPO with label smoothing eps):
        z = beta (h_c - h_r)
        L = -(1 - eps) log sigmoid(z) - eps log sigmoid(-z)
        dL/dpi_c = beta (-(1 - eps) sigmoid(-z) + eps sigmoid(z)) = -dL/dpi_r
    ipo (TRL's: the log-ratios averaged over each completion's n_c, n_r tokens):
        u = h_c / n_c - h_r / n_r - 1 / (2 beta)
        L = u^2,    dL/dpi_c = 2 u / n_c,    dL/dpi_r = -2 u / n_r

The step's loss is the mean over its P pairs, so a pair's sequence gradient is dL/dpi / P and
each completion token i of sequence s gets dlp_i = m_i dL/dpi_s / P: the dlp that
model.backward (the fused LM-head sweep) takes, as SFT's -m_i / n and GRPO's fused
surrogate give theirs. This is O(pairs) arithmetic on a few scalars a pair and one gather a
token, so it is plain torch, not a kernel. The metrics are TRL's: rewards/chosen = beta h_c,
rewards/rejected = beta h_r, rewards/margins their difference, rewards/accuracies the share
of pairs whose chosen reward is the larger, logps/chosen and logps/rejected the policy's
sums; all as sums here (`pair_stats`), divided by the pair count once summed over
micro-batches and ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo")
PAIR_STATS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
              "logps/chosen", "logps/rejected")


def pair_loss(pi_c, pi_r, ref_c, ref_r, n_c, n_r, *, loss_type: str = "sigmoid", beta: float = 0.1,
              label_smoothing: float = 0.0):
    """The per-pair loss and its gradient at the policy's sequence logprobs.

    pi_c, pi_r, ref_c, ref_r: [P] sequence logprobs; n_c, n_r: [P] completion token counts (IPO
    averages over them). Returns (loss [P], dpi_c [P], dpi_r [P]), float64."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"DPO loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    if not beta > 0:
        raise ValueError(f"DPO beta must be > 0, got {beta}")
    h_c = pi_c.double() - ref_c.double()
    h_r = pi_r.double() - ref_r.double()
    if loss_type == "sigmoid":
        eps = float(label_smoothing)
        z = beta * (h_c - h_r)
        loss = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        dh = beta * (-(1 - eps) * torch.sigmoid(-z) + eps * torch.sigmoid(z))
        return loss, dh, -dh
    nc, nr = n_c.double().clamp_min(1), n_r.double().clamp_min(1)
    u = h_c / nc - h_r / nr - 1 / (2 * beta)
    return u * u, 2 * u / nc, -2 * u / nr


def pair_stats(loss, pi_c, pi_r, ref_c, ref_r, beta: float) -> torch.Tensor:
    """[len(PAIR_STATS)] float64 sums over the pairs (TRL's metrics once divided by the pair count)."""
    rc = beta * (pi_c.double() - ref_c.double())
    rr = beta * (pi_r.double() - ref_r.double())
    return torch.stack([loss.double().sum(), rc.sum(), rr.sum(), (rc > rr).double().sum(), (rc - rr).sum(),
                        pi_c.double().sum(), pi_r.double().sum()])


def seq_sums(lp: torch.Tensor, mask: torch.Tensor, seq: torch.Tensor, n_seqs: int) -> torch.Tensor:
    """[n_seqs] float64: each sequence's masked logprob sum. lp, mask: [N]; seq: [N] the
    sequence index of each token."""
    out = torch.zeros(n_seqs, dtype=torch.float64, device=lp.device)
    return out.index_add_(0, seq, (lp.double() * mask.double()))


def token_grads(dseq: torch.Tensor, mask: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """[N] fp32 dlp_i = m_i dseq[seq_i]: a sequence's gradient on each of its completion tokens."""
    return (dseq.index_select(0, seq) * mask.double()).float()
