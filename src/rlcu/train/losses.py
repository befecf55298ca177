"""What turns rewards into per-token training signal: group advantages (GRPO, RLOO),
REINFORCE++'s whitened returns, GAE (PPO), the per-token weights that implement the loss
aggregation, the overlong penalty, and running reward normalisation. The per-token loss itself
is the fused op `rlcu.ops.rl_loss`. docs/estimators.md gives the formulas beside TRL's and
verl's names.

Aggregation is folded into per-token weights w so that the total loss is sum_i w_i loss_i:
    token    (DAPO):   w_i = m_i / sum_j m_j                     (every token of the batch counts once)
    seq_mean (GRPO):   w_i = m_i / (|o_s| S)                     (mean over each sequence, then over S)
    seq_mean_token_sum_norm (Dr. GRPO):  w_i = m_i / (S L)       (L = max_new_tokens, a constant)
with m_i = 1 on the completion tokens of unmasked samples and S the batch's sequences with
such a token. The first two sum to 1 over the whole batch, so the sums over micro-batches of
w-weighted statistics are batch means; Dr. GRPO's sum to (mean length) / L <= 1, and its
statistics are divided by that sum (the `weight` statistic) to read as means.
"""

from __future__ import annotations

import math

import torch

AGGREGATIONS = ("token", "seq_mean", "seq_mean_token_sum_norm")


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4):
    """rewards: [P*G] (nan = masked sample), groups of G consecutive samples.

    A = r - mean(group), divided by (std(group) + eps) when `scale`; mean and std over the
    group's unmasked samples (std unbiased, as GRPO). A group with fewer than two unmasked
    samples gives 0. Returns (adv [P*G] with 0 at masked samples, group std [P] (nan when
    undefined))."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.double().view(-1, group_size)
    valid = ~torch.isnan(r)
    n = valid.sum(1, keepdim=True)
    rz = torch.where(valid, r, torch.zeros_like(r))
    mean = rz.sum(1, keepdim=True) / n.clamp_min(1)
    var = (torch.where(valid, r - mean, torch.zeros_like(r)) ** 2).sum(1, keepdim=True) / (n - 1).clamp_min(1)
    std = var.sqrt()
    adv = rz - mean
    if scale:  # an all-equal group has adv = 0 already: keep it 0, not 0/0 (an inf reward stays non-finite)
        adv = torch.where(std == 0, torch.zeros_like(adv), adv / (std + eps))
    adv = torch.where(valid & (n >= 2), adv, torch.zeros_like(adv))
    std = torch.where(n >= 2, std, torch.full_like(std, float("nan")))
    return adv.view(-1).float(), std.view(-1).float()


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO's leave-one-out advantage: rewards [P*G] (nan = masked), groups of G consecutive.

    A_i = r_i - mean_{j != i} r_j over the group's unmasked samples = n/(n-1) (r_i - mean), n
    of them; no std scaling (TRL's RLOOTrainer, normalize_advantages off). A group with fewer
    than two unmasked samples gives 0, and so does a masked sample."""
    adv, _ = group_advantages(rewards, group_size, scale=False)
    n = (~torch.isnan(rewards.view(-1, group_size))).sum(1, keepdim=True).double()
    return (adv.double().view(-1, group_size) * n / (n - 1).clamp_min(1)).view(-1).float()


def reinforce_pp_advantages(scores: torch.Tensor, cu_seqlens: torch.Tensor, mask: torch.Tensor,
                            kl_tok: torch.Tensor | None, kl_coef: float) -> tuple[torch.Tensor, dict]:
    """REINFORCE++ (OpenRLHF): per-token rewards r_t = -kl_coef kl_t on the loss's tokens
    (mask 1; kl_tok the k1 estimate old_lp - ref_lp, or None) plus the sequence's score on its
    last such token; returns G_t = sum_{t' >= t} r_t' within the sequence (gamma 1, no critic:
    GAE with V = 0 and lambda 1); the advantages are those returns whitened over every loss
    token of the batch. scores: [S] (masked samples: any value; the baseline flavour passes
    them group-centred). Returns (adv [N], 0 off the mask; metrics)."""
    idx, lens = masked_index(cu_seqlens, mask)  # the loss's tokens, sequence after sequence
    r = torch.zeros(mask.numel(), device=mask.device, dtype=torch.float32)
    if kl_tok is not None and kl_coef:
        r -= kl_coef * kl_tok * (mask > 0)
    has = lens > 0
    last = idx[lens.cumsum(0)[has] - 1]
    r.index_add_(0, last, torch.nan_to_num(scores.to(r.device).float()[has]))
    ret_c, _ = gae(r[idx], torch.zeros_like(r[idx]), lens.tolist(), 1.0, 1.0)
    ret = torch.zeros_like(r).index_copy_(0, idx, ret_c)
    adv = whiten(ret, mask) * (mask > 0)
    live = mask > 0
    m = {"returns": float(ret[live].mean()) if live.any() else 0.0}
    if kl_tok is not None:
        m["kl_penalty"] = float((kl_tok * live).sum()) / max(int(has.sum()), 1)  # per sequence, as PPO's
    return adv, m


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[P] bool: the groups whose unmasked rewards are not all equal (dynamic sampling keeps these)."""
    r = rewards.view(-1, group_size)
    valid = ~torch.isnan(r)
    hi = torch.where(valid, r, torch.full_like(r, -math.inf)).amax(1)
    lo = torch.where(valid, r, torch.full_like(r, math.inf)).amin(1)
    return (valid.sum(1) >= 2) & (hi > lo)


def token_weights(cu_seqlens: torch.Tensor, mask: torch.Tensor, agg: str, n_seqs: int | None = None,
                  n_tokens: int | None = None, horizon: int | None = None) -> torch.Tensor:
    """Per-token weights for the aggregation `agg` over one packed (micro-)batch.

    mask: [N] 0/1 per token (completion tokens of kept samples). `n_seqs` / `n_tokens` are the
    normalisers of the WHOLE batch (when this is one micro-batch of it): the number of
    sequences with at least one masked-in token, and the number of masked-in tokens.
    horizon: seq_mean_token_sum_norm's constant L (max_new_tokens), which it needs."""
    if agg not in AGGREGATIONS:
        raise ValueError(f"loss aggregation must be one of {', '.join(AGGREGATIONS)}, got {agg!r}")
    m = mask.float()
    if agg == "token":
        tot = float(m.sum()) if n_tokens is None else float(n_tokens)
        return m / max(tot, 1.0)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=m.device), lens)
    per_seq = torch.zeros(lens.numel(), device=m.device).index_add_(0, seq, m)  # masked-in tokens per sequence
    S = int((per_seq > 0).sum()) if n_seqs is None else n_seqs
    if agg == "seq_mean_token_sum_norm":
        if not horizon or horizon < 1:
            raise ValueError(f"loss aggregation {agg} needs horizon (max_new_tokens) >= 1, got {horizon!r}")
        return m / (max(S, 1) * float(horizon))
    return m / (per_seq.clamp_min(1)[seq] * max(S, 1))


def overlong_penalty(lengths: torch.Tensor, max_len: int | torch.Tensor, buffer: int) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward: 0 up to max_len - buffer, then
    falling linearly to -1 at max_len (and -1 beyond); max_len one for all or one per sample."""
    L = lengths.float()
    if buffer <= 0:
        return torch.where(L >= max_len, -torch.ones_like(L), torch.zeros_like(L))
    start = max_len - buffer
    return torch.clamp((start - L) / buffer, -1.0, 0.0)


def gae(rewards: torch.Tensor, values: torch.Tensor, lengths: list[int], gamma: float, lam: float):
    """Generalised advantage estimation over the completion tokens of each sequence.

    rewards, values: [sum(lengths)] packed completion tokens, sequence after sequence (values[t]
    = V(state before token t)). With V = 0 after the last token:
        delta_t = r_t + gamma V_{t+1} - V_t,   A_t = delta_t + gamma lam A_{t+1},   R_t = A_t + V_t
    Returns (advantages, returns), packed the same way. The recursion runs over time for all
    sequences at once ([S, Lmax] padded), so its cost is Lmax vector steps."""
    S = len(lengths)
    if S == 0:
        return rewards.clone(), rewards.clone()
    Lmax = max(lengths)
    dev = rewards.device
    lens = torch.tensor(lengths, device=dev)
    idx = torch.arange(Lmax, device=dev)
    valid = idx[None, :] < lens[:, None]  # [S, Lmax]
    R = torch.zeros(S, Lmax, device=dev, dtype=torch.float64)
    V = torch.zeros(S, Lmax + 1, device=dev, dtype=torch.float64)
    R[valid] = rewards.double()
    V[:, :Lmax][valid] = values.double()
    adv = torch.zeros(S, Lmax, device=dev, dtype=torch.float64)
    last = torch.zeros(S, device=dev, dtype=torch.float64)
    for t in reversed(range(Lmax)):
        delta = R[:, t] + gamma * V[:, t + 1] - V[:, t]
        last = torch.where(valid[:, t], delta + gamma * lam * last, torch.zeros_like(last))
        adv[:, t] = last
    ret = adv + V[:, :Lmax]
    return adv[valid].float(), ret[valid].float()


def masked_index(cu_seqlens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([M] positions of the tokens with mask > 0, sequence after sequence, [S] how many each
    sequence has): the tokens GAE runs over (PPO), an episode's environment tokens left out."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=mask.device), lens)
    live = mask > 0
    counts = torch.zeros(lens.numel(), dtype=torch.long, device=mask.device).index_add_(0, seq, live.long())
    return live.nonzero()[:, 0], counts


def whiten(x: torch.Tensor, w: torch.Tensor | None = None, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the entries with w > 0 (all entries when w is None)."""
    sel = x if w is None else x[w > 0]
    if sel.numel() < 2:
        return x - (sel.mean() if sel.numel() else 0.0)
    return (x - sel.mean()) / (sel.std() + eps)


def reward_metrics(scores: torch.Tensor, masked: torch.Tensor) -> dict:
    """A step's reward metrics: reward and reward_std over the scored samples (nan = no
    score), masked_frac the fraction that carries no loss (`masked`, bool)."""
    ok = ~torch.isnan(scores)
    return {"reward": float(scores[ok].mean()) if ok.any() else math.nan,
            "reward_std": float(scores[ok].std()) if ok.sum() > 1 else 0.0,
            "masked_frac": float(masked.float().mean())}


class RunningMoments:
    """Running mean and variance of the scores seen so far (Chan et al.'s parallel update),
    for PPO's reward normalisation; state_dict() goes into the checkpoint."""

    def __init__(self):
        self.count, self.mean, self.var = 0.0, 0.0, 1.0

    def update(self, x: torch.Tensor) -> None:
        x = x[~torch.isnan(x)].double()
        n = x.numel()
        if n == 0:
            return
        self.merge(n, float(x.mean()), float(x.var(unbiased=False)))

    def merge(self, n: float, bm: float, bv: float) -> None:
        """Take in a batch of n scores of mean bm and (population) variance bv."""
        tot = self.count + n
        d = bm - self.mean
        m2 = self.var * self.count + bv * n + d * d * self.count * n / tot
        self.mean += d * n / tot
        self.var = m2 / tot
        self.count = tot

    @property
    def std(self) -> float:
        return math.sqrt(max(self.var, 0.0))

    def normalise(self, x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        return (x - self.mean) / (self.std + eps)

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "var": self.var}

    def load_state_dict(self, d: dict) -> None:
        self.count, self.mean, self.var = float(d["count"]), float(d["mean"]), float(d["var"])
