"""The train/inference mismatch of one RL step, measured, and the field's corrections for it.

The engine samples each completion token a ~ mu (the behaviour policy) and returns its logprob
lp_engine = log mu(a); the trainer's forward of the same weights gives lp_train = log pi(a).
Outside exact mode the two differ by kernel rounding (batch-dependent GEMM tiles, attention
splits, the sampler's vocabulary chunks), so "on-policy" GRPO/PPO is slightly off-policy.

Metrics, every step, over the loss's tokens (mask 1), with d = lp_train - lp_engine and
rho = exp(d) = pi(a) / mu(a):
    mismatch/abs_mean      mean |d|
    mismatch/abs_max       max |d|
    mismatch/exact_frac    fraction of tokens with lp_train == lp_engine bit for bit (fp32)
    mismatch/kl_k3         mean (rho - 1 - d): Schulman's k3 estimator of KL(mu || pi) from
                           mu's samples. E_mu[rho] = 1, so E_mu[rho - 1 - d] = E_mu[-d] =
                           E_mu[log mu - log pi] = KL(mu || pi); each term is >= 0.
    mismatch/ratio_p01     1st percentile of rho (linear interpolation between order statistics)
    mismatch/ratio_p99     99th percentile of rho
    mismatch/seq_abs_sum   mean over sequences of |sum_t d_t| (log of the sequence's ratio)
lp_train comes from a forward the step runs anyway: with old_logprobs: engine, the first
update's forward_backward (mu index 0, weights still theta_old; `StepCorrection.record`); with
old_logprobs: recompute, the recompute pass. Both are the trainer's logprobs at theta_old.

Old logprobs (`old_logprobs`): the policy the PPO ratio r = pi_theta / pi_old is taken against.
    engine     pi_old = mu: no extra pass. The ratio of the first update is rho, not 1: the clip
               sees the mismatch (verl's "bypass" mode: the behaviour policy is the proximal
               one, so no correction applies).
    recompute  pi_old = the trainer's forward without gradients before the updates
               (`Qwen3.forward(tokens, cu_seqlens, temperature=T)`, the micro-batches of the
               update), so the first update's ratio is exactly 1; mu is then corrected for with
               the weights below (decoupled PPO, Hilton et al. 2021, "Batch size-invariance for
               policy optimization"; verl's "decoupled" mode).

Behaviour-policy corrections (`behaviour_correction`, needs old_logprobs: recompute), with the
per-token rho_t = pi_old(a_t) / mu(a_t) = exp(old_lp - lp_engine) (log-ratios clamped to
+-20 before exp); the weight b multiplies the clipped surrogate of its token, as a constant
(rlcu.ops.rl_loss: loss = w (b pg + beta kl - c ent)):
    tis        b_t = min(rho_t, C), C = tis_cap. Truncated importance sampling: Yao, Liu et
               al. 2025, "Your efficient RL framework secretly brings you off-policy RL
               training" (C = 2 there); verl's rollout_is: token.
    mis_token  b_t = rho_t where mis_low <= rho_t <= mis_high; the other tokens are left out of
               the loss (out of its mask, and so of the aggregation's normaliser). Masked
               importance sampling: Liu, Li et al. 2025, "When speed kills stability:
               demystifying RL collapse from the training-inference mismatch"; verl's
               rollout_rs: token (rejection through the mask, the IS weight kept on the
               accepted tokens).
    mis_seq    the same at sequence level: rho_s = prod_t rho_t = exp(sum_t log rho_t) over the
               sequence's loss tokens (the product, as verl's rollout_rs: sequence / its seq_mis
               preset; verl's "geometric" level, exp(mean log rho), is a different option with
               far tighter bounds), b_t = rho_s on every token of an accepted sequence; a
               sequence with rho_s outside [mis_low, mis_high] leaves the loss whole.
The rejected tokens leave the policy loss only: PPO's critic, GAE and whitening keep the batch's
own mask. Correction metrics: correction/weight_mean (mean b over the kept tokens),
correction/capped_frac (tis), correction/rejected_frac (tokens), correction/rejected_seq_frac.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from rlcu.parallel.comm import all_sum, world
from rlcu.train import rollout as ro

OLD_LOGPROBS = ("engine", "recompute")
CORRECTIONS = ("none", "tis", "mis_token", "mis_seq")
MISMATCH_KEYS = ("mismatch/abs_mean", "mismatch/abs_max", "mismatch/exact_frac", "mismatch/kl_k3",
                 "mismatch/ratio_p01", "mismatch/ratio_p99", "mismatch/seq_abs_sum")
_LOG_BOUND = 20.0  # log-ratios are clamped to +-20 before exp: weights within [2e-9, 5e8]


def _seq_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[N] the sequence each token belongs to."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lens.numel(), device=cu_seqlens.device), lens)


def _seq_sum(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[S] per-sequence sums of the per-token x [N]."""
    S = cu_seqlens.numel() - 1
    return torch.zeros(S, device=x.device, dtype=x.dtype).index_add_(0, _seq_ids(cu_seqlens), x)


def quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """The q-quantile of a 1-d x, interpolating linearly between the order statistics at
    positions floor(q (n-1)) and ceil(q (n-1)) (numpy's default; no size limit)."""
    xs = torch.sort(x).values
    pos = q * (xs.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, xs.numel() - 1)
    return xs[lo] + (pos - lo) * (xs[hi] - xs[lo])


def mismatch_metrics(lp_train: torch.Tensor, lp_engine: torch.Tensor, mask: torch.Tensor,
                     cu_seqlens: torch.Tensor) -> dict[str, float]:
    """The mismatch metrics (module docstring) over the tokens with mask > 0.

    lp_train, lp_engine, mask: [N]; cu_seqlens: [S+1]. Returns {} when no token is masked in."""
    live = mask > 0
    n = int(live.sum())
    if n == 0:
        return {}
    d = torch.where(live, lp_train.double() - lp_engine.double(), torch.zeros((), dtype=torch.float64,
                                                                                 device=lp_train.device))
    dl = d[live]
    rho = torch.exp(dl)
    seq_d = _seq_sum(d, cu_seqlens)
    seq_live = _seq_sum(live.double(), cu_seqlens) > 0
    vals = torch.stack([dl.abs().mean(), dl.abs().max(), (lp_train[live] == lp_engine[live]).double().mean(),
                        (rho - 1 - dl).mean(), quantile(rho, 0.01), quantile(rho, 0.99),
                        seq_d[seq_live].abs().mean()])
    return dict(zip(MISMATCH_KEYS, vals.tolist()))


def behaviour_weights(old_lp: torch.Tensor, engine_lp: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor,
                      mode: str, tis_cap: float = 2.0, mis_low: float = 0.5, mis_high: float = 2.0):
    """The correction of `mode` (module docstring) for one batch.

    old_lp, engine_lp, mask: [N]; cu_seqlens: [S+1]. Returns (b [N] fp32 or None, keep [N] fp32
    0/1 or None: the tokens the policy loss keeps, metrics). b is 0 off the kept tokens."""
    if mode not in CORRECTIONS:
        raise ValueError(f"behaviour_correction must be one of {', '.join(CORRECTIONS)}, got {mode!r}")
    if mode == "none":
        return None, None, {}
    live = mask > 0
    zero = torch.zeros((), device=old_lp.device, dtype=torch.float32)
    logr = torch.where(live, old_lp.float() - engine_lp.float(), zero)  # log rho_t, 0 off the loss
    n_tok = max(int(live.sum()), 1)
    if mode == "tis":
        rho = torch.exp(logr.clamp(-_LOG_BOUND, _LOG_BOUND))
        b = torch.where(live, rho.clamp(max=tis_cap), zero)
        m = {"correction/capped_frac": float((live & (rho > tis_cap)).sum()) / n_tok,
             "correction/weight_mean": float(b.sum()) / n_tok}
        return b, None, m
    if mode == "mis_token":
        rho = torch.exp(logr.clamp(-_LOG_BOUND, _LOG_BOUND))
        acc = live & (rho >= mis_low) & (rho <= mis_high)
        m = {}
    else:  # mis_seq: one ratio per sequence, prod_t rho_t, on each of its tokens
        seq_logr = _seq_sum(logr.double(), cu_seqlens).clamp(-_LOG_BOUND, _LOG_BOUND)
        seq_rho = torch.exp(seq_logr).float()
        seq_ok = (seq_rho >= mis_low) & (seq_rho <= mis_high)
        seq_live = _seq_sum(live.float(), cu_seqlens) > 0
        ids = _seq_ids(cu_seqlens)
        rho = seq_rho[ids]
        acc = live & seq_ok[ids]
        m = {"correction/rejected_seq_frac": float((seq_live & ~seq_ok).sum()) / max(int(seq_live.sum()), 1)}
    keep = acc.float()
    b = torch.where(acc, rho, zero)
    n_acc = int(acc.sum())
    m.update({"correction/rejected_frac": 1.0 - n_acc / n_tok,
              "correction/weight_mean": float(b.sum()) / max(n_acc, 1)})
    return b, keep, m


class StepCorrection:
    """One step's behaviour policy: keeps the engine's logprobs, replaces the batch's old
    logprobs with the trainer's (old_logprobs: recompute), and makes the correction's weights
    and mask; collects the mismatch metrics.

    Use, in a trainer's step, after the batch is packed and before anything reads old_lp:
        sc = StepCorrection(cfg, model, batch)
        ... policy updates on sc.policy_batch(), the first with record=sc.record ...
        metrics.update(sc.metrics())
    """

    def __init__(self, cfg, model, batch):
        if cfg.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"old_logprobs must be one of {', '.join(OLD_LOGPROBS)}, got {cfg.old_logprobs!r}")
        if cfg.behaviour_correction != "none" and cfg.old_logprobs != "recompute":
            raise ValueError(f"behaviour_correction: {cfg.behaviour_correction} needs old_logprobs: recompute")
        self.batch = batch
        self.engine_lp = batch.old_lp
        self._metrics: dict[str, float] = {}
        self._first_lp = None
        if cfg.old_logprobs == "recompute" and bool((batch.mask > 0).any()):  # (no loss token: no update)
            t0 = time.perf_counter()
            # across ranks each computes its own sequences, then all hold the whole batch's (the
            # metrics, and PPO's KL reward, read every sequence)
            lp = all_sum(ro.local_logprobs(model, batch, cfg.temperature, cfg.micro_batch_tokens, cfg.group_size))
            comp = torch.zeros(batch.num_tokens, dtype=torch.bool, device=lp.device)
            comp[batch.completion_index()] = True
            batch.old_lp = torch.where(comp, lp, torch.zeros_like(lp))  # 0 off the completions, as the engine's
            self._metrics.update(mismatch_metrics(batch.old_lp, self.engine_lp, batch.mask, batch.cu_seqlens))
            self._metrics["time/old_logprobs"] = time.perf_counter() - t0
        elif cfg.old_logprobs == "engine":
            self._first_lp = torch.zeros_like(batch.old_lp)
            self._recorded = 0
        self.weights, self.keep, m = behaviour_weights(batch.old_lp, self.engine_lp, batch.mask, batch.cu_seqlens,
                                                       cfg.behaviour_correction, cfg.tis_cap, cfg.mis_low,
                                                       cfg.mis_high)
        self._metrics.update(m)

    def policy_batch(self):
        """The batch the policy loss sees: the batch itself without a correction; else a
        shallow copy whose mask leaves the rejected tokens out and whose field "is_w" holds
        the weights b. Call it when the batch's fields are complete (PPO: after advantages)."""
        if self.weights is None:
            return self.batch
        mask = self.batch.mask if self.keep is None else self.batch.mask * self.keep
        return dataclasses.replace(self.batch, mask=mask, fields={**self.batch.fields, "is_w": self.weights})

    def record(self, a: int, b: int, lp: torch.Tensor) -> None:
        """The first update's lp [tokens of sequences a..b-1] (its forward_backward's output):
        the trainer's logprobs at theta_old, which the metrics need with old_logprobs: engine."""
        if self._first_lp is None:
            return
        cu = self.batch.cu_seqlens
        t0, t1 = int(cu[a]), int(cu[b])
        self._first_lp[t0:t1] = lp
        self._recorded += t1 - t0

    def metrics(self) -> dict[str, float]:
        """The step's mismatch and correction metrics (none from a step whose first update did
        not run, with old_logprobs: engine)."""
        out = dict(self._metrics)
        if self._first_lp is not None and world().distributed:
            # each rank recorded its own sequences (zeros elsewhere): the sum is the whole batch's
            self._first_lp = all_sum(self._first_lp)
            self._recorded = int(all_sum(torch.tensor([self._recorded], dtype=torch.float64)).item())
        if self._first_lp is not None and self._recorded == self.batch.num_tokens:
            out.update(mismatch_metrics(self._first_lp, self.engine_lp, self.batch.mask, self.batch.cu_seqlens))
        return out
