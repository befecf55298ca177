"""Qwen3-MoE's router after its GEMM: softmax over the E experts in fp32, top-k, the weights
renormalised over the k when `norm_topk_prob`; its backward; and the load-balancing loss of
transformers' `load_balancing_loss_func` with its gradient.

    ids, weights, probs = route_fwd(logits, k, norm)      ids [T, k] int32, weights [T, k], probs [T, E] fp32
    weights, probs = route_replay(logits, ids, norm)      the weights of given ids (routing replay)
    dlogits = route_bwd(dweights, probs, ids, weights, norm, daux)

Routing replay (model/routes.py) takes the experts from elsewhere (the rollout engine's choice)
and the weights from this router's own logits over them, w_j = p[i_j] / S, S in slot order: the
same function of the logits as route_fwd's at its own top-k, so route_bwd is its backward too
(the router's gradient flows through the replayed choice as through its own).

Top-k is taken on the probabilities (as transformers does), slot 0 the largest; equal
probabilities go to the LOWER expert id first. transformers' `torch.topk` leaves ties to the
implementation (on the CPU it is not the lower id: topk([0]*128, 8) gives 84, 87, 86, ...), so
rlcu fixes one rule, the same in the kernel, the twin, the engine and the trainer.

One row is one program's (the kernel) or one tree (the twin), with tiles that depend on E alone:
a token's route does not depend on the batch (exact mode). The twin's exp runs over rows padded
to a multiple of 64 columns (with -inf), so that no row of a [T, E] tensor falls in the scalar
tail of torch's vectorised exp, which rounds other than its vector lanes.

Backward. With p = softmax(l), w_j = p[i_j] / S (S = sum_j p[i_j]; S = 1 without norm):
    dp[i_j] = (dw_j - sum_m dw_m w_m) / S          (dp[i_j] = dw_j without norm)
    dp[e]  += daux[e]                               (the aux loss's share, the same for every row)
    dl      = p * (dp - sum_e p[e] dp[e])
Aux loss (transformers', summed over the L layers before the product):
    aux = E * sum_e (C_e / N) (P_e / N),  C_e = top-k picks of e, P_e = sum of p[:, e], N = L T rows
so d aux / d p[t, e] = E C_e / N^2 for every row t of every layer (C counts no gradient).
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import dispatch, tl, triton
from rlcu.ops.exact import tree_sum

BT = 16  # rows a program: fixed, so that a row's reductions are the same at every T
_PAD = 64  # the twin's row width multiple


@triton.jit
def _softmax_rows(L, rows, cols, rmask, cmask, stride_l):
    x = tl.load(L + rows[:, None] * stride_l + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                other=float("-inf")).to(tl.float32)
    m = tl.max(x, 1)
    m = tl.where(rmask, m, 0.0)
    ex = tl.where(cmask[None, :], tl.exp(x - m[:, None]), 0.0)
    s = tl.where(rmask, tl.sum(ex, 1), 1.0)  # rows past T: no 0 / 0
    return ex / s[:, None]


@triton.jit(do_not_specialize=["T"])
def _route_fwd_kernel(L, IDS, W, P, T, E, stride_l, K: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr,
                      BT: tl.constexpr, BE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.arange(0, BE)
    rmask, cmask = rows < T, cols < E
    p = _softmax_rows(L, rows, cols, rmask, cmask, stride_l)  # [BT, BE]
    tl.store(P + rows[:, None] * E + cols[None, :], p, mask=rmask[:, None] & cmask[None, :])
    q = tl.where(cmask[None, :], p, -1.0)  # probabilities are >= 0: -1 is never picked
    slots = tl.arange(0, KP)
    ids = tl.zeros([BT, KP], tl.int32)
    vals = tl.zeros([BT, KP], tl.float32)
    s = tl.zeros([BT], tl.float32)
    for j in tl.static_range(K):  # the largest left, the lowest id among equals
        v = tl.max(q, 1)
        i = tl.min(tl.where(q == v[:, None], cols[None, :], BE), 1)
        ids = tl.where(slots[None, :] == j, i[:, None], ids)
        vals = tl.where(slots[None, :] == j, v[:, None], vals)
        s += v  # slot order
        q = tl.where(cols[None, :] == i[:, None], -1.0, q)
    if NORM:
        vals = vals / tl.where(rmask, s, 1.0)[:, None]
    omask = rmask[:, None] & (slots < K)[None, :]
    tl.store(IDS + rows[:, None] * K + slots[None, :], ids, mask=omask)
    tl.store(W + rows[:, None] * K + slots[None, :], vals, mask=omask)


@triton.jit(do_not_specialize=["T"])
def _route_replay_kernel(L, IDS, W, P, T, E, stride_l, K: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr,
                         BT: tl.constexpr, BE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.arange(0, BE)
    rmask, cmask = rows < T, cols < E
    p = _softmax_rows(L, rows, cols, rmask, cmask, stride_l)  # [BT, BE]
    tl.store(P + rows[:, None] * E + cols[None, :], p, mask=rmask[:, None] & cmask[None, :])
    slots = tl.arange(0, KP)
    omask = rmask[:, None] & (slots < K)[None, :]
    ids = tl.load(IDS + rows[:, None] * K + slots[None, :], mask=omask, other=-1)
    vals = tl.zeros([BT, KP], tl.float32)
    s = tl.zeros([BT], tl.float32)
    for j in tl.static_range(K):  # p at the given id of slot j; S in slot order, as route_fwd's
        i = tl.sum(tl.where(slots[None, :] == j, ids, 0), 1)
        v = tl.sum(tl.where(cols[None, :] == i[:, None], p, 0.0), 1)
        vals = tl.where(slots[None, :] == j, v[:, None], vals)
        s += v
    if NORM:
        vals = vals / tl.where(rmask, s, 1.0)[:, None]
    tl.store(W + rows[:, None] * K + slots[None, :], vals, mask=omask)


@triton.jit(do_not_specialize=["T"])
def _route_bwd_kernel(DW, P, IDS, W, DAUX, DL, T, E, K: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr,
                      HAS_AUX: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.arange(0, BE)
    slots = tl.arange(0, KP)
    rmask, cmask = rows < T, cols < E
    m2 = rmask[:, None] & cmask[None, :]
    p = tl.load(P + rows[:, None] * E + cols[None, :], mask=m2, other=0.0)
    kmask = rmask[:, None] & (slots < K)[None, :]
    ids = tl.load(IDS + rows[:, None] * K + slots[None, :], mask=kmask, other=-1)
    dw = tl.load(DW + rows[:, None] * K + slots[None, :], mask=kmask, other=0.0).to(tl.float32)
    if NORM:
        w = tl.load(W + rows[:, None] * K + slots[None, :], mask=kmask, other=0.0)
        s = tl.zeros([BT], tl.float32)
        for j in tl.static_range(K):  # S in the forward's slot order
            i = tl.sum(tl.where(slots[None, :] == j, ids, 0), 1)
            s += tl.load(P + rows * E + i, mask=rmask, other=0.0)
        c = tl.sum(dw * w, 1)
        dw = (dw - c[:, None]) / tl.where(rmask, s, 1.0)[:, None]
    dp = tl.zeros([BT, BE], tl.float32)
    for j in tl.static_range(K):
        i = tl.sum(tl.where(slots[None, :] == j, ids, 0), 1)
        d = tl.sum(tl.where(slots[None, :] == j, dw, 0.0), 1)
        dp = tl.where(cols[None, :] == i[:, None], d[:, None], dp)
    if HAS_AUX:
        dp += tl.load(DAUX + cols, mask=cmask, other=0.0)[None, :]
    dl = p * (dp - tl.sum(p * dp, 1)[:, None])
    tl.store(DL + rows[:, None] * E + cols[None, :], dl, mask=m2)


def _grid(T: int, E: int, k: int):
    return (triton.cdiv(T, BT),), triton.next_power_of_2(E), triton.next_power_of_2(k)


def route_fwd_triton(logits, k, norm_topk_prob):
    T, E = logits.shape
    ids = torch.empty(T, k, device=logits.device, dtype=torch.int32)
    w = torch.empty(T, k, device=logits.device, dtype=torch.float32)
    p = torch.empty(T, E, device=logits.device, dtype=torch.float32)
    if T:
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        grid, BE, KP = _grid(T, E, k)
        _route_fwd_kernel[grid](logits, ids, w, p, T, E, logits.stride(0), K=k, KP=KP, NORM=bool(norm_topk_prob),
                                BT=BT, BE=BE, num_warps=4)
    return ids, w, p


def route_replay_triton(logits, ids, norm_topk_prob):
    T, E = logits.shape
    k = ids.shape[1]
    w = torch.empty(T, k, device=logits.device, dtype=torch.float32)
    p = torch.empty(T, E, device=logits.device, dtype=torch.float32)
    if T:
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        grid, BE, KP = _grid(T, E, k)
        _route_replay_kernel[grid](logits, ids.contiguous(), w, p, T, E, logits.stride(0), K=k, KP=KP,
                                   NORM=bool(norm_topk_prob), BT=BT, BE=BE, num_warps=4)
    return w, p


def route_bwd_triton(dweights, probs, ids, weights, norm_topk_prob, daux=None):
    T, E = probs.shape
    k = ids.shape[1]
    dl = torch.empty(T, E, device=probs.device, dtype=torch.float32)
    if T:
        grid, BE, KP = _grid(T, E, k)
        _route_bwd_kernel[grid](dweights.contiguous(), probs.contiguous(), ids.contiguous(), weights.contiguous(),
                                daux if daux is not None else probs, dl, T, E, K=k, KP=KP,
                                NORM=bool(norm_topk_prob), HAS_AUX=daux is not None, BT=BT, BE=BE, num_warps=4)
    return dl


def softmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over the last dim, row by row in a fixed tree (module docstring)."""
    T, E = logits.shape
    x = logits.float()
    if E % _PAD:
        x = torch.cat([x, x.new_full((T, _PAD - E % _PAD), float("-inf"))], 1)
    ex = torch.exp(x - x.max(1, keepdim=True).values)[:, :E]
    return ex / tree_sum(ex)[:, None]


def route_fwd_ref(logits, k, norm_topk_prob):
    p = softmax_ref(logits)
    vals, ids = torch.sort(p, dim=1, descending=True, stable=True)  # stable: the lower id first among equals
    vals, ids = vals[:, :k].contiguous(), ids[:, :k].to(torch.int32).contiguous()
    if norm_topk_prob:
        s = torch.zeros_like(vals[:, 0])
        for j in range(k):  # slot order, as the kernel
            s = s + vals[:, j]
        vals = vals / s[:, None]
    return ids, vals, p


def route_replay_ref(logits, ids, norm_topk_prob):
    p = softmax_ref(logits)
    vals = p.gather(1, ids.long())
    if norm_topk_prob:
        s = torch.zeros_like(vals[:, 0])
        for j in range(vals.shape[1]):  # slot order, as the kernel
            s = s + vals[:, j]
        vals = vals / s[:, None]
    return vals.contiguous(), p


def route_bwd_ref(dweights, probs, ids, weights, norm_topk_prob, daux=None):
    dw, sel = dweights.float(), ids.long()
    if norm_topk_prob:
        ps = probs.gather(1, sel)
        s = torch.zeros_like(ps[:, 0])
        for j in range(ps.shape[1]):
            s = s + ps[:, j]
        dw = (dw - (dw * weights).sum(1, keepdim=True)) / s[:, None]
    dp = torch.zeros_like(probs).scatter_(1, sel, dw)
    if daux is not None:
        dp = dp + daux[None, :]
    return probs * (dp - (probs * dp).sum(1, keepdim=True))


@dispatch(route_fwd_triton, route_fwd_ref, on="logits")
def route_fwd(logits: torch.Tensor, k: int, norm_topk_prob: bool):
    """logits [T, E] (the router GEMM's, any float dtype) -> (ids [T, k] int32, weights [T, k]
    fp32, probs [T, E] fp32): softmax in fp32, the k largest in order (ties: the lower id),
    renormalised to sum 1 when norm_topk_prob. probs is what route_bwd and aux_stats read."""
    if logits.dim() != 2 or not 1 <= k <= logits.shape[1]:
        raise ValueError(f"route_fwd: logits must be [T, E] with 1 <= k <= E, got {list(logits.shape)} and k={k}")
    if not logits.dtype.is_floating_point:
        raise TypeError(f"route_fwd: logits must be floating point, got {logits.dtype}")


@dispatch(route_replay_triton, route_replay_ref, on="logits")
def route_replay(logits: torch.Tensor, ids: torch.Tensor, norm_topk_prob: bool):
    """logits [T, E], ids [T, k] int32 (k distinct experts a row, chosen elsewhere: routing
    replay) -> (weights [T, k] fp32, probs [T, E] fp32): route_fwd's weights and probs as if its
    top-k had picked ids; route_bwd differentiates them."""
    T, E = logits.shape if logits.dim() == 2 else (-1, -1)
    if logits.dim() != 2 or ids.dim() != 2 or ids.shape[0] != T or ids.dtype != torch.int32 \
            or not 1 <= ids.shape[1] <= E:
        raise ValueError(f"route_replay: logits must be [T, E] and ids int32 [T, k <= E], got "
                         f"{list(logits.shape)} and {ids.dtype} {list(ids.shape)}")


@dispatch(route_bwd_triton, route_bwd_ref, on="probs")
def route_bwd(dweights: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              norm_topk_prob: bool, daux: torch.Tensor | None = None) -> torch.Tensor:
    """dweights [T, k], route_fwd's probs [T, E], ids [T, k], weights [T, k]; daux None or [E]
    fp32 (d loss / d probs[t, e], the same for every row: aux_dprobs') -> dlogits [T, E] fp32."""
    T, E = probs.shape
    if ids.dim() != 2 or ids.shape[0] != T or ids.dtype != torch.int32:
        raise ValueError(f"route_bwd: ids must be int32 [{T}, k], got {ids.dtype} {list(ids.shape)}")
    for name, t in (("dweights", dweights), ("weights", weights)):
        if t.shape != ids.shape:
            raise ValueError(f"route_bwd: {name} must be {list(ids.shape)}, got {list(t.shape)}")
    if probs.dtype != torch.float32 or weights.dtype != torch.float32:
        raise TypeError("route_bwd: probs and weights must be fp32 (route_fwd's)")
    if daux is not None and (daux.shape != (E,) or daux.dtype != torch.float32):
        raise ValueError(f"route_bwd: daux must be fp32 [{E}], got {daux.dtype} {list(daux.shape)}")


def aux_stats(probs: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's share of the load-balancing loss: (C [E] fp32, the top-k picks of each expert,
    from moe_sort's counts; P [E] fp32, the sum of its probabilities over the T rows). Sum them
    over the layers, then aux_loss. Deterministic: torch's column sum, no atomics."""
    return counts.float(), probs.sum(0)


def aux_loss(counts: torch.Tensor, prob_sums: torch.Tensor, rows: int) -> torch.Tensor:
    """transformers' load_balancing_loss_func from the layers' summed aux_stats: E * sum_e
    (C_e / N)(P_e / N), N = rows of all layers (L T). A 0-dim fp32 tensor."""
    E = counts.shape[0]
    return E * ((counts / rows) * (prob_sums / rows)).sum()


def aux_dprobs(counts: torch.Tensor, rows: int, coef: float = 1.0) -> torch.Tensor:
    """d (coef aux) / d probs[t, e] = coef E C_e / N^2, the same for every row of every layer:
    route_bwd's daux (counts: summed over the layers, as aux_loss's)."""
    E = counts.shape[0]
    return (coef * E / float(rows) ** 2) * counts.float()
