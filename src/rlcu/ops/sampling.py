"""Token sampling from logits: temperature, min-p, top-k, top-p, seeded per row.

PLACEHOLDER docstring: kernels follow; the twin and the public signature are final.
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import use_triton

_M32 = 0xFFFFFFFF


# ----------------------------------------------------------------------------- the hash RNG
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2^32 for 0 <= x < 2^32 without int64 overflow: split c into 16-bit halves
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _hash32_ref(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (a bijection of 32-bit integers), on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _row_key_ref(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    s, o = seeds.long(), offsets.long()
    k = _hash32_ref((s & _M32) ^ 0x243F6A88)
    k = _hash32_ref(k ^ ((s >> 32) & _M32))
    k = _hash32_ref(k ^ (o & _M32))
    return _hash32_ref(k ^ ((o >> 32) & _M32))  # [B]


def _gumbel_ref(key: torch.Tensor, V: int) -> torch.Tensor:
    """[B] row keys -> [B, V] fp32 Gumbel noise -log(-log u), u = (2 r + 1) / 2^24 in (0, 1)."""
    i = torch.arange(V, device=key.device, dtype=torch.int64)[None, :]
    r = _hash32_ref((_hash32_ref(i ^ key[:, None]) + key[:, None]) & _M32)
    u = ((r >> 9) * 2 + 1).float() * (2.0**-24)  # 24-bit integer: exact in fp32
    return -torch.log(-torch.log(u))


# ------------------------------------------------------------------------------- the twin
def _kept_ref(z, top_k, top_p, min_p):
    """[B, V] bool: the tokens min-p, then top-k, then top-p keep (all sets closed under ties)."""
    B, V = z.shape
    zmax = z.max(-1, keepdim=True).values
    keep = z >= zmax + torch.log(min_p.float())[:, None]  # p_i >= min_p * p_max
    k_on = (top_k > 0) & (top_k < V)
    p_on = top_p < 1.0
    if not (bool(k_on.any()) or bool(p_on.any())):
        return keep
    zs, order = z.sort(-1, descending=True)
    # for each sorted position, the first position of its run of equal values
    first = torch.searchsorted(-zs, -zs, side="left")  # -zs is ascending
    if bool(k_on.any()):
        kth = zs.gather(1, (top_k.long() - 1).clamp(0, V - 1)[:, None])
        keep &= ~k_on[:, None] | (z >= kth)  # #{j: z_j > z_i} < k
    if bool(p_on.any()):
        p = torch.softmax(z, -1) * keep
        ps = p.gather(1, order)
        above_sorted = (ps.cumsum(-1) - ps).gather(1, first)  # mass strictly above, within kept
        above = torch.empty_like(above_sorted).scatter_(1, order, above_sorted)
        keep &= ~p_on[:, None] | (above < top_p[:, None] * p.sum(-1, keepdim=True))
    return keep


def sample_ref(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    B, V = logits.shape
    greedy = temperature <= 0
    T = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    z = logits.float() / T[:, None]  # [B, V]
    logp = torch.log_softmax(z, -1)
    keep = _kept_ref(z, top_k, top_p, min_p)
    score = (z + _gumbel_ref(_row_key_ref(seeds, offsets), V)).masked_fill(~keep, float("-inf"))
    tokens = torch.where(greedy, z.argmax(-1), score.argmax(-1))
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def sample(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    """logits: [B, V] fp32|bf16; temperature [B] fp32 (0 = greedy); top_k [B] int32 (<= 0 or
    >= V = off); top_p [B] fp32 (1 = off); min_p [B] fp32 (0 = off); seeds, offsets [B] int64
    -> (tokens [B] int64, logprobs [B] fp32 = log_softmax(logits / T)[token], unfiltered)."""
    return sample_ref(logits, temperature, top_k, top_p, min_p, seeds, offsets)


def greedy(logits):
    """logits: [B, V] -> tokens [B] int64 (argmax, first index on ties)."""
    return logits.argmax(-1)
