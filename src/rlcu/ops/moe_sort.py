"""Token-to-expert sorting: the T k (token, slot) pairs of a top-k routing, grouped by expert in
blocks of BM rows, on the device and without a host sync (CUDA graphs capture it).

    layout = moe_sort(ids [T, k] int32, E, BM)

A pair is p = t k + s. Expert e's pairs sit in rows [start_e, start_e + count_e) of the sorted
order, in increasing p (by token, then slot: stable, so deterministic), and its segment is
padded with -1 to a multiple of BM, so that each BM-row block holds one expert's pairs
(`block_expert`, -1 for the blocks past the last). The sizes depend on T, k, E and BM alone:
sum_e cdiv(count_e, BM) <= cdiv(T k, BM) + min(E, T k) blocks, whatever the routing.

Two kernels, one program an expert, no atomics: `_count_kernel` counts each expert's pairs;
`_place_kernel` takes its start from the counts of the experts before it (padded), marks its
blocks and writes its pairs in order (a running rank by cumsum over blocks of the ids).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rlcu.ops._backend import dispatch, tl, triton

BLOCK = 1024  # ids a step of the scans


class MoeLayout(NamedTuple):
    """pairs [n_blocks BM] int32: the pair (t k + s) at each sorted row, -1 in padding;
    pos [T k] int32: the sorted row of each pair (the inverse); block_expert [n_blocks] int32;
    counts [E] int32; starts [E + 1] int32: expert e's padded segment is rows starts[e]:starts[e+1];
    BM: the block rows the layout was made for; k: slots a token."""

    pairs: torch.Tensor
    pos: torch.Tensor
    block_expert: torch.Tensor
    counts: torch.Tensor
    starts: torch.Tensor
    BM: int
    k: int


def max_blocks(T: int, k: int, E: int, BM: int) -> int:
    """Blocks of a layout of T tokens, whatever the routing (module docstring)."""
    n = T * k
    return -(-n // BM) + min(E, n)


@triton.jit(do_not_specialize=["n"])
def _count_kernel(IDS, COUNTS, n, BLOCK: tl.constexpr):
    e = tl.program_id(0)
    c = tl.zeros([BLOCK], tl.int32)
    for p0 in range(0, n, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        c += (tl.load(IDS + offs, mask=offs < n, other=-1) == e).to(tl.int32)
    tl.store(COUNTS + e, tl.sum(c, 0))


@triton.jit(do_not_specialize=["n"])
def _place_kernel(IDS, COUNTS, PAIRS, POS, BLOCK_E, STARTS, n, E, BM: tl.constexpr, BLOCK: tl.constexpr,
                  BE: tl.constexpr):
    e = tl.program_id(0)
    ex = tl.arange(0, BE)
    counts = tl.load(COUNTS + ex, mask=ex < E, other=0)
    padded = (counts + BM - 1) // BM * BM
    start = tl.sum(tl.where(ex < e, padded, 0), 0)
    mine = tl.sum(tl.where(ex == e, padded, 0), 0)
    tl.store(STARTS + e, start)
    if e == E - 1:
        tl.store(STARTS + E, start + mine)
    for b in range(start // BM, (start + mine) // BM):
        tl.store(BLOCK_E + b, e)
    run = start
    for p0 in range(0, n, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        hit = (tl.load(IDS + offs, mask=offs < n, other=-1) == e).to(tl.int32)
        row = run + tl.cumsum(hit, 0) - 1
        tl.store(PAIRS + row, offs.to(tl.int32), mask=hit > 0)
        tl.store(POS + offs, row, mask=hit > 0)
        run += tl.sum(hit, 0)


def _empty(T: int, k: int, E: int, BM: int, dev) -> tuple:
    nb, i32 = max_blocks(T, k, E, BM), torch.int32
    return (torch.full((nb * BM,), -1, device=dev, dtype=i32), torch.empty(T * k, device=dev, dtype=i32),
            torch.full((nb,), -1, device=dev, dtype=i32), torch.empty(E, device=dev, dtype=i32),
            torch.empty(E + 1, device=dev, dtype=i32))


def moe_sort_triton(ids, E, BM):
    T, k = ids.shape
    pairs, pos, block_e, counts, starts = _empty(T, k, E, BM, ids.device)
    ids = ids.contiguous()
    n = T * k
    _count_kernel[(E,)](ids, counts, n, BLOCK=BLOCK, num_warps=4)
    _place_kernel[(E,)](ids, counts, pairs, pos, block_e, starts, n, E, BM=BM, BLOCK=BLOCK,
                        BE=triton.next_power_of_2(E), num_warps=4)
    return MoeLayout(pairs, pos, block_e, counts, starts, BM, k)


def moe_sort_ref(ids, E, BM):
    T, k = ids.shape
    pairs, pos, block_e, _, _ = _empty(T, k, E, BM, ids.device)
    flat = ids.flatten().long()
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + BM - 1) // BM * BM
    starts = torch.cat([padded.new_zeros(1), padded.cumsum(0)])
    order = torch.sort(flat, stable=True).indices  # by expert, then by pair
    first = torch.cat([counts.new_zeros(1), counts.cumsum(0)])[:-1]  # unpadded starts
    rank = torch.arange(T * k, device=ids.device) - first[flat[order]]
    rows = starts[flat[order]] + rank
    pairs[rows] = order.to(torch.int32)
    pos[order] = rows.to(torch.int32)
    nb = int(starts[-1]) // BM
    block_e[:nb] = torch.repeat_interleave(torch.arange(E, device=ids.device), padded // BM).to(torch.int32)
    return MoeLayout(pairs, pos, block_e, counts.to(torch.int32), starts.to(torch.int32), BM, k)


@dispatch(moe_sort_triton, moe_sort_ref, on="ids")
def moe_sort(ids: torch.Tensor, E: int, BM: int) -> MoeLayout:
    """ids [T, k] int32 (route_fwd's, each in [0, E)) -> MoeLayout (module docstring) with blocks
    of BM rows. Ids outside [0, E) are not checked (a check would read them on the host)."""
    if ids.dim() != 2 or ids.dtype != torch.int32:
        raise ValueError(f"moe_sort: ids must be int32 [T, k], got {ids.dtype} {list(ids.shape)}")
    if E < 1 or BM < 1:
        raise ValueError(f"moe_sort: E and BM must be >= 1, got E={E}, BM={BM}")
