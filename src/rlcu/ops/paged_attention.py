"""Attention of new query tokens over the paged KV cache (chunked prefill and decode).

PLACEHOLDER: kernels follow; the twin and the public signature are final.
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import use_triton

DEFAULT_BLOCK_SIZE = 16


def paged_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q,
                        max_seqlen_k, scale):
    N, Hq, D = q.shape
    BS, Hk = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hk
    o = torch.zeros_like(q)
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for s in range(len(lens)):  # a loop over sequences, not tokens
        q0, q1, L = cu[s], cu[s + 1], lens[s]
        if q1 == q0 or L == 0:
            continue
        blocks = block_tables[s, : (L + BS - 1) // BS].long()
        k = k_cache[blocks].flatten(0, 1)[:L].float()  # [L, Hk, D]
        v = v_cache[blocks].flatten(0, 1)[:L].float()
        k = k.transpose(0, 1).repeat_interleave(G, 0)  # [Hq, L, D]
        v = v.transpose(0, 1).repeat_interleave(G, 0)
        qs = q[q0:q1].float().transpose(0, 1)  # [Hq, Lq, D]
        S = qs @ k.transpose(1, 2) * scale  # [Hq, Lq, L]
        pos_q = torch.arange(L - (q1 - q0), L, device=q.device)  # absolute query positions
        mask = torch.arange(L, device=q.device)[None, :] > pos_q[:, None]
        P = torch.softmax(S.masked_fill(mask, float("-inf")), -1)
        o[q0:q1] = (P @ v).transpose(0, 1).to(q.dtype)
    return o


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q: int,
                    max_seqlen_k: int, scale: float):
    """q: [N, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hk, D]; block_tables:
    [S, max_blocks] int32; cu_seqlens_q: [S+1] int32; seq_lens: [S] int32 (context length
    including the new tokens) -> o [N, Hq, D] in q.dtype."""
    return paged_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                               max_seqlen_q, max_seqlen_k, scale)
