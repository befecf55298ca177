"""Weight-gradient accumulation shared by the model's layers and the fused LM head."""

from __future__ import annotations

import torch

_MIXED_ADDMM = [True]  # cuBLAS bf16 x bf16 -> fp32 accumulate-in-place; cleared if this torch lacks it


def acc_wgrad(g: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
    """g += dy^T x  (the weight gradient of y = x W^T), accumulated in g's dtype.

    On CUDA a bf16 product is accumulated by cuBLAS straight into the fp32 gradient (beta = 1,
    no bf16 rounding of the product, no temporary) through `addmm(out_dtype=)`; a torch
    without that overload gets the fallback below, which forms the product and adds it, as
    the CPU path always does."""
    if g.dtype == dy.dtype:
        g.addmm_(dy.t(), x)
        return
    if g.is_cuda and _MIXED_ADDMM[0]:
        try:
            torch.addmm(g, dy.t(), x, out_dtype=g.dtype, out=g)
            return
        except (TypeError, RuntimeError, NotImplementedError):  # the overload is missing: fall back
            _MIXED_ADDMM[0] = False
    g.add_(dy.t() @ x)
