"""Rotary position embedding, NeoX layout (the halves of each head are rotated as pairs).

For position p and frequency i < D/2: a = p * theta^(-2i/D),
    y[i]       = x[i] cos a - x[i+D/2] sin a
    y[i+D/2]   = x[i+D/2] cos a + x[i] sin a
The map is a rotation, so the backward is the rotation by -a. Angles are computed in fp32.
Positions restart at 0 at each sequence start of a packed batch (`positions_from_cu_seqlens`).
"""

from __future__ import annotations

import torch


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """[S+1] int32 offsets -> [N] int32 position of each token within its own sequence."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    idx = torch.arange(n_tokens, device=cu_seqlens.device, dtype=torch.long)
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lens, output_size=n_tokens)
    return (idx - starts).to(torch.int32)


def _cos_sin(positions: torch.Tensor, D: int, theta: float):
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, device=positions.device, dtype=torch.int64).float() / D))
    ang = positions.float()[:, None] * inv_freq[None, :]  # [N, D/2]
    return ang.cos()[:, None, :], ang.sin()[:, None, :]  # [N, 1, D/2]


def rope_fwd_ref(x: torch.Tensor, positions: torch.Tensor, theta: float, sign: float = 1.0):
    D = x.shape[-1]
    cos, sin = _cos_sin(positions, D, theta)
    sin = sin * sign
    x1, x2 = x.float()[..., : D // 2], x.float()[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


def rope_bwd_ref(dy: torch.Tensor, positions: torch.Tensor, theta: float):
    return rope_fwd_ref(dy, positions, theta, sign=-1.0)


def rope_fwd(x: torch.Tensor, positions: torch.Tensor, theta: float):
    """x: [N, H, D], positions: [N] int32 -> y [N, H, D]."""
    return rope_fwd_ref(x, positions, theta)


def rope_bwd(dy: torch.Tensor, positions: torch.Tensor, theta: float):
    """dy: [N, H, D], positions: [N] int32 -> dx [N, H, D]."""
    return rope_bwd_ref(dy, positions, theta)
