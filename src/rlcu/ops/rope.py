"""Rotary position embedding, NeoX layout (the halves of each head are rotated as pairs).

For position p and pair i < D/2: a = p * inv_freq[i], c = m cos a, s = m sin a,
    y[i]       = x[i] c - x[i+D/2] s
    y[i+D/2]   = x[i+D/2] c + x[i] s
inv_freq [D/2] (fp32) is the model's frequency table and m its `mscale` (1.0 but for YaRN):
every rope variant is one of these (model/rope.py). With m = 1 the map is a rotation, so the
backward is the rotation by -a (in general the transpose: the same with s negated). Angles are
computed in fp32. Positions restart at 0 at each sequence start of a packed batch
(`positions_from_cu_seqlens`).

The kernel needs no cos/sin cache: it reads the table (D/2 floats, in L1 after the first
program) and forms the angles in fp32 registers, once per (token, pair), and shares them across
the H heads of the token that the program holds.
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import dispatch, tl, triton

_TILE = 4096  # elements a program handles: BT tokens x BH heads x D
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def check_inv_freq(op: str, inv_freq: torch.Tensor, D: int, device: torch.device) -> None:
    """The frequency table's checks every rotating op makes: float32 [D/2] on x's device."""
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dtype != torch.float32 or inv_freq.shape != (D // 2,):
        got = f"{inv_freq.dtype} {list(inv_freq.shape)}" if isinstance(inv_freq, torch.Tensor) else repr(inv_freq)
        raise ValueError(f"{op}: inv_freq must be a float32 [{D // 2}] tensor (model/rope.py inv_freq), got {got}")
    if inv_freq.device != device:
        raise ValueError(f"{op}: inv_freq is on {inv_freq.device}, the input on {device}")


@triton.jit
def cos_sin(pos, i, INV, D2, mscale):
    """mscale cos and mscale sin [rows, 1, BD2] of the angles pos * inv_freq[i] (pos [rows] fp32,
    i [BD2] the pairs, INV the table), to broadcast over a token's heads. Every kernel that rotates
    (this one, qkv_prep.py's, decode_qkv.py's) forms them here, so all give the same bits."""
    f = tl.load(INV + i, mask=i < D2, other=0.0)
    ang = pos[:, None] * f[None, :]  # [rows, BD2]
    return (tl.cos(ang) * mscale)[:, None, :], (tl.sin(ang) * mscale)[:, None, :]


@triton.jit(do_not_specialize=["N"])
def _rope_kernel(X, POS, INV, Y, N, H, D2, stride_xn, stride_xh, stride_yn, stride_yh, mscale,
                 SIGN: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, BD2: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    t = pid * BT + tl.arange(0, BT)  # [BT] tokens
    h = tl.arange(0, BH)
    i = tl.arange(0, BD2)
    tmask = t < N
    pos = tl.load(POS + t, mask=tmask, other=0).to(tl.float32)
    cos, sin = cos_sin(pos, i, INV, D2, mscale)  # [BT, 1, BD2]
    sin = SIGN * sin
    mask = tmask[:, None, None] & (h < H)[None, :, None] & (i < D2)[None, None, :]
    x_off = t[:, None, None] * stride_xn + h[None, :, None] * stride_xh + i[None, None, :]
    y_off = t[:, None, None] * stride_yn + h[None, :, None] * stride_yh + i[None, None, :]
    x1 = tl.load(X + x_off, mask=mask, other=0.0).to(tl.float32)  # [BT, BH, BD2]
    x2 = tl.load(X + x_off + D2, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + y_off, (x1 * cos - x2 * sin).to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + y_off + D2, (x2 * cos + x1 * sin).to(Y.dtype.element_ty), mask=mask)


def _rope_triton(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, sign: float, mscale: float):
    if x.dim() != 3:
        raise ValueError(f"rope: x must be [N, H, D], got shape {list(x.shape)}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"rope: x must be float32, bfloat16 or float16, got {x.dtype}")
    N, H, D = x.shape
    if D % 2:
        raise ValueError(f"rope: head_dim D={D} must be even")
    if positions.shape != (N,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rope: positions must be an int32 [{N}] tensor, got {positions.dtype} "
                         f"{list(positions.shape)}")
    if positions.device != x.device:
        raise ValueError(f"rope: positions is on {positions.device}, x on {x.device}")
    check_inv_freq("rope", inv_freq, D, x.device)
    if x.stride(2) != 1:
        x = x.contiguous()
    positions = positions.contiguous()
    y = torch.empty(N, H, D, device=x.device, dtype=x.dtype)
    if y.numel() == 0:
        return y
    D2 = D // 2
    BD2, BH = triton.next_power_of_2(D2), triton.next_power_of_2(H)
    BT = max(1, _TILE // (2 * BD2 * BH))
    num_warps = 4 if BT * BH * BD2 <= 2048 else 8
    _rope_kernel[(triton.cdiv(N, BT),)](x, positions, inv_freq, y, N, H, D2, x.stride(0), x.stride(1),
                                        y.stride(0), y.stride(1), float(mscale),
                                        SIGN=sign, BT=BT, BH=BH, BD2=BD2, num_warps=num_warps)
    return y


def rope_fwd_triton(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, mscale: float = 1.0):
    return _rope_triton(x, positions, inv_freq, 1.0, mscale)


def rope_bwd_triton(dy: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, mscale: float = 1.0):
    return _rope_triton(dy, positions, inv_freq, -1.0, mscale)


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """[S+1] int32 offsets -> [N] int32 position of each token within its own sequence."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    idx = torch.arange(n_tokens, device=cu_seqlens.device, dtype=torch.long)
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lens, output_size=n_tokens)
    return (idx - starts).to(torch.int32)


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, mscale: float):
    ang = positions.float()[:, None] * inv_freq.float()[None, :]  # [N, D/2]
    return (ang.cos() * mscale)[:, None, :], (ang.sin() * mscale)[:, None, :]  # [N, 1, D/2]


def rope_fwd_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, mscale: float = 1.0,
                 sign: float = 1.0):
    D = x.shape[-1]
    cos, sin = _cos_sin(positions, inv_freq, mscale)
    sin = sin * sign
    x1, x2 = x.float()[..., : D // 2], x.float()[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


def rope_bwd_ref(dy: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, mscale: float = 1.0):
    return rope_fwd_ref(dy, positions, inv_freq, mscale, -1.0)


@dispatch(rope_fwd_triton, rope_fwd_ref, on="x")
def rope_fwd(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, mscale: float = 1.0):
    """x: [N, H, D], positions: [N] int32, inv_freq: [D/2] fp32 (model/rope.py) -> y [N, H, D];
    mscale: the factor on cos and sin (YaRN's attention factor)."""
    check_inv_freq("rope", inv_freq, x.shape[-1], x.device)


@dispatch(rope_bwd_triton, rope_bwd_ref, on="dy")
def rope_bwd(dy: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, mscale: float = 1.0):
    """dy: [N, H, D], positions: [N] int32, inv_freq: [D/2] fp32 -> dx [N, H, D]."""
    check_inv_freq("rope", inv_freq, dy.shape[-1], dy.device)
