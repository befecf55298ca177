"""Causal self-attention over packed variable-length sequences, with GQA.

Tokens of all sequences are concatenated ([N, H, D]); `cu_seqlens` ([S+1] int32) marks the
boundaries and a token attends to the earlier tokens of its own sequence only. Query head
h reads KV head h // (Hq / Hk). The forward returns the log-sum-exp of each row's scores
(fp32, [Hq, N]) so that the backward recomputes P = exp(S - lse) instead of storing it:
    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(dO * O)),  dQ = dS K * scale,
    dK = dS^T Q * scale   (summed over the query heads that share a KV head).
"""

from __future__ import annotations

import torch


def _seq_bounds(cu_seqlens: torch.Tensor):
    cu = cu_seqlens.tolist()
    return [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def attention_fwd_ref(q, k, v, cu_seqlens, max_seqlen, scale):
    N, Hq, D = q.shape
    G = Hq // k.shape[1]
    o = torch.empty_like(q)
    lse = torch.empty(Hq, N, device=q.device, dtype=torch.float32)
    for s, e in _seq_bounds(cu_seqlens):  # a loop over sequences, not tokens
        if e == s:
            continue
        qs = q[s:e].float().transpose(0, 1)  # [Hq, L, D]
        ks = k[s:e].float().transpose(0, 1).repeat_interleave(G, 0)
        vs = v[s:e].float().transpose(0, 1).repeat_interleave(G, 0)
        S = qs @ ks.transpose(1, 2) * scale  # [Hq, L, L]
        L = e - s
        mask = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)
        S = S.masked_fill(mask, float("-inf"))
        m = S.logsumexp(-1)  # [Hq, L]
        P = torch.exp(S - m[..., None])
        o[s:e] = (P @ vs).transpose(0, 1).to(q.dtype)
        lse[:, s:e] = m
    return o, lse


def attention_bwd_ref(do, q, k, v, o, lse, cu_seqlens, max_seqlen, scale):
    N, Hq, D = q.shape
    Hk = k.shape[1]
    G = Hq // Hk
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk = torch.zeros(N, Hk, D, device=q.device, dtype=torch.float32)
    dv = torch.zeros_like(dk)
    for s, e in _seq_bounds(cu_seqlens):
        if e == s:
            continue
        L = e - s
        qs = q[s:e].float().transpose(0, 1)
        ks = k[s:e].float().transpose(0, 1).repeat_interleave(G, 0)
        vs = v[s:e].float().transpose(0, 1).repeat_interleave(G, 0)
        dos = do[s:e].float().transpose(0, 1)
        os_ = o[s:e].float().transpose(0, 1)
        S = qs @ ks.transpose(1, 2) * scale
        mask = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)
        P = torch.exp(S.masked_fill(mask, float("-inf")) - lse[:, s:e, None])
        dvs = P.transpose(1, 2) @ dos  # [Hq, L, D]
        dP = dos @ vs.transpose(1, 2)
        delta = (dos * os_).sum(-1, keepdim=True)
        dS = P * (dP - delta)
        dq[s:e] = (dS @ ks * scale).transpose(0, 1)
        dks = dS.transpose(1, 2) @ qs * scale
        dk[s:e] = dks.view(Hk, G, L, D).sum(1).transpose(0, 1)
        dv[s:e] = dvs.view(Hk, G, L, D).sum(1).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def attention_fwd(q, k, v, cu_seqlens, max_seqlen: int, scale: float):
    """q: [N, Hq, D], k, v: [N, Hk, D], cu_seqlens: [S+1] int32
    -> (o [N, Hq, D], lse [Hq, N] fp32)."""
    return attention_fwd_ref(q, k, v, cu_seqlens, max_seqlen, scale)


def attention_bwd(do, q, k, v, o, lse, cu_seqlens, max_seqlen: int, scale: float):
    """-> (dq [N, Hq, D], dk [N, Hk, D], dv [N, Hk, D])."""
    return attention_bwd_ref(do, q, k, v, o, lse, cu_seqlens, max_seqlen, scale)
