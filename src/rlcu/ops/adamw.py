"""AdamW over the flat fp32 master buffer, writing the low-precision working weights in the
same pass, and the global gradient norm for clipping.

Decoupled weight decay, as torch.optim.AdamW:
    p <- p (1 - lr wd);  m <- b1 m + (1-b1) g;  v <- b2 v + (1-b2) g^2
    p <- p - lr (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)
`g` is the raw gradient times `grad_scale` (a 0-d fp32 tensor on the device, so that the
clip factor never has to visit the host).
"""

from __future__ import annotations

import torch


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
    return grad_norm_ref(g)


def adamw_step(p, g, m, v, p_out, *, lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float, step: int, grad_scale):
    """In place. p, m, v: [P] fp32; g: [P] any float dtype; p_out: [P] working weights or
    None (when the working weights are the fp32 master itself)."""
    adamw_step_ref(p, g, m, v, p_out, lr, beta1, beta2, eps, weight_decay, step, grad_scale)
