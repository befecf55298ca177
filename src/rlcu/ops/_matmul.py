"""Weight-gradient accumulation shared by the model's layers and the fused LM head."""

from __future__ import annotations

import torch

# (device index, product dtype, gradient dtype) -> whether torch.addmm(out_dtype=) works there
_MIXED_ADDMM: dict[tuple, bool] = {}


def mixed_addmm_supported(device: torch.device, in_dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether cuBLAS can accumulate an `in_dtype` product into an `out_dtype` tensor in place
    on `device` (torch's `addmm(out_dtype=)`, torch >= 2.8 on CUDA). Probed once with a tiny
    product, so that an error in a real call is never mistaken for a missing overload."""
    key = (device.index, in_dtype, out_dtype)
    ok = _MIXED_ADDMM.get(key)
    if ok is None:
        a = torch.ones(4, 8, device=device, dtype=in_dtype)
        g = torch.ones(8, 8, device=device, dtype=out_dtype)
        try:
            torch.addmm(g, a.t(), a, out_dtype=out_dtype, out=g)
            ok = bool((g == 5).all())
        except (TypeError, RuntimeError, NotImplementedError):  # no such overload or dtype pair here
            ok = False
        _MIXED_ADDMM[key] = ok
    return ok


def acc_wgrad(g: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
    """g += dy^T x  (the weight gradient of y = x W^T), accumulated in g's dtype.

    On CUDA a bf16 product is accumulated by cuBLAS straight into the fp32 gradient (beta = 1,
    no bf16 rounding of the product, no temporary) through `addmm(out_dtype=)`; a torch
    without that overload gets the fallback below, which forms the product and adds it, as
    the CPU path always does."""
    if g.dtype == dy.dtype:
        g.addmm_(dy.t(), x)
    elif g.is_cuda and mixed_addmm_supported(g.device, dy.dtype, g.dtype):
        torch.addmm(g, dy.t(), x, out_dtype=g.dtype, out=g)
    else:
        g.add_(dy.t() @ x)
