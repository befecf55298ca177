"""The RL per-token losses (GRPO/PPO policy loss, PPO value loss) and their gradients, fused
into one elementwise pass that also reduces the step's statistics, so that the backward
starts from one buffer (dlp) and the statistics never need a second pass.

Policy loss, per token i, with weight w_i (mask x aggregation, see rlcu.train.losses),
log-ratio d = lp - old, ratio r = exp(d), advantage A, k = ref - lp, and the behaviour-policy
correction weight b_i (1 without one; TIS / MIS weights, see rlcu.train.mismatch: a constant
per token, so it scales the surrogate's gradient and nothing else):
    pg   = max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A)           (clipped surrogate)
    kl   = exp(k) - k - 1                                              (k3 estimator of KL(pi||ref))
    loss = w (b pg + beta kl - c_ent ent)
    dlp  = w (-b r A [clip branch not active] + beta (1 - exp(k)))
    dent = -w c_ent
The clip branch is active (its gradient is zero) when -clip(r) A > -r A, i.e. r > 1 + eps_high
with A > 0 ("clip high") or r < 1 - eps_low with A < 0 ("clip low"). The statistic
approx_kl = r - 1 - d is the k3 estimate of KL(old || new): how far the updates have moved.

Value loss (PPO), with value v, the rollout's value v_old, return R and clip range c:
    vc   = v_old + clip(v - v_old, -c, c)
    loss = w / 2 max((v - R)^2, (vc - R)^2)
    dv   = w (v - R) if the unclipped branch is the max, else w (vc - R) [|v - v_old| < c]

Statistics are w-weighted sums over tokens, one row of partial sums per program (summed by
the caller: deterministic, no atomics); dividing by the `weight` statistic gives means under
the chosen aggregation, and sums over micro-batches add up. `pg_loss` is the corrected term
(sum w b pg); the clip fractions, ratio and approx_kl are w-weighted, b does not enter them.
Tokens with w = 0 contribute exactly zero to every output (their logprobs may be anything).

Sequence-level ratio (GSPO, `sequence_policy_loss`): sequence s's log-ratio is the mean over its
live tokens (w != 0, n_s of them) l_s = sum_t (lp_t - old_t) / n_s, its ratio s = exp(l_s), and
every token of s takes the surrogate pg_s = max(-s A_t, -clip(s) A_t) (A_t = A_s for GRPO), so
    loss = sum_t w_t (b_t pg_s + beta kl_t - c_ent ent_t)
    dlp_t = w_t beta (1 - exp(k_t)) + (1 / n_s) sum_{t' in s} w_t' b_t' (-s A_t') [unclipped]
The pg part is the token op above run on l_s broadcast to its tokens (old 0, no KL): its dlp at
t' is w_t' b_t' d pg_s / d l_s, and d l_s / d lp_t = 1 / n_s spreads their sum over the
sequence. The KL and entropy parts are the token op with A = 0. GSPO-token (`level="sequence_token"`)
is the same clip on the same s with each token's own gradient, s_t = sg(s) pi_t / sg(pi_t):
dlp_t = w_t b_t (-s A_t) [unclipped], the pg part's dlp as it comes. Statistics: the clip
fractions and the ratio are the sequences' (w-weighted, so per sequence under seq_mean), kl,
entropy and approx_kl the tokens'.
The public ops are `policy_loss`, `sequence_policy_loss` and `value_loss` (each is forward and
backward at once).
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import tl, triton, use_triton

POLICY_STATS = ("loss", "pg_loss", "kl", "entropy", "clip_low", "clip_high", "approx_kl", "ratio", "weight")
VALUE_STATS = ("loss", "clip_frac", "value", "weight")
_BN = 1024  # tokens a program handles


@triton.jit(do_not_specialize=["N"])
def _policy_loss_kernel(LP, OLD, REF, ADV, W, BW, ENT, LOSS, DLP, DENT, STATS, N, eps_low, eps_high, beta, c_ent,
                        HAS_REF: tl.constexpr, HAS_BW: tl.constexpr, HAS_ENT: tl.constexpr, NS: tl.constexpr,
                        BN: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BN + tl.arange(0, BN)
    m = i < N
    w = tl.load(W + i, mask=m, other=0.0).to(tl.float32)
    live = w != 0.0
    lp = tl.load(LP + i, mask=m, other=0.0).to(tl.float32)
    old = tl.load(OLD + i, mask=m, other=0.0).to(tl.float32)
    adv = tl.load(ADV + i, mask=m, other=0.0).to(tl.float32)
    d = tl.where(live, lp - old, 0.0)
    r = tl.exp(d)
    rc = tl.minimum(tl.maximum(r, 1.0 - eps_low), 1.0 + eps_high)
    a = -r * adv
    b = -rc * adv
    clipped = b > a
    pg = tl.maximum(a, b)
    g = tl.where(clipped, 0.0, a)  # d pg / d lp
    if HAS_BW:  # the behaviour-policy weight: a constant factor on the surrogate
        bw = tl.where(live, tl.load(BW + i, mask=m, other=0.0).to(tl.float32), 0.0)
        pg = bw * pg
        g = bw * g
    loss = pg
    kl = tl.zeros_like(pg)
    if HAS_REF:
        ref = tl.load(REF + i, mask=m, other=0.0).to(tl.float32)
        k = tl.where(live, ref - lp, 0.0)
        ek = tl.exp(k)
        kl = ek - k - 1.0
        loss += beta * kl
        g += beta * (1.0 - ek)
    ent = tl.zeros_like(pg)
    if HAS_ENT:
        ent = tl.load(ENT + i, mask=m, other=0.0).to(tl.float32)
        loss -= c_ent * ent
        tl.store(DENT + i, -c_ent * w, mask=m)
    loss = tl.where(live, w * loss, 0.0)
    tl.store(LOSS + i, loss, mask=m)
    tl.store(DLP + i, tl.where(live, w * g, 0.0), mask=m)
    # statistics: w-weighted partial sums, in the order of POLICY_STATS
    S = STATS + pid * NS
    wl = tl.where(live, w, 0.0)
    tl.store(S + 0, tl.sum(loss, 0))
    tl.store(S + 1, tl.sum(wl * pg, 0))
    tl.store(S + 2, tl.sum(wl * kl, 0))
    tl.store(S + 3, tl.sum(wl * ent, 0))
    tl.store(S + 4, tl.sum(tl.where(clipped & (adv < 0.0), wl, 0.0), 0))
    tl.store(S + 5, tl.sum(tl.where(clipped & (adv > 0.0), wl, 0.0), 0))
    tl.store(S + 6, tl.sum(wl * (r - 1.0 - d), 0))
    tl.store(S + 7, tl.sum(wl * r, 0))
    tl.store(S + 8, tl.sum(wl, 0))


@triton.jit(do_not_specialize=["N"])
def _value_loss_kernel(V, VOLD, RET, W, LOSS, DV, STATS, N, clip, NS: tl.constexpr, BN: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BN + tl.arange(0, BN)
    m = i < N
    w = tl.load(W + i, mask=m, other=0.0).to(tl.float32)
    live = w != 0.0
    v = tl.load(V + i, mask=m, other=0.0).to(tl.float32)
    vold = tl.load(VOLD + i, mask=m, other=0.0).to(tl.float32)
    ret = tl.load(RET + i, mask=m, other=0.0).to(tl.float32)
    dd = v - vold
    dc = tl.minimum(tl.maximum(dd, -clip), clip)
    e1 = v - ret
    e2 = vold + dc - ret
    clipped = e2 * e2 > e1 * e1
    g = tl.where(clipped, tl.where(dd == dc, e2, 0.0), e1)
    loss = tl.where(live, 0.5 * w * tl.maximum(e1 * e1, e2 * e2), 0.0)
    tl.store(LOSS + i, loss, mask=m)
    tl.store(DV + i, tl.where(live, w * g, 0.0), mask=m)
    S = STATS + pid * NS
    wl = tl.where(live, w, 0.0)
    tl.store(S + 0, tl.sum(loss, 0))
    tl.store(S + 1, tl.sum(tl.where(clipped, wl, 0.0), 0))
    tl.store(S + 2, tl.sum(wl * v, 0))
    tl.store(S + 3, tl.sum(wl, 0))


def _check(name: str, x: torch.Tensor | None, N: int, device) -> torch.Tensor | None:
    if x is None:
        return None
    if x.shape != (N,):
        raise ValueError(f"rl_loss: {name} must have shape [{N}], got {list(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"rl_loss: {name} must be a float tensor, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"rl_loss: {name} is on {x.device}, lp on {device}")
    return x.contiguous()


def _block(N: int, block: int | None) -> int:
    return block or min(_BN, max(16, triton.next_power_of_2(max(N, 1))))


def policy_loss_triton(lp, old_lp, ref_lp, adv, w, ent, clip_low, clip_high, kl_coef, entropy_coef, block=None,
                       is_w=None):
    N = lp.shape[0]
    lp, old_lp, ref_lp, adv, w, ent, is_w = (_check(n, x, N, lp.device) for n, x in (
        ("lp", lp, ), ("old_lp", old_lp), ("ref_lp", ref_lp), ("adv", adv), ("w", w), ("ent", ent), ("is_w", is_w)))
    BN = _block(N, block)
    grid = triton.cdiv(N, BN)
    f32 = dict(device=lp.device, dtype=torch.float32)
    loss, dlp = torch.empty(N, **f32), torch.empty(N, **f32)
    dent = torch.empty(N, **f32) if ent is not None else None
    NS = len(POLICY_STATS)
    part = torch.empty(max(grid, 1), NS, **f32)
    if N == 0:
        part.zero_()
    else:
        _policy_loss_kernel[(grid,)](lp, old_lp, lp if ref_lp is None else ref_lp, adv, w,
                                     w if is_w is None else is_w, lp if ent is None else ent, loss, dlp,
                                     loss if dent is None else dent, part, N, float(clip_low), float(clip_high),
                                     float(kl_coef), float(entropy_coef), HAS_REF=ref_lp is not None,
                                     HAS_BW=is_w is not None, HAS_ENT=ent is not None, NS=NS, BN=BN, num_warps=4)
    return loss, dlp, dent, part.sum(0)


def value_loss_triton(v, v_old, returns, w, clip, block=None):
    N = v.shape[0]
    v, v_old, returns, w = (_check(n, x, N, v.device) for n, x in (
        ("v", v), ("v_old", v_old), ("returns", returns), ("w", w)))
    BN = _block(N, block)
    grid = triton.cdiv(N, BN)
    f32 = dict(device=v.device, dtype=torch.float32)
    loss, dv = torch.empty(N, **f32), torch.empty(N, **f32)
    NS = len(VALUE_STATS)
    part = torch.empty(max(grid, 1), NS, **f32)
    if N == 0:
        part.zero_()
    else:
        _value_loss_kernel[(grid,)](v, v_old, returns, w, loss, dv, part, N, float(clip), NS=NS, BN=BN,
                                    num_warps=4)
    return loss, dv, part.sum(0)


def policy_loss_ref(lp, old_lp, ref_lp, adv, w, ent, clip_low, clip_high, kl_coef, entropy_coef, is_w=None):
    lp, old_lp, adv, w = lp.float(), old_lp.float(), adv.float(), w.float()
    live = w != 0
    zero = torch.zeros_like(lp)
    d = torch.where(live, lp - old_lp, zero)
    r = torch.exp(d)
    a = -r * adv
    b = -r.clamp(1 - clip_low, 1 + clip_high) * adv
    clipped = b > a
    pg = torch.maximum(a, b)
    g = torch.where(clipped, zero, a)
    if is_w is not None:
        bw = torch.where(live, is_w.float(), zero)
        pg, g = bw * pg, bw * g
    loss = pg.clone()
    kl = zero
    if ref_lp is not None:
        k = torch.where(live, ref_lp.float() - lp, zero)
        ek = torch.exp(k)
        kl = ek - k - 1
        loss = loss + kl_coef * kl
        g = g + kl_coef * (1 - ek)
    e = zero
    dent = None
    if ent is not None:
        e = ent.float()
        loss = loss - entropy_coef * e
        dent = -entropy_coef * w
    loss = torch.where(live, w * loss, zero)
    dlp = torch.where(live, w * g, zero)
    wl = torch.where(live, w, zero)
    stats = torch.stack([
        loss.sum(), (wl * pg).sum(), (wl * kl).sum(), (wl * e).sum(),
        torch.where(clipped & (adv < 0), wl, zero).sum(), torch.where(clipped & (adv > 0), wl, zero).sum(),
        (wl * (r - 1 - d)).sum(), (wl * r).sum(), wl.sum()])
    return loss, dlp, dent, stats


def value_loss_ref(v, v_old, returns, w, clip):
    v, v_old, returns, w = v.float(), v_old.float(), returns.float(), w.float()
    live = w != 0
    zero = torch.zeros_like(v)
    dd = v - v_old
    dc = dd.clamp(-clip, clip)
    e1 = v - returns
    e2 = v_old + dc - returns
    clipped = e2 * e2 > e1 * e1
    g = torch.where(clipped, torch.where(dd == dc, e2, zero), e1)
    loss = torch.where(live, 0.5 * w * torch.maximum(e1 * e1, e2 * e2), zero)
    dv = torch.where(live, w * g, zero)
    wl = torch.where(live, w, zero)
    stats = torch.stack([loss.sum(), torch.where(clipped, wl, zero).sum(), (wl * v).sum(), wl.sum()])
    return loss, dv, stats


def policy_loss(lp, old_lp, ref_lp, adv, w, ent=None, *, clip_low: float = 0.2, clip_high: float = 0.2,
                kl_coef: float = 0.0, entropy_coef: float = 0.0, is_w=None):
    """The clipped policy loss and its gradient in one pass.

    lp, old_lp, adv, w: [N]; ref_lp, ent: [N] or None (no KL term / no entropy term); is_w: [N]
    behaviour-policy correction weights on the surrogate, or None (all 1).
    Returns (loss [N], dlp [N], dent [N] | None, stats [len(POLICY_STATS)]), all fp32; the
    total loss is loss.sum() and dlp = d loss.sum() / d lp, dent = d loss.sum() / d ent.
    """
    if use_triton(lp):
        return policy_loss_triton(lp, old_lp, ref_lp, adv, w, ent, clip_low, clip_high, kl_coef, entropy_coef,
                                  is_w=is_w)
    return policy_loss_ref(lp, old_lp, ref_lp, adv, w, ent, clip_low, clip_high, kl_coef, entropy_coef, is_w)


def value_loss(v, v_old, returns, w, *, clip: float):
    """The clipped value loss and its gradient in one pass.

    v, v_old, returns, w: [N]. Returns (loss [N], dv [N], stats [len(VALUE_STATS)]), fp32.
    """
    if use_triton(v):
        return value_loss_triton(v, v_old, returns, w, clip)
    return value_loss_ref(v, v_old, returns, w, clip)


def sequence_policy_loss(lp, old_lp, ref_lp, adv, w, cu_seqlens, ent=None, *, level: str = "sequence",
                         clip_low: float = 0.2, clip_high: float = 0.2, kl_coef: float = 0.0,
                         entropy_coef: float = 0.0, is_w=None):
    """The clipped policy loss on each sequence's ratio (GSPO; module docstring) and its gradient.

    As `policy_loss`, over whole sequences: cu_seqlens [S+1] int offsets into the [N] inputs
    (a micro-batch never splits a sequence). level: sequence (GSPO) or sequence_token
    (GSPO-token). Returns (loss [N], dlp [N], dent [N] | None, stats [len(POLICY_STATS)])."""
    if level not in ("sequence", "sequence_token"):
        raise ValueError(f"sequence_policy_loss: level must be sequence or sequence_token, got {level!r}")
    N = lp.shape[0]
    if cu_seqlens.ndim != 1 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != N:
        raise ValueError(f"sequence_policy_loss: cu_seqlens must run from 0 to N = {N}, got "
                         f"{cu_seqlens.tolist() if cu_seqlens.numel() < 16 else list(cu_seqlens.shape)}")
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=lp.device), lens)  # [N] sequence of each token
    live = (w != 0).float()
    S = lens.numel()
    n = torch.zeros(S, device=lp.device).index_add_(0, seq, live).clamp_min(1)
    d = torch.where(live > 0, lp.float() - old_lp.float(), torch.zeros_like(live))
    ls = (torch.zeros(S, device=lp.device).index_add_(0, seq, d) / n)[seq]  # [N] l_s on each token
    zero = torch.zeros_like(ls)
    loss_t, dlp_t, dent, st_t = policy_loss(lp, old_lp, ref_lp, zero, w, ent, clip_low=clip_low,
                                            clip_high=clip_high, kl_coef=kl_coef, entropy_coef=entropy_coef)
    loss_s, dls, _, st_s = policy_loss(ls, zero, None, adv, w, None, clip_low=clip_low, clip_high=clip_high,
                                       is_w=is_w)
    if level == "sequence":
        dls = (torch.zeros(S, device=lp.device).index_add_(0, seq, dls) / n)[seq] * live
    stats = st_t.clone()
    for k in ("pg_loss", "clip_low", "clip_high", "ratio"):
        i = POLICY_STATS.index(k)
        stats[i] = st_s[i]
    stats[0] = st_t[0] + st_s[0]
    return loss_t + loss_s, dlp_t + dls, dent, stats
