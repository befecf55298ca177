"""Fused LM head: token log-probability and entropy from hidden states, without ever
holding the [N, V] logits (the twin and the kernel both go in chunks of rows).

With z = (h W^T) / T, lse = logsumexp(z), p = softmax(z):
    lp  = z[target] - lse
    ent = lse - sum_j p_j z_j
Backward, for upstream dlp and dent:
    dz_j = dlp (1[j = target] - p_j) - dent p_j (z_j - lse + ent)
    dlogits = dz / T;   dh = dlogits W;   dW += dlogits^T h

The GPU path goes C = `chunk_rows(V)` rows at a time through one reusable [C, V] buffer in the
input dtype: cuBLAS writes the logits tile, one Triton pass over it does the online
log-sum-exp (base 2), the target gather and the entropy sum in fp32. The backward
recomputes the tile (logits are never stored between forward and backward), turns it into
dlogits in place with a second Triton pass, then cuBLAS does dh = dlogits W and
dW += dlogits^T h (fp32 accumulation straight into an fp32 dW when torch's cuBLAS binding
offers `out_dtype`). The working set is the one tile, whatever N is: C * V elements, at most
CHUNK_BYTES (C = 2048 rows, 0.6 GB, for Qwen3's V = 151936 in bf16; 4096 rows took 1.2 GB,
the largest single item of a GRPO step's training peak, for no measurable speed: each chunk's
GEMMs are already [2048, 1024] x [1024, 151936]).

Gradient in the forward (`logprob_fwd_bwd`): when the upstream gradient is an elementwise
function of the chunk's own lp (and ent) -- SFT's constant weights, the GRPO/PPO clipped
surrogate of lp, old lp and advantage, an entropy bonus -- a caller-supplied
`grad_fn(lp_c, ent_c, rows) -> (dlp_c, dent_c)` is evaluated on each chunk while its logits
are still in the tile, and the chunk goes straight on to dlogits, dh and dW. Three GEMMs
per chunk instead of four (no recompute), and no lse kept between two calls.

Exact mode (`exact=True`, ops/exact.py): the forward's logits tile comes from the batch-invariant
GEMM and the kernel takes log2(e) / T from a per-row temperature tensor (ROW_T), so that
`token_logprob` -- the engine's logprob of its sampled tokens, on logits from the same GEMM --
runs the same instructions on the same bits as the trainer's head. The backward's recompute
stays on cuBLAS (its logits need not match the forward's to the bit).
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import HAS_TRITON, dispatch, use_triton
from rlcu.ops._matmul import acc_wgrad
from rlcu.ops.exact import tree_sum
from rlcu.ops.matmul_invariant import mm as mm_invariant

if HAS_TRITON:
    import triton
    import triton.language as tl

CHUNK_BYTES = 640 << 20  # the GPU path's logits tile: at most this many bytes ...
CHUNK_ROWS = 4096  # ... and this many rows (a power of two; 2048 rows for Qwen3's V in bf16)
BV_MAX = 8192  # vocabulary tile of one kernel iteration
_CHUNK = 1024  # rows of logits held at once by the twin
_LOG2E = 1.4426950408889634


if HAS_TRITON:

    @triton.jit
    def _logprob_fwd_kernel(Z, Tgt, Lp, Ent, Lse, stride_z, scale2, V: tl.constexpr,
                            WITH_ENT: tl.constexpr, BV: tl.constexpr, TEMP, ROW_T: tl.constexpr):
        # One program per row of the chunk. Base-2 online softmax over V tiles, with
        # x = z log2(e):  m = max x,  s = sum 2^(x - m),  t = sum 2^(x - m) x, so that
        # lse = ln2 (m + log2 s)  and  sum_j p_j z_j = ln2 t / s.
        # V is constexpr: one compile per vocabulary, and no loop over a runtime bound
        # (which the Triton interpreter cannot take with numpy >= 2.4).
        # ROW_T (exact mode): the scale log2(e) / T from the row's own temperature, in the
        # kernel, so that the trainer (one T) and the engine's sampler (a T a row) agree.
        row = tl.program_id(0).to(tl.int64)
        if ROW_T:
            scale2 = 1.4426950408889634 / tl.load(TEMP + row)
        Z += row * stride_z
        m = float("-inf")
        s = 0.0
        t = 0.0
        for v0 in range(0, V, BV):
            offs = v0 + tl.arange(0, BV)
            mask = offs < V
            x = tl.load(Z + offs, mask=mask, other=float("-inf")).to(tl.float32) * scale2
            m_new = tl.maximum(m, tl.max(x, 0))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(x - m_new)
            s = s * alpha + tl.sum(p, 0)
            if WITH_ENT:
                t = t * alpha + tl.sum(p * tl.where(mask, x, 0.0), 0)
            m = m_new
        lse = (m + tl.log2(s)) * 0.6931471805599453
        tgt = tl.load(Tgt + row)
        zt = tl.load(Z + tgt).to(tl.float32) * scale2 * 0.6931471805599453
        tl.store(Lp + row, zt - lse)
        tl.store(Lse + row, lse)
        if WITH_ENT:
            tl.store(Ent + row, lse - t / s * 0.6931471805599453)

    @triton.jit
    def _logprob_bwd_kernel(Z, Tgt, Dlp, Dent, Lse, Ent, stride_z, inv_t, V: tl.constexpr,
                            HAS_DLP: tl.constexpr, HAS_DENT: tl.constexpr, ENT_SAVED: tl.constexpr,
                            BV: tl.constexpr):
        # In place: the logits row becomes dlogits = dz / T with
        #   dz_j = dlp (1[j = tgt] - p_j) - dent p_j (z_j - lse + ent),  p_j = exp(z_j - lse).
        # The separate backward has no entropy (the forward keeps only lse), so with dent a
        # first pass re-sums p z; the fused op hands over the ent its forward pass just wrote.
        row = tl.program_id(0).to(tl.int64)
        Z += row * stride_z
        lse = tl.load(Lse + row)
        scale2 = inv_t * 1.4426950408889634
        lse2 = lse * 1.4426950408889634
        dlp = 0.0
        if HAS_DLP:
            dlp = tl.load(Dlp + row)
        dent = 0.0
        ent = 0.0
        if HAS_DENT:
            dent = tl.load(Dent + row)
            if ENT_SAVED:
                ent = tl.load(Ent + row)
            else:
                t = 0.0
                for v0 in range(0, V, BV):
                    offs = v0 + tl.arange(0, BV)
                    mask = offs < V
                    x = tl.load(Z + offs, mask=mask, other=0.0).to(tl.float32) * scale2
                    p = tl.where(mask, tl.exp2(x - lse2), 0.0)
                    t += tl.sum(p * x, 0)
                ent = lse - t * 0.6931471805599453
        tgt = tl.load(Tgt + row)
        for v0 in range(0, V, BV):
            offs = v0 + tl.arange(0, BV)
            mask = offs < V
            x = tl.load(Z + offs, mask=mask, other=0.0).to(tl.float32) * scale2
            p = tl.exp2(x - lse2)
            dz = -dlp * p
            if HAS_DENT:
                dz -= dent * p * (x * 0.6931471805599453 - lse + ent)
            dz = tl.where(offs == tgt, dz + dlp, dz)
            tl.store(Z + offs, (dz * inv_t).to(Z.dtype.element_ty), mask=mask)


def _check(h, W, targets):
    if h.dim() != 2 or W.dim() != 2 or h.shape[1] != W.shape[1]:
        raise ValueError(f"h must be [N, D] and W [V, D], got {list(h.shape)} and {list(W.shape)}")
    if h.dtype != W.dtype:
        raise TypeError(f"h and W must share a dtype, got {h.dtype} and {W.dtype}")
    if targets.shape != (h.shape[0],):
        raise ValueError(f"targets must have shape [{h.shape[0]}], got {list(targets.shape)}")


def _chunk_grads(grad_fn, lp_c, ent_c, rows: slice, device):
    """grad_fn's (dlp_c, dent_c) for one chunk, checked, as contiguous fp32 (or None)."""
    out = grad_fn(lp_c, ent_c, rows)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(f"grad_fn must return a pair (dlp, dent), got {type(out).__name__}")
    n = lp_c.shape[0]
    got = []
    for name, g in zip(("dlp", "dent"), out):
        if g is not None:
            if not isinstance(g, torch.Tensor) or g.shape != (n,) or g.device != device:
                what = f"{list(g.shape)} on {g.device}" if isinstance(g, torch.Tensor) else type(g).__name__
                raise ValueError(f"grad_fn's {name} for rows {rows.start}:{rows.stop} must be a "
                                 f"[{n}] tensor on {device} (or None), got {what}")
            g = g.float().contiguous()
        got.append(g)
    return got


def _tiles(V: int):
    BV = min(BV_MAX, triton.next_power_of_2(V))
    return BV, (8 if BV >= 4096 else 4)


def chunk_rows(V: int, dtype: torch.dtype) -> int:
    """Rows of the GPU path's logits tile: the largest power of two <= CHUNK_ROWS whose
    [C, V] tile fits in CHUNK_BYTES (at least 16)."""
    fit = max(CHUNK_BYTES // (V * torch.finfo(dtype).bits // 8), 16)
    return min(CHUNK_ROWS, 1 << (fit.bit_length() - 1))


def _logits_tile(h, W, z, exact: bool) -> None:
    """z = h W^T: cuBLAS, or in exact mode the batch-invariant GEMM (the engine's too)."""
    if exact:
        mm_invariant(h, W, out=z)
    else:
        torch.mm(h, W.t(), out=z)


def _logprob_fwd_triton(h, W, targets, temperature, with_entropy, exact):
    N, V = h.shape[0], W.shape[0]
    lp = torch.empty(N, device=h.device, dtype=torch.float32)
    lse = torch.empty(N, device=h.device, dtype=torch.float32)
    ent = torch.empty(N, device=h.device, dtype=torch.float32) if with_entropy else None
    if N == 0:
        return lp, ent, lse
    targets = targets.contiguous()
    C = min(N, chunk_rows(V, h.dtype))
    buf = torch.empty(C, V, device=h.device, dtype=h.dtype)  # [C, V] logits tile
    BV, warps = _tiles(V)
    temp = torch.full((C,), temperature, device=h.device, dtype=torch.float32) if exact else None
    for s in range(0, N, C):
        n = min(C, N - s)
        z = buf[:n]
        _logits_tile(h[s : s + n], W, z, exact)
        _logprob_fwd_kernel[(n,)](
            z, targets[s:], lp[s:], ent[s:] if with_entropy else lp, lse[s:], z.stride(0),
            _LOG2E / temperature, V=V, WITH_ENT=with_entropy, BV=BV, TEMP=temp if exact else lse, ROW_T=exact,
            num_warps=warps)
    return lp, ent, lse


def _logprob_bwd_triton(dlp, dent, h, W, targets, lse, dW, temperature):
    N, V = h.shape[0], W.shape[0]
    dh = torch.empty_like(h)
    if N == 0:
        return dh
    targets, lse = targets.contiguous(), lse.contiguous()
    dlp = dlp.float().contiguous() if dlp is not None else None
    dent = dent.float().contiguous() if dent is not None else None
    C = min(N, chunk_rows(V, h.dtype))
    buf = torch.empty(C, V, device=h.device, dtype=h.dtype)  # [C, V] logits, then dlogits
    BV, warps = _tiles(V)
    for s in range(0, N, C):
        n = min(C, N - s)
        z, hs = buf[:n], h[s : s + n]
        torch.mm(hs, W.t(), out=z)  # recomputed: the forward keeps only lse
        _logprob_bwd_kernel[(n,)](
            z, targets[s:], lse if dlp is None else dlp[s:], lse if dent is None else dent[s:],
            lse[s:], lse, z.stride(0), 1.0 / temperature, V=V,
            HAS_DLP=dlp is not None, HAS_DENT=dent is not None, ENT_SAVED=False, BV=BV,
            num_warps=warps)
        torch.mm(z, W, out=dh[s : s + n])
        if dW is not None:
            acc_wgrad(dW, z, hs)
    return dh


def _logprob_fwd_bwd_triton(h, W, targets, grad_fn, dW, temperature, with_entropy, exact):
    N, V = h.shape[0], W.shape[0]
    lp = torch.empty(N, device=h.device, dtype=torch.float32)
    lse = torch.empty(N, device=h.device, dtype=torch.float32)
    ent = torch.empty(N, device=h.device, dtype=torch.float32) if with_entropy else None
    dh = torch.empty_like(h)
    if N == 0:
        return lp, ent, dh
    targets = targets.contiguous()
    C = min(N, chunk_rows(V, h.dtype))
    buf = torch.empty(C, V, device=h.device, dtype=h.dtype)  # [C, V] logits, then dlogits
    BV, warps = _tiles(V)
    temp = torch.full((C,), temperature, device=h.device, dtype=torch.float32) if exact else None
    for s in range(0, N, C):
        n = min(C, N - s)
        z, hs, rows = buf[:n], h[s : s + n], slice(s, s + n)
        _logits_tile(hs, W, z, exact)
        _logprob_fwd_kernel[(n,)](
            z, targets[s:], lp[s:], ent[s:] if with_entropy else lp, lse[s:], z.stride(0),
            _LOG2E / temperature, V=V, WITH_ENT=with_entropy, BV=BV, TEMP=temp if exact else lse, ROW_T=exact,
            num_warps=warps)
        dlp, dent = _chunk_grads(grad_fn, lp[rows], ent[rows] if with_entropy else None, rows,
                                 h.device)
        if dlp is None and dent is None:
            dh[rows].zero_()
            continue
        _logprob_bwd_kernel[(n,)](
            z, targets[s:], lse[s:] if dlp is None else dlp, lse[s:] if dent is None else dent,
            lse[s:], ent[s:] if with_entropy else lse[s:], z.stride(0), 1.0 / temperature, V=V,
            HAS_DLP=dlp is not None, HAS_DENT=dent is not None, ENT_SAVED=with_entropy, BV=BV,
            num_warps=warps)
        torch.mm(z, W, out=dh[rows])
        if dW is not None:
            acc_wgrad(dW, z, hs)
    return lp, ent, dh


def _rows_exact_ref(z, targets, temp, with_entropy):
    """Exact mode's twin of the head on a logits tile z [n, V] (model dtype) at per-row
    temperatures temp [n] fp32 -> (lp, ent | None, lse): max, then fixed trees for the sums."""
    x = z.float() / temp[:, None]
    m = x.max(-1).values
    p = torch.exp(x - m[:, None])
    s = tree_sum(p)
    lse = m + torch.log(s)
    lp = x.gather(1, targets.long()[:, None])[:, 0] - lse
    ent = lse - tree_sum(p * x) / s if with_entropy else None
    return lp, ent, lse


def logprob_fwd_ref(h, W, targets, temperature=1.0, with_entropy=False, exact=False, chunk=_CHUNK):
    N = h.shape[0]
    lp = torch.empty(N, device=h.device, dtype=torch.float32)
    lse = torch.empty(N, device=h.device, dtype=torch.float32)
    ent = torch.empty(N, device=h.device, dtype=torch.float32) if with_entropy else None
    if exact:
        for s in range(0, N, chunk):
            r = slice(s, min(s + chunk, N))
            temp = torch.full((r.stop - s,), temperature, device=h.device, dtype=torch.float32)
            lp[r], e, lse[r] = _rows_exact_ref(mm_invariant(h[r], W), targets[r], temp, with_entropy)
            if with_entropy:
                ent[r] = e
        return lp, ent, lse
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
        dz = torch.zeros_like(z)
        if dlp is not None:
            dz -= p * dlp[s : s + chunk, None]
            dz.scatter_add_(1, targets[s : s + chunk].long()[:, None], dlp[s : s + chunk, None].float())
        if dent is not None:
            ent = m[:, 0] - (p * z).sum(-1)
            dz -= dent[s : s + chunk, None] * p * (z - m + ent[:, None])
        dz = (dz / temperature).to(h.dtype)
        dh[s : s + chunk] = dz @ W
        if dW is not None:
            dW += (dz.t() @ hs).to(dW.dtype)
    return dh


def logprob_fwd_bwd_ref(h, W, targets, grad_fn, dW, temperature=1.0, with_entropy=False, exact=False,
                        chunk=_CHUNK):
    N = h.shape[0]
    lp = torch.empty(N, device=h.device, dtype=torch.float32)
    ent = torch.empty(N, device=h.device, dtype=torch.float32) if with_entropy else None
    dh = torch.empty_like(h)
    for s in range(0, N, chunk):
        rows = slice(s, min(s + chunk, N))
        lp_c, ent_c, lse = logprob_fwd_ref(h[rows], W, targets[rows], temperature, with_entropy, exact, chunk)
        lp[rows] = lp_c
        if with_entropy:
            ent[rows] = ent_c
        dlp, dent = _chunk_grads(grad_fn, lp[rows], ent[rows] if with_entropy else None, rows,
                                 h.device)
        dh[rows] = logprob_bwd_ref(dlp, dent, h[rows], W, targets[rows], lse, dW, temperature,
                                   chunk)
    return lp, ent, dh


@dispatch(_logprob_fwd_triton, logprob_fwd_ref, on="h")
def logprob_fwd(h, W, targets, temperature: float = 1.0, with_entropy: bool = False, exact: bool = False):
    """h: [N, D], W: [V, D], targets: [N] int -> (lp [N], ent [N] | None, lse [N]), fp32.
    exact: exact mode's head (the batch-invariant GEMM, per-row temperatures; `token_logprob`)."""
    _check(h, W, targets)


@dispatch(_logprob_bwd_triton, logprob_bwd_ref, on="h")
def logprob_bwd(dlp, dent, h, W, targets, lse, dW, temperature: float = 1.0):
    """dlp, dent (either may be None): [N] fp32 -> dh [N, D] in h.dtype; dW [V, D] (any
    float dtype, e.g. fp32 beside bf16 h and W, or None) += the weight's gradient."""
    _check(h, W, targets)
    if dW is not None and dW.shape != W.shape:
        raise ValueError(f"dW must have W's shape {list(W.shape)}, got {list(dW.shape)}")


def logprob_fwd_bwd(h, W, targets, grad_fn, dW, temperature: float = 1.0,
                    with_entropy: bool = False, exact: bool = False):
    """Forward and backward in one sweep, for an upstream gradient that is elementwise in lp.

    h: [N, D], W: [V, D], targets: [N] int; dW: [V, D] (any float dtype, or None) += the
    weight's gradient. For each chunk of rows, once its lp (and ent) are known:
        dlp_c, dent_c = grad_fn(lp_c, ent_c, rows)
    with lp_c, ent_c: [n] fp32 (ent_c None unless with_entropy; read-only views) and rows the
    chunk's `slice` of the N rows; dlp_c, dent_c: [n] tensors on h's device, or None for no
    gradient through that output. Returns (lp [N], ent [N] | None, dh [N, D] in h.dtype),
    the same as logprob_fwd then logprob_bwd with the concatenated dlp, dent. grad_fn must
    not depend on other chunks' values (a mean over all lp, say): then use the separate ops.
    exact: the forward half in exact mode, as `logprob_fwd`'s.
    """
    _check(h, W, targets)
    if dW is not None and dW.shape != W.shape:
        raise ValueError(f"dW must have W's shape {list(W.shape)}, got {list(dW.shape)}")
    if use_triton(h):  # (not `dispatch`: the twin's chunk is the module's _CHUNK at call time)
        return _logprob_fwd_bwd_triton(h, W, targets, grad_fn, dW, temperature, with_entropy, exact)
    return logprob_fwd_bwd_ref(h, W, targets, grad_fn, dW, temperature, with_entropy, exact, _CHUNK)


def token_logprob(logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Exact mode's logprob of the engine's sampled tokens, taken as the trainer's head takes
    it: logits [B, V] (from the batch-invariant GEMM, the model's dtype), tokens [B] int,
    temperature [B] fp32 (<= 0: greedy, scored at T = 1 as the sampler does) -> lp [B] fp32,
    bit for bit `logprob_fwd`'s lp of the same row in exact mode."""
    B, V = logits.shape
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float().contiguous()
    if not use_triton(logits):
        return _rows_exact_ref(logits, tokens, temp, False)[0]
    lp = torch.empty(B, device=logits.device, dtype=torch.float32)
    if B == 0:
        return lp
    lse = torch.empty_like(lp)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    BV, warps = _tiles(V)
    _logprob_fwd_kernel[(B,)](logits, tokens.contiguous(), lp, lp, lse, logits.stride(0), 1.0,
                              V=V, WITH_ENT=False, BV=BV, TEMP=temp, ROW_T=True, num_warps=warps)
    return lp
