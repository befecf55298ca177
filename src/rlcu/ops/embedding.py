"""Token embedding lookup; the backward scatter-adds rows into the (flat) gradient buffer."""

from __future__ import annotations

import torch


def embedding_fwd_ref(ids: torch.Tensor, W: torch.Tensor):
    return W.index_select(0, ids.long())


def embedding_bwd_ref(dx: torch.Tensor, ids: torch.Tensor, dW: torch.Tensor):
    dW.index_add_(0, ids.long(), dx.to(dW.dtype))


def embedding_fwd(ids: torch.Tensor, W: torch.Tensor):
    """ids: [N] int, W: [V, D] -> x [N, D]."""
    return embedding_fwd_ref(ids, W)


def embedding_bwd(dx: torch.Tensor, ids: torch.Tensor, dW: torch.Tensor):
    """dW[ids[i]] += dx[i], in place. dx: [N, D], dW: [V, D]."""
    embedding_bwd_ref(dx, ids, dW)
