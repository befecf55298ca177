"""A paged KV cache with random contents for the paged-attention tests (the engine's ops and the
decode list kernel): each sequence's K/V written into shuffled blocks of a pool whose free
slots hold garbage, and the queries of its last tokens."""

import numpy as np
import torch

import rlcu.ops.kv_cache as kvc

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def paged_setup(q_lens, ctx_lens, Hq, Hk, D, BS, num_blocks=None, dtype=torch.float32,
                device=DEV, seed=0):
    """Random full K/V per sequence written into a shuffled block pool; the queries of the last
    q_len tokens. Returns everything paged_attention takes plus the dense per-sequence K/V."""
    g = torch.Generator(device=device).manual_seed(seed)
    S = len(q_lens)
    need = [(L + BS - 1) // BS for L in ctx_lens]
    num_blocks = num_blocks or sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g, device=device)  # shuffled, non-contiguous
    max_blocks = max(need) + 2
    bt = torch.full((S, max_blocks), -1, dtype=torch.int32, device=device)  # -1 past the end

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    kc, vc = rand(num_blocks, BS, Hk, D), rand(num_blocks, BS, Hk, D)  # garbage in free slots
    dense, used = [], 0
    for s, L in enumerate(ctx_lens):
        blocks = perm[used : used + need[s]]
        used += need[s]
        bt[s, : need[s]] = blocks.int()
        k, v = rand(L, Hk, D), rand(L, Hk, D)
        slots = blocks.repeat_interleave(BS)[:L] * BS + torch.arange(L, device=device) % BS
        kvc.kv_write_ref(k, v, kc, vc, slots)
        dense.append((k, v))
    cu = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32, device=device)
    q = rand(int(cu[-1]), Hq, D)
    return [q, kc, vc, bt, cu, torch.tensor(ctx_lens, dtype=torch.int32, device=device)], dense
