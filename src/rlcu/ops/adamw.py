"""AdamW over the flat fp32 master buffer, writing the low-precision working weights in the
same pass, and the global gradient norm for clipping.

Decoupled weight decay, as torch.optim.AdamW:
    p <- p (1 - lr wd);  m <- b1 m + (1-b1) g;  v <- b2 v + (1-b2) g^2
    p <- p - lr (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)
`g` is the raw gradient times `grad_scale` (a Python float, or a 0-d fp32 tensor on the
device that the kernel reads through a pointer, so that the clip factor never has to
visit the host).

The step is one memory-bound pass: per element it reads p, g, m, v and writes p, m, v and
the working copy (28-30 bytes). The norm is a deterministic tree reduction, no atomics:
one program per block writes the block's sum of squares, the partial sums are summed again
the same way while more than a block of them remain, and one program adds the last ones
and takes the root. (No kernel loops over a runtime bound: the Triton interpreter with
numpy >= 2.4 cannot take one.)
"""

from __future__ import annotations

import math

import torch

from rlcu.ops._backend import HAS_TRITON, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

BLOCK = 4096  # elements per program of the step
NORM_BLOCK = 4096  # elements summed by one program of the norm


if HAS_TRITON:

    @triton.jit
    def _adamw_kernel(P, G, M, V, Pout, Scale, n, scale, beta1, beta2, eps, decay, step_size,
                      inv_bc2_sqrt, SCALE_PTR: tl.constexpr, HAS_OUT: tl.constexpr,
                      BLOCK: tl.constexpr):
        # With c1 = 1 - b1^t, c2 = 1 - b2^t (folded on the host into step_size = lr / c1
        # and inv_bc2_sqrt = 1 / sqrt(c2)), as torch.optim.AdamW:
        #   p <- p (1 - lr wd) - step_size m / (sqrt(v) / sqrt(c2) + eps)
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(P + offs, mask=mask, other=0.0)
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(M + offs, mask=mask, other=0.0)
        v = tl.load(V + offs, mask=mask, other=0.0)
        if SCALE_PTR:
            g = g * tl.load(Scale).to(tl.float32)
        else:
            g = g * scale
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p * decay - step_size * m / (tl.sqrt_rn(v) * inv_bc2_sqrt + eps)
        tl.store(P + offs, p, mask=mask)
        tl.store(M + offs, m, mask=mask)
        tl.store(V + offs, v, mask=mask)
        if HAS_OUT:
            tl.store(Pout + offs, p.to(Pout.dtype.element_ty), mask=mask)

    @triton.jit
    def _block_sum_kernel(X, Out, n, SQUARE: tl.constexpr, BLOCK: tl.constexpr):
        # Out[i] = sum over block i of x^2 (SQUARE) or of x, in fp32
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
        if SQUARE:
            x = x * x
        tl.store(Out + pid, tl.sum(x, 0))

    @triton.jit
    def _sum_sqrt_kernel(Partial, Out, n_part, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(Partial + offs, mask=offs < n_part, other=0.0)
        tl.store(Out, tl.sqrt(tl.sum(x, 0)))


def _adamw_step_triton(p, g, m, v, p_out, lr, beta1, beta2, eps, weight_decay, step, grad_scale):
    n = p.numel()
    if n == 0:
        return
    scale_ptr = isinstance(grad_scale, torch.Tensor)
    if scale_ptr and (grad_scale.numel() != 1 or grad_scale.device != p.device):
        raise ValueError(f"grad_scale must be a float or a 1-element tensor on {p.device}, "
                         f"got shape {list(grad_scale.shape)} on {grad_scale.device}")
    grid = (triton.cdiv(n, BLOCK),)
    _adamw_kernel[grid](
        p, g, m, v, p_out if p_out is not None else p, grad_scale if scale_ptr else p, n,
        1.0 if scale_ptr else float(grad_scale), beta1, beta2, eps, 1.0 - lr * weight_decay,
        lr / (1.0 - beta1**step), 1.0 / math.sqrt(1.0 - beta2**step),
        SCALE_PTR=scale_ptr, HAS_OUT=p_out is not None, BLOCK=BLOCK, num_warps=8)


def _grad_norm_triton(g: torch.Tensor) -> torch.Tensor:
    out = torch.zeros((), device=g.device, dtype=torch.float32)
    if g.numel() == 0:
        return out
    x, square = g, True
    while square or x.numel() > NORM_BLOCK:  # 596M -> 146k -> 36 partial sums
        n = x.numel()
        part = torch.empty(triton.cdiv(n, NORM_BLOCK), device=g.device, dtype=torch.float32)
        _block_sum_kernel[(part.numel(),)](x, part, n, SQUARE=square, BLOCK=NORM_BLOCK, num_warps=8)
        x, square = part, False
    _sum_sqrt_kernel[(1,)](x, out, x.numel(), BLOCK=max(16, triton.next_power_of_2(x.numel())))
    return out


def grad_norm_ref(g: torch.Tensor) -> torch.Tensor:
    return g.float().pow(2).sum().sqrt()


def adamw_step_ref(p, g, m, v, p_out, lr, beta1, beta2, eps, weight_decay, step, grad_scale):
    gf = g.float() * grad_scale
    p.mul_(1 - lr * weight_decay)
    m.mul_(beta1).add_(gf, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(gf, gf, value=1 - beta2)
    bc1 = 1 - beta1**step
    bc2 = 1 - beta2**step
    p.addcdiv_(m / bc1, (v / bc2).sqrt_().add_(eps), value=-lr)
    if p_out is not None:
        p_out.copy_(p)


def grad_norm(g: torch.Tensor) -> torch.Tensor:
    """g: [P] -> 0-d fp32 tensor, the L2 norm."""
    if use_triton(g):
        return _grad_norm_triton(g.reshape(-1))
    return grad_norm_ref(g)


def clip_scale(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """0-d norm -> 0-d fp32 min(1, max_norm / (norm + 1e-6)), on norm's device (no sync)."""
    return torch.clamp(max_norm / (norm.float() + 1e-6), max=1.0)


def adamw_step(p, g, m, v, p_out, *, lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float, step: int, grad_scale):
    """In place. p, m, v: [P] fp32; g: [P] any float dtype; p_out: [P] working weights or
    None (when the working weights are the fp32 master itself); grad_scale: float or a
    1-element fp32 tensor on p's device; step: the 1-based step count."""
    if step < 1:
        raise ValueError(f"step must be >= 1 (1-based, for the bias correction), got {step}")
    if use_triton(p):
        for name, x in (("g", g), ("m", m), ("v", v), ("p_out", p_out)):
            if x is not None and (x.numel() != p.numel() or not x.is_contiguous()):
                raise ValueError(f"{name} must be contiguous with p's {p.numel()} elements")
        if not (p.is_contiguous() and p.dtype == m.dtype == v.dtype == torch.float32):
            raise ValueError("p, m and v must be contiguous fp32 buffers")
        _adamw_step_triton(p, g, m, v, p_out, lr, beta1, beta2, eps, weight_decay, step, grad_scale)
        return
    adamw_step_ref(p, g, m, v, p_out, lr, beta1, beta2, eps, weight_decay, step, grad_scale)
