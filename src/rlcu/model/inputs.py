"""The checks of a model's inputs (token ids, packed cu_seqlens), each error naming the tensor and
the bound it breaks. They read the data on the host, so the CUDA-graph paths skip them
(CausalLM.hidden_forward_unchecked)."""

from __future__ import annotations

import torch


def check_ids(ids: torch.Tensor, vocab_size: int, what: str) -> None:
    """Integer ids, all in [0, vocab_size)."""
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{what} must be an integer tensor, got {ids.dtype}")
    if ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{what} contains token id {bad}, outside the vocabulary [0, {vocab_size})")


def check_cu(tokens: torch.Tensor, cu_seqlens: torch.Tensor, max_positions: int) -> int:
    """Packed tokens [N] and their int32 offsets [S+1] (0 ... N, no empty sequence, one device) ->
    the longest sequence, which must fit max_positions."""
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be 1-D (packed), got shape {list(tokens.shape)}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor of S+1 offsets, got "
                         f"{cu_seqlens.dtype} of shape {list(cu_seqlens.shape)}")
    cu = cu_seqlens.tolist()
    N = tokens.numel()
    if cu[0] != 0 or cu[-1] != N:
        raise ValueError(f"cu_seqlens must start at 0 and end at the number of tokens ({N}), "
                         f"got {cu[0]} ... {cu[-1]}")
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if min(lens) < 1:
        i = min(range(len(lens)), key=lambda j: lens[j])
        raise ValueError(f"cu_seqlens must be strictly increasing: sequence {i} has length {lens[i]}")
    if cu_seqlens.device != tokens.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, tokens on {tokens.device}")
    mx = max(lens)
    if mx > max_positions:
        raise ValueError(f"a sequence of {mx} tokens exceeds max_position_embeddings ({max_positions})")
    return mx
