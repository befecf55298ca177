"""Fused LM head: token log-probability and entropy from hidden states, without ever
holding the [N, V] logits (the twin and the kernel both go in chunks of rows).

With z = (h W^T) / T, lse = logsumexp(z), p = softmax(z):
    lp  = z[target] - lse
    ent = lse - sum_j p_j z_j
Backward, for upstream dlp and dent:
    dz_j = dlp (1[j = target] - p_j) - dent p_j (z_j - lse + ent)
    dlogits = dz / T;   dh = dlogits W;   dW += dlogits^T h
"""

from __future__ import annotations

import torch

_CHUNK = 1024  # rows of logits held at once by the twin


def logprob_fwd_ref(h, W, targets, temperature=1.0, with_entropy=False, chunk=_CHUNK):
    N = h.shape[0]
    lp = torch.empty(N, device=h.device, dtype=torch.float32)
    lse = torch.empty(N, device=h.device, dtype=torch.float32)
    ent = torch.empty(N, device=h.device, dtype=torch.float32) if with_entropy else None
    for s in range(0, N, chunk):
        z = (h[s : s + chunk] @ W.t()).float() / temperature  # [n, V]
        m = z.logsumexp(-1)
        lse[s : s + chunk] = m
        lp[s : s + chunk] = z.gather(1, targets[s : s + chunk].long()[:, None])[:, 0] - m
        if with_entropy:
            p = torch.exp(z - m[:, None])
            ent[s : s + chunk] = m - (p * z).sum(-1)
    return lp, ent, lse


def logprob_bwd_ref(dlp, dent, h, W, targets, lse, dW, temperature=1.0, chunk=_CHUNK):
    N = h.shape[0]
    dh = torch.empty_like(h)
    for s in range(0, N, chunk):
        hs = h[s : s + chunk]
        z = (hs @ W.t()).float() / temperature
        m = lse[s : s + chunk, None]
        p = torch.exp(z - m)
        dz = -p * dlp[s : s + chunk, None]
        dz.scatter_add_(1, targets[s : s + chunk].long()[:, None], dlp[s : s + chunk, None].float())
        if dent is not None:
            ent = m[:, 0] - (p * z).sum(-1)
            dz -= dent[s : s + chunk, None] * p * (z - m + ent[:, None])
        dz = (dz / temperature).to(h.dtype)
        dh[s : s + chunk] = dz @ W
        if dW is not None:
            dW += (dz.t() @ hs).to(dW.dtype)
    return dh


def logprob_fwd(h, W, targets, temperature: float = 1.0, with_entropy: bool = False):
    """h: [N, D], W: [V, D], targets: [N] int -> (lp [N], ent [N] | None, lse [N]), fp32."""
    return logprob_fwd_ref(h, W, targets, temperature, with_entropy)


def logprob_bwd(dlp, dent, h, W, targets, lse, dW, temperature: float = 1.0):
    """dlp, dent (or None): [N] fp32 -> dh [N, D]; dW [V, D] += the weight's gradient."""
    return logprob_bwd_ref(dlp, dent, h, W, targets, lse, dW, temperature)
